"""What the resharding-from-the-tiers tests run on every rank (launcher workers; importable).

:func:`save_local` trains the small FSDP2 model of :mod:`sharded_manager_workers` on 4 ranks
(2 emulated hosts x 2) with a local tier per host (``<root>/local-{host}``, local saves every
update, replicas on the other host, no durable save) and saves DCP's copy of the last update's
state (the reference).  :func:`restore_tiers` restores it with ``restore_or_initialize`` onto
another mesh, whatever hosts the pool has, into a fresh FSDP2 model, and DCP restores its own
copy into another: the shards of both and the restore's tier figures come back.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import sharded_manager_workers as W
import torch.distributed.checkpoint as dcp

UPDATES = 3


def _mgr(run_dir: str, root: str, **kw: Any) -> Any:
    from xla_ckpt.manager import CheckpointManager
    from xla_ckpt.restore import RestoreConfig

    cfg = W._cfg(run_dir, local_dir=os.path.join(root, "local-{host}"),
                 local_interval_updates=1, save_interval_updates=1000,
                 keep_local_checkpoints=2, restore_file="checkpoint_last", **kw)
    return CheckpointManager(cfg, dist=W._dist(),
                             restore_config=RestoreConfig(rank_state_on_resize="drop"))


def save_local(run_dir: str, root: str, dcp_dir: str) -> dict[str, Any]:
    model, optim = W.fsdp_model(seed=0)
    mgr = _mgr(run_dir, root)
    for u in range(1, UPDATES + 1):
        W.train_step(model, optim, u)
        mgr.after_update(epoch=1, num_updates=u, end_of_epoch=False,
                         state=lambda: W.state_of(model, optim),
                         rank_state={"rank": W._dist().rank})
    mgr.wait()
    status = mgr.wait_for_replicas(60.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(W.state_of(model, optim), checkpoint_id=dcp_dir)
    mgr.close()
    return {"replication": status}


def restore_tiers(run_dir: str, root: str, dcp_dir: str, damage: str = "") -> dict[str, Any]:
    """Restore onto this pool's mesh from the tiers; ``damage="flip:<host>"``: rank 0 first
    flips the last byte of every data file host ``<host>`` holds as its own part."""
    dist = W._dist()
    if damage.startswith("flip:") and dist.rank == 0:
        _flip_own(root, int(damage.split(":")[1]))
    dist.barrier()
    model, optim = W.fsdp_model(seed=5)
    target = W.state_of(model, optim)
    mgr = _mgr(run_dir, root)
    res = mgr.restore_or_initialize(into=target)
    assert res is not None
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optim, model_state_dict=res.state["model"],
                   optim_state_dict=res.state["optim"])
    ours = W.shards(W.state_of(model, optim))
    ref_model, ref_optim = W.fsdp_model(seed=6)
    ref = W.state_of(ref_model, ref_optim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(ref, checkpoint_id=dcp_dir)
    theirs = W.shards(ref)
    mgr.close()
    return {"ours": ours, "theirs": theirs, "tier": res.tier, "restored_from": res.uri,
            "host": dist.topology.host_id}


def _flip_own(root: str, host: int) -> list[str]:
    import glob
    import json

    out = []
    for marker in glob.glob(os.path.join(root, f"local-{host}", "*", "*",
                                         f"host-{host}.commit.json")):
        folder = os.path.dirname(marker)
        with open(marker, "rb") as f:
            files = json.loads(f.read())["files"]
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "r+b") as f:  # the last byte: the last tensor's last row
                f.seek(-1, os.SEEK_END)
                b = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([b[0] ^ 0xFF]))
            out.append(path)
    return out
