"""Checkpoint folder names and the save schedule (fairseq ``checkpoint_utils.save_checkpoint``).

Pure: no I/O, no ranks.

* ``checkpoint<epoch>``: end of every ``save_interval_epochs``-th epoch
  (unless ``no_epoch_checkpoints``);
* ``checkpoint_<epoch>_<updates>``: every ``save_interval_updates`` updates,
  not at an epoch end (fairseq saves the epoch checkpoint there instead), and
  for a preemption save;
* ``checkpoint_last`` / ``checkpoint_best`` are pointers, not folders
  (:mod:`xla_ckpt.run.catalog`).
"""

from __future__ import annotations

from typing import Literal

from xla_ckpt.io.names import EPOCH_NAME as _EPOCH
from xla_ckpt.io.names import UPDATE_NAME as _UPDATE
from xla_ckpt.manager.config import CheckpointConfig

Kind = Literal["epoch", "update"]


def epoch_checkpoint_name(epoch: int) -> str:
    """``checkpoint<epoch>``: the end-of-epoch checkpoint."""
    return f"checkpoint{epoch}"


def update_checkpoint_name(epoch: int, num_updates: int) -> str:
    """``checkpoint_<epoch>_<num_updates>``: an update-interval (or preemption) checkpoint."""
    return f"checkpoint_{epoch}_{num_updates}"


def checkpoint_kind(name: str) -> Kind | None:
    """``"epoch"``, ``"update"``, or None for a folder this manager did not name."""
    if _EPOCH.match(name):
        return "epoch"
    if _UPDATE.match(name):
        return "update"
    return None


def scheduled_name(cfg: CheckpointConfig, *, epoch: int, num_updates: int,
                   end_of_epoch: bool) -> str | None:
    """Name of the checkpoint the schedule asks for after this update, or None.

    Args:
        epoch: current epoch (1-based in fairseq).
        num_updates: optimizer updates done so far (after this one).
        end_of_epoch: this update was the epoch's last (fairseq
            ``not epoch_itr.has_next()``).
    """
    if cfg.no_save:
        return None
    if end_of_epoch:
        if (not cfg.no_epoch_checkpoints and cfg.save_interval_epochs > 0
                and epoch % cfg.save_interval_epochs == 0):
            return epoch_checkpoint_name(epoch)
        return None
    if cfg.save_interval_updates > 0 and num_updates > 0 \
            and num_updates % cfg.save_interval_updates == 0:
        return update_checkpoint_name(epoch, num_updates)
    return None


def preemption_name(cfg: CheckpointConfig, *, epoch: int, num_updates: int,
                    end_of_epoch: bool) -> str:
    """Name of the checkpoint a preemption save writes at this update boundary."""
    return scheduled_name(cfg, epoch=epoch, num_updates=num_updates, end_of_epoch=end_of_epoch) \
        or update_checkpoint_name(epoch, num_updates)
