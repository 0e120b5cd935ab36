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

Pure: no I/O, no torch.distributed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence


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
        """Saved chunks overlapping ``box``, each with the overlap, in chunk order."""
        out = []
        for c in self.chunks:
            ov = intersect(c.box, box)
            if ov is not None:
                out.append((c, ov))
        return out
