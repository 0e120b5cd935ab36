"""Fast read paths of CheckpointReader (issue 16): arenas laid out like the file, spans across
blobs, coalesced small blobs (local and gs://), restore in place into live tensors."""

import logging
import uuid

import pytest
import torch

import xla_ckpt
from xla_ckpt.errors import (
    ConfigError,
    IntegrityError,
    PartiallyOverwrittenError,
    StateMismatchError,
)
from xla_ckpt.format.manifest import STATE_ITEM
from xla_ckpt.io import CheckpointReader, commit, new_save_id, write_item
from xla_ckpt.io.buffers import host_arenas, in_place_buffers, prefault
from xla_ckpt.io.planning import CACHE_STEP_BYTES, COALESCE_BLOB_BYTES, plan_spans
from xla_ckpt.storage import StorageConfig, open_storage
from xla_ckpt.testing.asserts import assert_state_identical
from xla_ckpt.testing.fault_proxy import downloads
from xla_ckpt.trainer.module_load import in_place_targets, load_module_state, saved_records

KIB = 1024


def mixed_state():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 1000, generator=g)                 # 1.2 MB: several 64 KiB chunks
    emb = torch.randn(50, 16, generator=g)
    base = torch.arange(60, dtype=torch.float32)
    return {
        "model": {"big": big, "emb": emb, "out": emb,           # tied: one blob, two keys
                  "flag": torch.tensor([True, False, True]),    # 3 bytes: unaligns what follows
                  "half": torch.randn(7, generator=g).to(torch.float16),
                  "i64": torch.arange(9, dtype=torch.int64),
                  "strided": base.view(6, 10)[:, ::3],          # a lone strided view
                  "empty": torch.empty(0, 4)},
        "opt": {"m": torch.randn(40, 40, generator=g), "v": torch.randn(33, generator=g),
                "step": 3, "lr": 0.1},
    }


def save_chunked(uri, state, chunk=64 * KIB, config=None):
    st = open_storage(uri, config)
    sid = new_save_id()
    commit(st, sid, [write_item(st, sid, STATE_ITEM, state, chunk_size_bytes=chunk)])
    st.close()


def test_local_load_is_bitwise_with_aliasing_strides_and_dtypes(tmp_path):
    state = mixed_state()
    save_chunked(str(tmp_path / "ck"), state)
    got = xla_ckpt.load(str(tmp_path / "ck"))
    assert_state_identical(got, state)
    m = got["model"]
    assert m["emb"].data_ptr() == m["out"].data_ptr()        # tie kept
    assert m["strided"].stride() == (3, 1) or m["strided"].is_contiguous()
    assert torch.equal(m["strided"], state["model"]["strided"])
    for k in ("big", "emb", "half", "i64", "m", "v"):        # typed views, aligned
        t = m.get(k, got["opt"].get(k))
        assert t.data_ptr() % t.element_size() == 0


def test_arenas_follow_the_file_and_never_mix_top_level_entries(tmp_path):
    save_chunked(str(tmp_path / "ck"), mixed_state())
    reader = CheckpointReader.open(str(tmp_path / "ck"))
    item = reader.manifest.item(STATE_ITEM)
    bufs = host_arenas(item, range(len(item.blobs)))
    top = {t.blob: t.key.split("][")[0] for t in item.tensors}
    storages: dict[int, set[str]] = {}
    for b, buf in bufs.items():
        if buf.numel():
            storages.setdefault(buf.untyped_storage().data_ptr(), set()).add(top[b])
    assert all(len(groups) == 1 for groups in storages.values())
    assert {g for groups in storages.values() for g in groups} == {"state['model'", "state['opt'"}
    # One arena holds adjacent blobs at their file distances: spans cross blob boundaries.
    spans = plan_spans(item, bufs, slice_size_bytes=16 * 1024 * 1024)
    assert len(spans) < len([b for b in item.blobs if b.length])
    assert sum(len(s.pieces) for s in spans) == sum(max(1, len(b.chunk_crc32c))
                                                    for b in item.blobs if b.length)
    reader.read_into(STATE_ITEM, bufs)
    assert reader.stats.requests == len(spans)


