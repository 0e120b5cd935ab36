r"""Save and restore time against the number of tensors: xla_ckpt vs torch.save/torch.load and DCP.

The state is the one of issue 25 (CASES C26): ``n`` parameters of 3 fp32 values each
(``torch.nn.ParameterList``) and AdamW after one step, so ``4 n`` tensors (the parameter, its
``exp_avg`` and ``exp_avg_sq``, its ``step``) of a few bytes each: the shape of LoRA adapters,
MoE experts and per-layer norms, where the cost per tensor, not per byte, is what counts.
For each ``--sizes`` entry (tensor counts; default 1,000 to 100,000) every method runs
``--repeat`` times, round-robin, on local disk, page cache warm:

  xla_save         xla_ckpt.save({"model", "optimizer"} state dicts, <folder>)
  xla_load         xla_ckpt.load(<folder>)
  trainer_save     Checkpointer.save_checkpoint(<folder>) (model + AdamW + meters, fsync, commit)
  trainer_restore  Checkpointer.load_checkpoint(<folder>) into a fresh Checkpointer (built before
                   the clock): fairseq semantics, the optimizer rebuilt over the live parameters
  torch_save       torch.save(the same state dicts, <file>) (the peer of both saves)
  torch_load       torch.load(<file>) (the peer of both restores)
  dcp_save         torch.distributed.checkpoint.save(state, checkpoint_id=<folder>)
  dcp_load         torch.distributed.checkpoint.load into preallocated tensors (made before
                   the clock)

Every restore is checked bitwise against the saved state after the clock stops.  One JSON line
per method and size: ``method``, ``tensors``, ``params``, ``seconds`` (median wall time),
``runs``, ``cpu_seconds`` (median CPU time of the process, every thread), ``ratio_vs_<peer>``
(peer seconds / these seconds, > 1: this one is faster; peers: torch_load for the restores,
torch_save for the saves, and the DCP method of the same direction).  ``--clock cpu`` makes the
ratios and targets compare CPU seconds instead: on a machine shared with other work, wall
times of one method move by several times from run to run, CPU times much less (the reads'
threads count in full, which can only favour the peers).  A peer that
does not import (DCP) is one line ``{"method", "skipped": "install with: ...", "reason"}`` and
the rest run.

The last line is ``{"summary": "targets (issue 25)", ...}``: at ``--at`` tensors (80,000),
``xla_load`` and ``trainer_restore`` at least as fast as ``torch_load`` (``ratio`` >= 1), and
for every xla_ckpt method ``t(--at) / t(--growth-from)`` at most 1.2 times the tensor-count
ratio (10,000 -> 80,000: at most 9.6); the saves' ratios to ``torch_save`` are reported without
a target.  A target whose sizes were not run is left out.

  .venv/bin/python benchmarks/tensor_count.py                 # 1,000 .. 100,000 tensors
  .venv/bin/python benchmarks/tensor_count.py --sizes 10000,80000 --repeat 5
  .venv/bin/python benchmarks/tensor_count.py --quick         # seconds-long smoke run
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

import torch

torch.set_num_threads(1)

import xla_ckpt  # noqa: E402 - after set_num_threads
from xla_ckpt.trainer import Checkpointer, Metrics  # noqa: E402 - after set_num_threads

SIZES = [1000, 10000, 20000, 40000, 80000, 100000]
QUICK_SIZES = [100, 800]
XLA_METHODS = ["xla_save", "xla_load", "trainer_save", "trainer_restore"]
TORCH_METHODS = ["torch_save", "torch_load"]
DCP_METHODS = ["dcp_save", "dcp_load"]
PEERS = {"xla_save": ["torch_save", "dcp_save"], "trainer_save": ["torch_save", "dcp_save"],
         "xla_load": ["torch_load", "dcp_load"], "trainer_restore": ["torch_load", "dcp_load"],
         "dcp_save": ["torch_save"], "dcp_load": ["torch_load"]}
GROWTH_SLACK = 1.2
"""Time may grow at most this many times faster than the tensor count (issue 25)."""


class Model(torch.nn.Module):
    """``n`` parameters of 3 fp32 values each."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(3)) for _ in range(n))


def make(n: int, seed: int) -> Checkpointer:
    torch.manual_seed(seed)
    return Checkpointer(model=Model(n), metrics=Metrics(),
                        build_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))


def populate(ckpt: Checkpointer) -> None:
    g = torch.Generator().manual_seed(0)
    for p in ckpt.live_parameters():
        p.grad = torch.randn(p.shape, generator=g)
    ckpt.optimizer.step()
    ckpt.set_num_updates(1)


