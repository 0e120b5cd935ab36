"""Rank failures while 4 gloo ranks restore, both strategies: nobody hangs, the culprit is named.

For each case (``rank_workers.py``): one rank raises during its read, is
SIGKILLed, stalls past the collective timeout, or is the coordinator (rank 0)
and dies.  Every surviving rank must end with a library error whose
``failures`` names the failed rank, within the collective timeout plus a
margin (the time :mod:`xla_ckpt.comm.liveness` takes to tell a dead rank from
a live one); the launcher's hard timeout turns any hang into a failure here.
``tests/restore/test_restore_multiprocess.py`` covers a corrupt read on local
files and a rank killed mid-broadcast with 8 ranks; this file adds the
naming, the timing, and the other cases.

Sharded cases (``rank_workers``, sharded section): 3 forked ranks save DTensor state with the
chunked ``save_distributed`` or restore it into DTensor targets (both strategies) while one
rank raises, stalls or dies at the structure agreement, its chunk write, rank 0's commit, or
its reads; every survivor names it in time, and a failed save commits nothing (but one
window, documented in RELIABILITY.md).

Every case with a job of its own (a rank that stalls or dies, a host's stream that stalls in a
fault proxy of its own, the sharded cases) runs in a fresh job forked from one warm zygote, all
in one staggered batch (``victim_jobs``): the cases mostly wait out timeouts, so they overlap.
The cases that leave every process alive run one at a time on a shared pool.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import crash_harness as H
import pytest
import rank_workers as W

from xla_ckpt.api import save
from xla_ckpt.comm.liveness import DEAD_AFTER_S
from xla_ckpt.testing.fault_proxy import Fault, FaultProxy, downloads, from_address, host_address
from xla_ckpt.testing.launcher import WorkerPool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TIMEOUT_S = 3.0
MARGIN_S = DEAD_AFTER_S + 12.0  # diagnosing who failed, plus generous scheduling slack on 2 cores
HARD_TIMEOUT_S = 60.0           # the launcher kills any rank still running after this
STRATEGIES = ["all_ranks", "broadcast", "broadcast_host_memory"]
STAGGER_S = 1.5  # between the starts of the forked jobs of one batch (see ``victim_jobs``)


@pytest.fixture(scope="module")
def zygote():
    """One clean worker process; every forked job (a rank that dies or stalls, the sharded
    jobs) is forked from it (a death retires nothing)."""
    p = WorkerPool(1, xla=False)
    (ready,) = p.run(W.preload)  # each fork starts warm: no imports of its own
    ready.unwrap()
    yield p
    p.close()


@dataclass
class _Forked:
    """One rank of a forked job, read like the launcher's ``RankResult``."""

    rank: int
    value: dict | None
    exitcode: int | None
    timed_out: bool

    def unwrap(self) -> dict:
        assert self.value is not None and "outcome" in self.value, (self.rank, self.exitcode,
                                                                    self.value)
        return self.value


def _fix_failures(rows: list[dict]) -> list[dict]:
    for r in rows:  # (the ranks answered in JSON: rank keys came back as strings)
        if r["value"] and "failures" in r["value"]:
            r["value"]["failures"] = {int(k): v for k, v in r["value"]["failures"].items()}
    return rows


@pytest.fixture(scope="module")
def pool():
    """4 ranks for the cases that leave every process alive."""
    p = WorkerPool(4, xla=False)
    yield p
    p.close()


@pytest.fixture(scope="module")
def local_ckpt(tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("ranks") / "ckpt")
    state, ranks = W.checkpoint_state()
    save(state, uri, rank_states=ranks)
    return uri


@pytest.fixture(scope="module")
def gcs_ckpt(gcs_emulator):
    uri = gcs_emulator.unique_uri("ranks")
    state, ranks = W.checkpoint_state()
    saved = dict(os.environ)
    os.environ.update(gcs_emulator.env())
    try:
        save(state, uri, rank_states=ranks)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    yield uri
    gcs_emulator.delete_prefix(uri.split("/", 3)[3] + "/")


@pytest.fixture(scope="module")
def sharded_saves(tmp_path_factory):
    """The folder under which each sharded save case saves (``<phase>-<scenario>-<victim>``)."""
    return tmp_path_factory.mktemp("sharded-saves")


