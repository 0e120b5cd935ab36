"""Reliability benchmark: the full counts of tests/reliability, with figures for RELIABILITY.md.

Parts (``--parts``, default all):

  crash      SIGKILL a saver at ``--crash-points`` points of its write sequence (local and on
             the GCS emulator, sync save) and ``--async-points`` points of an async save; after
             each kill a fresh process resumes as a trainer does (``Checkpointer.load_checkpoint``
             on the run folder and on ``<run>/checkpoint_last``), then the harness's fresh
             verifier checks the committed set, ``xla-ckpt ls``, "latest", bitwise restores of
             every committed checkpoint, ``CheckpointManager.restore_or_initialize``, and that
             a resumed job saves and restores.  ``fresh_starts_with_committed`` counts resumes
             that started from scratch while a committed checkpoint was there (must be 0).
  replace    A reader reads a checkpoint while another process saves to the same path:
             ``--replace-trials`` reads per backend in which the other process commits a save
             between two slices of the data file, once (the read must re-read and get the new
             save) or twice (``CheckpointReplacedError``), through the trainer, restore()
             (both strategies) and the manager; then ``--replace-free-reads`` reads while the
             other process saves on its own schedule.  Fresh starts must be 0.
  interrupt  Real processes (tests/storage/interrupted_upload_worker.py) doing a 64-part
             gs:// save get SIGINT (once, twice) or SIGKILL at a random time: parts left after
             SIGINT (must be 0), seconds from the signal to the exit; after SIGKILL, that
             ``xla-ckpt ls --grace 0`` lists exactly the parts and ``gc --in-flight --grace 0``
             frees exactly their bytes.  ``--interrupt-repeats`` runs of each case.
  fencing    The harness's fencing family: a successor incarnation starts while the
             predecessor is paused at each of ``--fencing-points`` points of its save (which
             was SIGKILLed there, or goes on afterwards), local and on the emulator.
  faults     8 gloo ranks restore (every rank reads) through the fault proxy until ``--faults``
             faults were injected (random 503/429/reset/short body/flipped byte, 12 % of
             requests), then a storm (60 %, 3 attempts) of ``--storm-faults``; also clean
             rounds, so the time cost of faults is a ratio measured in the same run; then
             ``--range-answers`` answers of HTTP 200 without Content-Range (Range ignored,
             short) to 12 % of media GETs, which the fault proxy cannot send.
  ranks      4 gloo ranks, both strategies: a rank raises during its read (403), stalls past
             the timeout, is SIGKILLed, or is the coordinator and dies; ``--rank-repeats`` each.
             Also the cost of the liveness progress marks: ``--exchanges`` control-plane
             exchanges timed with and without them in the same processes (a ratio).
  soak       ``--soak-cycles`` async save + restore cycles with rotation, on local disk and on
             the emulator's bucket: usage, RSS slope, threads, fds, bitwise.
  sharded    The sharded (chunked, manifest v2) save_distributed of DTensor state and its
             byte-range restore into DTensor targets: a job of ``--sharded-world`` forked gloo
             ranks SIGKILLed with one rank at each of ``--sharded-points`` points (per backend,
             spread over every rank's steps; verified by a fresh job of
             ``--sharded-verify-world`` ranks); ``--sharded-faults`` faults injected while 3
             ranks restore by byte range from the emulator (plus a round in which every read of
             one rank's chunk file is flipped); and every rank-failure case of a sharded save
             (agreement, writing, commit) and restore (all_ranks, broadcast), 3 ranks each,
             ``--sharded-rank-repeats`` times.

Each part prints one JSON line of figures per run; ``--out FILE`` also writes them all as one
JSON document.  The harnesses live in tests/reliability/ (the same code the CI subset runs);
the crash part's trainer resume and the replace and interrupt parts are here.

  .venv/bin/python benchmarks/reliability.py                       # everything, full counts
  .venv/bin/python benchmarks/reliability.py --parts crash --crash-points 60
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "reliability"))
os.environ.setdefault("PJRT_DEVICE", "CPU")


def emit(name: str, figures: dict, sink: dict) -> None:
    sink[name] = figures
    print(json.dumps({"part": name, **figures}, default=str), flush=True)


# ---- crash ---------------------------------------------------------------------------------

def _crash_model() -> Any:
    """A live model whose state_dict has the keys, shapes and dtypes of the crash harness's
    ``state_for(n)["model"]`` (``tied`` is a view there; here its own parameter)."""
    import torch

    model = torch.nn.Module()
    model.encoder = torch.nn.Module()
    model.encoder.w = torch.nn.Parameter(torch.zeros(256, 256))
    model.encoder.b = torch.nn.Parameter(torch.zeros(256))
    model.emb = torch.nn.Parameter(torch.zeros(64, 32, dtype=torch.bfloat16))
    model.tied = torch.nn.Parameter(torch.zeros(4, 256))
    return model


def _trainer_resume_main(run_uri: str, backend: str, wfd: int) -> None:
    """A fresh process resumes the way a trainer does: ``Checkpointer.load_checkpoint`` on the
    run folder and on ``<run>/checkpoint_last``; reports what it got (read-only)."""
    import crash_harness as H
    import torch

    from xla_ckpt.run.catalog import list_checkpoints
    from xla_ckpt.storage import open_storage
    from xla_ckpt.trainer import Checkpointer, CheckpointerConfig, SingleProcessRestorer

    torch.set_num_threads(1)
    config = H.storage_config(backend, traced=False)
    with open_storage(run_uri, config) as st:
        committed = [e.name for e in list_checkpoints(st) if e.committed]
    out: dict[str, Any] = {"committed": committed}
    for key, uri in (("run", run_uri), ("last", f"{run_uri}/checkpoint_last")):
        model = _crash_model()
        ck = Checkpointer(model=model, build_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                          restorer=SingleProcessRestorer(config=config),
                          config=CheckpointerConfig(dtype_policy="keep"))
        try:
            extra = ck.load_checkpoint(uri)
        except Exception as e:  # noqa: BLE001 - an error is a figure here, not a crash
            out[key] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            continue
        if extra is None:
            out[key] = {"fresh_start": True}
            continue
        n = int(extra["num_updates"])
        want = H.state_for(n)["model"]
        got = dict(model.named_parameters())
        diff = [k for k, t in want.items() if not torch.equal(got[k].detach(), t)]
        out[key] = {"num_updates": n, "differs": diff}
    os.write(wfd, (json.dumps(out) + "\n").encode())


def trainer_resume(run_uri: str, backend: str) -> dict:
    """:func:`_trainer_resume_main` in a process forked from the zygote; its report."""
    return _in_fork(lambda w: _trainer_resume_main(run_uri, backend, w))


def _collect_main(run_uri: str, backend: str, emulator_host: str, wfd: int) -> None:
    """After the verifier: the temp objects killed writes left, what ``xla-ckpt ls --grace 0
    --json`` lists in flight, what ``gc --in-flight --grace 0`` says it freed, what is left."""
    import re

    import crash_harness as H

    from xla_ckpt.storage import open_storage

    strays = H.stray_objects(run_uri, backend, emulator_host)
    with open_storage(run_uri, H.storage_config(backend, traced=False)) as st:
        nbytes = sum(st.stat(n).size for n in strays)
    code, out = _cli("ls", run_uri, "--grace", "0", "--json")
    doc = json.loads(out) if code == 0 else {}
    listed = sorted(o for up in doc.get("in_flight", []) for o in up["objects"])
    code, out = _cli("gc", run_uri, "--in-flight", "--grace", "0")
    freed = re.search(r"^freed (?:.* = )?(\d+) B", out, re.M)
    _send(wfd, {"strays": strays, "bytes": nbytes, "ls_listed": listed,
                "gc_exit": code, "gc_freed": int(freed.group(1)) if freed else None,
                "gc_output": out[-300:],
                "after_gc": H.stray_objects(run_uri, backend, emulator_host)})


def _in_fork(fn: Any) -> dict:
    """``fn(write_fd)`` in a process forked from the zygote; the JSON line it sent."""
    import crash_harness as H

    pid, r = H._fork(fn)
    try:
        msg = H._read_line(r, H.SAVE_TIMEOUT_S)
        code = H._reap(pid)
    finally:
        os.close(r)
    return msg if msg is not None else {"error": f"no answer (exit code {code})"}


def crash_campaign(base_uri: str, backend: str, mode: str, count: int, **kw: Any) -> dict:
    """The harness's :func:`campaign` (runs in the zygote) with two more fresh processes per
    kill: :func:`trainer_resume` before the harness's verifier, :func:`_collect_main` after it
    (before the run folder is wiped).  Their reports come back as ``result["trainer"]`` and
    ``result["collect"]``, in kill-point order."""
    import crash_harness as H

    reports: list[dict] = []
    collected: list[dict] = []
    real_verifier, real_wipe = H.run_verifier, H._wipe
    host = kw.get("emulator_host", "")

    def verifier(run_uri: str, backend_: str, recover: bool, emulator_host: str = "",
                 **more: Any) -> dict:
        reports.append(trainer_resume(run_uri, backend_))
        return real_verifier(run_uri, backend_, recover, emulator_host, **more)

    def wipe(run_uri: str, backend_: str, emulator_host: str) -> None:
        if not run_uri.endswith("/dry"):
            collected.append(_in_fork(lambda w: _collect_main(run_uri, backend_, host, w)))
        real_wipe(run_uri, backend_, emulator_host)

    H.run_verifier, H._wipe = verifier, wipe
    try:
        out = H.campaign(base_uri, backend, mode, count, **kw)
    finally:
        H.run_verifier, H._wipe = real_verifier, real_wipe
    if not len(reports) == len(collected) == len(out["results"]):
        raise AssertionError(f"{len(reports)} trainer reports and {len(collected)} collections "
                             f"for {len(out['results'])} points")
    for res, rep, col in zip(out["results"], reports, collected, strict=True):
        res["trainer"], res["collect"] = rep, col
    return out


def _collect_figures(results: list[dict]) -> dict:
    """Temp objects of killed writes: listed by ``ls --grace 0`` and freed by ``gc --in-flight``
    exactly (names and bytes), none left after."""
    cols = [r["collect"] for r in results]
    left = [c for c in cols if "error" not in c and c["strays"]]
    bad = [f"{r['label']}: {c}" for r, c in zip(results, cols, strict=True)
           if "error" in c or c["ls_listed"] != c["strays"] or c["gc_exit"] != 0
           or c["gc_freed"] != c["bytes"] or c["after_gc"]]
    return {"temp_objects_left_by_kills": sum(len(c["strays"]) for c in left),
            "temp_bytes_left_by_kills": sum(c["bytes"] for c in left),
            "ls_grace_0_listed_exactly_them": sum(c["ls_listed"] == c["strays"] for c in left),
            "gc_in_flight_freed_exactly_their_bytes": sum(c["gc_freed"] == c["bytes"]
                                                          for c in left),
            "temp_objects_after_gc": sum(len(c.get("after_gc", [])) for c in cols),
            "collect_mismatches": len(bad), "collect_samples": bad[:3]}


def _fresh_start_figures(results: list[dict]) -> dict:
    """Starts from scratch with a committed checkpoint present, by entry point, and what else
    the trainer's and the manager's resume got (they must get the latest committed one)."""
    import crash_harness as H

    fresh = {"trainer_run_folder": 0, "trainer_checkpoint_last": 0, "manager": 0}
    wrong: list[str] = []
    errors: list[str] = []
    resumes = 0
    for r in results:
        want = H.num_updates_of(H.C if r["expect_committed"] else H.B)
        v, t = r["verify"], r["trainer"]
        if "error" in t:
            errors.append(f"{r['label']}: trainer process: {t['error']}")
            continue
        for key, name in (("run", "trainer_run_folder"), ("last", "trainer_checkpoint_last")):
            got = t[key]
            resumes += 1
            if got.get("fresh_start") and t["committed"]:
                fresh[name] += 1
                wrong.append(f"{r['label']}: {name}: started fresh with {t['committed']} "
                             "committed")
            elif "error" in got:
                errors.append(f"{r['label']}: {name}: {got['error']}")
            elif got.get("num_updates") != want or got.get("differs"):
                wrong.append(f"{r['label']}: {name}: got num_updates {got.get('num_updates')} "
                             f"(differs: {got.get('differs')}), expected {want}")
        if "error" not in v:
            resumes += 1
            if v.get("resumed") is None and v.get("committed"):
                fresh["manager"] += 1
                wrong.append(f"{r['label']}: manager: started fresh with {v['committed']} "
                             "committed")
    return {"fresh_starts_with_committed": sum(fresh.values()),
            "fresh_starts_by_entry_point": fresh, "resumes_checked": resumes,
            "trainer_resume_wrong": len(wrong) - sum(fresh.values()),
            "trainer_resume_errors": len(errors), "resume_samples": (wrong + errors)[:5]}


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
            (res,) = zygote.run(crash_campaign, base, backend, mode, count, timeout_s=3600,
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
                **_fresh_start_figures(results),
                "recovered_and_saved_again": sum("recovered" in r["verify"] for r in results),
                "kills_leaving_temp_objects": sum(bool(r["verify"].get("strays_after_kill"))
                                                  for r in results),
                **_collect_figures(results),
                "seconds": round(out["seconds"], 1)}, sink)


# ---- replace: a checkpoint replaced while it is read -----------------------------------------

REPLACE_SLICE = 4 << 20  # the 16 MiB weight of Linear(2048, 2048) is 4 slices (4 MiB chunks)
REPLACE_ENTRIES = ("trainer", "restore_all_ranks", "restore_broadcast", "manager")
REPLACE_NAME = "checkpoint_1_5"


def _send(fd: int, msg: dict) -> None:
    os.write(fd, (json.dumps(msg) + "\n").encode())


def _replace_checkpointer(seed: int, num_updates: int, **kw: Any) -> Any:
    import torch

    from xla_ckpt.trainer import Checkpointer

    torch.manual_seed(seed)
    model = torch.nn.Linear(2048, 2048, bias=False)
    ck = Checkpointer(model=model, build_optimizer=lambda p: torch.optim.SGD(p, lr=0.1), **kw)
    ck.set_num_updates(num_updates)
    return ck


def _replace_weight(seed: int) -> Any:
    return _replace_checkpointer(seed, seed).model.weight.detach()


def _replace_config(backend: str) -> Any:
    """One reader thread, 4 MiB slices: the slices of a data file are read in order."""
    from xla_ckpt.storage import StorageConfig

    return StorageConfig(slice_size_bytes=REPLACE_SLICE, max_workers=1, initial_backoff_s=0.01,
                         max_backoff_s=0.1, retry_deadline_s=20.0)


def _replace_save(target: str, seed: int) -> str:
    """A trainer save of the seed's weights (num_updates = seed) to ``target``; its save id."""
    ck = _replace_checkpointer(seed, seed)
    m = ck.save_checkpoint(target, {"train_iterator": {"epoch": 1, "iterations_in_epoch": seed,
                                                       "version": 2}})
    return m.save_id


