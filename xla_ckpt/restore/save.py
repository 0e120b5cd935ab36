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

Steps, every rank in the same order: those of :mod:`xla_ckpt.restore.save_steps`, which the
:class:`~xla_ckpt.manager.CheckpointManager` takes too.  One agreement exchange (the URI, the
tensor layout, the flat shard layout, plain or chunked; it also carries rank 0's save id and,
with a lease, whether a newer one fences this save); chunked: agree on the structure and
plan the owners (:func:`xla_ckpt.restore.owners.plan_chunked_save`); every rank writes its
items into one data file (:func:`xla_ckpt.io.writer.write_items`); one agreement step (a
failed write anywhere -> every rank raises, rank 0 deletes the stray files); the written
item records travel to rank 0 (validated: :meth:`~xla_ckpt.io.WrittenItem.from_json`), which
writes the manifest -- the commit marker -- (:func:`~xla_ckpt.restore.save_steps.commit_save`,
checked against the lease when one is given); the committed manifest goes back to every rank.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from xla_ckpt.comm.base import Dist
from xla_ckpt.comm.select import get_dist
from xla_ckpt.errors import ConfigError, DistributedError, FencedError
from xla_ckpt.format.gc_pause import gc_paused
from xla_ckpt.format.manifest import DEFAULT_CHUNK_SIZE_BYTES, MANIFEST_NAME, Manifest
from xla_ckpt.io.writer import discard
from xla_ckpt.restore import save_steps as steps
from xla_ckpt.run.catalog import LEASE_EPOCH_KEY
from xla_ckpt.run.fencing import Lease, fenced_error
from xla_ckpt.storage import Storage, StorageConfig, open_storage

logger = logging.getLogger(__name__)


def _committed_manifest(storage: Any, save_id: str) -> bytes | None:
    """The manifest bytes at the storage root if they belong to ``save_id`` (else None)."""
    try:
        data = storage.read_bytes(MANIFEST_NAME)
        return data if Manifest.from_json_bytes(data).save_id == save_id else None
    except Exception:  # noqa: BLE001 - absent or unreadable: not committed
        return None


def _run_of(storage: Storage) -> Storage:
    """The run folder holding checkpoint folder ``storage`` (its parent), for the lease."""
    parent = storage.uri.rstrip("/").rsplit("/", 1)[0]
    return open_storage(parent, storage.config)


def _lease_run(storage: Storage, lease: Lease, uri: str) -> Storage:
    """The run folder of ``lease``, which must be the parent of checkpoint folder ``storage``:
    its lease.json is the one the commit is checked against, so a save elsewhere (a sub-folder,
    another run) would commit unfenced."""
    run = _run_of(storage)
    if not lease.run or run.uri.rstrip("/") != lease.run.rstrip("/"):
        run.close()
        where = f"the run folder {lease.run}" if lease.run else "no run folder (built by hand?)"
        raise ConfigError(
            f"save_distributed to {uri} with lease= ({lease.describe()}): the lease names "
            f"{where}, and {uri} is not a folder directly under it, so its lease.json would not "
            "fence this save; save to manager.run.url(<name>) with lease=manager.lease, or pass "
            "no lease (an unfenced save)")
    return run


def _fenced(fence: steps.SaveFence, doc: Any) -> FencedError:
    """The FencedError rank 0 met (``doc``: its message and epochs), on every rank."""
    return FencedError(str(doc[0]), own_epoch=int(doc[1]), current_epoch=int(doc[2]),
                       run=str(doc[3]) if doc[3] is not None else fence.run.uri)


