"""The striped plan: every byte of the replicated state is fetched from storage once per job.

Megatron's fully parallel load splits the read across data-parallel ranks and exchanges the
pieces; Orbax's single-replica load reads once and broadcasts.  This plan does the first on
every rank of the job, hosts first (DESIGN "Each byte once"; issue 13):

1. **Plan** (:func:`plan_stripes`, pure, the same on every rank): the replicated item's bytes,
   in the order of the host's segment, are cut at crc32c-chunk boundaries (a blob with one
   crc32c for all its bytes stays whole) into one contiguous run per host of about equal
   bytes (a host's network link is the bottleneck), each host's run into one per rank of the
   host, and each rank's run into *stripes*; every byte has exactly one reader.
2. **Read**: every rank fetches its own stripes with the ranged, checked reads of
   :class:`~xla_ckpt.io.CheckpointReader` (every byte crc32c-checked before it is passed on).
   With host shared memory (:mod:`xla_ckpt.restore.host_share`) each rank ``pwrite``\\ s its
   checked stripes straight into its host's memfd segment; without it, into buffers of its own.
3. **Exchange**: the stripes read on one host reach the other hosts with
   :meth:`Dist.all_gather_tensors` over the host leaders' subgroup (bounded buckets; gloo on
   CPU, NCCL on GPU, the XLA data plane when enabled), each host's run as one range of its
   segment (:func:`exchange_ranges`: bucket-sized slices sent and received in place, no
   staging copy), received straight into the leaders' segments.  Within a host nothing is
   copied: the leader seals its segment and every rank of the host maps it copy-on-write.
   Without host shared memory every rank is a "host" of its own and the all-gather runs over
   all ranks.
4. **Private bytes**: each rank reads its own ``rank/<r>`` item and ZeRO partition itself
   (those bytes are needed by one rank only, so they are fetched once too), as boxes of the
   engine (:mod:`xla_ckpt.restore.engine`).

Every step is entered by every rank and ends in an agreement, so a failed or dead reader
makes every rank raise one :class:`~xla_ckpt.errors.DistributedError` naming it (or a
:class:`~xla_ckpt.errors.CollectiveTimeoutError` after ``dist.timeout_s`` for a stalled one).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from xla_ckpt.comm.base import Dist
from xla_ckpt.comm.host_memory import ALIGN_BYTES, HEADER_BYTES, map_private, segment_layout
from xla_ckpt.format.manifest import Item
from xla_ckpt.format.plan import MapLocation, materialize_item
from xla_ckpt.io import CheckpointReader
from xla_ckpt.io.planning import COALESCE_BLOB_BYTES
from xla_ckpt.restore.assign import balance
from xla_ckpt.restore.decide import Decision
from xla_ckpt.restore.host_share import STAGING_BUFFERS, HostShare, negotiate
from xla_ckpt.restore.plan import RankPlan
from xla_ckpt.restore.result import Loaded, RestoreStats
from xla_ckpt.storage import StorageConfig, open_storage

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
MIN_STRIPE_BYTES = 1 * MiB
STRIPES_PER_READER = 4  # stripes per reader (their size bounds a run of small blobs per request)


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


def _atoms(item: Item) -> list[tuple[int, int, int]]:
    """The smallest pieces a reader may fetch and check alone, in segment order (blob index,
    then offset): each crc32c chunk of a large blob; a small blob (at most
    :data:`COALESCE_BLOB_BYTES`) or one with a single crc32c for all its bytes, whole."""
    out: list[tuple[int, int, int]] = []
    for i, rec in enumerate(item.blobs):
        if not rec.length:
            continue
        if rec.length <= COALESCE_BLOB_BYTES or not rec.chunk_crc32c:
            out.append((i, 0, rec.length))
        else:
            c = rec.chunk_size
            out.extend((i, st, min(c, rec.length - st)) for st in range(0, rec.length, c))
    return out


def _whole(item: Item, blob: int) -> bool:
    """True if ``blob`` is read whole: at most :data:`COALESCE_BLOB_BYTES`, or one crc32c for
    all its bytes."""
    rec = item.blobs[blob]
    return rec.length <= COALESCE_BLOB_BYTES or not rec.chunk_crc32c


def _group(atoms: Sequence[tuple[int, int, int]], item: Item,
           stripe_bytes: int) -> list[tuple[tuple[int, int, int], ...]]:
    """One reader's consecutive atoms as stripes: chunks of one blob joined into ranges of
    whole chunks of at most ``stripe_bytes`` (at least one chunk); small blobs back to back in
    one data file joined up to ``stripe_bytes`` (one ranged request fetches them)."""
    out: list[list[tuple[int, int, int]]] = []
    size = 0
    for b, st, n in atoms:
        if out and size + n <= stripe_bytes:
            pb, pst, pn = out[-1][-1]
            rec, prev = item.blobs[b], item.blobs[pb]
            c = rec.chunk_size
            if not _whole(item, b) and pb == b and pst + pn == st \
                    and pn + n <= max(c, stripe_bytes // c * c):
                out[-1][-1] = (b, pst, pn + n)  # the next chunk of the same blob
                size += n
                continue
            if _whole(item, b) and _whole(item, pb) and rec.file == prev.file \
                    and prev.offset + prev.length == rec.offset:
                out[-1].append((b, st, n))  # the next small blob of the same file
                size += n
                continue
        out.append([(b, st, n)])
        size = n
    return [tuple(p) for p in out]


def plan_stripes(item: Item, hosts: Sequence[Sequence[int]], stripe_bytes: int) -> list[Stripe]:
    """Cut ``item``'s blobs into stripes and give each to one reader (every rank, the same).

    Args:
        item: the manifest item every rank needs whole (the replicated state).
        hosts: the ranks of each host (every rank of the job once); with no host sharing,
            one rank per "host".
        stripe_bytes: target stripe size (:func:`stripe_size`); large blobs are cut at
            whole crc32c chunks (at least one), small adjacent ones grouped up to it.

    Returns:
        The stripes, in segment order (blob index, then offset); together they cover every
        byte of every blob exactly once.  The blobs' crc32c chunks and small blobs are shared
        out by :func:`xla_ckpt.restore.assign.balance`, first between hosts (equal bytes per
        host: a host's network link is the bottleneck), then between the ranks of each host:
        one contiguous run per host and per rank when that is within 20 % of equal shares
        (the exchange then moves each host's bytes as one range of the host's segment,
        :func:`exchange_ranges`), else runs of at most an eighth of a share given out
        largest first, so every reader is within 25 % of its share whatever the blob sizes
        and their order (unless one crc32c chunk is larger than that).

    Raises:
        ValueError: ``hosts`` is empty or has an empty host.
    """
    if not hosts or any(not h for h in hosts):
        raise ValueError(f"plan_stripes needs at least one rank per host, got {list(hosts)}")
    atoms = _atoms(item)
    sizes = [n for _, _, n in atoms]
    host_of = balance(sizes, list(range(len(hosts))))
    owner = [0] * len(atoms)
    for h, ranks in enumerate(hosts):
        mine = [i for i, x in enumerate(host_of) if x == h]
        for i, r in zip(mine, balance([sizes[i] for i in mine], list(ranks)), strict=True):
            owner[i] = r
    out: list[Stripe] = []
    for ranks in hosts:
        for r in ranks:
            out.extend(Stripe(p, r) for p in _group([a for a, o in zip(atoms, owner, strict=True)
                                                     if o == r], item, stripe_bytes))
    out.sort(key=lambda s: s.parts[0][:2])
    return out


def exchange_ranges(stripes: Sequence[Stripe], sizes: Sequence[int],
                    owner: Mapping[int, int], members: int) -> list[list[tuple[int, int]]]:
    """The byte ranges of the host's segment layout (:func:`segment_layout` of ``sizes``, the
    item's blob sizes) each member of the exchange contributes: ``[[(start, stop), ...], ...]``,
    one list per member (``owner`` maps a reader rank to its member: its host, or itself).

    A member's stripes are merged into as few ranges as possible: touching ranges, and
    ranges apart only by the alignment padding after a blob's end (no byte of any blob lies
    there; the padding travels with them).  With :func:`plan_stripes`' contiguous runs that is
    one range per member, which the all-gather moves in bucket-sized slices in place instead
    of packing every stripe through a staging buffer.
    """
    offsets, _ = segment_layout(sizes)
    spans: list[list[tuple[int, int, bool]]] = [[] for _ in range(members)]
    for s in stripes:
        for b, lo, n in s.parts:
            spans[owner[s.reader]].append((offsets[b] + lo, offsets[b] + lo + n,
                                           lo + n == sizes[b]))
    out: list[list[tuple[int, int]]] = []
    for mine in spans:
        merged: list[tuple[int, int, bool]] = []
        for lo, hi, ends_blob in sorted(mine):
            if merged:
                plo, phi, pends = merged[-1]
                reach = -(-phi // ALIGN_BYTES) * ALIGN_BYTES if pends else phi
                if lo <= reach:  # (spans are disjoint: hi > phi)
                    merged[-1] = (plo, hi, ends_blob)
                    continue
            merged.append((lo, hi, ends_blob))
        out.append([(lo, hi) for lo, hi, _ in merged])
    return out


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
        self.item = self.manifest.item(self.me.item)
        self.sizes = [b.length for b in self.item.blobs]
        self.map_location, self.storage_config = map_location, storage_config
        self.bucket_size_bytes, self.what = bucket_size_bytes, what
        self.host_shared_memory = host_shared_memory
        self.share: HostShare | None = None
        self.stats = RestoreStats(plan="striped")
        self.dest: list[torch.Tensor] = []  # the blobs' destinations: views of self.flat
        self.flat: torch.Tensor | None = None  # one buffer in the segment's layout
        self._prefault: threading.Thread | None = None

    def close(self) -> None:
        if self._prefault is not None:
            self._prefault.join()
        self.dest, self.flat = [], None
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
        state = dist.run_collectively(
            lambda: materialize_item(self.item, bufs, self.map_location),
            f"{what}: rebuild the state")
        self.dest, self.flat = [], None
        return Loaded(state=state, stats=self.stats)

    # ---- steps ------------------------------------------------------------------------
    def _leader(self) -> bool:
        return self.share is not None and self.share.segment is not None

    def _allocate(self) -> None:
        share = self.share
        offsets, data_bytes = segment_layout(self.sizes)
        if share is None:  # this rank's own copy, laid out as a segment (one range per part)
            self.flat = torch.empty(data_bytes, dtype=torch.uint8)
        elif self._leader():  # the host's one copy: the other ranks pwrite into it
            segment = share.own_segment()
            self.flat = segment.writable_data(self.sizes)
            if len(share.hosts) > 1:
                # the stripes other hosts send land in it: fault its pages in while this
                # host's reads wait on the network (measured: first touches made the
                # exchange 2-3x slower), joined before the exchange
                self._prefault = threading.Thread(target=segment.prefault,
                                                  name="xla_ckpt-prefault", daemon=True)
                self._prefault.start()
        else:  # the other ranks of a host pwrite their stripes into the leader's segment
            return
        flat = self.flat
        self.dest = [flat[o:o + n] for o, n in zip(offsets, self.sizes, strict=True)]

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
        """Across hosts: every host's stripes reach every other host (leaders only), each
        host's as the few contiguous ranges of :func:`exchange_ranges` (one, as planned)."""
        dist, share = self.dist, self.share
        group = dist if share is None else share.leaders_dist
        if share is not None and len(share.hosts) == 1:
            return  # one host: its segment already holds every stripe
        # with a shared copy the leaders gather one part per host; without, one per rank
        owner = {r: k for k, h in enumerate(hosts) for r in h} if share is not None else \
            {r: r for r in range(dist.world_size)}
        members = len(hosts) if share is not None else dist.world_size

        def gather() -> int:
            if self._prefault is not None:
                self._prefault.join()
            if group is None:  # not a leader: the leader receives for this host
                return 0
            flat = self.flat
            assert flat is not None  # allocated on every member of the exchange
            ranges = exchange_ranges(stripes, self.sizes, owner, members)
            parts = [[flat[lo:hi] for lo, hi in spans] for spans in ranges]
            group.all_gather_tensors(parts, bucket_size_bytes=self.bucket_size_bytes)
            # the blobs' bytes the others sent (the padding between blobs is not counted)
            return sum(s.length for s in stripes if owner[s.reader] != group.rank)

        self.stats.bytes_received = dist.run_collectively(
            gather, f"{self.what}: exchange the stripes between hosts")

    def _finish(self) -> dict[int, torch.Tensor]:
        """The state's blob buffers on this rank: its own, or its host's sealed copy mapped."""
        dist, share = self.dist, self.share
        if share is None:
            return dict(enumerate(self.dest))
        self.dest, self.flat = [], None  # the writable views: then the segment can be sealed
        dist.run_collectively(share.own_segment().seal if self._leader() else lambda: None,
                              f"{self.what}: seal host shared memory")
        fd = share.copy_fd()
        views = dist.run_collectively(lambda: map_private(fd, self.sizes),
                                      f"{self.what}: map host shared memory")
        self.stats.bytes_mapped = 0 if self._leader() else sum(self.sizes)
        return dict(enumerate(views))
