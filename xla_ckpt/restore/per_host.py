"""The per-host plan: one read of the replicated state per host, no cross-host collective.

``all_ranks`` (the TPU default) has every rank fetch the whole replicated state, so a host
with ``local_world_size`` ranks pulls it ``local_world_size`` times over its one network
link.  Here the host's leader (its lowest rank) reads it once, crc32c-checked, into a memfd
segment (``os.pwrite`` of checked slices, publishing its progress); the other ranks of the
host follow the fill and map the sealed segment copy-on-write
(:mod:`xla_ckpt.comm.host_memory`).  Storage bytes per host are 1x the state.  No tensor
bytes cross a collective, so it is safe on TPU today (only control-plane agreements run).

When the ranks of some host cannot share memory (no ``memfd_create``, another PID
namespace, ``restore.host_shared_memory: false``) every rank reads for itself, as
``all_ranks`` always did, and the reason goes into the log and ``Restored.reason``.
Per-rank items and ZeRO partitions are read by the rank that needs them (boxes of the
engine, :mod:`xla_ckpt.restore.engine`).
"""

from __future__ import annotations

import logging
import time

from xla_ckpt.comm.base import Dist
from xla_ckpt.comm.host_memory import (
    FAILED,
    HEADER_BYTES,
    HostMemoryError,
    PrivateMapping,
    map_private,
)
from xla_ckpt.format.manifest import Item
from xla_ckpt.format.plan import MapLocation, materialize_item
from xla_ckpt.io import CheckpointReader
from xla_ckpt.restore.all_ranks import restore_all_ranks
from xla_ckpt.restore.decide import Decision
from xla_ckpt.restore.host_share import STAGING_BUFFERS, HostShare, negotiate
from xla_ckpt.restore.plan import RankPlan
from xla_ckpt.restore.result import Loaded, RestoreStats
from xla_ckpt.storage import StorageConfig, open_storage

logger = logging.getLogger(__name__)


def restore_per_host(decision: Decision, dist: Dist, plans: list[RankPlan], *,
                     map_location: MapLocation, storage_config: StorageConfig | None, what: str,
                     host_shared_memory: bool = True) -> tuple[Loaded, str]:
    """Every rank calls this; each host's leader reads, the host's other ranks map its copy.

    Returns:
        ``(loaded, fallback)``: ``fallback`` is ``""`` when the hosts shared one read each,
        else why every rank read for itself (``loaded.stats.plan`` is then ``all_ranks``).

    Raises:
        DistributedError: on every rank when a leader's read, a follower's mapping or a
            rebuild failed (``failures`` names the rank and cause; a follower whose leader
            failed names the leader).
        CollectiveTimeoutError: a rank died or hung.
    """
    me = plans[dist.rank]
    item = decision.manifest.item(me.item)
    sizes = [b.length for b in item.blobs]
    share, why = negotiate(dist, host_shared_memory, sum(sizes), what, leaders_group=False,
                           plan="per_host")
    if share is None:
        loaded = restore_all_ranks(decision, dist, me, map_location=map_location,
                                   storage_config=storage_config, what=what)
        loaded.stats.plan = "all_ranks"
        loaded.stats.data_path = f"every rank reads for itself ({why})"
        return loaded, why
    try:
        return _shared(decision, dist, plans, share, item, sizes, map_location=map_location,
                       storage_config=storage_config, what=what), ""
    finally:
        share.close()


def _shared(decision: Decision, dist: Dist, plans: list[RankPlan], share: HostShare, item: Item,
            sizes: list[int], *, map_location: MapLocation, storage_config: StorageConfig | None,
            what: str) -> Loaded:
    me = plans[dist.rank]
    leader = share.segment is not None
    stats = RestoreStats(plan="per_host", data_path=share.describe)
    t0 = time.perf_counter()

    segment = share.segment
    offsets: list[int] = []

    def size() -> None:  # the segment has its final size before any follower maps it
        if segment is not None:
            offsets.extend(segment.size_for(sizes))

    dist.run_collectively(size, f"{what}: size host shared memory")
    got: dict[str, list] = {}

    def fill_or_follow() -> int:
        if segment is None:  # a follower: map the leader's bytes as they are published
            mapping = PrivateMapping(share.copy_fd(), sizes)
            outcome = mapping.follow(share.leader_pid, dist.timeout_s)
            if outcome != "sealed":
                raise HostMemoryError(f"rank {share.leader} (this host's leader) did not "
                                      f"complete its read into host shared memory: {outcome}")
            got["views"] = mapping.views
            return 0
        try:
            storage = open_storage(decision.checkpoint, storage_config)
            try:
                reader = CheckpointReader(storage, decision.manifest)
                reader.read_into_file(me.item, segment.fd, dict(enumerate(offsets)),
                                      staging_buffers=min(storage.config.max_workers,
                                                          STAGING_BUFFERS),
                                      on_written=lambda end: segment.publish(end - HEADER_BYTES))
            finally:
                storage.close()
            segment.seal()  # followers check the seal before the published progress
        except BaseException:
            if not segment.sealed:
                segment.publish(FAILED)  # the followers stop waiting at once
            raise
        got["views"] = map_private(segment.fd, sizes)
        return reader.stats.bytes_read

    stats.bytes_read = dist.run_collectively(
        fill_or_follow, f"{what}: each host's leader reads into host shared memory")
    stats.read_seconds = time.perf_counter() - t0
    views = got.pop("views")
    stats.bytes_mapped = 0 if leader else sum(sizes)
    state = dist.run_collectively(
        lambda: materialize_item(item, dict(enumerate(views)), map_location),
        f"{what}: rebuild the state")
    return Loaded(state=state, stats=stats)
