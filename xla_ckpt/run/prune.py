"""Delete checkpoints from a run folder safely (``xla-ckpt rm`` / ``xla-ckpt gc``).

Rules, whatever the caller asks:

* never delete a checkpoint that a pointer (``checkpoint_last``/``checkpoint_best``)
  names -- pointers are re-read right before each deletion, so a pointer
  moved by a concurrent save is honoured;
* never delete the newest committed checkpoint;
* except, for those two, with ``force`` (``xla-ckpt rm --force``, for a corrupt newest
  checkpoint: CASES C7): the checkpoint is uncommitted first, then ``checkpoint_last`` is
  moved by compare-and-swap, only if it still names it, back to the newest committed
  checkpoint that stays and whose data files are all there at their sizes
  (:func:`xla_ckpt.run.recovery.newest_intact`), and a ``checkpoint_best`` naming it is
  removed (by compare-and-swap too; the next scored save sets it again).  No lease is
  taken (an operator's tool must not fence the live job, CASES C25): a save that moved a
  pointer meanwhile wins, and a live job's next save moves ``checkpoint_last`` forward as
  usual.  Refused when no intact committed checkpoint would stay;
* uncommit first: a checkpoint's manifest (its commit marker) is deleted
  before its data files, so an interrupted deletion leaves an *incomplete*
  folder that readers already ignore, never a committed folder with missing
  data;
* a checkpoint of another kind (a DCP folder with its ``.metadata``, an HF model folder,
  a ``.pt`` file; :attr:`CheckpointEntry.kind`) is never deleted, not even when named
  (``xla-ckpt rm``): it is refused, naming its kind;
* :func:`collect_garbage` deletes only what this library provably wrote
  (:func:`xla_ckpt.run.retention.library_object`): an incomplete folder holding
  anything else (a ``.pt``, a DCP folder, files copied from another run) is left
  alone, and such objects in a committed folder stay where they are;
* in-flight objects (the ``.tmp-<upload id>-part-<n>`` parts of an interrupted
  upload) are deleted only when their write targeted one of this library's
  names in this run folder and its newest part is older than the grace period
  (:class:`xla_ckpt.run.retention.InFlightUpload`), so a save still writing is
  never touched;
* objects are deleted by their names in the run folder, so on a local disk a checkpoint
  folder that a deletion left empty is removed too (by the local backend, and only when
  empty: a folder still holding anything, ours or not, stays).

Which checkpoints a retention policy lets go is decided by
:func:`xla_ckpt.run.retention.plan_deletions` (fairseq ``keep_interval_updates``
/ ``keep_best_checkpoints``).  Call from one process (rank 0).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

from xla_ckpt.errors import CheckpointNotFoundError
from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.run.catalog import (
    LEFT,
    MOVED,
    POINTERS,
    CheckpointEntry,
    list_checkpoints,
    list_run,
    read_pointer,
    repoint,
)
from xla_ckpt.run.recovery import files_present, newest_intact
from xla_ckpt.run.retention import (
    DEFAULT_IN_FLIGHT_GRACE_S,
    InFlightUpload,
    RetentionPolicy,
    check_grace,
    group_in_flight,
    library_object,
    plan_deletions,
)
from xla_ckpt.storage import Storage

logger = logging.getLogger(__name__)


@dataclass
class RemovalResult:
    """What :func:`remove_checkpoints` / :func:`collect_garbage` did (or would do, on a dry run).

    Attributes:
        deleted: checkpoint folder names deleted (or to delete), oldest first.
        refused: name -> why it was kept although asked for.
        bytes_freed: bytes of the deleted objects: data files of committed checkpoints,
            objects of incomplete folders, in-flight objects.
        dry_run: nothing was deleted.
        in_flight: in-flight writes whose objects were deleted (or would be).
        in_flight_young: in-flight writes kept: younger than the grace period.
        left: folder -> objects in it this library did not write, left in place.
        grace_s: the grace period applied to in-flight objects (seconds).
        repointed: what ``force`` did to the pointers, one line each (``"moved
            checkpoint_last from checkpoint_1_12 back to checkpoint_1_10"``).
    """

    deleted: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    bytes_freed: int = 0
    dry_run: bool = False
    in_flight: list[InFlightUpload] = field(default_factory=list)
    in_flight_young: list[InFlightUpload] = field(default_factory=list)
    left: dict[str, list[str]] = field(default_factory=dict)
    grace_s: float = DEFAULT_IN_FLIGHT_GRACE_S
    repointed: list[str] = field(default_factory=list)

    @property
    def in_flight_objects(self) -> int:
        return sum(len(u.objects) for u in self.in_flight)


def pointer_targets(run: Storage) -> dict[str, str]:
    """checkpoint name -> pointer file that names it (``checkpoint_last.json`` ...)."""
    out: dict[str, str] = {}
    for which in POINTERS:
        name = read_pointer(run, which)
        if name is not None:
            out.setdefault(name, f"checkpoint_{which}")
    return out


def protection(run: Storage, entries: list[CheckpointEntry]) -> dict[str, str]:
    """checkpoint name -> reason it must never be deleted right now."""
    reasons = {name: f"named by the {ptr} pointer" for name, ptr in pointer_targets(run).items()}
    committed = [e for e in entries if e.committed]
    if committed:
        reasons.setdefault(committed[-1].name, "the newest committed checkpoint")
    return reasons


def in_flight_uploads(run: Storage, folder: str = "") -> list[InFlightUpload]:
    """This library's in-flight writes in ``run`` (or in its checkpoint folder ``folder``).

    Objects with an in-flight mark whose target is not a name this library writes
    there are not returned (see :func:`xla_ckpt.run.retention.owned_in_flight`).
    """
    uploads, _foreign = group_in_flight(run.list_in_flight(folder))
    if folder:
        uploads = [u for u in uploads if u.folder == folder.strip("/")]
    return uploads


def _delete_in_flight(run: Storage, uploads: list[InFlightUpload], *, grace_s: float,
                      now: float, result: RemovalResult) -> None:
    for up in uploads:
        if not up.stale(grace_s, now):
            result.in_flight_young.append(up)
            continue
        if not result.dry_run:
            for obj in up.objects:
                run.delete(obj.name)
            logger.info("deleted %d in-flight object(s) of an interrupted write of %s "
                        "(upload %s, %d bytes)", len(up.objects), run.url(up.target),
                        up.upload_id, up.nbytes)
        result.in_flight.append(up)
        result.bytes_freed += up.nbytes


def _size(storage: Storage, name: str) -> int:
    try:
        return storage.stat(name).size
    except CheckpointNotFoundError:
        return 0


def delete_checkpoint(run: Storage, name: str, *, only_ours: bool = False) -> int:
    """Delete one checkpoint folder under ``run``: manifest first, then every other object.

    With ``only_ours`` objects this library did not write (see
    :func:`xla_ckpt.run.retention.library_object`) stay.  In-flight objects are not
    touched here (see :func:`collect_in_flight`).  Does *not* check protection; use
    :func:`remove_checkpoints`.  Returns the number of objects deleted.
    """
    # By names in the run folder: the local backend then removes the folder it left empty.
    marker = f"{name}/{MANIFEST_NAME}"
    count = 0
    if run.exists(marker):
        run.delete(marker)
        count += 1
    for obj in run.list(name + "/"):
        if obj == marker or (only_ours and not library_object(obj)):
            continue
        run.delete(obj)
        count += 1
    logger.info("deleted checkpoint %s (%d objects)", run.url(name), count)
    return count


def _foreign(run: Storage, name: str) -> list[str]:
    """Objects of folder ``name`` this library did not write (names relative to the folder)."""
    return [obj for obj in run.child(name).list("") if not library_object(f"{name}/{obj}")]


def foreign_refusal(name: str, kind: str) -> str:
    """Why ``rm``/``gc`` keep ``name``, a checkpoint of another kind (``kind`` in words)."""
    return (f"{name} is {kind}, which xla_ckpt did not write; rm and gc delete only what "
            "xla_ckpt wrote. Left alone: remove it by hand if you mean to (xla_ckpt.load and "
            "`xla-ckpt convert` read it)")


def _force_hint(run: Storage, name: str, stay: CheckpointEntry | None, latest: bool) -> str:
    """What ``rm`` adds to the refusal of protected checkpoint ``name``: ``--force``, and how
    to restore ``stay`` (the newest intact committed checkpoint that would stay) instead.
    ``latest``: ``name`` is what "latest" resolves to (``checkpoint_last`` names it, or it is
    the newest committed); else only ``checkpoint_best`` names it."""
    if not latest:
        return (f"; pass --force to remove it anyway (checkpoint_best, which names {name}, is "
                "removed with it)")
    if stay is None:
        return "; no other intact committed checkpoint is in this run folder"
    uri = run.url(stay.name)
    return (f"; pass --force to remove it anyway: checkpoint_last then moves back to "
            f"{stay.name} (the newest intact committed checkpoint that stays); or restore "
            f"{stay.name} without removing anything: CheckpointConfig.restore_file="
            f"{stay.name!r} (CheckpointManager), Checkpointer.load_checkpoint({uri!r})")


def _force_off_pointers(run: Storage, name: str, stay: CheckpointEntry | None,
                        result: RemovalResult) -> None:
    """``force``: uncommit ``name``, then move ``checkpoint_last`` off it back to ``stay`` and
    remove a ``checkpoint_best`` naming it, each by compare-and-swap (catalog.repoint).
    ``stay`` None: only ``checkpoint_best`` names it."""
    if result.dry_run:
        for which in POINTERS:
            if read_pointer(run, which) != name:
                continue
            result.repointed.append(
                f"would move checkpoint_last from {name} back to {stay.name}"
                if which == "last" and stay is not None
                else f"would remove checkpoint_{which} (it names {name})")
        return
    marker = f"{name}/{MANIFEST_NAME}"
    if run.exists(marker):
        run.delete(marker)  # uncommitted first: from here on "latest" skips it
    for which in POINTERS:
        to = stay if which == "last" else None
        done = repoint(run, which, name, to)
        if done == LEFT:
            continue
        result.repointed.append(f"moved checkpoint_last from {name} back to {to.name}"
                                if done == MOVED and to is not None else
                                f"removed checkpoint_{which} (it named {name})")


def _delete_all(run: Storage, names: Iterable[str], entries: list[CheckpointEntry],
                result: RemovalResult, *, only_ours: bool = False, force: bool = False,
                hint: bool = False) -> RemovalResult:
    by_name = {e.name: e for e in entries}
    names = list(names)
    going = set(names)
    newest = next((e.name for e in reversed(entries) if e.committed), None)
    for name in names:
        if name in by_name and by_name[name].kind:
            result.refused[name] = foreign_refusal(name, by_name[name].kind)
            continue
        # Re-read pointers just before deleting: a concurrent save may have moved one here.
        live = protection(run, entries)
        if name in live:
            latest = name == newest or live[name].endswith("checkpoint_last pointer")
            stay = newest_intact(run, entries, skip=going) if (force or hint) and latest \
                else None
            if not force:
                result.refused[name] = live[name] + (_force_hint(run, name, stay, latest)
                                                     if hint else "")
                continue
            if stay is None and latest:
                result.refused[name] = (f"{live[name]}; not removed even with --force: no "
                                        "intact committed checkpoint would stay to resume "
                                        "from (to start the run from scratch, remove the run "
                                        "folder)")
                continue
            _force_off_pointers(run, name, stay, result)
        entry = by_name.get(name)
        committed = entry is not None and entry.committed
        if only_ours:
            if entry is not None and entry.error:
                result.refused[name] = (f"its manifest is not this library's or is damaged "
                                        f"({entry.error}); left alone, remove it by hand")
                continue
            foreign = _foreign(run, name)
            if foreign and not committed:
                result.refused[name] = (f"holds {len(foreign)} object(s) xla_ckpt did not write "
                                        f"(e.g. {foreign[0]}); left alone, remove it by hand")
                continue
            if foreign:
                result.left[name] = foreign
        nbytes = entry.nbytes if committed and entry is not None else \
            sum(_size(run.child(name), obj) for obj in run.child(name).list(""))
        if not result.dry_run:
            delete_checkpoint(run, name, only_ours=only_ours)
        result.deleted.append(name)
        result.bytes_freed += nbytes
    if force and result.repointed:
        _warn_broken_newer(run, entries, going, result)
    return result


def _warn_broken_newer(run: Storage, entries: list[CheckpointEntry], going: set[str],
                       result: RemovalResult) -> None:
    """After ``force`` moved ``checkpoint_last`` back: name each committed checkpoint left
    that is newer than what it names but not intact ("latest" picks the newest committed)."""
    target = read_pointer(run, "last")
    order = {e.name: e.sort_key for e in entries if e.committed}
    if target not in order:
        return
    for e in entries:
        if e.committed and e.name not in going and e.sort_key > order[target] and \
                not files_present(run, e):
            result.repointed.append(
                f"warning: {e.name} is committed, newer than {target} and not intact (a data "
                "file is missing or short): it is now the latest; remove it too (rm --force)")


def remove_checkpoints(run: Storage, names: Iterable[str], *, dry_run: bool = False,
                       grace_s: float = DEFAULT_IN_FLIGHT_GRACE_S,
                       now: float | None = None, force: bool = False) -> RemovalResult:
    """Delete the named checkpoint folders of ``run``, refusing protected ones.

    A protected one (a pointer names it, or it is the newest committed) is refused with a
    note on ``force`` and on how to restore the newest intact committed checkpoint instead;
    with ``force`` it is removed and the pointers move off it (module docstring), unless no
    intact committed checkpoint would stay.

    An incomplete folder may be named explicitly (the operator knows it is
    not a save in flight).  A named folder's in-flight objects go too once their
    write is older than ``grace_s`` (the rule ``gc`` applies); a folder holding
    nothing but younger ones is refused, saying so.  Unknown names are refused
    ("no such checkpoint"), and so is a checkpoint of another kind (a DCP folder, an HF
    model folder, a ``.pt`` file: :func:`foreign_refusal`).
    """
    grace_s = check_grace(grace_s)
    now = run.now_unix_s() if now is None else now
    entries, foreign = list_run(run)
    foreign_kind = dict(foreign)
    known = {e.name for e in entries}
    result = RemovalResult(dry_run=dry_run, grace_s=grace_s)
    wanted: list[str] = []
    in_flight: dict[str, list[InFlightUpload]] = {}
    for name in names:
        if name in wanted or name in in_flight:
            continue
        uploads = in_flight_uploads(run, name) if name and "/" not in name.strip("/") else []
        if name.strip("/") in foreign_kind:
            result.refused[name] = foreign_refusal(name, foreign_kind[name.strip("/")])
        elif name in known:
            wanted.append(name)
            in_flight[name] = uploads
        elif uploads:
            in_flight[name] = uploads
        else:
            result.refused[name] = "no such checkpoint in this run folder"
    order = {e.name: i for i, e in enumerate(entries)}
    _delete_all(run, sorted(wanted, key=order.__getitem__), entries, result, force=force,
                hint=True)
    for name, uploads in in_flight.items():
        if name in result.refused:
            continue
        if name not in known:
            live = protection(run, entries)
            if name in live:
                result.refused[name] = live[name]
                continue
            if not any(u.stale(grace_s, now) for u in uploads):
                young = sum(len(u.objects) for u in uploads)
                result.refused[name] = (
                    f"holds only {young} in-flight object(s) younger than the grace period "
                    f"({grace_s:g} s): a save may still be writing them; `gc --in-flight` "
                    "collects them once they are older")
                continue
        _delete_in_flight(run, uploads, grace_s=grace_s, now=now, result=result)
    return result


def collect_in_flight(run: Storage, *, grace_s: float = DEFAULT_IN_FLIGHT_GRACE_S,
                      dry_run: bool = False, now: float | None = None,
                      result: RemovalResult | None = None) -> RemovalResult:
    """Delete the in-flight objects interrupted writes of this library left in ``run``.

    Only writes whose target is one of this library's names in this run folder and
    whose newest object is at least ``grace_s`` old (see
    :class:`xla_ckpt.run.retention.InFlightUpload`); the others are reported in
    ``in_flight_young``.  Their bytes count in ``bytes_freed``.  Ages are taken on the
    store's clock: ``now`` defaults to :meth:`Storage.now_unix_s
    <xla_ckpt.storage.base.Storage.now_unix_s>`, never this host's (possibly skewed) clock.
    """
    grace_s = check_grace(grace_s)
    result = result if result is not None else RemovalResult(dry_run=dry_run, grace_s=grace_s)
    result.grace_s = grace_s
    _delete_in_flight(run, in_flight_uploads(run), grace_s=grace_s,
                      now=run.now_unix_s() if now is None else now, result=result)
    return result


def collect_garbage(run: Storage, policy: RetentionPolicy, *, delete_incomplete: bool = False,
                    delete_in_flight: bool | None = None,
                    grace_s: float = DEFAULT_IN_FLIGHT_GRACE_S, dry_run: bool = False,
                    now: float | None = None) -> RemovalResult:
    """Apply ``policy`` to ``run``: delete what it lets go, never a protected checkpoint.

    Only objects this library wrote are deleted (see the module docstring).
    Incomplete folders are deleted only with ``delete_incomplete=True`` (one may be
    a save in flight); in-flight objects older than ``grace_s`` only with
    ``delete_in_flight`` (default: as ``delete_incomplete``).
    """
    grace_s = check_grace(grace_s)
    entries = list_checkpoints(run)
    protect = protection(run, entries)
    names = plan_deletions(entries, policy, protect, delete_incomplete=delete_incomplete)
    result = _delete_all(run, names, entries, RemovalResult(dry_run=dry_run, grace_s=grace_s),
                         only_ours=True)
    if delete_incomplete if delete_in_flight is None else delete_in_flight:
        collect_in_flight(run, grace_s=grace_s, dry_run=dry_run, now=now, result=result)
    return result
