"""Who reads which bytes: the one balanced assignment of every plan that splits a read.

The striped plan (:mod:`xla_ckpt.restore.box_striped`: boxes of live targets and the
replicated item's blobs alike) cuts what the job needs into *pieces* (whole
crc32c chunks, small whole blobs, or runs of them, so every byte is checked by the rank that
fetches it) and gives each piece to one reader, so each byte is fetched once per job.
:func:`balance` decides, over the pieces' concatenated byte space, whatever their sizes and
order:

1. contiguous runs (piece order kept: one range per reader, one ranged request per run) when
   they put every reader within :data:`CONTIGUOUS_SLACK` of an equal share;
2. otherwise the longest-piece-first greedy (each piece, largest first, to the least loaded
   reader allowed to read it), which puts every reader within one piece of the mean.

With pieces of at most :func:`piece_limit` bytes (an eighth of a reader's share) every reader
ends within :data:`BALANCE_TOLERANCE` of the mean share, unless one crc32c chunk alone is
larger than that (a chunk is never split between readers: it would be fetched twice).

Pure: every rank computes the same answer from the same inputs.
"""

from __future__ import annotations

from typing import Sequence

#: Every reader's bytes within this fraction of the mean share (issue 23), pieces allowing.
BALANCE_TOLERANCE = 0.25
#: Contiguous runs are kept (fewer, longer requests) while every reader is this close.
CONTIGUOUS_SLACK = 0.20
#: Pieces per reader share the greedy works with (so it ends within 1/8 of the share).
PIECES_PER_SHARE = 8


def piece_limit(total_bytes: int, readers: int) -> int:
    """Largest run of consecutive atoms the greedy moves as one piece (bytes, at least 1)."""
    return max(1, total_bytes // max(1, readers * PIECES_PER_SHARE))


def runs(sizes: Sequence[int], limit: int,
         keys: Sequence[object] | None = None) -> list[tuple[int, int]]:
    """Consecutive index ranges ``[lo, hi)`` of ``sizes`` of at most ``limit`` bytes each (an
    item larger than ``limit`` is a run of its own); a run never joins items of different
    ``keys`` (e.g. who may read them)."""
    out: list[tuple[int, int]] = []
    lo, size = 0, 0
    for i, n in enumerate(sizes):
        if i > lo and (size + n > limit or (keys is not None and keys[i] != keys[lo])):
            out.append((lo, i))
            lo, size = i, 0
        size += n
    if lo < len(sizes):
        out.append((lo, len(sizes)))
    return out


def cuts(sizes: Sequence[int], parts: int) -> list[int]:
    """Indices ``0 = c_0 <= ... <= c_parts = len(sizes)`` cutting ``sizes`` into ``parts``
    contiguous runs of about equal bytes: each inner cut is the boundary nearest to its share
    of the bytes (ties: the lower index)."""
    prefix = [0]
    for n in sizes:
        prefix.append(prefix[-1] + n)
    total = prefix[-1]
    out, k = [0], 0
    for j in range(1, parts):
        target = total * j / parts
        # past empty pieces while short of the target (they would stop the walk: equal
        # distances), then on while the next boundary is nearer
        while k + 1 < len(prefix) and (prefix[k + 1] == prefix[k] < target or
                                       abs(prefix[k + 1] - target) < abs(prefix[k] - target)):
            k += 1
        out.append(k)
    out.append(len(sizes))
    return out


def contiguous(sizes: Sequence[int], readers: Sequence[int]) -> list[int]:
    """The reader of each piece when ``readers`` take contiguous runs in order (:func:`cuts`)."""
    c = cuts(sizes, len(readers))
    out = [0] * len(sizes)
    for k, r in enumerate(readers):
        for i in range(c[k], c[k + 1]):
            out[i] = r
    return out


def greedy(sizes: Sequence[int], readers: Sequence[int],
           eligible: Sequence[Sequence[int]] | None = None) -> list[int]:
    """The reader of each piece: largest first, each to the least loaded reader allowed to
    read it (``eligible[i]``, default every reader; ties: the lower rank).  Every reader ends
    within one piece of its share when every piece may go anywhere."""
    load = dict.fromkeys(readers, 0)
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        choice = eligible[i] if eligible is not None else readers
        r = min(choice, key=lambda r: (load[r], r))
        out[i] = r
        load[r] += sizes[i]
    return out


def spread(sizes: Sequence[int], readers: Sequence[int], owner: Sequence[int]) -> float:
    """Largest distance of a reader's bytes from the mean share, as a fraction of it."""
    total = sum(sizes)
    if not total or not readers:
        return 0.0
    load = dict.fromkeys(readers, 0)
    for n, r in zip(sizes, owner, strict=True):
        load[r] += n
    mean = total / len(readers)
    return max(abs(v - mean) for v in load.values()) / mean


def balance(sizes: Sequence[int], readers: Sequence[int],
            eligible: Sequence[tuple[int, ...]] | None = None) -> list[int]:
    """The reader of each atom (``sizes``: crc32c chunks or small whole blobs, in storage
    order; see the module docstring): contiguous runs when every atom may go to every reader
    and the runs are within :data:`CONTIGUOUS_SLACK` of equal shares; else runs of consecutive
    atoms of at most :func:`piece_limit` bytes (never mixing atoms of different ``eligible``
    readers) given out by :func:`greedy`, whichever is closer to equal shares (ties keep
    the contiguous runs).

    Raises:
        ValueError: no readers, or an atom no reader may read.
    """
    if not readers:
        raise ValueError("balance needs at least one reader")
    if eligible is not None and any(not e for e in eligible):
        raise ValueError("balance: an atom has no reader allowed to read it")
    everyone = set(readers)
    free = eligible is None or all(set(e) == everyone for e in eligible)
    first: list[int] | None = None
    off = 0.0
    if free:
        first = contiguous(sizes, readers)
        off = spread(sizes, readers, first)
        if off <= CONTIGUOUS_SLACK:
            return first
    pieces = runs(sizes, piece_limit(sum(sizes), len(readers)),
                  None if free else eligible)
    owner = greedy([sum(sizes[a:b]) for a, b in pieces], readers,
                   None if free or eligible is None else [eligible[a] for a, _ in pieces])
    out = [owner[k] for k, (a, b) in enumerate(pieces) for _ in range(a, b)]
    if first is not None and spread(sizes, readers, out) >= off:
        return first
    return out
