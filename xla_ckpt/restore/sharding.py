"""Flat sharded tensors: how ZeRO-style partitions are laid out, saved and resharded.

Scheme (the one DeepSpeed ZeRO-1 and FSDP's flat parameters use): a sharded
tensor is one flat 1-D tensor of ``numel`` elements, cut into contiguous
element ranges, one per rank.  Rank ``r`` of a save with world size ``W``
writes its range as a tensor in the checkpoint item ``shard/<r>``; that
item's typed state records, per key, the range ``[lo, hi)`` and ``numel``,
so every rank can rebuild the whole layout from the manifest alone, without
reading tensor bytes.

Why not ``torch.distributed.optim.ZeroRedundancyOptimizer``'s own format:
it assigns whole parameters to ranks (a 10-element tensor cannot be cut
across 4 ranks, CASES C9) and consolidates its state on one rank with pickled
object collectives before saving.  Flat ranges reshard exactly to any world
size by byte-range arithmetic, and each rank can read just its bytes.

Restoring with world size ``W'`` gives rank ``r'`` the range
:func:`partition_bounds` ``(numel, W')[r']`` (``zero_sharding="os"``) or the
whole tensor (``"none"``).  The pieces come from whichever saved shards
overlap it, so the new ranges always concatenate back to the saved tensor.

Pure: no I/O, no collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from xla_ckpt.errors import CheckpointCorruptError
from xla_ckpt.format import typed
from xla_ckpt.format.dtypes import dtype_from_name, itemsize
from xla_ckpt.format.manifest import Manifest, TensorRecord

SHARD_ITEM_PREFIX = "shard/"

# Keys of a shard item's typed state.
K_TENSORS = "tensors"
K_BOUNDS = "bounds"
K_NUMEL = "numel"


def shard_item(rank: int) -> str:
    """Item name holding ``rank``'s partitions of the flat sharded tensors."""
    return f"{SHARD_ITEM_PREFIX}{rank:05d}"


