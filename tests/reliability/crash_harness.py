"""Crash consistency: SIGKILL a saving process at chosen points of its write sequence.

How a kill point is chosen (deterministically):

1. A *dry run* saves checkpoint C into a run folder that already holds two
   committed checkpoints A and B (a restarted job: it restored B first), with a
   tracer hooked under the storage backend.  The tracer records the saver's
   sequence of *mutating steps*:

   * local backend: every ``write`` / ``fsync`` / ``replace`` (rename) /
     ``link`` (create-only publication) / ``unlink`` / ``rmdir``
     :mod:`xla_ckpt.storage.local` issues (the backend's ``os`` module is swapped
     for a recording proxy);
   * GCS backend: every mutating HTTP request the client sends (multipart
     and media uploads, compose, delete), hooked at
     ``requests.Session.request`` under the real ``google-cloud-storage``
     client.

2. A kill point is a position in that sequence: *before* step ``i``, or
   *inside* the body of write/upload step ``i`` after ``k`` of its bytes
   went out, or *after* the last step (the save returned).

3. For each point a fresh saver process (forked from a clean zygote) sets up
   A and B, arms the tracer and saves C.  When it reaches the point it writes
   its position to a pipe and blocks; the harness SIGKILLs it there.  A byte
   point writes exactly ``k`` bytes first (``os.write`` of the prefix, or a
   request body that has sent ``k`` bytes when the process dies).  Each
   killed saver re-records its steps and checks that they match the dry run
   (same operation on the same object, save ids masked), so a point always
   means the same place.

4. Another fresh process (forked from the zygote, never from the saver) then
   looks at the run folder: what is committed, what ``xla-ckpt ls --json``
   says, which checkpoint "latest" resolves to, whether the latest and every
   other committed checkpoint restores bitwise, and whether a resumed job can
   save again and restore that bitwise.

The zygote is one launcher worker (a fresh spawned interpreter that imported
torch and xla_ckpt); forking from it costs milliseconds, so hundreds of kill
points run in minutes.  Used by ``tests/reliability/test_crash_consistency.py``
and ``benchmarks/reliability.py``.

**Fencing family** (:func:`fencing_campaign`, case C15).  Two incarnations of one
job share the run folder.  The predecessor P (lease epoch 2: a set-up incarnation
committed A and B with epoch 1, P restored B) saves C with keep-last 1 and is
paused at each point of that save, chosen from its dry run as above.  While it is
paused the successor S starts in a fresh process, restores the latest committed
checkpoint (no lease) and saves ``checkpoint_1_20`` (keep-last 2: the one it restored
and its own; that first save takes lease epoch 3).  Then,
by variant:

* ``kill``: P was SIGKILLed at the point before S started;
* ``resume``: P was left running: it goes on from the point once S finished (or,
  when S waits on a folder lock P holds at that point, as soon as that is seen),
  and then tries one more save.

A fresh verifier then checks the invariants (:func:`check_fencing`): S's
checkpoints are committed, byte-identical to what S wrote and restore bitwise;
``checkpoint_last`` names S's checkpoint; the pointer's ``(lease_epoch,
num_updates)`` observed after every phase never decreased; nothing P committed
after S took the lease is pointed to; P got :class:`~xla_ckpt.errors.FencedError`
naming both epochs wherever a lease check was still ahead of it, and its later save
raised at once without a single mutating step.

**Sharded family** (:func:`sharded_campaign`, issue 12).  A 2-rank gloo job forked from the
zygote saves DTensor state with the chunked ``save_distributed``; every rank is traced, one
rank is SIGKILLed at each point of its own steps and then its peer; a fresh job verifies the
run folder with restores into DTensor targets (:func:`check_sharded`).  :func:`run_job` forks
such a job for the sharded rank-failure cases of ``rank_workers.py``; :func:`run_jobs` many at
once (the rank-failure batch of ``test_rank_failures.py``, the docs' ``torchrun`` blocks).

Each campaign can run its points in ``lanes`` side by side (:func:`in_lanes`): every point has
its own run folder, and a kill point is a place in the saver's own sequence of steps, not a
moment, so two lanes keep both cores of a small machine busy without changing any point.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import pickle
import re
import select
import shutil
import signal
import threading
import time
import traceback
import types
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

import torch

A, B, C = "checkpoint_1_1", "checkpoint_1_2", "checkpoint_1_3"  # two committed, one being saved
SAVE_TIMEOUT_S = 60.0

_HEX = re.compile(r"data-[0-9a-f]{12}-")
_TMP = re.compile(r"\.tmp-[0-9a-f]{12}")


# ---- the state that is saved ---------------------------------------------------------------

def state_for(num_updates: int) -> dict:
    """A small training state (about 330 KiB of tensors) that depends only on ``num_updates``."""
    g = torch.Generator().manual_seed(1000 + num_updates)
    w = torch.randn(256, 256, generator=g)
    return {
        "model": {"encoder.w": w, "encoder.b": torch.randn(256, generator=g),
                  "emb": torch.randn(64, 32, generator=g).to(torch.bfloat16),
                  "tied": w[:4]},  # a view: aliasing must survive
        "optimizer": {"state": {0: {"exp_avg": torch.randn(4096, generator=g),
                                    "step": torch.tensor(float(num_updates))}},
                      "param_groups": [{"lr": 0.1 / num_updates, "betas": (0.9, 0.98),
                                        "params": [0]}]},
        "extra_state": {"num_updates": num_updates, "previous_training_time": 1.5 * num_updates,
                        "train_iterator": {"epoch": 1, "iterations_in_epoch": num_updates,
                                           "version": 2}},
        "args": argparse.Namespace(lr=[0.1], arch="tiny"),
    }


def rank_state_for(num_updates: int) -> dict:
    g = torch.Generator().manual_seed(2000 + num_updates)
    return {"rng": torch.randint(0, 255, (512,), generator=g, dtype=torch.uint8),
            "iterations_in_epoch": num_updates}


def num_updates_of(name: str) -> int:
    return int(name.rsplit("_", 1)[1])


# ---- kill points -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    """One mutating storage operation of the save, as the tracer saw it.

    Attributes:
        op: ``write``/``fsync``/``replace``/``unlink``/``rmdir`` (local) or
            ``upload``/``compose``/``delete`` (GCS).
        target: the file or object it touches, relative to the run folder,
            save ids and temp suffixes masked.
        nbytes: bytes the step writes (writes and uploads; 0 otherwise).
    """

    op: str
    target: str
    nbytes: int = 0


@dataclass(frozen=True)
class KillPoint:
    """Where to kill: ``before`` step ``step``, at ``byte`` of its body, or ``after`` it.

    A negative ``byte`` counts from the end of the body (-1: all but the last
    byte went out), so it means the same place when the body's size varies.
    """

    step: int
    at: str  # "before" | "byte" | "after"
    byte: int = 0

    def label(self, steps: list[Step]) -> str:
        s = steps[self.step]
        b = f"n{self.byte}" if self.byte < 0 else str(self.byte)
        where = {"before": "before", "after": "after"}.get(self.at, f"at byte {b} of")
        return f"{where} step {self.step} ({s.op} {s.target})"


def commit_step(steps: list[Step]) -> int:
    """Index of the step after which C's manifest (the commit marker) is visible."""
    for i, s in enumerate(steps):
        if s.target == f"{C}/manifest.json" and s.op in ("replace", "link", "upload"):
            return i
    raise AssertionError(f"no manifest write for {C} in the trace: {steps}")


def committed_at(point: KillPoint, steps: list[Step]) -> bool:
    """True if C must be committed when the saver dies at ``point``."""
    c = commit_step(steps)
    return point.step > c or (point.step == c and point.at == "after")


def same_place(seen: list[Step], steps: list[Step], point: KillPoint) -> bool:
    """True if a killed saver's steps are the dry run's up to the kill point.

    Operations and targets must match; sizes may differ by a few bytes (the
    manifest carries a timestamp) but a byte point must fall inside its body.
    """
    if len(seen) != point.step + 1:
        return False
    if [(s.op, s.target) for s in seen] != [(s.op, s.target) for s in steps[:len(seen)]]:
        return False
    return point.at != "byte" or -seen[point.step].nbytes <= point.byte < seen[point.step].nbytes


