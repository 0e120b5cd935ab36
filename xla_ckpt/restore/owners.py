"""Save by owner: which rank writes which box of which global tensor, each byte once.

A state that holds sharded tensors (``DTensor`` from FSDP2 / tensor parallel, torch_xla
``XLAShardedTensor``) is saved as *chunked* global tensors (manifest version 2,
:mod:`xla_ckpt.format.chunks`): every rank writes the boxes it owns into its item
``chunks/<rank>``; rank 0 commits the state item whose ``{"$tensor": g}`` nodes index the
manifest's global tensors.  :func:`plan_chunked_save` decides all of it, collectively:

1. **Structure agreement, before anything is written.**  Every rank describes its state
   (:func:`xla_ckpt.restore.views.for_save` for each tensor leaf: global shape, dtype,
   placement, its boxes) and the ranks compare: the tensor keys, global shapes, dtypes,
   kinds (plain / DTensor / XLA) and placements, and the shape of the tree (containers and
   keys; non-tensor *values* are rank 0's, as for any replicated state).  A plain tensor is
   not declared sharded, so it must have the same key, shape and dtype on every rank.  Any
   difference is one :class:`~xla_ckpt.errors.DistributedError` on every rank whose
   ``failures`` name each differing rank and key, e.g. ``rank 1: has keys
   state['4.weight'], state['4.bias'] that rank 0 lacks`` or ``rank 1: passes state['w'] as
   a DTensor, rank 0 as a plain tensor``.  The sharded boxes must tile each global tensor.
   The common case costs one small all-gather (a crc32c digest of each rank's structure
   plus its boxes); the full structures travel only when the digests differ, to name the
   difference.
2. **Owners.**  A box held by one rank (a DTensor shard) is written by that rank.  A box
   held by several (a plain tensor, a ``Replicate()`` mesh dim, an SPMD replica) is written
   by exactly one of its holders: boxes are taken largest first (ties by tensor index and
   offsets) and each goes to the holder with the fewest planned bytes so far (ties: the
   lowest rank), after the single-holder boxes are counted -- DCP's save dedup and
   Megatron's fully parallel save do the same.  A replicated box larger than
   :data:`REPLICA_SPLIT_BYTES` is first cut along dim 0 into ``ceil(bytes /
   REPLICA_SPLIT_BYTES)`` row blocks (at most one per holder), so one large replicated
   tensor is written by several ranks.  Every rank computes the same assignment from the
   same exchanged data.  Empty boxes are not stored.
3. **Replica check (opt-in, ``check_replicas=True``).**  Every holder of a replicated box
   computes the crc32c of its copy; the ranks exchange them and the first box whose copies
   differ is named (key, box, ranks, crc32c values) in a DistributedError on every rank.

Which rank calls what: :func:`plan_chunked_save` is a COLLECTIVE (every rank, same order).
Then every rank writes :meth:`ChunkedSavePlan.chunk_item` (if it owns anything) with
:func:`xla_ckpt.io.writer.write_items`; rank 0 gathers every rank's
:class:`~xla_ckpt.io.WrittenItem` and commits :meth:`ChunkedSavePlan.state_item` with
``global_tensors=plan.global_tensors(parts)`` (:func:`xla_ckpt.restore.save_distributed`
does all of this).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from xla_ckpt.comm.base import Dist
from xla_ckpt.comm.failures import describe_error
from xla_ckpt.errors import DistributedError, MetaTensorError
from xla_ckpt.format import typed
from xla_ckpt.format.chunks import (
    Box,
    ChunkRecord,
    GlobalTensor,
    chunk_item,
    chunk_key,
    contiguous_strides,
)
from xla_ckpt.format.crc import crc32c
from xla_ckpt.format.dtypes import dtype_from_name, dtype_name, itemsize
from xla_ckpt.format.manifest import Item
from xla_ckpt.format.plan import tensor_bytes
from xla_ckpt.io.writer import WrittenItem
from xla_ckpt.restore import views

logger = logging.getLogger(__name__)

#: At most this many keys are listed in one line of a structure-mismatch report.
MAX_LISTED_KEYS = 8

REPLICA_SPLIT_BYTES = 32 * 1024 * 1024
"""A replicated box larger than this (bytes) is cut along dim 0 into ``ceil(bytes / this)``
row blocks, at most one per holder, so that one large replicated tensor is written by several
ranks at once (Megatron's fully parallel save does the same); each block is a chunk."""

_KIND_WORDS = {"plain": "a plain tensor", "dtensor": "a DTensor", "xla": "an XLAShardedTensor"}


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: str) -> int:
    return itemsize(dtype_from_name(dtype))


