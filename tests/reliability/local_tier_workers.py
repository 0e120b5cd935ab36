"""What the local-tier reliability tests run (module level: the launcher imports it).

A *job* is 4 real gloo ranks on 2 emulated hosts of 2 workers each (``GROUP_RANK``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and the host's loopback address as torchrun and
:func:`xla_ckpt.testing.launcher.rank_environment` give them), forked from a zygote process
(a launcher worker with torch, the library and the GCS client imported) with its rendezvous
store held by the zygote, as ``crash_harness.run_job`` does.  Each rank runs
:func:`train_main`: a :class:`~xla_ckpt.manager.CheckpointManager` with a local tier
(``local_dir=<tmp>/local-{host}``, every host its own folder; local saves every update,
durable every :data:`DURABLE_EVERY`), ``restore_or_initialize()``, then a small training loop
(:func:`train_step`, deterministic float math on CPU: a run that resumes from update ``n``
ends bit for bit where an uninterrupted one does, :func:`reference`).

How a job ends (``spec["end"]``):

* ``"close"``: ``close()`` after the last update, then report the final state's difference
  from the reference;
* ``"die"``: wait for the in-flight save, report, then block: the harness SIGKILLs every
  rank there (a job lost mid-epoch, between two updates);
* a kill point (``spec["point"]``, :data:`POINTS`): one rank (``spec["victim"]``) pauses at
  that place of the save of update ``spec["at"]``, reports, and the harness SIGKILLs it, then
  every other rank wherever it is (the job died); with ``spec["kill"] == "victim"`` only the
  victim, and the job ends when every other rank has ended on its own (a peer died).

The kill points wrap one library function in the victim's own process (the rest is the real
library); each names a place of the save's sequence (``manager.local_save``): the rank's
local data-file write, the host commit (manifest, then the host's marker, written last), the
durable copy that reads the local files, the durable commit, its pointer and rotation.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import select
import signal
import threading
import time
import traceback
from typing import Any

import crash_harness as H
import torch

WORLD = 4
HOSTS = 2
DURABLE_EVERY = 4
COLLECTIVE_TIMEOUT_S = 60.0   # inside a job; a job is killed by the harness long before
RENDEZVOUS_TIMEOUT_S = 100.0  # the ranks' first meeting (under the tests' 120 s job timeout)
MARKER_WAIT_S = 60.0          # a victim waiting for another host's marker gives up after this
N = 16 * 1024                 # elements of the largest tensor (64 KiB of float32)
TORN_AT_BYTES = 64 * 1024     # a torn data-file copy stops at the first blob past this

#: Kill point -> where the victim pauses (``at``: the update whose save it is).
POINTS = {
    "local-write": "before its local data files are staged (the copy into their pages)",
    "local-write-torn": "inside the copy into a local data file's pages: the temporary file "
                        "half written",
    "local-written": "after its local data files are published, before the exchange of parts",
    "host-manifest": "host leader: the host's manifest written, its marker not",
    "one-host-marker": "host 1's leader, once host 0's marker is there, before its own",
    "host-markers": "host 1's leader, after its marker (host 0's there too), before pruning",
    "durable-copy": "in the durable copy: one of its local files uploaded, the other not",
    "durable-commit": "rank 0: every rank's copy done, before the durable manifest",
    "durable-pointer": "rank 0: the durable manifest committed, before checkpoint_last",
    "durable-rotate": "rank 0: checkpoint_last moved, before rotation",
}
#: Points of a save whose step is committed on every host when the kill comes.
COMMITTED_LOCALLY = ("host-markers", "durable-copy", "durable-commit", "durable-pointer",
                     "durable-rotate")
#: Points after which the durable tier holds the save committed.
COMMITTED_DURABLE = ("durable-pointer", "durable-rotate")


# ---- the training state -------------------------------------------------------------------
def initial_state(seed: int = 24) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(N, generator=g), "b": torch.randn(N // 4, generator=g)},
            "opt": {"m": torch.zeros(N), "step": torch.tensor(0.0)}, "u": 0}


def train_step(state: dict, u: int, seed: int = 24) -> None:
    """One update, in place (a momentum step on a pseudo-random gradient of update ``u``)."""
    g = torch.Generator().manual_seed(seed * 1000 + u)
    grad = torch.randn(N, generator=g)
    m = state["opt"]["m"]
    m.mul_(0.9).add_(grad, alpha=0.1)
    state["model"]["w"].sub_(m, alpha=0.01)
    state["model"]["b"].mul_(0.999).add_(grad[: N // 4], alpha=1e-3)
    state["opt"]["step"].add_(1.0)
    state["u"] = u


def reference(u: int, seed: int = 24) -> dict:
    """The state after ``u`` updates of an uninterrupted run."""
    s = initial_state(seed)
    for k in range(1, u + 1):
        train_step(s, k, seed)
    return s


def rank_state(rank: int, u: int) -> dict:
    return {"rng": torch.tensor([rank, u, 7 * u + rank], dtype=torch.int64),
            "pos": 10 * u + rank}


def state_diff(got: Any, want: Any) -> str:
    """'' when ``got`` is bit for bit ``want``, else the first difference."""
    from xla_ckpt.testing.asserts import assert_state_identical

    try:
        assert_state_identical(got, want)
    except AssertionError as e:
        return str(e)
    return ""


# ---- the job ------------------------------------------------------------------------------
def local_template(base: str) -> str:
    """``local_dir`` of the jobs under ``base``: one folder per emulated host."""
    return os.path.join(base, "local-{host}")


def host_folder(local: str, host: int) -> str:
    return local.replace("{host}", str(host))


def tier_folder(local: str, host: int, run_uri: str) -> str:
    """Host ``host``'s folder of run ``run_uri`` in its local tier."""
    from xla_ckpt.run.local_tier import run_key

    return os.path.join(host_folder(local, host), run_key(run_uri))


