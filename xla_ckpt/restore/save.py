"""``save_distributed()``: every rank writes its own part, rank 0 commits after all have written.

Layout of what it writes (one checkpoint folder, one manifest)::

    state          rank 0 writes the replicated state
    rank/<r>       rank r writes its private state (iterator position, RNG) if any
    shard/<r>      rank r writes its partitions of the flat sharded tensors
                   (ZeRO optimizer state), with their element ranges

With sharded tensors (DTensor, XLAShardedTensor) in the state, or ``balance_replicated=True``,
the *chunked* layout (manifest version 2) replaces the ``state`` item's data::

    state          chunked: the tree, committed by rank 0 in the manifest; its tensors are
                   the manifest's global tensors, made of the chunks below
    chunks/<r>     rank r writes the boxes it owns (its DTensor / SPMD shards, and its share
                   of the replicated tensors, balanced by bytes: each byte written once)

Steps, every rank in the same order: agree on the sharded-tensor layout
(each rank's shard sizes, exchanged) and on the path (any rank with sharded tensors makes it
chunked); chunked: agree on the structure and plan the owners
(:func:`xla_ckpt.restore.owners.plan_chunked_save`); rank 0 picks the save id; every rank
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
from typing import Any, Callable, Mapping, Sequence

import torch

from xla_ckpt.comm.base import Dist
from xla_ckpt.comm.failures import describe_error
from xla_ckpt.comm.select import get_dist
from xla_ckpt.errors import DistributedError
from xla_ckpt.format.dtypes import dtype_name
from xla_ckpt.format.gc_pause import gc_paused
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
from xla_ckpt.restore.owners import ChunkedSavePlan, has_sharded, plan_chunked_save
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


def uri_mismatch(uris: Sequence[str]) -> dict[int, str]:
    """Rank -> how its checkpoint URI differs from rank 0's (empty: every rank's is the same).

    ``uris``: each rank's normalised URI (``Storage.uri``: an absolute local path, or
    ``gs://bucket/prefix``), in rank order."""
    return {r: f"saves to {u!r}, rank 0 to {uris[0]!r}" for r, u in enumerate(uris)
            if u != uris[0]}


URI_HINT = ("every rank must pass the same uri: one checkpoint folder on storage every rank "
            "shares (a shared filesystem or gs://; not a node-local path)")


def _shard_layout(dist: Dist, shards: Mapping[str, torch.Tensor], chunked: bool,
                  uri: str | None, *, error: BaseException | None = None
                  ) -> tuple[dict[str, tuple[int, int]], dict[str, int], bool]:
    """This rank's element range of each sharded tensor, each tensor's total numel, and
    whether any rank asks for the chunked path (one exchange, which also checks that every
    rank saves to the same ``uri``; ``error``: this rank could not open it)."""
    mine = {k: [int(t.numel()), dtype_name(t.dtype)] for k, t in shards.items()}
    gathered = dist.exchange({"shards": mine, "chunked": bool(chunked), "uri": uri,
                              "error": describe_error(error) if error is not None else None})
    failed = {r: g["error"] for r, g in enumerate(gathered) if g["error"] is not None}
    if failed:
        raise DistributedError("save_distributed: the checkpoint uri could not be opened on "
                               f"rank(s) {', '.join(str(r) for r in sorted(failed))}; nothing "
                               "was written", failed)
    differ = uri_mismatch([g["uri"] for g in gathered])
    if differ:
        raise DistributedError(f"save_distributed: ranks passed different checkpoint URIs "
                               f"({URI_HINT}); nothing was written", differ)
    every = [g["shards"] for g in gathered]
    any_chunked = any(g["chunked"] for g in gathered)
    keys = set(every[0])
    bad = {r: f"passes shards for keys {sorted(m)}, rank 0 for {sorted(keys)}"
           for r, m in enumerate(every) if set(m) != keys}
    if not bad:
        for k in keys:
            dtypes = {m[k][1] for m in every}
            if len(dtypes) > 1:
                bad = {r: f"{k!r} has dtype {m[k][1]}" for r, m in enumerate(every)}
                break
    if bad:
        raise DistributedError("save_distributed: ranks passed different flat sharded tensors "
                               "(shards=); nothing was written", bad)
    bounds, numels = {}, {}
    for k in keys:
        sizes = [m[k][0] for m in every]
        lo = sum(sizes[:dist.rank])
        bounds[k] = (lo, lo + sizes[dist.rank])
        numels[k] = sum(sizes)
    return bounds, numels, any_chunked


