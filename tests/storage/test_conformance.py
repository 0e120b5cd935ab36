"""The storage conformance suite: every backend in conftest.BACKENDS must pass all of it."""

import os

import pytest
import torch

from xla_ckpt.errors import CheckpointCorruptError, CheckpointNotFoundError
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
