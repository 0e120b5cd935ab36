"""Tensors through a real checkpoint folder: dtypes, empty/0-d, views, aliasing, size, C11, C13.

C1 (a checkpoint saved from ``xla:0`` tensors is host data and loads on CPU) is asserted on
the checkpoint the XLA fresh-process test writes (tests/trainer/test_fresh_process.py).
"""

import os

import numpy as np
import pytest
import torch
from safetensors import safe_open

import xla_ckpt
from xla_ckpt.errors import MetaTensorError
from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.testing.asserts import assert_state_identical, tensor_bits


def data_files(folder: str) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))


def data_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in data_files(folder))


def round_trip(state, folder):
    xla_ckpt.save(state, folder)
    return xla_ckpt.load(folder)


def special_floats(dtype: torch.dtype) -> torch.Tensor:
    t = torch.tensor([0.0, -0.0, 1.0009765625, 3.14159, float("inf"), -float("inf"), 1e-40],
                     dtype=torch.float32).to(dtype)
    nan = torch.tensor([float("nan")], dtype=dtype)
    return torch.cat([t, nan])


DTYPE_CASES = {
    "float32": special_floats(torch.float32),
    "float64": special_floats(torch.float64),
    "float16": special_floats(torch.float16),
    "bfloat16": special_floats(torch.bfloat16),
    "float8_e4m3fn": torch.tensor([0.5, -2.0, 448.0]).to(torch.float8_e4m3fn),
    "float8_e5m2": torch.tensor([0.5, -2.0, 57344.0]).to(torch.float8_e5m2),
    "bool": torch.tensor([True, False, True]),
    "int8": torch.tensor([-128, 0, 127], dtype=torch.int8),
    "int16": torch.tensor([-32768, 7, 32767], dtype=torch.int16),
    "int32": torch.tensor([-2**31, 7, 2**31 - 1], dtype=torch.int32),
    "int64": torch.tensor([-2**63, 7, 2**63 - 1], dtype=torch.int64),
    "uint8": torch.tensor([0, 7, 255], dtype=torch.uint8),
    "uint16": torch.tensor([0, 7, 65535], dtype=torch.uint16),
    "uint32": torch.tensor([0, 7, 2**32 - 1], dtype=torch.uint32),
    "uint64": torch.tensor([0, 7, 2**63 - 1], dtype=torch.uint64),
    "complex64": torch.tensor([1 + 2j, -0.5j], dtype=torch.complex64),
    "complex128": torch.tensor([1 + 2j, -0.5j], dtype=torch.complex128),
}


def test_every_dtype_round_trips_bitwise(local_dir):
    got = round_trip(DTYPE_CASES, local_dir)
    assert_state_identical(got, DTYPE_CASES)
    for name, t in got.items():
        assert t.device.type == "cpu" and str(t.dtype) == f"torch.{name}"


def test_nan_payload_and_signed_zero_bits_survive(local_dir):
    bits = torch.tensor([0x7FC00001, 0x80000000, 0x7F800001], dtype=torch.int64).to(torch.uint32)
    t = bits.view(torch.float32)  # a NaN with payload, -0.0, a signalling NaN
    got = round_trip({"t": t}, local_dir)["t"]
    assert torch.equal(tensor_bits(got), tensor_bits(t))


def test_empty_and_zero_dim_tensors(local_dir):
    state = {"e1": torch.empty(0), "e2": torch.empty(3, 0, dtype=torch.int64),
             "e3": torch.empty(0, 4, dtype=torch.bfloat16), "scalar": torch.tensor(2.5),
             "bool_scalar": torch.tensor(True), "step": torch.tensor(3.0)}
    got = round_trip(state, local_dir)
    assert_state_identical(got, state)
    assert got["scalar"].shape == () and got["e2"].shape == (3, 0)


def test_views_keep_shape_stride_and_values(local_dir):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"t": base.t(), "strided": base[:, ::2], "row": base[2],
             "expanded": torch.ones(3).expand(4, 3)}
    got = round_trip(state, local_dir)
    for k in ("t", "strided", "row", "expanded"):
        assert torch.equal(got[k], state[k]) and got[k].shape == state[k].shape
    assert got["t"].stride() == (1, 6) and got["strided"].stride() == (6, 2)


def test_aliasing_is_restored_and_shared_bytes_written_once(local_dir):
    a = torch.arange(1000, dtype=torch.float32)
    state = {"a": a, "middle": a[10:20], "grid": a.view(10, 100), "tr": a.view(10, 100).t()}
    got = round_trip(state, local_dir)
    assert_state_identical({k: got[k].contiguous() for k in state},
                           {k: v.contiguous() for k, v in state.items()})
    assert data_bytes(local_dir) < 4000 + 1024  # one copy of the 4000 bytes, plus a header
    got["a"][15] = -1.0
    assert got["middle"][5].item() == -1.0 and got["grid"][0, 15].item() == -1.0
    assert got["tr"][15, 0].item() == -1.0
    assert got["middle"].untyped_storage().data_ptr() == got["a"].untyped_storage().data_ptr()


