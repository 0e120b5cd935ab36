"""Manifest version 2 (chunked tensors): round trip, version 1 unchanged, hostile chunk tables.

Each hostile case edits a valid chunk table the way a broken tool or an attacker would and
checks that parsing refuses it with ``CheckpointCorruptError`` naming the manifest, the
global tensor's key and what is wrong -- before anything is sized from the table, with
work and memory bounded by the table's length, never by the elements it claims.
"""

from __future__ import annotations

import copy
import itertools
import json
import random
from typing import Any

import pytest
import torch

import xla_ckpt
from xla_ckpt.errors import CheckpointCorruptError
from xla_ckpt.format import manifest as manifest_mod
from xla_ckpt.format import typed
from xla_ckpt.format.chunks import (
    MAX_CHUNKS_PER_TENSOR,
    Box,
    ChunkRecord,
    GlobalTensor,
    LayoutTooIrregularError,
    chunk_item,
    chunk_key,
    first_overlap,
    intersect,
)
from xla_ckpt.format.manifest import (
    CRC_FIELD,
    MANIFEST_NAME,
    Item,
    Manifest,
    TensorRecord,
    seal,
)
from xla_ckpt.io.writer import WrittenItem, commit, new_save_id, write_items
from xla_ckpt.storage import open_storage

W_ROWS = [(0, 3), (3, 3), (6, 3), (9, 1)]  # torch.chunk of 10 rows over 4 ranks


def v2_doc() -> dict[str, Any]:
    """A valid version-2 manifest: global float32[10, 6] in 4 row chunks, one per rank, plus a
    replicated scalar written by rank 0, and a chunked state item referring to both."""
    files: dict[str, int] = {}
    items: dict[str, Any] = {}
    chunks = []
    for r, (o, n) in enumerate(W_ROWS):
        name = f"data-abc-chunks-{r:05d}.safetensors"
        recs: list[dict[str, Any]] = [{"key": f"state['w'][{o}:{o + n},0:6]", "blob": 0,
                                       "byte_offset": 0, "dtype": "float32", "shape": [n, 6],
                                       "stride": [6, 1]}]
        blobs: list[dict[str, Any]] = [{"file": name, "offset": 64, "length": n * 24,
                                        "crc32c": 1, "chunk_size": 4096}]
        if r == 0:
            recs.append({"key": "state['step'][]", "blob": 1, "byte_offset": 0,
                         "dtype": "int64", "shape": [], "stride": []})
            blobs.append({"file": name, "offset": 64 + n * 24, "length": 8, "crc32c": 2,
                          "chunk_size": 4096})
        files[name] = 64 + sum(b["length"] for b in blobs)
        items[chunk_item(r)] = {"state": [{"$tensor": i} for i in range(len(recs))],
                                "tensors": recs, "blobs": blobs}
        chunks.append({"item": chunk_item(r), "tensor": 0, "offsets": [o, 0], "sizes": [n, 6]})
    items["state"] = {"state": {"w": {"$tensor": 0}, "step": {"$tensor": 1}, "lr": 0.5},
                      "tensors": [], "blobs": [], "chunked": True}
    return {"format": "xla_ckpt", "version": 2, "save_id": "abc", "created_unix_s": 1.0,
            "world_size": 4, "metadata": None, "files": files,
            "global_tensors": [
                {"key": "state['w']", "dtype": "float32", "shape": [10, 6], "chunks": chunks,
                 "placement": "Shard(0) on mesh (4,)"},
                {"key": "state['step']", "dtype": "int64", "shape": [],
                 "chunks": [{"item": chunk_item(0), "tensor": 1, "offsets": [], "sizes": []}],
                 "placement": "replicated"}],
            "items": items}


def parse(doc: dict) -> Manifest:
    return Manifest.from_json_bytes(seal(json.dumps(doc).encode()), where="m.json",
                                    require_crc=True)


def refused(doc: dict, *match: str) -> str:
    with pytest.raises(CheckpointCorruptError) as err:
        parse(doc)
    text = str(err.value)
    assert text.startswith("m.json"), text
    for m in match:
        assert m in text, text
    return text


def w_chunks(doc: dict) -> list[dict]:
    return doc["global_tensors"][0]["chunks"]


# ---- round trip, version 1 unchanged -------------------------------------------------------


