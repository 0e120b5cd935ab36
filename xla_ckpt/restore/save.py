"""``save_distributed()``: every rank writes its own part, rank 0 commits after all have written.

Layout of what it writes (one checkpoint folder, one manifest)::

    state          rank 0 writes the replicated state
    rank/<r>       rank r writes its private state (iterator position, RNG) if any
    shard/<r>      rank r writes its partitions of the flat sharded tensors
                   (ZeRO optimizer state), with their element ranges

Steps, every rank in the same order: agree on the sharded-tensor layout
(each rank's shard sizes, exchanged); rank 0 picks the save id; every rank
writes its items into one data file (:func:`xla_ckpt.io.writer.write_items`); one agreement step
(a failed write anywhere -> every rank raises, rank 0 deletes the stray
files); the written item records travel to rank 0, which writes the
manifest — the commit marker — with :func:`xla_ckpt.io.commit`; the
committed manifest goes back to every rank.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Mapping

import torch

from xla_ckpt.comm.base import Dist
from xla_ckpt.comm.select import get_dist
from xla_ckpt.errors import DistributedError
from xla_ckpt.format.dtypes import dtype_name
from xla_ckpt.format.manifest import (
    DEFAULT_CHUNK_SIZE_BYTES,
    MANIFEST_NAME,
    STATE_ITEM,
    BlobRecord,
    Item,
    Manifest,
    TensorRecord,
    rank_item,
)
from xla_ckpt.io import WrittenItem, commit, discard, new_save_id
from xla_ckpt.io.writer import write_items
from xla_ckpt.restore.sharding import shard_item, shard_state
from xla_ckpt.storage import StorageConfig, open_storage

logger = logging.getLogger(__name__)


def _item_from_json(d: Mapping[str, Any]) -> Item:
    blobs = [BlobRecord(file=b["file"], offset=b["offset"], length=b["length"],
                        crc32c=b["crc32c"], chunk_size=b["chunk_size"],
                        chunk_crc32c=tuple(b.get("chunk_crc32c", ())))
             for b in d["blobs"]]
    tensors = [TensorRecord(key=t["key"], blob=t["blob"], byte_offset=t["byte_offset"],
                            dtype=t["dtype"], shape=tuple(t["shape"]), stride=tuple(t["stride"]))
               for t in d["tensors"]]
    return Item(state=d["state"], tensors=tensors, blobs=blobs)


def _committed_manifest(storage: Any, save_id: str) -> bytes | None:
    """The manifest bytes at the storage root if they belong to ``save_id`` (else None)."""
    try:
        data = storage.read_bytes(MANIFEST_NAME)
        return data if Manifest.from_json_bytes(data).save_id == save_id else None
    except Exception:  # noqa: BLE001 - absent or unreadable: not committed
        return None


def _shard_layout(dist: Dist, shards: Mapping[str, torch.Tensor]
                  ) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """This rank's element range of each sharded tensor, and each tensor's total numel."""
    mine = {k: [int(t.numel()), dtype_name(t.dtype)] for k, t in shards.items()}
    every = dist.exchange(mine)
    keys = set(every[0])
    bad = {r: f"sharded keys {sorted(m)} differ from rank 0's {sorted(keys)}"
           for r, m in enumerate(every) if set(m) != keys}
    if not bad:
        for k in keys:
            dtypes = {m[k][1] for m in every}
            if len(dtypes) > 1:
                bad = {r: f"{k!r} has dtype {m[k][1]}" for r, m in enumerate(every)}
                break
    if bad:
        raise DistributedError("save_distributed: ranks passed different sharded tensors", bad)
    bounds, numels = {}, {}
    for k in keys:
        sizes = [m[k][0] for m in every]
        lo = sum(sizes[:dist.rank])
        bounds[k] = (lo, lo + sizes[dist.rank])
        numels[k] = sum(sizes)
    return bounds, numels


def save_distributed(state: Any, uri: str, *, dist: Dist | None = None, metadata: Any = None,
                     rank_state: Any = None, shards: Mapping[str, torch.Tensor] | None = None,
                     storage_config: StorageConfig | None = None,
                     chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES) -> Manifest:
    """Save a checkpoint from every rank at once; every rank calls it with the same ``uri``.

    Matches the trainer's ``saver(state, uri, *, metadata, rank_state)`` protocol.

    Args:
        state: the replicated state; only rank 0's is written (the other
            ranks may pass theirs, or None).
        uri: checkpoint folder (local path or ``gs://``).
        dist: the job's :class:`~xla_ckpt.comm.Dist` (default :func:`get_dist`).
        metadata: small summary (``num_updates``, ``epoch``...) for ``xla-ckpt ls``.
        rank_state: this rank's private state, saved as item ``rank/<rank>``.
        shards: this rank's piece of each flat sharded tensor (ZeRO optimizer
            state), any shape (flattened), same keys and dtype on every rank;
            rank ``r``'s piece is the ``r``-th contiguous range of the flat
            tensor, so pieces may have any (uneven, even empty) lengths.
        storage_config: storage knobs.
        chunk_size_bytes: crc32c chunk size (the granularity of checked byte-range reads).

    Returns:
        The committed :class:`Manifest` (on every rank).

    Raises:
        DistributedError: a write or the commit failed on some rank(s)
            (``failures`` names them); nothing was committed and the stray
            data files are deleted.  Also when ranks pass different sharded keys
            or dtypes.
        CollectiveTimeoutError: a rank died or hung.
    """
    dist = dist if dist is not None else get_dist()
    t0 = time.perf_counter()
    flat = {k: t.detach().reshape(-1) for k, t in (shards or {}).items()}
    bounds, numels = _shard_layout(dist, flat)  # every rank enters it, shards or not
    save_id = dist.broadcast_object(new_save_id() if dist.rank == 0 else None, src=0)
    storage = open_storage(uri, storage_config)
    try:
        def write() -> bytes:
            # This rank's items go into one data file (one object, one fsync).
            mine: list[tuple[str, Any]] = []
            if dist.rank == 0:
                mine.append((STATE_ITEM, state))
            if rank_state is not None:
                mine.append((rank_item(dist.rank), rank_state))
            if flat:
                mine.append((shard_item(dist.rank), shard_state(flat, bounds, numels)))
            parts = (write_items(storage, save_id, mine, chunk_size_bytes=chunk_size_bytes)
                     if mine else [])
            return json.dumps([p.to_json() for p in parts], separators=(",", ":")).encode()

        try:
            mine = dist.run_collectively(write, f"save of {uri}: write data files")
            every = dist.exchange_bytes(mine)

            def do_commit() -> bytes:
                if dist.rank != 0:
                    return b""
                parts = [WrittenItem(d["name"], _item_from_json(d["item"]), dict(d["files"]))
                         for blob in every for d in json.loads(blob)]
                try:
                    return commit(storage, save_id, parts, metadata=metadata,
                                  world_size=dist.world_size).to_json_bytes()
                except Exception as e:
                    committed = _committed_manifest(storage, save_id)
                    if committed is None:
                        raise
                    logger.warning("rank 0: %s committed, but removing the files of earlier "
                                   "saves failed: %s", uri, e)
                    return committed

            data = dist.run_collectively(do_commit, f"save of {uri}: commit (rank 0)")
        except DistributedError:
            if dist.rank == 0 and _committed_manifest(storage, save_id) is None:
                discard(storage, save_id)
            raise
        data = dist.broadcast_bytes(data if dist.rank == 0 else None, src=0)
    finally:
        storage.close()
    manifest = Manifest.from_json_bytes(data, where=f"{uri}/{MANIFEST_NAME}")
    if dist.rank == 0:
        logger.info("rank 0: committed %s (save %s, %d ranks, %d bytes) in %.2f s", uri, save_id,
                    dist.world_size, manifest.nbytes, time.perf_counter() - t0)
    return manifest


def make_saver(*, dist: Dist | None = None, **kwargs: Any) -> Callable[..., Manifest]:
    """A ``saver(state, uri, *, metadata, rank_state)`` for
    :class:`xla_ckpt.trainer.Checkpointer`."""

    def saver(state: Any, uri: str, *, metadata: Any = None, rank_state: Any = None) -> Manifest:
        return save_distributed(state, uri, dist=dist, metadata=metadata, rank_state=rank_state,
                                **kwargs)

    return saver
