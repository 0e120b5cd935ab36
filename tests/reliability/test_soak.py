"""Soak: save/restore cycles with rotation; bounded usage, flat memory, every restore bitwise.

See ``soak_harness.py``.  CI runs a bounded number of cycles on each backend;
``benchmarks/reliability.py --soak-cycles 100`` runs the full count.
"""

from __future__ import annotations

import pytest
import soak_harness as S

from xla_ckpt.testing.launcher import WorkerPool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

CI_CYCLES = 24
# A leak of one copy of the state per cycle would be ~2.5 MiB/cycle; allocator noise is a few
# KiB/cycle.
MAX_RSS_SLOPE_KIB_PER_CYCLE = 64.0


@pytest.fixture(scope="module")
def worker(gcs_emulator):
    pool = WorkerPool(1, xla=False, env=gcs_emulator.env())
    yield pool
    pool.close()


@pytest.mark.parametrize("backend", ["local", "gcs"])
def test_soak_cycles_with_rotation(worker, gcs_emulator, tmp_path, backend):
    uri = str(tmp_path / "run") if backend == "local" else gcs_emulator.unique_uri("soak")
    (res,) = worker.run(S.soak, uri, CI_CYCLES, timeout_s=360)
    out = res.unwrap()
    s = out["summary"]
    print(f"soak {backend}: {s}")
    assert s["cycles"] == CI_CYCLES
    assert s["not_bitwise"] == []
    # Retention: the newest KEEP update checkpoints plus the checkpoint_best target.
    assert S.KEEP <= s["max_committed"] <= S.KEEP + 1
    assert all(len(r["committed"]) >= 1 for r in out["records"])
    assert s["max_objects"] <= 2 * (S.KEEP + 1) + 2  # manifest + data file each, 2 pointers
    assert s["max_bytes"] <= s["bytes_bound"]
    assert s["max_in_flight"] == 0
    # Host memory, threads and file descriptors do not grow with the number of cycles.
    assert s["rss_slope_kib_per_cycle"] < MAX_RSS_SLOPE_KIB_PER_CYCLE
    assert s["rss_tail_range_mib"] * S.MiB < s["checkpoint_bytes"]
    assert max(s["threads"]) - min(s["threads"]) <= 1
    assert s["fds_range"][1] - s["fds_range"][0] <= 2
    if backend == "gcs":
        gcs_emulator.delete_prefix(uri.split("/", 3)[3] + "/")
