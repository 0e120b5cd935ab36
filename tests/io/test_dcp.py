"""DCP in and out: read DCP checkpoints by byte range through the allow-list, write them with DCP.

Real parts only: torch's own ``dcp.save``/``dcp.load`` (4 and 2 gloo ranks, FSDP2 on
``init_device_mesh("cpu", ...)``), real files, the GCS emulator.  Hostile checkpoints are
real DCP checkpoints whose ``.metadata`` or ``.distcp`` bytes the test rewrites.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import pickle
import random
import warnings
import zipfile
from pathlib import Path
from typing import Any

import dcp_workers as W
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

import xla_ckpt
from xla_ckpt.cli.main import main as xla_ckpt_main
from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    DataFileMissingError,
    IncompleteCheckpointError,
    IntegrityError,
    MetaTensorError,
    PartiallyOverwrittenError,
    StateMismatchError,
    UnknownKeyError,
    UnsafePickleError,
    UnsupportedTypeError,
    XlaCkptError,
)
from xla_ckpt.format.dcp import DcpTensorEntry, load_dcp_metadata
from xla_ckpt.kinds.dcp import (
    is_dcp_checkpoint,
    read_dcp,
    read_dcp_into,
    read_dcp_metadata,
    unflatten_dcp_state,
)
from xla_ckpt.kinds.dcp_write import write_dcp
from xla_ckpt.storage import open_storage
from xla_ckpt.storage.local import LocalStorage
from xla_ckpt.testing.asserts import tensor_bits, tensors_identical
from xla_ckpt.testing.launcher import shared_pool
from xla_ckpt.trainer import Checkpointer

pytestmark = pytest.mark.timeout(300)


def _dcp_save(state: dict[str, Any], path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)


def _dcp_load_flat(path: str) -> dict[str, Any]:
    """DCP's own single-process restore into plain tensors of the saved shapes and dtypes."""
    md = read_dcp_metadata(path)
    ref: dict[str, Any] = {k: torch.empty(e.shape, dtype=e.dtype)
                           if isinstance(e, DcpTensorEntry) else None
                           for k, e in md.entries.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(ref, checkpoint_id=path, no_dist=True)
    return ref


def _assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert list(actual) == list(expected)
    for k, want in expected.items():
        got = actual[k]
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor), k
            assert tensors_identical(got, want), k
        else:
            assert type(got) is type(want) and got == want, k


def _copy_folder(src: str, uri: str) -> None:
    dst = open_storage(uri)
    try:
        for name in sorted(os.listdir(src)):
            with open(os.path.join(src, name), "rb") as f:
                dst.write_atomic(name, [f.read()])
    finally:
        dst.close()


def _download(uri: str, dst: Path) -> str:
    dst.mkdir()
    st = open_storage(uri)
    try:
        for name in st.list(""):
            (dst / name).write_bytes(st.read_bytes(name))
    finally:
        st.close()
    return str(dst)


# ---- 4-rank FSDP2 checkpoint, read in one process ---------------------------------------------


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory) -> tuple[str, list[dict[str, Any]]]:
    """A DCP checkpoint of an FSDP2 model + AdamW after one step, saved by 4 gloo ranks."""
    path = str(tmp_path_factory.mktemp("dcp") / "fsdp4")
    results = shared_pool(4).run(W.save_fsdp_checkpoint, path, timeout_s=240)
    return path, [r.unwrap() for r in results]


