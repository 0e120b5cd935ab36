"""Every rank reads: each rank fetches the replicated state item straight from storage.

The TPU default without host shared memory (DESIGN "restore"): no tensor bytes cross the
collective.  Per-rank items and ZeRO partitions are boxes each rank reads for itself
(:mod:`xla_ckpt.restore.engine`).  A failure on any rank reaches every rank through one
agreement step.
"""

from __future__ import annotations

import time

from xla_ckpt.comm.base import Dist
from xla_ckpt.format.plan import MapLocation, materialize_item
from xla_ckpt.io import CheckpointReader
from xla_ckpt.restore.decide import Decision
from xla_ckpt.restore.plan import RankPlan
from xla_ckpt.restore.result import Loaded, RestoreStats
from xla_ckpt.storage import StorageConfig, open_storage


def restore_all_ranks(decision: Decision, dist: Dist, plan: RankPlan, *,
                      map_location: MapLocation, storage_config: StorageConfig | None,
                      what: str) -> Loaded:
    """Every rank calls this; each reads the whole replicated item ``plan.item`` itself.

    Raises:
        DistributedError: on every rank when any rank's read or rebuild failed
            (``failures`` names the ranks and causes: IntegrityError,
            CheckpointCorruptError, StorageError, ...).
    """

    def work() -> Loaded:
        t0 = time.perf_counter()
        manifest = decision.manifest
        storage = open_storage(decision.checkpoint, storage_config)
        try:
            bufs = CheckpointReader(storage, manifest).read_blobs(plan.item)
        finally:
            storage.close()
        state = materialize_item(manifest.item(plan.item), bufs, map_location)
        stats = RestoreStats(bytes_read=sum(b.numel() for b in bufs.values()),
                             read_seconds=time.perf_counter() - t0)
        return Loaded(state=state, stats=stats)

    return dist.run_collectively(work, what)
