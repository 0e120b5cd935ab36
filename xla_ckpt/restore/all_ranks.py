"""Every rank reads: each rank fetches what it needs straight from storage, in parallel.

The TPU default (DESIGN "restore"): no tensor bytes cross the collective.
Each rank reads the replicated state item, its own ``rank/<r>`` item, and
only the byte ranges of the sharded tensors that make up its partition
(:meth:`CheckpointReader.read_blob_range`, crc32c-checked per chunk).  A
failure on any rank reaches every rank through one agreement step.
"""

from __future__ import annotations

import logging
import time

import torch

from xla_ckpt.comm.base import Dist
from xla_ckpt.comm.buckets import byte_view
from xla_ckpt.format.dtypes import dtype_from_name, itemsize
from xla_ckpt.format.plan import MapLocation, materialize_item, resolve_device
from xla_ckpt.io import CheckpointReader
from xla_ckpt.restore.decide import Decision
from xla_ckpt.restore.plan import RankPlan
from xla_ckpt.restore.result import Loaded, RestoreStats
from xla_ckpt.restore.sharding import ShardedTensorLayout
from xla_ckpt.storage import StorageConfig, open_storage

logger = logging.getLogger(__name__)


def read_shard_range(reader: CheckpointReader, layout: ShardedTensorLayout, lo: int,
                     hi: int) -> tuple[torch.Tensor, int]:
    """Elements ``[lo, hi)`` of a flat sharded tensor, read by byte range from the saved shards.

    Returns:
        (CPU tensor of ``hi - lo`` elements of the saved dtype, bytes fetched
        from storage — whole crc32c chunks, so a little more than asked).
    """
    dtype = dtype_from_name(layout.dtype, where=layout.key)
    isz = itemsize(dtype)
    out = torch.empty(hi - lo, dtype=dtype)
    out_bytes = byte_view(out)
    fetched = 0
    for piece, a, b in layout.overlapping(lo, hi):
        start, length = piece.byte_range(a, b)
        data = reader.read_blob_range(piece.item, piece.record.blob, start, length)
        out_bytes[(a - lo) * isz:(b - lo) * isz].copy_(data)
        fetched += _fetched_bytes(reader, piece.item, piece.record.blob, start, length)
    return out, fetched


def _fetched_bytes(reader: CheckpointReader, item: str, blob: int, start: int, length: int) -> int:
    rec = reader.manifest.item(item).blobs[blob]
    if not rec.chunk_crc32c:
        return rec.length
    c = rec.chunk_size
    return min(rec.length, -(-(start + length) // c) * c) - (start // c) * c


def place(t: torch.Tensor, map_location: MapLocation, key: str) -> torch.Tensor:
    """Move a restored CPU tensor where ``map_location`` says (CPU when None)."""
    dev = resolve_device(map_location, key)
    return t if dev is None or dev.type == "cpu" else t.to(dev)


def restore_all_ranks(decision: Decision, dist: Dist, plan: RankPlan, *,
                      map_location: MapLocation, storage_config: StorageConfig | None,
                      what: str) -> Loaded:
    """Every rank calls this; each reads its own part of the checkpoint.

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
            reader = CheckpointReader(storage, manifest)
            state, nread = None, 0
            if plan.with_state:
                bufs = reader.read_blobs(plan.item)
                nread = sum(b.numel() for b in bufs.values())
                state = materialize_item(manifest.item(plan.item), bufs, map_location)
            rank_state = None
            if plan.rank_item is not None:
                rbufs = reader.read_blobs(plan.rank_item)
                nread += sum(b.numel() for b in rbufs.values())
                rank_state = materialize_item(manifest.item(plan.rank_item), rbufs, map_location)
            shards = {}
            for key, (lo, hi) in plan.shards.items():
                t, n = read_shard_range(reader, plan.layout[key], lo, hi)
                nread += n
                shards[key] = place(t, map_location, key)
        finally:
            storage.close()
        stats = RestoreStats(bytes_read=nread, read_seconds=time.perf_counter() - t0)
        return Loaded(state=state, rank_state=rank_state, shards=shards, stats=stats)

    return dist.run_collectively(work, what)
