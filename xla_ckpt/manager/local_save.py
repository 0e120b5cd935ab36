"""The manager's saves into the local tier (:mod:`xla_ckpt.run.local_tier`): what each rank
writes there, the host commit, and the durable upload that reads the local bytes.

A save with a local tier runs these steps (``SavePath._save`` / ``_sync`` call them):

1. **Room** (every rank, collective, :func:`agree_on_room`): every rank sends its host and
   the bytes it will write; each host checks ``local_max_bytes`` against what keep-last-K
   leaves; when any host lacks room the local copy is skipped on every host with a
   WARNING naming the sizes (a durable save then writes to durable storage directly).
2. **Local write** (every rank): the training thread lays out this rank's data files and
   copies the live tensors straight into their pages in the host's tier (:func:`stage_local`:
   the one device-to-host copy of the save; no staging buffer, no second memcpy); the upload
   thread checksums and publishes them (:func:`finish_local`).  Each file recycles the
   pages of the file of the same name that keep-last-K evicted last, when the tier kept it
   (:meth:`LocalTier.spare_path`).  On the plain (replicated) path rank 0 writes the
   replicated state as a file of its own, and every other host's leader writes the same
   file from its own copy, so each host holds every byte its ranks restore; a copy whose
   records differ from rank 0's (the replicas were not equal) is dropped, and that host
   reads the state from durable storage.
3. **Host commit** (each host's leader, after every rank's write, :func:`commit_host`): the
   manifest, then the host's commit marker, then keep-last-K.
4. **Durable upload** (every rank, when the durable schedule asks, :func:`copy_to_durable`):
   this rank's files, read from the local tier, never from the live state; then rank 0
   commits the durable manifest as without a local tier.

Failures: a local write that fails (ENOSPC when its pages are reserved, before the copy:
never a SIGBUS) removes what it wrote; a durable save then
writes its staged copy to durable storage directly, and a local-only save is dropped with
a WARNING (the previous local step stays).  Training goes on either way.
"""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from xla_ckpt.errors import FencedError
from xla_ckpt.format.manifest import STATE_ITEM
from xla_ckpt.io.mapped_writer import MappedPages, StagedFile, stage_file
from xla_ckpt.io.writer import FilePlan, WrittenItem, plan_file, write_planned, writer_rank
from xla_ckpt.restore import save_steps as steps
from xla_ckpt.run.local_tier import LocalStep, LocalTier
from xla_ckpt.storage import Storage
from xla_ckpt.storage.local import LocalStorage

logger = logging.getLogger(__name__)


@dataclass
class LocalPart:
    """What one rank wrote into its host's local tier for one save.

    Attributes:
        parts: the items in the checkpoint (sent to every rank, as a durable save's).
        own_state: a host leader's own copy of the replicated state (not rank 0's), kept
            only when its records equal rank 0's.
        error: why the local write failed (then nothing of it is left).
        direct: ``parts`` were written to durable storage instead (a durable save).
    """

    parts: list[WrittenItem] = field(default_factory=list)
    own_state: list[WrittenItem] = field(default_factory=list)
    error: str | None = None
    direct: bool = False  # the local write failed and ``parts`` went to durable storage


def nbytes_of(payload: Any) -> int:
    """Tensor bytes of a payload tree (what a write puts in the local tier, near enough)."""
    total = 0

    def walk(v: Any) -> None:
        nonlocal total
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
    walk(payload)
    return total


def agree_on_room(exchange: Callable[[Any], list[Any]], tier: LocalTier, *, host: int,
                  name: str, nbytes: int, leader: bool = False
                  ) -> tuple[bool, dict[int, list[int]]]:
    """Every rank (two small exchanges): whether every host has room for its part of save
    ``name`` (``local_max_bytes`` once keep-last-K pruned), and the ranks of each host.
    A host's ``leader`` then makes that room before any rank writes
    (:meth:`LocalTier.make_room`: the oldest steps go first when the tier or its
    filesystem is full).

    Logs a WARNING naming each host short of room, the bytes it would hold and the limit,
    when the local copy is skipped (on every host: a step some host lacks is no use).
    """
    every = exchange((host, nbytes))
    hosts: dict[int, list[int]] = {}
    for r, (h, _) in enumerate(every):
        hosts.setdefault(h, []).append(r)
    mine = sum(n for h, n in every if h == host)
    fits, held = tier.room_for(mine, name)
    if fits and leader:
        tier.make_room(mine)  # before the verdicts: no rank of this host writes until then
    verdicts = exchange((host, fits, mine, held))
    short = sorted({(h, n, k) for h, ok, n, k in verdicts if not ok})
    if short:
        logger.warning("local tier: skipping the local copy of %s (%s); training and the "
                       "durable schedule go on", name, "; ".join(
                           f"host {h}: {n} bytes new + {k} bytes kept > local_max_bytes "
                           f"{tier.max_bytes}" for h, n, k in short))
    return not short, hosts


