"""Rank 0 reads, then the data plane fans the bytes out (the CUDA/NCCL and gloo default).

Order of steps (every rank enters every step, whatever happened locally):

1. the manifest has already reached every rank (:mod:`xla_ckpt.restore.decide`),
   so receivers know every blob's length: they preallocate exactly the
   destination buffers and pass nothing else;
2. rank 0 reads the blobs from storage (crc32c-checked) while receivers
   allocate; one agreement step turns a failure anywhere into the same
   :class:`~xla_ckpt.errors.DistributedError` on every rank;
3. the replicated item's blob buffers are broadcast in buckets of at most
   ``bucket_size_bytes`` straight into the receivers' buffers
   (:meth:`Dist.broadcast_tensors`);
4. each rank's own ``rank/<r>`` item and its partition of the sharded
   tensors go point to point from rank 0 to that rank only
   (:meth:`Dist.scatter_tensors`) — the full sharded state is never broadcast;
5. every rank rebuilds the same state from the same bytes with
   :func:`~xla_ckpt.format.plan.materialize_item` (aliasing, dtypes, empty
   tensors survive), placing tensors on its own ``map_location``.

Receiver memory: the state's blobs plus one staging bucket.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from xla_ckpt.dist.base import Dist
from xla_ckpt.format.manifest import Item
from xla_ckpt.format.plan import MapLocation, materialize_item
from xla_ckpt.io import CheckpointReader
from xla_ckpt.restore.all_ranks import place
from xla_ckpt.restore.decide import Decision
from xla_ckpt.restore.plan import RankPlan
from xla_ckpt.restore.result import Loaded
from xla_ckpt.storage import StorageConfig, open_storage

logger = logging.getLogger(__name__)


def _alloc(item: Item) -> dict[int, torch.Tensor]:
    return {i: torch.empty(b.length, dtype=torch.uint8) for i, b in enumerate(item.blobs)}


def _assemble(key: str, plan: RankPlan, saved: dict[str, dict[int, torch.Tensor]]) -> torch.Tensor:
    """On rank 0: the bytes of ``plan``'s range of sharded tensor ``key`` (a view when possible)."""
    lo, hi = plan.shards[key]
    parts = []
    for piece, a, b in plan.layout[key].overlapping(lo, hi):
        start, length = piece.byte_range(a, b)
        parts.append(saved[piece.item][piece.record.blob][start:start + length])
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def restore_broadcast(decision: Decision, dist: Dist, plans: list[RankPlan], *,
                      map_location: MapLocation, storage_config: StorageConfig | None,
                      bucket_size_bytes: int, what: str) -> Loaded:
    """Every rank calls this; rank 0 reads, every rank ends with its own state.

    Args:
        plans: every rank's :class:`RankPlan` (identical lists on every rank).

    Raises:
        DistributedError: on every rank when rank 0's read (or any rank's
            allocation or rebuild) failed; ``failures`` names rank and cause.
        CollectiveTimeoutError: a rank died or hung during a collective.
    """
    manifest = decision.manifest
    me = plans[dist.rank]
    is_src = dist.rank == 0
    keys = sorted(me.shards)

    def read() -> dict[str, Any]:
        t0 = time.perf_counter()
        out: dict[str, Any] = {"state": _alloc(manifest.item(me.item)), "bytes_read": 0}
        out["rank"] = _alloc(manifest.item(me.rank_item)) if me.rank_item else {}
        if not is_src:
            out["shards"] = [torch.empty(me.shard_nbytes(k), dtype=torch.uint8) for k in keys]
            return out
        storage = open_storage(decision.checkpoint, storage_config)
        try:
            reader = CheckpointReader(storage, manifest)
            reader.read_into(me.item, out["state"])
            nread = sum(b.numel() for b in out["state"].values())
            others: dict[int, dict[int, torch.Tensor]] = {}
            for p in plans:
                if p.rank_item is None:
                    continue
                bufs = out["rank"] if p.rank == 0 else reader.read_blobs(p.rank_item)
                if p.rank == 0:
                    reader.read_into(p.rank_item, bufs)
                others[p.rank] = bufs
                nread += sum(b.numel() for b in bufs.values())
            saved: dict[str, dict[int, torch.Tensor]] = {}
            for lay in me.layout.values():
                for piece in lay.pieces:
                    if piece.item not in saved:
                        saved[piece.item] = reader.read_blobs(piece.item)
                        nread += sum(b.numel() for b in saved[piece.item].values())
            out["rank_inputs"] = {r: [bufs[i] for i in sorted(bufs)] for r, bufs in others.items()}
            out["shard_inputs"] = {p.rank: [_assemble(k, p, saved) for k in keys] for p in plans}
            out["shards"] = out["shard_inputs"][0]
        finally:
            storage.close()
        out["bytes_read"] = nread
        out["read_seconds"] = time.perf_counter() - t0
        return out

    got = dist.run_collectively(read, f"{what}: rank 0 reads, receivers allocate")
    received = sent = 0
    state_bufs = got["state"]
    n = dist.broadcast_tensors([state_bufs[i] for i in sorted(state_bufs)], src=0,
                               bucket_size_bytes=bucket_size_bytes)
    if not is_src:
        received += n
    if any(p.rank_item for p in plans):
        rank_bufs = got["rank"]
        n = dist.scatter_tensors([rank_bufs[i] for i in sorted(rank_bufs)],
                                 got.get("rank_inputs"), src=0,
                                 bucket_size_bytes=bucket_size_bytes)
        sent, received = (sent + n, received) if is_src else (sent, received + n)
    if keys:
        if all(p.shards == me.shards for p in plans):  # zero_sharding="none": one broadcast
            n = dist.broadcast_tensors(got["shards"], src=0, bucket_size_bytes=bucket_size_bytes)
            received += 0 if is_src else n
        else:
            n = dist.scatter_tensors(got["shards"], got.get("shard_inputs"), src=0,
                                     bucket_size_bytes=bucket_size_bytes)
            sent, received = (sent + n, received) if is_src else (sent, received + n)
    got.pop("rank_inputs", None)
    got.pop("shard_inputs", None)

    def build() -> Loaded:
        state = materialize_item(manifest.item(me.item), state_bufs, map_location)
        rank_state = None
        if me.rank_item is not None:
            rank_state = materialize_item(manifest.item(me.rank_item), got["rank"], map_location)
        shards = {}
        for k, raw in zip(keys, got["shards"]):
            t = raw.view(me.shard_dtype(k)) if raw.numel() else torch.empty(0, dtype=me.shard_dtype(k))
            shards[k] = place(t.clone() if is_src else t, map_location, k)
        return Loaded(state=state, rank_state=rank_state, shards=shards,
                      bytes_read=got["bytes_read"], bytes_received=received, bytes_sent=sent,
                      read_seconds=got.get("read_seconds", 0.0))

    return dist.run_collectively(build, f"{what}: rebuild the state")
