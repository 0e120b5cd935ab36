"""A process that only reads never takes over the run folder (CASES C25, issue 25 defect 2).

An evaluator polling the run (``restore()``, ``restore(step=...)``, ``restore(keys=...)``,
``restore_or_initialize()`` with a default config, the trainer's ``Checkpointer``,
``xla_ckpt.load``) writes nothing and takes no lease, so the trainer saving there is never
fenced.  Taking over is the act of a job that saves: its first save takes the lease (or
``take_over()``), and from then on the stale predecessor is fenced and the successor's lineage
is "latest" (C15 still holds).

Real files and the GCS emulator; the evaluator is a real process (``evaluator_worker.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from manager_helpers import REPO, make_cfg

from xla_ckpt.cli.main import main as cli_main
from xla_ckpt.errors import FencedError
from xla_ckpt.manager import CheckpointManager
from xla_ckpt.run.catalog import pointer_order, read_pointer_doc, resolve_latest
from xla_ckpt.run.fencing import LEASE_NAME, read_lease
from xla_ckpt.storage import open_storage
from xla_ckpt.trainer import Checkpointer

HERE = os.path.dirname(os.path.abspath(__file__))
EVALUATOR = os.path.join(HERE, "evaluator_worker.py")


@pytest.fixture(params=["local", "gcs"])
def run_uri(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    return request.getfixturevalue("gcs_uri") + "/run"


def w_at(n: int) -> list[float]:
    """The trainer's model weight at update ``n`` (flat, exact in float32)."""
    return [n + 0.25, n + 0.5, n + 0.75, n + 1.0]


def lease_now(run_uri: str) -> tuple[int, int, int | None]:
    """``(epoch, owner pid, generation)`` of the run folder's lease."""
    with open_storage(run_uri) as st:
        lease = read_lease(st)
    assert lease is not None
    return lease.epoch, lease.owner["pid"], lease.generation


def pointer_now(run_uri: str) -> tuple[tuple[int, int], str | None]:
    with open_storage(run_uri) as st:
        doc = read_pointer_doc(st, "last")[0] or {}
    return pointer_order(doc), doc.get("checkpoint")


class Trainer:
    """A Checkpointer over Linear(2, 2) whose weight is :func:`w_at` of the update it saves."""

    def __init__(self, run_uri: str, **kw) -> None:
        self.model = torch.nn.Linear(2, 2)
        self.ckpt = Checkpointer(model=self.model,
                                 build_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        self.mgr = CheckpointManager(make_cfg(run_uri, **kw))

    def save(self, n: int, **kw) -> str:
        with torch.no_grad():
            self.model.weight.copy_(torch.tensor(w_at(n)).view(2, 2))
        self.ckpt.set_num_updates(n)
        return self.mgr.save(self.ckpt.state_dict(), epoch=1, num_updates=n, **kw)


class Evaluator:
    """``evaluator_worker.py`` in its own process, one round per request."""

    def __init__(self, run_uri: str, kind: str, tmp_path) -> None:
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + HERE, OMP_NUM_THREADS="1")
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        self.err = open(tmp_path / f"evaluator-{kind}.log", "w")
        self.proc = subprocess.Popen([sys.executable, EVALUATOR, "--run", run_uri, "--kind", kind],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, cwd=REPO)

    def round(self, prev: int) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"round {prev}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()  # bounded by the test's timeout mark
        assert line, f"the evaluator exited ({self.proc.poll()})"
        return json.loads(line)

    def close(self) -> int:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(30)
            self.err.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["manager", "checkpointer"])
def test_an_evaluator_process_polling_the_run_never_fences_the_trainer(run_uri, tmp_path,
                                                                       kind):
    """The trainer saves updates 1..6 (async from 3 on, keep-last 2); after each save is
    handed off, and while its upload runs, the evaluator restores latest, the step before,
    the model only, and with a fresh default-config manager (or the Checkpointer and
    xla_ckpt.load).  Every save commits; the lease is the trainer's, untouched."""
    trainer = Trainer(run_uri, keep_interval_updates=2, async_save=True)
    trainer.save(1, block=True)
    trainer.save(2, block=True)
    lease = lease_now(run_uri)
    assert lease[:2] == (1, os.getpid())
    ev = Evaluator(run_uri, kind, tmp_path)
    try:
        for n in range(3, 7):
            trainer.save(n, block=False)  # staged; its upload runs while the evaluator reads
            got = ev.round(prev=n - 2)
            latest = n - 1  # the save in flight commits at the trainer's next boundary
            if kind == "manager":
                assert got == {"latest_step": latest, "all_steps": [n - 2, n - 1],
                               "latest": [latest, w_at(latest)], "step": [n - 2, w_at(n - 2)],
                               "keys": [latest, ["model"], w_at(latest)],
                               "init": [latest, w_at(latest)]}, got
            else:
                assert got == {"checkpointer": [latest, w_at(latest)], "load": w_at(latest),
                               "load_last": w_at(latest)}, got
            assert trainer.mgr.wait() == (f"checkpoint_1_{n}",)  # committed: never fenced
            assert lease_now(run_uri) == lease  # nobody took (or rewrote) the lease
        trainer.save(7, block=True)  # the next save too
    finally:
        code = ev.close()
        trainer.mgr.close()
    assert code == 0
    assert lease_now(run_uri) == lease
    assert pointer_now(run_uri) == ((1, 7), "checkpoint_1_7")