def test_v2_round_trip_keeps_the_chunk_table_and_the_chunked_item():
    m = parse(v2_doc())
    assert m.version == 2 and m.written_version == 2
    w, step = m.global_tensors
    assert w == GlobalTensor("state['w']", "float32", (10, 6), tuple(
        ChunkRecord(chunk_item(r), 0, (o, 0), (n, 6)) for r, (o, n) in enumerate(W_ROWS)),
        placement="Shard(0) on mesh (4,)")
    assert step.shape == () and step.chunks == (ChunkRecord(chunk_item(0), 1, (), ()),)
    assert m.items["state"].chunked and not m.items[chunk_item(0)].chunked
    again = Manifest.from_json_bytes(m.to_json_bytes(), require_crc=True)
    assert again.global_tensors == m.global_tensors
    assert again.to_json_bytes() == m.to_json_bytes()
    doc = json.loads(m.to_json_bytes())
    assert doc["version"] == 2 and list(doc)[:8] == [
        "format", "version", "save_id", "created_unix_s", "world_size", "metadata", "files",
        "global_tensors"]
    assert doc["items"]["state"]["chunked"] is True
    assert "chunked" not in doc["items"]["chunks/00000"]


def _v1_bytes_as_before(m: Manifest) -> bytes:
    """What to_json_bytes wrote before version 2 existed (the schema of version 1)."""
    doc = {"format": "xla_ckpt", "version": 1, "save_id": m.save_id,
           "created_unix_s": m.created_unix_s, "world_size": m.world_size,
           "metadata": m.metadata, "files": m.files,
           "items": {k: {"state": v.state, "tensors": [t.to_json() for t in v.tensors],
                         "blobs": [b.to_json() for b in v.blobs]} for k, v in m.items.items()}}
    return seal(json.dumps(doc, ensure_ascii=False, allow_nan=False,
                           separators=(",", ":")).encode("utf-8"))


def test_a_checkpoint_without_global_tensors_stays_version_1_byte_for_byte(tmp_path):
    uri = str(tmp_path / "ck")
    m = xla_ckpt.save({"w": torch.ones(3), "n": 2}, uri, rank_states={1: {"it": 5}},
                      metadata={"step": 3})
    data = (tmp_path / "ck" / MANIFEST_NAME).read_bytes()
    assert data == _v1_bytes_as_before(m) == m.to_json_bytes()
    doc = json.loads(data)
    assert doc["version"] == 1 and "global_tensors" not in doc
    assert all("chunked" not in it for it in doc["items"].values())
    parsed = Manifest.from_json_bytes(data, require_crc=True)
    assert parsed.version == 1 and parsed.global_tensors == []
    assert parsed.to_json_bytes() == data


def test_commit_writes_version_2_only_with_global_tensors_and_refuses_a_bad_table(tmp_path):
    st = open_storage(str(tmp_path / "ck"))
    try:
        save_id = new_save_id()
        t = torch.arange(12.0).reshape(4, 3)
        parts = write_items(st, save_id, [(chunk_item(0), [t[:2].contiguous()])])
        parts += write_items(st, save_id, [(chunk_item(1), [t[2:].contiguous()])])
        for p, box in zip(parts, [Box((0, 0), (2, 3)), Box((2, 0), (2, 3))], strict=True):
            p.item.tensors[0] = TensorRecord(chunk_key("state['t']", box), 0, 0, "float32",
                                             box.sizes, (3, 1))
        state = WrittenItem("state", Item(state={"t": {"$tensor": 0}}, chunked=True), {})
        table = [GlobalTensor("state['t']", "float32", (4, 3),
                              (ChunkRecord(chunk_item(0), 0, (0, 0), (2, 3)),
                               ChunkRecord(chunk_item(1), 0, (1, 0), (2, 3))))]  # overlap
        with pytest.raises(ValueError, match=r"not committed.*state\['t'\].*overlap"):
            commit(st, save_id, [*parts, state], global_tensors=table)
        assert not (tmp_path / "ck" / MANIFEST_NAME).exists()
        good = [GlobalTensor("state['t']", "float32", (4, 3),
                             (ChunkRecord(chunk_item(0), 0, (0, 0), (2, 3)),
                              ChunkRecord(chunk_item(1), 0, (2, 0), (2, 3))))]
        dangling = WrittenItem("state", Item(state={"t": {"$tensor": 1}}, chunked=True), {})
        with pytest.raises(ValueError, match="refers to global tensor 1 but only 1 exist"):
            commit(st, save_id, [*parts, dangling], global_tensors=good)
        m = commit(st, save_id, [*parts, state], global_tensors=good)
    finally:
        st.close()
    assert m.version == 2 and m.global_tensors == good
    assert json.loads((tmp_path / "ck" / MANIFEST_NAME).read_bytes())["version"] == 2
    got = xla_ckpt.load(str(tmp_path / "ck"))
    assert torch.equal(got["t"], t)


