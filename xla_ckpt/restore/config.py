"""Restore knobs (one dataclass, validated; fairseq names accepted)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from xla_ckpt.comm.buckets import DEFAULT_BUCKET_SIZE_BYTES
from xla_ckpt.errors import ConfigError
from xla_ckpt.restore.cost import Bandwidths

STRATEGIES = ("auto", "all_ranks", "per_host", "broadcast", "striped")
ZERO_SHARDING = ("none", "os")
RANK_STATE_ON_RESIZE = ("error", "drop")


@dataclass(kw_only=True)
class RestoreConfig:
    """How :func:`xla_ckpt.restore.restore` moves a checkpoint onto every rank.

    Attributes:
        strategy: the read plan (:mod:`xla_ckpt.restore.cost` describes each):

            * ``"auto"`` (default): the plan with the lowest predicted seconds
              (:func:`~xla_ckpt.restore.cost.choose_plan` on the job's hosts x ranks per
              host, the checkpoint's size and ``cost_model``) among those the backend
              can run; on XLA never one that needs an XLA collective unless
              ``allow_xla_data_plane``;
            * ``"all_ranks"``: every rank reads what it needs from storage; with
              ``host_shared_memory`` (the default) the ranks of one host share one read
              of the replicated state (the ``per_host`` plan), else each rank reads all;
            * ``"per_host"``: one read per host, the host's other ranks map its sealed copy;
            * ``"broadcast"``: rank 0 reads, the data plane fans out in buckets;
            * ``"striped"``: every byte is fetched once per job, in crc32c-chunk-aligned
              stripes spread over all ranks, then exchanged (host shared memory within a
              host, bucketed broadcasts across hosts).
        load_checkpoint_on_all_dp_ranks: fairseq's flag; True means
            ``"all_ranks"`` (and conflicts with an explicit ``"broadcast"``).
        bucket_size_bytes: largest single collective of the broadcast path,
            in bytes; a receiver needs about one bucket of memory beyond the state.
        zero_sharding: ``"os"`` — each rank restores only its partition of the
            flat sharded tensors (ZeRO optimizer-state sharding); ``"none"`` —
            each rank gets the whole of every sharded tensor.
        allow_reshard: restore sharded tensors saved with another world size
            by exact resharding; False raises ``WorldSizeMismatchError`` instead.
        allow_xla_data_plane: on XLA/TPU, let ``auto`` pick plans that move tensor bytes
            over a data-plane collective across hosts (``broadcast``, multi-host
            ``striped``).  False (default): ``auto`` keeps to plans with no cross-host
            collective (``all_ranks`` / ``per_host``).
        cost_model: :class:`~xla_ckpt.restore.cost.Bandwidths` the cost model predicts
            with (storage per stream / per host / aggregate in bytes/s, first-byte latency
            in seconds, data-plane bandwidths); defaults describe a Cloud VM reading GCS.
        host_shared_memory: per_host, striped and broadcast.  True: ranks on the
            same host share one sealed, copy-on-write copy of the replicated
            state that their host's leader holds (rank 0 reads into its copy,
            other hosts' leaders receive one over the data plane), falling
            back to the collective, with the reason logged, when some rank
            cannot share; False: every rank receives every byte over the
            collective.
        rank_state_on_resize: what happens to the per-rank items (``rank/<r>``: data
            iterator position, RNG state) of a checkpoint saved with another world size.
            They are always kept when the world size matches.  ``"error"`` (default): one
            :class:`~xla_ckpt.errors.WorldSizeMismatchError` on every rank naming the
            per-rank items, unless ``restore(rank_state_remap=fn)`` maps them onto the new
            ranks; ``"drop"``: restore without them (``Restored.rank_state`` is None) and log
            a WARNING naming what was dropped.  Silently dropping a data loader's position
            replays or skips samples (torchtitan #811), so dropping is never the default.

    Raises:
        ConfigError: a value out of range (names the key).
    """

    strategy: str = "auto"
    load_checkpoint_on_all_dp_ranks: bool = False
    bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES
    zero_sharding: str = "none"
    allow_reshard: bool = True
    host_shared_memory: bool = True
    rank_state_on_resize: str = "error"
    allow_xla_data_plane: bool = False
    cost_model: Bandwidths = field(default_factory=Bandwidths)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"restore.strategy must be one of {', '.join(STRATEGIES)}; got "
                              f"{self.strategy!r}")
        if self.zero_sharding not in ZERO_SHARDING:
            raise ConfigError(f"restore.zero_sharding must be one of {', '.join(ZERO_SHARDING)}; "
                              f"got {self.zero_sharding!r}")
        if self.rank_state_on_resize not in RANK_STATE_ON_RESIZE:
            raise ConfigError(f"restore.rank_state_on_resize must be one of "
                              f"{', '.join(RANK_STATE_ON_RESIZE)}; got "
                              f"{self.rank_state_on_resize!r}")
        if isinstance(self.cost_model, dict):
            known = {f.name for f in dataclasses.fields(Bandwidths)}
            unknown = sorted(set(self.cost_model) - known)
            if unknown:
                raise ConfigError(f"restore.cost_model: unknown key(s) {', '.join(unknown)}; "
                                  f"valid keys: {', '.join(sorted(known))}")
            self.cost_model = Bandwidths(**self.cost_model)
        if not isinstance(self.cost_model, Bandwidths):
            raise ConfigError(f"restore.cost_model must be a Bandwidths (or a mapping of its "
                              f"fields), got {type(self.cost_model).__name__}")
        for name in ("load_checkpoint_on_all_dp_ranks", "allow_reshard", "host_shared_memory",
                     "allow_xla_data_plane"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"restore.{name} must be true or false, got "
                                  f"{getattr(self, name)!r}")
        b = self.bucket_size_bytes
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ConfigError(f"restore.bucket_size_bytes must be an integer >= 1, got {b!r}")
        if self.load_checkpoint_on_all_dp_ranks and self.strategy in ("broadcast", "striped"):
            raise ConfigError(f"restore.load_checkpoint_on_all_dp_ranks=true asks every rank to "
                              f"read, but restore.strategy is {self.strategy!r}; set one of them")