@dataclass
class _Batch:
    """What ``victim_jobs`` ran: each case's ranks (4-rank restores: :class:`_Forked` per
    rank; sharded jobs: ``run_job`` rows), and each stream stall's proxy records."""

    ranks: dict[tuple, list]
    proxy_records: dict[str, list]


@pytest.fixture(scope="module")
def victim_jobs(zygote, local_ckpt, plan_local_ckpt, sharded_ckpt, sharded_saves, gcs_emulator,
                plan_gcs_ckpt):
    """The cases below with a job of their own (a rank stalls or dies, a host's stream stalls
    in its own fault proxy; every sharded case), each job forked from the zygote, run as one
    batch (``crash_harness.run_jobs``).  Such a case spends its seconds waiting (a stall of
    ``TIMEOUT_S + STALL_EXTRA_S``, the collective timeout, a dead rank's silence for
    ``DEAD_AFTER_S``), so the jobs overlap, started ``STAGGER_S`` apart so that their busy
    starts do not; each test then asserts on its own job's ranks, as it did on a job run
    alone.  (The emulator is never held by a stalled body: a proxy reads the whole answer
    before it sends any of it.)"""
    cases: dict[tuple, tuple[int, functools.partial]] = {}
    scenario_of: dict[tuple, str] = {}

    def job(key: tuple, scenario: str, fn, *args, env: dict | None = None) -> None:
        cases[key] = (4, functools.partial(W.in_job, fn, args, env=env))
        scenario_of[key] = scenario

    for strategy in STRATEGIES:
        job(("stall", strategy), "stall", W.restore_with_victim, local_ckpt, strategy, "stall", 2,
            TIMEOUT_S)
        for scenario, victim in RANK_DEATHS:
            job(("dies", strategy, scenario, victim), scenario, W.restore_with_victim,
                local_ckpt, strategy, scenario, victim, TIMEOUT_S)
    for plan, victim in PLAN_STALLS:
        job(("plan_stall", plan, victim), "stall", W.restore_plan_with_victim, plan_local_ckpt,
            plan, "stall", victim, TIMEOUT_S)
    for plan, scenario, victim in PLAN_DEATHS:
        job(("plan_dies", plan, scenario, victim), scenario, W.restore_plan_with_victim,
            plan_local_ckpt, plan, scenario, victim, TIMEOUT_S)
    for phase, scenario, victim in SHARDED_CASES_SAVE:
        key = ("sharded_save", phase, scenario, victim)
        uri = str(sharded_saves / f"{phase}-{scenario}-{victim}")
        cases[key] = (W.SHARDED_WORLD, functools.partial(
            W.sharded_save_with_victim, uri=uri, phase=phase, scenario=scenario, victim=victim,
            timeout_s=TIMEOUT_S))
        scenario_of[key] = scenario
    for strategy, scenario, victim in SHARDED_CASES_RESTORE:
        key = ("sharded_restore", strategy, scenario, victim)
        cases[key] = (W.SHARDED_WORLD, functools.partial(
            W.sharded_restore_with_victim, uri=sharded_ckpt, strategy=strategy,
            scenario=scenario, victim=victim, timeout_s=TIMEOUT_S))
        scenario_of[key] = scenario
    # The longest first (a stall, then the stalled rank's late collective; then a death, the
    # survivors' DEAD_AFTER_S of silence; then a rank that raises): the batch ends sooner.
    order = {"stall": 0, "kill": 1, "coordinator": 1, "kill_follow": 1, "raise": 2}
    with contextlib.ExitStack() as stack:
        proxies = {}
        for plan in STREAM_STALLS:
            # The first body sent to host 1 for the state's data file stops after 1 KiB for
            # longer than the collective timeout (see test_plan_host_stream_stalls_mid_stripe).
            proxy = proxies[plan] = stack.enter_context(FaultProxy(gcs_emulator.host))
            proxy.inject(Fault.stall(TIMEOUT_S + W.STALL_EXTRA_S, after_bytes=1024),
                         match=from_address(host_address(1), downloads("-state.safetensors")))
            job(("stream_stall", plan), "stall", W.restore_plan_with_victim, plan_gcs_ckpt, plan,
                "proxy", -1, TIMEOUT_S, env=proxy.env())
        keys = sorted(cases, key=lambda k: order[scenario_of[k]])
        (res,) = zygote.run(H.run_jobs, [cases[k] for k in keys], HARD_TIMEOUT_S, STAGGER_S,
                            timeout_s=HARD_TIMEOUT_S + len(keys) * STAGGER_S + 60)
        records = {plan: proxy.records() for plan, proxy in proxies.items()}
    out: dict[tuple, list] = {}
    for key, rows in zip(keys, res.unwrap(), strict=True):
        rows = _fix_failures(rows)
        out[key] = rows if key[0].startswith("sharded") else [
            _Forked(r["rank"], r["value"], r["exitcode"], r["hang"]) for r in rows]
    return _Batch(out, records)


