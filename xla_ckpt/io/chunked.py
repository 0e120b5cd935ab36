"""Read boxes of chunked (global) tensors by byte range, crc32c-checked (manifest version 2).

A restore onto any mesh asks, for each tensor it fills, for one or more *boxes* of the
global index space (:class:`BoxRequest`: the global tensor, the box, the CPU tensor to
fill).  :func:`plan_box_reads` finds the saved chunks each box overlaps
(:meth:`~xla_ckpt.format.chunks.GlobalTensor.overlapping`) and, for each overlap, the
smallest contiguous run of the saved chunk's elements that holds it
(:func:`~xla_ckpt.format.chunks.row_span`: whole rows when the trailing dims are whole,
down to one partial row), widened to the blob's crc32c chunk boundaries (the granularity
the manifest checks at) -- so a rank restoring rows 3-5 of a saved 0-9 chunk fetches
those rows' bytes, not the chunk.  Ranges of one blob that meet or overlap are merged, so
every byte is fetched once per call.

:func:`read_boxes` runs the plan on the reader's shared I/O pool
(``storage.config.max_workers`` at a time), every crc32c chunk checked by the thread
that read it (a mismatch re-reads that chunk alone, up to ``reader.crc_retries`` times,
then :class:`~xla_ckpt.errors.IntegrityError` names the global tensor and the chunk):

* bytes that are exactly a contiguous run of one contiguous ``out`` in whole crc32c
  chunks (a blob's final, shorter chunk up to the blob's end counts as whole, and so does
  a blob no longer than one chunk, checked by its whole-blob crc32c) -- saved rows
  restored onto rows of a local shard, a tensor assembled from row chunks: the bulk of a
  restore -- are read straight into ``out`` in slices of about
  ``storage.config.slice_size_bytes``, then checked there (from local disk each crc32c
  chunk is read and checked at once, while it is still in the CPU cache), as
  :meth:`~xla_ckpt.io.blob_reader.BlobReader.read_into` reads live buffers: no staging,
  no copy, so host memory stays near the shards themselves.  A mismatch that the re-reads
  do not clear raises :class:`~xla_ckpt.errors.PartiallyOverwrittenError` naming the
  key (that ``out`` holds bytes that failed the check) unless the request is ``fresh``;
* everything else (column blocks, the partial crc32c chunks at the ends of a run, ranges
  several requests share) is read into reusable staging buffers of at most
  :data:`STAGING_SLICE_BYTES` each, checked, and only then copied into the ``out``
  tensors, which never hold an unchecked byte of it.  Staging memory stays near
  ``max_workers * STAGING_SLICE_BYTES``.
Ranges that follow each other in one data file with no byte between them (the chunks of
one rank's item that a restore onto the same layout reads) are fetched with one request
per slice; nothing outside the planned ranges is ever fetched, so the bytes fetched are
exactly the planned ranges' (a gap would be other ranks' chunks, which the bytes-per-rank
budget of a sharded restore cannot afford).

What checks the bytes is the reader's source (:class:`~xla_ckpt.io.blob_reader.BlobReader`'s
``check_grain``, ``range_checks``, ``checksum`` and ``range_integrity_error``): xla_ckpt's
crc32c records as above; a source without them still reads by byte range with the checks its
format offers (a DCP checkpoint, :mod:`xla_ckpt.kinds.dcp_boxes`: ranges not widened, a
whole zip member checked against the zip's CRC-32).

No ranks here: every rank (or the rank that reads for others) calls this for its own
requests.  Version-1 checkpoints have no global tensors; readers of those use
:meth:`~xla_ckpt.io.reader.CheckpointReader.load`.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from xla_ckpt.errors import CheckpointCorruptError, IntegrityError
from xla_ckpt.format import typed
from xla_ckpt.format.chunks import Box, ChunkRecord, GlobalTensor, intersect, row_span
from xla_ckpt.format.dtypes import dtype_from_name
from xla_ckpt.format.gc_pause import gc_paused
from xla_ckpt.format.manifest import BlobRecord, Manifest, TensorRecord
from xla_ckpt.format.plan import tensor_bytes
from xla_ckpt.io.blob_reader import BlobReader, ReadStats
from xla_ckpt.io.buffers import HUGE_PAGE_BYTES, host_buffer
from xla_ckpt.io.planning import COALESCE_BLOB_BYTES
from xla_ckpt.io.writer import WrittenItem
from xla_ckpt.storage.local import LocalStorage

logger = logging.getLogger(__name__)


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (its ``itemsize``: no tensor is made per call)."""
    return dtype.itemsize


