"""The storage conformance suite: every backend in conftest.BACKENDS must pass all of it."""

import concurrent.futures as cf
import os
import threading

import pytest
import torch

from xla_ckpt.errors import CheckpointCorruptError, CheckpointNotFoundError, PreconditionFailedError
from xla_ckpt.storage import RangeRead


def _payload(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return bytes(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy())


def test_write_then_stat_and_read_whole(storage):
    data = _payload(5000)
    info = storage.write_atomic("a/b/obj.bin", [data[:100], memoryview(data[100:])])
    assert info.size == 5000
    assert storage.stat("a/b/obj.bin").size == 5000
    assert storage.read_bytes("a/b/obj.bin") == data


def test_ranged_reads_in_parallel_slices_fill_destination_exactly(storage):
    data = _payload(10_000, seed=1)
    storage.write_atomic("obj", [data])
    outs = [bytearray(n) for n in (1, 999, 4096, 3000)]
    offsets = [0, 17, 2048, 7000]
    storage.read_ranges([RangeRead("obj", o, memoryview(b))
                         for o, b in zip(offsets, outs, strict=True)])
    for o, b in zip(offsets, outs, strict=True):
        assert bytes(b) == data[o:o + len(b)]


def test_read_into_tensor_memory_without_copy(storage):
    data = _payload(4096, seed=2)
    storage.write_atomic("t", [data])
    dest = torch.zeros(4096, dtype=torch.uint8)
    storage.read_ranges([RangeRead("t", 0, dest.numpy().data)])
    assert bytes(dest.numpy()) == data


def test_read_past_end_is_a_corrupt_error_naming_object_and_sizes(storage):
    storage.write_atomic("short", [b"x" * 10])
    with pytest.raises(CheckpointCorruptError) as ei:
        storage.read_range("short", 5, memoryview(bytearray(10)))
    msg = str(ei.value)
    assert "short" in msg and "15" in msg and "10" in msg


def test_missing_object_is_not_found(storage):
    with pytest.raises(CheckpointNotFoundError):
        storage.stat("nope")
    with pytest.raises(CheckpointNotFoundError):
        storage.read_bytes("nope")
    assert storage.exists("nope") is False


def test_overwrite_replaces_whole_object(storage):
    storage.write_atomic("o", [b"old-old-old"])
    storage.write_atomic("o", [b"new"])
    assert storage.read_bytes("o") == b"new"


def test_failed_write_leaves_previous_object_and_nothing_listed(storage):
    storage.write_atomic("keep", [b"committed"])

    def boom():
        yield b"partial"
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError, match="writer died"):
        storage.write_atomic("keep", boom())
    assert storage.read_bytes("keep") == b"committed"
    assert storage.list("") == ["keep"]


def test_list_is_recursive_sorted_and_prefix_scoped(storage):
    for n in ["r/c2/m", "r/c1/m", "r/c1/d", "other/x"]:
        storage.write_atomic(n, [b"1"])
    assert storage.list("r") == ["r/c1/d", "r/c1/m", "r/c2/m"]
    assert storage.list("") == ["other/x", "r/c1/d", "r/c1/m", "r/c2/m"]
    assert storage.list("absent") == []


def test_delete_is_idempotent(storage):
    storage.write_atomic("d/x", [b"1"])
    storage.delete("d/x")
    storage.delete("d/x")
    assert not storage.exists("d/x")
    assert storage.list("d") == []


def test_child_storage_is_rooted_under_prefix(storage):
    storage.write_atomic("run/ck/manifest.json", [b"{}"])
    child = storage.child("run")
    try:
        assert child.list("") == ["ck/manifest.json"]
        assert child.read_bytes("ck/manifest.json") == b"{}"
    finally:
        if child is not storage:
            child.close()


def test_empty_object(storage):
    storage.write_atomic("empty", [])
    assert storage.stat("empty").size == 0
    assert storage.read_bytes("empty") == b""


def test_large_object_round_trip(storage):
    data = os.urandom(300_000)
    storage.write_atomic("big", [data])
    out = bytearray(len(data))
    storage.read_ranges([RangeRead("big", 0, memoryview(out))])
    assert bytes(out) == data


# ---- preconditions (if_generation_match) ------------------------------------------------------
# Sizes: one multipart upload on GCS, and one above the conformance threshold (composed parts).
# Every write carries bytes of its own, so a write can never be taken for another one.
SIZES = [100, 150_000]


@pytest.mark.parametrize("n", SIZES)
def test_create_only_twice_the_second_raises_naming_the_live_generation(storage, n):
    first = storage.write_atomic("c/o", [_payload(n, 1)], if_generation_match=0)
    assert first.generation is not None
    assert storage.stat("c/o").generation == first.generation
    with pytest.raises(PreconditionFailedError) as ei:
        storage.write_atomic("c/o", [_payload(n, 2)], if_generation_match=0)
    e = ei.value
    assert (e.name, e.expected_generation, e.actual_generation) == ("c/o", 0, first.generation)
    assert storage.url("c/o") in str(e) and str(first.generation) in str(e)
    assert storage.read_bytes("c/o") == _payload(n, 1)
    assert storage.list("") == ["c/o"] and storage.list_in_flight("") == []