def _survivors_name(results, victim: int, what: str) -> float:
    """Assert every rank but ``victim`` raised a DistributedError naming it in time; returns the
    slowest survivor's seconds."""
    assert not any(r.timed_out for r in results), f"{what}: a rank hung"
    slowest = 0.0
    for r in results:
        if r.rank == victim:
            continue
        v = r.unwrap()
        assert v["outcome"] == "error", (what, r.rank, v)
        assert v["error"] in ("DistributedError", "CollectiveTimeoutError"), (what, v)
        assert set(v["failures"]) == {victim}, (what, r.rank, v["failures"])
        assert f"rank {victim}: " in v["message"]
        assert v["seconds"] <= TIMEOUT_S + MARGIN_S, (what, r.rank, v["seconds"])
        slowest = max(slowest, v["seconds"])
    print(f"{what}: survivors named rank {victim} within {slowest:.2f} s "
          f"(timeout {TIMEOUT_S:g} s + margin {MARGIN_S:g} s)")
    return slowest


@pytest.mark.parametrize("strategy,victim", [("all_ranks", 2), ("broadcast", 0),
                                             ("broadcast_host_memory", 0)])
def test_rank_raises_during_read(pool, gcs_emulator, gcs_ckpt, strategy, victim):
    # all_ranks: only rank 2 reads its own rank item; broadcast: only rank 0 reads at all.
    target = "rank-00002" if strategy == "all_ranks" else "-state.safetensors"
    with FaultProxy(gcs_emulator.host) as proxy:
        proxy.inject(Fault.error(403), match=downloads(target), times=1000)
        results = pool.run(W.restore_with_victim, gcs_ckpt, strategy, "raise", victim, TIMEOUT_S,
                           timeout_s=HARD_TIMEOUT_S, env=proxy.env())
    _survivors_name(results, victim, f"{strategy}: rank {victim} raises")
    for r in results:  # one agreement step: the same error, naming the cause, on every rank
        v = r.value
        assert v["error"] == "DistributedError"
        assert v["failures"][victim].startswith("StoragePermissionError: ")
        assert "HTTP 403" in v["failures"][victim] and target in v["failures"][victim]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_rank_stalls_past_the_timeout(victim_jobs, strategy):
    results = victim_jobs.ranks["stall", strategy]  # restore_with_victim(local_ckpt, "stall", 2)
    _survivors_name(results, 2, f"{strategy}: rank 2 stalls")
    for r in results:  # alive, but never entered the collective the others waited in
        if r.rank != 2:
            assert "did not enter" in r.value["failures"][2] and "hangs" in r.value["failures"][2]
    # The stalled rank itself does not hang either: its next collective fails at once.
    late = results[2].unwrap()
    assert late["outcome"] == "error" and late["error"] in ("DistributedError",
                                                            "CollectiveTimeoutError")
    assert late["seconds"] <= TIMEOUT_S + W.STALL_EXTRA_S + MARGIN_S


RANK_DEATHS = [("kill", 2), ("coordinator", 0)]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("scenario,victim", RANK_DEATHS)
def test_rank_dies(victim_jobs, strategy, scenario, victim):
    # restore_with_victim(local_ckpt, ...) in a job of its own (a death retires the job)
    results = victim_jobs.ranks["dies", strategy, scenario, victim]
    assert results[victim].exitcode == -9
    _survivors_name(results, victim, f"{strategy}: rank {victim} ({scenario}) SIGKILLed")
    for r in results:
        if r.rank != victim:
            assert r.value["failures"][victim].startswith(
                f"died: no heartbeat for {DEAD_AFTER_S:g} s"), r.value["failures"]



# ---- sharded save and restore: 3 ranks of DTensor state (rank_workers, sharded section) -------