def test_tied_weights_come_back_tied(local_dir):
    emb = torch.nn.Embedding(50, 8)
    out = torch.nn.Linear(8, 50, bias=False)
    out.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "out": out})
    got = round_trip({"model": model.state_dict()}, local_dir)["model"]
    assert got["emb.weight"].data_ptr() == got["out.weight"].data_ptr()
    assert data_bytes(local_dir) < 50 * 8 * 4 + 1024


def test_small_view_of_a_large_storage_is_written_compactly(local_dir):
    big = torch.zeros(1_000_000)
    big[5:15] = torch.arange(10.0)
    got = round_trip({"small": big[5:15], "other": big[500_000:500_002]}, local_dir)
    assert torch.equal(got["small"], torch.arange(10.0))
    assert data_bytes(local_dir) < 2048  # not the 4 MB storage


def test_tensor_from_numpy_array_is_restored_as_array(local_dir):
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    got = round_trip({"arr": arr}, local_dir)["arr"]
    assert type(got) is np.ndarray and got.dtype == np.int16 and (got == arr).all()


def test_c11_saving_a_meta_tensor_names_the_key_and_commits_nothing(local_dir):
    state = {"model": {"enc.weight": torch.ones(2), "dec.weight": torch.empty(3, device="meta")}}
    with pytest.raises(MetaTensorError) as e:
        xla_ckpt.save(state, local_dir)
    assert str(e.value).startswith(
        "tensor at state['model']['dec.weight'] is on the meta device and holds no data; "
        "materialise it")
    assert os.listdir(local_dir) == []


AWKWARD_KEYS = ["ünïcödé", "日本語", "a.b.c", "a/b/c", "with space", "__metadata__", "$tensor",
                "", "../../etc/passwd", "tab\tnew\nline", "'quoted\"", "#1"]


def test_c13_awkward_keys_round_trip(local_dir):
    state = {"model": {k: torch.full((2,), float(i)) for i, k in enumerate(AWKWARD_KEYS)},
             AWKWARD_KEYS[5]: {"__metadata__": torch.ones(1)}, "plain": {k: i for i, k in
                                                                        enumerate(AWKWARD_KEYS)}}
    got = round_trip(state, local_dir)
    assert_state_identical(got, state)
    assert set(os.listdir(local_dir)) == {MANIFEST_NAME, *data_files(local_dir)}


def test_c13_data_file_opens_with_safetensors(local_dir):
    state = {k: torch.full((2,), float(i)) for i, k in enumerate(AWKWARD_KEYS)}
    xla_ckpt.save(state, local_dir)
    (name,) = data_files(local_dir)
    with safe_open(os.path.join(local_dir, name), framework="pt") as f:
        names = list(f.keys())
        values = sorted(f.get_tensor(n)[0].item() for n in names)
        assert f.metadata()["format"] == "pt"
    assert len(names) == len(AWKWARD_KEYS) and "__metadata__" not in names
    assert values == [float(i) for i in range(len(AWKWARD_KEYS))]


def test_lone_non_contiguous_tensors_keep_their_strides_as_torch_save_does(local_dir, tmp_path):
    state = {"transposed": torch.arange(12.0).reshape(3, 4).t(),        # the reported case
             "columns": torch.arange(24.0).reshape(4, 6)[:, ::2],       # sliced with a step
             "expanded": torch.arange(3.0).expand(4, 3),                # a zero stride
             "permuted": torch.arange(24, dtype=torch.int64).reshape(2, 3, 4).permute(2, 0, 1)}
    torch.save(state, tmp_path / "peer.pt")
    peer = torch.load(tmp_path / "peer.pt", weights_only=True)
    got = round_trip(state, local_dir)
    for k, t in state.items():
        assert torch.equal(got[k], t), k
        assert got[k].stride() == t.stride() == peer[k].stride(), k
        assert got[k].dtype == t.dtype and got[k].shape == t.shape
    assert got["transposed"].stride() == (1, 4) and got["columns"].stride() == (6, 2)
    assert got["expanded"].stride() == (0, 1)
    # each written as the storage span covering it: 48 + 23*4 + 12 + 192 bytes, one header
    assert data_bytes(local_dir) < 48 + 92 + 12 + 192 + 1024


def test_a_lone_view_spread_thin_is_written_densely_and_named(local_dir, caplog):
    thin = torch.arange(1000.0).reshape(10, 100)[:, ::50]                # 20 of 951 elements
    with caplog.at_level("INFO", logger="xla_ckpt.format.plan"):
        got = round_trip({"thin": thin}, local_dir)["thin"]
    assert torch.equal(got, thin) and got.stride() == (2, 1)             # contiguous copy
    assert data_bytes(local_dir) < 80 + 1024                             # not the 3.8 KB span
    assert [r.getMessage() for r in caplog.records if r.name == "xla_ckpt.format.plan"] == [
        ("wrote 1 strided tensor(s) as contiguous copies, because the storage span covering "
         "each is more than 2x its own bytes; they load with contiguous strides: state['thin']")]
