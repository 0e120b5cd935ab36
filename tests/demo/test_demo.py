"""README command 1 in small: `xla-ckpt demo --model tiny` end to end, as a real subprocess.

Real parts only: the GCS emulator subprocess, 2 worker processes with gloo and their own XLA CPU
devices, a real SIGTERM, two resumes (every-rank reads, rank-0 broadcast); then the sharded leg:
the same run with FSDP2, preempted, restored on 2 workers (and trained on) and resharded onto 1,
each checked against the saved global tensors and DCP's restore of the same state.
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
    assert report["bitwise_identical"] == {"all_ranks": True, "broadcast": True,
                                           "fsdp_same_size": True, "fsdp_resharded": True}
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
    sh = report["sharded"]
    assert sh["workers"] == 2 and sh["saved_shards_match"] is True
    assert 1 <= sh["preempted_at_update"] < 8
    assert sh["checkpoint"].endswith(f"-fsdp/checkpoint_1_{sh['preempted_at_update']}")
    same, half = sh["restores"]
    assert (same["restore"], same["saved_workers"], same["workers"]) == ("same_size", 2, 2)
    assert (half["restore"], half["saved_workers"], half["workers"]) == ("resharded", 2, 1)
    for r in (same, half):
        assert r["resumed_at_update"] == sh["preempted_at_update"]
        assert r["shards_equal_saved"] and r["shards_equal_dcp"] and r["mismatched_shards"] == []
        assert r["strategy"] == "all_ranks"
        # Every rank reads its own shards' byte ranges (plus the small state item), no more.
        for read, shard in zip(r["bytes_read_per_rank"], r["shard_bytes_per_rank"], strict=True):
            assert shard <= read <= 1.05 * shard
    # Two ranks each hold half of the state; the resharded single rank holds (and reads) it all.
    # Only the replicated AdamW ``step`` scalars (4 bytes each) are held by both ranks.
    extra = sum(same["shard_bytes_per_rank"]) - half["shard_bytes_per_rank"][0]
    assert 0 < extra < 1024 and extra % 4 == 0
    assert same["rank_state_kept"] is True and half["rank_state_kept"] is False
    assert same["losses_identical"] and same["shards_identical"]
    assert "losses_identical" not in half  # a resharded run has other batches: no resume check


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


def _sharded_report():
    return {"workers": 4, "model": "minilm", "updates": 12, "storage": "local path",
            "legs": ["fsdp"], "restores": [], "bitwise_identical": {},
            "sharded": {"workers": 4, "checkpoint_name": "checkpoint_1_7",
                        "preempted_at_update": 7, "restores": [
                            {"restore": "same_size", "saved_workers": 4, "workers": 4,
                             "bytes_read_per_rank": [65 * 2**20] * 4,
                             "shard_bytes_per_rank": [65 * 2**20] * 4, "seconds": 1.5,
                             "shards_equal_saved": True, "shards_equal_dcp": True,
                             "losses_identical": True, "shards_identical": True,
                             "verdict": "bitwise identical"},
                            {"restore": "resharded", "saved_workers": 4, "workers": 2,
                             "bytes_read_per_rank": [130 * 2**20] * 2,
                             "shard_bytes_per_rank": [130 * 2**20] * 2, "seconds": 0.75,
                             "shards_equal_saved": True, "shards_equal_dcp": False,
                             "verdict": "MISMATCH"}]}}


def test_demo_table_of_the_sharded_leg():
    from xla_ckpt.demo.run import format_table

    table = format_table(_sharded_report()).splitlines()
    assert table[0] == "xla_ckpt demo: 4 workers, model minilm, 12 updates, storage local path"
    assert table[1] == ("FSDP2 (fully_shard per layer, 4 workers): preempted (SIGTERM) after "
                        "update 7; restoring checkpoint_1_7")
    assert table[2].split() == ["restore", "workers", "MiB", "read/rank", "MiB", "shards/rank",
                                "seconds", "=", "saved", "=", "DCP", "resume", "verdict"]
    assert table[4].split() == ["same", "size", "4->4", "65/65/65/65", "65/65/65/65", "1.50",
                                "yes", "yes", "bitwise", "bitwise", "identical"]
    assert table[5].split() == ["resharded", "4->2", "130/130", "130/130", "0.75", "yes", "NO",
                                "-", "MISMATCH"]


def _shard(t, offsets, sizes):
    from xla_ckpt.format.crc import crc32c
    from xla_ckpt.testing.asserts import tensor_bits

    box = t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
    return {"offsets": list(offsets), "sizes": list(sizes),
            "crc32c": crc32c(tensor_bits(box.contiguous())), "nbytes": box.numel() * 4}


def test_sharded_verdict_names_every_wrong_shard_and_each_failed_check():
    import torch

    from xla_ckpt.demo.run import sharded_verdict

    w = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)
    step = torch.tensor(3.0)
    saved = {"model.w": w, "optim.state.w.step": step}

    def table(rows, corrupt=False):
        t = {"model.w": _shard(w, (rows[0], 0), (rows[1], 6)),
             "optim.state.w.step": _shard(step, (), ())}
        if corrupt:
            t["model.w"] = dict(t["model.w"], crc32c=t["model.w"]["crc32c"] ^ 1)
        return t

    def rank(rows, *, corrupt=False, dcp_differs=False, losses=None, digest="d"):
        shards = table(rows, corrupt)  # ours
        # DCP's restore: the true bytes, unless this case makes DCP the one that differs.
        theirs = table(rows, corrupt=dcp_differs)
        return {"restore": {"saved_world_size": 4, "strategy": "all_ranks", "num_updates": 2,
                            "bytes_read": 100, "shard_bytes": 96, "seconds": 0.5,
                            "rank_state_kept": False, "shards": shards, "dcp_shards": theirs},
                "losses": losses or {"3": "0x1p+0"}, "digest": digest}

    good = [rank((0, 5)), rank((5, 5))]
    ok = sharded_verdict("resharded", good, saved, [], ref=None, pre=[])
    assert ok["bitwise_identical"] is True and ok["verdict"] == "bitwise identical"
    assert (ok["workers"], ok["saved_workers"], ok["bytes_read_per_rank"]) == (2, 4, [100, 100])
    assert ok["mismatched_shards"] == [] and ok["shards_equal_dcp"] is True

    bad = sharded_verdict("resharded", [rank((0, 5)), rank((5, 5), corrupt=True)], saved, [],
                          ref=None, pre=[])
    assert bad["verdict"] == "MISMATCH" and bad["shards_equal_saved"] is False
    assert bad["mismatched_shards"] == ["rank 1: model.w"]
    assert bad["shards_equal_dcp"] is False  # DCP restored the true bytes, we did not

    # Rank 0 claims rows 5..10 where it holds rows 0..5: its box does not match the saved one.
    wrong_box = [rank((0, 5)), rank((5, 5))]
    wrong_box[0]["restore"]["shards"]["model.w"]["offsets"] = [5, 0]
    wrong_box[0]["restore"]["dcp_shards"] = wrong_box[0]["restore"]["shards"]
    assert sharded_verdict("resharded", wrong_box, saved, [], ref=None,
                           pre=[])["mismatched_shards"] == ["rank 0: model.w"]

    missing = sharded_verdict("resharded", good, {"model.w": w}, ["rank 2: model.w"], ref=None,
                              pre=[])
    assert missing["mismatched_shards"] == ["rank 0: optim.state.w.step (not in the checkpoint)",
                                            "rank 1: optim.state.w.step (not in the checkpoint)",
                                            "rank 2: model.w"]

    dcp = sharded_verdict("resharded", [rank((0, 5)), rank((5, 5), dcp_differs=True)], saved, [],
                          ref=None, pre=[])
    assert (dcp["shards_equal_saved"], dcp["shards_equal_dcp"], dcp["verdict"]) == \
        (True, False, "MISMATCH")

    # Same size: the resumed losses after update 2 plus the preempted run's up to it must be the
    # reference's, and each rank's final shards the reference rank's.
    pre = [{"losses": {"1": "0x1.8p+0", "2": "0x1.4p+0", "3": "0x1p+1"}}] * 2
    ref = [{"losses": {"1": "0x1.8p+0", "2": "0x1.4p+0", "3": "0x1p+0"}, "digest": "d"}] * 2
    same = sharded_verdict("same_size", good, saved, [], ref=ref, pre=pre)
    assert (same["losses_identical"], same["shards_identical"], same["verdict"]) == \
        (True, True, "bitwise identical")
    drift = sharded_verdict("same_size", [rank((0, 5), losses={"3": "0x1.0000000000001p+0"}),
                                          rank((5, 5), losses={"3": "0x1.0000000000001p+0"})],
                            saved, [], ref=ref, pre=pre)
    assert (drift["losses_identical"], drift["verdict"]) == (False, "MISMATCH")
    other = sharded_verdict("same_size", [rank((0, 5)), rank((5, 5), digest="e")], saved, [],
                            ref=ref, pre=pre)
    assert (other["losses_identical"], other["shards_identical"], other["verdict"]) == \
        (True, False, "MISMATCH")


def test_demo_legs_option():
    import argparse

    from xla_ckpt.cli.demo import _legs
    from xla_ckpt.demo.run import LEGS

    assert LEGS == ("ddp", "fsdp")
    assert _legs("ddp,fsdp") == ["ddp", "fsdp"] and _legs(" fsdp ") == ["fsdp"]
    for bad in ("", ",", "ddp,zero3"):
        with pytest.raises(argparse.ArgumentTypeError) as e:
            _legs(bad)
        assert str(e.value) == f"expected a comma-separated subset of ddp,fsdp, got {bad!r}"