def test_small_blobs_in_separate_buffers_are_read_with_one_request(tmp_path):
    state = {f"b{i}": torch.full((100 + i,), float(i)) for i in range(12)}
    save_chunked(str(tmp_path / "ck"), state)
    reader = CheckpointReader.open(str(tmp_path / "ck"))
    item = reader.manifest.item(STATE_ITEM)
    bufs = {i: torch.empty(b.length, dtype=torch.uint8) for i, b in enumerate(item.blobs)}
    (span,) = plan_spans(item, bufs, slice_size_bytes=16 * 1024 * 1024)
    assert span.out is None and len(span.pieces) == 12          # staged, split back by offset
    reader.read_into(STATE_ITEM, bufs)
    assert reader.stats.requests == 1
    from xla_ckpt.format.plan import materialize_item
    assert_state_identical(materialize_item(item, bufs), state)


def corrupt_file(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def blob_of(reader, key):
    item = reader.manifest.item(STATE_ITEM)
    rec = next(t for t in item.tensors if t.key == key)
    return item.blobs[rec.blob]


def test_local_corrupt_small_blob_among_coalesced_names_that_tensor(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="xla_ckpt")
    state = {f"b{i}": torch.full((64,), float(i)) for i in range(10)}
    save_chunked(str(tmp_path / "ck"), state)
    reader = CheckpointReader.open(str(tmp_path / "ck"))
    rec = blob_of(reader, "state['b6']")
    corrupt_file(str(tmp_path / "ck" / rec.file), rec.offset + 5)
    with pytest.raises(IntegrityError) as e:
        reader.load()
    assert e.value.key == "state['b6']" and not isinstance(e.value, PartiallyOverwrittenError)
    want = (f"crc32c mismatch in bytes [{rec.offset}, {rec.offset + rec.length}) of tensor "
            "state['b6'] after 3 reads")
    assert want in str(e.value)
    assert reader.stats.requests == 1 + 2                       # one span, two re-reads of b6


def test_local_reads_check_each_cache_step_and_use_one_thread_per_cpu(tmp_path, monkeypatch):
    # A blob of 3 crc32c chunks of 2 MiB, in one 16 MiB span: on a local file it is read in
    # steps of whole chunks of at most CACHE_STEP_BYTES, each checked right after its read.
    state = {"w": torch.arange(3 * 512 * 1024, dtype=torch.float32)}   # 6 MiB
    save_chunked(str(tmp_path / "ck"), state, chunk=2 * 1024 * 1024)
    reader = CheckpointReader.open(str(tmp_path / "ck"))
    assert reader.storage.memory_bound_reads
    got = reader.load()
    assert torch.equal(got["w"], state["w"])
    assert reader.stats.requests == -(-6 * 1024 * 1024 // CACHE_STEP_BYTES)   # 2 steps of 2+1
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})
    assert reader.storage.read_concurrency() == 3                   # min(16 workers, 3 CPUs)
    st = open_storage(str(tmp_path / "ck"), StorageConfig(max_workers=2))
    assert st.read_concurrency() == 2


def test_local_corrupt_byte_in_a_later_cache_step_names_its_chunk(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="xla_ckpt")
    state = {"w": torch.arange(3 * 512 * 1024, dtype=torch.float32)}
    save_chunked(str(tmp_path / "ck"), state, chunk=2 * 1024 * 1024)
    reader = CheckpointReader.open(str(tmp_path / "ck"))
    rec = blob_of(reader, "state['w']")
    corrupt_file(str(tmp_path / "ck" / rec.file), rec.offset + 5 * 1024 * 1024 + 7)
    with pytest.raises(IntegrityError) as e:
        reader.load()
    lo = rec.offset + 4 * 1024 * 1024
    assert f"crc32c mismatch in bytes [{lo}, {lo + 2 * 1024 * 1024}) of tensor state['w']" \
        in str(e.value)