@pytest.mark.slow
def test_read_dcp_of_4_rank_fsdp2_equals_dcp_load_bitwise(fsdp_checkpoint):
    path, shards = fsdp_checkpoint
    flat = read_dcp(path)
    _assert_same(flat, _dcp_load_flat(path))

    md = read_dcp_metadata(path)
    w = md.entries["model.l1.weight"]
    assert isinstance(w, DcpTensorEntry)
    assert w.shape == (10, W.IN_FEATURES)
    assert sorted(c.sizes[0] for c in w.chunks) == [1, 3, 3, 3]  # torch.chunk rows over 4
    l2 = md.entries["model.l2.weight"]
    assert isinstance(l2, DcpTensorEntry)
    assert sorted(c.sizes[0] for c in l2.chunks) == [1, 2, 2, 2]
    # every rank's own shard is where DCP put it, bit for bit
    for rank in shards:
        for key, (off, local) in rank["shards"].items():
            box = tuple(slice(o, o + s) for o, s in zip(off, local.shape, strict=True))
            assert tensors_identical(flat[key][box], local), key
        for key, value in rank["values"].items():
            assert flat[key] == value, key
    # optimizer step counters, int64 and bool buffers keep dtype and value (CASES C23)
    steps = [k for k in flat if k.endswith(".step")]
    assert len(steps) == 4
    for k in steps:
        assert flat[k].dtype == torch.float32 and flat[k].shape == () and flat[k].item() == 1.0
    assert flat["model.seen"].dtype == torch.int64
    assert flat["model.seen"].tolist() == [3, -1, 2**40]
    assert flat["model.mask"].dtype == torch.bool
    assert flat["model.mask"].tolist() == [True, False, True, True, False, False, True]
    assert flat["optim.param_groups.0.lr"] == 0.01

    nested = unflatten_dcp_state(flat)
    assert list(nested) == ["model", "optim"]
    assert unflatten_dcp_state(dict(flat), md.mapping) == nested
    assert nested["optim"]["param_groups"][0]["lr"] == 0.01
    assert nested["optim"]["state"]["l1.weight"]["exp_avg"] is flat["optim.state.l1.weight.exp_avg"]
    assert nested["model"]["l1.weight"] is flat["model.l1.weight"]


@pytest.mark.slow
def test_read_dcp_from_gcs_equals_local(fsdp_checkpoint, gcs_uri):
    path, _ = fsdp_checkpoint
    uri = gcs_uri + "/fsdp4"
    st = open_storage(uri)
    assert not is_dcp_checkpoint(st)
    _copy_folder(path, uri)
    assert is_dcp_checkpoint(st)
    st.close()
    keys = ["model.l1.weight", "optim.state.l2.bias.exp_avg_sq", "optim.param_groups.0.lr"]
    _assert_same(read_dcp(uri, keys=keys), read_dcp(path, keys=keys))
    _assert_same(read_dcp(uri), read_dcp(path))


@pytest.mark.slow
def test_read_dcp_into_fsdp2_on_2_ranks_equals_dcp_load_and_reads_only_its_shards(
        fsdp_checkpoint, tmp_path):
    path, _ = fsdp_checkpoint
    exported = str(tmp_path / "export")
    md = read_dcp_metadata(path)
    write_dcp(unflatten_dcp_state(read_dcp(path), md.mapping), exported)

    results = [r.unwrap() for r in shared_pool(2, xla=False).run(
        W.restore_fsdp_two_ways, path, exported, timeout_s=240)]
    for rank, res in enumerate(results):
        ours, theirs, from_export = res["ours"], res["theirs"], res["from_export"]
        assert len(theirs["tensors"]) == 4 * 3 + 2 + 4  # params + Adam moments, buffers, steps
        assert list(ours) == list(theirs["tensors"]) == list(from_export["tensors"])
        for k, (dtype, shape, bits) in theirs["tensors"].items():
            assert ours[k][:2] == (dtype, shape), (rank, k)
            assert torch.equal(ours[k][2], bits), (rank, k)
            assert from_export["tensors"][k][:2] == (dtype, shape), (rank, k)
            assert torch.equal(from_export["tensors"][k][2], bits), (rank, k)
        assert from_export["values"] == theirs["values"]
        assert theirs["values"]["optim.param_groups.0.lr"] == 0.01
        # the model's own parameters were filled in place
        for k, (dtype, shape, bits) in res["params"].items():
            want = theirs["tensors"][k]
            assert (dtype, shape) == want[:2] and torch.equal(bits, want[2]), k
        # rows 0-4 / 5-9 of l1: each rank fetched about its half, not the whole checkpoint
        assert res["bytes_read"] < 0.6 * res["tensor_bytes_total"], (rank, res["bytes_read"])
    l1 = results[0]["theirs"]["tensors"]["model.l1.weight"]
    assert l1[1] == (5, W.IN_FEATURES)

    # The other way in: `xla-ckpt convert` to an xla_ckpt checkpoint, restored on 2 ranks with
    # xla_ckpt's restore() and applied with DCP's set_state_dict: the same shards as dcp.load.
    converted = str(tmp_path / "converted")
    assert xla_ckpt_main(["convert", path, converted]) == 0
    for rank, res in enumerate(r.unwrap() for r in shared_pool(2, xla=False).run(
            W.restore_converted, converted, timeout_s=240)):
        theirs = results[rank]["theirs"]
        assert list(res["tensors"]) == list(theirs["tensors"])
        for k, (dtype, shape, bits) in theirs["tensors"].items():
            assert res["tensors"][k][:2] == (dtype, shape), (rank, k)
            assert torch.equal(res["tensors"][k][2], bits), (rank, k)
        # what xla_ckpt restored is exactly what DCP saved (tuples stay tuples) ...
        assert res["restored_values"] == theirs["values"]
        # ... and DCP's set_state_dict hands the optimizer param_groups back with lists
        assert res["values"] == {k: list(v) if isinstance(v, tuple) else v
                                 for k, v in theirs["values"].items()}


