"""benchmarks/striped_restore.py in small, and scale_model.py's check against it: values only.

Real parts: 2 emulated hosts x 2 gloo ranks (``WorkerPool(4, hosts=2)``, each host on its own
loopback source address), the GCS emulator behind the shaping proxy, every read plan.  What is
asserted are bytes the proxy counted per host, bitwise verdicts and the predictions' arithmetic;
no timing.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "striped_restore.py")
SCALE = os.path.join(ROOT, "benchmarks", "scale_model.py")
PLANS = ["all_ranks", "per_host", "broadcast", "striped", "auto"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_small_run_counts_bytes_per_host_and_checks_every_plan(tmp_path):
    out = subprocess.run([sys.executable, BENCH, "--size-mib", "8", "--hosts", "2",
                          "--ranks-per-host", "2", "--repeats", "1", "--probe-mib", "4",
                          "--run-timeout-s", "180", "--balance", "off"],
                         capture_output=True, text=True, timeout=380, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "Traceback" not in out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    setup, summary = lines[0], lines[-1]
    by = {x["plan"]: x for x in lines[1:-1]}
    assert setup["kind"] == "setup" and summary["kind"] == "summary"
    assert (setup["hosts"], setup["ranks_per_host"], setup["world_size"]) == (2, 2, 4)
    assert setup["host_of_rank"] == [0, 0, 1, 1]
    assert setup["source_address_of_rank"] == ["127.0.0.10", "127.0.0.10", "127.0.0.11",
                                               "127.0.0.11"]
    assert setup["bandwidths"]["storage_host_bytes_per_s"] == 64 * 2**20
    assert setup["bandwidths"]["storage_stream_bytes_per_s"] == 32 * 2**20
    assert setup["bandwidths"]["first_byte_latency_s"] == 0.03
    assert setup["bandwidths"]["streams_per_reader"] == 32
    assert setup["data_plane_source"] == "probe"
    # every other measured parameter comes from a probe made before the timed runs
    assert (setup["intra_host_source"], setup["fixed_source"]) == ("probe", "probe")
    assert setup["storage_total_source"] in ("probe", "default")  # default: no slowdown seen
    bw = setup["bandwidths"]
    assert bw["restore_fixed_s"] == pytest.approx(setup["fixed_probe"]["fixed_s"], abs=1e-3)
    assert set(setup["fixed_probe"]["seconds"]) == set(PLANS[:4])
    assert bw["data_plane_intra_host_bytes_per_s"] == pytest.approx(
        setup["intra_host_probe"]["intra_host_mib_s"] * 2**20, rel=1e-3)
    assert setup["intra_host_probe"]["ranks_mapping_at_once"] == 4
    sp = setup["storage_probe"]
    assert (sp["ranks_one_host"], sp["ranks_every_host"]) == (2, 4)
    assert len(sp["one_host_s"]) == len(sp["every_host_s"]) == 3
    assert setup["checkpoint_bytes"] == setup["data_bytes"] + setup["manifest_bytes"]
    assert list(by) == PLANS
    assert summary["failed"] == {}
    assert summary["bitwise_ok"] == dict.fromkeys(PLANS, True)
    for plan, line in by.items():
        assert line["bitwise_ok"] is True, plan
        assert line["bytes_served_other"] == 0, plan  # every byte came from a host's address
        assert sum(line["bytes_served_per_host"]) == line["bytes_per_job"], plan
        assert line["predicted_s"] > 0 and len(line["seconds_all"]) == 1, plan
        assert line["stats_predicted_s"] == pytest.approx(line["predicted_s"], abs=2e-3), plan
    assert [by[p]["plan_ran"] for p in PLANS[:4]] == PLANS[:4]
    assert by["auto"]["plan_ran"] in PLANS[:4]
    # Fetched once per job: striped over both hosts, per_host once per host, broadcast host 0.
    striped = by["striped"]
    # every data byte once per job; the manifest is fetched once, by the deciding rank, and
    # sent with the decision, so the readers' total is the data files' share of the checkpoint
    assert 0.99 <= striped["bytes_per_job_x_checkpoint"] <= 1.0
    assert summary["striped_bytes_per_job"]["met"] is True
    assert all(0.3 <= x <= 0.7 for x in striped["bytes_per_host_x_checkpoint"]), striped
    assert all(0.99 <= x <= 1.0 for x in by["per_host"]["bytes_per_host_x_checkpoint"])
    assert summary["per_host_bytes_per_host"]["met"] is True
    assert by["broadcast"]["bytes_served_per_host"][1] == 0
    assert 0.99 <= by["broadcast"]["bytes_per_job_x_checkpoint"] <= 1.0
    assert by["all_ranks"]["bytes_per_job_x_checkpoint"] == pytest.approx(4.0, abs=0.03)
    assert set(summary["predictions_within_30_percent"]["errors"]) == set(PLANS)

    results = tmp_path / "striped.jsonl"
    results.write_text(out.stdout)
    check = subprocess.run([sys.executable, SCALE, "--no-grid", "--json", "--check-emulation",
                            str(results)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert check.returncode in (0, 1), check.stderr[-3000:]
    rows = [json.loads(line) for line in check.stdout.splitlines()]
    emulated = [r for r in rows if r["kind"] == "emulation_plan"]
    verdict = [r for r in rows if r["kind"] == "emulation_check"]
    assert [r["plan"] for r in emulated] == PLANS and len(verdict) == 1
    for r in emulated:  # the simulation's model gives the benchmark's own predictions
        assert r["predicted_s"] == pytest.approx(by[r["plan"]]["predicted_s"], abs=1e-3)
        assert r["met"] == (abs(r["error"]) <= 0.30)
    assert verdict[0]["met"] == all(r["met"] for r in emulated)
    assert check.returncode == (0 if verdict[0]["met"] else 1)


def test_check_emulation_names_a_file_without_a_setup_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"kind": "plan", "plan": "striped", "seconds": 1.0}) + "\n")
    out = subprocess.run([sys.executable, SCALE, "--no-grid", "--check-emulation", str(bad)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2
    assert "bad.jsonl" in out.stderr and "no {\"kind\": \"setup\"} line" in out.stderr
