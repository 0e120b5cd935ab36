"""Reliability benchmark: the full counts of tests/reliability, with figures for RELIABILITY.md.

Parts (``--parts``, default all):

  crash   SIGKILL a saver at ``--crash-points`` points of its write sequence (local and on the
          GCS emulator, sync save) and ``--async-points`` points of an async save; after each
          kill a fresh process checks the committed set, ``xla-ckpt ls``, "latest", bitwise
          restores of every committed checkpoint, and that a resumed job saves and restores.
  faults  8 gloo ranks restore (every rank reads) through the fault proxy until ``--faults``
          faults were injected (random 503/429/reset/short body/flipped byte, 12 % of
          requests), then a storm (60 %, 3 attempts) of ``--storm-faults``; also clean rounds,
          so the time cost of faults is a ratio measured in the same run.
  ranks   4 gloo ranks, both strategies: a rank raises during its read (403), stalls past the
          timeout, is SIGKILLed, or is the coordinator and dies; ``--rank-repeats`` each.  Also
          the cost of the liveness progress marks: ``--exchanges`` control-plane exchanges
          timed with and without them in the same processes (a ratio).
  soak    ``--soak-cycles`` async save + restore cycles with rotation, on local disk and on
          the emulator's bucket: usage, RSS slope, threads, fds, bitwise.

Each part prints one JSON line of figures; ``--out FILE`` also writes them all as one JSON
document.  Every harness lives in tests/reliability/ (the same code the CI subset runs).

  .venv/bin/python benchmarks/reliability.py                       # everything, full counts
  .venv/bin/python benchmarks/reliability.py --parts crash --crash-points 60
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "reliability"))
os.environ.setdefault("PJRT_DEVICE", "CPU")


def emit(name: str, figures: dict, sink: dict) -> None:
    sink[name] = figures
    print(json.dumps({"part": name, **figures}, default=str), flush=True)


# ---- crash ---------------------------------------------------------------------------------

def part_crash(emu, args, sink) -> None:
    import crash_harness as H

    from xla_ckpt.testing.launcher import WorkerPool

    tmp = tempfile.mkdtemp(prefix="xla-ckpt-crash-")
    runs = [("local", "sync", args.crash_points), ("gcs", "sync", args.crash_points),
            ("local", "async", args.async_points), ("gcs", "async", args.async_points)]
    with WorkerPool(1, xla=False, env=emu.env()) as zygote:
        for backend, mode, count in runs:
            base = os.path.join(tmp, f"{backend}-{mode}") if backend == "local" \
                else emu.unique_uri(f"crash-{mode}")
            (res,) = zygote.run(H.campaign, base, backend, mode, count, timeout_s=3600,
                                emulator_host=emu.host, bucket=emu.bucket)
            out = res.unwrap()
            results = out["results"]
            violations = [v for r in results for v in H.check(r)]
            lost = sum(1 for r in results
                       if H.B not in r["verify"].get("committed", [])
                       or any(r["verify"].get("bitwise", {}).values())
                       or r["verify"].get("resumed_bitwise"))
            torn_listed = sum(1 for r in results if not r["expect_committed"]
                              and H.C in r["verify"].get("ls_committed", []))
            emit(f"crash_{backend}_{mode}", {
                "kill_points": len(results), "mutating_steps": len(out["steps"]),
                "commit_step": out["commit_step"],
                "points_before_commit": sum(not r["expect_committed"] for r in results),
                "points_after_commit": sum(r["expect_committed"] for r in results),
                "points_inside_a_body": sum(r["point"]["at"] == "byte" for r in results),
                "sigkilled": sum(r["exitcode"] == -9 for r in results),
                "violations": len(violations), "violation_samples": violations[:5],
                "lost_checkpoints": lost, "torn_listed_as_committed": torn_listed,
                "recovered_and_saved_again": sum("recovered" in r["verify"] for r in results),
                "kills_leaving_temp_objects": sum(bool(r["verify"].get("strays_after_kill"))
                                                  for r in results),
                "seconds": round(out["seconds"], 1)}, sink)


# ---- faults ---------------------------------------------------------------------------------

def part_faults(emu, args, sink) -> None:
    import faults_harness as F

    from xla_ckpt.testing.fault_proxy import FaultProxy
    from xla_ckpt.testing.launcher import WorkerPool

    kib = 1024
    moderate = dict(max_workers=4, slice_size_bytes=512 * kib, initial_backoff_s=0.01,
                    max_backoff_s=0.2, max_attempts=8, retry_deadline_s=60.0)
    storm = dict(moderate, max_attempts=3)
    uri = emu.unique_uri("faults")
    saved = dict(os.environ)
    os.environ.update(emu.env())
    try:
        F.save_fault_checkpoint(uri)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    with WorkerPool(F.WORLD, xla=False) as pool, FaultProxy(emu.host, seed=args.seed) as proxy:
        pool.run(F.restore_round, uri, moderate, 120.0, timeout_s=180, env=proxy.env())  # warm-up
        clean = []
        for _ in range(args.clean_rounds):  # the peer: the same restores with no faults
            t0 = time.perf_counter()
            res = pool.run(F.restore_round, uri, moderate, 120.0, timeout_s=180, env=proxy.env())
            clean.append(time.perf_counter() - t0)
            assert all(r.value and r.value["outcome"] == "correct" for r in res), res
        t = F.run_rounds(pool, proxy, uri, min_faults=args.faults, probability=0.12,
                         storage_kwargs=moderate)
        per_round = t["seconds"] / max(t["rounds"], 1)
        t["seconds_per_round"] = round(per_round, 3)
        t["clean_seconds_per_round"] = round(statistics.median(clean), 3)
        t["ratio_vs_clean_rounds"] = round(per_round / statistics.median(clean), 2)
        emit("faults_moderate", t, sink)
        s = F.run_rounds(pool, proxy, uri, min_faults=args.storm_faults, probability=0.6,
                         storage_kwargs=storm)
        emit("faults_storm", s, sink)


# ---- rank failures ---------------------------------------------------------------------------

def part_ranks(emu, args, sink) -> None:
    import rank_workers as W

    from xla_ckpt.comm.liveness import DEAD_AFTER_S
    from xla_ckpt.io import save
    from xla_ckpt.testing.fault_proxy import Fault, FaultProxy, downloads
    from xla_ckpt.testing.launcher import WorkerPool

    timeout_s = 3.0
    state, ranks = W.checkpoint_state()
    local = os.path.join(tempfile.mkdtemp(prefix="xla-ckpt-ranks-"), "ckpt")
    save(state, local, rank_states=ranks)
    gcs = emu.unique_uri("ranks")
    saved = dict(os.environ)
    os.environ.update(emu.env())
    try:
        save(state, gcs, rank_states=ranks)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    cases = []
    for strategy in ("all_ranks", "broadcast", "broadcast_host_memory"):
        cases += [(strategy, "raise", 2 if strategy == "all_ranks" else 0),
                  (strategy, "stall", 2), (strategy, "kill", 2), (strategy, "coordinator", 0)]
    rows = []
    for strategy, scenario, victim in cases:
        for _ in range(args.rank_repeats):
            env = {}
            proxy = None
            if scenario == "raise":
                proxy = FaultProxy(emu.host).start()
                target = "rank-00002" if strategy == "all_ranks" else "-state.safetensors"
                proxy.inject(Fault.error(403), match=downloads(target), times=1000)
                env = proxy.env()
            with WorkerPool(4, xla=False) as pool:
                res = pool.run(W.restore_with_victim, gcs if proxy else local, strategy, scenario,
                               victim, timeout_s, timeout_s=60.0, env=env)
            if proxy is not None:
                proxy.stop()
            survivors = [r for r in res if r.rank != victim]
            named = sum(1 for r in survivors if r.value and r.value.get("failures", {}).keys()
                        == {victim})
            rows.append({"strategy": strategy, "scenario": scenario, "victim": victim,
                         "hangs": sum(r.timed_out for r in res),
                         "survivors": len(survivors), "survivors_naming_victim": named,
                         "slowest_survivor_s": round(max((r.value or {}).get("seconds", 1e9)
                                                         for r in survivors), 2)})
    with WorkerPool(4, xla=False) as pool:  # the cost of the progress marks, same processes
        cost = [r.unwrap() for r in pool.run(W.exchange_cost, args.exchanges, timeout_s=600)]
    with_marks = statistics.median(min(c["with_marks"], c["with_marks_again"]) for c in cost)
    without = statistics.median(c["without_marks"] for c in cost)
    emit("rank_failures", {
        "exchange_us_with_progress_marks": round(with_marks / args.exchanges * 1e6, 1),
        "exchange_us_without": round(without / args.exchanges * 1e6, 1),
        "ratio_with_vs_without_marks": round(with_marks / without, 2),
        "cases": len(rows), "collective_timeout_s": timeout_s, "diagnosis_s": DEAD_AFTER_S,
        "hangs": sum(r["hangs"] for r in rows),
        "survivor_errors_naming_the_failed_rank": sum(r["survivors_naming_victim"] for r in rows),
        "survivors": sum(r["survivors"] for r in rows),
        "slowest_survivor_s": max((r["slowest_survivor_s"] for r in rows), default=None),
        "rows": rows}, sink)


# ---- soak ------------------------------------------------------------------------------------

def part_soak(emu, args, sink) -> None:
    import soak_harness as S

    from xla_ckpt.testing.launcher import WorkerPool

    for backend in ("local", "gcs"):
        uri = os.path.join(tempfile.mkdtemp(prefix="xla-ckpt-soak-"), "run") \
            if backend == "local" else emu.unique_uri("soak")
        with WorkerPool(1, xla=False, env=emu.env()) as w:
            (res,) = w.run(S.soak, uri, args.soak_cycles, timeout_s=3600)
        out = res.unwrap()
        emit(f"soak_{backend}", {**out["summary"], "keep_interval_updates": S.KEEP,
                                 "seconds": round(out["seconds"], 1)}, sink)


PARTS = {"crash": part_crash, "faults": part_faults, "ranks": part_ranks, "soak": part_soak}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated: " + ",".join(PARTS))
    ap.add_argument("--crash-points", type=int, default=100, help="kill points per backend (sync)")
    ap.add_argument("--async-points", type=int, default=30, help="kill points per backend (async)")
    ap.add_argument("--faults", type=int, default=1000, help="faults to inject (moderate rate)")
    ap.add_argument("--storm-faults", type=int, default=300, help="faults to inject (storm)")
    ap.add_argument("--clean-rounds", type=int, default=5, help="fault-free rounds (the peer)")
    ap.add_argument("--rank-repeats", type=int, default=2, help="runs of each rank-failure case")
    ap.add_argument("--exchanges", type=int, default=500,
                    help="control-plane exchanges timed with and without progress marks")
    ap.add_argument("--soak-cycles", type=int, default=100, help="save/restore cycles per backend")
    ap.add_argument("--seed", type=int, default=20261130, help="fault schedule seed")
    ap.add_argument("--out", help="also write every part's figures to this JSON file")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts: {', '.join(sorted(unknown))}")

    import torch

    from xla_ckpt.testing.gcs_emulator import GCSEmulator

    torch.set_num_threads(1)
    sink: dict = {}
    t0 = time.perf_counter()
    with GCSEmulator() as emu:
        for p in parts:
            PARTS[p](emu, args, sink)
    sink["total_seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({"part": "total", "seconds": sink["total_seconds"]}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(sink, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
