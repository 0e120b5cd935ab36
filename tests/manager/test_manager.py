"""CheckpointManager in one process: rotation, best-N, pointers, async save, restore, preemption.

Each test asserts which checkpoint folders exist afterwards and what they hold
(loaded back with xla_ckpt.load and compared bitwise).
"""

import os
import re
import signal
import threading

import pytest
import torch
from manager_helpers import committed, folders, make_cfg, pointer

import xla_ckpt
from xla_ckpt.errors import (
    CheckpointNotFoundError,
    CheckpointSaveError,
    MetaTensorError,
    StorageError,
    UnsupportedTypeError,
)
from xla_ckpt.manager import CheckpointManager, RestoreResult


def w_at(n: int) -> torch.Tensor:
    """The 'model weight' after update n in these tests."""
    return torch.arange(4, dtype=torch.float32) * n + 0.5


def run_updates(mgr, updates, *, epoch=1, start=0, per_epoch=None, metrics=None, w=None):
    """Drive after_update for updates start+1..start+updates; returns the live weight tensor."""
    w = w if w is not None else torch.zeros(4)
    for n in range(start + 1, start + updates + 1):
        w.copy_(w_at(n))
        end = per_epoch is not None and n % per_epoch == 0
        ep = epoch if per_epoch is None else (n - 1) // per_epoch + 1
        mgr.after_update(epoch=ep, num_updates=n, end_of_epoch=end,
                         state=lambda n=n: {"model": {"w": w}, "num_updates": n},
                         rank_state={"seen": n},
                         metrics={"loss": metrics[n]} if metrics and n in metrics else None)
    return w


def load_w(run_dir, name):
    return xla_ckpt.load(os.path.join(run_dir, name))["model"]["w"]


def assert_holds(run_dir, name, n):
    state = xla_ckpt.load(os.path.join(run_dir, name))
    assert torch.equal(state["model"]["w"], w_at(n)), name
    assert state["num_updates"] == n
    assert xla_ckpt.load(os.path.join(run_dir, name), item="rank/00000") == {"seen": n}


def test_keep_last_n_update_checkpoints(run_dir):
    mgr = CheckpointManager(make_cfg(run_dir, save_interval_updates=2, keep_interval_updates=2))
    run_updates(mgr, 11)
    mgr.close()
    assert folders(run_dir) == ["checkpoint_1_10", "checkpoint_1_8"]
    assert_holds(run_dir, "checkpoint_1_8", 8)
    assert_holds(run_dir, "checkpoint_1_10", 10)
    assert pointer(run_dir, "last") == {"checkpoint": "checkpoint_1_10", "epoch": 1,
                                        "num_updates": 10, "lease_epoch": 1}
    assert not os.path.exists(os.path.join(run_dir, "checkpoint_best.json"))


def test_epoch_checkpoints_and_keep_last_epochs(run_dir):
    cfg = make_cfg(run_dir, save_interval_updates=2, save_interval_epochs=1,
                   keep_interval_updates=1, keep_last_epochs=2)
    mgr = CheckpointManager(cfg)
    run_updates(mgr, 12, per_epoch=3)  # epochs end at 3, 6, 9, 12
    mgr.close()
    # update checkpoints at 2, 4, 8, 10 (6 and 12 end epochs: epoch checkpoint instead)
    assert folders(run_dir) == ["checkpoint3", "checkpoint4", "checkpoint_4_10"]
    assert_holds(run_dir, "checkpoint3", 9)
    assert_holds(run_dir, "checkpoint4", 12)
    assert_holds(run_dir, "checkpoint_4_10", 10)
    assert pointer(run_dir, "last")["checkpoint"] == "checkpoint4"


@pytest.mark.parametrize("maximize,best,kept", [
    (False, "checkpoint_1_2", ["checkpoint_1_2", "checkpoint_1_4", "checkpoint_1_5"]),
    (True, "checkpoint_1_1", ["checkpoint_1_1", "checkpoint_1_3", "checkpoint_1_5"]),
])
def test_keep_best_n_and_best_pointer(run_dir, maximize, best, kept):
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 2.0, 5: 3.0}
    cfg = make_cfg(run_dir, save_interval_updates=1, keep_interval_updates=1,
                   keep_best_checkpoints=2, maximize_best_checkpoint_metric=maximize)
    mgr = CheckpointManager(cfg)
    run_updates(mgr, 5, metrics=losses)
    mgr.close()
    assert folders(run_dir) == kept
    for name in kept:
        assert_holds(run_dir, name, int(name.rsplit("_", 1)[1]))
    assert pointer(run_dir, "best") == {"checkpoint": best, "metric": "loss",
                                        "value": losses[int(best.rsplit("_", 1)[1])],
                                        "num_updates": int(best.rsplit("_", 1)[1]),
                                        "lease_epoch": 1}
    assert pointer(run_dir, "last")["checkpoint"] == "checkpoint_1_5"


