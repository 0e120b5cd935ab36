"""Load optimizer state onto the live parameters (CASES C5, C10).

``torch.optim.Optimizer.load_state_dict`` maps the saved state onto the
optimizer's *current* parameters by position and moves each state tensor to
its parameter's device, but it also casts every floating state tensor to the
parameter's dtype, so fp32 Adam moments kept for fp16 parameters silently
become fp16.  :func:`load_optimizer_state` wraps it:

* the optimizer must hold the module's live parameters (an optimizer built
  before ``model.to(xla_device)`` holds stale CPU copies; refused);
* the saved param groups must match in number and size, every saved state key
  must be a parameter id some saved param group lists (torch would keep a stray
  key such as DCP's stringified ``'0'`` as dead state and the parameter would
  restart from zero moments: a silent loss, refused; an optimizer outside
  ``torch.optim`` may keep entries of its own under non-id keys), and per-parameter
  state must fit its parameter's shape (a model whose parameters changed
  order would otherwise fail at the first step with a cryptic error); otherwise
  :class:`~xla_ckpt.errors.StateMismatchError` suggesting ``reset_optimizer``;
* state tensors keep their saved dtype and bits, except for parameters
  whose own dtype was cast on load (their state follows the parameter,
  as torch does);
* every state tensor with its parameter's shape ends on the parameter's
  device; scalar ``step`` stays where torch keeps it (CPU unless the
  optimizer is ``capturable``/``fused``), exactly as in an uninterrupted run;
* ``optimizer_overrides`` replace param-group values (fairseq
  ``FairseqOptimizer.load_state_dict``).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

import torch

from xla_ckpt.errors import StateMismatchError
from xla_ckpt.format.manifest import TensorRecord

logger = logging.getLogger(__name__)


def check_live_params(optimizer: torch.optim.Optimizer, live_params: Iterable[torch.Tensor], *,
                      where: str = "") -> None:
    """Raise StateMismatchError if ``optimizer`` holds a tensor that is not a live parameter."""
    live = {id(p) for p in live_params}
    stale = [(gi, pi) for gi, g in enumerate(optimizer.param_groups)
             for pi, p in enumerate(g["params"]) if id(p) not in live]
    if stale:
        loc = f"{where}: " if where else ""
        raise StateMismatchError(
            f"{loc}the optimizer holds {len(stale)} tensor(s) that are not the model's live "
            f"parameters (first: param group {stale[0][0]}, index {stale[0][1]}); it was probably "
            "built before the model moved to its device (moving to an XLA device replaces the "
            "parameter objects). Build the optimizer after model.to(device), or pass "
            "build_optimizer so the restore rebuilds it.")


def _fits(state: tuple[int, ...], param: tuple[int, ...], builtin: bool) -> bool:
    """Whether a per-parameter state tensor of shape ``state`` can belong to a parameter of
    shape ``param``.

    Same number of dimensions: each dimension equals the parameter's or is 1
    (factored state such as Adafactor's row/column variance).  Another number
    of dimensions: only 0-d, or any shape for optimizers outside
    ``torch.optim`` (their state layout is unknown).
    """
    if len(state) == len(param):
        return all(s == d or s == 1 for s, d in zip(state, param, strict=True))
    return len(state) == 0 or not builtin


def _param_list(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _id_like(key: Any) -> bool:
    return (isinstance(key, int) and not isinstance(key, bool)) or \
        (isinstance(key, str) and key.isdigit())


def check_saved_state_keys(saved_state: Mapping[Any, Any], saved_ids: list[Any], loc: str,
                           suggestion: str, *, builtin: bool = True) -> None:
    """Raise StateMismatchError naming the saved ``state`` keys that no saved param group lists.

    ``Optimizer.load_state_dict`` keeps such a key as a dead entry, so the parameter it was
    meant for restarts from empty state: a silent loss.  For an optimizer outside
    ``torch.optim`` (``builtin=False``), whose ``state`` may hold entries of its own under
    other keys (torch keeps non-tensor keys of ``optimizer.state`` as they are), only
    parameter-id-like keys (ints, decimal strings) are refused.  ``loc`` prefixes the
    message (the checkpoint), ``suggestion`` ends it.
    """
    listed = set(saved_ids)
    stray = [k for k in saved_state if k not in listed and (builtin or _id_like(k))]
    if not stray:
        return
    shown = ", ".join(repr(k) for k in stray[:8]) + (", ..." if len(stray) > 8 else "")
    hint = ""
    if any(isinstance(k, str) and k.isdigit() and int(k) in listed for k in stray):
        hint = (" The keys are parameter ids written as strings (DCP and JSON flattening "
                "stringify int keys); convert them back with "
                "{int(k): v for k, v in state_dict['state'].items()} or read the checkpoint "
                "with xla_ckpt.load, which restores them.")
    raise StateMismatchError(
        f"{loc}the saved optimizer state holds {len(stray)} key(s) that no saved param group "
        f"lists ({shown}; the param groups list {_ids_text(saved_ids)}); their state "
        f"would be silently dropped.{hint} Otherwise {suggestion}")


def _ids_text(ids: list[Any]) -> str:
    shown = ", ".join(repr(i) for i in ids[:8])
    return f"[{shown}{', ...' if len(ids) > 8 else ''}]"


class _IndexedIds(list[Any]):
    """A saved param group's ``params`` whose ``in`` is a set lookup (same answers).

    ``Optimizer.load_state_dict`` asks ``param_id in group["params"]`` of the saved groups
    once per state tensor; over plain lists that is quadratic in the number of parameters
    (5.4 s of a 20,000-parameter AdamW restore, CASES C26).
    """

    def __init__(self, ids: list[Any]) -> None:
        super().__init__(ids)
        self.id_set = frozenset(ids)

    def __contains__(self, x: object) -> bool:
        try:
            return x in self.id_set
        except TypeError:  # an unhashable value asked about: compare as a list does
            return list.__contains__(self, x)


def _indexed_groups(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow copy of ``state_dict``, its param groups listing ids as :class:`_IndexedIds`."""
    out = dict(state_dict)
    groups = []
    for g in state_dict["param_groups"]:
        ids = g.get("params") if isinstance(g, Mapping) else None
        try:
            groups.append({**g, "params": _IndexedIds(ids)} if isinstance(ids, list) else g)
        except TypeError:  # unhashable ids: keep the list as it is
            groups.append(g)
    out["param_groups"] = groups
    return out


SUGGESTION = ("pass reset_optimizer=True to start the optimizer afresh (the model weights are "
              "still restored)")


def check_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: Any, *,
                          where: str = "") -> None:
    """Every check of :func:`load_optimizer_state`, with nothing loaded.

    ``state_dict`` may hold tensors or their manifest :class:`TensorRecord`s (the trainer
    checks a checkpoint's records before any byte is read).  ``optimizer`` only gives the
    live structure (class, param groups, parameter shapes): a probe built like the live one
    serves.

    Raises:
        StateMismatchError: not an ``optimizer.state_dict()``; another number of param
            groups or of parameters in a group; a saved state key no saved group lists; a
            state tensor that does not fit its parameter's shape.  Names the checkpoint and
            suggests ``reset_optimizer=True``.
    """
    loc = f"{where}: " if where else ""
    suggestion = SUGGESTION
    saved_groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    saved_state = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    if not isinstance(saved_groups, list) or not isinstance(saved_state, Mapping) or \
            not all(isinstance(g, Mapping) and isinstance(g.get("params"), list)
                    for g in saved_groups):
        raise StateMismatchError(f"{loc}the saved optimizer state is not an optimizer.state_dict() "
                                 f"(needs 'state' and 'param_groups'); {suggestion}")
    live_groups = optimizer.param_groups
    if len(saved_groups) != len(live_groups):
        raise StateMismatchError(
            f"{loc}the saved optimizer has {len(saved_groups)} param group(s), the live one "
            f"{len(live_groups)}; {suggestion}")
    for i, (sg, lg) in enumerate(zip(saved_groups, live_groups, strict=True)):
        if len(sg["params"]) != len(lg["params"]):
            raise StateMismatchError(
                f"{loc}param group {i} holds {len(sg['params'])} parameters in the checkpoint and "
                f"{len(lg['params'])} in the live optimizer; {suggestion}")

    saved_ids = [pid for g in saved_groups for pid in g["params"]]
    builtin = type(optimizer).__module__.startswith("torch.optim")
    check_saved_state_keys(saved_state, saved_ids, loc, suggestion, builtin=builtin)

    by_id = dict(zip(saved_ids, _param_list(optimizer), strict=True))
    for pid, st in saved_state.items():
        p = by_id.get(pid)
        if p is None or not isinstance(st, Mapping):
            continue
        p_shape: tuple[int, ...] | None = None
        for name, v in st.items():
            if name == "step" or not isinstance(v, (torch.Tensor, TensorRecord)):
                continue
            shape = tuple(v.shape)
            if p_shape is None:
                p_shape = tuple(p.shape)
            if shape != p_shape and not _fits(shape, p_shape, builtin):
                raise StateMismatchError(
                    f"{loc}optimizer state {name!r} of parameter {pid} has shape {list(shape)} "
                    f"but the live parameter has shape {list(p.shape)}; the model's parameters "
                    f"changed or are in another order; {suggestion}")


