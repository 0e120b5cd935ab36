"""fairseq-style learning-rate schedules over a plain ``torch.optim.Optimizer``.

The trainer restore drives schedulers the way fairseq's ``Trainer`` does:

* a *fairseq-style* scheduler (anything with ``step_update``) is a pure
  function of ``(epoch, num_updates)``: the restore calls
  ``step(epoch, val_loss)`` and ``step_update(num_updates)`` and the learning
  rate comes out right.  Its ``state_dict()`` is ``{"best": ...}``.
* a *torch* scheduler (``torch.optim.lr_scheduler.LRScheduler``) counts its
  own ``step()`` calls, so the restore only loads its state (``last_epoch``,
  ``_last_lr``, ...) and never steps it; the training loop steps it.

:class:`InverseSquareRootSchedule` is fairseq's ``inverse_sqrt`` schedule.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from xla_ckpt.errors import ConfigError


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
        self.best = state_dict["best"]

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