def test_best_pointer_target_survives_rotation(run_dir):
    cfg = make_cfg(run_dir, save_interval_updates=1, keep_interval_updates=1)
    mgr = CheckpointManager(cfg)
    run_updates(mgr, 4, metrics={1: 0.5, 2: 2.0, 3: 1.0, 4: 3.0})
    mgr.close()
    assert folders(run_dir) == ["checkpoint_1_1", "checkpoint_1_4"]
    assert pointer(run_dir, "best")["checkpoint"] == "checkpoint_1_1"
    assert_holds(run_dir, "checkpoint_1_1", 1)


def test_async_save_writes_the_staged_snapshot(run_dir):
    cfg = make_cfg(run_dir, save_interval_updates=3, async_save=True)
    mgr = CheckpointManager(cfg)
    tied = torch.zeros(6)
    w = torch.zeros(4)
    for n in range(1, 4):
        w.copy_(w_at(n))
        tied.fill_(n)
        res = mgr.after_update(epoch=1, num_updates=n, rank_state={"seen": n},
                               state=lambda n=n: {"model": {"w": w, "emb": tied.view(2, 3),
                                                            "out": tied.view(2, 3)},
                                                  "num_updates": n})
    assert res.saved == "checkpoint_1_3" and mgr.in_flight == "checkpoint_1_3"
    # training goes on and changes the live tensors before the upload is committed
    w.add_(1000.0)
    tied.fill_(-1.0)
    assert mgr.wait() == ("checkpoint_1_3",)
    assert mgr.in_flight is None
    assert_holds(run_dir, "checkpoint_1_3", 3)
    state = xla_ckpt.load(os.path.join(run_dir, "checkpoint_1_3"))
    assert torch.equal(state["model"]["emb"], torch.full((2, 3), 3.0))
    assert state["model"]["emb"].data_ptr() == state["model"]["out"].data_ptr()
    assert pointer(run_dir, "last")["checkpoint"] == "checkpoint_1_3"
    mgr.close()


def test_async_saves_reusing_staging_buffers_keep_every_checkpoint_exact(run_dir):
    mgr = CheckpointManager(make_cfg(run_dir, save_interval_updates=2, async_save=True))
    w = torch.zeros(4)
    for n in range(1, 9):
        w.copy_(w_at(n))
        mgr.after_update(epoch=1, num_updates=n, state=lambda n=n: {"model": {"w": w},
                                                                    "num_updates": n},
                         rank_state={"seen": n})
        w.fill_(-1.0)  # the loop keeps changing the live tensor after each boundary
    mgr.close()
    assert committed(run_dir) == ["checkpoint_1_2", "checkpoint_1_4", "checkpoint_1_6",
                                  "checkpoint_1_8"]
    for n in (2, 4, 6, 8):
        assert_holds(run_dir, f"checkpoint_1_{n}", n)


def test_async_commit_is_reported_at_the_next_boundary(run_dir):
    mgr = CheckpointManager(make_cfg(run_dir, save_interval_updates=2, async_save=True))
    w = torch.zeros(4)
    results = []
    for n in range(1, 5):
        w.copy_(w_at(n))
        results.append(mgr.after_update(epoch=1, num_updates=n, state={"model": {"w": w},
                                                                       "num_updates": n}))
        mgr._executor.submit(lambda: None).result()  # let the background job finish
    # boundary 3 sees every upload done and starts the commit; boundary 4 learns it committed
    assert [(r.saved, r.committed) for r in results] == [
        (None, ()), ("checkpoint_1_2", ()), (None, ()), ("checkpoint_1_4", ("checkpoint_1_2",))]
    mgr.close()
    assert committed(run_dir) == ["checkpoint_1_2", "checkpoint_1_4"]
    assert torch.equal(load_w(run_dir, "checkpoint_1_4"), w_at(4))


