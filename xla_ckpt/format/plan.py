"""State -> (typed tree, tensor records, host blobs) and back.  No I/O here.

Save side (:func:`plan_item`):

* every tensor is brought to host (CPU) memory first: XLA tensors in one
  batched transfer, CUDA tensors with ``.cpu()``; the recorded data never
  carries a device tag (CASES C1);
* a tensor on the ``meta`` device is refused with :class:`MetaTensorError`
  naming its key (C11); a tensor the format has no layout for (sparse COO/CSR/CSC/BSR/
  BSC, mkldnn, nested, quantized) with :class:`UnsupportedTensorError` naming its key and
  layout and what to save instead (:func:`check_storable`);
* tensors that share one storage are written once, as one blob covering the
  bytes they use, and come back as views of one buffer (aliasing restored); a
  lone view of a much larger storage is written compactly (no bloat);
* a lone non-contiguous tensor (transposed, sliced with a step, expanded with
  a zero stride) is written as the span of its storage that covers it, so it
  comes back with its strides (as ``torch.save`` keeps them), unless that span
  is more than :data:`SPAN_MAX_FACTOR` times its bytes: then it is written as
  a contiguous copy and comes back contiguous (logged at INFO, naming it).

Load side (:func:`materialize_item`): blob buffers (``uint8`` CPU tensors)
become the recorded strided views, then the typed tree is decoded.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, cast

import torch

from xla_ckpt.errors import CheckpointCorruptError, MetaTensorError, UnsupportedTensorError
from xla_ckpt.format import typed
from xla_ckpt.format.crc import crc32c_chunks, crc32c_concat
from xla_ckpt.format.dtypes import dtype_from_name, dtype_name, itemsize, safetensors_code
from xla_ckpt.format.manifest import DEFAULT_CHUNK_SIZE_BYTES, BlobRecord, Item, TensorRecord

logger = logging.getLogger(__name__)


SPAN_MAX_FACTOR = 2
"""A tensor (or a group of views of one storage) is written as the byte span of its storage
that covers it, keeping its strides as ``torch.save`` does, when that span is at most this many
times the bytes the tensor(s) use; a lone view spread thinner is written as a contiguous copy
(its strides then become contiguous; logged at INFO)."""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor's data."""
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.reshape(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.reshape(-1)
    return flat.numpy().data.cast("B")


def chunk_crcs(buf: memoryview, chunk_size: int) -> tuple[int, ...]:
    """crc32c of each ``chunk_size``-byte chunk of ``buf``; empty when it fits in one chunk."""
    return crc32c_chunks(buf, chunk_size)[1]


@dataclass
class PlannedBlob:
    """A blob to write: ``data`` is a contiguous uint8 CPU tensor, ``name`` a readable label."""

    name: str
    data: torch.Tensor
    dtype_code: str
    shape: tuple[int, ...]


@dataclass
class ItemPlan:
    """What :func:`plan_item` hands to a writer."""

    state: Any
    tensors: list[TensorRecord] = field(default_factory=list)
    blobs: list[PlannedBlob] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(b.data.numel() for b in self.blobs)


def _to_host(tensors: list[torch.Tensor], *, xla_only: bool = False) -> list[torch.Tensor]:
    """Bring tensors to CPU, batching XLA transfers; CPU tensors are returned as they are
    (``xla_only``: every tensor but an XLA one is returned as it is)."""
    out = list(tensors)
    xla_idx = [i for i, t in enumerate(tensors) if t.device.type == "xla"]
    if xla_idx:
        import torch_xla.core.xla_model as xm  # noqa: PLC0415 - optional dependency

        # torch_xla annotates this as returning a ToXlaTensorArena; it returns the structure it
        # was given (here a list) with the tensors converted.
        cpu = cast(list[torch.Tensor], xm._maybe_convert_to_cpu([tensors[i] for i in xla_idx]))
        for i, t in zip(xla_idx, cpu, strict=True):
            out[i] = t
    for i, t in enumerate(out):
        if t.device.type != "cpu" and not xla_only:
            out[i] = t.detach().to("cpu")
    return [t.detach() for t in out]


_COMPRESSED_PARTS = {
    torch.sparse_csr: "t.crow_indices(), t.col_indices(), t.values()",
    torch.sparse_csc: "t.ccol_indices(), t.row_indices(), t.values()",
    torch.sparse_bsr: "t.crow_indices(), t.col_indices(), t.values()",
    torch.sparse_bsc: "t.ccol_indices(), t.row_indices(), t.values()",
}


def check_storable(t: torch.Tensor, key: str) -> None:
    """Refuse a tensor the format cannot store: only dense (strided, not nested, not
    quantized) tensors on a real device have bytes a blob can hold.

    Raises:
        MetaTensorError: ``t`` is on the meta device (names ``key``).
        UnsupportedTensorError: a sparse (COO, CSR, CSC, BSR, BSC), mkldnn, nested or
            quantized tensor; names ``key`` and the layout and says what to save instead.
    """
    if t.device.type == "meta":
        raise MetaTensorError(
            f"tensor at {key} is on the meta device and holds no data; materialise it "
            "(e.g. model.to_empty(device=...) and load/initialise weights) before saving")
    layout = str(t.layout)
    if t.is_nested:
        raise UnsupportedTensorError(
            f"tensor at {key} is a nested tensor (layout {layout}), which xla_ckpt does not "
            "store; save t.unbind() (the list of its tensors) and rebuild it with "
            "torch.nested.nested_tensor(...) after loading", key=key, layout=f"nested {layout}")
    if t.layout == torch.sparse_coo:
        raise UnsupportedTensorError(
            f"tensor at {key} is sparse (layout {layout}), which xla_ckpt does not store; "
            "save t.to_dense(), or, to keep it sparse, its parts t.coalesce().indices(), "
            "t.coalesce().values() and list(t.shape), and rebuild it with "
            "torch.sparse_coo_tensor(indices, values, shape) after loading",
            key=key, layout=layout)
    if t.layout in _COMPRESSED_PARTS:
        raise UnsupportedTensorError(
            f"tensor at {key} is sparse (layout {layout}), which xla_ckpt does not store; "
            f"save t.to_dense(), or, to keep it sparse, its parts {_COMPRESSED_PARTS[t.layout]} "
            "and list(t.shape), and rebuild it with torch.sparse_compressed_tensor(..., "
            f"layout={layout}) after loading", key=key, layout=layout)
    if t.layout != torch.strided:
        raise UnsupportedTensorError(
            f"tensor at {key} has layout {layout}, which xla_ckpt does not store; save "
            "t.to_dense() (a strided tensor) instead", key=key, layout=layout)
    if t.is_quantized:
        raise UnsupportedTensorError(
            f"tensor at {key} is quantized ({t.dtype}, {t.qscheme()}), which xla_ckpt does not "
            "store; save t.dequantize(), or t.int_repr() with its scale and zero point",
            key=key, layout=f"quantized {t.dtype}")


def plan_item(state: Any, *, chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES,
              to_host: bool = True) -> ItemPlan:
    """Encode ``state`` and lay out its tensors as blobs in host memory (``to_host=False``:
    blobs of CUDA and other non-XLA device tensors stay views of their device storage).

    Raises:
        MetaTensorError: a tensor lives on the meta device (names its key).
        UnsupportedTensorError: a sparse, mkldnn, nested or quantized tensor
            (:func:`check_storable`).
        UnsupportedTypeError: a non-tensor value the typed encoding cannot hold.
    """
    found: list[tuple[torch.Tensor, str]] = []

    def hook(t: torch.Tensor, path: tuple) -> int:
        key = typed.format_path(path)
        check_storable(t, key)
        found.append((t, key))
        return len(found) - 1

    encoded = typed.encode(state, hook)
    host = _to_host([t for t, _ in found], xla_only=not to_host)
    plan = ItemPlan(state=encoded)

    # Group by storage so aliasing survives and shared bytes are written once.
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(host):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        gkey = ("storage", ptr) if ptr and t.numel() else ("lone", i)
        groups.setdefault(gkey, []).append(i)

    records: list[TensorRecord | None] = [None] * len(host)
    densified: list[str] = []
    for members in groups.values():
        spans = []
        for i in members:
            t = host[i]
            isz = t.element_size()
            start = int(t.storage_offset()) * isz  # int: a concrete tensor has no SymInt offset
            last = (sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
                    if t.numel() else -1)
            spans.append((start, start + (last + 1) * isz))
        lo = min(s for s, _ in spans)
        hi = max(e for _, e in spans)
        used = sum(host[i].numel() * host[i].element_size() for i in members)
        if len(members) == 1 and hi - lo > SPAN_MAX_FACTOR * used:
            # A lone strided view spread thinly over its storage (x[:, ::8]): write it densely.
            records[members[0]] = _dense_blob(plan, host[members[0]], found[members[0]][1])
            densified.append(found[members[0]][1])
            continue
        if hi - lo > SPAN_MAX_FACTOR * used and len(members) > 1 and _disjoint(spans):
            # Views spread thinly over a big storage: write each tensor densely rather than
            # the whole span.
            for i in members:
                records[i] = _dense_blob(plan, host[i], found[i][1])
            continue
        t0 = host[members[0]]
        raw = torch.empty(0, dtype=torch.uint8, device=t0.device).set_(
            t0.untyped_storage(), lo, (hi - lo,), (1,)) if hi > lo else \
            torch.empty(0, dtype=torch.uint8)
        same = len(members) == 1 and host[members[0]].is_contiguous()
        dtype_code = _code(t0.dtype) if same else "U8"
        shape = tuple(t0.shape) if same and dtype_code != "U8" else (hi - lo,)
        plan.blobs.append(PlannedBlob(found[members[0]][1], raw, dtype_code, shape))
        bidx = len(plan.blobs) - 1
        for i, (s, _e) in zip(members, spans, strict=True):
            t = host[i]
            records[i] = TensorRecord(found[i][1], bidx, (s - lo) if t.numel() else 0,
                                      dtype_name(t.dtype), tuple(t.shape), tuple(t.stride()))
    plan.tensors = [r for r in records if r is not None]
    assert len(plan.tensors) == len(host)
    if densified:
        logger.info("wrote %d strided tensor(s) as contiguous copies, because the storage span "
                    "covering each is more than %dx its own bytes; they load with contiguous "
                    "strides: %s%s", len(densified), SPAN_MAX_FACTOR, ", ".join(densified[:5]),
                    f" (+{len(densified) - 5} more)" if len(densified) > 5 else "")
    return plan


def _disjoint(spans: list[tuple[int, int]]) -> bool:
    s = sorted(spans)
    return all(b[0] >= a[1] for a, b in itertools.pairwise(s))


def _code(dtype: torch.dtype) -> str:
    return safetensors_code(dtype) or "U8"


def _dense_blob(plan: ItemPlan, t: torch.Tensor, key: str) -> TensorRecord:
    dense = t.contiguous()
    raw = (dense.reshape(-1).view(torch.uint8) if dense.numel()
           else torch.empty(0, dtype=torch.uint8))  # on t's device (plan_item's to_host)
    code = _code(t.dtype)
    shape = tuple(t.shape) if code != "U8" else (raw.numel(),)
    plan.blobs.append(PlannedBlob(key, raw, code, shape))
    return TensorRecord(key, len(plan.blobs) - 1, 0, dtype_name(t.dtype), tuple(t.shape),
                        tuple(dense.stride()))


def blob_record(planned: PlannedBlob, file: str, offset: int,
                chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES, *,
                piece_crcs: Sequence[int] | None = None) -> BlobRecord:
    """Checksum a planned blob and record where the writer put it.

    ``piece_crcs``: the crc32c of each piece of :func:`blob_pieces` (computed by a writer
    that checksums while it writes); the blob's bytes are then not read again.  Without
    it the blob is checksummed here, each byte once.
    """
    buf = tensor_bytes(planned.data)
    n = len(buf)
    if piece_crcs is None:
        whole, chunks = crc32c_chunks(buf, chunk_size_bytes)
    else:
        want = max(1, -(-n // chunk_size_bytes)) if n else 0
        if len(piece_crcs) != want:
            raise ValueError(f"blob {planned.name!r}: {len(piece_crcs)} piece crc32c values for "
                             f"{want} pieces of {n} bytes")
        chunks = tuple(piece_crcs) if n > chunk_size_bytes else ()
        whole = crc32c_concat(piece_crcs, chunk_size_bytes, n) if n else 0
    return BlobRecord(file=file, offset=offset, length=n, crc32c=whole,
                      chunk_size=chunk_size_bytes, chunk_crc32c=chunks)


def blob_pieces(planned: PlannedBlob, chunk_size_bytes: int) -> list[memoryview]:
    """A blob's bytes cut at its crc32c chunk boundaries (zero-copy views; none if empty).

    Writers that checksum while they write hand these to storage in order; their crc32c
    values are the blob's ``chunk_crc32c`` (see :func:`blob_record`).
    """
    buf = tensor_bytes(planned.data)
    return [buf[i:i + chunk_size_bytes] for i in range(0, len(buf), chunk_size_bytes)]


MapLocation = Any  # None | str | torch.device | dict | callable, like torch.load


def resolve_device(map_location: MapLocation, key: str) -> torch.device | None:
    """Target device for one tensor; ``None`` keeps it on CPU (the default, as torch.load)."""
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, Mapping):
        dev = map_location.get("cpu")
        return torch.device(dev) if dev is not None else None
    if callable(map_location):
        dev = map_location(key)
        return torch.device(dev) if dev is not None else None
    raise TypeError(f"map_location must be None, a device, a dict or a callable, not "
                    f"{type(map_location).__name__}")


def materialize_item(item: Item, blobs: Mapping[int, torch.Tensor],
                     map_location: MapLocation = None,
                     tensor_filter: Callable[[TensorRecord], bool] | None = None) -> Any:
    """Rebuild an item's state from its blob buffers.

    Args:
        item: the manifest item.
        blobs: blob index -> uint8 CPU tensor holding the blob's bytes
            (already crc32c-checked by the reader); it may be a view into a
            larger storage (tensors then alias that storage).
        map_location: where tensors go (None = CPU). Tensors that shared a
            blob are placed together so they still alias on the target.
        tensor_filter: if given, tensors for which it returns False come back
            as ``None`` (used by sharded restores that read only some blobs).

    Raises:
        CheckpointCorruptError: a blob is missing or too short for a view.
    """
    moved: dict[tuple[int, str], torch.Tensor] = {}
    out: list[torch.Tensor | None] = []
    for rec in item.tensors:
        if tensor_filter is not None and not tensor_filter(rec):
            out.append(None)
            continue
        dtype = dtype_from_name(rec.dtype, where=rec.key)
        if rec.numel == 0:
            t = torch.empty(rec.shape, dtype=dtype)
        else:
            buf = blobs.get(rec.blob)
            if buf is None:
                raise CheckpointCorruptError(f"bytes of blob {rec.blob} for {rec.key} were not "
                                             "read")
            isz = itemsize(dtype)
            span = rec.span_bytes()
            if rec.byte_offset + span > buf.numel():
                raise CheckpointCorruptError(f"{rec.key} needs bytes [{rec.byte_offset}, "
                                             f"{rec.byte_offset + span}) of blob {rec.blob}, "
                                             f"which holds {buf.numel()}")
            # the blob may itself be a view into a larger storage (host shared memory)
            start = buf.storage_offset() + rec.byte_offset
            if start % isz:
                # Unaligned view: copy out (cannot alias a misaligned typed view).
                part = buf[rec.byte_offset:rec.byte_offset + span].clone()
                t = torch.empty(0, dtype=dtype).set_(part.untyped_storage(), 0, rec.shape,
                                                     rec.stride)
            else:
                t = torch.empty(0, dtype=dtype).set_(buf.untyped_storage(), start // isz,
                                                     rec.shape, rec.stride)
        dev = resolve_device(map_location, rec.key)
        if dev is not None and dev.type != "cpu" and rec.numel:
            t = _to_device(t, rec, dev, blobs[rec.blob], moved)
        elif dev is not None and dev.type != "cpu":
            t = t.to(dev)
        out.append(t)
    return typed.decode(item.state, lambda i: _lookup(out, i))


def _to_device(t: torch.Tensor, rec: TensorRecord, dev: torch.device, blob: torch.Tensor,
               moved: dict) -> torch.Tensor:
    """Place ``t`` on ``dev``; views of one blob stay views of one device buffer."""
    isz = t.element_size()
    if dev.type == "xla" or rec.byte_offset % isz:
        return t.to(dev)  # XLA tensors have no shared storage to alias
    k = (rec.blob, str(dev))
    base = moved.get(k)
    if base is None:
        base = moved[k] = blob.to(dev)
    return torch.empty(0, dtype=t.dtype, device=dev).set_(
        base.untyped_storage(), rec.byte_offset // isz, rec.shape, rec.stride)


def _lookup(out: list[torch.Tensor | None], i: int) -> torch.Tensor | None:
    if not 0 <= i < len(out):
        raise CheckpointCorruptError(f"typed state refers to tensor {i} but only {len(out)} exist")
    return out[i]
