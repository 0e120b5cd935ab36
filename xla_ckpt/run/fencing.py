"""Fencing between incarnations of one job: a lease epoch, create-only commits, ordered pointers.

On GKE and TPU VMs a preempted or rescheduled job often overlaps with its successor: the old
pod is still uploading while the new one restores and saves.  Fencing makes sure the stale
incarnation cannot overwrite a committed checkpoint, move ``checkpoint_last`` backwards, or
rotate away what its successor restored from or wrote.

**The lease.**  ``<run>/lease.json`` (:data:`LEASE_NAME`) holds
``{"epoch": n, "owner": {"host": ..., "pid": ..., "started_unix_s": ...}}``.  Each
incarnation that saves (a :class:`~xla_ckpt.manager.CheckpointManager` on its run folder;
rank 0 does it and the manager sends the epoch to every rank) takes a new epoch at its
first save (:func:`acquire_lease`): it reads the lease with its generation ``g`` and writes
``epoch + 1`` with ``if_generation_match=g`` (``0``, create only, when there is none); when
another incarnation advanced it in between the store refuses, and it reads again and
retries (bounded).  So epochs are unique and increase: the newest incarnation holds the
highest, and every older one is *fenced* from the moment that write landed.

**Who takes the lease** (CASES C25).  Only a job that saves, at its first save, or when it
calls :meth:`~xla_ckpt.manager.CheckpointManager.take_over` on purpose.  A restore
(``restore_or_initialize``, ``restore(step=...)``, ``restore(keys=...)``), a step query,
the trainer's ``Checkpointer.load_checkpoint``, ``xla_ckpt.load`` and the CLI never take it
and write nothing: an evaluator polling the run (Orbax's pattern) never fences the trainer,
and a reader needs no write permission on the run folder.

A successor that restored and has not saved yet has written nothing, so it cannot be told
from such a reader: an older incarnation still running keeps saving until the successor's
first save, and a restart in between resumes from the newest of those checkpoints (the
job's own newest progress; nothing of the successor was committed to lose).  From its first
save on, the successor's lineage decides whatever the timing: the lease is taken before any
of its data is written, so the predecessor is fenced at its next check; "newer" orders by
lease epoch first, so the successor's first checkpoint outranks every checkpoint the
predecessor committed, at any step; ``checkpoint_last`` moves to it (a higher epoch is
forward) and never back; and the successor's rotation, not the predecessor's, decides what
of the older lineage goes.  A job that must fence its predecessor before it saves (a long
warm-up) calls ``take_over()`` right after restoring.

**What the manager checks** (:func:`check_lease`, rank 0): right before the commit marker,
before the pointers and before rotation, it reads the lease; an epoch newer than its own
raises :class:`~xla_ckpt.errors.FencedError` (on every rank, naming both incarnations and the
run folder), the manager marks itself fenced, and every later save raises at once, writing
nothing.  A save also looks before it writes any data, so a fenced incarnation's next save
uploads nothing.

**What the store enforces whatever the timing:**

* the commit marker is created with ``if_generation_match=0``
  (:func:`manifest_precondition`): a committed manifest is never replaced by a save of the
  same or an older epoch (a second commit to the same folder raises).  Only a *newer*
  incarnation may replace a checkpoint of an *older* one under the same folder name (it
  resumed from an earlier checkpoint and trains over the same names): by compare-and-swap
  on the generation of the manifest whose epoch it checked, so atomically;
* the manifest records the writer's epoch (metadata ``lease_epoch``); "newer" means a higher
  ``(lease_epoch, num_updates)`` (:mod:`xla_ckpt.run.catalog`), for "latest" and rotation;
* pointers move by compare-and-swap and only forward in ``(lease_epoch, num_updates)``
  (:func:`xla_ckpt.run.catalog.write_pointer`): a pointer document of a newer epoch is never
  replaced by an older writer, whenever it writes;
* rotation (:mod:`xla_ckpt.manager.rotation`) deletes only checkpoints whose manifest epoch is
  at most its own, never one a pointer names (re-read before each deletion), never the
  one its incarnation restored from or just committed, and only objects this library wrote;
  a manifest is deleted on the generation whose epoch was checked.

**The residual window.**  A check and the write it guards are two requests: an incarnation
that checked the lease just before its successor advanced it can still do the *one* guarded
step that follows.  What that can be: it may commit its checkpoint in a *new* folder (a
stale checkpoint, committed, consistent), but it never replaces a committed one (create
only), it is never pointed to (the pointer check that follows fails, and a pointer written
by the successor is newer anyway), and its incarnation never rotates after it (the rotation
check fails; a rotation already under way deletes nothing of a newer epoch and nothing a
pointer names).  Its data files in that folder are removed by nothing but rotation or
``xla-ckpt gc``.  Nothing else of the successor's is touched.  Because "newer" orders by
epoch first, "latest" prefers the successor's checkpoints to such a stale one as soon as
the successor committed one.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    FencedError,
    PreconditionFailedError,
)
from xla_ckpt.format.manifest import MANIFEST_NAME, Manifest
from xla_ckpt.run.catalog import (
    LEASE_EPOCH_KEY,
    POINTERS,
    epoch_of,
    pointer_order,
    read_pointer_doc,
    read_versioned,
)
from xla_ckpt.storage import Storage

logger = logging.getLogger(__name__)

LEASE_NAME = "lease.json"
"""The lease object, at the top of the run folder."""

LEASE_ATTEMPTS = 32
"""Compare-and-swap attempts to advance the lease before giving up (each re-reads it)."""

__all__ = ["LEASE_EPOCH_KEY", "LEASE_NAME", "Lease", "acquire_lease", "check_lease",
           "describe_owner", "fenced_error", "lease_from_message", "lease_message",
           "manifest_precondition", "peek_lease", "read_lease"]


def owner_info() -> dict[str, Any]:
    """Who this incarnation is, as the lease records it: host, pid, start time."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started_unix_s": time.time()}


