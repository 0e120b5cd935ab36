"""Restore into live targets by byte range, onto any mesh (``restore(uri, into=...)``).

Every rank describes what it holds of each target leaf of ``into`` (plain tensors,
DTensor local shards, torch_xla SPMD device shards) as boxes of the global tensor
(:func:`xla_ckpt.sharded.views.for_restore`), matches the leaf to the checkpoint's global
tensor by its key path (:func:`xla_ckpt.format.typed.format_path`, the path it had at
save), and fills each box from the saved chunks that overlap it
(:func:`xla_ckpt.io.chunked.read_boxes`: only the overlapping byte ranges are fetched,
every byte crc32c-checked before it lands).  Targets are filled in place (a CPU DTensor's
local tensor is the destination itself); other devices get a CPU staging tensor and
``finish()`` copies it into place.  Saved tensors that ``into`` lacks come back whole.

A version-1 checkpoint (plain tensors, e.g. saved by a DDP job) is read the same way: each
saved tensor is one chunk covering it (:func:`~xla_ckpt.restore.targets.saved_tensors`
builds those global tensors in memory), so a DDP checkpoint restores into FSDP2 /
tensor-parallel targets, each rank reading only the rows of its shards.

Strategies (every rank calls :func:`restore_into` with the same arguments):

* ``all_ranks``: every rank reads its own boxes from storage;
* ``striped``: each box fetched once per job, the reads balanced over its holders and the
  rows exchanged between them (:mod:`xla_ckpt.restore.box_striped`);
* ``broadcast``: rank 0 reads and sends each rank its own boxes
  (:mod:`xla_ckpt.restore.box_broadcast`).

:func:`move_boxes` is the one box mover of the engine (:mod:`xla_ckpt.restore.engine`): the
per-rank items and ZeRO partitions (:mod:`xla_ckpt.restore.private`) go through it too.

Failures: a target the checkpoint lacks, or whose global shape or dtype differs, is one
:class:`~xla_ckpt.errors.StateMismatchError` on every rank naming the rank(s) and keys,
before anything is read.  A read or copy failure anywhere reaches every rank as one error
naming the failed rank(s) and the cause.  Its class says whether the live targets were
touched: with ``all_ranks`` every rank reads straight into its live targets (and checks the
bytes there), with ``broadcast`` rank 0 reads into its own and the others receive round by
round, so by the time a rank fails others may already hold this checkpoint's values.  When
any rank had begun writing any live target, EVERY rank raises
:class:`~xla_ckpt.errors.TargetsOverwrittenError` (a
:class:`~xla_ckpt.errors.PartiallyOverwrittenError` and a
:class:`~xla_ckpt.errors.DistributedError`) naming the ranks whose targets were (possibly
partially) overwritten and this rank's keys: restore again into every rank's targets, or
re-initialise them.  A plain :class:`~xla_ckpt.errors.DistributedError` means no rank's
target memory was written (targets staged for a copy, e.g. XLA or non-contiguous ones, are
written only by the last step).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from xla_ckpt.comm.base import Dist, describe_error
from xla_ckpt.comm.failures import is_broken_collective
from xla_ckpt.errors import CollectiveTimeoutError, DistributedError, TargetsOverwrittenError
from xla_ckpt.format import typed
from xla_ckpt.format.plan import MapLocation
from xla_ckpt.io import CheckpointReader
from xla_ckpt.restore.box_broadcast import BoxBroadcast
from xla_ckpt.restore.box_striped import FlatExchange, striped_boxes
from xla_ckpt.restore.decide import Decision
from xla_ckpt.restore.private import place
from xla_ckpt.restore.result import RestoreStats
from xla_ckpt.restore.select import ALL_RANKS, BROADCAST, STRIPED
from xla_ckpt.restore.targets import (
    MAX_LISTED_MISMATCHES,
    RankRequests,
    SavedTensors,
    plan_rank_requests,
    raise_agreed_mismatches,
    read_requests,
)
from xla_ckpt.storage import StorageConfig

logger = logging.getLogger(__name__)


def _finish(mine: RankRequests) -> None:
    for t in mine.targets:
        if t.view.finish is not None:
            mine.touched.add(t.key)
            t.view.finish()


def _state_tree(saved: SavedTensors, mine: RankRequests, map_location: MapLocation) -> Any:
    """The saved tree with each target replaced by its live object, other leaves whole."""
    live = {t.g: t.live for t in mine.targets}

    def lookup(g: int) -> Any:
        if g in live:
            return live[g]
        return place(mine.whole[g], map_location, saved.globals[g].key)

    return typed.decode(saved.tree, lookup)



def move_boxes(decision: Decision, dist: Dist, saved: SavedTensors, mine: RankRequests, *,
               strategy: str, storage_config: StorageConfig | None, bucket_size_bytes: int,
               what: str, stats: RestoreStats, flat: FlatExchange | None = None) -> None:
    """Every rank: fill ``mine``'s boxes with ``strategy``, adding to ``stats``.

    ``all_ranks``: each rank reads its own; ``striped``: each box fetched once per job, the
    reads balanced over its holders, rows exchanged (:mod:`xla_ckpt.restore.box_striped`);
    ``broadcast``: rank 0 reads and sends (:mod:`xla_ckpt.restore.box_broadcast`).
    ``flat``: striped, for boxes every rank requests alike in one flat buffer per member
    (the replicated state's blobs, :mod:`xla_ckpt.restore.blobs`).

    Raises:
        DistributedError: on every rank when a read or exchange failed somewhere.
    """
    t0 = time.perf_counter()
    if strategy == STRIPED:
        striped_boxes(decision, dist, saved, mine, storage_config, bucket_size_bytes, what,
                      stats, flat)
    elif strategy == BROADCAST:
        BoxBroadcast(decision, dist, saved, mine, storage_config, bucket_size_bytes, what,
                     stats).run()
        return
    else:
        def read_mine() -> int:
            if not mine.requests:
                return 0
            storage = decision.open(storage_config)
            try:
                reader = CheckpointReader(storage, saved.manifest)
                mine.touch()  # the boxes go straight into the live targets
                return read_requests(reader, saved, mine.requests)
            finally:
                storage.close()

        stats.bytes_read += dist.run_collectively(read_mine, f"{what}: read this rank's boxes")
    stats.read_seconds += time.perf_counter() - t0


def restore_into(decision: Decision, dist: Dist, *, saved: SavedTensors, into: Any,
                 strategy: str, map_location: MapLocation, storage_config: StorageConfig | None,
                 bucket_size_bytes: int, what: str, stats: RestoreStats,
                 private: RankRequests | None = None, private_strategy: str = ALL_RANKS) -> Any:
    """Restore the state item into ``into``'s tensor leaves on every rank, onto any mesh.

    Every rank calls it with its own ``into`` (the same keys on every rank; the values are
    this rank's live objects).  See the module docstring.

    Args:
        decision: the agreed checkpoint and manifest.
        saved: the state item's global tensors (:func:`~xla_ckpt.restore.targets.
            saved_tensors`, with the private ones appended).
        into: a state tree whose tensor leaves (plain, DTensor, XLAShardedTensor) are the
            targets, e.g. ``{"model": get_model_state_dict(m), "optim":
            get_optimizer_state_dict(m, o)}``; None: every saved tensor comes back whole.
        strategy: ``"all_ranks"``, ``"striped"`` or ``"broadcast"``.
        map_location: where the leaves ``into`` lacks are placed (targets stay where they are).
        bucket_size_bytes: bytes in flight per round of an exchange.
        stats: this rank's figures, added to (``bytes_read``: bytes fetched from storage,
            ``shard_bytes``: bytes of its own boxes).
        private: this rank's per-rank and ZeRO boxes (:mod:`xla_ckpt.restore.private`),
            moved after the state's with ``private_strategy``.

    Returns:
        The saved tree with every target leaf replaced by its (filled) live object and the
        other tensors whole.

    Raises:
        StateMismatchError: on every rank, before anything is read, when a target is not in
            the checkpoint or has another global shape or dtype (names the rank(s) and keys).
        TargetsOverwrittenError: on every rank when a read or a copy failed somewhere after
            some rank's live targets were (possibly partially) written; names those ranks
            and (``keys``) this rank's written targets.  Restore again or re-initialise.
        DistributedError: on every rank when a read or a copy failed somewhere before any
            rank's live target memory was written (targets unchanged).
        CollectiveTimeoutError: a rank died or hung (targets in an unknown state).
    """
    mine, tree, needs_finish = _plan_everywhere(dist, saved, into, map_location, what)
    stats.shard_bytes += mine.nbytes
    kw: dict[str, Any] = {"storage_config": storage_config,
                          "bucket_size_bytes": bucket_size_bytes, "what": what, "stats": stats}
    try:
        move_boxes(decision, dist, saved, mine, strategy=strategy, **kw)
        if needs_finish:  # else every rank's targets were filled in place: nothing to copy
            dist.run_collectively(lambda: _finish(mine), f"{what}: copy into the targets")
        if private is not None:
            move_boxes(decision, dist, saved, private, strategy=private_strategy, **kw)
    except CollectiveTimeoutError:
        raise  # a rank died or hung: no further exchange can complete
    except DistributedError as e:  # every rank got it at the same step: one more exchange
        if not is_broken_collective(e):  # the group is unusable: no further exchange
            _raise_if_overwritten(dist, mine, e, what)
        raise
    if tree is None:  # leaves go to a device: only once they hold their bytes
        tree = dist.run_collectively(lambda: _state_tree(saved, mine, map_location),
                                     f"{what}: rebuild the state")
    return tree.state


@dataclass
class _Tree:
    state: Any


def _plan_everywhere(dist: Dist, saved: SavedTensors, into: Any, map_location: MapLocation,
                     what: str) -> tuple[RankRequests, _Tree | None, bool]:
    """Every rank: match its targets and plan its boxes, then ONE exchange carries every
    rank's outcome: a failure (DistributedError everywhere), its mismatches (one
    StateMismatchError everywhere) and whether it has targets staged for a copy
    (``finish``).  Returns this rank's requests, the rebuilt state tree when nothing has to
    move after the read (``map_location`` None: the tree holds the live targets and the
    fresh CPU tensors the read fills), and whether any rank needs the copy step.

    Raises:
        DistributedError: matching or planning failed on some rank (names the ranks).
        StateMismatchError: some rank's targets do not fit the checkpoint.
    """
    step = f"{what}: match the targets to the checkpoint"
    error: BaseException | None = None
    mine: RankRequests | None = None
    tree: _Tree | None = None
    try:
        mine = plan_rank_requests(saved, into)
        if map_location is None and not mine.mismatches:
            tree = _Tree(_state_tree(saved, mine, None))
    except DistributedError:
        raise
    except Exception as e:  # noqa: BLE001 - reported to every rank just below
        logger.debug("rank %d: %s failed locally: %s", dist.rank, step, describe_error(e))
        error = e
    answers = dist.exchange([
        None if error is None else describe_error(error),
        mine.mismatches[:MAX_LISTED_MISMATCHES + 1] if mine is not None else [],
        mine is not None and any(t.view.finish is not None for t in mine.targets)])
    failures = {r: a[0] for r, a in enumerate(answers) if a[0] is not None}
    if failures:
        ranks = ", ".join(str(r) for r in sorted(failures))
        raise DistributedError(f"{step} failed on rank(s) {ranks} of {dist.world_size} "
                               f"(reported on rank {dist.rank})", failures) from error
    raise_agreed_mismatches(dist, [a[1] for a in answers], what)
    assert mine is not None  # no failure anywhere, this rank's included
    return mine, tree, any(bool(a[2]) for a in answers)


def _raise_if_overwritten(dist: Dist, mine: RankRequests, error: DistributedError,
                          what: str) -> None:
    """Every rank, after a failed read or copy: one exchange of which live targets each rank
    had begun to write; when any had, raise :class:`TargetsOverwrittenError` on every rank
    (naming those ranks and this rank's keys), else return (the caller re-raises ``error``).
    """
    touched = sorted(mine.touched)
    every = dist.exchange([len(touched), len(mine.targets)])
    overwritten = {r: int(n) for r, (n, _) in enumerate(every) if n}
    if not overwritten:
        return
    ranks = ", ".join(f"{r} ({n} of {every[r][1]} targets)" for r, n in sorted(overwritten.items()))
    failed = ", ".join(str(r) for r in sorted(error.failures)) or "?"
    shown = touched[:MAX_LISTED_MISMATCHES]
    more = f", ... ({len(touched) - len(shown)} more)" if len(touched) > len(shown) else ""
    here = (f"this rank ({dist.rank}): {', '.join(shown)}{more}" if touched
            else f"this rank ({dist.rank}): none")
    detail = "; ".join(f"rank {r}: {c}" for r, c in sorted(error.failures.items()))
    raise TargetsOverwrittenError(
        f"{what}: restore into the live targets failed on rank(s) {failed} after the targets "
        f"passed as into= were (possibly partially) overwritten on rank(s) {ranks}; "
        f"overwritten on {here}. The targets now hold a mix of this checkpoint's values and "
        "their old ones (and, where a check failed, bytes that did not pass it): do not use "
        "them; restore again into every rank's targets (this checkpoint once repaired, or "
        "another one) or re-initialise them [" + detail + "]",
        error.failures, keys=tuple(touched), overwritten=overwritten) from error
