"""CheckpointManager: when and where to save, async upload, commit, pointers, rotation, preemption.

The manager decides *when* and *where*; the caller (e.g. :mod:`xla_ckpt.trainer`)
decides *what* the state is.  Roles on save (all ranks call the same methods at
the same update boundary):

* rank 0 writes the replicated state (item ``state``);
* every rank writes its own private state, if it passes one (item ``rank/<r>``:
  iterator/RNG state), and its pieces of flat sharded tensors (item ``shard/<r>``:
  ZeRO optimizer state, the layout :func:`xla_ckpt.restore.save_distributed` writes);
* after every rank's upload is done (one ``exchange`` of the written items acts
  as the barrier) rank 0, the coordinator, writes the manifest (the commit
  marker), then the ``checkpoint_last`` / ``checkpoint_best`` pointers, then
  deletes old checkpoints (rotation).  Nothing is deleted before a newer
  checkpoint has committed, and never the checkpoint this job restored from.

Async save (``async_save=True``): the state is staged to host memory on the
training thread (:mod:`xla_ckpt.manager.staging`), uploaded by a background
thread while training goes on, and committed at a later update boundary.  At
most one save is in flight; a new save first finishes the previous one.  A
failure on any rank surfaces on every rank as :class:`CheckpointSaveError` at
the next boundary or :meth:`CheckpointManager.wait`.

Preemption: SIGTERM sets a flag; at the next update boundary the ranks agree
(any rank's flag counts), every rank saves, the save commits, and the process
exits with status 0 (``exit_on_preemption``).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from xla_ckpt.comm import Dist, get_dist
from xla_ckpt.config import CheckpointConfig
from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    DistributedError,
    IncompleteCheckpointError,
    StorageError,
    StoragePermissionError,
)
from xla_ckpt.format.manifest import FORMAT_NAME, FORMAT_VERSION, STATE_ITEM, Manifest, rank_item
from xla_ckpt.io.catalog import pointer_name, resolve_latest, write_pointer
from xla_ckpt.io.writer import WrittenItem, commit, discard, new_save_id, write_item
from xla_ckpt.manager.naming import preemption_name, scheduled_name
from xla_ckpt.manager.preemption import PreemptionNotice
from xla_ckpt.manager.rotation import rotate
from xla_ckpt.manager.staging import StagingPool, stage_to_host
from xla_ckpt.restore import RestoreConfig, Restored
from xla_ckpt.restore import restore as restore_checkpoint
from xla_ckpt.restore.save import _shard_layout as shard_layout
from xla_ckpt.restore.sharding import shard_item, shard_state
from xla_ckpt.storage import Storage, StorageConfig, open_storage

logger = logging.getLogger(__name__)

#: Metadata keys the manager writes; metric names must differ from these.
RESERVED_METADATA = ("epoch", "num_updates", "end_of_epoch", "preempted", "world_size")

StateArg = Any  # a state, or a zero-argument callable returning it

# Errors that reach every rank with their own type when rank 0 hits them resolving a restore.
_SHARED_ERRORS = {c.__name__: c for c in (CheckpointNotFoundError, IncompleteCheckpointError,
                                          CheckpointCorruptError, StorageError,
                                          StoragePermissionError)}


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


@dataclass
class StepResult:
    """What :meth:`CheckpointManager.after_update` did at this update boundary.

    Attributes:
        saved: checkpoint started at this boundary (async) or committed (sync), else None.
        committed: checkpoints whose commit every rank learned of during this call.
        preempted: the ranks agreed on a preemption (only seen with ``exit_on_preemption=False``;
            otherwise the call raises ``SystemExit(0)`` after the save commits).
    """

    saved: str | None = None
    committed: tuple[str, ...] = ()
    preempted: bool = False


@dataclass
class _InFlight:
    name: str
    save_id: str
    metadata: dict
    storage: Storage
    upload: cf.Future
    phase: str = "upload"  # "upload" -> "commit"
    commit: cf.Future | None = None  # rank 0 only
    manifest_written: bool = False
    staged_bytes: int = 0
    t0: float = field(default_factory=time.perf_counter)
    buffers: list = field(default_factory=list)  # host staging buffers, reusable once uploaded


def _status(fut: cf.Future | None) -> str:
    if fut is None:
        return ""
    if not fut.done():
        return "pending"
    exc = fut.exception()
    return "done" if exc is None else f"error:{type(exc).__name__}: {exc}"


def _parts_from_json(docs: list[dict], save_id: str, rank: int) -> list[WrittenItem]:
    """Rebuild (and validate) the items rank ``rank`` wrote from their JSON form."""
    out = []
    for d in docs:
        doc = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "save_id": save_id,
               "files": d["files"], "items": {d["name"]: d["item"]}}
        m = Manifest.from_json_bytes(json.dumps(doc).encode("utf-8"),
                                     where=f"item {d['name']!r} written by rank {rank}")
        out.append(WrittenItem(d["name"], m.items[d["name"]], dict(m.files)))
    return out


def _done_future(value: Any) -> cf.Future:
    f: cf.Future = cf.Future()
    f.set_result(value)
    return f


def _failed_future(exc: BaseException) -> cf.Future:
    f: cf.Future = cf.Future()
    f.set_exception(exc)
    return f


class CheckpointManager:
    """Saves on a schedule, keeps the newest/best, resumes, and handles preemption.

    Every rank constructs one with the same config and calls the same methods
    at the same points of the training loop (the collective ones say so).

    Typical loop (fairseq ``train.py`` semantics)::

        mgr = CheckpointManager(cfg.checkpoint, dist=get_dist(), storage_config=cfg.storage)
        resumed = mgr.restore_or_initialize()          # None -> fresh start
        for epoch in ...:
            for i, batch in ...:
                ...; num_updates += 1
                mgr.after_update(epoch=epoch, num_updates=num_updates,
                                 end_of_epoch=(i == last), state=trainer.state_dict,
                                 rank_state=trainer.rank_state_dict,
                                 metrics={"loss": valid_loss} if i == last else None)
        mgr.close()                                    # waits for the last save

    Args:
        config: the schedule, retention, async and preemption knobs.
        dist: the job's :class:`xla_ckpt.comm.Dist` (only ``rank``, ``world_size``
            and ``exchange`` are used); default :func:`xla_ckpt.comm.get_dist`.
        storage_config: storage knobs for ``config.save_dir``.
        restore_config: how :meth:`restore_or_initialize` moves the bytes (strategy
            ``auto`` / ``all_ranks`` / ``broadcast``, bucket size, ZeRO sharding).
        storage: an already open storage rooted at the run folder (overrides
            ``config.save_dir``; the caller keeps ownership).
    """

    def __init__(self, config: CheckpointConfig, *, dist: Dist | None = None,
                 storage_config: StorageConfig | None = None,
                 restore_config: RestoreConfig | None = None,
                 storage: Storage | None = None) -> None:
        self.config = config
        self.restore_config = restore_config or RestoreConfig()
        self.dist = dist if dist is not None else get_dist()
        self.rank = int(self.dist.rank)
        self.world_size = int(self.dist.world_size)
        self.run = storage if storage is not None else open_storage(config.save_dir,
                                                                     storage_config)
        self._own_run = storage is None
        self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix=f"xla_ckpt-save-r{self.rank}")
        self._inflight: _InFlight | None = None
        self._pool = StagingPool() if config.reuse_staging_buffers else None
        self._notice = PreemptionNotice()
        if config.handle_sigterm:
            self._notice.install()
        self._preempt_agreed = False
        self._last_saved: tuple[str, int] | None = None  # (name, num_updates) of the newest save
        self._best: float | None = None  # coordinator: best metric among committed checkpoints
        self._closed = False
        self.restored_from: str | None = None
        """Folder name of the checkpoint this job restored (never rotated away)."""

    # ---- schedule ------------------------------------------------------------------------
    def should_save(self, *, epoch: int, num_updates: int,
                    end_of_epoch: bool = False) -> str | None:
        """Checkpoint name the schedule asks for at this boundary, or None.  Pure, any rank."""
        return scheduled_name(self.config, epoch=epoch, num_updates=num_updates,
                              end_of_epoch=end_of_epoch)

    @property
    def in_flight(self) -> str | None:
        """Name of the save being uploaded or committed, or None."""
        return self._inflight.name if self._inflight else None

    @property
    def preemption_requested(self) -> bool:
        """True once this process got SIGTERM (or :meth:`request_preemption`)."""
        return self._notice.requested

    def request_preemption(self) -> None:
        """Act as if SIGTERM arrived: save at the next update boundary, then exit."""
        self._notice.request()

    # ---- the training-loop hook ----------------------------------------------------------
    def after_update(self, *, epoch: int, num_updates: int, state: StateArg,
                     rank_state: StateArg = None, shards: StateArg = None,
                     end_of_epoch: bool = False,
                     metrics: dict[str, float] | None = None) -> StepResult:
        """Call on every rank after every optimizer update.  Collective.

        Saves when the schedule says so (see :func:`xla_ckpt.manager.naming.scheduled_name`)
        or when any rank was preempted; checks on the in-flight save.

        Args:
            epoch: current epoch (1-based, as fairseq).
            num_updates: updates done so far, this one included.
            state: the replicated state, or a zero-argument callable returning it
                (called on every rank, only when saving; it may run collectives,
                e.g. optimizer consolidation).  Only rank 0's is written.
            rank_state: this rank's private state (or callable), written as item
                ``rank/<rank>``; None for none.
            shards: this rank's pieces of flat sharded tensors (ZeRO optimizer state,
                ``{key: tensor}``, or a callable), written as item ``shard/<rank>``
                exactly as :func:`xla_ckpt.restore.save_distributed` does; rank ``r``'s
                piece is the ``r``-th contiguous range.  Pass it on every rank or on none.
            end_of_epoch: this update was the last of the epoch.
            metrics: validation metrics for this checkpoint (``best_checkpoint_metric``
                picks the one ``checkpoint_best`` and ``keep_best_checkpoints`` use);
                rank 0's are recorded in the manifest metadata.

        Returns:
            A :class:`StepResult` (``preempted`` is reported once, with
            ``exit_on_preemption=False``; the caller should then stop).

        Raises:
            CheckpointSaveError: a save failed on some rank (every rank raises it).
            SystemExit: with code 0 after a preemption save committed
                (``exit_on_preemption``).
            CollectiveTimeoutError: another rank did not reach this boundary in time.
        """
        self._check_open()
        cfg = self.config
        name = self.should_save(epoch=epoch, num_updates=num_updates, end_of_epoch=end_of_epoch)
        committed: list[str] = []
        if self._inflight is not None or name is not None \
                or num_updates % cfg.sync_interval_updates == 0:
            committed += self._sync(block=False)
        preempted = self._preempt_agreed
        already = self._last_saved is not None and self._last_saved[1] == num_updates
        if preempted and name is None and not already and not cfg.no_save:
            name = preemption_name(cfg, epoch=epoch, num_updates=num_updates,
                                   end_of_epoch=end_of_epoch)
        saved = None
        if name is not None and (self._last_saved is None or self._last_saved[0] != name):
            committed += self._save(state, rank_state, shards, name=name, epoch=epoch,
                                    num_updates=num_updates, end_of_epoch=end_of_epoch,
                                    metrics=metrics, preempted=preempted,
                                    block=preempted or not cfg.async_save)
            saved = name
        if preempted:
            committed += self.wait()
            if self.rank == 0:
                logger.warning("[rank %d] preemption: every rank saved at update %d (%s); %s",
                               self.rank, num_updates, self._last_saved[0] if self._last_saved
                               else "nothing to save", "exiting" if cfg.exit_on_preemption
                               else "stopping")
            if cfg.exit_on_preemption:
                self.close()
                raise SystemExit(0)
            # Reported once; the caller stops (or a later SIGTERM asks again).
            self._preempt_agreed = False
            self._notice.clear()
        return StepResult(saved=saved, committed=tuple(committed), preempted=preempted)

    def save(self, state: StateArg, *, epoch: int, num_updates: int, name: str | None = None,
             rank_state: StateArg = None, shards: StateArg = None, end_of_epoch: bool = False,
             metrics: dict[str, float] | None = None, block: bool | None = None) -> str:
        """Save now, outside the schedule.  Collective: every rank calls it.

        Args:
            name: checkpoint folder name (default: the preemption-style
                ``checkpoint_<epoch>_<updates>``, or ``checkpoint<epoch>`` at an
                epoch end that the schedule saves).
            block: wait until committed (default: ``not config.async_save``).

        Returns:
            The checkpoint folder name.

        Raises:
            CheckpointSaveError: this or the previous save failed on some rank.
        """
        self._check_open()
        name = name or preemption_name(self.config, epoch=epoch, num_updates=num_updates,
                                       end_of_epoch=end_of_epoch)
        self._save(state, rank_state, shards, name=name, epoch=epoch, num_updates=num_updates,
                   end_of_epoch=end_of_epoch, metrics=metrics, preempted=False,
                   block=(not self.config.async_save) if block is None else block)
        return name

    def wait(self) -> tuple[str, ...]:
        """Block until the in-flight save (if any) committed on every rank.  Collective.

        Returns:
            Names of checkpoints whose commit was confirmed during this call.

        Raises:
            CheckpointSaveError: the save failed on some rank (every rank raises it).
        """
        if self._inflight is None:
            return ()
        return tuple(self._sync(block=True))

    # ---- restore -------------------------------------------------------------------------
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
            ``checkpoint_last`` and nothing is committed yet.

        Raises:
            CheckpointNotFoundError: an explicitly named checkpoint (or ``checkpoint_best``)
                does not exist (every rank raises it).
            DistributedError: a read failed on some rank (corrupt bytes, storage error);
                ``failures`` names the ranks, on every rank.
        """
        self._check_open()
        decision: Any = None
        if self.rank == 0:
            try:
                decision = ("ok", *self._resolve_restore())
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
        _, uri, name, in_run, best = decision
        self._best = best
        if uri is None:
            if self.rank == 0:
                logger.info("[rank %d] no committed checkpoint under %s: starting fresh",
                            self.rank, self.run.uri)
            if init_fn is not None:
                init_fn()
            return None
        result = self._read_checkpoint(uri, name, map_location)
        if in_run:
            self.restored_from = name
        if result.num_updates is not None:
            self._last_saved = (name, result.num_updates)
        return result

    # ---- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the in-flight save (collective), stop the save thread, remove the handler."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._inflight is not None:
            self._inflight.storage.close()
            self._inflight = None
        self._notice.uninstall()
        if self._own_run:
            self.run.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif not self._closed:
            # Abandon an in-flight save without a collective (other ranks may be gone):
            # its folder stays uncommitted and is never restored.
            self._shutdown()

    # ---- internals: saving ---------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")

    def _exchange(self, obj: Any) -> list[Any]:
        out = self.dist.exchange(obj)
        if len(out) != self.world_size:
            raise DistributedError(f"exchange returned {len(out)} entries for world size "
                                   f"{self.world_size}")
        return out

    def _metadata(self, *, epoch: int, num_updates: int, end_of_epoch: bool, preempted: bool,
                  metrics: dict[str, Any] | None) -> dict:
        md: dict[str, Any] = {"epoch": epoch, "num_updates": num_updates,
                              "end_of_epoch": end_of_epoch, "preempted": preempted,
                              "world_size": self.world_size}
        for k, v in (metrics or {}).items():
            if k in RESERVED_METADATA:
                raise ValueError(f"metric name {k!r} is reserved for checkpoint metadata "
                                 f"({', '.join(RESERVED_METADATA)}); rename it")
            try:
                md[k] = float(v.item() if hasattr(v, "item") else v)
            except (TypeError, ValueError):
                raise ValueError(f"metric {k!r} must be a number, got {v!r}") from None
        return md

    def _save(self, state: StateArg, rank_state: StateArg, shards: StateArg, *, name: str,
              epoch: int, num_updates: int, end_of_epoch: bool, metrics: dict | None,
              preempted: bool, block: bool) -> list[str]:
        committed = list(self._sync(block=True))  # at most one save in flight
        metadata = self._metadata(epoch=epoch, num_updates=num_updates,
                                  end_of_epoch=end_of_epoch, preempted=preempted, metrics=metrics)
        t0 = time.perf_counter()
        sh = shards() if callable(shards) else shards
        flat = None
        if sh is not None:
            # A collective: every rank learns the others' piece sizes (and they must agree).
            flat = {k: t.detach().reshape(-1) for k, t in sh.items()}
            bounds, numels = shard_layout(self.dist, flat)
        # One save id for every rank's data files (rank 0 picks it), so a failed save's files
        # can be found and removed, and a commit removes the files of earlier saves.
        save_id = self._exchange(new_save_id() if self.rank == 0 else None)[0]
        storage = self.run.child(name)
        buffers: list = []
        nbytes = 0
        try:
            st = state() if callable(state) else state
            rs = rank_state() if callable(rank_state) else rank_state
            payload = [st if self.rank == 0 else None, rs,
                       shard_state(flat, bounds, numels) if flat is not None else None]
            if block:
                # The caller waits anyway: write the live state from this thread, no copy.
                upload = _done_future(self._upload_job(storage, save_id, *payload))
            else:
                staged = [stage_to_host(p, self._pool) if p is not None else None
                          for p in payload]
                for sg in staged:
                    if sg is not None:
                        buffers += sg.buffers
                        nbytes += sg.nbytes
                upload = self._executor.submit(self._upload_job, storage, save_id,
                                               *[sg.state if sg else None for sg in staged])
                del staged
            del payload
        except Exception as e:  # noqa: BLE001 - agreed on with the other ranks in _sync
            upload = _failed_future(e)
        self._inflight = _InFlight(name=name, save_id=save_id, metadata=metadata,
                                   storage=storage, upload=upload, staged_bytes=nbytes, t0=t0,
                                   buffers=buffers)
        self._last_saved = (name, num_updates)
        logger.debug("[rank %d] %s %s: %d bytes in %.3f s", self.rank,
                     "wrote" if block else "staged", name, nbytes, time.perf_counter() - t0)
        if block:
            committed += self._sync(block=True)
        return committed

    def _upload_job(self, storage: Storage, save_id: str, state: Any, rank_state: Any,
                    shards: Any) -> list[WrittenItem]:
        """Write this rank's items (each a state, or None for none); returns what was written."""
        parts = []
        if state is not None:
            parts.append(write_item(storage, save_id, STATE_ITEM, state))
        if rank_state is not None:
            parts.append(write_item(storage, save_id, rank_item(self.rank), rank_state))
        if shards is not None:
            parts.append(write_item(storage, save_id, shard_item(self.rank), shards))
        return parts

    def _commit_job(self, fl: _InFlight, parts: list[WrittenItem]) -> None:
        """Coordinator only: manifest (commit marker), then pointers, then rotation."""
        commit(fl.storage, fl.save_id, parts, metadata=fl.metadata, world_size=self.world_size)
        fl.manifest_written = True
        md = fl.metadata
        write_pointer(self.run, "last", fl.name, epoch=md["epoch"], num_updates=md["num_updates"])
        metric = self.config.best_checkpoint_metric
        value = md.get(metric)
        if isinstance(value, float) and math.isfinite(value) and self._is_better(value):
            write_pointer(self.run, "best", fl.name, metric=metric, value=value)
            self._best = value
        try:
            rotate(self.run, self.config, protect={fl.name} | ({self.restored_from}
                                                              if self.restored_from else set()))
        except Exception as e:  # noqa: BLE001 - rotation failing must not fail training
            logger.warning("[rank %d] could not delete old checkpoints under %s: %s (will retry "
                           "after the next save)", self.rank, self.run.uri, e)

    def _is_better(self, value: float) -> bool:
        if self._best is None:
            return True
        # fairseq: ties go to the newer checkpoint.
        return value >= self._best if self.config.maximize_best_checkpoint_metric \
            else value <= self._best

    def _sync(self, *, block: bool) -> list[str]:
        """Exchange preemption flags and save progress; advance the in-flight save.  Collective.

        Every rank runs the same branches because they act only on the
        exchanged messages.  With ``block`` it loops until nothing is in flight.
        """
        committed: list[str] = []
        while True:
            fl = self._inflight
            if block and fl is not None:
                waiting = fl.upload if fl.phase == "upload" else fl.commit
                if waiting is not None:
                    cf.wait([waiting])
            msg = (self._notice.requested,
                   _status(fl.upload) if fl is not None and fl.phase == "upload" else "",
                   _status(fl.commit) if fl is not None and fl.phase == "commit" else "")
            msgs = self._exchange(msg)
            if any(m[0] for m in msgs):
                self._preempt_agreed = True
            if fl is not None:
                failures = {r: m[1][6:] for r, m in enumerate(msgs) if m[1].startswith("error:")}
                if msgs[0][2].startswith("error:"):
                    failures[0] = msgs[0][2][6:]
                if failures:
                    self._fail(fl, failures)
                if fl.phase == "upload" and all(m[1] == "done" for m in msgs):
                    gathered = self._exchange([p.to_json() for p in fl.upload.result()])
                    fl.phase = "commit"
                    if self.rank == 0:
                        parts = [p for r, docs in enumerate(gathered)
                                 for p in _parts_from_json(docs, fl.save_id, r)]
                        fl.commit = self._executor.submit(self._commit_job, fl, parts)
                elif fl.phase == "commit" and msgs[0][2] == "done":
                    self._inflight = None
                    fl.storage.close()
                    self._recycle(fl)
                    committed.append(fl.name)
                    if self.rank == 0:
                        dt = time.perf_counter() - fl.t0
                        logger.info("[rank %d] committed %s (%d bytes staged on rank 0) %.2f s "
                                    "after staging", self.rank, fl.storage.uri, fl.staged_bytes,
                                    dt)
            if not block or self._inflight is None:
                return committed

    def _recycle(self, fl: _InFlight) -> None:
        """Hand an uploaded snapshot's host buffers to the pool for the next save."""
        if self._pool is not None and fl.buffers:
            self._pool.release(fl.buffers)
        fl.buffers = []

    def _fail(self, fl: _InFlight, failures: dict[int, str]) -> None:
        self._inflight = None
        if self._last_saved is not None and self._last_saved[0] == fl.name:
            self._last_saved = None
        # Every rank lets its own upload finish, then rank 0 removes the uncommitted data files.
        cf.wait([f for f in (fl.upload, fl.commit) if f is not None])
        own = None
        for fut in (fl.upload, fl.commit):
            if fut is not None and fut.exception() is not None:
                own = fut.exception()
        self._recycle(fl)
        self._exchange(None)
        if self.rank == 0 and not fl.manifest_written:
            discard(fl.storage, fl.save_id)
        fl.storage.close()
        what = ("committed, but updating its pointers failed" if fl.manifest_written
                else "nothing was committed; the previous checkpoint and pointers are unchanged")
        raise CheckpointSaveError(f"saving checkpoint {fl.storage.uri} failed ({what})",
                                  failures) from own

    # ---- internals: restoring ------------------------------------------------------------
    def _resolve_restore(self) -> tuple[str | None, str, bool, float | None]:
        """Rank 0: (checkpoint URI or None, folder name, is it in the run folder, best metric)."""
        rf = self.config.restore_file
        best = self._read_best_value()
        if rf == "checkpoint_last":
            name = resolve_latest(self.run)
            return (self.run.url(name) if name else None), name or "", True, best
        if rf == "checkpoint_best":
            name = self._pointer_doc("best").get("checkpoint")
            if not name:
                raise CheckpointNotFoundError(
                    f"{self.run.url(pointer_name('best'))}: no checkpoint_best pointer; restore "
                    "checkpoint_last or name a checkpoint folder")
            return self.run.url(name), name, True, best
        if "://" in rf or rf.startswith(("/", "./", "../")):
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