SHARDED_CASES_SAVE = [("agree", "raise", 1), ("write", "kill", 1), ("commit", "stall", 0)]
SHARDED_CASES_RESTORE = [("all_ranks", "kill", 1), ("broadcast", "stall", 2),
                         ("broadcast", "raise", 0)]


def _job(zygote, body) -> list[dict]:
    (res,) = zygote.run(H.run_job, W.SHARDED_WORLD, body, HARD_TIMEOUT_S,
                        timeout_s=HARD_TIMEOUT_S + 60)
    return _fix_failures(res.unwrap())


@pytest.fixture(scope="module")
def sharded_ckpt(zygote, tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("sharded-ranks") / "ckpt")
    rows = _job(zygote, functools.partial(W.save_sharded_checkpoint, uri=uri))
    assert [r["value"]["outcome"] for r in rows] == ["ok"] * W.SHARDED_WORLD, rows
    return uri


def _sharded_survivors_name(rows: list[dict], victim: int, scenario: str, what: str) -> None:
    assert not any(r["hang"] for r in rows), f"{what}: a rank hung: {rows}"
    if scenario in ("kill", "coordinator"):
        assert rows[victim]["exitcode"] == -9, rows[victim]
    slowest = 0.0
    for r in rows:
        v = r["value"]
        if r["rank"] == victim:
            if scenario != "kill":  # the victim itself ends with an error too
                assert v["outcome"] == "error", (what, v)
            continue
        assert v["outcome"] == "error", (what, r["rank"], v)
        assert v["error"] in ("DistributedError", "CollectiveTimeoutError"), (what, v)
        assert set(v["failures"]) == {victim}, (what, r["rank"], v["failures"])
        assert f"rank {victim}" in v["message"], v["message"]
        assert v["seconds"] <= TIMEOUT_S + MARGIN_S, (what, r["rank"], v["seconds"])
        slowest = max(slowest, v["seconds"])
    print(f"{what}: survivors named rank {victim} within {slowest:.2f} s")


@pytest.mark.parametrize("phase,scenario,victim", SHARDED_CASES_SAVE)
def test_sharded_save_rank_fails(zygote, victim_jobs, sharded_saves, phase, scenario, victim):
    # sharded_save_with_victim(uri, phase, scenario, victim) in a job of its own
    uri = str(sharded_saves / f"{phase}-{scenario}-{victim}")
    rows = victim_jobs.ranks["sharded_save", phase, scenario, victim]
    _sharded_survivors_name(rows, victim, scenario, f"sharded save, {phase}: rank {victim} "
                                                    f"{scenario}")
    committed = os.path.exists(os.path.join(uri, "manifest.json"))
    if (phase, scenario, victim) == ("commit", "stall", 0):
        # Rank 0 stalled *at* its manifest write: the survivors gave up and raised; when it
        # woke it wrote the manifest, then raised too (its commit agreement had no peers).
        # The checkpoint is complete (every rank's data file was agreed before the commit)
        # and restores bitwise; see RELIABILITY.md "Found by these runs".
        assert rows[0]["value"]["outcome"] == "error"
        if committed:
            check = _job(zygote, functools.partial(W.sharded_restore_with_victim, uri=uri,
                                                   strategy="all_ranks", scenario="none",
                                                   victim=-1, timeout_s=60.0))
            assert [r["value"].get("diff") for r in check] == [""] * W.SHARDED_WORLD, check
    else:
        # Nothing was committed.
        assert not committed
    if phase == "agree":
        assert not os.path.exists(uri) or os.listdir(uri) == []  # nothing was written at all
        if scenario == "raise":  # the same error on every rank, naming the rank and the key
            for r in rows:
                assert "only_on_rank_1" in r["value"]["message"]


@pytest.mark.parametrize("strategy,scenario,victim", SHARDED_CASES_RESTORE)
def test_sharded_restore_rank_fails(victim_jobs, strategy, scenario, victim):
    # sharded_restore_with_victim(sharded_ckpt, strategy, scenario, victim) in a job of its own
    rows = victim_jobs.ranks["sharded_restore", strategy, scenario, victim]
    _sharded_survivors_name(rows, victim, scenario, f"sharded restore, {strategy}: rank "
                                                    f"{victim} {scenario}")
    if scenario == "raise":
        for r in rows:
            assert r["value"]["failures"][victim].startswith("OSError: "), r["value"]


