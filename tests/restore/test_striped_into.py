"""``striped`` into live plain targets: each box fetched once per job, tied keys into untied
targets filled (real gloo ranks, the default 4 MiB crc32c chunks)."""

from __future__ import annotations

import pytest

from tests.restore import striped_into_workers as W
from xla_ckpt.testing.launcher import shared_pool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_replicated_plain_targets_fetch_each_chunk_once_and_fill_every_target(tmp_path):
    pool = shared_pool(4)
    uri = str(tmp_path / "ck")
    for r in pool.run(W.save_tied, uri):
        r.unwrap()
    got = {s: [r.unwrap() for r in pool.run(W.restore_untied, uri, s)]
           for s in ("all_ranks", "striped")}
    for s, ranks in got.items():
        for v in ranks:  # both targets of the one saved tensor hold it, on every rank
            assert v["a"] and v["b"] and v["step"] == 7.0, (s, v)
    state = 1536 * 1024 * 4
    assert sum(v["read"] for v in got["all_ranks"]) >= 4 * state
    # the rows are split at crc32c chunk boundaries: no chunk is fetched by two holders
    striped = got["striped"]
    assert state <= sum(v["read"] for v in striped) <= state + 4096, striped
    assert all(v["plan"] == "striped" for v in striped)
    # saved tied, each key is its own box (one blob): each rank receives the rows it did not
    # read of both, and the 4-byte scalar one rank read: 2 x 3 x state + 3 x 4 in the job
    assert sum(v["received"] for v in striped) == 6 * state + 12, striped


@pytest.mark.parametrize("what,key", [("strategy", "restore.strategy"),
                                      ("bucket", "restore.bucket_size_bytes")])
def test_ranks_with_different_restore_settings_all_refuse(tmp_path, what, key):
    """Different plans enter different collectives (a hang, or a gloo abort that kills the
    process): every rank gets one ConfigError naming the setting and the ranks instead."""
    pool = shared_pool(4)
    uri = str(tmp_path / "ck")
    for r in pool.run(W.save_tied, uri):
        r.unwrap()
    for r in pool.run(W.restore_with_rank1_differing, uri, what):
        got = r.unwrap()
        assert got.startswith(f"ConfigError: {key} differs between ranks (rank 0: "), got
        assert "rank 1: " in got
