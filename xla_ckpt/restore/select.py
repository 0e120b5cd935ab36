"""Which restore strategy runs, and why (the reason goes into every log line and error)."""

from __future__ import annotations

from xla_ckpt.comm.base import Dist
from xla_ckpt.restore.config import RestoreConfig

ALL_RANKS = "all_ranks"
BROADCAST = "broadcast"


def choose_strategy(dist: Dist, config: RestoreConfig) -> tuple[str, str]:
    """``(strategy, reason)`` for this job; every rank computes the same answer.

    * fairseq ``load_checkpoint_on_all_dp_ranks=True`` -> ``all_ranks``;
    * an explicit ``strategy`` wins;
    * ``auto``: one process -> ``all_ranks``; XLA/TPU -> ``all_ranks``
      (every rank reads storage in parallel; XLA cannot broadcast objects);
      NCCL or gloo -> ``broadcast`` (rank 0 reads, the data plane fans out).
    """
    if config.load_checkpoint_on_all_dp_ranks:
        return ALL_RANKS, "load_checkpoint_on_all_dp_ranks=True (fairseq option)"
    if config.strategy != "auto":
        return config.strategy, f"strategy={config.strategy!r} was requested"
    if dist.world_size == 1:
        return ALL_RANKS, "auto: a single process reads the checkpoint itself"
    if dist.kind == "xla":
        return ALL_RANKS, ("auto: XLA/TPU job, every rank reads from storage in parallel "
                           "(XLA object broadcast is broken, pytorch/xla#5492)")
    return BROADCAST, (f"auto: {dist.backend} job, rank 0 reads and broadcasts in buckets over "
                       f"{dist.backend}")
