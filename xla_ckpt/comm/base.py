"""The distribution interface every backend implements (DESIGN: "dist" layer).

A :class:`Dist` has two planes (DESIGN decision 1):

* the **control plane** carries small typed objects (decisions, manifests,
  errors) on a CPU group with a timeout — gloo for every backend, because
  XLA object broadcast is broken upstream (pytorch/xla#5492) and NCCL cannot
  move host objects;
* the **data plane** carries tensor bytes in bounded buckets
  (:meth:`Dist.broadcast_tensors`, :meth:`Dist.scatter_tensors`) on the
  job's default group (gloo on CPU, NCCL on CUDA).

A backend implements a handful of primitives (``_allgather_bytes``,
``_broadcast_bytes``, ``_data_broadcast``, ``_data_send``, ``_data_recv``,
:meth:`Dist.barrier`); everything else is built on them here.

**Every rank calls every method** of this interface, in the same order —
they are collectives.  The rules that keep a job from hanging:

* every collective has a timeout; when it expires, or a peer's connection
  drops, the backend raises :class:`~xla_ckpt.errors.CollectiveTimeoutError`
  (or :class:`~xla_ckpt.errors.DistributedError`) naming the operation;
* a step that can fail on some ranks only (a storage read) runs inside
  :meth:`Dist.run_collectively`: each rank runs it, then *every* rank enters
  one agreement exchange whatever happened locally, and if any rank failed
  every rank raises the same :class:`DistributedError` whose ``failures``
  maps each failing rank to its cause.

Small objects travel as JSON produced by :mod:`xla_ckpt.format.typed`, never
as pickles: a peer can send data, not code (:mod:`xla_ckpt.comm.objects`); a
rank's failure travels as one line (:mod:`xla_ckpt.comm.failures`).
"""

from __future__ import annotations

import abc
import json
import logging
import time
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch

from xla_ckpt.comm.buckets import (
    DEFAULT_BUCKET_SIZE_BYTES,
    byte_view,
    max_staging_bytes,
    pack,
    plan_buckets,
    unpack,
)
from xla_ckpt.comm.failures import describe_error
from xla_ckpt.comm.objects import decode_object, encode_object
from xla_ckpt.comm.topology import Topology
from xla_ckpt.errors import DistributedError
from xla_ckpt.format.crc import crc32c

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Re-exported: callers import the control-plane helpers from here too.
__all__ = ["Dist", "decode_object", "describe_error", "encode_object"]


def _signature(sizes: Sequence[int]) -> list[int]:
    """(count, total bytes, crc32c of the size list): equal on two ranks iff the layouts match."""
    return [len(sizes), int(sum(sizes)), crc32c(json.dumps([int(n) for n in sizes]).encode())]


