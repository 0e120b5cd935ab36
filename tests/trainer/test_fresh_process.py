"""Done-when headline and C5 on the XLA device: restores in a fresh process, bitwise.

The saving side and the restoring side never share a process: the restoring
side is ``fresh_process_worker.py`` started with subprocess.
"""

import copy
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from trainer_utils import LR, inverse_sqrt, make_checkpointer, train_step, training_part

import xla_ckpt
from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.testing.asserts import assert_state_identical
from xla_ckpt.trainer import SingleProcessSaver

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fresh_process_worker.py")


def run_worker(mode: str, ckpt: str, out: str) -> None:
    env = dict(os.environ, PJRT_DEVICE="CPU", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, WORKER, mode, ckpt, out], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{mode} failed:\n{proc.stderr[-4000:]}"


class CapturingSaver(SingleProcessSaver):
    """The default saver, keeping a deep copy of exactly what it was given."""

    def __call__(self, state, uri, *, metadata, rank_state):
        self.captured = copy.deepcopy(state)
        return super().__call__(state, uri, metadata=metadata, rank_state=rank_state)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_full_training_state_round_trips_bitwise_in_a_fresh_process(tmp_path):
    uri, out = str(tmp_path / "checkpoint_2_3"), str(tmp_path / "out")
    saver = CapturingSaver()
    ckpt = make_checkpointer(0, saver=saver)
    for step in range(3):
        train_step(ckpt, step)
    extra = {"train_iterator": {"epoch": 2, "iterations_in_epoch": 3, "version": 2},
             "val_loss": np.float64(1.25), "best": np.float32(0.875), "seen": np.int64(12),
             "shuffled": np.bool_(True), "history": [(1, 2.5), (2, None)]}
    rng = torch.get_rng_state()
    ckpt.save_checkpoint(uri, extra, rank_extra_state={"rng": rng})
    torch.set_rng_state(rng)
    train_step(ckpt, 3)  # the uninterrupted run
    expected_after = copy.deepcopy(training_part(ckpt))

    run_worker("restore-tiny", uri, out)
    got = xla_ckpt.load(out)

    saved = saver.captured
    assert type(saved["args"].betas) is tuple and type(saved["args"].seed) is np.int64
    assert_state_identical(got["raw"], saved)  # every value and type, as saved
    assert_state_identical(got["extra"], {**saved["extra_state"], "rng": rng})
    assert_state_identical(got["after"], expected_after)  # one step after restore, bitwise
    assert got["wps_after_restore"] == (0, 0)  # TimeMeters restart
    assert got["lr"] == LR * inverse_sqrt(4)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_c5_c1_optimizer_state_on_the_xla_device_in_a_fresh_process(tmp_path):
    uri, ref, out = (str(tmp_path / n) for n in ("ckpt", "ref", "out"))
    run_worker("xla-train", uri, ref)
    assert_c1_host_data(uri)
    run_worker("xla-restore", uri, out)
    expected = xla_ckpt.load(ref)["expected"]
    got = xla_ckpt.load(out)
    want_placement = {
        "holds_live": True,
        "moments": {
            "0.step": ("cpu", [], "xla:0", [2, 2]),
            "0.exp_avg": ("xla:0", [2, 2], "xla:0", [2, 2]),
            "0.exp_avg_sq": ("xla:0", [2, 2], "xla:0", [2, 2]),
            "1.step": ("cpu", [], "xla:0", [2]),
            "1.exp_avg": ("xla:0", [2], "xla:0", [2]),
            "1.exp_avg_sq": ("xla:0", [2], "xla:0", [2]),
        },
    }
    assert got["placement"] == want_placement
    assert_state_identical(got["after"], expected)
    # C11 on the target device: a meta-device model is materialised on xla:0 with real values.
    assert got["meta_device"] == "xla:0"
    assert got["meta_placement"] == want_placement
    assert_state_identical(got["after_meta"], expected)


def assert_c1_host_data(uri: str) -> None:
    """C1: the checkpoint saved from xla:0 tensors records no device and loads on CPU."""
    manifest = open(os.path.join(uri, MANIFEST_NAME), encoding="utf-8").read()
    assert "xla:" not in manifest and "device" not in manifest
    state = xla_ckpt.load(uri)
    tensors = [state["model"]["weight"], state["model"]["bias"],
               *state["last_optimizer_state"]["state"][0].values()]
    assert {t.device.type for t in tensors} == {"cpu"}
    on_meta = xla_ckpt.load(uri, map_location="meta")  # placed only after a CPU read
    assert on_meta["model"]["weight"].device.type == "meta"
