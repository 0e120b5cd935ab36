"""fairseq checkpoints restored into torch optimizers: the name map and the state-layout mapping.

fairseq saves ``optimizer_history[-1]["optimizer_name"]`` as the class name of
its *wrapper* (``FairseqAdam``, ``FairseqNAG``, ``FP16Optimizer``, ...) and
``last_optimizer_state`` as the state of the torch optimizer inside it.  A
live ``torch.optim.AdamW`` therefore never matches by name.  With
``CheckpointerConfig.fairseq_compat`` (on by default) the restore looks the
saved name up in :data:`FAIRSEQ_OPTIMIZERS`, checks that the live optimizer
is one of the torch classes it maps to, and rewrites the saved state into the
live optimizer's layout (:func:`adapt_fairseq_optimizer_state`).  A *state*
that cannot map exactly is refused with one
:class:`~xla_ckpt.errors.StateMismatchError` naming the checkpoint, the key
and ``reset_optimizer=True``; every state tensor restored is exact.  One
difference of the *update rule* remains and is logged (WARNING, rank 0, once
per restore), not refused: see ``FairseqAdam`` below.

The map (saved ``optimizer_name`` -> live torch optimizer: what changes):

* ``FairseqAdam`` (``fairseq.optim.adam.Adam``; FusedAdam on CUDA) -> ``AdamW``
  or ``Adam``: same state keys (``step``, ``exp_avg``, ``exp_avg_sq``,
  ``max_exp_avg_sq``).  fairseq's Adam decays weights the AdamW way, so a
  live ``Adam`` gets ``decoupled_weight_decay=True`` when ``weight_decay != 0``.
  FusedAdam's fp16 stats (``exp_avg_scale``, ``exp_avg_sq_scale``) are
  unscaled to fp32.  ``adaptive_adam=True``, ``bias_correction=False``,
  ``max_grad_norm > 0`` and ``eps_inside_sqrt=True`` are refused.
  **Not bit-identical afterwards:** fairseq adds ``eps`` before the bias
  correction, torch after it.  fairseq steps by
  ``lr * sqrt(1 - beta2**t) / (1 - beta1**t) * m / (sqrt(v) + eps)``, torch by
  ``lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)``, so torch's
  step equals fairseq's with ``eps`` replaced by ``eps / sqrt(1 - beta2**t)``
  (x1.58 at ``t=1000``, x1.0025 at ``t=10000`` for ``beta2=0.999``; it tends to 1
  as ``t`` grows).  The difference matters only where ``sqrt(v)`` is not much
  larger than ``eps`` (rarely updated embedding rows); torch then steps a little
  further.  :attr:`FairseqOptimizerState.notes` carries it, with the factor at
  the next step, and the restore logs it.
* ``FairseqAdamW`` -> ``AdamW`` or ``Adam``: as ``FairseqAdam`` (fairseq itself
  registers no such class; the name is accepted for trainers that save it).
* ``FairseqCPUAdam`` (DeepSpeed CPU Adam in AdamW mode) -> ``AdamW`` or
  ``Adam``: as ``FairseqAdam``.
* ``FairseqNAG`` -> ``SGD``: fairseq's NAG keeps ``momentum_buffer`` scaled by
  ``-lr``, torch's nesterov SGD in gradient units, so
  ``buf_torch = buf / -lr_old`` (``lr_old``: the group's lr at the last step);
  the groups get ``nesterov=True, dampening=0``.  ``weight_decay != 0`` is
  refused: NAG decays weights decoupled (``p *= 1 - lr * wd``), SGD as an L2
  term that enters the momentum.
* ``SGD``, ``Adagrad``, ``Adadelta`` (and the aliases ``FairseqSGD``,
  ``FairseqAdagrad``) -> the same torch class: fairseq's ``sgd`` / ``adagrad`` /
  ``adadelta`` wrap the torch class itself, its state is unchanged.
* refused, with the reason in the error: ``FairseqAdafactor``
  (``torch.optim.Adafactor``'s ``row_var``/``col_var`` are a reshape of
  fairseq's ``exp_avg_sq_row``/``_col``, but its update differs: eps clamps
  instead of adding, no ``beta1``, no ``scale_parameter=False``),
  ``FairseqAdamax`` (torch takes ``eps`` inside the max and decays L2),
  ``FairseqLAMB``, ``FairseqBMUF``, ``FairseqCompositeOptimizer`` (no torch
  counterpart).

Wrappers: ``FP16Optimizer``, ``MemoryEfficientFP16Optimizer`` (fairseq's
``_FP16OptimizerMixin`` family) and ``AMPOptimizer`` save the state of the
optimizer they wrap; which one that is comes from the checkpoint's ``args``
(``args.optimizer``) or ``cfg`` (``cfg["optimizer"]["_name"]``), else from the
param-group keys (``betas`` -> Adam, ``lr_old`` -> NAG, ``nesterov`` -> SGD).
Their ``loss_scale`` (the dynamic loss scaler's scale, a float) is taken out
of the state and returned (:attr:`FairseqOptimizerState.loss_scale`); the
restore puts it in the returned ``extra_state["loss_scale"]`` so a
``torch.amp.GradScaler`` can continue from it
(``scaler.update(new_scale=extra_state["loss_scale"])``).  ``FP16Optimizer``
with flattened fp32 master parameters (fairseq's default) keeps *one* flat
1-D state tensor per device; it is split into per-parameter tensors in the
order of the live parameters (model, then criterion: fairseq's order).  The
fp32 master weights themselves are not in a fairseq checkpoint: fairseq
rebuilds them from the (fp16) model weights on load, and so does a live fp32
model (a widening cast).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from xla_ckpt.errors import StateMismatchError
from xla_ckpt.trainer.optimizer_state import check_saved_state_keys

__all__ = [
    "FAIRSEQ_OPTIMIZERS", "FAIRSEQ_OPTIMIZER_WRAPPERS", "FairseqOptimizerMap",
    "FairseqOptimizerState", "adapt_fairseq_optimizer_state", "fairseq_optimizer_map",
    "is_fairseq_optimizer_name",
]


@dataclass(frozen=True)
class FairseqOptimizerMap:
    """One row of the name map.

    Attributes:
        fairseq_name: the ``optimizer_name`` fairseq saves (its optimizer class name).
        registry_name: fairseq's ``--optimizer`` value (``cfg.optimizer._name``).
        torch_names: torch.optim class names the state restores into, preferred first;
            empty when it cannot map.
        layout: ``"adam"``, ``"nag"``, ``"torch"`` (already the torch layout) or
            ``"refused"``.
        why: for ``"refused"``, the reason given in the error.
    """

    fairseq_name: str
    registry_name: str
    torch_names: tuple[str, ...]
    layout: str
    why: str = ""


_ADAM = ("AdamW", "Adam")
FAIRSEQ_OPTIMIZERS: dict[str, FairseqOptimizerMap] = {m.fairseq_name: m for m in (
    FairseqOptimizerMap("FairseqAdam", "adam", _ADAM, "adam"),
    FairseqOptimizerMap("FairseqAdamW", "adamw", _ADAM, "adam"),
    FairseqOptimizerMap("FairseqCPUAdam", "cpu_adam", _ADAM, "adam"),
    FairseqOptimizerMap("FairseqNAG", "nag", ("SGD",), "nag"),
    FairseqOptimizerMap("SGD", "sgd", ("SGD",), "torch"),
    FairseqOptimizerMap("FairseqSGD", "sgd", ("SGD",), "torch"),
    FairseqOptimizerMap("Adagrad", "adagrad", ("Adagrad",), "torch"),
    FairseqOptimizerMap("FairseqAdagrad", "adagrad", ("Adagrad",), "torch"),
    FairseqOptimizerMap("Adadelta", "adadelta", ("Adadelta",), "torch"),
    FairseqOptimizerMap(
        "FairseqAdafactor", "adafactor", (), "refused",
        "torch.optim.Adafactor's update differs from fairseq's (eps clamps instead of adding, "
        "no beta1, no scale_parameter=False), so its next step would not continue this state"),
    FairseqOptimizerMap(
        "FairseqAdamax", "adamax", (), "refused",
        "torch.optim.Adamax takes eps inside the max and decays weights as L2; fairseq's adds "
        "eps to the denominator and decays them AdamW-style"),
    FairseqOptimizerMap("FairseqLAMB", "lamb", (), "refused",
                        "apex FusedLAMB has no torch.optim counterpart"),
    FairseqOptimizerMap("FairseqBMUF", "bmuf", (), "refused",
                        "BMUF's block-momentum state has no torch.optim counterpart"),
    FairseqOptimizerMap("FairseqCompositeOptimizer", "composite", (), "refused",
                        "a composite of several optimizers has no single torch.optim counterpart"),
)}

FAIRSEQ_OPTIMIZER_WRAPPERS = ("FP16Optimizer", "MemoryEfficientFP16Optimizer", "AMPOptimizer")

_BY_REGISTRY = {m.registry_name: m for m in reversed(list(FAIRSEQ_OPTIMIZERS.values()))}

# fairseq Adam-family param-group keys: (key, what a torch Adam/AdamW can continue from).
_ADAM_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")
_ADAM_CHECKED_KEYS = {
    "adaptive_adam": (lambda v: not v, "adaptive_adam=True (fairseq's per-row weight decay)"),
    "bias_correction": (lambda v: bool(v), "bias_correction=False"),
    "max_grad_norm": (lambda v: not v or v <= 0, "max_grad_norm > 0 (FusedAdam's own clipping)"),
    "eps_inside_sqrt": (lambda v: not v, "eps_inside_sqrt=True"),
    "use_fp16_stats": (lambda v: True, ""),
}
_ADAM_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_NAG_GROUP_KEYS = ("lr", "lr_old", "momentum", "weight_decay")


@dataclass
class FairseqOptimizerState:
    """What :func:`adapt_fairseq_optimizer_state` returns.

    Attributes:
        state_dict: ``{"state": ..., "param_groups": ...}`` in the live optimizer's layout,
            ready for :func:`~xla_ckpt.trainer.optimizer_state.load_optimizer_state`.
        saved_name: the ``optimizer_name`` in the checkpoint (``FP16Optimizer``, ...).
        fairseq_name: the fairseq optimizer whose state it is (the wrapped one for wrappers).
        loss_scale: the FP16 wrappers' dynamic loss scale (float), or None.
        flat_params_split: the state held flattened fp32 master parameters and was split.
        notes: how the live optimizer's next updates differ from fairseq's although the
            state restored exactly (the Adam ``eps`` placement, module docstring); the
            restore logs each at WARNING on rank 0.
    """

    state_dict: dict
    saved_name: str
    fairseq_name: str
    loss_scale: Optional[float] = None
    flat_params_split: bool = False
    notes: tuple[str, ...] = ()


def fairseq_optimizer_map(saved_name: Any) -> Optional[FairseqOptimizerMap]:
    """The row of :data:`FAIRSEQ_OPTIMIZERS` for ``saved_name``, or None (wrappers included)."""
    return FAIRSEQ_OPTIMIZERS.get(saved_name) if isinstance(saved_name, str) else None


def is_fairseq_optimizer_name(saved_name: Any) -> bool:
    """True for a name in :data:`FAIRSEQ_OPTIMIZERS` or :data:`FAIRSEQ_OPTIMIZER_WRAPPERS`."""
    return saved_name in FAIRSEQ_OPTIMIZERS or saved_name in FAIRSEQ_OPTIMIZER_WRAPPERS


_RESET = "pass reset_optimizer=True to restore the weights with a fresh optimizer"


def _configured_optimizer(cfg: Any, args: Any) -> Optional[str]:
    """fairseq's ``--optimizer`` from ``args`` (Namespace era) or ``cfg`` (dict era)."""
    if isinstance(args, argparse.Namespace) and isinstance(getattr(args, "optimizer", None), str):
        return args.optimizer
    if isinstance(cfg, Mapping):
        opt = cfg.get("optimizer")
        if isinstance(opt, Mapping) and isinstance(opt.get("_name"), str):
            return opt["_name"]
        if isinstance(opt, str):
            return opt
    return None


