"""What each rank restores from a checkpoint: items and sharded-tensor ranges.

Computed from the manifest and the topology alone, identically on every
rank (so every rank can also compute every other rank's plan, which the
broadcast path needs on rank 0).  World-size checks happen here, before any
bytes move, and raise the same error on every rank.

The per-rank item rule (``rank/<r>`` items: data iterator position, RNG state), when the
checkpoint was saved with world size ``W`` and is restored with ``W'``:

* ``W == W'``: rank ``r`` gets its own ``rank/<r>`` item back, never another rank's;
* ``W != W'`` and a remap hook was given (``restore(rank_state_remap=fn)``): every rank
  reads every saved per-rank item and gets ``fn({saved rank: state}, rank, W')``;
* ``W != W'`` and ``rank_state_on_resize="drop"``: no rank gets per-rank state; a WARNING
  names what was dropped;
* otherwise one :class:`~xla_ckpt.errors.WorldSizeMismatchError` on every rank naming the
  per-rank items and both ways out.  Silently dropping a data loader's position replays or
  skips samples (torchtitan #811).

``rank_item=False`` (``restore_rank_items``) still restores without per-rank state at any
world size, silently, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from xla_ckpt.errors import CheckpointCorruptError, WorldSizeMismatchError
from xla_ckpt.format import typed
from xla_ckpt.format.dtypes import dtype_from_name, itemsize
from xla_ckpt.format.manifest import Manifest, rank_item
from xla_ckpt.restore.sharding import ShardedTensorLayout, read_layout, wanted_range

RANK_ITEM_PREFIX = "rank/"
RANK_STATE_ERROR = "error"
RANK_STATE_DROP = "drop"


@dataclass
class RankPlan:
    """What one rank restores.

    Attributes:
        rank: the rank this plan is for.
        item: name of the replicated state item (``"state"``).
        rank_item: this rank's private item (``"rank/<r>"``) or None.
        shards: sharded tensor key -> element range ``[lo, hi)`` this rank gets.
        layout: sharded tensor key -> where its elements live in the checkpoint.
        remap_items: saved rank -> its ``rank/<r>`` item, when a remap hook maps the
            per-rank state of a checkpoint saved with another world size (every rank
            reads all of them); empty otherwise.
        dropped: what the per-rank item rule dropped (one line, for the WARNING), or "".
    """

    rank: int
    item: str
    rank_item: str | None = None
    shards: dict[str, tuple[int, int]] = field(default_factory=dict)
    layout: dict[str, ShardedTensorLayout] = field(default_factory=dict)
    remap_items: dict[int, str] = field(default_factory=dict)
    dropped: str = ""

    def shard_nbytes(self, key: str) -> int:
        lo, hi = self.shards[key]
        return (hi - lo) * itemsize(dtype_from_name(self.layout[key].dtype))

    def shard_dtype(self, key: str) -> torch.dtype:
        return dtype_from_name(self.layout[key].dtype)


def has_rank_items(manifest: Manifest) -> bool:
    return any(name.startswith(RANK_ITEM_PREFIX) for name in manifest.items)


def saved_rank_items(manifest: Manifest) -> dict[int, str]:
    """Saved rank -> its ``rank/<r>`` item name, in rank order.

    Raises:
        CheckpointCorruptError: an item named ``rank/...`` whose suffix is not a rank number.
    """
    out: dict[int, str] = {}
    for name in manifest.items:
        if name.startswith(RANK_ITEM_PREFIX):
            suffix = name[len(RANK_ITEM_PREFIX):]
            if not suffix.isdigit() or len(suffix) > 9:
                raise CheckpointCorruptError(f"per-rank item {name!r} does not name a rank")
            out[int(suffix)] = name
    return dict(sorted(out.items()))


def describe_rank_items(manifest: Manifest, items: dict[int, str]) -> str:
    """``"3 items rank/00000 .. rank/00002 (keys: 'iterator', 'rng')"``: what per-rank state is."""
    names = list(items.values())
    shown = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
    keys: list[str] = []
    for name in names[:4]:  # the keys of a few are enough to say what it holds
        try:
            tree = typed.decode(manifest.item(name).state, lambda _i: None)
        except CheckpointCorruptError:
            continue
        if isinstance(tree, dict):
            keys.extend(repr(k) for k in tree if repr(k) not in keys)
    what = f" (keys: {', '.join(keys[:8])}{', ...' if len(keys) > 8 else ''})" if keys else ""
    return f"{len(names)} item{'s' if len(names) != 1 else ''} {shown}{what}"


def plan_ranks(manifest: Manifest, world_size: int, *, item: str, restore_rank_items: bool,
               zero_sharding: str, allow_reshard: bool, context: str = "",
               rank_state_on_resize: str = RANK_STATE_ERROR,
               remap: bool = False) -> list[RankPlan]:
    """One :class:`RankPlan` per rank of a job of ``world_size``.

    ``rank_state_on_resize`` (``"error"`` or ``"drop"``) and ``remap`` (a remap hook was
    given) apply the per-rank item rule of the module docstring.

    Raises:
        CheckpointCorruptError: the manifest has no item ``item`` or a
            malformed sharded-tensor layout.
        WorldSizeMismatchError: the checkpoint was saved by a different number
            of ranks and holds per-rank items, with neither ``remap`` nor
            ``rank_state_on_resize="drop"`` (the message names the items and both
            options), or holds sharded tensors and ``allow_reshard`` is False.
            States saved vs current world size.
    """
    suffix = f" [{context}]" if context else ""
    manifest.item(item)  # raises CheckpointCorruptError naming the missing item
    saved = manifest.world_size
    remap_items: dict[int, str] = {}
    dropped = ""
    resized = saved is not None and saved != world_size
    if restore_rank_items and resized and has_rank_items(manifest):
        items = saved_rank_items(manifest)
        what = describe_rank_items(manifest, items)
        if remap:
            remap_items = items
        elif rank_state_on_resize == RANK_STATE_DROP:
            dropped = (f"per-rank state of a checkpoint saved with world size {saved} "
                       f"({what}), restored with world size {world_size}")
        else:
            raise WorldSizeMismatchError(
                f"checkpoint was saved with world size {saved} and holds per-rank state "
                f"({what}), but the current world size is "
                f"{world_size}; per-rank state cannot be resharded. Restore with {saved} "
                "ranks, or pass rank_state_remap=fn(saved, rank, world_size) to restore() / "
                "restore_or_initialize() to map the saved {rank: state} onto the new ranks, "
                "or set rank_state_on_resize='drop' in RestoreConfig to restore without it "
                f"(a warning names what is dropped; iterators restart the epoch){suffix}")
        restore_rank_items = False
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
        plans.append(RankPlan(rank=r, item=item, rank_item=own, shards=shards, layout=layout,
                              remap_items=dict(remap_items), dropped=dropped))
    for lay in layout.values():
        if lay.pieces and any(p.item not in manifest.items for p in lay.pieces):
            raise CheckpointCorruptError(f"sharded tensor {lay.key!r} names a missing item")
    return plans
