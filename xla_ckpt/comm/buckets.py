"""Bucket plans: how a list of tensors travels through a collective in bounded pieces.

Pure arithmetic, no collectives.  Given the byte sizes of the tensors to move
and a bucket size, :func:`plan_buckets` returns a list of :class:`Bucket`:

* small tensors (below ``direct_min_bytes``) are packed back to back into
  one staging bucket of at most ``bucket_size_bytes`` (one collective moves
  many tensors; a collective costs ~1-5 ms, copying 4 MiB on both sides about as much);
* a larger tensor is moved in place, in slices of at most
  ``bucket_size_bytes`` (no staging copy, no extra memory).

Every rank computes the same plan from the same sizes, so every rank enters
the same collectives in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

DEFAULT_BUCKET_SIZE_BYTES = 32 * 1024 * 1024
DEFAULT_DIRECT_MIN_BYTES = 4 * 1024 * 1024
_WORD = 4  # all-gather slots are whole 32-bit words (the XLA data plane moves int32)


@dataclass(frozen=True)
class Part:
    """Bytes ``[start, start + nbytes)`` of tensor ``index``, at ``offset`` in the bucket."""

    index: int
    start: int
    nbytes: int
    offset: int


@dataclass
class Bucket:
    """One collective: ``nbytes`` bytes made of ``parts``.

    ``direct`` buckets hold a single part of a single large tensor and are
    moved in place (no staging buffer).
    """

    direct: bool
    nbytes: int = 0
    parts: list[Part] = field(default_factory=list)


def plan_buckets(sizes_bytes: list[int], bucket_size_bytes: int,
                 direct_min_bytes: int = DEFAULT_DIRECT_MIN_BYTES) -> list[Bucket]:
    """Split tensors of ``sizes_bytes`` into buckets of at most ``bucket_size_bytes``.

    Tensors of at least ``direct_min_bytes`` (or larger than a bucket) move
    in place; smaller ones are packed.  Empty tensors get no bucket.

    Raises:
        ValueError: ``bucket_size_bytes`` < 1 or a negative size.
    """
    if bucket_size_bytes < 1:
        raise ValueError(f"bucket_size_bytes must be >= 1, got {bucket_size_bytes}")
    out: list[Bucket] = []
    packed = Bucket(direct=False)
    for i, n in enumerate(sizes_bytes):
        if n < 0:
            raise ValueError(f"tensor {i} has negative size {n}")
        if n == 0:
            continue
        if n > bucket_size_bytes or n >= direct_min_bytes:
            for start in range(0, n, bucket_size_bytes):
                k = min(bucket_size_bytes, n - start)
                out.append(Bucket(direct=True, nbytes=k, parts=[Part(i, start, k, 0)]))
            continue
        if packed.nbytes + n > bucket_size_bytes:
            out.append(packed)
            packed = Bucket(direct=False)
        packed.parts.append(Part(i, 0, n, packed.nbytes))
        packed.nbytes += n
    if packed.parts:
        out.append(packed)
    return out


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor's bytes (no copy).

    Raises:
        ValueError: the tensor is not contiguous (a collective needs dense memory).
    """
    if not t.is_contiguous():
        raise ValueError("collectives need contiguous tensors; call .contiguous() first")
    flat = t.reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8,
                                                                    device=t.device)


def max_staging_bytes(plan: list[Bucket]) -> int:
    """Size of the one staging buffer a plan needs (0 if every bucket is direct)."""
    return max((b.nbytes for b in plan if not b.direct), default=0)


def pack(buf: torch.Tensor, views: Sequence[torch.Tensor], bucket: Bucket) -> None:
    """Copy ``bucket``'s parts of ``views`` (byte views) into its staging buffer ``buf``."""
    for p in bucket.parts:
        buf[p.offset:p.offset + p.nbytes].copy_(views[p.index][p.start:p.start + p.nbytes])


def unpack(buf: torch.Tensor, views: Sequence[torch.Tensor], bucket: Bucket) -> None:
    """Copy the staging buffer ``buf`` of ``bucket`` back into its parts of ``views``."""
    for p in bucket.parts:
        views[p.index][p.start:p.start + p.nbytes].copy_(buf[p.offset:p.offset + p.nbytes])


@dataclass(frozen=True)
class GatherPiece:
    """Bytes ``[start, start + nbytes)`` of a rank's tensor ``index``, at ``offset`` in its
    slot of one all-gather round."""

    index: int
    start: int
    nbytes: int
    offset: int


