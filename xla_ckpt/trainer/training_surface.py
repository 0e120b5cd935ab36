"""The live-training surface of :class:`~xla_ckpt.trainer.Checkpointer` (fairseq ``Trainer``'s).

The optimizer and lr_scheduler (built lazily, rebuilt over the live
parameters), ``num_updates`` and the lr steps that follow it, and the
training-time counter.  :class:`TrainingSurface` also declares the state the
save (:mod:`~xla_ckpt.trainer.save_state`) and restore
(:mod:`~xla_ckpt.trainer.restore_state`) parts share; the constructor in
:mod:`~xla_ckpt.trainer.checkpointer` sets it.
"""

from __future__ import annotations

import logging
from itertools import chain
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, TypeGuard

import torch

from xla_ckpt.errors import ConfigError
from xla_ckpt.trainer.lr_scheduler import is_fairseq_style
from xla_ckpt.trainer.sources import Restorer, Saver

if TYPE_CHECKING:  # checkpointer imports this module
    from xla_ckpt.trainer.config import CheckpointerConfig

# One logger for all of the Checkpointer's parts: its lines keep the name they had as one module.
logger = logging.getLogger("xla_ckpt.trainer.checkpointer")


def has_parameters(module: Optional[torch.nn.Module]) -> TypeGuard[torch.nn.Module]:
    """fairseq ``utils.has_parameters``: True if ``module`` has at least one parameter."""
    return module is not None and next(iter(module.parameters()), None) is not None


class TrainingSurface:
    """Optimizer, lr_scheduler, ``num_updates``, training time; and the state every part shares."""

    model: torch.nn.Module
    criterion: Optional[torch.nn.Module]
    build_optimizer: Optional[Callable[[list], torch.optim.Optimizer]]
    build_lr_scheduler: Optional[Callable[[torch.optim.Optimizer], Any]]
    _optimizer: Optional[torch.optim.Optimizer]
    _lr_scheduler: Any
    metrics: Any
    cfg: Any
    args: Any
    config: CheckpointerConfig
    restorer: Restorer
    saver: Saver
    device: torch.device | str | None
    rank: int
    clock: Callable[[], float]
    _num_updates: int
    _optim_history: list  # optimizer_history restored (a save appends this run's entry)
    _start_time: float  # clock() when training (re)started
    _previous_training_time: float  # seconds trained before this restart
    rank_state: Any
    _restore_built: Optional[torch.optim.Optimizer]  # prepared by restore_targets (sharded)
    _restore_was_empty: bool  # its state was empty before restore_targets initialised it
    _restore_call: tuple[bool, bool, str]  # (reset_optimizer, reset_lr_scheduler, uri) of the
    # restore in progress, for the checks made before its read
    _sharded_read_in_place: bool  # the restore in progress read into live DTensors
    _records_plan: Optional[tuple[Any, Any]]  # (manifest item, RestorePlan its records passed)
    _checked_read: Optional[tuple[Any, Any]]  # (state read from that item, that RestorePlan)
    _sharded_memo: Optional[dict[int, tuple[Any, bool]]]  # is_sharded_module answers, by
    # id(module), within one load_checkpoint (None outside one)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            self._build_optimizer()
        return self._optimizer  # type: ignore[return-value]  # _build_optimizer set it

    @property
    def lr_scheduler(self) -> Any:
        if self._lr_scheduler is None and self.build_lr_scheduler is not None:
            if self._optimizer is None:
                self._build_optimizer()  # builds both, as fairseq does
            else:
                self._lr_scheduler = self.build_lr_scheduler(self._optimizer)
                self._first_step_update()
        return self._lr_scheduler

    def live_parameters(self) -> list[torch.nn.Parameter]:
        """Trainable parameters of the model, then the criterion (fairseq order)."""
        crit: Iterable = self.criterion.parameters() if self.criterion is not None else ()
        return [p for p in chain(self.model.parameters(), crit) if p.requires_grad]

    def _build_optimizer(self) -> None:
        """fairseq ``_build_optimizer``: optimizer over the live parameters, then the scheduler."""
        self._optimizer, self._lr_scheduler = self._make_optimizer()

    def _make_optimizer(self) -> tuple[torch.optim.Optimizer, Any]:
        """A new (optimizer, lr_scheduler) pair over the live parameters, not yet installed.

        The restore builds one before anything is loaded, to check the checkpoint against
        it, and installs it once the model is loaded (the live pair is untouched until then).
        """
        if self.build_optimizer is None:
            raise ConfigError("build_optimizer: cannot rebuild the optimizer without it")
        optimizer = self.build_optimizer(self.live_parameters())
        sched = (self.build_lr_scheduler(optimizer)
                 if self.build_lr_scheduler is not None else None)
        if sched is not None and is_fairseq_style(sched):
            sched.step_update(0)
        return optimizer, sched

    def _first_step_update(self) -> None:
        if is_fairseq_style(self._lr_scheduler):
            self._lr_scheduler.step_update(0)

    def get_num_updates(self) -> int:
        return self._num_updates

    def set_num_updates(self, num_updates: int) -> None:
        """Set the update count and let the lr_scheduler follow (fairseq semantics)."""
        self._num_updates = num_updates
        self.lr_step_update()
        self._log_scalar("num_updates", self._num_updates, priority=200)

    def lr_step(self, epoch: int, val_loss: Any = None) -> Any:
        """End of ``epoch``: a fairseq-style scheduler steps; a torch scheduler is left alone.

        Returns the learning rate of the first param group afterwards.
        """
        sched = self.lr_scheduler
        if is_fairseq_style(sched):
            sched.step(epoch, val_loss)
            return self.lr_step_update()
        return self.get_lr()

    def lr_step_update(self) -> Any:
        """After an update: a fairseq-style scheduler sets the lr from ``num_updates``."""
        sched = self.lr_scheduler
        if not is_fairseq_style(sched):
            return self.get_lr()
        new_lr = sched.step_update(self.get_num_updates())
        if isinstance(new_lr, dict):
            for k, v in new_lr.items():
                self._log_scalar(f"lr_{k}", v, priority=300)
            new_lr = new_lr.get("default", next(iter(new_lr.values())))
        else:
            self._log_scalar("lr", new_lr, priority=300)
        return new_lr

    def get_lr(self) -> Any:
        return self.optimizer.param_groups[0]["lr"]

    def _log_scalar(self, key: str, value: Any, priority: int) -> None:
        log = getattr(self.metrics, "log_scalar", None)
        if log is not None:
            log(key, value, weight=0, priority=priority)

    def cumulative_training_time(self) -> float:
        """Seconds of training so far, across restarts."""
        return self.clock() - self._start_time + self._previous_training_time
