"""The save schedule of :class:`~xla_ckpt.manager.CheckpointManager`: when to save.

:meth:`SaveSchedule.after_update`, called at every update boundary, saves
when :func:`~xla_ckpt.manager.naming.scheduled_name` names a checkpoint, checks
on the in-flight save, and acts on a preemption (SIGTERM on any rank): every
rank saves, the save commits, then the process exits or the caller stops.
"""

from __future__ import annotations

from dataclasses import dataclass

from xla_ckpt.manager import lockstep
from xla_ckpt.manager.base import logger
from xla_ckpt.manager.naming import preemption_name, scheduled_name, update_checkpoint_name
from xla_ckpt.manager.saving import MetricValues, SavePath, StateArg


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


class SaveSchedule(SavePath):
    """The schedule and the training-loop hook, on top of the save path."""

    # ---- schedule ------------------------------------------------------------------------
    def should_save(self, *, epoch: int, num_updates: int,
                    end_of_epoch: bool = False) -> str | None:
        """Checkpoint name the schedule asks for at this boundary, or None.  Pure, any rank."""
        return scheduled_name(self.config, epoch=epoch, num_updates=num_updates,
                              end_of_epoch=end_of_epoch)

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
                     metrics: MetricValues | None = None) -> StepResult:
        """Call on every rank after every optimizer update.  Collective.

        Saves when the schedule says so (see :func:`xla_ckpt.manager.naming.scheduled_name`)
        or when any rank was preempted; checks on the in-flight save.

        Args:
            epoch: current epoch (1-based, as fairseq).
            num_updates: updates done so far, this one included.
            state: the replicated state, or a zero-argument callable returning it
                (called on every rank, only when saving; it may run collectives,
                e.g. optimizer consolidation).  Only rank 0's is written, so every
                rank must hold the same tensors (keys, shapes, dtypes; checked before
                anything is written).  Sharded tensors (DTensor: FSDP2 / tensor
                parallel, e.g. ``get_state_dict(model, optim)``; torch_xla SPMD) are
                saved by their owners instead: each rank writes its own shards (and a
                byte-balanced share of the replicated tensors).
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
            CheckpointSaveError: a save failed on some rank (every rank raises it); or the
                ranks hold different state (a rank with keys the others lack, one rank
                alone passing DTensors or ``shards``): refused on every rank before
                anything is written, naming the rank and the key.
            FencedError: a newer incarnation of the job took the run folder over; every
                later save (a preemption save too) raises it at once, writing nothing.
            SystemExit: with code 0 after a preemption save committed
                (``exit_on_preemption``).
            ScheduleMismatchError: the ranks disagree about the schedule: another
                ``epoch`` / ``num_updates`` / ``end_of_epoch`` / ``metrics`` on some rank, a
                rank that skipped a call, or one in another manager call (every rank raises
                it, naming each rank's position and values; :mod:`~xla_ckpt.manager.lockstep`).
            CollectiveTimeoutError: another rank did not reach this boundary in time (named).
        """
        self._check_open()
        self._update_calls += 1
        with self._at(lockstep.position("after_update", calls=self._update_calls, epoch=epoch,
                                        num_updates=num_updates, end_of_epoch=end_of_epoch,
                                        metrics=metrics)):
            return self._after_update(epoch=epoch, num_updates=num_updates, state=state,
                                      rank_state=rank_state, shards=shards,
                                      end_of_epoch=end_of_epoch, metrics=metrics)

    def _after_update(self, *, epoch: int, num_updates: int, state: StateArg,
                      rank_state: StateArg, shards: StateArg, end_of_epoch: bool,
                      metrics: MetricValues | None) -> StepResult:
        cfg = self.config
        name = self.should_save(epoch=epoch, num_updates=num_updates, end_of_epoch=end_of_epoch)
        committed: list[str] = []
        continuous = self._tier is not None and cfg.local_policy == "continuous"
        timed = cfg.save_interval_seconds > 0 and not cfg.no_save
        if self._inflight is not None or name is not None or continuous or timed \
                or num_updates % cfg.sync_interval_updates == 0:
            committed += self._sync(block=False)
        if name is None and timed and self._durable_due and self._inflight is None:
            name = update_checkpoint_name(epoch, num_updates)  # the durable schedule in time
        preempted = self._preempt_agreed
        already = self._last_saved is not None and self._last_saved[1] == num_updates
        if preempted and name is None and not already and not cfg.no_save:
            name = preemption_name(cfg, epoch=epoch, num_updates=num_updates,
                                   end_of_epoch=end_of_epoch)
        saved = None
        local_name = None
        if name is None and not preempted and self._tier is not None and not cfg.no_save:
            due = (self._local_due and self._inflight is None) if continuous else \
                bool(cfg.local_interval_updates) and num_updates % cfg.local_interval_updates == 0
            if due:
                local_name = update_checkpoint_name(epoch, num_updates)
        if local_name is not None:
            # The local tier alone (manager.local_save); at most one save in flight, so a
            # local save waits for the one before it, as a durable save does.
            committed += self._save(state, rank_state, shards, name=local_name, epoch=epoch,
                                    num_updates=num_updates, end_of_epoch=end_of_epoch,
                                    metrics=metrics, preempted=False,
                                    block=not cfg.async_save, durable=False)
            saved = local_name
        if name is not None and (self._last_saved is None or self._last_saved[0] != name):
            committed += self._save(state, rank_state, shards, name=name, epoch=epoch,
                                    num_updates=num_updates, end_of_epoch=end_of_epoch,
                                    metrics=metrics, preempted=preempted,
                                    block=preempted or not cfg.async_save)
            saved = name
        if preempted:
            committed += self.wait()
            if self.rank == 0:
                last = self._last_saved[0] if self._last_saved else None
                tiers = ""
                if self._tier is not None and last is not None:
                    # The local commit comes first (manager.local_save), then the durable one.
                    done = {True: "committed", False: "not committed"}
                    tiers = (f"; local tier: {done[last in self.local_committed]}, "
                             f"durable: {done[last in committed]}")
                logger.warning("[rank %d] preemption: every rank saved at update %d (%s%s); %s",
                               self.rank, num_updates, last or "nothing to save", tiers,
                               "exiting" if cfg.exit_on_preemption else "stopping")
            if cfg.exit_on_preemption:
                self.close()
                raise SystemExit(0)
            # Reported once; the caller stops (or a later SIGTERM asks again).
            self._preempt_agreed = False
            self._notice.clear()
        return StepResult(saved=saved, committed=tuple(committed), preempted=preempted)