def _writer_main(target: str, cmd: int, ack: int) -> None:
    """W: saves to ``target`` on command ({"save": seed}), or continuously ({"free": ...}) until
    told to stop; {"exit": true} ends it.  Every reply is one JSON line on ``ack``."""
    import random
    import select

    import crash_harness as H
    import torch

    torch.set_num_threads(1)
    while True:
        msg = H._read_line(cmd, 600.0)
        if msg is None or msg.get("exit"):
            return
        if "save" in msg:
            _send(ack, {"saved": msg["save"], "save_id": _replace_save(target, msg["save"])})
            continue
        free = msg["free"]
        rng = random.Random(free["seed"])
        seed, saved = free["first_seed"], []
        while not select.select([cmd], [], [], 0)[0]:
            _replace_save(target, seed)
            saved.append(seed)
            seed += 1
            time.sleep(rng.uniform(0, free["pause_s"]))
        H._read_line(cmd, 5.0)  # the stop
        _send(ack, {"saved_seeds": saved})


def _read_via(entry: str, run_uri: str, backend: str) -> tuple[Any, Any]:
    """Resume through one entry point; (num_updates, weight), or (None, None) for a fresh start."""
    from xla_ckpt.comm import SingleProcess
    from xla_ckpt.manager import CheckpointConfig, CheckpointManager
    from xla_ckpt.restore import restore
    from xla_ckpt.trainer import SingleProcessRestorer

    cfg = _replace_config(backend)
    if entry == "trainer":  # the reported case: the checkpoint folder itself
        ck = _replace_checkpointer(99, 0, restorer=SingleProcessRestorer(config=cfg))
        if ck.load_checkpoint(f"{run_uri}/{REPLACE_NAME}") is None:
            return None, None
        return ck.get_num_updates(), ck.model.weight.detach()
    if entry == "manager":
        mgr = CheckpointManager(CheckpointConfig(save_dir=run_uri, save_interval_epochs=0,
                                                 handle_sigterm=False, exit_on_preemption=False),
                                dist=SingleProcess(), storage_config=cfg)
        try:
            res = mgr.restore_or_initialize()
        finally:
            mgr.close()
        return (None, None) if res is None else (res.num_updates, res.state["model"]["weight"])
    r = restore(run_uri, dist=SingleProcess(), strategy=entry[len("restore_"):],
                storage_config=cfg)
    return r.metadata["num_updates"], r.state["model"]["weight"]


