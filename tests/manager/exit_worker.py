"""A real training process stopped while an async save is in flight (issue 25, defect 4; C27).

``python exit_worker.py MODE RUN EVENTS`` (see tests/manager/test_exit_with_save_in_flight.py):
one process, ``with CheckpointManager(...)``, a 32 MiB state (``XLA_CKPT_EXIT_WORKER_MIB``
sets another size: benchmarks/exit_with_save_in_flight.py runs the issue's 192 MiB).
Update 1 is saved and waited for (the previous checkpoint); update 2's async save is handed
off (``<EVENTS>/handoff`` is written), then the loop goes on calling ``after_update`` every
20 ms and is stopped by MODE:

* ``sigint-now``: SIGINT to itself right after the handoff;
* ``sigint-upload``: SIGINT sent by the upload thread as it starts writing the data file;
* ``sigint-commit``: SIGINT sent as the commit marker (manifest) starts being written;
* ``sigint-external``: nothing here, the test sends SIGINT (after a delay of its choosing);
* ``raise``: a RuntimeError raised in the loop right after the handoff;
* ``sigterm``: the test sends SIGTERM (the manager's handler: a preemption save, exit 0);
* ``abandon-now``: as ``sigint-now`` with ``exit_grace_s=0``;
* ``no-with``: as ``sigint-now`` with the manager never closed (no ``with``, no close()):
  one process, so the exit hook finishes the save within ``exit_grace_s``;
* ``abandon-grace``: the data-file write of update 2 waits until the manager has logged that
  it gave the save up; SIGINT at once, ``exit_grace_s=1``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import torch

from xla_ckpt.manager import CheckpointConfig, CheckpointManager
from xla_ckpt.storage.local import LocalStorage

NUMEL = int(os.environ.get("XLA_CKPT_EXIT_WORKER_MIB", "32")) << 18  # MiB of float32


def w_at(n: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(n))


class _GaveUp(logging.Handler):
    """Sets ``event`` when the manager logs that it abandoned a save."""

    def __init__(self, event: threading.Event) -> None:
        super().__init__(logging.ERROR)
        self.event = event

    def emit(self, record: logging.LogRecord) -> None:
        if "abandoned the save" in record.getMessage():
            self.event.set()


def _hooked(run_dir: str, mode: str, gave_up: threading.Event) -> LocalStorage:
    class Hooked(LocalStorage):
        def write_atomic(self, name, buffers, **kw):
            if self.uri.rstrip("/").endswith("/checkpoint_1_2"):
                if mode == "sigint-upload" and name.startswith("data-"):
                    os.kill(os.getpid(), signal.SIGINT)
                elif mode == "sigint-commit" and name == "manifest.json":
                    os.kill(os.getpid(), signal.SIGINT)
                elif mode == "abandon-grace" and name.startswith("data-"):
                    gave_up.wait(120)  # held until the manager gave the save up
            return super().write_atomic(name, buffers, **kw)

        def child(self, prefix):
            c = super().child(prefix)
            c.__class__ = Hooked
            return c

    return Hooked(run_dir)


def main(mode: str, run_dir: str, events_dir: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    gave_up = threading.Event()
    logging.getLogger("xla_ckpt.manager.core").addHandler(_GaveUp(gave_up))
    grace = {"abandon-now": 0.0, "abandon-grace": 1.0}.get(mode, 60.0)
    cfg = CheckpointConfig(save_dir=run_dir, async_save=True, save_interval_epochs=0,
                           save_interval_updates=0, handle_sigterm=(mode == "sigterm"),
                           exit_grace_s=grace)
    w = torch.zeros(NUMEL)
    mgr = CheckpointManager(cfg, storage=_hooked(run_dir, mode, gave_up))
    if mode == "no-with":
        _loop(mgr, mode, w, events_dir)
    with mgr:
        _loop(mgr, mode, w, events_dir)


def _loop(mgr: CheckpointManager, mode: str, w: torch.Tensor, events_dir: str) -> None:
    w.copy_(w_at(1))
    mgr.save({"model": {"w": w}}, epoch=1, num_updates=1, block=False)
    mgr.wait()  # checkpoint_1_1 committed: the previous checkpoint
    w.copy_(w_at(2))
    name = mgr.save({"model": {"w": w}}, epoch=1, num_updates=2, block=False)
    with open(os.path.join(events_dir, "handoff"), "w") as f:
        f.write(name)
    if mode in ("sigint-now", "no-with", "abandon-now", "abandon-grace"):
        os.kill(os.getpid(), signal.SIGINT)
    if mode == "raise":
        raise RuntimeError("an error in the training loop")
    n = 2
    while True:  # "training": the weights change, the manager advances the save
        n += 1
        w.copy_(w_at(n))
        mgr.after_update(epoch=1, num_updates=n, state={"model": {"w": w}})
        time.sleep(0.02)


if __name__ == "__main__":
    # A job started in the background of a non-interactive shell inherits SIGINT ignored;
    # the test sends Ctrl-C, so take Python's default handler back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2], sys.argv[3])


def every_rank_raises(run_dir: str) -> dict:
    """One rank of a gloo job whose every rank leaves ``with manager:`` on an error right after
    handing off the save of update 2: the ranks agree on its commit on the way out."""
    from xla_ckpt.comm import DistConfig, get_dist

    dist = get_dist(DistConfig(backend="gloo", timeout_s=60))
    cfg = CheckpointConfig(save_dir=run_dir, async_save=True, save_interval_epochs=0,
                           handle_sigterm=False, exit_grace_s=60.0)
    w = torch.zeros(1 << 16)
    out: dict = {"rank": dist.rank}
    try:
        with CheckpointManager(cfg, dist=dist) as mgr:
            w.copy_(w_at(1)[: w.numel()])
            mgr.save({"model": {"w": w}}, epoch=1, num_updates=1, rank_state={"r": dist.rank})
            mgr.wait()
            w.copy_(w_at(2)[: w.numel()])
            mgr.save({"model": {"w": w}}, epoch=1, num_updates=2, rank_state={"r": dist.rank},
                     block=False)
            raise RuntimeError(f"an error on rank {dist.rank}")
    except RuntimeError as e:
        out["error"] = str(e)
    dist.barrier()
    out["committed"] = sorted(n for n in os.listdir(run_dir)
                              if os.path.exists(os.path.join(run_dir, n, "manifest.json")))
    return out