def step_files(local: str, host: int, run_uri: str, name: str) -> dict[str, int]:
    """Files of checkpoint ``name`` in host ``host``'s local tier, with their sizes."""
    p = os.path.join(tier_folder(local, host, run_uri), name)
    try:
        return {f: os.path.getsize(os.path.join(p, f)) for f in sorted(os.listdir(p))}
    except FileNotFoundError:
        return {}


def config(spec: dict):
    from xla_ckpt.manager import CheckpointConfig

    return CheckpointConfig(save_dir=spec["run"], local_dir=spec["local"],
                            local_interval_updates=1,
                            save_interval_updates=spec.get("durable_every", DURABLE_EVERY),
                            save_interval_epochs=0, handle_sigterm=False,
                            keep_local_checkpoints=2, keep_interval_updates=3,
                            local_max_bytes=spec.get("local_max_bytes", 0),
                            local_replicas=spec.get("replicas", 0))


class HostJob(H._Job):
    """A forked gloo job of :data:`WORLD` ranks on :data:`HOSTS` emulated hosts."""

    def env(self, rank: int) -> dict[str, str]:
        from xla_ckpt.testing.launcher import rank_environment

        return {**super().env(rank), **rank_environment(rank, self.world, HOSTS)}


def _pause(wfd: int, point: str, **info: Any) -> None:
    """The victim: say where it is, then wait for the SIGKILL."""
    H._send(wfd, {"kind": "paused", "point": point, **info})
    while True:
        time.sleep(3600)


def _wait_for(paths: list[str]) -> list[str]:
    """Wait (bounded) until every path exists; the ones still missing."""
    deadline = time.monotonic() + MARKER_WAIT_S
    while time.monotonic() < deadline:
        missing = [p for p in paths if not os.path.exists(p)]
        if not missing:
            return []
        time.sleep(0.005)
    return [p for p in paths if not os.path.exists(p)]


class _PauseOnCopy(torch.Tensor):
    """A blob's bytes whose copy into the data file's pages first calls ``stop`` (the blobs
    before it are in the temporary file already: a torn local write)."""

    stop: Any = None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_ and cls.stop is not None:
            cls.stop()
        return super().__torch_function__(func, types, args, kwargs or {})


