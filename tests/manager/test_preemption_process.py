"""Real processes: SIGTERM mid-epoch -> every rank saves at the next update boundary and exits
cleanly, and the resumed run equals the uninterrupted one bitwise.  Also: a save failing on one
rank fails on every rank, naming it.

The training loop is tests/manager/train_loop.py (Linear + Adam, async saves every 4 updates,
6 updates per epoch, 2 epochs, keep 1 update / 1 epoch / 1 best checkpoint).
"""

import os
import signal
import threading

import pytest
from manager_helpers import events, folders, pointer, start_train_loop, wait_for_files
from train_loop import TOTAL, UPDATES_PER_EPOCH, hexof, make_cfg, reference, run_rank, train

import xla_ckpt
from xla_ckpt.errors import CheckpointSaveError
from xla_ckpt.io import CheckpointReader
from xla_ckpt.testing.launcher import shared_pool

WORLD = 4


def updates_of(evs):
    return [ev for ev in evs if ev["event"] == "update"]


def check_preemption_checkpoint(run_dir, name, n, world_size, weights):
    """The checkpoint holds the state after update n on every rank, and nothing else is left."""
    assert folders(run_dir) == [name]  # keep_interval_updates=1 rotated the earlier one
    # the first incarnation in this run folder: lease epoch 1
    assert pointer(run_dir, "last") == {"checkpoint": name, "epoch": 1, "num_updates": n,
                                        "lease_epoch": 1}
    ck = os.path.join(run_dir, name)
    reader = CheckpointReader.open(ck)
    assert reader.manifest.world_size == world_size
    assert reader.metadata == {"epoch": 1, "num_updates": n, "end_of_epoch": False,
                               "preempted": True, "world_size": world_size, "lease_epoch": 1}
    assert sorted(reader.manifest.items) == [f"rank/{r:05d}" for r in range(world_size)] + \
        ["state"]
    state = xla_ckpt.load(ck)
    assert (hexof(state["model"]["weight"]), hexof(state["model"]["bias"])) == weights
    assert (state["epoch"], state["step"], state["num_updates"]) == (1, n, n)
    assert sorted(state["optimizer"]["state"]) == [0, 1]
    assert int(state["optimizer"]["state"][0]["step"].item()) == n
    return [xla_ckpt.load(ck, item=f"rank/{r:05d}") for r in range(world_size)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_mid_epoch_real_process_exits_zero_and_resumes_bitwise(run_dir, tmp_path):
    ref = reference()
    ev_dir = str(tmp_path / "ev")
    os.mkdir(ev_dir)
    proc = start_train_loop(["--save-dir", run_dir, "--events-dir", ev_dir, "--pause-at", "3"],
                            str(tmp_path / "stderr.log"))
    try:
        wait_for_files([os.path.join(ev_dir, "paused-0")], lambda: proc.poll() is None)
        proc.send_signal(signal.SIGTERM)  # mid-epoch: update 3 of 6
        open(os.path.join(ev_dir, "go"), "w").close()
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    with open(tmp_path / "stderr.log") as f:
        log = f.read()
    assert rc == 0, log
    evs = events(ev_dir, 0)
    # it stopped at the boundary right after the signal: no update after 3, no "done"
    assert [ev["n"] for ev in evs] == [1, 2, 3]
    assert all((ev["w"], ev["b"]) == ref["updates"][ev["n"]] for ev in evs)
    assert "preemption: every rank saved at update 3 (checkpoint_1_3); exiting" in log
    rank_states = check_preemption_checkpoint(run_dir, "checkpoint_1_3", 3, 1, ref["updates"][3])
    assert rank_states == [{"rank": 0, "num_updates": 3, "losses": ref["losses"][:3]}]

    # resume in this process and run to the end: bitwise the uninterrupted run
    os.remove(os.path.join(ev_dir, "events-0.jsonl"))
    train(make_cfg(run_dir), ev_dir)
    evs = events(ev_dir, 0)
    assert evs[0] == {"event": "resumed", "n": 3, "checkpoint": "checkpoint_1_3"}
    assert [ev["n"] for ev in updates_of(evs)] == list(range(4, TOTAL + 1))
    assert [ev["loss"] for ev in updates_of(evs)] == ref["losses"][3:]
    assert all((ev["w"], ev["b"]) == ref["updates"][ev["n"]] for ev in updates_of(evs))
    assert (evs[-1]["w"], evs[-1]["b"]) == ref["updates"][TOTAL]
    # rotation kept the newest update and epoch checkpoints and the best one; the restored
    # checkpoint went once newer ones committed (keep-N means N after a resume too)
    e1, e2 = ref["losses"][UPDATES_PER_EPOCH - 1], ref["losses"][TOTAL - 1]
    best = "checkpoint1" if e1 < e2 else "checkpoint2"
    assert folders(run_dir) == sorted({"checkpoint_2_8", "checkpoint2", best})
    # both epoch checkpoints were saved by the resumed incarnation (lease epoch 2)
    assert pointer(run_dir, "best") == {"checkpoint": best, "metric": "loss",
                                        "value": min(e1, e2), "lease_epoch": 2,
                                        "num_updates": UPDATES_PER_EPOCH if best == "checkpoint1"
                                        else TOTAL}
    final = xla_ckpt.load(os.path.join(run_dir, "checkpoint2"))
    assert (hexof(final["model"]["weight"]), hexof(final["model"]["bias"])) == \
        ref["updates"][TOTAL]


@pytest.fixture(scope="module")
def pool():
    return shared_pool(WORLD)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_to_one_rank_every_rank_saves_and_resume_is_bitwise(pool, tmp_path):
    # the uninterrupted run of the same job
    ref_dir, ref_ev = str(tmp_path / "ref"), str(tmp_path / "ref-ev")
    os.mkdir(ref_ev)
    for r in pool.run(run_rank, ref_dir, ref_ev, timeout_s=120):
        r.unwrap()
    ref = [updates_of(events(ref_ev, r)) for r in range(WORLD)]
    assert [len(u) for u in ref] == [TOTAL] * WORLD
    assert len({(u[-1]["w"], u[-1]["b"]) for u in ref}) == 1  # same params on every rank

    run_dir, ev_dir = str(tmp_path / "run"), str(tmp_path / "ev")
    os.mkdir(ev_dir)
    results = []
    job = threading.Thread(target=lambda: results.extend(
        pool.run(run_rank, run_dir, ev_dir, 5, timeout_s=120)))
    job.start()
    paused = [os.path.join(ev_dir, f"paused-{r}") for r in range(WORLD)]
    try:
        wait_for_files(paused, job.is_alive)
        with open(paused[2]) as f:
            os.kill(int(f.read()), signal.SIGTERM)  # only rank 2 is preempted
    finally:
        open(os.path.join(ev_dir, "go"), "w").close()
        job.join(150)
    # every rank agreed at the next boundary, saved update 5 (after finishing the async save of
    # update 4 still in flight) and raised SystemExit(0)
    assert len(results) == WORLD
    for r in results:
        assert isinstance(r.error, SystemExit) and r.error.args == (0,), r.traceback
    for r in range(WORLD):
        assert [ev["n"] for ev in events(ev_dir, r)] == [1, 2, 3, 4, 5]
    rank_states = check_preemption_checkpoint(run_dir, "checkpoint_1_5", 5, WORLD,
                                              (ref[0][4]["w"], ref[0][4]["b"]))
    for r in range(WORLD):
        assert rank_states[r] == {"rank": r, "num_updates": 5,
                                  "losses": [ev["loss"] for ev in ref[r][:5]]}

    os.rename(ev_dir, ev_dir + "-1")
    os.mkdir(ev_dir)
    for r in pool.run(run_rank, run_dir, ev_dir, timeout_s=120):
        r.unwrap()
    for r in range(WORLD):
        evs = events(ev_dir, r)
        assert evs[0] == {"event": "resumed", "n": 5, "checkpoint": "checkpoint_1_5"}
        assert updates_of(evs) == ref[r][5:]  # weights and this rank's losses, bitwise
        assert evs[-1]["event"] == "done"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_save_failing_on_one_rank_fails_on_every_rank(pool, tmp_path):
    run_dir, ev_dir = str(tmp_path / "run"), str(tmp_path / "ev")
    os.mkdir(ev_dir)
    results = pool.run(run_rank, run_dir, ev_dir, 0, 1, timeout_s=120)
    ck = f"{run_dir}/checkpoint_1_4"
    for r in results:
        assert isinstance(r.error, CheckpointSaveError), r.traceback
        assert str(r.error).startswith(
            f"saving checkpoint {ck} failed (nothing was committed; the previous checkpoint and "
            "pointers are unchanged) [rank 1: UnsupportedTypeError: cannot save value of type "
            "builtins.object at state['bad']")
        assert list(r.error.failures) == [1]
    for r in range(WORLD):
        # the async save of update 4 failed on rank 1; every rank learned it at update 5
        assert [ev["n"] for ev in events(ev_dir, r)] == [1, 2, 3, 4, 5]
    # the other ranks' data files of the failed save were removed; nothing is committed
    assert folders(run_dir) == []
    assert not os.path.exists(os.path.join(run_dir, "checkpoint_last.json"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_rank_writes_its_zero_shard_and_restore_reshards_exactly(pool, tmp_path):
    from manager_workers import FLAT, restore_zero_shards, save_zero_shards

    from xla_ckpt.restore import partition_bounds

    run_dir = str(tmp_path / "run")
    assert [r.unwrap() for r in pool.run(save_zero_shards, run_dir, timeout_s=120)] == \
        ["checkpoint_1_2"] * WORLD
    reader = CheckpointReader.open(os.path.join(run_dir, "checkpoint_1_2"))
    assert sorted(reader.manifest.items) == sorted(
        ["state"] + [f"rank/{r:05d}" for r in range(WORLD)]
        + [f"shard/{r:05d}" for r in range(WORLD)])
    os_results = [r.unwrap() for r in pool.run(restore_zero_shards, run_dir, "os",
                                                timeout_s=120)]
    bounds = partition_bounds(10, WORLD)
    for rank, got in enumerate(os_results):
        assert got["checkpoint"] == "checkpoint_1_2"
        assert got["state"] == {"step": 2} and got["rank_state"] == {"rank": rank}
        lo, hi = bounds[rank]
        assert got["bounds"] == [lo, hi] and got["exp_avg"] == FLAT[lo:hi].tolist()
    for got in (r.unwrap() for r in pool.run(restore_zero_shards, run_dir, "none",
                                             timeout_s=120)):
        assert got["exp_avg"] == FLAT.tolist() and got["bounds"] == [0, 10]
