"""``checkpoint.save_interval_seconds``: the durable schedule counted in seconds (rank 0's clock,
agreed in the manager's exchange), next to a local tier saving every update."""

import os

import torch

from xla_ckpt.manager import CheckpointConfig, CheckpointManager


def _train(tmp_path, seconds: float, updates: int = 5) -> tuple[list[str], list[str]]:
    cfg = CheckpointConfig(save_dir=str(tmp_path / "run"), local_dir=str(tmp_path / "local"),
                           local_interval_updates=1, save_interval_updates=0,
                           save_interval_epochs=0, save_interval_seconds=seconds,
                           async_save=False, handle_sigterm=False,
                           keep_local_checkpoints=10)
    w = torch.zeros(16)
    with CheckpointManager(cfg) as mgr:
        for n in range(1, updates + 1):
            w += 1
            mgr.after_update(epoch=1, num_updates=n, state={"w": w, "n": n})
        local = list(mgr.local_committed)
    durable = sorted(d for d in os.listdir(tmp_path / "run") if d.startswith("checkpoint_")
                     and os.path.isdir(tmp_path / "run" / d))
    return durable, local


def test_a_tiny_interval_saves_durably_at_every_boundary_and_locally_too(tmp_path):
    durable, local = _train(tmp_path, 1e-9)
    # The first boundary counts from the manager's start; each save restarts the clock.
    assert durable == [f"checkpoint_1_{n}" for n in range(1, 6)]
    assert local == [f"checkpoint_1_{n}" for n in range(1, 6)]  # the durable saves go through it


def test_a_long_interval_never_saves_durably_and_the_local_tier_goes_on(tmp_path):
    durable, local = _train(tmp_path, 1e9)
    assert durable == []
    assert local == [f"checkpoint_1_{n}" for n in range(1, 6)]
    res = CheckpointManager(CheckpointConfig(
        save_dir=str(tmp_path / "run"), local_dir=str(tmp_path / "local"),
        handle_sigterm=False)).restore_or_initialize()
    assert res is not None and res.tier is not None and res.tier["tier"] == "local"
    assert res.state["n"] == 5 and torch.equal(res.state["w"], torch.full((16,), 5.0))