@pytest.mark.parametrize("n", SIZES)
def test_cas_with_the_current_generation_replaces_and_gives_a_new_generation(storage, n):
    old = storage.write_atomic("o", [_payload(n, 3)])
    new = storage.write_atomic("o", [_payload(n, 4)], if_generation_match=old.generation)
    assert new.generation is not None and new.generation != old.generation
    assert storage.stat("o").generation == new.generation
    assert storage.read_bytes("o") == _payload(n, 4)
    newer = storage.write_atomic("o", [_payload(n, 5)], if_generation_match=new.generation)
    assert newer.generation not in (old.generation, new.generation)


@pytest.mark.parametrize("n", SIZES)
def test_cas_with_a_stale_generation_raises_and_leaves_the_object_byte_identical(storage, n):
    stale = storage.write_atomic("o", [_payload(n, 6)])
    live = storage.write_atomic("o", [_payload(n, 7)])
    with pytest.raises(PreconditionFailedError) as ei:
        storage.write_atomic("o", [_payload(n, 8)], if_generation_match=stale.generation)
    e = ei.value
    assert (e.expected_generation, e.actual_generation) == (stale.generation, live.generation)
    assert str(stale.generation) in str(e) and str(live.generation) in str(e)
    assert storage.read_bytes("o") == _payload(n, 7)
    assert storage.stat("o").generation == live.generation
    assert storage.list("") == ["o"] and storage.list_in_flight("") == []


def test_cas_on_an_absent_object_raises_with_no_actual_generation(storage):
    gen = storage.write_atomic("elsewhere", [b"x"]).generation
    with pytest.raises(PreconditionFailedError) as ei:
        storage.write_atomic("absent", [b"y"], if_generation_match=gen)
    assert ei.value.actual_generation is None and ei.value.expected_generation == gen
    assert not storage.exists("absent")


def test_unconditional_write_replaces_whatever_is_there(storage):
    first = storage.write_atomic("u", [b"1"], if_generation_match=None)
    second = storage.write_atomic("u", [b"2"])
    assert second.generation != first.generation and storage.read_bytes("u") == b"2"


def test_delete_with_a_stale_generation_raises_and_keeps_the_object(storage):
    stale = storage.write_atomic("d/o", [b"old"])
    live = storage.write_atomic("d/o", [b"live"])
    with pytest.raises(PreconditionFailedError) as ei:
        storage.delete("d/o", if_generation_match=stale.generation)
    e = ei.value
    assert (e.name, e.expected_generation, e.actual_generation) == \
        ("d/o", stale.generation, live.generation)
    assert "not deleted" in str(e) and storage.url("d/o") in str(e)
    with pytest.raises(PreconditionFailedError):
        storage.delete("d/o", if_generation_match=0)   # it exists
    assert storage.read_bytes("d/o") == b"live"
    storage.delete("d/o", if_generation_match=live.generation)
    assert not storage.exists("d/o") and storage.list("d") == []
    storage.delete("d/o", if_generation_match=live.generation)  # absent: still not an error


@pytest.mark.parametrize("bad", [-1, True, 1.5, "1"])
def test_a_precondition_that_is_not_a_generation_is_refused(storage, bad):
    with pytest.raises(ValueError, match="if_generation_match"):
        storage.write_atomic("v", [b"x"], if_generation_match=bad)
    with pytest.raises(ValueError, match="if_generation_match"):
        storage.delete("v", if_generation_match=bad)
    assert not storage.exists("v")


def _cas(storage, expected, body, barrier):
    barrier.wait()
    try:
        return body, storage.write_atomic("race", [body], if_generation_match=expected), None
    except PreconditionFailedError as e:
        return body, None, e


def test_concurrent_cas_exactly_one_of_eight_writers_wins_each_round(storage):
    writers, rounds = 8, 3
    gen = storage.write_atomic("race", [b"round 0"]).generation
    with cf.ThreadPoolExecutor(writers) as pool:
        for r in range(1, rounds + 1):
            barrier = threading.Barrier(writers, timeout=60)
            bodies = [f"round {r}, writer {i}".encode() for i in range(writers)]
            results = list(pool.map(_cas, [storage] * writers, [gen] * writers, bodies,
                                    [barrier] * writers))
            wins = [(body, info) for body, info, _ in results if info is not None]
            assert len(wins) == 1, f"round {r}: {len(wins)} writers won"
            ((body, info),) = wins
            assert info.generation is not None and info.generation != gen
            for _, _, err in results:
                if err is not None:
                    assert (err.expected_generation, err.actual_generation) == \
                        (gen, info.generation)
            assert storage.read_bytes("race") == body
            assert storage.stat("race").generation == info.generation
            gen = info.generation
    assert storage.list("") == ["race"]