# ---- hostile chunk tables ------------------------------------------------------------------


def test_overlapping_chunks_are_refused_naming_the_key():
    doc = v2_doc()
    w_chunks(doc)[1]["offsets"] = [2, 0]  # rows 2-4 overlap rows 0-2; the volume still adds up
    doc2 = v2_doc()
    refused(doc, "global tensor 0 (state['w'])", "overlap")
    # the same overlap with the sum of volumes right: rows 9 and 8-9 -> row 8 left out
    w_chunks(doc2)[2]["offsets"], w_chunks(doc2)[3]["offsets"] = [5, 0], [8, 0]
    refused(doc2, "state['w']", "chunks 1 (offsets [3, 0], sizes [3, 6]) and 2", "overlap")


def test_a_gap_is_refused():
    doc = v2_doc()
    del w_chunks(doc)[2]
    refused(doc, "state['w']", "chunks hold 42 elements of a tensor of 60", "gap")


def test_chunks_out_of_bounds_empty_or_malformed_are_refused():
    cases: list[tuple[Any, Any, str]] = [
        ([9, 0], [3, 6], "lies outside the tensor's shape [10, 6] (dim 0)"),
        ([-1, 0], [3, 6], "lies outside"),
        ([0, 0], [0, 6], "is empty or lies outside"),
        ([0.0, 0], [3, 6], "is empty or lies outside"),
        ([True, 0], [3, 6], "is empty or lies outside"),
        ([0], [3, 6], "offsets and sizes must be lists of 2 integers"),
        ("0,0", [3, 6], "offsets and sizes must be lists"),
    ]
    for offsets, sizes, msg in cases:
        doc = v2_doc()
        w_chunks(doc)[0].update(offsets=offsets, sizes=sizes)
        refused(doc, "global tensor 0 (state['w']) chunk 0", msg)


def test_a_chunk_must_point_at_a_matching_record():
    def edit(fn: Any, *msg: str) -> None:
        doc = v2_doc()
        fn(doc)
        refused(doc, "state['w']", *msg)

    edit(lambda d: w_chunks(d)[0].update(item="chunks/00099"), "not a (non-chunked) item")
    edit(lambda d: w_chunks(d)[0].update(item="state"), "not a (non-chunked) item")
    edit(lambda d: w_chunks(d)[0].update(tensor=5), "tensor 5 is not a record", "(2 records)")
    edit(lambda d: w_chunks(d)[0].update(tensor=-1), "tensor -1 is not a record")
    edit(lambda d: d["global_tensors"][0].update(dtype="int32"),
         "is not a C-contiguous int32[3, 6] tensor")
    # a record of another shape than the chunk's sizes
    edit(lambda d: d["items"]["chunks/00001"]["tensors"][0].update(shape=[2, 6], stride=[6, 1]),
         "record 0 of item 'chunks/00001'", "not a C-contiguous float32[3, 6]")
    # a transposed record: shape right, strides not C-contiguous (its bytes fit the blob)
    edit(lambda d: d["items"]["chunks/00001"]["tensors"][0].update(stride=[1, 3]),
         "stride [1, 3]", "not a C-contiguous")


def test_size_one_dims_may_have_any_stride_as_in_torch():
    doc = v2_doc()
    doc["items"]["chunks/00003"]["tensors"][0]["stride"] = [1, 1]  # shape [1, 6]: row stride free
    assert parse(doc).global_tensors[0].chunks[3].sizes == (1, 6)
    assert torch.empty(6)[None].stride() == (6, 1) and torch.empty(6).view(1, 6).is_contiguous()