def dcp_missing() -> str | None:
    """Why DCP cannot run here, or None."""
    try:
        import torch.distributed.checkpoint  # noqa: F401 - probing the peer
    except Exception as e:  # noqa: BLE001 - any import failure means the peer is missing
        return f"torch.distributed.checkpoint does not import: {type(e).__name__}: {e}"
    return None


def _zeros_like(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: _zeros_like(v) for k, v in obj.items()}
    return copy.deepcopy(obj)


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of two nested states (tensors compared as bytes)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8)
                                if b.dim() else b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class Bench:
    """One size: the saved state, the fresh targets of each restore, and the methods."""

    def __init__(self, n_params: int, tmp: str) -> None:
        self.tmp = tmp
        self.src = make(n_params, 0)
        populate(self.src)
        self.want = {"model": self.src.model.state_dict(),
                     "optimizer": self.src.optimizer.state_dict()}
        self.tensors = len(self.want["model"]) + sum(
            sum(isinstance(v, torch.Tensor) for v in st.values())
            for st in self.want["optimizer"]["state"].values())
        self.folder = os.path.join(tmp, "xla")
        self.trainer_folder = os.path.join(tmp, "checkpoint_1_1")
        self.pt = os.path.join(tmp, "state.pt")
        self.dcp_folder = os.path.join(tmp, "dcp")
        self.n_params = n_params
        self.fresh: Checkpointer | None = None
        self.dcp_target: Any = None
        self.last: Any = None

    def prepare(self, name: str) -> None:
        """Outside the clock: what the method restores into."""
        self.last = None
        if name == "trainer_restore":
            self.fresh = make(self.n_params, 1)
        elif name == "dcp_load":
            self.dcp_target = _zeros_like(self.want)
        gc.collect()

    def xla_save(self) -> None:
        xla_ckpt.save(self.want, self.folder)

    def xla_load(self) -> None:
        self.last = xla_ckpt.load(self.folder)

    def trainer_save(self) -> None:
        self.src.save_checkpoint(self.trainer_folder)

    def trainer_restore(self) -> None:
        assert self.fresh is not None
        self.fresh.load_checkpoint(self.trainer_folder)

    def torch_save(self) -> None:
        torch.save(self.want, self.pt)

    def torch_load(self) -> None:
        self.last = torch.load(self.pt, weights_only=False)

    def dcp_save(self) -> None:
        import torch.distributed.checkpoint as dcp

        if os.path.exists(self.dcp_folder):
            shutil.rmtree(self.dcp_folder)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(self.want, checkpoint_id=self.dcp_folder)

    def dcp_load(self) -> None:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():  # as dcp_save
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(self.dcp_target, checkpoint_id=self.dcp_folder)

    def check(self, name: str) -> bool | None:
        """Bitwise check of what a restore gave (outside the clock); None for a save."""
        if name in ("xla_load", "torch_load"):
            return _same(self.want, self.last)
        if name == "dcp_load":
            return _same(self.want, self.dcp_target)
        if name == "trainer_restore":
            assert self.fresh is not None
            return _same(self.want, {"model": self.fresh.model.state_dict(),
                                     "optimizer": self.fresh.optimizer.state_dict()})
        return None


