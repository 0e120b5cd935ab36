"""One phase of the demo: ``workers`` worker processes launched torchrun-style, watched, reaped.

:func:`run_phase` starts the workers (each with its emulated host's variables,
:func:`host_env`), logs their progress (:class:`~xla_ckpt.demo.progress.Heartbeat`), sends
SIGTERM for a preemption, and returns every rank's JSON report (:class:`PhaseResult`); a
worker that fails, or a phase that outlives its timeout, raises :class:`DemoError` with every
rank's log tail.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

from xla_ckpt.demo.progress import Heartbeat
from xla_ckpt.errors import XlaCkptError

logger = logging.getLogger(__name__)


@dataclass
class PhaseResult:
    """One phase: every rank's report (none after a crash), exit codes, its wall time;
    ``started_unix``: ``time.time()`` when the first worker was launched; ``crashed_after``:
    rank 0's last finished update when the workers were killed (``crash_when``)."""

    phase: str
    reports: list[dict]
    exitcodes: list[int]
    seconds: float
    started_unix: float = 0.0
    crashed_after: int | None = None


class DemoError(XlaCkptError, RuntimeError):
    """A demo phase failed; the message names the phase, the rank and its last error line.

    ``logs`` holds the tail of every rank's log; ``leg`` (``"ddp"``/``"fsdp"``) the leg that
    was running, set by :func:`xla_ckpt.demo.run.run_demo` (``""`` before any leg
    started).
    """

    def __init__(self, message: str, logs: str = "", leg: str = "") -> None:
        super().__init__(message)
        self.logs = logs
        self.leg = leg


#: How often a phase is relaunched when its rendezvous port was taken before rank 0 bound it.
PORT_RETRIES = 3