def test_chunked_items_and_versions_are_checked():
    doc = v2_doc()
    doc["items"]["state"]["state"]["extra"] = {"$tensor": 2}
    refused(doc, "chunked item 'state'", "refers to global tensor 2 but only 2 exist")
    doc = v2_doc()
    doc["items"]["state"]["tensors"] = doc["items"]["chunks/00000"]["tensors"]
    refused(doc, "chunked item 'state' has tensors/blobs of its own")
    doc = v2_doc()
    doc["items"]["state"]["chunked"] = "yes"
    refused(doc, "'chunked' must be true or false")
    doc = v2_doc()
    doc["version"] = 1
    refused(doc, "needs manifest version 2 (this one says 1)")
    doc = v2_doc()
    doc["version"] = 1
    del doc["items"]["state"]
    refused(doc, "'global_tensors' needs manifest version 2")
    doc = v2_doc()
    doc["version"] = 3
    refused(doc, "manifest version 3 is not supported", "reads versions 1, 2")
    doc = v2_doc()
    doc["global_tensors"].append(copy.deepcopy(doc["global_tensors"][0]))
    refused(doc, "global tensor 2: duplicate key state['w']")


def test_absurd_shapes_and_degenerate_tensors_are_refused():
    doc = v2_doc()
    doc["global_tensors"][0]["shape"] = [2**40, 2**40]
    refused(doc, "state['w']", "exceeds what a tensor can address")
    doc = v2_doc()
    doc["global_tensors"][0]["shape"] = [1] * 65
    refused(doc, "shape must be a list of at most 64")
    doc = v2_doc()
    doc["global_tensors"][1]["chunks"].append(dict(doc["global_tensors"][1]["chunks"][0]))
    refused(doc, "state['step']", "chunks hold 2 elements of a tensor of 1", "overlap")
    doc = v2_doc()  # a tensor with no elements has no chunks
    doc["global_tensors"][0]["shape"] = [0, 6]
    refused(doc, "state['w']", "lies outside the tensor's shape [0, 6]")
    doc = v2_doc()
    doc["global_tensors"][0].update(shape=[0, 6], chunks=[])
    assert parse(doc).global_tensors[0].numel == 0


def test_ten_million_chunks_are_refused_before_they_are_looked_at(monkeypatch):
    doc = v2_doc()
    marker = "__CHUNKS__"
    doc["global_tensors"][0]["chunks"] = marker
    text = json.dumps(doc).replace(json.dumps(marker), "[" + ",".join(["0"] * 10**7) + "]")
    data = seal(text.encode())
    assert len(data) < manifest_mod.MAX_MANIFEST_BYTES  # the JSON itself is within bounds
    looked: list[Any] = []
    real = manifest_mod._chunk
    def spy(c: Any, *a: Any) -> Any:
        looked.append(c)
        return real(c, *a)

    monkeypatch.setattr(manifest_mod, "_chunk", spy)
    with pytest.raises(CheckpointCorruptError,
                       match=rf"state\['w'\]\): 10000000 chunks, more than the "
                             rf"{MAX_CHUNKS_PER_TENSOR}"):
        Manifest.from_json_bytes(data, where="m.json")
    assert looked == []  # refused on the count: no chunk was checked, nothing built per chunk
    monkeypatch.setattr(manifest_mod, "_chunk", real)
    assert len(parse(v2_doc()).global_tensors) == 2


def test_the_entry_budget_counts_chunks(monkeypatch):
    monkeypatch.setattr(manifest_mod, "MAX_ENTRIES", 12)
    refused(v2_doc(), "more than 12 entries")  # 12 records+blobs, then 2 tensors, 5 chunks
    monkeypatch.setattr(manifest_mod, "MAX_ENTRIES", 20)
    assert len(parse(v2_doc()).global_tensors) == 2


def test_a_real_checkpoint_with_a_tampered_table_does_not_load(tmp_path):
    st = open_storage(str(tmp_path / "ck"))
    try:
        save_id = new_save_id()
        parts = write_items(st, save_id, [(chunk_item(0), [torch.ones(2, 2)])])
        parts[0].item.tensors[0] = TensorRecord("state['t'][0:2,0:2]", 0, 0, "float32", (2, 2),
                                                (2, 1))
        state = WrittenItem("state", Item(state={"t": {"$tensor": 0}}, chunked=True), {})
        commit(st, save_id, [*parts, state], global_tensors=[GlobalTensor(
            "state['t']", "float32", (2, 2), (ChunkRecord(chunk_item(0), 0, (0, 0), (2, 2)),))])
    finally:
        st.close()
    path = tmp_path / "ck" / MANIFEST_NAME
    doc = json.loads(path.read_text())
    doc.pop(CRC_FIELD)
    doc["global_tensors"][0]["shape"] = [4, 2]  # claims rows the file does not hold
    path.write_bytes(seal(json.dumps(doc).encode()))
    with pytest.raises(CheckpointCorruptError, match=r"manifest.json.*state\['t'\].*gap"):
        xla_ckpt.load(str(tmp_path / "ck"))


