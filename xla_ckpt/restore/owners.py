"""Save by owner: which rank writes which box of which global tensor, each byte once.

A state that holds sharded tensors (``DTensor`` from FSDP2 / tensor parallel, torch_xla
``XLAShardedTensor``) is saved as *chunked* global tensors (manifest version 2,
:mod:`xla_ckpt.format.chunks`): every rank writes the boxes it owns into its item
``chunks/<rank>``; rank 0 commits the state item whose ``{"$tensor": g}`` nodes index the
manifest's global tensors.  :func:`plan_chunked_save` decides all of it, collectively:

1. **Structure agreement, before anything is written.**  Every rank describes its state
   (:func:`xla_ckpt.sharded.views.for_save` for each tensor leaf: global shape, dtype,
   placement, its boxes) and the ranks compare: the tensor keys, global shapes, dtypes,
   kinds (plain / DTensor / XLA), placements and ties (below), and the shape of the whole
   tree: every key path (tensor or not) and what is there (a tensor, a value, a dict, a
   list, a tuple...).  Non-tensor *values* are not compared: rank 0's are committed (as
   for any replicated state), so ``{"step": 5}`` on rank 0 and ``{"step": 6}`` on rank 1
   save ``5``, while a key only one rank has is refused.  A plain tensor is not declared
   sharded, so it must have the same key, shape and dtype on every rank (its values are
   compared only with ``check_replicas``).  Any difference is one
   :class:`~xla_ckpt.errors.DistributedError` on every rank whose ``failures`` name each
   differing rank by the key paths the user wrote, e.g. ``rank 1: has state['4.weight'],
   state['4.bias'] that rank 0 lacks``, ``rank 1: lacks state['meta']['name'],
   state['meta'][3] that rank 0 has`` or ``rank 1: passes state['w'] as a DTensor, rank 0
   as a plain tensor``.  The sharded boxes must tile each global tensor.  The common case
   costs one small all-gather (a crc32c digest of each rank's structure plus its boxes);
   the full structures travel only when the digests differ, to name the difference.

   **Ties.**  A tensor leaf that is the same object as an earlier leaf, or a tensor over
   the same memory (same storage, storage offset, shape, stride and dtype; for a DTensor,
   the same local tensor and the same global shape and placement) -- a tied embedding and
   output projection -- is the same global tensor: one ``{"$tensor": g}`` under both keys,
   its bytes written once, and a whole load gives one tensor back under both keys (as a
   version-1 save keeps aliasing).  Views of one storage with other shapes or offsets (a
   slice ``a[4:8]`` of ``a``) are separate global tensors here: each is written with its
   own bytes and loads as its own tensor (the chunked format keeps ties, not partial
   overlaps).  Ranks must see the same ties (a rank that passes equal copies where rank 0
   passes one tensor twice is refused, naming the keys).
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
from xla_ckpt.format.plan import check_storable, tensor_bytes
from xla_ckpt.io.writer import WrittenItem
from xla_ckpt.sharded import views

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
    listing: list[list[Any]] = field(default_factory=list)
    ties: list[list[str]] = field(default_factory=list)

    def structure(self) -> dict[str, Any]:
        """What the ranks compare (exchanged in full only when the digests differ)."""
        return {"none": self.none, "listing": self.listing,
                "specs": [s.to_json() for s in self.specs], "ties": self.ties}

    def digest(self) -> int:
        return crc32c(json.dumps(self.structure(), separators=(",", ":")).encode())

    def boxes(self) -> list[list[Any]]:
        """``[g, offsets, sizes]`` of every box this rank holds of a sharded tensor (plain
        tensors are held whole by every rank: not sent)."""
        return [[g, list(s.box.offsets), list(s.box.sizes)]
                for g, v in enumerate(self.values) if v.kind != "plain" for s in v.shards]


_CONTAINER_TAGS = {"$dict": "dict", "$odict": "OrderedDict", "$namespace": "Namespace",
                   "$tuple": "tuple"}


def _decoded_key(k: Any) -> Any:
    try:
        return typed.decode(k)
    except Exception:  # noqa: BLE001 - a key encode wrote always decodes; shown as encoded
        return k


def _listing(tree: Any) -> list[list[Any]]:
    """``[key path, what, parent path]`` of every node of the typed tree, parents first, in
    the user's terms: paths as :func:`typed.format_path` writes them (``state['meta'][3]``,
    never the encoding's ``$dict``), what = ``tensor``, ``value``, ``dict``, ``list``,
    ``tuple``, ``OrderedDict``, ``Namespace``."""
    return [[key, what, parent] for key, what, parent, _ in _walk(tree)]


def tensor_paths(tree: Any) -> dict[str, int]:
    """Key path (``state['emb']``) -> ``g`` of every ``{"$tensor": g}`` node of a typed tree.

    Tied leaves (see the module docstring) are several paths with one ``g``; a restore that
    matches targets by key uses this to find every key of a global tensor, not only the
    global tensor's own ``key`` (the first of them).  Local, no communication.
    """
    return {key: g for key, what, _, g in _walk(tree) if what == "tensor" and g is not None}


def _walk(tree: Any) -> list[tuple[str, str, str | None, int | None]]:
    """``(key path, what, parent path, tensor index or None)`` of every node, parents first."""
    out: list[tuple[str, str, str | None, int | None]] = []
    stack: list[tuple[Any, tuple, str | None]] = [(tree, (), None)]
    while stack:
        node, path, parent = stack.pop()
        key = typed.format_path(path)
        children: list[tuple[Any, Any]] = []
        index: int | None = None
        if isinstance(node, list):
            what = "list"
            children = list(enumerate(node))
        elif isinstance(node, dict):
            tag = next((k for k in node if isinstance(k, str) and k.startswith("$")), None)
            if tag is None:
                what = "dict"
                children = list(node.items())
            elif tag == "$tensor":
                what = "tensor"
                index = node[tag] if isinstance(node[tag], int) else None
            elif tag in ("$dict", "$odict"):
                what = _CONTAINER_TAGS[tag]
                children = [(_decoded_key(k), v) for k, v in node[tag]]
            elif tag == "$namespace":
                what = "Namespace"
                inner = node[tag]
                if isinstance(inner, dict) and "$dict" in inner:
                    children = [(_decoded_key(k), v) for k, v in inner["$dict"]]
                elif isinstance(inner, dict):
                    children = list(inner.items())
            elif tag == "$tuple":
                what = "tuple"
                children = list(enumerate(node[tag]))
            else:
                what = "value"
        else:
            what = "value"
        out.append((key, what, parent, index))
        for k, v in reversed(children):
            stack.append((v, path + (k,), key))
    return out


def _storage_key(t: torch.Tensor, v: views.ShardedValue) -> tuple | None:
    """What identifies the memory of a leaf (the local tensor of a DTensor), for ties; None
    when it cannot be told (an XLA tensor, no storage)."""
    if v.kind == "xla":
        return None
    try:
        local = t.to_local() if v.kind == "dtensor" else t  # type: ignore[attr-defined]  # DTensor
        if local.device.type in ("meta", "xla"):
            return None
        ptr = local.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - a tensor subclass without storage: identity ties only
        return None
    if ptr == 0 or local.numel() == 0:  # byte-free: no bytes to share, never tied by memory
        return None
    return (str(local.device), ptr, local.storage_offset(), tuple(local.shape),
            tuple(local.stride()), local.dtype)


def _describe(state: Any, owned_devices: Sequence[int] | None) -> _Local:
    specs: list[GlobalSpec] = []
    values: list[views.ShardedValue] = []
    ties: list[list[str]] = []
    by_id: dict[int, int] = {}
    by_memory: dict[tuple, int] = {}
    held: list[torch.Tensor] = []  # keeps ids in by_id unique while describing

    def hook(t: torch.Tensor, path: tuple) -> int:
        key = typed.format_path(path)
        g = by_id.get(id(t))
        if g is not None:  # the same object again: a tie
            ties.append([key, specs[g].key])
            return g
        check_storable(t, key)  # a sparse, nested, ... tensor: refused by name
        try:
            v = views.for_save(t, owned_devices=owned_devices)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from e
        if any(s.tensor.device.type == "meta" for s in v.shards):
            raise MetaTensorError(
                f"tensor at {key} is on the meta device and holds no data; materialise it "
                "(e.g. model.to_empty(device=...) and load/initialise weights) before saving")
        spec = GlobalSpec(key, dtype_name(v.dtype), v.global_shape, v.placement, v.kind)
        memory = _storage_key(t, v)
        mkey = (memory, spec.dtype, spec.shape, spec.placement, spec.kind) if memory else None
        g = by_memory.get(mkey) if mkey is not None else None
        held.append(t)
        if g is not None:  # another tensor object over the same memory: a tie
            by_id[id(t)] = g
            ties.append([key, specs[g].key])
            return g
        specs.append(spec)
        values.append(v)
        g = len(specs) - 1
        by_id[id(t)] = g
        if mkey is not None:
            by_memory[mkey] = g
        return g

    tree = typed.encode(state, hook)
    return _Local(tree, specs, values, none=state is None, listing=_listing(tree), ties=ties)


# ---- naming what differs --------------------------------------------------------------------


def _listed(keys: Sequence[str]) -> str:
    shown = ", ".join(keys[:MAX_LISTED_KEYS])
    return shown + (f" (+{len(keys) - MAX_LISTED_KEYS} more)" if len(keys) > MAX_LISTED_KEYS
                    else "")


_WHAT_WORDS = {"tensor": "a tensor", "value": "a value (not a tensor)", "dict": "a dict",
               "list": "a list", "tuple": "a tuple", "OrderedDict": "an OrderedDict",
               "Namespace": "an argparse.Namespace"}


def _tree_difference(mine: Sequence[Sequence[Any]], ref: Sequence[Sequence[Any]]) -> list[str]:
    """How listing ``mine`` (a rank's) differs from ``ref`` (rank 0's), in the user's key
    paths: what only one side has, what is of another kind; below a difference nothing more
    is named."""
    a = {p: (w, par) for p, w, par in mine}
    b = {p: (w, par) for p, w, par in ref}
    extra: list[str] = []
    missing: list[str] = []
    other: list[str] = []
    below: set[str] = set()  # paths under a named difference
    order = [p for p, _, _ in ref] + [p for p, _, _ in mine if p not in b]
    for p in order:
        parent = (b.get(p) or a[p])[1]
        if parent in below:
            below.add(p)
            continue
        if p not in b:
            extra.append(p)
        elif p not in a:
            missing.append(p)
        elif a[p][0] != b[p][0]:
            other.append(f"has {_WHAT_WORDS.get(a[p][0], a[p][0])} at {p}, rank 0 "
                         f"{_WHAT_WORDS.get(b[p][0], b[p][0])}")
        else:
            continue
        below.add(p)
    lines = []
    if extra:
        lines.append(f"has {_listed(extra)} that rank 0 lacks")
    if missing:
        lines.append(f"lacks {_listed(missing)} that rank 0 has")
    lines.extend(other[:MAX_LISTED_KEYS])
    if len(other) > MAX_LISTED_KEYS:
        lines.append(f"(+{len(other) - MAX_LISTED_KEYS} more like it)")
    return lines


def _tie_difference(mine: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """Keys one rank passes as the same tensor as an earlier key and the other does not."""
    a = {k: first for k, first in mine["ties"]}
    b = {k: first for k, first in ref["ties"]}
    tensors = ({p for p, w, _ in mine["listing"] if w == "tensor"}
               & {p for p, w, _ in ref["listing"] if w == "tensor"})

    def words(first: str | None) -> str:
        return "a separate tensor" if first is None else f"the same tensor as {first}"

    out = []
    for k in [p for p, _, _ in ref["listing"] if p in tensors]:
        if a.get(k) != b.get(k):
            out.append(f"passes {k} as {words(a.get(k))}, rank 0 as {words(b.get(k))}")
    shown = out[:MAX_LISTED_KEYS]
    if len(out) > MAX_LISTED_KEYS:
        shown.append(f"(+{len(out) - MAX_LISTED_KEYS} more like it)")
    return shown


def _structure_difference(mine: dict[str, Any], ref: dict[str, Any]) -> str | None:
    """One line naming how a rank's structure differs from rank 0's (None: it does not)."""
    if mine["none"] != ref["none"]:
        who = "passed no state (None)" if mine["none"] else "passed a state"
        ref_who = "rank 0 none" if ref["none"] else "rank 0 did"
        return (f"{who}, {ref_who}: with sharded tensors (or balance_replicated) every rank "
                "passes its whole state, with the same structure")
    lines = _tree_difference(mine["listing"], ref["listing"])
    specs = [GlobalSpec.from_json(s) for s in mine["specs"]]
    ref_specs = {s.key: s for s in (GlobalSpec.from_json(s) for s in ref["specs"])}
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
    lines.extend(_tie_difference(mine, ref))
    return "; ".join(lines) if lines else None


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
        full = dist.exchange(local.structure())
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