class _CountReplaced(logging.Handler):
    """Counts the library's "replaced while reading ... once more" warnings (re-reads)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "was replaced while reading" in record.getMessage():
            self.n += 1


def _reader_main(run_uri: str, backend: str, entries: list[str], saves: int, at_slice: int,
                 cmd: int, ack: int, wfd: int) -> None:
    """R: reads through each of ``entries`` in turn; with ``saves`` > 0, after slice
    ``at_slice`` of each data file it has not seen, W saves (and commits) to the same path
    while R waits, ``saves`` times in all.  Reports one outcome per read."""
    import threading

    import crash_harness as H
    import torch

    from xla_ckpt.errors import CheckpointReplacedError

    torch.set_num_threads(1)
    from xla_ckpt.storage.gcs import GCSStorage
    from xla_ckpt.storage.local import LocalStorage

    cls: Any = LocalStorage if backend == "local" else GCSStorage
    original = cls.read_range
    lock = threading.Lock()
    slices: dict[str, int] = {}
    made: list[int] = []
    seed = [1000]

    def read_range(storage: Any, name: str, offset: int, out: memoryview,
                   generation: int | None = None) -> None:
        original(storage, name, offset, out, generation)
        if not os.path.basename(name).startswith("data-"):
            return
        with lock:
            slices[name] = slices.get(name, 0) + 1
            fire = slices[name] == at_slice and len(made) < saves
            if fire:
                seed[0] += 1
                made.append(seed[0])
        if fire:
            _send(cmd, {"save": seed[0]})
            if H._read_line(ack, H.SAVE_TIMEOUT_S) is None:
                raise AssertionError("the writer did not save")

    if saves:
        setattr(cls, "read_range", read_range)  # noqa: B010 - the hook, on the class on purpose
    rereads = _CountReplaced()
    logging.getLogger("xla_ckpt").addHandler(rereads)
    reads = []
    for entry in entries:
        t0 = time.perf_counter()
        rereads.n = 0
        out: dict[str, Any] = {"entry": entry}
        try:
            n, weight = _read_via(entry, run_uri, backend)
        except CheckpointReplacedError as e:
            out.update(outcome="replaced_error", message=str(e)[:300])
        except Exception as e:  # noqa: BLE001 - any other error is a figure (a bug)
            out.update(outcome="other_error", error=type(e).__name__, message=str(e)[:400])
        else:
            if n is None:
                out["outcome"] = "fresh_start"
            else:
                out.update(outcome="read", num_updates=int(n),
                           bitwise=bool(torch.equal(weight, _replace_weight(int(n)))))
        out["seconds"] = round(time.perf_counter() - t0, 3)
        out["rereads"] = rereads.n
        reads.append(out)
    _send(wfd, {"reads": reads, "saves_made": made, "slices": slices})


def _classify(read: dict, committed: set[int], newest: int | None) -> str:
    if read["outcome"] != "read":
        return read["outcome"]
    if not read["bitwise"] or read["num_updates"] not in committed:
        return "silent_corruption"
    if newest is None:
        return "got_a_committed_save"
    return "reread_got_the_new_save" if read["num_updates"] == newest else "got_an_older_save"


def replace_campaign(base_uri: str, backend: str, trials: int, free_reads: int, seed: int,
                     emulator_host: str = "") -> dict:
    """Runs in a launcher worker (the zygote); W and every R are forks of it.

    ``trials`` hooked reads, each through a random entry point with W saving once or twice
    between slices (at a random slice), then ``free_reads`` reads while W saves on its own
    schedule (a random pause of 0 to 2 reads' time between saves: a read meets no save, one,
    or two)."""
    import random

    import crash_harness as H
    import torch

    torch.set_num_threads(1)
    H.preload(backend)
    rng = random.Random(seed)
    t0 = time.perf_counter()
    hooked: list[dict] = []
    free: dict[str, Any] = {}

    def with_writer(j: int, body: Any) -> Any:
        run_uri = f"{base_uri}/r{j:04d}"
        cmd_r, cmd_w = os.pipe()
        ack_r, ack_w = os.pipe()
        wpid, wout = H._fork(lambda _w: _writer_main(f"{run_uri}/{REPLACE_NAME}", cmd_r, ack_w))
        try:
            _send(cmd_w, {"save": 1000})
            first = H._read_line(ack_r, H.SAVE_TIMEOUT_S)
            if first is None or "saved" not in first:
                raise AssertionError(f"the writer's first save failed: {first}")
            return body(run_uri, cmd_w, ack_r)
        finally:
            try:
                _send(cmd_w, {"exit": True})
            except OSError:
                pass
            H._reap(wpid)
            for fd in (cmd_r, cmd_w, ack_r, ack_w, wout):
                os.close(fd)
            H._wipe(run_uri, backend, emulator_host)

    def run_reader(run_uri: str, entries: list[str], saves: int, at_slice: int, cmd: int,
                   ack: int) -> dict:
        pid, r = H._fork(lambda w: _reader_main(run_uri, backend, entries, saves, at_slice,
                                                cmd, ack, w))
        try:
            msg = H._read_line(r, 600.0)
            code = H._reap(pid)
        finally:
            os.close(r)
        if msg is None or "reads" not in msg:
            return {"error": f"reader gave {msg} (exit code {code})"}
        return msg

    for j in range(trials):
        entry, saves = REPLACE_ENTRIES[j % len(REPLACE_ENTRIES)], 1 + (j // 4) % 2
        at_slice = rng.randint(1, 3)  # a slice of the file is always left to read

        def hooked_trial(run_uri: str, cmd: int, ack: int, entry: str = entry,
                         saves: int = saves, at_slice: int = at_slice) -> dict:
            return run_reader(run_uri, [entry], saves, at_slice, cmd, ack)

        got = with_writer(j, hooked_trial)
        res = {"entry": entry, "saves": saves, "at_slice": at_slice}
        if "error" in got:
            res["outcome"] = "other_error"
            res["message"] = got["error"]
        else:
            made = got["saves_made"]
            (read,) = got["reads"]
            res.update(read, saves_made=len(made),
                       outcome=_classify(read, {1000, *made}, made[-1] if made else 1000))
        hooked.append(res)

    if free_reads:
        entries = [REPLACE_ENTRIES[k % len(REPLACE_ENTRIES)] for k in range(free_reads)]

        def free_trial(run_uri: str, cmd: int, ack: int) -> dict:
            probe = run_reader(run_uri, list(REPLACE_ENTRIES), 0, 0, cmd, ack)  # a read's time
            pause = 2 * statistics.median(r["seconds"] for r in probe.get("reads", [])) \
                if "reads" in probe else 0.5
            _send(cmd, {"free": {"first_seed": 2000, "pause_s": pause, "seed": seed}})
            got = run_reader(run_uri, entries, 0, 0, cmd, ack)
            _send(cmd, {"stop": True})
            stopped = H._read_line(ack, H.SAVE_TIMEOUT_S) or {}
            return {**got, "saved_seeds": stopped.get("saved_seeds", []), "pause_s": pause}

        free = with_writer(trials, free_trial)
        if "reads" in free:
            committed = {1000, *free["saved_seeds"]}
            for read in free["reads"]:
                read["outcome"] = _classify(read, committed, None)
    return {"hooked": hooked, "free": free, "seconds": time.perf_counter() - t0}


def _tally(rows: list[dict], key: str = "outcome") -> dict:
    out: dict[str, int] = {}
    for r in rows:
        out[r[key]] = out.get(r[key], 0) + 1
    return dict(sorted(out.items()))


BUG_OUTCOMES = ("fresh_start", "other_error", "silent_corruption")


def part_replace(emu, args, sink) -> None:
    from xla_ckpt.testing.launcher import WorkerPool

    tmp = tempfile.mkdtemp(prefix="xla-ckpt-replace-")
    with WorkerPool(1, xla=False, env=emu.env()) as zygote:
        for backend in ("local", "gcs"):
            base = os.path.join(tmp, backend) if backend == "local" \
                else emu.unique_uri("replace")
            (res,) = zygote.run(replace_campaign, base, backend, args.replace_trials,
                                args.replace_free_reads, args.seed, emu.host, timeout_s=3600)
            out = res.unwrap()
            hooked, free = out["hooked"], out["free"]
            free_reads = free.get("reads", [])
            expected = {1: "reread_got_the_new_save", 2: "replaced_error"}
            unexpected = [r for r in hooked if r["outcome"] != expected[r["saves"]]]
            everything = hooked + free_reads
            emit(f"replace_{backend}", {
                "hooked_reads": len(hooked),
                "saved_once_mid_read": _tally([r for r in hooked if r["saves"] == 1]),
                "saved_twice_mid_read": _tally([r for r in hooked if r["saves"] == 2]),
                "by_entry_point": {e: _tally([r for r in hooked if r["entry"] == e])
                                   for e in REPLACE_ENTRIES},
                "hooked_unexpected": len(unexpected),
                "unexpected_samples": [{k: r.get(k) for k in ("entry", "saves", "at_slice",
                                                              "outcome", "error", "message")}
                                       for r in unexpected[:5]],
                "free_running_reads": len(free_reads),
                "free_running_saves": len(free.get("saved_seeds", [])),
                "free_running_pause_s": round(free.get("pause_s", 0.0), 3),
                "free_running": _tally(free_reads),
                "free_running_reads_that_re_read": sum(r.get("rereads", 0) > 0
                                                       for r in free_reads),
                "free_running_error": free.get("error"),
                "fresh_starts": sum(r["outcome"] == "fresh_start" for r in everything),
                "silent_corruptions": sum(r["outcome"] == "silent_corruption"
                                          for r in everything),
                "bugs": sum(r["outcome"] in BUG_OUTCOMES for r in everything),
                "bug_samples": [{k: r.get(k) for k in ("entry", "outcome", "error", "message")}
                                for r in everything if r["outcome"] in BUG_OUTCOMES][:5],
                "seconds": round(out["seconds"], 1)}, sink)


# ---- interrupt: Ctrl-C and SIGKILL of a real process while its gs:// save uploads parts -------

INTERRUPT_MODES = ("save", "manager", "manager-no-close")  # interrupted_upload_worker.py's
INTERRUPT_SIGNALS = ("sigint", "sigint_twice", "sigkill")


class _EmulatorEnv:
    """``os.environ`` with the emulator's variables for the ``with`` block (in-process CLI)."""

    def __init__(self, emu: Any) -> None:
        self.env = emu.env()
        self.saved: dict[str, str] = {}

    def __enter__(self) -> None:
        self.saved = dict(os.environ)
        os.environ.update(self.env)

    def __exit__(self, *exc: Any) -> None:
        os.environ.clear()
        os.environ.update(self.saved)


