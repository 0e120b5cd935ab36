"""8 readers restore through random 503/429/resets/short bodies/flipped bytes: nothing silent.

See ``faults_harness.py``.  The sharded cases: 3 ranks restore a chunked (DTensor) checkpoint
into DTensor targets of another layout, each reading only the byte ranges of its own shards,
through the same faults; and a round in which every read of one rank's chunk file is flipped
ends in one clean error on every rank naming the chunk.

CI injects a few hundred faults; the full count (``benchmarks/reliability.py --faults 1000``,
``--parts sharded --sharded-faults N``) is in RELIABILITY.md.
"""

from __future__ import annotations

import functools

import faults_harness as F
import pytest

from xla_ckpt.testing.fault_proxy import Fault, FaultProxy, downloads
from xla_ckpt.testing.launcher import WorkerPool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CI_FAULTS = 200
CI_SHARED_FAULTS = 60  # the moderate rounds on the default read path (see READ_PATHS)
CI_STORM_FAULTS = 100
KiB = 1024
# Fast retries for tests; the policy (capped exponential backoff, full jitter, deadline) is the
# production one.
MODERATE = dict(max_workers=4, slice_size_bytes=512 * KiB, initial_backoff_s=0.01,
                max_backoff_s=0.2, max_attempts=8, retry_deadline_s=60.0)
STORM = dict(MODERATE, max_attempts=3)
# The moderate rounds on both read paths of all_ranks.  The library's default, host shared
# memory: the ranks of a host share one read (rank 0 alone reads here, the other 7 map its
# copy), so a round makes an eighth of the requests and reaches fewer faults (the storm below
# keeps that path too).  And every rank reading the whole checkpoint itself (8 readers: 8
# times the requests of a round), where the full CI count of faults comes quickest.
READ_PATHS = {
    "host_shared_memory": (F.restore_round, CI_SHARED_FAULTS),
    "every_rank_reads": (functools.partial(F.restore_round, host_shared_memory=False),
                         CI_FAULTS),
}
PLAN_OF = {"host_shared_memory": "per_host", "every_rank_reads": "all_ranks"}  # stats.plan


@pytest.fixture(scope="module")
def pool8():
    pool = WorkerPool(F.WORLD, xla=False)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def checkpoint(gcs_emulator):
    import os

    uri = gcs_emulator.unique_uri("faults")
    saved = dict(os.environ)
    os.environ.update(gcs_emulator.env())
    try:
        nbytes = F.save_fault_checkpoint(uri)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert nbytes > 3 * 1024 * KiB
    yield uri
    gcs_emulator.delete_prefix(uri.split("/", 3)[3] + "/")


def _report(t: dict, what: str) -> str:
    return (f"{what}: {t['faults_total']} faults injected ({t['faults']}) over {t['requests']} "
            f"requests, {t['rounds']} rounds x {t['restores'] // max(t['rounds'], 1)} readers = "
            f"{t['restores']} restores: "
            f"{t['outcomes']}; clean errors {t['clean_errors']}; retries {t['retries']} "
            f"({t['retry_causes']}), crc32c re-reads {t['crc_rereads']}, one-request "
            f"fallbacks {t['fallbacks']}; hangs {t['hangs']}; "
            f"{t['seconds']:.1f} s")


def _nothing_silent(t: dict) -> None:
    assert t["problems"] == []
    assert t["silent_corruptions"] == 0 and t["hangs"] == 0
    assert set(t["outcomes"]) <= {"correct", "clean_error"}
    assert sum(t["outcomes"].values()) == t["restores"]



def _retries_match_faults(t: dict, f: dict) -> None:
    """Every injected 503 / 429 is one retry of that cause; every reset is one retry of a
    broken connection or body.  A short body usually fails its crc32c check (a re-read, not a
    retry), but when it is cut where the transport notices it first it is a "body ended"
    retry: so broken-transfer retries lie between the resets and resets + short bodies (seen
    once under CI load: 17 for 16 resets and 10 short bodies)."""
    causes = t["retry_causes"]
    assert causes.get("http_503", 0) == f["status_503"], causes
    assert causes.get("http_429", 0) == f["status_429"], causes
    broken = sum(causes.get(k, 0) for k in ("connection_broke", "body_ended", "empty_body",
                                            "request_failed"))
    assert f["reset"] <= broken <= f["reset"] + f["short"], (causes, f)
    assert t["retries"] == sum(causes.values()), causes


