"""The fairseq checkpoint upgrade: recognise a fairseq state dict and bring it to today's layout.

:func:`upgrade_fairseq_state` follows fairseq's
``checkpoint_utils._upgrade_state_dict``: ``optimizer_history`` and
``last_optimizer_state`` are synthesised for the oldest layouts, top-level
``epoch``/``batch_offset``/``val_loss`` move into ``extra_state``,
``optimizer_name``/``lr_scheduler_state``/``num_updates`` are filled,
``extra_state["train_iterator"]`` is synthesised (``version`` 1, fairseq's
default when absent) and ``previous_training_time`` defaults to 0.0; the
Namespace-level renames fairseq applies (``max_positions``,
``remove_bpe``->``post_process``, ``min_lr``->``stop_min_lr``, float ``lr`` ->
``[lr]``, ...) are applied to ``args``.  **args -> cfg decision:** ``args``
stays an ``argparse.Namespace``; when the file has no ``cfg``, ``cfg`` becomes
a *flat* ``dict`` copy of ``vars(args)`` (fairseq groups it with its dataclass
registry, which needs fairseq itself); a ``cfg`` dict in newer files is kept
as it is.

The names the upgrade fills for the oldest layouts (``optimizer_name``
``FairseqNAG``, ``criterion_name`` ``CrossEntropyCriterion``) are fairseq's;
the trainer restore maps them onto torch (``FairseqNAG`` -> nesterov ``SGD``,
see :mod:`xla_ckpt.trainer.fairseq_compat`; a criterion name is checked per
``CheckpointerConfig.criterion_check``).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from xla_ckpt.errors import CheckpointCorruptError


def looks_like_fairseq(obj: Any) -> bool:
    """True for a fairseq ``Trainer``/``checkpoint_utils.save_state`` dict (any vintage)."""
    if not isinstance(obj, dict) or "model" not in obj:
        return False
    return any(k in obj for k in ("optimizer_history", "args", "cfg", "extra_state",
                                  "last_optimizer_state", "best_loss"))


def upgrade_fairseq_state(state: dict, *, where: str = "<state>") -> dict:
    """Bring a fairseq checkpoint dict to the current layout, in place (fairseq
    ``checkpoint_utils._upgrade_state_dict`` semantics; see the module docstring).

    Raises:
        CheckpointCorruptError: a key the upgrade needs has the wrong type (names it).
    """
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise CheckpointCorruptError(f"{where}: fairseq checkpoint field {what} is malformed")

    if "optimizer_history" not in state:
        state["optimizer_history"] = [{"criterion_name": "CrossEntropyCriterion",
                                       "best_loss": state.pop("best_loss", None)}]
        if "optimizer" in state:
            state["last_optimizer_state"] = state.pop("optimizer")
    if "epoch" in state and "extra_state" not in state:
        state["extra_state"] = {k: state.pop(k, None)
                                for k in ("epoch", "batch_offset", "val_loss")}
    hist = state["optimizer_history"]
    need(isinstance(hist, list) and bool(hist) and all(isinstance(h, dict) for h in hist),
         "optimizer_history (a non-empty list of dicts)")
    last = hist[-1]
    if "optimizer" in last:
        state["last_optimizer_state"] = last["optimizer"]
        for h in hist:
            h.pop("optimizer", None)
    last.setdefault("optimizer_name", "FairseqNAG")
    if "lr_scheduler_state" not in last:
        last["lr_scheduler_state"] = {"best": last.pop("best_loss", None)}
    last.setdefault("num_updates", 0)

    extra = state.setdefault("extra_state", {})
    if extra is None:
        extra = state["extra_state"] = {}
    need(isinstance(extra, dict), "extra_state (a dict)")
    if "train_iterator" not in extra:
        extra["train_iterator"] = {"epoch": extra.get("epoch", 0),
                                   "iterations_in_epoch": extra.get("batch_offset", 0)}
    it = extra["train_iterator"]
    if it is not None:
        need(isinstance(it, dict), "extra_state['train_iterator'] (a dict)")
        it.setdefault("version", 1)
    extra.setdefault("previous_training_time", 0.0)

    args = state.get("args")
    if args is not None:
        need(isinstance(args, argparse.Namespace), "args (an argparse.Namespace)")
        _upgrade_args(args)
        if it is not None:
            epoch = it.get("epoch", 1)
            it["epoch"] = max(epoch if isinstance(epoch, int) else 1, 1)
        if state.get("cfg") is None:
            state["cfg"] = dict(vars(args))
    return state


def _upgrade_args(args: argparse.Namespace) -> None:
    """The Namespace renames of fairseq ``_upgrade_state_dict`` that need no fairseq registry."""
    if hasattr(args, "max_positions") and not hasattr(args, "max_source_positions"):
        args.max_source_positions = args.max_positions
        args.max_target_positions = args.max_positions
    if not hasattr(args, "task"):
        args.task = "translation"
    if getattr(args, "raw_text", False):
        args.dataset_impl = "raw"
    elif getattr(args, "lazy_load", False):
        args.dataset_impl = "lazy"
    if hasattr(args, "remove_bpe"):
        args.post_process = args.remove_bpe
    if hasattr(args, "min_lr"):
        args.stop_min_lr = args.min_lr
        del args.min_lr
    if getattr(args, "criterion", None) in ("binary_cross_entropy", "kd_binary_cross_entropy"):
        args.criterion = "wav2vec"
    if hasattr(args, "log_keys") and args.log_keys is None:
        del args.log_keys
    if getattr(args, "task", None) == "speech_pretraining":
        args.task = "audio_pretraining"
    if getattr(args, "arch", None) == "audio_cpc":
        args.arch = "wav2vec"
    if isinstance(getattr(args, "lr", None), float):
        args.lr = [args.lr]
    data = getattr(args, "data", None)
    if isinstance(data, list) and data:
        args.data = data[0]


def fairseq_metadata(state: dict) -> dict:
    """``num_updates``/``epoch``/``iterations_in_epoch``/``loss`` of an upgraded fairseq state."""
    md: dict = {}
    hist = state.get("optimizer_history")
    if isinstance(hist, list) and hist and isinstance(hist[-1], dict):
        n = hist[-1].get("num_updates")
        if isinstance(n, int) and not isinstance(n, bool):
            md["num_updates"] = n
    extra = state.get("extra_state")
    if isinstance(extra, dict):
        it = extra.get("train_iterator")
        if isinstance(it, dict):
            for k in ("epoch", "iterations_in_epoch"):
                if isinstance(it.get(k), int) and not isinstance(it.get(k), bool):
                    md[k] = it[k]
        loss = extra.get("val_loss")
        if isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss):
            md["loss"] = float(loss)
    return md

