"""CheckpointManager: when and where to save, async upload, commit, pointers, rotation, preemption.

The manager decides *when* and *where*; the caller (e.g. :mod:`xla_ckpt.trainer`)
decides *what* the state is.  Roles on save (all ranks call the same methods at
the same update boundary):

* before anything is written the ranks agree on what they save
  (:mod:`~xla_ckpt.restore.save_steps`): ranks whose state holds different tensors (a
  rank with extra keys, one rank alone passing DTensors or ``shards``) are refused
  with one :class:`~xla_ckpt.errors.CheckpointSaveError` on every rank naming the
  rank and the key (CASES C16), instead of rank 0's copy being written alone;
* rank 0 writes the replicated state (item ``state``);
* a state holding sharded tensors (``DTensor``: FSDP2, tensor parallel; torch_xla
  SPMD) is saved *chunked* instead (manifest version 2): the ranks plan who owns
  which box (:func:`xla_ckpt.restore.owners.plan_chunked_save`, collective, on the
  training thread), every rank writes the boxes it owns (its local shards, and its
  share of the replicated tensors, balanced by bytes) as item ``chunks/<r>``, and rank
  0 commits the state tree with the global tensors' chunk tables;
* every rank writes its own private state, if it passes one (item ``rank/<r>``:
  iterator/RNG state), and its pieces of flat sharded tensors (item ``shard/<r>``:
  ZeRO optimizer state, the layout :func:`xla_ckpt.restore.save_distributed` writes);
* after every rank's upload is done (one ``exchange`` of the written items acts
  as the barrier) rank 0, the coordinator, writes the manifest (the commit
  marker), then the ``checkpoint_last`` / ``checkpoint_best`` pointers, then
  deletes old checkpoints (rotation).  Nothing is deleted before a newer
  checkpoint has committed; the checkpoint this job restored from counts among the
  kept N like any other (keep-N means N after a resume).

Restore (:meth:`CheckpointManager.restore_or_initialize`, :meth:`CheckpointManager.restore`):
``into=`` live targets (e.g. ``get_state_dict(model, optimizer)`` of an FSDP2 model) are
filled in place, each rank reading only its shards' byte ranges, onto any mesh or world
size; per-rank items on another world size follow ``restore_config.rank_state_on_resize``
(error naming them by default, ``"drop"`` with a WARNING) or ``rank_state_remap``.

Async save (``async_save=True``): the state is staged to host memory on the
training thread (:mod:`xla_ckpt.manager.staging`; for a chunked save, the boxes this
rank owns), uploaded by a background
thread while training goes on, and committed at a later update boundary.  At
most one save is in flight; a new save first finishes the previous one.  A
failure on any rank surfaces on every rank as :class:`CheckpointSaveError` at
the next boundary or :meth:`CheckpointManager.wait`.  Leaving ``with manager:`` with an
exception (Ctrl-C, ``SystemExit``, an error in the loop) while a save is in flight commits
it within ``exit_grace_s`` (a second Ctrl-C gives it up), or names it as abandoned in an
ERROR line; the previous checkpoint and the pointers stay as they were (CASES C27).

Fencing (:mod:`xla_ckpt.run.fencing`): each incarnation of the job takes the next epoch
of the run folder's lease (``<run>/lease.json``) at its first save (rank 0 takes it, every
rank learns it), or earlier when it calls :meth:`CheckpointManager.take_over`.  A restore,
a step query or a partial restore never takes it and writes nothing, so an evaluator
polling the run never fences the trainer (CASES C25).  The coordinator checks the lease
before the commit marker, the pointers and rotation; when a newer incarnation took it every
rank raises :class:`~xla_ckpt.errors.FencedError` and every later save raises it at once.  Commit
markers are created with ``if_generation_match=0``, pointers move by compare-and-swap
and never backwards, and rotation never deletes what a newer incarnation wrote.

Preemption: SIGTERM sets a flag; at the next update boundary the ranks agree
(any rank's flag counts), every rank saves, the save commits, and the process
exits with status 0 (``exit_on_preemption``).

The class is built from one part per concern, each in its module:
:mod:`~xla_ckpt.manager.schedule` (when to save: :meth:`~CheckpointManager.should_save`,
:meth:`~CheckpointManager.after_update`, preemption), :mod:`~xla_ckpt.manager.saving`
(the save path: :meth:`~CheckpointManager.save`, upload, commit, pointers, best-N,
rotation, the in-flight save) and :mod:`~xla_ckpt.manager.restoring` (the restore path:
:meth:`~CheckpointManager.restore_or_initialize`, :meth:`~CheckpointManager.restore`,
:meth:`~CheckpointManager.all_steps`, :meth:`~CheckpointManager.latest_step`,
:meth:`~CheckpointManager.best_step`); :mod:`~xla_ckpt.manager.best` ranks checkpoints
(the config's metric or a ``best_fn``); :mod:`~xla_ckpt.manager.base` declares the state
they share.  This module holds the constructor and the lifecycle.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import time
from types import TracebackType

from xla_ckpt.comm import Dist, get_dist
from xla_ckpt.io.mapped_writer import MappedPages
from xla_ckpt.manager.best import RESERVED_METADATA, BestFn, BestScore
from xla_ckpt.manager.config import CheckpointConfig
from xla_ckpt.manager.preemption import PreemptionNotice
from xla_ckpt.manager.restoring import RestorePath, RestoreResult
from xla_ckpt.manager.saving import StateArg
from xla_ckpt.manager.schedule import SaveSchedule, StepResult
from xla_ckpt.manager.staging import StagingPool
from xla_ckpt.restore import RestoreConfig
from xla_ckpt.run.local_tier import LocalTier
from xla_ckpt.storage import Storage, StorageConfig, open_storage

LEASE_CHECK_WAIT_S = 30.0
"""Seconds ``close()`` waits for a background lease read of a local-only save still running
(one GCS request; then the storage is closed under it and its answer dropped)."""

# Defined in the part modules, importable from here as before the split.
__all__ = ["CheckpointManager", "RESERVED_METADATA", "RestoreResult", "StateArg", "StepResult"]


class CheckpointManager(SaveSchedule, RestorePath):
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

    Steps, as Orbax's and torch_xla's ``CheckpointManager`` (a step is the ``num_updates``
    a committed checkpoint records; every call is collective, rank 0 decides)::

        mgr.all_steps()                    # [500, 1000, 1500]
        mgr.latest_step()                  # 1500 (what restore() / checkpoint_last pick)
        mgr.best_step()                    # by best_fn / best_mode, else best_checkpoint_metric
        r = mgr.restore(step=1000)         # RestoreResult on every rank
        w = mgr.restore(keys=["model"])    # only the model's bytes are read

    A sharded model (FSDP2 / tensor parallel) saves its live DTensors and restores into
    them, on any mesh (every rank reads only its own shards)::

        state = lambda: dict(zip(("model", "optim"), get_state_dict(model, optim)))
        mgr.after_update(epoch=e, num_updates=n, state=state, rank_state=...)
        msd, osd = get_state_dict(model, optim)
        r = mgr.restore_or_initialize(into={"model": msd, "optim": osd})
        set_state_dict(model, optim, model_state_dict=r.state["model"],
                       optim_state_dict=r.state["optim"])

    Args:
        config: the schedule, retention, async and preemption knobs.
        dist: the job's :class:`xla_ckpt.comm.Dist` (only ``rank``, ``world_size``
            and ``exchange`` are used); default :func:`xla_ckpt.comm.get_dist`.
        storage_config: storage knobs for ``config.save_dir``.
        restore_config: how :meth:`restore_or_initialize` moves the bytes (strategy
            ``auto`` / ``all_ranks`` / ``per_host`` / ``broadcast`` / ``striped``, bucket size,
            ZeRO sharding).
        storage: an already open storage rooted at the run folder (overrides
            ``config.save_dir``; the caller keeps ownership).
        best_fn: ``best_fn(metrics) -> float`` (Orbax's ``best_fn``): the score of a
            checkpoint from the metrics it was saved with, used for ``checkpoint_best``
            and ``keep_best_checkpoints`` instead of ``config.best_checkpoint_metric``.
            Called on rank 0 only; a checkpoint saved without metrics has no score; None
            or a non-finite return means no score.  If it raises for the checkpoint
            being saved, that save fails on every rank (nothing written); for an older
            one at rotation, that checkpoint counts as unscored (WARNING).  See
            :mod:`xla_ckpt.manager.best`.
        best_mode: ``"min"`` or ``"max"``: which scores are better (Orbax's
            ``best_mode``).  Default: ``"max"`` if
            ``config.maximize_best_checkpoint_metric`` else ``"min"`` (fairseq).

    Raises:
        ConfigError: ``best_fn`` is not callable, or ``best_mode`` is not ``"min"``/``"max"``.
    """

    def __init__(self, config: CheckpointConfig, *, dist: Dist | None = None,
                 storage_config: StorageConfig | None = None,
                 restore_config: RestoreConfig | None = None,
                 storage: Storage | None = None, best_fn: BestFn | None = None,
                 best_mode: str | None = None) -> None:
        self._scorer = BestScore.from_config(config, best_fn, best_mode)
        self.config = config
        self.restore_config = restore_config or RestoreConfig()
        self.dist = dist if dist is not None else get_dist()
        self.rank = int(self.dist.rank)
        self.world_size = int(self.dist.world_size)
        self.run = storage if storage is not None else open_storage(config.save_dir,
                                                                     storage_config)
        self._own_run = storage is None
        self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix=f"xla_ckpt-save-r{self.rank}")
        self._inflight = None
        self._pool = StagingPool() if config.reuse_staging_buffers else None
        self._pages = MappedPages()  # the local tier's pages this rank staged into
        self._notice = PreemptionNotice()
        if config.handle_sigterm:
            self._notice.install()
        self._preempt_agreed = False
        self._last_saved = None
        self._best = None
        self._closed = False
        self.restored_from = None
        """Folder name of the checkpoint this job restored (rotated like any other once a
        newer one of this job committed)."""
        self._lease = None
        self._fenced = None
        self._lease_check = None
        topo = self.dist.topology
        self._host = topo.host_id
        self._host_leader = topo.local_rank == 0
        self._tier = None if not config.local_dir else LocalTier(
            config.local_dir.replace("{host}", str(topo.host_id)), self.run.uri,
            host=topo.host_id,
            keep_last=config.keep_local_checkpoints, max_bytes=config.local_max_bytes)
        self._local_started = float("-inf")  # rank 0: when the last local save began
        self._durable_started = time.perf_counter()  # save_interval_seconds counts from here
        self.local_committed: list[str] = []
        """Local-tier saves this host committed (each host's leader; newest last)."""

    # ---- lifecycle -----------------------------------------------------------------------
    def take_over(self) -> int:
        """Take the run folder's lease now, before the first save.  Collective.

        A job's first save takes the lease anyway; restores and queries never do.  Call
        this when the job that restored should fence an older incarnation still running
        *before* it saves (a long warm-up): from the moment it returns, that incarnation
        can no longer commit (past the residual window of :mod:`xla_ckpt.run.fencing`), move
        a pointer or rotate.  Never call it from a process that only reads (an evaluator):
        it would stop the trainer's saves with :class:`~xla_ckpt.errors.FencedError`.
        Idempotent: a manager holding the lease keeps its epoch.

        Returns:
            This incarnation's lease epoch (every rank).

        Raises:
            CheckpointSaveError: rank 0 could not take it (every rank).
            FencedError: this manager was fenced already.
        """
        self._check_open()
        self._raise_if_fenced()
        return self._ensure_lease().epoch

    def close(self) -> None:
        """Wait for the in-flight save (collective), stop the save thread, remove the handler."""
        if self._closed:
            return
        try:
            self.wait()
        except BaseException as e:
            if self._inflight is not None:  # interrupted (Ctrl-C): named as abandoned
                self._abandon(self._inflight, f"close() ended with {type(e).__name__}")
            raise
        finally:
            self._shutdown()

    def wait_for_replicas(self, timeout_s: float | None = None) -> dict[str, dict] | None:
        """This host's leader: wait (at most ``timeout_s`` seconds) until every replication
        round queued so far has ended, and return :attr:`replication`.  Not collective;
        None (at once) on other ranks and without replicas."""
        if self._replicator is None:
            return None
        self._replicator.wait(timeout_s)
        return self.replication

    @property
    def replication(self) -> dict[str, dict] | None:
        """This host's leader: per local checkpoint, how its replication went
        (:attr:`xla_ckpt.manager.replication.Replicator.status`: ``state`` is
        ``"replicated"`` once every part's holders committed); None elsewhere."""
        if self._replicator is None:
            return None
        return {k: dict(v) for k, v in self._replicator.status.items()}

    def _shutdown(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._replicator is not None:  # rounds already queued end (bounded by the timeout)
            self._replicator.close(timeout_s=self.dist.timeout_s + LEASE_CHECK_WAIT_S)
        if self._lease_check is not None:  # one lease read at most, before the storage closes
            with contextlib.suppress(cf.TimeoutError):
                self._lease_check.exception(timeout=LEASE_CHECK_WAIT_S)
            self._lease_check = None
        if self._inflight is not None:
            self._inflight.storage.close()
            self._inflight = None
        self._notice.uninstall()
        self._pages.close()
        if self._own_run:
            self.run.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        elif not self._closed:
            # A save already handed off commits within exit_grace_s (collective, on a helper
            # thread), or is named as abandoned: its folder stays uncommitted, never restored.
            try:
                self._finish_on_exit(exc)
            finally:
                self._shutdown()

