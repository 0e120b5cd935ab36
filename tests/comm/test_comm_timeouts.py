"""Nothing hangs: a late or a dead rank turns into an error on the others, within the timeout."""

from __future__ import annotations

import comm_workers as W
import pytest

from xla_ckpt.errors import CollectiveTimeoutError, DistributedError
from xla_ckpt.testing.launcher import RemoteError, WorkerPool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_late_rank_times_out_the_barrier_naming_it():
    with WorkerPool(3, xla=False) as pool:
        results = pool.run(W.late_barrier, 2, 3.5, 2.0, timeout_s=60)
    assert not any(r.timed_out for r in results)
    e0 = results[0].error
    assert type(e0) is CollectiveTimeoutError
    assert "rank 0: barrier did not complete within its 2 s timeout" in str(e0)
    assert e0.failures == {2: "did not reach barrier within 2 s"}  # rank 0 names the late rank
    for r in results[1:]:
        assert isinstance(r.error, DistributedError), r.traceback


def test_dead_peer_fails_the_exchange_on_the_others():
    pool = WorkerPool(3, xla=False)
    try:
        results = pool.run(W.exchange_with_dead_peer, 1, 3.0, timeout_s=60)
        # the launcher reports the dead worker and retires the pool
        assert results[1].exitcode == -9
        assert type(results[1].error) is RemoteError
        assert str(results[1].error) == "rank 1 killed by signal 9 before answering"
        assert pool.broken
        with pytest.raises(RuntimeError, match="worker pool is broken"):
            pool.run(W.env_and_rank, "X")
    finally:
        pool.close()
    for r in (results[0], results[2]):
        assert not r.timed_out
        assert isinstance(r.error, DistributedError), r.traceback
        assert "exchange (control plane all_gather)" in str(r.error)
        assert getattr(r.error, "collective_broken", None) is True