def test_a_reader_manager_in_the_same_process_takes_no_lease(run_uri, capsys):
    """Two manager instances: the reader (a default config, not ``no_save``) polls by step,
    by keys and latest between the trainer's saves, and ``xla-ckpt ls`` / ``inspect`` look;
    the trainer is never fenced."""
    trainer = Trainer(run_uri, keep_interval_updates=-1)
    trainer.save(10)
    lease = lease_now(run_uri)
    with CheckpointManager(make_cfg(run_uri)) as reader:
        for n in (11, 12):
            assert cli_main(["--no-progress", "ls", run_uri]) == 0
            assert cli_main(["--no-progress", "inspect", run_uri]) == 0
            assert f"checkpoint_1_{n - 1}" in capsys.readouterr().out
            got = reader.restore_or_initialize()
            assert got is not None and got.num_updates == n - 1
            assert reader.restore(step=10).state["model"]["weight"].flatten().tolist() == w_at(10)
            part = reader.restore(keys=["model.weight"])
            assert part.state["model"]["weight"].flatten().tolist() == w_at(n - 1)
            assert (reader.latest_step(), reader.all_steps()) == (n - 1, list(range(10, n)))
            trainer.save(n)  # not fenced
        with open_storage(run_uri) as st:
            assert LEASE_NAME in st.list("")
        assert lease_now(run_uri) == lease
    trainer.mgr.close()
    assert pointer_now(run_uri) == ((1, 12), "checkpoint_1_12")


@pytest.mark.parametrize("b_step", [12, 15])
def test_a_successor_outranks_what_its_predecessor_committed_after_its_restore(run_uri, b_step):
    """A saves 10; B restores 10 (no lease); A, not fenced yet, commits 15; B's first save
    (at 12, or at 15 over A's folder) takes lease epoch 2: "latest" is B's from then on,
    A is fenced, and a restart resumes from B's checkpoint, not A's 15."""
    a = Trainer(run_uri, keep_interval_updates=-1)
    a.save(10)
    b = Trainer(run_uri, keep_interval_updates=-1)
    r = b.mgr.restore_or_initialize()
    assert r is not None and (r.checkpoint, r.num_updates) == ("checkpoint_1_10", 10)
    a.save(15)  # B has not saved: A still holds the run, this commits
    assert pointer_now(run_uri) == ((1, 15), "checkpoint_1_15")
    with CheckpointManager(make_cfg(run_uri)) as probe:  # a restart now: A's newest progress
        assert probe.latest_step() == 15
    b.save(b_step)  # B's first save: lease epoch 2, B's lineage from here on
    assert lease_now(run_uri)[0] == 2
    assert pointer_now(run_uri) == ((2, b_step), f"checkpoint_1_{b_step}")
    with open_storage(run_uri) as st:
        assert resolve_latest(st) == f"checkpoint_1_{b_step}"
    with pytest.raises(FencedError) as ei:
        a.save(20)
    assert (ei.value.own_epoch, ei.value.current_epoch) == (1, 2)
    assert pointer_now(run_uri) == ((2, b_step), f"checkpoint_1_{b_step}")
    with CheckpointManager(make_cfg(run_uri)) as restart:  # B's restart resumes B's lineage
        res = restart.restore_or_initialize()
        assert res is not None
        assert (res.checkpoint, res.num_updates) == (f"checkpoint_1_{b_step}", b_step)
        assert res.state["model"]["weight"].flatten().tolist() == w_at(b_step)
    a.mgr.close()
    b.mgr.close()


def test_take_over_fences_the_predecessor_before_the_first_save(run_uri):
    a = Trainer(run_uri, keep_interval_updates=-1)
    a.save(10)
    b = Trainer(run_uri, keep_interval_updates=-1)
    r = b.mgr.restore_or_initialize()
    assert r is not None and r.num_updates == 10
    assert lease_now(run_uri)[0] == 1
    assert b.mgr.take_over() == 2
    assert b.mgr.take_over() == 2  # idempotent
    with pytest.raises(FencedError) as ei:
        a.save(12)
    assert (ei.value.own_epoch, ei.value.current_epoch) == (1, 2)
    assert pointer_now(run_uri) == ((1, 10), "checkpoint_1_10")
    b.save(11)
    assert pointer_now(run_uri) == ((2, 11), "checkpoint_1_11")
    a.mgr.close()
    b.mgr.close()