def _cli(*argv: str) -> tuple[int, str]:
    """``xla-ckpt ARGV`` in this process: (exit code, stdout)."""
    import contextlib
    import io

    from xla_ckpt.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["--no-progress", *argv])
    return code, out.getvalue()


def _default_sigint() -> None:
    """In the worker, before exec: SIGINT back to its default.  A benchmark started in the
    background (``nohup ... &`` from a script) has SIGINT ignored, children inherit that, and
    Python then installs no KeyboardInterrupt handler: every SIGINT would be lost."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def part_interrupt(emu, args, sink) -> None:
    import random
    import re
    import signal
    import subprocess

    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    from xla_ckpt.storage.gcs import TMP_MARK

    worker = os.path.join(REPO, "tests", "storage", "interrupted_upload_worker.py")
    logs = tempfile.mkdtemp(prefix="xla-ckpt-interrupt-")
    rng = random.Random(args.seed)
    client = storage.Client(project=emu.project, credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": emu.host})

    def objects(prefix: str) -> list[tuple[str, int]]:
        """(name, size) under ``prefix``, straight from the emulator's JSON API."""
        return sorted((b.name, int(b.size)) for b in client.list_blobs(emu.bucket, prefix=prefix))

    def parts(prefix: str) -> list[tuple[str, int]]:
        return [o for o in objects(prefix) if TMP_MARK in o[0]]

    def settled(prefix: str) -> list[tuple[str, int]]:
        """The in-flight objects once the listing held still for 0.5 s (at most 10 s)."""
        last, since, deadline = None, time.monotonic(), time.monotonic() + 10
        while True:
            now = parts(prefix)
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since > 0.5 or time.monotonic() > deadline:
                return now
            time.sleep(0.05)

    env = {**os.environ, **emu.env()}
    rows: list[dict] = []
    t_start = time.perf_counter()
    for rep in range(args.interrupt_repeats):
        for mode in INTERRUPT_MODES:
            for how in INTERRUPT_SIGNALS:
                run = emu.unique_uri("interrupt") + "/run"
                prefix = run[len(f"gs://{emu.bucket}/"):] + "/"
                log_path = os.path.join(logs, f"{rep}-{mode}-{how}.log")
                with open(log_path, "wb") as log:
                    proc = subprocess.Popen([sys.executable, worker, mode, run], env=env,
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                            preexec_fn=_default_sigint)
                row: dict[str, Any] = {"mode": mode, "signal": how}
                try:
                    deadline = time.monotonic() + 120
                    while not parts(prefix) and proc.poll() is None \
                            and time.monotonic() < deadline:
                        time.sleep(0.02)
                    delay = rng.uniform(0, args.interrupt_window_s)
                    time.sleep(delay)
                    row["delay_after_first_part_s"] = round(delay, 3)
                    row["parts_at_signal"] = len(parts(prefix))
                    row["running_at_signal"] = proc.poll() is None
                    t0 = time.monotonic()
                    proc.send_signal(signal.SIGKILL if how == "sigkill" else signal.SIGINT)
                    if how == "sigint_twice":
                        time.sleep(rng.uniform(0.0, 0.3))
                        row["second_sigint_sent"] = proc.poll() is None
                        if row["second_sigint_sent"]:
                            proc.send_signal(signal.SIGINT)
                    try:
                        row["exitcode"] = proc.wait(30)
                        row["hang"] = False
                    except subprocess.TimeoutExpired:
                        row["hang"] = True
                        proc.kill()
                        row["exitcode"] = proc.wait(10)
                    row["exit_s"] = round(time.monotonic() - t0, 3)
                finally:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait(10)
                with open(log_path, errors="replace") as f:
                    row["keyboard_interrupt_raised"] = "KeyboardInterrupt" in f.read()
                left = settled(prefix)
                row["committed"] = any(n.endswith("/manifest.json") for n, _ in objects(prefix))
                row["parts_left"] = len(left)
                if how == "sigkill":
                    left_bytes = sum(n for _, n in left)
                    with _EmulatorEnv(emu):
                        code, out = _cli("ls", run, "--grace", "0", "--json")
                        doc = json.loads(out) if code == 0 else {}
                        listed = sorted(prefix + o for up in doc.get("in_flight", [])
                                        for o in up["objects"])
                        row["ls_lists_exactly_the_parts"] = listed == [n for n, _ in left]
                        code, out = _cli("gc", run, "--in-flight", "--grace", "0")
                    freed = re.search(r"^freed (?:.* = )?(\d+) B", out, re.M)
                    row["gc_freed_bytes"] = int(freed.group(1)) if freed else None
                    row["parts_bytes"] = left_bytes
                    row["gc_freed_exactly_their_bytes"] = code == 0 and freed is not None \
                        and int(freed.group(1)) == left_bytes
                    row["parts_after_gc"] = len(settled(prefix))
                emu.delete_prefix(prefix)
                rows.append(row)
    client.close()
    ints = [r for r in rows if r["signal"] != "sigkill"]
    interrupted = [r for r in ints if r["running_at_signal"] and not r["committed"]]
    kills = [r for r in rows if r["signal"] == "sigkill"]

    def times(rs: list[dict]) -> dict:
        xs = [r["exit_s"] for r in rs]
        return {"n": len(xs), "median_s": round(statistics.median(xs), 3) if xs else None,
                "max_s": max(xs) if xs else None}

    emit("interrupt", {
        "processes": len(rows), "repeats": args.interrupt_repeats,
        "sigint_runs": len(ints), "sigint_during_upload": len(interrupted),
        "sigint_after_save_finished": len(ints) - len(interrupted),
        "second_sigints_sent": sum(bool(r.get("second_sigint_sent")) for r in ints),
        "parts_at_sigint_max": max((r["parts_at_signal"] for r in ints), default=0),
        "leaked_parts_after_sigint": sum(r["parts_left"] for r in ints),
        "runs_leaking_after_sigint": sum(r["parts_left"] > 0 for r in ints),
        "exit_by_keyboard_interrupt": sum(r["exitcode"] == -signal.SIGINT
                                          and r["keyboard_interrupt_raised"]
                                          for r in interrupted),
        "committed_after_sigint": sum(r["committed"] for r in ints),
        "signal_to_exit_once": times([r for r in ints if r["signal"] == "sigint"]),
        "signal_to_exit_twice": times([r for r in ints if r["signal"] == "sigint_twice"]),
        "signal_to_exit_by_mode": {m: times([r for r in ints if r["mode"] == m])
                                   for m in INTERRUPT_MODES},
        "hangs": sum(r["hang"] for r in rows),
        "sigkill_runs": len(kills),
        "sigkill_parts_left": sum(r["parts_left"] for r in kills),
        "sigkill_runs_leaving_parts": sum(r["parts_left"] > 0 for r in kills),
        "ls_listed_exactly_the_parts": sum(r["ls_lists_exactly_the_parts"] for r in kills),
        "gc_freed_exactly_their_bytes": sum(r["gc_freed_exactly_their_bytes"] for r in kills),
        "gc_freed_bytes_total": sum(r["gc_freed_bytes"] or 0 for r in kills),
        "parts_after_gc": sum(r["parts_after_gc"] for r in kills),
        "rows": rows, "seconds": round(time.perf_counter() - t_start, 1)}, sink)


