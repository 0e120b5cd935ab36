"""Chunked tensors: a *global* tensor stored as boxes of its index space (manifest version 2).

The model is the one DCP's ``ChunkStorageMetadata`` uses, without DCP's pickle: a tensor of
global ``shape`` and ``dtype`` is cut into chunks, each an axis-aligned box (``offsets``,
``sizes`` in the global index space) whose elements are stored C-contiguously as one tensor
record of some item (``item``, ``tensor`` = index into that item's tensor records), so its
bytes sit in a blob with a byte offset and crc32c like any other tensor.

* a replicated tensor is one chunk covering the whole tensor;
* a DTensor / FSDP2 / TP local shard is the chunk ``compute_local_shape_and_global_offset``
  gives (offsets from DTensor itself, never from our own partition arithmetic);
* a torch_xla ``XLAShardedTensor`` device shard is the chunk of its ``indices``;
* empty shards (a zero size) are not stored: a tensor with no elements has no chunks.

Restoring onto any mesh is box overlap (:func:`intersect`) between saved chunks and the
target's local boxes; :func:`row_span` gives the contiguous element range of a saved chunk
that covers an overlap, so a reader fetches that sub-range instead of the whole chunk.

Rank ``r`` writes its chunks as the tensor records of item :func:`chunk_item` ``(r)``
(``chunks/00003``), keyed :func:`chunk_key` (``state['w'][0:3,0:6]``).  A manifest parse
refuses a table whose chunks do not tile their tensor: :func:`first_overlap` finds two
chunks sharing an element in O(n log n) for the layouts sharding produces, and a tensor
may have at most :data:`MAX_CHUNKS_PER_TENSOR` chunks.

Pure: no I/O, no torch.distributed.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

CHUNK_ITEM_PREFIX = "chunks/"
"""Items named ``chunks/<rank>`` hold the chunk tensors rank ``<rank>`` wrote."""

MAX_CHUNKS_PER_TENSOR = 1 << 20
"""A global tensor with more chunks than this (1,048,576) is refused when a manifest is parsed:
real layouts have one chunk per shard (a few per rank or device), so more is a hostile or broken
table, and refusing it before looking at the chunks bounds the work and memory of the check."""


def chunk_item(rank: int) -> str:
    """Item name for the chunk tensors ``rank`` writes (``chunks/00003``)."""
    return f"{CHUNK_ITEM_PREFIX}{rank:05d}"


def chunk_key(key: str, box: "Box") -> str:
    """The tensor-record key of a chunk: ``<global key>[o0:e0,o1:e1]`` (readable in inspect)."""
    return f"{key}[{','.join(f'{o}:{e}' for o, e in zip(box.offsets, box.ends, strict=True))}]"


def contiguous_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """Row-major (C-contiguous) element strides of a tensor of ``sizes``."""
    out = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        out[d] = out[d + 1] * max(int(sizes[d + 1]), 1)
    return tuple(out)


@dataclass(frozen=True)
class Box:
    """An axis-aligned box ``[offsets[d], offsets[d] + sizes[d])`` of a global index space."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes, strict=True))

    @classmethod
    def whole(cls, shape: Sequence[int]) -> "Box":
        """The box covering a whole tensor of ``shape``."""
        return cls(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    def slices(self, within: "Box | None" = None) -> tuple[slice, ...]:
        """Index of this box inside a tensor holding ``within`` (default: the global tensor)."""
        base = within.offsets if within is not None else tuple(0 for _ in self.offsets)
        return tuple(slice(o - b, o - b + s)
                     for o, s, b in zip(self.offsets, self.sizes, base, strict=True))

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "sizes": list(self.sizes)}


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of the same rank, or None when it holds no element."""
    if a.ndim != b.ndim:
        raise ValueError(f"boxes of different rank: {a} and {b}")
    lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets, strict=True))
    hi = tuple(min(x, y) for x, y in zip(a.ends, b.ends, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)) and a.ndim > 0:
        return None
    return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))


def row_span(chunk: Box, overlap: Box) -> tuple[int, int]:
    """Element range ``[start, stop)`` of a C-contiguous ``chunk`` that holds ``overlap``.

    The smallest contiguous run of the chunk's elements (in its own row-major order)
    containing every element of ``overlap``: rows ``overlap`` spans along dim 0 when the
    trailing dims are whole, down to a single partial row.  A reader fetches these
    elements' bytes (widened to crc32c chunk boundaries) instead of the whole chunk.
    """
    if chunk.ndim == 0:
        return 0, 1
    strides = [1] * chunk.ndim
    for d in range(chunk.ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * chunk.sizes[d + 1]
    rel_lo = [o - c for o, c in zip(overlap.offsets, chunk.offsets, strict=True)]
    rel_hi = [lo + s - 1 for lo, s in zip(rel_lo, overlap.sizes, strict=True)]
    start = sum(i * st for i, st in zip(rel_lo, strides, strict=True))
    stop = sum(i * st for i, st in zip(rel_hi, strides, strict=True)) + 1
    return start, stop


@dataclass(frozen=True)
class ChunkRecord:
    """One stored chunk: box ``offsets``/``sizes`` of the global tensor, kept as tensor
    record ``tensor`` of item ``item`` (C-contiguous, shape ``sizes``, the global dtype)."""

    item: str
    tensor: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def box(self) -> Box:
        return Box(self.offsets, self.sizes)

    def to_json(self) -> dict:
        return {"item": self.item, "tensor": self.tensor, "offsets": list(self.offsets),
                "sizes": list(self.sizes)}


@dataclass(frozen=True)
class GlobalTensor:
    """A global tensor of ``shape``/``dtype`` (dtype name as in tensor records) made of
    ``chunks`` that tile it exactly (checked when a manifest is parsed).

    ``key`` is the tree path the tensor had at save (``state['model']['w']``), for errors and
    ``xla-ckpt inspect``; ``placement`` a human-readable note of how it was sharded at save
    (``"Shard(0) on mesh (4,)"``, ``"replicated"``), informational only.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkRecord, ...]
    placement: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"key": self.key, "dtype": self.dtype, "shape": list(self.shape),
                             "chunks": [c.to_json() for c in self.chunks]}
        if self.placement:
            d["placement"] = self.placement
        return d

    def overlapping(self, box: Box) -> list[tuple[ChunkRecord, Box]]:
        """Saved chunks overlapping ``box``, each with the overlap, in chunk order.

        Only the chunks whose dim-0 range can reach ``box`` are compared (a sorted index
        built on first use): a rank's box meets a few of a tensor's many chunks.
        """
        if not self.shape or len(self.chunks) < 8:
            candidates: Sequence[int] = range(len(self.chunks))
        else:
            starts, order, reach = self._by_start
            lo = bisect.bisect_left(starts, box.offsets[0] - reach + 1)
            hi = bisect.bisect_left(starts, box.offsets[0] + box.sizes[0])
            candidates = sorted(order[lo:hi])
        out = []
        for i in candidates:
            c = self.chunks[i]
            ov = intersect(c.box, box)
            if ov is not None:
                out.append((c, ov))
        return out

    @functools.cached_property
    def _by_start(self) -> tuple[list[int], list[int], int]:
        """(dim-0 offsets sorted, the chunk indices in that order, the largest dim-0 size)."""
        order = sorted(range(len(self.chunks)), key=lambda i: self.chunks[i].offsets[0])
        return ([self.chunks[i].offsets[0] for i in order], order,
                max((c.sizes[0] for c in self.chunks), default=0))