def _wrapped_map(saved_name: str, state: Mapping, cfg: Any, args: Any,
                 where: str) -> FairseqOptimizerMap:
    name = _configured_optimizer(cfg, args)
    if name is not None:
        row = _BY_REGISTRY.get(name)
        if row is None:
            raise StateMismatchError(
                f"{where}: the checkpoint's {saved_name} wraps fairseq optimizer {name!r}, which "
                f"xla_ckpt does not map to a torch optimizer (mapped: "
                f"{', '.join(sorted(_BY_REGISTRY))}); {_RESET}")
        return row
    groups = state.get("param_groups") or [{}]
    keys = set(groups[0]) if isinstance(groups[0], Mapping) else set()
    if "betas" in keys:
        return FAIRSEQ_OPTIMIZERS["FairseqAdam"]
    if "lr_old" in keys:
        return FAIRSEQ_OPTIMIZERS["FairseqNAG"]
    if "nesterov" in keys:
        return FAIRSEQ_OPTIMIZERS["SGD"]
    raise StateMismatchError(
        f"{where}: the checkpoint's optimizer is fairseq's {saved_name} and neither its args nor "
        f"its cfg say which optimizer it wraps (param-group keys: {sorted(map(str, keys))}); "
        f"{_RESET}")


def adapt_fairseq_optimizer_state(saved_name: str, optimizer: torch.optim.Optimizer,
                                  state_dict: Any, *, cfg: Any = None, args: Any = None,
                                  where: str = "") -> FairseqOptimizerState:
    """Rewrite a fairseq ``last_optimizer_state`` into ``optimizer``'s torch layout.

    Called by the trainer restore on every rank when the checkpoint's
    ``optimizer_name`` is a fairseq name (:data:`FAIRSEQ_OPTIMIZERS`,
    :data:`FAIRSEQ_OPTIMIZER_WRAPPERS`) that differs from the live class name.
    Tensors are not moved; new tensors (split flat state, converted NAG
    buffers, unscaled fp16 stats) are fresh copies of the saved ones.  Logs
    nothing (the caller logs, from rank 0).

    Args:
        saved_name: ``optimizer_history[-1]["optimizer_name"]``.
        optimizer: the live torch optimizer, built over the live parameters.
        state_dict: the checkpoint's ``last_optimizer_state``.
        cfg, args: the checkpoint's ``cfg`` / ``args`` (they name the optimizer a
            wrapper holds).
        where: checkpoint URI for messages.

    Returns:
        :class:`FairseqOptimizerState` (the mapped state, ``loss_scale``).

    Raises:
        StateMismatchError: the live optimizer is not a torch class the name maps to, the
            fairseq optimizer has no exact torch counterpart, or a state/param-group key
            cannot map; names the checkpoint and the key and suggests ``reset_optimizer=True``.
    """
    loc = f"{where}: " if where else ""
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("state"), Mapping) \
            or not isinstance(state_dict.get("param_groups"), list):
        raise StateMismatchError(f"{loc}the saved optimizer state is not an optimizer.state_dict() "
                                 f"(needs 'state' and 'param_groups'); {_RESET}")
    live_name = type(optimizer).__name__
    if saved_name in FAIRSEQ_OPTIMIZER_WRAPPERS:
        row = _wrapped_map(saved_name, state_dict, cfg, args, where or "<checkpoint>")
    else:
        found = fairseq_optimizer_map(saved_name)
        if found is None:
            raise StateMismatchError(
                f"{loc}optimizer does not match the checkpoint: saved {saved_name}, live "
                f"{live_name}; {_RESET}")
        row = found
    shown = saved_name if row.fairseq_name == saved_name else f"{saved_name} ({row.fairseq_name})"
    if row.layout == "refused":
        raise StateMismatchError(
            f"{loc}the checkpoint's optimizer {shown} cannot continue in torch: {row.why}; "
            f"{_RESET}")
    if live_name not in row.torch_names or not type(optimizer).__module__.startswith("torch.optim"):
        raise StateMismatchError(
            f"{loc}optimizer does not match the checkpoint: saved {shown}, live {live_name}; "
            f"fairseq's {row.fairseq_name} restores into torch.optim."
            f"{' or torch.optim.'.join(row.torch_names)}; build one of those or "
            f"{_RESET}")

    sd = dict(state_dict)
    loss_scale = sd.pop("loss_scale", None)
    if loss_scale is not None:
        loss_scale = float(loss_scale.item() if isinstance(loss_scale, torch.Tensor)
                           else loss_scale)
    unknown_top = sorted(str(k) for k in sd if k not in ("state", "param_groups"))
    if unknown_top:
        raise StateMismatchError(f"{loc}the saved optimizer state has key {unknown_top[0]!r}, "
                                 f"which no torch optimizer holds; {_RESET}")
    check_saved_state_keys(sd["state"], [pid for g in sd["param_groups"] if isinstance(g, Mapping)
                                         for pid in g.get("params", ())], loc, _RESET)
    sd, split = _unflatten(sd, optimizer, loc, where)
    live_group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    notes: tuple[str, ...] = ()
    if row.layout == "adam":
        sd = _adam_to_torch(sd, optimizer, live_group, loc, where)
        notes = (_adam_eps_note(sd, shown, live_name),)
    elif row.layout == "nag":
        sd = _nag_to_torch(sd, live_group, loc, where)
    return FairseqOptimizerState(state_dict=sd, saved_name=saved_name,
                                 fairseq_name=row.fairseq_name, loss_scale=loss_scale,
                                 flat_params_split=split, notes=notes)