class Dist(abc.ABC):
    """Topology plus collectives.  See the module docstring for the rules.

    Attributes:
        kind: ``"torch"``, ``"xla"`` or ``"single"``.
        timeout_s: seconds any collective waits before raising
            :class:`~xla_ckpt.errors.CollectiveTimeoutError`.
    """

    kind: str = "abstract"

    def __init__(self, topology: Topology, *, timeout_s: float) -> None:
        self._topology = topology
        self.timeout_s = float(timeout_s)

    # ---- what a backend provides -----------------------------------------------------
    @property
    def topology(self) -> Topology:
        """This process's :class:`Topology`."""
        return self._topology

    @property
    def rank(self) -> int:
        return self._topology.rank

    @property
    def world_size(self) -> int:
        return self._topology.world_size

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """This rank's own compute device (``xla``, ``cuda:<local_rank>`` or ``cpu``).

        Pass it as ``map_location`` to place restored tensors on this rank's
        device and nowhere else (CASES C2).
        """

    @property
    @abc.abstractmethod
    def data_device(self) -> torch.device:
        """Device the data-plane collectives move bytes on (``cpu`` for gloo, ``cuda`` for NCCL)."""

    @property
    @abc.abstractmethod
    def backend(self) -> str:
        """Data-plane backend name (``gloo``, ``nccl``, or ``none`` for a single process)."""

    @abc.abstractmethod
    def barrier(self, timeout_s: float | None = None) -> None:
        """Wait until every rank has arrived; every rank calls it.

        Raises:
            CollectiveTimeoutError: some rank did not arrive within ``timeout_s``
                (default :attr:`timeout_s`); names the missing ranks where the
                backend can tell.
        """

    @abc.abstractmethod
    def _allgather_bytes(self, data: bytes, op: str) -> list[bytes]:
        """Control plane: every rank's ``data``, indexed by rank."""

    @abc.abstractmethod
    def _broadcast_bytes(self, data: bytes | None, src: int, op: str) -> bytes:
        """Control plane: ``src``'s ``data`` on every rank (others pass None)."""

    @abc.abstractmethod
    def _data_broadcast(self, t: torch.Tensor, src: int) -> None:
        """Data plane: broadcast contiguous ``t`` (on :attr:`data_device`) in place."""

    @abc.abstractmethod
    def _data_send(self, t: torch.Tensor, dst: int) -> None:
        """Data plane: send contiguous ``t`` to rank ``dst``."""

    @abc.abstractmethod
    def _data_recv(self, t: torch.Tensor, src: int) -> None:
        """Data plane: receive into contiguous ``t`` from rank ``src``."""

    # ---- small objects (control plane) -------------------------------------------------
    def exchange(self, obj: Any) -> list[Any]:
        """All-gather a small object: element ``r`` of the result is rank ``r``'s ``obj``.

        ``obj`` travels as typed JSON (:mod:`xla_ckpt.format.typed`): None,
        numbers, strings, bytes, tuples, lists, dicts, Namespace... never tensors.

        Raises:
            UnsupportedTypeError: ``obj`` cannot be encoded (raised before any
                communication; every rank must then fail the same way).
            CollectiveTimeoutError / DistributedError: the exchange did not complete.
        """
        return [decode_object(b) for b in self._allgather_bytes(encode_object(obj), "exchange")]

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """``src``'s small object on every rank; receivers pass nothing.

        Same encoding and errors as :meth:`exchange`.
        """
        payload = encode_object(obj) if self.rank == src else None
        return decode_object(self._broadcast_bytes(payload, src, "broadcast_object"))

    def exchange_bytes(self, data: bytes) -> list[bytes]:
        """All-gather raw bytes (e.g. JSON a caller encoded); element ``r`` is rank ``r``'s."""
        return self._allgather_bytes(bytes(data), "exchange_bytes")

    def broadcast_bytes(self, data: bytes | None = None, src: int = 0) -> bytes:
        """``src``'s raw bytes (e.g. a manifest's JSON) on every rank; receivers pass nothing."""
        payload: bytes | None = None
        if self.rank == src:
            if data is None:
                raise ValueError("the source rank must pass the bytes to broadcast")
            payload = bytes(data)
        return self._broadcast_bytes(payload, src, "broadcast_bytes")

    # ---- failure agreement ----------------------------------------------------------
    def agree(self, error: BaseException | str | None, what: str) -> None:
        """Every rank reports how its local step went; if any failed, all raise.

        Every rank must call this after the step, whether or not it failed —
        that is what keeps the others from waiting forever.

        Args:
            error: this rank's failure (exception or one-line text), or None.
            what: the step, for messages (``"restore (all_ranks): read"``).

        Raises:
            DistributedError: on every rank when any rank failed; ``failures``
                maps each failing rank to ``"TypeName: message"``; on a failing
                rank the original exception is the ``__cause__``.
            CollectiveTimeoutError: the agreement itself did not complete (a
                rank died or hung).
        """
        cause = None if error is None else describe_error(error)
        causes = self.exchange(cause)
        failures = {r: c for r, c in enumerate(causes) if c is not None}
        if not failures:
            return
        ranks = ", ".join(str(r) for r in sorted(failures))
        exc = DistributedError(f"{what} failed on rank(s) {ranks} of {self.world_size} "
                               f"(reported on rank {self.rank})", failures)
        if isinstance(error, BaseException):
            exc.__cause__ = error
        raise exc

    def run_collectively(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn()`` on this rank, then :meth:`agree` on the outcome with every rank.

        Returns ``fn()``'s value when every rank succeeded.  An ``Exception``
        from ``fn`` is reported, not raised; a ``DistributedError`` that ``fn``
        itself got from a collective is re-raised at once (every rank already
        got it, or the group is broken and an agreement would only time out).

        Raises:
            DistributedError: some rank's ``fn`` failed (see :meth:`agree`).
        """
        error: BaseException | None = None
        result: Any = None
        try:
            result = fn()
        except DistributedError:
            raise
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
            logger.debug("rank %d: %s failed locally: %s", self.rank, what, describe_error(e))
            error = e
        self.agree(error, what)
        return result

    def run_on_subgroup(self, group: "Dist | None", ranks: Sequence[int],
                        fn: Callable[["Dist"], T], what: str) -> T | None:
        """Every rank of this job calls it: ``fn(group)`` runs on the members of ``group`` (a
        subgroup whose rank ``i`` is this job's rank ``ranks[i]``; None on the other ranks,
        which wait), then one agreement of the whole job.

        A failure reaches every rank of the job naming the job's ranks: an exception on a
        member, or a :class:`DistributedError` the subgroup raised on its members (its
        ``failures`` name subgroup ranks: they are mapped to the job's).

        Returns:
            ``fn``'s value on a member, None elsewhere.

        Raises:
            DistributedError: on every rank when ``fn`` failed somewhere.
            CollectiveTimeoutError: the job's agreement did not complete.
        """
        failed: dict[int, str] = {}
        error: BaseException | None = None
        result: T | None = None
        if group is not None:
            try:
                result = fn(group)
            except DistributedError as e:  # every member got it: name the job's ranks
                error = e
                failed = {int(ranks[int(r)]): c for r, c in e.failures.items()} or \
                    {self.rank: describe_error(e)}
            except Exception as e:  # noqa: BLE001 - reported to every rank just below
                error = e
                failed = {self.rank: describe_error(e)}
        failures: dict[int, str] = {}
        for part in self.exchange({str(r): c for r, c in failed.items()}):
            failures.update({int(r): c for r, c in part.items()})
        if failures:
            shown = ", ".join(str(r) for r in sorted(failures))
            raise DistributedError(f"{what} failed on rank(s) {shown} of {self.world_size} "
                                   f"(reported on rank {self.rank})", failures) from error
        return result

    # ---- tensors (data plane) -------------------------------------------------------
    def _check_layout(self, sizes: Sequence[int], src: int, what: str) -> None:
        """Raise on every rank unless every rank passed tensors of ``src``'s byte sizes."""
        sigs = self.exchange(_signature(sizes))
        bad = {r: f"passed {s[0]} tensors / {s[1]} bytes, rank {src} passed {sigs[src][0]} / "
                  f"{sigs[src][1]}" for r, s in enumerate(sigs) if s != sigs[src]}
        if bad:
            raise DistributedError(f"{what}: ranks passed tensors of different sizes", bad)

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], src: int = 0,
                          bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES, *,
                          wait_on_src: Callable[[int], None] | None = None,
                          check_layout: bool = True,
                          staging: torch.Tensor | None = None) -> int:
        """Copy ``src``'s tensors into the preallocated tensors of every other rank.

        Every rank passes the same number of contiguous tensors with the same
        byte sizes (``src``'s hold the data; elsewhere they are destinations,
        e.g. ``torch.empty``).  Small tensors travel packed in staging buckets
        of at most ``bucket_size_bytes``; a tensor larger than a bucket moves
        in place in bucket-sized slices.  Extra memory per rank: one bucket.
        When the tensors are not on :attr:`data_device` (CPU tensors with
        NCCL) every bucket is staged through a device buffer.

        ``check_layout=False`` skips the size check (one control-plane round)
        when every rank derived its sizes from the same bytes, e.g. a manifest.

        ``wait_on_src`` lets ``src`` fill its tensors while earlier buckets
        are already travelling: before sending a bucket, ``src`` calls
        ``wait_on_src(i)`` with the highest tensor index the bucket needs,
        which returns once tensors ``0..i`` hold their data.

        ``staging`` (uint8, on :attr:`data_device`, at least ``bucket_size_bytes``) is the
        staging bucket to pack into, for callers that broadcast in several calls: one
        buffer reused keeps the allocator from holding one freed bucket per call.

        Returns:
            Bytes moved (the sum of the tensors' sizes).

        Raises:
            DistributedError: ranks passed different sizes (checked first, on
                every rank), or a collective failed.
            ValueError: a tensor is not contiguous.
        """
        views = [byte_view(t) for t in tensors]
        sizes = [v.numel() for v in views]
        if self.world_size == 1:
            return sum(sizes)
        if check_layout:
            self._check_layout(sizes, src, "broadcast_tensors")
        dev = self.data_device
        plan = plan_buckets(sizes, bucket_size_bytes)
        staged_all = any(v.device != dev for v in views)
        need = max((b.nbytes for b in plan), default=0) if staged_all else max_staging_bytes(plan)
        if staging is not None and (staging.numel() < need or staging.device != dev):
            raise ValueError(f"broadcast_tensors: the staging buffer has {staging.numel()} "
                             f"bytes on {staging.device}; this plan needs {need} on {dev}")
        is_src = self.rank == src
        t0 = time.perf_counter()
        for b in plan:
            if is_src and wait_on_src is not None:
                wait_on_src(max(p.index for p in b.parts))
            if b.direct and not staged_all:
                p = b.parts[0]
                self._data_broadcast(views[p.index][p.start:p.start + p.nbytes], src)
                continue
            if staging is None:
                staging = torch.empty(need, dtype=torch.uint8, device=dev)
            buf = staging[:b.nbytes]
            if is_src:
                pack(buf, views, b)
            self._data_broadcast(buf, src)
            if not is_src:
                unpack(buf, views, b)
        total = sum(sizes)
        dt = time.perf_counter() - t0
        logger.debug("rank %d: broadcast_tensors moved %d bytes in %d buckets in %.3f s "
                     "(%.1f MiB/s)", self.rank, total, len(plan), dt, total / max(dt, 1e-9) / 2**20)
        return total

    def scatter_tensors(self, outputs: Sequence[torch.Tensor],
                        inputs: Mapping[int, Sequence[torch.Tensor]] | None = None,
                        src: int = 0,
                        bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES) -> int:
        """Give each rank its own tensors from ``src`` (point to point, in buckets).

        Every rank passes ``outputs``: its preallocated contiguous
        destinations.  On ``src``, ``inputs[r]`` holds rank ``r``'s tensors
        (same count and byte sizes as rank ``r``'s ``outputs``); ranks missing
        from ``inputs`` receive nothing and must pass no outputs; ``src``'s
        own outputs are filled from ``inputs[src]`` by a local copy.  Bytes
        for one rank never reach another.

        Returns:
            Bytes this rank sent (``src``) or received.

        Raises:
            DistributedError: on every rank when ``src``'s inputs do not match a
                rank's outputs (checked first), or a collective failed.
        """
        out_views = [byte_view(t) for t in outputs]
        my_sizes = [v.numel() for v in out_views]
        sigs = self.exchange(_signature(my_sizes))
        error = None
        in_views: dict[int, list[torch.Tensor]] = {}
        if self.rank == src:
            given = dict(inputs or {})
            for r in range(self.world_size):
                in_views[r] = [byte_view(t) for t in given.get(r, ())]
                sz = [v.numel() for v in in_views[r]]
                if _signature(sz) != sigs[r]:
                    error = (f"inputs for rank {r} ({len(sz)} tensors, {sum(sz)} bytes) do not "
                             f"match its outputs ({sigs[r][0]} tensors, {sigs[r][1]} bytes)")
                    break
        self.agree(error, "scatter_tensors")
        dev = self.data_device
        moved = 0
        if self.rank == src:
            # strict: the agreed check above matched inputs[src] to src's own outputs
            for v_out, v_in in zip(out_views, in_views.get(src, []), strict=True):
                if v_out.data_ptr() != v_in.data_ptr():
                    v_out.copy_(v_in)
            for r in range(self.world_size):
                if r == src or not in_views[r]:
                    continue
                moved += self._move(in_views[r], bucket_size_bytes, dev, self._data_send, r,
                                    send=True)
        elif out_views:
            moved = self._move(out_views, bucket_size_bytes, dev, self._data_recv, src,
                               send=False)
        return moved

    def all_gather_tensors(self, parts: Sequence[Sequence[torch.Tensor]],
                           bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES) -> int:
        """Every rank ends with every rank's bytes: an all-gather of tensor lists, in buckets.

        ``parts[r]`` are rank ``r``'s contiguous tensors (``len(parts) == world_size``): on
        rank ``r`` they hold its data, on the other ranks they are destinations of the same
        byte sizes (e.g. views of one preallocated buffer).  Every rank derives the sizes
        from the same plan, so they are not checked.  The default moves each rank's part
        with :meth:`broadcast_tensors` from that rank (bounded buckets, no staging beyond
        one bucket); a backend may override it with a native all-gather (the XLA data
        plane, :mod:`xla_ckpt.comm.xla_dist`).  Used by the striped restore
        (:mod:`xla_ckpt.restore.box_striped`): each rank's rows reach every other rank.

        Returns:
            Bytes this rank received (the other ranks' parts).

        Raises:
            ValueError: ``parts`` does not have ``world_size`` entries, or a tensor is not
                contiguous.
            DistributedError / CollectiveTimeoutError: a collective failed.
        """
        if len(parts) != self.world_size:
            raise ValueError(f"all_gather_tensors needs one part per rank ({self.world_size}), "
                             f"got {len(parts)}")
        received = 0
        for src, tensors in enumerate(parts):
            n = self.broadcast_tensors(tensors, src=src, bucket_size_bytes=bucket_size_bytes,
                                       check_layout=False)
            received += 0 if src == self.rank else n
        return received

    def send_tensors(self, tensors: Sequence[torch.Tensor], dst: int,
                     bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES) -> int:
        """Send contiguous ``tensors`` to rank ``dst`` (point to point, in buckets).

        ``dst`` calls :meth:`recv_tensors` with tensors of the same byte sizes at the same
        point of the same global order of transfers (the caller's schedule); nothing else
        is exchanged.  Returns the bytes sent.
        """
        views = [byte_view(t) for t in tensors]
        return self._move(views, bucket_size_bytes, self.data_device, self._data_send, dst,
                          send=True)

    def recv_tensors(self, tensors: Sequence[torch.Tensor], src: int,
                     bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES) -> int:
        """Receive into contiguous ``tensors`` what rank ``src`` sends with :meth:`send_tensors`.

        Returns the bytes received.
        """
        views = [byte_view(t) for t in tensors]
        return self._move(views, bucket_size_bytes, self.data_device, self._data_recv, src,
                          send=False)

    def _move(self, views: list[torch.Tensor], bucket_size_bytes: int, dev: torch.device,
              op: Callable[[torch.Tensor, int], None], peer: int, *, send: bool) -> int:
        """Move ``views`` to or from rank ``peer`` in buckets: ``op`` is the send or the receive."""
        sizes = [v.numel() for v in views]
        plan = plan_buckets(sizes, bucket_size_bytes)
        staged_all = any(v.device != dev for v in views)
        need = max((b.nbytes for b in plan), default=0) if staged_all else max_staging_bytes(plan)
        staging = torch.empty(need, dtype=torch.uint8, device=dev) if need else None
        for b in plan:
            if b.direct and not staged_all:
                p = b.parts[0]
                op(views[p.index][p.start:p.start + p.nbytes], peer)
                continue
            assert staging is not None
            buf = staging[:b.nbytes]
            if send:
                pack(buf, views, b)
            op(buf, peer)
            if not send:
                unpack(buf, views, b)
        return sum(sizes)

    def subgroup(self, ranks: Sequence[int]) -> "Dist | None":
        """A :class:`Dist` over some of this one's ranks (e.g. one leader per host).

        Every rank of this Dist calls it with the same ``ranks`` (it is a
        collective); members get a Dist whose ranks are numbered ``0..``
        in the order of ``sorted(ranks)``, the others get None.  The
        subgroup is made once and reused.

        Raises:
            NotImplementedError: this backend cannot make subgroups
                (:attr:`supports_subgroups` is False).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot make subgroups")

    def own_subgroup(self, ranks: Sequence[int]) -> "Dist | None":
        """As :meth:`subgroup`, but a new group each call that nothing else shares (a
        background thread's own).

        Raises:
            NotImplementedError: as :meth:`subgroup`.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot make subgroups")

    @property
    def supports_subgroups(self) -> bool:
        """Whether :meth:`subgroup` and :meth:`own_subgroup` work on this backend."""
        return False

    def close(self) -> None:  # noqa: B027 - a deliberate no-op default, not an abstract method
        """Release groups this object created (the default process group is left alone).

        The default does nothing: a backend that creates no groups need not override it.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._topology}, backend={self.backend})"