def test_prefault_changes_no_byte_and_tolerates_any_range():
    buf = torch.arange(3 * 4096 + 100, dtype=torch.uint8)
    want = buf.clone()
    prefault(buf.data_ptr() + 5, 2 * 4096 + 3)      # unaligned: widened to whole pages
    prefault(buf.data_ptr(), 0)
    prefault(0, 4096)                               # no address: nothing to do
    assert torch.equal(buf, want)
    fresh = torch.empty(1 << 20, dtype=torch.uint8)
    prefault(fresh.data_ptr(), fresh.numel())
    fresh.fill_(7)
    assert int(fresh.sum()) == 7 * (1 << 20)


# ---- gs:// -----------------------------------------------------------------------------------
@pytest.fixture
def stem(gcs_emulator):
    s = f"t-{uuid.uuid4().hex[:12]}"
    yield s
    gcs_emulator.delete_prefix(s + "/")


READ = StorageConfig(max_workers=4, slice_size_bytes=16 * 1024 * 1024, initial_backoff_s=0.001,
                     max_backoff_s=0.01)


def test_gcs_coalesces_small_blobs_and_is_bitwise(gcs_emulator, fault_proxy, stem):
    state = mixed_state()
    state["small"] = {f"ln{i}": torch.full((96,), float(i)) for i in range(20)}
    with gcs_emulator.storage(f"{stem}/ck") as direct:
        sid = new_save_id()
        commit(direct, sid, [write_item(direct, sid, STATE_ITEM, state,
                                        chunk_size_bytes=256 * KIB)])
    with fault_proxy.storage(gcs_emulator.uri(f"{stem}/ck"), READ) as st:
        fault_proxy.reset_log()
        reader = CheckpointReader(st)
        got = reader.load()
        data_gets = fault_proxy.records(downloads(".safetensors"))
    assert_state_identical(got, state)
    item = reader.manifest.item(STATE_ITEM)
    nonempty = [b for b in item.blobs if b.length]
    # 30-odd blobs, 1.2 MB of them in one: two arenas (model, opt, small) -> one GET each here
    assert len(nonempty) > 25
    assert len(data_gets) == reader.stats.requests <= 4
    assert sum(r.body_bytes for r in data_gets) == sum(b.length for b in nonempty)


def test_gcs_corrupt_byte_in_one_of_many_coalesced_blobs(gcs_emulator, fault_proxy, stem,
                                                         caplog):
    caplog.set_level(logging.ERROR, logger="xla_ckpt")
    state = {f"ln{i}": torch.full((96,), float(i)) for i in range(20)}
    with gcs_emulator.storage(f"{stem}/ck") as direct:
        sid = new_save_id()
        commit(direct, sid, [write_item(direct, sid, STATE_ITEM, state)])
        reader = CheckpointReader(direct)
        rec = blob_of(reader, "state['ln13']")
        raw = bytearray(direct.read_bytes(rec.file))
        raw[rec.offset + 17] ^= 0x01
        direct.write_atomic(rec.file, [bytes(raw)])           # stored bytes now corrupt
    with fault_proxy.storage(gcs_emulator.uri(f"{stem}/ck"), READ) as st:
        fault_proxy.reset_log()
        reader = CheckpointReader(st)
        with pytest.raises(IntegrityError) as e:
            reader.load()
        gets = fault_proxy.records(downloads(".safetensors"))
    assert e.value.key == "state['ln13']"
    assert e.value.path == f"gs://{st.bucket_name}/{st.prefix}/{rec.file}"
    # one GET for all 20 blobs, then two re-reads of ln13's bytes alone
    ranges = [r.range for r in gets]
    assert len(ranges) == 3
    assert ranges[1:] == [f"bytes={rec.offset}-{rec.offset + rec.length - 1}"] * 2