def _adam_eps_note(sd: dict, shown: str, live_name: str) -> str:
    """The Adam ``eps`` placement difference, with the factor at the saved step."""
    steps = [st.get("step") for st in sd["state"].values() if isinstance(st, Mapping)]
    t = next((float(s.item() if isinstance(s, torch.Tensor) else s) for s in steps
              if isinstance(s, (int, float, torch.Tensor)) and not isinstance(s, bool)), None)
    group = sd["param_groups"][0] if sd["param_groups"] else {}
    betas = group.get("betas")
    beta2 = float(betas[1]) if isinstance(betas, (tuple, list)) and len(betas) == 2 else None
    at = ""
    if t is not None and t > 0 and beta2 is not None and 0 <= beta2 < 1:
        at = (f" (x{1.0 / math.sqrt(1.0 - beta2 ** (t + 1)):.4g} at the next step, t={t + 1:g}, "
              f"with beta2={beta2:g}; it tends to 1 as t grows)")
    return (f"{shown} state restored exactly into torch.optim.{live_name}, but the update rule "
            "differs: fairseq adds eps before the bias correction, torch after it, so the next "
            f"steps equal fairseq's with eps / sqrt(1 - beta2**t) in place of eps{at}; this "
            "matters only where sqrt(exp_avg_sq) is not much larger than eps")


