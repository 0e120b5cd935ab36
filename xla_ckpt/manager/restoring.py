"""The restore path of :class:`~xla_ckpt.manager.CheckpointManager`: which checkpoint, then read.

Rank 0 resolves ``config.restore_file`` with the one resolver
(:func:`xla_ckpt.io.resolve.resolve`: ``checkpoint_last`` -> the run folder's
latest committed checkpoint, ``checkpoint_best`` -> its pointer; a folder name or
a URI is resolved by :func:`xla_ckpt.restore.restore` itself) and reads the best
metric recorded so far; every rank gets that decision (or rank 0's error) and
restores through :func:`xla_ckpt.restore.restore`.

Fencing: before it resolves anything, rank 0 takes this incarnation's lease epoch
(:mod:`xla_ckpt.io.fencing`; once per manager, and not with ``no_save``) and sends it
with the decision, so from then on an older incarnation still running can neither
commit over, point past nor rotate away what this one restores.

Fresh start: only ``checkpoint_last`` with nothing ever committed in the run
folder (:class:`~xla_ckpt.errors.NothingCommittedError`; a ``save_dir`` that does
not exist yet counts, the manager creates it), logged at WARNING.  A named
``restore_file`` with nothing committed raises ``CheckpointNotFoundError`` (or
``IncompleteCheckpointError``) on every rank, not the fresh-start class.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConfigError,
    DistributedError,
    IncompleteCheckpointError,
    NothingCommittedError,
    StorageError,
    StoragePermissionError,
    StorageURIError,
    UncommittedCheckpointError,
)
from xla_ckpt.io.catalog import pointer_name
from xla_ckpt.io.fencing import lease_from_message, lease_message
from xla_ckpt.io.resolve import resolve
from xla_ckpt.manager.base import ManagerBase, logger
from xla_ckpt.restore import Restored
from xla_ckpt.restore import restore as restore_checkpoint
from xla_ckpt.storage import parse_uri

# Errors that reach every rank with their own type when rank 0 hits them resolving a restore.
_SHARED_ERRORS = {c.__name__: c for c in (CheckpointNotFoundError, IncompleteCheckpointError,
                                          CheckpointCorruptError, StorageError,
                                          StoragePermissionError, StorageURIError,
                                          ConfigError)}


@dataclass
class RestoreResult:
    """What :meth:`CheckpointManager.restore_or_initialize` returns on every rank.

    Attributes:
        state: the replicated state as saved (tensors on CPU unless ``map_location``).
        rank_state: this rank's private state (item ``rank/<rank>``), or None if the
            checkpoint has none for this rank.
        checkpoint: checkpoint folder name (``checkpoint_1_500``).
        uri: full checkpoint URI.
        metadata: the manifest's metadata summary (epoch, num_updates, metrics, ...).
        epoch / num_updates: from ``metadata`` (None if the saver did not record them).
        restored: the restore layer's :class:`xla_ckpt.restore.Restored` (strategy and why,
            :class:`~xla_ckpt.restore.RestoreStats` with bytes read and seconds, shards).
    """

    state: Any
    rank_state: Any
    checkpoint: str
    uri: str
    metadata: dict
    epoch: int | None = None
    num_updates: int | None = None
    restored: Restored | None = None


class RestorePath(ManagerBase):
    """Restoring: :meth:`restore_or_initialize` and how it resolves and reads a checkpoint."""

    def restore_or_initialize(self, init_fn: Callable[[], Any] | None = None, *,
                              map_location: Any = None) -> RestoreResult | None:
        """Restore the checkpoint ``config.restore_file`` names, or start fresh.  Collective.

        Rank 0 resolves which checkpoint (``checkpoint_last``: the newest committed one,
        following the pointer unless it lags; ``checkpoint_best``; a folder name in
        ``save_dir``; or a full URI) and sends the decision to every rank (DESIGN
        decision 2).  Every rank then gets the replicated state and its own
        ``rank/<rank>`` item through :func:`xla_ckpt.restore.restore` with
        ``restore_config`` (every rank reads, or rank 0 reads and broadcasts).

        Args:
            init_fn: called (on every rank) when there is nothing to restore.
            map_location: where restored tensors go on this rank (as ``torch.load``;
                pass ``dist.device`` for this rank's own device).

        Returns:
            A :class:`RestoreResult` on every rank, or None when ``restore_file`` is
            ``checkpoint_last`` and nothing was ever committed in the run folder
            (logged at WARNING: training starts from scratch).

        Raises:
            CheckpointNotFoundError: an explicitly named checkpoint (or ``checkpoint_best``)
                does not exist, or the run folder holds no readable committed checkpoint
                while something was committed there (a dangling ``checkpoint_last``
                pointer); every rank raises it.
            IncompleteCheckpointError: a named checkpoint folder has no commit marker.
            CheckpointReplacedError: another writer replaced the checkpoint during the
                read, twice (every rank).
            DistributedError: a read failed on some rank (corrupt bytes, storage error);
                ``failures`` names the ranks, on every rank.
        """
        self._check_open()
        decision: Any = None
        if self.rank == 0:
            try:
                # The lease first: an older incarnation is fenced before this one chooses.
                lease = None
                if self._lease is None and not self.config.no_save:
                    lease = lease_message(self._take_lease())
                decision = ("ok", *self._resolve_restore(), lease)
            except Exception as e:  # noqa: BLE001 - sent to every rank, re-raised below
                decision = ("error", type(e).__name__, str(e))
                own = e
        decision = self._exchange(decision)[0]
        if decision[0] == "error":
            if self.rank == 0:
                raise own
            cls = _SHARED_ERRORS.get(decision[1])
            if cls is not None:
                raise cls(decision[2])
            raise DistributedError("rank 0 could not resolve the checkpoint to restore",
                                   {0: f"{decision[1]}: {decision[2]}"})
        _, uri, name, in_run, best, lease = decision
        if lease is not None:
            self._lease = lease_from_message(lease)
        self._best = best
        if uri is None:
            if self.rank == 0:
                logger.warning("[rank %d] %s: training starts from scratch", self.rank, name)
            if init_fn is not None:
                init_fn()
            return None
        try:
            result = self._read_checkpoint(uri, name, map_location)
        except UncommittedCheckpointError as e:  # a named folder: not a fresh start here
            raise IncompleteCheckpointError(str(e)) from e
        except NothingCommittedError as e:
            raise CheckpointNotFoundError(str(e)) from e
        if in_run:
            self.restored_from = name
        if result.num_updates is not None:
            self._last_saved = (name, result.num_updates)
        return result

    # ---- internals ----------------------------------------------------------------------
    def _resolve_restore(self) -> tuple[str | None, str, bool, float | None]:
        """Rank 0: (checkpoint URI or None, folder name, is it in the run folder, best metric).

        ``checkpoint_last`` with nothing committed gives ``(None, why, True, best)``.
        """
        rf = self.config.restore_file
        best = self._read_best_value()
        if rf in ("checkpoint_last", "checkpoint_best"):
            which = rf.rsplit("_", 1)[1]
            try:
                r = resolve(self.run, pointer=which, missing_ok=True)
            except NothingCommittedError as e:
                if which != "last":
                    raise
                return None, str(e), True, best
            return r.checkpoint, r.name, True, best
        target = parse_uri(rf)  # refuses s3://, gs:/b/x, gs//b/x before anything is read
        if target.is_gcs or str(target).startswith(("/", "./", "../")):
            return rf, rf.rstrip("/").rsplit("/", 1)[-1], False, best
        return self.run.url(rf), rf, True, best

    def _pointer_doc(self, which: str) -> dict:
        try:
            doc = json.loads(self.run.read_bytes(pointer_name(which)).decode("utf-8"))
        except CheckpointNotFoundError:
            return {}
        except (ValueError, UnicodeDecodeError):
            logger.warning("[rank %d] ignoring unreadable pointer %s", self.rank,
                           self.run.url(pointer_name(which)))
            return {}
        return doc if isinstance(doc, dict) else {}

    def _read_best_value(self) -> float | None:
        doc = self._pointer_doc("best")
        v = doc.get("value")
        if doc.get("metric") == self.config.best_checkpoint_metric and \
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
        return None

    def _read_checkpoint(self, uri: str, name: str, map_location: Any) -> RestoreResult:
        """Every rank restores ``uri`` with the configured strategy (xla_ckpt.restore.restore)."""
        r = restore_checkpoint(uri, dist=self.dist, map_location=map_location,
                               config=self.restore_config, storage_config=self.run.config)
        md = r.metadata if isinstance(r.metadata, dict) else {}
        return RestoreResult(state=r.state, rank_state=r.rank_state, checkpoint=name,
                             uri=r.checkpoint, metadata=md, epoch=md.get("epoch"),
                             num_updates=md.get("num_updates"), restored=r)
