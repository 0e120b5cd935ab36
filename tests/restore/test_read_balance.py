"""Every reader of a split read gets its share of the bytes (issue 23, "striped into live
targets is unbalanced"): counts of bytes read per rank, real gloo ranks, no timing.

The issue's state shape (many small vectors and a few matrices, each matrix larger than a
rank's share of the vectors), in both storage orders, restored with ``striped`` plainly and
into live targets: each of the 4 ranks reads within 25 % of the mean, the job reads each byte
once, and every rank ends with the saved values.  ``all_ranks`` and ``broadcast`` are the
peers: every rank reads everything, or rank 0 alone does.
"""

from __future__ import annotations

import random

import pytest

from tests.restore import balance_workers as W
from xla_ckpt.restore.assign import BALANCE_TOLERANCE, balance, spread
from xla_ckpt.testing.launcher import shared_pool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KiB, MiB = 1024, 1024 * 1024
STATE = W.VECTORS * W.VECTOR_NUMEL * 4 + W.MATRICES * W.MATRIX_ROWS ** 2 * 4


@pytest.mark.parametrize("vectors_first", [True, False], ids=["vectors_first", "matrices_first"])
def test_striped_reads_are_balanced_plain_and_into_targets(tmp_path, vectors_first):
    pool = shared_pool(4)
    uri = str(tmp_path / "ck")
    for r in pool.run(W.save, uri, vectors_first):
        r.unwrap()
    for into in (False, True):
        got = [r.unwrap() for r in pool.run(W.restore_bytes, uri, vectors_first, into, "striped")]
        assert all(g["same"] and g["plan"] == "striped" for g in got), got
        reads = [g["read"] for g in got]
        mean = sum(reads) / len(reads)
        assert sum(reads) == STATE, (into, reads)  # each byte once per job
        assert max(abs(n - mean) for n in reads) <= BALANCE_TOLERANCE * mean, (into, reads)
    # the peers, into live targets: every rank reads all, or rank 0 alone
    every = [r.unwrap() for r in pool.run(W.restore_bytes, uri, vectors_first, True,
                                          "all_ranks")]
    assert [g["read"] for g in every] == [STATE] * 4 and all(g["same"] for g in every)
    bcast = [r.unwrap() for r in pool.run(W.restore_bytes, uri, vectors_first, True,
                                          "broadcast")]
    assert [g["read"] for g in bcast] == [STATE, 0, 0, 0] and all(g["same"] for g in bcast)


@pytest.mark.parametrize("sizes", [
    [256 * KiB] * 48 + [4 * MiB] * 6,  # the state, vectors first
    [4 * MiB] * 6 + [256 * KiB] * 48,  # matrices first
    [MiB] * 3 + [7 * KiB] * 500 + [512 * KiB, 5] * 40,  # uneven, interleaved
])
def test_balance_shares_any_order_within_the_tolerance(sizes):
    for readers in ([0, 1, 2, 3], [0, 1, 2], list(range(8))):
        owner = balance(sizes, readers)
        assert spread(sizes, readers, owner) <= BALANCE_TOLERANCE, (readers, owner)
    # pieces only some readers may read (boxes held by some ranks): each goes to one of them
    eligible = [(0, 1) if i % 2 else (2, 3) for i in range(len(sizes))]
    owner = balance(sizes, [0, 1, 2, 3], eligible)
    assert all(o in e for o, e in zip(owner, eligible, strict=True))
    assert balance(sizes, [0, 1, 2, 3]) == balance(list(sizes), [0, 1, 2, 3])  # deterministic


def test_balance_within_the_tolerance_for_random_sizes_and_orders():
    """Whenever no single atom (a crc32c chunk, never split between readers) is over a
    quarter of a reader's share."""
    rng = random.Random(23)
    checked = 0
    for _ in range(200):
        sizes = [rng.choice([rng.randint(1, 64 * KiB), rng.randint(64 * KiB, MiB), 256 * KiB,
                             4 * MiB]) for _ in range(rng.randint(5, 200))]
        for n in (2, 3, 4, 8):
            if max(sizes) * 4 * n > sum(sizes):
                continue
            assert spread(sizes, list(range(n)), balance(sizes, list(range(n)))) \
                <= BALANCE_TOLERANCE, (n, sizes)
            checked += 1
    assert checked > 100


def test_balance_keeps_contiguous_runs_when_they_are_even():
    sizes = [MiB] * 16
    assert balance(sizes, [0, 1, 2, 3]) == [r for r in range(4) for _ in range(4)]
    with pytest.raises(ValueError, match="no reader allowed"):
        balance([1, 2], [0, 1], [(0,), ()])


def test_empty_pieces_do_not_stop_the_contiguous_cuts():
    # an empty blob (a zero-element tensor) among the pieces: the cuts still reach every
    # reader's share (before: every cut after it stuck there, one reader got the rest)
    sizes = [MiB] * 6 + [0] + [MiB] * 6
    assert balance(sizes, [0, 1, 2]) == [0] * 4 + [1] * 5 + [2] * 4
