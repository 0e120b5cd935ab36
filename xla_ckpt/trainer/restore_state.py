"""Restoring a :class:`~xla_ckpt.trainer.Checkpointer` (fairseq ``Trainer.load_checkpoint``).

The restore order is in :mod:`xla_ckpt.trainer.checkpointer`:
:meth:`RestoreState.load_checkpoint` reads through the injectable restorer,
:meth:`RestoreState.load_state` applies what was read: model and criterion,
optimizer and lr_scheduler (:meth:`RestoreState._restore_optimizer`), then
``extra_state``.

Start fresh (fairseq: "No existing checkpoint found <path>", then train from
scratch) happens on one answer only: the restorer raised
:class:`~xla_ckpt.errors.NothingCommittedError`, which only the resolver
(:mod:`xla_ckpt.run.resolve`) raises, when storage says nothing was ever
committed at the URI.  It is logged at WARNING: ``rank R: no existing checkpoint
found at <uri>``, or, when saves began there and none committed
(:class:`~xla_ckpt.errors.UncommittedCheckpointError`), ``rank R: ignoring
<why>; no existing checkpoint is used``.  Every other failure raises — a
typo'd path whose parent folder is missing too, a data file gone mid-read, a
checkpoint replaced during two reads in a row.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator, Mapping
from typing import Any, Optional

import torch

from xla_ckpt.errors import (
    ConfigError,
    NothingCommittedError,
    StateMismatchError,
    UncommittedCheckpointError,
    WorldSizeMismatchError,
)
from xla_ckpt.format.manifest import Item, TensorRecord
from xla_ckpt.restore.config import RANK_STATE_ON_RESIZE
from xla_ckpt.trainer import keys as K
from xla_ckpt.trainer.fairseq_compat import (
    adapt_fairseq_optimizer_state,
    is_fairseq_optimizer_name,
)
from xla_ckpt.trainer.lr_scheduler import (
    check_lr_scheduler_state,
    is_fairseq_style,
    load_lr_scheduler_state,
)
from xla_ckpt.trainer.module_load import (
    apply_module_state,
    in_place_targets,
    prepare_module_state,
    saved_records,
)
from xla_ckpt.trainer.optimizer_state import (
    check_live_params,
    check_optimizer_state,
    check_param_group_keys,
    load_optimizer_state,
)
from xla_ckpt.trainer.prefixes import unwrap_module
from xla_ckpt.trainer.restore_checks import (
    NOTHING_RESTORED,
    RestorePlan,
    ends,
    plain_optimizer_keys,
    trainer_layout,
)
from xla_ckpt.trainer.sharded import is_sharded_module, model_state, optimizer_state
from xla_ckpt.trainer.sharded import load_model as load_sharded_model
from xla_ckpt.trainer.sharded import load_optimizer as load_sharded_optimizer
from xla_ckpt.trainer.sources import RankStateRemap, RestoredState, RestoreRequest
from xla_ckpt.trainer.training_surface import TrainingSurface, has_parameters, logger


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (as it was before, after it).

    A restore builds hundreds of thousands of objects that all live on (records, tensors,
    state dicts): every automatic collection meanwhile walks the whole growing heap and
    frees nothing; at 80,000 tensors that was about 0.3 s of CPU per restore.  Reference
    counting still frees what the restore drops; cycles wait for the next collection.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()



def _holds_records(value: Any) -> bool:
    """True if ``value`` (a saved state) holds a manifest's TensorRecord where a tensor was
    (before the read): such a state cannot be tried on a probe yet."""
    if isinstance(value, TensorRecord):
        return True
    if isinstance(value, Mapping):
        return any(_holds_records(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_records(v) for v in value)
    return False

class RestoreState(TrainingSurface):
    """:meth:`load_checkpoint` / :meth:`load_state` and the optimizer restore behind them."""

    def load_checkpoint(self, uri: str, reset_optimizer: bool = False,
                        reset_lr_scheduler: bool = False,
                        optimizer_overrides: Optional[Mapping[str, Any]] = None,
                        reset_meters: bool = False, *,
                        rank_state_on_resize: Optional[str] = None,
                        rank_state_remap: Optional[RankStateRemap] = None) -> Optional[dict]:
        """Restore all training state from ``uri`` (fairseq ``Trainer.load_checkpoint``).

        Called by every rank with the same ``uri``.

        Args:
            uri: checkpoint folder, run folder (its latest committed checkpoint),
                ``<run>/checkpoint_last`` / ``<run>/checkpoint_best``, or a legacy
                ``.pt`` file (what the restorer accepts; the default resolves it with
                :func:`xla_ckpt.run.resolve.resolve`).
            reset_optimizer: keep a fresh optimizer (and lr_scheduler, and
                ``num_updates`` of 0) instead of the saved one.
            reset_lr_scheduler: load the optimizer but keep a fresh lr_scheduler.
            optimizer_overrides: param-group values replacing the saved ones
                (e.g. ``{"lr": 1e-4}``).
            reset_meters: do not load the saved meters.
            rank_state_on_resize: ``"error"`` / ``"drop"``, for this call (default
                ``config.rank_state_on_resize``): what a sharded model's restore does with
                per-rank items (``rank_extra_state``) saved by another world size
                (:class:`~xla_ckpt.trainer.config.CheckpointerConfig`).
            rank_state_remap: ``fn(saved, rank, world_size)``, for this call (default
                ``config.rank_state_remap``): maps them onto this rank instead.

        Returns:
            ``extra_state`` (with this rank's private values merged over it),
            or ``None`` when nothing was ever committed at ``uri`` (logged at
            WARNING; training starts from scratch).  A fairseq FP16Optimizer /
            MemoryEfficientFP16Optimizer checkpoint's dynamic loss scale is in
            ``extra_state["loss_scale"]`` (float; unless ``reset_optimizer``).

        Raises:
            CheckpointNotFoundError: ``uri`` is a local path whose parent folder is
                missing too (check the path), or names a missing pointer.
            CheckpointReplacedError: another writer replaced the checkpoint while it
                was read, twice in a row.
            StateMismatchError: model/criterion keys, shapes or dtypes do not
                fit (names them); criterion class differs from the checkpoint
                (``criterion_check``) or optimizer class differs and does not map
                (:mod:`~xla_ckpt.trainer.fairseq_compat`; names both, suggests
                ``reset_optimizer=True``); a fairseq optimizer state key cannot map
                (names it); the lr_scheduler state does not fit the live
                scheduler (names the class, the missing/extra keys and
                ``reset_lr_scheduler=True``).
            CheckpointCorruptError / IntegrityError: bad bytes (names the path).
            WorldSizeMismatchError: on every rank, the checkpoint holds per-rank items of
                another world size and neither ``rank_state_remap`` nor
                ``rank_state_on_resize="drop"`` was given (names them and both options).
            ConfigError: those options were given with a restorer that cannot take them.
        """
        self._sharded_memo = {}  # one answer per module for this restore
        try:
            with _gc_paused():
                restored = self._restore(uri, reset_optimizer=reset_optimizer,
                                         reset_lr_scheduler=reset_lr_scheduler,
                                         rank_state_on_resize=rank_state_on_resize,
                                         rank_state_remap=rank_state_remap)
                return self._load_state(restored, where=uri, reset_optimizer=reset_optimizer,
                                        reset_lr_scheduler=reset_lr_scheduler,
                                        optimizer_overrides=optimizer_overrides,
                                        reset_meters=reset_meters, absent_logged=restored is None)
        finally:  # nothing of this restore's plans outlives it (a failed read included)
            self._sharded_memo = self._records_plan = self._checked_read = None

    def restore_targets(self, *, reset_optimizer: bool = False) -> dict[str, Any] | None:
        """The live tensors a restore of a sharded model fills in place, or None for a model
        that is not sharded.  Every rank calls it (it may build the optimizer).

        For a model with ``DTensor`` parameters (FSDP2, tensor parallel):
        ``{"model": get_model_state_dict(model), "last_optimizer_state":
        get_optimizer_state_dict(model, optimizer)}`` (no optimizer entry with
        ``reset_optimizer`` or ``config.no_save_optimizer_state``).  The optimizer is
        rebuilt over the live parameters first (when ``build_optimizer`` was given, as the
        restore does, fairseq ``_build_optimizer``), so a restore that keeps the
        optimizer fills the one that trains on.  Pass it as ``into`` of
        ``CheckpointManager.restore_or_initialize`` (or ``xla_ckpt.restore.restore``), then
        hand the result, None included, to :meth:`load_state` with the same flags::

            res = mgr.restore_or_initialize(into=ckpt.restore_targets())
            extra_state = ckpt.load_state(res, where=res.uri if res else "")

        The optimizer state initialised here for the read (DCP's zero-lr step) is undone by
        :meth:`load_state` when the optimizer is not restored after all (nothing committed,
        ``reset_optimizer``): it is rebuilt fresh (or, without ``build_optimizer``, its
        state emptied again).

        Raises:
            ConfigError: the optimizer holds parameters that are not the model's.
        """
        module = unwrap_module(self.model)
        if not self._is_sharded(module):
            return None
        targets: dict[str, Any] = {K.MODEL: model_state(module)}
        if not reset_optimizer and not self.config.no_save_optimizer_state:
            if self.build_optimizer is not None:
                self._build_optimizer()
            optimizer = self.optimizer
            self._restore_built = optimizer
            self._restore_was_empty = not optimizer.state
            targets[K.LAST_OPTIMIZER_STATE] = optimizer_state(module, optimizer)
        return targets

    def load_state(self, restored: Any, *, where: str = "", reset_optimizer: bool = False,
                   reset_lr_scheduler: bool = False,
                   optimizer_overrides: Optional[Mapping[str, Any]] = None,
                   reset_meters: bool = False) -> Optional[dict]:
        """Apply an already-read checkpoint: :meth:`load_checkpoint` without the read.

        ``restored`` is ``None`` (no checkpoint) or what has ``.state`` and ``.rank_state``:
        a :class:`~xla_ckpt.trainer.sources.RestoredState`, what
        ``CheckpointManager.restore_or_initialize`` or :func:`xla_ckpt.restore.restore`
        returns.  ``where`` names the checkpoint in messages.  Same flags,
        return value and errors as :meth:`load_checkpoint`.  A sharded model's
        state read into :meth:`restore_targets` is applied with ``set_state_dict``
        (so are full tensors, sharded onto the live placements).

        Raises:
            TypeError: ``restored`` has no ``.state`` / ``.rank_state`` (wrap a bare state
                as ``RestoredState(state)``).
        """
        if restored is not None and not (hasattr(restored, "state") and
                                         hasattr(restored, "rank_state")):
            raise TypeError(f"load_state: restored must be None or have .state and .rank_state "
                            f"(xla_ckpt.trainer.RestoredState(state, rank_state)), got a "
                            f"{type(restored).__qualname__}")
        # A sharded model's state may have been read into its live DTensors already
        # (into=restore_targets()): a refusal cannot then say that nothing was restored.
        self._sharded_read_in_place = restored is not None and \
            is_sharded_module(unwrap_module(self.model))
        return self._load_state(restored, where=where, reset_optimizer=reset_optimizer,
                                reset_lr_scheduler=reset_lr_scheduler,
                                optimizer_overrides=optimizer_overrides, reset_meters=reset_meters)

    def _load_state(self, restored: Any, *, where: str, reset_optimizer: bool,
                    reset_lr_scheduler: bool, optimizer_overrides: Optional[Mapping[str, Any]],
                    reset_meters: bool, absent_logged: bool = False) -> Optional[dict]:
        uri = where
        t0 = time.perf_counter()
        extra_state: Optional[dict] = None
        self.rank_state = None
        if restored is None:
            self._optim_history = []
            self._discard_restore_targets()
            if not absent_logged:
                logger.info("rank %d: no existing checkpoint found at %s", self.rank, uri)
            return None
        state, rank_state = restored.state, restored.rank_state
        checked, self._records_plan, self._checked_read = self._checked_read, None, None
        prior = checked[1] if checked is not None and checked[0] is state else None
        try:
            plan = self._plan_restore(state, uri, reset_optimizer=reset_optimizer,
                                      reset_lr_scheduler=reset_lr_scheduler, prior=prior)
        except StateMismatchError as e:
            held = self._nothing_restored()
            self._discard_restore_targets()
            raise StateMismatchError(ends(e, held)) from e
        except BaseException:
            self._discard_restore_targets()
            raise
        # Every check passed: from here on the live objects change.
        self._optim_history = list(plan.history)
        self.rank_state = rank_state
        reports: list = []
        module = unwrap_module(self.model)
        if plan.model_state is None:
            # DTensor model: DCP's set_model_state_dict (strict keys, checked first).
            load_sharded_model(module, plan.state[K.MODEL], where=uri)
        else:
            assert plan.model_report is not None  # set with model_state
            apply_module_state(module, plan.model_state, plan.model_report, what="model",
                               where=uri, device=self.device)
            reports.append((self.model, plan.model_report))
        if plan.criterion_state is not None and plan.criterion_report is not None \
                and self.criterion is not None:
            apply_module_state(unwrap_module(self.criterion), plan.criterion_state,
                               plan.criterion_report, what="criterion", where=uri,
                               device=self.device)
            reports.append((self.criterion, plan.criterion_report))
        extra_state = dict(plan.extra_state)
        if isinstance(rank_state, Mapping):
            extra_state.update(rank_state)

        if plan.optimizer_state is not None:
            try:
                restored_extra = self._restore_optimizer(uri, plan, reset_lr_scheduler,
                                                         optimizer_overrides, reports)
            except StateMismatchError as e:
                raise StateMismatchError(ends(
                    e, f"The model{' and criterion' if len(reports) > 1 else ''} now hold "
                    "the checkpoint's weights; the optimizer and lr_scheduler are freshly "
                    "built and hold no restored state.")) from e
            for k, v in restored_extra.items():
                extra_state.setdefault(k, v)
        else:
            self._discard_restore_targets()
        if plan.layout == "plain":
            logger.info(
                "rank %d: %s: a plain torch.save training dict (no optimizer_history): "
                "restored the model%s; %s; no lr_scheduler state or num_updates is restored "
                "(the file has none)", self.rank, uri,
                f" and the optimizer from {plan.optimizer_key!r}"
                if plan.optimizer_state is not None else "",
                f"returned as saved in extra_state: {', '.join(map(str, plan.extra_state))}"
                if plan.extra_state else "nothing else in it",
            )
            if plan.not_restored:
                logger.warning("rank %d: %s: not restored from this plain torch.save dict: %s",
                               self.rank, uri, ", ".join(map(str, plan.not_restored)))

        itr_state = extra_state.get(K.TRAIN_ITERATOR)
        if not isinstance(itr_state, Mapping):
            # Nothing is made up: a state saved without an iterator (a plain torch.save dict,
            # a loop that passed none) comes back without one.  The schedule steps from
            # epoch 1, as a fresh run would; the log names the file's own epoch if it has one.
            itr_state = {}
        epoch = itr_state.get(K.EPOCH, 1)
        shown_epoch = epoch if itr_state else extra_state.get(K.EPOCH, "-")
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
                        self.rank, uri, shown_epoch, self.get_num_updates(),
                        time.perf_counter() - t0)
        return extra_state

    def _nothing_restored(self) -> str:
        """What the live objects hold after a refusal raised before anything was loaded."""
        if self._sharded_read_in_place:
            return ("Nothing else was restored, but a sharded restore reads into the live "
                    "DTensor model (and optimizer) in place: they may already hold the "
                    "checkpoint's values; rebuild them before training.")
        return NOTHING_RESTORED

    def _plan_restore(self, state: Any, uri: str, *, reset_optimizer: bool,
                      reset_lr_scheduler: bool, records: bool = False,
                      prior: Optional[RestorePlan] = None) -> RestorePlan:
        """Decide and check everything the restore will load; nothing live is changed.

        ``records``: ``state`` holds a manifest's :class:`TensorRecord`s instead of tensors
        (called before the read by :meth:`_in_place_targets`): the module checks are left
        to :func:`in_place_targets`, and a fairseq optimizer state that needs mapping makes
        the read go to fresh memory (``in_place_ok`` False).

        ``prior``: the plan that passed on the records of the manifest item ``state`` was
        read from (same flags, same restore): the optimizer it built and the optimizer
        state check it passed serve again (the tensors have the records' shapes and the
        tree their structure), so neither is built or checked twice.

        Raises:
            StateMismatchError: what the load would refuse (without :data:`NOTHING_RESTORED`).
        """
        state, layout = trainer_layout(state, where=uri, rank=self.rank)
        plan = RestorePlan(state=state, layout=layout)
        module = unwrap_module(self.model)
        sharded = self._is_sharded(module)
        if not records:
            if not sharded:
                plan.model_state, plan.model_report = prepare_module_state(
                    module, state[K.MODEL], what="model", where=uri,
                    strip_prefixes=self.config.strip_prefixes,
                    dtype_policy=self.config.dtype_policy)
            if has_parameters(self.criterion):
                plan.criterion_state, plan.criterion_report = prepare_module_state(
                    unwrap_module(self.criterion), state.get(K.CRITERION) or {},
                    what="criterion", where=uri, strip_prefixes=self.config.strip_prefixes,
                    dtype_policy=self.config.dtype_policy)
        if layout == "plain":
            opt_keys = plain_optimizer_keys(state)
            skip = {K.MODEL, K.CRITERION, *opt_keys}
            plan.extra_state = {k: v for k, v in state.items() if k not in skip}
            if reset_optimizer or not opt_keys:
                plan.not_restored = opt_keys if not reset_optimizer else []
                return plan
            if len(opt_keys) > 1:
                raise StateMismatchError(
                    f"{uri}: a plain torch.save dict (no optimizer_history) with "
                    f"{len(opt_keys)} optimizer states ({', '.join(map(str, opt_keys))}): which "
                    "one is this optimizer's is ambiguous. Pass reset_optimizer=True to restore "
                    "the model only, or load the file with xla_ckpt.load and call "
                    "optimizer.load_state_dict yourself.")
            plan.optimizer_key = opt_keys[0]
            plan.optimizer_state = state[opt_keys[0]]
            probe = self._probe_optimizer(plan, sharded, uri, prior)
            check_param_group_keys(probe, plan.optimizer_state, where=uri)
            if not sharded:
                self._check_optimizer_state(plan, probe, prior, uri)
            return plan

        plan.history = list(state.get(K.OPTIMIZER_HISTORY) or [])
        plan.extra_state = dict(state.get(K.EXTRA_STATE) or {})
        last_optim_state = state.get(K.LAST_OPTIMIZER_STATE)
        if last_optim_state is None or reset_optimizer:
            return plan
        if not plan.history or not isinstance(plan.history[-1], Mapping):
            raise StateMismatchError(f"{uri}: the checkpoint has optimizer state but an empty "
                                     f"{K.OPTIMIZER_HISTORY}; pass reset_optimizer=True")
        probe = self._probe_optimizer(plan, sharded, uri, prior)
        last = plan.history[-1]
        self._check_criterion_name(uri, last.get(K.CRITERION_NAME))
        opt_name = type(probe).__name__
        saved_opt = last.get(K.OPTIMIZER_NAME)
        plan.optimizer_state = last_optim_state
        if saved_opt != opt_name:
            if sharded or not (self.config.fairseq_compat and
                               is_fairseq_optimizer_name(saved_opt)):
                raise StateMismatchError(
                    f"{uri}: optimizer does not match the checkpoint: saved {saved_opt}, live "
                    f"{opt_name}; pass reset_optimizer=True to restore the weights with a fresh "
                    "optimizer")
            if records:
                plan.in_place_ok = False  # mapped (and checked) on the real tensors, not read
                return plan               # in place: the mapping may still refuse
            plan.adapted = adapt_fairseq_optimizer_state(
                str(saved_opt), probe, last_optim_state, cfg=state.get(K.CFG),
                args=state.get(K.ARGS), where=uri)
            plan.optimizer_state = plan.adapted.state_dict
            prior = None  # the mapped state was never checked
        if not sharded:
            self._check_optimizer_state(plan, probe, prior, uri)
        sched_state = last.get(K.LR_SCHEDULER_STATE)
        sched = plan.lr_scheduler if plan.optimizer is not None else self.lr_scheduler
        if not reset_lr_scheduler and sched is not None and sched_state is not None:
            # A scheduler built for this restore (not yet installed) tries the plain load
            # itself; the live one is never touched before every check has passed.
            check_lr_scheduler_state(sched, sched_state, num_updates=last.get(K.NUM_UPDATES, 0),
                                     where=uri, map_fairseq=self.config.fairseq_compat,
                                     probe=sched is plan.lr_scheduler
                                     and not (records and _holds_records(sched_state)))
        return plan

    def _is_sharded(self, module: torch.nn.Module) -> bool:
        """:func:`is_sharded_module`, asked once per module within one
        :meth:`load_checkpoint` (a restore does not change which parameters are DTensors)."""
        memo = self._sharded_memo
        if memo is None:
            return is_sharded_module(module)
        got = memo.get(id(module))
        if got is None or got[0] is not module:
            got = memo[id(module)] = (module, is_sharded_module(module))
        return got[1]

    @staticmethod
    def _check_optimizer_state(plan: RestorePlan, probe: torch.optim.Optimizer,
                               prior: Optional[RestorePlan], uri: str) -> None:
        """:func:`check_optimizer_state` of ``plan``'s optimizer state against ``probe``,
        unless ``prior`` (the same state's records) passed it on ``probe`` already."""
        if prior is None or prior.checked is None or prior.checked[0] is not probe:
            check_optimizer_state(probe, plan.optimizer_state, where=uri)
        plan.checked = (probe, plan.optimizer_state)

    def _probe_optimizer(self, plan: RestorePlan, sharded: bool, uri: str,
                         prior: Optional[RestorePlan] = None) -> torch.optim.Optimizer:
        """The optimizer the restore will load into, or one built the same way (kept in
        ``plan`` and installed after the model load); the live one is not replaced here.
        ``prior`` (:meth:`_plan_restore`): the one its check passed on serves again."""
        if prior is not None and prior.checked is not None:
            plan.optimizer, plan.lr_scheduler = prior.optimizer, prior.lr_scheduler
            return prior.checked[0]  # the read filled the live parameters in place
        if sharded and self._optimizer is not None and self._optimizer is self._restore_built:
            return self._optimizer  # restore_targets built it and the read filled it
        if self.build_optimizer is not None:
            plan.optimizer, plan.lr_scheduler = self._make_optimizer()
            return plan.optimizer
        if not sharded:
            check_live_params(self.optimizer, self.live_parameters(), where=uri)
        return self.optimizer

    def _in_place_targets(self, item: Item) -> dict[str, torch.Tensor]:
        """Live model (and criterion) tensors the restorer may fill in place, by tensor key.

        :func:`~xla_ckpt.trainer.module_load.in_place_targets` against the manifest's
        records: none for a module whose strict, shape or dtype checks would fail (the
        ordinary path then raises with nothing overwritten), on the meta device, or
        whose keys need a prefix stripped; only CPU tensors qualify.  When the model or
        the criterion gets none, neither gets any: the ordinary path checks both before
        loading either, and a refusal must find both as they were.  The rest of the
        restore (optimizer history and names, param groups, state shapes, lr_scheduler
        state) is checked here against the manifest's records, before any byte is read
        (:meth:`_plan_restore`); a fairseq optimizer state that still needs mapping sends
        the read to fresh memory.  A sharded (chunked) save gets none: its tensors are
        assembled whole from their chunks, then loaded.

        Raises:
            StateMismatchError: what the restore would refuse after the model load (ends
                with :data:`~xla_ckpt.trainer.restore_checks.NOTHING_RESTORED`).
        """
        if item.chunked:
            return {}  # a sharded save: its tensors are chunk tables, assembled by the read
        saved = saved_records(item)
        if not isinstance(saved, Mapping):
            return {}
        targets: dict[str, torch.Tensor] = {}
        modules = [(self.model, K.MODEL)]
        if has_parameters(self.criterion):
            modules.append((self.criterion, K.CRITERION))
        for module, key in modules:
            entry = saved.get(key)
            if not isinstance(entry, Mapping):
                return {}  # the ordinary path names what is wrong, before loading anything
            got = in_place_targets(unwrap_module(module), entry,
                                   dtype_policy=self.config.dtype_policy,
                                   strip_prefixes=self.config.strip_prefixes)
            if not got and entry:
                # This module goes the ordinary way (maybe to raise its strict error before
                # anything is loaded): so does the other, whose bytes would otherwise already
                # be in place when that error is raised.
                return {}
            targets.update(got)
        if not targets:
            return targets
        # What would fail after the model load is checked now, before any byte is read: a
        # refusal here leaves every live tensor as it was (the read never starts).
        reset_optimizer, reset_lr_scheduler, uri = self._restore_call
        try:
            plan = self._plan_restore(saved, uri, reset_optimizer=reset_optimizer,
                                      reset_lr_scheduler=reset_lr_scheduler, records=True)
        except StateMismatchError as e:
            raise StateMismatchError(ends(e, NOTHING_RESTORED)) from e
        if not plan.in_place_ok:
            return {}
        self._records_plan = (item, plan)
        return targets

    def _read_back(self, item: Item, state: Any) -> None:
        """The restorer read ``state`` from ``item``, whose records :meth:`_in_place_targets`
        checked: :meth:`_load_state` reuses that plan's probe and optimizer state check."""
        records = self._records_plan
        self._checked_read = (state, records[1]) \
            if records is not None and records[0] is item else None

    def _discard_restore_targets(self) -> None:
        """The optimizer :meth:`restore_targets` prepared is not restored (nothing committed,
        ``reset_optimizer``, no optimizer state saved): start it fresh, as if never touched
        (its state was initialised for the read, and the read may have filled it)."""
        built, self._restore_built = self._restore_built, None
        if built is None:
            return
        if self.build_optimizer is not None:
            self._build_optimizer()
        elif self._restore_was_empty:
            built.state.clear()  # exactly the empty state DCP's initialisation started from

    def _rank_state_options(self, rank_state_on_resize: Optional[str],
                            rank_state_remap: Optional[RankStateRemap]) -> dict[str, Any]:
        """The per-rank item options of the :class:`RestoreRequest` (only those set).

        Raises:
            ConfigError: a bad ``rank_state_on_resize``.
        """
        on_resize = rank_state_on_resize or self.config.rank_state_on_resize
        if on_resize not in RANK_STATE_ON_RESIZE:
            raise ConfigError(f"rank_state_on_resize: must be one of "
                              f"{', '.join(RANK_STATE_ON_RESIZE)}, got {on_resize!r}")
        remap = rank_state_remap or self.config.rank_state_remap
        wanted: dict[str, Any] = {}
        if on_resize != "error":
            wanted["rank_state_on_resize"] = on_resize
        if remap is not None:
            wanted["rank_state_remap"] = remap
        return wanted

    def _restore(self, uri: str, *, reset_optimizer: bool = False,
                 reset_lr_scheduler: bool = False,
                 rank_state_on_resize: Optional[str] = None,
                 rank_state_remap: Optional[RankStateRemap] = None) -> Any:
        """What the restorer read, or None (logged at WARNING) when nothing is committed.

        One call of the restorer with one :class:`~xla_ckpt.trainer.sources.RestoreRequest`:
        a sharded model's :meth:`restore_targets` as ``into`` (the default restorer and
        :func:`~xla_ckpt.trainer.sources.make_restorer`'s fill them in place; a restorer
        that returns full tensors instead has them sharded onto the live placements by
        :meth:`load_state`), any other model's live CPU tensors as ``targets``."""
        into = None
        options = self._rank_state_options(rank_state_on_resize, rank_state_remap)
        self._restore_call = (reset_optimizer, reset_lr_scheduler, uri)
        self._records_plan = self._checked_read = None
        self._sharded_read_in_place = False
        try:
            into = self.restore_targets(reset_optimizer=reset_optimizer)
            self._sharded_read_in_place = into is not None
            restored = self.restorer(RestoreRequest(
                uri=uri, into=into, targets=_InPlaceTargets(self) if into is None else None,
                **options))
        except WorldSizeMismatchError as e:
            self._discard_restore_targets()
            if "rank_state_remap" not in str(e):
                raise
            raise WorldSizeMismatchError(
                f"{e}. With Checkpointer.load_checkpoint: pass "
                "load_checkpoint(uri, rank_state_remap=fn(saved, rank, world_size)) to map "
                "the saved per-rank extra state onto the new ranks, or "
                "load_checkpoint(uri, rank_state_on_resize='drop') to restore without it "
                "(or set the same fields of CheckpointerConfig)") from e
        except UncommittedCheckpointError as e:
            logger.warning("rank %d: ignoring %s; no existing checkpoint is used", self.rank, e)
            return None  # load_state discards the restore targets
        except NothingCommittedError:
            logger.warning("rank %d: no existing checkpoint found at %s", self.rank, uri)
            return None
        except StateMismatchError as e:
            self._discard_restore_targets()
            self._sharded_read_in_place = False  # the read failed: see its own message
            if into is not None and K.LAST_OPTIMIZER_STATE in str(e):
                # The live optimizer's state does not fit the saved one (another optimizer
                # class or settings): fairseq's way out.
                raise StateMismatchError(
                    f"{e}; if the optimizer changed, pass reset_optimizer=True to restore the "
                    "weights with a fresh optimizer") from e
            raise
        except BaseException:
            self._discard_restore_targets()
            raise
        if not isinstance(restored, RestoredState):
            raise TypeError(
                f"the Checkpointer's restorer {type(self.restorer).__name__} returned a "
                f"{type(restored).__qualname__}: a restorer returns a "
                "xla_ckpt.trainer.RestoredState(state, rank_state) and raises "
                "NothingCommittedError when nothing is committed (xla_ckpt.trainer.Restorer)")
        return restored

    def _restore_optimizer(self, uri: str, plan: RestorePlan, reset_lr_scheduler: bool,
                           overrides: Optional[Mapping[str, Any]], reports: list) -> dict:
        """Optimizer, lr_scheduler and ``num_updates`` after the model load, as ``plan``
        decided and checked; returns entries for ``extra_state``."""
        live_module = unwrap_module(self.model)
        sharded = self._is_sharded(live_module)
        if sharded and self._optimizer is not None and self._optimizer is self._restore_built:
            pass  # restore_targets built it and the restore filled its state in place
        elif plan.optimizer is not None:
            built = [id(p) for g in plan.optimizer.param_groups for p in g["params"]]
            if built == [id(p) for p in self.live_parameters()]:
                self._optimizer, self._lr_scheduler = plan.optimizer, plan.lr_scheduler
            else:
                self._build_optimizer()  # the model load replaced parameters (meta device)
        elif not sharded:
            check_live_params(self.optimizer, self.live_parameters(), where=uri)
        self._restore_built = None
        extra: dict = {}
        opt_name = type(self.optimizer).__name__
        adapted = plan.adapted
        if adapted is not None:
            if adapted.loss_scale is not None:
                extra[K.LOSS_SCALE] = adapted.loss_scale
            if self.rank == 0:
                logger.info("rank %d: %s: fairseq optimizer %s restored as torch.optim.%s%s%s",
                            self.rank, uri, adapted.saved_name, opt_name,
                            "" if adapted.loss_scale is None
                            else f"; loss_scale {adapted.loss_scale:g} in extra_state",
                            "; flat fp32 master state split per parameter"
                            if adapted.flat_params_split else "")
                for note in adapted.notes:  # once per restore, rank 0 only
                    logger.warning("rank %d: %s: %s", self.rank, uri, note)
        last = plan.history[-1] if plan.history else {}
        num_updates = last.get(K.NUM_UPDATES, 0)
        sched = self.lr_scheduler
        lr_follows_sched = False
        if not reset_lr_scheduler and sched is not None \
                and last.get(K.LR_SCHEDULER_STATE) is not None:
            lr_follows_sched = load_lr_scheduler_state(
                sched, last[K.LR_SCHEDULER_STATE], num_updates=num_updates, where=uri,
                map_fairseq=self.config.fairseq_compat)
            if lr_follows_sched and self.rank == 0:
                logger.info("rank %d: %s: fairseq lr_scheduler_state %s restored as %s at "
                            "last_epoch=%s (num_updates); the lr follows its schedule",
                            self.rank, uri, last[K.LR_SCHEDULER_STATE], type(sched).__name__,
                            num_updates)
        saved_dtypes = {}  # id(live parameter) -> dtype it was saved with
        for module, report in reports:
            named = dict(unwrap_module(module).named_parameters(remove_duplicate=False))
            saved_dtypes.update({id(named[k]): dt for k, dt in report.saved_dtypes.items()
                                 if k in named})
        if sharded:
            load_sharded_optimizer(live_module, self.optimizer, plan.optimizer_state, where=uri)
        else:
            checked = plan.checked is not None and plan.checked[0] is self.optimizer \
                and plan.checked[1] is plan.optimizer_state
            load_optimizer_state(self.optimizer, plan.optimizer_state,
                                 saved_param_dtypes=saved_dtypes, where=uri, checked=checked)
        if sched is not None and not is_fairseq_style(sched) and hasattr(sched, "get_last_lr") \
                and (reset_lr_scheduler or lr_follows_sched):
            # A fresh (or fairseq-mapped) torch scheduler holds the lr of its own schedule; the
            # optimizer load overwrote it with the saved one. The torch schedule wins.
            for group, lr in zip(self.optimizer.param_groups, sched.get_last_lr(), strict=True):
                group["lr"] = lr
        if overrides:
            for group in self.optimizer.param_groups:
                group.update(overrides)
        if plan.history:
            self.set_num_updates(num_updates)
        return extra

    def _check_criterion_name(self, uri: str, saved: Any) -> None:
        """``config.criterion_check``: strict / warn (criteria without parameters) / off."""
        mode = self.config.criterion_check
        live = type(self.criterion).__name__ if self.criterion is not None else None
        if mode == "off" or saved == live:
            return
        if mode == "warn" and not has_parameters(self.criterion):
            logger.warning(
                "rank %d: %s: criterion does not match the checkpoint: saved %s, live %s; the "
                "live criterion has no parameters, so no criterion state is restored and "
                "training continues (criterion_check='warn'; 'strict' refuses, 'off' skips the "
                "check)", self.rank, uri, saved, live)
            return
        raise StateMismatchError(
            f"{uri}: criterion does not match the checkpoint: saved {saved}, live {live}; pass "
            "reset_optimizer=True to restore the weights with a fresh optimizer")


class _InPlaceTargets:
    """The ``targets`` a restore passes to its restorer: the trainer's
    :meth:`RestoreState._in_place_targets`, and ``read_back`` to learn which state was read
    from the item it checked (:class:`~xla_ckpt.trainer.sources.SingleProcessRestorer`)."""

    def __init__(self, owner: RestoreState) -> None:
        self.owner = owner

    def __call__(self, item: Item) -> dict[str, torch.Tensor]:
        return self.owner._in_place_targets(item)

    def read_back(self, item: Item, state: Any) -> None:
        self.owner._read_back(item, state)