# ---- the overlap check: right on any layout, n log n on grids ---------------------------


def _brute(boxes: list[Box]) -> bool:
    return any(intersect(a, b) is not None for a, b in itertools.combinations(boxes, 2))


@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
def test_first_overlap_agrees_with_brute_force(ndim):
    rng = random.Random(ndim)
    for _ in range(300):
        n = rng.randint(2, 9)
        boxes = []
        for _ in range(n):
            offs = tuple(rng.randint(0, 5) for _ in range(ndim))
            sizes = tuple(rng.randint(1, 3) for _ in range(ndim))
            boxes.append(Box(offs, sizes))
        pair = first_overlap([(b.offsets, b.ends) for b in boxes])
        assert (pair is not None) == _brute(boxes), boxes
        if pair is not None:
            assert intersect(boxes[pair[0]], boxes[pair[1]]) is not None


def _grid(shape: tuple[int, ...], cuts: tuple[int, ...]) -> list[tuple[tuple, tuple]]:
    axes = []
    for n, k in zip(shape, cuts, strict=True):
        step = -(-n // k)
        axes.append([(o, min(o + step, n)) for o in range(0, n, step)])
    return [(tuple(a for a, _ in cell), tuple(b for _, b in cell))
            for cell in itertools.product(*axes)]


def test_grid_layouts_fit_a_linear_work_budget():
    for shape, cuts in [((4096, 64), (256, 1)), ((4096, 4096), (16, 16)),
                        ((64, 64, 64), (8, 8, 4)), ((8, 4096), (1, 256)),
                        ((32, 32, 32, 32), (4, 4, 4, 4))]:
        boxes = _grid(shape, cuts)
        assert first_overlap(boxes, budget=8 * len(boxes)) is None
        bad = boxes + [boxes[len(boxes) // 2]]
        assert first_overlap(bad, budget=8 * len(bad)) is not None


def test_an_irregular_three_dim_layout_past_the_budget_is_refused():
    # staircase: box i starts at row i and spans every later row (disjoint through dim 2;
    # dim 1 varies, so three dims are left): the sweep's cross-sections grow, n^2 / 2 work
    n = 200
    boxes = [((i, 0, i), (n, 1 + i % 2, i + 1)) for i in range(n)]
    assert first_overlap(boxes, budget=10**6) is None
    with pytest.raises(LayoutTooIrregularError):
        first_overlap(boxes, budget=64 * n)


def test_a_thousand_tensors_of_256_chunks_parse():
    """The chunk table of 1,000 tensors x 256 chunks (a 256-rank FSDP job) is checked in one
    pass over its entries; the figure for the whole manifest is in benchmarks (size, time)."""
    ranks, tensors = 256, 1000
    # every rank's item holds record t for tensor t (one list shared: the check reads records)
    recs = [TensorRecord(f"state['l{t}'][..]", t, 0, "float32", (16, 64), (64, 1))
            for t in range(tensors)]
    items = {chunk_item(r): Item(state=None, tensors=recs) for r in range(ranks)}
    tables = [[{"item": chunk_item(r), "tensor": t, "offsets": [16 * r, 0], "sizes": [16, 64]}
               for r in range(ranks)] for t in range(tensors)]
    gdoc = [{"key": f"state['l{t}']", "dtype": "float32", "shape": [16 * ranks, 64],
             "chunks": tables[t]} for t in range(tensors)]
    tables[0].reverse()  # order does not matter
    got = manifest_mod._global_tensors(gdoc, items, "m.json", 0)
    assert len(got) == tensors and {len(g.chunks) for g in got} == {ranks}
    assert got[0].chunks[-1] == ChunkRecord(chunk_item(0), 0, (0, 0), (16, 64))
    tables[999][7]["offsets"] = [16 * 8, 0]
    with pytest.raises(CheckpointCorruptError, match=r"global tensor 0 \(state\['l999'\]\)"):
        manifest_mod._global_tensors(gdoc[999:], items, "m.json", 0)


def test_typed_state_of_a_chunked_item_decodes_with_global_indices():
    m = parse(v2_doc())
    seen: list[int] = []
    def lookup(g: int) -> int:
        seen.append(g)
        return g

    tree = typed.decode(m.items["state"].state, lookup)
    assert tree == {"w": 0, "step": 1, "lr": 0.5} and seen == [0, 1]
