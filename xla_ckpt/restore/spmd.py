"""torch_xla SPMD (``XLAShardedTensor``): local device shards as boxes, for save and restore.

Owned by the SPMD work of issue 12; see :mod:`xla_ckpt.restore.views` for the contract.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from xla_ckpt.restore.views import ShardedValue


def for_save(value: Any, *, owned_devices: Sequence[int] | None = None) -> ShardedValue:
    """This process's device shards of ``value`` (one box per distinct ``indices``)."""
    raise NotImplementedError("torch_xla SPMD save is not built yet")


def for_restore(value: Any) -> ShardedValue:
    """CPU staging boxes for every local device shard; ``finish`` loads them in place."""
    raise NotImplementedError("torch_xla SPMD restore is not built yet")
