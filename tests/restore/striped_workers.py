"""Functions the striped / per-host restore tests run on every rank (module level: importable).

The ranks run as emulated hosts (``WorkerPool(world, hosts=H)`` gives each rank
``GROUP_RANK`` / ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` and its host's GCS source address
``127.0.0.(10+h)``); :func:`emulated_dist` builds the same topology from ``hosts`` for a
pool started without them.  The faults are hooks on the real storage backend or on
:mod:`xla_ckpt.restore.host_share` in one rank only (faults a real part cannot produce on
demand at that point); the rest is the real library.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Iterator

import torch

from tests.restore.restore_workers import digest
from xla_ckpt.comm import DistConfig, TorchDist, get_dist
from xla_ckpt.restore import RestoreConfig, restore, save_distributed
from xla_ckpt.restore.sharding import partition_bounds
from xla_ckpt.storage.base import SOURCE_ADDRESS_ENV
from xla_ckpt.testing.asserts import assert_state_identical
from xla_ckpt.testing.fault_proxy import host_address
from xla_ckpt.testing.launcher import kill_self

KiB = 1024
#: crc32c chunk size of the mixed checkpoint: several stripes per large blob.
CHUNK_BYTES = 256 * KiB
FLAT_NUMEL = 1000  # the ZeRO-partitioned flat tensor
STALL_EXTRA_S = 6.0


# ---- topology ---------------------------------------------------------------------------

@contextlib.contextmanager
def emulated_host_env(hosts: int, *, bind_address: bool = False) -> Iterator[int]:
    """Set this rank's torchrun host variables for ``hosts`` emulated hosts (consecutive
    ranks share a host, as ``WorkerPool(hosts=H)`` numbers them), restored on exit; yields
    the host id.  ``bind_address``: also its host's GCS source address."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    per = world // hosts
    host = rank // per
    new = {"GROUP_RANK": str(host), "LOCAL_RANK": str(rank % per),
           "LOCAL_WORLD_SIZE": str(per)}
    if bind_address and hosts > 1:
        new[SOURCE_ADDRESS_ENV] = host_address(host)
    saved = {k: os.environ.get(k) for k in new}
    os.environ.update(new)
    try:
        yield host
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def emulated_dist(hosts: int, timeout_s: float = 60.0, *, fresh: bool = False):
    """This rank's Dist with ``hosts`` emulated hosts (torchrun GROUP_RANK / LOCAL_*).

    ``fresh``: new process groups for this call (a failure case leaves its groups broken),
    else the cached Dist of this timeout (another timeout is another cache key)."""
    job = get_dist(DistConfig(backend="gloo", timeout_s=120.0))  # the job's process group
    with emulated_host_env(hosts):
        if fresh:
            d = TorchDist.new_subgroup(range(job.world_size), timeout_s=timeout_s)
            assert d is not None  # every rank is a member
            return d
        return get_dist(DistConfig(backend="gloo", timeout_s=timeout_s + hosts / 1000))


# ---- the checkpoints ----------------------------------------------------------------------

