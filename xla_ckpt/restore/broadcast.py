"""Rank 0 reads, then the data plane fans the bytes out (the CUDA/NCCL and gloo default).

Order of steps (every rank enters every step, whatever happened locally):

1. the manifest has already reached every rank (:mod:`xla_ckpt.restore.decide`),
   so receivers know every blob's length: they preallocate exactly the
   destination buffers and pass nothing else;
2. one agreement step on the allocations (a rank out of memory fails all);
3. rank 0 reads the blobs from storage (crc32c-checked) in a background
   thread while the replicated item's buffers are already being broadcast
   in buckets of at most ``bucket_size_bytes`` straight into the receivers'
   buffers (:meth:`Dist.broadcast_tensors` waits, on rank 0, for just the
   blobs the next bucket needs);
4. rank 0 reports how its read went in one agreement step; if it failed,
   every rank raises the same :class:`~xla_ckpt.errors.DistributedError`
   naming rank 0 and the cause (rank 0 still completed the broadcast
   sequence, with whatever bytes it had, so no rank was left waiting; the
   receivers' bytes are discarded);
5. every rank rebuilds the same state from the same bytes with
   :func:`~xla_ckpt.format.plan.materialize_item` (aliasing, dtypes, empty
   tensors survive), placing tensors on its own ``map_location``.

Receiver memory: the state's blobs plus one staging bucket.

**Host shared memory** (``host_shared_memory=True``, the default; negotiated
by :mod:`xla_ckpt.restore.host_share`, which falls back to the steps above
when any rank cannot share).  Steps 2-3 change for the replicated item:

* one host: rank 0 writes the crc32c-checked bytes into one memfd segment
  (:mod:`xla_ckpt.comm.host_memory`) and publishes how far it got; every
  rank, rank 0 included, has mapped the segment copy-on-write beforehand
  and maps in each published range while the fill goes on; rank 0 seals
  the segment when it is complete.  Nothing crosses the collective and the
  host holds one copy of the state, not one per rank;
* several hosts: each host's leader (lowest rank) fills its own segment
  through a writable mapping — rank 0 by reading, the others by receiving
  rank 0's buckets over a leaders' subgroup — seals it, and the ranks of
  each host map it.

Steps 4-5 are unchanged.  The per-rank items and ZeRO partitions are boxes of the
engine (:mod:`xla_ckpt.restore.engine`): rank 0 reads them and sends each rank its own,
point to point.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from xla_ckpt.comm.base import Dist
from xla_ckpt.comm.host_memory import FAILED, HEADER_BYTES, PrivateMapping, map_private
from xla_ckpt.format.manifest import Item
from xla_ckpt.format.plan import MapLocation, materialize_item
from xla_ckpt.io import CheckpointReader
from xla_ckpt.restore.background_read import BackgroundRead
from xla_ckpt.restore.decide import Decision
from xla_ckpt.restore.host_share import HostShare, negotiate
from xla_ckpt.restore.plan import RankPlan
from xla_ckpt.restore.result import Loaded, RestoreStats
from xla_ckpt.storage import StorageConfig, open_storage, parse_uri

logger = logging.getLogger(__name__)

FILE_STAGING_BUFFERS = 2  # slices in flight when rank 0 writes a local checkpoint into a memfd


def _alloc(item: Item) -> dict[int, torch.Tensor]:
    return {i: torch.empty(b.length, dtype=torch.uint8) for i, b in enumerate(item.blobs)}


def restore_broadcast(decision: Decision, dist: Dist, plans: list[RankPlan], *,
                      map_location: MapLocation, storage_config: StorageConfig | None,
                      bucket_size_bytes: int, what: str,
                      host_shared_memory: bool = True) -> Loaded:
    """Every rank calls this; rank 0 reads, every rank ends with its own state.

    Args:
        plans: every rank's :class:`RankPlan` (identical lists on every rank).
        host_shared_memory: True — ranks on rank 0's host (and on every
            other host, behind that host's leader) map one sealed copy of the
            replicated state instead of receiving it, when every rank can
            (:mod:`xla_ckpt.restore.host_share`); False — the collective
            carries every byte.

    Raises:
        DistributedError: on every rank when rank 0's read (or any rank's
            allocation or rebuild) failed; ``failures`` names rank and cause.
        CollectiveTimeoutError: a rank died or hung during a collective.
    """
    sizes = [b.length for b in decision.manifest.item(plans[dist.rank].item).blobs]
    share, data_path = negotiate(dist, host_shared_memory, sum(sizes), what)
    if share is None:
        data_path = f"collective broadcast over {dist.backend} ({data_path})"
    run = _BroadcastRestore(decision, dist, plans, share, data_path, map_location=map_location,
                            storage_config=storage_config, bucket_size_bytes=bucket_size_bytes,
                            what=what)
    try:
        return run.run()
    finally:
        if share is not None:
            share.close()


class _BroadcastRestore:
    """One broadcast restore on this rank, one method per step of the module docstring.

    Every rank runs every step in the same order (:meth:`run`); the
    collective steps go through ``dist.run_collectively`` / ``dist.agree``, so
    a failure on any rank surfaces on all of them.
    """

    def __init__(self, decision: Decision, dist: Dist, plans: list[RankPlan],
                 share: HostShare | None, data_path: str, *, map_location: MapLocation,
                 storage_config: StorageConfig | None, bucket_size_bytes: int,
                 what: str) -> None:
        self.decision, self.dist, self.plans, self.share = decision, dist, plans, share
        self.manifest = decision.manifest
        self.me = plans[dist.rank]
        self.is_src = dist.rank == 0
        self.state_item = self.manifest.item(self.me.item)
        self.sizes = [b.length for b in self.state_item.blobs]
        self.map_location, self.storage_config = map_location, storage_config
        self.bucket_size_bytes, self.what = bucket_size_bytes, what
        self.leader = share is not None and share.segment is not None
        # One host: rank 0 writes checked slices into its segment (os.pwrite: no page zeroing,
        # no page faults) and publishes its progress; every rank maps the segment up front and
        # maps in each published range while the fill goes on.  Several hosts: the leaders
        # fill writable mappings, rank 0 by reading, the others by receiving.
        self.one_host = share is not None and len(share.hosts) == 1
        self.stats = RestoreStats(data_path=data_path)
        self.got: dict[str, Any] = {}
        self.state_bufs: dict[int, torch.Tensor] = {}
        self.mapping: PrivateMapping | None = None
        self.background: BackgroundRead | None = None

    def _host(self) -> HostShare:
        if self.share is None:  # the steps that call this run only after a negotiated share
            raise RuntimeError(f"{self.what}: host shared memory was not negotiated")
        return self.share

    def run(self) -> Loaded:
        self.allocate()
        t0 = time.perf_counter()
        if self.is_src:
            self.background = self.start_read()
        self.move_state()
        if self.is_src:
            self.stats.read_seconds = time.perf_counter() - t0
        if self.mapping is None and self.share is not None:
            self.map_sealed_copies()
        self.background = None
        return self.dist.run_collectively(self.build, f"{self.what}: rebuild the state")

    def _alloc_step(self) -> dict[str, Any]:
        if self.share is None:
            out: dict[str, Any] = {"state": _alloc(self.state_item)}
        elif self.one_host:
            out = {"state": {}}
            if self.is_src:
                out["offsets"] = dict(enumerate(self.share.own_segment().size_for(self.sizes)))
        elif self.leader:  # the host's one copy; the other ranks of the host allocate nothing
            out = {"state": dict(enumerate(self.share.own_segment().writable_views(self.sizes)))}
        else:
            out = {"state": {}}
        return out

    def allocate(self) -> None:
        """Step 2: destination buffers (or the host's segment), agreed by every rank."""
        self.got = self.dist.run_collectively(
            self._alloc_step, f"{self.what}: allocate the destination buffers")
        self.state_bufs = self.got.pop("state")
        if self.one_host:  # the segment has its final size: map it now, fill or no fill
            fd = self._host().copy_fd()
            self.mapping = self.dist.run_collectively(
                lambda: PrivateMapping(fd, self.sizes), f"{self.what}: map host shared memory")

    def start_read(self) -> BackgroundRead:
        """Step 3 on rank 0: read the replicated item (into buffers or the segment) on a
        background thread."""
        decision, manifest, storage_config = self.decision, self.manifest, self.storage_config

        def open_reader() -> CheckpointReader:
            return CheckpointReader(open_storage(decision.checkpoint, storage_config), manifest)

        fill: Callable[[CheckpointReader], int] | None = None
        abort: Callable[[], None] | None = None
        if self.one_host and self.mapping is not None:
            segment, offsets, mapping = self._host().own_segment(), self.got.pop("offsets"), \
                self.mapping
            local = parse_uri(decision.checkpoint).is_local
            staging = FILE_STAGING_BUFFERS if local else \
                (storage_config or StorageConfig()).max_workers  # network reads need streams

            def fill_segment(reader: CheckpointReader) -> int:
                reader.read_into_file(self.me.item, segment.fd, offsets, staging_buffers=staging,
                                      on_written=lambda end: segment.publish(end - HEADER_BYTES))
                segment.publish(mapping.data_bytes)
                segment.seal()
                return reader.stats.bytes_read

            def abort_fill() -> None:  # any failure before the seal: the followers stop waiting
                if not segment.sealed:
                    segment.publish(FAILED)

            fill, abort = fill_segment, abort_fill

        # read groups of a quarter bucket: the first bucket can leave early
        group = max(self.bucket_size_bytes // 4, 1 << 20)
        return BackgroundRead(open_reader, self.me.item, self.state_bufs, group,
                               fill=fill, abort=abort)

    def move_state(self) -> None:
        """Steps 3-4: the replicated bytes reach every rank (mapped, or over the data plane);
        one agreement step on how rank 0's read went."""
        dist, share, background, stats = self.dist, self.share, self.background, self.stats
        wait_on_src = background.wait_for if background is not None else None
        bufs = [self.state_bufs[i] for i in sorted(self.state_bufs)]
        data_error: BaseException | None = None
        try:
            group = dist if share is None else share.leaders_dist
            if self.mapping is not None:  # every rank, rank 0 too: map in what rank 0 published
                outcome = self.mapping.follow(self._host().leader_pid, dist.timeout_s)
                logger.debug("rank %d: host shared memory: %s", dist.rank, outcome)
            elif group is not None:
                # one collective broadcast, or several hosts: rank 0 -> the other leaders
                try:
                    n = group.broadcast_tensors(bufs, src=0,
                                                bucket_size_bytes=self.bucket_size_bytes,
                                                wait_on_src=wait_on_src,
                                                check_layout=False)  # sizes from one manifest
                    stats.bytes_received += 0 if self.is_src else n
                except Exception as e:
                    if share is None:
                        raise
                    # several hosts: the whole group agrees on the leaders' failure below
                    data_error = e
        finally:
            if background is not None:
                background.join()
                background.release()
        read_error = background.error if background is not None else None
        dist.agree(read_error or data_error,
                   f"{self.what}: rank 0 reads" + ("" if share is None
                                                   else " into host shared memory"))
        if background is not None:
            stats.bytes_read = background.bytes_read
        if self.mapping is not None:
            # the views are taken in build(), once checked
            stats.bytes_mapped = 0 if self.is_src else sum(self.sizes)

    def map_sealed_copies(self) -> None:
        """Several hosts: every leader seals its copy, then every rank maps its host's copy."""
        share, dist = self._host(), self.dist
        self.state_bufs = {}  # the writable views: the segment can be sealed once they are gone
        # two steps: no rank maps before every leader has sealed
        dist.run_collectively(share.own_segment().seal if self.leader else lambda: None,
                              f"{self.what}: seal host shared memory")
        fd = share.copy_fd()
        self.state_bufs = dist.run_collectively(
            lambda: dict(enumerate(map_private(fd, self.sizes))),
            f"{self.what}: map host shared memory")
        self.stats.bytes_mapped = 0 if self.leader else sum(self.sizes)
        share.close()

    def build(self) -> Loaded:
        """Step 5: the same state from the same bytes, placed on this rank's map_location."""
        bufs = self.state_bufs
        if self.mapping is not None:
            self.mapping.check_sealed()  # rank 0 said its fill succeeded: sealed, bytes final
            self.mapping.populate(self.mapping.data_bytes)
            bufs = dict(enumerate(self.mapping.views))
        state = materialize_item(self.state_item, bufs, self.map_location)
        return Loaded(state=state, stats=self.stats)
