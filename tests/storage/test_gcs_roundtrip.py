"""A full fairseq-style training state round-trips bitwise through gs:// (the emulator), read back
in a fresh process: dtypes, aliasing, views, Namespace, numpy scalars, typed containers."""

import argparse
import os
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest
import torch

import xla_ckpt
from xla_ckpt.testing.asserts import assert_state_identical


def training_state():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(50, 16, generator=g)
    base = torch.randn(10, generator=g)
    model = OrderedDict()
    model["encoder.embed.weight"] = emb
    model["decoder.embed.weight"] = emb                   # tied weights: one tensor twice
    model["decoder.out.bias"] = base[2:]                  # a view into another tensor's storage
    model["decoder.out.bias_full"] = base
    model["layer.weight_t"] = torch.randn(8, 4, generator=g).t()   # non-contiguous
    model["layer.bf16"] = torch.randn(7, 3, generator=g).to(torch.bfloat16)
    model["layer.fp16"] = torch.randn(5, generator=g).half()
    model["norm.num_batches_tracked"] = torch.tensor(17)
    model["mask"] = torch.tensor([True, False, True])
    model["bytes"] = torch.arange(256, dtype=torch.uint8)
    model["empty"] = torch.empty(0, 3)
    model["special"] = torch.tensor([float("nan"), float("inf"), -0.0])
    model._metadata = OrderedDict(  # type: ignore[attr-defined]  # as torch's state_dict sets it
        [("", {"version": 1}), ("encoder", {"version": 2})])
    optimizer = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(50, 16, generator=g),
                      "exp_avg_sq": torch.rand(50, 16, generator=g)}},
        "param_groups": [{"lr": 5e-4, "betas": (0.9, 0.98), "eps": 1e-8, "weight_decay": 0.01,
                          "amsgrad": False, "foreach": None, "params": [0, 1]}],
    }
    return {
        "args": argparse.Namespace(arch="transformer", lr=[0.25], max_tokens=4096, fp16=True,
                                   seed=1, update_freq=(1,)),
        "model": model,
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion",
                               "optimizer_name": "FairseqAdam",
                               "lr_scheduler_state": {"best": 2.5, "_last_lr": [5e-4]},
                               "num_updates": 1000}],
        "last_optimizer_state": optimizer,
        "extra_state": {
            "train_iterator": {"epoch": 3, "iterations_in_epoch": 17, "version": 2,
                               "shuffle": True},
            "previous_training_time": 1234.5,
            "val_loss": np.float64(2.25), "best": np.float32(2.5), "num_updates": np.int64(1000),
            "metrics": {"train": [("loss", {"val": 2.5, "count": 3})]},
            "rng": torch.Generator().manual_seed(5).get_state(),
        },
        "misc": {"none": None, "tuple": (1, 2.0, "3"), "big": 2 ** 70, "inf": float("inf"),
                 "set": {1, 2}, "bytes": b"\x00\xff", "dtype": torch.bfloat16,
                 "device": torch.device("cpu"), 3: "int key"},
    }


def check_aliasing(state):
    m = state["model"]
    assert m["decoder.embed.weight"] is m["encoder.embed.weight"] or (
        m["decoder.embed.weight"].data_ptr() == m["encoder.embed.weight"].data_ptr())
    full, view = m["decoder.out.bias_full"], m["decoder.out.bias"]
    assert view.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
    assert view.storage_offset() - full.storage_offset() == 2
    assert m._metadata == OrderedDict([("", {"version": 1}), ("encoder", {"version": 2})])


CHILD = r"""
import sys
sys.path.insert(0, sys.argv[3])
import torch
torch.set_num_threads(1)
import xla_ckpt
from xla_ckpt.testing.asserts import assert_state_identical
from test_gcs_roundtrip import check_aliasing, training_state
loaded = xla_ckpt.load(sys.argv[1])
assert_state_identical(loaded, training_state())
check_aliasing(loaded)
xla_ckpt.save(loaded, sys.argv[2], metadata={"num_updates": 1001})
print("OK")
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_full_training_state_round_trips_bitwise_through_gs_in_a_fresh_process(gcs_uri, gcs_env):
    state = training_state()
    xla_ckpt.save(state, gcs_uri + "/checkpoint_1", metadata={"num_updates": 1000})
    env = {**gcs_env, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", CHILD, gcs_uri + "/checkpoint_1",
                        gcs_uri + "/checkpoint_2", os.path.dirname(__file__)],
                       env=env, capture_output=True, text=True, timeout=230)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.strip().splitlines()[-1] == "OK"
    back = xla_ckpt.load(gcs_uri + "/checkpoint_2")   # written by the child, read here
    assert_state_identical(back, state)
    check_aliasing(back)
