"""The description of what one rank holds of a global tensor: boxes, each with its tensor.

:mod:`xla_ckpt.sharded.views` (DTensor, plain) and :mod:`xla_ckpt.sharded.spmd` (torch_xla SPMD)
build these; save-by-owner and restore-by-byte-range consume them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from xla_ckpt.format.chunks import Box


@dataclass
class LocalShard:
    """One box of a global tensor held by this process.

    For a save, ``tensor`` is a readable tensor of shape ``box.sizes`` (this process's copy;
    any device, the writer moves it to host).  For a restore it is the CPU destination of
    shape ``box.sizes``: the live memory itself when possible (a CPU DTensor's local
    tensor), else a staging tensor that :attr:`ShardedValue.finish` copies into place.
    ``replica_id``: which copy this is among processes/devices holding the same box (0 for
    the first), informational.
    """

    box: Box
    tensor: torch.Tensor
    replica_id: int = 0


@dataclass
class ShardedValue:
    """What one value of a state tree holds of its global tensor on this rank.

    Attributes:
        global_shape: shape of the global tensor (elements).
        dtype: its dtype.
        shards: this rank's boxes (none when its shard is empty).
        kind: ``"plain"``, ``"dtensor"`` or ``"xla"``.
        placement: human-readable placement (``"Shard(0) on mesh (4,)"``, ``"replicated"``),
            compared across ranks by the structure agreement and kept in the manifest.
        replicated: every rank holds the whole tensor (a plain tensor, or all ``Replicate()``).
        finish: for a restore, called once every shard's ``tensor`` is filled (copies staged
            values into the live tensor, or ``load_local_shards_`` on XLA); ``None`` when the
            shards are the live memory.
    """

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    shards: list[LocalShard]
    kind: str
    placement: str
    replicated: bool
    finish: Callable[[], None] | None = field(default=None)

    @property
    def local_nbytes(self) -> int:
        return sum(s.box.numel for s in self.shards) * self.dtype.itemsize
