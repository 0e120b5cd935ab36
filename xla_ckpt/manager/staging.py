"""Stage a state to host memory: a snapshot the training loop can no longer change.

The async save path calls :func:`stage_to_host` on the training thread, then
uploads the snapshot in a background thread while training goes on.  The
snapshot:

* holds a host (CPU) copy of every tensor: XLA tensors in one batched
  transfer, CUDA and CPU tensors copied into host buffers (the optimizer
  steps them in place next update);
* keeps aliasing: tensors that shared storage (tied weights) still share one
  copy, so the saved checkpoint is the same as a synchronous save's;
* freezes non-tensor values by passing them through the typed encoding, which
  also refuses what could not be saved (meta tensors, unsupported types) here,
  on the caller's thread, naming the key.

Host buffers can come from a :class:`StagingPool`: the buffers of the previous
snapshot, handed back once it was uploaded.  Fresh allocations page-fault on
first touch, which costs several times the copy itself (PyTorch DCP's async
stager caches its buffers for the same reason); with the pool a save's stall
is about one memcpy of the state.  Peak extra host memory stays one copy of
the staged tensors (the manager keeps at most one snapshot alive, and the pool
only holds the buffers of the last one).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from xla_ckpt.errors import MetaTensorError
from xla_ckpt.format import typed
from xla_ckpt.format.plan import SPAN_MAX_FACTOR, check_storable
from xla_ckpt.restore.save_steps import SavePayload


class StagingPool:
    """Host byte buffers kept between saves, reused by size.  Thread-safe.

    :meth:`release` hands a finished snapshot's buffers back (replacing what
    the pool held, so it never holds more than one snapshot's worth);
    :meth:`take` gives a buffer of exactly ``nbytes`` bytes or allocates one.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 CPU tensor of ``nbytes`` bytes (contents undefined)."""
        with self._lock:
            bufs = self._free.get(nbytes)
            if bufs:
                return bufs.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def release(self, buffers: list[torch.Tensor]) -> None:
        """Keep ``buffers`` (and drop whatever was kept before) for the next snapshot."""
        free: dict[int, list[torch.Tensor]] = {}
        for b in buffers:
            free.setdefault(b.numel(), []).append(b)
        with self._lock:
            self._free = free

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.numel() for bufs in self._free.values() for b in bufs)


@dataclass
class Staged:
    """A host snapshot of a state: ``state`` (same structure), host bytes it holds, its buffers."""

    state: Any
    nbytes: int
    buffers: list[torch.Tensor] = field(default_factory=list)


def stage_to_host(state: Any, pool: StagingPool | None = None) -> Staged:
    """Deep snapshot of ``state`` with every tensor copied to host memory.

    Args:
        state: nested containers of tensors (any device) and plain values.
        pool: reuse host buffers from here (None: allocate fresh ones).

    Raises:
        MetaTensorError: a tensor is on the meta device (names its key).
        UnsupportedTensorError: a sparse, mkldnn, nested or quantized tensor (names its key
            and layout; :func:`xla_ckpt.format.plan.check_storable`).
        UnsupportedTypeError: a value the checkpoint format cannot hold (names its key).
    """
    found: list[torch.Tensor] = []

    def hook(t: torch.Tensor, path: tuple) -> int:
        check_storable(t, typed.format_path(path))  # before any copy: as a blocking save
        found.append(t)
        return len(found) - 1

    encoded = typed.encode(state, hook)
    host, buffers, xla_bytes = _host_copies(found, pool or StagingPool())
    nbytes = sum(b.numel() for b in buffers) + xla_bytes
    return Staged(typed.decode(encoded, lambda i: host[i]), nbytes, buffers)


def stage_dense(tensors: list[torch.Tensor], pool: StagingPool | None = None) -> Staged:
    """Host copies of C-contiguous ``tensors`` (any device), for an async chunked save.

    The chunk tensors a rank owns (:attr:`xla_ckpt.restore.owners.ChunkedSavePlan.owned`:
    its DTensor local shards and the replicated boxes it writes) are views of live
    parameters and optimizer state; the copies here are what the upload reads, so the
    checkpoint holds the values at the moment of the save call (CASES C20).  Each copy is
    C-contiguous with the shape and dtype of its source (tensors sharing a storage stay
    views of one copy); ``state`` is the list of copies, in order.

    Raises:
        ValueError: a tensor is not C-contiguous (a chunk must be), naming its index.
    """
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            raise ValueError(f"chunk tensor {i} of shape {tuple(t.shape)} is not C-contiguous")
        if t.device.type == "meta":
            raise MetaTensorError(f"chunk tensor {i} is on the meta device and holds no data")
    host, buffers, xla_bytes = _host_copies(list(tensors), pool or StagingPool())
    nbytes = sum(b.numel() for b in buffers) + xla_bytes
    return Staged(host, nbytes, buffers)


def _host_copies(tensors: list[torch.Tensor], pool: StagingPool
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Host copies, the pooled buffers they live in, and bytes of XLA transfers (not pooled)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    buffers: list[torch.Tensor] = []
    xla_bytes = 0
    xla_idx = [i for i, t in enumerate(tensors) if t.device.type == "xla"]
    if xla_idx:
        import torch_xla.core.xla_model as xm  # noqa: PLC0415 - optional dependency

        # torch_xla annotates the converter's arena as the result; it returns the converted list.
        cpu = cast("list[torch.Tensor]", xm._maybe_convert_to_cpu([tensors[i] for i in xla_idx]))
        for i, t in zip(xla_idx, cpu, strict=True):
            out[i] = t.detach()  # a fresh host tensor already
            xla_bytes += t.numel() * t.element_size()
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        if out[i] is not None:
            continue
        ptr = t.untyped_storage().data_ptr() if t.device.type == "cpu" else 0
        if not ptr or t.numel() == 0:
            out[i] = _copy_dense(t, pool, buffers)
            continue
        groups.setdefault(ptr, []).append(i)
    for members in groups.values():
        if len(members) == 1:
            t = tensors[members[0]]
            # A lone non-contiguous tensor keeps its strides, as the synchronous save does
            # (xla_ckpt.format.plan: its storage span when at most SPAN_MAX_FACTOR x its bytes).
            keep = not t.is_contiguous() and _span_bytes(t) <= SPAN_MAX_FACTOR * t.numel() * \
                t.element_size()
            out[members[0]] = (_copy_shared([t], pool, buffers)[0] if keep
                               else _copy_dense(t, pool, buffers))
            continue
        for i, t in zip(members, _copy_shared([tensors[i] for i in members], pool, buffers),
                        strict=True):
            out[i] = t
    return out, buffers, xla_bytes  # type: ignore[return-value]  # every slot is filled above


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage span ``t`` covers (from its first to its last element)."""
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def _copy_dense(t: torch.Tensor, pool: StagingPool, buffers: list) -> torch.Tensor:
    """A contiguous host copy of ``t`` in a pooled buffer."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    buf = pool.take(nbytes)
    buffers.append(buf)
    dst = buf.view(t.dtype).view(t.shape)
    dst.copy_(t.detach())
    return dst


def _copy_shared(views: list[torch.Tensor], pool: StagingPool,
                 buffers: list) -> list[torch.Tensor]:
    """Copy tensors that share one storage as views of one new buffer (aliasing kept)."""
    spans = []
    for t in views:
        isz = t.element_size()
        start = int(t.storage_offset()) * isz
        last = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
        spans.append((start, start + (last + 1) * isz))
    align = max(t.element_size() for t in views)
    lo = min(s for s, _ in spans)
    lo -= lo % align
    hi = max(e for _, e in spans)
    src = torch.empty(0, dtype=torch.uint8).set_(views[0].untyped_storage(), lo, (hi - lo,), (1,))
    buf = pool.take(hi - lo)
    buf.copy_(src)
    buffers.append(buf)
    storage = buf.untyped_storage()
    out = []
    for t, (start, _end) in zip(views, spans, strict=True):
        isz = t.element_size()
        out.append(torch.empty(0, dtype=t.dtype).set_(storage, (start - lo) // isz, t.shape,
                                                       t.stride()))
    return out


def stage_payload(payload: SavePayload, pool: StagingPool | None
                  ) -> tuple[SavePayload, list[torch.Tensor], int]:
    """Host snapshot of a rank's save payload (:func:`stage_to_host` for its trees,
    :func:`stage_dense` for its chunks): ``(host payload, pooled buffers, bytes staged)``."""
    staged = [stage_to_host(p, pool) if p is not None else None
              for p in (payload.state, payload.rank_state, payload.shards)]
    chunks = stage_dense(payload.chunks, pool) if payload.chunks is not None else None
    buffers: list[torch.Tensor] = []
    nbytes = 0
    for sg in [*staged, chunks]:
        if sg is not None:
            buffers += sg.buffers
            nbytes += sg.nbytes
    st, rs, sh = [sg.state if sg else None for sg in staged]
    return (SavePayload(st, rs, sh, payload.chunk_name,
                        chunks.state if chunks is not None else None), buffers, nbytes)