def mixed_state() -> dict[str, Any]:
    """About 5.5 MiB: aliasing (a view of another tensor), bf16 / int8 / float64, an empty
    tensor, large tensors of several crc32c chunks and many small ones."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(600_000, generator=g)
    return {"t": [base, base[10:20], torch.randint(-9, 9, (1000,), dtype=torch.int8,
                                                    generator=g),
                  torch.randn(33, generator=g).to(torch.bfloat16), torch.empty(0, 3),
                  torch.randn(70_000, generator=g).double(),
                  torch.randn(3, 200_000, generator=g)],
            "small": {f"b{i}": torch.full((i % 7 + 1,), float(i)) for i in range(120)},
            "step": 7, "name": "mixed"}


def mixed_rank_state(rank: int) -> dict[str, Any]:
    return {"pos": 100 + rank, "rng": torch.full((16,), rank, dtype=torch.int64)}


def flat_shard(rank: int, world: int) -> torch.Tensor:
    flat = torch.arange(FLAT_NUMEL, dtype=torch.float32) * 0.5
    lo, hi = partition_bounds(FLAT_NUMEL, world)[rank]
    return flat[lo:hi]


def save_mixed(uri: str) -> int:
    """Every rank: save :func:`mixed_state` (rank 0's), each rank's own item and its ZeRO
    partition of ``exp_avg``; returns the data bytes."""
    d = get_dist(DistConfig(backend="gloo"))
    m = save_distributed(mixed_state(), uri, dist=d, rank_state=mixed_rank_state(d.rank),
                         shards={"exp_avg": flat_shard(d.rank, d.world_size)},
                         chunk_size_bytes=CHUNK_BYTES)
    return m.nbytes


def chunked_full() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(1003, 64, generator=g), "c": torch.randn(37, 130, generator=g),
            "r": torch.randn(5000, generator=g).to(torch.bfloat16),
            "plain": torch.arange(12, dtype=torch.int8), "step": 3}


def save_chunked(uri: str) -> int:
    """Every rank: save :func:`chunked_full` as DTensors (Shard(0), Shard(1), Replicate())
    on a 1-D CPU mesh: a chunked (manifest v2) checkpoint, with each rank's own item."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    d = get_dist(DistConfig(backend="gloo"))
    mesh = init_device_mesh("cpu", (d.world_size,))
    full = chunked_full()
    state = {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
             "c": distribute_tensor(full["c"], mesh, [Shard(1)]),
             "r": distribute_tensor(full["r"], mesh, [Replicate()]),
             "plain": full["plain"], "step": full["step"]}
    m = save_distributed(state, uri, dist=d, rank_state=mixed_rank_state(d.rank),
                         chunk_size_bytes=4 * KiB)
    return m.nbytes


# ---- restores -------------------------------------------------------------------------

def _refuse_segments(rank_of_dist: int, victim: int | None):
    """In rank ``victim`` only: opening the leader's segment fails (another PID namespace)."""
    from xla_ckpt.comm.host_memory import HostMemoryError
    from xla_ckpt.restore import host_share

    real = host_share.open_segment
    if victim != rank_of_dist:
        return real

    def refuse(handle, **_):  # a fault no same-host process produces on demand
        raise HostMemoryError(f"cannot open /proc/{handle['pid']}/fd/{handle['fd']}: "
                              "[Errno 13] Permission denied")

    host_share.open_segment = refuse
    return real


def restore_plan(uri: str, hosts: int, strategy: str, *, host_shared_memory: bool = True,
                 zero_sharding: str = "none", cost_model: dict | None = None,
                 expect: str = "mixed", cannot_open_rank: int | None = None) -> dict[str, Any]:
    """Every rank: restore ``uri`` with ``strategy``; what it got and the figures."""
    from xla_ckpt.restore import host_share

    d = emulated_dist(hosts)
    extra: dict[str, Any] = {"cost_model": cost_model} if cost_model else {}
    cfg = RestoreConfig(strategy=strategy, host_shared_memory=host_shared_memory,
                        zero_sharding=zero_sharding, bucket_size_bytes=1 << 20, **extra)
    real_open = _refuse_segments(d.rank, cannot_open_rank)
    try:
        r = restore(uri, dist=d, config=cfg)
    finally:
        host_share.open_segment = real_open
    want = mixed_state() if expect == "mixed" else chunked_full()
    try:
        assert_state_identical(r.state, want)
        differs = ""
    except AssertionError as e:
        differs = str(e)[:400]
    aliased = (r.state["t"][1].data_ptr() == r.state["t"][0].data_ptr() + 40
               and r.state["t"][1].untyped_storage().data_ptr()
               == r.state["t"][0].untyped_storage().data_ptr()) if expect == "mixed" else None
    return {"digest": digest(r.state), "differs": differs,
            "rank_state": digest(r.rank_state), "rank_pos": (r.rank_state or {}).get("pos"),
            "shards": {k: v.tolist() for k, v in r.shards.items()},
            "shard_bounds": dict(r.shard_bounds),
            "strategy": r.strategy, "plan": r.stats.plan, "reason": r.reason,
            "read": r.stats.bytes_read, "received": r.stats.bytes_received,
            "mapped": r.stats.bytes_mapped, "predicted": r.stats.predicted_s,
            "predictions": r.stats.predictions, "data_path": r.stats.data_path,
            "seconds": r.stats.seconds,
            "aliased": aliased, "host": d.topology.host_id,
            "address": os.environ.get(SOURCE_ADDRESS_ENV), "nbytes": r.manifest.nbytes}


# ---- failures -------------------------------------------------------------------------

def _hook_data_reads(action) -> None:
    """Run ``action()`` at this rank's first ranged read of a data file (local or GCS)."""
    from xla_ckpt.storage.gcs import GCSStorage
    from xla_ckpt.storage.local import LocalStorage

    fired = threading.Lock()  # reads run in parallel threads: act once

    for cls in (LocalStorage, GCSStorage):
        real = cls.read_range

        def hooked(self, name, *a, _real=real, **kw):
            if name.endswith(".safetensors") and fired.acquire(blocking=False):
                action()
            return _real(self, name, *a, **kw)

        cls.read_range = hooked  # type: ignore[method-assign]  # the fault hook, on purpose


def restore_failing(uri: str, hosts: int, strategy: str, scenario: str, victim: int,
                    timeout_s: float, host_shared_memory: bool = True) -> dict[str, Any]:
    """Every rank: restore ``uri`` on fresh groups with a ``timeout_s`` collective timeout
    while ``victim`` fails as ``scenario`` says (``none``: nothing is hooked -- a corrupt
    stored byte or a proxy fault does the damage; ``kill``: SIGKILL at its first data read;
    ``stall``: it sleeps ``timeout_s + STALL_EXTRA_S`` there).  Never raises."""
    from xla_ckpt.errors import XlaCkptError
    from xla_ckpt.storage import StorageConfig

    d = emulated_dist(hosts, timeout_s, fresh=True)
    if d.rank == victim and scenario in ("kill", "stall"):
        _hook_data_reads(kill_self if scenario == "kill"
                         else (lambda: time.sleep(timeout_s + STALL_EXTRA_S)))
    t0 = time.monotonic()
    out: dict[str, Any] = {"rank": d.rank, "host": d.topology.host_id}
    try:
        r = restore(uri, dist=d, config=RestoreConfig(
            strategy=strategy, host_shared_memory=host_shared_memory,
            bucket_size_bytes=256 * KiB),
            storage_config=StorageConfig(max_attempts=2, initial_backoff_s=0.01,
                                         max_backoff_s=0.05))
        try:
            assert_state_identical(r.state, mixed_state())
            out.update(outcome="restored", plan=r.stats.plan)
        except AssertionError as e:
            out.update(outcome="silent_corruption", message=str(e)[:400])
    except XlaCkptError as e:
        out.update(outcome="error", error=type(e).__name__, message=str(e),
                   failures={int(k): v for k, v in getattr(e, "failures", {}).items()})
    except Exception as e:  # noqa: BLE001 - recorded: the test fails on it
        out.update(outcome="foreign_error", error=type(e).__name__, message=str(e))
    out["seconds"] = time.monotonic() - t0
    return out
