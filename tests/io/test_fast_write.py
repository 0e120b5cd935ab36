"""The one-pass save path (issue 16): checksums computed as the bytes go out, large sequential
writes, write-back started window by window, and never weaker durability than before: every
data file fsynced before the manifest is published, the manifest fsynced and renamed, the
folder fsynced."""

import os
import threading

import google_crc32c
import pytest
import torch
from safetensors import safe_open

import xla_ckpt
import xla_ckpt.io.writer as writer
import xla_ckpt.storage.local as local
from xla_ckpt.errors import StorageError
from xla_ckpt.format.crc import crc32c_chunks, crc32c_combine, crc32c_concat
from xla_ckpt.format.manifest import MANIFEST_NAME, STATE_ITEM, rank_item
from xla_ckpt.io import commit, new_save_id
from xla_ckpt.io.writer import _ChecksummedPieces, write_items
from xla_ckpt.storage.local import LocalStorage
from xla_ckpt.testing.asserts import assert_state_identical


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(300, 64, generator=g)  # 76800 bytes: many 4 KiB chunks below
    base = torch.arange(40, dtype=torch.int64)
    return {
        "emb": emb, "tied": emb,  # aliasing
        "half": torch.randn(33, generator=g).to(torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
        "view": base[3:9], "strided": base.view(8, 5).t(),  # views of one storage
        "empty": torch.empty(0, 7),
        "bias": torch.randn(5, generator=g),
        "step": 7, "name": "ok",
        "many": [torch.full((3,), float(i)) for i in range(50)],  # small blobs: writev groups
    }


def _file_bytes(folder, name) -> bytes:
    with open(os.path.join(folder, name), "rb") as f:
        return f.read()


# ---- crc32c: each byte once --------------------------------------------------------------

@pytest.mark.parametrize("n,chunk", [(0, 4), (1, 4), (4, 4), (5, 4), (100_003, 4096),
                                     (1 << 16, 1 << 12), (10, 1)])
def test_chunk_crcs_and_the_whole_crc_come_from_one_pass_and_equal_google_crc32c(n, chunk):
    data = os.urandom(n)
    whole, chunks = crc32c_chunks(data, chunk)
    assert whole == google_crc32c.value(data)
    if n <= chunk:
        assert chunks == ()
    else:
        assert chunks == tuple(google_crc32c.value(data[i:i + chunk])
                               for i in range(0, n, chunk))
        assert crc32c_concat(chunks, chunk, n) == whole
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0,
                                                                                 dtype=torch.uint8)
    assert crc32c_chunks(t, chunk) == (whole, chunks)


def test_combine_with_cached_operators_equals_the_crc_of_the_concatenation():
    a, b = os.urandom(1000), os.urandom(123_457)
    assert crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), len(b)) \
        == google_crc32c.value(a + b)
    assert crc32c_combine(5, 9, 0) == 5


# ---- the checksummed stream --------------------------------------------------------------

def test_every_piece_is_checksummed_before_storage_sees_it_and_values_are_exact():
    pieces = [memoryview(os.urandom(n)) for n in (10, 3 << 20, 0, 700_000, 1, 2 << 20, 5)]
    check = [False] + [True] * (len(pieces) - 1)
    stream = _ChecksummedPieces(pieces, check)
    seen = []
    for i, p in enumerate(stream):
        assert stream._crcs[i] is not None or not check[i]  # checksummed before handed out
        seen.append(bytes(p))
    assert seen == [bytes(p) for p in pieces]
    assert stream._crcs[0] is None  # the header is not checksummed
    assert stream.crcs(1, len(pieces)) == [google_crc32c.value(bytes(p)) for p in pieces[1:]]


def test_indexing_computes_a_missing_checksum_and_an_abandoned_stream_stops_its_thread():
    pieces = [memoryview(os.urandom(1 << 20)) for _ in range(8)]
    stream = _ChecksummedPieces(pieces, [True] * 8)
    assert bytes(stream[-1]) == bytes(pieces[7]) and stream._crcs[7] is not None
    before = {t.ident for t in threading.enumerate()}
    it = iter(stream)
    next(it)
    it.close()  # a storage that stops consuming (an error mid-write)
    assert {t.ident for t in threading.enumerate()
            if t.name.startswith("xla_ckpt-crc32c")} - before == set()
    assert stream.crcs(0, 8) == [google_crc32c.value(bytes(p)) for p in pieces]


# ---- bitwise round trip, one data file per writer ----------------------------------------

