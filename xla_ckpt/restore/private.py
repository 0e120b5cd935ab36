"""Per-rank items and ZeRO partitions as boxes of the box model.

Everything a restore moves is a box of a global tensor (DESIGN "one restore engine"):

* a tensor of the replicated state: a box of its global tensor (:mod:`xla_ckpt.restore.targets`);
* each blob of a ``rank/<r>`` item: a 1-D ``uint8`` global tensor, one saved chunk covering
  the blob (the item's tensors are views of its blobs, so rebuilding it from whole blobs keeps
  their aliasing), wanted whole by rank ``r`` (by every rank when a remap hook maps them);
* each flat sharded (ZeRO) tensor: a 1-D global tensor whose chunks are the saved ranks'
  partitions (``shard/<r>`` items); rank ``r`` wants its element range ``[lo, hi)``.

:func:`add_private` appends these global tensors to a :class:`SavedTensors`, built from the
manifest alone in one order, so every rank numbers them alike (the strategies exchange box
descriptions by index).  :func:`private_requests` lists this rank's boxes;
:meth:`PrivateRequests.build` turns the filled boxes into ``rank_state``, ``shards`` and the
remapped items.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from xla_ckpt.format.chunks import Box, ChunkRecord, GlobalTensor
from xla_ckpt.format.dtypes import dtype_from_name
from xla_ckpt.format.manifest import Item, Manifest, TensorRecord
from xla_ckpt.format.plan import MapLocation, materialize_item, resolve_device
from xla_ckpt.io.chunked import BoxRequest
from xla_ckpt.restore.plan import RANK_ITEM_PREFIX, RankPlan
from xla_ckpt.restore.targets import SavedTensors


def place(t: torch.Tensor, map_location: MapLocation, key: str) -> torch.Tensor:
    """Move a restored CPU tensor where ``map_location`` says (CPU when None)."""
    dev = resolve_device(map_location, key)
    return t if dev is None or dev.type == "cpu" else t.to(dev)


@dataclass
class PrivateGlobals:
    """Where the private global tensors sit in :attr:`SavedTensors.globals`.

    Attributes:
        blobs: ``(item, blob)`` -> ``g`` of every non-empty blob of every ``rank/<r>`` item.
        flat: ZeRO key -> ``g`` of its flat tensor.
    """

    blobs: dict[tuple[str, int], int] = field(default_factory=dict)
    flat: dict[str, int] = field(default_factory=dict)


def add_private(saved: SavedTensors, plan: RankPlan) -> tuple[SavedTensors, PrivateGlobals]:
    """``saved`` with the private global tensors appended (and the tensor records of the
    rank items' blobs added to a copy of its manifest), and where they are.

    ``plan`` is any rank's :class:`RankPlan` (the layout of the flat tensors is the same on
    every rank).
    """
    manifest = saved.manifest
    gts = list(saved.globals)
    items = dict(manifest.items)
    out = PrivateGlobals()
    for name in sorted(n for n in manifest.items if n.startswith(RANK_ITEM_PREFIX)):
        it = manifest.items[name]
        extra: list[TensorRecord] = []
        for i, b in enumerate(it.blobs):
            if not b.length:
                continue
            t = len(it.tensors) + len(extra)
            extra.append(TensorRecord(f"{name} blob {i}", i, 0, "uint8", (b.length,), (1,)))
            out.blobs[(name, i)] = len(gts)
            gts.append(GlobalTensor(f"{name} blob {i}", "uint8", (b.length,),
                                    (ChunkRecord(name, t, (0,), (b.length,)),)))
        if extra:
            items[name] = dataclasses.replace(it, tensors=list(it.tensors) + extra)
    for key, lay in plan.layout.items():
        chunks = tuple(ChunkRecord(p.item, _index(manifest.items[p.item], p.record), (p.lo,),
                                   (p.hi - p.lo,)) for p in lay.pieces if p.hi > p.lo)
        out.flat[key] = len(gts)
        gts.append(GlobalTensor(f"shard/{key}", lay.dtype, (lay.numel,), chunks))
    if not out.blobs and not out.flat:
        return saved, out
    view = dataclasses.replace(manifest, items=items, global_tensors=gts)
    return dataclasses.replace(saved, manifest=view, globals=gts), out


def _index(item: Item, record: TensorRecord) -> int:
    return next(i for i, t in enumerate(item.tensors) if t is record)


@dataclass
class PrivateRequests:
    """This rank's private boxes and how to rebuild what they hold.

    Attributes:
        requests: the boxes (fresh buffers), rank items' blobs first, then flat ranges.
        items: item name -> ``{blob: buffer}`` of every rank item this rank rebuilds (its own,
            or every saved rank's for the remap hook).
        shards: ZeRO key -> this rank's ``[lo, hi)`` elements (filled by the requests).
    """

    requests: list[BoxRequest] = field(default_factory=list)
    items: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    shards: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(r.out.numel() * r.out.element_size() for r in self.requests)

    def build(self, manifest: Manifest, plan: RankPlan, map_location: MapLocation
              ) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
        """``(rank_state, shards, remapped)`` from the filled boxes: this rank's own
        ``rank/<r>`` item (None without one), its flat ranges placed on ``map_location``,
        and item name -> state of every item the remap hook maps (``manifest``: the
        checkpoint's own)."""
        states = {name: materialize_item(manifest.item(name), bufs, map_location)
                  for name, bufs in self.items.items()}
        rank_state = states.pop(plan.rank_item) if plan.rank_item is not None else None
        shards = {k: place(t, map_location, k) for k, t in self.shards.items()}
        return rank_state, shards, states


def private_requests(saved: SavedTensors, where: PrivateGlobals, plan: RankPlan
                     ) -> PrivateRequests:
    """The boxes ``plan``'s rank fills: its own ``rank/<r>`` item (or, with a remap hook,
    every saved rank's), then its range of every flat tensor."""
    out = PrivateRequests()
    names = ([plan.rank_item] if plan.rank_item is not None else []) + \
        list(plan.remap_items.values())
    for name in names:
        bufs: dict[int, torch.Tensor] = {}
        for i, b in enumerate(saved.manifest.item(name).blobs):
            bufs[i] = torch.empty(b.length, dtype=torch.uint8)
            if b.length:
                out.requests.append(BoxRequest(where.blobs[(name, i)], Box((0,), (b.length,)),
                                               bufs[i], fresh=True))
        out.items[name] = bufs
    for key, (lo, hi) in sorted(plan.shards.items()):
        t = torch.empty(hi - lo, dtype=dtype_from_name(plan.layout[key].dtype, where=key))
        out.shards[key] = t
        if hi > lo:
            out.requests.append(BoxRequest(where.flat[key], Box((lo,), (hi - lo,)), t,
                                           fresh=True))
    return out
