"""Both restore strategies on 4 real gloo ranks, each with its own XLA CPU device.

One pool of 4 worker processes serves the whole module (started once); the
tests that kill a rank start their own.
"""

from __future__ import annotations

import os
import shutil

import pytest
import restore_workers as W
import torch

from xla_ckpt.api import save
from xla_ckpt.comm import SingleProcess
from xla_ckpt.errors import (
    CollectiveTimeoutError,
    DistributedError,
    IncompleteCheckpointError,
    NothingCommittedError,
    UncommittedCheckpointError,
    WorldSizeMismatchError,
)
from xla_ckpt.format.crc import crc32c
from xla_ckpt.restore import partition_bounds, restore
from xla_ckpt.run.catalog import write_pointer
from xla_ckpt.storage import open_storage
from xla_ckpt.testing.asserts import tensor_bits
from xla_ckpt.testing.launcher import WorkerPool, shared_pool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WORLD = 4


@pytest.fixture(scope="module")
def pool():
    return shared_pool(WORLD)


def values(results):
    """Every rank's value; fails with the first rank's traceback if one raised."""
    return [r.unwrap() for r in results]


def errors(results):
    for r in results:
        assert r.error is not None, f"rank {r.rank} returned {r.value!r} instead of raising"
    return [r.error for r in results]


def _no_time(d: dict) -> dict:
    return {k: v for k, v in d.items() if "previous_training_time" not in k}


# ---- parity of the two strategies, trainer on top --------------------------------------------

@pytest.mark.parametrize("storage", ["local", "gcs"])
def test_parity_both_strategies_and_trainer_resume(pool, tmp_path, storage, request):
    env = {}
    if storage == "gcs":
        emu = request.getfixturevalue("gcs_emulator")
        env, base = emu.env(), emu.unique_uri("parity")
    else:
        base = str(tmp_path)
    out = {}
    for kind, strategy in (("xla", "all_ranks"), ("gloo", "broadcast")):
        out[strategy] = values(pool.run(W.trainer_resume, f"{base}/{strategy}", kind, strategy,
                                        env=env))
    for strategy, per_rank in out.items():
        reference = per_rank[0]["restored"]  # each run trained on its own device kind
        for rank, v in enumerate(per_rank):
            assert v["strategy"] == strategy
            # bitwise the same model, optimizer, scheduler and extra_state on every rank,
            # with either strategy ...
            assert v["restored"] == reference, (strategy, rank)
            assert v["restored_other"] == reference, (strategy, rank)
            assert v["other_rank_state"] == v["rank_state"]
            # ... and the same as what was saved
            assert _no_time(v["restored"]) == _no_time(v["saved"])
            # this rank's private state, never rank 0's
            assert v["shard_pos"] == 100 + rank
            assert v["iterator"] == {"epoch": 1, "iterations_in_epoch": 2, "version": 2}
            assert v["num_updates"] == 3
    assert {v["param_device"] for v in out["all_ranks"]} == {"xla:0"}
    assert {v["param_device"] for v in out["broadcast"]} == {"cpu"}
    assert "XLA" not in out["broadcast"][0]["reason"]
    # all_ranks: every rank read from storage; broadcast: only rank 0 read, the others received
    assert all(v["stats"][0] > 0 and v["stats"][1] == 0 for v in out["all_ranks"])
    b = out["broadcast"]
    assert b[0]["stats"][0] > 0 and all(v["stats"] == (0, b[1]["stats"][1]) for v in b[1:])
    assert b[1]["stats"][1] > 0


# ---- decide once ---------------------------------------------------------------------------

def _run_folder(tmp_path) -> str:
    run = tmp_path / "run"
    for n in (10, 20):
        save({"w": torch.full((3,), float(n))}, str(run / f"checkpoint_1_{n}"),
             metadata={"num_updates": n})
    write_pointer(open_storage(str(run)), "last", "checkpoint_1_10")  # lags behind 1_20
    # newer but never committed: data files, no manifest
    save({"w": torch.full((3,), 30.0)}, str(run / "checkpoint_1_30"), metadata={"num_updates": 30})
    os.remove(run / "checkpoint_1_30" / "manifest.json")
    return str(run)


