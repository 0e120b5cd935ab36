"""Striped and per-host restores on emulated hosts, on the GCS emulator through the proxy.

4 emulated hosts x 2 ranks and 2 x 2 (``WorkerPool(world, hosts=H)``: each host's ranks
connect from its own loopback address, so the proxy counts the bytes each host fetched).
Every plan -- ``all_ranks`` without host shared memory (every rank reads: the reference),
``all_ranks`` with it (one read per host), ``per_host``, ``broadcast``, ``striped`` with and
without host shared memory, ``auto`` -- must give every rank bitwise the saved state (with its
aliasing, empty tensor, bf16 / int8 / float64 and many small tensors), its own rank item and
its ZeRO partition.  The bytes fetched are checked exactly against what the manifest says each
plan needs: ``striped`` fetches the replicated state once per job, ``per_host`` once per host,
the every-rank read ``ranks_per_host`` times per host.  Then the failures of a stripe reader
(a corrupt stored byte in another rank's stripe), the fallback when a rank cannot open its
host's segment, and a chunked (manifest v2) checkpoint restored whole.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from typing import Any

import pytest

from tests.restore import striped_workers as SW
from xla_ckpt.io.manifest_file import read_manifest
from xla_ckpt.restore import RestoreConfig
from xla_ckpt.restore.blobs import blob_reads
from xla_ckpt.restore.cost import PLANS, RestoreTopology
from xla_ckpt.restore.plan import plan_ranks
from xla_ckpt.restore.select import JobShape, choose_plan_for_job, sizes_of
from xla_ckpt.testing.fault_proxy import FaultProxy, host_address
from xla_ckpt.testing.launcher import WorkerPool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

START_S = 600.0  # the machine is shared: starting 8 interpreters may take minutes
RUN_S = 300.0
#: (label, strategy, host_shared_memory); the first is the reference every plan must equal.
RUNS = [("all_ranks_private", "all_ranks", False), ("all_ranks", "all_ranks", True),
        ("per_host", "per_host", True), ("broadcast", "broadcast", True),
        ("striped", "striped", True), ("striped_private", "striped", False),
        ("auto", "auto", True)]
#: the plan each label runs (auto: what the cost model picks, computed in the test)
RAN = {"all_ranks_private": "all_ranks", "all_ranks": "per_host", "per_host": "per_host",
       "broadcast": "broadcast", "striped": "striped", "striped_private": "striped"}
TOPOLOGIES = {"4x2": (8, 4), "2x2": (4, 2)}


# ---- fixtures ---------------------------------------------------------------------------

_POOLS: dict[str, WorkerPool] = {}


@pytest.fixture(scope="module")
def pools():
    yield _POOLS
    for p in _POOLS.values():
        p.close()


def _pool(pools: dict, topo: str) -> WorkerPool:
    world, hosts = TOPOLOGIES[topo]
    p = pools.get(topo)
    if p is None or p.broken:
        p = pools[topo] = WorkerPool(world, xla=False, hosts=hosts, start_timeout_s=START_S)
    return p


@pytest.fixture(scope="module")
def emulator_env(gcs_emulator):
    return gcs_emulator.env()


_SAVED: dict[tuple[str, str], dict[str, Any]] = {}


def _checkpoint(pools, gcs_emulator, topo: str, kind: str = "mixed") -> dict[str, Any]:
    """The checkpoint of ``kind`` saved by the ranks of ``topo`` (once), with its manifest."""
    key = (topo, kind)
    if key not in _SAVED:
        uri = gcs_emulator.unique_uri(f"striped-{topo}-{kind}")
        fn = SW.save_mixed if kind == "mixed" else SW.save_chunked
        got = [r.unwrap() for r in _pool(pools, topo).run(fn, uri, env=gcs_emulator.env(),
                                                           timeout_s=RUN_S)]
        assert len(set(got)) == 1 and got[0] > 0
        with FaultProxy(gcs_emulator.host) as proxy:
            st = proxy.storage(uri)
            try:
                manifest = read_manifest(st)
                manifest_size = st.stat("manifest.json").size
            finally:
                st.close()
        _SAVED[key] = {"uri": uri, "manifest": manifest, "manifest_size": manifest_size}
    return _SAVED[key]


def _traffic(proxy: FaultProxy) -> dict[str, Any]:
    """What the proxy served since its last reset, by source address and kind."""
    data: Counter = Counter()
    manifest: Counter = Counter()
    other: Counter = Counter()
    json: Counter = Counter()
    manifest_reads = 0
    for rec in proxy.records():
        a = rec.client_address
        if rec.info.is_download:
            if rec.object_name.endswith(".safetensors"):
                data[a] += rec.body_bytes
            elif rec.object_name.endswith("manifest.json"):
                manifest[a] += rec.body_bytes
                manifest_reads += 1
            else:
                other[a] += rec.body_bytes
        else:
            json[a] += rec.body_bytes
    return {"data": dict(data), "manifest": dict(manifest), "other_media": dict(other),
            "json": dict(json), "manifest_reads": manifest_reads,
            "served": proxy.bytes_served_by_address()}


_RESULTS: dict[tuple, dict[str, Any]] = {}


def _run(pools, gcs_emulator, topo: str, label: str, *, zero: str = "os",
         kind: str = "mixed", **kw: Any) -> dict[str, Any]:
    """Restore plan ``label`` on ``topo`` through a fresh proxy (cached per arguments)."""
    key = (topo, label, zero, kind, tuple(sorted(kw.items())))
    if key not in _RESULTS:
        ck = _checkpoint(pools, gcs_emulator, topo, kind)
        _, strategy, hsm = next(r for r in RUNS if r[0] == label)
        with FaultProxy(gcs_emulator.host) as proxy:
            results = _pool(pools, topo).run(
                SW.restore_plan, ck["uri"], TOPOLOGIES[topo][1], strategy,
                host_shared_memory=hsm, zero_sharding=zero, expect=kind, env=proxy.env(),
                timeout_s=RUN_S, **kw)
            traffic = _traffic(proxy)
        _RESULTS[key] = {"values": [r.unwrap() for r in results], "traffic": traffic,
                         **ck}
    return _RESULTS[key]


# ---- the exact bytes each plan needs, from the manifest -----------------------------------

def _private(manifest, world: int, zero: str) -> list[int]:
    """Bytes only rank r needs: its own ``rank/<r>`` item and its part of every flat
    sharded (ZeRO) tensor (the whole tensor with ``zero_sharding="none"``)."""
    plans = plan_ranks(manifest, world, item="state", restore_rank_items=True,
                       zero_sharding=zero, allow_reshard=False)
    return [(manifest.item(p.rank_item).nbytes if p.rank_item else 0)
            + sum(p.shard_nbytes(k) for k in p.shards) for p in plans]


def _hosts(topo: str) -> list[list[int]]:
    world, hosts = TOPOLOGIES[topo]
    per = world // hosts
    return [list(range(h * per, (h + 1) * per)) for h in range(hosts)]


def _check_accounting(run: dict[str, Any], topo: str) -> None:
    """Every byte served is a data file's, the manifest (rank 0, once) or JSON metadata."""
    t = run["traffic"]
    assert t["other_media"] == {}
    assert t["manifest_reads"] == 1
    assert t["manifest"] == {host_address(0): run["manifest_size"]}
    addresses = {host_address(h) for h in range(TOPOLOGIES[topo][1])}
    assert set(t["served"]) <= addresses, t["served"]  # every host bound its own address
    for a, n in t["served"].items():
        assert n == t["data"].get(a, 0) + t["manifest"].get(a, 0) + t["json"].get(a, 0)


