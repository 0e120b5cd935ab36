"""Save and restore a whole training state with fairseq ``Trainer.load_checkpoint`` semantics.

:class:`Checkpointer` holds what fairseq's ``Trainer`` holds for
checkpointing (model, criterion, optimizer and the way to rebuild it,
lr_scheduler, meters, ``cfg``/``args``, ``num_updates``, training time) and
nothing else: no training loop, no data.  Restore order, as in fairseq:

1. read the state (injectable ``restorer``; the default resolves ``uri`` —
   checkpoint folder, run folder -> latest committed, pointer, legacy ``.pt`` —
   with :mod:`xla_ckpt.run.resolve`).  Nothing ever committed at ``uri``
   (:class:`~xla_ckpt.errors.NothingCommittedError`) -> ``None`` and the
   WARNING "no existing checkpoint found at <uri>": training starts from
   scratch.  Any other failure raises (a typo'd path whose parent folder is
   missing too, a data file gone mid-read, a checkpoint replaced twice while read);
2. check everything before anything is loaded
   (:meth:`~xla_ckpt.trainer.restore_state.RestoreState._plan_restore`,
   :mod:`~xla_ckpt.trainer.restore_checks`): model and criterion keys, shapes and
   dtypes; unless ``reset_optimizer``, the optimizer history, criterion and optimizer
   names, the fairseq mapping, param group count and sizes, state keys and shapes, and
   the lr_scheduler state, against an optimizer built the way the restore will build
   it.  A refusal says that nothing was restored, and nothing was (on the in-place path
   these checks run against the manifest before the read starts).  An old fairseq
   layout is upgraded here (logged); a plain ``torch.save`` dict (MAE/DeiT
   ``{"model", "optimizer", "epoch", "args"}``) restores its model and its one
   optimizer state, with nothing made up (:mod:`~xla_ckpt.trainer.restore_checks`);
3. model: strict load (:func:`~xla_ckpt.trainer.module_load.load_module_state`),
   criterion too when it has parameters.  With a restorer that takes
   ``targets=`` (the default does), an xla_ckpt checkpoint's model and
   criterion tensors are read straight into the live CPU parameters when the
   strict key, shape and dtype checks pass against its manifest before any byte
   is read (:func:`~xla_ckpt.trainer.module_load.in_place_targets`); the load
   then copies nothing and its hooks still run.  Otherwise (XLA/CUDA modules,
   casts, prefixes to strip, meta modules) it reads into fresh memory and
   copies, raising its strict errors with nothing overwritten;
4. unless ``reset_optimizer`` (and when the checkpoint holds optimizer
   state): rebuild the optimizer over the live parameters, check the
   criterion class name against the last ``optimizer_history`` entry
   (``config.criterion_check``: strict / warn / off) and the optimizer
   class name (a fairseq name such as ``FairseqAdam``, ``FairseqNAG`` or
   ``FP16Optimizer`` maps onto the torch class and layout of
   :mod:`~xla_ckpt.trainer.fairseq_compat`; an FP16 ``loss_scale`` comes back
   in ``extra_state["loss_scale"]``), load the lr_scheduler unless
   ``reset_lr_scheduler``
   (:func:`~xla_ckpt.trainer.lr_scheduler.load_lr_scheduler_state`, which
   also maps a fairseq ``lr_scheduler_state`` onto closed-form torch
   schedulers), load the optimizer state
   (:func:`~xla_ckpt.trainer.optimizer_state.load_optimizer_state`) with
   ``optimizer_overrides``, then set ``num_updates``;
5. ``extra_state``: this rank's private state merged over it;
   ``previous_training_time`` (the wall clock restarts from it);
   ``lr_step(epoch)``; meters loaded unless ``reset_meters`` or at an epoch
   boundary (iterator ``version`` >= 2 and ``iterations_in_epoch == 0``);
   every TimeMeter reset after loading.

Differences from fairseq, on purpose: errors are library errors naming keys
and the flag to pass (fairseq raises a bare ``Exception``/``AssertionError``);
a fairseq optimizer restores into its torch counterpart instead of failing
the name check, and a criterion without parameters whose name differs is a
warning (``criterion_check="warn"``), not a failure;
TimeMeters are reset in every aggregator (fairseq's loop iterates the keys of
the ``default`` aggregator and so resets none); a dtype policy guards casts;
an incomplete checkpoint (data files, no commit marker) is treated as
absent with a warning naming it, as in every entry point (nothing was committed there).

Sharded models (any ``DTensor`` parameter: FSDP2, tensor parallel): the same order and
flags, with model and optimizer state through DCP's ``get_state_dict`` /
``set_state_dict`` (:mod:`~xla_ckpt.trainer.sharded`): the restore reads each rank's shards
in place into :meth:`~xla_ckpt.trainer.restore_state.RestoreState.restore_targets` (the
live parameters and the rebuilt optimizer's state), onto any mesh; the optimizer class
must match (no fairseq optimizer mapping).  Any other model goes the way above, unchanged.

Where things are: this module holds the config and the constructor;
:mod:`~xla_ckpt.trainer.training_surface` the live-training surface (optimizer
and lr_scheduler builds, ``num_updates``, ``lr_step``, training time);
:mod:`~xla_ckpt.trainer.save_state` the save (``state_dict``,
``save_checkpoint``); :mod:`~xla_ckpt.trainer.restore_state` the restore above
(``load_checkpoint``, ``load_state``, ``restore_targets``); :mod:`~xla_ckpt.trainer.sharded`
the DTensor model path.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import torch

from xla_ckpt.errors import ConfigError, UnsupportedTypeError
from xla_ckpt.format import typed
from xla_ckpt.trainer.config import CheckpointerConfig
from xla_ckpt.trainer.metrics import Metrics
from xla_ckpt.trainer.restore_state import RestoreState
from xla_ckpt.trainer.save_state import SaveState
from xla_ckpt.trainer.sources import Restorer, Saver, SingleProcessRestorer, SingleProcessSaver
from xla_ckpt.trainer.training_surface import has_parameters

# has_parameters is defined with the live-training surface, importable from here as before.
__all__ = ["Checkpointer", "CheckpointerConfig", "has_parameters"]


class Checkpointer(SaveState, RestoreState):
    """The checkpointing half of fairseq's ``Trainer`` (module docstring gives the restore order).

    Every rank builds one and calls :meth:`load_checkpoint` with the same URI;
    :meth:`save_checkpoint` is called on every rank (the saver decides who
    writes; the default writes from this process).

    Args:
        model: the live model, already on its device (may be wrapped in
            DDP / ``torch.compile``; its unwrapped module is saved and loaded).  A
            sharded model (``DTensor`` parameters: FSDP2 ``fully_shard``, tensor
            parallel) is saved and restored through DCP's ``get_state_dict`` /
            ``set_state_dict`` (:mod:`~xla_ckpt.trainer.sharded`), each rank writing and
            reading only its shards; its optimizer must hold only the model's parameters.
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
        criterion_check: shorthand for ``config.criterion_check`` (``"strict"``,
            ``"warn"``, ``"off"``); None keeps the config's.
        restorer: a :class:`~xla_ckpt.trainer.sources.Restorer`:
            ``restorer(request: RestoreRequest) -> RestoredState``, called once per restore
            with the URI, the in-place targets (the live CPU tensors, or a sharded model's
            :meth:`restore_targets` as ``into``) and ``rank_state_on_resize`` /
            ``rank_state_remap`` (config or :meth:`load_checkpoint`); default
            :class:`~xla_ckpt.trainer.sources.SingleProcessRestorer`, or
            :func:`~xla_ckpt.trainer.sources.make_restorer` for a strategy of
            :func:`xla_ckpt.restore.restore`.
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
            without ``build_lr_scheduler`` (it would keep the old optimizer), or
            a ``criterion_check`` other than strict / warn / off; or an argument that
            would only fail later, at the first save or restore (:func:`_check_arguments`):
            a ``cfg``/``args`` the checkpoint cannot hold (a dataclass, an omegaconf
            container, any object outside the typed encoding; the message names the key
            path, the type and what to pass), a ``model``/``criterion`` that is not a
            ``torch.nn.Module``, an ``optimizer`` that is not a ``torch.optim.Optimizer``,
            a builder, ``restorer``, ``saver`` or ``clock`` that is not callable, a
            ``metrics`` or ``lr_scheduler`` without ``state_dict``/``load_state_dict``, a
            ``config`` that is not a :class:`CheckpointerConfig`, a bad ``device`` or
            ``rank``.
    """

    def __init__(self, *, model: torch.nn.Module, criterion: Optional[torch.nn.Module] = None,
                 build_optimizer: Optional[Callable[[list], torch.optim.Optimizer]] = None,
                 build_lr_scheduler: Optional[Callable[[torch.optim.Optimizer], Any]] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, lr_scheduler: Any = None,
                 metrics: Any = None, cfg: Any = None, args: Any = None,
                 config: Optional[CheckpointerConfig] = None, restorer: Optional[Restorer] = None,
                 saver: Optional[Saver] = None, device: torch.device | str | None = None,
                 rank: int = 0, clock: Callable[[], float] = time.time,
                 criterion_check: Optional[str] = None) -> None:
        _check_arguments(model=model, criterion=criterion, build_optimizer=build_optimizer,
                         build_lr_scheduler=build_lr_scheduler, optimizer=optimizer,
                         lr_scheduler=lr_scheduler, metrics=metrics, cfg=cfg, args=args,
                         config=config, restorer=restorer, saver=saver, device=device,
                         rank=rank, clock=clock)
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
        if criterion_check is not None:
            self.config = dataclasses.replace(self.config, criterion_check=criterion_check)
        self.restorer = restorer or SingleProcessRestorer(rank=rank)
        self.saver = saver or SingleProcessSaver(rank=rank)
        self.device = device
        self.rank = rank
        self.clock = clock
        self._num_updates = 0
        self._optim_history = []
        self._start_time = clock()
        self._previous_training_time = 0.0
        self.rank_state = None
        self._restore_built = None
        self._restore_was_empty = False
        self._restore_call = (False, False, "")
        self._records_plan = None
        self._checked_read = None
        self._sharded_memo = None
        self._sharded_read_in_place = False


def _check_arguments(**given: Any) -> None:
    """Refuse, at construction, what the first save or restore would refuse (issue 25 #8).

    Raises:
        ConfigError: names the argument, the type given and what to pass.
    """
    def refuse(name: str, want: str) -> None:
        raise ConfigError(f"{name}: must be {want}, got a {type(given[name]).__qualname__}")

    if not isinstance(given["model"], torch.nn.Module):
        refuse("model", "a torch.nn.Module")
    if given["criterion"] is not None and not isinstance(given["criterion"], torch.nn.Module):
        refuse("criterion", "a torch.nn.Module or None")
    if given["optimizer"] is not None and \
            not isinstance(given["optimizer"], torch.optim.Optimizer):
        refuse("optimizer", "a torch.optim.Optimizer or None (or pass build_optimizer)")
    for name in ("build_optimizer", "build_lr_scheduler", "restorer", "saver"):
        if given[name] is not None and not callable(given[name]):
            refuse(name, "callable or None")
    if not callable(given["clock"]):
        refuse("clock", "callable (seconds, like time.time)")
    for name in ("metrics", "lr_scheduler"):
        obj = given[name]
        if obj is not None and not (callable(getattr(obj, "state_dict", None)) and
                                    callable(getattr(obj, "load_state_dict", None))):
            refuse(name, "an object with state_dict() and load_state_dict() (or None)")
    if given["config"] is not None and not isinstance(given["config"], CheckpointerConfig):
        refuse("config", "a CheckpointerConfig (or None)")
    rank = given["rank"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ConfigError(f"rank: must be an int >= 0, got {rank!r}")
    if given["device"] is not None:
        try:
            torch.device(given["device"])
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"device: not a torch device: {given['device']!r} ({e})") from None
    for name in ("cfg", "args"):
        _check_saveable(name, given[name])


def _check_saveable(name: str, value: Any) -> None:
    """``value`` (the ``cfg`` or ``args`` every save writes) fits the typed encoding."""
    if value is None:
        return
    try:
        typed.encode({name: value}, tensor_hook=lambda t, path: 0)
    except UnsupportedTypeError as e:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fix = (f"pass dataclasses.asdict({name}) (a dict), or an argparse.Namespace; "
                   "rebuild the dataclass from it after a restore")
        elif type(value).__module__.startswith("omegaconf"):
            fix = f"pass OmegaConf.to_container({name}, resolve=True) (a dict)"
        else:
            fix = ("pass a dict, list or argparse.Namespace of None/bool/int/float/str values "
                   "(or tensors)")
        raise ConfigError(
            f"{name}: a {type(value).__module__}.{type(value).__qualname__} cannot be saved in "
            f"a checkpoint, and every save writes {name} ({e}); {fix}") from None