def test_at_most_one_save_in_flight(run_dir, held_storage_cls):
    run = held_storage_cls(run_dir)
    mgr = CheckpointManager(make_cfg(run_dir, async_save=True), storage=run)
    w = torch.zeros(4)
    w.copy_(w_at(1))
    assert mgr.save({"model": {"w": w}, "num_updates": 1}, epoch=1, num_updates=1) == \
        "checkpoint_1_1"
    assert mgr.in_flight == "checkpoint_1_1"
    assert not os.path.exists(os.path.join(run_dir, "checkpoint_last.json"))
    assert committed(run_dir) == []

    second = []
    w.copy_(w_at(2))
    t = threading.Thread(target=lambda: second.append(
        mgr.save({"model": {"w": w}, "num_updates": 2}, epoch=1, num_updates=2)))
    t.start()
    t.join(0.5)
    # the second save waits for the first: nothing of it is staged or written yet
    assert t.is_alive() and second == []
    assert len(run.started) == 1 and "checkpoint_1_1/data-" in run.started[0]
    run.release.set()
    t.join(30)
    assert second == ["checkpoint_1_2"]
    assert committed(run_dir) == ["checkpoint_1_1"]
    mgr.close()
    assert committed(run_dir) == ["checkpoint_1_1", "checkpoint_1_2"]
    assert torch.equal(load_w(run_dir, "checkpoint_1_1"), w_at(1))
    assert torch.equal(load_w(run_dir, "checkpoint_1_2"), w_at(2))
    assert pointer(run_dir, "last")["checkpoint"] == "checkpoint_1_2"


@pytest.mark.parametrize("async_save", [False, True])
def test_failed_save_leaves_previous_checkpoint_and_pointers(run_dir, failing_storage_cls,
                                                             async_save):
    run = failing_storage_cls(run_dir)
    cfg = make_cfg(run_dir, save_interval_updates=2, async_save=async_save)
    mgr = CheckpointManager(cfg, storage=run)
    w = run_updates(mgr, 2, metrics={2: 1.0})
    mgr.wait()
    run.fail_in.add("checkpoint_1_4")
    with pytest.raises(CheckpointSaveError) as ei:
        run_updates(mgr, 3, start=2, w=w, metrics={4: 0.1})
        mgr.wait()
    err = ei.value
    ck = f"{run_dir}/checkpoint_1_4"
    assert re.fullmatch(
        re.escape(f"saving checkpoint {ck} failed (nothing was committed; the previous checkpoint "
                  f"and pointers are unchanged) [rank 0: StorageError: {ck}/data-")
        + r"[0-9a-f]{12}-state\.safetensors: write failed: 503 Service Unavailable\]", str(err))
    assert isinstance(err.__cause__, StorageError)
    assert list(err.failures) == [0]
    assert folders(run_dir) == ["checkpoint_1_2"]  # stray data files removed
    assert pointer(run_dir, "last")["checkpoint"] == "checkpoint_1_2"
    assert pointer(run_dir, "best")["checkpoint"] == "checkpoint_1_2"
    # the manager keeps working after the error
    run.fail_in.clear()
    run_updates(mgr, 2, start=4, w=w)
    mgr.close()
    assert committed(run_dir) == ["checkpoint_1_2", "checkpoint_1_6"]
    assert_holds(run_dir, "checkpoint_1_6", 6)


def test_unsaveable_state_fails_the_save_naming_the_key(run_dir):
    mgr = CheckpointManager(make_cfg(run_dir))
    with pytest.raises(CheckpointSaveError) as ei:
        mgr.save({"w": torch.empty(2, device="meta")}, epoch=1, num_updates=1)
    assert isinstance(ei.value.__cause__, MetaTensorError)
    assert "rank 0: MetaTensorError: tensor at state['w'] is on the meta device" in str(ei.value)
    with pytest.raises(CheckpointSaveError) as ei:
        mgr.save({"w": torch.ones(2)}, rank_state={"f": len}, epoch=1, num_updates=2)
    assert isinstance(ei.value.__cause__, UnsupportedTypeError)
    mgr.close()
    assert folders(run_dir) == []


def test_restore_or_initialize_fresh_calls_init(run_dir):
    mgr = CheckpointManager(make_cfg(run_dir))
    calls = []
    assert mgr.restore_or_initialize(lambda: calls.append("init")) is None
    assert calls == ["init"]
    mgr.close()


