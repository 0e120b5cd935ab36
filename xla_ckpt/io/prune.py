"""Delete checkpoints from a run folder safely (``xla-ckpt rm`` / ``xla-ckpt gc``).

Rules, whatever the caller asks:

* never delete a checkpoint that a pointer (``checkpoint_last``/``checkpoint_best``)
  names -- pointers are re-read right before each deletion, so a pointer
  moved by a concurrent save is honoured;
* never delete the newest committed checkpoint;
* uncommit first: a checkpoint's manifest (its commit marker) is deleted
  before its data files, so an interrupted deletion leaves an *incomplete*
  folder that readers already ignore, never a committed folder with missing
  data.

Which checkpoints a retention policy lets go is decided by
:func:`xla_ckpt.io.retention.plan_deletions` (fairseq ``keep_interval_updates``
/ ``keep_best_checkpoints``).  Call from one process (rank 0).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.io.catalog import POINTERS, CheckpointEntry, list_checkpoints, read_pointer
from xla_ckpt.io.retention import RetentionPolicy, plan_deletions
from xla_ckpt.storage import Storage

logger = logging.getLogger(__name__)


@dataclass
class RemovalResult:
    """What :func:`remove_checkpoints` / :func:`collect_garbage` did (or would do, on a dry run).

    Attributes:
        deleted: checkpoint folder names deleted (or to delete), oldest first.
        refused: name -> why it was kept although asked for.
        bytes_freed: bytes of data files of the deleted committed checkpoints.
        dry_run: nothing was deleted.
    """

    deleted: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    bytes_freed: int = 0
    dry_run: bool = False


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


def delete_checkpoint(run: Storage, name: str) -> int:
    """Delete one checkpoint folder under ``run``: manifest first, then every other object.

    Does *not* check protection; use :func:`remove_checkpoints`.  Returns the
    number of objects deleted.
    """
    folder = run.child(name)
    count = 0
    if folder.exists(MANIFEST_NAME):
        folder.delete(MANIFEST_NAME)
        count += 1
    for obj in folder.list(""):
        folder.delete(obj)
        count += 1
    logger.info("deleted checkpoint %s (%d objects)", folder.uri, count)
    return count


def _delete_all(run: Storage, names: Iterable[str], entries: list[CheckpointEntry],
                result: RemovalResult) -> RemovalResult:
    by_name = {e.name: e for e in entries}
    for name in names:
        # Re-read pointers just before deleting: a concurrent save may have moved one here.
        live = protection(run, entries)
        if name in live:
            result.refused[name] = live[name]
            continue
        if not result.dry_run:
            delete_checkpoint(run, name)
        result.deleted.append(name)
        result.bytes_freed += by_name[name].nbytes if name in by_name else 0
    return result


def remove_checkpoints(run: Storage, names: Iterable[str], *, dry_run: bool = False
                       ) -> RemovalResult:
    """Delete the named checkpoint folders of ``run``, refusing protected ones.

    An incomplete folder may be named explicitly (the operator knows it is
    not a save in flight).  Unknown names are refused ("no such checkpoint").
    """
    entries = list_checkpoints(run)
    known = {e.name for e in entries}
    result = RemovalResult(dry_run=dry_run)
    wanted = []
    for name in names:
        if name not in known:
            result.refused[name] = "no such checkpoint in this run folder"
        elif name not in wanted:
            wanted.append(name)
    order = {e.name: i for i, e in enumerate(entries)}
    return _delete_all(run, sorted(wanted, key=order.__getitem__), entries, result)


def collect_garbage(run: Storage, policy: RetentionPolicy, *, delete_incomplete: bool = False,
                    dry_run: bool = False) -> RemovalResult:
    """Apply ``policy`` to ``run``: delete what it lets go, never a protected checkpoint.

    Incomplete folders are deleted only with ``delete_incomplete=True`` (one
    may be a save in flight).
    """
    entries = list_checkpoints(run)
    protect = protection(run, entries)
    names = plan_deletions(entries, policy, protect, delete_incomplete=delete_incomplete)
    return _delete_all(run, names, entries, RemovalResult(dry_run=dry_run))
