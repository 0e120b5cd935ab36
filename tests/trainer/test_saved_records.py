"""``module_load.saved_records`` decodes a manifest item's typed state exactly as
``typed.decode`` does (its own loop for the common nodes: the trainer restore's record tree at
80,000 tensors), and refuses a malformed tree with typed's own error."""

import argparse
import dataclasses
import math
from collections import OrderedDict

import numpy as np
import pytest
import torch

import xla_ckpt
from xla_ckpt.errors import CheckpointCorruptError
from xla_ckpt.format import typed
from xla_ckpt.format.manifest import TensorRecord
from xla_ckpt.io.reader import CheckpointReader
from xla_ckpt.trainer.module_load import saved_records


def same(a, b):
    assert type(a) is type(b), (a, b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b) and a.dtype == b.dtype
    elif isinstance(a, argparse.Namespace):
        same(vars(a), vars(b))
    else:
        assert a == b


def training_state():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(4, 2)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer_history": [
        {"optimizer_name": "AdamW", "num_updates": 1, "lr_scheduler_state": {"best": None}}],
        "last_optimizer_state": opt.state_dict(), "extra_state": {"epoch": (1, 2.5)}}


def every_kind():
    state = training_state()
    state.update({"nan": float("nan"), "inf": -math.inf, "np": np.float32(3), "b": b"xy",
                  "set": {1, 2}, "dtype": torch.float16, "device": torch.device("cpu"),
                  "args": argparse.Namespace(lr=[0.1], w=torch.zeros(2)), "c": 1 + 2j,
                  "keys": {1: "int", (1, 2): "tuple", 2.5: "float"}, "nested": [[{}], []]})
    return state


def with_arrays():
    state = every_kind()
    state["arr"] = np.arange(3)  # a tag left to typed.decode's whole-tree pass
    return state


@pytest.mark.parametrize("make", [training_state, every_kind, with_arrays])
def test_the_same_tree_as_typed_decode(tmp_path, make):
    xla_ckpt.save(make(), str(tmp_path / "c"))
    reader = CheckpointReader.open(str(tmp_path / "c"))
    try:
        item = reader.manifest.item("state")
        got = saved_records(item)
        same(got, typed.decode(item.state, lambda i: item.tensors[i]))
        assert isinstance(got["model"], OrderedDict)
        assert all(isinstance(v, TensorRecord) for v in got["model"].values())
    finally:
        reader.storage.close()


@pytest.mark.parametrize("bad, message", [
    ({"a": {"$tensor": "0"}}, "$tensor needs an integer index"),
    ({"a": {"$dict": [[1]]}}, "dict items must be a list of [key, value] pairs"),
    ({"a": {"$nope": 1}}, "unknown tag '$nope'"),
])
def test_a_malformed_tree_gets_typed_decodes_error(tmp_path, bad, message):
    xla_ckpt.save(training_state(), str(tmp_path / "c"))
    reader = CheckpointReader.open(str(tmp_path / "c"))
    try:
        item = dataclasses.replace(reader.manifest.item("state"), state=bad)
        with pytest.raises(CheckpointCorruptError) as e:
            saved_records(item)
        assert str(e.value) == f"malformed typed state: {message}"
    finally:
        reader.storage.close()
