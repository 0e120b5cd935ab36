"""The restore engine: one attempt of one plan, every item as boxes, one stats object.

Every rank computes what it wants from the manifest and its own inputs alone, as boxes of
global tensors (DESIGN "one restore engine"):

* the replicated state: the leaves of ``into`` (its own shards of each target) and the saved
  tensors ``into`` lacks, whole (:mod:`xla_ckpt.restore.targets`); restored whole and without
  ``into``, its blobs, which every rank wants alike;
* its ``rank/<r>`` item (every saved rank's with a remap hook) and its range of every ZeRO
  flat tensor (:mod:`xla_ckpt.restore.private`).

The plan decides who reads which bytes and how they move; each plan is written once, for
boxes, in :func:`~xla_ckpt.restore.sharded.move_boxes`: ``all_ranks`` (each rank reads its
own), ``striped`` (:mod:`~xla_ckpt.restore.box_striped`: each box fetched once per job, the
reads balanced by :mod:`xla_ckpt.restore.assign`, the rows exchanged) and ``broadcast``
(:mod:`~xla_ckpt.restore.box_broadcast`: rank 0 reads and sends).  The replicated state's
blobs, which every rank wants alike, are boxes too (:mod:`xla_ckpt.restore.blobs`), with
host shared memory as an option of the mover: the ranks of a host hold one sealed copy
that every rank maps (``per_host``: each host's leader reads it).  The per-rank boxes are
read by their own rank (``broadcast``: rank 0 reads and sends each its own; ``striped``: a
box several ranks want, a whole ZeRO tensor under ``zero_sharding="none"``, is fetched once
per job and exchanged).  Typed values
(non-tensor state) come from the manifest.

Every figure goes into the one :class:`~xla_ckpt.restore.result.RestoreStats` of the attempt.
"""

from __future__ import annotations

from typing import Any, Callable

from xla_ckpt.comm.base import Dist
from xla_ckpt.format.plan import MapLocation
from xla_ckpt.restore.blobs import restore_blobs
from xla_ckpt.restore.config import RestoreConfig
from xla_ckpt.restore.decide import Decision
from xla_ckpt.restore.plan import RankPlan
from xla_ckpt.restore.private import add_private, private_requests
from xla_ckpt.restore.result import Loaded, RestoreStats
from xla_ckpt.restore.select import ALL_RANKS, BROADCAST, STRIPED
from xla_ckpt.restore.sharded import move_boxes, restore_into
from xla_ckpt.restore.targets import RankRequests, SavedTensors, saved_tensors
from xla_ckpt.storage import StorageConfig

#: ``fn(saved: {saved rank: per-rank state}, rank, world_size) -> this rank's per-rank state``.
RankStateRemap = Callable[[dict[int, Any], int, int], Any]


def box_strategy(name: str) -> str:
    """How a plan moves boxes: rank 0 sends (broadcast), the holders of each box share its
    reads and exchange them (striped), or each rank reads its own (all_ranks, per_host)."""
    return name if name in (BROADCAST, STRIPED) else ALL_RANKS


def run_plan(decision: Decision, dist: Dist, plans: list[RankPlan], name: str,
             cfg: RestoreConfig, *, into: Any, item: str, map_location: MapLocation,
             storage_config: StorageConfig | None, what: str,
             remap: RankStateRemap | None = None) -> Loaded:
    """One restore attempt on every rank (every rank calls it with the same plan).

    Returns:
        :class:`Loaded` with the state, this rank's ``rank/<r>`` state (or the remap hook's
        value), its ZeRO ranges, and the attempt's one :class:`RestoreStats`.

    Raises:
        see :func:`xla_ckpt.restore.restore`.
    """
    manifest = decision.manifest
    me = plans[dist.rank]
    as_boxes = into is not None or manifest.item(item).chunked
    saved = saved_tensors(manifest, item) if as_boxes else SavedTensors(manifest, item, None,
                                                                         [], {})
    saved, where = add_private(saved, me)
    private = private_requests(saved, where, me)
    # the same on every rank: the plans come from the manifest alone
    any_private = any(p.rank_item is not None or p.shards or p.remap_items for p in plans)
    mine = RankRequests([], private.requests, {}, [], [None] * len(private.requests))
    # private boxes: own reads (a box one rank wants), rank 0's (broadcast), or, striped,
    # read once per job by one of the ranks that want it (zero_sharding="none", remap)
    how = box_strategy(name)
    if as_boxes:
        stats = RestoreStats(plan=box_strategy(name))
        state = restore_into(decision, dist, saved=saved, into=into, strategy=box_strategy(name),
                             map_location=map_location, storage_config=storage_config,
                             bucket_size_bytes=cfg.bucket_size_bytes, what=what, stats=stats,
                             private=mine if any_private else None, private_strategy=how)
        loaded = Loaded(state=state, stats=stats)
    else:
        loaded = restore_blobs(decision, dist, me.item, name,
                               host_shared_memory=cfg.host_shared_memory,
                               map_location=map_location, storage_config=storage_config,
                               bucket_size_bytes=cfg.bucket_size_bytes, what=what)
        if any_private:
            move_boxes(decision, dist, saved, mine, strategy=how, storage_config=storage_config,
                       bucket_size_bytes=cfg.bucket_size_bytes, what=what, stats=loaded.stats)
    if any_private:
        rank_state, shards, mapped = dist.run_collectively(
            lambda: private.build(manifest, me, map_location),
            f"{what}: rebuild the per-rank state")
        loaded.rank_state, loaded.shards = rank_state, shards
        if me.remap_items:
            assert remap is not None  # remap_items come only with a hook
            by_rank = {r: mapped[n] for r, n in me.remap_items.items()}
            loaded.rank_state = dist.run_collectively(
                lambda: remap(by_rank, dist.rank, dist.world_size), f"{what}: rank_state_remap")
    return loaded