@dataclass
class BoxRequest:
    """Fill ``out`` with ``global_tensors[tensor]`` restricted to ``box``.

    Attributes:
        tensor: index into :attr:`Manifest.global_tensors`.
        box: offsets/sizes in the global tensor's index space (elements).
        out: a CPU tensor of shape ``box.sizes`` and the global tensor's dtype (any
            strides: a view into a larger local shard is fine).
        fresh: ``out`` is a buffer nobody uses if the read fails (a tensor being
            assembled), so a crc32c failure in bytes read straight into it is a plain
            :class:`~xla_ckpt.errors.IntegrityError`, not a
            :class:`~xla_ckpt.errors.PartiallyOverwrittenError`.
        file: ``(fd, offset)``: write the checked bytes into the open file ``fd`` at byte
            ``offset`` (where ``out``'s first byte would be) with ``os.pwrite``, not into
            ``out``, which then only gives the shape and dtype (1-D uint8 requests only:
            blobs).  A memfd or tmpfs file the kernel fills on ``write`` gets its pages
            without zeroing them first or a page fault each, which is what writing into a
            fresh mapping of it costs (host shared memory filled by one reader).
    """

    tensor: int
    box: Box
    out: torch.Tensor
    fresh: bool = False
    file: tuple[int, int] | None = None


@dataclass(frozen=True)
class RangeRead:
    """One byte range fetched: bytes ``[start, start + length)`` of blob ``blob`` of ``item``.

    ``start``/``length`` are blob-relative and aligned to the blob's crc32c chunks (the
    whole blob when it has no per-chunk crc32c): what is actually read from storage for it.
    """

    item: str
    blob: int
    start: int
    length: int


@dataclass(frozen=True)
class _Copy:
    """The part ``overlap`` (global coordinates) of request ``request`` that saved ``chunk``
    (tensor record ``rec``) holds; its elements are the chunk's ``[lo, hi)`` (row-major)."""

    request: int
    tensor: GlobalTensor
    chunk: ChunkRecord
    rec: TensorRecord
    overlap: Box
    lo: int
    hi: int


@dataclass
class _Range:
    read: RangeRead
    blob: BlobRecord
    copies: list[_Copy] = field(default_factory=list)


@dataclass(frozen=True)
class _Segment:
    """Part ``[start, start + length)`` (blob-relative) of a range, fetched by one task.

    ``dest``: the bytes of the one ``out`` these bytes are exactly (read in place, then
    checked); None: read into a staging buffer, checked, then copied out.
    """

    range: _Range
    start: int
    length: int
    dest: memoryview | None = None


@dataclass(frozen=True)
class _Task:
    """One request to storage: ``length`` bytes of ``file`` from ``offset`` (file offsets),
    covering ``segments``, which follow each other in the file with no gap."""

    file: str
    offset: int
    length: int
    segments: tuple[_Segment, ...]


def _check_requests(manifest: Manifest, requests: Sequence[BoxRequest]) -> None:
    gts = manifest.global_tensors
    for r in requests:
        if not 0 <= r.tensor < len(gts):
            raise ValueError(f"box request for global tensor {r.tensor}, but the checkpoint has "
                             f"{len(gts)} global tensors")
        gt = gts[r.tensor]
        out, box = r.out, r.box
        dtype = dtype_from_name(gt.dtype, where=gt.key)
        if not isinstance(out, torch.Tensor) or out.device.type != "cpu" \
                or out.dtype != dtype or tuple(out.shape) != tuple(box.sizes) \
                or out.layout != torch.strided:
            got = (f"{out.dtype}{list(out.shape)} on {out.device}"
                   if isinstance(out, torch.Tensor) else type(out).__name__)
            raise ValueError(f"box request for {gt.key}: out must be a strided CPU "
                             f"{gt.dtype} tensor of shape {list(box.sizes)} (the box), got {got}")
        if r.file is not None and (out.dim() != 1 or out.dtype != torch.uint8):
            raise ValueError(f"box request for {gt.key}: a file destination takes a 1-D uint8 "
                             f"box (a blob), got {out.dtype}{list(out.shape)}")
        if len(box.offsets) != len(gt.shape) or len(box.sizes) != len(gt.shape) \
                or any(o < 0 or s < 0 or o + s > n
                       for o, s, n in zip(box.offsets, box.sizes, gt.shape, strict=True)):
            raise CheckpointCorruptError(
                f"{gt.key}: box offsets {list(box.offsets)} sizes {list(box.sizes)} is not "
                f"covered by the saved chunks: the saved tensor has shape {list(gt.shape)}")


Grain = Callable[[BlobRecord], int]
"""Bytes a range of a blob is widened to on both ends so that it can be checked (the
:meth:`~xla_ckpt.io.blob_reader.BlobReader.check_grain` of the reader's source)."""