def install_kill_point(spec: dict, run_uri: str, wfd: int) -> None:
    """Wrap the library function of ``spec["point"]`` in this (the victim's) process, so that
    it pauses there during the save of update ``spec["at"]`` (see :data:`POINTS`)."""
    from xla_ckpt.manager import local_save, saving
    from xla_ckpt.run.local_tier import LocalTier, marker_name

    point, target = spec["point"], f"checkpoint_1_{spec['at']}"
    fired = threading.Lock()

    def markers(hosts: range) -> list[str]:
        return [os.path.join(tier_folder(spec["local"], h, run_uri), target, marker_name(h))
                for h in hosts]

    def pause(**info: Any) -> None:
        if fired.acquire(blocking=False):
            _pause(wfd, point, **info)

    if point in ("local-write", "local-written"):
        real_stage, real_finish = local_save.stage_local, local_save.finish_local

        def stage_local(tier, name, *a, **kw):
            if name == target and point == "local-write":
                pause(files=sorted(os.listdir(tier.path(name))) if os.path.isdir(
                    tier.path(name)) else [])
            return real_stage(tier, name, *a, **kw)

        def finish_local(staged, tier, name, *a, **kw):
            part = real_finish(staged, tier, name, *a, **kw)
            if name == target:
                pause(files=sorted(f for p in part.parts for f in p.files), error=part.error)
            return part

        local_save.stage_local = stage_local  # the kill points, on purpose
        local_save.finish_local = finish_local
    elif point == "local-write-torn":
        from dataclasses import replace

        real_file = local_save.stage_file
        host = int(os.environ["GROUP_RANK"])
        folder = os.path.join(tier_folder(spec["local"], host, run_uri), target)

        def stage_file(storage, plan, *a, **kw):
            if storage.root.rstrip("/") == folder and plan.fname.startswith("data-"):
                k = next((i for i, off in enumerate(plan.offsets)
                          if off - len(plan.header) >= TORN_AT_BYTES), None)
                if k is not None:
                    _PauseOnCopy.stop = staticmethod(lambda: pause(file=plan.fname))
                    blobs = list(plan.labelled)
                    blobs[k] = replace(blobs[k], data=blobs[k].data.as_subclass(_PauseOnCopy))
                    plan = replace(plan, labelled=blobs)
            return real_file(storage, plan, *a, **kw)

        local_save.stage_file = stage_file  # the kill point, on purpose
    elif point in ("host-manifest", "one-host-marker", "host-markers"):
        real_commit = LocalTier.commit

        def commit(self, step, manifest_bytes):
            if step.name == target and point == "host-manifest":
                pause(host=self.host)
            if step.name == target and point == "one-host-marker":
                pause(host=self.host, waited_for=_wait_for(markers(range(self.host))))
            real_commit(self, step, manifest_bytes)
            if step.name == target:
                pause(host=self.host, waited_for=_wait_for(markers(range(HOSTS))))

        LocalTier.commit = commit  # type: ignore[method-assign]  # the kill point, on purpose
    elif point == "durable-copy":
        real_copy = local_save.copy_to_durable

        class PauseAfterFirst:
            def __init__(self, durable: Any) -> None:
                self.durable = durable

            def write_atomic(self, name, *a, **kw):
                info = self.durable.write_atomic(name, *a, **kw)
                pause(uploaded=name, waited_for=_wait_for(markers(range(HOSTS))))
                return info

        def copy_to_durable(local, durable, parts):
            if local.root.rstrip("/").endswith("/" + target):
                durable = PauseAfterFirst(durable)
            return real_copy(local, durable, parts)

        local_save.copy_to_durable = copy_to_durable  # the kill point, on purpose
    elif point == "durable-commit":
        real_job = saving.SavePath._commit_job

        def _commit_job(self, fl, every):
            if fl.name == target:
                pause()
            return real_job(self, fl, every)

        saving.SavePath._commit_job = _commit_job  # type: ignore[method-assign]  # on purpose
    elif point == "durable-pointer":
        real_pointer = saving.write_pointer

        def write_pointer(run, which, name, **kw):
            if which == "last" and name == target:
                pause()
            return real_pointer(run, which, name, **kw)

        saving.write_pointer = write_pointer  # type: ignore[assignment]  # the kill point
    elif point == "durable-rotate":
        real_rotate = saving.rotate

        def rotate(run, cfg, *, protect, **kw):
            if target in protect:
                pause()
            return real_rotate(run, cfg, protect=protect, **kw)

        saving.rotate = rotate  # type: ignore[assignment]  # the kill point, on purpose
    elif point in REPLICA_POINTS:
        _replica_kill_point(point, spec["at"], pause)
    else:
        raise ValueError(f"unknown kill point {point!r}")