# ---- 1. bitwise -------------------------------------------------------------------------

@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_every_plan_gives_every_rank_the_saved_state_bitwise(pools, gcs_emulator, topo):
    world, hosts = TOPOLOGIES[topo]
    ref = _run(pools, gcs_emulator, topo, "all_ranks_private", zero="none")["values"]
    assert [v["differs"] for v in ref] == [""] * world
    for label, _, _ in RUNS:  # zero_sharding="none": every rank gets the whole ZeRO tensor
        run = _run(pools, gcs_emulator, topo, label, zero="none")
        vals = run["values"]
        if label.startswith("striped"):  # ... fetched once per job, like the state
            m = run["manifest"]
            items = sum(m.item(n).nbytes for n in m.items if n.startswith("rank/"))
            flat = sum(m.item(n).nbytes for n in m.items if n.startswith("shard/"))
            assert flat == SW.FLAT_NUMEL * 4
            assert sum(run["traffic"]["data"].values()) == m.item("state").nbytes + items + flat
        for r, (v, want) in enumerate(zip(vals, ref, strict=True)):
            assert v["differs"] == "", (label, r, v["differs"])
            assert v["digest"] == want["digest"], (label, r)
            assert v["aliased"] is True, (label, r)  # the view is still a view of its base
            assert v["rank_pos"] == 100 + r and v["rank_state"] == want["rank_state"]
            assert v["shards"] == {"exp_avg": [x * 0.5 for x in range(SW.FLAT_NUMEL)]}
            assert v["host"] == r * hosts // world
            assert v["address"] == host_address(v["host"])
        assert len({str(v["rank_state"]) for v in vals}) == world  # each rank its own item