# ---- per_host and striped on 2 emulated hosts x 2 ranks (rank_workers, plans section) ---------
#
# The hosts are ranks 0-1 and 2-3.  Every survivor must raise within the timeout, naming the
# victim; a per-host follower whose leader failed may be named too, with a cause that names
# the leader (it waited for the leader's fill).

@pytest.fixture(scope="module")
def plan_local_ckpt(tmp_path_factory):
    from xla_ckpt.io.manifest_file import read_manifest
    from xla_ckpt.restore.blobs import blob_reads
    from xla_ckpt.storage import open_storage

    uri = str(tmp_path_factory.mktemp("plan-ranks") / "ckpt")
    state, ranks = W.plan_checkpoint_state()
    save(state, uri, rank_states=ranks)
    with open_storage(uri) as st:
        m = read_manifest(st)
    # striped and striped_private: every rank reads a range of its own, so a hooked first
    # read is a range read
    assert all(blob_reads(m, "state", 4))
    return uri


@pytest.fixture(scope="module")
def plan_gcs_ckpt(gcs_emulator):
    uri = gcs_emulator.unique_uri("plan-ranks")
    state, ranks = W.plan_checkpoint_state()
    saved = dict(os.environ)
    os.environ.update(gcs_emulator.env())
    try:
        save(state, uri, rank_states=ranks)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    yield uri
    gcs_emulator.delete_prefix(uri.split("/", 3)[3] + "/")


PLAN_STALLS = [("striped", 3), ("per_host", 2), ("striped_private", 1)]
PLAN_DEATHS = [("striped", "kill", 3), ("per_host", "kill", 2), ("per_host", "kill_follow", 3),
               ("striped_private", "kill", 2)]


def _plan_survivors_name(results, victim: int, what: str, *, dead: bool = False) -> None:
    """Every rank but ``victim`` raised a library error naming it within the timeout (others
    named beside it are followers that name it in their cause)."""
    assert not any(r.timed_out for r in results), f"{what}: a rank hung"
    slowest = 0.0
    for r in results:
        if r.rank == victim:
            continue
        v = r.unwrap()
        assert v["outcome"] == "error", (what, r.rank, v)
        assert v["error"] in ("DistributedError", "CollectiveTimeoutError"), (what, v)
        assert victim in v["failures"], (what, r.rank, v["failures"])
        for other, cause in v["failures"].items():
            if other != victim:
                assert f"rank {victim}" in cause, (what, r.rank, v["failures"])
        assert f"rank {victim}" in v["message"]
        assert v["seconds"] <= TIMEOUT_S + MARGIN_S, (what, r.rank, v["seconds"])
        slowest = max(slowest, v["seconds"])
    print(f"{what}: survivors named rank {victim} within {slowest:.2f} s")


@pytest.mark.parametrize("plan,victim", PLAN_STALLS)
def test_plan_reader_stalls_past_the_timeout(victim_jobs, plan, victim):
    # restore_plan_with_victim(plan_local_ckpt, plan, "stall", victim) in a job of its own
    results = victim_jobs.ranks["plan_stall", plan, victim]
    _plan_survivors_name(results, victim, f"{plan}: rank {victim} stalls mid-read")
    late = results[victim].unwrap()  # the stalled rank does not hang either
    assert late["outcome"] == "error", late
    assert late["seconds"] <= TIMEOUT_S + W.STALL_EXTRA_S + MARGIN_S


@pytest.mark.parametrize("plan,scenario,victim", PLAN_DEATHS)
def test_plan_reader_dies(victim_jobs, plan, scenario, victim):
    # restore_plan_with_victim(plan_local_ckpt, plan, scenario, victim) in a job of its own
    results = victim_jobs.ranks["plan_dies", plan, scenario, victim]
    assert results[victim].exitcode == -9
    _plan_survivors_name(results, victim, f"{plan}: rank {victim} ({scenario}) SIGKILLed",
                         dead=True)
    for r in results:
        if r.rank != victim:
            assert r.value["failures"][victim].startswith(
                f"died: no heartbeat for {DEAD_AFTER_S:g} s"), r.value["failures"]


