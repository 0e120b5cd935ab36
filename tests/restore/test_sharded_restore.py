"""``restore(uri, into=...)`` onto any mesh, both strategies, on real gloo ranks (CPU FSDP2/TP).

DCP is the reference: every case saves the same state with ``dcp.save`` too, loads it with
``dcp.load`` onto the same new targets, and compares local shards with their global offsets
bitwise (never ``full_tensor()``).  One pool per world size (2, 3, 4 processes) serves the
module; each test is one call per pool covering several cases.
"""

from __future__ import annotations

import pytest
import sharded_workers as W
import torch

from xla_ckpt.api import save
from xla_ckpt.comm import SingleProcess
from xla_ckpt.errors import ConfigError, StateMismatchError, WorldSizeMismatchError
from xla_ckpt.format.manifest import rank_item
from xla_ckpt.io import commit, new_save_id, read_manifest, write_item
from xla_ckpt.restore import RestoreConfig, restore
from xla_ckpt.restore.plan import plan_ranks
from xla_ckpt.storage import open_storage
from xla_ckpt.testing.launcher import WorkerPool

slow = pytest.mark.slow

RUN_TIMEOUT_S = 400


# ---- one process ---------------------------------------------------------------------------

def test_v1_strided_and_aliased_tensors_restore_into_plain_targets(tmp_path):
    """A version-1 checkpoint's transposed, expanded and aliased tensors fill targets in
    place; the leaves ``into`` lacks come back whole."""
    uri = str(tmp_path / "v1")
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state: dict = {"t": base.t(), "x": torch.tensor([1.5, -2.0]).expand(3, 2), "head": base[:2],
             "n": {"step": torch.tensor(7), "lr": 0.1}, "empty": torch.zeros(0, 3)}
    save(state, uri)
    into: dict = {"t": torch.zeros(6, 4), "x": torch.zeros(3, 2),
                  "n": {"step": torch.tensor(0)}}
    live = into["t"]
    r = restore(uri, into=into, dist=SingleProcess())
    assert r.state["t"] is live and torch.equal(live, base.t())
    assert torch.equal(into["x"], state["x"]) and into["n"]["step"].item() == 7
    assert torch.equal(r.state["head"], base[:2]) and r.state["n"]["lr"] == 0.1
    assert r.state["empty"].shape == (0, 3)
    # bytes of the boxes filled: t, x, step (int64) into targets; head whole; empty has none
    assert r.stats.shard_bytes == 24 * 4 + 6 * 4 + 8 + 12 * 4
    assert r.strategy == "all_ranks"


def test_targets_that_do_not_fit_name_the_keys(tmp_path):
    uri = str(tmp_path / "v1")
    save({"w": torch.ones(3, 2), "b": torch.ones(2, dtype=torch.float64)}, uri)
    with pytest.raises(StateMismatchError, match=r"on every rank: state\['w'\] is "
                       r"float32\[3, 2\] in the checkpoint but float32\[2, 3\] in the target; "
                       r"state\['b'\] is float64\[2\] in the checkpoint but float32\[2\] in the "
                       r"target; "
                       r"state\['c'\] is not in the checkpoint"):
        restore(uri, into={"w": torch.zeros(2, 3), "b": torch.zeros(2), "c": torch.zeros(1)},
                dist=SingleProcess())


def test_the_per_rank_item_rule_in_the_plan(tmp_path):
    st = open_storage(str(tmp_path / "c"))
    sid = new_save_id()
    parts = [write_item(st, sid, "state", {"step": 1})]
    parts += [write_item(st, sid, rank_item(r), {"iterator": {"offset": r}, "rng": r})
              for r in range(2)]
    commit(st, sid, parts, world_size=2)
    m = read_manifest(st)
    with pytest.raises(WorldSizeMismatchError) as e:
        plan_ranks(m, 3, item="state", restore_rank_items=True, zero_sharding="none",
                   allow_reshard=True)
    assert ("saved with world size 2 and holds per-rank state (2 items rank/00000 .. "
            "rank/00001 (keys: 'iterator', 'rng')), but the current world size is 3"
            ) in str(e.value)
    assert "rank_state_remap=fn(saved, rank, world_size)" in str(e.value)
    assert "rank_state_on_resize='drop'" in str(e.value)
    drop = plan_ranks(m, 3, item="state", restore_rank_items=True, zero_sharding="none",
                      allow_reshard=True, rank_state_on_resize="drop")
    assert all(p.rank_item is None and "2 items rank/00000 .. rank/00001" in p.dropped
               for p in drop)
    remap = plan_ranks(m, 3, item="state", restore_rank_items=True, zero_sharding="none",
                       allow_reshard=True, remap=True)
    assert all(p.remap_items == {0: "rank/00000", 1: "rank/00001"} and p.rank_item is None
               for p in remap)
    same = plan_ranks(m, 2, item="state", restore_rank_items=True, zero_sharding="none",
                      allow_reshard=True, remap=True)
    assert [p.rank_item for p in same] == ["rank/00000", "rank/00001"]
    assert all(not p.remap_items and not p.dropped for p in same)
    with pytest.raises(ConfigError, match="rank_state_on_resize must be one of error, drop"):
        RestoreConfig(rank_state_on_resize="keep")


