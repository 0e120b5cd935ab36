"""Save by owner (issue 12, CASES C16, C17): structure agreement, each box written once.

Real gloo ranks (the launcher's shared 4-worker pool), real FSDP2 (``fully_shard``) and
DTensor on CPU; the checkpoint is read back through the library's own reader.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import sharded_save_workers as W
import torch

import xla_ckpt
from xla_ckpt.comm import SingleProcess
from xla_ckpt.errors import DistributedError
from xla_ckpt.format.chunks import Box, chunk_item
from xla_ckpt.format.manifest import rank_item
from xla_ckpt.io import read_manifest
from xla_ckpt.restore.owners import (
    GlobalSpec,
    _assign,
    _listing,
    _split_replicas,
    _structure_difference,
    _tiling_problem,
    has_sharded,
    plan_chunked_save,
)
from xla_ckpt.storage import open_storage
from xla_ckpt.testing.asserts import tensors_identical
from xla_ckpt.testing.launcher import launch, shared_pool

WORLD = 4


def _values(results):
    return [r.unwrap() for r in results]


def _errors(results):
    for r in results:
        assert r.error is not None, f"rank {r.rank} returned {r.value!r} instead of raising"
    return [r.error for r in results]


# ---- single process: the pure parts --------------------------------------------------------


def test_plan_of_a_plain_state_on_one_process():
    state: dict[str, Any] = {"a": torch.arange(6.0).reshape(2, 3),
                             "b": [torch.zeros(0), torch.tensor(3)], "n": 5,
                             "t": torch.arange(6.0).reshape(2, 3).t()}
    plan = plan_chunked_save(SingleProcess(), state, check_replicas=True)
    assert plan.tree == {"a": {"$tensor": 0}, "b": [{"$tensor": 1}, {"$tensor": 2}], "n": 5,
                         "t": {"$tensor": 3}}
    assert [(s.key, s.dtype, s.shape, s.placement) for s in plan.specs] == [
        ("state['a']", "float32", (2, 3), "replicated"),
        ("state['b'][0]", "float32", (0,), "replicated"),
        ("state['b'][1]", "int64", (), "replicated"),
        ("state['t']", "float32", (3, 2), "replicated")]
    # The empty tensor has no chunk; the transposed one is written C-contiguous.
    assert plan.assignment == {0: [(0, Box((0, 0), (2, 3))), (2, Box((), ())),
                                   (3, Box((0, 0), (3, 2)))]}
    assert plan.owned[2].is_contiguous() and torch.equal(plan.owned[2], state["t"])
    assert plan.chunk_item() == ("chunks/00000", plan.owned)
    item = plan.state_item()
    assert item.chunked and item.state == plan.tree and not item.tensors and not item.blobs
    assert not has_sharded(state)


def test_owner_assignment_balances_replicas_largest_first_and_is_deterministic():
    specs = [GlobalSpec(f"state['t{i}']", "float32", (n,), "replicated")
             for i, n in enumerate([800, 700, 600, 500, 400, 300, 200, 100])]
    holders = {(g, Box((0,), s.shape)): [0, 1, 2, 3] for g, s in enumerate(specs)}
    # A single-holder box (a shard) is counted before the replicas are placed.
    specs.append(GlobalSpec("state['w']", "float32", (1000,), "Shard(0) on mesh (4,)",
                            "dtensor"))
    holders[(8, Box((0,), (1000,)))] = [3]
    out = _assign(specs, holders, 4)
    assert out == _assign(specs, dict(reversed(list(holders.items()))), 4)
    owner = {g: r for r, entries in out.items() for g, _ in entries}
    assert owner == {8: 3, 0: 0, 1: 1, 2: 2, 3: 2, 4: 1, 5: 0, 6: 3, 7: 0}
    load = {r: sum(specs[g].box_nbytes(b) for g, b in e) for r, e in out.items()}
    assert load == {0: 4800, 1: 4400, 2: 4400, 3: 4800}


def test_large_replicas_are_cut_into_row_blocks_one_per_holder():
    specs = [GlobalSpec("state['big']", "float32", (10, 4), "replicated"),
             GlobalSpec("state['small']", "float32", (2, 4), "replicated"),
             GlobalSpec("state['shard']", "float32", (10, 4), "Shard(0) on mesh (4,)",
                        "dtensor"),
             GlobalSpec("state['scalar']", "float32", (), "replicated")]
    holders = {(0, Box((0, 0), (10, 4))): [0, 1, 2, 3], (1, Box((0, 0), (2, 4))): [0, 1, 2, 3],
               (2, Box((3, 0), (3, 4))): [1], (3, Box((), ())): [0, 1, 2, 3]}
    out = _split_replicas(specs, holders, split_bytes=48)
    # 160 bytes over 48 -> 4 blocks by torch.chunk rules (3,3,3,1); 32 bytes stay whole.
    assert list(out) == [(0, Box((0, 0), (3, 4))), (0, Box((3, 0), (3, 4))),
                         (0, Box((6, 0), (3, 4))), (0, Box((9, 0), (1, 4))),
                         (1, Box((0, 0), (2, 4))), (2, Box((3, 0), (3, 4))), (3, Box((), ()))]
    assert out[(0, Box((9, 0), (1, 4)))] == [0, 1, 2, 3] and out[(2, Box((3, 0), (3, 4)))] == [1]


def test_structure_difference_names_the_key_in_words():
    def doc(specs, tree=None, none=False, ties=()):
        tree = {s.key[len("state['"):-2]: {"$tensor": g} for g, s in enumerate(specs)} \
            if tree is None else tree
        return {"none": none, "listing": _listing(tree), "ties": [list(t) for t in ties],
                "specs": [s.to_json() for s in specs]}

    w = GlobalSpec("state['w']", "float32", (4, 3), "replicated")
    wd = GlobalSpec("state['w']", "float32", (4, 3), "Shard(0) on mesh (4,)", "dtensor")
    assert _structure_difference(doc([wd]), doc([w])) == (
        "passes state['w'] as a DTensor, rank 0 as a plain tensor")
    assert _structure_difference(doc([GlobalSpec("state['w']", "float16", (4, 3),
                                                 "replicated")]), doc([w])) == (
        "has state['w'] of shape [4, 3] float16, rank 0 [4, 3] float32")
    assert _structure_difference(doc([w], {"w": {"$tensor": 0}, "x": None}),
                                 doc([w], {"w": {"$tensor": 0}})) == (
        "has state['x'] that rank 0 lacks")
    # The user's key paths, never the typed encoding ($dict, $tuple); values not compared.
    mine = {"w": {"$tensor": 0}, "meta": {"step": 6}}
    ref = {"w": {"$tensor": 0}, "meta": {"$dict": [["step", 5], ["name", "x"], [3, "i"]]}}
    assert _structure_difference(doc([w], mine), doc([w], ref)) == (
        "lacks state['meta']['name'], state['meta'][3] that rank 0 has")
    assert _structure_difference(doc([w], {"w": {"$tensor": 0}, "o": {"$tuple": [1, [2]]}}),
                                 doc([w], {"w": {"$tensor": 0}, "o": [1, [2]]})) == (
        "has a tuple at state['o'], rank 0 a list")  # nothing more named below it
    assert _structure_difference(doc([w], {"w": {"$tensor": 0}, "m": {"k": 1}}),
                                 doc([w], {"w": {"$tensor": 0}, "m": {"k": 2}})) is None
    tied = {"w": {"$tensor": 0}, "v": {"$tensor": 0}}
    v = GlobalSpec("state['v']", "float32", (4, 3), "replicated")
    assert _structure_difference(doc([w, v]), doc([w], tied, ties=[("state['v']",
                                                                    "state['w']")])) == (
        "passes state['v'] as a separate tensor, rank 0 as the same tensor as state['w']")
    assert "passed no state (None)" in str(_structure_difference(doc([], none=True), doc([w])))


def test_tiling_check_names_gaps_and_overlaps():
    spec = GlobalSpec("state['w']", "float32", (10, 6), "Shard(0) on mesh (4,)", "dtensor")
    rows = [Box((0, 0), (3, 6)), Box((3, 0), (3, 6)), Box((6, 0), (3, 6)), Box((9, 0), (1, 6))]
    assert _tiling_problem(spec, rows) is None
    assert "cover 54 of its 60 elements" in str(_tiling_problem(spec, rows[:3]))
    # Same volume as the tensor, but rows 3 overlap and row 6 is missing.
    assert "overlap" in str(_tiling_problem(spec, [Box((0, 0), (4, 6)), Box((3, 0), (3, 6)),
                                                   Box((7, 0), (3, 6))]))
    assert "outside" in str(_tiling_problem(spec, [Box((0, 0), (11, 6))]))


# ---- 4 gloo ranks ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    return shared_pool(WORLD)


@pytest.mark.slow
def test_plan_of_fsdp2_state_takes_boxes_from_dtensor_and_writes_each_once(pool):
    res = _values(pool.run(W.plan_fsdp, timeout_s=120))
    specs = res[0]["specs"]
    assignment = res[0]["assignment"]
    assert all(r["specs"] == specs and r["assignment"] == assignment for r in res)
    keys = [s.key for s in specs]
    by_key = {s.key: (s.shape, s.kind) for s in specs}
    assert by_key == {"state['l1.weight']": ((10, 6), "dtensor"),
                      "state['l1.bias']": ((10,), "dtensor"),
                      "state['l2.weight']": ((3, 10), "dtensor"),
                      "state['l2.bias']": ((3,), "dtensor"), "state['seen']": ((3,), "plain")}
    w1, w2, seen = (keys.index(k) for k in ("state['l1.weight']", "state['l2.weight']",
                                             "state['seen']"))
    written = [(g, b) for entries in assignment.values() for g, b in entries]
    assert len(written) == len(set(written))  # every box once
    for r in range(WORLD):
        for key, (off, shape) in res[r]["dtensor"].items():
            g = keys.index(key)
            box = Box(off, shape)
            if box.numel:  # DTensor's own box, written by the rank that holds it
                assert (g, box) in assignment[r], (r, key)
            else:  # empty shards are not stored
                assert all(b.numel for _, b in written)
    # (10, 6) rows 3,3,3,1 and (3, 10) rows 1,1,1,0 (offsets from DTensor itself).
    assert sorted(b.offsets[0] for g, b in written if g == w1) == [0, 3, 6, 9]
    assert sorted(b.sizes[0] for g, b in written if g == w2) == [1, 1, 1]
    # The plain buffer is written exactly once.
    assert sum(1 for g, _ in written if g == seen) == 1
    assert [r["owned"] for r in res] == [[tuple(b.sizes) for _, b in assignment[r]]
                                         for r in range(WORLD)]


def _manifest(uri: str):
    st = open_storage(uri)
    try:
        return read_manifest(st)
    finally:
        st.close()


def _files(path) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def _chunk_bytes_per_item(m) -> dict[str, int]:
    out: dict[str, int] = {}
    for gt in m.global_tensors:
        isz = torch.empty((), dtype=getattr(torch, gt.dtype)).element_size()
        for c in gt.chunks:
            out[c.item] = out.get(c.item, 0) + Box(c.offsets, c.sizes).numel * isz
    return out


@pytest.mark.slow
def test_fsdp2_save_writes_dtensor_boxes_once_and_loads_whole(pool, tmp_path):
    path = tmp_path / "fsdp"
    res = _values(pool.run(W.save_fsdp, str(path), timeout_s=120))
    assert {r["version"] for r in res} == {2}
    m = _manifest(str(path))
    assert m.version == 2 and m.world_size == WORLD
    gts = {gt.key: gt for gt in m.global_tensors}
    assert sorted(gts) == sorted(res[0]["local"])
    for key, gt in gts.items():
        # Chunks tile the tensor (volumes sum to numel, H1 checks overlap at parse).
        assert sum(Box(c.offsets, c.sizes).numel for c in gt.chunks) == gt.numel, key
        assert all(all(s > 0 for s in c.sizes) for c in gt.chunks), key  # no empty chunk
    for r, out in enumerate(res):
        for key, (off, shape) in out["dtensor"].items():
            chunks = [c for c in gts[key].chunks if c.offsets == off]
            if math.prod(shape) == 0:
                assert not chunks, (r, key)
                continue
            # The DTensor's own box (offsets from DTensor), written once, by its holder.
            assert [(c.item, c.sizes) for c in chunks] == [(chunk_item(r), shape)], (r, key)
    assert [len(gts[k].chunks) for k in ("state['l1.weight']", "state['l2.weight']")] == [4, 3]
    assert gts["state['l1.weight']"].placement == "Shard(0) on mesh (4,)"
    assert len(gts["state['seen']"].chunks) == 1  # the plain buffer: one writer
    rec_keys = [t.key for c in gts["state['l1.weight']"].chunks
                for t in [m.items[c.item].tensors[c.tensor]]]
    assert rec_keys == ["state['l1.weight'][0:3,0:6]", "state['l1.weight'][3:6,0:6]",
                        "state['l1.weight'][6:9,0:6]", "state['l1.weight'][9:10,0:6]"]
    state_item = m.items["state"]
    assert state_item.chunked and not state_item.tensors and not state_item.blobs
    assert sorted(n for n in m.items if n.startswith("rank/")) == [rank_item(r)
                                                                  for r in range(WORLD)]
    # One data file per rank, nothing else but the manifest.
    assert len([f for f in _files(path) if f.startswith("data-")]) == WORLD
    # One process reads it back whole: the local shards concatenated along dim 0.
    loaded = xla_ckpt.load(str(path))
    for key in gts:
        name = key[len("state['"):-2]
        parts = [out["local"][key] for out in res]
        want = parts[0] if key == "state['seen']" else torch.cat(parts)
        assert tensors_identical(loaded[name], want), key


@pytest.mark.slow
def test_replicated_plain_state_is_written_once_balanced_over_ranks(pool, tmp_path):
    path = tmp_path / "balanced"
    res = _values(pool.run(W.save_balanced, str(path), timeout_s=120))
    plan_bytes = res[0]["bytes_per_rank"]
    assert all(r["bytes_per_rank"] == plan_bytes for r in res)
    m = _manifest(str(path))
    written = _chunk_bytes_per_item(m)
    assert written == {chunk_item(r): n for r, n in plan_bytes.items() if n}
    # 8+7+...+1 KiB over 4 ranks, largest first onto the least loaded: 9 KiB each.
    assert sorted(plan_bytes.values()) == [9 * 1024] * 4
    assert all(len(gt.chunks) == 1 for gt in m.global_tensors)  # each tensor once
    loaded = xla_ckpt.load(str(path))
    assert loaded["step"] == 7
    assert all(tensors_identical(loaded[k], v) for k, v in W.plain_state(0).items()
               if isinstance(v, torch.Tensor))


@pytest.mark.slow
@pytest.mark.parametrize("case, failure", [
    ("extra_key", "rank 1: has state['4.weight'], state['4.bias'] that rank 0 lacks"),
    ("dtensor_alone", "rank 1: passes state['w'] as a DTensor, rank 0 as a plain tensor"),
    ("placement", ("rank 1: has state['w'] placed Replicate() on mesh (4,), rank 0 Shard(0) "
                   "on mesh (4,)")),
    ("shape", "rank 1: has state['t2'] of shape [1535] float32, rank 0 [1536] float32"),
    ("shards_alone", "rank 1: passes shards for keys ['exp_avg'], rank 0 for []"),
    ("plain_shape", ("rank 1: tensor state['t2'] has shape [1535] dtype float32, rank 0's "
                     "shape [1536] dtype float32")),
    ("plain_extra_key", "rank 1: holds 1 tensor(s) rank 0 does not: state['extra']"),
])
def test_structure_disagreement_is_one_error_on_every_rank_and_nothing_is_written(
        pool, tmp_path, case, failure):
    path = tmp_path / case
    errs = _errors(pool.run(W.save_disagreeing, str(path), case, timeout_s=120))
    assert all(isinstance(e, DistributedError) for e in errs)
    assert len({str(e) for e in errs}) == 1, [str(e) for e in errs]
    assert failure in str(errs[0])
    assert "nothing was written" in str(errs[0])
    assert set(errs[0].failures) == {1}
    assert _files(path) == []  # no manifest, no stray data file


@pytest.mark.slow
def test_failed_chunk_write_on_one_rank_commits_nothing_and_leaves_no_file(pool, tmp_path):
    path = tmp_path / "failing"
    errs = _errors(pool.run(W.save_failing_on, str(path), 2, timeout_s=120))
    assert all(isinstance(e, DistributedError) for e in errs)
    assert all(e.failures == errs[0].failures for e in errs)  # the same report on every rank
    assert set(errs[0].failures) == {2}
    assert "disk full (injected on rank 2)" in errs[0].failures[2]
    assert all("write data files failed on rank(s) 2 of 4" in str(e) for e in errs)
    assert _files(path) == []  # the other ranks' data files were removed, no manifest


@pytest.mark.slow
def test_check_replicas_names_the_first_differing_copy(pool, tmp_path):
    path = tmp_path / "replica"
    errs = _errors(pool.run(W.save_disagreeing, str(path), "replica", timeout_s=120))
    assert len({str(e) for e in errs}) == 1
    err = errs[0]
    assert isinstance(err, DistributedError)
    assert "the copies of replicated tensor state['t3'] differ across ranks" in str(err)
    assert set(err.failures) == {2}
    assert "its copy of state['t3'] box" in err.failures[2] and "rank 0's" in err.failures[2]
    assert _files(path) == []


@pytest.mark.slow
def test_xla_ckpt_save_of_a_dtensor_state_on_every_rank_loads_whole(pool, tmp_path):
    path = tmp_path / "api"
    res = _values(pool.run(W.xla_ckpt_save_dtensor, str(path), timeout_s=120))
    assert [r["version"] for r in res] == [2] * WORLD
    loaded = xla_ckpt.load(str(path))
    assert tensors_identical(loaded["w"], torch.arange(70.0).reshape(10, 7))
    assert tensors_identical(loaded["b"], torch.arange(3))
    assert loaded["lr"] == 0.5
    assert _manifest(str(path)).metadata == {"step": 3}


@pytest.mark.slow
def test_xla_ckpt_save_of_a_dtensor_state_keeps_each_ranks_own_rank_state(pool, tmp_path):
    path, other = tmp_path / "ranks", tmp_path / "other"
    res = pool.run(W.xla_ckpt_save_dtensor_rank_states, str(path), str(other), timeout_s=120)
    got = [r.value if r.error is None else r.error for r in res]
    assert all(isinstance(g, dict) for g in got), got
    assert got[0]["items"] == ["chunks/00000", "chunks/00001", "chunks/00002", "chunks/00003",
                               "rank/00000", "rank/00001", "rank/00002", "rank/00003", "state"]
    for r in range(WORLD):
        assert xla_ckpt.load(str(path), item=rank_item(r)) == {"pos": 10 + r}
    # rank 1 passes every rank's entry: refused before anything is written, on every rank
    for g in got:
        kind, msg, failures = g["other"]
        assert kind == "DistributedError" and "nothing was written" in msg, g["other"]
        assert failures == {1: (
            "ShardedStateError: state['w'] is a sharded tensor: a sharded state is saved by "
            "every rank together, each writing its own rank_state, but rank_states on rank 1 "
            "holds the state of rank(s) [0, 2, 3]; pass rank_states={1: ...} on rank 1 (its "
            "own only)")}
    assert _files(other) == []


@pytest.mark.slow
def test_xla_ckpt_save_of_a_dtensor_without_process_group_names_the_key(tmp_path):
    path = tmp_path / "nogroup"
    [res] = launch(W.xla_ckpt_save_dtensor_without_group, 1, args=(str(path),), xla=False,
                   timeout_s=120)
    msg = res.unwrap()
    assert msg.startswith("ShardedStateError: state['model']['w'] is a DTensor, but "
                          "torch.distributed is not initialised"), msg
    assert "call xla_ckpt.save(state, uri) on every rank" in msg
    assert _files(path) == []


@pytest.mark.slow
def test_split_replica_pieces_are_row_blocks_of_the_live_tensor(pool):
    res = _values(pool.run(W.plan_split, 4096, timeout_s=120))
    assignment, specs = res[0]["assignment"], res[0]["specs"]
    state = W.plain_state(0)
    seen: dict[int, list[Box]] = {}
    for r, out in enumerate(res):
        for (g, box), t in zip(assignment[r], out["owned"], strict=True):
            want = state[specs[g].key[len("state['"):-2]][box.slices()]
            assert tensors_identical(t, want), (r, g, box)
            seen.setdefault(g, []).append(box)
    # t0 (8 KiB) -> 2 blocks, t1 (7 KiB) -> 2, t3 (5 KiB) -> 2, t4 (4 KiB) stays whole.
    assert [len(seen[g]) for g in range(8)] == [2, 2, 2, 2, 1, 1, 1, 1]
    assert all(sum(b.numel for b in seen[g]) == specs[g].shape[0] for g in range(8))


@pytest.mark.slow
def test_2d_mesh_replicated_dims_are_written_once_by_balanced_holders(pool, tmp_path):
    path = tmp_path / "mesh2d"
    res = _values(pool.run(W.save_2d, str(path), timeout_s=120))
    assignment = res[0]["assignment"]
    assert all(r["assignment"] == assignment for r in res)
    written = [(g, b) for entries in assignment.values() for g, b in entries]
    assert len(written) == len(set(written)) == 4  # 2 boxes of w, 2 of v, each once
    # Largest first onto the least-loaded holder: w's row blocks (120 bytes; holders {0, 1},
    # {2, 3}) to ranks 0 and 2, v's column blocks (80 bytes on {0, 2}, 60 on {1, 3}) next.
    assert res[0]["bytes_per_rank"] == {0: 200, 1: 60, 2: 120, 3: 0}
    m = _manifest(str(path))
    gts = {gt.key: gt for gt in m.global_tensors}
    assert gts["state['w']"].placement == "Shard(0),Replicate() on mesh (2, 2)"
    assert sorted(c.offsets for c in gts["state['v']"].chunks) == [(0, 0), (0, 4)]
    loaded = xla_ckpt.load(str(path))
    assert tensors_identical(loaded["w"], torch.arange(60.0).reshape(10, 6))
    assert tensors_identical(loaded["v"], torch.arange(35.0).reshape(5, 7))


# ---- 2 gloo ranks: where the ranks write (H9-6), ties (H9-1), structure words (H9-2) --------


@pytest.fixture(scope="module")
def pool2():
    return shared_pool(2, xla=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sharded", "rank_state"])
def test_ranks_passing_different_uris_are_refused_before_anything_is_written(
        pool2, tmp_path, case):
    errs = _values(pool2.run(W.save_per_rank_uri, str(tmp_path), case, timeout_s=120))
    u0, u1 = str(tmp_path / "u0"), str(tmp_path / "u1")
    for err in errs:
        assert err is not None, "a save to two folders returned"
        kind, msg, failures = err
        assert kind == "DistributedError", err
        assert failures == {1: f"saves to {u1!r}, rank 0 to {u0!r}"}
        assert "ranks passed different checkpoint URIs" in msg and "nothing was written" in msg
    assert errs[0] == errs[1]  # one error, on every rank
    assert _files(tmp_path) == []  # neither folder was created


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sharded", "rank_state"])
def test_storage_not_shared_between_ranks_is_never_committed(pool2, tmp_path, case):
    # Rank 0's "host" already holds a checkpoint at that path: it must stay whole.
    old = tmp_path / "host0" / "ckpt"
    xla_ckpt.save({"w": torch.full((3,), 7.0)}, str(old))
    before = _files(old)
    res = _values(pool2.run(W.save_node_local, str(tmp_path), case, timeout_s=120))
    (err0, files0), (err1, files1) = res
    assert err0 is not None and err1 is not None
    assert err0[0] == err1[0] == "DistributedError" and err0[2] == err1[2]  # every rank
    kind, msg, failures = err0
    assert set(failures) == {0} and "commit (rank 0) failed" in msg, err0
    assert failures[0].startswith("StorageNotSharedError: /proc/self/cwd/ckpt: not committed: "
                                  "1 of 2 data files"), failures[0]
    rank1_item = "chunks-00001" if case == "sharded" else "rank-00001"
    assert f"{rank1_item}.safetensors (written by rank 1, " in failures[0]
    assert "not found" in failures[0]
    assert "one folder shared by all hosts" in failures[0]
    # Rank 0's folder: the earlier checkpoint untouched (no new manifest, the commit's
    # clean-up of other saves' files never ran), this save's data file removed.  Rank 1's
    # file stays on its "host" (rank 0 cannot see it to remove it).
    assert files0 == before and len(before) == 2
    assert tensors_identical(xla_ckpt.load(str(old))["w"], torch.full((3,), 7.0))
    assert len(files1) == 1 and files1[0].endswith(f"{rank1_item}.safetensors")


@pytest.mark.slow
def test_tied_tensors_are_one_global_tensor_written_once_and_load_tied(pool2, tmp_path):
    path = tmp_path / "tied"
    res = _values(pool2.run(W.save_tied, str(path), timeout_s=120))
    assert [r["version"] for r in res] == [2, 2]
    m = _manifest(str(path))
    tree = m.items["state"].state
    assert tree["emb"] == tree["head"] == tree["head2"]  # one global tensor, three keys
    assert tree["a"] == tree["b"] == tree["c"] and tree["view"] != tree["a"]
    gts = {gt.key: gt for gt in m.global_tensors}
    assert sorted(gts) == ["state['a']", "state['emb']", "state['step']", "state['view']"]
    # Each byte once: the (6, 4) float32 weight, 12 + 4 floats of a and its view, the step.
    assert sum(_chunk_bytes_per_item(m).values()) == (24 + 12 + 4 + 1) * 4
    assert len(gts["state['emb']"].chunks) == 2
    loaded = xla_ckpt.load(str(path))
    assert loaded["emb"] is loaded["head"] is loaded["head2"]
    assert loaded["a"] is loaded["b"] is loaded["c"]
    assert tensors_identical(loaded["emb"], torch.arange(24.0).reshape(6, 4))
    assert tensors_identical(loaded["a"], torch.arange(12.0))
    assert tensors_identical(loaded["view"], torch.arange(4.0, 8.0))
    assert loaded["view"].untyped_storage().data_ptr() != loaded["a"].untyped_storage().data_ptr()


@pytest.mark.slow
def test_restore_into_both_keys_of_a_tied_tensor(pool2, tmp_path):
    path = tmp_path / "tied"
    _values(pool2.run(W.save_tied, str(path), timeout_s=120))
    got = _values(pool2.run(W.restore_tied, str(path), timeout_s=120))
    full = torch.arange(24.0).reshape(6, 4)
    for rank, g in enumerate(got):
        assert g["same"]
        assert tensors_identical(g["local"], full[3 * rank:3 * rank + 3])
        assert tensors_identical(g["a"], torch.arange(12.0))
        assert tensors_identical(g["b"], torch.arange(12.0))


@pytest.mark.slow
def test_structure_message_uses_the_users_key_paths(pool2, tmp_path):
    errs = _values(pool2.run(W.save_meta_differs, str(tmp_path / "meta"), timeout_s=120))
    assert errs[0] == errs[1] and errs[0] is not None
    kind, msg, failures = errs[0]
    assert kind == "DistributedError"
    assert failures == {1: "lacks state['meta']['name'], state['meta'][3] that rank 0 has"}
    assert "$dict" not in msg
    assert _files(tmp_path / "meta") == []


@pytest.mark.slow
def test_other_non_tensor_values_on_a_rank_save_rank_0s(pool2, tmp_path):
    path = tmp_path / "values"
    assert [r["version"] for r in _values(pool2.run(W.save_values_differ, str(path),
                                                     timeout_s=120))] == [2, 2]
    loaded = xla_ckpt.load(str(path))
    assert loaded["meta"] == {"step": 5, 3: ["x", 0]}