@pytest.mark.parametrize("plan", ["striped", "per_host"])
def test_plan_host_reads_fail(pool, gcs_emulator, plan_gcs_ckpt, plan):
    # Host 1's reads of the state's data file are refused (HTTP 403): its stripe readers
    # (striped: ranks 2 and 3) or its leader (per_host: rank 2) fail; every rank says so.
    target = "-state.safetensors"
    with FaultProxy(gcs_emulator.host) as proxy:
        proxy.inject(Fault.error(403), match=from_address(host_address(1), downloads(target)),
                     times=1000)
        results = pool.run(W.restore_plan_with_victim, plan_gcs_ckpt, plan, "proxy", -1, TIMEOUT_S,
                           timeout_s=HARD_TIMEOUT_S, env=proxy.env())
        refused = [r for r in proxy.records() if r.status == 403]
    assert refused and {r.client_address for r in refused} == {host_address(1)}
    readers = {2, 3} if plan == "striped" else {2}
    outs = [r.unwrap() for r in results]
    for v in outs:
        assert v["outcome"] == "error" and v["error"] == "DistributedError", v
        assert readers <= set(v["failures"]) <= {2, 3}, v["failures"]
        for k in readers:
            assert v["failures"][k].startswith("StoragePermissionError: ")
            assert "HTTP 403" in v["failures"][k] and target in v["failures"][k]
        assert v["seconds"] <= TIMEOUT_S + MARGIN_S
    assert len({tuple(sorted(v["failures"].items())) for v in outs}) == 1  # one agreement


STREAM_STALLS = ["striped", "per_host"]


@pytest.mark.parametrize("plan", STREAM_STALLS)
def test_plan_host_stream_stalls_mid_stripe(victim_jobs, plan):
    # The first body sent to host 1 for the state's data file stops after 1 KiB for longer
    # than the collective timeout: the rank reading it stalls mid-stripe (striped: rank 2 or
    # 3; per_host: the leader, rank 2); every other rank raises in time naming it.
    # (restore_plan_with_victim(plan_gcs_ckpt, plan, "proxy") through its own proxy, in a job
    # of its own: see victim_jobs.)
    results = victim_jobs.ranks["stream_stall", plan]
    stalled = [r for r in victim_jobs.proxy_records[plan] if r.fault == "stall"]
    assert len(stalled) == 1 and stalled[0].client_address == host_address(1)
    assert not any(r.timed_out for r in results)
    outs = [r.unwrap() for r in results]
    named = set().union(*(set(v.get("failures", {})) for v in outs))
    assert named and named <= {2, 3}, [v.get("failures") for v in outs]
    if plan == "per_host":
        assert 2 in named
    for v in outs:
        assert v["outcome"] == "error", v
        assert v["error"] in ("DistributedError", "CollectiveTimeoutError"), v
        if v["rank"] not in named:
            assert set(v["failures"]) & named and v["seconds"] <= TIMEOUT_S + MARGIN_S, v


# ---- the manager's restore decision: rank 0 fails alone (issue 25, defect 9) ------------------

@pytest.mark.parametrize("call", ["restore_or_initialize", "restore_step"])
@pytest.mark.parametrize("fault", ["precondition", "eio"])
def test_manager_restore_rank0_fails_every_rank_raises_one_type(pool, tmp_path, fault, call):
    """Rank 0 decides for every rank and fails: a library error (the issue's
    PreconditionFailedError) is raised as that class on every rank, with its attributes and a
    note naming rank 0; any other error is one DistributedError naming rank 0 and the cause."""
    run_dir = str(tmp_path / "run")
    os.mkdir(run_dir)
    outs = [r.unwrap() for r in pool.run(W.manager_restore_rank0_fails, run_dir, fault, call,
                                         timeout_s=HARD_TIMEOUT_S)]
    assert [o["rank"] for o in outs] == [0, 1, 2, 3]
    assert len({(o["error"], o["message"]) for o in outs}) == 1, outs  # one error, every rank
    for o in outs:
        assert o["outcome"] == "error"
        if fault == "precondition":
            assert o["error"] == "PreconditionFailedError"
            assert o["message"] == f"{run_dir}: the object changed (HTTP 412)"
            assert o["attrs"] == {"name": "", "expected_generation": 7, "actual_generation": 9}
            assert any(n.startswith("rank 0 hit this error while it decided for all 4 ranks")
                       for n in o["notes"]), o["notes"]
        else:
            assert o["error"] == "DistributedError"
            assert list(o["failures"]) == [0]
            assert o["failures"][0].startswith("OSError: [Errno 5] Input/output error")
            assert o["message"].startswith("rank 0 could not ")
