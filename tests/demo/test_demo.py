"""README command 1 in small: `xla-ckpt demo --model tiny` end to end, as a real subprocess.

Real parts only: the GCS emulator subprocess, 2 worker processes with gloo and their own XLA CPU
devices, a real SIGTERM, two resumes (every-rank reads, rank-0 broadcast).
"""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_tiny_resumes_bitwise_with_both_strategies():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "xla_ckpt.cli.main", "demo", "--model", "tiny", "--workers", "2",
         "--json", "train.max_updates=8", "checkpoint.save_interval_updates=2"],
        capture_output=True, text=True, env=env, timeout=580)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["bitwise_identical"] == {"all_ranks": True, "broadcast": True}
    assert report["workers"] == 2 and report["updates"] == 8
    assert 1 <= report["preempted_at_update"] < 8
    assert report["checkpoint"].endswith(f"_{report['preempted_at_update']}")
    by = {r["strategy"]: r for r in report["restores"]}
    # Every rank reads the whole checkpoint itself on the TPU path; nothing is broadcast.
    ar = by["all_ranks"]
    assert all(b > 0 for b in ar["bytes_read_per_rank"]) and ar["bytes_received_per_rank"] == [0, 0]
    assert ar["bytes_read_per_rank"][0] == ar["bytes_read_per_rank"][1]
    # Broadcast path: rank 0 reads, rank 1 reads nothing: on one host it maps rank 0's sealed
    # copy of the replicated state and receives only its own rank item.
    bc = by["broadcast"]
    assert bc["bytes_read_per_rank"][1] == 0 and bc["bytes_read_per_rank"][0] > 0
    assert bc["data_path"].startswith("host shared memory (1 host(s) x 2 rank(s)")
    assert bc["bytes_mapped_per_rank"][0] == 0
    got = bc["bytes_received_per_rank"][1] + bc["bytes_mapped_per_rank"][1]
    assert 0.99 * bc["bytes_read_per_rank"][0] < got <= bc["bytes_read_per_rank"][0]
    assert bc["bytes_received_per_rank"][1] < 0.01 * bc["bytes_mapped_per_rank"][1]
    for r in report["restores"]:
        assert r["resumed_at_update"] == report["preempted_at_update"]
        assert r["losses_identical"] and r["params_identical"]
        assert r["state_devices"] == ["xla:0"]  # restored onto each worker's own XLA device


def test_demo_table_lists_both_strategies_and_verdicts():
    from xla_ckpt.demo.run import format_table

    report = {"workers": 2, "model": "tiny", "updates": 8, "storage": "local path",
              "preempted_at_update": 4, "checkpoint": "checkpoint_1_4",
              "restores": [
                  {"strategy": "all_ranks", "checkpoint": "gs://b/run/checkpoint_1_4",
                   "bytes_read_per_rank": [2**20, 2**20], "bytes_received_per_rank": [0, 0],
                   "bytes_mapped_per_rank": [0, 0],
                   "seconds": 0.5, "mib_per_s": 2.0, "state_devices": ["xla:0"],
                   "verdict": "bitwise identical"},
                  {"strategy": "broadcast", "checkpoint": "gs://b/run/checkpoint_1_4",
                   "bytes_read_per_rank": [2**20, 0], "bytes_received_per_rank": [0, 0],
                   "bytes_mapped_per_rank": [0, 2**20],
                   "seconds": 0.25, "mib_per_s": 4.0, "state_devices": ["xla:0"],
                   "verdict": "MISMATCH"}]}
    table = format_table(report).splitlines()
    assert table[0] == "xla_ckpt demo: 2 workers, model tiny, 8 updates, storage local path"
    assert table[1] == "preempted (SIGTERM) after update 4; restoring checkpoint_1_4"
    assert table[2].split() == ["strategy", "checkpoint", "MiB", "read/rank", "MiB",
                                "bcast/rank", "MiB", "mapped/rank", "seconds", "MiB/s", "on",
                                "device", "verdict"]
    assert table[4].split() == ["all_ranks", "checkpoint_1_4", "1/1", "0/0", "0/0", "0.50", "2",
                                "xla:0", "bitwise", "identical"]
    assert table[5].split()[:5] == ["broadcast", "checkpoint_1_4", "1/0", "0/0", "0/1"]
    assert table[5].split()[-1] == "MISMATCH"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_command_restores_latest_and_continues(tmp_path):
    """`xla-ckpt train` (one rank of a real job, here single-process) resumes where it stopped."""
    run = tmp_path / "run"
    out1, out2 = tmp_path / "o1", tmp_path / "o2"
    base = [sys.executable, "-m", "xla_ckpt.cli.main", "train", "--config",
            "configs/cpu-emulation.yaml", "--device", "cpu"]
    settings = ["train.model=tiny",
            "dist.backend=single", f"checkpoint.save_dir={run}",
            "checkpoint.save_interval_updates=2", "checkpoint.async_save=false"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p1 = subprocess.run(base + ["--out", str(out1)] + settings + ["train.max_updates=3"],
                        cwd=root, env=env, capture_output=True, text=True, timeout=280)
    assert p1.returncode == 0, p1.stderr[-2000:]
    first = json.loads((out1 / "rank0.json").read_text())
    assert first["restore"] is None and sorted(map(int, first["losses"])) == [1, 2, 3]
    assert sorted(os.listdir(run)) == ["checkpoint_1_2", "checkpoint_last.json", "lease.json"]
    p2 = subprocess.run(base + ["--out", str(out2)] + settings + ["train.max_updates=5"],
                        cwd=root, env=env, capture_output=True, text=True, timeout=280)
    assert p2.returncode == 0, p2.stderr[-2000:]
    second = json.loads((out2 / "rank0.json").read_text())
    assert second["restore"]["checkpoint"] == "checkpoint_1_2"
    assert second["restore"]["num_updates"] == 2
    assert sorted(map(int, second["losses"])) == [3, 4, 5]
    # update 3 is recomputed from the checkpoint exactly as the first run computed it
    assert second["losses"]["3"] == first["losses"]["3"]