# ---- fencing: a successor incarnation starts while the predecessor saves ---------------------

def _fencing_figures(out: dict) -> dict:
    """Figures of one ``crash_harness.fencing_campaign``: interleavings, orders, FencedError
    where a lease check was still ahead of the predecessor, the newest incarnation's
    checkpoints lost, ``checkpoint_last`` going backwards or naming the predecessor's late
    checkpoint."""
    import crash_harness as H

    results = out["results"]
    violations = [v for r in results for v in H.check_fencing(r)]
    lost = regressions = names_late = 0
    fence_expected = fenced = next_fenced = silent_next = window_commits = 0
    for r in results:
        v, succ = r.get("verify") or {}, r.get("successor") or {}
        committed = set(v.get("committed", []))
        mine = {H.S_NAME, succ.get("restored")} - {None}
        if r["error"] or "error" in v or not mine <= committed \
                or v.get("digests") != succ.get("digests") \
                or any(v.get("bitwise", {}).get(f) for f in mine):
            lost += 1
        orders = [(o[1], o[2]) for o in r["observed"]]
        regressions += any(a > b for a, b in zip(orders, orders[1:], strict=False))
        after_s = False
        for phase, _epoch, _n, name in r["observed"]:
            after_s = after_s or phase == "S saved"
            names_late += after_s and name in (H.C, H.NEXT)
        if r["variant"] != "resume" or r["error"]:
            continue
        pred = r["predecessor"]
        s_first = r["order"] in ("S after P died", "S finished first")
        if s_first and r["expect_fenced"]:
            fence_expected += 1
            fenced += pred.get("saved_c", {}).get("error") == "FencedError"
        next_fenced += pred.get("saved_next", {}).get("error") == "FencedError"
        silent_next += pred.get("steps_during_next") == 0
        window_commits += s_first and r["in_window"] and H.C in committed
    resumed = [r for r in results if r["variant"] == "resume" and not r["error"]]
    return {
        "interleavings": len(results), "predecessor_steps": len(out["steps"]),
        "manifest_step": out["manifest_step"], "pointer_step": out["pointer_step"],
        "rotation_step": out["rotation_step"], "orders": _tally(results, "order"),
        "points_before_commit": sum(not r["expect_committed"] for r in results),
        "points_with_a_lease_check_ahead": sum(r["expect_fenced"] for r in results),
        "violations": len(violations), "violation_samples": violations[:5],
        "errors": sum(bool(r["error"]) for r in results),
        "fenced_error_where_expected": f"{fenced} / {fence_expected}",
        "next_save_fenced_error": f"{next_fenced} / {len(resumed)}",
        "next_save_without_a_mutating_step": f"{silent_next} / {len(resumed)}",
        "late_commits_in_the_residual_window": window_commits,
        "newest_incarnation_checkpoints_lost": lost, "pointer_regressions": regressions,
        "pointer_naming_the_predecessors_late_checkpoint": names_late,
        "seconds": round(out["seconds"], 1)}


