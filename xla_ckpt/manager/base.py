"""What the parts of :class:`~xla_ckpt.manager.CheckpointManager` share.

The manager is built from a part per concern (:mod:`~xla_ckpt.manager.schedule`,
:mod:`~xla_ckpt.manager.saving`, :mod:`~xla_ckpt.manager.restoring`; see
:mod:`~xla_ckpt.manager.core`).  :class:`ManagerBase` declares the state they share,
which the constructor in :mod:`~xla_ckpt.manager.core` sets, and the two helpers every
collective method uses.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from typing import TYPE_CHECKING, Any

from xla_ckpt.comm import Dist
from xla_ckpt.config import CheckpointConfig
from xla_ckpt.errors import DistributedError
from xla_ckpt.manager.preemption import PreemptionNotice
from xla_ckpt.manager.staging import StagingPool
from xla_ckpt.restore import RestoreConfig
from xla_ckpt.storage import Storage

if TYPE_CHECKING:  # saving imports this module
    from xla_ckpt.manager.saving import _InFlight

# One logger for every part of the manager: its lines keep the name they had as one module.
logger = logging.getLogger("xla_ckpt.manager.core")


class ManagerBase:
    """The state the manager's parts share; :class:`~xla_ckpt.manager.CheckpointManager` sets it."""

    config: CheckpointConfig
    restore_config: RestoreConfig
    dist: Dist
    rank: int
    world_size: int
    run: Storage  # the run folder
    _own_run: bool  # the manager opened ``run`` (and closes it)
    _executor: cf.ThreadPoolExecutor  # the save thread: uploads, and commits on rank 0
    _inflight: _InFlight | None
    _pool: StagingPool | None
    _notice: PreemptionNotice
    _preempt_agreed: bool
    _last_saved: tuple[str, int] | None  # (name, num_updates) of the newest save
    _best: float | None  # coordinator: best metric among committed checkpoints
    _closed: bool
    restored_from: str | None

    def close(self) -> None:
        """Wait for the in-flight save, release everything (:class:`CheckpointManager`)."""
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")

    def _exchange(self, obj: Any) -> list[Any]:
        out = self.dist.exchange(obj)
        if len(out) != self.world_size:
            raise DistributedError(f"exchange returned {len(out)} entries for world size "
                                   f"{self.world_size}")
        return out