def check_param_group_keys(optimizer: torch.optim.Optimizer, state_dict: Any, *,
                           where: str = "") -> None:
    """Refuse a saved optimizer state whose param groups hold keys the live class's lack.

    For a state saved without its optimizer's class name (a plain ``torch.save`` dict such
    as MAE's ``{"model", "optimizer", "epoch", "args"}``), the param-group hyperparameters
    are the class's signature: AdamW's ``betas``/``eps``/``amsgrad`` are no SGD's, SGD's
    ``momentum``/``nesterov`` no Adam's.  A key the live groups lack means another class
    (keys the saved groups lack are torch-version additions, which torch fills on load).
    torch's ``Adam`` and ``AdamW`` share their keys and differ by
    ``decoupled_weight_decay``, which must then agree too.

    Raises:
        StateMismatchError: names the keys, the live class and what to pass.
    """
    loc = f"{where}: " if where else ""
    saved_groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    if not isinstance(saved_groups, list):
        return  # check_optimizer_state names the malformed state
    live = optimizer.param_groups[0] if optimizer.param_groups else {}
    name = type(optimizer).__name__
    for gi, g in enumerate(saved_groups):
        if not isinstance(g, Mapping):
            continue
        extra = sorted(str(k) for k in g if k != "params" and k not in live)
        if extra:
            raise StateMismatchError(
                f"{loc}the saved optimizer state names no optimizer class, and its param group "
                f"{gi} holds {', '.join(extra)}, which the live torch.optim.{name}'s groups "
                f"lack: it was saved from another optimizer class. Build the class it was saved "
                f"from, or {SUGGESTION}")
        dwd = "decoupled_weight_decay"
        if dwd in g and dwd in live and bool(g[dwd]) != bool(live[dwd]):
            saved_cls = "AdamW" if g[dwd] else "Adam"
            raise StateMismatchError(
                f"{loc}the saved optimizer state names no optimizer class, and its param group "
                f"{gi} has {dwd}={g[dwd]!r} (torch.optim.{saved_cls}) where the live "
                f"torch.optim.{name} has {live[dwd]!r}. Build torch.optim.{saved_cls}, or "
                f"{SUGGESTION}")