def describe_owner(owner: Any) -> str:
    """``host h, pid p, started <UTC time>`` (or what of it the document holds)."""
    if not isinstance(owner, dict):
        return "owner unknown"
    parts = []
    if owner.get("host"):
        parts.append(f"host {owner['host']}")
    if owner.get("pid") is not None:
        parts.append(f"pid {owner['pid']}")
    t = owner.get("started_unix_s")
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        stamp = datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        parts.append(f"started {stamp}")
    return ", ".join(parts) or "owner unknown"


@dataclass(frozen=True)
class Lease:
    """A lease as read or taken.

    Attributes:
        epoch: the incarnation's epoch (1 for the first; 0 for none).
        owner: who took it (:func:`owner_info`).
        generation: the lease object's generation when read or written.
        run: the URI of the run folder it is a lease of, as its storage names it
            (``Storage.uri``); empty when unknown (a lease rebuilt from a rank's message).
    """

    epoch: int
    owner: dict = field(default_factory=dict)
    generation: int | None = None
    run: str = ""

    def describe(self) -> str:
        return f"lease epoch {self.epoch} ({describe_owner(self.owner)})"


def lease_message(lease: Lease) -> tuple[int, dict, int | None]:
    """A lease as plain values (what ranks exchange); :func:`lease_from_message` undoes it."""
    return (lease.epoch, dict(lease.owner), lease.generation)


def lease_from_message(msg: Any) -> Lease:
    epoch, owner, generation = msg
    return Lease(int(epoch), dict(owner), generation)


def read_lease(run: Storage) -> Lease | None:
    """The run folder's lease, or None when it has none.

    Raises:
        CheckpointCorruptError: ``lease.json`` is there but is not a lease document.
        PreconditionFailedError: it was replaced during each of a few reads.
    """
    got = read_versioned(run, LEASE_NAME)
    if got is None:
        return None
    return _parse_lease(run, *got)


def peek_lease(run: Storage) -> Lease | None:
    """The run folder's lease as one plain read (one GET on GCS), without its generation:
    what a restore checks a local step's lineage against (it writes nothing, so it needs no
    compare-and-swap version).  None when the run folder has no lease.

    Raises:
        CheckpointCorruptError: ``lease.json`` is there but is not a lease document.
    """
    try:
        data = run.read_bytes(LEASE_NAME)
    except CheckpointNotFoundError:
        return None
    return _parse_lease(run, data, None)


def _parse_lease(run: Storage, data: bytes, generation: int | None) -> Lease:
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{run.url(LEASE_NAME)}: not a lease document ({e})",
                                     ) from None
    epoch = doc.get("epoch") if isinstance(doc, dict) else None
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise CheckpointCorruptError(f"{run.url(LEASE_NAME)}: not a lease document (epoch "
                                     f"{epoch!r})")
    owner = doc.get("owner")
    return Lease(epoch, owner if isinstance(owner, dict) else {}, generation)


def _floor_from_pointers(run: Storage) -> int:
    """The highest epoch any pointer records (what a damaged lease must be taken above)."""
    return max((pointer_order(read_pointer_doc(run, w)[0])[0] for w in POINTERS), default=0)


