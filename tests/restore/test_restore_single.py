"""Restore layer in one process: partitions, sharded layouts, plans, strategy choice, ZeRO
helpers."""

from __future__ import annotations

import os

import pytest
import torch

from xla_ckpt.api import save
from xla_ckpt.comm import SingleProcess
from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
    WorldSizeMismatchError,
)
from xla_ckpt.format.manifest import rank_item
from xla_ckpt.io import commit, new_save_id, read_manifest, write_item
from xla_ckpt.restore import (
    RestoreConfig,
    choose_strategy,
    partition_bounds,
    restore,
    save_distributed,
    shard_item,
)
from xla_ckpt.restore.plan import plan_ranks
from xla_ckpt.restore.sharding import read_layout, shard_state
from xla_ckpt.restore.zero import join_optimizer_state, split_optimizer_state
from xla_ckpt.storage import open_storage
from xla_ckpt.testing.asserts import assert_state_identical


def test_partition_bounds_uneven_and_empty():
    assert partition_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert partition_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert partition_bounds(10, 8) == [(0, 2), (2, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 9),
                                       (9, 10)]
    assert partition_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    with pytest.raises(ValueError, match="world_size >= 1"):
        partition_bounds(3, 0)


def _multi_writer_checkpoint(path: str, sizes: list[int], *, world_size: int | None = None,
                             rank_states: bool = False) -> torch.Tensor:
    """What save_distributed writes, written from one process: one shard item per saved rank."""
    full = torch.arange(sum(sizes), dtype=torch.float32) * 0.5
    st = open_storage(path)
    sid = new_save_id()
    parts = [write_item(st, sid, "state", {"step": 1})]
    lo = 0
    for r, n in enumerate(sizes):
        parts.append(write_item(st, sid, shard_item(r), shard_state(
            {"m": full[lo:lo + n].clone()}, {"m": (lo, lo + n)}, {"m": full.numel()})))
        if rank_states:
            parts.append(write_item(st, sid, rank_item(r), {"pos": r}))
        lo += n
    commit(st, sid, parts, world_size=len(sizes) if world_size is None else world_size)
    st.close()
    return full


def test_layout_from_the_manifest_alone(tmp_path):
    full = _multi_writer_checkpoint(str(tmp_path / "c"), [4, 1, 3, 2])
    lay = read_layout(read_manifest(open_storage(str(tmp_path / "c"))))["m"]
    assert (lay.numel, lay.dtype) == (10, "float32")
    assert [(p.rank, p.lo, p.hi) for p in lay.pieces] == [(0, 0, 4), (1, 4, 5), (2, 5, 8),
                                                          (3, 8, 10)]
    assert [(p.rank, a, b) for p, a, b in lay.overlapping(3, 6)] == [(0, 3, 4), (1, 4, 5),
                                                                     (2, 5, 6)]
    for zero, expected in (("os", full), ("none", full)):
        r = restore(str(tmp_path / "c"), dist=SingleProcess(), zero_sharding=zero)
        assert torch.equal(r.shards["m"], expected) and r.shard_bounds == {"m": (0, 10)}


def test_missing_shard_item_is_corrupt(tmp_path):
    _multi_writer_checkpoint(str(tmp_path / "c"), [4, 1, 3, 2], world_size=5)
    with pytest.raises(CheckpointCorruptError, match=r"saved by 5 ranks lacks shard items of "
                                                     r"rank\(s\) \[4\]"):
        read_layout(read_manifest(open_storage(str(tmp_path / "c"))))


def test_plans_refuse_what_cannot_be_resharded(tmp_path):
    _multi_writer_checkpoint(str(tmp_path / "c"), [5, 5], rank_states=True)
    m = read_manifest(open_storage(str(tmp_path / "c")))
    with pytest.raises(WorldSizeMismatchError, match="saved with world size 2 and holds per-rank "
                                                     "state .* current world size is 3"):
        plan_ranks(m, 3, item="state", restore_rank_items=True, zero_sharding="os",
                   allow_reshard=True)
    plans = plan_ranks(m, 3, item="state", restore_rank_items=False, zero_sharding="os",
                       allow_reshard=True)
    assert [p.shards["m"] for p in plans] == [(0, 4), (4, 7), (7, 10)]
    assert all(p.rank_item is None for p in plans)
    with pytest.raises(WorldSizeMismatchError, match="saved with world size 2, but the current "
                                                     "world size is 3 and allow_reshard is False"):
        plan_ranks(m, 3, item="state", restore_rank_items=False, zero_sharding="os",
                   allow_reshard=False)
    plans = plan_ranks(m, 2, item="state", restore_rank_items=True, zero_sharding="os",
                       allow_reshard=False)
    assert [p.rank_item for p in plans] == ["rank/00000", "rank/00001"]