# auto asks the cost model: a 12-byte state costs one first-byte latency whichever plan runs,
# and every exchange only adds to it, so each rank reads for itself on both backends
@pytest.mark.parametrize("kind,expected_strategy", [("xla", "all_ranks"), ("gloo", "all_ranks")])
def test_latest_committed_decided_once(pool, tmp_path, kind, expected_strategy):
    run = _run_folder(tmp_path)
    got = values(pool.run(W.restore_digest, run, kind, "auto"))
    assert {g["strategy"] for g in got} == {expected_strategy}
    assert {g["checkpoint"] for g in got} == {os.path.join(run, "checkpoint_1_20")}
    assert len({g["save_id"] for g in got}) == 1
    assert all(g["metadata"] == {"num_updates": 20} for g in got)
    expected = crc32c(tensor_bits(torch.full((3,), 20.0)))
    assert all(g["digest"]["state['w']"][2] == expected for g in got)


def test_nothing_committed_raises_the_same_on_every_rank(pool, tmp_path):
    empty = tmp_path / "empty_run"
    empty.mkdir()
    for e in errors(pool.run(W.restore_digest, str(empty), "gloo", "broadcast")):
        assert type(e) is NothingCommittedError  # the one fresh-start class, on every rank
        assert "no committed checkpoint" in str(e) and "strategy broadcast" in str(e)
    folder = tmp_path / "half"
    save({"w": torch.ones(2)}, str(folder))
    os.remove(folder / "manifest.json")
    for e in errors(pool.run(W.restore_digest, str(folder), "xla", "auto")):
        assert type(e) is UncommittedCheckpointError and isinstance(e, IncompleteCheckpointError)
        assert "no manifest.json commit marker" in str(e)
        assert "strategy auto: auto: the cost model decides" in str(e)


# ---- C2 ------------------------------------------------------------------------------------

def test_c2_tensors_land_on_cpu_or_the_ranks_own_device(pool, tmp_path):
    got = values(pool.run(W.c2_devices, str(tmp_path / "c2")))
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3).tolist()
    for g in got:
        for strategy in ("all_ranks", "broadcast"):
            assert g[strategy]["cpu"] == "cpu"
            assert g[strategy]["dev"] == g["own"]
            assert g[strategy]["dev_is_own"] is True
            assert g[strategy]["values"] == [w, w, w]


# ---- C6 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("host_shared_memory", [False, True])
def test_c6_broadcast_50_tensors_receivers_pass_nothing_memory_bounded(pool, tmp_path,
                                                                       host_shared_memory):
    g = torch.Generator().manual_seed(6)
    tensors = [torch.randn(256 * 1024, generator=g) for _ in range(50)]  # 50 x 1 MiB
    uri = str(tmp_path / "c6")
    save({"t": tensors}, uri)
    bucket = 4 * 1024 * 1024
    state_bytes = 50 * 1024 * 1024
    warm = str(tmp_path / "warm")  # first use of gloo and the restore path costs ~10 MiB once
    save({"t": [torch.ones(1000)]}, warm)
    values(pool.run(W.c6_broadcast, warm, bucket, host_shared_memory))
    got = values(pool.run(W.c6_broadcast, uri, bucket, host_shared_memory))
    expected = [crc32c(tensor_bits(t)) for t in tensors]
    for rank, v in enumerate(got):
        assert v["crcs"] == expected
        if rank:
            assert v["read"] == 0
            if not host_shared_memory:
                assert v["received"] == state_bytes and v["mapped"] == 0
                assert v["data_path"].startswith("collective broadcast over gloo")
            else:  # one host: rank 0's sealed copy, mapped; nothing crosses the collective
                assert v["received"] == 0 and v["mapped"] == state_bytes
                assert v["data_path"].startswith("host shared memory (1 host(s) x 4 rank(s)")
            # issue target: receiver peak RSS <= state + 2 buckets above its baseline
            assert v["peak_over_base"] <= state_bytes + 2 * bucket, v["peak_over_base"]


# ---- host shared memory -------------------------------------------------------------------

@pytest.fixture(scope="module")
def hs_checkpoint(pool, tmp_path_factory):
    """Replicated tensors (aliasing, dtypes, empty), per-rank items and flat ZeRO shards."""
    uri = str(tmp_path_factory.mktemp("hs") / "ckpt")
    values(pool.run(W.hs_save, uri))
    return uri


def _same_everywhere(got):
    ref = got[0]
    for v in got:
        assert v["digest"] == ref["digest"]
    return ref


