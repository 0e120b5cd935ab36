"""Checkpoint I/O: the format over a storage backend (sits between storage and restore).

Read side: :func:`resolve` (what a URI names: checkpoint folder, run folder -> latest
committed, pointer, legacy file, HF safetensors index, DCP folder; the one rule for "nothing
committed"), :func:`load` (every kind), :class:`CheckpointReader`, :func:`read_manifest`.
Other formats: :mod:`xla_ckpt.io.export` (``.pt``, HF safetensors, DCP out),
:mod:`xla_ckpt.io.hf` (sharded safetensors in), :mod:`xla_ckpt.io.legacy` (``.pt`` files and
whole fairseq run folders in).
Write side: :func:`save`, or :func:`write_item` + :func:`commit` for several writers.
"""

from xla_ckpt.io.opener import load, read_checkpoint
from xla_ckpt.io.reader import CheckpointReader, ReadStats, read_manifest
from xla_ckpt.io.resolve import Resolved, resolve
from xla_ckpt.io.writer import WrittenItem, commit, discard, new_save_id, save, write_item

__all__ = ["CheckpointReader", "ReadStats", "Resolved", "WrittenItem", "commit", "discard",
           "load", "new_save_id", "read_checkpoint", "read_manifest", "resolve", "save",
           "write_item"]
