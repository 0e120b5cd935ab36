"""Control requests per restore: the storage requests that are not data ranges, counted.

Before the first byte of a checkpoint is read, a restore decides which checkpoint (lists the
run folder, reads the ``checkpoint_last`` pointer, stats and downloads manifests) and
opens it.  On GCS each of those is a round trip.  This benchmark counts them through
:class:`~xla_ckpt.testing.fault_proxy.FaultProxy` (its request log) in front of the GCS
emulator, for three entry points:

  load      ``xla_ckpt.load(run)`` on every rank (a single-process API: each process
            decides for itself, so its total grows with the ranks by design; its
            per-rank figure is the one to read)
  manager   ``CheckpointManager(...).restore_or_initialize()`` (constructor included)
  trainer   ``xla_ckpt.trainer.Checkpointer(...).load_checkpoint(run)`` with the default
            restorer

on 1, 2 and 4 ranks (real gloo worker processes from :mod:`xla_ckpt.testing.launcher`, one
emulated host, the default process group up as in a training job; each rank's connections
leave from its own loopback address, so the log says which rank sent what) and for run
folders holding 3 and 100 committed checkpoints of a tiny training state (a ``Linear(4, 2)``
with AdamW), written once by a ``CheckpointManager`` and reused by every measurement.

Kinds of request (GCS JSON API, from the proxy's log):

  list      an object listing (``GET /storage/v1/b/B/o``); ``list_recursive`` of them had
            neither a delimiter nor a ``matchGlob`` (every object under the prefix, data
            files included)
  stat      object metadata (``GET /storage/v1/b/B/o/NAME``)
  manifest  a download of a ``manifest.json``
  pointer   a download of ``checkpoint_last.json`` / ``checkpoint_best.json``
  lease     a download or a write of ``lease.json``
  bucket    bucket metadata (``GET /storage/v1/b/B``)
  write     any other upload, delete, compose or patch
  other     anything else
  data      a download of anything else (data files): not a control request, shown apart

``control`` is the sum of every kind but ``data``.  The issue's four columns are ``list``,
``stat`` ("object metadata"), ``manifest`` and ``pointer + lease + bucket + write + other``.

One JSON line per entry point x ranks x checkpoints kept: ``counts`` by kind (all ranks),
``per_rank`` (each rank's counts by kind), ``control`` (total), ``control_per_rank``, the
checkpoint every rank restored (``restored_num_updates``: always the newest), the number of
distinct manifests downloaded and the most any process downloaded one manifest.  A last
``{"summary": ...}`` line gives per entry point the control total at each size and world
size, ``growth_100_vs_3`` (control requests with 100 kept / with 3) and
``growth_per_rank_4_vs_1`` (per-rank average on 4 ranks / on 1), and, with ``--compare
FILE`` (an earlier run's output), ``ratio_vs_<label>`` per line (that run's control
total / this one's: > 1 means fewer requests now).

  .venv/bin/python benchmarks/control_requests.py --label before \\
      --out benchmarks/results/control_requests_before.jsonl
  .venv/bin/python benchmarks/control_requests.py --label after \\
      --out benchmarks/results/control_requests_after.jsonl \\
      --compare benchmarks/results/control_requests_before.jsonl

Uses the public API only (``xla_ckpt.load``, ``xla_ckpt.manager.CheckpointManager``,
``xla_ckpt.trainer.Checkpointer``) plus the testing helpers.  Counts, not timings: the
figures are the same on every run (``--repeat 2`` checks that).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

KINDS = ("list", "stat", "manifest", "pointer", "lease", "bucket", "write", "other")
"""Control kinds, in the order lines show them (``data`` is counted apart)."""
ISSUE_COLUMNS = {"listings": ("list",), "object_metadata": ("stat",),
                 "manifest_downloads": ("manifest",),
                 "other": ("pointer", "lease", "bucket", "write", "other")}
ENTRIES = ("load", "manager", "trainer")
SOURCE_ADDRESS_ENV = "XLA_CKPT_GCS_SOURCE_ADDRESS"  # the launcher's per-host variable
_BUCKET_PATH = re.compile(r"^/storage/v1/b/[^/]+/?$")
_LIST_PATH = re.compile(r"^/storage/v1/b/[^/]+/o/?$")
_POINTERS = ("checkpoint_last.json", "checkpoint_best.json")


# ---- what each rank runs -------------------------------------------------------------------
def _config(run: str) -> Any:
    """The manager's config for ``run`` (CheckpointConfig moves between releases)."""
    import importlib

    for module in ("xla_ckpt.manager", "xla_ckpt.config"):  # its home after / before issue 23
        cls = getattr(importlib.import_module(module), "CheckpointConfig", None)
        if cls is not None:
            return cls(save_dir=run, async_save=False, handle_sigterm=False,
                       save_interval_epochs=0)
    raise ImportError("no CheckpointConfig in xla_ckpt.manager or xla_ckpt.config")


