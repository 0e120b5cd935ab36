"""The replicated state restored whole, as boxes: each blob of the item is one uint8 tensor.

Restored without ``into`` from a version-1 item, every rank wants every blob of the
replicated state whole.  Each blob ``b`` is global tensor ``b`` of :func:`blob_tensors`:
uint8, shape ``(length,)``, one saved chunk (its own bytes, crc32c-checked as every read),
so every plan moves them with the one box mover,
:func:`~xla_ckpt.restore.sharded.move_boxes`, and :func:`~xla_ckpt.format.plan.
materialize_item` rebuilds the tensors from the blobs (aliasing, strides, dtypes and empty
tensors as saved).  Without host memory each blob has a buffer of its own (the tensors of
one keep no other alive); a host's copy is one memfd segment in the layout of
:func:`~xla_ckpt.comm.host_memory.segment_layout`.

**Host shared memory** (``restore.host_shared_memory``, the default; negotiated by
:mod:`xla_ckpt.restore.host_share`, every rank falling back to a copy of its own when any
rank cannot share): the ranks of a host hold one copy, a memfd segment
(:mod:`xla_ckpt.comm.host_memory`), and the plan says who fills it:

* ``per_host`` (and ``all_ranks`` with host memory on several ranks): each host's leader
  reads the whole state into it; storage bytes per host are 1x the state, and no tensor
  byte crosses a collective (safe on TPU today);
* ``broadcast``: rank 0 reads into its host's copy; the other hosts' leaders receive it over
  the leaders' subgroup (:mod:`xla_ckpt.restore.box_broadcast`);
* ``striped``: every rank reads its balanced share into its host's copy and the leaders
  all-gather the shares across hosts (:mod:`xla_ckpt.restore.box_striped`,
  :class:`~xla_ckpt.restore.box_striped.FlatExchange`): each byte fetched once per job.

Then every filler unmaps, the leader seals the segment and every rank of the host maps it
copy-on-write: one copy per host, nothing copied within it.  Without host memory, every
rank fills its own buffer: ``all_ranks`` reads it, ``broadcast`` receives rank 0's reads,
``striped`` reads its share and all-gathers the rest.

Every step is entered by every rank and ends in an agreement, so a failed or dead rank
makes every rank raise one :class:`~xla_ckpt.errors.DistributedError` naming it (or a
:class:`~xla_ckpt.errors.CollectiveTimeoutError` after ``dist.timeout_s``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import torch

from xla_ckpt.comm.base import Dist
from xla_ckpt.comm.host_memory import (
    ALIGN_BYTES,
    HEADER_BYTES,
    WritableMapping,
    map_private,
    segment_layout,
)
from xla_ckpt.format.chunks import Box, ChunkRecord, GlobalTensor
from xla_ckpt.format.manifest import Item, Manifest, TensorRecord
from xla_ckpt.format.plan import MapLocation, materialize_item
from xla_ckpt.io.chunked import BoxRequest, fresh_tensor
from xla_ckpt.restore.box_striped import FlatExchange, plan_blocks, unit_rows
from xla_ckpt.restore.decide import Decision
from xla_ckpt.restore.host_share import HostShare, negotiate
from xla_ckpt.restore.result import Loaded, RestoreStats
from xla_ckpt.restore.select import ALL_RANKS, BROADCAST, PER_HOST, STRIPED
from xla_ckpt.restore.sharded import move_boxes
from xla_ckpt.restore.targets import RankRequests, SavedTensors
from xla_ckpt.storage import StorageConfig

logger = logging.getLogger(__name__)


def blob_tensors(manifest: Manifest, item: str) -> SavedTensors:
    """The blobs of version-1 item ``item`` as global tensors: ``g`` = blob index, uint8,
    shape ``(length,)``, one chunk each (a manifest copy whose item has one tensor record
    per blob; the checkpoint itself is untouched).

    Raises:
        CheckpointCorruptError: no item ``item`` (names it).
    """
    it = manifest.item(item)
    # Each blob is named after the first tensor it holds (what a crc32c failure or a local
    # tier's fallback reports); a tensor lies in one blob, so the names stay unique.
    first: dict[int, str] = {}
    for t in it.tensors:
        first.setdefault(t.blob, t.key)
    records = [TensorRecord(first.get(b, f"{item}/blob/{b}"), b, 0, "uint8", (blob.length,),
                            (1,))
               for b, blob in enumerate(it.blobs)]
    gts = [GlobalTensor(rec.key, "uint8", rec.shape,
                        (ChunkRecord(item, b, (0,), rec.shape),) if rec.shape[0] else ())
           for b, rec in enumerate(records)]
    view = dataclasses.replace(
        manifest, items={**manifest.items, item: Item(None, records, list(it.blobs))},
        global_tensors=gts)
    return SavedTensors(view, item, None, gts, {g.key: i for i, g in enumerate(gts)})


def restore_blobs(decision: Decision, dist: Dist, item: str, plan: str, *,
                  host_shared_memory: bool, map_location: MapLocation,
                  storage_config: StorageConfig | None, bucket_size_bytes: int,
                  what: str) -> Loaded:
    """Every rank calls it; every rank ends with the whole replicated item ``item``.

    Args:
        plan: ``all_ranks``, ``per_host``, ``broadcast`` or ``striped`` (module docstring).
        host_shared_memory: this rank's ``restore.host_shared_memory``.
        bucket_size_bytes: largest single collective of an exchange.

    Returns:
        :class:`Loaded` with the state; ``stats.bytes_read`` is what this rank fetched,
        ``bytes_received`` what an exchange brought it, ``bytes_mapped`` what it maps from
        its host's copy instead of holding it, ``data_path`` how the bytes moved.

    Raises:
        DistributedError: on every rank when any rank's allocation, read, exchange or
            rebuild failed (``failures`` names the ranks and causes: IntegrityError,
            StorageError, HostMemoryError, ...).
        CollectiveTimeoutError: a rank died or stalled.
    """
    it = decision.manifest.item(item)
    sizes = [b.length for b in it.blobs]
    if plan == ALL_RANKS and host_shared_memory and dist.world_size > 1:
        plan = PER_HOST  # the ranks of a host share one read
    share, why = negotiate(dist, host_shared_memory, sum(sizes), what,
                           writable=plan == STRIPED,
                           leaders_group=plan in (BROADCAST, STRIPED), plan=plan)
    stats = RestoreStats(plan=plan if share is not None or plan != PER_HOST else ALL_RANKS,
                         data_path=share.describe if share is not None else _own(dist, plan, why))
    if dist.rank == 0:
        logger.info("rank 0: %s: %s", what, stats.data_path)
    run = _Blobs(decision, dist, item, sizes, share, stats, storage_config=storage_config,
                 bucket_size_bytes=bucket_size_bytes, what=what)
    try:
        bufs = run.run(plan)
        state = dist.run_collectively(lambda: materialize_item(it, bufs, map_location),
                                      f"{what}: rebuild the state")
    finally:
        run.close()
    return Loaded(state=state, stats=stats)


def _own(dist: Dist, plan: str, why: str) -> str:
    if dist.world_size == 1:
        return "one process reads for itself"
    if plan in (ALL_RANKS, PER_HOST):
        return f"every rank reads for itself ({why})"
    if plan == BROADCAST:
        return f"collective broadcast over {dist.backend} ({why})"
    return f"stripes all-gathered over {dist.backend} between every rank ({why})"


class _Blobs:
    """One restore of the blobs on this rank: allocate, move, (seal and map)."""

    def __init__(self, decision: Decision, dist: Dist, item: str, sizes: list[int],
                 share: HostShare | None, stats: RestoreStats, *,
                 storage_config: StorageConfig | None, bucket_size_bytes: int,
                 what: str) -> None:
        self.decision, self.dist, self.item, self.sizes = decision, dist, item, sizes
        self.share, self.stats, self.what = share, stats, what
        self.storage_config, self.bucket_size_bytes = storage_config, bucket_size_bytes
        self.offsets, self.data_bytes = segment_layout(sizes)
        self.mapping: WritableMapping | None = None
        self.bufs: list[torch.Tensor] | None = None  # this rank's destination of each blob
        self.leader = share is not None and share.segment is not None
        self._prefault: threading.Thread | None = None

    def _join_prefault(self) -> None:
        if self._prefault is not None:
            self._prefault.join()
            self._prefault = None

    def close(self) -> None:
        self._join_prefault()
        self.bufs = None
        if self.mapping is not None:
            self.mapping.close(strict=False)
            self.mapping = None
        if self.share is not None:
            self.share.close()

    def run(self, plan: str) -> dict[int, torch.Tensor]:
        dist, share, what = self.dist, self.share, self.what
        # who fills a copy: every rank (its own, or its share of its host's), or the leaders
        fills = share is None or plan == STRIPED or (self.leader and (
            plan == PER_HOST or len(share.hosts) > 1 or dist.rank == 0))
        self._allocate(fills, plan)
        saved = blob_tensors(self.decision.manifest, self.item)
        # one reader fills its host's copy (per_host, all_ranks, broadcast on one host):
        # checked bytes go in with pwrite, no page of the segment faulted or zeroed first
        sink = None
        if self.mapping is not None and share is not None and self._reads_alone(plan, share):
            sink = share.copy_fd()
        reqs = [BoxRequest(b, Box((0,), (int(t.numel()),)), t, fresh=True,
                           file=None if sink is None else (sink, HEADER_BYTES + self.offsets[b]))
                for b, t in enumerate(self.bufs or [])]
        mine = RankRequests([], reqs, {}, [], [None] * len(reqs))
        kw: dict[str, Any] = {"storage_config": self.storage_config, "what": what,
                              "stats": self.stats, "bucket_size_bytes": self.bucket_size_bytes}
        t0 = time.perf_counter()
        if plan == STRIPED:
            flat = None  # without host memory: each rank's rows to every other rank
            if share is not None:  # the leaders all-gather their host's rows of its segment
                member = [k for r in range(dist.world_size)
                          for k, h in enumerate(share.hosts) if r in h]
                group = share.leaders_dist  # None off the leaders, or with one host
                flat = FlatExchange(group, member, None if group is None or self.mapping is None
                                    else self.mapping.data, self.offsets, ALIGN_BYTES,
                                    share.leaders)
            move_boxes(self.decision, dist, saved, mine, strategy=STRIPED, flat=flat, **kw)
            flat = None  # its view of the segment: gone before the seal
        elif plan == BROADCAST and (share is None or len(share.hosts) > 1):
            if share is None:  # rank 0 reads and sends to every rank
                move_boxes(self.decision, dist, saved, mine, strategy=BROADCAST, **kw)
            else:  # ... to the other hosts' leaders; the other ranks wait for the outcome
                dist.run_on_subgroup(
                    share.leaders_dist, share.leaders,
                    lambda leaders: move_boxes(self.decision, leaders, saved, mine,
                                               strategy=BROADCAST, **kw),
                    f"{what}: rank 0 reads and sends the state to the hosts' leaders")
        else:  # each rank that fills a copy reads it (per_host, all_ranks, one host)
            move_boxes(self.decision, dist, saved, mine, strategy=ALL_RANKS, **kw)
        self.stats.read_seconds = time.perf_counter() - t0
        if share is None:
            assert self.bufs is not None  # every rank filled its own
            bufs, self.bufs = self.bufs, None
            return dict(enumerate(bufs))
        return self._seal_and_map(share, mine)

    @staticmethod
    def _reads_alone(plan: str, share: HostShare) -> bool:
        """Whether the one rank that fills its host's copy reads all of it from storage (no
        other rank writes into it, nothing arrives over a collective)."""
        return plan != STRIPED and not (plan == BROADCAST and len(share.hosts) > 1)

    def _allocate(self, fills: bool, plan: str) -> None:
        """This rank's copy, or (host memory) its host's segment sized by the leader, then
        mapped writable by the ranks that fill it (two steps: sized before any rank maps)."""
        dist, share, what = self.dist, self.share, self.what
        if share is None:
            def own() -> None:  # one buffer per blob: the tensors of one keep no other alive
                self.bufs = [fresh_tensor((n,), torch.uint8) for n in self.sizes]

            dist.run_collectively(own, f"{what}: allocate the state's destination")
            return
        dist.run_collectively(lambda: share.own_segment().size_for(self.sizes)
                              if self.leader else None, f"{what}: size host shared memory")

        def map_for_filling() -> None:
            if not fills:
                return
            self.mapping = WritableMapping(share.copy_fd(), self.sizes)
            self.bufs = self.mapping.views
            if self.leader and len(share.hosts) > 1 and not self._reads_alone(plan, share):
                # other hosts' bytes land in it: fault its pages in while the reads wait on
                # the network (measured: first touches made the exchange 2-3x slower)
                self._prefault = threading.Thread(target=self.mapping.prefault,
                                                  name="xla_ckpt-prefault", daemon=True)
                self._prefault.start()

        dist.run_collectively(map_for_filling, f"{what}: map host shared memory to fill it")

    def _seal_and_map(self, share: HostShare, mine: RankRequests) -> dict[int, torch.Tensor]:
        dist, what = self.dist, self.what
        mine.requests.clear()  # the writable views: every one must be gone before the seal

        def unmap() -> None:
            self._join_prefault()
            self.bufs = None
            if self.mapping is not None:
                self.mapping.close()
                self.mapping = None

        dist.run_collectively(unmap, f"{what}: unmap host shared memory")
        dist.run_collectively(share.own_segment().seal if self.leader else lambda: None,
                              f"{what}: seal host shared memory")
        fd = share.copy_fd()
        views = dist.run_collectively(lambda: map_private(fd, self.sizes),
                                      f"{what}: map host shared memory")
        self.stats.bytes_mapped = 0 if self.leader else sum(self.sizes)
        return dict(enumerate(views))


def blob_reads(manifest: Manifest, item: str, world_size: int) -> list[list[tuple[int, int, int]]]:
    """What each rank fetches of the replicated item's blobs in the striped plan: per rank,
    ``(blob, start, stop)`` byte ranges (whole crc32c chunks, or whole blobs with one
    crc32c).  Pure and the same on every rank: :func:`~xla_ckpt.restore.box_striped.
    plan_blocks` of every rank requesting every blob whole, with or without host memory."""
    saved = blob_tensors(manifest, item)
    desc = [[b, [0], [gt.shape[0]]] for b, gt in enumerate(saved.globals)]
    reads, _, _ = plan_blocks([desc] * world_size, unit_rows(saved), lambda g, sizes: 1)
    return [[(b.index, b.lo, b.hi) for b in reads[r]] for r in range(world_size)]
