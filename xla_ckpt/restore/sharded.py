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
saved tensor is one chunk covering it (:func:`saved_tensors` builds those global tensors in
memory), so a DDP checkpoint restores into FSDP2 / tensor-parallel targets, each rank
reading only the rows of its shards.

Strategies (every rank calls :func:`restore_into` with the same arguments):

* ``all_ranks``: every rank reads its own boxes from storage;
* ``broadcast``: rank 0 collects every rank's boxes (one exchange of ``(global index,
  box)`` lists), reads them and sends each rank only its own, point to point, in rounds
  of at most ``bucket_size_bytes`` in flight (a box larger than that is cut into row
  ranges), so rank 0's extra memory stays near one bucket.  Ranks that ask for the same
  box in one round get one read.  When every rank asks for the same boxes (plain targets,
  or no ``into``: everything whole), rank 0 reads each round straight into its own
  destinations and one bucketed broadcast fills everyone's.

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

import concurrent.futures as cf
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from xla_ckpt.comm.base import Dist, describe_error
from xla_ckpt.comm.failures import is_broken_collective
from xla_ckpt.errors import (
    CollectiveTimeoutError,
    ConfigError,
    DistributedError,
    StateMismatchError,
    TargetsOverwrittenError,
)
from xla_ckpt.format import typed
from xla_ckpt.format.chunks import Box, ChunkRecord, GlobalTensor, contiguous_strides
from xla_ckpt.format.dtypes import dtype_from_name, dtype_name, itemsize
from xla_ckpt.format.manifest import Manifest, TensorRecord
from xla_ckpt.format.plan import MapLocation, materialize_item
from xla_ckpt.io import CheckpointReader
from xla_ckpt.io.chunked import BoxRequest, fresh_tensor, read_boxes
from xla_ckpt.restore.all_ranks import place
from xla_ckpt.restore.decide import Decision
from xla_ckpt.restore.owners import tensor_paths
from xla_ckpt.restore.result import Loaded, RestoreStats
from xla_ckpt.restore.select import ALL_RANKS, STRIPED
from xla_ckpt.sharded.value import ShardedValue
from xla_ckpt.sharded.views import for_restore, is_sharded
from xla_ckpt.storage import StorageConfig, open_storage

logger = logging.getLogger(__name__)

MIN_ROUND_BYTES_PER_RANK = 64 * 1024
"""Broadcast strategy, point to point: each rank's share of one round (of about
``bucket_size_bytes`` on rank 0) is at least this many bytes (64 KiB), so many ranks do not
make the rounds tiny."""

MAX_LISTED_MISMATCHES = 8


# ---- the checkpoint's side: global tensors -----------------------------------------------

@dataclass
class SavedTensors:
    """The tensors of one state item as global tensors (index ``g`` = position).

    Attributes:
        manifest: the manifest to read from; for a version-1 item a copy whose
            ``global_tensors`` are built in memory (one whole chunk per saved tensor).
        item: the state item's name.
        tree: its typed tree; ``{"$tensor": g}`` indexes :attr:`globals`.
        globals: the global tensors.
        by_key: global tensor key (the path at save) -> ``g``.
        strided: version 1 only: ``g`` -> the saved record of a tensor that is not
            C-contiguous (a transposed or expanded view saved with its strides); read
            through its storage span rather than by row ranges.
    """

    manifest: Manifest
    item: str
    tree: Any
    globals: list[GlobalTensor]
    by_key: dict[str, int]
    strided: dict[int, TensorRecord] = field(default_factory=dict)


def saved_tensors(manifest: Manifest, item: str) -> SavedTensors:
    """The global tensors of ``item``: the manifest's own (version 2, a chunked item), or one
    whole chunk per tensor record (version 1), so every checkpoint is read one way.

    Raises:
        CheckpointCorruptError: no item ``item`` (names it).
    """
    it = manifest.item(item)
    if it.chunked:
        gts = list(manifest.global_tensors)
        by_key = {g.key: i for i, g in enumerate(gts)}
        for k, g in tensor_paths(it.state).items():  # tied leaves: every key of one tensor
            by_key.setdefault(k, g)
        return SavedTensors(manifest, item, it.state, gts, by_key)
    gts = []
    strided: dict[int, TensorRecord] = {}
    for i, rec in enumerate(it.tensors):
        chunks: tuple[ChunkRecord, ...] = ()
        if rec.numel:
            chunks = (ChunkRecord(item, i, tuple(0 for _ in rec.shape), rec.shape),)
            if rec.stride != contiguous_strides(rec.shape):
                strided[i] = rec
        gts.append(GlobalTensor(rec.key, rec.dtype, rec.shape, chunks if i not in strided
                                else ()))
    view = dataclasses.replace(manifest, global_tensors=gts)
    return SavedTensors(view, item, it.state, gts, {g.key: i for i, g in enumerate(gts)},
                        strided)