# ---- in place ----------------------------------------------------------------------------------
class Tied(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(300, 64)
        self.fc = torch.nn.Linear(64, 5000)
        self.norm = torch.nn.LayerNorm(64)
        self.out = torch.nn.Linear(64, 300, bias=False)
        self.out.weight = self.emb.weight                      # tied
        self.register_buffer("count", torch.tensor(7, dtype=torch.int64))


def save_module(tmp_path, module, chunk=64 * KIB):
    state = {"model": module.state_dict(), "extra": {"epoch": 2}}
    save_chunked(str(tmp_path / "ck"), state, chunk=chunk)
    return state


def restore_in_place(uri, module, **kw):
    reader = CheckpointReader.open(uri)
    try:
        item = reader.manifest.item(STATE_ITEM)
        into = in_place_targets(module, saved_records(item)["model"], **kw)
        state = reader.load(STATE_ITEM, into=into)
    finally:
        reader.storage.close()
    load_module_state(module, state["model"], **kw)
    return into, state


def test_in_place_restore_keeps_data_ptrs_values_and_ties(tmp_path):
    src = Tied(0)
    save_module(tmp_path, src)
    dst = Tied(1)
    ptrs = {k: t.data_ptr() for k, t in dst.state_dict(keep_vars=True).items()}
    version = dst.fc.weight._version
    into, state = restore_in_place(str(tmp_path / "ck"), dst)
    assert "state['model']['fc.weight']" in into and "state['model']['out.weight']" in into
    assert {k: t.data_ptr() for k, t in dst.state_dict(keep_vars=True).items()} == ptrs
    assert_state_identical(dict(dst.state_dict()), dict(src.state_dict()))
    assert dst.out.weight is dst.emb.weight
    assert state["model"]["fc.weight"].data_ptr() == dst.fc.weight.data_ptr()  # read in place
    assert dst.fc.weight._version > version                    # autograd told


def test_in_place_refused_before_any_byte_on_a_shape_mismatch(tmp_path):
    src = Tied(0)
    save_module(tmp_path, src)
    dst = Tied(1)
    dst.fc = torch.nn.Linear(64, 1999)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    reader = CheckpointReader.open(str(tmp_path / "ck"))
    assert in_place_targets(dst, saved_records(reader.manifest.item(STATE_ITEM))["model"]) == {}
    with pytest.raises(StateMismatchError, match="shape mismatch in fc.weight"):
        restore_in_place(str(tmp_path / "ck"), dst)
    assert_state_identical(dict(dst.state_dict()), before)


def test_in_place_leaves_casts_and_subclasses_to_the_ordinary_path(tmp_path):
    src = Tied(0)
    save_module(tmp_path, src)
    dst = Tied(1).to(torch.float64)                          # widening cast: allowed, copied
    into, _ = restore_in_place(str(tmp_path / "ck"), dst)
    assert set(into) == {"state['model']['count']"}              # int64 buffer: same dtype
    assert torch.equal(dst.fc.weight, src.fc.weight.double())


def test_in_place_crc_failure_in_a_large_blob_says_partially_overwritten(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="xla_ckpt")
    save_module(tmp_path, Tied(0))
    reader = CheckpointReader.open(str(tmp_path / "ck"))
    rec = blob_of(reader, "state['model']['fc.weight']")
    assert rec.length > COALESCE_BLOB_BYTES
    corrupt_file(str(tmp_path / "ck" / rec.file), rec.offset + rec.length - 3)
    dst = Tied(1)
    with pytest.raises(PartiallyOverwrittenError) as e:
        restore_in_place(str(tmp_path / "ck"), dst)
    assert e.value.key == "state['model']['fc.weight']"
    assert e.value.keys == ("state['model']['fc.weight']",)
    assert "partially overwritten" in str(e.value)


def test_in_place_small_blob_failure_leaves_the_live_tensor_untouched(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="xla_ckpt")
    save_module(tmp_path, Tied(0))
    reader = CheckpointReader.open(str(tmp_path / "ck"))
    rec = blob_of(reader, "state['model']['norm.bias']")
    corrupt_file(str(tmp_path / "ck" / rec.file), rec.offset + 1)
    dst = Tied(1)
    before = dst.norm.bias.detach().clone()
    with pytest.raises(IntegrityError) as e:
        restore_in_place(str(tmp_path / "ck"), dst)
    assert e.value.key == "state['model']['norm.bias']"
    assert not isinstance(e.value, PartiallyOverwrittenError)
    assert torch.equal(dst.norm.bias.detach(), before)      # staged: checked before it landed


def test_in_place_buffers_skip_targets_sharing_memory_across_blobs(tmp_path):
    state = {"a": torch.randn(2000), "b": torch.randn(2000)}
    save_chunked(str(tmp_path / "ck"), state)
    reader = CheckpointReader.open(str(tmp_path / "ck"))
    item = reader.manifest.item(STATE_ITEM)
    live = torch.zeros(2000)
    assert in_place_buffers(item, {"state['a']": live, "state['b']": live}) == {}
    other = torch.zeros(2000)
    got = in_place_buffers(item, {"state['a']": live, "state['b']": other})
    assert sorted(got) == [0, 1] and got[1].data_ptr() == other.data_ptr()


# ---- host buffers ------------------------------------------------------------------------------
def test_host_buffer_huge_pages_only_when_asked_or_stall_free(monkeypatch):
    from xla_ckpt.io import buffers as reader

    monkeypatch.setattr(reader, "HUGE_PAGES", True)
    buf = reader.host_buffer(5 * reader.HUGE_PAGE_BYTES + 123)
    assert buf.numel() == 5 * reader.HUGE_PAGE_BYTES + 123 and buf.dtype == torch.uint8
    if reader._madvise is not None:
        assert buf.data_ptr() % reader.HUGE_PAGE_BYTES == 0
    buf.fill_(7)                                               # every byte is ours to write
    assert int(buf[-1]) == 7
    choices = {"enabled": "madvise", "defrag": "madvise"}
    monkeypatch.setattr(reader, "_sysfs_choice", lambda path: choices[path.rsplit("/", 1)[1]])
    assert not reader.huge_pages_stall_free()                  # madvise defrag: faults may stall
    choices["defrag"] = "defer"
    assert reader.huge_pages_stall_free()
    choices["enabled"] = "never"
    assert not reader.huge_pages_stall_free()
    monkeypatch.setattr(reader, "HUGE_PAGES", False)
    small = reader.host_buffer(3 * reader.HUGE_PAGE_BYTES)
    assert small.untyped_storage().nbytes() == 3 * reader.HUGE_PAGE_BYTES   # no reserve


def test_load_with_huge_pages_is_bitwise(tmp_path, monkeypatch):
    from xla_ckpt.io import buffers as reader

    monkeypatch.setattr(reader, "HUGE_PAGES", True)
    state = {"a": torch.randn(1 << 20), "b": torch.arange(10), "c": torch.randn(3, 5)}
    save_chunked(str(tmp_path / "ck"), state)
    assert_state_identical(xla_ckpt.load(str(tmp_path / "ck")), state)


# ---- mmap (local) ------------------------------------------------------------------------------
def test_mmap_load_is_bitwise_checked_and_writes_stay_private(tmp_path):
    state = mixed_state()
    save_chunked(str(tmp_path / "ck"), state)
    reader = CheckpointReader.open(str(tmp_path / "ck"))
    got = reader.load(mmap=True)
    assert_state_identical(got, state)
    assert got["model"]["emb"].data_ptr() == got["model"]["out"].data_ptr()   # tie kept
    file = next(iter(reader.manifest.files))
    before = (tmp_path / "ck" / file).read_bytes()
    got["model"]["big"].add_(1.0)                               # copy-on-write, file untouched
    assert (tmp_path / "ck" / file).read_bytes() == before
    assert_state_identical(xla_ckpt.load(str(tmp_path / "ck")), state)


def test_mmap_load_of_a_corrupt_blob_reads_it_again_then_names_it(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="xla_ckpt")
    state = {"a": torch.randn(5000), "b": torch.randn(300)}
    save_chunked(str(tmp_path / "ck"), state)
    reader = CheckpointReader.open(str(tmp_path / "ck"))
    rec = blob_of(reader, "state['b']")
    corrupt_file(str(tmp_path / "ck" / rec.file), rec.offset + 2)
    with pytest.raises(IntegrityError) as e:
        reader.load(mmap=True)
    assert e.value.key == "state['b']"
    assert reader.stats.requests == 3                          # b alone, read and re-read twice


def _load_in_child(uri, n, q):
    q.put(int(xla_ckpt.load(uri)["a"].numel() == n))


def test_a_forked_child_reads_with_its_own_threads(tmp_path):
    import multiprocessing

    uri = str(tmp_path / "ck")
    xla_ckpt.save({"a": torch.randn(3 << 20)}, uri)
    assert xla_ckpt.load(uri)["a"].numel() == 3 << 20          # the parent's pool now exists
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_load_in_child, args=(uri, 3 << 20, q))
    p.start()
    p.join(60)
    assert p.exitcode == 0 and q.get(timeout=1) == 1          # not stuck on the parent's threads