def part_fencing(emu, args, sink) -> None:
    import crash_harness as H

    from xla_ckpt.testing.launcher import WorkerPool

    if not hasattr(H, "fencing_campaign"):
        emit("fencing", {"pending": "tests/reliability/crash_harness.py has no fencing family"},
             sink)
        return
    tmp = tempfile.mkdtemp(prefix="xla-ckpt-fencing-")
    with WorkerPool(1, xla=False, env=emu.env()) as zygote:
        for backend in ("local", "gcs"):
            for variant in ("resume", "kill"):
                base = os.path.join(tmp, f"{backend}-{variant}") if backend == "local" \
                    else emu.unique_uri(f"fence-{variant}")
                (res,) = zygote.run(H.fencing_campaign, base, backend, variant,
                                    args.fencing_points, timeout_s=3600,
                                    emulator_host=emu.host, bucket=emu.bucket)
                emit(f"fencing_{backend}_{variant}", _fencing_figures(res.unwrap()), sink)


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
        if args.range_answers:
            emit("faults_range_answers",
                 range_answer_rounds(pool, emu, uri, args.range_answers, 0.12, moderate,
                                     args.seed), sink)


RANGED_ANSWERS = ("range_ignored_whole", "range_ignored_short", "ranged_200_exact",
                  "ranged_200_short")
WHOLE_ANSWERS = ("whole_short_with_hash", "whole_short_without_hash", "whole_without_hash")


