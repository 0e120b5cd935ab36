"""The restore path of :class:`~xla_ckpt.manager.CheckpointManager`: which checkpoint, then read.

Rank 0 resolves ``config.restore_file`` with the one resolver
(:func:`xla_ckpt.run.resolve.resolve`: ``checkpoint_last`` -> the run folder's
latest committed checkpoint, ``checkpoint_best`` -> its pointer; a folder name or
a URI is resolved by :func:`xla_ckpt.restore.restore` itself) and reads the best
metric recorded so far; every rank gets that decision (or rank 0's error) and
restores through :func:`xla_ckpt.restore.restore`.

Fencing: a restore, a step query and a partial restore never take the run folder's lease
(:mod:`xla_ckpt.run.fencing`) and write nothing: an evaluator polling the run, or any other
process that only reads, never fences the trainer saving there (CASES C25).  Taking over a
run is the act of a job that saves: its first save takes the next lease epoch (or
:meth:`~xla_ckpt.manager.CheckpointManager.take_over`, on purpose, earlier).  Until then an
older incarnation still running may commit newer checkpoints; the first save of this one
outranks them ("newer" orders by lease epoch first, pointers never move backwards) and
fences that incarnation (see :mod:`xla_ckpt.run.fencing`, "Who takes the lease").

A checkpoint of the run folder that cannot be read (truncated, bad crc32c, a data file
missing) raises with a note naming the previous intact committed checkpoint and the options
that restore it (:mod:`xla_ckpt.run.recovery`).

Steps (Orbax / torch_xla ``CheckpointManager`` parity): a checkpoint's *step* is the
``num_updates`` its manifest metadata records; :meth:`RestorePath.all_steps`,
:meth:`RestorePath.latest_step` and :meth:`RestorePath.best_step` list them (rank 0
lists the run folder, every rank gets the answer), and :meth:`RestorePath.restore`
restores one (``step=None``: the latest) on every rank, optionally only some ``keys``
of the state (:mod:`xla_ckpt.kinds.partial`).  Two committed checkpoints with one step (an
epoch checkpoint and an update checkpoint of the same update, or an incarnation that
saved that update again): the newest committed one by the catalog's order (lease
epoch, then creation time) is restored, the same one on every rank.

Fresh start: only ``checkpoint_last`` with nothing ever committed in the run
folder (:class:`~xla_ckpt.errors.NothingCommittedError`; a ``save_dir`` that does
not exist yet counts, the manager creates it), logged at WARNING.  A named
``restore_file`` with nothing committed raises ``CheckpointNotFoundError`` (or
``IncompleteCheckpointError``) on every rank, not the fresh-start class.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from xla_ckpt.comm.failures import describe_error, is_broken_collective
from xla_ckpt.errors import (
    CheckpointNotFoundError,
    CheckpointReplacedError,
    CollectiveTimeoutError,
    ConfigError,
    DistributedError,
    IncompleteCheckpointError,
    NothingCommittedError,
    StepNotFoundError,
    UncommittedCheckpointError,
)
from xla_ckpt.format import typed
from xla_ckpt.format.manifest import STATE_ITEM, Manifest, valid_file_name
from xla_ckpt.io.reader import CheckpointReader
from xla_ckpt.kinds.partial import Keys, PartialResult, check_keys, read_partial, select_item
from xla_ckpt.manager import local_restore, rank0
from xla_ckpt.manager.base import ManagerBase, logger
from xla_ckpt.restore import RestoreConfig, Restored
from xla_ckpt.restore import restore as restore_checkpoint
from xla_ckpt.restore.decide import Decision
from xla_ckpt.run.catalog import CheckpointEntry, list_checkpoints, pointer_name
from xla_ckpt.run.recovery import add_note, is_corruption, recovery_hint
from xla_ckpt.run.resolve import committed_manifest, resolve
from xla_ckpt.storage import open_storage, parse_uri
from xla_ckpt.storage.tiered import TierCounters

_SHOWN_STEPS = 20  # steps listed in a StepNotFoundError message

RankStateRemap = Callable[[dict[int, Any], int, int], Any]
"""``fn(saved rank states by rank, rank, world_size) -> this rank's state`` (the restore's
``rank_state_remap``)."""


def _steps(entries: list[CheckpointEntry]) -> list[int]:
    return sorted({e.num_updates for e in entries if e.committed and e.num_updates >= 0})


def _check_step(step: object) -> int | None:
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step must be an int >= 0 (a checkpoint's num_updates) or None for "
                          f"the latest, got {step!r}")
    return step


@dataclass
class RestoreResult:
    """What :meth:`CheckpointManager.restore_or_initialize` returns on every rank.

    Attributes:
        state: the replicated state as saved (tensors on CPU unless ``map_location``);
            with ``into``, its tensor leaves are the ``into`` objects, filled in place.
        rank_state: this rank's private state (item ``rank/<rank>``), or None if the
            checkpoint has none for this rank.
        checkpoint: checkpoint folder name (``checkpoint_1_500``).
        uri: full checkpoint URI.
        metadata: the manifest's metadata summary (epoch, num_updates, metrics, ...).
        epoch / num_updates: from ``metadata`` (None if the saver did not record them).
        restored: the restore layer's :class:`xla_ckpt.restore.Restored` (strategy and why,
            :class:`~xla_ckpt.restore.RestoreStats` with bytes read and seconds, shards);
            None for a partial restore.
        partial: for :meth:`CheckpointManager.restore` with ``keys``: the
            :class:`~xla_ckpt.kinds.partial.PartialResult` of this rank's read (selection,
            bytes read, seconds); None otherwise.
        tier: with a local tier (``checkpoint.local_dir``): ``tier`` (``"local"`` or
            ``"durable"``), ``host``, ``local_bytes`` / ``durable_bytes`` this rank read from
            each, ``peer_bytes`` it read from other hosts' tiers (a replaced host, a restore
            onto another mesh; ``peer_bytes_by_host``, ``healed_from``: the peer host that
            served the most of them, or None), ``fallbacks``, and the phase times in seconds
            (``decide_s``, ``read_s``, ``local_read_s`` / ``durable_read_s`` /
            ``peer_read_s``: summed over the reading threads, ``total_s``); None without a
            local tier.
    """

    state: Any
    rank_state: Any
    checkpoint: str
    uri: str
    metadata: dict
    epoch: int | None = None
    num_updates: int | None = None
    restored: Restored | None = None
    partial: PartialResult | None = None
    tier: dict | None = None


#: A restore from the local tier whose copy failed its checks decides again at most this
#: many times (each time that host's copy of that step is untrusted: no loop).
MAX_LOCAL_ATTEMPTS = 2

_UNREAD: Any = object()  # _resolve_restore: the best score is still to be read


class _LocalCopyFailed(Exception):
    """A restore from the local tier failed on a local copy's bytes (marked untrusted)."""

    def __init__(self, name: str, error: DistributedError) -> None:
        super().__init__(name)
        self.name = name
        self.error = error


