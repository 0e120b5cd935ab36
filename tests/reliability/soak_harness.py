"""Soak: many save/restore cycles with rotation; usage bounded, no memory growth, all bitwise.

One process (a launcher worker, so the measurements are its own) runs a
training loop with a :class:`~xla_ckpt.manager.CheckpointManager`: every
cycle it changes the state (a training step), saves a checkpoint (async:
staged, uploaded in the background, committed at the next boundary, then
rotated), restores the latest committed checkpoint with
:func:`xla_ckpt.restore.restore` (a fresh storage client each time) and
compares it bit for bit with what it saved.  After every cycle it records:

* committed checkpoints, objects and bytes under the run folder (bucket or
  disk), in-flight temp objects;
* RSS after ``gc.collect()`` and ``malloc_trim(0)``, threads, open file
  descriptors.

Retention: ``keep_interval_updates`` newest update checkpoints plus the
``checkpoint_best`` target, so at most ``keep + 1`` are committed at any
time.  Used by ``test_soak.py`` and ``benchmarks/reliability.py``.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time

import numpy as np
import torch

MiB = 1024 * 1024
KEEP = 3


def soak_state(step: int) -> dict:
    """About 4 MiB of model and optimizer tensors plus fairseq-style extra state at ``step``."""
    g = torch.Generator().manual_seed(5000 + step)
    model = {f"layers.{i}.w": torch.randn(256, 512, generator=g) for i in range(4)}
    opt = {i: {"exp_avg": torch.randn(32768, generator=g), "step": torch.tensor(float(step))}
           for i in range(4)}
    return {"model": model, "optimizer": {"state": opt, "param_groups": [{"lr": 1e-3 / step}]},
            "extra_state": {"num_updates": step, "train_iterator": {"epoch": 1,
                                                                    "iterations_in_epoch": step}}}


def loss_at(step: int) -> float:
    """A noisy, slowly falling validation loss (the best checkpoint moves now and then)."""
    return round(2.0 / (1 + 0.05 * step) + 0.1 * ((step * 7919) % 11) / 11, 6)


def _rss_bytes() -> int:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def run_usage(run_uri: str) -> dict:
    """Objects, bytes and in-flight temp objects under a run folder (local or gs://)."""
    if not run_uri.startswith("gs://"):
        objs = tmp = size = 0
        for d, _dirs, files in os.walk(run_uri):
            for f in files:
                objs += 1
                tmp += ".tmp-" in f
                size += os.path.getsize(os.path.join(d, f))
        return {"objects": objs, "bytes": size, "in_flight": tmp}
    from xla_ckpt.storage.gcs import GCSStorage

    st = GCSStorage(run_uri)
    try:
        blobs = list(st._conn.client.list_blobs(st.bucket_name, prefix=st.prefix + "/"))
    finally:
        st.close()
    return {"objects": len(blobs), "bytes": sum(int(b.size or 0) for b in blobs),
            "in_flight": sum(".tmp-" in b.name for b in blobs)}


def soak(run_uri: str, cycles: int, *, keep: int = KEEP) -> dict:
    """Run ``cycles`` save/restore cycles at ``run_uri``; returns per-cycle records, a summary."""
    from xla_ckpt.comm import SingleProcess
    from xla_ckpt.manager import CheckpointConfig, CheckpointManager
    from xla_ckpt.restore import restore
    from xla_ckpt.run.catalog import list_checkpoints
    from xla_ckpt.storage import open_storage
    from xla_ckpt.testing.asserts import assert_state_identical

    torch.set_num_threads(1)
    cfg = CheckpointConfig(save_dir=run_uri, save_interval_epochs=0, save_interval_updates=1,
                           keep_interval_updates=keep, keep_best_checkpoints=0,
                           best_checkpoint_metric="loss", async_save=True, handle_sigterm=False,
                           exit_on_preemption=False)
    mgr = CheckpointManager(cfg, dist=SingleProcess())
    records = []
    ckpt_bytes = 0
    t_start = time.perf_counter()
    for step in range(1, cycles + 1):
        t0 = time.perf_counter()
        state = soak_state(step)  # "train": a new state every update
        mgr.after_update(epoch=1, num_updates=step, state=state, metrics={"loss": loss_at(step)})
        mgr.wait()  # the async save commits (and rotates) before we look
        r = restore(run_uri, dist=SingleProcess())
        try:
            assert_state_identical(r.state, state)
            diff = "" if r.metadata["num_updates"] == step else f"restored {r.checkpoint}"
        except AssertionError as e:
            diff = str(e)
        del r, state
        with open_storage(run_uri) as run:
            committed = [e.name for e in list_checkpoints(run) if e.committed]
            ckpt_bytes = max(ckpt_bytes, max((e.nbytes for e in list_checkpoints(run)
                                              if e.committed), default=0))
        records.append({"step": step, "bitwise": diff, "committed": committed,
                        **run_usage(run_uri), "rss": _rss_bytes(),
                        "threads": threading.active_count(),
                        "fds": len(os.listdir("/proc/self/fd")),
                        "seconds": time.perf_counter() - t0})
    mgr.close()
    return {"records": records, "summary": summarize(records, keep, ckpt_bytes),
            "seconds": time.perf_counter() - t_start}


def summarize(records: list[dict], keep: int, ckpt_bytes: int) -> dict:
    """Bounds and trends: what the soak test asserts and the benchmark prints."""
    warm = max(2, len(records) // 4)  # the first cycles fill the retention window and caches
    tail = records[warm:]
    x = np.array([r["step"] for r in tail], dtype=float)
    rss = np.array([r["rss"] for r in tail], dtype=float)
    slope = float(np.polyfit(x, rss, 1)[0]) if len(tail) >= 2 else 0.0
    return {
        "cycles": len(records),
        "not_bitwise": [r["step"] for r in records if r["bitwise"]],
        "max_committed": max(len(r["committed"]) for r in records),
        "max_objects": max(r["objects"] for r in records),
        "max_bytes": max(r["bytes"] for r in records),
        "max_in_flight": max(r["in_flight"] for r in records),
        "checkpoint_bytes": ckpt_bytes,
        "bytes_bound": (keep + 1) * ckpt_bytes + 64 * 1024,  # + manifests and pointers
        "rss_first_mib": records[0]["rss"] / MiB,
        "rss_last_mib": records[-1]["rss"] / MiB,
        "rss_slope_kib_per_cycle": slope / 1024,
        "rss_tail_range_mib": float(rss.max() - rss.min()) / MiB if len(tail) else 0.0,
        "threads": sorted({r["threads"] for r in tail}),
        "fds_range": [min(r["fds"] for r in tail), max(r["fds"] for r in tail)],
        "seconds_per_cycle": float(np.median([r["seconds"] for r in records])),
    }