def has_sharded(state: Any) -> bool:
    """True if any tensor leaf of ``state`` is sharded: a ``DTensor``, an ``XLAShardedTensor``
    or an XLA tensor ``xs.mark_sharding`` annotated in place (:func:`views.is_sharded`).

    Walks dicts (values), lists, tuples and ``argparse.Namespace``; local, no communication.
    """
    stack = [state]
    seen: set[int] = set()
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if views.is_sharded(x):
                return True
            continue
        if id(x) in seen:
            continue
        if isinstance(x, dict):
            seen.add(id(x))
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            seen.add(id(x))
            stack.extend(x)
        elif isinstance(x, argparse.Namespace):
            seen.add(id(x))
            stack.extend(vars(x).values())
    return False


@dataclass(frozen=True)
class GlobalSpec:
    """What every rank agreed a tensor leaf is: global tensor ``g`` of the plan.

    Attributes:
        key: its tree path at save (``state['model']['w']``).
        dtype: dtype name as in tensor records (``"float32"``).
        shape: global shape (elements).
        placement: ``"Shard(0) on mesh (4,)"``, ``"replicated"``... (kept in the manifest).
        kind: ``"plain"``, ``"dtensor"`` or ``"xla"``.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    placement: str
    kind: str = "plain"

    def box_nbytes(self, box: Box) -> int:
        """Bytes of ``box`` of this tensor."""
        return box.numel * _itemsize(self.dtype)

    def to_json(self) -> list[Any]:
        return [self.key, self.dtype, list(self.shape), self.placement, self.kind]

    @classmethod
    def from_json(cls, d: Sequence[Any]) -> "GlobalSpec":
        return cls(str(d[0]), str(d[1]), tuple(int(s) for s in d[2]), str(d[3]), str(d[4]))


@dataclass
class ChunkedSavePlan:
    """What :func:`plan_chunked_save` decided (the same on every rank except ``owned``).

    Attributes:
        tree: this rank's typed tree; ``{"$tensor": g}`` refers to ``specs[g]`` (rank 0's tree
            is the one committed).
        specs: ``g`` -> the global tensor's key, dtype, shape, placement.
        assignment: rank -> the ``(g, box)`` it writes, in write order (every rank's, the same
            on all ranks).
        owned: this rank's tensors for ``assignment[rank]``, same order, each C-contiguous of
            shape ``box.sizes`` and the global dtype (on the device the value lives on; the
            writer brings them to host).  They are the live memory where possible: do not
            change them until the write returns (stage them for an async save).
        rank: this rank.
    """

    tree: Any
    specs: list[GlobalSpec]
    assignment: dict[int, list[tuple[int, Box]]]
    owned: list[torch.Tensor]
    rank: int = 0

    @property
    def bytes_per_rank(self) -> dict[int, int]:
        """Planned bytes each rank writes (chunk data only)."""
        return {r: sum(self.specs[g].box_nbytes(b) for g, b in entries)
                for r, entries in sorted(self.assignment.items())}

    def chunk_item(self) -> tuple[str, list[torch.Tensor]] | None:
        """``("chunks/<rank>", owned)`` for :func:`~xla_ckpt.io.writer.write_items`, or None
        when this rank owns no chunk."""
        if not self.owned:
            return None
        return chunk_item(self.rank), self.owned

    def state_item(self) -> Item:
        """The chunked state item rank 0 commits: the tree, no tensors, no blobs."""
        return Item(state=self.tree, chunked=True)

    def global_tensors(self, parts: Sequence[WrittenItem]) -> list[GlobalTensor]:
        """The manifest's global tensors, from every rank's written items (rank 0).

        ``parts`` must hold each owning rank's ``chunks/<rank>`` item (other items are
        ignored).  Also sets each chunk tensor record's key to ``"<global key>[o0:e0,...]"``
        (in place, in ``parts``), so ``xla-ckpt inspect`` shows what a record holds.

        Raises:
            ValueError: an owning rank's chunk item is missing, or one of its records does
                not have the planned dtype and shape (names the rank and the key).
        """
        by_name = {p.name: p for p in parts}
        chunks: list[list[ChunkRecord]] = [[] for _ in self.specs]
        for r, entries in sorted(self.assignment.items()):
            if not entries:
                continue
            name = chunk_item(r)
            part = by_name.get(name)
            if part is None:
                raise ValueError(f"rank {r}'s chunk item {name!r} is missing from the written "
                                 f"items ({sorted(by_name)[:8]})")
            records = part.item.tensors
            if len(records) != len(entries):
                raise ValueError(f"rank {r}'s chunk item {name!r} has {len(records)} tensor "
                                 f"records, {len(entries)} planned")
            for k, (g, box) in enumerate(entries):
                spec, rec = self.specs[g], records[k]
                if rec.dtype != spec.dtype or tuple(rec.shape) != box.sizes:
                    raise ValueError(
                        f"rank {r}'s chunk {k} of {spec.key} was written as {rec.dtype} "
                        f"{list(rec.shape)}, planned {spec.dtype} {list(box.sizes)}")
                records[k] = replace(rec, key=chunk_key(spec.key, box))
                chunks[g].append(ChunkRecord(name, k, box.offsets, box.sizes))
        return [GlobalTensor(spec.key, spec.dtype, spec.shape,
                             tuple(sorted(cs, key=lambda c: c.offsets)), spec.placement)
                for spec, cs in zip(self.specs, chunks, strict=True)]


# ---- describing this rank's state ----------------------------------------------------------


@dataclass
class _Local:
    tree: Any
    specs: list[GlobalSpec]
    values: list[views.ShardedValue]
    none: bool = False
    skeleton: Any = field(default=None)

    def digest(self) -> int:
        doc = [self.none, self.skeleton, [s.to_json() for s in self.specs]]
        return crc32c(json.dumps(doc, separators=(",", ":")).encode())

    def boxes(self) -> list[list[Any]]:
        """``[g, offsets, sizes]`` of every box this rank holds of a sharded tensor (plain
        tensors are held whole by every rank: not sent)."""
        return [[g, list(s.box.offsets), list(s.box.sizes)]
                for g, v in enumerate(self.values) if v.kind != "plain" for s in v.shards]


def _skeleton(x: Any) -> Any:
    """The typed tree with non-tensor leaf values blanked: what must agree across ranks."""
    if isinstance(x, dict):
        if "$tensor" in x:
            return x
        for tag in ("$dict", "$odict"):
            if tag in x:
                return {tag: [[k, _skeleton(v)] for k, v in x[tag]]}
        return {k: _skeleton(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_skeleton(v) for v in x]
    return None


def _describe(state: Any, owned_devices: Sequence[int] | None) -> _Local:
    specs: list[GlobalSpec] = []
    values: list[views.ShardedValue] = []

    def hook(t: torch.Tensor, path: tuple) -> int:
        key = typed.format_path(path)
        try:
            v = views.for_save(t, owned_devices=owned_devices)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from e
        if any(s.tensor.device.type == "meta" for s in v.shards):
            raise MetaTensorError(
                f"tensor at {key} is on the meta device and holds no data; materialise it "
                "(e.g. model.to_empty(device=...) and load/initialise weights) before saving")
        specs.append(GlobalSpec(key, dtype_name(v.dtype), v.global_shape, v.placement, v.kind))
        values.append(v)
        return len(specs) - 1

    tree = typed.encode(state, hook)
    return _Local(tree, specs, values, none=state is None, skeleton=_skeleton(tree))


# ---- naming what differs --------------------------------------------------------------------


def _listed(keys: Sequence[str]) -> str:
    shown = ", ".join(keys[:MAX_LISTED_KEYS])
    return shown + (f" (+{len(keys) - MAX_LISTED_KEYS} more)" if len(keys) > MAX_LISTED_KEYS
                    else "")


def _json_path(where: str, k: Any) -> str:
    return f"{where}[{k!r}]"


def _tree_difference(a: Any, b: Any, where: str = "state") -> str | None:
    """Where skeleton ``a`` (a rank's) first differs from ``b`` (rank 0's), in words."""
    if isinstance(a, dict) and isinstance(b, dict):
        if "$tensor" in a and "$tensor" in b:
            return None
        ka, kb = list(a), list(b)
        if set(ka) != set(kb):
            extra = [_json_path(where, k) for k in ka if k not in b]
            missing = [_json_path(where, k) for k in kb if k not in a]
            parts = []
            if extra:
                parts.append(f"has {_listed(extra)} that rank 0 lacks")
            if missing:
                parts.append(f"lacks {_listed(missing)} that rank 0 has")
            return "; ".join(parts)
        if ka != kb:
            return f"has the keys of {where} in another order than rank 0"
        for k in ka:
            if k in ("$dict", "$odict"):
                la, lb = a[k], b[k]
                if [p[0] for p in la] != [p[0] for p in lb]:
                    return f"has other keys in {where} than rank 0"
                for (key, va), (_, vb) in zip(la, lb, strict=True):
                    d = _tree_difference(va, vb, _json_path(where, key))
                    if d:
                        return d
                continue
            d = _tree_difference(a[k], b[k], where if k.startswith("$") else _json_path(where, k))
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"has {len(a)} entries in {where}, rank 0 {len(b)}"
        for i, (va, vb) in enumerate(zip(a, b, strict=True)):
            d = _tree_difference(va, vb, f"{where}[{i}]")
            if d:
                return d
        return None
    if a is None and b is None:
        return None

    def what(x: Any) -> str:
        if isinstance(x, dict) and "$tensor" in x:
            return "a tensor"
        if isinstance(x, (dict, list)):
            return "a container"
        return "a value"

    return f"has {what(a)} at {where}, rank 0 {what(b)}"


def _structure_difference(mine: dict[str, Any], ref: dict[str, Any]) -> str | None:
    """One line naming how a rank's structure differs from rank 0's (None: it does not)."""
    if mine["none"] != ref["none"]:
        who = "passed no state (None)" if mine["none"] else "passed a state"
        ref_who = "rank 0 none" if ref["none"] else "rank 0 did"
        return (f"{who}, {ref_who}: with sharded tensors (or balance_replicated) every rank "
                "passes its whole state, with the same structure")
    specs = [GlobalSpec.from_json(s) for s in mine["specs"]]
    ref_specs = {s.key: s for s in (GlobalSpec.from_json(s) for s in ref["specs"])}
    by_key = {s.key: s for s in specs}
    lines: list[str] = []
    extra = [s.key for s in specs if s.key not in ref_specs]
    missing = [k for k in ref_specs if k not in by_key]
    if extra:
        lines.append(f"has keys {_listed(extra)} that rank 0 lacks")
    if missing:
        lines.append(f"lacks keys {_listed(missing)} that rank 0 has")
    kinds, shapes, placements = [], [], []
    for s in specs:
        r = ref_specs.get(s.key)
        if r is None:
            continue
        if s.kind != r.kind:
            kinds.append(f"passes {s.key} as {_KIND_WORDS.get(s.kind, s.kind)}, rank 0 as "
                         f"{_KIND_WORDS.get(r.kind, r.kind)}")
        elif s.shape != r.shape or s.dtype != r.dtype:
            what = "global shape" if s.kind != "plain" else "shape"
            shapes.append(f"has {s.key} of {what} {list(s.shape)} {s.dtype}, rank 0 "
                          f"{list(r.shape)} {r.dtype}")
        elif s.placement != r.placement:
            placements.append(f"has {s.key} placed {s.placement}, rank 0 {r.placement}")
    for group in (kinds, shapes, placements):
        lines.extend(group[:MAX_LISTED_KEYS])
        if len(group) > MAX_LISTED_KEYS:
            lines.append(f"(+{len(group) - MAX_LISTED_KEYS} more like it)")
    if lines:
        return "; ".join(lines)
    return _tree_difference(mine["skeleton"], ref["skeleton"])


def _tiling_problem(spec: GlobalSpec, boxes: Sequence[Box]) -> str | None:
    """Why the distinct ``boxes`` of a sharded tensor do not tile it exactly (None: they do)."""
    total = 1
    for s in spec.shape:
        total *= s
    for b in boxes:
        if b.ndim != len(spec.shape) or any(
                o < 0 or o + s > n for o, s, n in zip(b.offsets, b.sizes, spec.shape,
                                                      strict=True)):
            return f"{spec.key}: box {b.to_json()} lies outside its global shape {list(spec.shape)}"
    # Sweep along dim 0: each box against the earlier ones whose rows it reaches.
    active: list[Box] = []
    for b in sorted(boxes, key=lambda b: b.offsets):
        active = [a for a in active if b.ndim == 0 or a.ends[0] > b.offsets[0]]
        for a in active:
            lo = [max(x, y) for x, y in zip(a.offsets, b.offsets, strict=True)]
            hi = [min(x, y) for x, y in zip(a.ends, b.ends, strict=True)]
            if all(h > low for low, h in zip(lo, hi, strict=True)):
                return f"{spec.key}: the ranks' shards {a.to_json()} and {b.to_json()} overlap"
        active.append(b)
    covered = sum(b.numel for b in boxes)
    if covered == total:  # disjoint boxes inside the shape with its volume: they tile it
        return None
    return (f"{spec.key} ({spec.placement}): the ranks' shards cover {covered} of its "
            f"{total} elements; every rank of its device mesh must take part in the save "
            "(call it on every rank)")


# ---- the plan ------------------------------------------------------------------------------


def _c_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its strides are the C-contiguous ones, else a C-contiguous copy."""
    if tuple(t.stride()) == contiguous_strides(tuple(t.shape)):
        return t
    out = torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device)
    with torch.no_grad():
        out.copy_(t)
    return out