def crc32c_grain(blob: BlobRecord) -> int:
    """xla_ckpt's blobs: their crc32c chunk, or the whole blob when it has one crc32c."""
    return blob.chunk_size if blob.chunk_crc32c else max(blob.length, 1)


def _plan(manifest: Manifest, boxes: Sequence[tuple[int, Box]],
          grain: Grain = crc32c_grain) -> list[_Range]:
    """The merged ranges that hold ``boxes`` (global tensor index, box; already checked),
    each widened to ``grain`` bytes of its blob."""
    per_blob: dict[tuple[str, int], list[tuple[int, int, _Copy]]] = {}
    # A box that is exactly a saved chunk (a restore onto the layout it was saved from) is
    # found by one dict look-up; the chunks tile the tensor, so it overlaps no other chunk.
    exact: dict[int, dict[tuple[tuple[int, ...], tuple[int, ...]], ChunkRecord]] = {}
    isizes: dict[str, int] = {}
    for ri, (g, box) in enumerate(boxes):
        gt = manifest.global_tensors[g]
        if box.numel == 0:
            continue
        isz = isizes.get(gt.dtype) or isizes.setdefault(
            gt.dtype, itemsize(dtype_from_name(gt.dtype, where=gt.key)))
        by_box = exact.get(g)
        if by_box is None:
            by_box = exact[g] = {(tuple(c.offsets), tuple(c.sizes)): c for c in gt.chunks}
        hit = by_box.get((tuple(box.offsets), tuple(box.sizes)))
        covered = 0
        for chunk, ov in ([(hit, box)] if hit is not None else gt.overlapping(box)):
            it = manifest.item(chunk.item)
            rec = it.tensors[chunk.tensor]
            blob = it.blobs[rec.blob]
            lo, hi = (0, box.numel) if chunk is hit else row_span(chunk.box, ov)
            b0, b1 = rec.byte_offset + lo * isz, rec.byte_offset + hi * isz
            c = grain(blob)
            s0, s1 = b0 // c * c, min(blob.length, -(-b1 // c) * c)
            per_blob.setdefault((chunk.item, rec.blob), []).append(
                (s0, s1, _Copy(ri, gt, chunk, rec, ov, lo, hi)))
            covered += ov.numel
        if covered != box.numel:
            raise CheckpointCorruptError(
                f"{gt.key}: the saved chunks hold {covered} of the {box.numel} elements of box "
                f"offsets {list(box.offsets)} sizes {list(box.sizes)}; the chunk table does "
                "not tile the tensor")
    out: list[_Range] = []
    for (iname, b), spans in per_blob.items():
        blob = manifest.item(iname).blobs[b]
        spans.sort(key=lambda s: s[0])
        cur: _Range | None = None
        end = -1
        for s0, s1, cp in spans:
            if cur is None or s0 >= end:  # touching ranges stay apart: each may go in place
                cur = _Range(RangeRead(iname, b, s0, s1 - s0), blob)
                out.append(cur)
                end = s1
            elif s1 > end:
                end = s1
                cur.read = RangeRead(iname, b, cur.read.start, end - cur.read.start)
            cur.copies.append(cp)
    out.sort(key=lambda r: (r.blob.file, r.blob.offset + r.read.start))
    return out


def plan_box_reads(manifest: Manifest, requests: Sequence[BoxRequest]) -> list[RangeRead]:
    """The byte ranges :func:`read_boxes` fetches for ``requests``.  Pure: no I/O.

    One :class:`RangeRead` per run of a blob's bytes (overlapping ranges of one blob
    merged), in data-file order; their ``length`` summed is exactly what
    :func:`read_boxes` fetches.  For byte accounting (bytes read per rank) and read
    planning across ranks.

    Raises:
        ValueError: a request names no global tensor, or its ``out`` is not a CPU tensor
            of the box's shape and the global dtype.
        CheckpointCorruptError: a box is not covered by the saved chunks (it lies outside
            the saved shape; names the key).
    """
    _check_requests(manifest, requests)
    return [r.read for r in _plan(manifest, [(r.tensor, r.box) for r in requests])]


def plan_whole_reads(manifest: Manifest, tensors: Iterable[int]) -> list[RangeRead]:
    """The byte ranges a read of the whole global tensors ``tensors`` fetches.  Pure."""
    return [r.read for r in _plan(manifest, [(g, Box.whole(manifest.global_tensors[g].shape))
                                             for g in tensors])]