def acquire_lease(run: Storage, *, owner: dict | None = None,
                  attempts: int = LEASE_ATTEMPTS) -> Lease:
    """Take the next epoch of ``run``'s lease for a starting incarnation (one process only).

    Reads the lease with its generation and writes ``epoch + 1`` on that generation
    (create only when absent); another incarnation advancing it in between makes the
    store refuse, and this reads again and retries, up to ``attempts`` times.  A damaged
    lease document is replaced (on its generation) above the highest epoch a pointer
    records, with a warning.

    Raises:
        PreconditionFailedError: the lease changed under every attempt.
        StorageError: the run folder cannot be written.
    """
    owner = owner or owner_info()
    last: PreconditionFailedError | None = None
    for attempt in range(attempts):
        try:
            try:
                current = read_lease(run)
                base, generation = (current.epoch, current.generation) if current else (0, 0)
            except CheckpointCorruptError as e:
                got = read_versioned(run, LEASE_NAME)
                generation = got[1] if got else 0
                base = _floor_from_pointers(run)
                logger.warning("%s; replacing it with an epoch above every pointer's (%d)", e,
                               base)
            epoch = base + 1
            body = json.dumps({"epoch": epoch, "owner": owner}, sort_keys=True).encode("utf-8")
            info = run.write_atomic(LEASE_NAME, [body], if_generation_match=generation)
        except PreconditionFailedError as e:  # another incarnation took it meanwhile
            last = e
            time.sleep(random.uniform(0, min(0.5, 0.005 * 2 ** attempt)))
            continue
        lease = Lease(epoch, owner, info.generation)
        logger.info("%s: this incarnation holds %s", run.url(LEASE_NAME), lease.describe())
        return lease
    raise PreconditionFailedError(
        f"{run.url(LEASE_NAME)}: could not take the next lease epoch: it changed under each "
        f"of {attempts} attempts (many incarnations starting at once?)", name=LEASE_NAME,
        expected_generation=last.expected_generation if last else 0,
        actual_generation=last.actual_generation if last else None) from last


def fenced_error(run: Storage, own: Lease, current_epoch: int, current_owner: Any = None, *,
                 what: str = "") -> FencedError:
    """The :class:`FencedError` of incarnation ``own`` of ``run``, superseded by epoch
    ``current_epoch`` (of ``current_owner``, when known)."""
    newer = f"lease epoch {current_epoch} ({describe_owner(current_owner)})" \
        if current_owner is not None else f"lease epoch {current_epoch}"
    doing = f" {what}" if what else ""
    return FencedError(
        f"{run.uri}: this incarnation of the job ({own.describe()}) is fenced: a newer "
        f"incarnation ({newer}) took over the run folder; refused{doing}. This incarnation "
        "stops saving: nothing more is committed, pointed to or deleted by it",
        own_epoch=own.epoch, current_epoch=current_epoch, run=run.uri)


def check_lease(run: Storage, own: Lease, *, what: str = "") -> None:
    """Raise :class:`FencedError` if ``run``'s lease epoch is newer than ``own``'s.

    An absent lease (removed by hand) fences nobody.  ``what`` names the step refused
    (for the message).

    Raises:
        FencedError: a newer incarnation took the lease.
        CheckpointCorruptError: the lease document is damaged (the save fails; a new
            incarnation repairs it).
    """
    current = read_lease(run)
    if current is not None and current.epoch > own.epoch:
        raise fenced_error(run, own, current.epoch, current.owner, what=what)


def manifest_precondition(folder: Storage, own: Lease, *, run: Storage | None = None) -> int:
    """The ``if_generation_match`` for the commit marker of a save by ``own`` into ``folder``.

    ``0`` (create only) when the folder holds no manifest (``run``: the run folder, for
    messages).  When it holds a committed one
    written by an *older* epoch (a successor retraining over the names of a checkpoint it
    did not restore from), that manifest's generation: it is replaced atomically, and only
    if it is still that one.

    Raises:
        FencedError: the manifest there was written by a newer incarnation.
        PreconditionFailedError: it was written by this epoch (a second commit to the same
            folder: a committed checkpoint is never replaced by its own incarnation), or it
            cannot be read as a manifest.
    """
    got = read_versioned(folder, MANIFEST_NAME)
    if got is None:
        return 0
    data, generation = got
    try:
        m = Manifest.from_json_bytes(data, where=folder.url(MANIFEST_NAME), require_crc=True)
    except CheckpointCorruptError as e:
        raise PreconditionFailedError(
            f"{folder.uri} already holds a commit marker that cannot be read ({e}); it is "
            "never replaced: nothing was committed, save under another name or remove it",
            name=MANIFEST_NAME, expected_generation=0, actual_generation=generation) from None
    from xla_ckpt.format import typed  # noqa: PLC0415 - only needed on this rare path

    epoch = epoch_of(typed.decode(m.metadata) if m.metadata is not None else None)
    if epoch > own.epoch:
        raise fenced_error(run or folder, own, epoch,
                           what=f"to commit over {folder.uri} (committed by lease epoch {epoch})")
    if epoch == own.epoch or generation is None:
        raise PreconditionFailedError(
            f"{folder.uri} already holds a committed checkpoint (save id {m.save_id}, lease "
            f"epoch {epoch}); a committed checkpoint is never replaced by its own incarnation: "
            "nothing was committed, save under another name", name=MANIFEST_NAME,
            expected_generation=0, actual_generation=generation)
    logger.info("%s: replacing checkpoint save id %s of lease epoch %d (older than this "
                "incarnation's %d)", folder.uri, m.save_id, epoch, own.epoch)
    return generation