def test_strategy_choice_and_config():
    d = SingleProcess()
    assert choose_strategy(d, RestoreConfig()) == (
        "all_ranks", "auto: a single process reads the checkpoint itself")
    assert choose_strategy(d, RestoreConfig(strategy="broadcast"))[0] == "broadcast"
    assert choose_strategy(d, RestoreConfig(load_checkpoint_on_all_dp_ranks=True)) == (
        "all_ranks", "load_checkpoint_on_all_dp_ranks=True (fairseq option)")
    with pytest.raises(ConfigError, match="restore.strategy must be one of auto, all_ranks, "
                                          "per_host, broadcast, striped; got 'rank0'"):
        RestoreConfig(strategy="rank0")
    with pytest.raises(ConfigError, match="load_checkpoint_on_all_dp_ranks=true asks every rank "
                                          "to read, but restore.strategy is 'broadcast'"):
        RestoreConfig(strategy="broadcast", load_checkpoint_on_all_dp_ranks=True)
    with pytest.raises(ConfigError, match="restore.bucket_size_bytes must be an integer >= 1"):
        RestoreConfig(bucket_size_bytes=0)
    with pytest.raises(ConfigError, match="restore.zero_sharding must be one of none, os"):
        RestoreConfig(zero_sharding="full")
    with pytest.raises(ConfigError, match="restore.host_shared_memory must be true or false"):
        RestoreConfig(host_shared_memory="auto")  # type: ignore[arg-type]  # wrong on purpose


@pytest.mark.parametrize("strategy", ["all_ranks", "broadcast"])
def test_single_process_round_trip(tmp_path, strategy):
    base = torch.randn(4, 6)
    state = {"w": base, "w_t": base.t(), "half": torch.randn(3).to(torch.bfloat16),
             "empty": torch.empty(0, 2), "meta": (1, 2.5, None)}
    uri = str(tmp_path / "run" / "checkpoint_1_1")
    m = save_distributed(state, uri, dist=SingleProcess(), metadata={"num_updates": 1},
                         rank_state={"pos": 9}, shards={"m": torch.arange(3.0)})
    assert m.world_size == 1 and sorted(m.items) == ["rank/00000", "shard/00000", "state"]
    r = restore(str(tmp_path / "run"), dist=SingleProcess(), strategy=strategy)
    assert_state_identical(r.state, state)
    assert r.state["w_t"].data_ptr() == r.state["w"].data_ptr()  # aliasing survives
    assert r.rank_state == {"pos": 9} and r.metadata == {"num_updates": 1}
    assert r.checkpoint == uri and r.strategy == strategy
    assert torch.equal(r.shards["m"], torch.arange(3.0))


@pytest.mark.parametrize("strategy", ["all_ranks", "striped"])
def test_each_restored_tensor_keeps_only_its_own_blob_alive(tmp_path, strategy):
    # Without host shared memory every blob has a buffer of its own: keeping the model's
    # weights must not keep the optimizer state (or anything else) alive.
    state = {"model": {"w": torch.randn(1000)}, "optim": {"exp_avg": torch.randn(1 << 20)}}
    save(state, str(tmp_path / "c"))
    r = restore(str(tmp_path / "c"), dist=SingleProcess(), strategy=strategy)
    w, exp_avg = r.state["model"]["w"], r.state["optim"]["exp_avg"]
    assert w.untyped_storage().nbytes() == 4000
    assert w.untyped_storage().data_ptr() != exp_avg.untyped_storage().data_ptr()
    assert_state_identical(r.state, state)


def test_nothing_to_restore(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint here"):
        restore(str(tmp_path), dist=SingleProcess())
    save({"w": torch.ones(1)}, str(tmp_path / "c"))
    os.remove(tmp_path / "c" / "manifest.json")
    with pytest.raises(IncompleteCheckpointError, match="strategy all_ranks"):
        restore(str(tmp_path / "c"), dist=SingleProcess())
    with pytest.raises(CheckpointNotFoundError, match=r"skipped incomplete: c\)"):
        restore(str(tmp_path), dist=SingleProcess())


def _adam_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    return opt.state_dict()


def test_zero_split_join_is_exact_for_any_world_size():
    sd = _adam_state()
    numel = sum(p["exp_avg"].numel() for p in sd["state"].values())  # 32
    for world in (1, 3, 4, 8):
        parts = [split_optimizer_state(sd, rank=r, world_size=world) for r in range(world)]
        replicated = parts[0][0]
        assert all(p[0] == replicated for p in parts)
        key = "optimizer.exp_avg.float32"
        assert [p[1][key].numel() for p in parts] == [b - a for a, b in
                                                       partition_bounds(numel, world)]
        flat = {k: torch.cat([p[1][k] for p in parts]) for k in parts[0][1]}
        assert_state_identical(join_optimizer_state(replicated, flat), sd)


def test_zero_state_saved_sharded_restores_whole(tmp_path):
    sd = _adam_state()
    replicated, mine = split_optimizer_state(sd, rank=0, world_size=1)
    save_distributed({"last_optimizer_state": replicated}, str(tmp_path / "z"),
                     dist=SingleProcess(), shards=mine)
    r = restore(str(tmp_path / "z"), dist=SingleProcess(), zero_sharding="none")
    assert_state_identical(join_optimizer_state(r.state["last_optimizer_state"], r.shards), sd)
    with pytest.raises(CheckpointCorruptError, match="optimizer flat tensor 'optimizer.exp_avg"):
        join_optimizer_state(r.state["last_optimizer_state"], {})
