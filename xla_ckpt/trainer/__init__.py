"""Trainer-level save and restore of a whole training state (fairseq ``Trainer`` semantics).

Public surface::

    from xla_ckpt.trainer import Checkpointer, CheckpointerConfig, Metrics

    ckpt = Checkpointer(model=model, criterion=criterion,
                        build_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                        build_lr_scheduler=lambda opt: InverseSquareRootSchedule(opt, 1e-3, 4000),
                        metrics=Metrics(), args=args)
    extra_state = ckpt.load_checkpoint(uri)          # None when nothing is committed there
    ...
    ckpt.save_checkpoint(uri, {"train_iterator": itr.state_dict(), "val_loss": loss})

:class:`Checkpointer` (``checkpointer``: config and constructor) is built from the
live-training surface (``training_surface``), the save (``save_state``) and the restore
(``restore_state``); ``module_load``, ``optimizer_state`` and ``prefixes`` hold the loading
rules, ``sharded`` the DTensor (FSDP2 / tensor parallel) model path, ``meters``/``metrics``
fairseq's meters, ``sources`` the default reader and
writer, ``fairseq_compat`` the map from fairseq optimizer names and states to torch's
(``lr_scheduler`` maps fairseq ``lr_scheduler_state`` onto torch schedulers).
"""

from xla_ckpt.trainer.checkpointer import Checkpointer
from xla_ckpt.trainer.config import CheckpointerConfig
from xla_ckpt.trainer.fairseq_compat import FAIRSEQ_OPTIMIZERS
from xla_ckpt.trainer.lr_scheduler import (
                                          FairseqLRScheduler,
                                          InverseSquareRootSchedule,
                                          load_lr_scheduler_state,
)
from xla_ckpt.trainer.meters import (
                                          AverageMeter,
                                          DerivedMeter,
                                          Meter,
                                          MetersDict,
                                          StopwatchMeter,
                                          SumMeter,
                                          TimeMeter,
                                          register_meter,
)
from xla_ckpt.trainer.metrics import Metrics
from xla_ckpt.trainer.module_load import DTYPE_POLICIES, ModuleLoadReport, load_module_state
from xla_ckpt.trainer.optimizer_state import check_live_params, load_optimizer_state
from xla_ckpt.trainer.prefixes import best_prefix_strip, strip_state_dict, unwrap_module
from xla_ckpt.trainer.sources import (
                                          RestoredState,
                                          Restorer,
                                          RestoreRequest,
                                          SingleProcessRestorer,
                                          SingleProcessSaver,
                                          make_restorer,
)
from xla_ckpt.trainer.training_surface import has_parameters

__all__ = [
    "AverageMeter", "Checkpointer", "CheckpointerConfig", "DTYPE_POLICIES", "DerivedMeter",
    "FAIRSEQ_OPTIMIZERS", "FairseqLRScheduler", "InverseSquareRootSchedule", "Meter",
    "MetersDict", "Metrics", "ModuleLoadReport", "RestoreRequest", "RestoredState", "Restorer",
    "SingleProcessRestorer", "SingleProcessSaver",
    "StopwatchMeter", "SumMeter", "TimeMeter", "best_prefix_strip", "check_live_params",
    "has_parameters", "load_lr_scheduler_state", "load_module_state", "load_optimizer_state",
    "make_restorer", "register_meter", "strip_state_dict", "unwrap_module",
]