# ---- this rank's side: targets and the boxes to fill -------------------------------------

@dataclass
class Target:
    """One leaf of ``into`` matched to global tensor ``g``."""

    key: str
    g: int
    live: Any
    view: ShardedValue


@dataclass
class RankRequests:
    """What this rank fills: its targets' boxes and fresh tensors for the leaves ``into`` lacks.

    Attributes:
        targets: matched leaves of ``into``.
        requests: every box this rank fills (targets first, then whole leaves).
        whole: ``g`` -> fresh CPU tensor of a saved leaf that ``into`` lacks.
        mismatches: one line per target that does not fit the checkpoint (empty when all fit).
        live: parallel to ``requests``: the target key when that request's ``out`` is the
            target's live memory (a CPU destination filled in place), else None (a staging
            tensor, or a fresh whole leaf).
        touched: keys of targets whose live memory this rank has begun to write (filled in
            as the restore goes, conservatively: before the write), for the error of a
            restore that fails half way.
    """

    targets: list[Target]
    requests: list[BoxRequest]
    whole: dict[int, torch.Tensor]
    mismatches: list[str]
    live: list[str | None] = field(default_factory=list)
    touched: set[str] = field(default_factory=set)

    def touch(self, indices: Sequence[int] | None = None) -> None:
        """Record that the live targets of ``requests[i]`` (every one when None) are about to
        be written."""
        for i in range(len(self.requests)) if indices is None else indices:
            if i < len(self.live) and self.live[i] is not None:
                self.touched.add(str(self.live[i]))

    @property
    def nbytes(self) -> int:
        """Bytes this rank's boxes hold (its own shards plus the whole leaves)."""
        return sum(r.out.numel() * r.out.element_size() for r in self.requests)


def tensor_leaves(into: Any) -> dict[str, Any]:
    """``into``'s tensor leaves by key path, as the saver names them (``state['model']['w']``).

    Paths come from the same walk the typed encoding makes at save
    (:func:`xla_ckpt.format.typed.encode`), so a leaf of ``into`` and the saved tensor at
    the same place have the same key.

    Raises:
        UnsupportedTypeError: ``into`` holds a value a checkpoint cannot hold (names it).
    """
    found: dict[str, Any] = {}

    def hook(t: torch.Tensor, path: tuple) -> int:
        found[typed.format_path(path)] = t
        return len(found) - 1

    typed.encode(into, hook)
    return found


def _used_globals(tree: Any, n: int) -> list[int]:
    used: list[int] = []

    def lookup(g: int) -> None:
        if 0 <= g < n:
            used.append(g)

    typed.decode(tree, lookup)
    return used


def plan_rank_requests(saved: SavedTensors, into: Any) -> RankRequests:
    """Match ``into``'s leaves to the checkpoint and list the boxes this rank fills.

    Pure apart from allocating the fresh tensors of leaves ``into`` lacks (and the staging
    tensors :func:`~xla_ckpt.sharded.views.for_restore` makes for non-CPU targets).  A
    target that does not fit adds a line to ``mismatches`` (no exception, so every rank can
    report its own before any of them raises).
    """
    leaves = tensor_leaves(into) if into is not None else {}
    mismatches: list[str] = []
    targets: list[Target] = []
    for key, live in leaves.items():
        g = saved.by_key.get(key)
        if g is None:
            mismatches.append(f"{key} is not in the checkpoint")
            continue
        gt = saved.globals[g]
        shape = [int(n) for n in live.shape]  # the global shape, for a DTensor too
        if shape != list(gt.shape) or dtype_name(live.dtype) != gt.dtype:
            mismatches.append(f"{key} is {gt.dtype}{list(gt.shape)} in the checkpoint but "
                              f"{dtype_name(live.dtype)}{shape} in the target")
            continue
        if not mismatches:  # staging tensors only once every target fits
            targets.append(Target(key, g, live, for_restore(live)))
    if mismatches:
        targets = []
    requests = [BoxRequest(t.g, s.box, s.tensor) for t in targets for s in t.view.shards]
    live_keys: list[str | None] = [t.key if t.view.finish is None else None
                                   for t in targets for _ in t.view.shards]
    wanted = {t.g for t in targets}
    whole: dict[int, torch.Tensor] = {}
    if not mismatches:
        for g in _used_globals(saved.tree, len(saved.globals)):
            if g in wanted or g in whole:
                continue
            gt = saved.globals[g]
            out = fresh_tensor(gt.shape, dtype_from_name(gt.dtype, where=gt.key))
            whole[g] = out
            if out.numel():
                requests.append(BoxRequest(g, Box.whole(gt.shape), out, fresh=True))
    live_keys += [None] * (len(requests) - len(live_keys))
    return RankRequests(targets, requests, whole, mismatches, live_keys)


