"""CheckpointManager with an FSDP2 model and its AdamW state, on real gloo ranks.

DCP is the reference: the same ``get_state_dict`` state saved with ``dcp.save`` and restored
with ``dcp.load`` onto the same mesh must give bitwise the shards (and offsets) the manager's
restore gives.  One save run (2 ranks: async save held in flight while training changes the
state, then a sync save) feeds the restores: same world size (values, in place, the next step
bitwise the uninterrupted one), 1 and 3 ranks (the per-rank item rule: error / drop / remap), and
ranks holding different state (refused on every rank, nothing committed).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import sharded_manager_workers as W
import torch
from manager_helpers import committed

import xla_ckpt
from xla_ckpt.testing.asserts import tensor_bits
from xla_ckpt.testing.launcher import shared_pool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _same_shards(a: dict[str, Any], b: dict[str, Any], *, what: str) -> None:
    """Same keys; tensors: same global offsets, dtype, shape and bits; other leaves equal."""
    assert sorted(a) == sorted(b), what
    for k in a:
        if isinstance(a[k], tuple) and len(a[k]) == 2 and isinstance(a[k][1], torch.Tensor):
            (oa, ta), (ob, tb) = a[k], b[k]
            assert oa == ob, f"{what}: {k} offsets {oa} vs {ob}"
            assert ta.dtype == tb.dtype and ta.shape == tb.shape, f"{what}: {k}"
            assert torch.equal(tensor_bits(ta), tensor_bits(tb)), f"{what}: {k} differs"
        else:
            assert a[k] == b[k], f"{what}: {k}: {a[k]!r} vs {b[k]!r}"


def _differ(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [k for k in a if isinstance(a[k], tuple) and isinstance(a[k][1], torch.Tensor)
            and a[k][1].numel() and not torch.equal(a[k][1], b[k][1])]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_manager")
    run_dir, dcp_dir = str(root / "run"), str(root / "dcp")
    os.makedirs(run_dir)
    results = [r.unwrap() for r in shared_pool(2, xla=False).run(W.save_run, run_dir, dcp_dir,
                                                                 timeout_s=300)]
    return run_dir, dcp_dir, results


def test_save_async_and_sync_holds_the_values_of_the_call(saved):
    run_dir, _, results = saved
    assert committed(run_dir) == ["checkpoint_1_1", "checkpoint_1_2"]
    for res in results:
        assert res["held"] == "checkpoint_1_1"  # save() returned with the upload held
        # Step 2 changed every parameter and moment after save() returned...
        assert {k for k in _differ(res["at_1"], res["at_2"])} >= {
            "model.l1.weight", "model.l2.bias", "optim.state.l1.weight.exp_avg"}
    with open(os.path.join(run_dir, "checkpoint_1_1", "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["version"] == 2
    items = manifest["items"]
    assert {"chunks/00000", "chunks/00001", "rank/00000", "rank/00001"} <= set(items)
    assert items["state"].get("chunked") is True
    by_key = {g["key"]: g for g in manifest["global_tensors"]}
    w1 = by_key["state['model']['l1.weight']"]
    assert w1["shape"] == [7, 6]
    assert sorted((c["offsets"], c["sizes"]) for c in w1["chunks"]) == [
        ([0, 0], [4, 6]), ([4, 0], [3, 6])]
    # ... but the checkpoint holds the values of the call (C20), read back whole by xla_ckpt.load.
    whole = xla_ckpt.load(os.path.join(run_dir, "checkpoint_1_1"))
    for key, node in (("model.l1.weight", whole["model"]["l1.weight"]),
                      ("model.l2.weight", whole["model"]["l2.weight"]),
                      ("optim.state.l1.weight.exp_avg",
                       whole["optim"]["state"]["l1.weight"]["exp_avg"])):
        parts = sorted((res["at_1"][key] for res in results), key=lambda p: p[0])
        full = torch.cat([t for _, t in parts])
        assert torch.equal(tensor_bits(node), tensor_bits(full)), key
    assert torch.equal(whole["model"]["seen"], torch.tensor([3, -1, 2**40]))
    assert xla_ckpt.load(os.path.join(run_dir, "checkpoint_1_1"), item="rank/00001") == {
        "rank": 1, "position": 11}


def test_restore_into_fsdp2_equals_dcp_and_next_step_is_bitwise(saved):
    run_dir, dcp_dir, results = saved
    got = [r.unwrap() for r in shared_pool(2, xla=False).run(
        W.restore_same_world, run_dir, dcp_dir, timeout_s=300)]
    for rank, (g, s) in enumerate(zip(got, results, strict=True)):
        _same_shards(g["ours"], g["theirs"], what=f"rank {rank}: ours vs DCP")
        _same_shards(g["ours"], s["at_1"], what=f"rank {rank}: ours vs saved")
        _same_shards(g["next_step"], s["at_2"], what=f"rank {rank}: next step vs uninterrupted")
        _same_shards(g["latest"], s["at_2"], what=f"rank {rank}: latest")
        _same_shards(g["latest"], g["theirs_latest"], what=f"rank {rank}: latest vs DCP")
        assert g["latest_name"] == "checkpoint_1_2"
        assert g["same_objects"]  # the live targets themselves, filled in place
        assert g["rank_state_1"] == {"rank": rank, "position": 10 + rank}
        assert g["rank_state_latest"] == {"rank": rank, "position": 10 + rank}
        assert g["bytes_read"] > 0


@pytest.mark.parametrize("world", [1, 3])
def test_restart_on_another_world_size_follows_the_rank_item_rule(saved, world):
    run_dir, dcp_dir, results = saved
    got = [r.unwrap() for r in shared_pool(world, xla=False).run(
        W.restore_resized, run_dir, dcp_dir, timeout_s=300)]
    full_w = torch.cat([t for _, t in sorted((r["at_1"]["model.l1.weight"] for r in results),
                                             key=lambda p: p[0])])
    for rank, g in enumerate(got):
        kind, msg = g["default"]
        assert kind == "WorldSizeMismatchError"
        assert "rank/00000" in msg and "rank/00001" in msg, msg
        assert "rank_state_remap" in msg and "drop" in msg, msg
        # drop: the values restored as DCP restores them on this mesh, no rank state, a warning
        _same_shards(g["dropped"], g["theirs"], what=f"{world} ranks, rank {rank}: ours vs DCP")
        off, local = g["dropped"]["model.l1.weight"]
        assert torch.equal(local, full_w[off[0]:off[0] + local.shape[0]])
        assert g["dropped_rank_state"] is None
        # remap: the hook sees every saved rank's state and decides this rank's
        assert g["remap_saw"] == {0: {"rank": 0, "position": 10},
                                  1: {"rank": 1, "position": 11}}
        assert g["remapped_rank_state"] == {"rank": rank, "position": 21, "world_size": world}
    assert any("rank/00001" in line for line in got[0]["warnings"]), got[0]["warnings"]
    if world == 3:  # 7 rows over 3 ranks: 3, 3, 1
        assert [g["dropped"]["model.l1.weight"][1].shape[0] for g in got] == [3, 3, 1]


def test_ranks_holding_different_state_are_refused_on_every_rank(tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    got = [r.unwrap() for r in shared_pool(2, xla=False).run(W.save_disagreeing, run_dir,
                                                             timeout_s=300)]
    for rank, g in enumerate(got):
        for case in ("plain_extra_keys", "sharded_vs_plain", "sharded_extra_key",
                     "shards_on_one_rank"):
            assert g[case] is not None, f"rank {rank}: {case} was saved"
            assert g[case][0] == "CheckpointSaveError", (case, g[case])
            assert "nothing was written" in g[case][1], (case, g[case])
        # the same message on every rank, naming the rank and the key
        assert "rank 1" in g["plain_extra_keys"][1]
        assert "4.weight" in g["plain_extra_keys"][1] and "4.bias" in g["plain_extra_keys"][1]
        assert "rank 1" in g["sharded_vs_plain"][1] and "'w'" in g["sharded_vs_plain"][1]
        assert "rank 1" in g["sharded_extra_key"][1] and "extra" in g["sharded_extra_key"][1]
        assert "rank 0" in g["shards_on_one_rank"][1] and "exp_avg" in g["shards_on_one_rank"][1]
    assert got[0] == got[1]
    # nothing of the refused saves was written; the agreed one was
    assert committed(run_dir) == ["checkpoint_1_10"]
    assert sorted(os.listdir(run_dir)) == ["checkpoint_1_10", "checkpoint_last.json", "lease.json"]
    w = xla_ckpt.load(os.path.join(run_dir, "checkpoint_1_10"))["w"]
    assert torch.equal(w, torch.arange(12, dtype=torch.float32).reshape(6, 2))


def test_sharded_async_save_and_restore_on_gcs(gcs_emulator, tmp_path):
    """The same save and restore against the GCS emulator (async uploads on daemon threads)."""
    run_uri = gcs_emulator.unique_uri("sharded-manager")
    dcp_dir = str(tmp_path / "dcp")
    pool, env = shared_pool(2, xla=False), gcs_emulator.env()
    saved = [r.unwrap() for r in pool.run(W.save_run, run_uri, dcp_dir, False, env=env,
                                          timeout_s=300)]
    got = [r.unwrap() for r in pool.run(W.restore_same_world, run_uri, dcp_dir, env=env,
                                        timeout_s=300)]
    for rank, (g, s) in enumerate(zip(got, saved, strict=True)):
        _same_shards(g["ours"], g["theirs"], what=f"rank {rank}: ours vs DCP")
        _same_shards(g["ours"], s["at_1"], what=f"rank {rank}: ours vs saved")
        _same_shards(g["next_step"], s["at_2"], what=f"rank {rank}: next step vs uninterrupted")
        _same_shards(g["latest"], g["theirs_latest"], what=f"rank {rank}: latest vs DCP")
        assert g["latest_name"] == "checkpoint_1_2"
        assert g["rank_state_1"] == {"rank": rank, "position": 10 + rank}


def test_ranks_with_different_run_folders_are_refused_before_anything_is_written(tmp_path):
    got = [r.unwrap() for r in shared_pool(2, xla=False).run(W.save_per_rank_run, str(tmp_path),
                                                             timeout_s=300)]
    run0, run1 = str(tmp_path / "run0"), str(tmp_path / "run1")
    for g in got:
        assert g is not None, "a save to two run folders returned"
        kind, msg, failures = g
        assert kind == "CheckpointSaveError"
        assert "ranks save to different checkpoint folders" in msg
        assert "nothing was written" in msg
        assert failures == {1: f"saves to {run1 + '/checkpoint_1_1'!r}, rank 0 to "
                               f"{run0 + '/checkpoint_1_1'!r}"}
    assert got[0] == got[1]
    for run in (run0, run1):
        assert committed(run) == [] and not os.path.exists(os.path.join(run, "checkpoint_1_1"))


def test_run_folder_not_shared_between_ranks_commits_nothing_and_keeps_the_last(tmp_path):
    got = [r.unwrap() for r in shared_pool(2, xla=False).run(W.save_node_local_run,
                                                             str(tmp_path), timeout_s=300)]
    for g in got:
        assert g is not None, "a save rank 0 cannot see whole returned"
        kind, msg, failures = g
        assert kind == "CheckpointSaveError" and "nothing was committed" in msg, g
        assert set(failures) == {0}
        assert "StorageNotSharedError" in failures[0] and "written by rank 1" in failures[0]
        assert "chunks-00001.safetensors" in failures[0]
    assert got[0][2] == got[1][2]
    run = str(tmp_path / "shared" / "run")
    # Retention (keep 1) did not run: the first checkpoint is there, still the last one.
    assert committed(run) == ["checkpoint_1_1"]
    assert json.loads(open(os.path.join(run, "checkpoint_last.json")).read())["checkpoint"] \
        == "checkpoint_1_1"
    w = xla_ckpt.load(os.path.join(run, "checkpoint_1_1"))["w"]
    assert torch.equal(w, torch.arange(12, dtype=torch.float32).reshape(6, 2))
    second = os.path.join(run, "checkpoint_1_2")
    assert (os.listdir(second) if os.path.isdir(second) else []) == []  # rank 0's file removed