def _split_rows(box: Box, pieces: int) -> list[Box]:
    """``box`` cut along dim 0 into ``pieces`` row blocks by ``torch.chunk`` rules."""
    rows = box.sizes[0]
    step = -(-rows // pieces)
    out = []
    for lo in range(0, rows, step):
        n = min(step, rows - lo)
        out.append(Box((box.offsets[0] + lo,) + box.offsets[1:], (n,) + box.sizes[1:]))
    return out


def _split_replicas(specs: Sequence[GlobalSpec], holders: dict[tuple[int, Box], list[int]],
                    split_bytes: int) -> dict[tuple[int, Box], list[int]]:
    """Replicated boxes over ``split_bytes`` cut into row blocks (same holders), see
    :data:`REPLICA_SPLIT_BYTES`; the others as they are."""
    out: dict[tuple[int, Box], list[int]] = {}
    for (g, box), ranks in holders.items():
        nbytes = specs[g].box_nbytes(box)
        pieces = min(len(ranks), box.sizes[0] if box.ndim else 1, -(-nbytes // split_bytes))
        if len(ranks) < 2 or pieces < 2:
            out[(g, box)] = ranks
            continue
        for piece in _split_rows(box, pieces):
            out[(g, piece)] = ranks
    return out


def _assign(specs: Sequence[GlobalSpec], holders: dict[tuple[int, Box], list[int]],
            world_size: int) -> dict[int, list[tuple[int, Box]]]:
    """Owner of every box: single holders first, then replicas largest first onto the
    least-loaded holder (ties: lowest rank).  Deterministic."""
    load = [0] * world_size
    owner: dict[tuple[int, Box], int] = {}
    shared = []
    for (g, box), ranks in holders.items():
        if len(ranks) == 1:
            owner[(g, box)] = ranks[0]
            load[ranks[0]] += specs[g].box_nbytes(box)
        else:
            shared.append((g, box))
    shared.sort(key=lambda gb: (-specs[gb[0]].box_nbytes(gb[1]), gb[0], gb[1].offsets))
    for g, box in shared:
        r = min(holders[(g, box)], key=lambda h: (load[h], h))
        owner[(g, box)] = r
        load[r] += specs[g].box_nbytes(box)
    out: dict[int, list[tuple[int, Box]]] = {r: [] for r in range(world_size)}
    for (g, box), r in sorted(owner.items(), key=lambda kv: (kv[0][0], kv[0][1].offsets)):
        out[r].append((g, box))
    return out


def _inside(inner: Box, outer: Box) -> bool:
    return all(o <= i and i + n <= o + m for i, n, o, m in
               zip(inner.offsets, inner.sizes, outer.offsets, outer.sizes, strict=True))


def _raise(what: str, problem: str, failures: dict[int, str],
           cause: BaseException | None = None) -> None:
    exc = DistributedError(f"{what}: {problem}; nothing was written", failures)
    if cause is not None:
        exc.__cause__ = cause
    raise exc


def plan_chunked_save(dist: Dist, state: Any, *, owned_devices: Sequence[int] | None = None,
                      check_replicas: bool = False, what: str = "save",
                      split_bytes: int = REPLICA_SPLIT_BYTES) -> ChunkedSavePlan:
    """Agree on the state's structure across ranks and decide who writes which box.

    COLLECTIVE: every rank calls it, in the same order, with its whole ``state`` (its
    DTensor / XLA shards and the plain tensors every rank holds); see the module docstring
    for the rules.  Nothing is written here.

    Args:
        dist: the job's :class:`~xla_ckpt.comm.Dist`.
        state: nested dicts/lists/tuples of tensors (plain, DTensor, XLAShardedTensor) and
            plain values (rank 0's non-tensor values are the ones committed).
        owned_devices: torch_xla SPMD only: the global device ids whose shards this process
            writes (multi-host emulation; default every addressable device).
        check_replicas: also compare the crc32c of every replicated box across its holders
            (one pass over the replicated bytes on each holder, one more all-gather).
        what: the operation, for messages (``"save of gs://b/run/ckpt_10"``).
        split_bytes: a replicated box larger than this is cut into row blocks written by
            several of its holders (:data:`REPLICA_SPLIT_BYTES`).

    Returns:
        The :class:`ChunkedSavePlan` (same ``tree`` shape, ``specs`` and ``assignment`` on
        every rank; ``owned`` is this rank's).

    Raises:
        DistributedError: on every rank, before anything is written: a rank could not
            describe its state (a meta tensor, an unsupported value: ``failures`` names the
            rank and the cause); ranks disagree on the structure (``failures`` names each
            differing rank and the keys, against rank 0); sharded boxes do not tile their
            global tensor; with ``check_replicas``, copies of a replicated box differ (names
            the key, the box and the ranks).
        CollectiveTimeoutError: a rank died or hung.
    """
    local: _Local | None = None
    error: BaseException | None = None
    try:
        local = _describe(state, owned_devices)
        mine: dict[str, Any] = {"error": None, "digest": local.digest(), "boxes": local.boxes()}
    except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
        error = e
        mine = {"error": describe_error(e), "digest": None, "boxes": []}
    # Plain JSON bytes, not the typed encoding: thousands of boxes decode in C.
    every = [json.loads(b) for b in dist.exchange_bytes(json.dumps(mine).encode())]
    failed = {r: m["error"] for r, m in enumerate(every) if m["error"] is not None}
    if failed:
        _raise(what, f"the state could not be described on rank(s) "
               f"{', '.join(str(r) for r in sorted(failed))}", failed, error)
    assert local is not None  # no rank failed, this one included
    if len({m["digest"] for m in every}) > 1:
        full = dist.exchange({"none": local.none, "skeleton": local.skeleton,
                              "specs": [s.to_json() for s in local.specs]})
        diffs = {r: _structure_difference(full[r], full[0]) for r in range(1, dist.world_size)}
        failures = {r: d for r, d in diffs.items() if d}
        if not failures:  # same structure, different encoding (cannot happen): say so anyway
            failures = {r: "its state differs from rank 0's" for r, m in enumerate(every)
                        if m["digest"] != every[0]["digest"]}
        _raise(what, "ranks passed states of different structure", failures)

    specs = local.specs
    holders: dict[tuple[int, Box], list[int]] = {}
    for g, v in enumerate(local.values):
        if v.kind == "plain" and v.shards:
            holders[(g, v.shards[0].box)] = list(range(dist.world_size))
    sharded_boxes: dict[int, list[Box]] = {}
    for r, m in enumerate(every):
        for g, offsets, sizes in m["boxes"]:
            box = Box(tuple(offsets), tuple(sizes))
            hs = holders.setdefault((g, box), [])
            if not hs:
                sharded_boxes.setdefault(g, []).append(box)
            if r not in hs:
                hs.append(r)
    problems = []
    for g, spec in enumerate(specs):
        if spec.kind != "plain":
            problem = _tiling_problem(spec, sharded_boxes.get(g, []))
            if problem:
                problems.append(problem)
    if problems:
        _raise(what, "sharded tensors are not covered exactly by the ranks' shards: "
               + "; ".join(problems[:MAX_LISTED_KEYS]), {})

    if check_replicas:
        _check_replicas(dist, what, local, holders)

    assignment = _assign(specs, _split_replicas(specs, holders, split_bytes), dist.world_size)
    owned: list[torch.Tensor] = []
    for g, box in assignment[dist.rank]:
        shard = next(s for s in local.values[g].shards if _inside(box, s.box))
        t = shard.tensor.detach()
        if box != shard.box:  # a row block of a split replica
            t = t[box.slices(within=shard.box)]
        owned.append(_c_contiguous(t))
    plan = ChunkedSavePlan(local.tree, specs, assignment, owned, dist.rank)
    if dist.rank == 0:
        logger.debug("rank 0: %s: %d global tensors, %d chunks, planned bytes per rank %s",
                     what, len(specs), sum(len(e) for e in assignment.values()),
                     plan.bytes_per_rank)
    return plan


def _check_replicas(dist: Dist, what: str, local: _Local,
                    holders: dict[tuple[int, Box], list[int]]) -> None:
    """crc32c of every replicated box this rank holds, compared across its holders."""
    shared = sorted(((g, b) for (g, b), hs in holders.items() if len(hs) > 1),
                    key=lambda gb: (gb[0], gb[1].offsets))
    crcs: list[int | None] = []
    for g, box in shared:
        if dist.rank not in holders[(g, box)]:
            crcs.append(None)
            continue
        shard = next(s for s in local.values[g].shards if s.box == box)
        host = shard.tensor.detach().to("cpu").contiguous()
        crcs.append(crc32c(tensor_bytes(host)))
    every = dist.exchange(crcs)
    for i, (g, box) in enumerate(shared):
        seen = {r: every[r][i] for r in holders[(g, box)]}
        ref_rank = min(seen)
        ref = seen[ref_rank]
        differing = {r: c for r, c in seen.items() if c != ref}
        if differing:
            key = local.specs[g].key
            failures = {r: f"its copy of {key} box {box.to_json()} has crc32c {c:#010x}, "
                           f"rank {ref_rank}'s {ref:#010x}" for r, c in sorted(differing.items())}
            _raise(what, f"the copies of replicated tensor {key} differ across ranks "
                   f"(first difference found; the replicas must be equal)", failures)
