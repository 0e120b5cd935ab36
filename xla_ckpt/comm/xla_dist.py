"""torch_xla backend: ranks from the XLA runtime, control plane on gloo, data plane gloo or XLA.

On a Cloud TPU VM / pod (PJRT, one process per chip) the topology comes from
``torch_xla.runtime`` and the gloo group is initialised with
``init_method="xla://"`` (torch_xla's rendezvous), so no ``MASTER_ADDR`` is
needed.  XLA collectives are never used to move Python objects (object
broadcast is broken upstream, pytorch/xla#5492): the control plane (decisions,
manifests, errors) is always gloo.

**Data plane.**  By default the bulk tensor bytes of :meth:`Dist.broadcast_tensors`
and :meth:`Dist.all_gather_tensors` move as host (CPU) buffers over a gloo group of
this object's own.  Opt in with ``XlaDist(data_plane="xla")`` or the environment
variable ``XLA_CKPT_XLA_DATA_PLANE=1`` to move them with torch_xla's tensor
collectives instead:

* ``_data_broadcast`` (each bucket of :meth:`Dist.broadcast_tensors`):
  ``xm.collective_broadcast([words], root_ordinal=src)`` (in torch_xla 2.9 a
  multiply by 1 on the root and 0 elsewhere, then an all-reduce SUM);
* :meth:`XlaDist.all_gather_tensors`: ``xm.all_gather(words, dim=0, pin_layout=False)``
  (a real XLA AllGather) in rounds of at most ``bucket_size_bytes`` gathered bytes
  (:func:`plan_all_gather`).

Each bucket is a host ``uint8`` buffer reinterpreted, without conversion, as
:data:`WIRE_DTYPE` (int32) words, copied to this rank's XLA device, moved, and
copied back; buckets are padded to a multiple of 4 bytes (and, for broadcasts, to
a few size classes so XLA compiles a handful of graphs, :func:`padded_broadcast_bytes`).
int32 rather than uint8 because the broadcast is an all-reduce and 32-bit integer
reductions are what every XLA backend implements; adding the zeros of the other
ranks leaves the root's words unchanged bit for bit.  ``pin_layout=False`` is safe
here: the buffers are 1-D, so every rank's layout is the same.

The XLA plane is used only when it was asked for **and** ``torch_xla.runtime``
reports a world size > 1 (a real TPU job, where every process is an XLA replica
and rank == ``xr.global_ordinal()``); otherwise the data plane stays gloo and the
reason is logged and kept in :attr:`XlaDist.data_plane_reason`
(:func:`choose_data_plane`).  Point-to-point moves (:meth:`Dist.scatter_tensors`)
and subgroups (:meth:`TorchDist.subgroup`, e.g. host leaders) always use gloo: an
XLA collective must be entered by every replica of the job.

XLA collectives take no timeout: before each one every rank passes a gloo
``monitored_barrier`` (with :attr:`Dist.timeout_s`), so a rank that died or failed
before the exchange is named as usual; a rank that dies *inside* an XLA collective
is left to the TPU runtime to detect.

**Unverified on TPU.**  XLA collectives do not complete across CPU processes
(each ``PJRT_DEVICE=CPU`` process is its own world of one), so the XLA plane is
written against the torch_xla 2.9 API and tested only in one process (world size
1: the same calls, bucket plans and byte round trips); it has not run on a TPU.

CPU emulation (tests, the demo): N processes with ``PJRT_DEVICE=CPU`` each
own an XLA CPU device, but ``torch_xla.runtime`` reports world size 1 in
every one of them; the job's real topology then comes from the gloo process
group (initialised from ``env://``), and the data plane is gloo.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as tdist

from xla_ckpt.comm.buckets import (  # noqa: F401 - AllGatherPlan, GatherPiece re-exported
    _WORD,
    DEFAULT_BUCKET_SIZE_BYTES,
    AllGatherPlan,
    GatherPiece,
    byte_view,
    plan_all_gather,
    run_all_gather,
)
from xla_ckpt.comm.topology import Topology
from xla_ckpt.comm.torch_dist import DEFAULT_TIMEOUT_S, TorchDist, init_process_group
from xla_ckpt.errors import ConfigError

logger = logging.getLogger(__name__)

DATA_PLANE_ENV = "XLA_CKPT_XLA_DATA_PLANE"
"""``1``/``true``/``xla``: ask for the XLA data plane; ``0``/``false``/``gloo``/unset: gloo."""

DATA_PLANES = ("gloo", "xla")

WIRE_DTYPE = torch.int32
"""dtype the byte buffers are reinterpreted as on the XLA device (see the module docstring)."""

_BROADCAST_SIZE_STEP = 1024 * 1024

_TRUE = ("1", "true", "yes", "on", "xla")
_FALSE = ("", "0", "false", "no", "off", "gloo")


def choose_data_plane(requested: str | None, xla_world_size: int,
                      environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The data plane an :class:`XlaDist` uses, and why: ``("gloo" | "xla", reason)``.

    Args:
        requested: ``"xla"``, ``"gloo"``, or None (read :data:`DATA_PLANE_ENV` from
            ``environ``, default ``os.environ``).
        xla_world_size: ``torch_xla.runtime.world_size()`` in this process.

    "xla" only when requested and ``xla_world_size > 1``: under CPU emulation every
    process is an XLA world of one, so an XLA collective cannot reach the others.

    Raises:
        ConfigError: ``requested`` or the environment variable holds another value.
    """
    if requested is None:
        raw = (os.environ if environ is None else environ).get(DATA_PLANE_ENV, "")
        value = raw.strip().lower()
        if value in _TRUE:
            requested, how = "xla", f"{DATA_PLANE_ENV}={raw}"
        elif value in _FALSE:
            requested, how = "gloo", ""
        else:
            raise ConfigError(f"environment variable {DATA_PLANE_ENV}={raw!r} must be 1/true/xla "
                              "(XLA tensor collectives) or 0/false/gloo (host buffers over gloo)")
    elif requested in DATA_PLANES:
        how = f"data_plane={requested!r}"
    else:
        raise ConfigError(f"XlaDist data_plane must be one of {', '.join(DATA_PLANES)} or None "
                          f"(read {DATA_PLANE_ENV}), got {requested!r}")
    if requested == "gloo":
        why = f" ({how})" if how else (f" (the XLA data plane is opt-in: XlaDist(data_plane="
                                       f"'xla') or {DATA_PLANE_ENV}=1)")
        return "gloo", f"host buffers over gloo{why}"
    if xla_world_size <= 1:
        return "gloo", (f"host buffers over gloo: the XLA data plane was requested ({how}) but "
                        f"torch_xla.runtime reports world size {xla_world_size} (CPU emulation "
                        "or one device), so XLA collectives cannot reach the other processes")
    return "xla", (f"XLA tensor collectives ({how}; torch_xla.runtime world size "
                   f"{xla_world_size}; xm.collective_broadcast / xm.all_gather, unverified on "
                   "TPU)")


