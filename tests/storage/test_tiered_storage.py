"""Reads through :class:`TieredStorage`: a host's local copy of a checkpoint folder first, the
durable copy behind it (a local folder, or gs:// on the emulator).

Real checkpoints in temp folders; the local copy is a copy of the durable one's files, then
damaged (a file removed, truncated, a byte flipped).  Each test asserts the bytes a read
returns, which tier served them (``TierCounters``), the reported fallbacks and how often
``on_failure`` was called; the end-to-end cases read whole checkpoints with the real reader
(:class:`CheckpointReader`) and compare every tensor bitwise.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from dataclasses import replace
from typing import Any

import pytest
import torch

import xla_ckpt
from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DataFileMissingError,
    IntegrityError,
    StorageError,
)
from xla_ckpt.format import typed
from xla_ckpt.format.chunks import Box, ChunkRecord, GlobalTensor, chunk_item, chunk_key
from xla_ckpt.format.dtypes import dtype_name
from xla_ckpt.format.manifest import MANIFEST_NAME, STATE_ITEM, Item, Manifest
from xla_ckpt.io import CheckpointReader
from xla_ckpt.io.writer import WrittenItem, commit, new_save_id, write_items
from xla_ckpt.storage import Storage, StorageConfig
from xla_ckpt.storage.local import LocalStorage
from xla_ckpt.storage.tiered import TierCounters, TieredStorage

CFG = StorageConfig(max_workers=2, slice_size_bytes=4096)


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {"model": {"a": torch.randn(300, generator=g), "b": torch.randn(40, 20, generator=g),
                      "c": torch.arange(500, dtype=torch.int64)},
            "step": 12}


class Tiers:
    """A committed checkpoint in ``durable`` and a byte-identical copy in ``local``."""

    def __init__(self, local: str, durable: Storage, manifest: Manifest) -> None:
        self.local = local
        self.durable = durable
        self.manifest = manifest
        self.failures: list[str] = []
        self.opened = 0
        self.counters = TierCounters()

    def data_file(self) -> str:
        (name,) = [f for f in self.manifest.files if f.startswith("data-")]
        return name

    def path(self, name: str) -> str:
        return os.path.join(self.local, name)

    def storage(self, *, durable: bool = True) -> TieredStorage:
        def open_durable() -> Storage:
            self.opened += 1
            return self.durable
        return TieredStorage(LocalStorage(self.local, CFG), open_durable if durable else None,
                             files=self.manifest.files, host=3, counters=self.counters,
                             on_failure=self.failures.append, config=CFG)

    def flip(self, name: str, offset: int) -> None:
        with open(self.path(name), "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0xFF]))


def copy_up(src: str, dst: Storage) -> None:
    """Upload a checkpoint folder's files (data first, the manifest last), as a save does."""
    names = sorted(os.listdir(src), key=lambda n: n == MANIFEST_NAME)
    for n in names:
        with open(os.path.join(src, n), "rb") as f:
            dst.write_atomic(n, [f.read()])


@pytest.fixture(params=["local", "gcs"])
def durable_kind(request):
    return request.param


@pytest.fixture
def make_durable(durable_kind, tmp_path, request):
    """A factory of empty durable folders of the parametrized kind (closed at teardown)."""
    made: list[Storage] = []
    stems: list[str] = []

    def make() -> Storage:
        if durable_kind == "local":
            st: Storage = LocalStorage(str(tmp_path / f"durable-{len(made)}"), CFG)
        else:
            emu = request.getfixturevalue("gcs_emulator")
            stem = f"tiered-{uuid.uuid4().hex[:12]}"
            stems.append(stem)
            st = emu.storage(stem, CFG)
        made.append(st)
        return st
    yield make
    for st in made:
        st.close()
    if stems:
        emu = request.getfixturevalue("gcs_emulator")
        for s in stems:
            emu.delete_prefix(s + "/")


def make_tiers(tmp_path, durable: Storage, tree: Any = None) -> Tiers:
    local = str(tmp_path / "local" / "checkpoint_1_12")
    manifest = xla_ckpt.save(state() if tree is None else tree, local)
    copy_up(local, durable)
    return Tiers(local, durable, manifest)


@pytest.fixture
def tiers(tmp_path):
    """A plain checkpoint with a local-folder durable copy (the unit cases)."""
    durable = LocalStorage(str(tmp_path / "durable" / "checkpoint_1_12"), CFG)
    t = make_tiers(tmp_path, durable)
    yield t
    durable.close()


