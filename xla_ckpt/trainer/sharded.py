"""Sharded models (FSDP2, tensor parallel): model and optimizer state through DCP's state_dict API.

A model is *sharded* when any parameter is a ``DTensor`` (``fully_shard``,
``parallelize_module``; a torch_xla ``XLAShardedTensor`` is one too).  Its state goes through
``torch.distributed.checkpoint.state_dict`` exactly as DCP's own flow does (torchtitan's
checkpointer)::

    msd, osd = get_state_dict(model, optimizer)          # live DTensors, keyed by FQN
    <restore in place into msd / osd>                    # xla_ckpt.restore.restore(into=...)
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)

* save: ``model`` is ``get_model_state_dict(model)`` and ``last_optimizer_state``
  ``get_optimizer_state_dict(model, optimizer)`` (state keyed by parameter FQN, DTensor
  moments, ``param_groups`` naming FQNs); the chunked save writes each rank's shards;
* restore: the same two dicts of the live model and (rebuilt) optimizer are the restore
  targets (:meth:`~xla_ckpt.trainer.restore_state.RestoreState.restore_targets`); each rank
  reads only its shards' byte ranges into them, onto any mesh; then :func:`load_model` /
  :func:`load_optimizer` apply them with ``set_state_dict``.  Values read whole instead (a
  restorer without ``into``, a checkpoint of full tensors) are applied with
  ``full_state_dict=True``, which shards them onto the live placements.

A non-sharded model never comes here: its save and restore are unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from xla_ckpt.errors import ConfigError, StateMismatchError
from xla_ckpt.sharded.views import is_sharded

# Keys a mismatch message lists at most.
_SHOWN_KEYS = 8


def is_sharded_module(module: torch.nn.Module | None) -> bool:
    """True if any parameter of ``module`` is a ``DTensor`` (FSDP2, TP; an XLAShardedTensor
    is one too).  Plain XLA tensors annotated with ``mark_sharding`` do not count: such a
    model keeps the ordinary path (its state is plain tensors to DCP's state_dict API)."""
    return module is not None and any(isinstance(p, DTensor) for p in module.parameters())


def check_optimizer_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           *, where: str = "") -> None:
    """A sharded model's optimizer must hold only the model's parameters (DCP's state_dict API
    names optimizer state by the model's FQNs).

    Raises:
        ConfigError: a parameter of the optimizer is not one of the model's (e.g. a criterion
            with parameters), naming how many.
    """
    own = {id(p) for p in model.parameters()}
    stray = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
    if stray:
        raise ConfigError(f"{where + ': ' if where else ''}the optimizer holds {stray} "
                          "parameter(s) that are not the sharded model's (a criterion with "
                          "parameters?); with a sharded (DTensor) model the optimizer state is "
                          "saved by the model's parameter names, so the optimizer must hold "
                          "only the model's parameters")


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """``get_model_state_dict(model)``: FQN -> live DTensor (or plain tensor, e.g. a buffer)."""
    return get_model_state_dict(model)


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``get_optimizer_state_dict(model, optimizer)`` (initialises an empty optimizer state
    with one zero-lr step, as DCP does, so every moment tensor exists to restore into)."""
    check_optimizer_params(model, optimizer)
    return get_optimizer_state_dict(model, optimizer)


def _is_full(live: Mapping[str, Any], saved: Mapping[str, Any]) -> bool:
    """True when ``saved`` holds plain tensors where the live state holds DTensors."""
    for k, v in live.items():
        if is_sharded(v) and isinstance(saved.get(k), torch.Tensor) and \
                not is_sharded(saved[k]):
            return True
    return False


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN_KEYS])
    return shown + (f" (+{len(keys) - _SHOWN_KEYS} more)" if len(keys) > _SHOWN_KEYS else "")


def load_model(model: torch.nn.Module, saved: Mapping[str, Any], *, where: str) -> None:
    """Apply a saved model state (FQN -> tensor) with ``set_model_state_dict``, strictly.

    Raises:
        StateMismatchError: keys missing from or unexpected in the checkpoint, or a global
            shape that differs (names them), before anything is changed.
    """
    if not isinstance(saved, Mapping):
        raise StateMismatchError(f"{where}: the saved model state is a {type(saved).__name__}, "
                                 "not a state dict")
    live = model_state(model)
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"Missing keys ({len(missing)}): {_listed(missing)}")
        if unexpected:
            parts.append(f"Unexpected keys ({len(unexpected)}): {_listed(unexpected)}")
        raise StateMismatchError(f"{where}: model state does not match the checkpoint: "
                                 + "; ".join(parts))
    for k, v in live.items():
        s = saved[k]
        if isinstance(v, torch.Tensor) and isinstance(s, torch.Tensor) and \
                tuple(s.shape) != tuple(v.shape):
            raise StateMismatchError(f"{where}: model tensor {k} has shape {list(s.shape)} in "
                                     f"the checkpoint, {list(v.shape)} in the live model")
    full = _is_full(live, saved)
    set_model_state_dict(model, dict(saved), options=StateDictOptions(full_state_dict=full))


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   saved: Mapping[str, Any], *, where: str) -> None:
    """Apply a saved optimizer state (``get_optimizer_state_dict`` layout) with
    ``set_optimizer_state_dict``.

    Raises:
        StateMismatchError: not that layout, or its parameters (FQNs) differ from the live
            optimizer's (names them); pass ``reset_optimizer=True`` to keep a fresh optimizer.
    """
    if not isinstance(saved, Mapping) or "state" not in saved or "param_groups" not in saved:
        raise StateMismatchError(f"{where}: the saved optimizer state is not a sharded "
                                 "optimizer state dict (state, param_groups by parameter "
                                 "name); pass reset_optimizer=True")
    live = optimizer_state(model, optimizer)
    live_names = [n for g in live["param_groups"] for n in g["params"]]
    saved_names = [n for g in saved["param_groups"] for n in g.get("params", ())]
    if live_names != saved_names:
        missing = [n for n in live_names if n not in set(saved_names)]
        extra = [n for n in saved_names if n not in set(live_names)]
        detail = "; ".join(p for p in (
            f"live parameters not in the checkpoint: {_listed(missing)}" if missing else "",
            f"checkpoint parameters not in the live optimizer: {_listed(extra)}" if extra
            else "") if p) or "the parameters are in another order or other groups"
        raise StateMismatchError(f"{where}: optimizer parameters do not match the checkpoint "
                                 f"({detail}); pass reset_optimizer=True to restore the weights "
                                 "with a fresh optimizer")
    flat_live = {(n, k): v for n, st in live["state"].items() for k, v in st.items()}
    flat_saved = {(n, k): v for n, st in saved["state"].items() for k, v in st.items()}
    full = _is_full({f"{n}.{k}": v for (n, k), v in flat_live.items()},
                    {f"{n}.{k}": v for (n, k), v in flat_saved.items()})
    osd: dict[str, Any] = {"state": {n: dict(st) for n, st in saved["state"].items()},
                           "param_groups": [dict(g) for g in saved["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, osd,
                             options=StateDictOptions(full_state_dict=full))