class RestorePath(ManagerBase):
    """Restoring: :meth:`restore_or_initialize` and how it resolves and reads a checkpoint."""

    _parsed: tuple[str, Manifest] | None = None
    """Rank 0: the manifest it parsed for the decision being sent, with its checkpoint URI
    (taken by :meth:`_take_parsed`, so rank 0 does not parse the bytes it sends again)."""

    def _take_parsed(self, uri: str) -> Manifest | None:
        parsed, self._parsed = self._parsed, None
        return parsed[1] if parsed is not None and parsed[0] == uri else None

    def restore_or_initialize(self, init_fn: Callable[[], Any] | None = None, *,
                              map_location: Any = None, into: Any = None,
                              rank_state_remap: RankStateRemap | None = None
                              ) -> RestoreResult | None:
        """Restore the checkpoint ``config.restore_file`` names, or start fresh.  Collective.

        Rank 0 resolves which checkpoint (``checkpoint_last``: the newest committed one,
        following the pointer unless it lags; ``checkpoint_best``; a folder name in
        ``save_dir``; or a full URI) and sends the decision to every rank (DESIGN
        decision 2).  Every rank then gets the replicated state and its own
        ``rank/<rank>`` item through :func:`xla_ckpt.restore.restore` with
        ``restore_config`` (every rank reads, or rank 0 reads and broadcasts).

        Sharded training state (FSDP2, tensor parallel, torch_xla SPMD): pass the live
        targets as ``into`` (e.g. ``{"model": msd, "optim": osd}`` from
        ``torch.distributed.checkpoint.state_dict.get_state_dict``, laid out as the state was
        saved); each rank reads only the byte ranges of its own shards, straight into them,
        onto any mesh or world size (:func:`xla_ckpt.restore.restore` ``into=``).

        Another world size than the checkpoint's: per-rank items (``rank/<r>``: iterator
        position, RNG state) follow ``restore_config.rank_state_on_resize``: ``"error"``
        (default) raises :class:`~xla_ckpt.errors.WorldSizeMismatchError` on every rank
        naming them, unless ``rank_state_remap`` maps them onto the new ranks; ``"drop"``
        restores without them (``rank_state`` None) and logs a WARNING naming what was
        dropped.  The same world size always keeps them.

        Args:
            init_fn: called (on every rank) when there is nothing to restore.
            map_location: where restored tensors go on this rank (as ``torch.load``;
                pass ``dist.device`` for this rank's own device).
            into: a state tree whose tensor leaves (plain tensors, DTensors,
                XLAShardedTensors) are filled in place; ``RestoreResult.state`` is the saved
                tree holding those live objects (leaves ``into`` lacks are read whole).
            rank_state_remap: ``fn(saved: dict[rank, rank_state], rank, world_size) ->
                rank_state`` (every rank): this rank's private state from the saved ranks',
                when the world size changed.

        Returns:
            A :class:`RestoreResult` on every rank, or None when ``restore_file`` is
            ``checkpoint_last`` and nothing was ever committed in the run folder
            (logged at WARNING: training starts from scratch).

        Raises:
            CheckpointNotFoundError: an explicitly named checkpoint (or ``checkpoint_best``)
                does not exist, or the run folder holds no readable committed checkpoint
                while something was committed there (a dangling ``checkpoint_last``
                pointer); every rank raises it.
            IncompleteCheckpointError: a named checkpoint folder has no commit marker.
            CheckpointReplacedError: another writer replaced the checkpoint during the
                read, twice (every rank).
            WorldSizeMismatchError: saved with another world size and it holds per-rank
                items, with neither ``rank_state_remap`` nor ``rank_state_on_resize="drop"``
                (names the items; every rank).
            StateMismatchError: an ``into`` target the checkpoint lacks, or whose global
                shape or dtype differs (names the key; every rank).
            DistributedError: a read failed on some rank (corrupt bytes, storage error);
                ``failures`` names the ranks, on every rank.
        """
        self._check_open()
        t0 = time.perf_counter()
        tiered = self._tier is not None and self.config.restore_file == "checkpoint_last"
        for attempt in range(MAX_LOCAL_ATTEMPTS + 1):
            try:
                return self._restore_once(init_fn, map_location, into, rank_state_remap,
                                          tiered=tiered, t0=t0)
            except _LocalCopyFailed as e:
                if attempt == MAX_LOCAL_ATTEMPTS:
                    raise e.error from None
                if self.rank == 0:
                    logger.warning("[rank %d] the local copy of %s failed its checks on some "
                                   "host (%s); it is not trusted again: deciding once more",
                                   self.rank, e.name, e.error)
        raise AssertionError("unreachable")

    def _restore_once(self, init_fn: Callable[[], Any] | None, map_location: Any, into: Any,
                      rank_state_remap: RankStateRemap | None, *, tiered: bool,
                      t0: float) -> RestoreResult | None:
        """One decision and one read (:meth:`restore_or_initialize`).  With a local tier,
        every host's inventory goes to rank 0 first and the read goes through this host's
        copy (:mod:`xla_ckpt.manager.local_restore`)."""
        every = self._exchange((self._host, local_restore.inventory_message(
            self._tier, self._host_leader))) if tiered else None
        decision: Any = None
        if self.rank == 0:
            try:
                # The local tier decides first (one round trip to the durable tier: its lease
                # and its commit markers, read at once); only when no local step wins is
                # checkpoint_last resolved in the durable tier.  No lease is taken: a restore
                # only reads.
                local, best = None, _UNREAD
                if tiered:
                    assert self._tier is not None and every is not None
                    with cf.ThreadPoolExecutor(1, thread_name_prefix="xla_ckpt-best") as pool:
                        best_read = pool.submit(self._read_best_value)
                        local = local_restore.decide_local(self.run, self._tier, every,
                                                           world_size=self.world_size)
                        best = best_read.result()
                if local is not None:
                    decision = ("ok", None, local.name, True, best, None,
                                local.to_message())
                else:
                    decision = ("ok", *self._resolve_restore(best), None)
            except Exception as e:  # noqa: BLE001 - sent to every rank, re-raised below
                decision = rank0.error_message(e)
                own = e
        decision = self._exchange(decision)[0]
        if decision[0] == "error":  # the same type on every rank (manager.rank0)
            rank0.raise_error(decision, own if self.rank == 0 else None,
                              world_size=self.world_size,
                              what="resolve the checkpoint to restore")
        _, uri, name, in_run, best, mbytes, message = decision
        local = None if message is None else local_restore.LocalDecision.from_message(message)
        self._best = best
        decided_s = time.perf_counter() - t0
        counters = TierCounters()
        tier_used: str | None = "durable" if tiered else None
        peers: local_restore.PeerSources | None = None
        if local is not None:
            assert self._tier is not None and every is not None
            name, save_id, in_durable, why = local.name, local.save_id, local.durable, \
                local.reason
            mbytes = local.manifest
            if local.sources is not None:
                peers, mbytes = self._serve_peers(local, every, mbytes)
            uri, in_run, tier_used = self.run.url(name), True, "local"
            manifest = Manifest.from_json_bytes(mbytes, where=f"{self._tier.path(name)}/"
                                                f"manifest.json", require_crc=True)
            if self.rank == 0:
                logger.info("[rank %d] restoring %s from the local tier: %s%s", self.rank,
                            name, why, "" if in_durable else " (not in the durable tier yet)")
            opener = local_restore.tier_source(self._tier, self.run, name=name,
                                               save_id=save_id, durable=in_durable,
                                               manifest=manifest, counters=counters,
                                               peers=peers)
            self._parsed = (uri, manifest)
        if uri is None:
            if self.rank == 0:
                logger.warning("[rank %d] %s: training starts from scratch", self.rank, name)
            if init_fn is not None:
                init_fn()
            return None
        # The run folder's choice, made once on rank 0 and read from the manifest it sent:
        # restore() decides nothing again.  A named checkpoint restore() resolves itself.
        source: str | Decision = uri if mbytes is None else \
            Decision.from_bytes(uri, mbytes, self._take_parsed(uri))
        config = None
        if local is not None:
            assert isinstance(source, Decision)
            source = dataclasses.replace(source, source=opener)
            config = local_restore.own_host_config(self.restore_config)
        try:
            try:
                result = self._read_checkpoint(source, name, map_location, into=into,
                                               rank_state_remap=rank_state_remap,
                                               config=config)
                if peers is not None:
                    assert self._tier is not None
                    peers.end(self._exchange, self._tier, counters, leader=self._host_leader)
            finally:
                if peers is not None:
                    peers.close()
        except UncommittedCheckpointError as e:  # a named folder: not a fresh start here
            raise IncompleteCheckpointError(str(e)) from e
        except NothingCommittedError as e:
            raise CheckpointNotFoundError(str(e)) from e
        except DistributedError as e:
            if local is not None and not isinstance(e, CollectiveTimeoutError) and \
                    not is_broken_collective(e) and (
                    peers.end(self._exchange, self._tier, counters, leader=self._host_leader)
                    if peers is not None and self._tier is not None else
                    any(self._exchange(bool(counters.fallbacks)))):
                raise _LocalCopyFailed(name, e) from e
            self._note_recovery(e, name if in_run else None)
            raise
        if in_run:
            self.restored_from = name
        if result.num_updates is not None:
            self._last_saved = (name, result.num_updates)
        if tier_used is not None:
            stats = result.restored.stats if result.restored is not None else None
            result.tier = {
                "tier": tier_used, "host": self._host, "local_bytes": counters.local_bytes,
                "durable_bytes": counters.durable_bytes if tier_used == "local" else
                (stats.bytes_read if stats is not None else 0),
                "local_read_s": counters.local_seconds,
                "durable_read_s": counters.durable_seconds if tier_used == "local" else None,
                "fallbacks": list(counters.fallbacks), "decide_s": decided_s,
                "peer_bytes": counters.peer_bytes, "peer_read_s": counters.peer_seconds,
                "peer_bytes_by_host": dict(counters.peer_by_host),
                "healed_from": max(counters.peer_by_host, default=None,
                                   key=lambda h: (counters.peer_by_host[h], -h)),
                "read_s": stats.seconds if stats is not None else 0.0,
                "total_s": time.perf_counter() - t0}
        return result

    def _serve_peers(self, local: local_restore.LocalDecision, every: list,
                     mbytes: bytes | None) -> tuple[local_restore.PeerSources, bytes]:
        """Every rank, a restore onto another mesh: each host leader whose tier holds files
        of the step serves them to the other hosts for the read (one exchange of the
        servers' addresses); the manifest every rank reads (from a peer, by rank 0, when
        its host holds none of the step)."""
        assert self._tier is not None and local.sources is not None
        peers = local_restore.PeerSources(local.name, local.save_id, dict(local.sources),
                                          local.token, timeout_s=self.dist.timeout_s)
        try:
            url = peers.serve(self._tier) if self._host_leader else None
            got: Any = (self._host, url)
            for host, u in self._exchange(got):
                if u is not None:
                    peers.urls[host] = u
            if mbytes is None:
                if self.rank == 0:
                    try:
                        got = ("ok", peers.manifest_bytes())
                    except Exception as e:  # noqa: BLE001 - sent to every rank, raised below
                        got = rank0.error_message(e)
                        own = e
                else:
                    got = None
                got = self._exchange(got)[0]
                if got[0] == "error":
                    rank0.raise_error(got, own if self.rank == 0 else None,
                                      world_size=self.world_size,
                                      what=f"read the manifest of {local.name} from a peer")
                mbytes = got[1]
        except BaseException:
            peers.close()
            raise
        assert mbytes is not None
        return peers, mbytes

    # ---- steps (Orbax / torch_xla CheckpointManager parity) -----------------------------
    def all_steps(self) -> list[int]:
        """Steps (``num_updates``) of the committed checkpoints in the run folder, ascending,
        each once.  Collective: rank 0 lists the run folder, every rank gets its answer.

        Only committed checkpoints count (call :meth:`wait` first to include an async save
        in flight); one without ``num_updates`` in its metadata (not written by a manager)
        has no step.  Orbax ``all_steps()``, torch_xla ``all_steps()``.

        Raises:
            StorageError: listing failed on rank 0 (every rank; never read as "no steps").
            CheckpointNotFoundError / CheckpointCorruptError: nothing committed here is
                readable although the folder is not empty, exactly when :meth:`restore`
                raises them: checkpoints of another kind (a DCP step folder, a fairseq
                ``checkpoint_last.pt``; named), a dangling ``checkpoint_last``, an
                unreadable commit marker (every rank; never read as "no steps", so
                ``if mgr.latest_step() is None: start fresh`` cannot skip them).
        """
        self._check_open()
        return [int(n) for n in self._on_rank0(lambda: _steps(self._committed_entries()),
                                                "list the run folder")]

    def latest_step(self) -> int | None:
        """Step of the checkpoint :meth:`restore` (and ``restore_or_initialize`` with
        ``checkpoint_last``) restores now, or None when no committed checkpoint has a step.
        Collective (as :meth:`all_steps`).

        That is the newest committed checkpoint by the run folder's order (lease epoch,
        then ``num_updates``), following ``checkpoint_last`` unless it lags: normally
        ``max(all_steps())``; after a newer incarnation resumed from an older step, that
        incarnation's step.  Orbax ``latest_step()``.

        Raises:
            StorageError / CheckpointNotFoundError / CheckpointCorruptError: as
            :meth:`all_steps` (None only when :meth:`restore` would find nothing committed).
        """
        self._check_open()
        return self._on_rank0(self._latest_step, "list the run folder")

    def best_step(self) -> int | None:
        """Step of the best committed checkpoint by the manager's ranking (``best_fn`` /
        ``best_mode``, else ``best_checkpoint_metric``; ties: the newer), or None when no
        committed checkpoint has a score.  Collective (as :meth:`all_steps`).  Orbax
        ``best_step()``.

        Raises:
            StorageError / CheckpointNotFoundError / CheckpointCorruptError: as
            :meth:`all_steps`.
        """
        self._check_open()

        def best() -> int | None:
            top = self._scorer.best_entries(
                [e for e in self._committed_entries() if e.num_updates >= 0], 1)
            return top[0].num_updates if top else None

        return self._on_rank0(best, "list the run folder")

    def restore(self, step: int | None = None, *, keys: Keys = None,
                map_location: Any = None, into: Any = None,
                rank_state_remap: RankStateRemap | None = None) -> RestoreResult:
        """Restore the checkpoint of ``step`` (None: the latest) on every rank.  Collective.

        Orbax ``restore(step)`` / torch_xla ``restore(step, state_dict)``, with the one-resolver
        rule (DESIGN decision 2): rank 0 lists the run folder and picks the checkpoint whose
        metadata records ``num_updates == step`` (two such, e.g. ``checkpoint3`` and
        ``checkpoint_3_900`` of the same update: the newest committed one, by lease epoch then
        creation time, on every rank alike), or, for ``step=None``, the latest committed one
        exactly as ``restore_or_initialize`` resolves ``checkpoint_last``; every rank restores
        that one.  Unlike :meth:`restore_or_initialize` there is no fresh start: nothing
        committed raises.  As there, nothing is written (no lease is taken: a process that
        polls the run this way never fences the job saving there), and the restored
        checkpoint is never rotated away by this manager's later saves.

        Args:
            step: a step of :meth:`all_steps`, or None for :meth:`latest_step`'s checkpoint.
            keys: restore only these keys of the replicated state (dotted paths such as
                ``"model.encoder.layer.0"`` or ``"optimizer"``, see :mod:`xla_ckpt.kinds.partial`);
                every rank then reads only the blobs those tensors live in, from storage
                itself (``restore_config.strategy`` does not apply), and ``rank_state`` is
                None.  None: the whole state and this rank's ``rank/<rank>`` item through
                :func:`xla_ckpt.restore.restore` (the configured strategy).
            map_location: where restored tensors go on this rank (as ``torch.load``).
            into / rank_state_remap: as :meth:`restore_or_initialize` (live targets filled in
                place, onto any mesh; per-rank items on another world size); not with ``keys``.

        Returns:
            A :class:`RestoreResult` on every rank (``partial`` set when ``keys`` is given).

        Raises:
            StepNotFoundError: no committed checkpoint records ``step``; the message lists
                the steps there are (a ``CheckpointNotFoundError``; every rank).
            NothingCommittedError: ``step=None`` and nothing is committed (every rank).
            UnknownKeyError: a key selects nothing; names it and the closest keys (every rank).
            CheckpointReplacedError: the checkpoint was replaced during the read, twice.
            DistributedError: a read failed on some rank; ``failures`` names them.
            WorldSizeMismatchError / StateMismatchError: as :meth:`restore_or_initialize`.
            ConfigError: ``step`` is not an int >= 0, or ``keys`` given with ``into`` or
                ``rank_state_remap`` (before any collective).
            ValueError: ``keys`` is empty (pass None for everything) or holds an empty or
                non-string key (before any collective).
        """
        self._check_open()
        step = _check_step(step)
        check_keys(keys)  # an empty or malformed key list fails on every rank alike, first
        if keys is not None and (into is not None or rank_state_remap is not None):
            raise ConfigError("restore(keys=...) reads a selection of the replicated state on "
                              "its own; into= and rank_state_remap= apply to a whole restore "
                              "(pass keys=None)")
        decision = self._decide(step, keys)
        for attempt in range(2):
            if keys is None:
                try:
                    result = self._read_checkpoint(decision, decision.name, map_location,
                                                   into=into, rank_state_remap=rank_state_remap)
                except UncommittedCheckpointError as e:
                    raise IncompleteCheckpointError(str(e)) from e
                except NothingCommittedError as e:
                    raise CheckpointNotFoundError(str(e)) from e
                except DistributedError as e:
                    self._note_recovery(e, decision.name)
                    raise
                break
            try:
                result = self._read_partial(decision, keys, map_location)
                break
            except DistributedError as e:
                if isinstance(e, CollectiveTimeoutError) or getattr(e, "collective_broken", False):
                    raise
                again = self._decide(step, keys)
                if (again.checkpoint, again.save_id) == (decision.checkpoint, decision.save_id):
                    self._note_recovery(e, decision.name)
                    raise  # not replaced: the read's own error
                if attempt == 1:
                    raise CheckpointReplacedError(
                        f"{decision.checkpoint} was replaced while reading (save id "
                        f"{decision.save_id} -> {again.save_id}); retry or pause the other "
                        "writer", e.failures, uri=decision.checkpoint, before=decision.save_id,
                        after=again.save_id) from e
                if self.rank == 0:
                    logger.warning("[rank %d] %s was replaced while reading (save id %s -> "
                                   "%s); restoring %s once more", self.rank, decision.checkpoint,
                                   decision.save_id, again.save_id, again.checkpoint)
                decision = again
        self.restored_from = decision.name  # a folder of the run folder: never rotated away
        if result.num_updates is not None:
            self._last_saved = (decision.name, result.num_updates)
        return result

    def _committed_entries(self, entries: list[CheckpointEntry] | None = None
                           ) -> list[CheckpointEntry]:
        """Rank 0: the committed checkpoints of the run folder (``entries``: a listing of it).

        None committed: raises what :meth:`restore` raises unless that is "nothing committed"
        (checkpoints of another kind, a dangling pointer, an unreadable commit marker), so
        the step queries never answer "no steps" where a restore would fail.
        """
        if entries is None:
            entries = list_checkpoints(self.run)
        committed = [e for e in entries if e.committed]
        if not committed:
            try:
                resolve(self.run, pointer="last", missing_ok=True)
            except NothingCommittedError:  # UncommittedCheckpointError too: truly no steps
                pass
        return committed

    def _latest_step(self) -> int | None:
        """Rank 0: :meth:`latest_step`: the step of what the one resolver picks for
        ``restore()`` (so the two never disagree), else the newest committed step."""
        try:
            r = resolve(self.run, pointer="last", missing_ok=True)
        except NothingCommittedError:  # UncommittedCheckpointError too: no steps
            return None
        md = typed.decode(r.manifest.metadata) if r.manifest is not None and \
            r.manifest.metadata is not None else None
        step = md.get("num_updates") if isinstance(md, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            return step
        stepped = [e for e in list_checkpoints(self.run) if e.committed and e.num_updates >= 0]
        return stepped[-1].num_updates if stepped else None

    def _decide(self, step: int | None, keys: Keys) -> Decision:
        """Every rank: rank 0's decision for :meth:`restore` (and the best score so far, read
        on the way), with the manifest rank 0 read: no rank reads it again.  Takes no lease."""
        uri, mbytes, best = self._on_rank0(
            lambda: self._decide_on_rank0(step, keys), "resolve the checkpoint to restore")
        self._best = best
        return Decision.from_bytes(uri, mbytes, self._take_parsed(uri))

    def _decide_on_rank0(self, step: int | None, keys: Keys) -> tuple:
        """Rank 0: ``(checkpoint URI, its manifest bytes, best)``; the manifest it parsed is
        kept for this rank's :class:`Decision` (:attr:`_parsed`)."""
        if step is None:
            r = resolve(self.run, pointer="last", missing_ok=True)
            uri, manifest, mbytes = r.checkpoint, r.manifest, r.manifest_bytes
        else:
            entries = [e for e in list_checkpoints(self.run) if e.committed]
            matches = [e for e in entries if e.num_updates == step]
            if not matches:
                steps = _steps(entries)
                shown = ", ".join(str(n) for n in steps[:_SHOWN_STEPS]) + \
                    (f", ... ({len(steps)} in all, the last {steps[-1]})"
                     if len(steps) > _SHOWN_STEPS else "")
                raise StepNotFoundError(
                    f"{self.run.uri}: no committed checkpoint at step {step} (num_updates); "
                    f"steps there: {shown or 'none'}", step=step, steps=tuple(steps),
                    run=self.run.uri)
            chosen = matches[-1]  # oldest first: the newest committed of that step
            if len(matches) > 1:
                logger.info("[rank %d] step %d: %s committed; restoring the newest, %s",
                            self.rank, step, ", ".join(e.name for e in matches), chosen.name)
            with self.run.child(chosen.name) as child:
                found = committed_manifest(child)
                uri = child.uri
            if found is None:
                raise CheckpointNotFoundError(f"{uri}: deleted while the run folder was read "
                                              "(is another job rotating it?)")
            manifest, mbytes, _ = found
        if manifest is None:
            raise ConfigError(f"{uri} is not an xla_ckpt checkpoint folder")
        if keys is not None:  # an unknown key fails here, on every rank alike
            select_item(manifest.item(STATE_ITEM), keys, where=uri)
        self._parsed = (uri, manifest)
        return uri, mbytes, self._read_best_value()

    def _read_partial(self, decision: Decision, keys: Keys,
                      map_location: Any) -> RestoreResult:
        """Every rank reads its selection of ``decision``'s checkpoint; failures agreed on."""
        uri, name = decision.checkpoint, decision.name
        got: PartialResult | None = None
        err: Exception | None = None
        manifest = decision.manifest
        try:
            with open_storage(uri, self.run.config) as st:
                got = read_partial(CheckpointReader(st, manifest), keys,
                                   map_location=map_location)
        except Exception as e:  # noqa: BLE001 - agreed on with every rank just below
            err = e
        causes = self._exchange(None if err is None else describe_error(err))
        failures = {r: c for r, c in enumerate(causes) if c is not None}
        if failures:
            ranks = ", ".join(str(r) for r in sorted(failures))
            raise DistributedError(f"partial restore of {uri} failed on rank(s) {ranks} of "
                                   f"{self.world_size}", failures) from err
        assert got is not None
        md = typed.decode(manifest.metadata) if manifest.metadata is not None else None
        md = md if isinstance(md, dict) else {}
        return RestoreResult(state=got.state, rank_state=None, checkpoint=name, uri=uri,
                             metadata=md, epoch=md.get("epoch"),
                             num_updates=md.get("num_updates"), restored=None, partial=got)

    def _on_rank0(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` on rank 0 and give every rank its value, or its error.  Collective.

        An error rank 0 hits is raised as one type on every rank (:mod:`~xla_ckpt.manager.
        rank0`): a library error as its own class with its attributes (the step/partial
        errors' ``step``, ``steps``, ``key`` ...), any other as a :class:`DistributedError`
        naming rank 0 and the cause.
        """
        msg: Any = None
        own: Exception | None = None
        if self.rank == 0:
            try:
                msg = ("ok", fn())
            except Exception as e:  # noqa: BLE001 - sent to every rank, re-raised below
                own = e
                msg = rank0.error_message(e)
        msg = self._exchange(msg)[0]
        if msg[0] == "ok":
            return msg[1]
        rank0.raise_error(msg, own, world_size=self.world_size, what=what)

    # ---- internals ----------------------------------------------------------------------
    def _note_recovery(self, err: DistributedError, name: str | None) -> None:
        """Every rank, on a restore of run-folder checkpoint ``name`` that failed with ``err``
        (the same on every rank): when a cause is bad bytes (truncated, crc32c, a data file
        missing), add to ``err``'s message the previous intact committed checkpoint and the
        options that restore it (:func:`xla_ckpt.run.recovery.recovery_hint`, rank 0; one
        exchange).  A broken collective or another cause is left as it is.
        """
        if name is None or isinstance(err, CollectiveTimeoutError) or \
                getattr(err, "collective_broken", False):
            return
        if not any(is_corruption(c) for c in err.failures.values()):
            return
        hint = ""
        if self.rank == 0:
            try:
                hint = recovery_hint(self.run, name)
            except Exception as e:  # noqa: BLE001 - only decorates the error being raised
                logger.warning("[rank %d] could not look for an intact checkpoint before %s: "
                               "%s: %s", self.rank, self.run.url(name), type(e).__name__, e)
        hint = self._exchange(hint)[0]
        add_note(err, hint)

    def _resolve_restore(self, best: Any = _UNREAD
                         ) -> tuple[str | None, str, bool, float | None, bytes | None]:
        """Rank 0: (checkpoint URI or None, folder name, is it in the run folder, best metric,
        the manifest bytes it read or None when ``restore()`` is to resolve the URI itself).

        ``checkpoint_last`` with nothing committed gives ``(None, why, True, best, None)``.
        ``best``: the best score when already read (default: read it here).
        """
        rf = self.config.restore_file
        if best is _UNREAD:  # else read already, beside the local tier's decision
            best = self._read_best_value()
        if rf in ("checkpoint_last", "checkpoint_best"):
            which = rf.rsplit("_", 1)[1]
            try:
                r = resolve(self.run, pointer=which, missing_ok=True)
            except NothingCommittedError as e:
                if which != "last":
                    raise
                return None, str(e), True, best, None
            if r.manifest is None:
                raise ConfigError(f"{r.checkpoint} is not an xla_ckpt checkpoint folder")
            self._parsed = (r.checkpoint, r.manifest)
            return r.checkpoint, r.name, True, best, r.manifest_bytes
        target = parse_uri(rf)  # refuses s3://, gs:/b/x, gs//b/x before anything is read
        if target.is_gcs or str(target).startswith(("/", "./", "../")):
            return rf, rf.rstrip("/").rsplit("/", 1)[-1], False, best, None
        return self.run.url(rf), rf, True, best, None

    def _pointer_doc(self, which: str) -> dict:
        try:
            doc = json.loads(self.run.read_bytes(pointer_name(which)).decode("utf-8"))
        except CheckpointNotFoundError:
            return {}
        except (ValueError, UnicodeDecodeError):
            logger.warning("[rank %d] ignoring unreadable pointer %s", self.rank,
                           self.run.url(pointer_name(which)))
            return {}
        return doc if isinstance(doc, dict) else {}

    def _read_best_value(self) -> float | None:
        """Rank 0: the best score so far, from ``checkpoint_best`` (None: none yet).

        Built-in ranking: the value the pointer records for ``best_checkpoint_metric``.
        With a ``best_fn``: the function applied to the metrics of the checkpoint the
        pointer names (a changed function re-ranks it).
        """
        doc = self._pointer_doc("best")
        if self._scorer.fn is not None:
            return self._score_of(doc.get("checkpoint"))
        v = doc.get("value")
        if doc.get("metric") == self._scorer.label and \
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
        return None

    def _score_of(self, name: Any) -> float | None:
        if not valid_file_name(name):
            return None
        try:
            with self.run.child(name) as child:
                found = committed_manifest(child)
            if found is None:
                return None
            m = found[0]
            return self._scorer.score(typed.decode(m.metadata) if m.metadata is not None
                                      else None)
        except Exception as e:  # noqa: BLE001 - no best so far: the next save may take it
            logger.warning("[rank %d] could not score %s, named by checkpoint_best: %s: %s",
                           self.rank, self.run.url(name), type(e).__name__, e)
            return None

    def _read_checkpoint(self, source: str | Decision, name: str, map_location: Any, *,
                         into: Any = None, rank_state_remap: RankStateRemap | None = None,
                         config: RestoreConfig | None = None) -> RestoreResult:
        """Every rank restores ``source`` (the decision made, or a URI to resolve) with the
        configured strategy (xla_ckpt.restore.restore), into the live targets ``into`` when
        given."""
        extra: dict[str, Any] = {}
        if into is not None:
            extra["into"] = into
        if rank_state_remap is not None:
            extra["rank_state_remap"] = rank_state_remap
        r = restore_checkpoint(source, dist=self.dist, map_location=map_location,
                               config=config or self.restore_config,
                               storage_config=self.run.config,
                               **extra)
        md = r.metadata if isinstance(r.metadata, dict) else {}
        return RestoreResult(state=r.state, rank_state=r.rank_state, checkpoint=name,
                             uri=r.checkpoint, metadata=md, epoch=md.get("epoch"),
                             num_updates=md.get("num_updates"), restored=r)