@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_zero_partitions_with_each_plan(pools, gcs_emulator, topo):
    world, _ = TOPOLOGIES[topo]
    for label in ("all_ranks_private", "per_host", "striped", "striped_private"):
        vals = _run(pools, gcs_emulator, topo, label, zero="os")["values"]
        for r, v in enumerate(vals):
            assert v["differs"] == ""
            assert v["shards"] == {"exp_avg": SW.flat_shard(r, world).tolist()}, (label, r)
    run = _run(pools, gcs_emulator, topo, "striped", zero="os")
    m = run["manifest"]
    want = m.item("state").nbytes + sum(_private(m, world, "os"))
    assert sum(run["traffic"]["data"].values()) == want
    assert sum(v["read"] for v in run["values"]) == want


def test_chunked_checkpoint_restored_whole_by_every_plan(pools, gcs_emulator):
    topo = "4x2"
    ref = _run(pools, gcs_emulator, topo, "all_ranks_private", kind="chunked")["values"]
    assert [v["differs"] for v in ref] == [""] * 8
    assert _SAVED[(topo, "chunked")]["manifest"].written_version == 2
    for label, _, _ in RUNS:
        vals = _run(pools, gcs_emulator, topo, label, kind="chunked")["values"]
        for r, v in enumerate(vals):
            assert v["differs"] == "", (label, r, v["differs"])
            assert v["digest"] == ref[r]["digest"], (label, r)
            assert v["rank_pos"] == 100 + r


# ---- 2. bytes and stats ------------------------------------------------------------------

@pytest.mark.parametrize("label", ["striped", "striped_private"])
@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_striped_fetches_the_state_once_per_job(pools, gcs_emulator, topo, label):
    world, hosts = TOPOLOGIES[topo]
    run = _run(pools, gcs_emulator, topo, label)
    _check_accounting(run, topo)
    m = run["manifest"]
    state = m.item("state").nbytes
    private = _private(m, world, "os")
    data = run["traffic"]["data"]
    # 1.00x: the state item's bytes once, plus each rank's own bytes; nothing twice
    assert sum(data.values()) == state + sum(private)
    vals = run["values"]
    assert sum(v["read"] for v in vals) == state + sum(private)
    for h, ranks in enumerate(_hosts(topo)):
        assert data.get(host_address(h), 0) == sum(vals[r]["read"] for r in ranks)
    if label == "striped":  # host leaders all-gather; the other ranks map their leader's copy
        leaders = [ranks[0] for ranks in _hosts(topo)]
        assert sum(vals[r]["received"] for r in leaders) == (hosts - 1) * state
        for r, v in enumerate(vals):
            assert v["mapped"] == (0 if r in leaders else state)
            if r not in leaders:
                assert v["received"] == 0
        # the state's reads are balanced over the hosts (within 25 % of the mean share)
        reads = blob_reads(m, "state", world)
        per_host = [data.get(host_address(h), 0) - sum(private[r] for r in ranks)
                    for h, ranks in enumerate(_hosts(topo))]
        assert per_host == [sum(hi - lo for r in ranks for _, lo, hi in reads[r])
                            for ranks in _hosts(topo)]
        assert max(per_host) <= 1.25 * state / hosts, per_host
    else:  # every rank is its own "host": all-gather over every rank, no mapping
        assert sum(v["received"] for v in vals) == (world - 1) * state
        assert all(v["mapped"] == 0 for v in vals)
        assert "between every rank" in vals[0]["data_path"]


@pytest.mark.parametrize("label", ["per_host", "all_ranks"])
@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_per_host_fetches_the_state_once_per_host(pools, gcs_emulator, topo, label):
    world, _ = TOPOLOGIES[topo]
    run = _run(pools, gcs_emulator, topo, label)
    _check_accounting(run, topo)
    m = run["manifest"]
    state = m.item("state").nbytes
    private = _private(m, world, "os")
    vals = run["values"]
    for h, ranks in enumerate(_hosts(topo)):
        assert run["traffic"]["data"][host_address(h)] == state + sum(private[r] for r in ranks)
        leader = ranks[0]
        for r in ranks:
            assert vals[r]["read"] == (state if r == leader else 0) + private[r]
            assert vals[r]["mapped"] == (0 if r == leader else state)
            assert vals[r]["received"] == 0  # no cross-host collective moved tensor bytes


