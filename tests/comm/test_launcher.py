"""The multi-process launcher itself: env per rank, values and errors back, hard timeout.

(A worker killed mid-call is covered in test_comm_timeouts.py.)
"""

from __future__ import annotations

import comm_workers as W
import pytest

from xla_ckpt.errors import DistributedError
from xla_ckpt.testing.launcher import launch, shared_pool

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