@gc_paused()  # many small objects, no cycles (CASES C26)
def save_distributed(state: Any, uri: str, *, dist: Dist | None = None, metadata: Any = None,
                     rank_state: Any = None, shards: Mapping[str, torch.Tensor] | None = None,
                     storage_config: StorageConfig | None = None,
                     chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES,
                     balance_replicated: bool = False, check_replicas: bool = False,
                     owned_devices: Sequence[int] | None = None,
                     progress: Callable[[int], object] | None = None,
                     lease: Lease | None = None) -> Manifest:
    """Save a checkpoint from every rank at once; every rank calls it with the same ``uri``.

    COLLECTIVE: every rank calls it, in the same order.  Matches the trainer's
    ``saver(state, uri, *, metadata, rank_state)`` protocol.  It takes the steps of
    :mod:`xla_ckpt.restore.save_steps`, as the :class:`~xla_ckpt.manager.CheckpointManager`
    does: one agreement exchange (which also carries rank 0's save id), the writes, one
    gather of what was written, rank 0's commit.

    ``uri`` must be one folder on storage every rank shares (a shared filesystem or
    ``gs://``): the ranks compare their (normalised) URIs in their first exchange and refuse
    different ones before anything is written, and rank 0 checks that every rank's data file
    is there for it, with the size its writer reported, before it writes the manifest, so
    ranks writing to storage they do not share (a node-local ``/tmp/ckpt`` on several hosts)
    never commit a checkpoint that misses their files.

    Two layouts (see the module docstring):

    * plain (the default for a state of plain tensors): only rank 0's ``state`` is written,
      by rank 0; the other ranks pass theirs (which must hold the same tensors: keys, shapes
      and dtypes are compared, as the manager does, C16) or None; manifest version 1.
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
      Byte-free shards (an FSDP2 ``(3, 0)`` parameter) take no box.
      Manifest version 2; ``xla_ckpt.load(uri)`` gives the full tensors on one process.

    **Fencing** (``lease``): a save on behalf of a
    :class:`~xla_ckpt.manager.CheckpointManager`'s incarnation passes its lease
    (``manager.lease``, held once it saved or called ``take_over()``); ``uri`` is then a
    checkpoint folder directly under the manager's run folder (``manager.run.url(name)``),
    whose ``lease.json`` is checked as the manager's own commit checks it: rank 0 looks at it
    before any rank writes, and again right before the commit marker, which is created only
    if absent or on the generation of an older epoch's manifest; the manifest records the
    epoch (metadata ``lease_epoch``, when ``metadata`` is a dict or None).  A newer lease
    raises :class:`~xla_ckpt.errors.FencedError` on every rank and commits nothing.  Without
    a lease the commit replaces whatever is at ``uri`` (no fencing).

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
        lease: the lease to commit under (see Fencing), the same on every rank.

    Returns:
        The committed :class:`Manifest` (on every rank).

    Raises:
        DistributedError: a write or the commit failed on some rank(s)
            (``failures`` names them); nothing was committed and the stray
            data files rank 0 sees are deleted.  The commit fails (rank 0's failure a
            :class:`~xla_ckpt.errors.StorageNotSharedError` naming the file and the rank
            that wrote it) when a rank's data file is not there for rank 0: storage not
            shared by the ranks.  Also, before anything is written: a rank could not open
            ``uri``; ranks pass different URIs (``failures`` names each rank's), different
            sharded keys or dtypes (``shards``), plain states holding different tensors, or
            (chunked) states of different structure, or differing replicas with
            ``check_replicas``.
        FencedError: ``lease`` is older than the run folder's (every rank; nothing
            committed, the data files written are removed).
        CollectiveTimeoutError: a rank died or hung.  One case commits all the same:
            rank 0 stalls past the timeout *inside* its manifest write, the other ranks
            give up naming rank 0, then rank 0's write lands.  That checkpoint is
            complete (every rank's data file was written and agreed before the commit
            began) and restores bitwise; ``xla-ckpt ls`` shows it as committed.
    """
    dist = dist if dist is not None else get_dist()
    t0 = time.perf_counter()
    inputs = steps.evaluate_inputs(state, rank_state, shards)
    storage: Storage | None = None
    fence: steps.SaveFence | None = None
    try:
        storage = open_storage(uri, storage_config)
        if lease is not None:
            fence = steps.SaveFence(_lease_run(storage, lease, uri), lease)
    except Exception as e:  # noqa: BLE001 - told to every rank in the agreement, raised there
        inputs.error = inputs.error or e
    if fence is not None and (metadata is None or isinstance(metadata, dict)):
        metadata = {**(metadata or {}), LEASE_EPOCH_KEY: fence.lease.epoch}
    what = "save_distributed of {uri}"
    try:
        # Every rank enters it; the path is chosen by all ranks together, and they check they
        # save the same thing to the same folder before anyone writes.
        def fenced_head() -> dict[str, Any]:
            return {"fenced": fence.newer() if fence is not None else None}

        head, agreed = steps.agree_on_save(
            dist.exchange, dist.rank, inputs, storage.uri if storage is not None else uri,
            chunked=balance_replicated or check_replicas, head=fenced_head)
        steps.refuse(agreed, inputs, exchange=dist.exchange, what=what)
        assert storage is not None  # no rank's inputs failed, this one's included
        if fence is not None and head["fenced"] is not None:
            epoch, owner = head["fenced"]
            raise fenced_error(fence.run, fence.lease, epoch, owner, what=f"to save {uri}")
        plan = steps.plan(dist, agreed, inputs, what=what, owned_devices=owned_devices,
                          check_replicas=check_replicas)
        save_id = head["save_id"]
        mine = steps.payload(inputs, agreed, plan, dist.rank)

        def write() -> bytes:
            # This rank's items go into one data file (one object, one fsync).
            return steps.parts_json(steps.write_payload(
                storage, save_id, mine, dist.rank, chunk_size_bytes=chunk_size_bytes,
                progress=progress))

        def do_commit(every: list[bytes]) -> bytes:
            if dist.rank != 0:
                return b""
            parts = steps.parts_from_json(every, save_id)
            try:
                return b"M" + steps.commit_save(
                    storage, save_id, parts, name=storage.uri, plan=plan, metadata=metadata,
                    world_size=dist.world_size, fence=fence).to_json_bytes()
            except FencedError as e:  # every rank raises it, below
                return b"F" + json.dumps([str(e), e.own_epoch, e.current_epoch, e.run]).encode()
            except Exception as e:
                committed = _committed_manifest(storage, save_id)
                if committed is None:
                    raise
                logger.warning("rank 0: %s committed, but removing the files of earlier "
                               "saves failed: %s", uri, e)
                return b"M" + committed

        try:
            every = dist.exchange_bytes(dist.run_collectively(
                write, f"save of {uri}: write data files"))
            data = dist.run_collectively(lambda: do_commit(every),
                                         f"save of {uri}: commit (rank 0)")
        except DistributedError:
            if dist.rank == 0 and _committed_manifest(storage, save_id) is None:
                discard(storage, save_id)
            raise
        data = dist.broadcast_bytes(data if dist.rank == 0 else None, src=0)
        if data[:1] == b"F":
            assert fence is not None  # only a fenced commit says F
            if dist.rank == 0:
                discard(storage, save_id)
            raise _fenced(fence, json.loads(data[1:]))
    finally:
        if storage is not None:
            storage.close()
        if fence is not None:
            fence.run.close()
    manifest = Manifest.from_json_bytes(data[1:], where=f"{uri}/{MANIFEST_NAME}")
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