@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_every_rank_reading_fetches_ranks_per_host_times(pools, gcs_emulator, topo):
    world, hosts = TOPOLOGIES[topo]
    run = _run(pools, gcs_emulator, topo, "all_ranks_private")
    _check_accounting(run, topo)
    m = run["manifest"]
    state = m.item("state").nbytes
    private = _private(m, world, "os")
    for h, ranks in enumerate(_hosts(topo)):
        assert run["traffic"]["data"][host_address(h)] == \
            len(ranks) * state + sum(private[r] for r in ranks)
    assert [v["read"] for v in run["values"]] == [state + p for p in private]


@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_stats_name_the_plan_and_its_prediction(pools, gcs_emulator, topo):
    world, hosts = TOPOLOGIES[topo]
    m = _checkpoint(pools, gcs_emulator, topo)["manifest"]
    cfg = RestoreConfig()
    auto = choose_plan_for_job(JobShape(RestoreTopology(hosts=hosts,
                                                        ranks_per_host=world // hosts), "gloo"),
                               sizes_of(m, "state", cfg, None), cfg)
    for label, strategy, _ in RUNS:
        vals = _run(pools, gcs_emulator, topo, label)["values"]
        want_plan = auto.plan if label == "auto" else RAN[label]
        if label == "auto" and want_plan == "all_ranks":
            want_plan = "per_host"  # all_ranks with host shared memory: one read per host
        for v in vals:
            assert v["plan"] == want_plan, (label, v["plan"], v["reason"])
            assert v["strategy"] == (auto.plan if label == "auto" else strategy)
            assert set(v["predictions"]) == set(PLANS)
            assert v["predicted"] > 0 and v["predicted"] == v["predictions"][v["plan"]]
            assert v["predictions"] == vals[0]["predictions"]  # the same on every rank
            assert v["reason"] == vals[0]["reason"]
        if label == "auto":
            assert vals[0]["reason"].startswith(auto.reason[:40])


# ---- 3. a stripe reader fails ---------------------------------------------------------------

@pytest.fixture(scope="module")
def local_mixed(pools, tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("striped-local") / "ckpt")
    got = [r.unwrap() for r in _pool(pools, "4x2").run(SW.save_mixed, uri, timeout_s=RUN_S)]
    assert len(set(got)) == 1
    return uri


@pytest.mark.parametrize("host_shared_memory", [True, False])
def test_corrupt_byte_in_another_ranks_stripe_names_that_rank(pools, local_mixed, tmp_path,
                                                             host_shared_memory):
    uri = str(tmp_path / "ckpt")
    shutil.copytree(local_mixed, uri)
    from xla_ckpt.storage import open_storage

    with open_storage(uri) as st:
        m = read_manifest(st)
    item = m.item("state")
    reads = blob_reads(m, "state", 8)  # with or without a shared copy: the same reads
    # a range of one large blob (its crc32c chunks) read by a non-leader rank (it writes
    # into its leader's segment), else by any rank but 0
    large = [(r, b, lo, hi) for r, mine in enumerate(reads) for b, lo, hi in mine
             if hi - lo > 64 * 1024]
    victim, blob, start, stop = ([x for x in large if x[0] % 2 == 1] or
                                 [x for x in large if x[0] != 0])[0]
    length = stop - start
    rec = item.blobs[blob]
    path = os.path.join(uri, rec.file)
    at = rec.offset + start + length // 2
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
    results = _pool(pools, "4x2").run(SW.restore_failing, uri, 4, "striped", "none", -1, 20.0,
                                      host_shared_memory, timeout_s=RUN_S)
    for r in results:
        v = r.unwrap()
        assert v["outcome"] == "error", v
        assert v["error"] == "DistributedError", v
        assert set(v["failures"]) == {victim}, v["failures"]
        assert v["failures"][victim].startswith("IntegrityError: "), v["failures"]
        assert "crc32c mismatch" in v["failures"][victim] and rec.file in v["failures"][victim]
        assert f"rank {victim}" in v["message"]


# ---- 4. fallbacks -------------------------------------------------------------------------

def test_per_host_falls_back_when_a_rank_cannot_open_the_segment(pools, gcs_emulator):
    topo, world = "4x2", 8
    run = _run(pools, gcs_emulator, topo, "per_host", cannot_open_rank=3)
    m = run["manifest"]
    state = m.item("state").nbytes
    private = _private(m, world, "os")
    ref = _run(pools, gcs_emulator, topo, "all_ranks_private")["values"]
    for r, v in enumerate(run["values"]):
        assert v["differs"] == "" and v["digest"] == ref[r]["digest"]
        assert v["plan"] == "all_ranks" and v["strategy"] == "per_host"
        assert "rank 3" in v["reason"] and "Permission denied" in v["reason"], v["reason"]
        assert "every rank reads for itself" in v["data_path"] and "rank 3" in v["data_path"]
        assert v["read"] == state + private[r] and v["mapped"] == 0
    for h, ranks in enumerate(_hosts(topo)):  # every rank read: ranks_per_host x per host
        assert run["traffic"]["data"][host_address(h)] == 2 * state + sum(private[r]
                                                                          for r in ranks)


def test_striped_without_a_shared_segment_still_fetches_each_byte_once(pools, gcs_emulator):
    topo, world = "4x2", 8
    run = _run(pools, gcs_emulator, topo, "striped", cannot_open_rank=5)
    m = run["manifest"]
    state = m.item("state").nbytes
    private = _private(m, world, "os")
    ref = _run(pools, gcs_emulator, topo, "all_ranks_private")["values"]
    for r, v in enumerate(run["values"]):
        assert v["differs"] == "" and v["digest"] == ref[r]["digest"]
        assert v["plan"] == "striped" and v["mapped"] == 0
        assert "between every rank" in v["data_path"] and "rank 5" in v["data_path"]
    assert sum(run["traffic"]["data"].values()) == state + sum(private)
    assert sum(v["received"] for v in run["values"]) == (world - 1) * state


def test_striped_without_host_memory_still_balances_the_host_links(pools, gcs_emulator):
    topo, world = "4x2", 8
    run = _run(pools, gcs_emulator, topo, "striped_private")
    m = run["manifest"]
    state = m.item("state").nbytes
    private = _private(m, world, "os")
    per_host = [run["traffic"]["data"].get(host_address(h), 0) - sum(private[r] for r in ranks)
                for h, ranks in enumerate(_hosts(topo))]
    assert sum(per_host) == state
    # the issue: "balance bytes" per host link -- within 25 %, as with shared memory
    assert max(per_host) <= 1.25 * state / len(per_host), per_host


def test_a_crc32c_mismatch_in_a_coalesced_read_is_logged(gcs_emulator, caplog):
    # Single process: small blobs side by side in one file are fetched with one ranged
    # request by the chunk reader (every plan's read of the replicated blobs); one flipped
    # byte in that body must be re-read (bytes right) and logged like any other mismatch.
    import logging

    import torch

    from xla_ckpt.api import save
    from xla_ckpt.format.chunks import Box
    from xla_ckpt.io import CheckpointReader
    from xla_ckpt.io.chunked import BoxRequest
    from xla_ckpt.restore.blobs import blob_tensors
    from xla_ckpt.restore.targets import read_requests
    from xla_ckpt.testing.fault_proxy import Fault, downloads

    state = {f"s{i}": torch.full((16 * 1024,), float(i)) for i in range(8)}  # 8 x 64 KiB
    uri = gcs_emulator.unique_uri("coalesced-flip")

    def read_all(st, saved) -> list[bytes]:
        outs = [torch.empty(gt.shape, dtype=torch.uint8) for gt in saved.globals]
        read_requests(CheckpointReader(st, saved.manifest), saved,
                      [BoxRequest(g, Box((0,), tuple(o.shape)), o, fresh=True)
                       for g, o in enumerate(outs)])
        return [o.numpy().tobytes() for o in outs]

    with FaultProxy(gcs_emulator.host) as proxy:
        st = proxy.storage(uri)
        try:
            save(state, uri, storage=st)
            saved = blob_tensors(read_manifest(st), "state")
            proxy.reset_log()
            proxy.inject(Fault.flip(), match=downloads(".safetensors"))
            with caplog.at_level(logging.WARNING, "xla_ckpt"):
                got = read_all(st, saved)
            want = read_all(st, saved)  # the same read with no fault: the reference
        finally:
            st.close()
        flips = [r for r in proxy.records() if r.fault == "flip"]
    assert len(flips) == 1 and flips[0].body_bytes > 2 * 64 * 1024  # one request, several blobs
    assert sorted(want) == sorted(state[f"s{i}"].numpy().tobytes() for i in range(8))
    assert got == want  # re-read: the right bytes
    assert any("crc32c mismatch" in r.getMessage() for r in caplog.records), caplog.text