def write_local(tier: LocalTier, name: str, save_id: str, payload: steps.SavePayload,
                rank: int, *, pages: MappedPages, own_state: Any = None,
                direct: Storage | None = None) -> LocalPart:
    """One rank, all at once (a blocking save, on the caller's thread):
    :func:`stage_local` then :func:`finish_local`.  A failure (ENOSPC) removes this rank's
    files and is returned, not raised; with ``direct`` (a durable save's storage) the live
    ``payload`` is then written there instead."""
    try:
        staged = stage_local(tier, name, save_id, payload, rank, own_state=own_state,
                             pages=pages)
    except Exception as e:  # noqa: BLE001 - the local copy is best effort; reported, not raised
        out = failed(tier, name, rank, f"{type(e).__name__}: {e}", durable=direct is not None)
        if direct is not None:
            out.parts, out.direct = steps.write_payload(direct, save_id, payload, rank), True
        return out
    return finish_local(staged, tier, name, rank, direct=direct)


def direct_part(error: str, storage: Storage, save_id: str, payload: steps.SavePayload,
                rank: int) -> LocalPart:
    """Upload thread: the local copy could not be staged (``error``); a durable save writes
    its staged host copy (``payload``) to durable storage directly."""
    return LocalPart(parts=steps.write_payload(storage, save_id, payload, rank), error=error,
                     direct=True)


def failed(tier: LocalTier, name: str, rank: int, error: str, *, durable: bool) -> LocalPart:
    """A rank's local write of ``name`` that failed with ``error``: logged (WARNING), as a part."""
    logger.warning("[rank %d] host %d: the local copy of %s failed (%s)%s", rank, tier.host,
                   name, error, "; writing it to durable storage directly" if durable else
                   "; the previous local step stays")
    return LocalPart(error=error)


@dataclass
class StagedLocal:
    """A rank's part of a save staged into its local files' pages (:func:`stage_local`):
    ``files`` as ``(what, file)`` with ``what`` ``"parts"`` or ``"own"`` (a host leader's
    own copy of the replicated state)."""

    files: list[tuple[str, StagedFile]]

    @property
    def nbytes(self) -> int:
        return sum(f.plan.size for _, f in self.files)

    def payloads(self) -> list[FilePlan]:
        """The staged files' plans whose bytes go to durable storage when the local write
        fails on a durable save (their blobs are the pages: the snapshot)."""
        return [f.plan for what, f in self.files if what == "parts"]


def stage_local(tier: LocalTier, name: str, save_id: str, payload: steps.SavePayload,
                rank: int, *, own_state: Any = None, pages: MappedPages) -> StagedLocal:
    """One rank, the training thread: lay out this rank's data files of save ``name`` and copy
    ``payload`` (live tensors) straight into their pages in this host's tier, each file
    recycling the spare of the same name when the tier holds one
    (:mod:`xla_ckpt.io.mapped_writer`).  Rank 0's replicated ``state`` goes in a file of
    its own; ``own_state``: a host leader's own copy of it (hosts other than rank 0's).

    Raises:
        OSError: a file could not be made or its pages reserved (ENOSPC); nothing of this
            save is left in the tier.
        MetaTensorError / UnsupportedTypeError: a value cannot be saved (names its key).
    """
    storage = tier.step_storage(name)
    groups = [("parts", steps.SavePayload(state=payload.state)),
              ("parts", steps.SavePayload(None, payload.rank_state, payload.shards,
                                          payload.chunk_name, payload.chunks)),
              ("own", steps.SavePayload(state=own_state))]
    out = StagedLocal([])
    try:
        for what, group in groups:
            items = group.items(rank)
            if items:
                fp = plan_file(save_id, items, to_host=False)
                out.files.append((what, stage_file(storage, fp, pages,
                                                   spare=tier.spare_path(fp.fname))))
    except BaseException:
        for _, f in out.files:
            f.discard()
        raise
    return out


def finish_local(staged: StagedLocal, tier: LocalTier, name: str, rank: int, *,
                 direct: Storage | None = None) -> LocalPart:
    """One rank, the upload thread: checksum and publish the staged files.  A failure removes
    this rank's files of the save and is returned, not raised; with ``direct`` (a durable
    save's storage) the staged pages are then written there instead."""
    out = LocalPart()
    done: list[str] = []
    try:
        for what, f in staged.files:
            written = f.finish()
            done.append(os.path.join(f.storage.root, f.plan.fname))
            (out.parts if what == "parts" else out.own_state).extend(written)
    except Exception as e:  # noqa: BLE001 - the local copy is best effort; reported, not raised
        for _, f in staged.files:
            f.discard()
        for path in done:
            _unlink(path)
        out = failed(tier, name, rank, f"{type(e).__name__}: {e}", durable=direct is not None)
        if direct is not None:
            out.parts = [w for fp in staged.payloads() for w in write_planned(direct, fp)]
            out.direct = True
    return out


