"""Where this process sits in the job: rank, world size, local rank, host."""

from __future__ import annotations

from dataclasses import dataclass

from xla_ckpt.errors import ConfigError


@dataclass(frozen=True)
class Topology:
    """This process's place in the job.

    Attributes:
        rank: global rank, ``0 <= rank < world_size``.
        world_size: number of ranks (processes) in the job.
        local_rank: rank among the processes on this host.
        local_world_size: processes on this host.
        host_id: index of this host (torchrun ``GROUP_RANK``; TPU worker id).

    Raises:
        ConfigError: values out of range (names the field).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    host_id: int = 0

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "local_rank", "local_world_size", "host_id"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"topology.{name} must be an integer >= 0, got {v!r}")
        if self.world_size < 1 or self.local_world_size < 1:
            raise ConfigError(f"topology world sizes must be >= 1, got world_size="
                              f"{self.world_size}, local_world_size={self.local_world_size}")
        if self.rank >= self.world_size:
            raise ConfigError(f"topology.rank {self.rank} must be < world_size {self.world_size}")
        if self.local_rank >= self.local_world_size:
            raise ConfigError(f"topology.local_rank {self.local_rank} must be < local_world_size "
                              f"{self.local_world_size}")

    @property
    def is_coordinator(self) -> bool:
        """True on rank 0, the rank that decides, reads (broadcast path) and commits."""
        return self.rank == 0

    def __str__(self) -> str:
        return (f"rank {self.rank}/{self.world_size} (local {self.local_rank}/"
                f"{self.local_world_size}, host {self.host_id})")
