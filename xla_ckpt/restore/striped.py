"""The striped plan: every byte of the replicated state is fetched from storage once per job.

Megatron's fully parallel load splits the read across data-parallel ranks and exchanges the
pieces; Orbax's single-replica load reads once and broadcasts.  This plan does the first on
every rank of the job, hosts first (DESIGN "Each byte once"; issue 13):

1. **Plan** (:func:`plan_stripes`, pure, the same on every rank): the replicated item's blobs
   are cut into *stripes* at crc32c-chunk boundaries (a blob with one crc32c for all its
   bytes is one stripe); each stripe goes to exactly one reader, balancing bytes per host
   first (a host's network link is the bottleneck) and then per rank within the host.
2. **Read**: every rank fetches its own stripes with the ranged, checked reads of
   :class:`~xla_ckpt.io.CheckpointReader` (every byte crc32c-checked before it is passed on).
   With host shared memory (:mod:`xla_ckpt.restore.host_share`) each rank ``pwrite``\\ s its
   checked stripes straight into its host's memfd segment; without it, into buffers of its own.
3. **Exchange**: the stripes read on one host reach the other hosts with
   :meth:`Dist.all_gather_tensors` over the host leaders' subgroup (bounded buckets; gloo on
   CPU, NCCL on GPU, the XLA data plane when enabled), received straight into the leaders'
   segments.  Within a host nothing is copied: the leader seals its segment and every rank
   of the host maps it copy-on-write.  Without host shared memory every rank is a "host" of
   its own and the all-gather runs over all ranks.
4. **Private bytes**: each rank reads its own ``rank/<r>`` item and ZeRO partition itself
   (those bytes are needed by one rank only, so they are fetched once too).

Every step is entered by every rank and ends in an agreement, so a failed or dead reader
makes every rank raise one :class:`~xla_ckpt.errors.DistributedError` naming it (or a
:class:`~xla_ckpt.errors.CollectiveTimeoutError` after ``dist.timeout_s`` for a stalled one).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from xla_ckpt.comm.base import Dist
from xla_ckpt.comm.host_memory import HEADER_BYTES, map_private, segment_layout
from xla_ckpt.format.manifest import Item
from xla_ckpt.format.plan import MapLocation, materialize_item
from xla_ckpt.io import CheckpointReader
from xla_ckpt.io.reader import COALESCE_BLOB_BYTES
from xla_ckpt.restore.all_ranks import restore_all_ranks
from xla_ckpt.restore.decide import Decision
from xla_ckpt.restore.host_share import STAGING_BUFFERS, HostShare, negotiate
from xla_ckpt.restore.plan import RankPlan
from xla_ckpt.restore.result import Loaded, RestoreStats
from xla_ckpt.storage import StorageConfig, open_storage

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
MIN_STRIPE_BYTES = 1 * MiB
STRIPES_PER_READER = 4  # enough stripes per reader to balance bytes within about a quarter


@dataclass(frozen=True)
class Stripe:
    """Byte ranges of the item's blobs fetched together by rank ``reader``.

    ``parts`` are ``(blob, start, length)``: a chunk-aligned range of one large blob
    (``start`` a multiple of its crc32c chunk size, the end a chunk boundary or the blob's
    end), or several small whole blobs that sit back to back in one data file (one ranged
    request fetches them all), so the reader checks every byte it passes on.
    """

    parts: tuple[tuple[int, int, int], ...]
    reader: int

    @property
    def length(self) -> int:
        """Bytes of the stripe."""
        return sum(n for _, _, n in self.parts)


def stripe_size(total_bytes: int, readers: int, slice_bytes: int) -> int:
    """Target stripe bytes: about :data:`STRIPES_PER_READER` per reader, at most one read
    slice (``StorageConfig.slice_size_bytes``), at least :data:`MIN_STRIPE_BYTES`."""
    want = -(-total_bytes // max(1, readers * STRIPES_PER_READER))
    return max(MIN_STRIPE_BYTES, min(slice_bytes, want))


def _pieces(item: Item, stripe_bytes: int) -> list[tuple[tuple[int, int, int], ...]]:
    """The stripes' parts (see :class:`Stripe`), in file order: large blobs cut at chunk
    boundaries into pieces of about ``stripe_bytes``; runs of small blobs adjacent in one
    file grouped up to ``stripe_bytes``."""
    out: list[tuple[tuple[int, int, int], ...]] = []
    run: list[tuple[int, int, int]] = []
    run_bytes, run_end, run_file = 0, -1, ""
    order = sorted((i for i, rec in enumerate(item.blobs) if rec.length),
                   key=lambda i: (item.blobs[i].file, item.blobs[i].offset))
    for i in order:
        rec = item.blobs[i]
        small = rec.length <= COALESCE_BLOB_BYTES or not rec.chunk_crc32c
        if small and run and rec.file == run_file and rec.offset == run_end \
                and run_bytes + rec.length <= stripe_bytes:
            run.append((i, 0, rec.length))
            run_bytes += rec.length
        else:
            if run:
                out.append(tuple(run))
            run, run_bytes = [], 0
            if small:
                run, run_bytes = [(i, 0, rec.length)], rec.length
            else:
                c = rec.chunk_size
                step = max(c, stripe_bytes // c * c)
                out.extend(((i, st, min(step, rec.length - st)),)
                           for st in range(0, rec.length, step))
        run_end, run_file = rec.offset + rec.length, rec.file
    if run:
        out.append(tuple(run))
    return out


def plan_stripes(item: Item, hosts: Sequence[Sequence[int]], stripe_bytes: int) -> list[Stripe]:
    """Cut ``item``'s blobs into stripes and give each to one reader (every rank, the same).

    Args:
        item: the manifest item every rank needs whole (the replicated state).
        hosts: the ranks of each host (every rank of the job once); with no host sharing,
            one rank per "host".
        stripe_bytes: target stripe size (:func:`stripe_size`); large blobs are cut at
            whole crc32c chunks (at least one), small adjacent ones grouped up to it.

    Returns:
        The stripes in file order; together they cover every byte of every blob exactly
        once.  Assignment is greedy, largest stripe first, to the host with the fewest
        bytes so far and within it the rank with the fewest (ties: the lower index), so
        per-host bytes differ by at most one stripe.

    Raises:
        ValueError: ``hosts`` is empty or has an empty host.
    """
    if not hosts or any(not h for h in hosts):
        raise ValueError(f"plan_stripes needs at least one rank per host, got {list(hosts)}")
    pieces = _pieces(item, stripe_bytes)
    host_load = [0] * len(hosts)
    rank_load = {r: 0 for h in hosts for r in h}
    owner = [0] * len(pieces)
    sizes = [sum(n for _, _, n in p) for p in pieces]
    for k in sorted(range(len(pieces)), key=lambda k: (-sizes[k], k)):
        h = min(range(len(hosts)), key=lambda j: (host_load[j], j))
        r = min(hosts[h], key=lambda x: (rank_load[x], x))
        host_load[h] += sizes[k]
        rank_load[r] += sizes[k]
        owner[k] = r
    return [Stripe(p, owner[k]) for k, p in enumerate(pieces)]


def ranges_of(stripes: Sequence[Stripe], rank: int) -> dict[int, list[tuple[int, int]]]:
    """``{blob: [(start, length), ...]}`` of the stripes ``rank`` reads."""
    out: dict[int, list[tuple[int, int]]] = {}
    for s in stripes:
        if s.reader == rank:
            for blob, start, n in s.parts:
                out.setdefault(blob, []).append((start, n))
    return out


def restore_striped(decision: Decision, dist: Dist, plans: list[RankPlan], *,
                    map_location: MapLocation, storage_config: StorageConfig | None,
                    bucket_size_bytes: int, what: str, host_shared_memory: bool = True) -> Loaded:
    """Every rank calls this; every rank ends with the whole replicated state, fetched once.

    Args:
        plans: every rank's :class:`RankPlan` (identical lists on every rank).
        bucket_size_bytes: largest single collective of the exchange across hosts.
        host_shared_memory: True: one copy of the state per host (a sealed memfd every
            rank of the host maps), stripes written into it by the host's readers; False
            (or sharing impossible, reason in ``stats.data_path``): each rank holds its own
            copy and the exchange runs over all ranks.

    Returns:
        :class:`Loaded`; ``stats.bytes_read`` is this rank's stripes plus its private
        bytes, ``stats.bytes_received`` what the exchange brought it, ``stats.bytes_mapped``
        the bytes it maps from its leader's segment instead of holding them.

    Raises:
        DistributedError: on every rank when a rank's read, allocation, exchange or
            rebuild failed (``failures`` names the rank and cause: IntegrityError,
            StorageError...).
        CollectiveTimeoutError: a rank died or stalled (nothing waits beyond
            ``dist.timeout_s``).
    """
    run = _Striped(decision, dist, plans, map_location=map_location,
                   storage_config=storage_config, bucket_size_bytes=bucket_size_bytes,
                   what=what, host_shared_memory=host_shared_memory)
    try:
        return run.run()
    finally:
        run.close()


class _Striped:
    """One striped restore on this rank (see the module docstring for the steps)."""

    def __init__(self, decision: Decision, dist: Dist, plans: list[RankPlan], *,
                 map_location: MapLocation, storage_config: StorageConfig | None,
                 bucket_size_bytes: int, what: str, host_shared_memory: bool) -> None:
        self.decision, self.dist, self.plans = decision, dist, plans
        self.me = plans[dist.rank]
        self.manifest = decision.manifest
        self.item = self.manifest.item(self.me.item) if self.me.with_state else Item(state=None)
        self.sizes = [b.length for b in self.item.blobs]
        self.map_location, self.storage_config = map_location, storage_config
        self.bucket_size_bytes, self.what = bucket_size_bytes, what
        self.host_shared_memory = host_shared_memory
        self.share: HostShare | None = None
        self.stats = RestoreStats(plan="striped")
        self.dest: list[torch.Tensor] = []
        self._prefault: threading.Thread | None = None

    def close(self) -> None:
        if self._prefault is not None:
            self._prefault.join()
        self.dest = []
        if self.share is not None:
            self.share.close()

    def run(self) -> Loaded:
        dist, what = self.dist, self.what
        total = sum(self.sizes)
        self.share, why = negotiate(dist, self.host_shared_memory, total, what, writable=True,
                                    plan="striped")
        share = self.share
        if share is not None:
            hosts = share.hosts
        else:  # no shared copy, but the host links are still shared: balance per host
            by_host: dict[int, list[int]] = {}
            for r, h in enumerate(dist.exchange(dist.topology.host_id)):
                by_host.setdefault(h, []).append(r)
            hosts = sorted(by_host.values(), key=lambda ranks: ranks[0])
        readers = dist.world_size
        cfg = self.storage_config or StorageConfig()
        stripes = plan_stripes(self.item, hosts, stripe_size(total, readers,
                                                             cfg.slice_size_bytes))
        self.stats.data_path = (why if share is not None else
                                f"stripes all-gathered over {dist.backend} between every rank "
                                f"({why})")
        if dist.rank == 0:
            logger.info("rank 0: %s: %d stripes over %d host(s) x %d reader(s); %s", what,
                        len(stripes), len(hosts), readers, self.stats.data_path)
        dist.run_collectively(self._allocate, f"{what}: allocate the stripes' destination")
        t0 = time.perf_counter()
        mine = ranges_of(stripes, dist.rank)
        self.stats.bytes_read = dist.run_collectively(lambda: self._read(mine),
                                                      f"{what}: read this rank's stripes")
        self.stats.read_seconds = time.perf_counter() - t0
        self._exchange(stripes, hosts)
        bufs = self._finish()
        state = None
        if self.me.with_state:
            state = dist.run_collectively(
                lambda: materialize_item(self.item, bufs, self.map_location),
                f"{what}: rebuild the state")
        loaded = Loaded(state=state, stats=self.stats)
        self.dest = []
        if any(p.rank_item is not None or p.shards for p in self.plans):
            rest = restore_all_ranks(self.decision, dist,
                                     dataclasses.replace(self.me, with_state=False),
                                     map_location=self.map_location,
                                     storage_config=self.storage_config, what=what)
            loaded.rank_state, loaded.shards = rest.rank_state, rest.shards
            self.stats.bytes_read += rest.stats.bytes_read
        return loaded

    # ---- steps ------------------------------------------------------------------------
    def _leader(self) -> bool:
        return self.share is not None and self.share.segment is not None

    def _allocate(self) -> None:
        share = self.share
        if share is None:
            self.dest = [torch.empty(n, dtype=torch.uint8) for n in self.sizes]
        elif self._leader():  # the host's one copy: the other ranks pwrite into it
            segment = share.own_segment()
            self.dest = segment.writable_views(self.sizes)
            if len(share.hosts) > 1:
                # the stripes other hosts send land in it: fault its pages in while this
                # host's reads wait on the network (measured: first touches made the
                # exchange 2-3x slower), joined before the exchange
                self._prefault = threading.Thread(target=segment.prefault,
                                                  name="xla_ckpt-prefault", daemon=True)
                self._prefault.start()

    def _read(self, mine: dict[int, list[tuple[int, int]]]) -> int:
        if not mine:
            return 0
        storage = open_storage(self.decision.checkpoint, self.storage_config)
        try:
            reader = CheckpointReader(storage, self.manifest)
            if self.share is None:
                return reader.read_ranges_into(self.me.item, dict(enumerate(self.dest)), mine)
            offsets, _ = segment_layout(self.sizes)
            reader.read_into_file(self.me.item, self.share.copy_fd(),
                                  {b: HEADER_BYTES + offsets[b] for b in mine},
                                  staging_buffers=min(storage.config.max_workers,
                                                      STAGING_BUFFERS), ranges=mine)
            return reader.stats.bytes_read
        finally:
            storage.close()

    def _exchange(self, stripes: Sequence[Stripe], hosts: Sequence[Sequence[int]]) -> None:
        """Across hosts: every host's stripes reach every other host (leaders only)."""
        dist, share = self.dist, self.share
        group = dist if share is None else share.leaders_dist
        if share is not None and len(share.hosts) == 1:
            return  # one host: its segment already holds every stripe
        # with a shared copy the leaders gather one part per host; without, one per rank
        owner = {r: k for k, h in enumerate(hosts) for r in h} if share is not None else \
            {r: r for r in range(dist.world_size)}

        def gather() -> int:
            if self._prefault is not None:
                self._prefault.join()
            if group is None:  # not a leader: the leader receives for this host
                return 0
            parts: list[list[torch.Tensor]] = [[] for _ in range(group.world_size)]
            for s in stripes:
                parts[owner[s.reader]].extend(self.dest[b][lo:lo + n] for b, lo, n in s.parts)
            return group.all_gather_tensors(parts, bucket_size_bytes=self.bucket_size_bytes)

        self.stats.bytes_received = dist.run_collectively(
            gather, f"{self.what}: exchange the stripes between hosts")

    def _finish(self) -> dict[int, torch.Tensor]:
        """The state's blob buffers on this rank: its own, or its host's sealed copy mapped."""
        dist, share = self.dist, self.share
        if share is None:
            return dict(enumerate(self.dest))
        self.dest = []  # the writable views: the segment can be sealed once they are gone
        dist.run_collectively(share.own_segment().seal if self._leader() else lambda: None,
                              f"{self.what}: seal host shared memory")
        fd = share.copy_fd()
        views = dist.run_collectively(lambda: map_private(fd, self.sizes),
                                      f"{self.what}: map host shared memory")
        self.stats.bytes_mapped = 0 if self._leader() else sum(self.sizes)
        return dict(enumerate(views))