@gc_paused()  # many small objects, no cycles (CASES C26)
def save_distributed(state: Any, uri: str, *, dist: Dist | None = None, metadata: Any = None,
                     rank_state: Any = None, shards: Mapping[str, torch.Tensor] | None = None,
                     storage_config: StorageConfig | None = None,
                     chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES,
                     balance_replicated: bool = False, check_replicas: bool = False,
                     owned_devices: Sequence[int] | None = None,
                     progress: Callable[[int], object] | None = None) -> Manifest:
    """Save a checkpoint from every rank at once; every rank calls it with the same ``uri``.

    COLLECTIVE: every rank calls it, in the same order.  Matches the trainer's
    ``saver(state, uri, *, metadata, rank_state)`` protocol.

    ``uri`` must be one folder on storage every rank shares (a shared filesystem or
    ``gs://``): the ranks compare their (normalised) URIs in their first exchange and refuse
    different ones before anything is written, and rank 0 checks that every rank's data file
    is there for it, with the size its writer reported, before it writes the manifest, so
    ranks writing to storage they do not share (a node-local ``/tmp/ckpt`` on several hosts)
    never commit a checkpoint that misses their files.

    Two layouts (see the module docstring):

    * plain (the default for a state of plain tensors): only rank 0's ``state`` is written,
      by rank 0 (the other ranks may pass theirs, or None); manifest version 1.
    * chunked, when any rank's ``state`` holds a ``DTensor`` / ``XLAShardedTensor``, or
      ``balance_replicated`` / ``check_replicas`` is set: every rank passes its *whole* state
      (its shards; the plain tensors, which must be equal on every rank); the ranks agree on
      its structure first, before anything is written: every key path of the tree (tensor
      or not) and what is there (tensor, value, dict, list, tuple...), and for tensors the
      global shape, dtype, kind (plain / DTensor / XLA), placement and ties.  A difference is
      one :class:`DistributedError` on every rank naming the rank and the user's key paths
      (``rank 1: lacks state['meta']['name'] that rank 0 has``).  Non-tensor *values* are
      not compared: rank 0's are committed (a ``step`` of 5 on rank 0 and 6 on rank 1 saves
      5); plain tensors' values are compared only with ``check_replicas``.  Each box is
      written once, by its owner (its shard's rank; replicated boxes balanced by bytes over
      their holders); a tensor passed under several keys (the same object, or the same
      memory: a tied weight) is one global tensor, written once and loaded back tied.
      Manifest version 2; ``xla_ckpt.load(uri)`` gives the full tensors on one process.

    Args:
        state: the state (see the two layouts above).
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
        balance_replicated: use the chunked layout for a plain state too, so the replicated
            tensors are written by all ranks (balanced by bytes) instead of rank 0 alone.
        check_replicas: chunked layout, and compare the crc32c of each replicated box's
            copies across ranks before writing (one extra pass over them on each holder);
            the first that differs is named in a DistributedError on every rank.
        owned_devices: torch_xla SPMD: the global device ids whose shards this process
            writes (multi-host emulation; default every addressable device).
        progress: called with the bytes of each piece this rank hands to the storage.

    Returns:
        The committed :class:`Manifest` (on every rank).

    Raises:
        DistributedError: a write or the commit failed on some rank(s)
            (``failures`` names them); nothing was committed and the stray
            data files rank 0 sees are deleted.  The commit fails (rank 0's failure a
            :class:`~xla_ckpt.errors.StorageNotSharedError` naming the file and the rank
            that wrote it) when a rank's data file is not there for rank 0: storage not
            shared by the ranks.  Also, before anything is written: ranks pass different
            URIs (``failures`` names each rank's), different sharded keys or dtypes
            (``shards``), or (chunked) states of different structure, or differing
            replicas with ``check_replicas``.
        CollectiveTimeoutError: a rank died or hung.  One case commits all the same:
            rank 0 stalls past the timeout *inside* its manifest write, the other ranks
            give up naming rank 0, then rank 0's write lands.  That checkpoint is
            complete (every rank's data file was written and agreed before the commit
            began) and restores bitwise; ``xla-ckpt ls`` shows it as committed.
    """
    dist = dist if dist is not None else get_dist()
    t0 = time.perf_counter()
    flat = {k: t.detach().reshape(-1) for k, t in (shards or {}).items()}
    wants_chunked = balance_replicated or check_replicas or has_sharded(state)
    try:
        storage = open_storage(uri, storage_config)
    except Exception as e:  # told to every rank in the first exchange, then raised there
        _shard_layout(dist, flat, wants_chunked, None, error=e)
        raise  # not reached: the exchange raised on every rank
    try:
        # Every rank enters it, shards or not; the path is chosen by all ranks together, and
        # they check they save to the same folder before anyone writes.
        bounds, numels, chunked = _shard_layout(dist, flat, wants_chunked, storage.uri)
        plan: ChunkedSavePlan | None = None
        if chunked:
            plan = plan_chunked_save(dist, state, owned_devices=owned_devices,
                                     check_replicas=check_replicas, what=f"save of {uri}")
        save_id = dist.broadcast_object(new_save_id() if dist.rank == 0 else None, src=0)

        def write() -> bytes:
            # This rank's items go into one data file (one object, one fsync).
            mine: list[tuple[str, Any]] = []
            if plan is not None:
                chunk = plan.chunk_item()
                if chunk is not None:
                    mine.append(chunk)
            elif dist.rank == 0:
                mine.append((STATE_ITEM, state))
            if rank_state is not None:
                mine.append((rank_item(dist.rank), rank_state))
            if flat:
                mine.append((shard_item(dist.rank), shard_state(flat, bounds, numels)))
            parts = (write_items(storage, save_id, mine, chunk_size_bytes=chunk_size_bytes,
                                 progress=progress)
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
                    if plan is None:
                        return commit(storage, save_id, parts, metadata=metadata,
                                      world_size=dist.world_size).to_json_bytes()
                    global_tensors = plan.global_tensors(parts)
                    parts.append(WrittenItem(STATE_ITEM, plan.state_item(), {}))
                    return commit(storage, save_id, parts, metadata=metadata,
                                  world_size=dist.world_size,
                                  global_tensors=global_tensors).to_json_bytes()
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
        if plan is not None:
            logger.info("rank 0: committed %s (save %s, %d ranks, %d bytes, chunked: %d global "
                        "tensors, chunk bytes per rank %s) in %.2f s", uri, save_id,
                        dist.world_size, manifest.nbytes, len(plan.specs),
                        list(plan.bytes_per_rank.values()), time.perf_counter() - t0)
        else:
            logger.info("rank 0: committed %s (save %s, %d ranks, %d bytes) in %.2f s", uri,
                        save_id, dist.world_size, manifest.nbytes, time.perf_counter() - t0)
    return manifest


def make_saver(*, dist: Dist | None = None, **kwargs: Any) -> Callable[..., Manifest]:
    """A ``saver(state, uri, *, metadata, rank_state)`` for
    :class:`xla_ckpt.trainer.Checkpointer`."""

    def saver(state: Any, uri: str, *, metadata: Any = None, rank_state: Any = None) -> Manifest:
        return save_distributed(state, uri, dist=dist, metadata=metadata, rank_state=rank_state,
                                **kwargs)

    return saver