# ---- real gloo ranks -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def pools():
    made: dict[int, WorkerPool] = {}

    def get(n: int) -> WorkerPool:
        if n not in made:
            made[n] = WorkerPool(n, xla=False)
        return made[n]

    yield get
    for p in made.values():
        p.close()


def values(results):
    return [r.unwrap() for r in results]


@pytest.fixture(scope="module")
def saved4(pools, tmp_path_factory):
    """4 ranks: FSDP2, 2-D dp x tp and DDP-style plain states, each after one AdamW step,
    saved by xla_ckpt and by DCP."""
    root = str(tmp_path_factory.mktemp("sharded4"))
    got = {kind: values(pools(4).run(W.save_case, root, kind, timeout_s=RUN_TIMEOUT_S))
           for kind in ("fsdp", "2d", "ddp")}
    return root, got


@pytest.fixture(scope="module")
def saved2(pools, tmp_path_factory):
    """2 ranks: FSDP2 after one AdamW step with per-rank items (iterator, RNG)."""
    root = str(tmp_path_factory.mktemp("sharded2"))
    return root, values(pools(2).run(W.save_case, root, "fsdp", rank_state=True,
                                     timeout_s=RUN_TIMEOUT_S))


def _same_as_dcp(case: dict, strategies=("all_ranks", "broadcast")) -> None:
    ref = case["dcp"]
    assert ref, "the DCP reference restored nothing"
    for s in strategies:
        got = case[s]["shards"]
        assert got.keys() == ref.keys(), (s, sorted(set(got) ^ set(ref)))
        for k in ref:
            assert got[k] == ref[k], f"{s}: {k} (offsets/shape/dtype/bytes) differs from DCP's"
        # restored in place: the targets passed as into= hold the values themselves
        for k, v in case[s]["into"].items():
            assert v == ref[k], f"{s}: the into= target {k} was not filled in place"


@slow
def test_same_mesh_both_strategies_resume_bitwise_bytes_and_1d_to_2d(pools, saved4):
    root, saved = saved4
    results = values(pools(4).run(W.restore_cases, root,
                                  [("fsdp", "fsdp"), ("2d", "2d"), ("fsdp", "2d")], resume=True,
                                  timeout_s=RUN_TIMEOUT_S))
    for rank, res in enumerate(results):
        _same_as_dcp(res["2d->2d"])
        _same_as_dcp(res["fsdp->2d"])  # 1-D -> 2-D dp x tp
        assert res["2d->2d"]["all_ranks"]["shards"] == saved["2d"][rank]["saved"]
        case = res["fsdp->fsdp"]
        _same_as_dcp(case)
        assert case["all_ranks"]["shards"] == saved["fsdp"][rank]["saved"]
        for s in ("all_ranks", "broadcast"):
            # the next FSDP2 step after the restore equals the uninterrupted run, bitwise
            assert case[s]["after_step2"] == saved["fsdp"][rank]["after_step2"], (rank, s)
            assert case[s]["param_groups"][0]["lr"] == 0.01
        ours = case["all_ranks"]
        assert ours["strategy"] == "all_ranks"
        # each rank fetched its own shards' bytes only (same mesh: the saved chunks are its
        # boxes, so no crc32c widening)
        assert 0 < ours["planned_bytes"] <= 1.05 * ours["shard_bytes"], (rank, ours)
        assert ours["bytes_read"] <= 1.05 * ours["shard_bytes"], (rank, ours)
        b = case["broadcast"]
        if rank:  # rank 0 read and sent it exactly its boxes
            assert b["bytes_read"] == 0 and b["received"] == b["shard_bytes"]
        else:
            assert b["bytes_read"] > 0


