"""Staging to host memory: a snapshot that later in-place updates cannot change."""

import argparse
import os
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch

from xla_ckpt.errors import MetaTensorError, UnsupportedTypeError
from xla_ckpt.manager.staging import stage_to_host


def test_snapshot_is_independent_and_exact():
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    sd = OrderedDict(w=w, step=torch.tensor(3))
    sd._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]  # as in state_dict()
    state: dict[str, Any] = {"model": sd, "args": argparse.Namespace(lr=0.1),
                             "best": np.float64(1.5), "hist": [1, (2, 3.0)],
                             "arr": np.arange(3, dtype=np.int64)}
    staged = stage_to_host(state)
    w.add_(100)
    state["hist"].append(4)
    state["args"].lr = 9.0
    s = staged.state
    assert torch.equal(s["model"]["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert s["model"]["w"].data_ptr() != w.data_ptr()
    assert isinstance(s["model"], OrderedDict)
    assert s["model"]._metadata == {"": {"version": 1}}  # type: ignore[attr-defined]  # kept
    assert s["hist"] == [1, (2, 3.0)] and s["args"] == argparse.Namespace(lr=0.1)
    assert type(s["best"]) is np.float64 and s["best"] == 1.5
    assert np.array_equal(s["arr"], np.arange(3)) and s["arr"].dtype == np.int64
    assert staged.nbytes == 6 * 4 + 8 + 3 * 8 and len(staged.buffers) == 3


def test_aliasing_is_kept():
    base = torch.arange(10, dtype=torch.float32)
    tied = {"emb": base.view(2, 5), "out": base.view(2, 5), "tail": base[6:],
            "other": torch.ones(2)}
    s = stage_to_host(tied).state
    base.zero_()
    assert torch.equal(s["emb"], torch.arange(10.).view(2, 5))
    assert s["emb"].data_ptr() == s["out"].data_ptr()
    assert s["tail"].untyped_storage().data_ptr() == s["emb"].untyped_storage().data_ptr()
    assert s["tail"].storage_offset() == 6 and torch.equal(s["tail"], torch.arange(6., 10.))
    s["emb"][0, 0] = 42.0
    assert s["out"][0, 0].item() == 42.0


def test_mixed_dtype_views_of_one_storage():
    raw = torch.arange(16, dtype=torch.uint8)
    state = {"bytes": raw[1:9], "floats": raw[8:16].view(torch.float32)}
    s = stage_to_host(state).state
    assert torch.equal(s["bytes"], torch.arange(1, 9, dtype=torch.uint8))
    assert torch.equal(s["floats"].view(torch.uint8), torch.arange(8, 16, dtype=torch.uint8))


def test_xla_tensors_come_back_on_host():
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla

    dev = torch_xla.device()
    w = torch.arange(4, dtype=torch.float32, device=dev)
    s = stage_to_host({"w": w, "b": torch.ones(2, dtype=torch.bfloat16, device=dev)}).state
    w.add_(1)
    assert s["w"].device.type == "cpu" and torch.equal(s["w"], torch.arange(4.))
    assert s["b"].dtype == torch.bfloat16 and s["b"].device.type == "cpu"


def test_refusals_name_the_key():
    with pytest.raises(MetaTensorError, match=r"tensor at state\['m'\]\['w'\] is on the meta"):
        stage_to_host({"m": {"w": torch.empty(2, device="meta")}})
    with pytest.raises(UnsupportedTypeError, match=r"at state\['x'\]"):
        stage_to_host({"x": object()})


def test_pool_reuses_buffers_of_the_last_snapshot():
    from xla_ckpt.manager.staging import StagingPool

    pool = StagingPool()
    w = torch.arange(8, dtype=torch.float32)
    tied = torch.zeros(4)
    first = stage_to_host({"w": w, "a": tied.view(2, 2), "b": tied.view(4)}, pool)
    assert pool.nbytes == 0 and first.nbytes == 32 + 16
    ptrs = sorted(b.data_ptr() for b in first.buffers)
    pool.release(first.buffers)
    assert pool.nbytes == 48
    w.add_(1)
    second = stage_to_host({"w": w, "a": tied.view(2, 2), "b": tied.view(4)}, pool)
    assert sorted(b.data_ptr() for b in second.buffers) == ptrs  # same host memory again
    assert torch.equal(second.state["w"], torch.arange(8.) + 1)
    assert second.state["a"].data_ptr() == second.state["b"].data_ptr()
    assert pool.nbytes == 0
    # a snapshot of other sizes allocates; release keeps only the last snapshot's buffers
    third = stage_to_host({"x": torch.ones(3)}, pool)
    pool.release(third.buffers)
    assert pool.nbytes == 12


def test_lone_non_contiguous_tensors_keep_their_strides_as_the_sync_save_does():
    base = torch.arange(12.0).reshape(3, 4)
    thin = torch.arange(64.0).reshape(8, 8)[:, ::8]  # spread over 8x its bytes: copied densely
    state = {"t": base.t(), "perm": torch.arange(24.0).reshape(2, 3, 4).permute(2, 0, 1),
             "expanded": torch.tensor([1.0, 2.0]).expand(3, 2), "thin": thin}
    staged = stage_to_host(state).state
    for key in ("t", "perm", "expanded"):
        assert staged[key].stride() == state[key].stride(), key
        assert torch.equal(staged[key], state[key]), key
        assert staged[key].untyped_storage().data_ptr() != state[key].untyped_storage().data_ptr()
    assert staged["thin"].is_contiguous() and torch.equal(staged["thin"], thin)
    base[0, 0] = 99.0  # the snapshot is a copy taken at the call
    assert staged["t"][0, 0] == 0.0
