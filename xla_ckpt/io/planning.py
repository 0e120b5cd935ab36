"""Read planning for blobs: chunk-aligned slices and spans over adjacent blobs.

Pure arithmetic over a manifest's blob records and the destination buffers (no I/O):
:func:`plan_spans` packs the chunk-aligned pieces of many blobs into byte-range reads
(in place where the buffers sit like the file, staged where small blobs sit apart),
:func:`slice_ranges` cuts a blob's bytes into slices of about ``slice_size_bytes`` and
:func:`first_bad_chunk` finds the first crc32c chunk that does not match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from xla_ckpt.format.crc import crc32c
from xla_ckpt.format.manifest import BlobRecord, Item
from xla_ckpt.format.plan import tensor_bytes
from xla_ckpt.storage import StorageConfig

COALESCE_BLOB_BYTES = 1024 * 1024
"""Blobs of at most this many bytes whose buffers are not adjacent in memory are read together
(one request for a run of them, through a staging buffer) rather than one request each."""

MAX_GAP_BYTES = 64 * 1024
"""Bytes between two coalesced small blobs in a data file that are read and dropped rather than
starting another request."""

CACHE_STEP_BYTES = 4 * 1024 * 1024
"""On memory-bound storage an in-place span is read in steps of whole pieces of about this
many bytes (one crc32c chunk by default), each checked right after its read, while it is
still in cache."""


def cache_steps(pieces: Sequence["Piece"]) -> list[list["Piece"]]:
    """``pieces`` (adjacent in the file) cut into runs of at most :data:`CACHE_STEP_BYTES`
    (a larger piece is a run of its own)."""
    steps: list[list[Piece]] = []
    size = 0
    for p in pieces:
        if steps and size + p.length <= CACHE_STEP_BYTES:
            steps[-1].append(p)
            size += p.length
        else:
            steps.append([p])
            size = p.length
    return steps


def slice_ranges(rec: BlobRecord, length: int, config: StorageConfig) -> list[tuple[int, int]]:
    """``(start, length)`` of the chunk-aligned slices of ``length`` bytes of blob ``rec``."""
    if length == 0:
        return []
    if not rec.chunk_crc32c:
        return [(0, length)]
    step = max(rec.chunk_size, config.slice_size_bytes // rec.chunk_size * rec.chunk_size)
    return [(s, min(step, length - s)) for s in range(0, length, step)]


def first_bad_chunk(rec: BlobRecord, start: int, out: memoryview) -> tuple[int, int] | None:
    """None if ``out`` (blob bytes from ``start``) matches the manifest crc32c values."""
    if not rec.chunk_crc32c:
        return None if crc32c(out) == rec.crc32c else (0, rec.length)
    c = rec.chunk_size
    for off in range(0, len(out), c):
        idx = (start + off) // c
        if crc32c(out[off:off + c]) != rec.chunk_crc32c[idx]:
            return (start + off, start + off + len(out[off:off + c]))
    return None


@dataclass(frozen=True)
class Piece:
    """A crc32c-checkable piece of one blob: a chunk, or the whole blob when it has no chunks.

    ``file_offset``/``length`` in bytes of the data file; ``dest`` is where the
    piece's bytes go when its span is staged (None when the span reads in place).
    """

    blob_id: int
    file_offset: int
    length: int
    crc32c: int
    dest: memoryview | None = None


@dataclass(frozen=True)
class Span:
    """One byte-range read: ``length`` bytes of ``file`` from ``offset``, covering ``pieces``.

    ``out`` is the destination of all of it (blob buffers adjacent in one
    storage as in the file), or None: read into a staging buffer, then each
    piece copied to its ``dest`` once every piece passed its crc32c.
    """

    file: str
    offset: int
    length: int
    pieces: tuple[Piece, ...]
    out: memoryview | None
    addr: int = 0  # address of ``out``'s first byte (0 when staged)


@dataclass(slots=True)  # not frozen: a frozen __init__ costs 2x, and one is made per chunk
class _Unit:
    blob_id: int
    file: str
    file_offset: int
    length: int
    crc32c: int
    addr: int           # address of the piece's first destination byte
    storage: int        # address of the destination's storage
    buf: torch.Tensor   # the blob's buffer; the piece starts ``at`` bytes in
    at: int
    small: bool         # its blob is at most COALESCE_BLOB_BYTES


def plan_spans(item: Item, buffers: Mapping[int, torch.Tensor], slice_size_bytes: int,
               stage: frozenset[int] = frozenset()) -> list[Span]:
    """Plan the reads that fill ``buffers`` (blob index -> contiguous uint8 CPU tensor).

    Pieces (chunks) are taken in file order and packed into spans of at most
    ``slice_size_bytes`` (a piece larger than that is a span of its own):

    * in place, when the next piece follows in the file with no gap and its
      buffer follows in the same storage at the same distance (the chunks of
      one blob; adjacent blobs of an :func:`~xla_ckpt.io.buffers.host_arenas` arena);
    * staged, when the pieces are of small blobs (at most
      :data:`COALESCE_BLOB_BYTES`) at most :data:`MAX_GAP_BYTES` apart in the file
      but not adjacent in memory (separate tensors): one request for all of them.

    Small blobs in ``stage`` are always staged (a span of them never reads in
    place): their bytes reach the buffer only after they passed the check.
    """
    units: list[_Unit] = []
    for i, buf in buffers.items():
        rec = item.blobs[i]
        if rec.length == 0:
            continue
        addr = buf.data_ptr()
        st = addr - int(buf.storage_offset()) * buf.element_size()  # its storage's first byte
        small = rec.length <= COALESCE_BLOB_BYTES
        if not rec.chunk_crc32c:
            units.append(_Unit(i, rec.file, rec.offset, rec.length, rec.crc32c, addr, st, buf, 0,
                               small))
            continue
        c = rec.chunk_size
        units.extend(_Unit(i, rec.file, rec.offset + at, min(c, rec.length - at), crc,
                           addr + at, st, buf, at, small)
                     for crc, at in zip(rec.chunk_crc32c, range(0, rec.length, c), strict=False))
    units.sort(key=lambda u: (u.file, u.file_offset))
    spans: list[Span] = []
    group: list[_Unit] = []
    staged = False
    # Whether every unit of ``group`` is of a small blob, kept as the group grows: a test
    # over the whole group per unit made planning quadratic in the number of blobs.
    all_small = False
    views: dict[int, memoryview] = {}  # storage address -> its bytes (one view per arena)

    def dest(u: _Unit) -> memoryview:
        view = views.get(u.storage)
        if view is None:
            st = u.buf.untyped_storage()
            whole = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))
            view = views[u.storage] = tensor_bytes(whole)
        at = u.addr - u.storage
        return view[at:at + u.length]

    def close() -> None:
        g0, gl = group[0], group[-1]
        length = gl.file_offset + gl.length - g0.file_offset
        if staged or all(u.small and u.blob_id in stage for u in group):
            spans.append(Span(g0.file, g0.file_offset, length, tuple(
                Piece(u.blob_id, u.file_offset, u.length, u.crc32c, dest(u)) for u in group),
                None))
            return
        st = g0.buf.untyped_storage()
        out = torch.empty(0, dtype=torch.uint8).set_(st, g0.addr - g0.storage, (length,), (1,))
        spans.append(Span(g0.file, g0.file_offset, length, tuple(
            Piece(u.blob_id, u.file_offset, u.length, u.crc32c) for u in group),
            tensor_bytes(out), g0.addr))

    for u in units:
        if group:
            g0, gl = group[0], group[-1]
            gap = u.file_offset - (gl.file_offset + gl.length)
            fits = (u.file == g0.file and gap >= 0
                    and u.file_offset + u.length - g0.file_offset <= slice_size_bytes)
            if fits and not staged and gap == 0 and u.storage == g0.storage \
                    and u.addr - g0.addr == u.file_offset - g0.file_offset:
                group.append(u)
                all_small = all_small and u.small
                continue
            if fits and gap <= MAX_GAP_BYTES and u.small and all_small:
                group.append(u)
                staged = True
                continue
            close()
        group, staged, all_small = [u], False, u.small
    if group:
        close()
    return spans

