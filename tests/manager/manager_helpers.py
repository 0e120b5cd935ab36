"""Helpers for the CheckpointManager tests: configs, run-folder views, storages with held or
failing writes, and a launcher for train_loop.py processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from xla_ckpt.config import CheckpointConfig
from xla_ckpt.errors import StorageError
from xla_ckpt.storage.local import LocalStorage
from xla_ckpt.testing.launcher import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TRAIN_LOOP = os.path.join(HERE, "train_loop.py")


def make_cfg(save_dir: str, **kw) -> CheckpointConfig:
    """A CheckpointConfig for in-process tests: no SIGTERM handler unless asked, sync by default."""
    kw.setdefault("handle_sigterm", False)
    kw.setdefault("async_save", False)
    kw.setdefault("save_interval_epochs", 0)
    return CheckpointConfig(save_dir=save_dir, **kw)


def folders(run_dir: str) -> list[str]:
    """Checkpoint folders in a local run folder (sorted)."""
    return sorted(n for n in os.listdir(run_dir) if os.path.isdir(os.path.join(run_dir, n)))


def committed(run_dir: str) -> list[str]:
    return [n for n in folders(run_dir)
            if os.path.exists(os.path.join(run_dir, n, "manifest.json"))]


def pointer(run_dir: str, which: str) -> dict:
    with open(os.path.join(run_dir, f"checkpoint_{which}.json")) as f:
        return json.load(f)


class HeldWrites(LocalStorage):
    """A real local storage whose data-file writes wait until ``release`` is set.

    Models a slow upload (a latency a real disk does not produce on demand).
    Subclass per test (class attributes hold the shared events).
    """

    release: threading.Event
    started: list

    def write_atomic(self, name, buffers):
        if name.startswith("data-"):
            self.started.append(self.url(name))
            self.release.wait(30)
        return super().write_atomic(name, buffers)


class FailingWrites(LocalStorage):
    """A real local storage that fails data-file writes under checkpoint folders in ``fail_in``."""

    fail_in: set

    def write_atomic(self, name, buffers):
        folder = os.path.basename(self.uri)
        if name.startswith("data-") and folder in self.fail_in:
            raise StorageError(f"{self.url(name)}: write failed: 503 Service Unavailable")
        return super().write_atomic(name, buffers)


def launch(world_size: int, args: list[str], log_dir: str) -> list[subprocess.Popen]:
    """Start ``world_size`` train_loop.py processes sharing a gloo group on 127.0.0.1.

    stdout (JSON events) is piped; stderr goes to ``<log_dir>/rank<r>.log``.
    """
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PJRT_DEVICE="CPU")
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT"):
            env.pop(k, None)
        if world_size > 1:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                       LOCAL_WORLD_SIZE=str(world_size), GLOO_SOCKET_IFNAME="lo")
        err = open(os.path.join(log_dir, f"rank{rank}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, TRAIN_LOOP, *args], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                      text=True, cwd=REPO))
        err.close()
    return procs


def stderr_of(log_dir: str, rank: int) -> str:
    with open(os.path.join(log_dir, f"rank{rank}.log")) as f:
        return f.read()


def read_events(proc: subprocess.Popen, until=None) -> list[dict]:
    """JSON events from a train_loop process's stdout, up to and including ``until(ev)``."""
    out = []
    for line in proc.stdout:
        ev = json.loads(line)
        out.append(ev)
        if until is not None and until(ev):
            break
    return out
