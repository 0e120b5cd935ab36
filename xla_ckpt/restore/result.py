"""What a restore hands back on each rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from xla_ckpt.format.manifest import Manifest


@dataclass
class RestoreStats:
    """Figures of one restore on this rank.

    Attributes:
        bytes_read: bytes this rank fetched from storage.
        bytes_received: tensor bytes this rank received over the data plane.
        bytes_sent: tensor bytes this rank sent point to point (rank 0, ZeRO scatter).
        bytes_mapped: tensor bytes this rank mapped from its host leader's
            shared memory instead of receiving them (broadcast strategy).
        seconds: wall time of the whole restore on this rank.
        read_seconds: wall time of this rank's storage reads.
        data_path: how the tensor bytes reached the ranks (broadcast strategy:
            host shared memory or the collective, and why); ``""`` for all_ranks.
        plan: the read plan that ran (``all_ranks``, ``per_host``, ``broadcast`` or
            ``striped``; :mod:`xla_ckpt.restore.cost`).
        predicted_s: the cost model's predicted seconds for ``plan`` on this job
            (compare with ``seconds``, the measured wall time).
        predictions: predicted seconds of every plan (what ``auto`` chose from).
        shard_bytes: restores into live targets (``restore(into=...)``): bytes of the
            boxes this rank fills (its own shards of every target, plus the saved tensors
            ``into`` lacks, whole); what ``bytes_read`` is compared with.  0 otherwise.
    """

    bytes_read: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    bytes_mapped: int = 0
    seconds: float = 0.0
    read_seconds: float = 0.0
    data_path: str = ""
    shard_bytes: int = 0
    plan: str = ""
    predicted_s: float = 0.0
    predictions: dict[str, float] = field(default_factory=dict)


@dataclass
class Loaded:
    """What a strategy produced on one rank (internal; :class:`Restored` is the public face).

    The strategy fills ``stats`` as it goes (every field but ``seconds``, which
    :func:`~xla_ckpt.restore.restore` sets once the whole restore is done); the
    same object becomes :attr:`Restored.stats`, so no figure is copied by hand.
    """

    state: Any
    rank_state: Any = None
    shards: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: RestoreStats = field(default_factory=RestoreStats)


@dataclass
class Restored:
    """The restored training state on this rank.

    Attributes:
        state: the replicated state (the ``"state"`` item), tensors on CPU or
            on ``map_location``, with saved dtypes, shapes and aliasing.
        rank_state: this rank's own ``rank/<rank>`` item (iterator position,
            RNG state...), never another rank's; None if the checkpoint has none.
        shards: this rank's part of every flat sharded tensor (ZeRO optimizer
            state): its partition with ``zero_sharding="os"``, the whole
            tensor with ``"none"``; 1-D, saved dtype.
        shard_bounds: key -> element range ``[lo, hi)`` of ``shards[key]`` in
            the flat tensor.
        shard_numel: key -> number of elements of the whole flat tensor.
        checkpoint: URI of the checkpoint restored (the one rank 0 decided on).
        manifest: its manifest.
        metadata: the typed-decoded metadata summary the saver passed.
        strategy: the plan that ran: ``"all_ranks"``, ``"per_host"``, ``"broadcast"`` or
            ``"striped"`` (``stats.plan``).
        reason: why that strategy ran.
        stats: :class:`RestoreStats` of this rank.
    """

    state: Any
    rank_state: Any
    shards: dict[str, torch.Tensor]
    shard_bounds: dict[str, tuple[int, int]]
    shard_numel: dict[str, int]
    checkpoint: str
    manifest: Manifest
    metadata: Any
    strategy: str
    reason: str
    stats: RestoreStats