def _trainer(rank: int) -> Any:
    import torch

    from xla_ckpt.trainer import Checkpointer

    torch.manual_seed(0)
    return Checkpointer(model=torch.nn.Linear(4, 2),
                        build_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
                        rank=rank)


def restore_once(entry: str, run: str) -> int:
    """One restore of ``run`` through ``entry`` on this rank; the num_updates it restored."""
    import torch.distributed as tdist

    from xla_ckpt.testing.fault_proxy import host_address

    rank = int(os.environ.get("RANK", "0"))
    os.environ[SOURCE_ADDRESS_ENV] = host_address(rank)  # the proxy's log names the rank
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not tdist.is_initialized():
        tdist.init_process_group("gloo", init_method="env://")  # as a training job has it
    if entry == "load":
        import xla_ckpt

        state = xla_ckpt.load(run)
        return int(state["optimizer_history"][-1]["num_updates"])
    if entry == "manager":
        from xla_ckpt.manager import CheckpointManager

        mgr = CheckpointManager(_config(run))
        try:
            result = mgr.restore_or_initialize()
        finally:
            mgr.close()
        assert result is not None and result.num_updates is not None, \
            f"rank {rank}: nothing restored from {run}"
        return int(result.num_updates)
    ckpt = _trainer(rank)
    ckpt.load_checkpoint(run)
    return int(ckpt.get_num_updates())


def populate(run: str, count: int) -> None:
    """Commit ``count`` checkpoints of a tiny trainer state in ``run`` (this process)."""
    import torch

    from xla_ckpt.manager import CheckpointManager

    ckpt = _trainer(0)
    loss = ckpt.model(torch.ones(3, 4)).sum()
    loss.backward()
    ckpt.optimizer.step()
    with CheckpointManager(_config(run)) as mgr:
        for n in range(1, count + 1):
            ckpt.set_num_updates(n)
            mgr.save(ckpt.state_dict({"train_iterator": {"epoch": 1, "iterations_in_epoch": n,
                                                          "version": 2}}),
                     epoch=1, num_updates=n, block=True)


# ---- counting ------------------------------------------------------------------------------
def classify(rec: Any) -> str:
    """The kind of one logged request (module docstring)."""
    name = rec.object_name
    base = name.rsplit("/", 1)[-1]
    if rec.method == "GET" and not name:
        if _LIST_PATH.match(rec.path):
            return "list"
        if _BUCKET_PATH.match(rec.path):
            return "bucket"
        return "other"
    if base == "lease.json":
        return "lease"
    if rec.info.is_download:
        if base == "manifest.json":
            return "manifest"
        if base in _POINTERS:
            return "pointer"
        return "data"
    if rec.method == "GET":
        return "stat"
    if rec.method in ("POST", "PUT", "PATCH", "DELETE"):
        return "write"
    return "other"


def count(records: list[Any], world_size: int) -> dict[str, Any]:
    """Counts by kind, per rank (by source address) and the manifest downloads' spread."""
    from xla_ckpt.testing.fault_proxy import host_address

    rank_of = {host_address(r): r for r in range(world_size)}
    total: Counter[str] = Counter()
    per_rank: dict[int, Counter[str]] = {r: Counter() for r in range(world_size)}
    manifests: Counter[tuple[int, str]] = Counter()
    recursive = 0
    for rec in records:
        kind = classify(rec)
        rank = rank_of.get(rec.client_address, -1)
        total[kind] += 1
        per_rank.setdefault(rank, Counter())[kind] += 1
        if kind == "manifest":
            manifests[(rank, rec.object_name)] += 1
        if kind == "list" and "delimiter=" not in rec.query and "matchGlob=" not in rec.query:
            recursive += 1
    control = sum(total[k] for k in KINDS)
    return {
        "counts": {k: total[k] for k in KINDS},
        "issue_columns": {c: sum(total[k] for k in ks) for c, ks in ISSUE_COLUMNS.items()},
        "control": control,
        "data_requests": total["data"],
        "list_recursive": recursive,
        "per_rank": {str(r): {k: c[k] for k in KINDS if c[k]} for r, c in sorted(per_rank.items())},
        "control_per_rank": {str(r): sum(c[k] for k in KINDS) for r, c in sorted(per_rank.items())},
        "list_max_per_process": max((c["list"] for c in per_rank.values()), default=0),
        "manifests_distinct": len({name for _, name in manifests}),
        "manifest_max_per_process": max(manifests.values(), default=0),
    }


def measure(pool: Any, proxy: Any, entry: str, run: str, world_size: int) -> dict[str, Any]:
    proxy.reset_log()
    t0 = time.perf_counter()
    values = [r.unwrap() for r in pool.run(restore_once, entry, run, timeout_s=600)]
    seconds = time.perf_counter() - t0
    got = count(proxy.records(), world_size)
    got["restored_num_updates"] = sorted(set(values))
    got["seconds"] = round(seconds, 3)
    return got


