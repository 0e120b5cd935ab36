"""Functions the striped / per-host restore tests run on every rank (module level: importable)."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.restore.restore_workers import digest
from xla_ckpt.comm import get_dist
from xla_ckpt.config import DistConfig
from xla_ckpt.restore import RestoreConfig, restore, save_distributed
from xla_ckpt.restore.sharding import partition_bounds


def emulated_dist(hosts: int, timeout_s: float = 60.0):
    """This rank's Dist with ``hosts`` emulated hosts (torchrun GROUP_RANK / LOCAL_*)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    saved = {k: os.environ.get(k) for k in ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    per = world // hosts
    os.environ.update(GROUP_RANK=str(rank // per), LOCAL_RANK=str(rank % per),
                      LOCAL_WORLD_SIZE=str(per))
    try:  # its own Dist (another timeout is another cache key): topology from the env
        return get_dist(DistConfig(backend="gloo", timeout_s=timeout_s + hosts / 1000))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def save_mixed(uri: str, big_elems: int = 600_000) -> None:
    """Replicated tensors (aliasing, dtypes, empty, large and small), rank items, ZeRO shards."""
    d = get_dist(DistConfig(backend="gloo"))
    g = torch.Generator().manual_seed(5)
    base = torch.randn(big_elems, generator=g)
    state = {"t": [base, base[10:20], torch.randint(0, 9, (1000,), dtype=torch.int8),
                   torch.randn(33, generator=g).to(torch.bfloat16), torch.empty(0, 3),
                   torch.randn(70_000, generator=g).double(),
                   torch.randn(3, 200_000, generator=g)],
             "small": {f"b{i}": torch.full((i + 1,), float(i)) for i in range(40)},
             "step": 7}
    flat = torch.arange(1000, dtype=torch.float32)
    lo, hi = partition_bounds(1000, d.world_size)[d.rank]
    save_distributed(state, uri, dist=d, rank_state={"pos": 100 + d.rank},
                     shards={"exp_avg": flat[lo:hi]})


def restore_plan(uri: str, hosts: int, strategy: str, *, host_shared_memory: bool = True,
                 zero_sharding: str = "none", cost_model: dict | None = None) -> dict[str, Any]:
    d = emulated_dist(hosts)
    cfg = RestoreConfig(strategy=strategy, host_shared_memory=host_shared_memory,
                        zero_sharding=zero_sharding, bucket_size_bytes=1 << 20,
                        **({"cost_model": cost_model} if cost_model else {}))
    r = restore(uri, dist=d, config=cfg)
    aliased = r.state["t"][1].data_ptr() == r.state["t"][0].data_ptr() + 40
    return {"digest": digest(r.state), "rank_state": r.rank_state,
            "shards": {k: v.tolist() for k, v in r.shards.items()},
            "strategy": r.strategy, "plan": r.stats.plan, "reason": r.reason,
            "read": r.stats.bytes_read, "received": r.stats.bytes_received,
            "mapped": r.stats.bytes_mapped, "predicted": r.stats.predicted_s,
            "predictions": r.stats.predictions, "data_path": r.stats.data_path,
            "aliased": aliased, "host": d.topology.host_id, "nbytes": r.manifest.nbytes}