def test_host_shared_memory_one_host_bitwise_same_as_collective(pool, hs_checkpoint):
    off = values(pool.run(W.host_share_restore, hs_checkpoint, False))
    on = values(pool.run(W.host_share_restore, hs_checkpoint, True))
    assert _same_everywhere(on)["digest"] == _same_everywhere(off)["digest"]
    state_bytes = on[1]["mapped"]
    assert state_bytes > 300_000 * 4
    for rank in range(WORLD):
        assert on[rank]["rank_state"] == off[rank]["rank_state"]
        assert on[rank]["shards"] == off[rank]["shards"]
        assert on[rank]["data_path"].startswith("host shared memory (1 host(s) x 4 rank(s)")
        if rank:
            assert on[rank]["mapped"] == state_bytes and on[rank]["read"] == 0
            # only each rank's own item (and the replicated shards) cross the collective
            assert on[rank]["received"] == off[rank]["received"] - state_bytes
    assert on[0]["mapped"] == 0 and on[0]["read"] == off[0]["read"]


def test_host_shared_memory_is_copy_on_write_per_rank(pool, hs_checkpoint):
    got = values(pool.run(W.host_share_restore, hs_checkpoint, True, poke=True))
    before = got[0]["digest"]
    for rank, v in enumerate(got):
        if rank == 1:  # its own writes, on its own pages
            assert v["after"] != before
            changed = {k for k in before if v["after"][k] != before[k]}
            assert changed and all("['t']" in k for k in changed)
        else:  # the host's copy and every other rank's tensors are untouched
            assert v["after"] == before, rank


def test_host_shared_memory_two_hosts_leaders_receive_members_map(pool, hs_checkpoint):
    off = values(pool.run(W.host_share_restore, hs_checkpoint, False))
    got = values(pool.run(W.host_share_restore, hs_checkpoint, True, 2, zero_sharding="os"))
    _same_everywhere(got)
    assert got[0]["digest"] == off[0]["digest"]
    assert [v["host_id"] for v in got] == [0, 0, 1, 1]
    state_bytes = got[1]["mapped"]
    for v in got:
        assert v["data_path"].startswith("host shared memory (2 host(s) x 2 rank(s)")
    assert got[0]["mapped"] == 0  # rank 0 read it
    assert got[1]["mapped"] == state_bytes and got[3]["mapped"] == state_bytes  # members
    assert got[2]["mapped"] == 0 and got[2]["received"] >= state_bytes  # host 1's leader
    assert got[1]["received"] < state_bytes and got[3]["received"] < state_bytes
    shard = [v["shards"]["exp_avg"] for v in got]
    assert len(set(shard)) == WORLD  # each rank its own ZeRO partition


def test_a_read_error_on_two_hosts_reaches_every_rank_naming_rank_0(pool, hs_checkpoint,
                                                                    tmp_path):
    # broadcast through host memory on 2 hosts: rank 0 reads, host 1's leader receives over
    # the leaders' subgroup.  A corrupt byte fails rank 0's read; the members that wait
    # outside the subgroup must get the same error at once (not the 62 s collective
    # timeout), naming the job's rank 0, not a subgroup rank.
    bad = str(tmp_path / "bad")
    shutil.copytree(hs_checkpoint, bad)
    (name,) = [n for n in os.listdir(bad) if n.endswith("-state.safetensors")]
    path = os.path.join(bad, name)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    got = errors(pool.run(W.host_share_restore, bad, True, 2, timeout_s=45))
    assert len(got) == WORLD
    for e in got:
        assert type(e) is DistributedError and set(e.failures) == {0}, e
        assert e.failures[0].startswith("IntegrityError: ") and "of 4" in str(e), e


def test_host_shared_memory_falls_back_when_a_rank_cannot_open(pool, hs_checkpoint):
    off = values(pool.run(W.host_share_restore, hs_checkpoint, False))
    got = values(pool.run(W.host_share_restore, hs_checkpoint, True, cannot_open_rank=2))
    assert _same_everywhere(got)["digest"] == off[0]["digest"]
    for rank, v in enumerate(got):
        assert v["data_path"].startswith("collective broadcast over gloo (host shared memory "
                                         "unavailable (rank 2: HostMemoryError: cannot open")
        assert v["mapped"] == 0 and v["received"] == off[rank]["received"]


def test_host_shared_memory_false_on_one_rank_means_off_for_all(pool, hs_checkpoint):
    got = values(pool.run(W.host_share_restore, hs_checkpoint, True, off_rank=3))
    for v in got:
        assert v["data_path"] == ("collective broadcast over gloo (restore.host_shared_memory "
                                  "is false on rank(s) 3)")
        assert v["mapped"] == 0


