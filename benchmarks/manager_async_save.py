"""How long a checkpoint save stalls the training thread: CheckpointManager async vs sync vs
``torch.save`` (the fairseq way), same state, same disk, same process.

State: ``--size-mib`` MiB of fp32 tensors (8 MiB each) plus an Adam-like ``step`` per tensor.
Methods (median of ``--repeat`` saves by one manager; local folder under ``--dir``, default a
temp dir):

  async_stall_first  the first async save: staging into freshly allocated host buffers
  async_stall        CheckpointManager(async_save=True).after_update at a save boundary: stage
                     the state into the host buffers of the previous save, hand it to the
                     upload thread, return
  async_commit       from that call until the checkpoint is committed (manifest + pointer)
  sync_stall         CheckpointManager(async_save=False).after_update at a save boundary
                     (write the live state, commit, pointer, rotation)
  peer_torch_save    torch.save(state, path) + os.sync() into the same folder

Each line is JSON with ``seconds``, ``mib_s`` and ``ratio_vs_peer_torch_save`` (peer seconds /
these seconds: > 1 means the training thread is blocked for less time).

  .venv/bin/python benchmarks/manager_async_save.py [--size-mib 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402 - after the sys.path insert above

from xla_ckpt.manager import CheckpointConfig, CheckpointManager  # noqa: E402 - as above

TENSOR_MIB = 8


def make_state(size_mib: int) -> dict:
    g = torch.Generator().manual_seed(0)
    n = max(1, size_mib // TENSOR_MIB)
    model = {f"layer{i}.weight": torch.randn(TENSOR_MIB * 2**18, generator=g) for i in range(n)}
    return {"model": model, "optimizer": {"state": {i: {"step": torch.tensor(float(i))}
                                                    for i in range(n)}}}


def bench_manager(root: str, state: dict, async_save: bool,
                  saves: int) -> list[tuple[float, float]]:
    """One manager, ``saves`` saves: per save (seconds after_update blocked, seconds to commit)."""
    run = tempfile.mkdtemp(dir=root)
    cfg = CheckpointConfig(save_dir=run, save_interval_updates=1, async_save=async_save,
                           handle_sigterm=False, keep_interval_updates=1)
    out = []
    with CheckpointManager(cfg) as mgr:
        for n in range(1, saves + 1):
            t0 = time.perf_counter()
            mgr.after_update(epoch=1, num_updates=n, state=lambda: state)
            stall = time.perf_counter() - t0
            mgr.wait()
            out.append((stall, time.perf_counter() - t0))
    shutil.rmtree(run)
    return out


def bench_torch_save(root: str, state: dict) -> float:
    path = os.path.join(root, "peer.pt")
    t0 = time.perf_counter()
    torch.save(state, path)
    os.sync()
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="folder to write into (default: a temp dir)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(dir=a.dir)
    state = make_state(a.size_mib)
    nbytes = sum(t.numel() * 4 for t in state["model"].values())
    runs: dict[str, list[float]] = {}
    try:
        a_runs = bench_manager(root, state, True, a.repeat + 1)
        runs["async_stall_first"] = [a_runs[0][0]]
        runs["async_stall"] = [x for x, _ in a_runs[1:]]
        runs["async_commit"] = [y for _, y in a_runs[1:]]
        runs["sync_stall"] = [x for x, _ in bench_manager(root, state, False, a.repeat)]
        runs["peer_torch_save"] = [bench_torch_save(root, state) for _ in range(a.repeat)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    peer = statistics.median(runs["peer_torch_save"])
    for name, secs in runs.items():
        med = statistics.median(secs)
        print(json.dumps({"method": name, "size_mib": nbytes / 2**20, "seconds": round(med, 4),
                          "mib_s": round(nbytes / 2**20 / med, 1),
                          "ratio_vs_peer_torch_save": round(peer / med, 2)}))


if __name__ == "__main__":
    main()