@pytest.mark.slow
def test_read_dcp_into_column_shards(tmp_path):
    path = str(tmp_path / "cols")
    full = {"few_rows": torch.arange(48.0).reshape(8, 6),
            "many_rows": torch.arange(240.0).reshape(40, 6),
            "cube": torch.arange(120.0).reshape(4, 5, 6)}
    write_dcp(full, path)
    results = [r.unwrap() for r in shared_pool(2, xla=False).run(
        W.read_column_shards, path, timeout_s=120)]
    for rank, res in enumerate(results):
        for key, t in full.items():
            want = torch.chunk(t, 2, dim=1)[rank]
            assert torch.equal(res[key], tensor_bits(want)), (rank, key)


# ---- single-process reads: layouts, keys, errors ----------------------------------------------


def _small_state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"w": torch.arange(60, dtype=torch.float32).reshape(10, 6) / 7,
            "b": torch.arange(7, dtype=torch.int64) - 3,
            "t": torch.randn(4, 3).t(),  # saved with strides (1, 3)
            "s": torch.tensor(3.0),
            "e": torch.empty(0, 4),
            "m": torch.tensor([True, False, True]),
            "lr": 0.1, "names": ["a", "b"]}


@pytest.fixture
def small_checkpoint(tmp_path) -> str:
    path = str(tmp_path / "small")
    _dcp_save(_small_state(), path)
    return path


def test_read_dcp_layouts_equal_the_saved_values(small_checkpoint):
    flat = read_dcp(small_checkpoint)
    want = _small_state()
    assert list(flat) == list(_dcp_load_flat(small_checkpoint))
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert tensors_identical(flat[k], v.contiguous()), k
        else:
            assert flat[k] == v, k
    _assert_same(flat, _dcp_load_flat(small_checkpoint))


def test_read_dcp_keys_subset_and_unknown_key(small_checkpoint):
    got = read_dcp(small_checkpoint, keys=["s", "lr"])
    assert list(got) == ["s", "lr"] and got["s"].item() == 3.0 and got["lr"] == 0.1
    with pytest.raises(UnknownKeyError) as e:
        read_dcp(small_checkpoint, keys=["ww"])
    assert "'ww'" in str(e.value) and e.value.closest[0] == "w"


def test_read_dcp_into_plain_tensors_and_refusals(small_checkpoint):
    w, t = torch.zeros(10, 6), torch.zeros(3, 4)
    stats = read_dcp_into(small_checkpoint, {"w": w, "t": t})
    want = _small_state()
    assert torch.equal(w, want["w"]) and torch.equal(t, want["t"])
    assert stats.keys == 2 and stats.bytes_read > 0
    md = _load_md(small_checkpoint)
    _flipped_byte(small_checkpoint, md)
    w = torch.zeros(10, 6)
    with pytest.raises(PartiallyOverwrittenError, match=r"key 'w'.*now holds") as e:
        read_dcp_into(small_checkpoint, {"w": w})
    assert e.value.keys == ("w",)
    with pytest.raises(StateMismatchError, match=r"'w'.*saved dtype float32, target float64"):
        read_dcp_into(small_checkpoint, {"w": torch.zeros(10, 6, dtype=torch.float64)})
    with pytest.raises(StateMismatchError, match=r"'w'.*shape \(10, 6\), target \(6, 10\)"):
        read_dcp_into(small_checkpoint, {"w": torch.zeros(6, 10)})
    with pytest.raises(StateMismatchError, match=r"'lr' is a non-tensor item"):
        read_dcp_into(small_checkpoint, {"lr": torch.zeros(())})
    with pytest.raises(MetaTensorError, match="'w'"):
        read_dcp_into(small_checkpoint, {"w": torch.empty(10, 6, device="meta")})