def test_small_chunks_round_trip_bitwise_and_the_manifest_crcs_match_the_file(tmp_path):
    folder = str(tmp_path / "ck")
    st = LocalStorage(folder)
    sid = new_save_id()
    state, mine = _state(), {"rng": torch.arange(6, dtype=torch.int32), "pos": 3}
    parts = write_items(st, sid, [(STATE_ITEM, state), (rank_item(1), mine)],
                        chunk_size_bytes=4096)
    manifest = commit(st, sid, parts)
    assert list(manifest.files) == [f"data-{sid}-state.safetensors"]
    raw = _file_bytes(folder, f"data-{sid}-state.safetensors")
    assert manifest.files[f"data-{sid}-state.safetensors"] == len(raw)
    for item in manifest.items.values():
        for b in item.blobs:
            body = raw[b.offset:b.offset + b.length]
            assert b.crc32c == google_crc32c.value(body)
            if b.length > 4096:
                assert b.chunk_crc32c == tuple(google_crc32c.value(body[i:i + 4096])
                                               for i in range(0, b.length, 4096))
            else:
                assert b.chunk_crc32c == ()
    got = xla_ckpt.load(folder)
    got_rank = xla_ckpt.load(folder, item=rank_item(1))
    assert_state_identical(got, state)
    assert got["tied"].data_ptr() == got["emb"].data_ptr()
    assert_state_identical(got_rank, mine)
    with safe_open(os.path.join(folder, f"data-{sid}-state.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
    assert "state['emb']" in keys and "rank/00001/state['rng']" in keys
    assert meta["xla_ckpt_items"] == f"{STATE_ITEM},{rank_item(1)}"


def test_save_writes_rank_zeros_item_with_the_state_and_one_file_per_other_rank(tmp_path):
    folder = str(tmp_path / "ck")
    state = _state()
    mine = {"it": 4, "rng": torch.arange(8, dtype=torch.uint8)}
    m = xla_ckpt.save(state, folder, rank_states={0: mine, 2: {"it": 9}})
    state_file = f"data-{m.save_id}-state.safetensors"
    assert sorted(m.files) == sorted([state_file, f"data-{m.save_id}-rank-00002.safetensors"])
    assert {b.file for b in m.items[rank_item(0)].blobs} == {state_file}
    assert sorted(f for f in os.listdir(folder) if f.startswith("data-")) == sorted(m.files)
    assert_state_identical(xla_ckpt.load(folder), state)
    assert_state_identical(xla_ckpt.load(folder, item=rank_item(0)), mine)
    assert xla_ckpt.load(folder, item=rank_item(2)) == {"it": 9}
    m1 = xla_ckpt.save(state, folder, rank_states={0: {"it": 5}})  # the trainer's own save
    assert list(m1.files) == [f"data-{m1.save_id}-state.safetensors"]


def test_a_checkpoint_with_one_file_per_item_still_loads(tmp_path):
    # what earlier versions wrote: every item in its own data file
    folder = str(tmp_path / "ck")
    st = LocalStorage(folder)
    sid = new_save_id()
    state = _state()
    parts = [writer.write_item(st, sid, STATE_ITEM, state),
             writer.write_item(st, sid, rank_item(0), {"it": 1})]
    assert len(commit(st, sid, parts).files) == 2
    assert_state_identical(xla_ckpt.load(folder), state)
    assert xla_ckpt.load(folder, item=rank_item(0)) == {"it": 1}


# ---- durability order and overlapped write-back -------------------------------------------

def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name fds")
def test_data_is_fsynced_before_the_manifest_is_published_then_the_folder(tmp_path,
                                                                         monkeypatch):
    folder = str(tmp_path / "ck")
    xla_ckpt.save({"w": torch.zeros(4)}, folder)  # a save to replace (CAS path)
    log: list[tuple[str, str]] = []
    real_fsync, real_replace, real_link = os.fsync, os.replace, os.link

    def fsync(fd):
        path = _fd_path(fd)
        real_fsync(fd)
        log.append(("fsync", os.path.basename(path) if os.path.isfile(path) else "<dir>"))

    def replace(a, b):
        real_replace(a, b)
        log.append(("publish", os.path.basename(str(b))))

    def link(a, b):
        real_link(a, b)
        log.append(("publish", os.path.basename(str(b))))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "link", link)
    m = xla_ckpt.save(_state(), folder, rank_states={0: {"it": 4}})
    (data,) = m.files
    data_fsync = next(i for i, (k, n) in enumerate(log)
                      if k == "fsync" and n.startswith(data + ".tmp-"))
    data_pub = log.index(("publish", data))
    man_fsync = next(i for i, (k, n) in enumerate(log)
                     if k == "fsync" and n.startswith(MANIFEST_NAME + ".tmp-"))
    man_pub = log.index(("publish", MANIFEST_NAME))
    assert data_fsync < data_pub < man_fsync < man_pub, log
    assert ("fsync", "<dir>") in log[data_pub + 1:man_fsync], log  # data's name is durable
    assert log[man_pub + 1] == ("fsync", "<dir>"), log  # and then the manifest's


@pytest.mark.skipif(local._sync_file_range is None, reason="no sync_file_range here")
def test_write_back_of_each_window_starts_while_later_windows_are_written(tmp_path,
                                                                          monkeypatch):
    window, group = 64 << 10, 16 << 10
    monkeypatch.setattr(local, "WRITEBACK_WINDOW_BYTES", window)
    monkeypatch.setattr(local, "WRITE_GROUP_BYTES", group)
    log: list[tuple] = []
    real_start, real_write, real_fsync = local._start_writeback, os.write, os.fsync
    written = [0]

    def start_writeback(fd, offset, nbytes):
        log.append(("writeback", offset, nbytes))
        real_start(fd, offset, nbytes)

    def write(fd, data):
        n = real_write(fd, data)
        if ".tmp-" in _fd_path(fd):
            log.append(("write", written[0], written[0] + n))  # (start, end) in the file
            written[0] += n
        return n

    def fsync(fd):
        log.append(("fsync",))
        real_fsync(fd)

    monkeypatch.setattr(local, "_start_writeback", start_writeback)
    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)
    data = os.urandom(1 << 20)  # 16 windows
    st = LocalStorage(str(tmp_path))
    info = st.write_atomic("blob", [memoryview(data)[:100_000], memoryview(data)[100_000:]])
    assert info.size == len(data) and _file_bytes(str(tmp_path), "blob") == data
    wbs = [e for e in log if e[0] == "writeback"]
    assert [(o, n) for _, o, n in wbs] == [(k * window, window) for k in range(16)]
    first_fsync = log.index(("fsync",))
    assert all(log.index(e) < first_fsync for e in wbs)  # all started before the fsync
    for k in range(16):
        at = log.index(("writeback", k * window, window))
        # never before its bytes were written ...
        assert any(e[0] == "write" and e[2] >= (k + 1) * window for e in log[:at]), (k, log)
        # ... and started before the writer began writing more than WINDOWS_AHEAD windows past
        beyond = [i for i, e in enumerate(log) if e[0] == "write"
                  and e[1] >= (k + local.WRITEBACK_WINDOWS_AHEAD + 1) * window]
        assert not beyond or at < beyond[0], (k, log)
    assert not [t for t in threading.enumerate() if t.name == "xla_ckpt-writeback"]