def _split_step(rng: _Range, config_slice: int) -> int | None:
    """Slice length (bytes) a range may be cut at, or None when it must be one read.

    Cuts fall on crc32c chunk boundaries, and only where no element of a chunk record is
    cut in two (every record's elements start at a multiple of its itemsize from a cut).
    """
    blob = rng.blob
    if not blob.chunk_crc32c:
        return None
    c = blob.chunk_size
    step = max(c, config_slice // c * c)
    for cp in rng.copies:
        isz = itemsize(dtype_from_name(cp.rec.dtype))
        if step % isz or cp.rec.byte_offset % isz or rng.read.start % isz:
            return None
    return step


STAGING_SLICE_BYTES = 4 * 1024 * 1024
"""Staged reads (bytes that cannot go straight into an ``out``: column blocks, the partial
crc32c chunks at the ends of a run) are fetched in slices of at most this many bytes (or
one crc32c chunk, if larger), so staging memory stays near ``max_workers`` times this."""


def _is_run(sizes: tuple[int, ...], sub: Box) -> bool:
    """Whether box ``sub`` (local coordinates) of a C-contiguous array of ``sizes`` is one
    contiguous run of its elements: whole in every dim after some dim, one in every dim
    before it."""
    d = len(sizes)
    while d > 0 and sub.offsets[d - 1] == 0 and sub.sizes[d - 1] == sizes[d - 1]:
        d -= 1
    return all(n == 1 for n in sub.sizes[:max(d - 1, 0)])


def _direct_part(rng: _Range, requests: Sequence[BoxRequest], views: dict[int, memoryview],
                 grain: Grain) -> tuple[int, int, memoryview] | None:
    """Blob bytes ``[a, b)`` of ``rng`` that are exactly a contiguous run of its one
    request's ``out`` (whole crc32c chunks), with that run's bytes; None when there are none.

    Then they are read straight into ``out`` (no staging, no copy): a saved chunk restored
    onto rows of a contiguous local shard, a whole tensor assembled from its row chunks.
    """
    blob = rng.blob
    if len(rng.copies) != 1:
        return None
    cp = rng.copies[0]
    req = requests[cp.request]
    out = req.out
    if req.file is not None:  # written with pwrite from a checked staging buffer
        return None
    isz = itemsize(out.dtype)
    # A blob without per-chunk crc32c (one no longer than a crc32c chunk) is one chunk: its
    # whole-blob crc32c checks it, so a copy that is the whole blob goes in place too.
    c = grain(blob)
    if not out.is_contiguous() or cp.rec.byte_offset % isz \
            or (blob.chunk_crc32c and c % isz):
        return None
    chunk, ov, box = cp.chunk.box, cp.overlap, req.box
    in_chunk = Box(tuple(o - x for o, x in zip(ov.offsets, chunk.offsets, strict=True)),
                   ov.sizes)
    in_out = Box(tuple(o - x for o, x in zip(ov.offsets, box.offsets, strict=True)), ov.sizes)
    if not (_is_run(chunk.sizes, in_chunk) and _is_run(box.sizes, in_out)):
        return None
    b0, b1 = cp.rec.byte_offset + cp.lo * isz, cp.rec.byte_offset + cp.hi * isz
    a = -(-b0 // c) * c
    b = b1 if b1 == blob.length else b1 // c * c  # the final chunk may be short: whole too
    if b <= a:
        return None
    first = sum(o * st for o, st in zip(in_out.offsets, _strides(box.sizes), strict=True))
    at = (first + (a - b0) // isz) * isz
    view = views.get(cp.request)
    if view is None:  # one byte view per out, however many ranges land in it
        view = views[cp.request] = tensor_bytes(out)
    return a, b, view[at:at + (b - a)]


def _cut(rng: _Range, start: int, end: int, step: int | None,
         dest: memoryview | None = None) -> list[_Segment]:
    if end <= start:
        return []
    if step is None or end - start <= step:
        return [_Segment(rng, start, end - start, dest)]
    return [_Segment(rng, s, min(step, end - s),
                     None if dest is None else dest[s - start:min(s + step, end) - start])
            for s in range(start, end, step)]


def _small_neighbours(ranges: list[_Range]) -> set[int]:
    """Indices of the ranges (in file order) of at most :data:`COALESCE_BLOB_BYTES` that
    touch another such range in the same data file."""
    out: set[int] = set()
    for k in range(1, len(ranges)):
        a, b = ranges[k - 1], ranges[k]
        if a.blob.file == b.blob.file and max(a.read.length, b.read.length) <= \
                COALESCE_BLOB_BYTES and a.blob.offset + a.read.start + a.read.length == \
                b.blob.offset + b.read.start:
            out.update((k - 1, k))
    return out


def _tasks(ranges: list[_Range], requests: Sequence[BoxRequest],
           slice_size: int, grain: Grain = crc32c_grain, *,
           coalesce_small: bool = False) -> list[_Task]:
    staged: list[_Segment] = []
    tasks: list[_Task] = []
    views: dict[int, memoryview] = {}
    beside = _small_neighbours(ranges) if coalesce_small else set()
    for k, rng in enumerate(ranges):
        r = rng.read
        end = r.start + r.length
        step = _split_step(rng, min(slice_size, STAGING_SLICE_BYTES))
        # object storage: a small range beside another in its file is staged, so they share
        # one request (many small tensors: one ranged GET, one first-byte latency, for a run
        # of them, not one each); a local file's pread costs no latency, so in place there
        direct = None if k in beside else _direct_part(rng, requests, views, grain)
        if direct is None:
            staged.extend(_cut(rng, r.start, end, step))
            continue
        a, b, dest = direct
        staged.extend(_cut(rng, r.start, a, step))
        for seg in _cut(rng, a, b, _split_step(rng, slice_size), dest):
            tasks.append(_Task(rng.blob.file, rng.blob.offset + seg.start, seg.length, (seg,)))
        staged.extend(_cut(rng, b, end, step))
    group: list[_Segment] = []

    def close() -> None:
        first, last = group[0], group[-1]
        off = first.range.blob.offset + first.start
        end = last.range.blob.offset + last.start + last.length
        tasks.append(_Task(first.range.blob.file, off, end - off, tuple(group)))

    cap = max(STAGING_SLICE_BYTES, max((s.length for s in staged), default=0))
    for seg in staged:
        if group:
            g0, gl = group[0], group[-1]
            start = seg.range.blob.offset + seg.start
            gap = start - (gl.range.blob.offset + gl.start + gl.length)
            if (seg.range.blob.file == g0.range.blob.file and gap == 0
                    and start + seg.length - (g0.range.blob.offset + g0.start)
                    <= min(slice_size, cap)):
                group.append(seg)
                continue
            close()
        group = [seg]
    if group:
        close()
    return tasks


def _flat_boxes(sizes: tuple[int, ...], a: int, b: int) -> list[Box]:
    """Boxes (local coordinates of a C-contiguous array of ``sizes``) that exactly cover its
    elements ``[a, b)`` in row-major order: at most ``2 * ndim - 1`` of them."""
    ndim = len(sizes)
    if ndim == 0:
        return [Box((), ())] if a < b else []
    strides = [1] * ndim
    for d in range(ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    out: list[Box] = []

    def rec(d: int, prefix: tuple[int, ...], a: int, b: int) -> None:
        if a >= b:
            return
        st = strides[d]
        lead = (1,) * len(prefix)
        m0, m1 = -(-a // st), b // st
        if m0 > m1:  # a and b inside one row of dim d
            i = a // st
            rec(d + 1, prefix + (i,), a - i * st, b - i * st)
            return
        if a < m0 * st:
            rec(d + 1, prefix + (m0 - 1,), a - (m0 - 1) * st, st)
        if m1 > m0:
            out.append(Box(prefix + (m0,) + (0,) * (ndim - d - 1),
                           lead + (m1 - m0,) + tuple(sizes[d + 1:])))
        if b > m1 * st:
            rec(d + 1, prefix + (m1,), 0, b - m1 * st)

    rec(0, (), a, b)
    return out


def _typed(buf: torch.Tensor, at: int, count: int, dtype: torch.dtype, isz: int) -> torch.Tensor:
    """``count`` elements of ``dtype`` starting ``at`` bytes into uint8 ``buf`` (a view when
    aligned, else a copy)."""
    raw = buf[at:at + count * isz]
    if at % isz == 0 and raw.storage_offset() % isz == 0:
        return raw.view(dtype)
    return raw.clone().view(dtype)


def _copy_out(requests: Sequence[BoxRequest], seg: _Segment, buf: torch.Tensor) -> None:
    """Copy the elements segment ``seg`` (staged in ``buf``, checked) holds into the outs."""
    for cp in seg.range.copies:
        rec = cp.rec
        dtype = dtype_from_name(rec.dtype)
        isz = itemsize(dtype)
        # Elements of the chunk record whose bytes lie wholly inside this segment.
        first = max(cp.lo, -(-(seg.start - rec.byte_offset) // isz))
        last = min(cp.hi, (seg.start + seg.length - rec.byte_offset) // isz)
        if first >= last:
            continue
        chunk = cp.chunk.box
        local = Box(tuple(o - c for o, c in zip(cp.overlap.offsets, chunk.offsets, strict=True)),
                    cp.overlap.sizes)
        req = requests[cp.request]
        for sub in _flat_boxes(chunk.sizes, first, last):
            part = intersect(sub, local)
            if part is None:
                continue
            # Flat element range of ``sub`` in the chunk, then ``part`` inside it.
            fa = sum(o * st for o, st in zip(sub.offsets, _strides(chunk.sizes), strict=True))
            src = _typed(buf, rec.byte_offset + fa * isz - seg.start, sub.numel, dtype, isz)
            src = src.view(sub.sizes)[part.slices(within=sub)]
            glob = Box(tuple(o + c for o, c in zip(part.offsets, chunk.offsets, strict=True)),
                       part.sizes)
            if req.file is not None:  # 1-D uint8: one contiguous run of the file
                fd, base = req.file
                _pwrite_all(fd, src, base + glob.offsets[0] - req.box.offsets[0])
                continue
            req.out[glob.slices(within=req.box)].copy_(src)


def _pwrite_all(fd: int, src: torch.Tensor, offset: int) -> None:
    """Write contiguous uint8 ``src`` into ``fd`` at byte ``offset`` (short writes resumed).

    Raises:
        OSError: the write failed (a full tmpfs or memfd: ENOSPC / ENOMEM).
    """
    view = tensor_bytes(src.contiguous())
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    out = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        out[d] = out[d + 1] * sizes[d + 1]
    return tuple(out)


class _Staging:
    """Reusable uint8 staging buffers: at most one per task in flight (the pool's width)."""

    def __init__(self) -> None:
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()

    def take(self, n: int) -> torch.Tensor:
        try:
            buf = self._free.get_nowait()
        except queue.Empty:
            return torch.empty(n, dtype=torch.uint8)
        return buf if buf.numel() >= n else torch.empty(n, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        self._free.put(buf)


def _run_task(reader: BlobReader, requests: Sequence[BoxRequest], task: _Task,
              staging: _Staging) -> None:
    info = reader._infos.get(task.file)
    generation = info.generation if info else None
    if task.segments[0].dest is not None:
        _run_in_place(reader, requests, task.segments[0], generation)
        return
    whole = staging.take(task.length)
    try:
        buf = whole[:task.length]
        view = tensor_bytes(buf)
        reader._fetch(task.file, task.offset, view, generation)
        for seg in task.segments:
            blob = seg.range.blob
            base = blob.offset + seg.start - task.offset  # segment start inside buf
            for start, n, want in reader.range_checks(blob, seg.start, seg.length):
                at = base + start - seg.start
                piece = view[at:at + n]
                got = reader.checksum(piece)
                attempt = 0
                while got != want:
                    if reader.fall_back(task.file, blob.offset + start, n,
                                        _tensors_of(seg, start, n)):
                        reader._fetch(task.file, blob.offset + start, piece, generation)
                        got = reader.checksum(piece)
                        continue
                    if attempt >= reader.crc_retries:
                        raise _integrity_error(reader, requests, seg, start, n, got, want)
                    attempt += 1
                    reader.stats.crc_retries += 1
                    logger.warning("crc32c mismatch in %s bytes [%d, %d) (attempt %d of %d); "
                                   "re-reading", reader.storage.url(blob.file),
                                   blob.offset + start, blob.offset + start + n, attempt,
                                   reader.crc_retries + 1)
                    reader._fetch(task.file, blob.offset + start, piece, generation)
                    got = reader.checksum(piece)
            _copy_out(requests, seg, buf[base:base + seg.length])
    finally:
        staging.give(whole)


def _run_in_place(reader: BlobReader, requests: Sequence[BoxRequest], seg: _Segment,
                  generation: int | None) -> None:
    """Fetch a segment straight into its ``out`` bytes, then check each crc32c chunk there."""
    blob = seg.range.blob
    view = seg.dest
    assert view is not None  # in-place segments carry their destination
    # From local disk a request costs no round trip: each crc32c chunk is read, then checked
    # while its bytes are still in the CPU cache (one pass over memory, not two).  Remote
    # storage fetches the segment in one request, then checks each chunk.
    # Bytes the source records no check for (a part of a DCP member) are read as they are.
    checks = reader.range_checks(blob, seg.start, seg.length)
    per_piece = isinstance(reader.storage, LocalStorage) and bool(checks)
    if not per_piece:
        reader._fetch(blob.file, blob.offset + seg.start, view, generation)
    for start, n, want in checks:
        piece = view[start - seg.start:start - seg.start + n]
        if per_piece:
            reader._fetch(blob.file, blob.offset + start, piece, generation)
        attempt = 0
        while (got := reader.checksum(piece)) != want:
            if reader.fall_back(blob.file, blob.offset + start, n, _tensors_of(seg, start, n)):
                reader._fetch(blob.file, blob.offset + start, piece, generation)
                continue
            if attempt >= reader.crc_retries:
                raise _integrity_error(reader, requests, seg, start, n, got, want,
                                       in_place=True)
            attempt += 1
            reader.stats.crc_retries += 1
            logger.warning("crc32c mismatch in %s bytes [%d, %d) (attempt %d of %d); "
                           "re-reading", reader.storage.url(blob.file), blob.offset + start,
                           blob.offset + start + n, attempt, reader.crc_retries + 1)
            reader._fetch(blob.file, blob.offset + start, piece, generation)


def _hit(seg: _Segment, start: int, n: int) -> list[_Copy]:
    """The copies of ``seg`` that hold blob bytes ``[start, start + n)`` (all when none)."""
    return [cp for cp in seg.range.copies
            if cp.rec.byte_offset < start + n
            and start < cp.rec.byte_offset + cp.rec.numel * itemsize(dtype_from_name(
                cp.rec.dtype))] or seg.range.copies


def _tensors_of(seg: _Segment, start: int, n: int) -> list[str]:
    return list(dict.fromkeys(cp.tensor.key for cp in _hit(seg, start, n)))


def _integrity_error(reader: BlobReader, requests: Sequence[BoxRequest], seg: _Segment,
                     start: int, n: int, got: int, want: int, *,
                     in_place: bool = False) -> IntegrityError:
    """The reader's error for blob bytes ``[start, start + n)`` of ``seg`` failing their check
    after the re-reads (:meth:`~xla_ckpt.io.blob_reader.BlobReader.range_integrity_error`)."""
    hit = _hit(seg, start, n)
    return reader.range_integrity_error(
        seg.range.read.item, seg.range.blob, start, n, got, want,
        chunks=tuple(dict.fromkeys(cp.rec.key for cp in hit)),
        tensors=tuple(dict.fromkeys(cp.tensor.key for cp in hit)),
        live=in_place and not all(requests[cp.request].fresh for cp in hit))


@gc_paused()  # many small objects, no cycles (CASES C26)
def read_boxes(reader: BlobReader, requests: Sequence[BoxRequest]) -> int:
    """Fill every request's ``out`` from the checkpoint; returns the bytes fetched.

    Only the byte ranges :func:`plan_box_reads` gives are read (row sub-ranges of saved
    chunks, crc32c-chunk aligned), in parallel on the reader's I/O pool: contiguous runs
    of an ``out`` straight into it, then checked; the rest through staging buffers, checked
    before it is copied (module docstring).  ``reader.stats`` then says what this call did
    (``bytes_read`` = bytes fetched, ``requests``, ``crc_retries``, ``seconds``).
    On an error some ``out`` tensors may already hold (checked) values.  Any rank may
    call it, for any boxes; nothing here communicates.

    Raises:
        ValueError: a malformed request (see :func:`plan_box_reads`).
        CheckpointCorruptError: a box is not covered by saved chunks (names the key); a
            data file has the wrong size.
        DataFileMissingError: a data file is not there for this process.
        IntegrityError: crc32c mismatch after ``reader.crc_retries`` re-reads (names the
            data file, the byte range, the chunk and the global tensor key).
        PartiallyOverwrittenError: the same, in bytes read straight into an ``out`` of a
            request that is not ``fresh`` (``keys`` names the global tensors).
    """
    t0 = time.perf_counter()
    _check_requests(reader.manifest, requests)
    ranges = _plan(reader.manifest, [(r.tensor, r.box) for r in requests], reader.check_grain)
    reader.stats = ReadStats()
    reader.check_files({r.blob.file for r in ranges})
    tasks = _tasks(ranges, requests, reader.storage.config.slice_size_bytes, reader.check_grain,
                   coalesce_small=not isinstance(reader.storage, LocalStorage))
    tasks.sort(key=lambda t: -t.length)  # longest first: the short ones fill the last gaps
    staging = _Staging()
    reader._run([(reader, requests, t, staging) for t in tasks], fn=_run_task)
    fetched = sum(t.length for t in tasks)
    reader.stats.bytes_read = fetched
    reader.stats.seconds = time.perf_counter() - t0
    logger.debug("read %d boxes of %s: %d bytes in %d requests, %.3f s", len(requests),
                 reader.storage.uri, fetched, reader.stats.requests, reader.stats.seconds)
    return fetched


def fresh_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor, on huge pages when large
    (:func:`~xla_ckpt.io.buffers.host_buffer`): what a whole-tensor request fills when no
    ``out`` is given."""
    n = math.prod(shape) * dtype.itemsize
    if n < HUGE_PAGE_BYTES:
        return torch.empty(tuple(shape), dtype=dtype)
    return host_buffer(n).view(dtype).view(tuple(shape))


def whole_tensor_request(manifest: Manifest, g: int, out: torch.Tensor | None = None
                         ) -> BoxRequest:
    """A request for all of global tensor ``g`` (into ``out``, or a :func:`fresh_tensor`)."""
    gt = manifest.global_tensors[g]
    if out is None:
        out = fresh_tensor(gt.shape, dtype_from_name(gt.dtype, where=gt.key))
        return BoxRequest(g, Box.whole(gt.shape), out, fresh=True)
    return BoxRequest(g, Box.whole(gt.shape), out)


def nbytes_of(gt: GlobalTensor) -> int:
    """Bytes of a whole global tensor."""
    return math.prod(gt.shape) * itemsize(dtype_from_name(gt.dtype, where=gt.key))


FLAT_SHARD_PREFIX = "shard/"
"""Items ``shard/<rank>`` hold flat ZeRO partitions (:mod:`xla_ckpt.restore.sharding`)."""


def flat_shard_tables(parts: Sequence[WrittenItem], *, prefix: str = FLAT_SHARD_PREFIX,
                      tensors_key: str = "tensors", bounds_key: str = "bounds",
                      numel_key: str = "numel") -> list[GlobalTensor]:
    """The flat ZeRO partitions of ``parts`` described as 1-D global tensors (chunk tables).

    For the coordinator of a save (rank 0), from every rank's :class:`WrittenItem`: each
    item named ``<prefix><rank>`` whose typed state is ``{tensors_key: {key: tensor},
    bounds_key: {key: [lo, hi]}, numel_key: {key: numel}}`` (what
    :func:`xla_ckpt.restore.sharding.shard_state` writes) contributes, per key, the chunk
    ``offsets (lo,)``, ``sizes (hi - lo,)`` pointing at that tensor's record; empty ranges
    are not chunks.  The result goes to :func:`xla_ckpt.io.writer.commit`'s
    ``global_tensors`` (appended after any others); the global key is
    ``"<prefix><key>"`` (``shard/exp_avg``), its placement ``"flat 1-D over N ranks"``.
    A reader then gets any element range of a flat tensor with one :class:`BoxRequest`
    (``Box((lo,), (hi - lo,))``), by byte range, as for any sharded tensor.

    Raises:
        ValueError: a shard item is malformed, or ranks disagree on a key's numel or
            dtype (names the item and key); the commit must not go ahead.
    """
    numels: dict[str, int] = {}
    dtypes: dict[str, str] = {}
    chunks: dict[str, list[ChunkRecord]] = {}
    ranks = 0
    for part in parts:
        if not part.name.startswith(prefix) or part.item.chunked:
            continue
        ranks += 1
        doc = typed.decode(part.item.state, lambda i: i)
        tens = doc.get(tensors_key) if isinstance(doc, dict) else None
        bounds = doc.get(bounds_key) if isinstance(doc, dict) else None
        nums = doc.get(numel_key) if isinstance(doc, dict) else None
        if not (isinstance(tens, dict) and isinstance(bounds, dict) and isinstance(nums, dict)):
            raise ValueError(f"item {part.name!r} is not a flat shard item (needs "
                             f"{tensors_key}, {bounds_key}, {numel_key})")
        for key, k in tens.items():
            lohi, numel = bounds.get(key), nums.get(key)
            if not (isinstance(k, int) and 0 <= k < len(part.item.tensors)
                    and isinstance(lohi, (list, tuple)) and len(lohi) == 2
                    and all(isinstance(x, int) for x in lohi) and isinstance(numel, int)
                    and 0 <= lohi[0] <= lohi[1] <= numel):
                raise ValueError(f"item {part.name!r}: bad flat shard record for {key!r}")
            rec = part.item.tensors[k]
            if numels.setdefault(key, numel) != numel or dtypes.setdefault(key, rec.dtype) \
                    != rec.dtype:
                raise ValueError(f"flat sharded tensor {key!r}: item {part.name!r} says numel "
                                 f"{numel} / {rec.dtype}, another rank {numels[key]} / "
                                 f"{dtypes[key]}")
            lo, hi = lohi
            if hi > lo:
                chunks.setdefault(key, []).append(ChunkRecord(part.name, k, (lo,), (hi - lo,)))
    return [GlobalTensor(f"{prefix}{key}", dtypes[key], (numels[key],),
                         tuple(sorted(chunks.get(key, []), key=lambda c: c.offsets)),
                         placement=f"flat 1-D over {ranks} ranks")
            for key in sorted(numels)]
