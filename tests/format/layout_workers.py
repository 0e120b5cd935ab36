"""Worker functions (run by the gloo worker pool) for ``test_unsupported_layouts.py``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard


def chunked_save_with_a_sparse_tensor(run_dir: str) -> dict[str, Any]:
    """2 ranks save a DTensor beside a sparse tensor through one manager (the chunked save
    path), blocking and async: ``{mode: (error type, message)}``, then the steps committed
    after a save without the sparse tensor."""
    from xla_ckpt.comm import DistConfig, get_dist
    from xla_ckpt.manager import CheckpointConfig, CheckpointManager

    if not tdist.is_initialized():
        tdist.init_process_group("gloo", init_method="env://")
    dist = get_dist(DistConfig(backend="gloo", timeout_s=60))
    rank, world = dist.rank, dist.world_size
    mesh = init_device_mesh("cpu", (world,))
    w = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    local = w[2 * rank:2 * rank + 2].clone()
    sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=w.shape,
                                 stride=w.stride())
    out: dict[str, Any] = {}
    cfg = CheckpointConfig(save_dir=run_dir, handle_sigterm=False, save_interval_epochs=0)
    with CheckpointManager(cfg, dist=dist) as mgr:
        for n, block in enumerate((True, False), start=1):
            try:
                mgr.save({"w": sharded, "emb": torch.eye(2).to_sparse()}, epoch=1,
                         num_updates=n, block=block)
                mgr.wait()
                out["block" if block else "async"] = None
            except Exception as e:  # noqa: BLE001 - the test asserts type and message
                out["block" if block else "async"] = (type(e).__name__, str(e))
        mgr.save({"w": sharded}, epoch=1, num_updates=3)
        mgr.wait()
        out["steps"] = mgr.all_steps()
    tdist.barrier()
    return out
