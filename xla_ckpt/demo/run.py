"""The orchestrator behind ``xla-ckpt demo``: reference run, preempted run, two resumes, verdicts.

1. Start the GCS emulator on 127.0.0.1 (unless ``--uri`` names real storage or a local path).
2. **Reference**: ``--workers`` processes train ``U`` updates without interruption; record the
   global loss of every update and a digest of the final parameters.
3. **Preempted run**: the same job checkpoints every few updates to ``<uri>``; once it passes the
   middle of an epoch the orchestrator sends SIGTERM to every worker (as GKE / a TPU
   maintenance event would).  Every rank saves at the next update boundary and exits 0.
4. **Resume**, twice from that same checkpoint: once with the every-rank strategy (the TPU
   default, each worker reads the checkpoint itself in parallel), once with rank-0-reads-
   then-broadcasts (the CUDA/gloo default).  Each resumed run trains to ``U`` updates.
5. **Verdict** per strategy: losses of the preempted run up to the checkpoint plus the
   resumed run's losses equal the reference losses bit for bit, and so do the final
   parameters on every worker.
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
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from xla_ckpt.config import load_config
from xla_ckpt.demo import corpus
from xla_ckpt.errors import XlaCkptError
from xla_ckpt.io.catalog import resolve_latest
from xla_ckpt.storage import open_storage
from xla_ckpt.storage.uri import parse_uri

logger = logging.getLogger(__name__)

STRATEGIES = ("all_ranks", "broadcast")
REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


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

    ``logs`` holds the tail of every rank's log.
    """

    def __init__(self, message: str, logs: str = "") -> None:
        super().__init__(message)
        self.logs = logs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_phase(phase: str, *, workers: int, config: str, overrides: list[str], env: dict,
              workdir: str, device: str = "cpu", preempt_after_update: int | None = None,
              timeout_s: float = 1200.0) -> PhaseResult:
    """Launch ``workers`` worker processes (torchrun-style env) and collect their reports.

    With ``preempt_after_update``, SIGTERM goes to every worker once rank 0 has finished that
    update.  Raises :class:`DemoError` if a worker fails or the phase outlives ``timeout_s``.
    """
    out = os.path.join(workdir, phase)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    port = _free_port()
    procs = []
    logs = []
    t0 = time.perf_counter()
    for rank in range(workers):
        wenv = dict(os.environ)
        wenv.update(env)
        wenv.update({"RANK": str(rank), "WORLD_SIZE": str(workers), "LOCAL_RANK": str(rank),
                     "LOCAL_WORLD_SIZE": str(workers), "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port), "PJRT_DEVICE": "CPU", "GLOO_SOCKET_IFNAME": "lo",
                     "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                     "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                     "PYTHONUNBUFFERED": "1"})
        cmd = [sys.executable, "-m", "xla_ckpt.demo.worker", "--config", config, "--phase", phase,
               "--out", out, "--device", device]
        for o in overrides:
            cmd += ["--set", o]
        log = open(os.path.join(out, f"log{rank}.txt"), "w")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=wenv, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    sent = False
    try:
        while any(p.poll() is None for p in procs):
            if time.perf_counter() - t0 > timeout_s:
                raise DemoError(f"{phase}: workers still running after {timeout_s:.0f} s",
                                _tails(out, workers))
            if preempt_after_update is not None and not sent:
                done = _read_int(os.path.join(out, "progress0"))
                if done is not None and done >= preempt_after_update:
                    logger.info("%s: rank 0 finished update %d; sending SIGTERM to every worker",
                                phase, done)
                    for p in procs:
                        if p.poll() is None:
                            p.send_signal(signal.SIGTERM)
                    sent = True
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
        raise DemoError(f"{phase}: rank {bad} exited with {codes[bad]} ({_last_error(out, bad)}); "
                        f"exit codes {codes}; logs in {out}", _tails(out, workers))
    reports = []
    for rank in range(workers):
        path = os.path.join(out, f"rank{rank}.json")
        if not os.path.exists(path):
            raise DemoError(f"{phase}: rank {rank} wrote no report; logs in {out}",
                            _tails(out, workers))
        with open(path) as f:
            reports.append(json.load(f))
    if preempt_after_update is not None and not all(r.get("preempted") for r in reports):
        raise DemoError(f"{phase}: the job ended before the preemption at update "
                        f"{preempt_after_update}; lower train.preempt_at_update")
    return PhaseResult(phase, reports, codes, time.perf_counter() - t0)


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