@dataclass(frozen=True)
class AllGatherPlan:
    """How :meth:`Dist.all_gather_tensors` moves every rank's bytes in bounded rounds.

    Each rank's tensors are read as one byte stream; round ``k`` carries bytes
    ``[k * slot_bytes, (k + 1) * slot_bytes)`` of every rank's stream, each rank's
    slot zero-padded to ``slot_bytes`` (an all-gather needs equal shapes).

    Attributes:
        slot_bytes: bytes per rank per round (a multiple of 4); one round gathers
            ``world_size * slot_bytes`` <= ``bucket_size_bytes`` bytes (or one word
            per rank when the bucket is smaller than that).
        rounds: number of all-gathers: ``ceil(max stream bytes / slot_bytes)``.
        pieces: ``pieces[r][k]``: rank ``r``'s pieces in round ``k``.
    """

    slot_bytes: int
    rounds: int
    pieces: tuple[tuple[tuple[GatherPiece, ...], ...], ...]

    @property
    def wire_bytes(self) -> int:
        """Bytes each rank receives in all (padding included): ``rounds * world * slot``."""
        return self.rounds * len(self.pieces) * self.slot_bytes


def plan_all_gather(sizes: Sequence[Sequence[int]], bucket_size_bytes: int) -> AllGatherPlan:
    """Plan the rounds of an all-gather of ``sizes[r]`` (rank ``r``'s tensor byte sizes).

    Every rank computes the same plan from the same sizes, so every rank enters the
    same collectives in the same order.  Empty tensors get no piece; a rank with no
    bytes contributes zero padding.

    Raises:
        ValueError: ``bucket_size_bytes`` < 1, no ranks, or a negative size.
    """
    if bucket_size_bytes < 1:
        raise ValueError(f"bucket_size_bytes must be >= 1, got {bucket_size_bytes}")
    world = len(sizes)
    if world < 1:
        raise ValueError("plan_all_gather needs the sizes of at least one rank")
    for r, row in enumerate(sizes):
        for i, n in enumerate(row):
            if n < 0:
                raise ValueError(f"rank {r}'s tensor {i} has negative size {n}")
    slot = max(_WORD, bucket_size_bytes // world // _WORD * _WORD)
    longest = max(sum(row) for row in sizes)
    rounds = -(-longest // slot)
    plan: list[tuple[tuple[GatherPiece, ...], ...]] = []
    for row in sizes:
        per_round: list[list[GatherPiece]] = [[] for _ in range(rounds)]
        pos = 0
        for i, n in enumerate(row):
            start = 0
            while start < n:
                k, off = divmod(pos, slot)
                take = min(n - start, slot - off)
                per_round[k].append(GatherPiece(i, start, take, off))
                start += take
                pos += take
        plan.append(tuple(tuple(p) for p in per_round))
    return AllGatherPlan(slot, rounds, tuple(plan))



def run_all_gather(plan: AllGatherPlan, views: Sequence[Sequence[torch.Tensor]], rank: int,
                   gather: Callable[[int, int, torch.Tensor], torch.Tensor]) -> int:
    """Run ``plan`` on this ``rank``: pack its slot, ``gather``, unpack the others' bytes.

    Args:
        plan: from :func:`plan_all_gather` on the byte sizes of ``views``.
        views: ``views[r]``: rank ``r``'s tensors as flat uint8 views (this rank's hold
            data; the others' are destinations).
        rank: this rank.
        gather: ``gather(k, rounds, send)`` -> every rank's ``send`` of round ``k``, back
            to back (``world * slot_bytes`` host uint8 bytes): the collective.

    Returns:
        Bytes written into the other ranks' destinations.
    """
    slot = plan.slot_bytes
    send = torch.zeros(slot, dtype=torch.uint8)
    received = 0
    for k in range(plan.rounds):
        mine = plan.pieces[rank][k]
        if sum(p.nbytes for p in mine) < slot:
            send.zero_()
        for p in mine:
            send[p.offset:p.offset + p.nbytes].copy_(views[rank][p.index][p.start:
                                                                          p.start + p.nbytes])
        got = gather(k, plan.rounds, send)
        for r, pieces in enumerate(plan.pieces):
            if r == rank:
                continue
            base = r * slot
            for p in pieces[k]:
                views[r][p.index][p.start:p.start + p.nbytes].copy_(
                    got[base + p.offset:base + p.offset + p.nbytes])
                received += p.nbytes
    return received
