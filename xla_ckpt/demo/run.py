"""The orchestrator behind ``xla-ckpt demo``: reference run, preempted run, two resumes, verdicts.

1. Start the GCS emulator on 127.0.0.1 (unless ``--uri`` names real storage or a local path).
2. **Reference**: ``--workers`` processes train ``U`` updates without interruption; record the
   global loss of every update and a digest of the final parameters.
3. **Preempted run**: the same job checkpoints every few updates to ``<uri>``; once it passes the
   middle of an epoch the orchestrator sends SIGTERM to every worker (as GKE / a TPU
   maintenance event would).  Every rank saves at the next update boundary and exits 0.
   The workers of this (replicated, DDP-style) leg run as ``train.hosts`` emulated hosts
   (default 2 x 2 workers): rank ``r`` gets ``GROUP_RANK = r * hosts // workers``, its
   ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` and its host's loopback source address
   (``XLA_CKPT_GCS_SOURCE_ADDRESS = 127.0.0.(10+h)``), so each host has its own link.
4. **Resume**, twice from that same checkpoint, through a :class:`FaultProxy` in front of the
   emulator that shapes every host's link (:data:`RESTORE_SHAPING_FIGURES`: 30 ms first byte,
   32 MiB/s per stream, 64 MiB/s per host) and counts the bytes it serves to each host: once
   with every rank reading everything (``all_ranks`` with ``host_shared_memory=false``, the
   old TPU path), once with rank-0-reads-then-broadcasts.  Each resumed run trains to ``U``
   updates.  Before it trains on, the ``all_ranks`` resume restores the same checkpoint
   again with the ``per_host`` and ``striped`` plans and with ``auto``
   (:data:`RESTORE_ONLY`), one after the other (no worker start-up, no training of their own).
5. **Verdict** per strategy: losses of the preempted run up to the checkpoint plus the
   resumed run's losses equal the reference losses bit for bit, and so do the final
   parameters on every worker; every restore's state (digest of every tensor's bytes, the
   rank's own item included) equals the ``all_ranks`` resume's on the same rank.
6. **The sharded leg** (:func:`run_sharded_leg`, workers :mod:`xla_ckpt.demo.fsdp`): the same
   run with FSDP2 -- reference, preempted run (every rank saves only its own shards; DCP saves
   the same state alongside), a restore on the same number of workers that trains on, and a
   restore resharded onto half as many.  Verdict per restore: every restored local shard
   equals its box of the saved global tensors and DCP's restore of the same state; the
   same-size resume also reproduces the FSDP2 reference bit for bit.

Progress goes to this module's logger at INFO (``xla-ckpt demo`` prints it on stderr): a start
and a done line for every leg, worker phase and long step of the orchestrator, and a
``still running, N s`` line every :data:`HEARTBEAT_S` seconds while one runs
(:class:`Heartbeat`); :func:`verdict_line` is the one PASS/FAIL line the CLI ends with.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from xla_ckpt.config import load_config
from xla_ckpt.demo import corpus
from xla_ckpt.errors import XlaCkptError
from xla_ckpt.run.catalog import resolve_latest
from xla_ckpt.storage import open_storage
from xla_ckpt.storage.uri import parse_uri

logger = logging.getLogger(__name__)

STRATEGIES = ("all_ranks", "broadcast")
"""Restores of the replicated leg that train on (resume phases), in order; ``all_ranks`` runs
with ``restore.host_shared_memory=false`` (every rank reads everything)."""
RESTORE_ONLY = ("per_host", "striped", "auto")
"""Restores of the replicated leg without training of their own (done by the ``all_ranks``
resume's workers before they train on), checked against that resume's restored state."""
LEGS = ("ddp", "fsdp")
RESTORE_SHAPING_FIGURES = {"first_byte_latency_s": 0.03, "stream_mib_s": 32.0,
                           "host_mib_s": 64.0}
"""The link every emulated host restores through (``Shaping`` arguments; the demo config's
``restore.cost_model`` carries the same figures, so ``auto`` predicts this emulation)."""
REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"
HEARTBEAT_S = 15.0
"""Seconds between two "still running" lines of a long step (:class:`Heartbeat`)."""


def default_config_path() -> str:
    """``configs/cpu-emulation.yaml`` of the source tree (the demo's default)."""
    return str(REPO_CONFIGS / "cpu-emulation.yaml")


@dataclass
class PhaseResult:
    phase: str
    reports: list[dict]
    exitcodes: list[int]
    seconds: float


class DemoError(XlaCkptError, RuntimeError):
    """A demo phase failed; the message names the phase, the rank and its last error line.

    ``logs`` holds the tail of every rank's log; ``leg`` (``"ddp"``/``"fsdp"``) the leg that
    was running, set by :func:`run_demo` (``""`` before any leg started).
    """

    def __init__(self, message: str, logs: str = "", leg: str = "") -> None:
        super().__init__(message)
        self.logs = logs
        self.leg = leg


class Heartbeat:
    """Progress lines of one long step: ``<step>: started``, ``<step>: still running, N s``
    about every ``every_s`` seconds (:meth:`beat`, called often), ``<step>: done in N s``.

    ``clock``: seconds, monotonic (tests pass their own).  Lines go to this module's logger
    at INFO, which ``xla-ckpt demo`` prints on stderr.
    """

    def __init__(self, step: str, *, every_s: float = HEARTBEAT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.step = step
        self.every_s = every_s
        self.clock = clock
        self.t0 = clock()
        self.last = self.t0

    def start(self, detail: str = "") -> None:
        logger.info("%s: started%s", self.step, f" ({detail})" if detail else "")

    def beat(self, detail: str = "") -> bool:
        """Log ``still running`` when ``every_s`` passed since the last line; True if it did."""
        now = self.clock()
        if now - self.last < self.every_s:
            return False
        self.last = now
        logger.info("%s: still running, %.0f s%s", self.step, now - self.t0,
                    f" ({detail})" if detail else "")
        return True

    def done(self, detail: str = "") -> float:
        """Log ``done in N s``; returns N."""
        seconds = self.clock() - self.t0
        logger.info("%s: done in %.1f s%s", self.step, seconds, f" ({detail})" if detail else "")
        return seconds


@contextlib.contextmanager
def step(name: str, *, every_s: float = HEARTBEAT_S) -> Iterator[Heartbeat]:
    """A step of the orchestrator itself (no workers): start and done lines, and a
    ``still running`` line every ``every_s`` seconds from a helper thread while the step
    blocks."""
    hb = Heartbeat(name, every_s=every_s)
    hb.start()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(min(1.0, every_s)):
            hb.beat()

    thread = threading.Thread(target=beat, name=f"heartbeat {name}", daemon=True)
    thread.start()
    try:
        yield hb
    finally:
        stop.set()
        thread.join(timeout=5.0)
    hb.done()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
              poll: Callable[[str], None] | None = None) -> PhaseResult:
    """Launch ``workers`` worker processes (torchrun-style env) and collect their reports.

    ``module`` is the worker program (:mod:`xla_ckpt.demo.worker`, or :mod:`xla_ckpt.demo.fsdp`
    for the sharded leg, which takes no ``--device``), ``args`` extra arguments for it, ``label``
    the folder name of the phase's logs and reports (default ``phase``).  ``hosts``: emulated
    hosts the workers are spread over (:func:`host_env`).  ``poll(out)`` is called about every
    50 ms while the workers run (``out``: the phase's folder).  With
    ``preempt_after_update``, SIGTERM goes to every worker once rank 0 has finished that
    update.  Raises :class:`DemoError` if a worker fails or the phase outlives ``timeout_s``.
    """
    name = label or phase
    out = os.path.join(workdir, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    port = _free_port()
    procs = []
    logs = []
    t0 = time.perf_counter()
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
    if any(codes):
        bad = next(r for r, c in enumerate(codes) if c)
        raise DemoError(f"{name}: rank {bad} exited with {codes[bad]} ({_last_error(out, bad)}); "
                        f"exit codes {codes}; logs in {out}", _tails(out, workers))
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
    return PhaseResult(name, reports, codes, time.perf_counter() - t0)


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


def _losses(reports: list[dict]) -> dict[int, str]:
    """Per-update global losses; every rank must report the same value."""
    merged: dict[int, str] = {}
    for r in reports:
        for u, v in r["losses"].items():
            u = int(u)
            if merged.setdefault(u, v) != v:
                raise DemoError(f"ranks disagree on the loss of update {u}")
    return merged


def _plan(config: str, overrides: list[str]) -> tuple[Any, int, int, int]:
    """(config, total updates, update after which to preempt, emulated hosts ``train.hosts``;
    the config refuses ``train.workers`` that is not a multiple of it)."""

    cfg = load_config(config, overrides)
    tc = cfg.train
    hosts = tc.hosts
    per_epoch = len(corpus.pairs()) // (tc.batch_size * tc.workers)
    if per_epoch < 2:
        raise DemoError(f"train.batch_size={tc.batch_size} x train.workers={tc.workers} leaves "
                        f"{per_epoch} update(s) per epoch; use smaller batches or fewer workers")
    total = tc.max_updates or tc.max_epoch * per_epoch
    preempt = tc.preempt_at_update or (total - per_epoch // 2 if total > per_epoch else total // 2)
    preempt = max(1, min(preempt, total - 2))
    return cfg, total, preempt, hosts


class ServedCounter:
    """Bytes a :class:`~xla_ckpt.testing.fault_proxy.FaultProxy` served to each emulated host,
    per restore of a phase whose workers run with ``--sync-restores``.

    :meth:`poll` (run_phase's ``poll``) sees ``<out>/restored<k>`` (every rank finished
    restore ``k``), records :meth:`FaultProxy.bytes_served_by_address`, zeroes the proxy's
    counters and writes ``<out>/counted<k>`` (the workers go on).  :meth:`reset` before the
    phase starts.
    """

    def __init__(self, proxy: Any, hosts: int) -> None:
        self.proxy = proxy
        self.hosts = hosts
        self.counts: list[dict[str, int]] = []

    def reset(self) -> None:
        self.proxy.reset_log()
        self.counts = []

    def poll(self, out: str) -> None:
        k = len(self.counts)
        if os.path.exists(os.path.join(out, f"restored{k}")):
            self.counts.append(self.proxy.bytes_served_by_address())
            self.proxy.reset_log()
            with open(os.path.join(out, f"counted{k}"), "w") as f:
                f.write(str(k))

    def served(self, k: int) -> dict[str, Any]:
        """Restore ``k``: ``served_bytes_per_host`` (host ``h``: bytes sent to its address
        ``127.0.0.(10+h)``; one host: every byte) and ``served_bytes_other`` (to any other
        address: a client that did not bind its host's address)."""
        if k >= len(self.counts):
            raise DemoError(f"restore {k} was not counted (the workers did not sync)")
        by = self.counts[k]
        total = sum(by.values())
        if self.hosts == 1:
            return {"served_bytes_per_host": [total], "served_bytes_other": 0}
        from xla_ckpt.testing.fault_proxy import host_address  # noqa: PLC0415 - light

        per = [by.get(host_address(h), 0) for h in range(self.hosts)]
        return {"served_bytes_per_host": per, "served_bytes_other": total - sum(per)}


def run_demo(*, config: str | None = None, overrides: list[str] | None = None,
             uri: str | None = None, workers: int | None = None, model: str | None = None,
             device: str = "cpu", keep: bool = False, legs: Sequence[str] = LEGS,
             hosts: int | None = None) -> dict:
    """Run the whole demo and return the report (what ``--json`` prints).

    ``legs``: ``"ddp"`` (the replicated run: every worker holds the whole model; resumed with
    ``all_ranks`` and ``broadcast``, then restored with ``per_host``, ``striped`` and
    ``auto``) and/or ``"fsdp"`` (the same run sharded with FSDP2; restored on the same
    number of workers and resharded onto half as many, checked against DCP).  ``hosts``:
    emulated hosts of the ddp leg (``train.hosts``; the demo config says 2); the fsdp leg
    runs on one host.  ``report["bitwise_identical"]`` has one entry per restore;
    the CLI exits 0 only when all are true.

    Raises:
        DemoError: a phase failed (names the phase and the ranks' log tails).
        ConfigError: a bad config value, e.g. ``train.workers`` not a multiple of
            ``train.hosts``.
        ValueError: an unknown leg.
    """
    bad = sorted(set(legs) - set(LEGS))
    if bad or not legs:
        raise ValueError(f"legs must be a non-empty subset of {LEGS}, got {list(legs)}")
    config = config or default_config_path()
    overrides = list(overrides or [])
    if workers:
        overrides.append(f"train.workers={workers}")
    if model:
        overrides.append(f"train.model={model}")
    if hosts:
        overrides.append(f"train.hosts={hosts}")
    cfg, total, preempt, hosts = _plan(config, overrides)
    n = cfg.train.workers
    report: dict[str, Any] = {"workers": n, "hosts": hosts, "model": cfg.train.model,
                              "updates": total, "legs": list(legs), "restores": [],
                              "bitwise_identical": {}}
    with contextlib.ExitStack() as stack:
        env: dict[str, str] = {}
        restore_env: dict[str, str] = {}
        counter: ServedCounter | None = None
        if uri is None:
            from xla_ckpt.testing.fault_proxy import (  # noqa: PLC0415 - only with the emulator
                FaultProxy,
                Shaping,
            )
            from xla_ckpt.testing.gcs_emulator import GCSEmulator  # noqa: PLC0415 - only the gs:// default starts it

            with step("starting the GCS emulator and the shaped proxy"):
                emu = stack.enter_context(GCSEmulator(bucket="xla-ckpt-demo"))
                env.update(emu.env())
                link = RESTORE_SHAPING_FIGURES
                proxy = stack.enter_context(FaultProxy(emu.host, shaping=Shaping(
                    first_byte_latency_s=link["first_byte_latency_s"],
                    stream_mib_s=link["stream_mib_s"], host_mib_s=link["host_mib_s"])))
            restore_env = dict(env, **proxy.env())
            counter = ServedCounter(proxy, hosts)
            uri = emu.uri(f"demo-{uuid.uuid4().hex[:8]}/run")
            storage_kind = "GCS emulator on " + emu.host
            report["restore_link"] = {
                "proxy": proxy.url, **RESTORE_SHAPING_FIGURES,
                "note": "every emulated host restores through its own shaped link"}
        else:
            storage_kind = "gs://" if parse_uri(uri).is_gcs else "local path"
        report.update(uri=uri, storage=storage_kind)
        workdir = tempfile.mkdtemp(prefix="xla-ckpt-demo-")
        if not keep:  # a failed demo keeps the worker logs its error points to
            stack.push(lambda exc_type, *_: None if exc_type is not None
                       else shutil.rmtree(workdir, True))
        base = overrides + [f"checkpoint.save_dir={uri}", f"train.max_updates={total}"]
        logger.info("%d workers (%d emulated host(s)), model %s, %d updates, checkpoints "
                    "to %s (%s)", n, hosts, cfg.train.model, total, uri, storage_kind)
        if "ddp" in legs:
            with _leg("ddp"):
                report.update(_replicated_leg(n, config, base, env, workdir, device, preempt,
                                              uri, hosts=hosts, restore_env=restore_env or env,
                                              counter=counter))
            report["bitwise_identical"].update(
                {r["strategy"]: r["bitwise_identical"] for r in report["restores"]})
        if "fsdp" in legs:
            with _leg("fsdp"):
                sharded = run_sharded_leg(n, config=config, overrides=base, env=env,
                                          workdir=workdir, preempt=preempt,
                                          save_dir=f"{uri.rstrip('/')}-fsdp")
            report["sharded"] = sharded
            report["bitwise_identical"].update(
                {f"fsdp_{r['restore']}": r["bitwise_identical"] for r in sharded["restores"]})
    return report


@contextlib.contextmanager
def _leg(leg: str) -> Iterator[None]:
    """Start and done lines of one leg; a :class:`DemoError` raised in it names the leg."""
    hb = Heartbeat(f"leg {leg}")
    hb.start()
    try:
        yield
    except DemoError as e:
        e.leg = e.leg or leg
        raise
    hb.done()


def restore_leg(key: str) -> tuple[str, str]:
    """``(leg, restore)`` of a ``report["bitwise_identical"]`` key: ``"fsdp_resharded"`` ->
    ``("fsdp", "resharded")``, ``"striped"`` -> ``("ddp", "striped")``."""
    if key.startswith("fsdp_"):
        return "fsdp", key.removeprefix("fsdp_")
    return "ddp", key


def verdict_line(report: dict, seconds: float) -> str:
    """The demo's last line: ``PASS: ...`` when every restore is bitwise identical, else
    ``FAIL: ...`` naming each failing restore by leg (``ddp (striped)``); ``seconds``: the
    whole demo's wall time."""
    results = report.get("bitwise_identical", {})
    by_leg: dict[str, list[str]] = {}
    failed: dict[str, list[str]] = {}
    for key, ok in results.items():
        leg, name = restore_leg(key)
        by_leg.setdefault(leg, []).append(name)
        if not ok:
            failed.setdefault(leg, []).append(name)
    if not results:
        legs = ", ".join(report.get("legs", []))
        return f"FAIL: no restore was checked (legs {legs}) in {seconds:.0f} s"
    if failed:
        bad = ", ".join(f"{leg} ({', '.join(names)})" for leg, names in failed.items())
        n_bad = sum(len(v) for v in failed.values())
        return (f"FAIL: not bitwise identical: {bad}; {len(results) - n_bad} of "
                f"{len(results)} restores passed in {seconds:.0f} s")
    good = ", ".join(f"{leg} ({', '.join(names)})" for leg, names in by_leg.items())
    return (f"PASS: every restore bitwise identical: {good}; {len(results)} restores in "
            f"{seconds:.0f} s")


def failure_line(error: BaseException, seconds: float) -> str:
    """The demo's last line when it could not finish: ``FAIL: leg <leg> did not finish:
    <the error's first line>``."""
    leg = getattr(error, "leg", "")
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    where = f"leg {leg} did not finish" if leg else "the demo did not finish"
    return f"FAIL: {where}: {text} (after {seconds:.0f} s)"


def _replicated_leg(n: int, config: str, base: list[str], env: dict, workdir: str,
                    device: str, preempt: int, uri: str, *, hosts: int = 1,
                    restore_env: dict | None = None,
                    counter: ServedCounter | None = None) -> dict:
    """Reference, preempted run, the two resumes and the restore-only plans of the replicated
    (DDP-style) model, on ``hosts`` emulated hosts.

    Saves go to storage through ``env``, restores through ``restore_env`` (the shaped proxy,
    whose bytes per host ``counter`` counts; None: not counted).
    """
    renv = restore_env if restore_env is not None else env
    sync = ["--sync-restores"] if counter is not None else []
    ref = run_phase("reference", workers=n, config=config, overrides=base, env=env,
                    workdir=workdir, device=device, hosts=hosts)
    ref_losses = _losses(ref.reports)
    ref_digest = {r["digest"] for r in ref.reports}
    pre = run_phase("train", workers=n, config=config, overrides=base, env=env,
                    workdir=workdir, device=device, preempt_after_update=preempt, hosts=hosts)
    pre_losses = _losses(pre.reports)

    with _env(env), open_storage(uri) as run_storage:
        checkpoint = resolve_latest(run_storage)
    if checkpoint is None:
        raise DemoError("the preempted run left no committed checkpoint")
    logger.info("preempted after update %d; latest committed checkpoint %s",
                pre.reports[0]["num_updates"], checkpoint)
    restore_file = f"checkpoint.restore_file={uri.rstrip('/')}/{checkpoint}"
    results = []
    phase_seconds: dict[str, float] = {"reference": round(ref.seconds, 2),
                                       "train": round(pre.seconds, 2)}
    extra: list[dict] = []
    for strategy in STRATEGIES:
        ov = base + [f"restore.strategy={strategy}", restore_file,
                     f"checkpoint.save_dir={uri.rstrip('/')}-resumed-{strategy}"]
        args = list(sync)
        if strategy == "all_ranks":
            # Its own restore: every rank reads everything (the old TPU path).  The other
            # plans restore the same checkpoint in these workers before they train on (no
            # start-up or training of their own), with the config as it is (host shared
            # memory on); each must give every rank this state.
            args += ["--resume-set", "restore.host_shared_memory=false",
                     "--also-restore", ",".join(RESTORE_ONLY)]
        if counter is not None:
            counter.reset()
        res = run_phase("resume", workers=n, config=config, overrides=ov, env=renv,
                        workdir=workdir, device=device, hosts=hosts, args=args,
                        label=f"resume-{strategy}",
                        poll=counter.poll if counter is not None else None)
        phase_seconds[f"resume-{strategy}"] = round(res.seconds, 2)
        served = counter.served(0) if counter is not None else {}
        results.append(_verdict(strategy, res, pre_losses, ref_losses, ref_digest, served))
        if strategy == "all_ranks":
            for k, plan in enumerate(RESTORE_ONLY):
                served = counter.served(k + 1) if counter is not None else {}
                extra.append(_restore_verdict(
                    plan, [r["restores"][k] for r in res.reports], served))
    results += extra
    _check_states(results)
    return {"preempted_at_update": pre.reports[0]["num_updates"], "checkpoint": checkpoint,
            "reference_seconds": round(ref.seconds, 2), "phase_seconds": phase_seconds,
            "restores": results}


# ---- the sharded leg (FSDP2) ---------------------------------------------------------------
def run_sharded_leg(n: int, *, config: str, overrides: list[str], env: dict, workdir: str,
                    preempt: int, save_dir: str) -> dict:
    """The FSDP2 leg (:mod:`xla_ckpt.demo.fsdp`): reference, preempted run, two restores.

    1. ``n`` workers train the sharded model without checkpoints (the reference);
    2. ``n`` workers train it with the manager's save schedule into ``save_dir``; SIGTERM after
       update ``preempt``; every rank saves its own shards (and DCP saves the same state into
       the work folder) and exits 0;
    3. restore the latest committed checkpoint on ``n`` workers and train on (``same_size``),
       and on ``max(1, n // 2)`` workers (``resharded``; per-rank items dropped), each also
       restored by DCP into a second model.

    Verdicts (:func:`sharded_verdict`) check every restored local shard against the saved
    global tensors (read back whole by :func:`xla_ckpt.load`, itself checked against the
    shards every rank saved) and against DCP's restore of the same state; the same-size resume
    must also reproduce the reference's losses and final shards bit for bit.
    """
    module = "xla_ckpt.demo.fsdp"
    dcp_dir = os.path.join(workdir, "fsdp-dcp")
    base = overrides + [f"checkpoint.save_dir={save_dir}"]
    ref = run_phase("reference", workers=n, config=config, overrides=base, env=env,
                    workdir=workdir, module=module, label="fsdp-reference")
    pre = run_phase("train", workers=n, config=config, overrides=base, env=env,
                    workdir=workdir, module=module, label="fsdp-train",
                    preempt_after_update=preempt, args=["--dcp-dir", dcp_dir])
    with _env(env), open_storage(save_dir) as run_storage:
        name = resolve_latest(run_storage)
    if name is None:
        raise DemoError("the preempted FSDP2 run left no committed checkpoint")
    checkpoint = f"{save_dir.rstrip('/')}/{name}"
    logger.info("FSDP2 run preempted after update %d; restoring %s",
                pre.reports[0]["num_updates"], checkpoint)
    with step("fsdp: reading the saved global tensors"):
        global_tensors = _saved_global_tensors(checkpoint, env)
    saved_bad = _shards_match(global_tensors, [r["saved"]["shards"] for r in pre.reports])
    restores = []
    for kind, workers in (("same_size", n), ("resharded", max(1, n // 2))):
        ov = base + [f"checkpoint.restore_file={checkpoint}",
                     f"checkpoint.save_dir={save_dir.rstrip('/')}-resumed-{kind}"]
        if kind == "resharded":
            ov.append("restore.rank_state_on_resize=drop")
        res = run_phase("resume" if kind == "same_size" else "reshard", workers=workers,
                        config=config, overrides=ov, env=env, workdir=workdir, module=module,
                        label=f"fsdp-{kind}", args=["--dcp-dir", dcp_dir])
        restores.append(sharded_verdict(kind, res.reports, global_tensors, saved_bad,
                                        ref=ref.reports if kind == "same_size" else None,
                                        pre=pre.reports))
    return {"workers": n, "checkpoint": checkpoint, "checkpoint_name": name,
            "preempted_at_update": pre.reports[0]["num_updates"],
            "reference_seconds": round(ref.seconds, 2), "saved_shards_match": saved_bad == [],
            "restores": restores}


def _saved_global_tensors(checkpoint: str, env: dict) -> dict[str, Any]:
    """The checkpoint's model and optimizer tensors as whole CPU tensors (``xla_ckpt.load``
    assembles them from their chunks), flattened DCP-style (``model.<fqn>``,
    ``optim.state.<fqn>.exp_avg``, ...)."""
    import torch  # noqa: PLC0415 - the orchestrator needs torch only here
    from torch.distributed.checkpoint._nested_dict import (  # noqa: PLC0415 - DCP helper
        flatten_state_dict,
    )

    import xla_ckpt  # noqa: PLC0415 - the top-level API, loaded once here

    with _env(env):
        tree = xla_ckpt.load(checkpoint)
    flat, _ = flatten_state_dict({"model": tree["model"], "optim": tree["optim"]})
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def _shards_match(global_tensors: dict[str, Any], tables: list[dict]) -> list[str]:
    """``"rank r: key"`` for every local shard (of :func:`xla_ckpt.demo.fsdp.shard_table`)
    whose crc32c differs from its box of the global tensor (or whose key is missing)."""
    from xla_ckpt.format.crc import crc32c  # noqa: PLC0415 - light
    from xla_ckpt.testing.asserts import tensor_bits  # noqa: PLC0415 - light

    bad = []
    for rank, table in enumerate(tables):
        for key, e in table.items():
            full = global_tensors.get(key)
            if full is None:
                bad.append(f"rank {rank}: {key} (not in the checkpoint)")
                continue
            box = full[tuple(slice(o, o + s) for o, s in
                             zip(e["offsets"], e["sizes"], strict=True))]
            crc = crc32c(tensor_bits(box.contiguous())) if box.numel() else 0
            if list(box.shape) != e["sizes"] or crc != e["crc32c"]:
                bad.append(f"rank {rank}: {key}")
    return bad


def sharded_verdict(kind: str, reports: list[dict], global_tensors: dict[str, Any],
                    saved_bad: list[str], *, ref: list[dict] | None, pre: list[dict]) -> dict:
    """One restore of the sharded leg, judged.

    ``shards_equal_saved``: every rank's restored local shards equal their boxes of the saved
    global tensors (and those equal the shards every rank saved: ``saved_bad`` is empty);
    ``shards_equal_dcp``: the same boxes and bytes as DCP's restore of the same state; for
    ``same_size`` (``ref`` given) also ``losses_identical`` (the preempted run's losses up to
    the checkpoint plus the resumed run's equal the reference's) and ``shards_identical`` (each
    rank's final local shards equal the reference rank's).
    """
    restores = [r["restore"] for r in reports]
    mismatched = _shards_match(global_tensors, [r["shards"] for r in restores]) + saved_bad
    dcp_equal = all(r.get("dcp_shards") == r["shards"] for r in restores)
    out: dict[str, Any] = {
        "restore": kind, "workers": len(reports),
        "saved_workers": restores[0]["saved_world_size"], "strategy": restores[0]["strategy"],
        "resumed_at_update": restores[0]["num_updates"],
        "bytes_read_per_rank": [r["bytes_read"] for r in restores],
        "shard_bytes_per_rank": [r["shard_bytes"] for r in restores],
        "seconds": round(max(r["seconds"] for r in restores), 3),
        "rank_state_kept": all(r["rank_state_kept"] for r in restores),
        "shards_equal_saved": not mismatched, "mismatched_shards": mismatched[:10],
        "shards_equal_dcp": dcp_equal,
    }
    ok = not mismatched and dcp_equal
    if ref is not None:
        start = out["resumed_at_update"]
        combined = {u: v for u, v in _losses(pre).items() if u <= start}
        combined.update(_losses(reports))
        out["losses_identical"] = combined == _losses(ref)
        out["shards_identical"] = [r["digest"] for r in reports] == [r["digest"] for r in ref]
        ok = ok and out["losses_identical"] and out["shards_identical"]
    out["bitwise_identical"] = ok
    out["verdict"] = "bitwise identical" if ok else "MISMATCH"
    return out


@contextlib.contextmanager
def _env(env: dict) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _restore_figures(strategy: str, restores: list[dict], served: dict) -> dict:
    """The figures of one restore (``restores``: every rank's, in rank order) for the table."""
    seconds = max(r["seconds"] for r in restores)
    read = [r["bytes_read"] for r in restores]
    received = [r["bytes_received"] for r in restores]
    mapped = [r.get("bytes_mapped", 0) for r in restores]
    moved = max(a + b + c for a, b, c in zip(read, received, mapped, strict=True))
    return {
        "strategy": strategy, "plan": restores[0].get("plan") or restores[0]["strategy"],
        "reason": restores[0]["reason"],
        "checkpoint": restores[0]["checkpoint"], "resumed_at_update": restores[0]["num_updates"],
        "bytes_read_per_rank": read, "bytes_received_per_rank": received,
        "bytes_mapped_per_rank": mapped, "data_path": restores[0].get("data_path", ""),
        "host_shared_memory": restores[0].get("host_shared_memory", True),
        "served_bytes_per_host": served.get("served_bytes_per_host"),
        "served_bytes_other": served.get("served_bytes_other"),
        "seconds": round(seconds, 3), "mib_per_s": round(moved / max(seconds, 1e-9) / 2**20, 1),
        "restore_seconds": round(max(r.get("restore_seconds", r["seconds"]) for r in restores),
                                 3),
        "predicted_s": round(float(restores[0].get("predicted_s", 0.0)), 3),
        "predictions": restores[0].get("predictions", {}),
        "state_devices": restores[0]["state_devices"],
        "state_digests": [r.get("state_digest", "") for r in restores],
    }


def _verdict(strategy: str, res: PhaseResult, pre_losses: dict, ref_losses: dict,
             ref_digest: set, served: dict | None = None) -> dict:
    """A resume that trained on: its losses and final parameters against the reference's
    (``state_identical``, against the ``all_ranks`` resume, comes from :func:`_check_states`)."""
    restores = [r["restore"] for r in res.reports]
    start = restores[0]["num_updates"]
    resumed = _losses(res.reports)
    combined = {u: v for u, v in pre_losses.items() if u <= start}
    combined.update(resumed)
    digests = {r["digest"] for r in res.reports}
    losses_ok = combined == ref_losses
    params_ok = len(digests) == 1 and digests == ref_digest
    out = _restore_figures(strategy, restores, served or {})
    out.update(kind="resume", losses_identical=losses_ok, params_identical=params_ok,
               bitwise_identical=losses_ok and params_ok,
               verdict="bitwise identical" if losses_ok and params_ok else "MISMATCH")
    return out


def _restore_verdict(strategy: str, restores: list[dict], served: dict | None = None) -> dict:
    """A restore-only plan: judged by :func:`_check_states` (its state against the
    ``all_ranks`` resume's on every rank)."""
    out = _restore_figures(strategy, restores, served or {})
    out.update(kind="restore", bitwise_identical=False, verdict="MISMATCH")
    return out


def _check_states(rows: list[dict]) -> None:
    """Every row's restored state must equal the ``all_ranks`` row's on every rank (the
    :func:`~xla_ckpt.demo.worker.state_digest` of the state and the rank's own item): sets
    ``state_identical`` on each row and folds it into ``bitwise_identical`` / ``verdict``;
    a restore-only row also needs the ``all_ranks`` resume itself to be bitwise identical.
    """
    ref = next((r for r in rows if r["strategy"] == "all_ranks"), None)
    ref_states = ref["state_digests"] if ref is not None else None
    ref_ok = ref is not None and ref["bitwise_identical"]
    for r in rows:
        same = (ref_states is not None and all(ref_states)
                and r["state_digests"] == ref_states)
        r["state_identical"] = same
        ok = same and (r["bitwise_identical"] if r["kind"] == "resume" else ref_ok)
        r["bitwise_identical"] = ok
        r["verdict"] = "bitwise identical" if ok else "MISMATCH"


def _grid(cols: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))
    sep = "  ".join("-" * w for w in widths)
    body = "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True))
                     for row in rows)
    return line + "\n" + sep + "\n" + body


def _mib(values: Sequence[int]) -> str:
    return "/".join(f"{b / 2**20:.0f}" for b in values)


def format_table(report: dict) -> str:
    """The human-readable tables ``xla-ckpt demo`` prints (one per leg that ran)."""
    hosts = report.get("hosts", 1)
    out = (f"xla_ckpt demo: {report['workers']} workers, model {report['model']}, "
           f"{report['updates']} updates, storage {report['storage']}\n")
    if report.get("restores"):
        link = report.get("restore_link")
        where = ""
        if link:
            where = (f" through a link per host ({link['first_byte_latency_s'] * 1000:.0f} ms "
                     f"first byte, {link['stream_mib_s']:.0f} MiB/s per stream, "
                     f"{link['host_mib_s']:.0f} MiB/s per host)")
        out += (f"{hosts} emulated host(s) x {report['workers'] // max(hosts, 1)} workers; "
                f"preempted (SIGTERM) after update {report['preempted_at_update']}; "
                f"restoring {report['checkpoint']}{where}\n")
        cols: tuple[str, ...] = (
            "strategy", "plan", "MiB read/rank", "MiB recv/rank", "MiB mapped/rank",
            "MiB served/host", "predicted s", "seconds", "on device", "checked", "verdict")
        rows: list[tuple[str, ...]] = []
        for r in report["restores"]:
            served = r.get("served_bytes_per_host")
            strategy = r["strategy"]
            if strategy == "all_ranks" and r.get("host_shared_memory") is False:
                strategy += "*"
            rows.append((strategy, r.get("plan") or r["strategy"],
                         _mib(r["bytes_read_per_rank"]), _mib(r["bytes_received_per_rank"]),
                         _mib(r.get("bytes_mapped_per_rank",
                                    [0] * len(r["bytes_read_per_rank"]))),
                         _mib(served) if served is not None else "-",
                         f"{r['predicted_s']:.2f}" if r.get("predicted_s") else "-",
                         f"{r.get('restore_seconds', r['seconds']):.2f}",
                         ",".join(r["state_devices"]),
                         "resume" if r.get("kind", "resume") == "resume" else "state",
                         r["verdict"]))
        out += _grid(cols, rows)
        if any(r["strategy"] == "all_ranks" and r.get("host_shared_memory") is False
               for r in report["restores"]):
            out += "\n* restore.host_shared_memory=false: every rank reads everything"
    sh = report.get("sharded")
    if sh:
        if report.get("restores"):
            out += "\n\n"
        out += (f"FSDP2 (fully_shard per layer, {sh['workers']} workers): preempted (SIGTERM) "
                f"after update {sh['preempted_at_update']}; restoring {sh['checkpoint_name']}\n")
        cols = ("restore", "workers", "MiB read/rank", "MiB shards/rank", "seconds",
                "= saved", "= DCP", "resume", "verdict")
        rows = []
        for r in sh["restores"]:
            resume = "-"
            if "losses_identical" in r:
                resume = ("bitwise" if r["losses_identical"] and r["shards_identical"]
                          else "DIFFERS")
            rows.append((r["restore"].replace("_", " "),
                         f"{r['saved_workers']}->{r['workers']}",
                         _mib(r["bytes_read_per_rank"]), _mib(r["shard_bytes_per_rank"]),
                         f"{r['seconds']:.2f}", "yes" if r["shards_equal_saved"] else "NO",
                         "yes" if r["shards_equal_dcp"] else "NO", resume, r["verdict"]))
        out += _grid(cols, rows)
    return out
