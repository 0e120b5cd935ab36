"""Local tier on an accelerator: the save's stall from CUDA memory and the restore's
host-to-device rate, each against torch's own copies (issue 24 item 10).

One prepared script for one GPU that fits in 10 minutes (512 MiB state, ``--repeat 5``: about
a minute on an H200 host).  It has two halves and prints which ran:

device half (only with CUDA; state: ``--size-mib`` MiB of fp32 tensors in CUDA memory)
  cuda_local_save_stall         ``mgr.after_update`` starting a local save (tmpfs local tier,
                                durable schedule off, warmed up so the evicted step's files
                                are recycled): the device-to-host copy straight into the
                                local data files' pages (pageable), on the training thread
  cuda_local_save_stall_pinned  the same with those pages registered with CUDA
                                (``cudaHostRegister``, once per mapping: a patch of
                                ``MappedPages.open`` made here; not a library option today)
  cuda_d2h_pageable             torch: ``copy_`` of each tensor into preallocated pageable host
                                tensors, then ``synchronize``
  cuda_d2h_pinned               torch: the same into pinned host tensors
  cuda_local_restore_to_device  a fresh manager: ``restore_or_initialize(map_location="cuda")``
                                from the local tier, then ``synchronize``
  cuda_h2d_restored             ``.to("cuda")`` of the tensors a host restore returned
                                (the restore's pageable buffers), then ``synchronize``
  cuda_h2d_pageable             torch: preallocated pageable host tensors ``.to("cuda")``
  cuda_h2d_pinned               torch: pinned host tensors ``.to("cuda", non_blocking=True)``,
                                then ``synchronize`` (torch's own pinned rate)
cpu half (always; the same state in host memory)
  cpu_local_save_stall, cpu_copy_preallocated   the save's stall against ``dst.copy_(src)``
  cpu_local_restore, cpu_memcpy                 a fresh manager's local-tier restore against
                                                ``copy_`` into preallocated host tensors

The durable tier is a folder on local disk (the device machine reaches no GCS; the decision
then costs no round trip), the local tier a fresh folder under ``/dev/shm``; both are removed
at the end.  Every line has ``seconds`` (median of ``--repeat``) and ``gib_s``; the last line
is ``{"summary": ...}`` with the ratios and which halves ran.

  .venv/bin/python benchmarks/device_local_tier.py [--size-mib 512] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402 - after the sys.path insert above

from benchmarks.gcs_restore import state_layout  # noqa: E402 - as above
from xla_ckpt.io import mapped_writer  # noqa: E402 - as above
from xla_ckpt.manager import CheckpointConfig, CheckpointManager  # noqa: E402 - as above

GiB = 1024**3
DEVICE = "cuda"  # the device half's device


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


def note(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def make_state(size_mib: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(1234)
    return {k: torch.rand(shape, generator=g, device=device) for k, shape in
            state_layout(size_mib)}


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def config(run: str, local: str) -> CheckpointConfig:
    return CheckpointConfig(save_dir=run, local_dir=local, local_interval_updates=1,
                            save_interval_updates=0, save_interval_epochs=0,
                            handle_sigterm=False)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def pin_pages(pages: mapped_writer.MappedPages) -> Callable[[], None]:
    """From now on each mapping of the local tier's pages that ``pages`` (one manager's)
    hands out is registered with CUDA once (``cudaHostRegister``: page-locked, so the save's
    device-to-host copy is DMA straight into the data files' pages).  Returns the function
    that unregisters them.  A benchmark-only patch of that one object's ``open``: pinned
    pages are not a library option today."""
    plain = pages.open
    registered: dict[int, int] = {}

    def open_pages(path: str, size: int) -> torch.Tensor:
        view = plain(path, size)
        storage = view.untyped_storage()
        base, n = storage.data_ptr(), storage.nbytes()
        if registered.get(base) != n:
            if base in registered:
                torch.cuda.cudart().cudaHostUnregister(base)
            rc = torch.cuda.cudart().cudaHostRegister(base, n, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of {n} bytes of {path} failed: {rc}")
            registered[base] = n
        return view

    pages.open = open_pages  # type: ignore[method-assign]  # benchmark-only, this object only

    def unpin() -> None:
        for base in registered:
            torch.cuda.cudart().cudaHostUnregister(base)
        registered.clear()
    return unpin


class Saver:
    """One manager saving ``state`` to its local tier at every call (warmed up)."""

    def __init__(self, work: str, name: str, state: dict[str, torch.Tensor],
                 warmup: int) -> None:
        self.run = tempfile.mkdtemp(prefix="xla_ckpt_dev_durable_")  # local disk
        self.local = os.path.join(work, name)
        self.mgr = CheckpointManager(config(self.run, self.local))
        self.state, self.u = state, 0
        for _ in range(warmup):
            self()

    def __call__(self) -> float:
        self.u += 1
        sync()
        t = time.perf_counter()
        r = self.mgr.after_update(epoch=1, num_updates=self.u, state=self.state)
        secs = time.perf_counter() - t
        assert r.saved, f"update {self.u} did not start a local save"
        self.mgr.wait()
        return secs

    def restore(self, map_location: Any = None) -> tuple[float, Any]:
        mgr = CheckpointManager(config(self.run, self.local))
        try:
            sync()
            t = time.perf_counter()
            res = mgr.restore_or_initialize(map_location=map_location)
            sync()
            secs = time.perf_counter() - t
        finally:
            mgr.close()
        assert res is not None and res.tier is not None and res.tier["tier"] == "local", \
            "the restore did not read the local tier"
        return secs, res.state

    def close(self) -> None:
        self.mgr.close()
        shutil.rmtree(self.run, ignore_errors=True)


def copies(src: dict[str, torch.Tensor], pin: bool = False,
           device: str = "cpu") -> dict[str, torch.Tensor]:
    out = {k: torch.empty(v.shape, dtype=v.dtype, device=device, pin_memory=pin)
           for k, v in src.items()}
    for k, v in src.items():
        out[k].copy_(v)
    sync()
    return out


def copy_into(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor],
              non_blocking: bool = False) -> float:
    sync()
    t = time.perf_counter()
    for k, v in src.items():
        dst[k].copy_(v, non_blocking=non_blocking)
    sync()
    return time.perf_counter() - t


def measure(fns: dict[str, Callable[[], float]], repeat: int, half: str,
            size: int) -> dict[str, float]:
    """Round-robin ``repeat`` times; one line per method; medians."""
    runs: dict[str, list[float]] = {m: [] for m in fns}
    for _ in range(repeat):
        for m, fn in fns.items():
            gc.collect()
            runs[m].append(fn())
    out = {}
    for m, secs in runs.items():
        out[m] = statistics.median(secs)
        emit({"method": m, "half": half, "size_mib": round(size / 2**20, 1),
              "seconds": round(out[m], 4), "runs_seconds": [round(s, 4) for s in secs],
              "gib_s": round(size / GiB / out[m], 2)})
    return out


def cpu_half(a: argparse.Namespace, work: str) -> dict[str, float]:
    state = make_state(a.size_mib, "cpu")
    size = nbytes(state)
    dst = copies(state)
    saver = Saver(work, "local_cpu", state, a.warmup)
    try:
        def restore() -> float:
            secs, got = saver.restore()
            assert all(torch.equal(got[k], state[k]) for k in state), "restore differs"
            return secs

        return measure({"cpu_local_save_stall": saver,
                        "cpu_copy_preallocated": lambda: copy_into(dst, state),
                        "cpu_local_restore": restore,
                        "cpu_memcpy": lambda: copy_into(dst, state)}, a.repeat, "cpu", size)
    finally:
        saver.close()


def device_half(a: argparse.Namespace, work: str) -> dict[str, float]:
    dev = DEVICE
    state = make_state(a.size_mib, dev)
    size = nbytes(state)
    host_pageable = copies(state)
    host_pinned = copies(state, pin=True)
    on_dev = copies(state, device=dev)
    saver = Saver(work, "local_cuda", state, 0)
    saver_pinned = Saver(work, "local_cuda_pinned", state, 0)
    unpin = pin_pages(saver_pinned.mgr._pages)
    try:
        for _ in range(a.warmup):
            saver()
            saver_pinned()

        def stall_pinned() -> float:
            return saver_pinned()

        def restore_to_device() -> float:
            secs, got = saver.restore(map_location=dev)
            assert all(got[k].device.type == dev and torch.equal(got[k], state[k])
                       for k in state), "restore to device differs"
            return secs

        restored_host = saver.restore()[1]

        def h2d_restored() -> float:
            sync()
            t = time.perf_counter()
            got = {k: v.to(dev) for k, v in restored_host.items()}
            sync()
            secs = time.perf_counter() - t
            del got
            return secs

        return measure({
            "cuda_local_save_stall": saver,
            "cuda_local_save_stall_pinned": stall_pinned,
            "cuda_d2h_pageable": lambda: copy_into(host_pageable, state),
            "cuda_d2h_pinned": lambda: copy_into(host_pinned, state, non_blocking=True),
            "cuda_local_restore_to_device": restore_to_device,
            "cuda_h2d_restored": h2d_restored,
            "cuda_h2d_pageable": lambda: copy_into(on_dev, host_pageable),
            "cuda_h2d_pinned": lambda: copy_into(on_dev, host_pinned, non_blocking=True),
        }, a.repeat, "device", size)
    finally:
        saver.close()
        unpin()  # before the manager unmaps the pages
        saver_pinned.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=4,
                    help="saves before the timed ones (keep-last-K + 2: evicted files recycled)")
    ap.add_argument("--shm", default="/dev/shm", help="tmpfs of the local tier")
    a = ap.parse_args(argv)
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    work = tempfile.mkdtemp(prefix="xla_ckpt_dev_", dir=a.shm)
    s: dict[str, Any] = {"summary": "local tier on a device (issue 24 item 10)",
                         "size_mib": a.size_mib, "halves": {}}
    try:
        cpu = cpu_half(a, work)
        s["halves"]["cpu"] = "ran"
        s["cpu_stall_vs_copy"] = round(cpu["cpu_local_save_stall"] /
                                       cpu["cpu_copy_preallocated"], 3)
        s["cpu_restore_vs_memcpy"] = round(cpu["cpu_local_restore"] / cpu["cpu_memcpy"], 3)
        if not cuda:
            s["halves"]["device"] = "not run: torch.cuda.is_available() is False"
            note("no CUDA device: only the CPU half ran")
        else:
            s["device"] = torch.cuda.get_device_name()
            d = device_half(a, work)
            s["halves"]["device"] = "ran"
            s["cuda_stall_vs_d2h_pageable"] = round(d["cuda_local_save_stall"] /
                                                    d["cuda_d2h_pageable"], 3)
            s["cuda_stall_pinned_vs_d2h_pinned"] = round(d["cuda_local_save_stall_pinned"] /
                                                         d["cuda_d2h_pinned"], 3)
            s["cuda_stall_pageable_over_pinned"] = round(d["cuda_local_save_stall"] /
                                                         d["cuda_local_save_stall_pinned"], 3)
            s["cuda_h2d_restored_rate_vs_pinned"] = round(d["cuda_h2d_pinned"] /
                                                          d["cuda_h2d_restored"], 3)
            s["cuda_h2d_pageable_rate_vs_pinned"] = round(d["cuda_h2d_pinned"] /
                                                          d["cuda_h2d_pageable"], 3)
            s["cuda_restore_to_device_vs_h2d_pinned"] = round(
                d["cuda_local_restore_to_device"] / d["cuda_h2d_pinned"], 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    s["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
