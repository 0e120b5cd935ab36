"""Functions the multi-rank manager tests run on every rank (xla_ckpt.testing.launcher workers)."""

from __future__ import annotations

import torch

FLAT = torch.arange(10, dtype=torch.float32) * 1.5 + 0.25
PIECES = [(0, 1), (1, 5), (5, 5), (5, 10)]  # rank r owns FLAT[lo:hi] (uneven, one empty)


def save_zero_shards(run_dir: str) -> str:
    """Every rank saves its piece of FLAT (async) plus private state; returns the checkpoint."""
    from xla_ckpt.comm import get_dist
    from xla_ckpt.config import CheckpointConfig, DistConfig
    from xla_ckpt.manager import CheckpointManager

    dist = get_dist(DistConfig(backend="gloo", timeout_s=60))
    lo, hi = PIECES[dist.rank]
    piece = FLAT[lo:hi].clone()
    cfg = CheckpointConfig(save_dir=run_dir, save_interval_updates=2, async_save=True,
                           handle_sigterm=False)
    with CheckpointManager(cfg, dist=dist) as mgr:
        for n in (1, 2):
            res = mgr.after_update(epoch=1, num_updates=n, state={"step": n},
                                   rank_state={"rank": dist.rank},
                                   shards=lambda: {"exp_avg": piece})
        piece.fill_(-1.0)  # changed after staging: the checkpoint keeps the staged values
    assert res.saved is not None
    return res.saved


def restore_zero_shards(run_dir: str, zero_sharding: str) -> dict:
    """Restore through the manager with the given ZeRO mode; returns what this rank got."""
    from xla_ckpt.comm import get_dist
    from xla_ckpt.config import CheckpointConfig, DistConfig
    from xla_ckpt.manager import CheckpointManager
    from xla_ckpt.restore import RestoreConfig

    dist = get_dist(DistConfig(backend="gloo", timeout_s=60))
    cfg = CheckpointConfig(save_dir=run_dir, handle_sigterm=False)
    with CheckpointManager(cfg, dist=dist,
                           restore_config=RestoreConfig(zero_sharding=zero_sharding)) as mgr:
        r = mgr.restore_or_initialize()
    assert r is not None and r.restored is not None
    return {"checkpoint": r.checkpoint, "state": r.state, "rank_state": r.rank_state,
            "exp_avg": r.restored.shards["exp_avg"].tolist(),
            "bounds": list(r.restored.shard_bounds["exp_avg"])}
