"""What each rank restores from a checkpoint: items and sharded-tensor ranges.

Computed from the manifest and the topology alone, identically on every
rank (so every rank can also compute every other rank's plan, which the
broadcast path needs on rank 0).  World-size checks happen here, before any
bytes move, and raise the same error on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from xla_ckpt.errors import CheckpointCorruptError, WorldSizeMismatchError
from xla_ckpt.format.dtypes import dtype_from_name, itemsize
from xla_ckpt.format.manifest import Manifest, rank_item
from xla_ckpt.restore.sharding import ShardedTensorLayout, read_layout, wanted_range

RANK_ITEM_PREFIX = "rank/"


@dataclass
class RankPlan:
    """What one rank restores.

    Attributes:
        rank: the rank this plan is for.
        item: name of the replicated state item (``"state"``).
        rank_item: this rank's private item (``"rank/<r>"``) or None.
        shards: sharded tensor key -> element range ``[lo, hi)`` this rank gets.
        layout: sharded tensor key -> where its elements live in the checkpoint.
    """

    rank: int
    item: str
    rank_item: str | None = None
    shards: dict[str, tuple[int, int]] = field(default_factory=dict)
    layout: dict[str, ShardedTensorLayout] = field(default_factory=dict)

    def shard_nbytes(self, key: str) -> int:
        lo, hi = self.shards[key]
        return (hi - lo) * itemsize(dtype_from_name(self.layout[key].dtype))

    def shard_dtype(self, key: str) -> torch.dtype:
        return dtype_from_name(self.layout[key].dtype)


def has_rank_items(manifest: Manifest) -> bool:
    return any(name.startswith(RANK_ITEM_PREFIX) for name in manifest.items)


def plan_ranks(manifest: Manifest, world_size: int, *, item: str, restore_rank_items: bool,
               zero_sharding: str, allow_reshard: bool, context: str = "") -> list[RankPlan]:
    """One :class:`RankPlan` per rank of a job of ``world_size``.

    Raises:
        CheckpointCorruptError: the manifest has no item ``item`` or a
            malformed sharded-tensor layout.
        WorldSizeMismatchError: the checkpoint was saved by a different number
            of ranks and holds per-rank items that cannot be resharded
            (``restore_rank_items``), or holds sharded tensors and
            ``allow_reshard`` is False.  States saved vs current world size.
    """
    suffix = f" [{context}]" if context else ""
    manifest.item(item)  # raises CheckpointCorruptError naming the missing item
    saved = manifest.world_size
    if restore_rank_items and has_rank_items(manifest) and saved is not None \
            and saved != world_size:
        raise WorldSizeMismatchError(
            f"checkpoint was saved with world size {saved} and holds per-rank state "
            f"(rank/<r> items: iterator position, RNG), but the current world size is "
            f"{world_size}; per-rank state cannot be resharded. Restore with {saved} ranks, or "
            f"pass rank_item=False to restore without it (iterators restart the epoch){suffix}")
    layout = read_layout(manifest)
    if layout and saved is not None and saved != world_size and not allow_reshard:
        raise WorldSizeMismatchError(
            f"checkpoint holds sharded tensors saved with world size {saved}, but the current "
            f"world size is {world_size} and allow_reshard is False; restore with {saved} ranks "
            f"or set allow_reshard=True for exact resharding{suffix}")
    plans = []
    for r in range(world_size):
        own = rank_item(r) if restore_rank_items and rank_item(r) in manifest.items else None
        shards = {k: wanted_range(lay.numel, r, world_size, zero_sharding)
                  for k, lay in layout.items()}
        plans.append(RankPlan(rank=r, item=item, rank_item=own, shards=shards, layout=layout))
    for lay in layout.values():
        if lay.pieces and any(p.item not in manifest.items for p in lay.pieces):
            raise CheckpointCorruptError(f"sharded tensor {lay.key!r} names a missing item")
    return plans
