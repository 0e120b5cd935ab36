"""The striped plan for boxes: each box fetched once per job, its holders exchange the rows.

Every rank lists the boxes it fills (:mod:`xla_ckpt.restore.targets`); one exchange of those
lists tells every rank who holds which box.  The rows of every distinct box are cut into
whole crc32c chunks' worth of rows (so every byte is checked by the rank that fetches it),
and :func:`xla_ckpt.restore.assign.balance` gives them out over the holders, across boxes, so
each reader fetches its share of the job's bytes (within 25 % of the mean, whatever the
tensor sizes and their order); then each block goes point to point to the other holders of
its box.  A box only one rank holds (a fully sharded FSDP2 shard) is read by it alone and
never moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from xla_ckpt.comm.base import Dist
from xla_ckpt.format.chunks import Box
from xla_ckpt.format.dtypes import dtype_from_name, itemsize
from xla_ckpt.io import CheckpointReader
from xla_ckpt.io.chunked import BoxRequest
from xla_ckpt.restore.assign import balance
from xla_ckpt.restore.decide import Decision
from xla_ckpt.restore.result import RestoreStats
from xla_ckpt.restore.targets import RankRequests, SavedTensors, describe_requests, read_requests
from xla_ckpt.storage import StorageConfig


@dataclass(frozen=True)
class _Block:
    """Rows ``[lo, hi)`` of request ``index`` of ``rank``: read by ``rank``, sent to others."""

    rank: int
    index: int
    lo: int
    hi: int


@dataclass
class FlatExchange:
    """The exchange of boxes that are views of one flat uint8 buffer per member, and that
    every rank requests alike (the replicated state's blobs, :mod:`xla_ckpt.restore.blobs`).

    Each member of ``group`` (one rank per host when the ranks of a host share one copy in
    host memory, else every rank) sends, in one all-gather, the rows its ranks read, as few
    ranges of ``flat`` as they make (ranges apart only by the alignment padding after a
    box's end travel as one): no staging copy.

    Attributes:
        group: this rank's exchange group; None on a rank whose member sends and receives
            for it (a rank of a host other than its leader), or when nothing crosses (one
            host).
        member: rank -> its member's index in ``group`` (its host, or itself).
        flat: the buffer ``group``'s member sends from and receives into (None off the group).
        offsets: request index -> the byte offset of its ``out`` in ``flat``.
        align: the alignment of every box's start in ``flat`` (bytes).
        leaders: when ``group`` is a subgroup (the host leaders'), the job's rank of each of
            its ranks (a failure there reaches every rank of the job naming them,
            :meth:`~xla_ckpt.comm.base.Dist.run_on_subgroup`); None when it is the job.
    """

    group: Dist | None
    member: list[int]
    flat: torch.Tensor | None
    offsets: list[int]
    align: int
    leaders: list[int] | None = None


def flat_ranges(reads: dict[int, list[_Block]], sizes: list[int], ex: FlatExchange,
                members: int) -> list[list[tuple[int, int]]]:
    """``[[(start, stop), ...], ...]``: the byte ranges of ``flat`` each member contributes
    (the blocks its ranks read; ``sizes``: each request's bytes), merged where they touch or
    are apart only by the padding after a box's end."""
    spans: list[list[tuple[int, int, bool]]] = [[] for _ in range(members)]
    for rank, blocks in reads.items():
        for b in blocks:
            o = ex.offsets[b.index]
            spans[ex.member[rank]].append((o + b.lo, o + b.hi, b.hi == sizes[b.index]))
    out: list[list[tuple[int, int]]] = []
    for mine in spans:
        merged: list[tuple[int, int, bool]] = []
        for lo, hi, ends in sorted(mine):
            if merged:
                plo, phi, pends = merged[-1]
                reach = -(-phi // ex.align) * ex.align if pends else phi
                if lo <= reach:  # (blocks are disjoint: hi > phi)
                    merged[-1] = (plo, hi, ends)
                    continue
            merged.append((lo, hi, ends))
        out.append([(lo, hi) for lo, hi, _ in merged])
    return out


def _same_bytes(saved: SavedTensors) -> list[int]:
    """Each global tensor's first twin: the lowest ``g`` whose one saved chunk is the same
    tensor record bytes (keys tied at save, written once, in a version-1 item), else itself;
    twins' boxes are read together, so their bytes are fetched once."""
    first: dict[tuple, int] = {}
    out: list[int] = []
    for g, gt in enumerate(saved.globals):
        key: tuple | None = None
        if len(gt.chunks) == 1 and g not in saved.strided:
            c = gt.chunks[0]
            rec = saved.manifest.item(c.item).tensors[c.tensor]
            key = (c.item, rec.blob, rec.byte_offset, rec.dtype, tuple(rec.shape))
        out.append(g if key is None else first.setdefault(key, g))
    return out


def plan_blocks(every: list[list[list[Any]]], unit_rows: Callable[[int, tuple], int],
                row_bytes: Callable[[int, tuple], int], twin: Callable[[int], int] = int
                ) -> tuple[dict[int, list[_Block]], list[tuple[_Block, list[_Block]]],
                           dict[int, list[tuple[int, int]]]]:
    """From every rank's described requests: each rank's blocks to read, each block with the
    other holders' blocks it fills, and each rank's local copies.

    The distinct boxes (a global tensor and a box of it; boxes of twins, ``twin(g)``, that
    every holder of each holds, together) are cut into whole units of ``unit_rows(g,
    sizes)`` rows (the rows of one crc32c chunk, so no two readers fetch the same chunk;
    a 0-d box is one unit), and :func:`~xla_ckpt.restore.assign.balance` gives the units out
    over the ranks, each to a holder of its box, so every reader fetches about the same
    bytes across boxes (replicas: plain targets, replicated DTensor placements, HSDP; a box
    only one rank holds is that rank's).  A rank with several requests for one box (keys
    tied at save, restored into separate targets) reads and receives into the first and
    copies it into the others (``copies[rank]``: ``(from, to)`` request indices, after the
    exchange).  Pure: every rank computes the same answer.
    """
    holders: dict[tuple, dict[int, dict[int, int]]] = {}
    copies: dict[int, list[tuple[int, int]]] = {r: [] for r in range(len(every))}
    for rank, desc in enumerate(every):
        for index, (g, offsets, sizes) in enumerate(desc):
            boxes = holders.setdefault((twin(int(g)), tuple(offsets), tuple(sizes)), {})
            first = boxes.setdefault(int(g), {})
            if rank in first:
                copies[rank].append((first[rank], index))
            else:
                first[rank] = index
    groups: list[tuple[tuple, dict[int, dict[int, int]], tuple[int, ...]]] = []
    for (t, offsets, sizes), boxes in sorted(holders.items(), key=lambda kv: kv[0]):
        both = set.intersection(*(set(h) for h in boxes.values()))
        if both:
            groups.append(((t, offsets, sizes), boxes, tuple(sorted(both))))
        else:  # no rank holds every twin: each box on its own (its bytes fetched per twin)
            groups.extend(((g, offsets, sizes), {g: h}, tuple(sorted(h)))
                          for g, h in sorted(boxes.items()))
    atoms: list[tuple[int, int, int]] = []  # (group, lo, hi)
    sizes_: list[int] = []
    eligible: list[tuple[int, ...]] = []
    for k, ((g, _, sizes), _, readers) in enumerate(groups):
        rows = sizes[0] if sizes else 1
        unit = max(1, unit_rows(g, sizes)) if sizes else 1
        per_row = row_bytes(g, sizes)
        for lo in range(0, max(rows, 1), unit):
            hi = min(rows, lo + unit)
            atoms.append((k, lo, hi))
            sizes_.append((hi - lo) * per_row)
            eligible.append(readers)
    every_reader = sorted({r for *_, readers in groups for r in readers})
    owner = balance(sizes_, every_reader, eligible) if atoms else []
    reads: dict[int, list[_Block]] = {r: [] for r in range(len(every))}
    sends: list[tuple[_Block, list[_Block]]] = []
    i = 0
    while i < len(atoms):  # consecutive units of one box with one reader: one block
        k, lo, hi = atoms[i]
        j = i + 1
        while j < len(atoms) and atoms[j][0] == k and owner[j] == owner[i]:
            hi = atoms[j][2]
            j += 1
        rank = owner[i]
        for _, first in sorted(groups[k][1].items()):
            block = _Block(rank, first[rank], lo, hi)
            reads[rank].append(block)
            others = [_Block(r, x, lo, hi) for r, x in sorted(first.items()) if r != rank]
            if others:
                sends.append((block, others))
        i = j
    return reads, sends, copies


def unit_rows(saved: SavedTensors) -> Callable[[int, tuple], int]:
    """Rows of a box of global tensor ``g`` that one crc32c chunk of its blobs holds (all of
    them for a tensor read through its storage span, or whose blob has one crc32c for all
    its bytes: a range of it is checked only whole)."""
    manifest = saved.manifest

    def rows(g: int, sizes: tuple) -> int:
        whole = sizes[0] if sizes else 1
        gt = saved.globals[g]
        if g in saved.strided or not gt.chunks:
            return whole
        grain = 0
        for c in gt.chunks:
            it = manifest.item(c.item)
            blob = it.blobs[it.tensors[c.tensor].blob]
            if not blob.chunk_crc32c:
                return whole
            grain = max(grain, blob.chunk_size)
        row = itemsize(dtype_from_name(gt.dtype, where=gt.key))
        for n in sizes[1:]:
            row *= n
        return -(-grain // max(row, 1))

    return rows


def _row_bytes(saved: SavedTensors) -> Callable[[int, tuple], int]:
    """Bytes of one row of a box of global tensor ``g`` (all of a 0-d box)."""

    def nbytes(g: int, sizes: tuple) -> int:
        n = itemsize(dtype_from_name(saved.globals[g].dtype, where=saved.globals[g].key))
        for d in sizes[1:]:
            n *= d
        return n

    return nbytes


def _rows(out: torch.Tensor, block: _Block) -> torch.Tensor:
    return out if out.dim() == 0 else out[block.lo:block.hi]


def striped_boxes(decision: Decision, dist: Dist, saved: SavedTensors, mine: RankRequests,
                  storage_config: StorageConfig | None, bucket_size_bytes: int, what: str,
                  stats: RestoreStats, flat: FlatExchange | None = None) -> None:
    """Every rank: fetch each box once per job and exchange rows among the box's holders.

    One exchange of every rank's box list; each rank reads the rows :func:`plan_blocks`
    gives it (its share of the job's bytes, straight into its targets, checked); then, in
    one global order of (sender, receiver) pairs the same on every rank, each block goes
    point to point to the other holders of its box (buckets of ``bucket_size_bytes``).  A
    box only one rank holds (a fully sharded FSDP2 shard) is read by it alone, never moved.
    With ``flat`` (boxes every rank requests alike, views of one flat buffer per member),
    the members all-gather the ranges their ranks read instead (:class:`FlatExchange`).
    """
    every = dist.exchange(describe_requests(mine.requests))
    twins = _same_bytes(saved)
    reads, sends, copies = plan_blocks(every, unit_rows(saved), _row_bytes(saved),
                                       twins.__getitem__)
    me = dist.rank

    def read_mine() -> int:
        reqs = [BoxRequest(mine.requests[b.index].tensor,
                           _sub_box(mine.requests[b.index].box, b),
                           _rows(mine.requests[b.index].out, b), mine.requests[b.index].fresh)
                for b in reads[me]]
        if not reqs:
            return 0
        storage = decision.open(storage_config)
        try:
            reader = CheckpointReader(storage, saved.manifest)
            mine.touch([b.index for b in reads[me]])
            return read_requests(reader, saved, reqs)
        finally:
            storage.close()

    stats.bytes_read += dist.run_collectively(read_mine, f"{what}: read this rank's rows")
    if flat is not None:
        sizes = [r.out.numel() for r in mine.requests]
        if flat.leaders is None:  # every rank a member: the job's own all-gather
            stats.bytes_received += dist.run_collectively(
                lambda: _exchange_flat(flat, reads, sizes, bucket_size_bytes),
                f"{what}: exchange rows between ranks")
        else:  # the host leaders' subgroup; the other ranks wait for its outcome
            stats.bytes_received += dist.run_on_subgroup(
                flat.group, flat.leaders,
                lambda _group: _exchange_flat(flat, reads, sizes, bucket_size_bytes),
                f"{what}: exchange rows between hosts") or 0
        return
    pairs: dict[tuple[int, int], list[tuple[_Block, _Block]]] = {}
    for block, others in sends:
        for o in others:
            pairs.setdefault((block.rank, o.rank), []).append((block, o))

    world = dist.world_size
    # every box held by every rank (plain or replicated targets): one all-gather, every rank's
    # blocks at once (NCCL's own all-gather on GPUs), instead of pairs one after the other
    gather = world > 1 and len(sends) == sum(len(v) for v in reads.values()) \
        and all(len(others) == world - 1 for _, others in sends)

    def exchange_all() -> int:
        parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        mine_bytes = 0
        for block, others in sends:  # one order on every rank
            if block.rank == me:
                t = _rows(mine.requests[block.index].out, block).contiguous()
                mine_bytes += t.numel() * t.element_size()
            else:
                o = next(o for o in others if o.rank == me)
                mine.touch([o.index])
                t = _rows(mine.requests[o.index].out, o)
                if not t.is_contiguous():
                    buf = torch.empty_like(t, memory_format=torch.contiguous_format)
                    staged.append((t, buf))
                    t = buf
            parts[block.rank].append(t)
        stats.bytes_received += dist.all_gather_tensors(parts, bucket_size_bytes)
        with torch.no_grad():
            for t, buf in staged:
                t.copy_(buf)
        return mine_bytes * (world - 1)

    def exchange() -> int:
        moved = exchange_all() if gather else 0
        for (src, dst), items in sorted(pairs.items()) if not gather else ():
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

    stats.bytes_sent += dist.run_collectively(exchange, f"{what}: exchange rows between holders")


def _sub_box(box: Box, block: _Block) -> Box:
    if box.ndim == 0:
        return box
    return Box((box.offsets[0] + block.lo,) + box.offsets[1:],
               (block.hi - block.lo,) + box.sizes[1:])



def _exchange_flat(ex: FlatExchange, reads: dict[int, list[_Block]], sizes: list[int],
                   bucket_size_bytes: int) -> int:
    """One all-gather of every member's ranges of its flat buffer; returns the box bytes
    this rank received (the padding between boxes not counted)."""
    group = ex.group
    if group is None:
        return 0
    assert ex.flat is not None  # every member of the exchange has its buffer
    flat = ex.flat
    ranges = flat_ranges(reads, sizes, ex, group.world_size)
    group.all_gather_tensors([[flat[lo:hi] for lo, hi in spans] for spans in ranges],
                             bucket_size_bytes=bucket_size_bytes)
    return sum(b.hi - b.lo for r, blocks in reads.items() for b in blocks
               if ex.member[r] != group.rank)