def load_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any], *,
                         overrides: Mapping[str, Any] | None = None,
                         saved_param_dtypes: Mapping[int, torch.dtype] | None = None,
                         where: str = "", checked: bool = False) -> None:
    """Load ``state_dict`` (an ``optimizer.state_dict()``) into ``optimizer``.

    Args:
        optimizer: built over the live parameters, already on their devices.
        state_dict: ``{"state": {int: {name: tensor | value}}, "param_groups": [...]}``
            with CPU tensors.
        overrides: param-group values to replace after loading (e.g. ``{"lr": 1e-4}``).
        saved_param_dtypes: ``id(live param) -> dtype the parameter was saved
            with``; state of a parameter whose dtype changed on load follows
            the parameter's new dtype. Missing entries count as unchanged.
        where: checkpoint URI for messages.
        checked: :func:`check_optimizer_state` already passed on this very ``optimizer`` and
            ``state_dict`` (the trainer checks before anything is loaded): not done again.

    Raises:
        StateMismatchError: group count/size or state shape mismatch, or a
            saved state key that no saved param group lists (names the keys and
            the checkpoint); the message suggests ``reset_optimizer=True``.
    """
    if not checked:
        check_optimizer_state(optimizer, state_dict, where=where)
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    saved_ids = [pid for g in saved_groups for pid in g["params"]]
    params = _param_list(optimizer)
    by_id = dict(zip(saved_ids, params, strict=True))
    # torch casts each floating state tensor to its parameter's dtype and moves it to the
    # parameter's device; what it changed is undone below.  Without load hooks, and with
    # every saved state tensor (but ``step``) already in its parameter's dtype, it changed
    # no dtype and left none off its parameter's device: nothing to undo, nothing to note.
    plain = not _load_hooks(optimizer) and all(
        p is None or not isinstance(st, Mapping) or all(
            name == "step" or not isinstance(v, torch.Tensor) or v.dtype == p.dtype
            for name, v in st.items())
        for p, st in ((by_id.get(pid), st) for pid, st in saved_state.items()))
    saved_dtypes: dict[tuple[int, str], torch.dtype] = {}
    if not plain:
        for pid, st in saved_state.items():
            p = by_id.get(pid)
            if p is None or not isinstance(st, Mapping):
                continue
            key = id(p)
            for name, v in st.items():
                if name != "step" and isinstance(v, torch.Tensor):
                    saved_dtypes[(key, name)] = v.dtype

    optimizer.load_state_dict(_indexed_groups(state_dict))

    if not plain:
        _undo_casts(optimizer, params, saved_ids, saved_state, saved_dtypes,
                    saved_param_dtypes or {})

    if overrides:
        for group in optimizer.param_groups:
            group.update(overrides)