#: Kill points of the background replication (issue 26), in the replication round of the first
#: local step at or after ``spec["at"]`` (the thread of the victim's host leader pauses).
REPLICA_POINTS = {
    "replica-send": "host 1's leader, before it sends its part (nothing sent)",
    "replica-mid-send": "host 1's leader, the manifest sent, no data file yet",
    "replica-received": "host 0's leader, host 1's files received and checked, no marker",
    "replica-committed": "host 0's leader, right after host 1's replica marker",
    "peer-mid-read": "a restore: host 0's leader serving host 1's ranks their first data "
                     "range from its tier",
}


def _replica_kill_point(point: str, at: int, pause: Any) -> None:
    from xla_ckpt.manager import replication
    from xla_ckpt.run import replicas
    from xla_ckpt.run.local_tier import LocalTier

    if point == "peer-mid-read":
        from xla_ckpt.storage import peer

        real_send = peer._Handler._send_file

        def send_file(self, f, name, start, end):
            if name.startswith("data-"):
                pause()
            return real_send(self, f, name, start, end)

        peer._Handler._send_file = send_file  # type: ignore[method-assign]  # on purpose
        return
    if point in ("replica-send", "replica-mid-send"):
        where = replication
        real_transfer = where.transfer_part
        real_mapped = replicas._mapped_for_sending
        armed = threading.Event()

        def transfer_part(group, tier, step, files, *, src, dst):
            if step.num_updates >= at and group.rank == src:
                if point == "replica-send":
                    pause(step=step.name)
                armed.set()
            try:
                return real_transfer(group, tier, step, files, src=src, dst=dst)
            finally:
                armed.clear()

        def mapped_for_sending(*a, **kw):
            if armed.is_set():
                pause()
            return real_mapped(*a, **kw)

        where.transfer_part = transfer_part  # the kill point, on purpose
        replicas._mapped_for_sending = mapped_for_sending  # the kill point, on purpose
    else:
        real_commit = LocalTier.commit_replica

        def commit_replica(self, step, manifest_bytes=None):
            if step.num_updates >= at and point == "replica-received":
                pause(step=step.name)
            real_commit(self, step, manifest_bytes)
            if step.num_updates >= at:
                pause(step=step.name)

        LocalTier.commit_replica = commit_replica  # type: ignore[method-assign]  # on purpose


def train_main(spec: dict, rank: int, wfd: int) -> None:
    """One rank of a job (see the module docstring); sends JSON lines to the harness."""
    from xla_ckpt.comm import TorchDist
    from xla_ckpt.comm.torch_dist import init_process_group
    from xla_ckpt.manager import CheckpointManager

    torch.set_num_threads(1)
    seed = spec.get("seed", 24)
    H._send(wfd, {"kind": "started", "rank": rank, "pid": os.getpid()})
    # The ranks meet with a longer timeout (a fork slow to start on a loaded 2-core machine
    # is not the failure under test), then every collective of the job gets the short one.
    init_process_group("gloo", "env://", RENDEZVOUS_TIMEOUT_S)
    d = TorchDist(backend="gloo", timeout_s=COLLECTIVE_TIMEOUT_S)
    m = CheckpointManager(config(spec), dist=d)
    if spec.get("point") is not None and rank == spec["victim"]:
        install_kill_point(spec, m.run.uri, wfd)
    res = m.restore_or_initialize()
    start = 0 if res is None else int(res.num_updates or 0)
    if res is None:
        state = initial_state(seed)
        H._send(wfd, {"kind": "restored", "rank": rank, "checkpoint": None, "host":
                      d.topology.host_id})
    else:
        # The live state takes the restored values (as ``load_state_dict`` copies them into
        # the model's own tensors): each its own storage, not views of the restore's buffers.
        state = _copy_tree(res.state)
        H._send(wfd, {"kind": "restored", "rank": rank, "checkpoint": res.checkpoint,
                      "num_updates": res.num_updates, "tier": res.tier,
                      "host": d.topology.host_id,
                      "diff": state_diff(res.state, reference(start, seed)),
                      "rank_diff": state_diff(res.rank_state, rank_state(rank, start))})
    for u in range(start + 1, spec["upto"] + 1):
        train_step(state, u, seed)
        m.after_update(epoch=1, num_updates=u, state=state, rank_state=rank_state(rank, u))
    end = spec.get("end", "close")
    if end == "die":
        m.wait()
        replication = m.wait_for_replicas(COLLECTIVE_TIMEOUT_S) if spec.get("wait_replicas") \
            else None
        H._send(wfd, {"kind": "dying", "rank": rank, "at": spec["upto"],
                      "local_committed": list(m.local_committed),
                      "replication": replication})
        while True:  # killed here by the harness, mid-epoch, the manager open
            time.sleep(3600)
    m.close()
    H._send(wfd, {"kind": "done", "rank": rank, "at": spec["upto"],
                  "local_committed": list(m.local_committed),
                  "diff": state_diff(state, reference(spec["upto"], seed))})