def test_restore_latest_best_and_named(run_dir, tmp_path):
    cfg = make_cfg(run_dir, save_interval_updates=2)
    mgr = CheckpointManager(cfg)
    run_updates(mgr, 6, metrics={2: 3.0, 4: 1.0, 6: 2.0})
    mgr.close()
    assert committed(run_dir) == ["checkpoint_1_2", "checkpoint_1_4", "checkpoint_1_6"]

    def restore(**kw):
        m = CheckpointManager(make_cfg(run_dir, **kw))
        try:
            return m.restore_or_initialize(), m
        finally:
            m.close()

    r, m = restore()
    assert isinstance(r, RestoreResult)
    assert (r.checkpoint, r.epoch, r.num_updates) == ("checkpoint_1_6", 1, 6)
    assert r.uri == os.path.join(run_dir, "checkpoint_1_6")
    assert torch.equal(r.state["model"]["w"], w_at(6)) and r.rank_state == {"seen": 6}
    assert r.metadata == {"epoch": 1, "num_updates": 6, "end_of_epoch": False,
                          "preempted": False, "world_size": 1, "loss": 2.0, "lease_epoch": 1}
    assert m.restored_from == "checkpoint_1_6"
    assert r.restored is not None
    assert r.restored.strategy == "all_ranks"
    man = r.restored.manifest
    assert r.restored.stats.bytes_read == sum(b.length for it in ("state", "rank/00000")
                                              for b in man.item(it).blobs)

    r, _ = restore(restore_file="checkpoint_best")
    assert r.checkpoint == "checkpoint_1_4" and torch.equal(r.state["model"]["w"], w_at(4))
    r, _ = restore(restore_file="checkpoint_1_2")
    assert r.checkpoint == "checkpoint_1_2" and torch.equal(r.state["model"]["w"], w_at(2))
    # a full URI outside the run folder (fine-tuning from another run)
    other = str(tmp_path / "other" / "ckpt")
    xla_ckpt.save({"model": {"w": w_at(9)}}, other, metadata={"epoch": 3, "num_updates": 9})
    r, m = restore(restore_file=other)
    assert (r.checkpoint, r.uri, r.num_updates, r.rank_state) == ("ckpt", other, 9, None)
    assert m.restored_from is None

    with pytest.raises(CheckpointNotFoundError) as ei:
        restore(restore_file="checkpoint_1_3")
    assert str(ei.value) == (f"{run_dir}/checkpoint_1_3: no committed checkpoint here [strategy "
                             "all_ranks: auto: a single process reads the checkpoint itself]")


def test_restore_skips_incomplete_and_lagging_pointer(run_dir):
    mgr = CheckpointManager(make_cfg(run_dir, save_interval_updates=2))
    run_updates(mgr, 4)
    mgr.close()
    # a save that crashed before its commit marker
    os.makedirs(os.path.join(run_dir, "checkpoint_1_6"))
    with open(os.path.join(run_dir, "checkpoint_1_6", "data-abc-state.safetensors"), "wb") as f:
        f.write(b"partial")
    m = CheckpointManager(make_cfg(run_dir))
    r = m.restore_or_initialize()
    assert r is not None and r.checkpoint == "checkpoint_1_4"
    m.close()
    # the pointer lags behind the newest commit (crash between commit and pointer update)
    from xla_ckpt.run.catalog import write_pointer
    from xla_ckpt.storage.local import LocalStorage

    write_pointer(LocalStorage(run_dir), "last", "checkpoint_1_2")
    m = CheckpointManager(make_cfg(run_dir))
    r = m.restore_or_initialize()
    assert r is not None and r.checkpoint == "checkpoint_1_4"
    m.close()
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint_best pointer"):
        CheckpointManager(make_cfg(run_dir, restore_file="checkpoint_best")) \
            .restore_or_initialize()


def test_the_restored_checkpoint_is_rotated_once_a_newer_one_commits(run_dir):
    """Keep-N means N after a resume too (issue 25, defect 8; tests/manager/
    test_resume_rotation.py): the checkpoint restored from is kept until this job's first save
    commits, then rotated like any other."""
    mgr = CheckpointManager(make_cfg(run_dir, save_interval_updates=2))
    run_updates(mgr, 6)
    mgr.close()
    # resume from an older checkpoint with aggressive rotation
    mgr = CheckpointManager(make_cfg(run_dir, save_interval_updates=2, keep_interval_updates=1,
                                     restore_file="checkpoint_1_2"))
    r = mgr.restore_or_initialize()
    assert r is not None and r.num_updates == 2
    w = r.state["model"]["w"].clone()
    run_updates(mgr, 1, start=2, w=w)  # no save yet: nothing rotated
    assert folders(run_dir) == ["checkpoint_1_2", "checkpoint_1_4", "checkpoint_1_6"]
    run_updates(mgr, 5, start=3, w=w)
    mgr.close()
    assert folders(run_dir) == ["checkpoint_1_8"]
    assert_holds(run_dir, "checkpoint_1_8", 8)


