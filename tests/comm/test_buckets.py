"""Bucket plans: pure arithmetic shared by broadcast and scatter."""

from __future__ import annotations

import itertools

import pytest
import torch

from xla_ckpt.comm.buckets import Bucket, Part, byte_view, max_staging_bytes, plan_buckets


def test_small_tensors_are_packed_and_large_ones_move_in_place():
    plan = plan_buckets([3, 0, 5, 10, 2, 2], bucket_size_bytes=8, direct_min_bytes=6)
    assert plan == [  # a large tensor goes out at once; the open packed bucket when full
        Bucket(direct=True, nbytes=8, parts=[Part(3, 0, 8, 0)]),
        Bucket(direct=True, nbytes=2, parts=[Part(3, 8, 2, 0)]),
        Bucket(direct=False, nbytes=8, parts=[Part(0, 0, 3, 0), Part(2, 0, 5, 3)]),
        Bucket(direct=False, nbytes=4, parts=[Part(4, 0, 2, 0), Part(5, 0, 2, 2)]),
    ]
    assert max_staging_bytes(plan) == 8
    # with the default threshold (4 MiB) everything here is small enough to pack
    assert [b.direct for b in plan_buckets([3, 5, 10], 8)] == [True, True, False]


def test_every_byte_is_planned_exactly_once():
    sizes = [7, 64, 1, 0, 65, 128, 3, 3, 200, 40]
    plan = plan_buckets(sizes, bucket_size_bytes=64, direct_min_bytes=32)
    covered: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(sizes))}
    for b in plan:
        assert b.nbytes <= 64
        assert b.nbytes == sum(p.nbytes for p in b.parts)
        for p in b.parts:
            covered[p.index].append((p.start, p.start + p.nbytes))
    for i, n in enumerate(sizes):
        spans = sorted(covered[i])
        assert sum(e - s for s, e in spans) == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="bucket_size_bytes must be >= 1, got 0"):
        plan_buckets([1], 0)
    with pytest.raises(ValueError, match="tensor 1 has negative size -1"):
        plan_buckets([1, -1], 4)


def test_byte_view_shares_memory():
    t = torch.arange(4, dtype=torch.int32)
    v = byte_view(t)
    assert v.dtype == torch.uint8 and v.numel() == 16 and v.data_ptr() == t.data_ptr()
    assert byte_view(torch.tensor([True, False])).tolist() == [1, 0]
    assert byte_view(torch.empty(0, 3)).numel() == 0
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(torch.zeros(3, 3).t())
