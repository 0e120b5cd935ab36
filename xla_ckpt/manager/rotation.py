"""Which checkpoints of a run folder to delete after a save commits (fairseq rotation).

fairseq keeps ``keep_interval_updates`` update checkpoints (``checkpoint_E_U``),
``keep_last_epochs`` epoch checkpoints (``checkpointE``) and
``keep_best_checkpoints`` best ones by the metric (or the manager's ``best_fn``:
:mod:`xla_ckpt.manager.best`).  Built on
:func:`xla_ckpt.run.retention.plan_deletions`, so its safety rules hold too:
a folder is deleted only when every rule allows it, never one named by a
pointer or in ``protect`` (the checkpoint being restored, the one just
committed), never the newest committed one, never an incomplete folder (it may
be a save in flight), and never a folder this manager did not name.

Fencing (:mod:`xla_ckpt.run.fencing`): an incarnation deletes only what its own epoch may
delete.  Never a checkpoint whose manifest records a newer lease epoch than its own; the
pointers are re-read right before each deletion (a successor may have moved one); a
manifest is deleted on the generation whose epoch was checked, so one replaced meanwhile
stays; and only objects this library wrote go (:func:`xla_ckpt.run.retention.library_object`:
a ``.pt``, a DCP folder or anything else copied into a checkpoint folder stays, C22).
"""

from __future__ import annotations

import logging
from typing import Iterable

from xla_ckpt.errors import CheckpointCorruptError, PreconditionFailedError
from xla_ckpt.format import typed
from xla_ckpt.format.manifest import MANIFEST_NAME, Manifest
from xla_ckpt.manager.best import BestScore
from xla_ckpt.manager.config import CheckpointConfig
from xla_ckpt.manager.naming import checkpoint_kind
from xla_ckpt.run.catalog import (
    CheckpointEntry,
    epoch_of,
    list_checkpoints,
    read_pointer,
    read_versioned,
)
from xla_ckpt.run.retention import RetentionPolicy, library_object, plan_deletions
from xla_ckpt.storage import Storage

logger = logging.getLogger(__name__)


def plan_rotation(entries: list[CheckpointEntry], cfg: CheckpointConfig,
                  protect: Iterable[str] = (), *, own_epoch: int | None = None,
                  scorer: BestScore | None = None) -> list[str]:
    """Names of committed checkpoint folders to delete, oldest first.  Pure.

    Args:
        entries: :func:`xla_ckpt.run.catalog.list_checkpoints` output (oldest first).
        protect: folder names never to delete (pointer targets, the restored one).
        own_epoch: the deleting incarnation's lease epoch: checkpoints of a newer epoch
            are never planned (None: no such limit).
        scorer: how "best" is ranked for ``keep_best_checkpoints`` (default: the
            config's ``best_checkpoint_metric``; see :mod:`xla_ckpt.manager.best`).
    """
    scorer = scorer or BestScore.from_config(cfg)
    protect = set(protect)
    committed = [e for e in entries if e.committed]
    if own_epoch is not None:
        protect |= {e.name for e in committed if e.lease_epoch > own_epoch}
    if cfg.keep_best_checkpoints >= 0:
        keep_best = {e.name for e in scorer.best_entries(committed, cfg.keep_best_checkpoints)}
    else:
        keep_best = {e.name for e in committed if scorer.score_entry(e) is not None}
    doomed: set[str] = set()
    for kind, keep in (("update", cfg.keep_interval_updates), ("epoch", cfg.keep_last_epochs)):
        if keep < 0:
            continue
        of_kind = [e for e in committed if checkpoint_kind(e.name) == kind]
        doomed |= set(plan_deletions(of_kind, RetentionPolicy(keep_last=keep, keep_best=0),
                                     protect | keep_best))
    if committed:
        doomed.discard(committed[-1].name)
    return [e.name for e in committed if e.name in doomed]


def delete_checkpoint(run: Storage, name: str, *, own_epoch: int | None = None) -> int:
    """Delete one checkpoint folder, manifest (commit marker) first; returns objects deleted.

    With the manifest gone first, a crash half-way leaves an incomplete folder
    (ignored by readers), never a committed checkpoint with missing data files.
    The manifest is deleted on the generation read here, and only if it records a
    lease epoch of at most ``own_epoch`` (when given); otherwise nothing is deleted
    and 0 is returned.  Then the folder's other objects that this library wrote;
    anything else stays.
    """
    marker = f"{name}/{MANIFEST_NAME}"
    count = 0
    got = read_versioned(run, marker)
    if got is not None:
        data, generation = got
        if own_epoch is not None:
            try:
                m = Manifest.from_json_bytes(data, where=run.url(marker), require_crc=True)
            except CheckpointCorruptError as e:
                logger.warning("not deleting %s: %s", run.url(name), e)
                return 0
            epoch = epoch_of(typed.decode(m.metadata) if m.metadata is not None else None)
            if epoch > own_epoch:
                logger.info("not deleting %s: written by lease epoch %d, newer than this "
                            "incarnation's %d", run.url(name), epoch, own_epoch)
                return 0
        try:
            if generation is None:
                run.delete(marker)
            else:
                run.delete(marker, if_generation_match=generation)
        except PreconditionFailedError:
            logger.info("not deleting %s: its manifest was replaced meanwhile", run.url(name))
            return 0
        count += 1
    for n in run.list(name + "/"):
        if n != marker and library_object(n):
            run.delete(n)
            count += 1
    return count


def rotate(run: Storage, cfg: CheckpointConfig, protect: Iterable[str] = (), *,
           own_epoch: int | None = None, scorer: BestScore | None = None) -> list[str]:
    """List the run folder, delete what :func:`plan_rotation` allows; returns deleted names.

    Called by one rank (the coordinator), only after the newest save committed, and
    (by the manager) right after checking that its incarnation still holds the lease.
    Pointers are re-read before each deletion; see the module docstring for what
    ``own_epoch`` limits.
    """
    entries = list_checkpoints(run)
    pointers = {p for p in (read_pointer(run, "last"), read_pointer(run, "best")) if p}
    doomed = plan_rotation(entries, cfg, set(protect) | pointers, own_epoch=own_epoch,
                           scorer=scorer)
    deleted = []
    for name in doomed:
        if name in (read_pointer(run, "last"), read_pointer(run, "best")):
            logger.info("not deleting %s: a pointer names it now", run.url(name))
            continue
        n = delete_checkpoint(run, name, own_epoch=own_epoch)
        if n:
            logger.info("deleted old checkpoint %s (%d objects)", run.url(name), n)
            deleted.append(name)
    return deleted