@slow
def test_fsdp2_4_to_2_2d_to_1d_and_ddp_v1_into_fsdp2(pools, saved4):
    root, _ = saved4
    results = values(pools(2).run(
        W.restore_cases, root, [("fsdp", "fsdp"), ("2d", "fsdp"), ("ddp", "fsdp")],
        whole=True, timeout_s=RUN_TIMEOUT_S,
        # broadcast: boxes (a 320 KiB tensor whole, 160 KiB rows) cut into row ranges that
        # travel in several rounds of at most 96 KiB
        config=RestoreConfig(bucket_size_bytes=96 * 1024)))
    for res in results:
        for case in res.values():
            _same_as_dcp(case)
            for s in ("all_ranks", "broadcast"):
                assert case[s]["whole_differs"] == [], s
    for res in results:
        for name, case in res.items():
            ours = case["all_ranks"]
            # rows of a saved chunk are read as a sub-range, widened to crc32c chunks at most
            slack = 2 * W.CHUNK_SIZE_BYTES * len(ours["shards"])
            assert ours["planned_bytes"] <= 1.05 * ours["shard_bytes"] + slack, (name, ours)
            assert ours["bytes_read"] <= 1.05 * ours["shard_bytes"] + slack, (name, ours)


@slow
def test_fsdp2_4_to_3_and_the_per_rank_item_rule(pools, saved4, saved2):
    root4, _ = saved4
    root2, _ = saved2
    results = values(pools(3).run(W.restore_cases, root4, [("fsdp", "fsdp")],
                                  timeout_s=RUN_TIMEOUT_S))
    for res in results:
        _same_as_dcp(res["fsdp->fsdp"])
    got = values(pools(3).run(W.rank_item_cases, root2, timeout_s=RUN_TIMEOUT_S))
    for rank, g in enumerate(got):
        kind, text = g["error"]
        assert kind == "WorldSizeMismatchError"
        assert ("saved with world size 2 and holds per-rank state (2 items rank/00000 .. "
                "rank/00001 (keys: 'iterator', 'rng'))") in text
        assert "current world size is 3" in text
        assert "rank_state_remap=" in text and "rank_state_on_resize='drop'" in text
        assert g["drop"]["rank_state"] is None
        assert any("dropped the per-rank state of a checkpoint saved with world size 2 (2 "
                   "items rank/00000 .. rank/00001 (keys: 'iterator', 'rng')), restored "
                   "with world size 3" in w for w in g["drop"]["warnings"]), g["drop"]
        src = rank % 2
        want = {"iterator": {"epoch": 1, "offset": 10 * src, "remapped_from": src},
                "rng": [src]}
        assert g["remap_all_ranks"] == want and g["remap_broadcast"] == want
        assert g["remap_calls"] == [([0, 1], rank, 3)] * 2
        assert g["rank_item_false"] is None


@slow
def test_fsdp2_2_to_4_and_same_size_keeps_per_rank_items(pools, saved2):
    root, _ = saved2
    results = values(pools(4).run(W.restore_cases, root, [("fsdp", "fsdp")], rank_item=False,
                                  timeout_s=RUN_TIMEOUT_S))
    for res in results:
        _same_as_dcp(res["fsdp->fsdp"])
    kept = values(pools(2).run(W.same_size_rank_item, root, timeout_s=RUN_TIMEOUT_S))
    assert kept == [{"iterator": {"epoch": 1, "offset": 0}, "rng": [0]},
                    {"iterator": {"epoch": 1, "offset": 10}, "rng": [1]}]