def test_missing_and_uncommitted_checkpoints(small_checkpoint, tmp_path):
    with pytest.raises(CheckpointNotFoundError) as e:
        read_dcp(str(tmp_path / "nothing"))
    assert not isinstance(e.value, IncompleteCheckpointError)
    os.remove(os.path.join(small_checkpoint, ".metadata"))
    with pytest.raises(IncompleteCheckpointError, match="without the .metadata commit marker"):
        read_dcp(small_checkpoint)
    assert not is_dcp_checkpoint(LocalStorage(small_checkpoint))


def test_missing_data_file_names_the_key(small_checkpoint):
    os.remove(os.path.join(small_checkpoint, "__0_0.distcp"))
    with pytest.raises(DataFileMissingError, match=r"__0_0.distcp: data file of key '\w+'"):
        read_dcp(small_checkpoint)


# ---- write_dcp ---------------------------------------------------------------------------------


def _export_state() -> dict[str, Any]:
    emb = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    return {"model": {"w": torch.tensor([1.0009765625, 3.14159]),
                      "h": torch.tensor([1.0009765625, -2.5, 65504.0], dtype=torch.bfloat16),
                      "ids": torch.tensor([2**40 + 1, -7], dtype=torch.int64),
                      "mask": torch.tensor([True, False, True]),
                      "embed.weight": emb, "out.weight": emb},  # tied
            "num_updates": 7, "lr": 0.25, "name": "run-1", "betas": (0.9, 0.999)}


