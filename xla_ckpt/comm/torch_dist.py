"""torch.distributed backend: NCCL or gloo data plane, gloo control plane with a timeout.

Started the way torchrun starts a job (``env://``: ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``).  If the process group is already initialised (by the
training script), it is used as it is.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as tdist

from xla_ckpt.comm import liveness
from xla_ckpt.comm.base import Dist
from xla_ckpt.comm.buckets import (
    DEFAULT_BUCKET_SIZE_BYTES,
    byte_view,
    plan_all_gather,
    run_all_gather,
)
from xla_ckpt.comm.topology import Topology
from xla_ckpt.errors import CollectiveTimeoutError, ConfigError, DistributedError

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0

# Control-plane messages up to these sizes take one collective instead of two.
SMALL_ALLGATHER_BYTES = 1024
SMALL_BROADCAST_BYTES = 64 * 1024
_HEADER = 8


def _length(n: int) -> torch.Tensor:
    return torch.tensor(list(n.to_bytes(_HEADER, "little")), dtype=torch.uint8)


def _read_length(slot: torch.Tensor) -> int:
    return int.from_bytes(slot[:_HEADER].numpy().tobytes(), "little")


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"environment variable {name}={v!r} must be an integer") from None


def init_process_group(backend: str, init_method: str, timeout_s: float) -> None:
    """Initialise the default process group unless it already is (every rank calls it).

    Raises:
        CollectiveTimeoutError: the rendezvous did not complete within ``timeout_s``.
    """
    if tdist.is_initialized():
        return
    t0 = time.monotonic()
    try:
        tdist.init_process_group(backend=backend, init_method=init_method,
                                 timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as e:
        if "timeout" in str(e).lower() or "timed out" in str(e).lower():
            raise CollectiveTimeoutError(
                f"rendezvous ({init_method}, backend {backend}) did not complete within "
                f"{timeout_s} s ({e}); check MASTER_ADDR/MASTER_PORT and that every rank "
                "started") from e
        raise
    logger.info("rank %d: process group initialised (%s, %s, world %d) in %.2f s",
                tdist.get_rank(), backend, init_method, tdist.get_world_size(),
                time.monotonic() - t0)


_MISSING_RANKS = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


def collective_error(op: str, rank: int, timeout_s: float, seconds: float,
                     cause: BaseException, blamed: dict[int, str] | None = None
                     ) -> DistributedError:
    """Turn a backend failure of ``op`` into our error type (marked as a broken collective).

    A gloo ``monitored_barrier`` names the ranks that did not arrive; they
    become the error's ``failures``, with ``blamed`` (rank -> cause, from
    :meth:`xla_ckpt.comm.liveness.Liveness.diagnose`).
    """
    text = " ".join(str(cause).split())[:500]
    missing = _MISSING_RANKS.search(text)
    failures = dict(blamed or {})
    low = text.lower()
    if missing or "timed out" in low or "timeout" in low:
        if missing:
            failures.update({int(r): f"did not reach {op} within {timeout_s:g} s"
                             for r in re.findall(r"\d+", missing.group(1))})
        err: DistributedError = CollectiveTimeoutError(
            f"rank {rank}: {op} did not complete within its {timeout_s:g} s timeout ({text}); "
            "another rank died, hung or never entered it — check the other ranks' logs",
            failures)
    else:
        err = DistributedError(
            f"rank {rank}: {op} failed after {seconds:.1f} s ({text}); another rank has "
            "probably died or left — check the other ranks' logs", failures)
    err.collective_broken = True  # type: ignore[attr-defined]  # a flag, see is_broken_collective
    return err


class TorchDist(Dist):
    """:class:`Dist` over ``torch.distributed``.

    Args:
        backend: data-plane backend used when this object initialises the
            process group: ``"gloo"``, ``"nccl"`` or None (NCCL when CUDA is
            available, else gloo).  Ignored if the group already exists.
        init_method: rendezvous URL (``env://`` as torchrun sets it).
        timeout_s: seconds every collective waits (process group and control group).
        group: the data-plane group (see :meth:`new_subgroup`); by default a new
            group over every rank with ``timeout_s``, on the default backend.

    Every rank of the default group must construct it (creating the gloo
    control group is itself a collective).
    """

    kind = "torch"

    def __init__(self, *, backend: str | None = None, init_method: str = "env://",
                 timeout_s: float = DEFAULT_TIMEOUT_S, group: Any = None,
                 _ctrl_group: Any = None) -> None:
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend not in ("gloo", "nccl"):
            raise ConfigError(f"dist.backend for TorchDist must be gloo or nccl, got {backend!r}")
        init_process_group(backend, init_method, timeout_s)
        td = datetime.timedelta(seconds=timeout_s)
        if group is None:
            # Our own data group over every rank, so its collectives time out after
            # *this* timeout_s, whatever the default group (maybe the user's) was given.
            group = tdist.new_group(timeout=td)
        self._group = group
        self._backend = str(tdist.get_backend(self._group)).lower()
        if _ctrl_group is not None:
            self._ctrl = _ctrl_group
        else:
            self._ctrl = tdist.new_group(backend="gloo", timeout=td)
        super().__init__(self._make_topology(), timeout_s=timeout_s)
        self._liveness = liveness.for_group(self._ctrl)
        self._subgroups: dict[tuple[int, ...], TorchDist | None] = {}

    def _make_topology(self) -> Topology:
        rank = tdist.get_rank(self._group)
        world = tdist.get_world_size(self._group)
        local_world = max(_env_int("LOCAL_WORLD_SIZE", 1), 1)
        local_rank = _env_int("LOCAL_RANK", 0)
        if local_rank >= local_world:
            local_world = local_rank + 1
        return Topology(rank=rank, world_size=world, local_rank=local_rank,
                        local_world_size=local_world, host_id=_env_int("GROUP_RANK", 0))

    @classmethod
    def new_subgroup(cls, ranks: Sequence[int], *, timeout_s: float = DEFAULT_TIMEOUT_S
                     ) -> "TorchDist | None":
        """A :class:`TorchDist` over some global ranks (e.g. one data-parallel group).

        Every rank of the default group calls it with the same ``ranks``;
        members get a ``TorchDist`` whose ranks are numbered 0.. within the
        subgroup, the others get None.
        """
        ranks = sorted(int(r) for r in ranks)
        td = datetime.timedelta(seconds=timeout_s)
        data = tdist.new_group(ranks=ranks, timeout=td)
        ctrl = tdist.new_group(ranks=ranks, backend="gloo", timeout=td)
        if tdist.get_rank() not in ranks:
            return None
        return cls(timeout_s=timeout_s, group=data, _ctrl_group=ctrl)

    @property
    def supports_subgroups(self) -> bool:
        # tdist.new_group is a collective of the *default* group: only a Dist
        # spanning every process of the job can make one without a hang
        return tdist.get_world_size(self._group) == tdist.get_world_size()

    def subgroup(self, ranks: Sequence[int]) -> "TorchDist | None":
        key = tuple(sorted(int(r) for r in ranks))
        if key not in self._subgroups:
            self._subgroups[key] = self.own_subgroup(key)
        return self._subgroups[key]

    def own_subgroup(self, ranks: Sequence[int]) -> "TorchDist | None":
        """A new subgroup over ``ranks`` that nothing else uses: a background thread's own,
        so its collectives never interleave with this Dist's (the local tier's replication,
        :mod:`xla_ckpt.manager.replication`).  A collective of every rank of this Dist, as
        :meth:`subgroup`, but never cached: each call makes new process groups.

        Raises:
            NotImplementedError: this Dist does not span every process of the job.
        """
        key = tuple(sorted(int(r) for r in ranks))
        if not self.supports_subgroups:
            raise NotImplementedError("subgroups need a TorchDist over every process of "
                                      "the job")
        td = datetime.timedelta(seconds=self.timeout_s)
        global_ranks = [self._global(r, self._group) for r in key]
        data = tdist.new_group(ranks=global_ranks, timeout=td, backend=self._backend)
        ctrl = tdist.new_group(ranks=global_ranks, backend="gloo", timeout=td)
        if self.rank not in key:
            return None
        return TorchDist(backend=self._backend, timeout_s=self.timeout_s, group=data,
                         _ctrl_group=ctrl)

    # ---- properties -------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        if self._backend == "nccl":
            local = self._topology.local_rank
            return torch.device("cuda", local % max(torch.cuda.device_count(), 1))
        return torch.device("cpu")

    @property
    def data_device(self) -> torch.device:
        return self.device if self._backend == "nccl" else torch.device("cpu")

    @property
    def backend(self) -> str:
        return self._backend

    # ---- primitives -------------------------------------------------------------------
    def _global(self, group_rank: int, group: Any) -> int:
        if group is None or group is tdist.group.WORLD:
            return group_rank
        return tdist.get_global_rank(group, group_rank)

    def _guard(self, op: str, fn: Callable[[], Any], *, collective: bool = True) -> Any:
        t0 = time.monotonic()
        if collective and self._liveness is not None:
            self._liveness.entering(op)  # every rank of the group enters it: a progress mark
        try:
            return fn()
        except (RuntimeError, tdist.DistBackendError) as e:
            # Name the rank(s) to blame (dead: heartbeat stopped; hung: never entered `op`).
            blamed = self._liveness.diagnose() if self._liveness is not None else {}
            raise collective_error(op, self.rank, self.timeout_s, time.monotonic() - t0, e,
                                   blamed) from e

    def barrier(self, timeout_s: float | None = None) -> None:
        timeout = datetime.timedelta(seconds=timeout_s or self.timeout_s)
        self._guard("barrier", lambda: tdist.monitored_barrier(
            group=self._ctrl, timeout=timeout, wait_all_ranks=True))

    def _allgather_bytes(self, data: bytes, op: str) -> list[bytes]:
        world = self.world_size

        def run() -> list[bytes]:
            # One collective when every payload fits a small slot (decisions, errors);
            # a second one, sized to the largest payload, only when some does not.
            slot = torch.zeros(_HEADER + SMALL_ALLGATHER_BYTES, dtype=torch.uint8)
            slot[:_HEADER] = _length(len(data))
            if len(data) <= SMALL_ALLGATHER_BYTES and data:
                slot[_HEADER:_HEADER + len(data)] = _tensor(data)
            slots = [torch.empty_like(slot) for _ in range(world)]
            tdist.all_gather(slots, slot, group=self._ctrl)
            lens = [_read_length(sl) for sl in slots]
            if max(lens) <= SMALL_ALLGATHER_BYTES:
                return [sl[_HEADER:_HEADER + k].numpy().tobytes()
                        for sl, k in zip(slots, lens, strict=True)]
            m = max(lens)
            buf = torch.zeros(m, dtype=torch.uint8)
            if data:
                buf[:len(data)] = _tensor(data)
            outs = [torch.empty(m, dtype=torch.uint8) for _ in range(world)]
            tdist.all_gather(outs, buf, group=self._ctrl)
            return [o[:k].numpy().tobytes() for o, k in zip(outs, lens, strict=True)]

        return self._guard(f"{op} (control plane all_gather)", run)

    def _broadcast_bytes(self, data: bytes | None, src: int, op: str) -> bytes:
        gsrc = self._global(src, self._ctrl)
        is_src = self.rank == src

        def run() -> bytes:
            # The first SMALL_BROADCAST_BYTES travel with the length; the rest, if any, after.
            first = torch.zeros(_HEADER + SMALL_BROADCAST_BYTES, dtype=torch.uint8)
            if is_src:
                payload = data or b""
                first[:_HEADER] = _length(len(payload))
                head = payload[:SMALL_BROADCAST_BYTES]
                if head:
                    first[_HEADER:_HEADER + len(head)] = _tensor(head)
            tdist.broadcast(first, src=gsrc, group=self._ctrl)
            k = _read_length(first)
            if k <= SMALL_BROADCAST_BYTES:
                return first[_HEADER:_HEADER + k].numpy().tobytes()
            rest = torch.empty(k - SMALL_BROADCAST_BYTES, dtype=torch.uint8)
            if is_src:
                rest[:] = _tensor((data or b"")[SMALL_BROADCAST_BYTES:])
            tdist.broadcast(rest, src=gsrc, group=self._ctrl)
            return first[_HEADER:].numpy().tobytes() + rest.numpy().tobytes()

        return self._guard(f"{op} (control plane broadcast from rank {src})", run)

    def _data_broadcast(self, t: torch.Tensor, src: int) -> None:
        gsrc = self._global(src, self._group)
        self._guard(f"broadcast of {t.numel()} bytes from rank {src} (data plane)",
                    lambda: tdist.broadcast(t, src=gsrc, group=self._group))

    def _data_send(self, t: torch.Tensor, dst: int) -> None:
        g = self._global(dst, self._group)
        self._guard(f"send of {t.numel()} bytes to rank {dst} (data plane)",
                    lambda: tdist.send(t, dst=g, group=self._group), collective=False)

    def _data_recv(self, t: torch.Tensor, src: int) -> None:
        g = self._global(src, self._group)
        self._guard(f"recv of {t.numel()} bytes from rank {src} (data plane)",
                    lambda: tdist.recv(t, src=g, group=self._group), collective=False)

    def all_gather_tensors(self, parts: Sequence[Sequence[torch.Tensor]],
                           bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES) -> int:
        """:meth:`Dist.all_gather_tensors`: on NCCL as ``torch.distributed.all_gather`` rounds;
        on gloo one bucketed broadcast per source rank (faster there, measured).

        Each rank's tensors are one byte stream cut into rounds
        (:func:`~xla_ckpt.comm.buckets.plan_all_gather`): in each round every rank sends
        one slot of at most ``bucket_size_bytes / world_size`` bytes (zero-padded) and
        receives every other rank's, so a round moves at most one bucket per rank and
        the whole exchange costs what a ring all-gather costs (each rank receives the
        others' bytes once), not one broadcast tree per source rank.  Staging: one slot
        and one round on :attr:`data_device` (NCCL: CUDA; gloo: host).
        """
        if self.backend == "gloo":
            # measured on gloo (benchmarks/striped_restore.py --all-gather): one bucketed
            # broadcast per source moved 256 MiB in 0.46 s, all_gather rounds in 1.9 s
            return super().all_gather_tensors(parts, bucket_size_bytes)
        return self.all_gather_rounds(parts, bucket_size_bytes)

    def all_gather_rounds(self, parts: Sequence[Sequence[torch.Tensor]],
                          bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES) -> int:
        """:meth:`all_gather_tensors` as rounds of ``torch.distributed.all_gather`` (the NCCL
        path; any backend runs it)."""
        if len(parts) != self.world_size:
            raise ValueError(f"all_gather_tensors needs one part per rank ({self.world_size}), "
                             f"got {len(parts)}")
        if self.world_size == 1:
            return 0
        views = [[byte_view(t) for t in ts] for ts in parts]
        plan = plan_all_gather([[v.numel() for v in vs] for vs in views], bucket_size_bytes)
        dev = self.data_device
        out = torch.empty(self.world_size * plan.slot_bytes, dtype=torch.uint8, device=dev) \
            if plan.rounds else None

        def gather(k: int, rounds: int, send: torch.Tensor) -> torch.Tensor:
            assert out is not None  # rounds > 0
            src = send if send.device == dev else send.to(dev)
            slots = list(out.chunk(self.world_size))
            self._guard(f"all-gather round {k + 1} of {rounds} ({plan.slot_bytes} bytes per "
                        "rank, data plane)",
                        lambda: tdist.all_gather(slots, src, group=self._group))
            return out if out.device.type == "cpu" else out.cpu()

        t0 = time.perf_counter()
        received = run_all_gather(plan, views, self.rank, gather)
        dt = time.perf_counter() - t0
        logger.debug("rank %d: all_gather_tensors received %d bytes in %d rounds in %.3f s "
                     "(%.1f MiB/s)", self.rank, received, plan.rounds, dt,
                     received / max(dt, 1e-9) / 2**20)
        return received
