"""The broadcast plan for boxes: rank 0 reads every rank's boxes and sends each its own.

Rank 0 collects every rank's boxes (one exchange of ``(global index, box)`` lists), reads
them and sends each rank only its own, point to point, in rounds of at most
``bucket_size_bytes`` in flight (a box larger than that is cut into row ranges), so rank 0's
extra memory stays near one bucket.  Ranks that ask for the same box in one round get one
read.  When every rank asks for the same boxes (plain targets, or no ``into``: everything
whole), rank 0 reads each round straight into its own destinations and one bucketed
broadcast fills everyone's.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from xla_ckpt.comm.base import Dist
from xla_ckpt.format.chunks import Box
from xla_ckpt.format.dtypes import dtype_from_name, itemsize
from xla_ckpt.io import CheckpointReader
from xla_ckpt.io.chunked import BoxRequest
from xla_ckpt.restore.box_striped import unit_rows
from xla_ckpt.restore.decide import Decision
from xla_ckpt.restore.result import RestoreStats
from xla_ckpt.restore.targets import RankRequests, SavedTensors, describe_requests, read_requests
from xla_ckpt.storage import StorageConfig

logger = logging.getLogger(__name__)

MIN_ROUND_BYTES_PER_RANK = 64 * 1024
"""Broadcast strategy, point to point: each rank's share of one round (of about
``bucket_size_bytes`` on rank 0) is at least this many bytes (64 KiB), so many ranks do not
make the rounds tiny."""

REPLICATED_ROUNDS = 8
"""Broadcast strategy, every rank filling the same boxes: the state moves in about this
many rounds (each at least ``bucket_size_bytes``).  Rank 0 reads straight into its own
destinations, so a round's size costs no memory; rounds only overlap rank 0's read of the
next with the broadcast of this one, and each costs one agreement."""


@dataclass(frozen=True)
class _Piece:
    """A part of request ``index`` of one rank: rows ``[lo, hi)`` of its box (all of a 0-d)."""

    index: int
    g: int
    box: Box
    lo: int
    hi: int
    nbytes: int


def _split(index: int, g: int, box: Box, isz: int, budget: int, unit: int = 1) -> list[_Piece]:
    """Cut a box into row ranges of at most ``budget`` bytes each, in whole units of
    ``unit`` rows (a crc32c chunk's: no chunk is fetched twice; at least one unit)."""
    nbytes = box.numel * isz
    if box.ndim == 0 or nbytes <= budget or box.sizes[0] <= 1:
        return [_Piece(index, g, box, 0, box.sizes[0] if box.ndim else 1, nbytes)]
    row = nbytes // box.sizes[0]
    step = max(unit, budget // max(row, 1) // unit * unit)
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



class BoxBroadcast:
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
        self._staging: torch.Tensor | None = None  # one staging bucket for every round
        self.unit_rows = unit_rows(saved)
        # point to point: each rank's share of a round, so rank 0 holds about one bucket
        self.budget = max(bucket_size_bytes // max(dist.world_size - 1, 1),
                          MIN_ROUND_BYTES_PER_RANK)

    def _pieces(self, desc: list[list[Any]]) -> list[_Piece]:
        out: list[_Piece] = []
        for i, (g, offsets, sizes) in enumerate(desc):
            gt = self.saved.globals[int(g)]
            isz = itemsize(dtype_from_name(gt.dtype, where=gt.key))
            out.extend(_split(i, int(g), Box(tuple(offsets), tuple(sizes)), isz, self.budget,
                              self.unit_rows(int(g), tuple(sizes))))
        return out

    def run(self) -> None:
        dist, stats, what = self.dist, self.stats, self.what
        every = dist.exchange(describe_requests(self.mine.requests))
        replicated = all(d == every[0] for d in every)
        reader: CheckpointReader | None = None
        t0 = time.perf_counter()

        def open_reader() -> CheckpointReader | None:
            if dist.rank != 0:
                return None
            return CheckpointReader(self.decision.open(self.storage_config),
                                    self.saved.manifest)

        try:
            reader = dist.run_collectively(open_reader, f"{what}: rank 0 opens the checkpoint")
            if replicated:  # every rank fills the same boxes: one broadcast carries them
                pieces = self._pieces(every[0])
                total = sum(p.nbytes for p in pieces)
                batches = _batches(pieces, max(self.bucket_size_bytes,
                                               -(-total // REPLICATED_ROUNDS)))
                staged = [self._outputs(b) for b in batches]
                rounds = len(batches)
                self._staging = torch.empty(self.bucket_size_bytes, dtype=torch.uint8,
                                            device=dist.data_device) if rounds > 1 else None
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
        stats.read_seconds += time.perf_counter() - t0
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
                                        check_layout=False,  # every rank planned the same batch
                                        staging=self._staging)
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

