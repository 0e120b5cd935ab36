"""The trainer's config section: :class:`CheckpointerConfig`, the knobs of
:class:`~xla_ckpt.trainer.Checkpointer`'s restore and save."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from xla_ckpt.errors import ConfigError
from xla_ckpt.restore.config import RANK_STATE_ON_RESIZE
from xla_ckpt.trainer.module_load import check_dtype_policy

# How the trainer restore treats a criterion class name that differs from the checkpoint's
# (CheckpointerConfig.criterion_check).
CRITERION_CHECKS = ("strict", "warn", "off")


@dataclass(kw_only=True)
class CheckpointerConfig:
    """Restore/save knobs of :class:`~xla_ckpt.trainer.Checkpointer` (``Checkpointer(config=)``).

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
        criterion_check: what the restore does when the criterion class name
            differs from the checkpoint's (``optimizer_history[-1]["criterion_name"]``,
            e.g. saved ``LabelSmoothedCrossEntropyCriterion``, live ``CrossEntropyLoss``
            or ``None``): ``"strict"`` raises StateMismatchError; ``"warn"``
            (default) logs a WARNING and continues when the live criterion has
            no parameters (it has no state to load, so only its name differs) and
            raises when it has parameters; ``"off"`` never checks (a criterion
            with parameters is still loaded strictly by key).  Config key
            ``train.criterion_check``.
        fairseq_compat: map fairseq optimizer names and states
            (:data:`~xla_ckpt.trainer.fairseq_compat.FAIRSEQ_OPTIMIZERS`, FP16
            wrappers with their ``loss_scale``) and fairseq ``lr_scheduler_state``
            onto the live torch optimizer and scheduler
            (:mod:`~xla_ckpt.trainer.fairseq_compat`,
            :func:`~xla_ckpt.trainer.lr_scheduler.load_lr_scheduler_state`).  On by
            default; off, the saved optimizer name must equal the live class name
            (fairseq's own rule).  Config key ``train.fairseq_compat``.
        rank_state_on_resize: a sharded model's restore from a checkpoint saved with
            another world size that holds per-rank items (``rank_extra_state``: iterator
            position, RNG): ``"error"`` (default) raises
            :class:`~xla_ckpt.errors.WorldSizeMismatchError` on every rank naming them and
            these options; ``"drop"`` restores without them (a WARNING names what was
            dropped; ``extra_state`` then lacks the per-rank values).  Passed to the
            restorer (the default one, or one from
            :func:`xla_ckpt.trainer.make_restorer`) as
            :attr:`xla_ckpt.restore.RestoreConfig.rank_state_on_resize`.
        rank_state_remap: ``fn(saved: dict[int, Any], rank: int, world_size: int) -> Any``
            mapping every saved rank's per-rank state (saved rank -> its
            ``rank_extra_state``) onto this rank when the world size differs; its value is
            merged over ``extra_state`` as the saved rank's own was.  Called on every rank.
            Wins over ``rank_state_on_resize``.  Both can also be given per call to
            :meth:`~xla_ckpt.trainer.Checkpointer.load_checkpoint`.

    Raises:
        ConfigError: a value outside its choices, a ``rank_state_remap`` that is not
            callable, or a flag that is not a bool (names the field and the value).
    """

    dtype_policy: str = "error"
    strip_prefixes: bool = False
    no_save_optimizer_state: bool = False
    criterion_check: str = "warn"
    fairseq_compat: bool = True
    rank_state_on_resize: str = "error"
    rank_state_remap: Optional[Callable[[dict[int, Any], int, int], Any]] = None

    def __post_init__(self) -> None:
        check_dtype_policy(self.dtype_policy, "dtype_policy")
        if self.criterion_check not in CRITERION_CHECKS:
            raise ConfigError(f"criterion_check: must be one of {', '.join(CRITERION_CHECKS)}, "
                              f"got {self.criterion_check!r}")
        if self.rank_state_on_resize not in RANK_STATE_ON_RESIZE:
            raise ConfigError(f"rank_state_on_resize: must be one of "
                              f"{', '.join(RANK_STATE_ON_RESIZE)}, got "
                              f"{self.rank_state_on_resize!r}")
        if self.rank_state_remap is not None and not callable(self.rank_state_remap):
            raise ConfigError("rank_state_remap: must be fn(saved, rank, world_size) or None, "
                              f"got {self.rank_state_remap!r}")
        for name in ("strip_prefixes", "no_save_optimizer_state", "fairseq_compat"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: must be true or false, got {getattr(self, name)!r}")
