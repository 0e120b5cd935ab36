"""Keep-N after a resume: the checkpoint a job restored from is rotated like any other.

Issue 25, defect 8: a job that resumed from a run folder holding N checkpoints and saved once
kept N + 1 (the one it restored from was protected).  Orbax's ``max_to_keep=N`` and fairseq's
``keep_interval_updates=N`` keep N.
"""

import pytest
import torch
from manager_helpers import committed, make_cfg, pointer

import xla_ckpt
from xla_ckpt.manager import CheckpointManager


def _state(n: int) -> dict:
    return {"model": {"w": torch.arange(3, dtype=torch.float32) + n}, "num_updates": n}


def _train(run_dir: str, first: int, last: int, **kw) -> str | None:
    """A job that resumes (restore_or_initialize) and runs updates first..last."""
    mgr = CheckpointManager(make_cfg(run_dir, **kw))
    got = mgr.restore_or_initialize()
    for n in range(first, last + 1):
        mgr.after_update(epoch=1, num_updates=n, state=lambda n=n: _state(n))
    mgr.close()
    return got.checkpoint if got is not None else None


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_resume_then_one_save_keeps_exactly_n(run_dir, keep):
    _train(run_dir, 1, 2 * keep, save_interval_updates=2, keep_interval_updates=keep)
    before = committed(run_dir)
    assert len(before) == keep
    restored = _train(run_dir, 2 * keep + 1, 2 * keep + 2, save_interval_updates=2,
                      keep_interval_updates=keep)
    assert restored == f"checkpoint_1_{2 * keep}"
    newest = [f"checkpoint_1_{n}" for n in range(2 * keep + 2, 2, -2)][:keep]
    assert committed(run_dir) == sorted(newest)
    assert pointer(run_dir, "last")["checkpoint"] == f"checkpoint_1_{2 * keep + 2}"
    for name in newest:
        n = int(name.rsplit("_", 1)[1])
        got = xla_ckpt.load(f"{run_dir}/{name}")["model"]["w"]
        assert torch.equal(got, _state(n)["model"]["w"])


def test_restore_of_an_older_step_is_rotated_too(run_dir):
    """restore(step=) of the oldest of N, then one save: the newest N remain (the new one and
    the N - 1 newest of the previous incarnation)."""
    _train(run_dir, 1, 6, save_interval_updates=2, keep_interval_updates=3)
    assert committed(run_dir) == ["checkpoint_1_2", "checkpoint_1_4", "checkpoint_1_6"]
    mgr = CheckpointManager(make_cfg(run_dir, save_interval_updates=2, keep_interval_updates=3))
    r = mgr.restore(step=2)
    assert r.checkpoint == "checkpoint_1_2" and mgr.restored_from == "checkpoint_1_2"
    mgr.save(_state(3), epoch=1, num_updates=3)
    mgr.close()
    assert committed(run_dir) == ["checkpoint_1_3", "checkpoint_1_4", "checkpoint_1_6"]
