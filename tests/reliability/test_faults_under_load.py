"""8 readers restore through random 503/429/resets/short bodies/flipped bytes: nothing silent.

See ``faults_harness.py``.  CI injects a few hundred faults; the full count
(``benchmarks/reliability.py --faults 1000``) is in RELIABILITY.md.
"""

from __future__ import annotations

import faults_harness as F
import pytest

from xla_ckpt.testing.fault_proxy import FaultProxy
from xla_ckpt.testing.launcher import WorkerPool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CI_FAULTS = 200
CI_STORM_FAULTS = 100
KiB = 1024
# Fast retries for tests; the policy (capped exponential backoff, full jitter, deadline) is the
# production one.
MODERATE = dict(max_workers=4, slice_size_bytes=512 * KiB, initial_backoff_s=0.01,
                max_backoff_s=0.2, max_attempts=8, retry_deadline_s=60.0)
STORM = dict(MODERATE, max_attempts=3)


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
            f"requests, {t['rounds']} rounds x {F.WORLD} readers = {t['restores']} restores: "
            f"{t['outcomes']}; clean errors {t['clean_errors']}; retries {t['retries']} "
            f"({t['retry_causes']}), crc32c re-reads {t['crc_rereads']}, one-request "
            f"fallbacks {t['fallbacks']}; hangs {t['hangs']}; "
            f"{t['seconds']:.1f} s")


def _nothing_silent(t: dict) -> None:
    assert t["problems"] == []
    assert t["silent_corruptions"] == 0 and t["hangs"] == 0
    assert set(t["outcomes"]) <= {"correct", "clean_error"}
    assert sum(t["outcomes"].values()) == t["restores"]


def test_eight_readers_recover_from_every_fault(pool8, gcs_emulator, checkpoint):
    with FaultProxy(gcs_emulator.host, seed=20261130) as proxy:
        t = F.run_rounds(pool8, proxy, checkpoint, min_faults=CI_FAULTS, probability=0.12,
                         storage_kwargs=MODERATE)
    print(_report(t, "moderate"))
    _nothing_silent(t)
    assert t["faults_total"] >= CI_FAULTS
    assert all(t["faults"][k] > 0 for k in F.FAULT_KINDS), t["faults"]
    # At this rate the retry budget absorbs nearly every fault.  A restore may still fail --
    # cleanly -- when one slice came back flipped on all 3 of its reads (p ~ 1e-3 per round):
    # then the same IntegrityError reaches every rank.
    assert t["outcomes"].get("correct", 0) >= 0.9 * t["restores"]
    assert all("IntegrityError" in e and "after 3 reads" in e for e in t["error_samples"])
    # ... each 503/429/reset cost exactly one retry; each flipped byte of a ranged read one
    # crc32c re-read; a flipped or short answer to a small object's one-request read one
    # fallback to ranged reads; other short bodies were resumed from their last byte.
    f, whole = t["faults"], t["one_request_faults"]
    assert t["retries"] == f["status_503"] + f["status_429"] + f["reset"]
    assert t["crc_rereads"] == f["flip"] - whole["flip"]
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