def _corrupt_last_row(src: str, dst: str, key: str) -> None:
    """Copy checkpoint ``src`` to ``dst`` and flip a byte in the last row of ``key``."""
    import shutil

    from xla_ckpt.io.manifest_file import read_manifest
    from xla_ckpt.storage import open_storage

    shutil.copytree(src, dst)
    m = read_manifest(open_storage(dst))
    item = m.item("state")
    rec = next(t for t in item.tensors if t.key == key)
    blob = item.blobs[rec.blob]
    at = blob.offset + rec.byte_offset + rec.span_bytes() - 8
    with open(f"{dst}/{blob.file}", "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


@slow
def test_failures_reach_every_rank_naming_the_rank_and_key(pools, saved4, tmp_path):
    root, _ = saved4
    bad = str(tmp_path / "corrupt")
    _corrupt_last_row(f"{root}/ours_ddp", bad, "state['model']['l1.weight']")
    got = values(pools(2).run(W.failure_cases, root, bad, timeout_s=RUN_TIMEOUT_S))
    for g in got:
        kind, text, _ = g["extra_key"]
        assert kind == "StateMismatchError"
        assert ("do not fit the checkpoint on rank(s) 1: rank 1: state['model']['extra.weight'] "
                "is not in the checkpoint") in text
        kind, text, _ = g["shape"]
        assert kind == "StateMismatchError"
        assert ("on every rank: state['model']['l2.bias'] is float32[7] in the checkpoint but "
                "float32[8] in the target") in text
        kind, text, failures = g["unsupported_on_rank1"]
        assert kind == "DistributedError" and list(failures) == [1], g
        assert "UnsupportedTypeError" in failures[1] and "state['model']['hook']" in failures[1]
        kind, text, _ = g["into_on_rank0_only"]
        assert kind == "StateMismatchError"
        assert "restore(into=...) was given on rank(s) 0 but not on rank(s) 1" in text
    # the last row of l1.weight is rank 1's (rows 5-9) to read straight into its live
    # shard (which now holds unchecked bytes, and says so), or rank 0's to send
    for rank, g in enumerate(got):
        e = g["corrupt_all_ranks"]
        assert e["mro"][:2] == ["TargetsOverwrittenError", "PartiallyOverwrittenError"], e
        assert {"IntegrityError", "DistributedError"} <= set(e["mro"])
        assert list(e["failures"]) == [1], e
        assert e["failures"][1].startswith("PartiallyOverwrittenError")
        assert "l1.weight" in e["failures"][1]
        # every rank read straight into all of its targets before the agreement
        assert sorted(e["overwritten"]) == [0, 1] and e["changed"], e
        assert set(e["changed"]) <= set(e["keys"]), e
        assert "overwritten on rank(s) 0 (" in e["text"] and "re-initialise" in e["text"]
        # broadcast: rank 0 reads into its own targets first, then fails reading rank 1's
        e = g["corrupt_broadcast"]
        assert e["mro"][0] == "TargetsOverwrittenError" and list(e["failures"]) == [0], e
        assert e["failures"][0].startswith("IntegrityError") and "l1.weight" in e["failures"][0]
        assert list(e["overwritten"]) == [0], e
        assert set(e["changed"]) <= set(e["keys"]) and bool(e["keys"]) == (rank == 0), (rank, e)
        assert f"overwritten on this rank ({rank}): " + ("none" if rank else "state[") in e["text"]


def _flip_chunk_byte(src: str, dst: str, rank: int) -> str:
    """Copy checkpoint ``src`` to ``dst`` and flip a byte in the middle of the first chunk
    of ``chunks/<rank>``; returns that chunk's key."""
    import shutil

    shutil.copytree(src, dst)
    item = read_manifest(open_storage(dst)).item(f"chunks/{rank:05d}")
    rec = max(item.tensors, key=lambda t: t.numel)
    blob = item.blobs[rec.blob]
    at = blob.offset + rec.byte_offset + rec.span_bytes() // 2
    with open(f"{dst}/{blob.file}", "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))
    return rec.key


@slow
def test_a_failed_restore_into_says_on_every_rank_whose_targets_were_overwritten(
        pools, saved4, tmp_path):
    """4 FSDP2 ranks saved, 3 restore; a flipped byte in a chunk rank 1 wrote.  Every rank's
    error is one class (TargetsOverwrittenError: a PartiallyOverwrittenError and a
    DistributedError) naming the ranks whose live targets were written and its own keys
    (every target whose value changed among them), both strategies; into staged targets only
    (nothing written before the final copy) it stays a plain DistributedError and the
    targets keep their values."""
    root, _ = saved4
    bad = str(tmp_path / "flipped")
    chunk = _flip_chunk_byte(f"{root}/ours_fsdp", bad, 1)
    got = values(pools(3).run(W.overwrite_cases, bad, timeout_s=RUN_TIMEOUT_S))
    for rank, g in enumerate(got):
        for s in ("all_ranks", "broadcast"):
            e = g[s]
            assert e is not None, (rank, s)
            assert e["mro"][:2] == ["TargetsOverwrittenError", "PartiallyOverwrittenError"], e
            assert {"IntegrityError", "DistributedError"} <= set(e["mro"]), e
            assert len(e["failures"]) == 1, e
            (failed, cause), = e["failures"].items()
            assert chunk in cause and "crc32c mismatch" in cause, cause
            assert set(e["changed"]) <= set(e["keys"]), (rank, s, e)
            assert bool(e["keys"]) == (rank in e["overwritten"]), (rank, s, e)
            assert e["overwritten"], e
            assert all(str(r) in e["text"] for r in e["overwritten"]), e
            assert "restore again" in e["text"] and "re-initialise" in e["text"], e
            if s == "all_ranks":  # every rank read straight into all of its targets
                assert sorted(e["overwritten"]) == [0, 1, 2] and e["changed"], e
            # the message is the same on every rank but for this rank's own keys
            assert e["overwritten"] == got[0][s]["overwritten"], (rank, s)
            staged = g[f"staged_{s}"]
            assert staged["mro"][0] == "DistributedError", staged
            assert staged["overwritten"] == {} and staged["changed"] == [], staged
            assert chunk in next(iter(staged["failures"].values())), staged


@slow
def test_4_to_3_from_gcs_by_byte_range(pools, saved4, gcs_emulator, gcs_uri):
    """The same restore from the GCS emulator (the real client, ranged reads)."""
    root, _ = saved4
    base = gcs_uri
    src, dst = open_storage(f"{root}/ours_fsdp"), open_storage(f"{base}/ours_fsdp")
    names = sorted(src.list(""))
    for name in [n for n in names if n != "manifest.json"] + ["manifest.json"]:
        dst.write_atomic(name, [src.read_bytes(name)])
    results = values(pools(3).run(W.restore_cases, root, [("fsdp", "fsdp")], ours_root=base,
                                  env=gcs_emulator.env(), timeout_s=RUN_TIMEOUT_S))
    for res in results:
        case = res["fsdp->fsdp"]
        _same_as_dcp(case)
        ours = case["all_ranks"]
        assert ours["bytes_read"] <= 1.05 * ours["shard_bytes"] + 2 * W.CHUNK_SIZE_BYTES * len(
            ours["shards"])


@slow
def test_striped_into_targets_splits_replicated_boxes_and_matches_dcp(pools, saved4):
    """``striped`` into live targets: ranks holding the same box (the dp replicas of a 2-D
    dp x tp mesh, plain DDP-style targets, FSDP2's replicated ``step`` scalars) each read a
    share of its rows and exchange them; bitwise DCP's values, each box fetched once."""
    root, _ = saved4
    results = values(pools(4).run(
        W.restore_cases, root, [("2d", "2d"), ("ddp", "ddp"), ("fsdp", "fsdp")],
        strategies=("all_ranks", "striped"), timeout_s=RUN_TIMEOUT_S,
        config=RestoreConfig(bucket_size_bytes=64 * 1024)))
    for res in results:
        for case in res.values():
            _same_as_dcp(case, strategies=("all_ranks", "striped"))
            assert case["striped"]["strategy"] == "striped"
    for name in ("2d->2d", "fsdp->fsdp"):  # FSDP2 x TP shards are distinct: only the scalars
        every = sum(r[name]["all_ranks"]["bytes_read"] for r in results)
        assert sum(r[name]["striped"]["bytes_read"] for r in results) <= every, name
    every = sum(r["ddp->ddp"]["all_ranks"]["bytes_read"] for r in results)
    once = sum(r["ddp->ddp"]["striped"]["bytes_read"] for r in results)
    # replicated plain targets: the job fetches them once (4x fewer bytes), not once per rank
    assert once <= every / 4 + 4 * W.CHUNK_SIZE_BYTES, (once, every)
    assert all(r["ddp->ddp"]["striped"]["received"] > 0 for r in results)
