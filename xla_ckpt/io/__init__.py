"""The format engine: the xla_ckpt format over a storage backend (between storage and the rooms
that decide what to read).

Read side: :class:`CheckpointReader` (parallel chunk-aligned ranged reads, crc32c-checked),
:mod:`xla_ckpt.io.chunked` (boxes of chunked tensors), :func:`read_manifest`,
:mod:`xla_ckpt.io.verify`.  Write side: :func:`write_item` + :func:`commit` for several
writers, :func:`write_checkpoint` for one.  What a URI names is :mod:`xla_ckpt.run`'s
business; other kinds of checkpoint are :mod:`xla_ckpt.kinds`'; ``xla_ckpt.load`` /
``xla_ckpt.save`` are :mod:`xla_ckpt.api`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xla_ckpt.io.blob_reader import ReadStats
    from xla_ckpt.io.manifest_file import read_manifest
    from xla_ckpt.io.reader import CheckpointReader
    from xla_ckpt.io.writer import (
        WrittenItem,
        commit,
        discard,
        new_save_id,
        write_checkpoint,
        write_item,
    )

__all__ = ["CheckpointReader", "ReadStats", "WrittenItem", "commit", "discard", "new_save_id",
           "read_manifest", "write_checkpoint", "write_item"]

_LAZY = {"CheckpointReader": "reader", "ReadStats": "blob_reader", "read_manifest": "manifest_file",
         "WrittenItem": "writer", "commit": "writer", "discard": "writer",
         "new_save_id": "writer", "write_checkpoint": "writer", "write_item": "writer"}
"""Public names loaded on first use (PEP 562), so the light parts of this package (names,
the manifest file) import without torch: name -> its module here."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'xla_ckpt.io' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"xla_ckpt.io.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