@pytest.mark.parametrize("read_path", list(READ_PATHS))
def test_eight_readers_recover_from_every_fault(pool8, gcs_emulator, checkpoint, read_path):
    round_fn, min_faults = READ_PATHS[read_path]
    with FaultProxy(gcs_emulator.host, seed=20261130) as proxy:
        t = F.run_rounds(pool8, proxy, checkpoint, min_faults=min_faults, probability=0.12,
                         storage_kwargs=MODERATE, round_fn=round_fn)
    print(_report(t, f"moderate, {read_path}"))
    _nothing_silent(t)
    assert t["faults_total"] >= min_faults
    assert all(t["faults"][k] > 0 for k in F.FAULT_KINDS), t["faults"]
    # At this rate the retry budget absorbs nearly every fault.  A restore may still fail --
    # cleanly -- when one slice came back flipped on all 3 of its reads (p ~ 1e-3 per round):
    # then the same IntegrityError reaches every rank.
    assert t["outcomes"].get("correct", 0) >= 0.9 * t["restores"]
    # ... on the read path asked for (no silent fall-back from host shared memory)
    assert t["plans"] == {PLAN_OF[read_path]: t["outcomes"]["correct"]}, t["plans"]
    assert all("IntegrityError" in e and "after 3 reads" in e for e in t["error_samples"])
    # ... each 503/429/reset cost exactly one retry; each flipped byte of a ranged read one
    # crc32c re-read; a flipped or short answer to a small object's one-request read one
    # fallback to ranged reads; other short bodies were resumed from their last byte.
    f, whole = t["faults"], t["one_request_faults"]
    _retries_match_faults(t, f)
    # A slice flipped on all 3 reads is re-read twice, not 3 times (then IntegrityError); in
    # that round the other ranks stop, and a flipped answer they abandoned is never checked.
    # Without a failed round every flipped ranged answer cost exactly one re-read.
    failed_rounds = t["outcomes"].get("clean_error", 0) // 8
    unchecked = f["flip"] - whole["flip"] - t["crc_rereads"]
    assert failed_rounds <= unchecked <= 8 * failed_rounds, (unchecked, failed_rounds)
    assert t["fallbacks"] == whole["flip"] + whole["short"]


def test_fault_storm_gives_clean_errors_never_wrong_bytes(pool8, gcs_emulator, checkpoint):
    with FaultProxy(gcs_emulator.host, seed=7) as proxy:
        t = F.run_rounds(pool8, proxy, checkpoint, min_faults=CI_STORM_FAULTS, probability=0.6,
                         storage_kwargs=STORM)
    print(_report(t, "storm"))
    _nothing_silent(t)
    assert t["faults_total"] >= CI_STORM_FAULTS
    # With 3 attempts per request and 60 % of requests failing, restores do fail -- cleanly,
    # on every rank with the same library error (one agreement step names the failed ranks).
    assert t["outcomes"].get("clean_error", 0) > 0
    assert set(t["clean_errors"]) == {"DistributedError"}
    assert t["errors_naming_ranks"] == t["outcomes"]["clean_error"]
    # the default path, host shared memory, in every round that restored
    assert set(t["plans"]) == ({"per_host"} if t["outcomes"].get("correct") else set()), t["plans"]


# ---- sharded: 3 ranks read only the byte ranges of their own shards (DTensor targets) ---------

CI_SHARDED_FAULTS = 60


@pytest.fixture(scope="module")
def pool3():
    pool = WorkerPool(F.SHARDED_WORLD, xla=False)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def sharded_checkpoint(pool3, gcs_emulator):
    uri = gcs_emulator.unique_uri("faults-sharded")
    sizes = [r.unwrap() for r in pool3.run(F.save_sharded_fault_checkpoint, uri,
                                           env=gcs_emulator.env())]
    assert sizes[0] > 3.5 * 1024 * KiB  # about 3.7 MiB of chunks (plus the state item)
    yield uri
    gcs_emulator.delete_prefix(uri.split("/", 3)[3] + "/")


def test_sharded_restore_by_byte_range_recovers_from_every_fault(pool3, gcs_emulator,
                                                                 sharded_checkpoint):
    with FaultProxy(gcs_emulator.host, seed=20261201) as proxy:
        t = F.run_rounds(pool3, proxy, sharded_checkpoint, min_faults=CI_SHARDED_FAULTS,
                         probability=0.12, storage_kwargs=MODERATE,
                         round_fn=F.sharded_restore_round)
        ranged = [r for r in proxy.records() if r.info.is_download and r.range is not None]
    print(_report(t, "sharded"))
    _nothing_silent(t)
    assert t["faults_total"] >= CI_SHARDED_FAULTS
    assert all(t["faults"][k] > 0 for k in F.FAULT_KINDS), t["faults"]
    assert t["outcomes"].get("correct", 0) >= 0.9 * t["restores"]
    assert all("IntegrityError" in e and "after 3 reads" in e for e in t["error_samples"])
    f, whole = t["faults"], t["one_request_faults"]
    _retries_match_faults(t, f)
    assert t["crc_rereads"] == f["flip"] - whole["flip"]
    # Every data read was a byte range of one rank's chunk file.
    assert ranged and all("chunks-0000" in r.object_name for r in ranged
                          if "safetensors" in r.object_name)


