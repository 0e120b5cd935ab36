"""Ctrl-C / an exception / SIGTERM shortly after an async save was handed off (CASES C27).

Issue 25, defect 4: in 4 of 4 single-process runs (192 MiB, SIGINT 0-0.6 s after
``after_update`` reported the save) nothing was committed.  This runs the real process of
``tests/manager/exit_worker.py`` (``--mib`` of float32 state, ``with CheckpointManager``,
the default ``exit_grace_s``) and stops it at ``--delays`` seconds after the handoff, by
SIGINT (``sigint-external``), plus the in-process points (SIGINT right after the handoff,
during the data-file write, during the commit-marker write; an exception; SIGTERM), each
``--repeats`` times.  One JSON line per run: whether the handed-off save (``checkpoint_1_2``)
was committed and restores bitwise, whether an abandonment was named, the previous
checkpoint intact, the exit code, and seconds from the signal to the exit; then a summary.

    .venv/bin/python benchmarks/exit_with_save_in_flight.py --mib 192 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

import xla_ckpt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "manager", "exit_worker.py")


def w_at(n: int, mib: int) -> torch.Tensor:
    """The worker's weights after update ``n`` (tests/manager/exit_worker.py ``w_at``)."""
    return torch.randn(mib << 18, generator=torch.Generator().manual_seed(n))


def one(mode: str, delay_s: float | None, mib: int, sig: int = signal.SIGINT) -> dict:
    root = tempfile.mkdtemp(prefix="xla-ckpt-exit-")
    run_dir, ev = os.path.join(root, "run"), os.path.join(root, "ev")
    os.mkdir(ev)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1",
               XLA_CKPT_EXIT_WORKER_MIB=str(mib))
    log_path = os.path.join(root, "log")
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, WORKER, mode, run_dir, ev], env=env,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                     signal.SIG_DFL))
        t_sig = None
        if delay_s is not None:
            while not os.path.exists(os.path.join(ev, "handoff")) and proc.poll() is None:
                time.sleep(0.005)
            time.sleep(delay_s)
            t_sig = time.monotonic()
            proc.send_signal(sig)
        rc = proc.wait(300)
        exit_s = time.monotonic() - t_sig if t_sig is not None else None
        with open(log_path) as f:
            text = f.read()
        names = sorted(n for n in os.listdir(run_dir)
                       if os.path.exists(os.path.join(run_dir, n, "manifest.json")))
        w = xla_ckpt.load(os.path.join(run_dir, "checkpoint_1_2"))["model"]["w"] \
            if "checkpoint_1_2" in names else None
        prev = xla_ckpt.load(os.path.join(run_dir, "checkpoint_1_1"))["model"]["w"]
        return {"mode": mode, "delay_s": delay_s, "mib": mib, "rc": rc,
                "committed": w is not None,
                "bitwise": bool(w is not None and torch.equal(w, w_at(2, mib))),
                "abandoned_named": "abandoned the save of checkpoint" in text,
                "previous_intact": bool(torch.equal(prev, w_at(1, mib))),
                "on_the_way_out": "on the way out" in text,
                "signal_to_exit_s": round(exit_s, 3) if exit_s is not None else None}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--delays", type=float, nargs="*", default=[0.0, 0.1, 0.2, 0.3, 0.4, 0.5,
                                                                0.6])
    a = ap.parse_args()
    rows = []
    for _ in range(a.repeats):
        for d in a.delays:
            rows.append(one("sigint-external", d, a.mib))
            print(json.dumps(rows[-1]), flush=True)
        for mode in ("sigint-now", "sigint-upload", "sigint-commit", "raise"):
            rows.append(one(mode, None, a.mib))
            print(json.dumps(rows[-1]), flush=True)
        rows.append(one("sigterm", 0.0, a.mib, signal.SIGTERM))
        print(json.dumps(rows[-1]), flush=True)
    lost = [r for r in rows if not r["committed"] and not r["abandoned_named"]]
    print(json.dumps({"summary": True, "runs": len(rows),
                      "committed_bitwise": sum(r["bitwise"] for r in rows),
                      "abandoned_named": sum(r["abandoned_named"] for r in rows),
                      "lost_silently": len(lost),
                      "previous_intact": sum(r["previous_intact"] for r in rows)}), flush=True)


if __name__ == "__main__":
    main()
