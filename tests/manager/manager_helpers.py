"""Helpers for the CheckpointManager tests: configs, run-folder views, storages with held or
failing writes, and driving train_loop.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

from xla_ckpt.errors import StorageError
from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.manager import CheckpointConfig
from xla_ckpt.storage.local import LocalStorage

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
    """Checkpoint folders holding any object in a local run folder (sorted).

    An emptied folder does not count: it holds no object (and on GCS it does not exist).
    """
    if not os.path.isdir(run_dir):
        return []
    paths = {n: os.path.join(run_dir, n) for n in os.listdir(run_dir)}
    return sorted(n for n, p in paths.items() if os.path.isdir(p) and os.listdir(p))


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

    def write_atomic(self, name, buffers, **kw):
        if name.startswith("data-"):
            self.started.append(self.url(name))
            self.release.wait(30)
        return super().write_atomic(name, buffers, **kw)


class FailingWrites(LocalStorage):
    """A real local storage that fails data-file writes under checkpoint folders in ``fail_in``."""

    fail_in: set

    def write_atomic(self, name, buffers, **kw):
        folder = os.path.basename(self.uri)
        if name.startswith("data-") and folder in self.fail_in:
            raise StorageError(f"{self.url(name)}: write failed: 503 Service Unavailable")
        return super().write_atomic(name, buffers, **kw)


def start_train_loop(args: list[str], log_path: str) -> subprocess.Popen:
    """Start train_loop.py as a real single-process job (stderr to ``log_path``)."""
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PJRT_DEVICE="CPU")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT"):
        env.pop(k, None)
    with open(log_path, "w") as err:
        return subprocess.Popen([sys.executable, TRAIN_LOOP, *args], env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                cwd=REPO)


def events(events_dir: str, rank: int) -> list[dict]:
    """The JSON events train_loop wrote for ``rank``."""
    path = os.path.join(events_dir, f"events-{rank}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def wait_for_files(paths: list[str], proc_alive=lambda: True, timeout_s: float = 90.0) -> None:
    """Wait until every path exists (the training loop paused), or fail."""
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in paths):
        if not proc_alive():
            raise AssertionError(f"training stopped before pausing (waiting for {paths})")
        if time.monotonic() > deadline:
            raise AssertionError(f"{paths} did not all appear within {timeout_s} s")
        time.sleep(0.02)


_LIST = re.compile(r"^/storage/v1/b/[^/]+/o/?$")
_BUCKET = re.compile(r"^/storage/v1/b/[^/]+/?$")


def kind(rec) -> str:
    """list / bucket / stat / manifest / pointer / lease / data / write (from the request)."""
    base = rec.object_name.rsplit("/", 1)[-1]
    if rec.method == "GET" and not rec.object_name:
        return "list" if _LIST.match(rec.path) else "bucket" if _BUCKET.match(rec.path) else "?"
    if base == "lease.json":
        return "lease"
    if rec.info.is_download:
        return {MANIFEST_NAME: "manifest", "checkpoint_last.json": "pointer",
                "checkpoint_best.json": "pointer"}.get(base, "data")
    return "stat" if rec.method == "GET" else "write"
