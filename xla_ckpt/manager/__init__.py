"""Checkpoint manager: save schedule, rotation, pointers, async save, preemption, resume.

Public surface::

    from xla_ckpt.manager import CheckpointManager, RestoreResult, StepResult

Modules: ``core`` (the manager), ``naming`` (fairseq checkpoint names and the
schedule), ``rotation`` (keep-last-N / best-N), ``staging`` (host snapshots for
async save), ``preemption`` (the SIGTERM flag).
"""

from xla_ckpt.manager.core import CheckpointManager, RestoreResult, StepResult
from xla_ckpt.manager.naming import (
                                     checkpoint_kind,
                                     epoch_checkpoint_name,
                                     scheduled_name,
                                     update_checkpoint_name,
)

__all__ = ["CheckpointManager", "RestoreResult", "StepResult",
           "checkpoint_kind", "epoch_checkpoint_name", "scheduled_name", "update_checkpoint_name"]
