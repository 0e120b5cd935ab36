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
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from xla_ckpt.comm import Dist
from xla_ckpt.comm.failures import is_broken_collective
from xla_ckpt.errors import (
    CheckpointSaveError,
    CollectiveTimeoutError,
    DistributedError,
    FencedError,
)
from xla_ckpt.io.mapped_writer import MappedPages
from xla_ckpt.manager import lockstep
from xla_ckpt.manager.best import BestScore
from xla_ckpt.manager.config import CheckpointConfig
from xla_ckpt.manager.preemption import PreemptionNotice
from xla_ckpt.manager.replication import Replicator
from xla_ckpt.manager.staging import StagingPool
from xla_ckpt.restore import RestoreConfig
from xla_ckpt.restore.owners import ChunkedSavePlan
from xla_ckpt.run.fencing import Lease, acquire_lease, lease_from_message, lease_message
from xla_ckpt.run.local_tier import LocalStep, LocalTier
from xla_ckpt.storage import Storage

# One logger for every part of the manager: its lines keep the name they had as one module.
logger = logging.getLogger("xla_ckpt.manager.core")



@dataclass
class InFlightSave:
    """A save handed to the background: what it wrote, its upload and commit futures, the
    host staging buffers to reuse once uploaded; ``SavePath._finish_on_exit`` gives it up
    under ``gate``."""


    name: str
    save_id: str
    metadata: dict
    storage: Storage
    upload: cf.Future
    phase: str = "upload"  # "upload" -> "commit"
    commit: cf.Future | None = None  # rank 0 only
    manifest_written: bool = False
    staged_bytes: int = 0
    score: float | None = None  # rank 0: its best score (manager.best), None for none
    t0: float = field(default_factory=time.perf_counter)
    buffers: list = field(default_factory=list)  # host staging buffers, reusable once uploaded
    plan: ChunkedSavePlan | None = None  # rank 0, chunked save: what it commits
    # On the way out (SavePath._finish_on_exit): set under ``gate`` once the save is given up;
    # rank 0's commit job writes the commit marker under ``gate`` only if it is not set.
    abandoned: bool = False
    gate: threading.Lock = field(default_factory=threading.Lock)
    # The local tier (manager.local_save): the save writes there first; ``durable`` says
    # whether it is then uploaded (phase "copy") and committed in the run folder.
    local: bool = False
    durable: bool = True
    local_storage: Storage | None = None
    host_ranks: dict[int, list[int]] = field(default_factory=dict)
    gathered: list = field(default_factory=list)  # every rank's written items (phase "copy")
    copy: cf.Future | None = None  # this rank's durable upload of its local files

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
    _inflight: InFlightSave | None
    _pool: StagingPool | None
    _pages: MappedPages  # mappings of the local tier's files this rank staged into
    _notice: PreemptionNotice
    _preempt_agreed: bool
    _last_saved: tuple[str, int] | None  # (name, num_updates) of the newest save
    _best: float | None  # coordinator: best score among committed checkpoints
    _scorer: BestScore  # what "best" means (config metric or best_fn; manager.best)
    _closed: bool
    restored_from: str | None
    _lease: Lease | None  # this incarnation's lease (every rank; rank 0 takes it at the first
    # save or take_over(), never on a restore or a query)
    _fenced: FencedError | None  # set once a newer incarnation was seen: no more saves
    _lease_check: cf.Future | None  # rank 0: the background lease read of local-only saves
    _where: lockstep.Position = None  # this rank's schedule position (manager.lockstep)
    _update_calls: int = 0  # after_update calls so far (its position counts them)
    _collective_broken: bool = False  # an exchange did not complete: close() skips its own
    _metrics_warned: lockstep.Position = None  # the call whose metrics difference was logged
    _tier: LocalTier | None  # this host's local tier (config.local_dir), None for none
    _host: int  # this host's index
    _host_leader: bool  # local rank 0: writes the host's commit marker, prunes
    _local_started: float  # rank 0: perf_counter() when the last local save began
    local_committed: list[str]
    _local_due: bool = False  # rank 0's clock, agreed in _sync: the continuous policy may save
    _durable_started: float = 0.0  # rank 0: perf_counter() when the last durable save began
    _durable_due: bool = False  # rank 0's clock, agreed in _sync: save_interval_seconds passed
    _replicator: Replicator | None = None  # host leaders: the background replication
    _replication_set_up: bool = False  # every rank: the replication group was made (or not)

    def close(self) -> None:
        """Wait for the in-flight save, release everything (:class:`CheckpointManager`)."""
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")

    # ---- fencing (xla_ckpt.run.fencing) ------------------------------------------------------
    def _take_lease(self) -> Lease:
        """Rank 0 only: take the next lease epoch of the run folder."""
        lease = acquire_lease(self.run)
        if self.restored_from is not None:
            logger.info("[rank %d] %s: took lease epoch %d (restored from %s); from now on an "
                        "older incarnation still running is fenced, and this one's checkpoints "
                        "outrank whatever it committed meanwhile", self.rank, self.run.uri,
                        lease.epoch, self.restored_from)
        return lease

    def _ensure_lease(self) -> Lease:
        """Hold a lease epoch on every rank (rank 0 takes it, the others get it).  Collective
        when none is held yet.  Called by the first save (and :meth:`CheckpointManager.
        take_over`) only: taking over a run folder is the act of a job that saves, never of
        a restore or a query (CASES C25).

        Raises:
            CheckpointSaveError: rank 0 could not take it (every rank).
        """
        if self._lease is not None:
            return self._lease
        msg: Any = None
        own: BaseException | None = None
        if self.rank == 0:
            try:
                msg = ("ok", *lease_message(self._take_lease()))
            except Exception as e:  # noqa: BLE001 - sent to every rank, raised below
                msg, own = ("error", f"{type(e).__name__}: {e}"), e
        msg = self._exchange(msg)[0]
        if msg[0] == "error":
            raise CheckpointSaveError(f"could not take the lease of run folder {self.run.uri}",
                                      {0: msg[1]}) from own
        self._lease = lease_from_message(msg[1:])
        if self._tier is not None and self._host_leader:
            # No incarnation of this run folder wrote a step of this epoch or later: such a
            # step is another job's (the run folder was deleted and made anew).
            self._tier.discard_foreign(self._lease.epoch)
        return self._lease

    def _replicate(self, name: str, step: LocalStep | None,
                   host_ranks: dict[int, list[int]]) -> None:
        """Every rank, where a local save ends (``SavePath._local_written``, collective):
        hand this host's committed part of ``name`` (None: not committed here) to the
        background replication (:mod:`xla_ckpt.manager.replication`).  The first call makes
        the host leaders' own process group (a collective of every rank)."""
        cfg = self.config
        if self._tier is None or cfg.local_replicas <= 0 or len(host_ranks) < 2:
            return
        if not self._replication_set_up:
            self._replication_set_up = True
            if not self.dist.supports_subgroups:
                if self.rank == 0:
                    logger.warning("local_replicas=%d: %r cannot make a process group of the "
                                   "host leaders; no replicas are made", cfg.local_replicas,
                                   self.dist)
                return
            leaders = [r for r, lead in enumerate(self._exchange(self._host_leader)) if lead]
            group = self.dist.own_subgroup(leaders)
            if group is not None:
                self._replicator = Replicator(group, self._tier, host=self._host,
                                              replicas=cfg.local_replicas,
                                              domains=cfg.local_replica_domains)
        if self._replicator is not None:
            self._replicator.submit(name, step)

    def _raise_if_fenced(self) -> None:
        """A fenced manager refuses every save at once, writing nothing (no collective)."""
        if self._fenced is not None:
            f = self._fenced
            raise FencedError(str(f), own_epoch=f.own_epoch, current_epoch=f.current_epoch,
                              run=f.run)

    def _exchange(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, once every rank's schedule position agrees
        (:mod:`~xla_ckpt.manager.lockstep`; else :class:`~xla_ckpt.errors.ScheduleMismatchError`
        on every rank)."""
        try:
            out = self.dist.exchange(lockstep.wrap(self._where, obj))
        except DistributedError as e:
            if isinstance(e, CollectiveTimeoutError) or is_broken_collective(e):
                self._collective_broken = True
            raise
        if len(out) != self.world_size:
            raise DistributedError(f"exchange returned {len(out)} entries for world size "
                                   f"{self.world_size}")
        payloads, metrics_differ = lockstep.unwrap(out)
        if metrics_differ and self.rank == 0 and self._metrics_warned is not self._where:
            self._metrics_warned = self._where  # once per collective call
            logger.warning("[rank %d] ranks passed different metrics (%s); %s", self.rank,
                           lockstep.grouped(lockstep.positions_of(out)), lockstep.METRICS_HINT)
        return payloads
