"""benchmarks/time_to_resume.py in small (``--quick``): every line it prints, no timings.

Real parts: a CheckpointManager with a local tier on /dev/shm and the shaped GCS emulator as
its durable tier, fresh managers restoring from each tier, DCP's save, load and async save on
the same tmpfs folder, a small synthetic training loop with local and durable saves.  A second
run makes the demo model's import fail: its lines say which extra to install.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "time_to_resume.py")
RESTORE = ["memcpy", "local_tier_restore", "gcs_restore", "dcp_load", "local_tier_restore_into",
           "memcpy_fresh", "local_tier_restore_disk_durable", "dcp_save"]
STALL = ["local_save_stall", "copy_preallocated", "dcp_async_save_stall",
         "local_save_stall_disk_durable"]
TARGETS = {"local_restore_vs_memcpy": ("<=", 2.0), "local_restore_vs_gcs_restore": (">=", 10.0),
           "local_restore_vs_dcp_load": (">=", 1.5), "local_save_stall_vs_copy": ("<=", 1.1),
           "durable_n_over_local_n": (">=", 10.0)}


def _shm_entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("xla_ckpt_ttr_")}


def _run(args: list[str], env: dict | None = None) -> list[dict]:
    out = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                         timeout=110, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.timeout(120)
def test_quick_run_prints_every_method_then_the_summary(tmp_path):
    before = _shm_entries()
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    lines = _run(["--size-mib", "4", "--quick"], env)
    body, summary = lines[:-1], lines[-1]
    by = {x["method"]: x for x in body}
    assert [x["method"] for x in body] == RESTORE + STALL + ["steps_local", "steps_durable"]
    for x in body:
        assert x["seconds"] >= 0 and x["world_size"] == 1 and x["durable"] == "gcs_emulator"
    for m in ("local_tier_restore", "gcs_restore", "dcp_load", "local_tier_restore_into",
              "local_tier_restore_disk_durable"):
        assert by[m]["bitwise_ok"] is True, by[m]
    assert by["local_tier_restore"]["tier"] == ["local"]
    assert by["local_tier_restore"]["local_mib"] == pytest.approx(4.0, abs=0.5)
    assert by["local_tier_restore"]["durable_mib"] == 0 and by["gcs_restore"]["tier"] == ["durable"]
    assert {"decide_s", "read_s", "durable_requests"} <= set(by["local_tier_restore"])
    for m in ("local_save_stall", "copy_preallocated", "dcp_async_save_stall"):
        assert len(by[m]["runs_seconds"]) == 1
    for kind in ("local", "durable"):
        line = by[f"steps_{kind}"]
        assert line["model"].startswith("synthetic MLP") and line["p"] == 2
        assert line["n_for_3pct"] >= 1 and line["n_for_3pct"] >= line["commit_steps"]
        assert {"step_seconds", "stall_seconds", "overhead_at_p"} <= set(line)
    assert summary["summary"] == "targets (issue 24 item 8)"
    assert (summary["size_mib"], summary["world_size"]) == (4, 1)
    for name, (rule, goal) in TARGETS.items():
        t = summary[name]
        assert (t["rule"], t["target"]) == (rule, goal) and isinstance(t["met"], bool), t
        assert t["met"] is (t["ratio"] <= goal if rule == "<=" else t["ratio"] >= goal)
    n = summary["durable_n_over_local_n"]
    assert (n["n_local"], n["n_durable"]) == (by["steps_local"]["n_for_3pct"],
                                              by["steps_durable"]["n_for_3pct"])
    assert "ratio" in summary["local_save_stall_vs_dcp_async_save"]
    assert _shm_entries() == before  # its tmpfs folder removed
    assert os.listdir(tmp_path) == []  # and the disk-durable run folders


@pytest.mark.timeout(60)
def test_a_missing_demo_extra_is_one_line_per_method_naming_the_extra(tmp_path):
    (tmp_path / "transformers.py").write_text("raise ImportError('transformers is broken here')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    lines = _run(["--parts", "steps", "--model", "tiny"], env)
    assert lines[:2] == [
        {"method": f"steps_{k}", "part": "steps", "extra": "demo",
         "skipped": "install with: .venv/bin/pip install -e '.[demo]' (or --model synthetic)",
         "reason": "ImportError: transformers is broken here"} for k in ("local", "durable")]
    assert set(lines[2]) == {"summary", "size_mib", "world_size", "durable", "local_tier"}
