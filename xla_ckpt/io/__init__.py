"""Checkpoint I/O: the format over a storage backend (sits between storage and restore).

Read side: :func:`resolve` (what a URI names: checkpoint folder, run folder -> latest
committed, pointer, legacy file, HF safetensors index, DCP folder; the one rule for "nothing
committed"), :func:`load` (every kind), :class:`CheckpointReader`, :func:`read_manifest`.
Other formats: :mod:`xla_ckpt.io.export` (``.pt``, HF safetensors, DCP out),
:mod:`xla_ckpt.io.hf` (sharded safetensors in), :mod:`xla_ckpt.io.legacy` (``.pt`` files and
whole fairseq run folders in).
Write side: :func:`save`, or :func:`write_item` + :func:`commit` for several writers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Eager (and torch-free): the function ``resolve`` must stay this package's attribute, which
# the submodule of the same name would otherwise replace once imported.
from xla_ckpt.io.resolve import Resolved, resolve

if TYPE_CHECKING:
    from xla_ckpt.io.manifest_file import read_manifest
    from xla_ckpt.io.opener import load, read_checkpoint
    from xla_ckpt.io.reader import CheckpointReader, ReadStats
    from xla_ckpt.io.writer import WrittenItem, commit, discard, new_save_id, save, write_item

__all__ = ["CheckpointReader", "ReadStats", "Resolved", "WrittenItem", "commit", "discard",
           "load", "new_save_id", "read_checkpoint", "read_manifest", "resolve", "save",
           "write_item"]

_LAZY = {"load": "opener", "read_checkpoint": "opener", "CheckpointReader": "reader",
         "ReadStats": "reader", "read_manifest": "manifest_file", "WrittenItem": "writer",
         "commit": "writer", "discard": "writer", "new_save_id": "writer", "save": "writer",
         "write_item": "writer"}
"""Public names loaded on first use (PEP 562), so the light parts of this package (the run
folder catalog, names, retention) import without torch: name -> its module here."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'xla_ckpt.io' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"xla_ckpt.io.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
