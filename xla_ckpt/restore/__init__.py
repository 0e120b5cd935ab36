"""Restore strategies: a checkpoint + a topology -> the same state on every rank (DESIGN "restore").

Public surface:

* :func:`restore` -> :class:`Restored` — every rank calls it; rank 0 decides
  which checkpoint (decide once), then ``all_ranks`` (every rank reads;
  the XLA/TPU default) or ``broadcast`` (rank 0 reads, bucketed broadcast;
  the CUDA/NCCL and gloo default) moves the bytes.  :class:`RestoreConfig`
  holds the knobs (fairseq's ``load_checkpoint_on_all_dp_ranks`` accepted).
* :func:`save_distributed` — every rank writes its own part (replicated state
  from rank 0, ``rank/<r>`` private state, ``shard/<r>`` flat partitions),
  rank 0 commits after all have written.
* Flat sharded tensors (ZeRO optimizer-state sharding, ``zero_sharding="os"``):
  :func:`partition_bounds`; :mod:`xla_ckpt.restore.zero` turns a torch
  optimizer state dict into flat partitions and back.
* :func:`make_saver` — plug it into :class:`xla_ckpt.trainer.Checkpointer` (its restorer
  counterpart is :func:`xla_ckpt.trainer.make_restorer`).
"""

from xla_ckpt.restore.api import restore
from xla_ckpt.restore.config import RestoreConfig
from xla_ckpt.restore.result import Restored, RestoreStats
from xla_ckpt.restore.save import make_saver, save_distributed
from xla_ckpt.restore.select import choose_strategy
from xla_ckpt.restore.sharding import partition_bounds, shard_item

__all__ = ["RestoreConfig", "RestoreStats", "Restored", "choose_strategy", "make_saver",
           "partition_bounds", "restore", "save_distributed", "shard_item"]