def _load_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.load_state_dict`` may do more than torch's own (hooks, an override)."""
    return (type(optimizer).load_state_dict is not torch.optim.Optimizer.load_state_dict
            or bool(getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", True))
            or bool(getattr(optimizer, "_optimizer_load_state_dict_post_hooks", True)))


def _undo_casts(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                saved_ids: list[Any], saved_state: Mapping[Any, Any],
                saved_dtypes: Mapping[tuple[int, str], torch.dtype],
                changed: Mapping[int, torch.dtype]) -> None:
    """After ``optimizer.load_state_dict``: state tensors torch cast to their parameter's
    dtype get their saved bits back (unless the parameter itself was cast on load), and
    those of the parameter's shape end on its device."""
    pid_of = {id(p): pid for pid, p in zip(saved_ids, params, strict=True)}
    live_state = optimizer.state
    for p in params:
        st = live_state.get(p)
        if not st:
            continue
        key, device = id(p), p.device
        param_cast = key in changed and changed[key] != p.dtype
        for name, v in list(st.items()):
            if not isinstance(v, torch.Tensor):
                continue
            want = saved_dtypes.get((key, name))
            if want is not None and v.dtype != want and not param_cast:
                # torch cast it to the parameter dtype; give back the saved bits.
                src = saved_state[pid_of[key]][name]
                st[name] = v = src.to(device=v.device, copy=True)
            if name != "step" and v.device != device and tuple(v.shape) == tuple(p.shape):
                st[name] = v.to(device)
