"""What each rank fills, as boxes of the checkpoint's global tensors (the box model).

The checkpoint's side: :func:`saved_tensors` sees every tensor of a state item as a global
tensor made of saved chunks (a version-2 item's own, or one whole chunk per tensor record of
a version-1 item, so every checkpoint is read one way).  This rank's side:
:func:`plan_rank_requests` matches the leaves of ``into`` (plain tensors, DTensor local
shards, torch_xla SPMD device shards) to them by key path and lists the boxes this rank
fills (:class:`~xla_ckpt.io.chunked.BoxRequest`); :func:`read_requests` fills boxes from
storage, crc32c-checked.  The strategies that move the boxes are
:mod:`xla_ckpt.restore.sharded` (all_ranks), :mod:`xla_ckpt.restore.box_striped` and
:mod:`xla_ckpt.restore.box_broadcast`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from xla_ckpt.comm.base import Dist, describe_error
from xla_ckpt.errors import ConfigError, DistributedError, StateMismatchError
from xla_ckpt.format import typed
from xla_ckpt.format.chunks import Box, ChunkRecord, GlobalTensor, contiguous_strides
from xla_ckpt.format.dtypes import dtype_from_name, dtype_name
from xla_ckpt.format.manifest import Manifest, TensorRecord
from xla_ckpt.io import CheckpointReader
from xla_ckpt.io.chunked import BoxRequest, fresh_tensor, read_boxes
from xla_ckpt.restore.owners import tensor_paths
from xla_ckpt.sharded.value import ShardedValue
from xla_ckpt.sharded.views import for_restore, is_sharded

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


def describe_requests(requests: Sequence[BoxRequest]) -> list[list[Any]]:
    return [[r.tensor, list(r.box.offsets), list(r.box.sizes)] for r in requests]



def raise_agreed_mismatches(dist: Dist, every: list[list[str]], what: str) -> None:
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