def padded_broadcast_bytes(nbytes: int) -> int:
    """Bytes a broadcast bucket of ``nbytes`` travels as on the XLA plane.

    At least one :data:`WIRE_DTYPE` word; up to 1 MiB the next power of two, above it
    the next multiple of 1 MiB.  Few distinct sizes means few XLA graph
    compilations; the padding costs at most 1 MiB per bucket above 1 MiB.

    Raises:
        ValueError: ``nbytes`` < 0.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes <= _BROADCAST_SIZE_STEP:
        return max(_WORD, 1 << max(nbytes - 1, 0).bit_length())
    return -(-nbytes // _BROADCAST_SIZE_STEP) * _BROADCAST_SIZE_STEP


def _env_launched() -> bool:
    return bool(os.environ.get("MASTER_ADDR")) and bool(os.environ.get("WORLD_SIZE"))


class XlaDist(TorchDist):
    """:class:`Dist` for torch_xla jobs (TPU, or XLA CPU devices under emulation).

    Args:
        init_method: ``None`` picks ``env://`` when a launcher set
            ``MASTER_ADDR``/``WORLD_SIZE`` (torchrun, CPU emulation) and
            ``xla://`` otherwise (TPU runtime rendezvous).
        timeout_s: seconds every collective waits (gloo; XLA collectives take none,
            see the module docstring).
        data_plane: ``"xla"`` to move data-plane bytes with torch_xla tensor
            collectives when the XLA runtime spans the job (world size > 1), ``"gloo"``
            for host buffers over gloo, None (default) to read ``XLA_CKPT_XLA_DATA_PLANE``
            (unset: gloo).  Every rank must pass the same.

    Attributes:
        data_plane: the plane in use, ``"gloo"`` or ``"xla"`` (:func:`choose_data_plane`).
        data_plane_reason: why (logged once at construction).

    Raises:
        ConfigError: the XLA runtime and the process group disagree about rank
            or world size; a bad ``data_plane`` or ``XLA_CKPT_XLA_DATA_PLANE``; the ranks
            chose different planes (checked on every rank with one control-plane exchange).
    """

    kind = "xla"

    def __init__(self, *, init_method: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, data_plane: str | None = None) -> None:
        import torch_xla  # noqa: PLC0415 - optional dependency
        import torch_xla.core.xla_model as xm  # noqa: PLC0415 - optional dependency
        import torch_xla.runtime as xr  # noqa: PLC0415 - optional dependency

        # Checked before any collective, so a bad value fails every rank alike and at once.
        plane, reason = choose_data_plane(data_plane, xr.world_size())

        if not tdist.is_initialized():
            if init_method is None:
                init_method = "env://" if _env_launched() else "xla://"
            if init_method.startswith("xla://"):
                import torch_xla.distributed.xla_backend  # noqa: PLC0415 - registers xla://
            init_process_group("gloo", init_method, timeout_s)
        self._xr = xr
        self._xm = xm
        self._torch_xla = torch_xla
        self._xla_device = torch_xla.device()
        ctrl = tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        # the gloo data plane (and scatter's point-to-point moves) on a group of our own
        data = tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.data_plane = plane
        self.data_plane_reason = reason
        super().__init__(timeout_s=timeout_s, group=data, _ctrl_group=ctrl)
        planes = self.exchange(plane)
        if len(set(planes)) > 1:
            by_plane = {p: [r for r, q in enumerate(planes) if q == p] for p in sorted(set(planes))}
            raise ConfigError(f"rank {self.rank}: the ranks chose different data planes "
                              f"({by_plane}); pass the same XlaDist(data_plane=...) and "
                              f"{DATA_PLANE_ENV} on every rank")
        logger.info("rank %d: data plane: %s", self.rank, reason)

    def _make_topology(self) -> Topology:
        pg = super()._make_topology()
        xr = self._xr
        xla_world = xr.world_size()
        if xla_world <= 1:
            if pg.world_size > 1:
                logger.info("rank %d: torch_xla.runtime reports world size %d (CPU emulation); "
                            "topology taken from the process group: %s", pg.rank, xla_world, pg)
            return pg
        topo = Topology(rank=xr.global_ordinal(), world_size=xla_world,
                        local_rank=xr.local_ordinal(),
                        local_world_size=max(xr.local_device_count(), 1),
                        host_id=xr.host_index())
        if (topo.rank, topo.world_size) != (pg.rank, pg.world_size):
            raise ConfigError(f"torch_xla.runtime says rank {topo.rank} of {topo.world_size} but "
                              f"the process group says rank {pg.rank} of {pg.world_size}; "
                              "initialise the group with init_method='xla://'")
        return topo

    @property
    def device(self) -> torch.device:
        """This process's XLA device (``torch_xla.device()``)."""
        return self._xla_device

    @property
    def data_device(self) -> torch.device:
        """``cpu``: buckets are staged in host memory on both planes (the XLA plane copies
        each one to the XLA device and back inside the collective)."""
        return torch.device("cpu")

    @property
    def backend(self) -> str:
        """``"xla"`` when the data plane is XLA tensor collectives, else the gloo group's."""
        return "xla" if self.data_plane == "xla" else super().backend

    # ---- the XLA data plane ------------------------------------------------------------
    def _before_xla_collective(self, op: str) -> None:
        """A gloo barrier with a timeout: XLA collectives have none, so a rank already dead
        or failed is named here instead of hanging the others inside XLA."""
        self.barrier()
        logger.debug("rank %d: entering %s", self.rank, op)

    def _to_words(self, buf: torch.Tensor) -> Any:
        """Host uint8 ``buf`` (length a multiple of 4) as int32 words on the XLA device."""
        return buf.view(WIRE_DTYPE).to(self._xla_device)

    def _xla_gather_round(self, k: int, rounds: int, send: torch.Tensor) -> torch.Tensor:
        """One all-gather of host uint8 ``send`` (a multiple of 4 bytes) over every XLA
        replica: the ranks' buffers back to back, on the host."""
        op = (f"XLA all_gather round {k + 1}/{rounds} of {send.numel()} bytes per rank "
              "(data plane)")
        self._before_xla_collective(op)

        def run() -> torch.Tensor:
            gathered = self._xm.all_gather(self._to_words(send), dim=0, pin_layout=False)
            self._torch_xla.sync()
            return gathered.cpu().view(torch.uint8)

        got: torch.Tensor = self._guard(op, run)
        if got.numel() != send.numel() * self.world_size:
            raise ConfigError(f"rank {self.rank}: xm.all_gather returned {got.numel()} bytes, "
                              f"expected {self.world_size} ranks x {send.numel()}: the XLA "
                              "world does not match the process group")
        return got

    def _data_broadcast(self, t: torch.Tensor, src: int) -> None:
        if self.data_plane != "xla":
            super()._data_broadcast(t, src)
            return
        op = f"XLA collective_broadcast of {t.numel()} bytes from rank {src} (data plane)"
        self._before_xla_collective(op)
        n = t.numel()
        buf = torch.zeros(padded_broadcast_bytes(n), dtype=torch.uint8)
        if self.rank == src:
            buf[:n].copy_(t)
        out = self._xla_broadcast_bytes(buf, src, op)
        if self.rank != src:
            t.copy_(out[:n])

    def _xla_broadcast_bytes(self, buf: torch.Tensor, src: int, op: str) -> torch.Tensor:
        """``src``'s host uint8 ``buf`` (a multiple of 4 bytes) on every rank, on the host,
        through ``xm.collective_broadcast`` (every rank passes a buffer of the same size)."""

        def run() -> torch.Tensor:
            words = self._to_words(buf)
            self._xm.collective_broadcast([words], root_ordinal=src)
            self._torch_xla.sync()
            return words.cpu().view(torch.uint8)

        out: torch.Tensor = self._guard(op, run)
        return out

    def all_gather_tensors(self, parts: Sequence[Sequence[torch.Tensor]],
                           bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES) -> int:
        """:meth:`Dist.all_gather_tensors`; on the XLA plane with ``xm.all_gather`` rounds.

        Same contract as the base method (every rank calls it; ``parts[r]`` are rank
        ``r``'s contiguous tensors, data on ``r``, same-sized destinations elsewhere;
        returns the bytes this rank received).  On the gloo plane it is the base
        method.  On the XLA plane (:attr:`data_plane` ``"xla"``, unverified on TPU)
        the bytes move in :func:`plan_all_gather` rounds: this rank packs its slot of
        the round into a host buffer, the buffer goes to the XLA device as int32 words,
        ``xm.all_gather(..., dim=0, pin_layout=False)`` gathers every rank's slot, the
        result comes back to the host and is unpacked into the other ranks'
        destinations.  Extra memory: one slot plus one gathered round (<=
        ``bucket_size_bytes``) on the host and on the device.  A rank with fewer bytes
        sends zero padding (an XLA all-gather needs equal shapes).

        Raises:
            ValueError: ``parts`` does not have ``world_size`` entries, or a tensor is
                not contiguous.
            DistributedError / CollectiveTimeoutError: a collective (or the barrier
                before it) failed.
        """
        if self.data_plane != "xla":
            return super().all_gather_tensors(parts, bucket_size_bytes)
        if len(parts) != self.world_size:
            raise ValueError(f"all_gather_tensors needs one part per rank ({self.world_size}), "
                             f"got {len(parts)}")
        views = [[byte_view(t) for t in ts] for ts in parts]
        plan = plan_all_gather([[v.numel() for v in vs] for vs in views], bucket_size_bytes)
        t0 = time.perf_counter()
        received = run_all_gather(plan, views, self.rank, self._xla_gather_round)
        dt = time.perf_counter() - t0
        logger.debug("rank %d: XLA all_gather_tensors received %d bytes in %d rounds in %.3f s "
                     "(%.1f MiB/s)", self.rank, received, plan.rounds, dt,
                     received / max(dt, 1e-9) / 2**20)
        return received
