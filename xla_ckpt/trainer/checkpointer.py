"""Save and restore a whole training state with fairseq ``Trainer.load_checkpoint`` semantics.

:class:`Checkpointer` holds what fairseq's ``Trainer`` holds for
checkpointing (model, criterion, optimizer and the way to rebuild it,
lr_scheduler, meters, ``cfg``/``args``, ``num_updates``, training time) and
nothing else: no training loop, no data.  Restore order, as in fairseq:

1. read the state (injectable ``restorer``; nothing committed -> ``None``
   and the log line "no existing checkpoint");
2. model: strict load (:func:`~xla_ckpt.trainer.module_load.load_module_state`),
   criterion too when it has parameters;
3. unless ``reset_optimizer`` (and when the checkpoint holds optimizer
   state): rebuild the optimizer over the live parameters, check the
   criterion and optimizer class names against the last
   ``optimizer_history`` entry, load the lr_scheduler unless
   ``reset_lr_scheduler``, load the optimizer state
   (:func:`~xla_ckpt.trainer.optimizer_state.load_optimizer_state`) with
   ``optimizer_overrides``, then set ``num_updates``;
4. ``extra_state``: this rank's private state merged over it;
   ``previous_training_time`` (the wall clock restarts from it);
   ``lr_step(epoch)``; meters loaded unless ``reset_meters`` or at an epoch
   boundary (iterator ``version`` >= 2 and ``iterations_in_epoch == 0``);
   every TimeMeter reset after loading.

Differences from fairseq, on purpose: errors are library errors naming keys
and the flag to pass (fairseq raises a bare ``Exception``/``AssertionError``);
TimeMeters are reset in every aggregator (fairseq's loop iterates the keys of
the ``default`` aggregator and so resets none); a dtype policy guards casts;
an incomplete checkpoint is treated as absent with a warning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable, Iterable, Optional

import torch

from xla_ckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
    StateMismatchError,
)
from xla_ckpt.trainer import keys as K
from xla_ckpt.trainer.lr_scheduler import is_fairseq_style
from xla_ckpt.trainer.metrics import Metrics
from xla_ckpt.trainer.module_load import check_dtype_policy, load_module_state
from xla_ckpt.trainer.optimizer_state import check_live_params, load_optimizer_state
from xla_ckpt.trainer.prefixes import unwrap_module
from xla_ckpt.trainer.sources import (
    Restorer,
    Saver,
    SingleProcessRestorer,
    SingleProcessSaver,
    unpack_restored,
)

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class CheckpointerConfig:
    """Restore/save knobs of :class:`Checkpointer`.

    Attributes:
        dtype_policy: what a restore does when a saved model/criterion tensor
            has another dtype than the live one and the cast narrows:
            ``"error"`` (refuse), ``"warn"`` (cast, log a warning), ``"cast"``
            (cast silently) or ``"keep"`` (the live tensor takes the saved dtype).
        strip_prefixes: remove wrapper prefixes (``module.``, ``_orig_mod.``)
            that every saved model key carries when that makes the keys match.
        no_save_optimizer_state: leave ``last_optimizer_state`` out of saves
            (fairseq ``--no-save-optimizer-state``); such a checkpoint
            restores weights only.
    """

    dtype_policy: str = "error"
    strip_prefixes: bool = False
    no_save_optimizer_state: bool = False

    def __post_init__(self) -> None:
        check_dtype_policy(self.dtype_policy, "dtype_policy")
        for name in ("strip_prefixes", "no_save_optimizer_state"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: must be true or false, got {getattr(self, name)!r}")


def has_parameters(module: Optional[torch.nn.Module]) -> bool:
    """fairseq ``utils.has_parameters``: True if ``module`` has at least one parameter."""
    return module is not None and next(iter(module.parameters()), None) is not None


def _plain(value: Any) -> Any:
    """Numpy scalars and one-element tensors as Python numbers (for manifest metadata)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return value.item()
    return value