def _range_mangler(upstream: str, probability: float, seed: int) -> Any:
    """tests/storage/test_gcs_short_answers.py's forwarding proxy, answering a seeded random
    ``probability`` of media GETs with HTTP 200 and no ``Content-Range``: for a ranged GET the
    whole object (Range ignored) or the asked bytes, either exact or cut short (1 to 4 KiB off,
    ``Content-Length`` to match); for an un-ranged GET (manifests) a body cut short, with or
    without ``X-Goog-Hash``, or whole without it.  The fault proxy has no such kind: its
    ``Fault.short`` keeps the 206 and ``Content-Range``."""
    import importlib
    import random
    from collections import Counter

    sys.path.insert(0, os.path.join(REPO, "tests", "storage"))
    M = importlib.import_module("test_gcs_short_answers")
    base: Any = M._Mangler

    class RandomMangler(base):
        def __init__(self) -> None:
            super().__init__(upstream)
            self.rng = random.Random(seed)
            self.kinds: Counter = Counter()

        def _choose(self, asked: str | None) -> Any:
            with self._lock:
                if self.rng.random() >= probability:
                    return None
                kind = self.rng.choice(RANGED_ANSWERS if asked else WHOLE_ANSWERS)
                self.kinds[kind] += 1
                drop = self.rng.randint(1, 4096) if "short" in kind else 0
                return M.Answer(whole=kind.startswith(("range_ignored", "whole")), drop=drop,
                                hash=kind.endswith("with_hash") or bool(asked),
                                stored_length=self.rng.random() < 0.5)

    return RandomMangler()