def _free_port() -> int:
    """A free port for a phase's rendezvous, below the kernel's ephemeral range when it can:
    a port from that range (``bind(0)``) can be taken by any outgoing connection (the GCS
    client's, gloo's) between this check and rank 0's bind (EADDRINUSE)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng = random.Random()
    for _ in range(64 if low > 20000 else 0):
        port = rng.randrange(20000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_taken(out: str, codes: list[int | None]) -> bool:
    """Rank 0 failed to listen on the rendezvous port (another process took it after
    :func:`_free_port`) before any update: nothing ran, the phase can start again."""
    if not codes or not codes[0] or os.path.exists(os.path.join(out, "progress0")):
        return False
    try:
        with open(os.path.join(out, "log0.txt")) as f:
            text = f.read()
    except OSError:
        return False
    return "EADDRINUSE" in text and "failed to listen" in text


def host_env(rank: int, workers: int, hosts: int) -> dict[str, str]:
    """torchrun's per-rank host variables for ``hosts`` emulated hosts of ``workers // hosts``
    (:func:`xla_ckpt.testing.launcher.rank_environment`, less ``RANK``).

    ``GROUP_RANK = rank * hosts // workers``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``; with more
    than one host also ``XLA_CKPT_GCS_SOURCE_ADDRESS`` = the host's loopback address
    (:func:`xla_ckpt.testing.fault_proxy.host_address`), which the GCS storage binds.

    Raises:
        ValueError: ``hosts`` < 1 or ``workers`` not a multiple of it (names both keys).
    """
    if not isinstance(hosts, int) or isinstance(hosts, bool) or hosts < 1 or workers % hosts:
        raise ValueError(f"train.workers={workers} must be a multiple of train.hosts={hosts} "
                         f"(>= 1); set train.hosts to a divisor of train.workers")
    from xla_ckpt.testing.launcher import rank_environment  # noqa: PLC0415 - the demo's launcher env only

    env = rank_environment(rank, workers, hosts)
    del env["RANK"]
    return env


def run_phase(phase: str, *, workers: int, config: str, overrides: list[str], env: dict,
              workdir: str, device: str = "cpu", preempt_after_update: int | None = None,
              timeout_s: float = 1200.0, module: str = "xla_ckpt.demo.worker",
              args: list[str] | None = None, label: str | None = None, hosts: int = 1,
              poll: Callable[[str], None] | None = None,
              crash_when: Callable[[int | None], bool] | None = None,
              _retries: int = 0) -> PhaseResult:
    """Launch ``workers`` worker processes (torchrun-style env) and collect their reports.

    ``module`` is the worker program (:mod:`xla_ckpt.demo.worker`, or :mod:`xla_ckpt.demo.fsdp`
    for the sharded leg, which takes no ``--device``), ``args`` extra arguments for it, ``label``
    the folder name of the phase's logs and reports (default ``phase``).  ``hosts``: emulated
    hosts the workers are spread over (:func:`host_env`).  ``poll(out)`` is called about every
    50 ms while the workers run (``out``: the phase's folder).  With
    ``preempt_after_update``, SIGTERM goes to every worker once rank 0 has finished that
    update.  ``crash_when(update)`` (rank 0's last finished update, None before the first)
    is asked about every 50 ms; once it says True every worker gets SIGKILL (a crash: no
    save, no report) and the phase returns with no reports and ``crashed_after`` set (a
    phase that ends before that raises).  Raises :class:`DemoError` if a worker fails or the
    phase outlives ``timeout_s``.  A phase whose rendezvous port was taken before rank 0 bound
    it (EADDRINUSE, before any update) starts again on another port, at most
    :data:`PORT_RETRIES` times.
    """
    name = label or phase
    out = os.path.join(workdir, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    port = _free_port()
    procs = []
    logs = []
    t0 = time.perf_counter()
    started_unix = time.time()
    crashed_after: int | None = None
    for rank in range(workers):
        wenv = dict(os.environ)
        wenv.update(env)
        wenv.pop("XLA_CKPT_GCS_SOURCE_ADDRESS", None)
        wenv.update(host_env(rank, workers, hosts))
        wenv.update({"RANK": str(rank), "WORLD_SIZE": str(workers), "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port), "PJRT_DEVICE": "CPU", "GLOO_SOCKET_IFNAME": "lo",
                     "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                     "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                     "PYTHONUNBUFFERED": "1"})
        cmd = [sys.executable, "-m", module, "--config", config, "--phase", phase, "--out", out]
        if module == "xla_ckpt.demo.worker":
            cmd += ["--device", device]
        cmd += list(args or [])
        for o in overrides:
            cmd += ["--set", o]
        log = open(os.path.join(out, f"log{rank}.txt"), "w")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=wenv, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    sent = False
    hb = Heartbeat(f"phase {name}")
    hb.start(f"{workers} workers")
    try:
        while any(p.poll() is None for p in procs):
            done = _read_int(os.path.join(out, "progress0"))
            hb.beat("rank 0: no update finished yet" if done is None
                    else f"rank 0 at update {done}")
            if time.perf_counter() - t0 > timeout_s:
                raise DemoError(f"{name}: workers still running after {timeout_s:.0f} s",
                                _tails(out, workers))
            if preempt_after_update is not None and not sent:
                if done is not None and done >= preempt_after_update:
                    logger.info("phase %s: rank 0 finished update %d; sending SIGTERM to every "
                                "worker",
                                name, done)
                    for p in procs:
                        if p.poll() is None:
                            p.send_signal(signal.SIGTERM)
                    sent = True
            if crash_when is not None and crashed_after is None and crash_when(done):
                logger.info("phase %s: rank 0 finished update %s; SIGKILL to every worker "
                            "(a crash)", name, done)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                for p in procs:
                    p.wait()
                crashed_after = done if done is not None else 0
                break
            if poll is not None:
                poll(out)
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2.0)  # let the others fail with their own (named) error
                break
            time.sleep(0.05)
    finally:
        for p in procs:  # a failed, timed-out or interrupted phase leaves no worker behind
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]
    if crashed_after is not None:
        hb.done()
        return PhaseResult(name, [], codes, time.perf_counter() - t0, started_unix,
                           crashed_after)
    if any(codes) and _port_taken(out, codes) and _retries < PORT_RETRIES:
        logger.warning("phase %s: rank 0 could not listen on rendezvous port %d (taken by "
                       "another process meanwhile); starting the phase again on another port",
                       name, port)
        hb.done()
        return run_phase(phase, workers=workers, config=config, overrides=overrides, env=env,
                         workdir=workdir, device=device,
                         preempt_after_update=preempt_after_update, timeout_s=timeout_s,
                         module=module, args=args, label=label, hosts=hosts, poll=poll,
                         crash_when=crash_when, _retries=_retries + 1)
    if any(codes):
        bad = next(r for r, c in enumerate(codes) if c)
        raise DemoError(f"{name}: rank {bad} exited with {codes[bad]} ({_last_error(out, bad)}); "
                        f"exit codes {codes}; logs in {out}", _tails(out, workers))
    if crash_when is not None:
        raise DemoError(f"{name}: the job ended before the crash; logs in {out}",
                        _tails(out, workers))
    reports = []
    for rank in range(workers):
        path = os.path.join(out, f"rank{rank}.json")
        if not os.path.exists(path):
            raise DemoError(f"{name}: rank {rank} wrote no report; logs in {out}",
                            _tails(out, workers))
        with open(path) as f:
            reports.append(json.load(f))
    if preempt_after_update is not None and not all(r.get("preempted") for r in reports):
        raise DemoError(f"{name}: the job ended before the preemption at update "
                        f"{preempt_after_update}; lower train.preempt_at_update")
    hb.done()
    return PhaseResult(name, reports, codes, time.perf_counter() - t0, started_unix)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip() or "0")
    except (OSError, ValueError):
        return None


def _last_error(out: str, rank: int) -> str:
    try:
        with open(os.path.join(out, f"log{rank}.txt")) as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return "no log"
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln:
            return ln.split("]: ", 1)[-1][:300]
    return lines[-1][:300] if lines else "empty log"


def _tails(out: str, workers: int, n: int = 1500) -> str:
    parts = []
    for rank in range(workers):
        try:
            with open(os.path.join(out, f"log{rank}.txt")) as f:
                text = f.read()[-n:]
        except OSError:
            text = "(no log)"
        parts.append(f"\n--- rank {rank} log tail ---\n{text}")
    return "".join(parts)

