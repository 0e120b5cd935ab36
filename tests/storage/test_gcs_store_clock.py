"""The in-flight grace period is measured on the store's clock, never on this host's (issue 25,
defect 9; CASES C19/C22).

An interrupted write's parts are collected once they are older than a grace period.  Their age
used to be this host's ``time.time()`` minus the store's ``timeCreated``: a host clock ahead of
the store's deleted the parts of a save still running, one behind it never collected anything.
Now both sides come from the store (``Storage.now_unix_s``: the ``Date`` of an answer about the
bucket).  A real clock skew cannot be made here (the emulator runs on this host), so the host's
clock is skewed in this process only, by replacing ``time.time`` -- what the old code read.
"""

import time

import pytest

from xla_ckpt.cli.main import main
from xla_ckpt.run.prune import collect_in_flight
from xla_ckpt.storage.gcs import TMP_MARK

HOUR_S = 3600.0
SKEWS = [3 * HOUR_S, 26 * HOUR_S, -3 * HOUR_S]  # host ahead by 3 h / a day and more, behind 3 h
TARGET = "checkpoint_1_1/data-0123456789ab-state.safetensors"
PARTS = [f"{TARGET}{TMP_MARK}aaaaaaaaaaaa-part-{i:05d}" for i in range(3)]



@pytest.fixture
def host_clock(monkeypatch):
    """Set this process's ``time.time`` off by ``skew_s`` seconds from the real clock."""
    real = time.time

    def skew(skew_s):
        monkeypatch.setattr(time, "time", lambda: real() + skew_s)
        return real

    return skew


def _write_parts(st):
    for i, name in enumerate(PARTS):
        st.write_atomic(name, [bytes([i]) * (10 + i)])


@pytest.mark.parametrize("skew_s", SKEWS)
def test_now_unix_s_is_the_store_clock_whatever_this_host_says(gcs_emulator, stem, host_clock,
                                                                skew_s):
    with gcs_emulator.storage(stem) as st:
        real = host_clock(skew_s)
        before = real()
        _write_parts(st)
        store_now = st.now_unix_s()
        after = real()
        created = [o.created_unix_s for o in st.list_in_flight()]
    assert len(created) == 3 and all(c is not None for c in created)
    # Date has whole seconds, and now_unix_s is the end of that second: never earlier than the
    # real time, at most 1 s later (the emulator shares this machine's real clock).
    assert before <= store_now <= after + 1.0
    assert all(int(before) <= c <= store_now for c in created)
    assert abs(time.time() - store_now) > HOUR_S / 2  # the host clock really is skewed


@pytest.mark.parametrize("skew_s", [3 * HOUR_S, 26 * HOUR_S])
def test_a_host_clock_ahead_never_collects_the_parts_of_a_write_still_running(
        gcs_emulator, stem, host_clock, skew_s):
    """Host ahead by more than the grace: the old rule took parts just written for hours old."""
    with gcs_emulator.storage(stem) as st:
        _write_parts(st)
        host_clock(skew_s)
        result = collect_in_flight(st, grace_s=HOUR_S)
        left = [o.name for o in st.list_in_flight()]
    assert result.in_flight == [] and result.in_flight_objects == 0
    assert [u.upload_id for u in result.in_flight_young] == ["aaaaaaaaaaaa"]
    assert left == PARTS


def _wait_until_store_age(st, seconds, within_s=15.0):
    """Poll until the newest part is ``seconds`` old on the store's clock (bounded)."""
    deadline = time.monotonic() + within_s
    while True:
        newest = max(o.created_unix_s for o in st.list_in_flight())
        if st.now_unix_s() - newest >= seconds:
            return
        assert time.monotonic() < deadline, "the store's clock did not advance"
        time.sleep(0.2)


@pytest.mark.parametrize("skew_s", [-3 * HOUR_S, -26 * HOUR_S])
def test_a_host_clock_behind_still_collects_parts_older_than_the_grace(
        gcs_emulator, stem, host_clock, skew_s):
    """Host behind: the old rule saw every part as created in the future, never collected."""
    with gcs_emulator.storage(stem) as st:
        _write_parts(st)
        host_clock(skew_s)
        _wait_until_store_age(st, 1.0)
        young = collect_in_flight(st, grace_s=HOUR_S)      # 1 s old: kept under a 1 h grace
        assert young.in_flight == [] and len(young.in_flight_young) == 1
        result = collect_in_flight(st, grace_s=1.0)
        left = st.list_in_flight()
    assert [u.upload_id for u in result.in_flight] == ["aaaaaaaaaaaa"]
    assert result.in_flight_objects == 3 and result.bytes_freed == 10 + 11 + 12
    assert left == []


@pytest.mark.parametrize("skew_s", [3 * HOUR_S, -3 * HOUR_S])
def test_the_cli_measures_in_flight_ages_on_the_store_clock(gcs_emulator, stem, host_clock,
                                                           capsys, monkeypatch, skew_s):
    """``xla-ckpt ls`` and ``gc --in-flight`` on a skewed host: parts just written are young
    (never collected under the default 1 h grace) and their age is seconds, not hours."""
    for k, v in gcs_emulator.env().items():
        monkeypatch.setenv(k, v)
    run = gcs_emulator.uri(stem)
    with gcs_emulator.storage(stem) as st:
        _write_parts(st)
    host_clock(skew_s)
    capsys.readouterr()
    assert main(["--no-progress", "ls", run]) == 0
    out = capsys.readouterr().out
    assert "in flight for less than 1.0 h (a save may still be writing them): 3 objects" in out
    assert main(["--no-progress", "gc", run, "--in-flight"]) == 0
    out = capsys.readouterr().out
    assert "kept 3 in-flight object(s) (33 B) younger than the grace period (1.0 h)" in out
    assert "deleted in-flight" not in out
    assert sorted(gcs_emulator.object_names(stem + "/")) == [f"{stem}/{p}" for p in PARTS]