def test_short_writes_are_resumed_and_small_buffers_are_gathered(tmp_path, monkeypatch):
    calls: list[int] = []
    real_write = os.write

    def write(fd, data):
        if ".tmp-" not in _fd_path(fd):
            return real_write(fd, data)
        calls.append(len(data))
        return real_write(fd, bytes(data[:1000]))  # at most 1000 bytes per call

    monkeypatch.setattr(os, "write", write)
    big = os.urandom(local.GATHER_BELOW_BYTES)
    pieces = [b"", os.urandom(3), os.urandom(5000), b"z", os.urandom(2500), big, b"tail"]
    st = LocalStorage(str(tmp_path))
    assert st.write_atomic("x", pieces).size == sum(map(len, pieces))
    assert _file_bytes(str(tmp_path), "x") == b"".join(pieces)
    assert calls[0] == 3 + 5000 + 1 + 2500  # the small buffers went out as one write
    assert calls[-1] == 4  # the big buffer alone, then the tail


def test_a_failed_data_write_keeps_the_previous_checkpoint_and_leaves_no_files(tmp_path,
                                                                              monkeypatch):
    folder = str(tmp_path / "ck")
    old = {"w": torch.arange(5.0)}
    xla_ckpt.save(old, folder)
    before = sorted(os.listdir(folder))
    real_write = os.write
    count = [0]

    def write(fd, data):
        count[0] += ".tmp-" in _fd_path(fd)
        if count[0] == 3:
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(local, "WRITE_GROUP_BYTES", 4096)
    with pytest.raises(StorageError, match="No space left"):
        xla_ckpt.save(_state(), folder)
    monkeypatch.undo()
    assert sorted(os.listdir(folder)) == before
    assert_state_identical(xla_ckpt.load(folder), old)
    assert not [t for t in threading.enumerate()
                if t.name in ("xla_ckpt-writeback",) or t.name.startswith("xla_ckpt-crc32c")]
