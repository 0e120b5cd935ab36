"""Trainer-level save/restore of a real training state: xla_ckpt Checkpointer vs the fairseq way.

State: all-MiniLM-L6-v2 (22.7 M parameters, fp32) + a criterion with a parameter + AdamW with
its moments after one step (~260 MiB of tensors), meters, iterator state, ``args``.  Local
disk, page cache warm for both sides.  Methods (same process, same state; every repeat runs
every method once, round-robin, and each line gives the median and every run):

  save_xla_ckpt      Checkpointer.save_checkpoint (pickle-free, crc32c, fsync, atomic commit)
  save_torch         fairseq-style with the same durability: torch.save(trainer.state_dict()) to
                     a temp name, fsync, rename, fsync of the folder
  restore_xla_ckpt   Checkpointer.load_checkpoint into a fresh trainer (fairseq semantics, crc32c)
                     with its default restorer, which reads the model and criterion straight
                     into their live parameters (module_load.in_place_targets +
                     CheckpointReader.load(into=...)); the check after the clock asserts every
                     model tensor was a target
  restore_xla_ckpt_copy
                     the same with a restorer that takes no targets (fresh memory, then
                     load_state_dict copies): the path of XLA/CUDA models, casts and prefixes
  restore_torch      fairseq-style: torch.load + model/criterion/optimizer load_state_dict
  read_xla_ckpt      xla_ckpt.load alone (what the restore reads before applying it)
  read_xla_ckpt_mmap xla_ckpt.load(mmap=True): tensors are checked views of private maps of the
                     data files (no copy; see its docstring for what that trades)
  torch_load         torch.load alone (the peer of both reads)

Each line is JSON with ``seconds`` (median), ``runs``, ``cpu_seconds`` (median user + system
time of all threads) and ``ratio_vs_peer`` (peer seconds / these seconds, > 1 means xla_ckpt
is faster); every restore is checked bitwise against the saved
state after the clock stops.  ``--rss`` also runs each method once in a fresh process and reports
its peak RSS above that process's baseline (``VmHWM`` after resetting it through
``/proc/self/clear_refs`` once the trainer is built), as a multiple of the state's bytes, and
its time there (``fresh_process_seconds``: nothing of an earlier run to reuse, as in a real
restart; in the timed loop ``torch.load`` gets its buffers from the heap the run before freed).
``--fresh-repeat`` (3) such processes per method, round-robin, give the median fresh-process time
(``fresh_ratio_vs_peer``) and the worst RSS.  In the timed loop the methods share one heap, so
whoever frees memory just before another runs lends it pages already faulted in; the
fresh-process figures have no such order effect.
``--breakdown`` times the parts of a local restore (see benchmarks/README.md, "Local restore"),
in the loop and in ``--fresh-repeat`` fresh processes (page faults on a line of their own).

  .venv/bin/python benchmarks/trainer_restore.py [--repeat 5] [--rss] [--breakdown]
      [--huge-pages auto|on|off]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch

torch.set_num_threads(1)

import xla_ckpt  # noqa: E402 - after set_num_threads
from xla_ckpt.demo.model import ContrastiveLoss, build  # noqa: E402 - after set_num_threads
from xla_ckpt.format.crc import crc32c  # noqa: E402 - after set_num_threads
from xla_ckpt.format.manifest import STATE_ITEM  # noqa: E402 - after set_num_threads
from xla_ckpt.format.plan import materialize_item, tensor_bytes  # noqa: E402 - after set_num_threads
from xla_ckpt.io import buffers  # noqa: E402 - after set_num_threads
from xla_ckpt.kinds.opener import open_reader  # noqa: E402 - after set_num_threads
from xla_ckpt.run.resolve import resolve  # noqa: E402 - after set_num_threads
from xla_ckpt.testing.asserts import assert_state_identical  # noqa: E402 - after set_num_threads
from xla_ckpt.trainer import Checkpointer, Metrics, Restorer  # noqa: E402 - after set_num_threads
from xla_ckpt.trainer.sources import (  # noqa: E402 - after set_num_threads
    RestoredState,
    RestoreRequest,
    SingleProcessRestorer,
)

EXTRA = {"train_iterator": {"epoch": 1, "iterations_in_epoch": 7, "version": 2}, "val_loss": 1.5}
PEERS = {"save_xla_ckpt": "save_torch", "restore_xla_ckpt": "restore_torch",
         "restore_xla_ckpt_copy": "restore_torch", "read_xla_ckpt": "torch_load",
         "read_xla_ckpt_mmap": "torch_load"}
ORDER = ["save_xla_ckpt", "save_torch", "restore_torch", "restore_xla_ckpt",
         "restore_xla_ckpt_copy", "torch_load", "read_xla_ckpt", "read_xla_ckpt_mmap"]


def make(seed: int, restorer: Restorer | None = None) -> Checkpointer:
    _, model = build("minilm", seed=seed)
    with torch.no_grad():
        # The pretrained weights come as a private mapping of the package's safetensors file:
        # the first write into each page would copy it (a fault and new memory) whichever
        # restore writes first.  A trainer's model lives in its own memory (after init, a step
        # or .to(device)); give every method that.
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.clone()
    return Checkpointer(
        model=model, criterion=ContrastiveLoss(),
        build_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4, betas=(0.9, 0.98)),
        metrics=Metrics(), args=argparse.Namespace(arch="minilm", lr=[1e-4]), restorer=restorer)


def copying_restorer() -> Callable[[RestoreRequest], RestoredState]:
    """The default restorer without in-place targets: fresh buffers, then load_state_dict."""
    inner = SingleProcessRestorer()

    def restorer(request: RestoreRequest) -> RestoredState:
        return inner(RestoreRequest(uri=request.uri))
    return restorer


def populate(ckpt: Checkpointer) -> None:
    g = torch.Generator().manual_seed(0)
    for p in ckpt.live_parameters():
        p.grad = torch.randn(p.shape, generator=g)
    ckpt.optimizer.step()
    ckpt.set_num_updates(1)
    ckpt.metrics.log_scalar("loss", 2.5, weight=32)


def state_bytes(ckpt: Checkpointer) -> int:
    n = sum(t.numel() * t.element_size() for t in ckpt.model.state_dict().values())
    return n + sum(t.numel() * t.element_size() for st in ckpt.optimizer.state.values()
                   for t in st.values())


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Bench:
    """The saved state, the live objects each method restores into, and the methods."""

    def __init__(self, tmp: str) -> None:
        self.src = make(0)
        populate(self.src)
        self.want = {"model": self.src.model.state_dict(),
                     "optimizer": self.src.optimizer.state_dict()}
        self.nbytes = state_bytes(self.src)
        self.folder = os.path.join(tmp, "checkpoint_1_1")
        self.pt = os.path.join(tmp, "checkpoint_1_1.pt")
        self.dst = make(1)
        self.fresh = make(2)
        self.copy = make(3, restorer=copying_restorer())
        self.last: Any = None

    def method(self, name: str) -> Callable[[], None]:
        return getattr(self, name)

    def save_xla_ckpt(self) -> None:
        self.src.save_checkpoint(self.folder, EXTRA)

    def save_torch(self) -> None:
        state = self.src.state_dict(EXTRA)
        with open(self.pt + ".tmp", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self.pt + ".tmp", self.pt)
        fsync_dir(os.path.dirname(self.pt))

    def restore_torch(self) -> None:
        state = torch.load(self.pt, map_location="cpu", weights_only=False)
        criterion = self.dst.criterion
        assert criterion is not None
        self.dst.model.load_state_dict(state["model"], strict=True)
        criterion.load_state_dict(state["criterion"], strict=True)
        self.dst.optimizer.load_state_dict(state["last_optimizer_state"])

    def restore_xla_ckpt(self) -> None:
        self.fresh.load_checkpoint(self.folder)

    def restore_xla_ckpt_copy(self) -> None:
        self.copy.load_checkpoint(self.folder)

    def read_xla_ckpt(self) -> None:
        self.last = xla_ckpt.load(self.folder)

    def read_xla_ckpt_mmap(self) -> None:
        self.last = xla_ckpt.load(self.folder, mmap=True)

    def torch_load(self) -> None:
        self.last = torch.load(self.pt, map_location="cpu", weights_only=False)

    def check(self, name: str) -> None:
        """Bitwise check of what ``name`` restored (outside the clock)."""
        target = {"restore_torch": self.dst, "restore_xla_ckpt": self.fresh,
                  "restore_xla_ckpt_copy": self.copy}.get(name)
        if name == "restore_xla_ckpt":
            reader = open_reader(resolve(self.folder))
            try:
                targets = self.fresh._in_place_targets(reader.manifest.item(STATE_ITEM))
            finally:
                reader.storage.close()
            n_model = len(self.fresh.model.state_dict())
            assert sum("['model']" in k for k in targets) == n_model, \
                "the default restore did not read the model in place"
        if target is not None:
            assert_state_identical({"model": target.model.state_dict(),
                                    "optimizer": target.optimizer.state_dict()}, self.want)
        elif name in ("read_xla_ckpt", "read_xla_ckpt_mmap"):
            assert_state_identical(dict(self.last["model"]), dict(self.want["model"]))
        self.last = None


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(method: str, tmp: str) -> None:
    """``--child``: run ``method`` once in this fresh process; print its peak RSS above baseline."""
    bench = Bench(tmp)                            # the parent saved both files in ``tmp``
    fn = bench.method(method)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                              # reset VmHWM to the current RSS
    base = status_kib("VmRSS")
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    peak = status_kib("VmHWM")
    print(json.dumps({"method": method, "fresh_process_seconds": round(seconds, 4),
                      "peak_rss_over_baseline_mib": round((peak - base) / 1024, 1),
                      "x_state": round((peak - base) * 1024 / bench.nbytes, 2)}))


def rss(methods: list[str], tmp: str, huge_pages: str, repeat: int) -> dict[str, dict]:
    """Each method ``repeat`` times in fresh processes, round-robin: median seconds, worst RSS."""
    got: dict[str, list[dict]] = {m: [] for m in methods}
    for _ in range(repeat):
        for m in methods:
            r = subprocess.run([sys.executable, __file__, "--child", m, "--tmp", tmp,
                                "--huge-pages", huge_pages],
                               capture_output=True, text=True, check=True)
            got[m].append(json.loads(r.stdout.strip().splitlines()[-1]))
    out = {}
    for m, lines in got.items():
        worst = max(lines, key=lambda d: d["peak_rss_over_baseline_mib"])
        out[m] = {"fresh_process_seconds": round(statistics.median(
                      d["fresh_process_seconds"] for d in lines), 4),
                  "fresh_process_runs": [d["fresh_process_seconds"] for d in lines],
                  "peak_rss_over_baseline_mib": worst["peak_rss_over_baseline_mib"],
                  "x_state": worst["x_state"]}
    return out


def _pread_all(fd: int, offsets: list[int], views: list[memoryview]) -> None:
    for off, v in zip(offsets, views, strict=True):
        os.preadv(fd, [v], off)


def breakdown(bench: Bench, repeat: int) -> dict[str, float]:
    """Medians (seconds) of the parts of ``xla_ckpt.load`` on the saved checkpoint."""
    parts: dict[str, list[float]] = {}

    def clock(name: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args)
        parts.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    for _ in range(repeat):
        resolved = clock("resolve_and_manifest", resolve, bench.folder)
        reader = open_reader(resolved)
        item = reader.manifest.item(STATE_ITEM)
        bufs = clock("read_fresh_buffers(read+crc32c+faults)", reader.read_blobs)
        clock("read_reused_buffers(read+crc32c)", reader.read_into, STATE_ITEM, bufs)
        views = [tensor_bytes(b) for b in bufs.values()]
        clock("crc32c_one_thread", lambda vs: [crc32c(v) for v in vs], views)
        fd = os.open(os.path.join(bench.folder, item.blobs[0].file), os.O_RDONLY)
        try:
            clock("preadv_reused_one_thread", _pread_all, fd,
                  [item.blobs[i].offset for i in bufs], views)
        finally:
            os.close(fd)
        clock("rebuild(views+typed decode)", materialize_item, item, bufs)
        reader.storage.close()
        clock("load_total", xla_ckpt.load, bench.folder)
        clock("trainer_restore_total", bench.restore_xla_ckpt)
        clock("trainer_restore_copy_total", bench.restore_xla_ckpt_copy)
    return {k: round(statistics.median(v), 4) for k, v in parts.items()}


def child_breakdown(tmp: str) -> None:
    """``--child-breakdown``: the parts of one ``xla_ckpt.load`` in this fresh process.

    Fresh memory is what a restarted job pays for and the loop hides, so the page faults get
    a line of their own: the arenas are prefaulted first (``buffers.prefault``, one madvise
    per arena: the kernel's allocation and zeroing of every page), then read into.
    """
    folder = os.path.join(tmp, "checkpoint_1_1")
    parts: dict[str, float] = {}

    def clock(name: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args)
        parts[name] = round(time.perf_counter() - t0, 4)
        return out

    resolved = clock("resolve_and_manifest", resolve, folder)
    rd = clock("open_reader", open_reader, resolved)
    item = rd.manifest.item(STATE_ITEM)
    bufs = clock("allocate_arenas", rd.allocate)
    storages = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes()
                for b in bufs.values() if b.numel()}
    def fault_in() -> None:
        for addr, nbytes in storages.items():
            buffers.prefault(addr, nbytes)

    clock("page_faults(prefault every arena)", fault_in)
    clock("read(copy+crc32c, pool)", rd.read_into, STATE_ITEM, bufs)
    clock("rebuild(views+typed decode)", materialize_item, item, bufs)
    rd.storage.close()
    print(json.dumps({"fresh_breakdown_seconds": parts}))


def breakdown_fresh(tmp: str, repeat: int) -> dict[str, float]:
    """Medians of :func:`child_breakdown` over ``repeat`` fresh processes."""
    runs: list[dict[str, float]] = []
    for _ in range(repeat):
        r = subprocess.run([sys.executable, __file__, "--child-breakdown", "--tmp", tmp],
                           capture_output=True, text=True, check=True)
        runs.append(json.loads(r.stdout.strip().splitlines()[-1])["fresh_breakdown_seconds"])
    return {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}


def cpu_seconds() -> float:
    """User + system CPU time of this process, every thread (less moved by other load than
    wall time on a shared machine)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def vmstat() -> dict[str, int]:
    """Kernel counters of huge-page faults and compaction stalls (deltas go in the output)."""
    keep = ("thp_fault_alloc", "thp_fault_fallback", "compact_stall")
    with open("/proc/vmstat") as f:
        return {k: int(v) for k, v in (line.split() for line in f) if k in keep}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--methods", default=",".join(ORDER))
    ap.add_argument("--rss", action="store_true")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--fresh-repeat", type=int, default=3,
                    help="with --rss: fresh processes per method (median seconds, worst RSS)")
    ap.add_argument("--huge-pages", choices=("auto", "on", "off"), default="auto",
                    help="xla_ckpt.io.buffers.HUGE_PAGES for fresh buffers (auto: only where "
                         "the kernel's THP settings cannot stall a fault)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-breakdown", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    args = ap.parse_args()
    buffers.HUGE_PAGES = {"auto": None, "on": True, "off": False}[args.huge_pages]
    if args.child:
        child(args.child, args.tmp)
        return
    if args.child_breakdown:
        child_breakdown(args.tmp)
        return
    methods = args.methods.split(",")
    tmp = tempfile.mkdtemp(prefix="xla_ckpt_bench_")
    bench = Bench(tmp)
    bench.save_xla_ckpt()
    bench.save_torch()
    runs: dict[str, list[float]] = {m: [] for m in methods}
    cpu: dict[str, list[float]] = {m: [] for m in methods}
    kernel = vmstat()
    for _ in range(args.repeat):
        for m in methods:
            c0, t0 = cpu_seconds(), time.perf_counter()
            bench.method(m)()
            runs[m].append(time.perf_counter() - t0)
            cpu[m].append(cpu_seconds() - c0)
            bench.check(m)
    results = {m: statistics.median(v) for m, v in runs.items()}
    kernel = {k: v - kernel[k] for k, v in vmstat().items()}
    memory = rss(methods, tmp, args.huge_pages, args.fresh_repeat) if args.rss else {}
    for name, sec in results.items():
        line: dict[str, Any] = {"method": name, "seconds": round(sec, 4),
                                "runs": [round(t, 4) for t in runs[name]],
                                "cpu_seconds": round(statistics.median(cpu[name]), 4),
                                "state_mib": round(bench.nbytes / 2**20, 1),
                                "mib_s": round(bench.nbytes / 2**20 / sec, 1)}
        if PEERS.get(name) in results:
            line["ratio_vs_peer"] = round(results[PEERS[name]] / sec, 2)
            line["peer"] = PEERS[name]
        if name in memory:
            line.update(memory[name])
            fresh_peer = memory.get(PEERS.get(name, ""))
            if fresh_peer is not None:
                line["fresh_ratio_vs_peer"] = round(fresh_peer["fresh_process_seconds"]
                                                    / memory[name]["fresh_process_seconds"], 2)
        print(json.dumps(line), flush=True)
    print(json.dumps({"kernel_counters_during_timed_runs": kernel, "huge_pages": args.huge_pages,
                      "huge_pages_stall_free": buffers.huge_pages_stall_free()}), flush=True)
    if args.breakdown:
        print(json.dumps({"breakdown_seconds": breakdown(bench, args.repeat)}), flush=True)
        print(json.dumps({"fresh_process_breakdown_seconds":
                          breakdown_fresh(tmp, args.fresh_repeat)}), flush=True)


if __name__ == "__main__":
    main()