def test_sharded_restore_names_the_key_when_every_read_is_flipped(pool3, gcs_emulator,
                                                                  sharded_checkpoint):
    with FaultProxy(gcs_emulator.host) as proxy:
        proxy.inject(Fault.flip(), match=downloads("chunks-00001"), times=100_000)
        results = pool3.run(F.sharded_restore_round, sharded_checkpoint, dict(MODERATE), 120.0,
                            timeout_s=180, env=proxy.env())
        flips = proxy.snapshot().faults.get("flip", 0)
    outs = [r.unwrap() for r in results]
    assert flips >= 3
    # Never wrong bytes: one clean error, the same on every rank, naming the rank(s) whose
    # reads failed and the chunk's key (global key and box) after its bounded re-reads.
    assert {o["outcome"] for o in outs} == {"clean_error"}, outs
    # The ranks whose reads passed filled their live targets, so every rank gets the
    # DistributedError that says so (TargetsOverwrittenError), never a silent mix.
    assert {o["error"] for o in outs} == {"TargetsOverwrittenError"}
    assert len({tuple(o["failed_ranks"]) for o in outs}) == 1 and outs[0]["failed_ranks"]
    for o in outs:
        assert "IntegrityError" in o["message"] and "after 3 reads" in o["message"]
        assert "chunks-00001" in o["message"] and "model" in o["message"], o["message"]


# ---- per_host and striped: 8 ranks as 4 emulated hosts x 2, through the same faults -----------

CI_PLAN_FAULTS = 60


@pytest.mark.parametrize("strategy", ["striped", "per_host"])
def test_plans_reading_once_never_return_wrong_bytes(pool8, gcs_emulator, checkpoint, strategy):
    import functools

    with FaultProxy(gcs_emulator.host, seed=20261202) as proxy:
        t = F.run_rounds(pool8, proxy, checkpoint, min_faults=CI_PLAN_FAULTS, probability=0.12,
                         storage_kwargs=MODERATE,
                         round_fn=functools.partial(F.plan_restore_round, strategy, 4))
        by_address = proxy.bytes_served_by_address()
    print(_report(t, strategy))
    _nothing_silent(t)
    assert t["faults_total"] >= CI_PLAN_FAULTS
    # Most rounds recover (a retry or a crc32c re-read absorbs the fault); the others fail
    # cleanly on every rank with one DistributedError naming the reader(s).
    assert t["outcomes"].get("correct", 0) >= 0.5 * t["restores"]
    assert set(t["clean_errors"]) <= {"DistributedError"}
    assert t["errors_naming_ranks"] == t["outcomes"].get("clean_error", 0)
    f, whole = t["faults"], t["one_request_faults"]
    _retries_match_faults(t, f)
    # each flipped ranged read cost one logged crc32c re-read (also of pieces read together)
    assert t["crc_rereads"] == f["flip"] - whole["flip"]
    # every emulated host fetched through its own address (nothing from the default one)
    assert set(by_address) <= {f"127.0.0.{10 + h}" for h in range(4)}, by_address


@pytest.mark.parametrize("strategy", ["striped", "per_host"])
def test_plans_reading_once_fail_cleanly_in_a_fault_storm(pool8, gcs_emulator, checkpoint,
                                                          strategy):
    import functools

    with FaultProxy(gcs_emulator.host, seed=8) as proxy:
        t = F.run_rounds(pool8, proxy, checkpoint, min_faults=CI_PLAN_FAULTS, probability=0.6,
                         storage_kwargs=STORM,
                         round_fn=functools.partial(F.plan_restore_round, strategy, 4))
    print(_report(t, f"{strategy} storm"))
    _nothing_silent(t)  # also: every rank of a failed round raised the same error, same ranks
    assert t["faults_total"] >= CI_PLAN_FAULTS
    # one reader's exhausted retries fail the whole job: on every rank, naming the reader(s)
    assert t["outcomes"].get("clean_error", 0) > 0
    assert set(t["clean_errors"]) == {"DistributedError"}
    assert t["errors_naming_ranks"] == t["outcomes"]["clean_error"]
