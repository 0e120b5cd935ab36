"""Which tensors of a state an export writes as its weights, and which of them are tied.

Pure (no I/O), for :mod:`xla_ckpt.kinds.export`: :func:`select_weights` picks the model
weights of a state (``state["model"]``, or a state that is all tensors),
:func:`left_out` names what they leave out, :func:`find_ties` finds tensors whose memory
overlaps (a tied embedding/output weight) and :class:`Tie` records what the export did
about each.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from xla_ckpt.errors import ConfigError


@dataclass(frozen=True)
class Tie:
    """Two names of overlapping tensor memory, and what the export did about it.

    Attributes:
        name: the later name (state order).
        kept: the earlier name it overlaps.
        action: ``"kept"`` (one storage in the output: pt), ``"dropped"`` (not written;
            the same view, ``torch.equal`` checked; safetensors), ``"copied"`` (written as
            its own tensor: an overlapping but different view, or a format without
            aliasing).
    """

    name: str
    kept: str
    action: str

    def describe(self) -> str:
        what = {"kept": "kept tied to", "dropped": "dropped, tied to",
                "copied": "written as its own copy of memory shared with"}[self.action]
        return f"{self.name}: {what} {self.kept}"



def walk_state(obj: Any, path: str, out: list[tuple[str, Any]], depth: int = 0) -> None:
    """``(dotted path, leaf)`` of every tensor and non-plain leaf under ``obj``."""
    if depth > 100:
        raise ConfigError(f"{path or '<state>'}: state nested more than 100 levels deep")
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            walk_state(v, f"{path}.{k}" if path else str(k), out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            walk_state(v, f"{path}.{i}" if path else str(i), out, depth + 1)
    elif isinstance(obj, argparse.Namespace):
        out.append((path, obj))
        walk_state(vars(obj), path, out, depth + 1)
    elif isinstance(obj, (np.generic, np.ndarray, np.dtype)):
        out.append((path, obj))


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Byte range ``[start, end)`` of ``t``'s elements in memory (by data pointer)."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.device == b.device)


def find_ties(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, str, bool]]:
    """``(name, earlier name, same view)`` for each tensor whose memory overlaps an earlier one's.

    "Same view" (same data pointer, dtype, shape and strides) is a tie such as an
    embedding shared with the output projection; anything else that overlaps is a view
    of another tensor.  Tensors on different storages never overlap.  O(n log n).
    """
    spans = []
    for name, t in tensors.items():
        if t.numel() and t.device.type != "meta":
            start, end = _span(t)
            spans.append((start, end, name))
    order = {name: i for i, name in enumerate(tensors)}
    spans.sort()
    out = []
    open_: list[tuple[int, int, str]] = []  # spans that may still overlap the next ones
    for start, end, name in spans:
        open_ = [s for s in open_ if s[1] > start]
        for _, _, other in open_:
            first, later = sorted((other, name), key=order.__getitem__)
            out.append((later, first, _same_view(tensors[first], tensors[later])))
        open_.append((start, end, name))
    # One entry per later name: the earliest name it overlaps.
    best: dict[str, tuple[str, str, bool]] = {}
    for later, first, same in out:
        if later not in best or order[first] < order[best[later][1]]:
            best[later] = (later, first, same)
    return sorted(best.values(), key=lambda e: order[e[0]])


# ---- choosing the weights ---------------------------------------------------------------------

def select_weights(state: Any, key: str = "auto") -> dict[str, torch.Tensor]:
    """The flat ``{name: tensor}`` model weights of ``state``, for safetensors.

    Args:
        key: ``"auto"``: ``state`` itself when every value is a tensor, else
            ``state["model"]`` (fairseq and trainer layouts), else the keys of a flat DCP
            state under ``model.`` (prefix removed).  Any other string: ``state[key]``, or
            the flat keys under ``key + "."``.  ``""``: the whole state.  Nested dicts
            below the choice are flattened with ``.``.

    Raises:
        ConfigError: nothing matches ``key`` (lists the top-level keys), or a value is
            not a tensor (names it: safetensors holds tensors only; pass another ``key``).
    """
    if not isinstance(state, Mapping):
        raise ConfigError(f"the state is a {type(state).__name__}, not a dict of tensors; "
                          "safetensors holds a flat dict of tensors")
    chosen: Any
    if key == "auto":
        if state and all(isinstance(v, torch.Tensor) for v in state.values()):
            chosen, where = state, "the state"
        else:
            chosen, where = _under(state, "model"), "state['model']"
            if chosen is None:
                raise ConfigError(
                    "cannot tell which part of the state is the model weights: it is not all "
                    "tensors and has no 'model' entry (top-level keys: "
                    f"{_keys(state)}); pass --key NAME")
    elif key == "":
        chosen, where = state, "the state"
    else:
        chosen, where = _under(state, key), f"state[{key!r}]"
        if chosen is None:
            raise ConfigError(f"the state has no {key!r} entry (top-level keys: "
                              f"{_keys(state)}); pass another --key")
    leaves: list[tuple[str, Any]] = []
    _walk_plain(chosen, "", leaves)
    weights: dict[str, torch.Tensor] = {}
    for name, v in leaves:
        if not isinstance(v, torch.Tensor):
            raise ConfigError(f"{where}: {name!r} is a {type(v).__name__}, not a tensor; "
                              "safetensors holds tensors only: pass --key to choose the "
                              "weights (e.g. --key model)")
        weights[name] = v
    if not weights:
        raise ConfigError(f"{where} holds no tensors")
    return weights


def left_out(state: Any, key: str = "auto") -> list[str]:
    """Top-level entries of ``state`` that :func:`select_weights` with ``key`` does not
    export (``["optimizer", "extra_state"]`` for a trainer state and ``key="auto"``)."""
    if not isinstance(state, Mapping):
        return []
    if key == "auto":
        if state and all(isinstance(v, torch.Tensor) for v in state.values()):
            return []
        key = "model"
    if key == "":
        return []
    return [str(k) for k in state if k != key and not str(k).startswith(key + ".")]


def _under(state: Mapping, key: str) -> Any:
    if key in state and isinstance(state[key], Mapping):
        return state[key]
    prefix = key + "."
    flat = {k[len(prefix):]: v for k, v in state.items()
            if isinstance(k, str) and k.startswith(prefix)}
    return flat or None


def _keys(state: Mapping) -> str:
    names = [str(k) for k in state]
    return ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")


def _walk_plain(obj: Any, path: str, out: list[tuple[str, Any]]) -> None:
    if isinstance(obj, Mapping) and not isinstance(obj, torch.Tensor):
        for k, v in obj.items():
            _walk_plain(v, f"{path}.{k}" if path else str(k), out)
    else:
        out.append((path, obj))