def _unflatten(sd: dict, optimizer: torch.optim.Optimizer, loc: str,
               where: str) -> tuple[dict, bool]:
    """Split FP16Optimizer's flat fp32 master state into per-parameter state (live order)."""
    saved_groups = sd["param_groups"]
    saved_ids = [pid for g in saved_groups for pid in g.get("params", ())]
    live = [p for g in optimizer.param_groups for p in g["params"]]
    if len(saved_ids) == len(live):
        return sd, False
    flat = {pid: st for pid, st in sd["state"].items() if pid in saved_ids}
    if not any(isinstance(v, torch.Tensor) for st in flat.values() if isinstance(st, Mapping)
               for v in st.values()) and len(saved_ids) == 1 and len(saved_groups) == 1 \
            and len(optimizer.param_groups) == 1:
        # One flat fp32 master parameter saved before its first step (state {}): nothing to
        # split; its group's hyperparameters apply to every live parameter.
        group = {k: v for k, v in saved_groups[0].items() if k != "params"}
        group["params"] = list(range(len(live)))
        return {"state": {}, "param_groups": [group]}, True
    sizes: list[int] = []
    for pid in saved_ids:
        st = flat.get(pid, {})
        dims = {v.dim() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
        numels = {v.numel() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
        if dims != {1} or len(numels) != 1:
            sizes = []
            break
        sizes.append(numels.pop())
    live_total = sum(p.numel() for p in live)
    if not sizes or sum(sizes) != live_total or len(saved_groups) != 1 \
            or len(optimizer.param_groups) != 1:
        raise StateMismatchError(
            f"{loc}the saved optimizer holds {len(saved_ids)} parameter(s) and the live one "
            f"{len(live)}; a fairseq FP16Optimizer's flat fp32 state is split only when it is "
            f"1-D, in one param group, and its {sum(sizes) if sizes else '?'} elements equal the "
            f"live parameters' {live_total}; {_RESET}")
    out_state: dict = {}
    i = 0
    for pid, size in zip(saved_ids, sizes, strict=True):
        st = flat.get(pid, {})
        end = 0
        while end < size:
            p = live[i]
            n = p.numel()
            if end + n > size:
                raise StateMismatchError(
                    f"{loc}live parameter {i} (shape {list(p.shape)}) straddles two flat fp32 "
                    f"state tensors of the saved FP16Optimizer; {_RESET}")
            entry: dict = {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    entry[k] = v[end:end + n].reshape(p.shape).clone()
                elif isinstance(v, torch.Tensor):
                    entry[k] = v.clone()
                else:
                    entry[k] = v
            out_state[i] = entry
            end += n
            i += 1
    group = {k: v for k, v in saved_groups[0].items() if k != "params"}
    group["params"] = list(range(len(live)))
    return {"state": out_state, "param_groups": [group]}, True


def _adam_to_torch(sd: dict, optimizer: torch.optim.Optimizer, live_group: Mapping, loc: str,
                   where: str) -> dict:
    groups = []
    for gi, g in enumerate(sd["param_groups"]):
        new = dict(live_group)
        for k, v in g.items():
            if k == "params" or k in _ADAM_GROUP_KEYS:
                new[k] = v
            elif k in _ADAM_CHECKED_KEYS:
                ok, what = _ADAM_CHECKED_KEYS[k]
                if not ok(v):
                    raise StateMismatchError(
                        f"{loc}param group {gi} of the saved fairseq Adam has {what}; torch's "
                        f"Adam/AdamW cannot continue it (key {k!r}); {_RESET}")
            elif k in live_group:
                new[k] = v
            else:
                raise StateMismatchError(
                    f"{loc}param group {gi} of the saved fairseq Adam has key {k!r}, which torch's "
                    f"{type(optimizer).__name__} does not know; {_RESET}")
        if isinstance(new.get("betas"), list):
            new["betas"] = tuple(new["betas"])
        if new.get("weight_decay", 0) and type(optimizer).__name__ == "Adam":
            new["decoupled_weight_decay"] = True  # fairseq's Adam is AdamW
        groups.append(new)
    state: dict = {}
    for pid, st in sd["state"].items():
        if not isinstance(st, Mapping):
            state[pid] = st
            continue
        st = dict(st)
        scales = {k: st.pop(k) for k in ("exp_avg_scale", "exp_avg_sq_scale") if k in st}
        for k, scale_key in (("exp_avg", "exp_avg_scale"), ("exp_avg_sq", "exp_avg_sq_scale")):
            if scale_key in scales and isinstance(st.get(k), torch.Tensor):
                st[k] = st[k].float() * float(scales[scale_key])
        for k in st:
            if k not in _ADAM_STATE_KEYS:
                raise StateMismatchError(
                    f"{loc}optimizer state {k!r} of parameter {pid} (fairseq Adam) has no "
                    f"counterpart in torch's {type(optimizer).__name__}; {_RESET}")
        state[pid] = st
    return {"state": state, "param_groups": groups}


def _nag_to_torch(sd: dict, live_group: Mapping, loc: str, where: str) -> dict:
    groups, lr_old_of = [], {}
    for gi, g in enumerate(sd["param_groups"]):
        for k in g:
            if k != "params" and k not in _NAG_GROUP_KEYS and k not in live_group:
                raise StateMismatchError(
                    f"{loc}param group {gi} of the saved fairseq NAG has key {k!r}, which torch's "
                    f"SGD does not know; {_RESET}")
        if g.get("weight_decay", 0):
            raise StateMismatchError(
                f"{loc}param group {gi} of the saved fairseq NAG has weight_decay="
                f"{g['weight_decay']!r}: NAG decays weights decoupled (p *= 1 - lr*wd), torch's "
                f"SGD as an L2 term in the momentum, so the next step would differ (key "
                f"'weight_decay'); {_RESET}")
        lr_old = g.get("lr_old", g.get("lr"))
        if not isinstance(lr_old, (int, float)) or lr_old == 0:
            raise StateMismatchError(
                f"{loc}param group {gi} of the saved fairseq NAG has lr_old={lr_old!r}; its "
                f"momentum buffer (scaled by -lr_old) cannot be brought to torch's units (key "
                f"'lr_old'); {_RESET}")
        new = dict(live_group)
        new.update({k: v for k, v in g.items() if k != "lr_old"})
        new.update(weight_decay=0.0, nesterov=True, dampening=0.0)
        for pid in g.get("params", ()):
            lr_old_of[pid] = float(lr_old)
        groups.append(new)
    state: dict = {}
    for pid, st in sd["state"].items():
        if not isinstance(st, Mapping):
            state[pid] = st
            continue
        extra = sorted(str(k) for k in st if k != "momentum_buffer")
        if extra:
            raise StateMismatchError(
                f"{loc}optimizer state {extra[0]!r} of parameter {pid} (fairseq NAG) has no "
                f"counterpart in torch's SGD; {_RESET}")
        buf = st.get("momentum_buffer")
        new_st = dict(st)
        if isinstance(buf, torch.Tensor) and pid in lr_old_of:
            new_st["momentum_buffer"] = buf / -lr_old_of[pid]
        state[pid] = new_st
    return {"state": state, "param_groups": groups}
