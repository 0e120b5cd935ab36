"""Checkpoint manager: save schedule, rotation, pointers, async save, preemption, resume.

Public surface::

    from xla_ckpt.manager import CheckpointConfig, CheckpointManager, RestoreResult, StepResult

Modules: ``core`` (the manager: constructor and lifecycle), its parts ``schedule`` (when
to save, the training-loop hook, preemption), ``saving`` (the save path: upload, commit,
pointers, best-N, the in-flight save) and ``restoring`` (the restore path), ``base`` (what
the parts share), ``agreement`` (what the ranks agree on before a save writes);
``naming`` (fairseq checkpoint names and the schedule), ``rotation``
(keep-last-N / best-N), ``staging`` (host snapshots for async save), ``preemption`` (the
SIGTERM flag).
"""

from xla_ckpt.manager.config import CheckpointConfig
from xla_ckpt.manager.core import CheckpointManager
from xla_ckpt.manager.naming import (
    checkpoint_kind,
    epoch_checkpoint_name,
    scheduled_name,
    update_checkpoint_name,
)
from xla_ckpt.manager.restoring import RestoreResult
from xla_ckpt.manager.schedule import StepResult

__all__ = ["CheckpointConfig", "CheckpointManager", "RestoreResult", "StepResult",
           "checkpoint_kind", "epoch_checkpoint_name", "scheduled_name", "update_checkpoint_name"]
