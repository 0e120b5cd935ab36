"""xla_ckpt: restore and save the complete training state of PyTorch jobs on TPU, GKE and CUDA.

Quick use::

    import xla_ckpt
    xla_ckpt.save(state, "gs://bucket/run/checkpoint_100")   # atomic, pickle-free
    state = xla_ckpt.load("gs://bucket/run/checkpoint_100")  # parallel ranged reads, crc32c

``import xla_ckpt`` does not import torch: :func:`load` and :func:`save` (from
:mod:`xla_ckpt.api`) are loaded on first use, so tools that only need the package's light parts
(``xla-ckpt --help``) start fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xla_ckpt.api import load, save

__version__ = "0.1.0"
__all__ = ["load", "save", "__version__"]

_LAZY = {"load": "xla_ckpt.api", "save": "xla_ckpt.api"}
"""Public names loaded on first access (PEP 562): name -> the module that defines it."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'xla_ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