def partition_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` element ranges of a flat tensor, one per rank.

    The first ``numel % world_size`` ranks get one element more (the rule of
    ``torch.tensor_split``); ranks beyond ``numel`` get empty ranges.  E.g.
    ``partition_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]``.

    Raises:
        ValueError: ``numel < 0`` or ``world_size < 1``.
    """
    if numel < 0 or world_size < 1:
        raise ValueError(f"partition_bounds needs numel >= 0 and world_size >= 1, got "
                         f"{numel}, {world_size}")
    base, extra = divmod(numel, world_size)
    out, lo = [], 0
    for r in range(world_size):
        hi = lo + base + (1 if r < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


@dataclass(frozen=True)
class SavedPiece:
    """One saved shard of one key: elements ``[lo, hi)`` live in ``item``'s tensor ``record``."""

    item: str
    rank: int
    lo: int
    hi: int
    record: TensorRecord

    def byte_range(self, a: int, b: int) -> tuple[int, int]:
        """(start, length) in bytes, within the piece's blob, of elements ``[a, b)``."""
        isz = itemsize(dtype_from_name(self.record.dtype))
        return self.record.byte_offset + (a - self.lo) * isz, (b - a) * isz


@dataclass(frozen=True)
class ShardedTensorLayout:
    """Where every element of one flat sharded tensor lives in a checkpoint."""

    key: str
    numel: int
    dtype: str
    pieces: tuple[SavedPiece, ...]

    def overlapping(self, lo: int, hi: int) -> Iterator[tuple[SavedPiece, int, int]]:
        """Saved pieces overlapping elements ``[lo, hi)``, with the overlap ``[a, b)``, in order."""
        for p in self.pieces:
            a, b = max(lo, p.lo), min(hi, p.hi)
            if a < b:
                yield p, a, b


def shard_items(manifest: Manifest) -> dict[int, str]:
    """Saved rank -> shard item name, for every ``shard/<r>`` item in the manifest."""
    out = {}
    for name in manifest.items:
        if name.startswith(SHARD_ITEM_PREFIX):
            try:
                out[int(name[len(SHARD_ITEM_PREFIX):])] = name
            except ValueError:
                raise CheckpointCorruptError(
                    f"manifest item {name!r} is not shard/<rank>") from None
    return dict(sorted(out.items()))


def read_layout(manifest: Manifest) -> dict[str, ShardedTensorLayout]:
    """Rebuild the layout of every sharded tensor from the manifest (no tensor bytes read).

    Raises:
        CheckpointCorruptError: a shard item is malformed, a saved rank's item
            is missing (``manifest.world_size`` says how many there should be),
            keys or dtypes differ between ranks, or the saved ranges do not
            tile ``[0, numel)`` exactly.
    """
    items = shard_items(manifest)
    if not items:
        return {}
    if manifest.world_size is not None:
        missing = [r for r in range(manifest.world_size) if r not in items]
        if missing:
            raise CheckpointCorruptError(
                f"checkpoint saved by {manifest.world_size} ranks lacks shard items of rank(s) "
                f"{missing}; it cannot be restored (save it again)")
    pieces: dict[str, list[SavedPiece]] = {}
    numels: dict[str, int] = {}
    for rank, name in items.items():
        item = manifest.items[name]
        doc = typed.decode(item.state, lambda i: i)
        if not (isinstance(doc, dict) and isinstance(doc.get(K_TENSORS), dict)
                and isinstance(doc.get(K_BOUNDS), dict) and isinstance(doc.get(K_NUMEL), dict)):
            raise CheckpointCorruptError(f"shard item {name!r} is malformed (needs {K_TENSORS}, "
                                         f"{K_BOUNDS}, {K_NUMEL})")
        for key, tidx in doc[K_TENSORS].items():
            bounds, numel = doc[K_BOUNDS].get(key), doc[K_NUMEL].get(key)
            if not (isinstance(tidx, int) and 0 <= tidx < len(item.tensors)
                    and isinstance(bounds, (list, tuple)) and len(bounds) == 2
                    and all(isinstance(x, int) for x in bounds) and isinstance(numel, int)):
                raise CheckpointCorruptError(f"shard item {name!r}: bad record for {key!r}")
            rec = item.tensors[tidx]
            lo, hi = bounds
            if (not (0 <= lo <= hi <= numel) or rec.shape != (hi - lo,)
                    or (hi > lo and rec.stride != (1,))):
                raise CheckpointCorruptError(
                    f"shard item {name!r}: {key!r} covers [{lo}, {hi}) of {numel} but its tensor "
                    f"has shape {list(rec.shape)} / stride {list(rec.stride)}")
            if numels.setdefault(key, numel) != numel:
                raise CheckpointCorruptError(f"sharded tensor {key!r} has numel {numels[key]} on "
                                             f"one rank and {numel} on rank {rank}")
            pieces.setdefault(key, []).append(SavedPiece(name, rank, lo, hi, rec))
    out = {}
    for key, ps in pieces.items():
        ps.sort(key=lambda p: (p.lo, p.hi))
        dtypes = {p.record.dtype for p in ps}
        if len(dtypes) != 1:
            raise CheckpointCorruptError(f"sharded tensor {key!r} saved with mixed dtypes "
                                         f"{sorted(dtypes)}")
        cursor = 0
        for p in ps:
            if p.lo != cursor:
                raise CheckpointCorruptError(
                    f"sharded tensor {key!r}: saved shards do not tile [0, {numels[key]}): "
                    f"{'gap' if p.lo > cursor else 'overlap'} at element {min(p.lo, cursor)}")
            cursor = p.hi
        if cursor != numels[key]:
            raise CheckpointCorruptError(f"sharded tensor {key!r}: saved shards end at element "
                                         f"{cursor} of {numels[key]}")
        if manifest.world_size is not None and len({p.rank for p in ps}) != len(items):
            absent = sorted(set(items) - {p.rank for p in ps})
            raise CheckpointCorruptError(f"sharded tensor {key!r} is missing from the shard "
                                         f"items of rank(s) {absent}")
        out[key] = ShardedTensorLayout(key, numels[key], dtypes.pop(), tuple(ps))
    return dict(sorted(out.items()))


def wanted_range(numel: int, rank: int, world_size: int, zero_sharding: str) -> tuple[int, int]:
    """Elements of a flat tensor that ``rank`` restores.

    Its partition with ``zero_sharding="os"``, all of them with ``"none"``."""
    if zero_sharding == "os":
        return partition_bounds(numel, world_size)[rank]
    return (0, numel)


def shard_state(shards: dict[str, Any], bounds: dict[str, tuple[int, int]],
                numels: dict[str, int]) -> dict:
    """The typed state a rank saves in its ``shard/<rank>`` item."""
    return {K_TENSORS: dict(shards),
            K_BOUNDS: {k: [int(a), int(b)] for k, (a, b) in bounds.items()},
            K_NUMEL: {k: int(v) for k, v in numels.items()}}