class Checkpointer:
    """The checkpointing half of fairseq's ``Trainer`` (module docstring gives the restore order).

    Every rank builds one and calls :meth:`load_checkpoint` with the same URI;
    :meth:`save_checkpoint` is called on every rank (the saver decides who
    writes; the default writes from this process).

    Args:
        model: the live model, already on its device (may be wrapped in
            DDP / ``torch.compile``; its unwrapped module is saved and loaded).
        criterion: the loss module; its state is saved and loaded when it
            has parameters.
        build_optimizer: ``fn(params) -> optimizer`` over the trainable
            parameters of model then criterion (fairseq ``_build_optimizer``);
            the restore calls it so the optimizer holds the live parameters.
        build_lr_scheduler: ``fn(optimizer) -> scheduler`` (fairseq-style or
            a torch ``LRScheduler``), called after each build.
        optimizer, lr_scheduler: ready objects, used when no builder is given
            (the optimizer must hold the live parameters).
        metrics: a :class:`~xla_ckpt.trainer.metrics.Metrics` (or any object
            with ``state_dict``/``load_state_dict``); a new one by default.
        cfg, args: configuration saved as ``cfg`` and ``args`` (dict /
            ``argparse.Namespace``; anything the typed encoding holds).
        config: :class:`CheckpointerConfig`.
        restorer: ``fn(uri) -> (state, rank_state | None)`` or a ``Restored``;
            default :class:`~xla_ckpt.trainer.sources.SingleProcessRestorer`.
        saver: ``fn(state, uri, *, metadata, rank_state)``; default
            :class:`~xla_ckpt.trainer.sources.SingleProcessSaver`.
        device: where a model built on the meta device is materialised
            (default CPU).
        rank: this process's rank, for log lines and the default restorer/saver.
        clock: wall clock in seconds (``time.time``); the training-time
            counter uses it.

    Raises:
        ConfigError: neither ``optimizer`` nor ``build_optimizer`` given, or
            an ``lr_scheduler`` object given with ``build_optimizer`` but
            without ``build_lr_scheduler`` (it would keep the old optimizer).
    """

    def __init__(self, *, model: torch.nn.Module, criterion: Optional[torch.nn.Module] = None,
                 build_optimizer: Optional[Callable[[list], torch.optim.Optimizer]] = None,
                 build_lr_scheduler: Optional[Callable[[torch.optim.Optimizer], Any]] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, lr_scheduler: Any = None,
                 metrics: Any = None, cfg: Any = None, args: Any = None,
                 config: Optional[CheckpointerConfig] = None, restorer: Optional[Restorer] = None,
                 saver: Optional[Saver] = None, device: torch.device | str | None = None,
                 rank: int = 0, clock: Callable[[], float] = time.time) -> None:
        if optimizer is None and build_optimizer is None:
            raise ConfigError("build_optimizer: pass build_optimizer (preferred: the restore "
                              "rebuilds the optimizer over the live parameters) or optimizer")
        if lr_scheduler is not None and build_optimizer is not None and build_lr_scheduler is None:
            raise ConfigError("build_lr_scheduler: the restore rebuilds the optimizer, so the "
                              "lr_scheduler must be rebuilt with it; pass build_lr_scheduler")
        self.model = model
        self.criterion = criterion
        self.build_optimizer = build_optimizer
        self.build_lr_scheduler = build_lr_scheduler
        self._optimizer = optimizer
        self._lr_scheduler = lr_scheduler
        self.metrics = metrics if metrics is not None else Metrics()
        self.cfg = cfg
        self.args = args
        self.config = config or CheckpointerConfig()
        self.restorer = restorer or SingleProcessRestorer(rank=rank)
        self.saver = saver or SingleProcessSaver(rank=rank)
        self.device = device
        self.rank = rank
        self.clock = clock
        self._num_updates = 0
        self._optim_history: list = []
        self._start_time = clock()
        self._previous_training_time = 0.0
        self.rank_state: Any = None

    # ---- what fairseq's Trainer exposes -------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            self._build_optimizer()
        return self._optimizer  # type: ignore[return-value]

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
        if self.build_optimizer is None:
            raise ConfigError("build_optimizer: cannot rebuild the optimizer without it")
        self._optimizer = self.build_optimizer(self.live_parameters())
        self._lr_scheduler = (self.build_lr_scheduler(self._optimizer)
                              if self.build_lr_scheduler is not None else None)
        self._first_step_update()

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

    # ---- save ---------------------------------------------------------------------
    def state_dict(self, extra_state: Optional[Mapping] = None) -> dict:
        """The whole training state (layout in :mod:`xla_ckpt.trainer.keys`).

        ``extra_state`` (``train_iterator``, ``val_loss``, ...) is merged into
        the saved ``extra_state``.  Tensors stay on their devices (the writer
        brings them to host).  Pass ``lambda: ckpt.state_dict(extra)`` as the
        ``state`` of :class:`xla_ckpt.manager.CheckpointManager`.
        """
        criterion = self.criterion
        state = {
            K.ARGS: self.args,
            K.CFG: self.cfg,
            K.MODEL: unwrap_module(self.model).state_dict(),
            K.CRITERION: (unwrap_module(criterion).state_dict()
                          if has_parameters(criterion) else None),
            K.OPTIMIZER_HISTORY: list(self._optim_history) + [{
                K.CRITERION_NAME: type(criterion).__name__ if criterion is not None else None,
                K.OPTIMIZER_NAME: type(self.optimizer).__name__,
                K.LR_SCHEDULER_STATE: (self.lr_scheduler.state_dict()
                                       if self.lr_scheduler is not None else None),
                K.NUM_UPDATES: self.get_num_updates(),
            }],
            K.EXTRA_STATE: {
                K.METRICS: self.metrics.state_dict(),
                K.PREVIOUS_TRAINING_TIME: self.cumulative_training_time(),
            },
        }
        state[K.EXTRA_STATE].update(extra_state or {})
        if not self.config.no_save_optimizer_state:
            state[K.LAST_OPTIMIZER_STATE] = self.optimizer.state_dict()
        return state

    def save_checkpoint(self, uri: str, extra_state: Optional[Mapping] = None, *,
                        rank_extra_state: Optional[Mapping] = None,
                        metadata: Optional[Mapping] = None) -> Any:
        """Save the training state to ``uri`` (fairseq ``Trainer.save_checkpoint``).

        Args:
            uri: checkpoint folder (local path or ``gs://``).
            extra_state: merged into ``extra_state`` (``train_iterator``,
                ``val_loss``, ``best``, ...).
            rank_extra_state: this rank's own values (iterator position, RNG
                state) saved in its ``rank/<r>`` item; on restore they are
                merged over ``extra_state`` for this rank only.
            metadata: extra manifest metadata (e.g. ``{"loss": 2.1}``) on top
                of ``num_updates``, ``epoch``, ``iterations_in_epoch`` and
                ``loss`` (from ``extra_state["val_loss"]``).

        Returns:
            What the saver returns (the committed manifest by default).

        Raises:
            MetaTensorError: a model tensor is on the meta device (names the key).
            UnsupportedTypeError: a value the typed encoding cannot hold.
            StorageError: the write failed; nothing was committed.
        """
        t0 = time.perf_counter()
        state = self.state_dict(extra_state)
        md = self._summary(state[K.EXTRA_STATE], metadata)
        result = self.saver(state, uri, metadata=md, rank_state=rank_extra_state)
        if self.rank == 0:
            logger.info("rank %d: saved checkpoint %s (epoch %s @ %d updates) in %.2f s", self.rank,
                        uri, md.get(K.EPOCH), self.get_num_updates(), time.perf_counter() - t0)
        return result

    def _summary(self, extra_state: Mapping, metadata: Optional[Mapping]) -> dict:
        md: dict = {K.NUM_UPDATES: int(self.get_num_updates())}
        itr = extra_state.get(K.TRAIN_ITERATOR)
        if isinstance(itr, Mapping):
            for k in (K.EPOCH, K.ITERATIONS_IN_EPOCH):
                if k in itr:
                    md[k] = _plain(itr[k])
        if extra_state.get(K.VAL_LOSS) is not None:
            md[K.META_LOSS] = _plain(extra_state[K.VAL_LOSS])
        for k, v in (metadata or {}).items():
            md[k] = _plain(v)
        return md

    # ---- restore ------------------------------------------------------------------
    def load_checkpoint(self, uri: str, reset_optimizer: bool = False,
                        reset_lr_scheduler: bool = False,
                        optimizer_overrides: Optional[Mapping[str, Any]] = None,
                        reset_meters: bool = False) -> Optional[dict]:
        """Restore all training state from ``uri`` (fairseq ``Trainer.load_checkpoint``).

        Called by every rank with the same ``uri``.

        Args:
            uri: checkpoint folder.
            reset_optimizer: keep a fresh optimizer (and lr_scheduler, and
                ``num_updates`` of 0) instead of the saved one.
            reset_lr_scheduler: load the optimizer but keep a fresh lr_scheduler.
            optimizer_overrides: param-group values replacing the saved ones
                (e.g. ``{"lr": 1e-4}``).
            reset_meters: do not load the saved meters.

        Returns:
            ``extra_state`` (with this rank's private values merged over it),
            or ``None`` when no committed checkpoint exists at ``uri``.

        Raises:
            StateMismatchError: model/criterion keys, shapes or dtypes do not
                fit (names them); criterion or optimizer class differs from
                the checkpoint (names both, suggests ``reset_optimizer=True``).
            CheckpointCorruptError / IntegrityError: bad bytes (names the path).
        """
        return self.load_state(self._restore(uri), where=uri, reset_optimizer=reset_optimizer,
                               reset_lr_scheduler=reset_lr_scheduler,
                               optimizer_overrides=optimizer_overrides, reset_meters=reset_meters)

    def load_state(self, restored: Any, *, where: str = "", reset_optimizer: bool = False,
                   reset_lr_scheduler: bool = False,
                   optimizer_overrides: Optional[Mapping[str, Any]] = None,
                   reset_meters: bool = False) -> Optional[dict]:
        """Apply an already-read checkpoint: :meth:`load_checkpoint` without the read.

        ``restored`` is ``None`` (no checkpoint), ``(state, rank_state)``, or
        an object with ``.state`` and ``.rank_state`` (what
        ``CheckpointManager.restore_or_initialize`` or a restore strategy
        returns).  ``where`` names the checkpoint in messages.  Same flags,
        return value and errors as :meth:`load_checkpoint`.
        """
        uri = where
        t0 = time.perf_counter()
        extra_state, self._optim_history, last_optim_state = None, [], None
        self.rank_state = None
        reports: list = []
        if restored is not None:
            state, rank_state = unpack_restored(restored)
            if not isinstance(state, Mapping) or K.MODEL not in state:
                raise StateMismatchError(
                    f"{uri}: not a trainer checkpoint (no {K.MODEL!r} entry; keys: "
                    f"{sorted(map(str, state))[:8] if isinstance(state, Mapping) else type(state)}"
                    "); load it with xla_ckpt.load instead")
            self.rank_state = rank_state
            last_optim_state = state.get(K.LAST_OPTIMIZER_STATE)
            reports.append((self.model, load_module_state(
                unwrap_module(self.model), state[K.MODEL], what="model", where=uri,
                strip_prefixes=self.config.strip_prefixes, dtype_policy=self.config.dtype_policy,
                device=self.device)))
            if has_parameters(self.criterion):
                reports.append((self.criterion, load_module_state(
                    unwrap_module(self.criterion), state.get(K.CRITERION) or {},
                    what="criterion", where=uri, strip_prefixes=self.config.strip_prefixes,
                    dtype_policy=self.config.dtype_policy, device=self.device)))
            extra_state = dict(state.get(K.EXTRA_STATE) or {})
            self._optim_history = list(state.get(K.OPTIMIZER_HISTORY) or [])
            if isinstance(rank_state, Mapping):
                extra_state.update(rank_state)

        if last_optim_state is not None and not reset_optimizer:
            self._restore_optimizer(uri, last_optim_state, reset_lr_scheduler,
                                    optimizer_overrides, reports)

        if extra_state is None:
            logger.info("rank %d: no existing checkpoint found at %s", self.rank, uri)
            return None

        itr_state = extra_state.get(K.TRAIN_ITERATOR)
        if not isinstance(itr_state, Mapping):
            itr_state = extra_state[K.TRAIN_ITERATOR] = {K.EPOCH: 1, K.ITERATIONS_IN_EPOCH: 0}
        epoch = itr_state.get(K.EPOCH, 1)
        if K.PREVIOUS_TRAINING_TIME in extra_state:
            self._previous_training_time = extra_state[K.PREVIOUS_TRAINING_TIME]
            self._start_time = self.clock()
        self.lr_step(epoch)
        if itr_state.get(K.ITERATOR_VERSION, 1) >= 2 and itr_state.get(K.ITERATIONS_IN_EPOCH) == 0:
            reset_meters = True  # start of an epoch: meters start afresh
        if K.METRICS in extra_state and not reset_meters:
            self.metrics.load_state_dict(extra_state[K.METRICS])
            reset_time = getattr(self.metrics, "reset_time_meters", None)
            if reset_time is not None:
                reset_time()
        if self.rank == 0:
            logger.info("rank %d: loaded checkpoint %s (epoch %s @ %d updates) in %.2f s",
                        self.rank, uri, epoch, self.get_num_updates(), time.perf_counter() - t0)
        return extra_state

    def _restore(self, uri: str) -> Any:
        try:
            return self.restorer(uri)
        except IncompleteCheckpointError as e:
            logger.warning("rank %d: ignoring %s; no existing checkpoint is used", self.rank, e)
            return None
        except CheckpointNotFoundError:
            return None

    def _restore_optimizer(self, uri: str, last_optim_state: Any, reset_lr_scheduler: bool,
                           overrides: Optional[Mapping[str, Any]], reports: list) -> None:
        if self.build_optimizer is not None:
            self._build_optimizer()  # after the model load: params may have changed
        else:
            check_live_params(self.optimizer, self.live_parameters(), where=uri)
        if not self._optim_history:
            raise StateMismatchError(f"{uri}: the checkpoint has optimizer state but an empty "
                                     f"{K.OPTIMIZER_HISTORY}; pass reset_optimizer=True")
        last = self._optim_history[-1]
        crit_name = type(self.criterion).__name__ if self.criterion is not None else None
        if last.get(K.CRITERION_NAME) != crit_name:
            raise StateMismatchError(
                f"{uri}: criterion does not match the checkpoint: saved "
                f"{last.get(K.CRITERION_NAME)}, live {crit_name}; pass reset_optimizer=True to "
                "restore the weights with a fresh optimizer")
        opt_name = type(self.optimizer).__name__
        if last.get(K.OPTIMIZER_NAME) != opt_name:
            raise StateMismatchError(
                f"{uri}: optimizer does not match the checkpoint: saved "
                f"{last.get(K.OPTIMIZER_NAME)}, live {opt_name}; pass reset_optimizer=True to "
                "restore the weights with a fresh optimizer")
        sched = self.lr_scheduler
        if not reset_lr_scheduler and sched is not None \
                and last.get(K.LR_SCHEDULER_STATE) is not None:
            sched.load_state_dict(last[K.LR_SCHEDULER_STATE])
        saved_dtypes = {}  # id(live parameter) -> dtype it was saved with
        for module, report in reports:
            named = dict(unwrap_module(module).named_parameters(remove_duplicate=False))
            saved_dtypes.update({id(named[k]): dt for k, dt in report.saved_dtypes.items()
                                 if k in named})
        load_optimizer_state(self.optimizer, last_optim_state, saved_param_dtypes=saved_dtypes,
                             where=uri)
        if (reset_lr_scheduler and sched is not None and not is_fairseq_style(sched)
                and hasattr(sched, "get_last_lr")):
            # A fresh torch scheduler set the lr at construction; the optimizer load
            # overwrote it with the saved one. The fresh schedule wins.
            for group, lr in zip(self.optimizer.param_groups, sched.get_last_lr()):
                group["lr"] = lr
        if overrides:
            for group in self.optimizer.param_groups:
                group.update(overrides)
        self.set_num_updates(last.get(K.NUM_UPDATES, 0))