# ---- reading -----------------------------------------------------------------------------

def _fetched(rec_length: int, chunk: int, has_chunks: bool, start: int, length: int) -> int:
    if not has_chunks:
        return rec_length
    return min(rec_length, -(-(start + length) // chunk) * chunk) - (start // chunk) * chunk


def _read_strided(reader: CheckpointReader, saved: SavedTensors, req: BoxRequest) -> int:
    """A box of a version-1 tensor saved with its strides: read its storage span, copy out."""
    rec = saved.strided[req.tensor]
    dtype = dtype_from_name(rec.dtype, where=rec.key)
    span = rec.span_bytes()
    raw = reader.read_blob_range(saved.item, rec.blob, rec.byte_offset, span).clone()
    src = raw.view(dtype).as_strided(rec.shape, rec.stride)
    with torch.no_grad():
        req.out.copy_(src[req.box.slices()])
    blob = saved.manifest.item(saved.item).blobs[rec.blob]
    return _fetched(blob.length, blob.chunk_size, bool(blob.chunk_crc32c), rec.byte_offset, span)


def read_requests(reader: CheckpointReader, saved: SavedTensors,
                  requests: Sequence[BoxRequest]) -> int:
    """Fill every request's ``out`` from storage, crc32c-checked; returns bytes fetched.

    Raises:
        IntegrityError / CheckpointCorruptError / StorageError: from the reads (naming the
            key and the object).
    """
    ranged = [r for r in requests if r.tensor not in saved.strided]
    fetched = read_boxes(reader, ranged) if ranged else 0
    for r in requests:
        if r.tensor in saved.strided:
            fetched += _read_strided(reader, saved, r)
    return fetched


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


# ---- the two strategies -----------------------------------------------------------------

def _raise_agreed_mismatches(dist: Dist, every: list[list[str]], what: str) -> None:
    """One StateMismatchError (the same on every rank) if any rank's list in ``every`` (rank
    -> its mismatch lines, as exchanged) is not empty."""
    bad = {r: m for r, m in enumerate(every) if m}
    if not bad:
        return
    first = next(iter(bad.values()))
    if len(bad) == dist.world_size and all(m == first for m in bad.values()):
        where, lines = "every rank", first
    else:
        where = f"rank(s) {', '.join(str(r) for r in sorted(bad))}"
        lines = [f"rank {r}: {line}" for r, m in sorted(bad.items()) for line in m]
    shown = lines[:MAX_LISTED_MISMATCHES]
    more = f"; ... ({len(lines) - len(shown)} more)" if len(lines) > len(shown) else ""
    raise StateMismatchError(
        f"{what}: the targets passed as into= do not fit the checkpoint on {where}: "
        f"{'; '.join(shown)}{more}. Build the model and optimizer as they were saved (same "
        "keys, global shapes and dtypes; the mesh and placements may differ)")


def restore_into(decision: Decision, dist: Dist, *, into: Any, strategy: str, item: str,
                 map_location: MapLocation, storage_config: StorageConfig | None,
                 bucket_size_bytes: int, what: str) -> Loaded:
    """Restore the state item into ``into``'s tensor leaves on every rank, onto any mesh.

    Every rank calls it with its own ``into`` (the same keys on every rank; the values are
    this rank's live objects).  See the module docstring.

    Args:
        decision: the agreed checkpoint and manifest.
        into: a state tree whose tensor leaves (plain, DTensor, XLAShardedTensor) are the
            targets, e.g. ``{"model": get_model_state_dict(m), "optim":
            get_optimizer_state_dict(m, o)}``; None: every saved tensor comes back whole.
        strategy: ``"all_ranks"``, ``"striped"`` or ``"broadcast"``.
        item: the state item.
        map_location: where the leaves ``into`` lacks are placed (targets stay where they are).
        bucket_size_bytes: broadcast only: bytes rank 0 has in flight per round.

    Returns:
        :class:`Loaded` whose ``state`` is the saved tree with every target leaf replaced by
        its (filled) live object and the other tensors whole; ``stats.bytes_read`` = bytes
        this rank fetched from storage, ``stats.shard_bytes`` = bytes of its own boxes.

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
    t0 = time.perf_counter()
    saved = saved_tensors(decision.manifest, item)
    mine, tree, needs_finish = _plan_everywhere(dist, saved, into, map_location, what)
    stats = RestoreStats(shard_bytes=mine.nbytes)
    try:
        if strategy == ALL_RANKS:
            def read_mine() -> int:
                storage = open_storage(decision.checkpoint, storage_config)
                try:
                    reader = CheckpointReader(storage, saved.manifest)
                    mine.touch()  # the boxes go straight into the live targets
                    return read_requests(reader, saved, mine.requests)
                finally:
                    storage.close()

            stats.bytes_read = dist.run_collectively(read_mine,
                                                     f"{what}: read this rank's boxes")
            stats.read_seconds = time.perf_counter() - t0
        elif strategy == STRIPED:
            _striped_boxes(decision, dist, saved, mine, storage_config, bucket_size_bytes,
                           what, stats)
            stats.read_seconds = time.perf_counter() - t0
        else:
            _Broadcast(decision, dist, saved, mine, storage_config, bucket_size_bytes, what,
                       stats).run()
        if needs_finish:  # else every rank's targets were filled in place: nothing to copy
            dist.run_collectively(lambda: _finish(mine), f"{what}: copy into the targets")
    except CollectiveTimeoutError:
        raise  # a rank died or hung: no further exchange can complete
    except DistributedError as e:  # every rank got it at the same step: one more exchange
        if not is_broken_collective(e):  # the group is unusable: no further exchange
            _raise_if_overwritten(dist, mine, e, what)
        raise
    if tree is None:  # leaves go to a device: only once they hold their bytes
        tree = dist.run_collectively(lambda: _state_tree(saved, mine, map_location),
                                     f"{what}: rebuild the state")
    return Loaded(state=tree.state, stats=stats)


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
    _raise_agreed_mismatches(dist, [a[1] for a in answers], what)
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


def agree_on_inputs(dist: Dist, into: Any, remap: bool) -> bool:
    """Every rank: check that every rank passes ``into`` (or none does) and a
    ``rank_state_remap`` hook (or none does); return whether any rank's ``into`` holds a
    DTensor or XLAShardedTensor leaf.  One small exchange.

    Raises:
        DistributedError: on every rank, when some rank's ``into`` holds a value a
            checkpoint cannot hold (``failures`` names the rank and the key path).
        StateMismatchError: on every rank, when some ranks pass ``into`` and others do not.
        ConfigError: on every rank, when some ranks pass ``rank_state_remap`` and others do
            not.  (Either would make the ranks' collectives differ.)
    """
    def describe() -> list[bool]:
        return [into is not None,
                into is not None and any(is_sharded(v) for v in tensor_leaves(into).values()),
                bool(remap)]

    what = "restore: look at the targets passed as into="
    if dist.world_size == 1:
        every = [describe()]
    else:  # one exchange carries the answers and a failure (a tree the encoding cannot walk)
        error: BaseException | None = None
        try:
            mine = describe()
        except Exception as e:  # noqa: BLE001 - reported to every rank just below
            error, mine = e, [False, False, False]
        answers = dist.exchange([mine, None if error is None else describe_error(error)])
        failures = {r: a[1] for r, a in enumerate(answers) if a[1] is not None}
        if failures:
            raise DistributedError(f"{what} failed on rank(s) "
                                   f"{', '.join(str(r) for r in sorted(failures))}",
                                   failures) from error
        every = [a[0] for a in answers]

    def split(i: int) -> tuple[str, str]:
        yes = [str(r) for r, m in enumerate(every) if m[i]]
        no = [str(r) for r, m in enumerate(every) if not m[i]]
        return ", ".join(yes), ", ".join(no) if yes else ""

    given, missing = split(0)
    if given and missing:
        raise StateMismatchError(
            f"restore(into=...) was given on rank(s) {given} but not on rank(s) {missing}; "
            "every rank passes its own targets, or none does")
    given, missing = split(2)
    if given and missing:
        raise ConfigError(
            f"restore(rank_state_remap=...) was given on rank(s) {given} but not on rank(s) "
            f"{missing}; pass the same hook on every rank")
    return any(m[1] for m in every)


# ---- striped: the ranks that need the same box split its rows, then exchange them -------

@dataclass(frozen=True)
class _Block:
    """Rows ``[lo, hi)`` of request ``index`` of ``rank``: read by ``rank``, sent to others."""

    rank: int
    index: int
    lo: int
    hi: int


def _replica_blocks(every: list[list[list[Any]]], unit_rows: Callable[[int, tuple], int]
                    ) -> tuple[dict[int, list[_Block]], list[tuple[_Block, list[_Block]]],
                               dict[int, list[tuple[int, int]]]]:
    """From every rank's described requests: each rank's blocks to read, each block with the
    other holders' blocks it fills, and each rank's local copies.

    Ranks that request the same box of the same global tensor (replicas: plain targets,
    replicated DTensor placements, HSDP) split its rows as evenly as they can in rank
    order, in whole units of ``unit_rows(g, sizes)`` rows (the rows of one crc32c chunk,
    so no two holders fetch the same chunk); a box of one unit, a 0-d box and a box only
    one rank needs is read whole by its first holder.  A rank with several requests for
    one box (keys tied at save, restored into separate targets) reads and receives into
    the first and copies it into the others (``copies[rank]``: ``(from, to)`` request
    indices, after the exchange).  Pure: every rank computes the same answer.
    """
    holders: dict[tuple, list[tuple[int, int]]] = {}
    for rank, desc in enumerate(every):
        for index, (g, offsets, sizes) in enumerate(desc):
            holders.setdefault((g, tuple(offsets), tuple(sizes)), []).append((rank, index))
    reads: dict[int, list[_Block]] = {r: [] for r in range(len(every))}
    sends: list[tuple[_Block, list[_Block]]] = []
    copies: dict[int, list[tuple[int, int]]] = {r: [] for r in range(len(every))}
    for (g, _, sizes), hs in sorted(holders.items(), key=lambda kv: kv[0]):
        first: dict[int, int] = {}
        for r, j in hs:
            if r in first:
                copies[r].append((first[r], j))
            else:
                first[r] = j
        ranks = list(first.items())
        rows = sizes[0] if sizes else 1
        unit = max(1, unit_rows(g, sizes)) if sizes else 1
        units = -(-rows // unit)
        k = max(1, min(len(ranks), units))
        for i in range(k):
            lo, hi = min(rows, units * i // k * unit), min(rows, units * (i + 1) // k * unit)
            rank, index = ranks[i]
            block = _Block(rank, index, lo, hi)
            reads[rank].append(block)
            others = [_Block(r, j, lo, hi) for r, j in ranks if r != rank]
            if others:
                sends.append((block, others))
    return reads, sends, copies


def _unit_rows(saved: SavedTensors) -> Callable[[int, tuple], int]:
    """Rows of a box of global tensor ``g`` that one crc32c chunk holds (all of them for a
    tensor read through its storage span)."""
    chunk = max((b.chunk_size for it in saved.manifest.items.values() for b in it.blobs
                 if b.chunk_crc32c), default=0)

    def rows(g: int, sizes: tuple) -> int:
        if g in saved.strided or not chunk:
            return sizes[0] if sizes else 1
        row = itemsize(dtype_from_name(saved.globals[g].dtype, where=saved.globals[g].key))
        for n in sizes[1:]:
            row *= n
        return -(-chunk // max(row, 1))

    return rows


def _rows(out: torch.Tensor, block: _Block) -> torch.Tensor:
    return out if out.dim() == 0 else out[block.lo:block.hi]


def _striped_boxes(decision: Decision, dist: Dist, saved: SavedTensors, mine: RankRequests,
                   storage_config: StorageConfig | None, bucket_size_bytes: int, what: str,
                   stats: RestoreStats) -> None:
    """Every rank: fetch each box once per job and exchange rows among the box's holders.

    One exchange of every rank's box list; each rank reads its share of rows of every box
    it holds (straight into its targets, checked); then, in one global order of (sender,
    receiver) pairs the same on every rank, each block goes point to point to the other
    holders of its box (buckets of ``bucket_size_bytes``).  A box only one rank holds (a
    fully sharded FSDP2 shard) is read by it alone and never moves.
    """
    every = dist.exchange(_describe(mine.requests))
    reads, sends, copies = _replica_blocks(every, _unit_rows(saved))
    me = dist.rank

    def read_mine() -> int:
        reqs = [BoxRequest(mine.requests[b.index].tensor,
                           _sub_box(mine.requests[b.index].box, b),
                           _rows(mine.requests[b.index].out, b), mine.requests[b.index].fresh)
                for b in reads[me]]
        if not reqs:
            return 0
        storage = open_storage(decision.checkpoint, storage_config)
        try:
            reader = CheckpointReader(storage, saved.manifest)
            mine.touch([b.index for b in reads[me]])
            return read_requests(reader, saved, reqs)
        finally:
            storage.close()

    stats.bytes_read = dist.run_collectively(read_mine, f"{what}: read this rank's rows")
    pairs: dict[tuple[int, int], list[tuple[_Block, _Block]]] = {}
    for block, others in sends:
        for o in others:
            pairs.setdefault((block.rank, o.rank), []).append((block, o))

    def exchange() -> int:
        moved = 0
        for (src, dst), items in sorted(pairs.items()):
            if me == src:
                moved += dist.send_tensors(
                    [_rows(mine.requests[b.index].out, b).contiguous() for b, _ in items],
                    dst, bucket_size_bytes)
            elif me == dst:
                outs = [_rows(mine.requests[o.index].out, o) for _, o in items]
                mine.touch([o.index for _, o in items])
                bufs = [t if t.is_contiguous() else torch.empty_like(t, memory_format=
                                                                     torch.contiguous_format)
                        for t in outs]
                n = dist.recv_tensors(bufs, src, bucket_size_bytes)
                stats.bytes_received += n
                with torch.no_grad():
                    for t, buf in zip(outs, bufs, strict=True):
                        if buf is not t:
                            t.copy_(buf)
        if copies[me]:  # the same box in two targets of this rank: one read, one copy
            mine.touch([j for _, j in copies[me]])
            with torch.no_grad():
                for i, j in copies[me]:
                    mine.requests[j].out.copy_(mine.requests[i].out)
        return moved

    stats.bytes_sent = dist.run_collectively(exchange, f"{what}: exchange rows between holders")


def _sub_box(box: Box, block: _Block) -> Box:
    if box.ndim == 0:
        return box
    return Box((box.offsets[0] + block.lo,) + box.offsets[1:],
               (block.hi - block.lo,) + box.sizes[1:])


# ---- broadcast: rank 0 reads every rank's boxes and sends each its own ------------------

@dataclass(frozen=True)
class _Piece:
    """A part of request ``index`` of one rank: rows ``[lo, hi)`` of its box (all of a 0-d)."""

    index: int
    g: int
    box: Box
    lo: int
    hi: int
    nbytes: int


def _split(index: int, g: int, box: Box, isz: int, budget: int) -> list[_Piece]:
    """Cut a box into row ranges of at most ``budget`` bytes each (at least one row)."""
    nbytes = box.numel * isz
    if box.ndim == 0 or nbytes <= budget or box.sizes[0] <= 1:
        return [_Piece(index, g, box, 0, box.sizes[0] if box.ndim else 1, nbytes)]
    row = nbytes // box.sizes[0]
    step = max(1, budget // max(row, 1))
    out = []
    for lo in range(0, box.sizes[0], step):
        hi = min(lo + step, box.sizes[0])
        sub = Box((box.offsets[0] + lo,) + box.offsets[1:], (hi - lo,) + box.sizes[1:])
        out.append(_Piece(index, g, sub, lo, hi, (hi - lo) * row))
    return out


def _batches(pieces: list[_Piece], budget: int) -> list[list[_Piece]]:
    """Consecutive pieces grouped into batches of at most ``budget`` bytes (or one piece)."""
    out: list[list[_Piece]] = []
    size = 0
    for p in pieces:
        if not out or (out[-1] and size + p.nbytes > budget):
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.nbytes
    return out


def _describe(requests: Sequence[BoxRequest]) -> list[list[Any]]:
    return [[r.tensor, list(r.box.offsets), list(r.box.sizes)] for r in requests]


class _Broadcast:
    """Rank 0 reads and sends each rank its boxes; every rank runs every round in order.

    Rank 0 reads round ``k + 1`` on a helper thread while round ``k`` travels (so at most
    two rounds of read bytes are held); each round starts with one agreement step on how
    its read went, so a failed read stops every rank before any unchecked byte moves.
    """

    def __init__(self, decision: Decision, dist: Dist, saved: SavedTensors, mine: RankRequests,
                 storage_config: StorageConfig | None, bucket_size_bytes: int, what: str,
                 stats: RestoreStats) -> None:
        self.decision, self.dist, self.saved, self.mine = decision, dist, saved, mine
        self.storage_config, self.what, self.stats = storage_config, what, stats
        self.bucket_size_bytes = bucket_size_bytes
        # point to point: each rank's share of a round, so rank 0 holds about one bucket
        self.budget = max(bucket_size_bytes // max(dist.world_size - 1, 1),
                          MIN_ROUND_BYTES_PER_RANK)

    def _pieces(self, desc: list[list[Any]]) -> list[_Piece]:
        out: list[_Piece] = []
        for i, (g, offsets, sizes) in enumerate(desc):
            gt = self.saved.globals[int(g)]
            isz = itemsize(dtype_from_name(gt.dtype, where=gt.key))
            out.extend(_split(i, int(g), Box(tuple(offsets), tuple(sizes)), isz, self.budget))
        return out

    def run(self) -> None:
        dist, stats, what = self.dist, self.stats, self.what
        every = dist.exchange(_describe(self.mine.requests))
        replicated = all(d == every[0] for d in every)
        reader: CheckpointReader | None = None
        t0 = time.perf_counter()

        def open_reader() -> CheckpointReader | None:
            if dist.rank != 0:
                return None
            return CheckpointReader(open_storage(self.decision.checkpoint, self.storage_config),
                                    self.saved.manifest)

        try:
            reader = dist.run_collectively(open_reader, f"{what}: rank 0 opens the checkpoint")
            if replicated:  # every rank fills the same boxes: one broadcast carries them
                batches = _batches(self._pieces(every[0]), self.bucket_size_bytes)
                staged = [self._outputs(b) for b in batches]
                rounds = len(batches)
                self._pipeline(rounds, reader,
                               lambda k, rd: self._read_into_own(rd, batches[k], staged[k][0]),
                               lambda k, _got: self._broadcast_round(batches[k], staged[k]))
            else:
                def read_own() -> None:
                    if reader is not None:
                        self.mine.touch()
                        stats.bytes_read += read_requests(reader, self.saved,
                                                          self.mine.requests)

                dist.run_collectively(read_own, f"{what}: rank 0 reads its own boxes")
                plans = {r: _batches(self._pieces(d), self.budget)
                         for r, d in enumerate(every) if r}
                rounds = max((len(b) for b in plans.values()), default=0)
                mine = plans.get(dist.rank, [])
                self._pipeline(rounds, reader, lambda k, rd: self._read_for_others(rd, plans, k),
                               lambda k, got: self._scatter_round(
                                   mine[k] if dist.rank and k < len(mine) else [], got))
        finally:
            if reader is not None:
                reader.storage.close()
        stats.read_seconds = time.perf_counter() - t0
        logger.debug("rank %d: %s: %d rounds (%s), %d bytes read, %d sent, %d received",
                     dist.rank, what, rounds,
                     "one broadcast each" if replicated else "point to point", stats.bytes_read,
                     stats.bytes_sent, stats.bytes_received)

    def _pipeline(self, rounds: int, reader: CheckpointReader | None,
                  read: Callable[[int, CheckpointReader], Any],
                  move: Callable[[int, Any], None]) -> None:
        """Every rank: for each round, agree on rank 0's read of it, then ``move`` it; rank 0
        reads the next round on a helper thread meanwhile."""
        pool = cf.ThreadPoolExecutor(1, thread_name_prefix="xla_ckpt-rank0-boxes") \
            if reader is not None and rounds else None
        try:
            nxt = pool.submit(read, 0, reader) if pool is not None and reader is not None \
                else None
            for k in range(rounds):
                got: Any = None
                error: BaseException | None = None
                if nxt is not None:
                    try:
                        got = nxt.result()
                    except Exception as e:  # noqa: BLE001 - reported to every rank just below
                        error = e
                    nxt = None
                    if error is None and k + 1 < rounds and pool is not None \
                            and reader is not None:
                        nxt = pool.submit(read, k + 1, reader)
                self.dist.agree(error, f"{self.what}: rank 0 reads the boxes of round "
                                       f"{k + 1} of {rounds}")
                move(k, got)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def _outputs(self, batch: list[_Piece]) -> tuple[list[torch.Tensor], Callable[[], None]]:
        """Contiguous destinations of a batch's pieces (staged when the target is not), and
        the copy-back of the staged ones once they hold the bytes."""
        outs: list[torch.Tensor] = []
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p in batch:
            out = self.mine.requests[p.index].out
            view = out if out.dim() == 0 else out[p.lo:p.hi]
            if not view.is_contiguous():
                tmp = torch.empty(tuple(view.shape), dtype=view.dtype)
                staged.append((view, tmp))
                view = tmp
            outs.append(view)

        def copy_back() -> None:
            with torch.no_grad():
                for dst, tmp in staged:
                    dst.copy_(tmp)

        return outs, copy_back

    def _read_into_own(self, reader: CheckpointReader, batch: list[_Piece],
                       outs: list[torch.Tensor]) -> None:
        """Rank 0, replicated boxes: read a batch straight into its own destinations."""
        mine = self.mine.requests
        self.mine.touch([p.index for p in batch])
        self.stats.bytes_read += read_requests(
            reader, self.saved, [BoxRequest(p.g, p.box, o, fresh=mine[p.index].fresh)
                                 for p, o in zip(batch, outs, strict=True)])

    def _broadcast_round(self, batch: list[_Piece],
                         staged: tuple[list[torch.Tensor], Callable[[], None]]) -> None:
        outs, copy_back = staged
        if self.dist.rank:  # rank 0's own were read in place (_read_into_own)
            self.mine.touch(sorted({p.index for p in batch}))
        n = self.dist.broadcast_tensors(outs, src=0, bucket_size_bytes=self.bucket_size_bytes,
                                        check_layout=False)  # every rank planned the same batch
        if self.dist.rank:
            self.stats.bytes_received += n
        copy_back()

    def _read_for_others(self, reader: CheckpointReader, plans: dict[int, list[list[_Piece]]],
                         k: int) -> dict[int, list[torch.Tensor]]:
        """Rank 0: the pieces of round ``k`` of every other rank, read once per distinct box."""
        inputs: dict[int, list[torch.Tensor]] = {}
        cache: dict[tuple, torch.Tensor] = {}
        todo: list[BoxRequest] = []
        for r, batches in plans.items():
            if k >= len(batches):
                continue
            tensors = []
            for p in batches[k]:
                key = (p.g, p.box.offsets, p.box.sizes)
                t = cache.get(key)
                if t is None:
                    gt = self.saved.globals[p.g]
                    t = cache[key] = torch.empty(p.box.sizes,
                                                 dtype=dtype_from_name(gt.dtype, where=gt.key))
                    todo.append(BoxRequest(p.g, p.box, t, fresh=True))
                tensors.append(t)
            inputs[r] = tensors
        self.stats.bytes_read += read_requests(reader, self.saved, todo)
        return inputs

    def _scatter_round(self, batch: list[_Piece], inputs: dict[int, list[torch.Tensor]] | None
                       ) -> None:
        dist, stats = self.dist, self.stats
        outputs, copy_back = self._outputs(batch)
        self.mine.touch(sorted({p.index for p in batch}))
        n = dist.scatter_tensors(outputs, inputs if dist.rank == 0 else None, src=0,
                                 bucket_size_bytes=self.budget)
        if dist.rank == 0:
            stats.bytes_sent += n
        else:
            stats.bytes_received += n
        copy_back()


# ---- per-rank items read by every rank (the remap hook) ---------------------------------

def read_items_everywhere(decision: Decision, dist: Dist, items: Sequence[str], *,
                          strategy: str, map_location: MapLocation,
                          storage_config: StorageConfig | None, bucket_size_bytes: int,
                          what: str) -> dict[str, Any]:
    """Every rank: the states of ``items`` (small items: per-rank iterator/RNG state).

    ``all_ranks``: every rank reads them; ``broadcast``: rank 0 reads them and broadcasts
    the blob bytes (sizes from the manifest), every rank rebuilds them.

    Raises:
        DistributedError: a read or rebuild failed on some rank (names it).
    """
    manifest = decision.manifest
    names = list(items)

    def alloc() -> dict[str, dict[int, torch.Tensor]]:
        return {n: {i: torch.empty(b.length, dtype=torch.uint8)
                    for i, b in enumerate(manifest.item(n).blobs)} for n in names}

    bufs = dist.run_collectively(alloc, f"{what}: allocate the per-rank items")

    def read() -> None:
        if strategy != ALL_RANKS and dist.rank != 0:
            return  # rank 0 reads, the broadcast below brings the bytes
        storage = open_storage(decision.checkpoint, storage_config)
        try:
            reader = CheckpointReader(storage, manifest)
            for n in names:
                reader.read_into(n, bufs[n])
        finally:
            storage.close()

    dist.run_collectively(read, f"{what}: read the per-rank items")
    if strategy != ALL_RANKS:
        flat = [bufs[n][i] for n in names for i in sorted(bufs[n])]
        dist.broadcast_tensors(flat, src=0, bucket_size_bytes=bucket_size_bytes,
                               check_layout=False)

    def build() -> dict[str, Any]:
        return {n: materialize_item(manifest.item(n), bufs[n], map_location) for n in names}

    return dist.run_collectively(build, f"{what}: rebuild the per-rank items")


def remap_rank_state(dist: Dist, hook: Callable[[dict[int, Any], int, int], Any],
                     saved: dict[int, Any], what: str) -> Any:
    """Every rank: ``hook(saved, rank, world_size)``; a failure on any rank reaches all."""
    return dist.run_collectively(lambda: hook(saved, dist.rank, dist.world_size),
                                 f"{what}: rank_state_remap")