# ---- the run -------------------------------------------------------------------------------
def summarize(lines: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for entry in ENTRIES:
        mine = [ln for ln in lines if ln["entry"] == entry]
        if not mine:
            continue
        by = {(ln["ranks"], ln["kept"]): ln for ln in mine}
        e: dict[str, Any] = {"control": {f"{r}x{k}": ln["control"]
                                         for (r, k), ln in sorted(by.items())}}
        kept = sorted({k for _, k in by})
        ranks = sorted({r for r, _ in by})
        if len(kept) > 1:
            lo, hi = kept[0], kept[-1]
            e[f"growth_{hi}_vs_{lo}"] = {
                str(r): round(by[(r, hi)]["control"] / max(by[(r, lo)]["control"], 1), 3)
                for r in ranks if (r, lo) in by and (r, hi) in by}
        if len(ranks) > 1:
            lo, hi = ranks[0], ranks[-1]
            e[f"growth_per_rank_{hi}_vs_{lo}"] = {
                str(k): round((by[(hi, k)]["control"] / hi)
                              / max(by[(lo, k)]["control"] / lo, 1e-9), 3)
                for k in kept if (lo, k) in by and (hi, k) in by}
        e["max_list_per_restore"] = max(ln["counts"]["list"] for ln in mine)
        e["max_list_per_process"] = max(ln.get("list_max_per_process", 0) for ln in mine)
        e["max_recursive_lists"] = max(ln["list_recursive"] for ln in mine)
        e["max_manifest_per_process"] = max(ln["manifest_max_per_process"] for ln in mine)
        out[entry] = e
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--label", choices=("before", "after"), required=True,
                    help="which column these figures are (written into every line)")
    ap.add_argument("--out", help="also write the JSON lines to this file")
    ap.add_argument("--ranks", default="1,2,4", help="world sizes (default 1,2,4)")
    ap.add_argument("--kept", default="3,100", help="checkpoints kept (default 3,100)")
    ap.add_argument("--entries", default=",".join(ENTRIES),
                    help="entry points (default load,manager,trainer)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure each case this many times; counts must agree")
    ap.add_argument("--compare", help="an earlier run's output: add ratio_vs_<its label>")
    args = ap.parse_args()
    ranks = [int(x) for x in args.ranks.split(",")]
    kept = [int(x) for x in args.kept.split(",")]
    entries = [e for e in args.entries.split(",") if e]
    for e in entries:
        if e not in ENTRIES:
            ap.error(f"unknown entry point {e!r}; choose from {', '.join(ENTRIES)}")

    import logging

    logging.basicConfig(level=logging.ERROR)
    from xla_ckpt.testing.fault_proxy import FaultProxy
    from xla_ckpt.testing.gcs_emulator import GCSEmulator
    from xla_ckpt.testing.launcher import WorkerPool

    earlier: dict[tuple, dict] = {}
    earlier_label = ""
    if args.compare:
        with open(args.compare) as f:
            for raw in f:
                doc = json.loads(raw)
                if "entry" in doc:
                    earlier[(doc["entry"], doc["ranks"], doc["kept"])] = doc
                    earlier_label = doc.get("label", "earlier")

    lines: list[dict[str, Any]] = []
    out = open(args.out, "w") if args.out else None

    def emit(doc: dict[str, Any]) -> None:
        text = json.dumps(doc, sort_keys=False)
        print(text, flush=True)
        if out is not None:
            out.write(text + "\n")
            out.flush()

    with GCSEmulator() as emu, FaultProxy(emu.host) as proxy:
        os.environ.update(emu.env())  # this process writes the run folders straight to it
        runs = {}
        for k in kept:
            runs[k] = emu.unique_uri("control") + f"/run{k}"
            t0 = time.perf_counter()
            populate(runs[k], k)
            print(f"# wrote {k} checkpoints to {runs[k]} in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
        env = {**emu.env(), **proxy.env()}
        for world in ranks:
            with WorkerPool(world, xla=False, env=env) as pool:
                for entry in entries:
                    for k in kept:
                        got = [measure(pool, proxy, entry, runs[k], world)
                               for _ in range(max(args.repeat, 1))]
                        first = got[0]
                        stable = all(g["counts"] == first["counts"] for g in got)
                        if first["restored_num_updates"] != [k]:
                            raise SystemExit(f"{entry} on {world} ranks restored "
                                             f"{first['restored_num_updates']}, not the newest "
                                             f"checkpoint ({k})")
                        doc = {"label": args.label, "entry": entry, "ranks": world, "kept": k,
                               **first, "stable": stable}
                        before = earlier.get((entry, world, k))
                        if before is not None:
                            doc[f"ratio_vs_{earlier_label}"] = round(
                                before["control"] / max(first["control"], 1), 3)
                        lines.append(doc)
                        emit(doc)
    emit({"summary": summarize(lines), "label": args.label})
    if out is not None:
        out.close()


if __name__ == "__main__":
    main()
