"""fairseq-style learning-rate schedules over a plain ``torch.optim.Optimizer``.

The trainer restore drives schedulers the way fairseq's ``Trainer`` does:

* a *fairseq-style* scheduler (anything with ``step_update``) is a pure
  function of ``(epoch, num_updates)``: the restore calls
  ``step(epoch, val_loss)`` and ``step_update(num_updates)`` and the learning
  rate comes out right.  Its ``state_dict()`` is ``{"best": ...}``.
* a *torch* scheduler (``torch.optim.lr_scheduler.LRScheduler``) counts its
  own ``step()`` calls, so the restore only loads its state (``last_epoch``,
  ``_last_lr``, ...) and never steps it; the training loop steps it.

:func:`load_lr_scheduler_state` is the restore's one way in: it also takes a
*fairseq* ``lr_scheduler_state`` (``{"best": ...}``, ``{"lr": ...}``; no step
counter) into a torch scheduler when that is exact (the closed-form torch
schedules continue at ``last_epoch = num_updates``; ``ReduceLROnPlateau``
takes ``best``/``last_epoch``), and otherwise raises one
:class:`~xla_ckpt.errors.StateMismatchError` naming the live class, the
missing and extra keys and ``reset_lr_scheduler=True``, never a bare
``KeyError``.

:class:`InverseSquareRootSchedule` is fairseq's ``inverse_sqrt`` schedule.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Optional

import torch

from xla_ckpt.errors import ConfigError, StateMismatchError

logger = logging.getLogger(__name__)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set ``lr`` in every param group of ``optimizer``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def is_fairseq_style(scheduler: Any) -> bool:
    """True for schedulers driven by ``step(epoch, val_loss)`` + ``step_update(num_updates)``."""
    return callable(getattr(scheduler, "step_update", None))


class FairseqLRScheduler:
    """Base of fairseq-style schedules: tracks the best validation loss."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.best: Optional[float] = None

    def state_dict(self) -> dict:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take ``best`` (absent in fairseq's ``fixed``/``manual`` states: None)."""
        self.best = state_dict.get("best")

    def step(self, epoch: int, val_loss: Optional[float] = None) -> Optional[float]:
        """End of ``epoch``: remember the best (lowest) ``val_loss``."""
        if val_loss is not None:
            self.best = val_loss if self.best is None else min(self.best, val_loss)
        return None

    def step_update(self, num_updates: int) -> float:
        """After update ``num_updates``: set and return the learning rate."""
        return self.optimizer.param_groups[0]["lr"]


class InverseSquareRootSchedule(FairseqLRScheduler):
    """fairseq ``inverse_sqrt``: linear warm-up, then ``lr * sqrt(warmup_updates / num_updates)``.

    Args:
        optimizer: its param groups get the learning rate.
        lr: peak learning rate (one value; fairseq passes ``[lr]``).
        warmup_updates: updates of linear warm-up (>= 1).
        warmup_init_lr: learning rate at update 0; negative means 0 when
            there is a warm-up (fairseq's default of -1).

    Raises:
        ConfigError: more than one ``lr`` or ``warmup_updates`` < 1.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 lr: float | list[float] | tuple[float, ...], warmup_updates: int = 4000,
                 warmup_init_lr: float = -1) -> None:
        super().__init__(optimizer)
        lrs = list(lr) if isinstance(lr, (list, tuple)) else [lr]
        if len(lrs) != 1:
            raise ConfigError("lr: inverse_sqrt takes one learning rate, got "
                              f"{lrs}; use a fixed schedule for several")
        if warmup_updates < 1:
            raise ConfigError(f"warmup_updates: must be >= 1, got {warmup_updates}")
        warmup_end_lr = lrs[0]
        if warmup_init_lr < 0:
            warmup_init_lr = 0
        self.warmup_updates = warmup_updates
        self.warmup_init_lr = warmup_init_lr
        self.lr_step = (warmup_end_lr - warmup_init_lr) / warmup_updates
        self.decay_factor = warmup_end_lr * warmup_updates ** 0.5
        self.lr = warmup_init_lr
        set_lr(optimizer, self.lr)

    def step(self, epoch: int, val_loss: Optional[float] = None) -> float:
        super().step(epoch, val_loss)
        return self.optimizer.param_groups[0]["lr"]

    def step_update(self, num_updates: int) -> float:
        if num_updates < self.warmup_updates:
            self.lr = self.warmup_init_lr + num_updates * self.lr_step
        else:
            self.lr = self.decay_factor * num_updates ** -0.5
        set_lr(self.optimizer, self.lr)
        return self.lr


# torch schedulers whose learning rate is a closed-form function of ``last_epoch`` and their
# constructor arguments (they define ``_get_closed_form_lr``): a fairseq ``lr_scheduler_state``
# (no step counter) plus ``num_updates`` restores them exactly.
CLOSED_FORM_SCHEDULERS = ("StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR",
                          "PolynomialLR", "CosineAnnealingLR")
# What fairseq schedulers save: {"best"} (inverse_sqrt, cosine, polynomial_decay, step,
# tri_stage, triangular), {"lr"} (fixed, manual), {"best", "last_epoch"} (reduce_lr_on_plateau).
FAIRSEQ_SCHEDULER_KEYS = ("best", "lr", "last_epoch")
_RESET_LR = "pass reset_lr_scheduler=True to keep the fresh lr_scheduler"


def load_lr_scheduler_state(scheduler: Any, state: Any, *, num_updates: int,
                            where: str = "", map_fairseq: bool = True) -> bool:
    """Load an ``lr_scheduler_state`` into ``scheduler``, mapping fairseq's layout to torch's.

    Called by the trainer restore on every rank, before the optimizer state is loaded.

    * A fairseq-style scheduler (``step_update``) or any non-torch object:
      its own ``load_state_dict(state)``.
    * A torch scheduler and a torch state (every key of the live
      ``state_dict()`` present): ``load_state_dict(state)``.
    * A torch scheduler and a fairseq state (keys from
      :data:`FAIRSEQ_SCHEDULER_KEYS`, no step counter): fairseq schedules are
      functions of ``num_updates``, so a torch scheduler stepped once per update
      continues at ``last_epoch = num_updates``.  That is exact for the
      closed-form schedulers (:data:`CLOSED_FORM_SCHEDULERS`: StepLR,
      MultiStepLR, ConstantLR, LinearLR, ExponentialLR, PolynomialLR,
      CosineAnnealingLR): their constructor arguments and ``base_lrs`` (the
      live optimizer's initial ``lr``) stay the live ones,
      ``last_epoch``/``_step_count`` follow ``num_updates`` and ``_last_lr`` is
      the closed form there (which can differ in the last bit from a chain of
      ``step()`` calls, the chainable form torch uses from then on).
      ``ReduceLROnPlateau`` takes fairseq's ``best`` and ``last_epoch``
      (fairseq's ``reduce_lr_on_plateau`` wraps it).  fairseq's
      ``best`` (best validation loss) and ``lr`` are not part of the closed-form
      states and are not used (the restore logs the mapping from rank 0).
    * Anything else (``LambdaLR``/``MultiplicativeLR``, whose lambdas fairseq
      never saved; ``OneCycleLR``, ``CyclicLR``, ``SequentialLR``, ... whose
      position is more than a counter): one error.

    Args:
        scheduler: the live lr_scheduler.
        state: the checkpoint's ``optimizer_history[-1]["lr_scheduler_state"]``.
        num_updates: the checkpoint's ``num_updates`` (>= 0).
        where: checkpoint URI for messages.
        map_fairseq: False refuses a fairseq state instead of mapping it
            (``CheckpointerConfig.fairseq_compat``).

    Returns:
        True when a fairseq state was mapped (the learning rate now follows the
        torch scheduler: the caller sets the param groups' ``lr`` to
        ``get_last_lr()`` after loading the optimizer), False for a plain load.

    Raises:
        StateMismatchError: the keys do not map (names the URI, the live scheduler
            class, the missing and the extra keys, and ``reset_lr_scheduler=True``);
            never a bare ``KeyError``.
    """
    loc = f"{where}: " if where else ""
    how = _plan_load(scheduler, state, num_updates=num_updates, loc=loc,
                     map_fairseq=map_fairseq)
    if how == "plain":
        _plain_load(scheduler, state, loc)
        return False
    new = dict(scheduler.state_dict())
    if how == "plateau":
        if state.get("best") is not None:
            new["best"] = state["best"]
        if isinstance(state.get("last_epoch"), int):
            new["last_epoch"] = state["last_epoch"]
        scheduler.load_state_dict(new)
        return False
    new.update(last_epoch=num_updates, _step_count=num_updates + 1)
    scheduler.load_state_dict(new)
    # every CLOSED_FORM_SCHEDULERS class defines _get_closed_form_lr
    scheduler._last_lr = list(scheduler._get_closed_form_lr())
    return True


def check_lr_scheduler_state(scheduler: Any, state: Any, *, num_updates: int, where: str = "",
                             map_fairseq: bool = True, probe: bool = False) -> None:
    """The decision of :func:`load_lr_scheduler_state`, with nothing live loaded.

    The trainer restore calls it before the model is loaded.  A plain load into a
    fairseq-style or non-torch scheduler is that scheduler's own ``load_state_dict``;
    with ``probe=True`` (``scheduler`` is a throwaway built like the live one, which the
    restore installs only after every check) that load is tried here, so its refusal
    too comes before anything live changes.  Without a probe it can still refuse later.

    Raises:
        StateMismatchError: as :func:`load_lr_scheduler_state`.
    """
    loc = f"{where}: " if where else ""
    how = _plan_load(scheduler, state, num_updates=num_updates, loc=loc,
                     map_fairseq=map_fairseq)
    if probe and how == "plain":
        _plain_load(scheduler, state, loc)


def _plan_load(scheduler: Any, state: Any, *, num_updates: int, loc: str,
               map_fairseq: bool) -> str:
    """``"plain"``, ``"plateau"`` or ``"closed_form"``: how ``state`` goes into ``scheduler``."""
    torch_sched = isinstance(scheduler, (torch.optim.lr_scheduler.LRScheduler,
                                         torch.optim.lr_scheduler.ReduceLROnPlateau))
    name = type(scheduler).__name__
    if not torch_sched or is_fairseq_style(scheduler):
        return "plain"
    live = scheduler.state_dict()
    saved: Mapping = state if isinstance(state, Mapping) else {}
    saved_keys = set(map(str, saved))
    if isinstance(state, Mapping) and set(live) <= saved_keys:
        return "plain"
    missing = sorted(set(live) - saved_keys)
    extra = sorted(saved_keys - set(live))
    fairseq_layout = isinstance(state, Mapping) and saved_keys <= set(FAIRSEQ_SCHEDULER_KEYS)
    from_torch = type(scheduler).__module__ == "torch.optim.lr_scheduler" and map_fairseq
    if fairseq_layout and from_torch and isinstance(
            scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return "plateau"
    if fairseq_layout and from_torch and name in CLOSED_FORM_SCHEDULERS \
            and isinstance(num_updates, int) and num_updates >= 0:
        return "closed_form"
    if fairseq_layout and not map_fairseq:
        why = ("a fairseq lr_scheduler_state is mapped onto torch schedulers only with "
               "fairseq_compat=True")
    elif fairseq_layout:
        why = (f"a fairseq lr_scheduler_state (keys {sorted(saved_keys)}; fairseq schedules are "
               f"functions of num_updates) maps only onto a fairseq-style scheduler "
               f"(xla_ckpt.trainer.InverseSquareRootSchedule, FairseqLRScheduler) or a "
               f"closed-form torch scheduler ({', '.join(CLOSED_FORM_SCHEDULERS)}, "
               f"ReduceLROnPlateau)")
    else:
        why = "the saved lr_scheduler_state was written by another scheduler"
    raise StateMismatchError(
        f"{loc}lr_scheduler does not match the checkpoint: live {name} needs keys {missing} "
        f"that the saved lr_scheduler_state lacks (extra saved keys: {extra}); {why}; "
        f"{_RESET_LR}")


def _plain_load(scheduler: Any, state: Any, loc: str) -> None:
    if isinstance(state, Mapping) and isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        extra = sorted(set(map(str, state)) - set(scheduler.state_dict()))
        if extra:  # torch's load_state_dict takes them as attributes: another class's state
            logger.warning("%sthe saved lr_scheduler_state has keys the live %s lacks (%s): "
                           "it was probably saved from another scheduler class; its values "
                           "now override the live ones (pass reset_lr_scheduler=True to keep "
                           "the live schedule)", loc, type(scheduler).__name__,
                           ", ".join(extra))
    try:
        scheduler.load_state_dict(state)
    except Exception as e:  # a user scheduler's own refusal: named, re-raised as a mismatch
        saved = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
        raise StateMismatchError(
            f"{loc}lr_scheduler does not match the checkpoint: live {type(scheduler).__name__} "
            f"could not load the saved lr_scheduler_state (keys {saved}): "
            f"{type(e).__name__}: {e}; {_RESET_LR}") from e