def choose_points(steps: list[Step], count: int) -> list[KillPoint]:
    """``count`` kill points spread over the whole sequence (deterministic).

    Candidates: before every step, after the last one, and inside every body
    after its first, middle and last-but-one byte, plus evenly spaced bytes of
    the largest bodies until there are at least ``count``.  The result always
    holds the points around the commit marker (before, inside its last byte,
    after, before the next step), then -- if ``count`` allows -- a ``before``
    point for every step, then byte points taken evenly from the rest.
    """
    pts: list[KillPoint] = []
    for i, s in enumerate(steps):
        pts.append(KillPoint(i, "before"))
        if s.nbytes >= 2:
            pts += [KillPoint(i, "byte", b) for b in sorted({1, s.nbytes // 2})]
            pts.append(KillPoint(i, "byte", -1))
    pts.append(KillPoint(len(steps) - 1, "after"))
    c = commit_step(steps)
    pts.append(KillPoint(c, "after"))
    bodies = sorted((i for i, s in enumerate(steps) if s.nbytes >= 16),
                    key=lambda i: -steps[i].nbytes)
    extra = 3
    while len(set(pts)) < count and bodies:
        for i in bodies:
            n = steps[i].nbytes
            pts += [KillPoint(i, "byte", b) for b in (n * j // (extra + 1)
                                                       for j in range(1, extra + 1)) if 0 < b < n]
        extra = extra * 2 + 1

    def order(p: KillPoint) -> tuple:
        b = p.byte if p.byte >= 0 else steps[p.step].nbytes + p.byte
        return (p.step, {"before": 0, "byte": 1, "after": 2}[p.at], b)

    uniq = sorted(set(pts), key=order)
    if len(uniq) <= count:
        return uniq
    must = {KillPoint(c, "before"), KillPoint(c, "byte", -1), KillPoint(c, "after"),
            KillPoint(c + 1, "before")} & set(uniq)
    base = must | {KillPoint(i, "before") for i in range(len(steps))}
    if len(base) >= count:
        return sorted(must | set(_evenly(sorted(base - must, key=order), count - len(must))),
                      key=order)
    rest = [p for p in uniq if p not in base]
    return sorted(base | set(_evenly(rest, count - len(base))), key=order)


def _evenly(items: list, k: int) -> list:
    """``k`` items taken at even intervals (first and last included)."""
    if k <= 0:
        return []
    if k == 1 or len(items) <= k:
        return items[:max(k, 0)] if len(items) > k else list(items)
    return [items[round(j * (len(items) - 1) / (k - 1))] for j in range(k)]


# ---- the tracer and its hooks ----------------------------------------------------------------

class Tracer:
    """Records mutating steps; pauses the process at the armed kill point.

    ``notify`` is a pipe fd: when the point is reached one JSON line goes out
    and the calling thread blocks until the harness kills the process, or -- with a
    ``resume`` pipe fd -- until the harness writes one byte there; then the step goes
    on where it stopped (the rest of a write's or an upload's body included).
    """

    def __init__(self, root: str, notify: int, resume: int | None = None) -> None:
        self.root = root.rstrip("/")
        self.notify = notify
        self.resume = resume
        self.steps: list[Step] = []
        self.armed = False
        self.kill: KillPoint | None = None
        self._lock = threading.Lock()

    def target(self, path: str) -> str:
        if path == self.root:
            return "."
        rel = path[len(self.root) + 1:] if path.startswith(self.root + "/") else path
        return _TMP.sub(".tmp-*", _HEX.sub("data-*-", rel))

    def begin(self, op: str, path: str, nbytes: int = 0) -> int:
        if not self.armed:
            return -1
        with self._lock:
            i = len(self.steps)
            self.steps.append(Step(op, self.target(path), nbytes))
        if self.kill is not None and self.kill.step == i and self.kill.at == "before":
            self.pause(i)
        return i

    def end(self, i: int) -> None:
        if i >= 0 and self.kill is not None and self.kill.step == i and self.kill.at == "after":
            self.pause(i)

    def byte_limit(self, i: int) -> int | None:
        """Bytes of step ``i``'s body to let through before pausing (None: all)."""
        if i >= 0 and self.kill is not None and self.kill.step == i and self.kill.at == "byte":
            b = self.kill.byte
            return b if b >= 0 else self.steps[i].nbytes + b
        return None

    def pause(self, i: int) -> None:
        msg = {"paused": i, "steps": [asdict(s) for s in self.steps]}
        os.write(self.notify, (json.dumps(msg) + "\n").encode())
        if self.resume is not None and os.read(self.resume, 1):
            self.kill = None  # consumed: the save goes on from here
            return
        while True:  # the harness SIGKILLs us here
            time.sleep(3600)


class _LocalOs(types.SimpleNamespace):
    """Stands in for the ``os`` module inside :mod:`xla_ckpt.storage.local`."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self._t = tracer
        self._paths: dict[int, str] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def open(self, path, flags, mode=0o777, **kw):
        fd = os.open(path, flags, mode, **kw)
        self._paths[fd] = os.fspath(path)
        return fd

    def close(self, fd):
        self._paths.pop(fd, None)
        return os.close(fd)

    def write(self, fd, data):
        mv = memoryview(data).cast("B")
        i = self._t.begin("write", self._paths.get(fd, "?"), len(mv))
        limit = self._t.byte_limit(i)
        if limit is not None:
            done = 0
            while done < limit:
                done += os.write(fd, mv[done:limit])
            self._t.pause(i)
            while done < len(mv):  # resumed: the rest of the body
                done += os.write(fd, mv[done:])
            self._t.end(i)
            return done
        n = os.write(fd, mv)
        self._t.end(i)
        return n

    def fsync(self, fd):
        i = self._t.begin("fsync", self._paths.get(fd, "?"))
        os.fsync(fd)
        self._t.end(i)

    def replace(self, src, dst):
        i = self._t.begin("replace", os.fspath(dst))
        os.replace(src, dst)
        self._t.end(i)

    def link(self, src, dst, **kw):  # create-only publication (the commit marker)
        i = self._t.begin("link", os.fspath(dst))
        os.link(src, dst, **kw)
        self._t.end(i)

    def unlink(self, path):
        i = self._t.begin("unlink", os.fspath(path))
        os.unlink(path)
        self._t.end(i)

    def rmdir(self, path):
        i = self._t.begin("rmdir", os.fspath(path))
        os.rmdir(path)
        self._t.end(i)


class _PausingBody:
    """A request body that sends ``stop`` bytes, then pauses the process (mid-upload)."""

    def __init__(self, data: bytes, stop: int, tracer: Tracer, step: int) -> None:
        self.data, self.stop, self.tracer, self.step = data, stop, tracer, step
        self.pos = 0

    def __len__(self) -> int:
        return len(self.data)

    def read(self, n: int = -1) -> bytes:
        if self.pos >= self.stop and self.stop < len(self.data):
            self.tracer.pause(self.step)
            self.stop = len(self.data)  # resumed: send the rest
        k = self.stop - self.pos if n is None or n < 0 else min(n, self.stop - self.pos)
        chunk = self.data[self.pos:self.pos + k]
        self.pos += k
        return chunk


def _body_bytes(data: Any) -> bytes:
    if data is None:
        return b""
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if hasattr(data, "read"):  # xla_ckpt.storage.gcs.writes._BodyReader over several buffers
        parts = []
        while True:
            chunk = data.read(1 << 20)
            if not chunk:
                break
            parts.append(bytes(chunk))
        return b"".join(parts)
    raise TypeError(f"unexpected request body type {type(data).__name__}")


_UPLOAD_NAME = re.compile(rb'"name"\s*:\s*"([^"]+)"')


def _gcs_target(method: str, url: str, params: dict | None, body: bytes) -> tuple[str, str]:
    """(op, full object name) of a mutating GCS JSON-API request."""
    from urllib.parse import unquote, urlsplit

    path = unquote(urlsplit(url).path)
    if "/upload/" in path:
        name = (params or {}).get("name")
        if name is None:
            hit = _UPLOAD_NAME.search(body[:4096])
            name = hit.group(1).decode() if hit else "?"
        return "upload", name
    m = re.search(r"/o/(.+?)(/compose)?$", path)
    obj = m.group(1) if m else path
    if m and m.group(2):
        return "compose", obj
    return {"DELETE": "delete"}.get(method, method.lower()), obj


def install_gcs_hook(tracer: Tracer, bucket: str) -> None:
    """Trace (and pause at) every mutating request of this process's GCS clients to ``bucket``."""
    import requests

    real = requests.Session.request

    def request(self, method, url, *args, **kw):
        if method.upper() not in ("POST", "PUT", "PATCH", "DELETE") or "/b/" + bucket not in url:
            return real(self, method, url, *args, **kw)
        body = _body_bytes(kw.get("data"))
        op, obj = _gcs_target(method.upper(), url, kw.get("params"), body)
        if "data" in kw:
            kw["data"] = body
        i = tracer.begin(op, obj, len(body) if op == "upload" else 0)
        limit = tracer.byte_limit(i)
        if limit is not None:
            kw["data"] = _PausingBody(body, limit, tracer, i)
        resp = real(self, method, url, *args, **kw)
        tracer.end(i)
        return resp

    requests.Session.request = request  # type: ignore[method-assign]  # the hook, on purpose


def install_local_hook(tracer: Tracer) -> None:
    import xla_ckpt.storage.local as local

    local.os = _LocalOs(tracer)  # type: ignore[assignment]  # a tracing stand-in for os


# ---- storage set-up per backend ----------------------------------------------------------------

def storage_config(backend: str, *, traced: bool = True):
    """Knobs for the crash runs: GCS uploads the ~330 KiB state file as 3 parts + compose.

    ``max_workers=1`` keeps the parts in one order, so every run issues the
    same sequence of requests.  Set-up and verification (``traced=False``)
    use plain one-request uploads.
    """
    from xla_ckpt.storage import StorageConfig

    if backend == "gcs" and not traced:
        return StorageConfig(initial_backoff_s=0.01, max_backoff_s=0.1, retry_deadline_s=20.0)
    if backend == "gcs":
        return StorageConfig(max_workers=1, parallel_upload_threshold_bytes=192 * 1024,
                             upload_part_size_bytes=128 * 1024, initial_backoff_s=0.01,
                             max_backoff_s=0.1, retry_deadline_s=20.0)
    return StorageConfig(max_workers=2)


def manager_for(run_uri: str, backend: str, *, async_save: bool = False, traced: bool = True,
                keep: int = 2):
    from xla_ckpt.comm import SingleProcess
    from xla_ckpt.manager import CheckpointConfig, CheckpointManager

    cfg = CheckpointConfig(save_dir=run_uri, save_interval_epochs=0, save_interval_updates=0,
                           keep_interval_updates=keep, async_save=async_save,
                           handle_sigterm=False,
                           exit_on_preemption=False, reuse_staging_buffers=False)
    return CheckpointManager(cfg, dist=SingleProcess(),
                             storage_config=storage_config(backend, traced=traced))


def _save(mgr, n: int, *, block: bool = True) -> None:
    mgr.save(state_for(n), epoch=1, num_updates=n, name=f"checkpoint_1_{n}",
             rank_state=rank_state_for(n), block=block)


# ---- processes ------------------------------------------------------------------------------

def _saver_main(run_uri: str, backend: str, mode: str, kill: KillPoint | None, wfd: int,
                bucket: str) -> None:
    """Body of a forked saver: set up A and B, arm, save C (sync or async), report."""
    torch.set_num_threads(1)
    root = run_uri if backend == "local" else run_uri.split("/", 3)[3]
    tracer = Tracer(root, wfd)
    if backend == "local":
        install_local_hook(tracer)
    else:
        install_gcs_hook(tracer, bucket)
    mgr = manager_for(run_uri, backend, traced=False)
    _save(mgr, 1)
    _save(mgr, 2)
    mgr.close()
    mgr = manager_for(run_uri, backend, async_save=(mode == "async"))
    mgr.restore_or_initialize()  # a restarted job: restores B first ...
    mgr.take_over()  # ... and takes its lease before the traced save (a restore takes none)
    tracer.kill = kill
    tracer.armed = True
    if mode == "sync":
        _save(mgr, 3)
    else:
        # Async: stage C, then keep "training" (the live tensors change in place) while the
        # background thread uploads; each update boundary advances the save towards its commit.
        live = state_for(3)
        mgr.save(live, epoch=1, num_updates=3, name=C, rank_state=rank_state_for(3),
                 block=False)
        u = 3
        while mgr.in_flight is not None:
            u += 1
            live["model"]["encoder.w"].add_(1.0)  # training goes on: the snapshot must not see it
            live["optimizer"]["state"][0]["exp_avg"].mul_(0.5)
            mgr.after_update(epoch=1, num_updates=u, state=live)
            time.sleep(0.002)
    mgr.close()
    tracer.armed = False
    os.write(wfd, (json.dumps({"done": True, "steps": [asdict(s) for s in tracer.steps]})
                   + "\n").encode())


def _fork(fn: Callable[[int], None]) -> tuple[int, int]:
    """Fork a child running ``fn(write_fd)``; returns (pid, read_fd)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            fn(w)
        except BaseException:  # noqa: BLE001 - reported to the harness, then exit
            try:
                os.write(w, (json.dumps({"error": traceback.format_exc()[-4000:]}) + "\n").encode())
            except OSError:
                pass
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _read_line(fd: int, timeout_s: float) -> dict | None:
    """One JSON line from the pipe, or None on EOF/timeout."""
    buf = b""
    deadline = time.monotonic() + timeout_s
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return None
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        buf += chunk
    line = buf.split(b"\n", 1)[0]
    return json.loads(line) if line else None


def kill_and_reap(pid: int) -> None:
    """SIGKILL ``pid`` if it still runs and reap it (a teardown, whatever state it ended in)."""
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def kill_all(procs: Iterable[tuple[int, int]]) -> None:
    """SIGKILL every ``(pid, pipe fd)`` still running, reap it and close its pipe (a job's
    teardown, whatever state it ended in)."""
    for pid, r in procs:
        kill_and_reap(pid)
        os.close(r)


def _reap(pid: int, timeout_s: float = 30.0) -> int:
    """Wait for a child; returns its exit status the way subprocess does (-signal when killed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -signal.SIGKILL
        time.sleep(0.005)


def run_saver(run_uri: str, backend: str, mode: str, kill: KillPoint | None,
              bucket: str = "") -> dict:
    """Fork a saver; SIGKILL it at ``kill``.  Returns what happened (exit code, recorded steps)."""
    pid, r = _fork(lambda w: _saver_main(run_uri, backend, mode, kill, w, bucket))
    try:
        msg = _read_line(r, SAVE_TIMEOUT_S)
        if msg is not None and "paused" in msg:
            os.kill(pid, signal.SIGKILL)  # the crash
        code = _reap(pid)
    finally:
        os.close(r)
    out: dict[str, Any] = {"exitcode": code, "paused": None, "steps": None, "error": None}
    if msg is None:
        out["error"] = f"saver gave no sign within {SAVE_TIMEOUT_S} s (exit code {code})"
    elif "error" in msg:
        out["error"] = msg["error"]
    else:
        out["paused"] = msg.get("paused")
        out["steps"] = [Step(**s) for s in msg["steps"]]
    return out


# ---- the verifier (a fresh process) --------------------------------------------------------------

def _ls_json(run_uri: str) -> dict:
    from xla_ckpt.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["ls", "--json", run_uri])
    if code != 0:
        raise AssertionError(f"xla-ckpt ls exited with {code}: {out.getvalue()[-500:]}")
    return json.loads(out.getvalue())


def _bitwise(restored_state, restored_rank, n: int) -> str:
    """'' when the restored state is bit for bit what was saved at ``n``, else the difference."""
    from xla_ckpt.testing.asserts import assert_state_identical

    try:
        assert_state_identical(restored_state, state_for(n))
        assert_state_identical(restored_rank, rank_state_for(n))
        aliased = restored_state["model"]["tied"].untyped_storage().data_ptr() == \
            restored_state["model"]["encoder.w"].untyped_storage().data_ptr()
        if not aliased:
            return "model.tied no longer shares storage with model.encoder.w"
    except AssertionError as e:
        return str(e)
    return ""


def stray_objects(run_uri: str, backend: str, emulator_host: str = "") -> list[str]:
    """Temp objects of interrupted writes under the run folder (never listed as checkpoints)."""
    if backend == "local":
        out = []
        for d, _dirs, files in os.walk(run_uri):
            out += [os.path.relpath(os.path.join(d, f), run_uri) for f in files if ".tmp-" in f]
        return sorted(out)
    from xla_ckpt.storage.gcs import GCSStorage

    st = GCSStorage(run_uri, storage_config(backend, traced=False), endpoint=emulator_host or None)
    try:
        return [n for n in st.list("", include_in_flight=True) if ".tmp-" in n]
    finally:
        st.close()


def _verify_main(run_uri: str, backend: str, recover: bool, wfd: int,
                 emulator_host: str, digest: tuple[str, ...] = ()) -> None:
    torch.set_num_threads(1)
    from xla_ckpt.comm import SingleProcess
    from xla_ckpt.restore import restore
    from xla_ckpt.run.catalog import list_checkpoints, read_pointer_doc, resolve_latest
    from xla_ckpt.storage import open_storage

    out: dict[str, Any] = {}
    with open_storage(run_uri, storage_config(backend, traced=False)) as run:
        entries = list_checkpoints(run)
        out["committed"] = [e.name for e in entries if e.committed]
        out["incomplete"] = [e.name for e in entries if not e.committed]
        out["latest"] = resolve_latest(run)
        out["pointer_last"] = read_pointer_doc(run, "last")[0]
        out["pointer_best"] = read_pointer_doc(run, "best")[0]
        if digest:
            out["digests"] = {f: folder_digest(run, f) for f in digest}
    ls = _ls_json(run_uri)
    out["ls_committed"] = [e["name"] for e in ls["committed"]]
    out["ls_incomplete"] = [e["name"] for e in ls["incomplete"]]
    out["ls_last_pointer"] = ls["pointers"].get("last")
    # Every committed checkpoint restores bit for bit (nothing lost, nothing half-deleted).
    out["bitwise"] = {}
    for name in out["committed"]:
        r = restore(f"{run_uri}/{name}", dist=SingleProcess(),
                    storage_config=storage_config(backend, traced=False))
        out["bitwise"][name] = _bitwise(r.state, r.rank_state, num_updates_of(name))
    # A job resuming here gets the latest committed checkpoint, bitwise.
    mgr = manager_for(run_uri, backend, traced=False)
    res = mgr.restore_or_initialize()
    out["resumed"] = res.checkpoint if res is not None else None
    out["resumed_bitwise"] = _bitwise(res.state, res.rank_state, res.num_updates) if res else "none"
    out["strays_after_kill"] = stray_objects(run_uri, backend, emulator_host)
    if recover and res is not None:
        # ... and can go on: it redoes the updates after the resumed checkpoint and saves.
        n = res.num_updates + 1
        _save(mgr, n)
        after = mgr.restore_or_initialize()
        out["recovered"] = after.checkpoint
        out["recovered_bitwise"] = _bitwise(after.state, after.rank_state, after.num_updates)
        with open_storage(run_uri, storage_config(backend, traced=False)) as run:
            out["committed_after_recovery"] = [e.name for e in list_checkpoints(run) if e.committed]
    mgr.close()
    os.write(wfd, (json.dumps(out) + "\n").encode())


def run_verifier(run_uri: str, backend: str, recover: bool, emulator_host: str = "", *,
                 digest: list[str] | tuple[str, ...] = ()) -> dict:
    pid, r = _fork(lambda w: _verify_main(run_uri, backend, recover, w, emulator_host,
                                          tuple(digest)))
    try:
        msg = _read_line(r, SAVE_TIMEOUT_S)
        code = _reap(pid)
    finally:
        os.close(r)
    if msg is None:
        return {"error": f"verifier gave no answer (exit code {code})"}
    msg["exitcode"] = code
    return msg


# ---- one campaign (runs inside the zygote) ----------------------------------------------------

def _wipe(run_uri: str, backend: str, emulator_host: str) -> None:
    if backend == "local":
        shutil.rmtree(run_uri, ignore_errors=True)
        return
    from xla_ckpt.storage.gcs import GCSStorage

    st = GCSStorage(run_uri, storage_config(backend, traced=False), endpoint=emulator_host or None)
    try:
        for n in st.list("", include_in_flight=True):
            st.delete(n)
    finally:
        st.close()


def preload(backend: str) -> None:
    """Import in the zygote what savers and verifiers use, so each fork starts warm."""
    import xla_ckpt.cli.main
    import xla_ckpt.manager
    import xla_ckpt.restore
    import xla_ckpt.testing.asserts

    if backend == "gcs":
        import requests  # noqa: F401 - imported to warm the forks, not used here
        from google.cloud import storage  # noqa: F401 - imported to warm the forks, not used

        import xla_ckpt.storage.gcs  # noqa: F401 - imported to warm the forks, not used here


def in_lanes(points: list, one: Callable[[int, Any], dict], lanes: int) -> list[dict]:
    """``[one(j, p) for j, p in enumerate(points)]``, run in ``lanes`` lanes side by side.

    Lane ``i`` runs the points ``j`` with ``j % lanes == i``: lane 0 in this process (the
    zygote), every other one in a fork of it made here, before any point (it forks its own
    savers and verifiers as the zygote does).  Every point has its own run folder, and a kill
    point is a place in the saver's own sequence of steps, not a moment, so lanes do not
    meet; a point keeps about one process busy at a time, so on 2 cores two lanes take about
    half the time.  Results come back in point order.
    """
    if lanes <= 1:
        return [one(j, p) for j, p in enumerate(points)]
    children: list[tuple[int, int]] = []
    try:
        for lane in range(1, lanes):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # a lane: its points, then its results (pickled) on the pipe
                code = 0
                try:
                    os.close(r)
                    data = pickle.dumps([(j, one(j, p)) for j, p in enumerate(points)
                                         if j % lanes == lane])
                except BaseException:  # noqa: BLE001 - reported to lane 0, which raises it
                    data = pickle.dumps(traceback.format_exc()[-4000:])
                    code = 1
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(w, view):]
                finally:
                    os._exit(code)
            os.close(w)
            children.append((pid, r))
        out = {j: one(j, p) for j, p in enumerate(points) if j % lanes == 0}
        for pid, r in children:
            chunks = []
            while chunk := os.read(r, 1 << 20):
                chunks.append(chunk)
            got = pickle.loads(b"".join(chunks)) if chunks else "a lane died"
            if isinstance(got, str):
                raise AssertionError(f"lane of pid {pid} failed: {got}")
            out.update(got)
        return [out[j] for j in range(len(points))]
    finally:
        for pid, r in children:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            os.close(r)


def campaign(base_uri: str, backend: str, mode: str, count: int, *, recover: bool = True,
             emulator_host: str = "", bucket: str = "", lanes: int = 1) -> dict:
    """Dry run, choose ``count`` kill points, kill a saver at each, verify after each.

    Runs in a launcher worker (the zygote): every saver and verifier is a fork
    of it.  Returns ``{"steps": [...], "points": [...], "results": [...]}``
    (plain data; the test asserts on it).  Each run folder is removed after
    its point was verified.  ``lanes``: the points run in that many lanes side by
    side (:func:`in_lanes`).
    """
    torch.set_num_threads(1)
    preload(backend)
    t0 = time.perf_counter()
    dry_uri = f"{base_uri}/dry"
    dry = run_saver(dry_uri, backend, mode, None, bucket)
    if dry["error"] or dry["exitcode"] != 0:
        raise AssertionError(f"dry run failed (exit {dry['exitcode']}): {dry['error']}")
    steps: list[Step] = dry["steps"]
    _wipe(dry_uri, backend, emulator_host)
    points = choose_points(steps, count)

    def one(j: int, p: KillPoint) -> dict:
        uri = f"{base_uri}/p{j:04d}"
        killed = run_saver(uri, backend, mode, p, bucket)
        res: dict[str, Any] = {"point": asdict(p), "label": p.label(steps),
                               "expect_committed": committed_at(p, steps),
                               "exitcode": killed["exitcode"], "saver_error": killed["error"],
                               "paused_at": killed["paused"]}
        res["trace_matches"] = same_place(killed["steps"] or [], steps, p)
        res["verify"] = run_verifier(uri, backend, recover, emulator_host)
        _wipe(uri, backend, emulator_host)
        return res

    results = in_lanes(points, one, lanes)
    return {"steps": [asdict(s) for s in steps], "commit_step": commit_step(steps),
            "results": results, "seconds": time.perf_counter() - t0}


def check(result: dict) -> list[str]:
    """Every violation of the crash-consistency rules in one point's result ('' list: none)."""
    bad = []
    v = result["verify"]
    label = result["label"]
    if result["saver_error"]:
        return [f"{label}: saver failed: {result['saver_error']}"]
    if result["exitcode"] != -signal.SIGKILL:
        bad.append(f"{label}: saver exit code {result['exitcode']}, expected SIGKILL")
    if not result["trace_matches"]:
        bad.append(f"{label}: the killed saver's steps differ from the dry run")
    if "error" in v:
        return bad + [f"{label}: verifier: {v['error']}"]
    want_c = result["expect_committed"]
    committed = set(v["committed"])
    if B not in committed:
        bad.append(f"{label}: the previous checkpoint {B} is no longer committed")
    if (C in committed) != want_c:
        bad.append(f"{label}: {C} committed={C in committed}, expected {want_c}")
    if not want_c and A not in committed:
        bad.append(f"{label}: {A} was deleted before {C} committed")
    if v["ls_committed"] != v["committed"]:
        bad.append(f"{label}: ls lists {v['ls_committed']} as committed, catalog {v['committed']}")
    if not want_c and C in v["ls_committed"]:
        bad.append(f"{label}: ls lists the torn {C} as committed")
    expect_latest = C if want_c else B
    if v["latest"] != expect_latest or v["resumed"] != expect_latest:
        bad.append(f"{label}: latest={v['latest']} resumed={v['resumed']}, "
                   f"expected {expect_latest}")
    for name, diff in v["bitwise"].items():
        if diff:
            bad.append(f"{label}: {name} does not restore bitwise: {diff}")
    if v["resumed_bitwise"]:
        bad.append(f"{label}: resumed state differs: {v['resumed_bitwise']}")
    if "recovered" in v:
        nxt = f"checkpoint_1_{num_updates_of(expect_latest) + 1}"
        if v["recovered"] != nxt or v["recovered_bitwise"]:
            bad.append(f"{label}: after resuming, saving {nxt} gave {v['recovered']} "
                       f"({v['recovered_bitwise'] or 'bitwise'})")
    return bad


# ---- the fencing family (C15): a successor starts while the predecessor saves ----------------

S_NAME = "checkpoint_1_20"  # what the successor saves
NEXT = "checkpoint_1_4"  # the predecessor's save after C
P_EPOCH, S_EPOCH = 2, 3  # lease epochs: the set-up incarnation has 1
# Without /proc/locks: the successor made no progress for this long, so it waits on P's lock
BLOCK_WAIT_S = 5.0


class _Lines:
    """JSON lines from a pipe, buffered (a child may write several at once)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""

    def read(self, timeout_s: float) -> dict | None:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line) if line else None


def _waits_on_lock_of(waiter: int, holder: int) -> bool | None:
    """Whether process ``waiter`` waits for a ``flock`` that process ``holder`` holds (in
    ``/proc/locks`` a blocked request, ``->``, has the number of the lock it waits for);
    None where the kernel gives no ``/proc/locks``.  (A wait on a lock another thread of
    ``waiter`` holds, a moment's contention inside the successor, does not count.)"""
    try:
        with open("/proc/locks") as f:
            rows = [w for w in map(str.split, f.read().splitlines()) if len(w) > 5]
    except OSError:
        return None
    held = {w[0] for w in rows if w[1] != "->" and w[4] == str(holder)}
    return any(w[1] == "->" and w[5] == str(waiter) and w[0] in held for w in rows)


def _gone(pid: int) -> bool:
    """Whether child ``pid`` has exited (a zombie not yet reaped, or no process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _next_unless_blocked(lines: _Lines, pid: int, holder: int) -> dict | None:
    """The successor's (``pid``) next message, or None once it waits on a folder lock that
    the paused predecessor (``holder``) holds: it waits for a ``flock`` of the holder's (it
    stays waiting while the holder is paused), or, without ``/proc/locks``, it said nothing
    for :data:`BLOCK_WAIT_S`.  None as well when it exited or said nothing for
    :data:`SAVE_TIMEOUT_S`."""
    start = time.monotonic()
    while True:
        m = lines.read(0.05)
        if m is not None:
            return m
        waiting = _waits_on_lock_of(pid, holder)
        quiet = time.monotonic() - start
        if waiting or _gone(pid) or quiet > SAVE_TIMEOUT_S or (
                waiting is None and quiet > BLOCK_WAIT_S):
            # Blocked or gone, it sends nothing more; what it sent before is in the pipe
            # already (it may have written it after the read above gave up).
            return lines.read(0.05)


def _send(fd: int, msg: dict) -> None:
    os.write(fd, (json.dumps(msg) + "\n").encode())


def _outcome(fn: Callable[[], Any]) -> dict:
    """What a save did: ``{"ok": True}`` or the error's class, message and fencing epochs."""
    from xla_ckpt.errors import FencedError

    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the harness, which asserts on it
        out: dict[str, Any] = {"ok": False, "error": type(e).__name__, "message": str(e)}
        if isinstance(e, FencedError):
            out.update(own_epoch=e.own_epoch, current_epoch=e.current_epoch, run=e.run)
        return out
    return {"ok": True}


def folder_digest(st, folder: str) -> dict[str, str]:
    """sha256 of every object of checkpoint folder ``folder`` (names relative to the run)."""
    import hashlib

    return {n: hashlib.sha256(st.read_bytes(n)).hexdigest() for n in st.list(folder + "/")}


def pointer_order_now(run_uri: str, backend: str, emulator_host: str = "") -> list:
    """``[lease_epoch, num_updates, checkpoint]`` of ``checkpoint_last`` now ([0, -1, None]
    when absent)."""
    from xla_ckpt.run.catalog import pointer_order, read_pointer_doc

    if backend == "local":
        from xla_ckpt.storage.local import LocalStorage

        st: Any = LocalStorage(run_uri)
    else:
        from xla_ckpt.storage.gcs import GCSStorage

        st = GCSStorage(run_uri, storage_config(backend, traced=False),
                        endpoint=emulator_host or None)
    try:
        doc, _ = read_pointer_doc(st, "last")
    finally:
        st.close()
    return [*pointer_order(doc), doc.get("checkpoint") if doc else None]


def _predecessor_main(run_uri: str, backend: str, point: KillPoint | None, wfd: int,
                      resume: int | None, bucket: str) -> None:
    """P: set up A and B (epoch 1), restore B (epoch 2), save C with keep-last 1 (paused at
    ``point``), then -- when the harness says so -- save NEXT; report each outcome."""
    torch.set_num_threads(1)
    root = run_uri if backend == "local" else run_uri.split("/", 3)[3]
    tracer = Tracer(root, wfd, resume)
    if backend == "local":
        install_local_hook(tracer)
    else:
        install_gcs_hook(tracer, bucket)
    mgr = manager_for(run_uri, backend, traced=False)
    _save(mgr, 1)
    _save(mgr, 2)
    mgr.close()
    mgr = manager_for(run_uri, backend, keep=1)
    restored = mgr.restore_or_initialize()
    assert restored is not None and restored.checkpoint == B
    mgr.take_over()  # epoch 2 before the traced save of C (a restore takes no lease)
    tracer.kill = point
    tracer.armed = True
    saved_c = _outcome(lambda: _save(mgr, 3))
    n_c = len(tracer.steps)
    _send(wfd, {"saved_c": saved_c, "steps": [asdict(s) for s in tracer.steps]})
    if resume is not None:
        os.read(resume, 1)  # the harness lets the successor finish first
    saved_next = _outcome(lambda: _save(mgr, num_updates_of(NEXT)))
    _send(wfd, {"saved_next": saved_next, "steps_during_next": len(tracer.steps) - n_c})
    mgr.close()
    tracer.armed = False
    _send(wfd, {"done": True})


def _successor_main(run_uri: str, backend: str, wfd: int) -> None:
    """S: a new incarnation: restore the latest (no lease), save S_NAME with keep-last 2 (its
    first save takes the next lease epoch; keep-N rotates a restored checkpoint like any
    other, and 2 keeps it), report what it restored, the epoch it holds and the bytes of
    what it holds."""
    torch.set_num_threads(1)
    from xla_ckpt.run.fencing import read_lease

    mgr = manager_for(run_uri, backend, traced=False, keep=2)
    res = mgr.restore_or_initialize()
    restored = res.checkpoint if res is not None else None
    _send(wfd, {"restored": restored,
                "restored_bitwise": _bitwise(res.state, res.rank_state, res.num_updates)
                if res is not None else "none"})
    _save(mgr, num_updates_of(S_NAME))
    lease = read_lease(mgr.run)
    digests = {f: folder_digest(mgr.run, f) for f in {S_NAME, restored} if f}
    _send(wfd, {"saved": S_NAME, "epoch": lease.epoch if lease else None, "digests": digests})
    mgr.close()
    _send(wfd, {"done": True})


def _fork_with_resume(fn: Callable[[int, int | None], None], resumable: bool
                      ) -> tuple[int, int, int | None]:
    """Fork ``fn(write_fd, resume_fd)``; returns (pid, read fd, the harness's resume fd)."""
    if not resumable:
        pid, r = _fork(lambda w: fn(w, None))
        return pid, r, None
    rr, rw = os.pipe()

    def child(w: int) -> None:
        os.close(rw)
        fn(w, rr)

    pid, r = _fork(child)
    os.close(rr)
    return pid, r, rw


def run_fencing_point(run_uri: str, backend: str, variant: str, point: KillPoint | None,
                      *, bucket: str = "", emulator_host: str = "") -> dict:
    """One interleaving (see the module docstring); ``point=None`` is the dry run (no S)."""
    obs: list[list] = []  # [phase, lease_epoch, num_updates, checkpoint] of checkpoint_last

    def observe(phase: str) -> None:
        obs.append([phase, *pointer_order_now(run_uri, backend, emulator_host)])

    out: dict[str, Any] = {"error": None, "observed": obs, "order": None, "successor": {},
                           "predecessor": {}}
    resumable = variant == "resume"
    pid, r, resume = _fork_with_resume(
        lambda w, rr: _predecessor_main(run_uri, backend, point, w, rr, bucket), resumable)
    lp = _Lines(r)
    pids = [pid]
    try:
        if point is None:  # the dry run: no successor; P saves C and NEXT undisturbed
            for key in ("saved_c", "saved_next", "done"):
                msg = lp.read(SAVE_TIMEOUT_S)
                if msg is None or key not in msg:
                    raise AssertionError(f"dry run: no {key}: {msg}")
                out["predecessor"].update(msg)
                if key == "saved_c" and resume is not None:
                    os.write(resume, b"g")
            out["exitcode"] = _reap(pid)
            return out
        msg = lp.read(SAVE_TIMEOUT_S)
        if msg is None or "paused" not in msg:
            out["error"] = f"predecessor did not pause: {msg}"
            return out
        out["paused_at"] = msg["paused"]
        out["seen_steps"] = msg["steps"]
        if not (backend == "gcs" and point.at == "byte"):
            # (A request body half sent holds the single-threaded emulator until P dies.)
            observe("P paused")
        succ = out["successor"]
        if variant == "kill":
            os.kill(pid, signal.SIGKILL)
            out["exitcode"] = _reap(pid)
            observe("P killed")
            spid, sr = _fork(lambda w: _successor_main(run_uri, backend, w))
            pids.append(spid)
            ls = _Lines(sr)
            for key in ("restored", "saved", "done"):
                m = ls.read(SAVE_TIMEOUT_S)
                if m is None or key not in m:
                    out["error"] = f"successor gave no {key!r}: {m}"
                    return out
                succ.update(m)
            observe("S saved")
            out["order"] = "S after P died"
            out["successor_exitcode"] = _reap(spid)
        else:
            assert resume is not None
            spid, sr = _fork(lambda w: _successor_main(run_uri, backend, w))
            pids.append(spid)
            ls = _Lines(sr)
            pending = ["restored", "saved", "done"]
            while pending:
                m = _next_unless_blocked(ls, spid, pid) if backend == "local" \
                    else ls.read(SAVE_TIMEOUT_S)
                if m is None:
                    break  # S waits on a folder lock P holds at its point
                if "error" in m:
                    out["error"] = f"successor failed: {m['error']}"
                    return out
                succ.update(m)
                pending.remove(next(k for k in pending if k in m))
            out["order"] = "S finished first" if not pending else f"S blocked before {pending[0]}"
            if not pending:
                observe("S saved")
            os.write(resume, b"g")  # P goes on from its point
            m = lp.read(SAVE_TIMEOUT_S)
            if m is None or "saved_c" not in m:
                out["error"] = f"predecessor did not finish saving C: {m}"
                return out
            out["predecessor"]["saved_c"] = m["saved_c"]
            out["predecessor"]["steps_c"] = m["steps"]
            observe("P saved C")
            for key in pending:  # S got the lock P let go of
                m = ls.read(SAVE_TIMEOUT_S)
                if m is None or key not in m:
                    out["error"] = f"successor gave no {key!r} after P went on: {m}"
                    return out
                succ.update(m)
            if pending:
                observe("S saved")
            out["successor_exitcode"] = _reap(spid)
            os.write(resume, b"g")  # P tries one more save
            m = lp.read(SAVE_TIMEOUT_S)
            if m is None or "saved_next" not in m:
                out["error"] = f"predecessor did not try its next save: {m}"
                return out
            out["predecessor"].update(m)
            observe("P saved next")
            m = lp.read(SAVE_TIMEOUT_S)
            out["exitcode"] = _reap(pid)
            if m is None or "done" not in m:
                out["error"] = f"predecessor did not finish: {m}"
                return out
        digest = sorted(succ.get("digests", {}))
        out["verify"] = run_verifier(run_uri, backend, False, emulator_host, digest=digest)
        observe("verified")
        return out
    finally:
        for p in pids:  # nothing is left running, whatever went wrong
            kill_and_reap(p)
        os.close(r)
        if resume is not None:
            os.close(resume)


def rotation_step(steps: list[Step]) -> int:
    """Index of P's first rotation step (deleting A): every lease check of the save of C is
    behind a point at or after it."""
    for i, s in enumerate(steps):
        if s.target.startswith(f"{A}/"):
            return i
    raise AssertionError(f"no rotation of {A} in the trace: {steps}")


def manifest_step(steps: list[Step]) -> int:
    """Index of P's first step writing C's manifest (right after the lease check before it):
    from there on a resumed P commits C even though S holds the lease (the residual window)."""
    for i, s in enumerate(steps):
        if s.target.startswith(f"{C}/manifest.json"):
            return i
    raise AssertionError(f"no manifest write for {C} in the trace: {steps}")


def pointer_step(steps: list[Step]) -> int:
    """Index of the first step of P's ``checkpoint_last`` write (after the check before it)."""
    for i, s in enumerate(steps):
        if s.target.startswith("checkpoint_last.json") and i > commit_step(steps):
            return i
    raise AssertionError(f"no pointer write in the trace: {steps}")


def fencing_campaign(base_uri: str, backend: str, variant: str, count: int, *,
                     emulator_host: str = "", bucket: str = "", lanes: int = 1) -> dict:
    """Dry run of P's save of C, ``count`` points chosen from it, one interleaving at each.

    Runs in a launcher worker (the zygote), like :func:`campaign` (``lanes`` too).
    """
    torch.set_num_threads(1)
    preload(backend)
    t0 = time.perf_counter()
    dry_uri = f"{base_uri}/dry"
    dry = run_fencing_point(dry_uri, backend, variant, None, bucket=bucket,
                            emulator_host=emulator_host)
    pred = dry["predecessor"]
    if not pred.get("saved_c", {}).get("ok") or not pred.get("saved_next", {}).get("ok"):
        raise AssertionError(f"dry run failed: {dry}")
    steps = [Step(**x) for x in pred["steps"]]
    _wipe(dry_uri, backend, emulator_host)
    points = choose_points(steps, count)
    if backend == "gcs" and variant == "resume":
        # The emulator is one single-threaded server: a request body P left half sent holds
        # every other request until P goes on, so S could not run meanwhile (real GCS serves
        # both).  Those points are the kill variant's; here P pauses between requests.
        points = [p for p in points if p.at != "byte"]

    def one(j: int, p: KillPoint) -> dict:
        uri = f"{base_uri}/f{j:04d}"
        res = run_fencing_point(uri, backend, variant, p, bucket=bucket,
                                emulator_host=emulator_host)
        res.update(point=asdict(p), label=p.label(steps), variant=variant,
                   expect_committed=committed_at(p, steps),
                   expect_fenced=p.step < rotation_step(steps),
                   in_window=p.step >= manifest_step(steps),
                   before_pointer=p.step < pointer_step(steps),
                   trace_matches=same_place([Step(**x) for x in res.get("seen_steps") or []],
                                            steps, p))
        _wipe(uri, backend, emulator_host)
        return res

    results = in_lanes(points, one, lanes)
    return {"steps": [asdict(s) for s in steps], "commit_step": commit_step(steps),
            "manifest_step": manifest_step(steps), "pointer_step": pointer_step(steps),
            "rotation_step": rotation_step(steps), "results": results,
            "seconds": time.perf_counter() - t0}


def _non_decreasing(observed: list[list]) -> bool:
    orders = [(o[1], o[2]) for o in observed]
    return all(a <= b for a, b in zip(orders, orders[1:], strict=False))


def check_fencing(result: dict) -> list[str]:
    """Every violation of the fencing rules in one interleaving's result ([]: none)."""
    label = f"{result['variant']} {result['label']}"
    if result["error"]:
        return [f"{label}: {result['error']}"]
    bad = []
    if not result["trace_matches"]:
        bad.append(f"{label}: the predecessor's steps differ from the dry run")
    v = result.get("verify", {})
    if "error" in v:
        return bad + [f"{label}: verifier: {v['error']}"]
    succ = result["successor"]
    want_code = -signal.SIGKILL if result["variant"] == "kill" else 0
    if result.get("exitcode") != want_code or result.get("successor_exitcode") != 0:
        bad.append(f"{label}: exit codes P={result.get('exitcode')} "
                   f"S={result.get('successor_exitcode')}")
    if succ.get("epoch") != S_EPOCH:
        bad.append(f"{label}: the successor holds lease epoch {succ.get('epoch')}, not {S_EPOCH}")
    committed = set(v["committed"])
    restored = succ.get("restored")
    s_first = result["order"] in ("S after P died", "S finished first")
    if s_first:
        want_restored = C if result["expect_committed"] else B
        if restored != want_restored:
            bad.append(f"{label}: the successor restored {restored}, expected {want_restored}")
    if succ.get("restored_bitwise"):
        bad.append(f"{label}: the successor's restore differs: {succ['restored_bitwise']}")
    # The newest incarnation's checkpoints survive, byte for byte, and restore bitwise.
    for folder in (S_NAME, restored):
        if folder not in committed:
            bad.append(f"{label}: the successor's {folder} is no longer committed")
    if v.get("digests") != succ.get("digests"):
        bad.append(f"{label}: the successor's checkpoints changed: {succ.get('digests')} -> "
                   f"{v.get('digests')}")
    for name, diff in v["bitwise"].items():
        if diff:
            bad.append(f"{label}: {name} does not restore bitwise: {diff}")
    # checkpoint_last names the successor's checkpoint and never went backwards.
    last = v.get("pointer_last") or {}
    if last.get("checkpoint") != S_NAME or last.get("lease_epoch") != S_EPOCH:
        bad.append(f"{label}: checkpoint_last is {last}, expected {S_NAME} of epoch {S_EPOCH}")
    if not _non_decreasing(result["observed"]):
        bad.append(f"{label}: checkpoint_last went backwards: {result['observed']}")
    if v["latest"] != S_NAME or v["resumed"] != S_NAME or v["resumed_bitwise"]:
        bad.append(f"{label}: latest={v['latest']} resumed={v['resumed']} "
                   f"({v['resumed_bitwise'] or 'bitwise'}), expected {S_NAME}")
    # Nothing the predecessor committed after the successor took over is pointed to.
    after_s = False
    for phase, _epoch, _n, name in result["observed"]:
        after_s = after_s or phase == "S saved"
        if after_s and name in (C, NEXT):
            bad.append(f"{label}: checkpoint_last names the predecessor's {name} ({phase})")
    if v.get("pointer_best"):
        bad.append(f"{label}: a checkpoint_best pointer appeared: {v['pointer_best']}")
    if NEXT in committed or NEXT in v["incomplete"]:
        bad.append(f"{label}: the fenced predecessor wrote {NEXT}")
    if result["variant"] == "resume":
        bad += _check_predecessor(label, result, s_first, committed, v)
    return bad


def _fenced_message_ok(out: dict, run_uri_tail: str) -> bool:
    msg = out.get("message", "")
    return (out.get("error") == "FencedError" and out.get("own_epoch") == P_EPOCH
            and out.get("current_epoch") == S_EPOCH and f"lease epoch {P_EPOCH}" in msg
            and f"lease epoch {S_EPOCH}" in msg and "stops saving" in msg
            and run_uri_tail in msg)


def _check_predecessor(label: str, result: dict, s_first: bool, committed: set,
                       v: dict) -> list[str]:
    bad = []
    pred = result["predecessor"]
    tail = "/f"  # every interleaving's run folder is <base>/fNNNN
    nxt = pred.get("saved_next", {})
    if not _fenced_message_ok(nxt, tail):
        bad.append(f"{label}: the predecessor's next save gave {nxt}, expected FencedError "
                   f"naming epochs {P_EPOCH} and {S_EPOCH}")
    if pred.get("steps_during_next") != 0:
        bad.append(f"{label}: the fenced predecessor's next save made "
                   f"{pred.get('steps_during_next')} mutating steps")
    c_out = pred.get("saved_c", {})
    if s_first:
        if result["expect_fenced"] and not _fenced_message_ok(c_out, tail):
            bad.append(f"{label}: saving C gave {c_out}, expected FencedError naming both epochs")
        if not result["expect_fenced"] and not c_out.get("ok"):
            bad.append(f"{label}: saving C (past its last lease check) gave {c_out}")
        if not result["in_window"]:
            # Fenced before its commit marker: nothing of C was committed, nor kept.
            if C in committed or C in v["incomplete"]:
                bad.append(f"{label}: the fenced predecessor left {C} behind "
                           f"(committed={C in committed})")
        elif C not in committed:
            # Past the check before its commit marker: C commits in a new folder (the
            # residual window), and is never pointed to (checked above).
            bad.append(f"{label}: {C} was not committed, though past its lease check")
    elif not (c_out.get("ok") or c_out.get("error") == "FencedError"):
        bad.append(f"{label}: saving C gave {c_out}")
    return bad


# ---- the sharded family: SIGKILL one rank of a multi-rank sharded save_distributed ----------
#
# A job of ``world`` ranks (forked from the zygote, a real gloo group each time, its rendezvous
# store held by the zygote so that it outlives any rank) holds DTensor state on
# ``init_device_mesh("cpu", (world,))``: uneven Shard(0), Shard(1), a Replicate() placement,
# plain tensors (written once, by the rank the owner plan balances them onto) and per-rank
# items.  In a run folder it commits A and B with ``xla_ckpt.restore.save_distributed``
# (chunked: every rank writes its ``chunks/<r>`` item in its own data file, rank 0 commits the
# v2 manifest), then saves C with every rank traced; the *victim* rank pauses at the chosen
# point of its own steps and is SIGKILLed there, and its peers are SIGKILLed right after,
# wherever they are (the job died).  A fresh job of ``verify_world`` ranks (forked again) then
# checks the run folder: the catalog, ``xla-ckpt ls``, which checkpoint "latest" resolves to,
# that every committed checkpoint restores bitwise *into DTensor targets*, that a restore of
# the run folder resumes from the latest committed one (never the torn C, never "nothing
# committed"), and that the resumed job saves the next checkpoint and restores it bitwise.
# Rank 0's points reach its manifest write (the commit marker); another rank's stop at its
# last data-file step, before the agreement step rank 0 needs to commit, so C never commits.

SHARDED_WORLD = 2
SHARDED_TIMEOUT_S = 30.0  # collective timeout inside the forked jobs (they are killed anyway)
#: crc32c chunk size of the sharded saves (small: byte-range reads are checked piecewise)
SHARDED_CHUNK_BYTES = 16 * 1024


def sharded_placements() -> dict[str, Any]:
    """Leaf path -> DTensor placement of the sharded state (leaves not named stay plain)."""
    from torch.distributed.tensor import Replicate, Shard

    return {"model.l1.weight": Shard(0), "model.l2.weight": Shard(1), "model.emb": Shard(0),
            "model.bias": Replicate(), "optim.exp_avg": Shard(0)}


def sharded_full_state(n: int) -> dict:
    """The global values of the sharded state at update ``n`` (about 440 KiB of tensors: each
    of 2 ranks' data files is over the traced GCS knobs' composite-upload threshold).

    Rows 131 and 7 and columns 250 divide unevenly by 2, 3 and 4 ranks (7 rows on 4 ranks:
    shards 2,2,2,1; with Shard(0) of 7 on 8 ranks an empty one)."""
    g = torch.Generator().manual_seed(3000 + n)
    return {"model": {"l1.weight": torch.randn(131, 256, generator=g),
                      "l2.weight": torch.randn(96, 250, generator=g),
                      "emb": torch.randn(7, 32, generator=g).to(torch.bfloat16),
                      "bias": torch.randn(256, generator=g)},
            "optim": {"exp_avg": torch.randn(50_001, generator=g),
                      "step": torch.tensor(float(n))},
            "extra_state": {"num_updates": n, "lr": 0.1 / n, "betas": (0.9, 0.98)}}


def sharded_rank_state(n: int, rank: int) -> dict:
    return {"rng": torch.full((64,), (7 * n + rank) % 251, dtype=torch.uint8),
            "iterations_in_epoch": n * 10 + rank}


def distribute_state(full: Any, mesh: Any, placements: dict[str, Any], path: str = "") -> Any:
    """``full`` with the leaves named in ``placements`` made DTensors on ``mesh`` (each rank
    keeps its own piece of its own copy: no communication), the others left as they are."""
    from torch.distributed.tensor import distribute_tensor

    if isinstance(full, dict):
        return {k: distribute_state(v, mesh, placements, f"{path}.{k}" if path else str(k))
                for k, v in full.items()}
    p = placements.get(path)
    if p is not None and isinstance(full, torch.Tensor):
        return distribute_tensor(full, mesh, [p], src_data_rank=None)
    return full


def zero_targets(full: dict, mesh: Any, placements: dict[str, Any]) -> dict:
    """Restore targets for ``full``: its tensors zero-filled, as DTensors where ``placements``
    names them (which may differ from the saved layout), plain otherwise; no other values."""
    zeros = {k: {kk: torch.zeros_like(vv) for kk, vv in v.items() if isinstance(vv, torch.Tensor)}
             for k, v in full.items() if isinstance(v, dict) and k != "extra_state"}
    return distribute_state(zeros, mesh, placements)


def sharded_targets(mesh: Any, placements: dict[str, Any] | None = None) -> dict:
    """Restore targets of the sharded state's layout (or of another one)."""
    return zero_targets(sharded_full_state(1), mesh, placements or sharded_placements())


def shard_diff(state: Any, full: dict, mesh: Any, placements: dict[str, Any]) -> str:
    """'' when ``state`` (restored into targets of ``placements``) is bit for bit ``full`` on
    this rank -- each DTensor's local shard against the same piece of the global value, its
    placements included; plain tensors whole, dtype included; other values equal -- else
    the first difference."""
    from torch.distributed.tensor import DTensor

    from xla_ckpt.testing.asserts import tensors_identical

    want = distribute_state(full, mesh, placements)
    for top, values in want.items():
        if not isinstance(values, dict) or top == "extra_state":
            if state[top] != values:
                return f"{top}: {state[top]!r}, expected {values!r}"
            continue
        for k, w in values.items():
            got = state[top][k]
            where = f"{top}.{k}"
            if isinstance(w, DTensor):
                if not isinstance(got, DTensor) or tuple(got.placements) != tuple(w.placements):
                    return (f"{where}: {type(got).__name__} {getattr(got, 'placements', '')}, "
                            f"expected DTensor {w.placements}")
                if not tensors_identical(got.to_local(), w.to_local()):
                    return f"{where}: local shard differs"
            elif isinstance(w, torch.Tensor):
                if not isinstance(got, torch.Tensor) or got.dtype != w.dtype \
                        or not tensors_identical(got, w):
                    return f"{where}: differs"
            elif got != w:
                return f"{where}: {got!r}, expected {w!r}"
    if state.get("extra_state") != full.get("extra_state"):
        return f"extra_state: {state.get('extra_state')}"
    return ""


def sharded_diff(state: Any, n: int, mesh: Any, placements: dict[str, Any] | None = None
                 ) -> str:
    """:func:`shard_diff` against the sharded state of update ``n``."""
    return shard_diff(state, sharded_full_state(n), mesh, placements or sharded_placements())


class ForkGate:
    """A pipe children forked from here wait on until :meth:`open` (EOF once the parent's
    write end and every child's copy of it are closed)."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()

    def wait(self) -> None:
        """In a child: close the inherited write end, then block until the gate opens."""
        os.close(self.w)
        while os.read(self.r, 1):
            pass
        os.close(self.r)

    def open(self) -> None:
        """In the parent, after forking: let every child go."""
        for fd in (self.w, self.r):
            with contextlib.suppress(OSError):
                os.close(fd)


class _Job:
    """The rendezvous store of one forked gloo job, held by the zygote (it outlives any rank:
    survivors still read their peers' heartbeats after a rank died)."""

    def __init__(self, world: int) -> None:
        import datetime
        import socket

        import torch.distributed as tdist

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        self.world = world
        self.store = tdist.TCPStore("127.0.0.1", self.port, world + 1, True,
                                    timeout=datetime.timedelta(seconds=60),
                                    master_listen_fd=sock.detach(), wait_for_workers=False)

    def env(self, rank: int) -> dict[str, str]:
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port),
                "WORLD_SIZE": str(self.world), "RANK": str(rank), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(self.world), "GROUP_RANK": "0",
                "TORCHELASTIC_USE_AGENT_STORE": "True", "GLOO_SOCKET_IFNAME": "lo"}

    def fork(self, body: Callable[[int, int], None], gate: ForkGate | None = None
             ) -> list[tuple[int, int]]:
        """Fork one process per rank running ``body(rank, write_fd)``: [(pid, read fd)].

        No rank starts before every rank is forked (``gate``: one shared by several jobs,
        opened by the caller once all are forked; by default this job's own): the store's
        server thread in this process then serves nobody while it forks, so no child
        inherits a lock that thread held (a rank that hung before its rendezvous)."""
        own = gate is None
        g = ForkGate() if gate is None else gate
        out = []
        try:
            for rank in range(self.world):
                def child(w: int, rank: int = rank) -> None:
                    g.wait()
                    os.environ.update(self.env(rank))
                    body(rank, w)
                out.append(_fork(child))
        finally:
            if own:
                g.open()
        return out

    def close(self) -> None:
        del self.store


def join_job(timeout_s: float = SHARDED_TIMEOUT_S) -> tuple[Any, Any]:
    """In a forked rank: the job's :class:`TorchDist` and its 1-D CPU device mesh.

    With a ``timeout_s`` shorter than :data:`SHARDED_TIMEOUT_S` the ranks first meet on a
    group with the long timeout (a rank slow to start is not a failure), then get a fresh
    group with ``timeout_s`` for what follows."""
    from torch.distributed.device_mesh import init_device_mesh

    from xla_ckpt.comm import TorchDist

    torch.set_num_threads(1)
    d = TorchDist(backend="gloo", timeout_s=max(timeout_s, SHARDED_TIMEOUT_S))
    mesh = init_device_mesh("cpu", (d.world_size,))
    if timeout_s < SHARDED_TIMEOUT_S:
        d.barrier()
        short = TorchDist.new_subgroup(range(d.world_size), timeout_s=timeout_s)
        assert short is not None  # every rank is a member
        d = short
    return d, mesh


def _sharded_save(d: Any, mesh: Any, run_uri: str, n: int, backend: str, *,
                  traced: bool) -> None:
    from xla_ckpt.restore import save_distributed

    save_distributed(distribute_state(sharded_full_state(n), mesh, sharded_placements()),
                     f"{run_uri}/checkpoint_1_{n}", dist=d,
                     metadata={"epoch": 1, "num_updates": n},
                     rank_state=sharded_rank_state(n, d.rank),
                     storage_config=storage_config(backend, traced=traced),
                     chunk_size_bytes=SHARDED_CHUNK_BYTES)


def _sharded_saver_main(run_uri: str, backend: str, rank: int, kill: KillPoint | None,
                        wfd: int, bucket: str) -> None:
    """One rank of the saving job: commit A and B (untraced), then save C traced; the victim
    pauses at ``kill``."""
    root = run_uri if backend == "local" else run_uri.split("/", 3)[3]
    tracer = Tracer(root, wfd)
    if backend == "local":
        install_local_hook(tracer)
    else:
        install_gcs_hook(tracer, bucket)
    d, mesh = join_job()
    for n in (1, 2):
        _sharded_save(d, mesh, run_uri, n, backend, traced=False)
    d.barrier()
    tracer.kill = kill
    tracer.armed = True
    _sharded_save(d, mesh, run_uri, 3, backend, traced=True)
    tracer.armed = False
    _send(wfd, {"done": True, "steps": [asdict(s) for s in tracer.steps]})


def run_sharded_saver(run_uri: str, backend: str, world: int, victim: int,
                      kill: KillPoint | None, bucket: str = "") -> dict:
    """Fork the saving job; SIGKILL ``victim`` at ``kill``, then its peers.  ``kill=None``:
    the dry run (every rank's steps)."""
    job = _Job(world)
    procs = job.fork(lambda rank, w: _sharded_saver_main(
        run_uri, backend, rank, kill if rank == victim else None, w, bucket))
    out: dict[str, Any] = {"exitcodes": {}, "paused": None, "steps": {}, "error": None}
    try:
        if kill is None:
            for rank, (_pid, r) in enumerate(procs):
                msg = _Lines(r).read(SAVE_TIMEOUT_S)
                if msg is None or "error" in msg:
                    out["error"] = f"rank {rank}: {msg and msg.get('error')}"
                    break
                out["steps"][rank] = [Step(**s) for s in msg["steps"]]
        else:
            pid, r = procs[victim]
            msg = _Lines(r).read(SAVE_TIMEOUT_S)
            if msg is not None and "paused" in msg:
                os.kill(pid, signal.SIGKILL)  # the crash: the victim first ...
                out["paused"] = msg["paused"]
                out["steps"][victim] = [Step(**s) for s in msg["steps"]]
            else:
                out["error"] = f"victim rank {victim} did not pause: {msg}"
        for rank, (pid, _r) in enumerate(procs):  # ... then its peers, wherever they are
            if rank != victim and kill is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            out["exitcodes"][rank] = _reap(pid)
    finally:
        kill_all(procs)
        job.close()
    return out


def _sharded_verify_main(run_uri: str, backend: str, rank: int, saved_world: int, recover: bool,
                         wfd: int) -> None:
    """One rank of the verifying job (a fresh job, maybe of another size)."""
    from xla_ckpt.restore import RestoreConfig, restore
    from xla_ckpt.run.catalog import list_checkpoints, resolve_latest
    from xla_ckpt.storage import open_storage

    d, mesh = join_job()
    out: dict[str, Any] = {"rank": rank}
    if rank == 0:
        with open_storage(run_uri, storage_config(backend, traced=False)) as run:
            entries = list_checkpoints(run)
            out["committed"] = [e.name for e in entries if e.committed]
            out["incomplete"] = [e.name for e in entries if not e.committed]
            out["latest"] = resolve_latest(run)
        ls = _ls_json(run_uri)
        out["ls_committed"] = [e["name"] for e in ls["committed"]]
        out["ls_incomplete"] = [e["name"] for e in ls["incomplete"]]
    committed = d.broadcast_object(out.get("committed"), src=0)
    resized = d.world_size != saved_world
    cfg = RestoreConfig(rank_state_on_resize="drop") if resized else None
    sc = storage_config(backend, traced=False)

    def diff(r: Any, n: int) -> str:
        bad = sharded_diff(r.state, n, mesh)
        if not bad and not resized:
            from xla_ckpt.testing.asserts import assert_state_identical

            try:
                assert_state_identical(r.rank_state, sharded_rank_state(n, rank))
            except AssertionError as e:
                bad = f"rank_state: {e}"
        return bad

    # Every committed checkpoint restores bit for bit into DTensor targets.
    out["bitwise"] = {}
    for name in committed:
        r = restore(f"{run_uri}/{name}", dist=d, into=sharded_targets(mesh), config=cfg,
                    storage_config=sc)
        out["bitwise"][name] = diff(r, num_updates_of(name))
    # A job resuming from the run folder gets the latest committed checkpoint, bitwise.
    r = restore(run_uri, dist=d, into=sharded_targets(mesh), config=cfg, storage_config=sc)
    resumed = r.checkpoint.rstrip("/").rsplit("/", 1)[1]
    out["resumed"] = resumed
    out["resumed_bitwise"] = diff(r, num_updates_of(resumed))
    if recover:
        # ... and goes on: it saves the next checkpoint and restores that bitwise.
        n = num_updates_of(resumed) + 1
        _sharded_save(d, mesh, run_uri, n, backend, traced=False)
        after = restore(run_uri, dist=d, into=sharded_targets(mesh), config=cfg,
                        storage_config=sc)
        out["recovered"] = after.checkpoint.rstrip("/").rsplit("/", 1)[1]
        out["recovered_bitwise"] = sharded_diff(after.state, n, mesh)
    d.barrier()
    _send(wfd, out)


def run_sharded_verifier(run_uri: str, backend: str, world: int, saved_world: int,
                         recover: bool) -> dict:
    """Fork a fresh job of ``world`` ranks that checks the run folder (see above)."""
    job = _Job(world)
    procs = job.fork(lambda rank, w: _sharded_verify_main(run_uri, backend, rank, saved_world,
                                                          recover, w))
    outs: list[dict | None] = []
    try:
        for _pid, r in procs:
            outs.append(_Lines(r).read(SAVE_TIMEOUT_S))
        codes = [_reap(pid) for pid, _r in procs]
    finally:
        kill_all(procs)
        job.close()
    if any(o is None or "error" in o for o in outs) or any(codes):
        return {"error": f"verifier ranks gave {outs} (exit codes {codes})"}
    merged = dict(outs[0] or {})
    # Every rank's verdicts (each compares its own shards).
    for key in ("bitwise", "resumed", "resumed_bitwise", "recovered", "recovered_bitwise"):
        if key in merged:
            merged[key] = {o["rank"]: o.get(key) for o in outs if o is not None}
    return merged


def choose_rank_points(steps: list[Step], count: int) -> list[KillPoint]:
    """Kill points of a rank whose steps hold no commit marker (a rank > 0): before every
    step, inside every body (first, middle, last-but-one byte), after the last step;
    ``count`` of them evenly, the first and the last always kept."""
    pts: list[KillPoint] = []
    for i, s in enumerate(steps):
        pts.append(KillPoint(i, "before"))
        if s.nbytes >= 2:
            pts += [KillPoint(i, "byte", b) for b in sorted({1, s.nbytes // 2})]
            pts.append(KillPoint(i, "byte", -1))
    pts.append(KillPoint(len(steps) - 1, "after"))
    return _evenly(pts, count)


def sharded_campaign(base_uri: str, backend: str, count: int, *, world: int = SHARDED_WORLD,
                     verify_world: int | None = None, victims: tuple[int, ...] | None = None,
                     recover: bool = True, emulator_host: str = "", bucket: str = "",
                     lanes: int = 1) -> dict:
    """Dry run of the sharded save, ``count`` kill points spread over the victims' steps
    (rank 0 gets half, the commit marker's neighbours always among them), one killed job and
    one verifying job at each.  Runs in a launcher worker (the zygote), like :func:`campaign`
    (``lanes`` too)."""
    torch.set_num_threads(1)
    preload(backend)
    # (torch._dynamo: distribute_tensor imports it on its first call, seconds in every fork)
    for mod in ("torch.distributed.device_mesh", "torch.distributed.tensor", "torch._dynamo"):
        importlib.import_module(mod)  # warms the forks

    t0 = time.perf_counter()
    victims = tuple(range(world)) if victims is None else victims
    dry_uri = f"{base_uri}/dry"
    dry = run_sharded_saver(dry_uri, backend, world, 0, None, bucket)
    if dry["error"] or any(dry["exitcodes"].values()):
        raise AssertionError(f"dry run failed ({dry['exitcodes']}): {dry['error']}")
    steps: dict[int, list[Step]] = dry["steps"]
    _wipe(dry_uri, backend, emulator_host)
    per: dict[int, int] = {}
    others = [v for v in victims if v != 0]
    if 0 in victims:
        # (rank 0's points always hold the 4 around its commit marker)
        per[0] = count if not others else min(max(count // 2, 4), count - len(others))
    for j, v in enumerate(others):
        left = count - per.get(0, 0)
        per[v] = left // len(others) + (j < left % len(others))
    points = [(v, p) for v in victims
              for p in (choose_points(steps[v], per[v]) if v == 0
                        else choose_rank_points(steps[v], per[v]))]

    def one(j: int, vp: tuple[int, KillPoint]) -> dict:
        v, p = vp
        uri = f"{base_uri}/s{j:04d}"
        killed = run_sharded_saver(uri, backend, world, v, p, bucket)
        res: dict[str, Any] = {
            "victim": v, "point": asdict(p), "label": f"rank {v} {p.label(steps[v])}",
            "expect_committed": v == 0 and committed_at(p, steps[0]),
            "exitcodes": killed["exitcodes"], "saver_error": killed["error"],
            "paused_at": killed["paused"],
            "trace_matches": same_place(killed["steps"].get(v) or [], steps[v], p)}
        res["verify"] = run_sharded_verifier(uri, backend, verify_world or world, world,
                                             recover)
        res["strays"] = stray_objects(uri, backend, emulator_host)
        _wipe(uri, backend, emulator_host)
        return res

    results = in_lanes(points, one, lanes)
    return {"steps": {v: [asdict(s) for s in st] for v, st in steps.items()},
            "commit_step": commit_step(steps[0]), "results": results, "world": world,
            "verify_world": verify_world or world, "seconds": time.perf_counter() - t0}


def check_sharded(result: dict) -> list[str]:
    """Every violation of the crash-consistency rules after one killed sharded save."""
    label = result["label"]
    if result["saver_error"]:
        return [f"{label}: saver failed: {result['saver_error']}"]
    bad = []
    if set(result["exitcodes"].values()) != {-signal.SIGKILL}:
        bad.append(f"{label}: exit codes {result['exitcodes']}, expected SIGKILL everywhere")
    if not result["trace_matches"]:
        bad.append(f"{label}: the killed rank's steps differ from the dry run")
    v = result["verify"]
    if "error" in v:
        return bad + [f"{label}: verifier: {v['error']}"]
    want_c = result["expect_committed"]
    committed = set(v["committed"])
    for name in (A, B):
        if name not in committed:
            bad.append(f"{label}: {name} is no longer committed")
    if (C in committed) != want_c:
        bad.append(f"{label}: {C} committed={C in committed}, expected {want_c}")
    if v["ls_committed"] != v["committed"]:
        bad.append(f"{label}: ls lists {v['ls_committed']} as committed, catalog {v['committed']}")
    expect = C if want_c else B
    if v["latest"] != expect:
        bad.append(f"{label}: latest={v['latest']}, expected {expect}")
    for rank, name in v["resumed"].items():
        if name != expect or v["resumed_bitwise"][rank]:
            bad.append(f"{label}: rank {rank} resumed {name} "
                       f"({v['resumed_bitwise'][rank] or 'bitwise'}), expected {expect}")
    for rank, per_ckpt in v["bitwise"].items():
        if set(per_ckpt) != committed:
            bad.append(f"{label}: rank {rank} restored {sorted(per_ckpt)}")
        for name, diff in per_ckpt.items():
            if diff:
                bad.append(f"{label}: rank {rank}: {name} does not restore bitwise: {diff}")
    if "recovered" in v:
        nxt = f"checkpoint_1_{num_updates_of(expect) + 1}"
        for rank, name in v["recovered"].items():
            if name != nxt or v["recovered_bitwise"][rank]:
                bad.append(f"{label}: rank {rank}: after resuming, saving {nxt} gave {name} "
                           f"({v['recovered_bitwise'][rank] or 'bitwise'})")
    return bad


def run_job(world: int, body: Callable[[int], dict], timeout_s: float) -> list[dict]:
    """Fork a gloo job of ``world`` ranks (see :class:`_Job`), each running ``body(rank)``;
    returns per rank ``{"rank", "exitcode", "value"}`` (``value`` None when the rank died,
    ``"hang"`` True when it was still running after ``timeout_s`` and was killed)."""
    return run_jobs([(world, body)], timeout_s)[0]


EXIT_GRACE_S = 5.0  # run_jobs: a rank that answered exits this soon after its last peer


def run_jobs(jobs: list[tuple[int, Callable[[int], dict]]], timeout_s: float,
             stagger_s: float = 0.0) -> list[list[dict]]:
    """:func:`run_job` of several jobs at once, each with its own store: every rank of every
    job is forked first (one :class:`ForkGate`), then job ``k`` starts ``k * stagger_s``
    seconds after the gate opened and has ``timeout_s`` from its own start.  Jobs that
    mostly wait (a rank stalled past a collective timeout, a dead rank's silence) so overlap;
    the stagger keeps their busy starts apart.  Returns each job's rows, as :func:`run_job`.
    """
    stores = [_Job(world) for world, _body in jobs]
    gate = ForkGate()
    # A rank that answered stays alive, as in a real job, until every rank of its job answered
    # or died: a peer still diagnosing a failure reads its heartbeat (an exited rank's
    # heartbeat stands still: it would be named dead).
    releases = [ForkGate() for _ in jobs]
    procs: list[list[tuple[int, int]]] = []
    outs: list[list[dict]] = []
    try:
        try:
            for k, ((_world, body), job) in enumerate(zip(jobs, stores, strict=True)):
                def child(rank: int, w: int, body: Callable[[int], dict] = body,
                          delay: float = k * stagger_s, mine: int = k) -> None:
                    for j, g in enumerate(releases):
                        if j != mine:  # only its own job's release may keep it waiting
                            g.open()
                    time.sleep(delay)
                    _send(w, body(rank))
                    releases[mine].wait()

                procs.append(job.fork(child, gate))
        finally:
            gate.open()
        start = time.monotonic()
        for k, ps in enumerate(procs):
            deadline = start + k * stagger_s + timeout_s
            out: list[dict] = []
            for rank, (_pid, r) in enumerate(ps):
                msg = _Lines(r).read(max(deadline - time.monotonic(), 0.1))
                out.append({"rank": rank, "value": msg, "hang": False})
            releases[k].open()  # every rank answered, died or hangs: the job is over
            # A rank that answered exits once every peer answered or died.  One with no
            # answer died (an exit status now), or hangs: still running at the deadline, it
            # is killed and marked, and then the ranks that answered (waiting for it) have
            # EXIT_GRACE_S to exit before they are marked as well.
            running = {rank: pid for rank, (pid, _r) in enumerate(ps)}
            while running:
                for rank, pid in list(running.items()):
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        out[rank]["exitcode"] = -os.WTERMSIG(status) if os.WIFSIGNALED(
                            status) else os.WEXITSTATUS(status)
                        del running[rank]
                now = time.monotonic()
                for rank in [q for q in running if now > deadline and (
                        out[q]["value"] is None or now > deadline + EXIT_GRACE_S)]:
                    out[rank]["hang"] = True
                    out[rank]["exitcode"] = _reap(running.pop(rank), 0.0)
                time.sleep(0.01)
            outs.append(out)
    finally:
        for g in releases:
            g.open()
        for ps in procs:
            kill_all(ps)
        for job in stores:
            job.close()
    return outs