def run_size(tensors: int, methods: list[str], repeat: int,
             clock: str = "wall") -> list[dict[str, Any]]:
    """Every method ``repeat`` times, round-robin, on a state of ``tensors`` tensors; the
    ratios compare ``clock`` medians (``wall`` or ``cpu``)."""
    tmp = tempfile.mkdtemp(prefix="xla_ckpt_tensor_count_")
    try:
        bench = Bench(tensors // 4, tmp)
        order = sorted(methods, key=lambda m: ("load" in m or "restore" in m, m))  # saves first
        runs: dict[str, list[float]] = {m: [] for m in order}
        cpu: dict[str, list[float]] = {m: [] for m in order}
        ok: dict[str, bool] = {}
        for _ in range(repeat):
            for m in order:
                bench.prepare(m)
                fn: Callable[[], None] = getattr(bench, m)
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                runs[m].append(time.perf_counter() - t0)
                cpu[m].append(time.process_time() - c0)
                good = bench.check(m)
                if good is not None:
                    ok[m] = ok.get(m, True) and good
        med = {m: statistics.median(v) for m, v in (cpu if clock == "cpu" else runs).items()}
        lines = []
        for m in methods:
            line: dict[str, Any] = {"method": m, "tensors": bench.tensors,
                                    "params": bench.n_params,
                                    "seconds": round(statistics.median(runs[m]), 4),
                                    "runs": [round(x, 4) for x in runs[m]],
                                    "cpu_seconds": round(statistics.median(cpu[m]), 4)}
            for peer in PEERS.get(m, []):
                if peer in med:
                    line[f"ratio_vs_{peer}"] = round(med[peer] / med[m], 3)
            if m in ok:
                line["bitwise_ok"] = ok[m]
            lines.append(line)
        return lines
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def summary(lines: list[dict[str, Any]], at: int, growth_from: int,
            clock: str = "wall") -> dict[str, Any]:
    """Issue 25's targets against the measured figures (left out where a size was not run);
    ``clock``: compare ``seconds`` (wall) or ``cpu_seconds`` (cpu)."""
    out: dict[str, Any] = {"summary": "targets (issue 25)", "clock": clock, "at_tensors": at,
                           "growth_from_tensors": growth_from}
    field = "cpu_seconds" if clock == "cpu" else "seconds"
    sec = {(x["method"], x["tensors"]): x[field] for x in lines}
    for m in ("xla_load", "trainer_restore"):
        if (m, at) in sec and ("torch_load", at) in sec:
            r = round(sec["torch_load", at] / sec[m, at], 3)
            out[f"{m}_vs_torch_load_at_{at}"] = {"ratio": r, "target": 1.0, "met": r >= 1.0}
    for m in ("xla_save", "trainer_save"):
        if (m, at) in sec and ("torch_save", at) in sec:
            out[f"{m}_vs_torch_save_at_{at}"] = {
                "ratio": round(sec["torch_save", at] / sec[m, at], 3), "target": None}
    limit = round(GROWTH_SLACK * at / growth_from, 3)
    for m in XLA_METHODS + TORCH_METHODS + DCP_METHODS:
        if (m, at) in sec and (m, growth_from) in sec:
            g = round(sec[m, at] / sec[m, growth_from], 3)
            entry: dict[str, Any] = {"ratio": g, "tensor_ratio": round(at / growth_from, 3)}
            if m in XLA_METHODS:
                entry.update(target=limit, met=g <= limit)
            out[f"{m}_growth_{growth_from}_to_{at}"] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=None,
                    help="tensor counts, comma-separated (default "
                         f"{','.join(map(str, SIZES))}; --quick {','.join(map(str, QUICK_SIZES))})")
    ap.add_argument("--repeat", type=int, default=None,
                    help="runs per method and size, median reported (default 3; --quick 1)")
    ap.add_argument("--at", type=int, default=None,
                    help="tensor count of the targets (default 80000; --quick 800)")
    ap.add_argument("--growth-from", type=int, default=None,
                    help="tensor count the growth is measured from (default 10000; --quick 100)")
    ap.add_argument("--methods", default=",".join(XLA_METHODS + TORCH_METHODS + DCP_METHODS))
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="what the ratios and targets compare: wall seconds (default) or the "
                         "process's CPU seconds, all threads (steadier on a shared machine)")
    ap.add_argument("--quick", action="store_true",
                    help="a seconds-long smoke run: 100 and 800 tensors, one run each")
    a = ap.parse_args(argv)
    sizes = [int(s) for s in (a.sizes or ",".join(map(str, QUICK_SIZES if a.quick else SIZES)))
             .split(",") if s]
    repeat = a.repeat or (1 if a.quick else 3)
    at = a.at or (QUICK_SIZES[-1] if a.quick else 80000)
    growth_from = a.growth_from or (QUICK_SIZES[0] if a.quick else 10000)
    known = XLA_METHODS + TORCH_METHODS + DCP_METHODS
    methods = [m for m in a.methods.split(",") if m]
    for m in methods:
        if m not in known:
            ap.error(f"unknown method {m!r}; choose from {', '.join(known)}")
    if any(s < 4 or s % 4 for s in sizes):
        ap.error("--sizes: every size is a multiple of 4 tensors (parameters with AdamW: 4 "
                 "tensors each)")
    why = dcp_missing() if any(m in DCP_METHODS for m in methods) else None
    if why is not None:
        for m in [m for m in methods if m in DCP_METHODS]:
            print(json.dumps({"method": m, "skipped": "install with: .venv/bin/pip install -e . "
                              "(torch with torch.distributed)", "reason": why}), flush=True)
            methods.remove(m)
    lines: list[dict[str, Any]] = []
    for tensors in sizes:
        for line in run_size(tensors, methods, repeat, a.clock):
            lines.append(line)
            print(json.dumps(line), flush=True)
    print(json.dumps(summary(lines, at, growth_from, a.clock)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
