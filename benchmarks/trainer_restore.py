"""Trainer-level save/restore of a real training state: xla_ckpt Checkpointer vs the fairseq way.

State: all-MiniLM-L6-v2 (22.7 M parameters, fp32) + a criterion with a parameter + AdamW with
its moments after one step (~270 MiB of tensors), meters, iterator state, ``args``.  Local
disk, page cache warm for both sides.  Methods (same process, same state, median of
``--repeat``):

  save_xla_ckpt      Checkpointer.save_checkpoint (pickle-free, crc32c, fsync, atomic commit)
  save_torch         fairseq-style: torch.save(trainer.state_dict()) to a temp name + rename
  restore_xla_ckpt   Checkpointer.load_checkpoint into fresh objects (fairseq semantics, crc32c)
  restore_torch      fairseq-style: torch.load + model/criterion/optimizer load_state_dict
  read_xla_ckpt      xla_ckpt.load alone (what the restore reads before applying it)

Each line is JSON with ``seconds`` and ``ratio_vs_peer`` (peer seconds / these seconds, > 1 means
xla_ckpt is faster); every restore is checked bitwise against the saved state after the clock stops.

  .venv/bin/python benchmarks/trainer_restore.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

torch.set_num_threads(1)

import xla_ckpt  # noqa: E402 - after set_num_threads
from xla_ckpt.demo.model import ContrastiveLoss, build  # noqa: E402 - after set_num_threads
from xla_ckpt.testing.asserts import assert_state_identical  # noqa: E402 - after set_num_threads
from xla_ckpt.trainer import Checkpointer, Metrics  # noqa: E402 - after set_num_threads

EXTRA = {"train_iterator": {"epoch": 1, "iterations_in_epoch": 7, "version": 2}, "val_loss": 1.5}


def make(seed: int) -> Checkpointer:
    _, model = build("minilm", seed=seed)
    ckpt = Checkpointer(
        model=model, criterion=ContrastiveLoss(),
        build_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4, betas=(0.9, 0.98)),
        metrics=Metrics(), args=argparse.Namespace(arch="minilm", lr=[1e-4]))
    return ckpt


def populate(ckpt: Checkpointer) -> None:
    g = torch.Generator().manual_seed(0)
    for p in ckpt.live_parameters():
        p.grad = torch.randn(p.shape, generator=g)
    ckpt.optimizer.step()
    ckpt.set_num_updates(1)
    ckpt.metrics.log_scalar("loss", 2.5, weight=32)


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    src = make(0)
    populate(src)
    want = {"model": src.model.state_dict(), "optimizer": src.optimizer.state_dict()}
    nbytes = sum(t.numel() * t.element_size() for t in src.model.state_dict().values())
    nbytes += sum(t.numel() * t.element_size() for st in src.optimizer.state.values()
                  for t in st.values())
    tmp = tempfile.mkdtemp(prefix="xla_ckpt_bench_")
    folder, pt = os.path.join(tmp, "checkpoint_1_1"), os.path.join(tmp, "checkpoint_1_1.pt")

    def save_torch() -> None:
        state = src.state_dict(EXTRA)
        torch.save(state, pt + ".tmp")
        os.replace(pt + ".tmp", pt)

    results = {"save_xla_ckpt": timed(lambda: src.save_checkpoint(folder, EXTRA), args.repeat),
               "save_torch": timed(save_torch, args.repeat)}

    dst = make(1)
    criterion = dst.criterion
    assert criterion is not None

    def restore_torch() -> None:
        state = torch.load(pt, map_location="cpu", weights_only=False)
        dst.model.load_state_dict(state["model"], strict=True)
        criterion.load_state_dict(state["criterion"], strict=True)
        dst.optimizer.load_state_dict(state["last_optimizer_state"])

    results["restore_torch"] = timed(restore_torch, args.repeat)
    assert_state_identical({"model": dst.model.state_dict(),
                            "optimizer": dst.optimizer.state_dict()}, want)
    fresh = make(2)
    results["restore_xla_ckpt"] = timed(lambda: fresh.load_checkpoint(folder), args.repeat)
    assert_state_identical({"model": fresh.model.state_dict(),
                            "optimizer": fresh.optimizer.state_dict()}, want)
    results["read_xla_ckpt"] = timed(lambda: xla_ckpt.load(folder), args.repeat)

    peers = {"save_xla_ckpt": "save_torch", "restore_xla_ckpt": "restore_torch",
             "read_xla_ckpt": "restore_torch"}
    for name, sec in results.items():
        line = {"method": name, "seconds": round(sec, 3), "state_mib": round(nbytes / 2**20, 1),
                "mib_s": round(nbytes / 2**20 / sec, 1)}
        if name in peers:
            line["ratio_vs_peer"] = round(results[peers[name]] / sec, 2)
            line["peer"] = peers[name]
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
