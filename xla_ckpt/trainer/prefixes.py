"""Wrapper prefixes in state_dict keys (CASES C3).

``DistributedDataParallel``/``DataParallel`` save their model's keys as
``module.<key>``; ``torch.compile`` saves ``_orig_mod.<key>``; a compiled DDP
model carries both, in either order.  Strict loading of such a state into the
bare model fails on every key.

:func:`best_prefix_strip` finds the sequence of wrapper prefixes whose removal
makes the saved keys match the live model's keys best.  A prefix is only ever
removed when *every* key carries it, and only when removing it increases the
number of keys that match, so a model whose genuine child is named ``module``
(keys ``module.weight``) is never touched.  The result is a pure function of
the two key sets: every rank computes the same answer.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Collection, Mapping

import torch

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
MAX_WRAPPER_DEPTH = 4

_WRAPPER_OF = {"module.": "DistributedDataParallel/DataParallel", "_orig_mod.": "torch.compile"}


def best_prefix_strip(saved_keys: Collection[str], model_keys: Collection[str],
                      prefixes: tuple[str, ...] = WRAPPER_PREFIXES) -> tuple[str, ...]:
    """The wrapper prefixes (outermost first) to strip from ``saved_keys``; ``()`` for none.

    Tries every sequence of up to :data:`MAX_WRAPPER_DEPTH` prefixes that all
    saved keys carry, and returns the one that makes the most keys match
    ``model_keys`` (the shortest on ties), if it beats stripping nothing.
    """
    target = set(model_keys)
    keys = list(saved_keys)
    best: tuple[tuple[str, ...], int] = ((), len(target.intersection(keys)))
    frontier: list[tuple[tuple[str, ...], list[str]]] = [((), keys)]
    for _ in range(MAX_WRAPPER_DEPTH):
        nxt = []
        for seq, ks in frontier:
            for p in prefixes:
                if ks and all(k.startswith(p) for k in ks):
                    stripped = [k[len(p):] for k in ks]
                    score = len(target.intersection(stripped))
                    if score > best[1]:
                        best = (seq + (p,), score)
                    nxt.append((seq + (p,), stripped))
        frontier = nxt
        if not frontier:
            break
    return best[0]


def strip_key(key: str, strip: tuple[str, ...]) -> str:
    for p in strip:
        key = key[len(p):] if key.startswith(p) else key
    return key


def strip_state_dict(state_dict: Mapping[str, Any],
                     strip: tuple[str, ...]) -> "OrderedDict[str, Any]":
    """A copy of ``state_dict`` with the prefixes ``strip`` removed from keys and ``_metadata``."""
    out: "OrderedDict[str, Any]" = OrderedDict((strip_key(k, strip), v)
                                               for k, v in state_dict.items())
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        new_meta = OrderedDict()
        for k, v in meta.items():
            # metadata keys are module paths without the trailing dot ("module", "module.fc").
            s = strip_key(k + "." if k else k, strip)
            new_meta[s[:-1] if s.endswith(".") else s] = v
        out._metadata = new_meta  # type: ignore[attr-defined]  # torch's state_dict field
    return out


def describe_prefix_hint(saved_keys: Collection[str], model_keys: Collection[str]) -> str:
    """One sentence saying how a wrapper prefix explains a key mismatch, or ``""``."""
    strip = best_prefix_strip(saved_keys, model_keys)
    if strip:
        names = " then ".join(f"{p!r} ({_WRAPPER_OF.get(p, 'a wrapper')})" for p in strip)
        return (f"The checkpoint's keys carry the wrapper prefix {names}; pass "
                "strip_prefixes=True to remove it, or save the unwrapped model.")
    extra = best_prefix_strip(model_keys, saved_keys)
    if extra:
        names = " then ".join(repr(p) for p in extra)
        return (f"The live model's keys carry the wrapper prefix {names}; load into the "
                "unwrapped model (model.module / model._orig_mod).")
    return ""


def unwrap_module(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP/DataParallel/FSDP-less wrappers and ``torch.compile`` (by type).

    Unwrapping goes by wrapper *type*, never by attribute name, so a model
    whose own child is called ``module`` is returned as it is.
    """
    while True:
        if isinstance(module, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
            module = module.module
            continue
        orig = getattr(module, "_orig_mod", None)
        if isinstance(orig, torch.nn.Module) and type(module).__name__ == "OptimizedModule":
            module = orig
            continue
        return module