def copy_to_durable(local: Storage, durable: Storage, parts: list[WrittenItem]) -> None:
    """One rank: upload the data files it wrote, reading the local tier's bytes (one mapped
    view each, no copy into this process's heap)."""
    for f in sorted({f for p in parts for f in p.files}):
        assert isinstance(local, LocalStorage)  # the tier's own folder
        path = os.path.join(local.root, f)
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                durable.write_atomic(f, [b""])
                continue
            mm = mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ)
            try:
                view = memoryview(mm)
                try:
                    durable.write_atomic(f, [view])
                finally:
                    view.release()
            finally:
                try:
                    mm.close()
                except BufferError:
                    # A slice of the view is still referenced (an upload pool thread that
                    # has not dropped its finished work item yet): the mapping goes when
                    # the last slice does.  Closing is only an early unmap.
                    pass


def commit_host(tier: LocalTier, *, name: str, save_id: str, gathered: list[WrittenItem],
                own_state: list[WrittenItem], host_ranks: list[int], world_size: int,
                plan: Any, metadata: dict, lease_epoch: int, single_host: bool) -> LocalStep:
    """A host's leader, after every rank's local write: the manifest, then the host's commit
    marker (last), then keep-last-K.

    A step of a newer lease epoch already committed in this host's tier means a newer
    incarnation runs on this host: nothing is committed (a local-only save reads the run
    folder's lease only in the background, so this host-local check is what stops a fenced
    incarnation on the same host first).

    Raises:
        FencedError: a newer incarnation committed a step in this host's tier.
        OSError / StorageError / ValueError: the commit failed (the marker is absent).
    """
    newer = [s for s in tier.inventory() if s.lease_epoch > lease_epoch]
    if newer:
        raise FencedError(
            f"host {tier.host}: not committing {name} in the local tier {tier.folder}: "
            f"{newer[-1].name} there was committed by lease epoch {newer[-1].lease_epoch}, "
            f"newer than this incarnation's {lease_epoch}; this job was replaced: stop it",
            own_epoch=lease_epoch, current_epoch=newer[-1].lease_epoch, run=tier.run_uri)
    storage = tier.step_storage(name)
    held: dict[str, int] = {}
    for p in gathered:
        r = writer_rank(p.name)
        mine = r in host_ranks or (r is None and 0 in host_ranks)
        if mine:
            held.update(p.files)
    complete = plan is None
    state = [p for p in gathered if p.name == STATE_ITEM]
    if state and 0 not in host_ranks:
        if own_state and _same_bytes(own_state, state):
            held.update(state[0].files)
        else:
            complete = False
            for p in own_state:
                for f in p.files:
                    _unlink(os.path.join(storage.root, f))
            if own_state:
                logger.warning("host %d: its copy of the replicated state of %s differs from "
                               "rank 0's; that host reads it from the durable tier", tier.host,
                               name)
    if plan is not None and single_host:
        complete = True
    steps.commit_save(storage, save_id, gathered, name=name, plan=plan,
                      metadata=metadata, world_size=world_size, cleanup=False,
                      check_files=False)
    step = LocalStep(name=name, save_id=save_id, host=tier.host, ranks=tuple(host_ranks),
                     world_size=world_size, lease_epoch=lease_epoch,
                     epoch=int(metadata.get("epoch", 0)),
                     num_updates=int(metadata.get("num_updates", 0)), files=held,
                     complete=complete)
    tier.commit(step, None)  # the manifest is there: the marker, last
    tier.prune(protect=[name])
    return step


def _same_bytes(own: list[WrittenItem], state: list[WrittenItem]) -> bool:
    """Whether a host's own copy of the replicated state holds rank 0's bytes where the
    manifest (rank 0's records) points: the same files and sizes, blobs (offsets, lengths,
    crc32c) and tensor records.  The typed tree's other values are not compared: the
    manifest carries rank 0's, and a replica may differ there harmlessly (fairseq's
    ``previous_training_time`` is each rank's own wall clock)."""
    def key(items: list[WrittenItem]) -> list[Any]:
        return [(p.name, p.files, [t.to_json() for t in p.item.tensors],
                 [b.to_json() for b in p.item.blobs]) for p in items]
    return key(own) == key(state)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