def range_answer_rounds(pool: Any, emu: Any, uri: str, min_answers: int, probability: float,
                        storage_kwargs: dict, seed: int) -> dict:
    """Restore rounds of the 8 ranks through :func:`_range_mangler` until it sent
    ``min_answers`` such answers; the same tally as ``faults_harness.run_rounds``."""
    from collections import Counter

    import faults_harness as F

    mangler = _range_mangler(emu.host, probability, seed)
    env = {"STORAGE_EMULATOR_HOST": mangler.url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    outcomes: Counter = Counter()
    counts: Counter = Counter()
    problems: list[str] = []
    rounds = hangs = 0
    t0 = time.perf_counter()
    try:
        while sum(mangler.kinds.values()) < min_answers and rounds < 1000:
            rounds += 1
            for res in pool.run(F.restore_round, uri, storage_kwargs, 120.0, timeout_s=180,
                                env=env):
                if res.timed_out:
                    hangs += 1
                    outcomes["hang"] += 1
                elif res.error is not None:
                    outcomes["other_error"] += 1
                    problems.append(f"round {rounds}: rank {res.rank} died: {res.error}")
                else:
                    v = res.value
                    outcomes[v["outcome"]] += 1
                    counts.update(v["counts"])
                    if v["outcome"] != "correct":
                        problems.append(f"round {rounds}: rank {v['rank']}: {v['outcome']}: "
                                        f"{v.get('error', '')} {v.get('message', '')[:300]}")
            if pool.broken:
                problems.append(f"round {rounds}: the worker pool broke")
                break
        media = mangler.media()
    finally:
        mangler.close()
    return {"rounds": rounds, "restores": rounds * F.WORLD, "outcomes": dict(outcomes),
            "answers": dict(mangler.kinds), "answers_total": sum(mangler.kinds.values()),
            "media_requests": len(media), "probability": probability,
            "retries": counts.get("retries", 0), "crc_rereads": counts.get("crc_rereads", 0),
            "fallbacks": counts.get("fallbacks", 0),
            "retry_causes": {k[6:]: v for k, v in counts.items() if k.startswith("retry:")},
            "hangs": hangs, "silent_corruptions": outcomes.get("silent_corruption", 0),
            "problems": problems[:10], "seconds": round(time.perf_counter() - t0, 1)}


# ---- rank failures ---------------------------------------------------------------------------

def part_ranks(emu, args, sink) -> None:
    import rank_workers as W

    from xla_ckpt.api import save
    from xla_ckpt.comm.liveness import DEAD_AFTER_S
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


# ---- sharded: crash points, faults and rank failures of the chunked (DTensor) save/restore ---

def part_sharded(emu, args, sink) -> None:
    import functools

    import crash_harness as H
    import faults_harness as F
    import rank_workers as W

    from xla_ckpt.comm.liveness import DEAD_AFTER_S
    from xla_ckpt.testing.fault_proxy import Fault, FaultProxy, downloads
    from xla_ckpt.testing.launcher import WorkerPool

    tmp = tempfile.mkdtemp(prefix="xla-ckpt-sharded-")
    with WorkerPool(1, xla=False, env=emu.env()) as zygote:
        for backend in args.sharded_backends.split(","):
            if not args.sharded_points:
                break
            base = os.path.join(tmp, "crash") if backend == "local" \
                else emu.unique_uri("crash-sharded")
            (res,) = zygote.run(H.sharded_campaign, base, backend, args.sharded_points,
                                timeout_s=3600, world=args.sharded_world,
                                verify_world=args.sharded_verify_world,
                                emulator_host=emu.host, bucket=emu.bucket)
            out = res.unwrap()
            results = out["results"]
            violations = [v for r in results for v in H.check_sharded(r)]
            lost = sum(1 for r in results
                       if not {H.A, H.B} <= set(r["verify"].get("committed", []))
                       or any(d for per in r["verify"].get("bitwise", {}).values()
                              for d in per.values()))
            emit(f"sharded_crash_{backend}", {
                "world": out["world"], "verify_world": out["verify_world"],
                "kill_points": len(results),
                "points_per_rank": {v: sum(r["victim"] == v for r in results)
                                    for v in sorted(out["steps"])},
                "mutating_steps_per_rank": {v: len(s) for v, s in out["steps"].items()},
                "commit_step_rank0": out["commit_step"],
                "points_after_commit": sum(r["expect_committed"] for r in results),
                "points_inside_a_body": sum(r["point"]["at"] == "byte" for r in results),
                "jobs_sigkilled": sum(set(r["exitcodes"].values()) == {-9} for r in results),
                "violations": len(violations), "violation_samples": violations[:5],
                "lost_checkpoints": lost,
                "torn_chosen_as_latest": sum(1 for r in results if not r["expect_committed"]
                                             and r["verify"].get("latest") == H.C),
                "fresh_starts_with_committed": sum(
                    1 for r in results for n in r["verify"].get("resumed", {}).values()
                    if n is None),
                "resumes": sum(len(r["verify"].get("resumed", {})) for r in results),
                "resumed_and_saved_again": sum(
                    1 for r in results for n in r["verify"].get("recovered", {}).values() if n),
                "kills_leaving_temp_objects": sum(bool(r["strays"]) for r in results),
                "seconds": round(out["seconds"], 1)}, sink)

        if args.sharded_faults:
            kib = 1024
            moderate = dict(max_workers=4, slice_size_bytes=512 * kib, initial_backoff_s=0.01,
                            max_backoff_s=0.2, max_attempts=8, retry_deadline_s=60.0)
            uri = emu.unique_uri("faults-sharded")
            with WorkerPool(F.SHARDED_WORLD, xla=False) as pool:
                [r.unwrap() for r in pool.run(F.save_sharded_fault_checkpoint, uri,
                                              env=emu.env(), timeout_s=300)]
                with FaultProxy(emu.host, seed=args.seed) as proxy:
                    t = F.run_rounds(pool, proxy, uri, min_faults=args.sharded_faults,
                                     probability=0.12, storage_kwargs=moderate,
                                     round_fn=F.sharded_restore_round)
                    emit("sharded_faults_moderate", t, sink)
                with FaultProxy(emu.host) as proxy:
                    proxy.inject(Fault.flip(), match=downloads("chunks-00001"), times=100_000)
                    flipped = pool.run(F.sharded_restore_round, uri, moderate, 120.0,
                                       timeout_s=300, env=proxy.env())
                    outs = [r.unwrap() for r in flipped]
                    emit("sharded_faults_every_read_flipped", {
                        "flips": proxy.snapshot().faults.get("flip", 0),
                        "outcomes": sorted({o["outcome"] for o in outs}),
                        "errors": sorted({o.get("error", "") for o in outs}),
                        "same_failed_ranks_everywhere":
                            len({tuple(o.get("failed_ranks", ())) for o in outs}) == 1,
                        "message_names_chunk_key": all("chunks-00001" in o.get("message", "")
                                                       and "model" in o.get("message", "")
                                                       for o in outs),
                        "sample": outs[0].get("message", "")[:600]}, sink)

        if not args.sharded_rank_repeats:
            return
        cases = [("save", phase, scenario, 0 if phase == "commit" else 1)
                 for phase in ("agree", "write", "commit") for scenario in ("raise", "stall",
                                                                             "kill")]
        cases += [("restore", strategy, scenario, victim)
                  for strategy in ("all_ranks", "broadcast")
                  for scenario, victim in (("raise", 0 if strategy == "broadcast" else 1),
                                           ("stall", 2), ("kill", 2), ("coordinator", 0))]
        ckpt = os.path.join(tmp, "ranks-ckpt")
        (saved,) = zygote.run(H.run_job, W.SHARDED_WORLD,
                              functools.partial(W.save_sharded_checkpoint, uri=ckpt), 120.0,
                              timeout_s=300)
        assert all(r["value"]["outcome"] == "ok" for r in saved.unwrap())
        rows: list[dict] = []
        for kind, where, scenario, victim in cases * args.sharded_rank_repeats:
            if kind == "save":
                uri = os.path.join(tmp, f"save-{len(rows)}")
                body = functools.partial(W.sharded_save_with_victim, uri=uri, phase=where,
                                         scenario=scenario, victim=victim, timeout_s=3.0)
            else:
                uri = ckpt
                body = functools.partial(W.sharded_restore_with_victim, uri=ckpt,
                                         strategy=where, scenario=scenario, victim=victim,
                                         timeout_s=3.0)
            (job,) = zygote.run(H.run_job, W.SHARDED_WORLD, body, 60.0, timeout_s=180)
            got = job.unwrap()
            survivors = [r for r in got if r["rank"] != victim]
            named = sum(1 for r in survivors if r["value"] and r["value"].get("outcome") ==
                        "error" and {int(k) for k in r["value"].get("failures", {})} == {victim})
            row = {"kind": kind, "where": where, "scenario": scenario, "victim": victim,
                   "hangs": sum(r["hang"] for r in got), "survivors": len(survivors),
                   "survivors_naming_victim": named,
                   "slowest_survivor_s": round(max((r["value"] or {}).get("seconds", 1e9)
                                                   for r in survivors), 2)}
            if kind == "save":
                row["committed"] = os.path.exists(os.path.join(uri, "manifest.json"))
                row["files_left"] = sorted(os.listdir(uri)) if os.path.isdir(uri) else []
            rows.append(row)
        emit("sharded_rank_failures", {
            "cases": len(rows), "world": W.SHARDED_WORLD, "collective_timeout_s": 3.0,
            "diagnosis_s": DEAD_AFTER_S, "hangs": sum(r["hangs"] for r in rows),
            "survivors": sum(r["survivors"] for r in rows),
            "survivor_errors_naming_the_failed_rank": sum(r["survivors_naming_victim"]
                                                          for r in rows),
            "failed_saves_committed": [f"{r['where']}/{r['scenario']}" for r in rows
                                       if r["kind"] == "save" and r["committed"]],
            "slowest_survivor_s": max((r["slowest_survivor_s"] for r in rows), default=None),
            "rows": rows}, sink)


PARTS = {"crash": part_crash, "replace": part_replace,
         "interrupt": part_interrupt, "fencing": part_fencing, "faults": part_faults,
         "ranks": part_ranks, "soak": part_soak, "sharded": part_sharded}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated: " + ",".join(PARTS))
    ap.add_argument("--crash-points", type=int, default=100, help="kill points per backend (sync)")
    ap.add_argument("--async-points", type=int, default=30, help="kill points per backend (async)")
    ap.add_argument("--replace-trials", type=int, default=40,
                    help="reads with a save between slices, per backend")
    ap.add_argument("--replace-free-reads", type=int, default=40,
                    help="reads while another process saves freely, per backend")
    ap.add_argument("--interrupt-repeats", type=int, default=3,
                    help="runs of each (worker mode, signal) pair")
    ap.add_argument("--interrupt-window-s", type=float, default=4.5,
                    help="the signal comes at a uniform random time this long after the first "
                         "part appeared")
    ap.add_argument("--fencing-points", type=int, default=48,
                    help="points of the predecessor's save per backend and variant")
    ap.add_argument("--faults", type=int, default=1000, help="faults to inject (moderate rate)")
    ap.add_argument("--storm-faults", type=int, default=300, help="faults to inject (storm)")
    ap.add_argument("--range-answers", type=int, default=300,
                    help="200-without-Content-Range answers (Range ignored, short) to send")
    ap.add_argument("--clean-rounds", type=int, default=5, help="fault-free rounds (the peer)")
    ap.add_argument("--rank-repeats", type=int, default=2, help="runs of each rank-failure case")
    ap.add_argument("--exchanges", type=int, default=500,
                    help="control-plane exchanges timed with and without progress marks")
    ap.add_argument("--soak-cycles", type=int, default=100, help="save/restore cycles per backend")
    ap.add_argument("--sharded-points", type=int, default=24,
                    help="sharded part: kill points per backend (over every rank's steps)")
    ap.add_argument("--sharded-world", type=int, default=2, help="sharded part: saving ranks")
    ap.add_argument("--sharded-backends", default="local,gcs",
                    help="sharded part: backends of the crash points (comma-separated)")
    ap.add_argument("--sharded-verify-world", type=int, default=None,
                    help="sharded part: ranks of the verifying job (default: the saving world)")
    ap.add_argument("--sharded-faults", type=int, default=300,
                    help="sharded part: faults to inject into the byte-range restores")
    ap.add_argument("--sharded-rank-repeats", type=int, default=1,
                    help="sharded part: runs of each rank-failure case")
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