def test_resume_continues_schedule_without_resaving(run_dir):
    mgr = CheckpointManager(make_cfg(run_dir, save_interval_updates=2))
    run_updates(mgr, 4)
    mgr.close()
    mgr = CheckpointManager(make_cfg(run_dir, save_interval_updates=2))
    r = mgr.restore_or_initialize()
    first = mgr.after_update(epoch=1, num_updates=4, state={"x": 1})  # same boundary again
    assert first.saved is None and r is not None and r.num_updates == 4
    mgr.close()


def test_sigterm_saves_at_next_update_boundary(run_dir):
    cfg = make_cfg(run_dir, save_interval_updates=4, handle_sigterm=True,
                   exit_on_preemption=False, async_save=True)
    before = signal.getsignal(signal.SIGTERM)
    mgr = CheckpointManager(cfg)
    w = run_updates(mgr, 2)
    assert not mgr.preemption_requested
    os.kill(os.getpid(), signal.SIGTERM)
    assert mgr.preemption_requested
    w.copy_(w_at(3))
    res = mgr.after_update(epoch=1, num_updates=3, state=lambda: {"model": {"w": w},
                                                                  "num_updates": 3},
                           rank_state={"seen": 3})
    assert (res.saved, res.committed, res.preempted) == ("checkpoint_1_3", ("checkpoint_1_3",),
                                                         True)
    assert mgr.in_flight is None  # committed before returning, even with async_save
    mgr.close()
    assert signal.getsignal(signal.SIGTERM) is before
    assert folders(run_dir) == ["checkpoint_1_3"]
    assert_holds(run_dir, "checkpoint_1_3", 3)
    md = xla_ckpt.io.CheckpointReader.open(os.path.join(run_dir, "checkpoint_1_3")).metadata
    assert md["preempted"] is True
    assert pointer(run_dir, "last")["checkpoint"] == "checkpoint_1_3"


def test_preemption_exits_zero_after_commit(run_dir):
    mgr = CheckpointManager(make_cfg(run_dir, async_save=True))
    w = run_updates(mgr, 1)
    mgr.request_preemption()
    w.copy_(w_at(2))
    with pytest.raises(SystemExit) as ei:
        mgr.after_update(epoch=1, num_updates=2, state={"model": {"w": w}, "num_updates": 2},
                         rank_state={"seen": 2})
    assert ei.value.code == 0
    assert folders(run_dir) == ["checkpoint_1_2"]
    assert_holds(run_dir, "checkpoint_1_2", 2)
    with pytest.raises(RuntimeError, match="CheckpointManager is closed"):
        mgr.after_update(epoch=1, num_updates=3, state={})


def test_preemption_right_after_a_save_does_not_save_twice(run_dir):
    mgr = CheckpointManager(make_cfg(run_dir, save_interval_updates=2, exit_on_preemption=False))
    w = run_updates(mgr, 2)
    mgr.request_preemption()
    res = mgr.after_update(epoch=1, num_updates=2, state={"model": {"w": w}, "num_updates": 2})
    assert (res.saved, res.preempted) == (None, True)
    # reported once: a caller that goes on trains and saves on schedule again
    w = run_updates(mgr, 2, start=2, w=w)
    mgr.close()
    assert folders(run_dir) == ["checkpoint_1_2", "checkpoint_1_4"]


def test_metric_names_are_checked(run_dir):
    mgr = CheckpointManager(make_cfg(run_dir))
    with pytest.raises(ValueError, match="metric name 'epoch' is reserved"):
        mgr.save({}, epoch=1, num_updates=1, metrics={"epoch": 1.0})
    with pytest.raises(ValueError, match="metric 'loss' must be a number, got 'low'"):
        not_a_number: dict = {"loss": "low"}
        mgr.save({}, epoch=1, num_updates=1, metrics=not_a_number)
    mgr.save({}, epoch=1, num_updates=1, metrics={"loss": torch.tensor(0.25)})
    mgr.close()
    assert pointer(run_dir, "best")["value"] == 0.25