# ---- strided targets (issue 16 defect: strides of lone non-contiguous tensors) ----------------

def test_into_fills_a_transposed_target_in_place_and_keeps_a_sliced_one_apart(tmp_path):
    saved = {"tr": torch.arange(12.0).reshape(3, 4).t(),
             "col": torch.arange(24.0).reshape(4, 6)[:, ::2]}
    save_chunked(str(tmp_path / "ck"), saved)
    tr = torch.zeros(3, 4).t()                         # same strides (1, 4): one dense span
    base = torch.full((4, 6), -7.0)
    col = base[:, ::2]                                 # same strides (6, 2); gaps hold base's
    reader = CheckpointReader.open(str(tmp_path / "ck"))
    try:
        got = reader.load(into={"state['tr']": tr, "state['col']": col})
    finally:
        reader.storage.close()
    assert got["tr"].data_ptr() == tr.data_ptr() and got["tr"].stride() == (1, 4)
    assert torch.equal(tr, saved["tr"])                # read straight into the live tensor
    # the column slice's blob covers base's other columns too: never read into base
    assert got["col"].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert got["col"].stride() == (6, 2) and torch.equal(got["col"], saved["col"])
    assert torch.equal(base, torch.full((4, 6), -7.0))


# ---- xla_ckpt.load(mmap=True) ------------------------------------------------------------------

