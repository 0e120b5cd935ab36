"""Reading chunked (global) tensors of a version-2 checkpoint: whole, in place, by key, by box.

The checkpoints are written the way a sharded save writes them: every "rank" writes its
chunk tensors as an ordinary item ``chunks/<r>`` with :func:`write_items`, and one commit
adds the chunked state item and the chunk table (:func:`commit` with ``global_tensors``).
Reads go through the real reader against local folders and the GCS emulator; the bytes a
read fetched are counted by the reader and, on gs://, by the bytes the server sent.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import replace
from typing import Any, Sequence

import pytest
import torch

import xla_ckpt
from xla_ckpt.cli.main import main
from xla_ckpt.errors import (
    CheckpointCorruptError,
    ConfigError,
    IntegrityError,
    PartiallyOverwrittenError,
    StateMismatchError,
)
from xla_ckpt.format import typed
from xla_ckpt.format.chunks import Box, ChunkRecord, GlobalTensor, chunk_item, chunk_key
from xla_ckpt.format.dtypes import dtype_name
from xla_ckpt.format.manifest import STATE_ITEM, Item, Manifest, rank_item
from xla_ckpt.io import CheckpointReader, chunked
from xla_ckpt.io.chunked import BoxRequest, flat_shard_tables, plan_box_reads, read_boxes
from xla_ckpt.io.verify import verify_checkpoint
from xla_ckpt.io.writer import WrittenItem, commit, new_save_id, write_items
from xla_ckpt.kinds.partial import read_partial
from xla_ckpt.restore.sharding import partition_bounds, read_layout, shard_item, shard_state
from xla_ckpt.storage import StorageConfig, open_storage
from xla_ckpt.testing.fault_proxy import Fault, downloads


def rows(n: int, world: int) -> list[Box]:
    """torch.chunk rule along dim 0 (what DTensor Shard(0) gives), empty shards left out."""
    step = -(-n // world)
    return [Box((o,), (min(step, n - o),)) for o in range(0, n, step)]


def shard0(shape: Sequence[int], world: int) -> list[Box]:
    return [Box(b.offsets + (0,) * (len(shape) - 1), b.sizes + tuple(shape[1:]))
            for b in rows(shape[0], world)]


def grid(shape: Sequence[int], g0: int, g1: int) -> list[Box]:
    return [Box((a.offsets[0], b.offsets[0]), (a.sizes[0], b.sizes[0]))
            for a in rows(shape[0], g0) for b in rows(shape[1], g1)]


def write_chunked(uri: str, tree: Any, layout: dict[str, list[Box]], *, world: int,
                  extra: Sequence[tuple[str, Any]] = (), chunk_size_bytes: int = 4 * 2**20,
                  config: StorageConfig | None = None) -> Manifest:
    """Save ``tree`` as a sharded save would: its tensors as global tensors whose chunks
    (``layout[key]``, default one whole chunk) are written round-robin by ``world`` ranks."""
    found: list[tuple[str, torch.Tensor]] = []

    def hook(t: torch.Tensor, path: tuple) -> int:
        found.append((typed.format_path(path), t))
        return len(found) - 1

    encoded = typed.encode(tree, hook)
    st = open_storage(uri, config)
    save_id = new_save_id()
    owned: dict[int, list[tuple[int, Box]]] = {r: [] for r in range(world)}
    turn = 0
    for g, (key, t) in enumerate(found):
        for box in layout.get(key, [Box.whole(t.shape)] if t.numel() else []):
            owned[turn % world].append((g, box))
            turn += 1
    parts: list[WrittenItem] = []
    table: dict[int, list[ChunkRecord]] = {g: [] for g in range(len(found))}
    for r in range(world):
        mine = [found[g][1][box.slices()].contiguous() for g, box in owned[r]]
        items: list[tuple[str, Any]] = [(chunk_item(r), mine)] if mine else []
        items += [(n, s) for n, s in extra if r == 0]
        if not items:
            continue
        written = write_items(st, save_id, items, chunk_size_bytes=chunk_size_bytes)
        for w in written:
            if w.name == chunk_item(r):
                w.item.tensors = [replace(rec, key=chunk_key(found[g][0], box))
                                  for rec, (g, box) in zip(w.item.tensors, owned[r], strict=True)]
                for k, (g, box) in enumerate(owned[r]):
                    table[g].append(ChunkRecord(w.name, k, box.offsets, box.sizes))
        parts += written
    gts = [GlobalTensor(key, dtype_name(t.dtype), tuple(t.shape), tuple(table[g]),
                        placement=f"Shard(0) on mesh ({world},)" if key in layout else "replicated")
           for g, (key, t) in enumerate(found)]
    parts.append(WrittenItem(STATE_ITEM, Item(state=encoded, chunked=True), {}))
    try:
        return commit(st, save_id, parts, world_size=world, global_tensors=gts)
    finally:
        st.close()


def model_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(10, 6, generator=g),
                      "b": torch.randn(7, generator=g).to(torch.bfloat16),
                      "emb": torch.randint(0, 100, (13, 4, 3), generator=g),
                      "empty": torch.empty(0, 5),
                      "scalar": torch.tensor(2.5, dtype=torch.float64)},
            "step": 7, "lrs": (0.1, 0.2)}


def model_layout(world: int = 4) -> dict[str, list[Box]]:
    return {"state['model']['w']": shard0((10, 6), world),
            "state['model']['b']": rows(7, world),
            "state['model']['emb']": [Box((r.offsets[0], c.offsets[0], 0),
                                          (r.sizes[0], c.sizes[0], 3))
                                      for r in rows(13, 2) for c in rows(4, 2)]}


def assert_same(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype
        assert got.shape == want.shape and torch.equal(got, want)
        return
    if isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_same(got[k], want[k])
        return
    assert got == want and type(got) is type(want)


@pytest.fixture(params=["local", "gcs"])
def uri(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "checkpoint_1")
    return request.getfixturevalue("gcs_uri") + "/checkpoint_1"


def test_whole_load_assembles_every_global_tensor(uri):
    state = model_state()
    m = write_chunked(uri, state, model_layout(), world=4,
                      extra=[(rank_item(0), {"it": torch.arange(3)})])
    assert m.version == 2 and len(m.global_tensors) == 5
    assert [len(g.chunks) for g in m.global_tensors] == [4, 4, 4, 0, 1]
    got = xla_ckpt.load(uri)
    assert_same(got, state)
    rank0 = xla_ckpt.load(uri, item=rank_item(0))
    assert torch.equal(rank0["it"], torch.arange(3))
    # map_location: moved per global key (callable gets the key)
    seen: list[str] = []

    def where(key: str) -> str:
        seen.append(key)
        return "meta"

    moved = xla_ckpt.load(uri, map_location=where)
    assert moved["model"]["w"].device.type == "meta" and moved["model"]["w"].shape == (10, 6)
    assert "state['model']['w']" in seen


def test_load_into_fills_plain_tensors_in_place(tmp_path):
    uri = str(tmp_path / "ck")
    state = model_state()
    write_chunked(uri, state, model_layout(), world=4)
    target_w = torch.zeros(10, 6)
    target_b_t = torch.zeros(7, dtype=torch.bfloat16)
    stepped = torch.zeros(13, 4, 6, dtype=state["model"]["emb"].dtype)[..., ::2]
    assert not stepped.is_contiguous()  # gaps: filled through a checked staging copy
    transposed = torch.zeros(6, 10).t()  # any strides that fill their memory once
    reader = CheckpointReader.open(uri)
    try:
        version = target_w._version
        got = reader.load(into={"state['model']['w']": transposed,
                                "state['model']['b']": target_b_t,
                                "state['model']['emb']": stepped})
    finally:
        reader.storage.close()
    assert got["model"]["w"] is transposed and torch.equal(transposed, state["model"]["w"])
    assert got["model"]["b"] is target_b_t and torch.equal(target_b_t, state["model"]["b"])
    assert got["model"]["emb"] is stepped and torch.equal(stepped, state["model"]["emb"])
    assert target_w._version == version  # untouched: not a target
    assert transposed._version > 0


@pytest.mark.parametrize("key,target,says", [
    ("state['model']['emb']", torch.zeros(13, 4, 3, dtype=torch.int32),
     "state['model']['emb'] is int64[13, 4, 3] in the checkpoint but int32[13, 4, 3]"),
    ("state['model']['w']", torch.zeros(10, 7),
     "state['model']['w'] is float32[10, 6] in the checkpoint but float32[10, 7]"),
    ("w", torch.zeros(10, 6), "w is not a tensor of this item (keys look like state["),
])
def test_load_into_a_target_that_cannot_be_filled_raises_naming_the_key(tmp_path, key, target,
                                                                       says):
    """Never a stale target: a key the item lacks, or another dtype or shape, raises before
    anything is read, and the target keeps its values."""
    uri = str(tmp_path / "ck")
    state = model_state()
    write_chunked(uri, state, model_layout(), world=4)
    before = target.clone()
    reader = CheckpointReader.open(uri)
    try:
        with pytest.raises(StateMismatchError) as e:
            reader.load(into={key: target})
        with pytest.raises(ConfigError, match="into= or map_location="):
            reader.load(into={"state['model']['w']": torch.zeros(10, 6)}, map_location="cpu")
    finally:
        reader.storage.close()
    assert says in str(e.value) and "nothing was read" in str(e.value)
    assert torch.equal(target, before)


def test_keys_load_only_the_selected_global_tensors(uri):
    state = model_state()
    write_chunked(uri, state, model_layout(), world=4)
    reader = CheckpointReader.open(uri)
    try:
        got = read_partial(reader, ["model.w", "step"])
        one = read_partial(reader, "model.b")
    finally:
        reader.storage.close()
    assert list(got.state) == ["model", "step"] and list(got.state["model"]) == ["w"]
    assert torch.equal(got.state["model"]["w"], state["model"]["w"])
    assert got.state["step"] == 7
    assert got.bytes_read == got.selection.nbytes == 10 * 6 * 4
    assert one.bytes_read == 7 * 2 and torch.equal(one.state["model"]["b"], state["model"]["b"])
    assert_same(xla_ckpt.load(uri, keys="model.emb")["model"]["emb"], state["model"]["emb"])


def test_read_boxes_onto_another_layout_equals_slices_of_the_original(uri):
    state = model_state()
    write_chunked(uri, state, model_layout(4), world=4)
    reader = CheckpointReader.open(uri)
    try:
        m = reader.manifest
        keys = [g.key for g in m.global_tensors]
        w, emb = keys.index("state['model']['w']"), keys.index("state['model']['emb']")
        # 4 -> 3 ranks on rows, a column block, a single element, a 3-D box across chunks
        boxes = [(w, b) for b in shard0((10, 6), 3)]
        boxes += [(w, Box((2, 1), (7, 3))), (w, Box((9, 5), (1, 1))), (w, Box((0, 0), (0, 6))),
                  (emb, Box((5, 1, 1), (4, 3, 2)))]
        reqs = [BoxRequest(g, b, torch.full(b.sizes, -1, dtype=state["model"]["w"].dtype
                                            if g == w else torch.int64)) for g, b in boxes]
        n = reader.read_boxes(reqs)
    finally:
        reader.storage.close()
    for (g, b), r in zip(boxes, reqs, strict=True):
        src = state["model"]["w"] if g == w else state["model"]["emb"]
        assert torch.equal(r.out, src[b.slices()]), b
    planned = plan_box_reads(m, reqs)
    assert n == reader.stats.bytes_read == sum(r.length for r in planned)
    # each saved chunk the boxes touch is read once, however many boxes need it
    assert len({(r.item, r.blob) for r in planned}) == len(planned)


def test_a_row_overlap_fetches_only_those_rows_not_the_whole_chunk(tmp_path, gcs_uri,
                                                                   fault_proxy):
    # One saved chunk of 1024 rows x 1 KiB (1 MiB), crc32c chunks of 4 KiB (4 rows).
    t = torch.arange(1024 * 256, dtype=torch.float32).reshape(1024, 256)
    local, remote = str(tmp_path / "ck"), gcs_uri + "/ck"
    for where in (local, remote):
        write_chunked(where, {"w": t}, {}, world=1, chunk_size_bytes=4096)
    box = Box((100, 0), (10, 256))  # rows 100-109: crc chunks of rows 100-111
    reader = CheckpointReader.open(local)
    try:
        out = torch.zeros(10, 256)
        plan = plan_box_reads(reader.manifest, [BoxRequest(0, box, out)])
        n = read_boxes(reader, [BoxRequest(0, box, out)])
    finally:
        reader.storage.close()
    assert torch.equal(out, t[100:110])
    assert [(r.start, r.length) for r in plan] == [(100 * 1024, 12 * 1024)]
    assert n == 12 * 1024 < t.numel() * 4 // 64
    # a column sub-box of one row block: rows 100-109 are still the smallest run holding it;
    # on gs:// the server sends just those bytes
    with fault_proxy.storage(remote) as st:
        reader = CheckpointReader(st)
        fault_proxy.reset_log()
        out2 = torch.zeros(10, 3)
        n2 = reader.read_boxes([BoxRequest(0, Box((100, 7), (10, 3)), out2)])
    served = sum(r.body_bytes for r in fault_proxy.records(downloads("data-")))
    assert torch.equal(out2, t[100:110, 7:10])
    assert served == n2 == 12 * 1024


def test_large_range_is_read_in_parallel_slices(tmp_path):
    t = torch.arange(3 * 2**20, dtype=torch.int32).reshape(3 * 1024, 1024)  # 12 MiB
    uri = str(tmp_path / "ck")
    cfg = StorageConfig(slice_size_bytes=2**20, max_workers=4)
    write_chunked(uri, {"w": t}, {"state['w']": shard0(t.shape, 2)}, world=2,
                  chunk_size_bytes=2**18)
    reader = CheckpointReader(open_storage(uri, cfg))
    try:
        out = torch.empty(3 * 1024, 1024, dtype=torch.int32)
        n = reader.read_boxes([BoxRequest(0, Box.whole(t.shape), out)])
        part = torch.empty(1000, 1024, dtype=torch.int32)
        n2 = reader.read_boxes([BoxRequest(0, Box((1024, 0), (1000, 1024)), part)])
    finally:
        reader.storage.close()
    assert torch.equal(out, t) and n == t.numel() * 4 and reader.stats.requests > 1
    assert torch.equal(part, t[1024:2024])
    assert n2 == math.ceil(1000 * 4096 / 2**18) * 2**18


def _flip(uri: str, name: str, offset: int) -> None:
    """Flip one bit of data file ``name`` at ``offset`` in place (any backend)."""
    st = open_storage(uri)
    try:
        data = bytearray(st.read_bytes(name))
        data[offset] ^= 0x40
        st.write_atomic(name, [bytes(data)])
    finally:
        st.close()


def test_flipped_byte_in_a_chunk_is_an_integrity_error_naming_the_key(uri):
    state = model_state()
    m = write_chunked(uri, state, model_layout(), world=4)
    g = next(i for i, t in enumerate(m.global_tensors) if t.key == "state['model']['w']")
    c = m.global_tensors[g].chunks[2]  # rows 6-8
    it = m.items[c.item]
    blob = it.blobs[it.tensors[c.tensor].blob]
    _flip(uri, blob.file, blob.offset + 5)
    with pytest.raises(IntegrityError, match=r"state\['model'\]\['w'\]") as err:
        xla_ckpt.load(uri)
    assert err.value.key == "state['model']['w']"
    assert "state['model']['w'][6:9,0:6]" in str(err.value)
    reader = CheckpointReader.open(uri)
    try:
        # boxes that do not touch the bad chunk still read
        out = torch.zeros(3, 6)
        reader.read_boxes([BoxRequest(g, Box((0, 0), (3, 6)), out)])
        assert torch.equal(out, state["model"]["w"][:3])
        bad = torch.zeros(2, 6)
        with pytest.raises(IntegrityError, match="crc32c mismatch"):
            reader.read_boxes([BoxRequest(g, Box((7, 0), (2, 6)), bad)])
        assert torch.equal(bad, torch.zeros(2, 6))  # nothing unchecked landed
        assert reader.stats.crc_retries == reader.crc_retries
    finally:
        reader.storage.close()
    report = verify_checkpoint(open_storage(uri))
    assert not report.ok and report.bad_keys == [f"{c.item}:state['model']['w'][6:9,0:6]"]


def test_requests_that_do_not_fit_are_refused(tmp_path):
    uri = str(tmp_path / "ck")
    write_chunked(uri, {"w": torch.ones(4, 4)}, {}, world=1)
    reader = CheckpointReader.open(uri)
    try:
        with pytest.raises(CheckpointCorruptError, match=r"state\['w'\].*not covered"):
            reader.read_boxes([BoxRequest(0, Box((2, 0), (3, 4)), torch.zeros(3, 4))])
        with pytest.raises(ValueError, match="out must be a strided CPU float32"):
            reader.read_boxes([BoxRequest(0, Box((0, 0), (2, 4)), torch.zeros(2, 4,
                                                                             dtype=torch.int32))])
        with pytest.raises(ValueError, match="global tensor 3"):
            reader.read_boxes([BoxRequest(3, Box((0, 0), (2, 4)), torch.zeros(2, 4))])
    finally:
        reader.storage.close()


def test_a_file_destination_gets_only_checked_bytes_at_its_offsets(tmp_path):
    """``BoxRequest.file``: how one reader fills host shared memory (a memfd) with pwrite."""
    import os

    from xla_ckpt.restore.blobs import blob_tensors
    from xla_ckpt.restore.targets import read_requests

    g = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(1_500_000, generator=g),  # 6 MB: two crc32c chunks
             "small": [torch.randn(n, generator=g) for n in (1, 7, 300)],
             "empty": torch.empty(0), "step": 4}
    uri = str(tmp_path / "ck")
    xla_ckpt.save(state, uri)
    m = CheckpointReader.open(uri).manifest
    saved = blob_tensors(m, STATE_ITEM)
    sizes = [gt.shape[0] for gt in saved.globals]
    assert max(sizes) > 4 * 2**20
    base = 4096  # the data starts past a header, as in a host-memory segment
    at = [base + sum(sizes[:b]) + 64 * b for b in range(len(sizes))]

    def read(fd: int) -> None:
        reader = CheckpointReader(open_storage(uri), saved.manifest)
        try:
            read_requests(reader, saved, [
                BoxRequest(b, Box((0,), (n,)), torch.empty(n, dtype=torch.uint8), fresh=True,
                           file=(fd, at[b])) for b, n in enumerate(sizes)])
        finally:
            reader.storage.close()

    fd = os.memfd_create("xla_ckpt-test")
    try:
        os.ftruncate(fd, at[-1] + sizes[-1])
        read(fd)
        outs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        reader = CheckpointReader(open_storage(uri), saved.manifest)
        read_requests(reader, saved, [BoxRequest(b, Box((0,), (n,)), o, fresh=True)
                                      for b, (n, o) in enumerate(zip(sizes, outs, strict=True))])
        reader.storage.close()
        for b, n in enumerate(sizes):  # the same bytes as read into tensors, where asked
            assert os.pread(fd, n, at[b]) == outs[b].numpy().tobytes(), b
        assert os.pread(fd, 4096, 0) == bytes(4096)  # nothing outside the offsets
    finally:
        os.close(fd)
    big = max(range(len(sizes)), key=lambda b: sizes[b])
    blob = m.item(STATE_ITEM).blobs[big]
    _flip(uri, blob.file, blob.offset + 4 * 2**20 + 9)  # the big blob's second crc32c chunk
    fd = os.memfd_create("xla_ckpt-test")
    try:
        os.ftruncate(fd, at[-1] + sizes[-1])
        with pytest.raises(IntegrityError, match="crc32c mismatch"):
            read(fd)
        second = os.pread(fd, sizes[big] - 4 * 2**20, at[big] + 4 * 2**20)
        assert second == bytes(len(second))  # no unchecked byte reached the file
    finally:
        os.close(fd)
    plain = str(tmp_path / "plain")
    write_chunked(plain, {"w": torch.ones(4, 4)}, {}, world=1)
    reader = CheckpointReader.open(plain)
    try:
        with pytest.raises(ValueError, match=r"state\['w'\]: a file destination takes a 1-D "
                                             r"uint8 box \(a blob\), got torch.float32\[2, 4\]"):
            reader.read_boxes([BoxRequest(0, Box((0, 0), (2, 4)), torch.zeros(2, 4),
                                          file=(0, 0))])
    finally:
        reader.storage.close()


def test_inspect_and_verify_show_a_v2_checkpoint(tmp_path, capsys):
    uri = str(tmp_path / "ck")
    write_chunked(uri, model_state(), model_layout(), world=4)
    assert verify_checkpoint(open_storage(uri)).ok
    assert main(["inspect", uri]) == 0
    out = capsys.readouterr().out
    assert "global      5 tensors in 13 chunks (manifest version 2)" in out
    assert "      w  float32[10, 6]  240 B  (4 chunks, Shard(0) on mesh (4,))" in out
    assert "      scalar  float64[]  8 B  (1 chunk, replicated)" in out
    assert "chunk items: 4 (chunks/00000 .. chunks/00003), 13 chunk tensors" in out
    assert main(["inspect", "--json", uri]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["version"] == 2
    assert doc["global_tensors"][0] == {
        "key": "state['model']['w']", "dtype": "float32", "shape": [10, 6], "nbytes": 240,
        "chunks": 4, "placement": "Shard(0) on mesh (4,)",
        "chunk_items": ["chunks/00000", "chunks/00001", "chunks/00002", "chunks/00003"]}
    assert doc["items"]["state"]["chunked"] is True
    assert doc["summary"]["all_tensors"]["nbytes"] == 240 + 14 + 13 * 4 * 3 * 8 + 8


def test_zero_flat_partitions_are_described_as_1d_global_tensors(tmp_path):
    """C9's flat tensor of 10 elements saved as 4 uneven shards: the chunk table lets any
    element range (a new world size's partition) be read by byte range."""
    uri = str(tmp_path / "ck")
    flat = {"exp_avg": torch.arange(10, dtype=torch.float32),
            "step": torch.arange(3, dtype=torch.int64)}
    st = open_storage(uri)
    try:
        save_id = new_save_id()
        parts = write_items(st, save_id, [(STATE_ITEM, {"lr": 0.1})])
        for r in range(4):
            bounds = {k: partition_bounds(v.numel(), 4)[r] for k, v in flat.items()}
            shards = {k: v[bounds[k][0]:bounds[k][1]].clone() for k, v in flat.items()}
            parts += write_items(st, save_id, [(shard_item(r), shard_state(
                shards, bounds, {k: v.numel() for k, v in flat.items()}))])
        tables = flat_shard_tables(parts)
        m = commit(st, save_id, parts, world_size=4, global_tensors=tables)
    finally:
        st.close()
    assert [(g.key, g.shape, [c.offsets for c in g.chunks]) for g in m.global_tensors] == [
        ("shard/exp_avg", (10,), [(0,), (3,), (6,), (8,)]),
        ("shard/step", (3,), [(0,), (1,), (2,)])]  # rank 3's empty range is not a chunk
    assert m.version == 2 and read_layout(m)["exp_avg"].numel == 10  # shard items unchanged
    assert xla_ckpt.load(uri) == {"lr": 0.1}
    reader = CheckpointReader.open(uri)
    try:
        for world in (1, 2, 3, 8):
            for lo, hi in partition_bounds(10, world):
                out = torch.full((hi - lo,), -1.0)
                reader.read_boxes([BoxRequest(0, Box((lo,), (hi - lo,)), out)])
                assert torch.equal(out, flat["exp_avg"][lo:hi])
    finally:
        reader.storage.close()


def test_rows_go_straight_into_a_contiguous_out_and_only_partial_crc_chunks_are_staged(
        tmp_path, monkeypatch):
    """Rows 5-100 of a chunk of 128 rows of 1 KiB, crc32c chunks of 4 KiB (4 rows): rows 8-99
    are whole crc chunks read into ``out`` in place; rows 5-7 and 100 come through staging."""
    t = torch.arange(128 * 256, dtype=torch.float32).reshape(128, 256)
    uri = str(tmp_path / "ck")
    write_chunked(uri, {"w": t}, {}, world=1, chunk_size_bytes=4096)
    staged: list[int] = []
    real = chunked._copy_out

    def spy(requests: Any, seg: Any, buf: torch.Tensor) -> None:
        staged.append(seg.length)
        real(requests, seg, buf)

    monkeypatch.setattr(chunked, "_copy_out", spy)
    reader = CheckpointReader.open(uri)
    try:
        out = torch.zeros(96, 256)
        n = reader.read_boxes([BoxRequest(0, Box((5, 0), (96, 256)), out)])
    finally:
        reader.storage.close()
    assert torch.equal(out, t[5:101])
    assert n == (104 - 4) * 1024  # crc chunks of rows 4-103
    assert sorted(staged) == [4096, 4096]  # rows 4-7 and 100-103 only


def test_a_bad_crc_in_bytes_read_in_place_names_the_overwritten_target(tmp_path):
    t = torch.arange(64 * 256, dtype=torch.float32).reshape(64, 256)  # 64 KiB, one chunk
    uri = str(tmp_path / "ck")
    m = write_chunked(uri, {"w": t}, {}, world=1, chunk_size_bytes=4096)
    it = m.items[chunk_item(0)]
    blob = it.blobs[it.tensors[0].blob]
    _flip(uri, blob.file, blob.offset + 40 * 1024 + 3)
    reader = CheckpointReader.open(uri)
    try:
        live = torch.zeros(64, 256)
        with pytest.raises(PartiallyOverwrittenError, match="partially overwritten") as err:
            reader.read_boxes([BoxRequest(0, Box.whole((64, 256)), live)])
        assert err.value.keys == ("state['w']",)
    finally:
        reader.storage.close()
    # a tensor being assembled by load() is nobody's yet: a plain integrity error
    with pytest.raises(IntegrityError) as plain:
        xla_ckpt.load(uri)
    assert not isinstance(plain.value, PartiallyOverwrittenError)
    assert plain.value.key == "state['w']"


def test_boxes_of_several_targets_in_one_saved_chunk_each_go_in_place(tmp_path, monkeypatch):
    """What the reading rank of the broadcast strategy does: rows 0-63 and 64-127 of one saved
    chunk for two ranks' shards; each run is whole crc32c chunks, so nothing is staged."""
    t = torch.arange(128 * 256, dtype=torch.float32).reshape(128, 256)
    uri = str(tmp_path / "ck")
    write_chunked(uri, {"w": t}, {}, world=1, chunk_size_bytes=4096)
    staged: list[int] = []
    monkeypatch.setattr(chunked, "_copy_out", lambda r, seg, buf: staged.append(seg.length))
    reader = CheckpointReader.open(uri)
    try:
        a, b = torch.zeros(64, 256), torch.zeros(64, 256)
        n = reader.read_boxes([BoxRequest(0, Box((0, 0), (64, 256)), a),
                               BoxRequest(0, Box((64, 0), (64, 256)), b)])
    finally:
        reader.storage.close()
    assert torch.equal(a, t[:64]) and torch.equal(b, t[64:]) and n == t.numel() * 4
    assert staged == []


@pytest.mark.parametrize("n_rows", [3, 130], ids=["blob-shorter-than-a-crc-chunk",
                                                    "short-final-crc-chunk"])
def test_a_range_ending_in_the_blobs_short_final_crc_chunk_goes_in_place(tmp_path, monkeypatch,
                                                                          n_rows):
    """A saved chunk whose blob ends in a short crc32c chunk (3 rows of 1 KiB: the whole blob
    is one 3 KiB chunk under 4 KiB crc32c chunks, checked by the blob's crc32c; 130 rows:
    32 whole chunks and a 2 KiB one) restored into a contiguous target of the same rows:
    read straight into the target, no staging buffer, exactly the blob's bytes fetched."""
    t = torch.arange(n_rows * 256, dtype=torch.float32).reshape(n_rows, 256)
    uri = str(tmp_path / "ck")
    m = write_chunked(uri, {"w": t}, {}, world=1, chunk_size_bytes=4096)
    it = m.items[chunk_item(0)]
    blob = it.blobs[it.tensors[0].blob]
    assert blob.length == n_rows * 1024 and bool(blob.chunk_crc32c) == (n_rows > 4)
    staged: list[int] = []
    monkeypatch.setattr(chunked, "_copy_out", lambda r, seg, buf: staged.append(seg.length))
    takes: list[int] = []
    real_take = chunked._Staging.take

    def take(self: Any, n: int) -> torch.Tensor:
        takes.append(n)
        return real_take(self, n)

    monkeypatch.setattr(chunked._Staging, "take", take)
    live = torch.zeros(n_rows, 256)
    ptr = live.data_ptr()
    reader = CheckpointReader.open(uri)
    try:
        n = reader.read_boxes([BoxRequest(0, Box.whole((n_rows, 256)), live)])
    finally:
        reader.storage.close()
    assert torch.equal(live, t) and live.data_ptr() == ptr
    assert n == blob.length == reader.stats.bytes_read
    assert staged == [] and takes == []
    # the short chunk is still checked: a flipped byte in it, in place, names the target
    _flip(uri, blob.file, blob.offset + blob.length - 5)
    reader = CheckpointReader.open(uri)
    try:
        live.zero_()
        with pytest.raises(PartiallyOverwrittenError, match="partially overwritten") as err:
            reader.read_boxes([BoxRequest(0, Box.whole((n_rows, 256)), live)])
        assert err.value.keys == ("state['w']",) and reader.stats.crc_retries == 2
    finally:
        reader.storage.close()
    assert takes == []


@pytest.mark.parametrize("rows", [(0, 128), (5, 96)], ids=["in-place", "staged-ends"])
def test_bytes_flipped_in_transit_are_read_again_and_the_values_are_right(gcs_uri, fault_proxy,
                                                                         rows):
    t = torch.arange(128 * 256, dtype=torch.float32).reshape(128, 256)
    uri = gcs_uri + "/ck"
    write_chunked(uri, {"w": t}, {}, world=1, chunk_size_bytes=4096)
    lo, n = rows
    with fault_proxy.storage(uri) as st:
        reader = CheckpointReader(st)
        fault_proxy.inject(Fault.flip(), match=downloads("data-"), times=1)
        out = torch.zeros(n, 256)
        reader.read_boxes([BoxRequest(0, Box((lo, 0), (n, 256)), out)])
    assert torch.equal(out, t[lo:lo + n])
    assert reader.stats.crc_retries == 1 and fault_proxy.pending_faults() == 0


@pytest.mark.parametrize("seed", range(4))
def test_random_boxes_over_random_layouts_equal_slices_of_the_original(tmp_path, monkeypatch,
                                                                       seed):
    """Tiny crc32c chunks and staging slices, so reads cut rows at arbitrary elements: every
    way a box, a saved chunk and a slice can meet, against plain slicing."""
    rng = random.Random(seed)
    monkeypatch.setattr(chunked, "STAGING_SLICE_BYTES", 48)
    shape = tuple(rng.randint(1, 9) for _ in range(rng.choice([1, 2, 3])))
    dtype = rng.choice([torch.float64, torch.int16, torch.bfloat16])
    t = torch.arange(math.prod(shape)).reshape(shape).to(dtype)
    cuts = [sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 2)))) if n > 1 else []
            for n in shape]
    axes = [list(zip([0, *c], [*c, n], strict=True)) for c, n in zip(cuts, shape, strict=True)]
    layout = [Box(tuple(a for a, _ in cell), tuple(b - a for a, b in cell))
              for cell in itertools.product(*axes)]
    uri = str(tmp_path / "ck")
    write_chunked(uri, {"t": t}, {"state['t']": layout}, world=3, chunk_size_bytes=16,
                  config=StorageConfig(slice_size_bytes=64))
    reader = CheckpointReader(open_storage(uri, StorageConfig(slice_size_bytes=64)))
    try:
        for _ in range(12):
            lo = tuple(rng.randint(0, n - 1) for n in shape)
            box = Box(lo, tuple(rng.randint(1, n - o) for o, n in zip(lo, shape, strict=True)))
            out = torch.zeros(box.sizes, dtype=dtype)
            if rng.random() < 0.3:  # a strided view into a larger tensor
                out = torch.zeros(tuple(s + 1 for s in box.sizes), dtype=dtype)[
                    tuple(slice(1, None) for _ in box.sizes)]
            reader.read_boxes([BoxRequest(0, box, out)])
            assert torch.equal(out, t[box.slices()]), (shape, layout, box)
    finally:
        reader.storage.close()