class LayoutTooIrregularError(ValueError):
    """:func:`first_overlap` gave up: the boxes need more than its work budget to compare."""


def first_overlap(boxes: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                  budget: int | None = None) -> tuple[int, int] | None:
    """Two boxes that share an element, as indices into ``boxes``, or None when all are disjoint.

    ``boxes`` are ``(offsets, ends)`` pairs of one rank, each non-empty (every size > 0).
    Dimensions in which every box spans the same range are left out first (they cannot
    separate two boxes); one dimension left is a sort, two a sweep over the first with the
    intervals of the second kept sorted (O(n log n) for any layout), more a sweep over the
    first whose cross-sections are checked the same way (O(n log n) for grid layouts).

    Raises:
        LayoutTooIrregularError: more than ``budget`` box visits would be needed (only for
            three or more varying dimensions; default ``64 * len(boxes) + 2**20``).
    """
    n = len(boxes)
    if n < 2:
        return None
    ndim = len(boxes[0][0])
    dims = [d for d in range(ndim)
            if any(b[0][d] != boxes[0][0][d] or b[1][d] != boxes[0][1][d] for b in boxes)]
    left = [budget if budget is not None else 64 * n + (1 << 20)]
    return _overlap(list(range(n)), boxes, dims, left)


def _overlap(ids: list[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]],
             dims: list[int], left: list[int]) -> tuple[int, int] | None:
    left[0] -= len(ids)
    if left[0] < 0:
        raise LayoutTooIrregularError(f"more than the work budget for {len(boxes)} boxes")
    if len(ids) < 2:
        return None
    if not dims:
        return ids[0], ids[1]
    d0 = dims[0]
    if len(dims) == 1:
        order = sorted(ids, key=lambda i: boxes[i][0][d0])
        for a, b in zip(order, order[1:], strict=False):
            if boxes[b][0][d0] < boxes[a][1][d0]:
                return a, b
        return None
    events = sorted([(boxes[i][0][d0], 1, i) for i in ids] + [(boxes[i][1][d0], 0, i) for i in ids])
    if len(dims) == 2:
        return _sweep_2d(events, boxes, dims[1])
    active: list[int] = []
    rest = dims[1:]
    k = 0
    while k < len(events):
        x = events[k][0]
        started = False
        while k < len(events) and events[k][0] == x:
            _, kind, i = events[k]
            if kind == 0:
                active.remove(i)
            else:
                active.append(i)
                started = True
            k += 1
        if started and len(active) > 1:
            sub = [d for d in rest if any(boxes[i][0][d] != boxes[active[0]][0][d]
                                          or boxes[i][1][d] != boxes[active[0]][1][d]
                                          for i in active)]
            found = _overlap(list(active), boxes, sub, left)
            if found is not None:
                return found
    return None


def _sweep_2d(events: list[tuple[int, int, int]],
              boxes: Sequence[tuple[Sequence[int], Sequence[int]]], d1: int
              ) -> tuple[int, int] | None:
    """Sweep over the first dimension (``events``: ends before starts at one coordinate),
    keeping the active boxes' ``d1`` intervals sorted; they must never overlap."""
    starts: list[int] = []
    ends: list[int] = []
    who: list[int] = []
    for _, kind, i in events:
        lo, hi = boxes[i][0][d1], boxes[i][1][d1]
        pos = bisect.bisect_left(starts, lo)
        if kind == 0:
            while who[pos] != i:  # starts are distinct while the intervals are disjoint
                pos += 1
            del starts[pos], ends[pos], who[pos]
            continue
        if pos > 0 and ends[pos - 1] > lo:
            return who[pos - 1], i
        if pos < len(starts) and starts[pos] < hi:
            return who[pos], i
        starts.insert(pos, lo)
        ends.insert(pos, hi)
        who.insert(pos, i)
    return None
