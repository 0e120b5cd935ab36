"""The multi-process launcher itself: env per rank, values and errors back, hard timeout,
emulated hosts (``hosts=H``: host id, local rank, GCS source address per rank).

(A worker killed mid-call is covered in test_comm_timeouts.py.)
"""

from __future__ import annotations

import comm_workers as W
import pytest

from xla_ckpt.errors import DistributedError
from xla_ckpt.storage.base import SOURCE_ADDRESS_ENV
from xla_ckpt.testing.launcher import WorkerPool, launch, rank_environment, shared_pool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_each_rank_gets_its_environment_and_returns_its_value():
    pool = shared_pool(4)
    got = [r.unwrap() for r in pool.run(W.env_and_rank, "EXTRA")]
    assert got == [(str(r), "4", None, "127.0.0.1", "CPU") for r in range(4)]
    got = [r.unwrap() for r in pool.run(W.env_and_rank, "EXTRA", env={"EXTRA": "call"})]
    assert [g[2] for g in got] == ["call"] * 4
    assert [r.unwrap()[2] for r in pool.run(W.env_and_rank, "EXTRA")] == [None] * 4  # undone
    # an exception comes back with its type, message and attributes
    results = pool.run(W.raise_on, 1)
    assert [r.unwrap() for r in results if r.rank != 1] == [0, 2, 3]
    e = results[1].error
    assert type(e) is DistributedError and e.failures == {1: "IntegrityError: bad bytes"}
    assert str(e) == "restore failed [rank 1: IntegrityError: bad bytes]"
    assert "raise DistributedError" in results[1].traceback
    assert not pool.broken


def test_hard_timeout_kills_stragglers():
    results = launch(W.sleep_on, 2, args=(1, 600.0), timeout_s=5, xla=False,
                     env={"EXTRA": "pool-wide"})
    assert results[0].unwrap() == 0
    assert results[1].timed_out and type(results[1].error) is TimeoutError
    assert "did not answer within 5 s" in str(results[1].error)
    assert results[1].exitcode is not None  # the process is gone


# ---- emulated hosts: WorkerPool(world_size, hosts=H) --------------------------------------
def test_rank_environment_splits_consecutive_ranks_into_hosts():
    assert rank_environment(0, 4) == {"RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0",
                                      "LOCAL_WORLD_SIZE": "4"}  # hosts=1: as it always was
    assert [rank_environment(r, 4)["LOCAL_RANK"] for r in range(4)] == ["0", "1", "2", "3"]
    envs = [rank_environment(r, 8, 4) for r in range(8)]
    assert [(e["GROUP_RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e[SOURCE_ADDRESS_ENV])
            for e in envs] == [(str(r // 2), str(r % 2), "2", f"127.0.0.{10 + r // 2}")
                               for r in range(8)]
    assert SOURCE_ADDRESS_ENV not in rank_environment(3, 4, 2, bind_host_addresses=False)
    with pytest.raises(ValueError, match="world_size 6 is not a multiple of hosts 4"):
        rank_environment(0, 6, 4)
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="hosts must be an integer >= 1"):
            rank_environment(0, 4, bad)


def test_pool_refuses_an_uneven_host_split():
    with pytest.raises(ValueError, match="world_size 3 is not a multiple of hosts 2"):
        WorkerPool(3, hosts=2, xla=False)  # raised before any process starts
    with pytest.raises(ValueError, match="world_size 4 is not a multiple of hosts 3"):
        launch(W.env_and_rank, 4, args=("X",), hosts=3, xla=False)


def test_four_ranks_as_two_hosts_get_their_topology_and_address():
    with WorkerPool(4, hosts=2, xla=False) as pool:
        topo = [r.unwrap() for r in pool.run(W.topology, "gloo")]
        assert [(t["rank"], t["world_size"], t["host_id"], t["local_rank"],
                 t["local_world_size"]) for t in topo] == [
            (0, 4, 0, 0, 2), (1, 4, 0, 1, 2), (2, 4, 1, 0, 2), (3, 4, 1, 1, 2)]
        got = [r.unwrap()[2] for r in pool.run(W.env_and_rank, SOURCE_ADDRESS_ENV)]
        assert got == ["127.0.0.10", "127.0.0.10", "127.0.0.11", "127.0.0.11"]
        got = [r.unwrap()[2] for r in pool.run(W.env_and_rank, "GROUP_RANK")]
        assert got == ["0", "0", "1", "1"]


def test_one_host_keeps_the_old_environment():
    pool = shared_pool(4)  # hosts=1, the pool the other launcher tests share
    assert [r.unwrap()[2] for r in pool.run(W.env_and_rank, SOURCE_ADDRESS_ENV)] == [None] * 4
    topo = [r.unwrap() for r in pool.run(W.topology, "gloo")]
    assert [(t["host_id"], t["local_rank"], t["local_world_size"]) for t in topo] == [
        (0, r, 4) for r in range(4)]
    assert shared_pool(4, hosts=1) is pool and shared_pool(4, hosts=1,
                                                           bind_host_addresses=False) is pool