def test_xla_ckpt_load_mmap_is_bitwise_and_private(tmp_path):
    state = mixed_state()
    save_chunked(str(tmp_path / "ck"), state)
    files = {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()}
    got = xla_ckpt.load(str(tmp_path / "ck"), mmap=True)
    assert_state_identical(got, state)
    assert got["model"]["emb"].data_ptr() == got["model"]["out"].data_ptr()   # tie kept
    got["model"]["big"].mul_(-1.0)                     # copy-on-write: pages become private
    got["opt"]["m"].zero_()
    assert {p.name: p.read_bytes() for p in (tmp_path / "ck").iterdir()} == files
    assert_state_identical(xla_ckpt.load(str(tmp_path / "ck"), mmap=True), state)


def test_xla_ckpt_load_mmap_refuses_what_it_cannot_map(tmp_path, gcs_uri):
    xla_ckpt.save({"w": torch.ones(3)}, gcs_uri)
    with pytest.raises(ConfigError, match="mmap=True needs a checkpoint on a local file system"):
        xla_ckpt.load(gcs_uri, mmap=True)
    pt = str(tmp_path / "legacy.pt")
    torch.save({"w": torch.ones(3)}, pt)
    with pytest.raises(ConfigError, match=r"legacy\.pt is .*: mmap=True maps only the data files "
                                          "of a local xla_ckpt checkpoint"):
        xla_ckpt.load(pt, mmap=True)
    xla_ckpt.save({"w": torch.ones(3)}, str(tmp_path / "ck"))
    with pytest.raises(ConfigError, match="cannot be combined with keys="):
        xla_ckpt.load(str(tmp_path / "ck"), mmap=True, keys="w")
    assert torch.equal(xla_ckpt.load(gcs_uri)["w"], torch.ones(3))   # without mmap: fine