def test_host_shared_memory_rank0_fails_before_filling_nobody_waits(pool, hs_checkpoint):
    # the followers learn it from the agreement that ends the read step, not from the 120 s
    # collective timeout: the launcher would kill them at 60 s
    results = pool.run(W.rank0_cannot_open_storage, hs_checkpoint, timeout_s=60)
    for e in errors(results):
        assert isinstance(e, DistributedError) and set(e.failures) == {0}, e
        assert "StorageError" in e.failures[0] and "connection refused" in e.failures[0]


@pytest.mark.timeout(120)
def test_leader_dies_before_sealing_the_others_raise(tmp_path):
    uri = str(tmp_path / "k")
    save({"t": [torch.randn(64 * 1024) for _ in range(4)]}, uri)
    with WorkerPool(WORLD, xla=False) as p:
        results = p.run(W.leader_dies_before_sealing, uri, 3.0, timeout_s=90)
    assert results[0].exitcode == -9
    for r in results[1:]:
        assert not r.timed_out, "a rank hung instead of raising"
        assert isinstance(r.error, DistributedError), r.traceback
        assert "rank 0" in str(r.error) or "0" in getattr(r.error, "failures", {}), str(r.error)


# ---- C9 ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def c9_checkpoint(pool, tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("c9") / "ckpt")
    got = values(pool.run(W.c9_save, uri))
    assert got[0]["world_size"] == 4
    assert got[0]["items"] == ["shard/00000", "shard/00001", "shard/00002", "shard/00003", "state"]
    return uri


def _check_resharded(per_rank, world):
    full = W.c9_values()
    for key, t in full.items():
        pieces = [v["shards"][key] for v in per_rank]
        assert [v["bounds"][key] for v in per_rank] == partition_bounds(10, world)
        assert all(dt == str(t.dtype) for dt, _ in pieces)
        joined = [x for _, vals in pieces for x in vals]
        assert torch.equal(torch.tensor(joined, dtype=t.dtype), t)  # exact, nothing lost
    assert all(v["numel"] == {"exp_avg": 10, "exp_avg_sq": 10} for v in per_rank)


