"""Ctrl-C, SIGTERM or an exception while an async save is in flight (issue 25, defect 4; C27).

A save the training thread already handed off commits before the process exits (within
``exit_grace_s``), or is named as abandoned in an ERROR line while the previous checkpoint
stays intact.  Real processes (exit_worker.py): a 32 MiB state, stopped at points after the
handoff: right after it, while the data file is written, while the commit marker is written,
from outside after a delay, by an exception in the loop, by SIGTERM.  (The issue's input:
4 of 4 runs with SIGINT 0-0.6 s after the handoff committed nothing.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from exit_worker import w_at
from manager_helpers import REPO, committed, pointer, wait_for_files

import xla_ckpt

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exit_worker.py")
EXIT_S = 120  # a hang bound, not a timing assertion


def _run(mode: str, tmp_path, *, signal_after_s: float | None = None,
         sig: int = signal.SIGINT) -> tuple[int, str, str]:
    run_dir, ev = str(tmp_path / "run"), str(tmp_path / "ev")
    os.mkdir(ev)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    log_path = str(tmp_path / "worker.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, WORKER, mode, run_dir, ev], env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=REPO,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        if signal_after_s is not None:
            wait_for_files([os.path.join(ev, "handoff")], lambda: proc.poll() is None)
            time.sleep(signal_after_s)  # where the signal lands, not something asserted
            proc.send_signal(sig)
        rc = proc.wait(EXIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with open(log_path) as f:
        return rc, f.read(), run_dir


def _holds(run_dir: str, name: str, n: int) -> bool:
    return torch.equal(xla_ckpt.load(os.path.join(run_dir, name))["model"]["w"], w_at(n))


def _assert_committed_on_the_way_out(run_dir: str, log: str) -> None:
    assert committed(run_dir)[:2] == ["checkpoint_1_1", "checkpoint_1_2"], log
    assert _holds(run_dir, "checkpoint_1_1", 1) and _holds(run_dir, "checkpoint_1_2", 2)
    assert "abandoned" not in log, log


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sigint-now", "sigint-upload", "sigint-commit"])
def test_ctrl_c_after_the_handoff_commits_the_save_before_exiting(tmp_path, mode):
    rc, log, run_dir = _run(mode, tmp_path)
    assert rc == -signal.SIGINT, log  # the KeyboardInterrupt still ends the process
    assert "KeyboardInterrupt" in log
    _assert_committed_on_the_way_out(run_dir, log)
    line = f"committed {run_dir}/checkpoint_1_2 on the way out (leaving on KeyboardInterrupt)"
    assert line in log, log
    assert pointer(run_dir, "last")["checkpoint"] == "checkpoint_1_2"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_with_a_manager_never_closed_still_commits_in_one_process(tmp_path):
    """No ``with``, no close(): one process has no other rank to agree with, so the exit
    hook finishes the save in flight within exit_grace_s (the issue's single-process loop)."""
    rc, log, run_dir = _run("no-with", tmp_path)
    assert rc == -signal.SIGINT, log
    _assert_committed_on_the_way_out(run_dir, log)
    assert f"committed {run_dir}/checkpoint_1_2 on the way out (leaving on exit)" in log, log
    assert pointer(run_dir, "last")["checkpoint"] == "checkpoint_1_2"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_from_outside_shortly_after_the_handoff(tmp_path):
    """The issue's input: SIGINT 0-0.6 s after the handoff (the loop may have committed it
    meanwhile; either way it is committed and bitwise).  0 s is sigint-now above; the whole
    range at 192 MiB is benchmarks/exit_with_save_in_flight.py."""
    rc, log, run_dir = _run("sigint-external", tmp_path, signal_after_s=0.3)
    assert rc == -signal.SIGINT, log
    _assert_committed_on_the_way_out(run_dir, log)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_exception_in_the_loop_commits_the_save_and_still_propagates(tmp_path):
    rc, log, run_dir = _run("raise", tmp_path)
    assert rc == 1, log
    assert "RuntimeError: an error in the training loop" in log
    _assert_committed_on_the_way_out(run_dir, log)
    assert f"committed {run_dir}/checkpoint_1_2 on the way out (leaving on RuntimeError)" in log


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_after_the_handoff_commits_it_and_the_preemption_save(tmp_path):
    rc, log, run_dir = _run("sigterm", tmp_path, signal_after_s=0.0, sig=signal.SIGTERM)
    assert rc == 0, log
    names = committed(run_dir)
    assert names[:2] == ["checkpoint_1_1", "checkpoint_1_2"] and len(names) == 3, names
    assert _holds(run_dir, "checkpoint_1_2", 2)
    last = pointer(run_dir, "last")
    assert last["checkpoint"] == names[2] and _holds(run_dir, names[2], last["num_updates"])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode, reason", [
    ("abandon-now", "leaving on KeyboardInterrupt with exit_grace_s=0"),
    ("abandon-grace", "leaving on KeyboardInterrupt, it did not commit within exit_grace_s=1 s"),
])
def test_a_save_given_up_is_named_and_the_previous_checkpoint_stays(tmp_path, mode, reason):
    rc, log, run_dir = _run(mode, tmp_path)
    # Known defect (issue 25's closing note): the abandoned upload runs on a daemon thread,
    # and when interpreter finalization catches it inside torch's C++ code the process ends
    # with "terminate called without an active exception" (SIGABRT) instead of SIGINT; seen
    # once in ~30 runs.  The process still ends at once, and what it leaves is checked below.
    assert rc == -signal.SIGINT or (rc == -signal.SIGABRT and "terminate called" in log), log
    line = (f"ERROR:xla_ckpt.manager.core:[rank 0] abandoned the save of checkpoint "
            f"{run_dir}/checkpoint_1_2: {reason}.  It is not committed")
    assert line in log, log
    kept = f"the previous checkpoint {run_dir}/checkpoint_1_1 and the pointers are unchanged"
    assert kept in log
    assert committed(run_dir) == ["checkpoint_1_1"]
    assert _holds(run_dir, "checkpoint_1_1", 1)
    assert pointer(run_dir, "last")["checkpoint"] == "checkpoint_1_1"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_rank_leaving_on_an_error_commits_the_save_together(tmp_path):
    from exit_worker import every_rank_raises

    from xla_ckpt.testing.launcher import shared_pool

    run_dir = str(tmp_path / "run")
    outs = [r.unwrap() for r in shared_pool(2, xla=False).run(every_rank_raises, run_dir,
                                                               timeout_s=120)]
    for rank, o in enumerate(outs):
        assert o["error"] == f"an error on rank {rank}"
        assert o["committed"] == ["checkpoint_1_1", "checkpoint_1_2"]
    ck = os.path.join(run_dir, "checkpoint_1_2")
    assert torch.equal(xla_ckpt.load(ck)["model"]["w"], w_at(2)[: 1 << 16])
    assert [xla_ckpt.load(ck, item=f"rank/{r:05d}") for r in range(2)] == [{"r": 0}, {"r": 1}]
