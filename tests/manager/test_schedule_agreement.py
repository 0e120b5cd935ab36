"""Ranks that disagree about the save schedule get one library error on every rank.

Issue 25, defect 6: rank 1 passing ``num_updates + 1`` to ``after_update`` gave
``TypeError: cannot unpack non-iterable bool object`` (it read another call's message), and
rank 1 skipping one ``after_update`` finished without error while nothing was committed.  Now
every manager exchange carries each rank's schedule position (xla_ckpt.manager.lockstep):
every rank raises the same ScheduleMismatchError naming the ranks and their values.  Real
gloo ranks (schedule_workers.py).
"""

import pytest
from schedule_workers import disagree, stops_calling

from xla_ckpt.errors import ScheduleMismatchError
from xla_ckpt.manager import lockstep
from xla_ckpt.testing.launcher import WorkerPool, shared_pool

WORLD = 2

# case -> (async_save, sync_interval_updates, (what rank 1 says, what rank 0 says), committed
# afterwards)
CASES = {
    # the inputs (async saves, the default sync_interval_updates=1)
    "plus_one": (True, 1, ("after_update #1(epoch=1, num_updates=2",
                           "after_update #1(epoch=1, num_updates=1"), []),
    "skip": (True, 1, ("after_update #4(epoch=1, num_updates=5",
                       "after_update #4(epoch=1, num_updates=4"), ["checkpoint_1_2"]),
    # the same kind, other inputs: ranks exchange every 4 updates only (the call count tells)
    "plus_one_sparse": (False, 4, ("after_update #1(epoch=1, num_updates=2",
                                   "after_update #2(epoch=1, num_updates=2"), []),
    "skip_sparse": (False, 4, ("after_update #5(epoch=1, num_updates=6",
                               "after_update #4(epoch=1, num_updates=4"), ["checkpoint_1_2"]),
    # other schedule inputs: end_of_epoch, epoch, the metrics of a save, save vs wait
    "end_of_epoch": (False, 1, ("num_updates=3, end_of_epoch=True",
                                "num_updates=3, end_of_epoch=False"), ["checkpoint_1_2"]),
    "epoch": (False, 1, ("after_update #3(epoch=2, num_updates=3",
                         "after_update #3(epoch=1, num_updates=3"), ["checkpoint_1_2"]),
    "save_vs_wait": (False, 1, ("wait()", "save(name='checkpoint_1_3', epoch=1, num_updates=3"),
                     ["checkpoint_1_2"]),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_ranks_that_disagree_get_one_error_naming_the_ranks_and_values(tmp_path, case):
    async_save, sync, (rank1_says, rank0_says), committed = CASES[case]
    run_dir = str(tmp_path / "run")
    outs = [r.unwrap() for r in shared_pool(WORLD, xla=False).run(
        disagree, run_dir, case, async_save, sync, timeout_s=120)]
    for o in outs:
        assert o["error"] == "ScheduleMismatchError", o
        assert o["message"] == outs[0]["message"]  # one error, the same on every rank
        assert rank1_says in o["message"] and rank0_says in o["message"], o["message"]
        assert "every rank must call after_update once per update" in o["message"]
        assert not any("different metrics" in w for w in o["warnings"])
        assert rank1_says in o["positions"][1] and rank0_says in o["positions"][0]
        assert set(o["failures"]) == {1}, o["failures"]  # rank 0's position wins a tie
        # an async save in flight at the mismatch is committed on the way out (every rank
        # leaves its `with manager:` on the same error, so they agree on it: C27)
        assert o["committed"] == committed


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_different_metrics_are_reported_on_rank_0_and_rank_0s_are_recorded(tmp_path):
    """Metrics are not the schedule (only rank 0's are recorded): ranks passing different
    validation losses get a WARNING on rank 0 naming every rank's value, and the save goes on."""
    run_dir = str(tmp_path / "run")
    outs = [r.unwrap() for r in shared_pool(WORLD, xla=False).run(
        disagree, run_dir, "metrics", False, 1, timeout_s=120)]
    for o in outs:
        assert o["error"] is None, o
        assert o["committed"] == ["checkpoint_1_2", "checkpoint_1_4", "checkpoint_1_6"]
        assert o["metadata_1_4"]["loss"] == 0.25
    assert outs[1]["warnings"] == []
    (line,) = [w for w in outs[0]["warnings"] if "different metrics" in w]
    at4 = "after_update #4(epoch=1, num_updates=4, end_of_epoch=False, "
    assert f"rank 0: {at4}metrics={{'loss': 0.25}})" in line
    assert f"rank 1: {at4}metrics={{'loss': 0.5}})" in line
    assert "only rank 0's metrics are recorded" in line


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_that_stops_calling_is_named_by_the_timeout(tmp_path):
    """Rank 1 leaves the loop (no more calls, no close); its process stays alive in the pool:
    rank 0 raises at its next exchange, at the collective timeout, naming rank 1 as alive but
    not having arrived."""
    with WorkerPool(WORLD, xla=False) as pool:
        outs = [r.unwrap() for r in pool.run(stops_calling, str(tmp_path / "run"), 0.5,
                                             timeout_s=120)]
    assert outs[1]["error"] is None
    assert outs[0]["error"] == "CollectiveTimeoutError", outs[0]
    assert set(outs[0]["failures"]) == {1}
    assert "did not enter" in outs[0]["failures"][1]


def test_positions_in_one_process():
    """The comparison itself, on inputs no loop produces: foreign messages, NaN metrics,
    metrics passed on rank 0 only, and metrics on a rank while rank 0 passes none."""
    at = lockstep.position("after_update", calls=3, epoch=1, num_updates=3, end_of_epoch=False,
                           metrics=None)
    nan = lockstep.position("after_update", calls=3, epoch=1, num_updates=3,
                            end_of_epoch=False, metrics={"loss": float("nan")})
    assert lockstep.unwrap([lockstep.wrap(at, "a"), lockstep.wrap(at, "b")]) == (["a", "b"], {})
    assert lockstep.unwrap([lockstep.wrap(nan, 1), lockstep.wrap(nan, 2)]) == ([1, 2], {})
    assert lockstep.unwrap([lockstep.wrap(nan, 1), lockstep.wrap(at, 2)]) == ([1, 2], {})
    payloads, differ = lockstep.unwrap([lockstep.wrap(at, 1), lockstep.wrap(nan, 2)])
    assert payloads == [1, 2] and set(differ) == {0, 1}
    assert "metrics={'loss': nan}" in differ[1]
    with pytest.raises(ScheduleMismatchError) as ei:
        lockstep.unwrap([lockstep.wrap(at, 1), (False, "", "")])
    assert ei.value.failures == {1: "a collective outside the CheckpointManager's calls"}
    with pytest.raises(ScheduleMismatchError) as ei:
        lockstep.unwrap([lockstep.wrap(None, 1), lockstep.wrap(at, 2), lockstep.wrap(at, 3)])
    assert list(ei.value.failures) == [0]
    assert "rank 0: a restore or step query" in str(ei.value)
    assert "ranks 1, 2: after_update #3(epoch=1, num_updates=3, end_of_epoch=False)" in \
        str(ei.value)
