"""fairseq checkpoints: recognise one exactly, and bring an old one to today's layout on request.

**Recognition** (:func:`looks_like_fairseq`, :func:`fairseq_vintage`) is by the
fields fairseq itself writes, with their exact shapes (``checkpoint_utils.save_state``
and ``_upgrade_state_dict``), never by ``model`` plus ``args``/``cfg`` alone: MAE,
DeiT, DINO and most ``torch.save`` training loops write
``{"model", "optimizer", "epoch", "args"}`` too (CASES C24).  A dict is fairseq's
when it holds a ``model`` mapping and either

* ``optimizer_history``: a non-empty list of dicts, each with a ``criterion_name``
  (str or None) and only fairseq's history fields: ``optimizer_name`` (str),
  ``lr_scheduler_state`` (dict or None), ``num_updates`` (int), ``optimizer`` (an
  ``optimizer.state_dict()``), ``best_loss`` (number or None); with
  ``last_optimizer_state``, when present, an optimizer state (dict with
  ``param_groups``) or None, and ``extra_state``, when present, a dict (or None)
  whose ``train_iterator``, when present, is a dict or None;
* or the 2017 fairseq-py layout, whose keys are exactly ``args`` (an
  ``argparse.Namespace``), ``model``, ``optimizer`` (an optimizer state),
  ``best_loss`` (number or None), ``epoch``, ``batch_offset`` and ``val_loss``: what
  fairseq's own upgrade requires of a file without ``optimizer_history`` (it raises
  KeyError on anything less).

A dict holding ``last_optimizer_state`` or ``extra_state`` without a history is not
fairseq's: fairseq writes ``optimizer_history`` into every file that has them (and its
upgrade fails on such a file).

**The upgrade** (:func:`upgrade_fairseq_state`) runs only when asked by name
(``layout="fairseq"``, ``xla-ckpt convert --layout fairseq``) or on the trainer's
restore path (:class:`~xla_ckpt.trainer.Checkpointer`), never in ``xla_ckpt.load``,
``xla-ckpt inspect`` or ``convert``'s default layout, which return what was saved.
It does fairseq's *moves* of values the file holds: ``optimizer`` ->
``last_optimizer_state``, top-level ``best_loss`` into the history (then into
``lr_scheduler_state["best"]``), ``epoch``/``batch_offset``/``val_loss`` into
``extra_state``, an ``optimizer`` kept in the history -> ``last_optimizer_state``,
``extra_state["train_iterator"]`` from ``epoch``/``batch_offset``.  It fills only the
names the oldest files lack and the trainer needs (``criterion_name``,
``optimizer_name``: from ``args.criterion`` / ``args.optimizer`` when they name one,
else fairseq's own defaults ``CrossEntropyCriterion`` / ``FairseqNAG``) and
``num_updates`` 0 (fairseq's), and every change is returned as a line the caller logs.
Unlike fairseq it leaves ``args`` as saved (no ``lr`` -> ``[lr]``, no
``task='translation'``, no renames: those only feed fairseq's omegaconf ``cfg``,
which is not built here) and adds no ``cfg``, iterator ``version`` or
``previous_training_time``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from typing import Any, Optional

from xla_ckpt.errors import CheckpointCorruptError

HISTORY_FIELDS = ("criterion_name", "optimizer_name", "lr_scheduler_state", "num_updates",
                  "optimizer", "best_loss")
"""The keys fairseq writes in an ``optimizer_history`` entry (any vintage)."""

OLDEST_KEYS = ("args", "model", "optimizer", "best_loss", "epoch", "batch_offset", "val_loss")
"""The keys of a 2017 fairseq-py checkpoint (no ``optimizer_history``)."""

_OLDEST_EPOCH_KEYS = ("epoch", "batch_offset", "val_loss")

# fairseq --optimizer / --criterion registry names -> the class names fairseq records.
_OPTIMIZER_CLASS = {"nag": "FairseqNAG", "adam": "FairseqAdam", "sgd": "SGD",
                    "adagrad": "Adagrad", "adadelta": "Adadelta"}
_CRITERION_CLASS = {"cross_entropy": "CrossEntropyCriterion",
                    "label_smoothed_cross_entropy": "LabelSmoothedCrossEntropyCriterion"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number_or_none(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _is_optimizer_state(v: Any) -> bool:
    return isinstance(v, Mapping) and isinstance(v.get("param_groups"), list)


_FIELD_OK = {
    "criterion_name": lambda v: v is None or isinstance(v, str),
    "optimizer_name": lambda v: isinstance(v, str),
    "lr_scheduler_state": lambda v: v is None or isinstance(v, Mapping),
    "num_updates": _is_int,
    "optimizer": _is_optimizer_state,
    "best_loss": _is_number_or_none,
}


def _history_entry_ok(h: Any) -> bool:
    return isinstance(h, Mapping) and "criterion_name" in h and \
        all(k in _FIELD_OK and _FIELD_OK[k](v) for k, v in h.items())


def fairseq_vintage(obj: Any) -> Optional[str]:
    """``"current"``, ``"old"`` (an upgrade would move fields) or None (not fairseq's).

    The rules are the module docstring's; values are checked after the allow-listed
    load (numpy scalars already Python numbers unless kept).
    """
    if not isinstance(obj, Mapping) or not isinstance(obj.get("model"), Mapping):
        return None
    if "optimizer_history" in obj:
        hist = obj["optimizer_history"]
        if not isinstance(hist, list) or not hist or not all(map(_history_entry_ok, hist)):
            return None
        if "last_optimizer_state" in obj and obj["last_optimizer_state"] is not None and \
                not _is_optimizer_state(obj["last_optimizer_state"]):
            return None
        extra = obj.get("extra_state")
        if extra is not None and not isinstance(extra, Mapping):
            return None
        it = extra.get("train_iterator") if isinstance(extra, Mapping) else None
        if it is not None and not isinstance(it, Mapping):
            return None
        return "old" if _needs_upgrade(obj) else "current"
    if set(obj) != set(OLDEST_KEYS):
        return None
    if not isinstance(obj["args"], argparse.Namespace) or \
            not _is_optimizer_state(obj["optimizer"]) or not _is_number_or_none(obj["best_loss"]):
        return None
    return "old"


def _needs_upgrade(obj: Mapping) -> bool:
    hist = obj["optimizer_history"]
    last = hist[-1]
    if any("optimizer" in h for h in hist) or \
            any(k not in last for k in ("optimizer_name", "lr_scheduler_state", "num_updates")):
        return True
    if "epoch" in obj and "extra_state" not in obj:
        return True
    extra = obj.get("extra_state")
    return isinstance(extra, Mapping) and "train_iterator" not in extra and "epoch" in extra


def looks_like_fairseq(obj: Any) -> bool:
    """True when ``obj`` is a fairseq checkpoint dict of any vintage (:func:`fairseq_vintage`)."""
    return fairseq_vintage(obj) is not None


def upgrade_fairseq_state(state: dict, *, where: str = "<state>") -> tuple[dict, list[str]]:
    """Bring a fairseq checkpoint dict to the current layout (module docstring).

    Returns a new top-level dict (history entries and ``extra_state`` copied where they
    change; tensors and ``args`` are the same objects) and the list of changes made, one
    line each, for the caller to log; an empty list for a current-layout file.

    Raises:
        CheckpointCorruptError: ``state`` is not a fairseq checkpoint
            (:func:`fairseq_vintage`); names the keys found.
    """
    vintage = fairseq_vintage(state)
    if vintage is None:
        shown = sorted(map(str, state))[:12] if isinstance(state, Mapping) else \
            type(state).__name__
        raise CheckpointCorruptError(
            f"{where}: not a fairseq checkpoint (keys: {shown}); fairseq writes "
            "optimizer_history with criterion_name/optimizer_name/lr_scheduler_state/"
            "num_updates entries (or, in 2017, exactly args, model, optimizer, best_loss, "
            "epoch, batch_offset, val_loss)")
    if vintage == "current":
        return dict(state), []
    out = dict(state)
    changes: list[str] = []
    args = out.get("args")
    if "optimizer_history" not in out:
        reg = getattr(args, "criterion", None)
        named = _CRITERION_CLASS.get(reg) if isinstance(reg, str) else None
        crit = named or "CrossEntropyCriterion"
        out["optimizer_history"] = [{"criterion_name": crit, "best_loss": out.pop("best_loss")}]
        out["last_optimizer_state"] = out.pop("optimizer")
        changes.append("optimizer -> last_optimizer_state; best_loss -> optimizer_history[0]")
        src = "from args.criterion" if named else "fairseq default"
        changes.append(f"optimizer_history[0]['criterion_name'] = {crit!r} (the file names "
                       f"none; {src})")
    if "epoch" in out and "extra_state" not in out:
        out["extra_state"] = {k: out.pop(k) for k in _OLDEST_EPOCH_KEYS if k in out}
        changes.append(f"{', '.join(out['extra_state'])} -> extra_state")
    hist = [dict(h) for h in out["optimizer_history"]]
    out["optimizer_history"] = hist
    last = hist[-1]
    if "optimizer" in last:
        out["last_optimizer_state"] = last["optimizer"]
        changes.append("optimizer_history[-1]['optimizer'] -> last_optimizer_state")
    for h in hist:
        h.pop("optimizer", None)
    if "optimizer_name" not in last:
        reg = getattr(args, "optimizer", None)
        name = _OPTIMIZER_CLASS.get(reg) if isinstance(reg, str) else None
        last["optimizer_name"] = name or "FairseqNAG"
        changes.append(f"optimizer_history[-1]['optimizer_name'] = {last['optimizer_name']!r} "
                       f"(the file names none; "
                       f"{'from args.optimizer' if name else 'fairseq default'})")
    if "lr_scheduler_state" not in last:
        last["lr_scheduler_state"] = {"best": last.pop("best_loss", None)}
        changes.append("optimizer_history[-1]['best_loss'] -> lr_scheduler_state['best']")
    if "num_updates" not in last:
        last["num_updates"] = 0
        changes.append("optimizer_history[-1]['num_updates'] = 0 (fairseq default)")
    extra = out.get("extra_state")
    if isinstance(extra, Mapping) and "train_iterator" not in extra and "epoch" in extra:
        extra = out["extra_state"] = dict(extra)
        extra["train_iterator"] = {"epoch": extra["epoch"],
                                   "iterations_in_epoch": extra.get("batch_offset", 0)}
        changes.append("extra_state['train_iterator'] from epoch/batch_offset")
    return out, changes


def fairseq_metadata(state: Mapping) -> dict:
    """``num_updates``/``epoch``/``iterations_in_epoch``/``loss`` of a fairseq state.

    Reads either layout without changing it: an upgraded (current) one, or the
    fields an old one keeps at the top level or in ``extra_state``.
    """
    md: dict = {}
    hist = state.get("optimizer_history")
    if isinstance(hist, list) and hist and isinstance(hist[-1], Mapping):
        n = hist[-1].get("num_updates")
        if _is_int(n):
            md["num_updates"] = n
    extra = state.get("extra_state")
    src: Mapping = extra if isinstance(extra, Mapping) else state
    it = src.get("train_iterator")
    if isinstance(it, Mapping):
        for k in ("epoch", "iterations_in_epoch"):
            if _is_int(it.get(k)):
                md[k] = it[k]
    else:
        if _is_int(src.get("epoch")):
            md["epoch"] = src["epoch"]
        if _is_int(src.get("batch_offset")):
            md["iterations_in_epoch"] = src["batch_offset"]
    loss = src.get("val_loss")
    if isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss):
        md["loss"] = float(loss)
    return md