def read(st: Storage, name: str, offset: int, n: int) -> bytes:
    buf = bytearray(n)
    st.read_range(name, offset, memoryview(buf))
    return bytes(buf)


def file_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# ---- unit cases -----------------------------------------------------------------------------


def test_reads_the_local_copy_and_never_opens_durable(tiers):
    name = tiers.data_file()
    want = file_bytes(tiers.path(name))
    with tiers.storage() as st:
        assert st.stat(name).size == len(want) == tiers.manifest.files[name]
        assert read(st, name, 0, len(want)) == want
        assert read(st, name, 100, 50) == want[100:150]
        assert st.list() == sorted([*tiers.manifest.files, MANIFEST_NAME])
    assert (tiers.counters.local_bytes, tiers.counters.durable_bytes) == (len(want) + 50, 0)
    assert (tiers.counters.local_requests, tiers.counters.durable_requests) == (2, 0)
    assert tiers.opened == 0 and tiers.counters.fallbacks == [] and tiers.failures == []


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_missing_or_truncated_local_file_is_read_from_durable(tiers, damage, caplog):
    name = tiers.data_file()
    want = file_bytes(tiers.path(name))
    size = len(want)
    if damage == "missing":
        os.unlink(tiers.path(name))
        why = "is missing"
    else:
        os.truncate(tiers.path(name), size // 2)
        why = f"has {size // 2} bytes, the manifest says {size}"
    with caplog.at_level(logging.WARNING, logger="xla_ckpt.storage.tiered"), \
            tiers.storage() as st:
        assert st.stat(name).size == size
        assert read(st, name, 0, size) == want
        assert st.stat(name).size == size  # reported once
    reason = (f"local file {tiers.path(name)} {why}; its bytes come from the durable tier")
    assert tiers.counters.fallbacks == [reason]
    assert tiers.failures == [reason]
    assert f"host 3: {reason}" in caplog.text
    assert (tiers.counters.local_bytes, tiers.counters.durable_bytes) == (0, size)


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_without_durable_the_reader_gets_the_local_file_as_it_is(tiers, damage):
    name = tiers.data_file()
    size = tiers.manifest.files[name]
    if damage == "missing":
        os.unlink(tiers.path(name))
        why = "is missing"
    else:
        os.truncate(tiers.path(name), 10)
        why = f"has 10 bytes, the manifest says {size}"
    with tiers.storage(durable=False) as st:
        for _ in range(2):
            if damage == "missing":
                with pytest.raises(CheckpointNotFoundError):
                    st.stat(name)
            else:
                assert st.stat(name).size == 10
        # The reader's own errors name the file (and the sizes).
        with pytest.raises(DataFileMissingError if damage == "missing" else
                           CheckpointCorruptError, match=re.escape(tiers.path(name))):
            CheckpointReader(st, tiers.manifest).load()
    reason = (f"local file {tiers.path(name)} {why}, and the durable tier does not hold this "
              "save")
    assert tiers.counters.fallbacks == tiers.failures == [reason]
    assert tiers.opened == 0


def test_crc_mismatch_sends_only_that_range_to_durable(tiers):
    name = tiers.data_file()
    good = file_bytes(tiers.path(name))
    tiers.flip(name, 1000)  # inside the range reported below
    tiers.flip(name, 3000)  # outside it: still read from the local copy
    with tiers.storage() as st:
        assert read(st, name, 512, 1024) != good[512:1536]
        assert st.crc_mismatch(name, 512, 1024, ["state['model']['a']"]) is True
        assert read(st, name, 512, 1024) == good[512:1536]  # durable bytes
        assert read(st, name, 1000, 1) == good[1000:1001]  # inside: durable
        assert read(st, name, 0, 600) == good[:600]  # overlaps the range: durable
        assert read(st, name, 0, 512) == good[:512]  # before it: local (same bytes)
        local_part = read(st, name, 2048, 2048)  # after it: local, flipped byte and all
        assert local_part[3000 - 2048] == good[3000] ^ 0xFF
        # The same range failing again: those were durable bytes, no second fallback.
        assert st.crc_mismatch(name, 512, 1024, ["state['model']['a']"]) is False
    c = tiers.counters
    assert (c.durable_bytes, c.durable_requests) == (1024 + 1 + 600, 3)
    assert (c.local_bytes, c.local_requests) == (1024 + 512 + 2048, 3)
    reason = (f"crc32c mismatch in local file {tiers.path(name)} bytes [512, 1536) (tensor "
              "state['model']['a']); those bytes come from the durable tier")
    assert c.fallbacks == [reason] and tiers.failures == [reason]
    assert tiers.opened == 1


def test_crc_mismatch_without_durable_returns_false_and_reports_once(tiers):
    name = tiers.data_file()
    with tiers.storage(durable=False) as st:
        assert st.crc_mismatch(name, 0, 64, ["t1", "t2", "t3", "t4"]) is False
        assert st.crc_mismatch(name, 0, 64, ["t1", "t2", "t3", "t4"]) is False  # a re-read
        assert st.crc_mismatch(name, 64, 64, ["t1"]) is False
        assert read(st, name, 0, 64) == file_bytes(tiers.path(name))[:64]  # still local
    assert tiers.failures == [(
        f"crc32c mismatch in local file {tiers.path(name)} bytes [0, 64) (tensor t1, t2, t3 "
        "(+1 more)), and the durable tier does not hold this save")]
    assert len(tiers.counters.fallbacks) == 2  # every failed range, once
    assert tiers.opened == 0 and tiers.counters.durable_bytes == 0


def test_on_failure_that_raises_does_not_fail_the_read(tiers, caplog):
    name = tiers.data_file()
    good = file_bytes(tiers.path(name))
    tiers.flip(name, 10)

    def boom(why: str) -> None:
        raise OSError(28, "No space left on device")
    st = TieredStorage(LocalStorage(tiers.local, CFG), lambda: tiers.durable,
                       files=tiers.manifest.files, host=3, counters=tiers.counters,
                       on_failure=boom)
    with caplog.at_level(logging.WARNING, logger="xla_ckpt.storage.tiered"), st:
        assert st.crc_mismatch(name, 0, 64, []) is True
        assert read(st, name, 0, 64) == good[:64]
    assert "could not record the failure: [Errno 28] No space left on device" in caplog.text


def test_writes_and_deletes_are_refused(tiers):
    name = tiers.data_file()
    before = file_bytes(tiers.path(name))
    with tiers.storage() as st:
        with pytest.raises(StorageError, match="a tiered restore source is read-only"):
            st.write_atomic(name, [b"x"])
        with pytest.raises(StorageError, match="a tiered restore source is read-only"):
            st.write_atomic("new-file", [b"x"])
        with pytest.raises(StorageError, match="a tiered restore source is read-only"):
            st.delete(name)
    assert file_bytes(tiers.path(name)) == before
    assert not os.path.exists(tiers.path("new-file"))
    assert file_bytes(os.path.join(tiers.durable.uri, name)) == before


# ---- end to end through the reader ----------------------------------------------------------


def blob_of(manifest: Manifest, key: str) -> tuple[str, int, int]:
    """(file, offset, length) of the blob holding tensor ``key`` of the state item."""
    item = manifest.item(STATE_ITEM)
    (rec,) = [t for t in item.tensors if t.key == key]
    blob = item.blobs[rec.blob]
    return blob.file, blob.offset, blob.length


def assert_same_tree(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert set(got) == set(want)
        for k in want:
            assert_same_tree(got[k], want[k])
    else:
        assert got == want


def test_reader_with_a_flipped_local_byte_reads_exact_values(tmp_path, make_durable, caplog):
    caplog.set_level(logging.ERROR, logger="xla_ckpt.io.blob_reader")
    t = make_tiers(tmp_path, make_durable())
    key = "state['model']['b']"
    file, offset, length = blob_of(t.manifest, key)
    t.flip(file, offset + length // 2)
    with t.storage() as st:
        reader = CheckpointReader(st, t.manifest)
        got = reader.load()
    assert_same_tree(got, state())
    (reason,) = t.counters.fallbacks
    assert reason.startswith(f"crc32c mismatch in local file {t.path(file)} bytes [")
    assert f"(tensor {key})" in reason and reason.endswith("come from the durable tier")
    assert t.failures == [reason]
    total = sum(t.manifest.files.values())
    assert 0 < t.counters.durable_bytes <= length < total
    assert t.counters.local_bytes > 0


def test_reader_without_durable_raises_integrity_error_and_reports_once(tmp_path, caplog):
    caplog.set_level(logging.CRITICAL, logger="xla_ckpt.io.blob_reader")
    durable = LocalStorage(str(tmp_path / "durable"), CFG)
    t = make_tiers(tmp_path, durable)
    key = "state['model']['c']"
    file, offset, length = blob_of(t.manifest, key)
    t.flip(file, offset + 3)
    with t.storage(durable=False) as st, pytest.raises(IntegrityError) as e:
        CheckpointReader(st, t.manifest).load()
    assert key in str(e.value) and t.path(file) in str(e.value)
    assert len(t.failures) == 1 and f"(tensor {key})" in t.failures[0]
    assert t.counters.fallbacks == t.failures  # once, though the reader re-read it
    assert t.counters.durable_bytes == 0
    durable.close()


def write_chunked(uri: str, tree: dict[str, torch.Tensor], rows_per_chunk: int,
                  chunk_size_bytes: int) -> Manifest:
    """A chunked (version 2) checkpoint of one writer: every tensor of ``tree`` as a global
    tensor saved in row blocks of ``rows_per_chunk`` (what a sharded save writes)."""
    found: list[tuple[str, torch.Tensor]] = []

    def hook(t: torch.Tensor, path: tuple) -> int:
        found.append((typed.format_path(path), t))
        return len(found) - 1
    encoded = typed.encode(tree, hook)
    boxes = [(g, Box((r,) + (0,) * (t.dim() - 1), (min(rows_per_chunk, t.shape[0] - r),)
                     + tuple(t.shape[1:])))
             for g, (_, t) in enumerate(found) for r in range(0, t.shape[0], rows_per_chunk)]
    st = LocalStorage(uri, CFG)
    save_id = new_save_id()
    mine = [found[g][1][box.slices()].contiguous() for g, box in boxes]
    (written,) = write_items(st, save_id, [(chunk_item(0), mine)],
                             chunk_size_bytes=chunk_size_bytes)
    written.item.tensors = [replace(rec, key=chunk_key(found[g][0], box))
                            for rec, (g, box) in zip(written.item.tensors, boxes, strict=True)]
    table: dict[int, list[ChunkRecord]] = {g: [] for g in range(len(found))}
    for k, (g, box) in enumerate(boxes):
        table[g].append(ChunkRecord(written.name, k, box.offsets, box.sizes))
    gts = [GlobalTensor(key, dtype_name(t.dtype), tuple(t.shape), tuple(table[g]),
                        placement="Shard(0) on mesh (1,)")
           for g, (key, t) in enumerate(found)]
    parts = [written, WrittenItem(STATE_ITEM, Item(state=encoded, chunked=True), {})]
    try:
        return commit(st, save_id, parts, world_size=1, global_tensors=gts)
    finally:
        st.close()


@pytest.mark.parametrize("in_place", [False, True])
def test_chunked_read_with_a_flipped_local_byte_reads_exact_values(tmp_path, make_durable,
                                                                   in_place, caplog):
    caplog.set_level(logging.ERROR, logger="xla_ckpt.io.blob_reader")
    g = torch.Generator().manual_seed(2)
    tree = {"w": torch.randn(64, 32, generator=g), "v": torch.randn(40, generator=g)}
    local = str(tmp_path / "local" / "checkpoint_1_12")
    manifest = write_chunked(local, tree, rows_per_chunk=16, chunk_size_bytes=1024)
    durable = make_durable()
    copy_up(local, durable)
    t = Tiers(local, durable, manifest)
    file = t.data_file()
    # A byte inside w's second row block (rows 16..31): 2 KiB in a 1 KiB-checked chunk.
    (rec,) = [r for r in manifest.item(chunk_item(0)).tensors
              if r.key == chunk_key("state['w']", Box((16, 0), (16, 32)))]
    blob = manifest.item(chunk_item(0)).blobs[rec.blob]
    t.flip(file, blob.offset + rec.byte_offset + 100)
    into = {"state['w']": torch.zeros(64, 32), "state['v']": torch.zeros(40)} if in_place \
        else None
    with t.storage() as st:
        got = CheckpointReader(st, manifest).load(into=into)
    assert torch.equal(got["w"], tree["w"]) and torch.equal(got["v"], tree["v"])
    if in_place:
        assert got["w"] is into["state['w']"]  # type: ignore[index]  # into is set here
    (reason,) = t.counters.fallbacks
    # Only the 1 KiB checked chunk holding the byte came from durable storage.
    bad = blob.offset + rec.byte_offset + 100 // 1024 * 1024
    assert reason == (f"crc32c mismatch in local file {t.path(file)} bytes [{bad}, "
                      f"{bad + 1024}) (tensor state['w']); those bytes come from the durable "
                      "tier")
    assert t.failures == [reason]
    assert t.counters.durable_bytes == 1024
    assert t.counters.local_bytes == (64 * 32 + 40) * 4  # every byte read once locally
