"""What a trainer restore will do, decided and checked before anything is loaded.

:meth:`~xla_ckpt.trainer.restore_state.RestoreState.load_checkpoint` first turns the
state it read into a :class:`RestorePlan` (:meth:`RestoreState._plan_restore
<xla_ckpt.trainer.restore_state.RestoreState._plan_restore>`): every check that can
fail (model and criterion keys, shapes and dtypes; the optimizer's history, criterion
and class names, fairseq mapping, param group count and sizes, state keys and shapes;
the lr_scheduler state) runs against the checkpoint and probes built like the live
objects, and only then does the first byte land in a live object.  A refusal leaves
the live model, criterion, optimizer and lr_scheduler as they were, and says so
(:data:`NOTHING_RESTORED`).

Which layout a state has (:func:`trainer_layout`):

* ``"trainer"``: fairseq's ``Trainer`` layout (``optimizer_history``,
  ``last_optimizer_state``, ``extra_state``), written by fairseq or by
  :class:`~xla_ckpt.trainer.Checkpointer`.  An *old* fairseq layout (recognised by
  fairseq's own fields, :func:`~xla_ckpt.format.legacy.fairseq_vintage`) is upgraded here,
  on the trainer's path only, each change logged;
* ``"plain"``: a ``torch.save`` training dict with a ``model`` entry and none of those
  keys, such as MAE's / DeiT's ``{"model", "optimizer", "epoch", "args", ...}`` (CASES
  C24).  Its model is restored; its optimizer state too when exactly one entry is an
  ``optimizer.state_dict()`` and its param groups fit the live optimizer's class
  (:func:`~xla_ckpt.trainer.optimizer_state.check_param_group_keys`: the file names no
  class).  It has no ``optimizer_history``, so no criterion or optimizer name is checked,
  no lr_scheduler state or ``num_updates`` is restored, and none is made up; its other
  entries come back in ``extra_state`` exactly as saved.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from xla_ckpt.errors import StateMismatchError
from xla_ckpt.format.legacy import fairseq_vintage, upgrade_fairseq_state
from xla_ckpt.trainer import keys as K
from xla_ckpt.trainer.fairseq_compat import FairseqOptimizerState
from xla_ckpt.trainer.module_load import ModuleLoadReport

logger = logging.getLogger("xla_ckpt.trainer.checkpointer")

NOTHING_RESTORED = ("Nothing was restored: the live model, criterion, optimizer and "
                    "lr_scheduler hold what they held before this call.")
"""Ends every refusal raised before the first byte lands in a live object."""

def ends(message: Any, tail: str) -> str:
    """``message`` (an error) as a sentence, then ``tail``."""
    text = str(message).rstrip()
    return f"{text}{'' if text.endswith('.') else '.'} {tail}"


TRAINER_KEYS = (K.OPTIMIZER_HISTORY, K.LAST_OPTIMIZER_STATE, K.EXTRA_STATE)


def is_optimizer_state(value: Any) -> bool:
    """Whether ``value`` looks like an ``optimizer.state_dict()`` (``state``, ``param_groups``)."""
    return isinstance(value, Mapping) and isinstance(value.get("state"), Mapping) and \
        isinstance(value.get("param_groups"), list)


def _keys(state: Mapping) -> str:
    names = sorted(map(str, state))
    return ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")


def trainer_layout(state: Any, *, where: str, rank: int = 0) -> tuple[Mapping, str]:
    """``(state, layout)``: the state to restore (an old fairseq layout upgraded) and
    ``"trainer"`` or ``"plain"`` (module docstring).

    Raises:
        StateMismatchError: no ``model`` entry (names the keys found and what to do).
    """
    if not isinstance(state, Mapping) or not isinstance(state.get(K.MODEL), Mapping):
        found = f"keys {_keys(state)}" if isinstance(state, Mapping) else \
            f"a {type(state).__name__}"
        raise StateMismatchError(
            f"{where}: not a trainer checkpoint: it holds {found} and no {K.MODEL!r} "
            "state_dict. A Checkpointer restores fairseq's / its own layout or a torch.save "
            "dict with a 'model' entry (and at most one optimizer.state_dict()); load this "
            "one with xla_ckpt.load and pick its entries yourself (e.g. "
            "model.load_state_dict(state['student'])).")
    if fairseq_vintage(state) == "old":
        state, changes = upgrade_fairseq_state(dict(state), where=where)
        logger.info("rank %d: %s: old fairseq layout upgraded for the restore (the file is "
                    "unchanged): %s", rank, where, "; ".join(changes))
        for c in changes:
            if "fairseq default" in c:
                logger.warning("rank %d: %s: %s", rank, where, c)
        return state, "trainer"
    if any(k in state for k in TRAINER_KEYS):
        return state, "trainer"
    return state, "plain"


@dataclass
class RestorePlan:
    """What the restore loads, decided and checked before anything is loaded.

    Attributes:
        state: the state read (an old fairseq layout upgraded).
        layout: ``"trainer"`` or ``"plain"`` (:func:`trainer_layout`).
        model_state / model_report: the model's checked state_dict and report (None for a
            sharded model, which DCP loads with its own strict check).
        criterion_state / criterion_report: the same for a criterion with parameters.
        optimizer_state: the state to load into the optimizer (mapped from fairseq's layout
            where needed), or None when the optimizer is not restored.
        optimizer_key: where it came from (``last_optimizer_state``, or a plain dict's key).
        adapted: the fairseq mapping, when one was made.
        optimizer / lr_scheduler: a new pair built over the live parameters for the checks,
            installed after the model load (None: the live optimizer is used).
        history: the ``optimizer_history`` read (empty for a plain dict).
        extra_state: what the restore returns (before this rank's private state).
        not_restored: keys of a plain dict that no part of the trainer restores.
        in_place_ok: for a manifest's records: whether the model may be read in place (not
            when the optimizer state still needs mapping, which can refuse later).
        checked: ``(optimizer, optimizer_state)`` that ``check_optimizer_state`` passed on
            (by identity): loading that state into that optimizer need not check it again.
    """

    state: Mapping
    layout: str
    model_state: Optional[Mapping[str, Any]] = None
    model_report: Optional[ModuleLoadReport] = None
    criterion_state: Optional[Mapping[str, Any]] = None
    criterion_report: Optional[ModuleLoadReport] = None
    optimizer_state: Any = None
    optimizer_key: Any = K.LAST_OPTIMIZER_STATE
    adapted: Optional[FairseqOptimizerState] = None
    optimizer: Optional[torch.optim.Optimizer] = None
    lr_scheduler: Any = None
    history: list = field(default_factory=list)
    extra_state: dict = field(default_factory=dict)
    not_restored: list[str] = field(default_factory=list)
    in_place_ok: bool = True
    checked: Optional[tuple[Any, Any]] = None


def plain_optimizer_keys(state: Mapping) -> list[Any]:
    """The keys of a plain dict whose values are ``optimizer.state_dict()``s."""
    return [k for k, v in state.items() if k != K.MODEL and is_optimizer_state(v)]