def _dcp_load_export(path: str) -> dict[str, Any]:
    state = _export_state()
    ref = {"model": {k: torch.full_like(v, 0) for k, v in state["model"].items()},
           "num_updates": None, "lr": None, "name": None, "betas": None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(ref, checkpoint_id=path, no_dist=True)
    return ref


def _assert_export_round_trip(loaded: dict[str, Any]) -> None:
    state = _export_state()
    for k, v in state["model"].items():
        got = loaded["model"][k]
        assert got.dtype == v.dtype and tensors_identical(got, v), k
    assert torch.equal(loaded["model"]["embed.weight"], loaded["model"]["out.weight"])
    for k in ("num_updates", "lr", "name", "betas"):
        assert loaded[k] == state[k] and type(loaded[k]) is type(state[k]), k


def test_write_dcp_dtypes_ties_and_items_read_back_by_dcp_load(tmp_path, monkeypatch, caplog):
    path = str(tmp_path / "exp")
    order: list[str] = []
    real = LocalStorage.write_atomic

    def recording(self, name, buffers, **kw):
        order.append(name)
        return real(self, name, buffers, **kw)

    monkeypatch.setattr(LocalStorage, "write_atomic", recording)
    with caplog.at_level("INFO", logger="xla_ckpt.kinds.dcp_write"):
        write_dcp(_export_state(), path)
    assert order == ["__0_0.distcp", ".metadata"]  # the commit marker last
    assert "tied tensors model.embed.weight, model.out.weight" in caplog.text
    _assert_export_round_trip(_dcp_load_export(path))
    flat = read_dcp(path)
    assert flat["model.ids"].tolist() == [2**40 + 1, -7] and flat["betas"] == (0.9, 0.999)


def test_write_dcp_to_gcs_read_back_by_dcp_load(tmp_path, gcs_uri):
    uri = gcs_uri + "/exp"
    write_dcp(_export_state(), uri)
    local = _download(uri, tmp_path / "dl")
    _assert_export_round_trip(_dcp_load_export(local))
    _assert_same(read_dcp(uri), read_dcp(local))


def test_write_dcp_refuses_what_could_not_be_read_back(tmp_path):
    path = str(tmp_path / "exp")
    write_dcp({"a": torch.ones(2)}, path)
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        write_dcp({"a": torch.zeros(2)}, path)
    assert read_dcp(path)["a"].tolist() == [1.0, 1.0]
    Path(path, "__1_0.distcp").write_bytes(b"a data file of the replaced checkpoint")
    write_dcp({"a": torch.zeros(3)}, path, overwrite=True)
    assert read_dcp(path)["a"].tolist() == [0.0, 0.0, 0.0]
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp"]
    with pytest.raises(MetaTensorError, match="'m.x'"):
        write_dcp({"m": {"x": torch.empty(2, device="meta")}}, str(tmp_path / "meta"))
    with pytest.raises(UnsupportedTypeError, match="'args'.*Namespace.*weights_only"):
        write_dcp({"args": argparse.Namespace(lr=0.1)}, str(tmp_path / "ns"))
    assert not os.path.exists(tmp_path / "meta") or not os.listdir(tmp_path / "meta")


# ---- hostile pickles: refused, nothing runs ----------------------------------------------------


class _Evil:
    """Pickles as a call of ``os.system`` (what a hostile file would carry)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _EvalEvil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({self.marker!r}, 'w')",))


def _write_metadata(folder: str, data: bytes) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        f.write(data)


@pytest.mark.parametrize("kind", ["global_opcode", "stack_global_eval", "inside_metadata"])
def test_malicious_metadata_global_is_refused_and_nothing_runs(small_checkpoint, tmp_path, kind):
    marker = str(tmp_path / "pwned")
    if kind == "global_opcode":
        data = f"cos\nsystem\n(Vtouch {marker}\ntR.".encode()
        name = "os.system"
    elif kind == "stack_global_eval":
        data = pickle.dumps(_EvalEvil(marker), protocol=4)
        assert b"\x93" in data  # STACK_GLOBAL
        name = "builtins.eval"
    else:
        with open(os.path.join(small_checkpoint, ".metadata"), "rb") as f:
            md = pickle.load(f)  # our own test checkpoint: trusted
        md.planner_data = {"w": _Evil(marker)}
        data = pickle.dumps(md)
        name = f"{os.system.__module__}.system"
    folder = small_checkpoint if kind == "inside_metadata" else str(tmp_path / "evil")
    _write_metadata(folder, data)
    with pytest.raises(UnsafePickleError) as e:
        read_dcp(folder)
    assert repr(name) in str(e.value) and ".metadata" in str(e.value)
    with pytest.raises(UnsafePickleError):
        load_dcp_metadata(data, source="x/.metadata")
    assert not os.path.exists(marker)


def test_malicious_bytes_item_is_refused_by_weights_only(tmp_path):
    marker = str(tmp_path / "pwned")
    path = str(tmp_path / "ck")
    _dcp_save({"w": torch.ones(3), "evil": _Evil(marker)}, path)
    assert not os.path.exists(marker)
    with pytest.raises(UnsafePickleError, match=r"'evil'.*weights_only=True.*system"):
        read_dcp(path)
    assert not os.path.exists(marker)
    assert read_dcp(path, keys=["w"])["w"].tolist() == [1.0, 1.0, 1.0]


# ---- hostile metadata and data files: clear errors naming the key ------------------------------


def _load_md(folder: str):
    with open(os.path.join(folder, ".metadata"), "rb") as f:
        return pickle.load(f)  # our own test checkpoint: trusted


def _save_md(folder: str, md) -> None:
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _index(md, key: str) -> MetadataIndex:
    return next(i for i in md.storage_data if i.fqn == key)


def _chunk_zip(folder: str, md, key: str) -> bytes:
    info = md.storage_data[_index(md, key)]
    with open(os.path.join(folder, info.relative_path), "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def _replace_chunk(folder: str, md, key: str, data: bytes) -> None:
    """Append ``data`` to the key's data file and point the key's storage entry at it."""
    idx = _index(md, key)
    info = md.storage_data[idx]
    path = os.path.join(folder, info.relative_path)
    offset = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(data)
    md.storage_data[idx] = _StorageInfo(info.relative_path, offset, len(data))


def _rezip(data: bytes, *, compression: int = zipfile.ZIP_STORED,
           replace: dict[str, bytes] | None = None) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", compression) as dst:
        for info in src.infolist():
            body = (replace or {}).get(info.filename.rpartition("/")[2], src.read(info))
            dst.writestr(info.filename, body)
    return out.getvalue()


def _out_of_bounds(folder, md):
    md.state_dict_metadata["w"].chunks[0] = ChunkStorageMetadata(
        offsets=torch.Size([0, 0]), sizes=torch.Size([11, 6]))


def _offset_past_end(folder, md):
    info = md.storage_data[_index(md, "w")]
    md.storage_data[_index(md, "w")] = _StorageInfo(info.relative_path, 10**9, info.length)


def _compressed(folder, md):
    _replace_chunk(folder, md, "w", _rezip(_chunk_zip(folder, md, "w"),
                                           compression=zipfile.ZIP_DEFLATED))


def _escaping_path(folder, md):
    info = md.storage_data[_index(md, "w")]
    md.storage_data[_index(md, "w")] = _StorageInfo("../elsewhere.distcp", info.offset,
                                                    info.length)


def _overlap(folder, md):
    chunks = md.state_dict_metadata["w"].chunks
    chunks[0] = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([6, 6]))
    md.state_dict_metadata["w"].chunks = chunks + [ChunkStorageMetadata(
        offsets=torch.Size([5, 0]), sizes=torch.Size([5, 6]))]
    md.storage_data[MetadataIndex("w", torch.Size([5, 0]), 1)] = md.storage_data[_index(md, "w")]


def _dtype_mismatch(folder, md):
    md.state_dict_metadata["w"].properties.dtype = torch.int32  # same element size


def _shape_lie(folder, md):  # chunk sizes agree with the tensor but not with the zip's tensor
    md.state_dict_metadata["b"].size = torch.Size([7, 1])
    md.state_dict_metadata["b"].chunks[0] = ChunkStorageMetadata(
        offsets=torch.Size([0, 0]), sizes=torch.Size([7, 1]))
    info = md.storage_data.pop(_index(md, "b"))
    md.storage_data[MetadataIndex("b", torch.Size([0, 0]), 0)] = info


def _short_length(folder, md):
    info = md.storage_data[_index(md, "w")]
    md.storage_data[_index(md, "w")] = _StorageInfo(info.relative_path, info.offset, 100)


def _evil_data_pkl(folder, md):
    evil = f"cos\nsystem\n(Vtouch {os.path.join(folder, 'pwned')}\ntR.".encode()
    _replace_chunk(folder, md, "w", _rezip(_chunk_zip(folder, md, "w"),
                                           replace={"data.pkl": evil}))


def _flipped_byte(folder, md):
    info = md.storage_data[_index(md, "w")]
    path = os.path.join(folder, info.relative_path)
    raw = _small_state()["w"].numpy().tobytes()
    at = _chunk_zip(folder, md, "w").find(raw)
    assert at > 0
    with open(path, "r+b") as f:
        f.seek(info.offset + at + 17)  # inside the 240 tensor bytes
        b = f.read(1)
        f.seek(-1, io.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize(("edit", "error", "pattern"), [
    (_out_of_bounds, CheckpointCorruptError, r"key 'w': .*out of the bounds of the tensor's shape"),
    (_offset_past_end, CheckpointCorruptError, r"key 'w': its bytes .* run past the end of the"),
    (_compressed, CheckpointCorruptError, r"key 'w'.*is compressed"),
    (_escaping_path, CheckpointCorruptError, r"key 'w': data file name '../elsewhere.distcp'"),
    (_overlap, CheckpointCorruptError, r"key 'w': chunks at offsets \(0, 0\) and \(5, 0\) overlap"),
    (_dtype_mismatch, CheckpointCorruptError, r"key 'w'.*is float32 but the .metadata says int32"),
    (_shape_lie, CheckpointCorruptError, r"key 'b'.*shape \(7,\) but the .metadata says sizes"),
    (_short_length, CheckpointCorruptError, r"key 'w': chunk at offsets \(0, 0\) has 100 bytes"),
    (_evil_data_pkl, UnsafePickleError, r"key 'w'.*data.pkl.*'os.system'"),
    (_flipped_byte, IntegrityError, r"key 'w'.*CRC-32 of the tensor bytes read .*corrupt$"),
], ids=lambda v: v.__name__.strip("_") if callable(v) and not isinstance(v, type) else "")
def test_hostile_checkpoint_is_refused_naming_the_key(small_checkpoint, edit, error, pattern):
    md = _load_md(small_checkpoint)
    edit(small_checkpoint, md)
    _save_md(small_checkpoint, md)
    with pytest.raises(error, match=pattern):
        read_dcp(small_checkpoint)
    assert not os.path.exists(os.path.join(small_checkpoint, "pwned"))


def test_flipped_bits_give_the_saved_values_or_a_library_error(small_checkpoint):
    """Any one-bit flip of a data file: the exact saved values, or an xla_ckpt error; a flip of
    the .metadata: an xla_ckpt error or values (it has no checksum), never another exception."""
    want = read_dcp(small_checkpoint)
    meta, data = Path(small_checkpoint, ".metadata"), Path(small_checkpoint, "__0_0.distcp")
    m0, d0 = meta.read_bytes(), data.read_bytes()
    rng = random.Random(0)
    outcomes: collections.Counter[str] = collections.Counter()
    for i in range(240):
        target, orig = (meta, m0) if i % 3 == 0 else (data, d0)
        flipped = bytearray(orig)
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(flipped))
        try:
            got = read_dcp(small_checkpoint)
        except XlaCkptError as e:
            outcomes[type(e).__name__] += 1
        else:
            outcomes["values"] += 1
            if target is data:
                _assert_same(got, want)
        finally:
            target.write_bytes(orig)
    assert outcomes["IntegrityError"] > 0 and outcomes["CheckpointCorruptError"] > 0
    assert sum(outcomes.values()) == 240


def _fairseq_dcp(path: str) -> tuple[torch.nn.Linear, torch.optim.AdamW]:
    """A fairseq-shaped state (plain ``optimizer.state_dict()``, int state keys) saved by DCP."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).pow(2).sum().backward()
    opt.step()
    _dcp_save({"model": model.state_dict(), "last_optimizer_state": opt.state_dict(),
               "optimizer_history": [{"criterion_name": None, "optimizer_name": "AdamW",
                                      "lr_scheduler_state": None, "num_updates": 1}],
               "extra_state": {}}, path)
    return model, opt


def test_dcp_optimizer_state_comes_back_with_int_keys_on_every_path(tmp_path):
    """DCP stores dict keys as strings (also in planner_data); an optimizer's int parameter ids
    come back as ints, so neither torch nor the trainer restore drops the state (defect 2)."""
    path = str(tmp_path / "dcp")
    model, opt = _fairseq_dcp(path)
    saved = opt.state_dict()
    assert read_dcp_metadata(path).mapping["last_optimizer_state.state.0.step"] == (
        "last_optimizer_state", "state", "0", "step")  # what DCP records: the string form

    loaded = xla_ckpt.load(path)
    assert list(loaded["last_optimizer_state"]["state"]) == [0, 1]
    assert loaded["last_optimizer_state"]["param_groups"][0]["params"] == [0, 1]
    for pid in (0, 1):
        for k, v in saved["state"][pid].items():
            assert tensors_identical(loaded["last_optimizer_state"]["state"][pid][k], v)

    fresh = torch.nn.Linear(4, 2)
    ckpt = Checkpointer(model=fresh, build_optimizer=lambda p: torch.optim.AdamW(p, lr=0.01))
    ckpt.load_checkpoint(path)
    assert [id(p) for p in ckpt.optimizer.state] == [id(fresh.weight), id(fresh.bias)]
    for p, ref in zip((fresh.weight, fresh.bias), (model.weight, model.bias), strict=True):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert tensors_identical(ckpt.optimizer.state[p][k], opt.state[ref][k]), k

    out = str(tmp_path / "converted")
    assert xla_ckpt_main(["convert", path, out]) == 0
    assert list(xla_ckpt.load(out)["last_optimizer_state"]["state"]) == [0, 1]


def test_dcp_string_keys_that_are_not_param_ids_stay_strings(tmp_path):
    """FQN-keyed optimizer state (``get_optimizer_state_dict``) and ordinary dicts keep their
    string keys; only an optimizer state dict's decimal ids listed in param_groups change."""
    path = str(tmp_path / "dcp")
    t = torch.arange(2.0)
    _dcp_save({"fqn": {"state": {"w": {"exp_avg": t}}, "param_groups": [{"params": ["w"]}]},
               "digits": {"state": {"0": {"m": t}, "5": {"m": t}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
               "plain": {"0": t, "1": t}}, path)
    nested = unflatten_dcp_state(read_dcp(path))
    assert list(nested["fqn"]["state"]) == ["w"]
    assert list(nested["digits"]["state"]) == [0, "5"]  # '5' is no listed id: left as saved
    assert list(nested["plain"]) == ["0", "1"]
