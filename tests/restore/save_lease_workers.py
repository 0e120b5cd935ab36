"""Functions the save-lease tests run on every rank of a launcher pool (module level).

Each rank joins the pool's gloo group, opens a :class:`~xla_ckpt.manager.CheckpointManager` on
the run folder, takes its lease (``take_over``) and saves with
:func:`xla_ckpt.restore.save_distributed` under that lease (``lease=manager.lease``), in the
cases the tests name.  A newer incarnation is a real second ``acquire_lease`` on the same run
folder (rank 0), taken before the save, or while the data files are written (from the
save's own ``progress`` callback, so after the first check and before the commit's).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as tdist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from xla_ckpt.comm import DistConfig, get_dist
from xla_ckpt.manager import CheckpointConfig, CheckpointManager
from xla_ckpt.restore import save_distributed
from xla_ckpt.run.fencing import acquire_lease
from xla_ckpt.storage import open_storage


def _state(rank: int, sharded: bool) -> dict[str, Any]:
    w = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    if sharded:
        mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
        n = 6 // tdist.get_world_size()
        value: Any = DTensor.from_local(w[n * rank:n * (rank + 1)].clone(), mesh, [Shard(0)],
                                        run_check=False, shape=w.shape, stride=w.stride())
    else:
        value = w
    return {"w": value, "step": 7}


def _caught(fn: Any) -> tuple[str, str, dict[int, str], Any] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts type, message, failures, epochs
        return (type(e).__name__, str(e), dict(getattr(e, "failures", {}) or {}),
                (getattr(e, "own_epoch", None), getattr(e, "current_epoch", None)))
    return None


def _files(path: str) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def fenced_saves(run_dir: str, sharded: bool) -> dict[str, Any]:
    """A save under the manager's lease commits; after a newer incarnation took the lease
    (before the save, or while it writes) the same save is refused on every rank."""
    if not tdist.is_initialized():
        tdist.init_process_group("gloo", init_method="env://")
    dist = get_dist(DistConfig(backend="gloo", timeout_s=60))
    rank = dist.rank
    out: dict[str, Any] = {}
    cfg = CheckpointConfig(save_dir=run_dir, handle_sigterm=False, save_interval_epochs=0)
    with CheckpointManager(cfg, dist=dist) as mgr:
        out["epoch"] = mgr.take_over()
        lease = mgr.lease
        m = save_distributed(_state(rank, sharded), mgr.run.url("ckpt_a"), dist=dist,
                             metadata={"num_updates": 1}, lease=lease)
        out["a_metadata"] = m.metadata
        # the same folder again under the same lease: the commit marker is create-only
        out["again"] = _caught(lambda: save_distributed(
            {"w": torch.zeros(6, 4), "step": 8}, mgr.run.url("ckpt_a"), dist=dist,
            lease=lease))
        # a newer incarnation takes the lease while this save writes its data files
        run = open_storage(run_dir)
        fired: list[int] = []

        def progress(nbytes: int) -> None:
            if rank == 0 and not fired:
                fired.append(acquire_lease(run).epoch)

        out["during_write"] = _caught(lambda: save_distributed(
            _state(rank, sharded), mgr.run.url("ckpt_b"), dist=dist, lease=lease,
            progress=progress))
        out["newer_epoch"] = fired[0] if fired else None
        tdist.barrier()
        out["b_files"] = _files(os.path.join(run_dir, "ckpt_b"))
        # ... and from then on the save is refused before anything is written
        out["before_write"] = _caught(lambda: save_distributed(
            _state(rank, sharded), mgr.run.url("ckpt_c"), dist=dist, lease=lease))
        tdist.barrier()
        out["c_files"] = _files(os.path.join(run_dir, "ckpt_c"))
        run.close()
    tdist.barrier()
    return out