def _plan(config: str, overrides: list[str]) -> tuple[Any, int, int]:
    """(config, total updates, update after which to preempt)."""

    cfg = load_config(config, overrides)
    tc = cfg.train
    per_epoch = len(corpus.pairs()) // (tc.batch_size * tc.workers)
    if per_epoch < 2:
        raise DemoError(f"train.batch_size={tc.batch_size} x train.workers={tc.workers} leaves "
                        f"{per_epoch} update(s) per epoch; use smaller batches or fewer workers")
    total = tc.max_updates or tc.max_epoch * per_epoch
    preempt = tc.preempt_at_update or (total - per_epoch // 2 if total > per_epoch else total // 2)
    preempt = max(1, min(preempt, total - 2))
    return cfg, total, preempt


def run_demo(*, config: str | None = None, overrides: list[str] | None = None,
             uri: str | None = None, workers: int | None = None, model: str | None = None,
             device: str = "cpu", keep: bool = False) -> dict:
    """Run the whole demo and return the report (what ``--json`` prints).

    Raises:
        DemoError: a phase failed (names the phase and the ranks' log tails).
    """
    config = config or default_config_path()
    overrides = list(overrides or [])
    if workers:
        overrides.append(f"train.workers={workers}")
    if model:
        overrides.append(f"train.model={model}")
    cfg, total, preempt = _plan(config, overrides)
    n = cfg.train.workers
    with contextlib.ExitStack() as stack:
        env: dict[str, str] = {}
        if uri is None:
            from xla_ckpt.testing.gcs_emulator import GCSEmulator  # noqa: PLC0415 - only the gs:// default starts it

            emu = stack.enter_context(GCSEmulator(bucket="xla-ckpt-demo"))
            env.update(emu.env())
            uri = emu.uri(f"demo-{uuid.uuid4().hex[:8]}/run")
            storage_kind = "GCS emulator on " + emu.host
        else:
            storage_kind = "gs://" if parse_uri(uri).is_gcs else "local path"
        workdir = tempfile.mkdtemp(prefix="xla-ckpt-demo-")
        if not keep:  # a failed demo keeps the worker logs its error points to
            stack.push(lambda exc_type, *_: None if exc_type is not None
                       else shutil.rmtree(workdir, True))
        base = overrides + [f"checkpoint.save_dir={uri}", f"train.max_updates={total}"]
        logger.info("demo: %d workers, model %s, %d updates, checkpoints to %s (%s)", n,
                    cfg.train.model, total, uri, storage_kind)
        ref = run_phase("reference", workers=n, config=config, overrides=base, env=env,
                        workdir=workdir, device=device)
        ref_losses = _losses(ref.reports)
        ref_digest = {r["digest"] for r in ref.reports}
        logger.info("demo: reference run done in %.1f s", ref.seconds)
        pre = run_phase("train", workers=n, config=config, overrides=base, env=env,
                        workdir=workdir, device=device, preempt_after_update=preempt)
        pre_losses = _losses(pre.reports)

        with _env(env), open_storage(uri) as run_storage:
            checkpoint = resolve_latest(run_storage)
        if checkpoint is None:
            raise DemoError("the preempted run left no committed checkpoint")
        logger.info("demo: preempted after update %d; latest committed checkpoint %s",
                    pre.reports[0]["num_updates"], checkpoint)
        results = []
        for strategy in STRATEGIES:
            ov = base + [f"restore.strategy={strategy}",
                         f"checkpoint.restore_file={uri.rstrip('/')}/{checkpoint}",
                         f"checkpoint.save_dir={uri.rstrip('/')}-resumed-{strategy}"]
            res = run_phase("resume", workers=n, config=config, overrides=ov, env=env,
                            workdir=workdir, device=device)
            results.append(_verdict(strategy, res, pre_losses, ref_losses, ref_digest))
    return {"workers": n, "model": cfg.train.model, "updates": total, "uri": uri,
            "storage": storage_kind, "preempted_at_update": pre.reports[0]["num_updates"],
            "checkpoint": checkpoint, "reference_seconds": round(ref.seconds, 2),
            "restores": results,
            "bitwise_identical": {r["strategy"]: r["bitwise_identical"] for r in results}}


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


def _verdict(strategy: str, res: PhaseResult, pre_losses: dict, ref_losses: dict,
             ref_digest: set) -> dict:
    restores = [r["restore"] for r in res.reports]
    start = restores[0]["num_updates"]
    resumed = _losses(res.reports)
    combined = {u: v for u, v in pre_losses.items() if u <= start}
    combined.update(resumed)
    digests = {r["digest"] for r in res.reports}
    losses_ok = combined == ref_losses
    params_ok = len(digests) == 1 and digests == ref_digest
    seconds = max(r["seconds"] for r in restores)
    read = [r["bytes_read"] for r in restores]
    received = [r["bytes_received"] for r in restores]
    mapped = [r.get("bytes_mapped", 0) for r in restores]
    moved = max(a + b + c for a, b, c in zip(read, received, mapped, strict=True))
    return {
        "strategy": strategy, "reason": restores[0]["reason"],
        "checkpoint": restores[0]["checkpoint"], "resumed_at_update": start,
        "bytes_read_per_rank": read, "bytes_received_per_rank": received,
        "bytes_mapped_per_rank": mapped, "data_path": restores[0].get("data_path", ""),
        "seconds": round(seconds, 3), "mib_per_s": round(moved / max(seconds, 1e-9) / 2**20, 1),
        "state_devices": restores[0]["state_devices"],
        "losses_identical": losses_ok, "params_identical": params_ok,
        "bitwise_identical": losses_ok and params_ok,
        "verdict": "bitwise identical" if losses_ok and params_ok else "MISMATCH",
    }


def format_table(report: dict) -> str:
    """The human-readable table ``xla-ckpt demo`` prints."""
    head = (f"xla_ckpt demo: {report['workers']} workers, model {report['model']}, "
            f"{report['updates']} updates, storage {report['storage']}\n"
            f"preempted (SIGTERM) after update {report['preempted_at_update']}; "
            f"restoring {report['checkpoint']}\n")
    cols = ("strategy", "checkpoint", "MiB read/rank", "MiB bcast/rank", "MiB mapped/rank",
            "seconds", "MiB/s", "on device", "verdict")
    rows = []
    for r in report["restores"]:
        rows.append((r["strategy"], r["checkpoint"].rsplit("/", 1)[-1],
                     "/".join(f"{b / 2**20:.0f}" for b in r["bytes_read_per_rank"]),
                     "/".join(f"{b / 2**20:.0f}" for b in r["bytes_received_per_rank"]),
                     "/".join(f"{b / 2**20:.0f}" for b in r.get("bytes_mapped_per_rank",
                                                              [0] * len(r["bytes_read_per_rank"]))),
                     f"{r['seconds']:.2f}", f"{r['mib_per_s']:.0f}",
                     ",".join(r["state_devices"]), r["verdict"]))
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))
    sep = "  ".join("-" * w for w in widths)
    body = "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True))
                     for row in rows)
    return head + line + "\n" + sep + "\n" + body
