"""Checkpoint I/O: the format over a storage backend (sits between storage and restore).

Read side: :class:`CheckpointReader`, :func:`read_manifest`, :func:`load`.
Write side: :func:`save`, or :func:`write_item` + :func:`commit` for several writers.
"""

from xla_ckpt.io.reader import CheckpointReader, ReadStats, load, read_manifest
from xla_ckpt.io.writer import WrittenItem, commit, discard, new_save_id, save, write_item

__all__ = ["CheckpointReader", "ReadStats", "WrittenItem", "commit", "discard", "load",
           "new_save_id", "read_manifest", "save", "write_item"]