@pytest.mark.parametrize("strategy", ["all_ranks", "broadcast"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_c9_reshard_uneven_flat_shards(pool, c9_checkpoint, world, strategy):
    got = values(pool.run(W.c9_restore, c9_checkpoint, world, strategy))
    per_rank = [g for g in got if g is not None]
    assert len(per_rank) == world
    _check_resharded(per_rank, world)
    assert all(v["state"] == {"step": 7} for v in per_rank)
    if strategy == "all_ranks":
        assert all(v["received"] == 0 for v in per_rank)
    else:  # scattered: each receiver got exactly its partition's bytes
        for r, v in enumerate(per_rank[1:], start=1):
            lo, hi = partition_bounds(10, world)[r]
            assert v["received"] == (hi - lo) * (4 + 8)


def test_c9_reshard_to_one_rank(c9_checkpoint):
    r = restore(c9_checkpoint, dist=SingleProcess(), zero_sharding="os")
    assert r.strategy == "all_ranks" and r.shard_bounds == {"exp_avg": (0, 10),
                                                             "exp_avg_sq": (0, 10)}
    for key, t in W.c9_values().items():
        assert torch.equal(r.shards[key], t)


@pytest.fixture(scope="module")
def pool8():
    """8 ranks without torch_xla (faster to start); the kill test breaks it last."""
    p = WorkerPool(8, xla=False)
    yield p
    p.close()


@pytest.mark.parametrize("strategy", ["all_ranks", "broadcast"])
def test_c9_reshard_to_eight_ranks(pool8, c9_checkpoint, strategy):
    results = pool8.run(W.c9_restore, c9_checkpoint, 8, strategy, timeout_s=120)
    _check_resharded([r.unwrap() for r in results], 8)


@pytest.mark.timeout(120)
def test_killed_rank_makes_the_others_raise(pool8, tmp_path):
    """Rank 2 dies while receiving the second bucket: the other 7 raise, none hangs."""
    uri = str(tmp_path / "k")
    g = torch.Generator().manual_seed(1)
    save({"t": [torch.randn(64 * 1024, generator=g) for _ in range(4)]}, uri)
    results = pool8.run(W.killed_mid_broadcast, uri, 3.0, timeout_s=90)
    assert results[2].exitcode == -9
    for r in results[:2] + results[3:]:
        assert not r.timed_out, "a rank hung instead of raising"
        assert isinstance(r.error, DistributedError), r.traceback
        assert isinstance(r.error, CollectiveTimeoutError) or "died" in str(r.error)
        assert "(strategy broadcast: strategy='broadcast' was requested)" in str(r.error)


def test_c9_world_size_mismatch_without_resharding(pool, c9_checkpoint):
    results = pool.run(W.c9_restore, c9_checkpoint, 3, "all_ranks", "os", False)
    assert results[3].unwrap() is None  # not in the 3-rank group
    for e in errors(results[:3]):
        assert type(e) is WorldSizeMismatchError
        assert "saved with world size 4" in str(e) and "current world size is 3" in str(e)


def test_zero_none_gives_every_rank_the_whole_tensor(pool, c9_checkpoint):
    got = values(pool.run(W.c9_restore, c9_checkpoint, 2, "broadcast", "none"))
    for v in got[:2]:
        assert v["bounds"] == {"exp_avg": (0, 10), "exp_avg_sq": (0, 10)}
        assert v["shards"]["exp_avg"][1] == W.c9_values()["exp_avg"].tolist()


# ---- C12 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["all_ranks", "broadcast"])
def test_c12_per_rank_iterator_and_rng_resume(pool, tmp_path, strategy):
    got = [g for g in values(pool.run(W.c12_resume, str(tmp_path / "c12"), 2, strategy)) if g]
    assert len(got) == 2
    for rank, g in enumerate(got):
        assert g["resumed"] == g["rest"] and len(g["rest"]) == 2
        assert g["rank_state_is_own"] is True and g["noise_equal"] is True
        mine = set(range(rank, 20, 2))
        assert {x for b in g["seen"] + g["resumed"] for x in b} == mine
    assert got[0]["rest"] != got[1]["rest"]


def test_c12_rank_state_with_another_world_size_is_refused(pool, tmp_path):
    uri = str(tmp_path / "c12w")
    values(pool.run(W.c12_resume, uri, 2, "all_ranks"))
    for e in errors(pool.run(W.restore_digest, uri, "gloo", "broadcast")):
        assert type(e) is WorldSizeMismatchError
        assert "saved with world size 2" in str(e) and "current world size is 4" in str(e)
    got = values(pool.run(W.restore_digest, uri, "gloo", "broadcast", rank_item=False))
    assert all(g["rank_state"] is None for g in got)


# ---- a rank that fails to read -------------------------------------------------------------

def _flip_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("kind,strategy,failing", [("xla", "all_ranks", [2]),
                                                     ("gloo", "broadcast", [0])])
def test_corrupt_rank_item_fails_every_rank_naming_the_reader(pool, tmp_path, kind, strategy,
                                                                failing):
    uri = str(tmp_path / "bad")
    values(pool.run(W.save_with_rank_states, uri))
    (name,) = [n for n in os.listdir(uri) if n.endswith("-rank-00002.safetensors")]
    _flip_last_byte(os.path.join(uri, name))
    for e in errors(pool.run(W.restore_expect_failure, uri, kind, strategy)):
        assert type(e) is DistributedError
        assert sorted(e.failures) == failing
        assert e.failures[failing[0]].startswith("IntegrityError: ")
        assert name in e.failures[failing[0]]
        assert f"strategy {strategy}" in str(e)


# all_ranks with host shared memory (the default) is per_host: the host's leader alone reads
@pytest.mark.parametrize("kind,strategy,failing", [("xla", "all_ranks", [0]),
                                                     ("gloo", "broadcast", [0])])
def test_truncated_state_file_error_reaches_every_rank(pool, tmp_path, kind, strategy, failing):
    uri = str(tmp_path / "trunc")
    values(pool.run(W.save_with_rank_states, uri))
    (name,) = [n for n in os.listdir(uri) if n.endswith("-state.safetensors")]
    path = os.path.join(uri, name)
    size = os.path.getsize(path)
    os.truncate(path, size // 2)
    for e in errors(pool.run(W.restore_expect_failure, uri, kind, strategy)):
        assert type(e) is DistributedError
        assert sorted(e.failures) == failing
        assert e.failures[failing[0]].startswith("CheckpointCorruptError: ")
        assert f"expected {size} bytes, found {size // 2} bytes" in e.failures[failing[0]]