def _copy_tree(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: _copy_tree(x) for k, x in v.items()}
    return v


def _rank_entry(spec: dict, rank: int, wfd: int) -> None:
    try:
        train_main(spec, rank, wfd)
    except BaseException as e:
        H._send(wfd, {"kind": "error", "rank": rank, "error": type(e).__name__,
                      "message": str(e)[:2000], "traceback": traceback.format_exc()[-3000:]})
        raise


# ---- the harness (runs in the zygote) -----------------------------------------------------
class _Pipe:
    """JSON lines of one rank, read without blocking."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""
        self.eof = False
        self.lines: list[dict] = []

    def pump(self) -> None:
        import json

        try:
            chunk = os.read(self.fd, 1 << 20)
        except BlockingIOError:
            return
        if not chunk:
            self.eof = True
        self.buf += chunk
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            if line:
                self.lines.append(json.loads(line))

    def end(self) -> dict | None:
        for msg in self.lines:
            if msg.get("kind") in ("done", "dying", "paused", "error"):
                return msg
        return None


def run_jobs(specs: list[dict], timeout_s: float = 120.0) -> list[dict]:
    """Fork one job of :data:`WORLD` ranks per spec (all at once: several jobs on the same
    hosts), each rank running :func:`train_main`, and see each end.

    Returns per job ``{"ranks": {rank: {"lines", "exitcode", "hang"}}, "killed": bool,
    "paused": the victim's message or None, "seconds"}``: every rank's messages, its exit
    status (``-9``: SIGKILLed by the harness), and whether it still ran at ``timeout_s``
    without having ended (a hang; killed then).  A job with a kill point ends when its
    victim paused (SIGKILLed there, then every other rank of the job); a job with
    ``end="die"`` when every rank waits to die (every rank SIGKILLed).
    """
    t0 = time.perf_counter()
    jobs = [HostJob(WORLD) for _ in specs]
    gate = H.ForkGate()  # no rank of any job starts before every rank of every job is forked
    try:
        procs = [job.fork(lambda rank, w, spec=spec: _rank_entry(spec, rank, w), gate)
                 for job, spec in zip(jobs, specs, strict=True)]
    finally:
        gate.open()
    pipes = [[_Pipe(r) for _pid, r in ps] for ps in procs]
    outs: list[dict[str, Any]] = [{"killed": False, "paused": None, "ranks": {}} for _ in specs]
    open_jobs = set(range(len(specs)))
    deadline = time.monotonic() + timeout_s
    try:
        for ps in pipes:
            for p in ps:
                os.set_blocking(p.fd, False)
        while open_jobs:
            for j in sorted(open_jobs):
                if _job_over(specs[j], pipes[j], outs[j], procs[j]):
                    open_jobs.discard(j)
                    outs[j]["seconds"] = time.perf_counter() - t0
            left = deadline - time.monotonic()
            if not open_jobs:
                break
            if left <= 0:
                for j in open_jobs:  # still running without having ended: a hang
                    ends = [p.end() for p in pipes[j]]
                    outs[j]["hang"] = [r for r, (e, p) in enumerate(zip(ends, pipes[j],
                                                                        strict=True))
                                       if e is None and not p.eof]
                    _kill(procs[j], None)
                    outs[j]["killed"] = True
                    outs[j]["seconds"] = time.perf_counter() - t0
                break
            fds = [p.fd for j in open_jobs for p in pipes[j] if not p.eof]
            ready, _, _ = select.select(fds, [], [], min(left, 1.0))
            for j in open_jobs:
                for p in pipes[j]:
                    if p.fd in ready:
                        p.pump()
        for j, out in enumerate(outs):
            hang = set(out.pop("hang", []))
            for r, (pid, _r) in enumerate(procs[j]):
                code = H._reap(pid, 30.0)
                while not pipes[j][r].eof:
                    pipes[j][r].pump()
                out["ranks"][r] = {"lines": pipes[j][r].lines, "exitcode": code,
                                   "hang": r in hang}
    finally:
        for ps in procs:
            H.kill_all(ps)
        for job in jobs:
            job.close()
    return outs


def run_job(spec: dict, timeout_s: float = 120.0) -> dict:
    """:func:`run_jobs` of one job."""
    return run_jobs([spec], timeout_s)[0]


def _kill(procs: list[tuple[int, int]], victim: int | None) -> None:
    """The crash: SIGKILL the victim first, then every other rank of the job."""
    order = [victim] if victim is not None else []
    order += [r for r in range(len(procs)) if r not in order]
    for r in order:
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[r][0], signal.SIGKILL)


def _job_over(spec: dict, pipes: list[_Pipe], out: dict, procs: list[tuple[int, int]]) -> bool:
    """Whether one job has ended (killing it where its spec says so)."""
    ends = [p.end() for p in pipes]
    victim = spec.get("victim") if spec.get("point") is not None else None
    if victim is not None and ends[victim] is not None:
        alone = spec.get("kill") == "victim"  # the victim dies, the other ranks go on
        if ends[victim]["kind"] == "paused" and not out.get("killed"):
            out["paused"] = ends[victim]
            out["killed"] = True
            if alone:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(procs[victim][0], signal.SIGKILL)
            else:
                _kill(procs, victim)
        if alone and ends[victim]["kind"] == "paused":
            return all(e is not None or p.eof for r, (e, p) in enumerate(zip(ends, pipes,
                                                                                strict=True))
                       if r != victim)
        return True
    if victim is None and all(e is not None or p.eof for e, p in zip(ends, pipes, strict=True)):
        if spec.get("end") == "die":
            out["killed"] = True
            _kill(procs, None)
        return True
    return all(p.eof for p in pipes)


def warm(backend: str = "local") -> bool:
    """In the zygote: import what every rank uses, so each fork starts warm."""
    torch.set_num_threads(1)
    H.preload(backend)
    for mod in ("xla_ckpt.comm", "xla_ckpt.manager.local_restore", "xla_ckpt.manager.local_save",
                "xla_ckpt.storage.tiered", "xla_ckpt.testing.launcher"):
        importlib.import_module(mod)  # warms the forks

    initial_state()
    return True


def lines_of(result: dict, kind: str) -> dict[int, dict]:
    """Every rank's message of ``kind`` (``restored``, ``done``, ...) by rank."""
    out = {}
    for r, row in result["ranks"].items():
        for msg in row["lines"]:
            if msg.get("kind") == kind:
                out[int(r)] = msg
    return out


def errors_of(result: dict) -> list[str]:
    """Every rank that failed, hung, never started or died without a word, and why."""
    bad = []
    for r, row in result["ranks"].items():
        kinds = [msg.get("kind") for msg in row["lines"]]
        for msg in row["lines"]:
            if msg.get("kind") == "error":
                bad.append(f"rank {r}: {msg['error']}: {msg['message']}\n{msg['traceback']}")
            elif "error" in msg and "kind" not in msg:  # the fork's own report (crash_harness)
                bad.append(f"rank {r}: {msg['error']}")
        if row["hang"]:
            bad.append(f"rank {r} hung (its last message: {kinds[-1:] or 'none'})")
        if "started" not in kinds:
            bad.append(f"rank {r} never started (exit status {row['exitcode']})")
        elif not row["hang"] and row["exitcode"] not in (0, -9) and "error" not in kinds:
            bad.append(f"rank {r} died without a message (exit status {row['exitcode']}, "
                       f"messages {kinds})")
    return bad


def catalog(run_uri: str) -> dict[str, list[str]]:
    """The durable run folder's committed and incomplete checkpoints (read in the caller)."""
    from xla_ckpt.run.catalog import list_checkpoints
    from xla_ckpt.storage import open_storage

    with open_storage(run_uri) as run:
        entries = list_checkpoints(run)
    return {"committed": [e.name for e in entries if e.committed],
            "incomplete": [e.name for e in entries if not e.committed]}
