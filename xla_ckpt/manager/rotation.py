"""Which checkpoints of a run folder to delete after a save commits (fairseq rotation).

fairseq keeps ``keep_interval_updates`` update checkpoints (``checkpoint_E_U``),
``keep_last_epochs`` epoch checkpoints (``checkpointE``) and
``keep_best_checkpoints`` best ones by the metric.  Built on
:func:`xla_ckpt.io.retention.plan_deletions`, so its safety rules hold too:
a folder is deleted only when every rule allows it, never one named by a
pointer or in ``protect`` (the checkpoint being restored, the one just
committed), never the newest committed one, never an incomplete folder (it may
be a save in flight), and never a folder this manager did not name.
"""

from __future__ import annotations

import logging
from typing import Iterable

from xla_ckpt.config import CheckpointConfig
from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.io.catalog import CheckpointEntry, list_checkpoints, read_pointer
from xla_ckpt.io.retention import RetentionPolicy, best_entries, metric_value, plan_deletions
from xla_ckpt.manager.naming import checkpoint_kind
from xla_ckpt.storage import Storage

logger = logging.getLogger(__name__)


def plan_rotation(entries: list[CheckpointEntry], cfg: CheckpointConfig,
                  protect: Iterable[str] = ()) -> list[str]:
    """Names of committed checkpoint folders to delete, oldest first.  Pure.

    Args:
        entries: :func:`xla_ckpt.io.catalog.list_checkpoints` output (oldest first).
        protect: folder names never to delete (pointer targets, the restored one).
    """
    protect = set(protect)
    committed = [e for e in entries if e.committed]
    if cfg.keep_best_checkpoints >= 0:
        best = best_entries(committed, cfg.best_checkpoint_metric,
                            cfg.maximize_best_checkpoint_metric, cfg.keep_best_checkpoints)
        keep_best = {e.name for e in best}
    else:
        keep_best = {e.name for e in committed
                     if metric_value(e, cfg.best_checkpoint_metric) is not None}
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


def delete_checkpoint(run: Storage, name: str) -> int:
    """Delete one checkpoint folder, manifest (commit marker) first; returns objects deleted.

    With the manifest gone first, a crash half-way leaves an incomplete folder
    (ignored by readers), never a committed checkpoint with missing data files.
    """
    names = run.list(name + "/")
    marker = f"{name}/{MANIFEST_NAME}"
    ordered = ([marker] if marker in names else []) + [n for n in names if n != marker]
    for n in ordered:
        run.delete(n)
    return len(ordered)


def rotate(run: Storage, cfg: CheckpointConfig, protect: Iterable[str] = ()) -> list[str]:
    """List the run folder, delete what :func:`plan_rotation` allows; returns deleted names.

    Called by one rank (the coordinator), only after the newest save committed.
    """
    entries = list_checkpoints(run)
    pointers = {p for p in (read_pointer(run, "last"), read_pointer(run, "best")) if p}
    doomed = plan_rotation(entries, cfg, set(protect) | pointers)
    for name in doomed:
        n = delete_checkpoint(run, name)
        logger.info("deleted old checkpoint %s (%d objects)", run.url(name), n)
    return doomed
