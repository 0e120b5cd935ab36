"""The dist layer on 4 real ranks: gloo process group, each rank with its own XLA CPU device."""

from __future__ import annotations

import argparse
import math

import comm_workers as W
import numpy as np
import pytest

from xla_ckpt.errors import DistributedError
from xla_ckpt.testing.launcher import shared_pool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WORLD = 4
KINDS = ["gloo", "xla"]


@pytest.fixture(scope="module")
def pool():
    return shared_pool(WORLD)


def values(results):
    return [r.unwrap() for r in results]


@pytest.mark.parametrize("kind", KINDS)
def test_topology_from_the_process_group(pool, kind):
    got = values(pool.run(W.topology, kind))
    for rank, t in enumerate(got):
        assert (t["rank"], t["world_size"], t["local_rank"], t["local_world_size"],
                t["host_id"]) == (rank, WORLD, rank, WORLD, 0)
        assert t["backend"] == "gloo" and t["data_device"] == "cpu"
    # XLA under CPU emulation: torch_xla.runtime says world 1, the group says 4; each
    # rank owns an XLA CPU device of its own
    assert {t["kind"] for t in got} == {"torch" if kind == "gloo" else "xla"}
    assert {t["device"] for t in got} == {"cpu" if kind == "gloo" else "xla:0"}


@pytest.mark.parametrize("kind", KINDS)
def test_exchange_and_broadcast_typed_objects(pool, kind):
    got = values(pool.run(W.exchange_objects, kind))
    for g in got:
        every = g["every"]
        assert [e["rank"] for e in every] == [0, 1, 2, 3]
        for r, e in enumerate(every):
            assert e["tuple"] == (r, 2.0, None) and type(e["tuple"]) is tuple
            assert [type(x) for x in e["int_vs_float"]] == [int, float]
            assert e["ns"] == argparse.Namespace(lr=0.1 * r)
            assert type(e["np"]) is np.int64 and e["np"] == r
            assert e["bytes"] == bytes([r]) * 3
            assert math.isnan(e["nan"])
        assert g["src2"] == {"from": 2, "set": {1, 2}}
        assert g["raw"] == b"\x00manifest\xff"


@pytest.mark.parametrize("bucket", [256, 4096, 1 << 20])
@pytest.mark.parametrize("kind,src", [("gloo", 0), ("xla", 3)])
def test_broadcast_tensors_into_preallocated(pool, kind, src, bucket):
    got = values(pool.run(W.broadcast_tensors, kind, src, bucket))
    expected = [bytes(b) for b in got[src]]
    assert all(g == expected for g in got)
    assert len(expected[0]) == 300 * 4 and len(expected[5]) == 5_000 * 8


def test_broadcast_tensors_size_mismatch_raises_on_every_rank(pool):
    for r in pool.run(W.broadcast_mismatch, "gloo"):
        assert type(r.error) is DistributedError
        assert sorted(r.error.failures) == [3]
        assert "passed 1 tensors / 44 bytes, rank 0 passed 1 / 40" in r.error.failures[3]


@pytest.mark.parametrize("bucket", [128, 1 << 20])
def test_scatter_gives_each_rank_its_own(pool, bucket):
    got = values(pool.run(W.scatter, "gloo", bucket))
    for r, (first, second_values, second_numel) in enumerate(got):
        assert first == [float(10 * r + i) for i in range(r + 1)]
        assert second_numel == 2_000 * r
        assert second_values == ([r] if r else [])


@pytest.mark.parametrize("kind", KINDS)
def test_local_failure_reaches_every_rank_naming_it(pool, kind):
    results = pool.run(W.run_collectively_failing, kind, [1, 3])
    for r in results:
        e = r.error
        assert type(e) is DistributedError
        assert e.failures == {
            1: "FileNotFoundError: gs://b/ckpt/data-1.safetensors seen from rank 1",
            3: "FileNotFoundError: gs://b/ckpt/data-1.safetensors seen from rank 3"}
        assert str(e).startswith(f"reading the shard failed on rank(s) 1, 3 of 4 (reported on "
                                 f"rank {r.rank}) [rank 1: FileNotFoundError")
    # on a failing rank the original error is the cause
    assert "FileNotFoundError" in results[1].traceback
    assert values(pool.run(W.run_collectively_ok, kind)) == [0, 2, 4, 6]


def test_subgroup_numbers_its_ranks_from_zero(pool):
    got = values(pool.run(W.subgroup, [1, 3]))
    assert got[0] is None and got[2] is None
    assert got[1] == {"rank": 0, "world": 2, "every": ["1", "3"], "t": 41.0}
    assert got[3] == {"rank": 1, "world": 2, "every": ["1", "3"], "t": 41.0}


@pytest.mark.parametrize("rounds", [False, True])  # gloo's broadcasts; NCCL's all_gather rounds
@pytest.mark.parametrize("bucket", [64, 4096, 1 << 20])
def test_all_gather_tensors_rounds_deliver_every_rank_bytes(pool, bucket, rounds):
    """The striped restore's exchange: uneven parts (a rank with none, empty tensors, sizes
    that are not whole words) in rounds of at most one bucket, bitwise on every rank."""
    for v in values(pool.run(W.all_gather_tensors, "gloo", bucket, rounds)):
        assert v["same"] and v["received"] == v["expected"] > 0
