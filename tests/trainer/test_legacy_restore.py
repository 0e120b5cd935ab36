"""C4 at the trainer level: a fairseq ``.pt`` restores through the allow-list, never unsafe
unpickling."""

import argparse
import os

import numpy as np
import pytest
import torch
from trainer_utils import make_checkpointer, train_step

from xla_ckpt.errors import UnsafePickleError
from xla_ckpt.testing.asserts import assert_state_identical


class NotAllowed:
    """Any class outside the allow-list; unpickling it could run code."""


def fairseq_file(path: str, **extra) -> dict:
    """A fairseq-layout checkpoint written with torch.save, as fairseq's Trainer does."""
    ckpt = make_checkpointer(0)
    for step in range(2):
        train_step(ckpt, step)
    state = {
        "args": argparse.Namespace(lr=0.1, arch="tiny_transformer", seed=np.int64(1)),
        "model": ckpt.model.state_dict(),
        "criterion": ckpt.criterion.state_dict(),
        "optimizer_history": [{"criterion_name": "TemperatureMSE", "optimizer_name": "AdamW",
                               "lr_scheduler_state": ckpt.lr_scheduler.state_dict(),
                               "num_updates": np.int64(2)}],
        "last_optimizer_state": ckpt.optimizer.state_dict(),
        "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 2, "version": 2},
                        "best_loss": np.float64(1.5), "step": np.int64(2), **extra},
    }
    torch.save(state, path)
    return state


def test_fairseq_pt_restores_weights_optimizer_and_python_numbers(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    saved = fairseq_file(path)
    fresh = make_checkpointer(7)
    extra = fresh.load_checkpoint(path)
    assert_state_identical(fresh.model.state_dict(), saved["model"])
    assert_state_identical(fresh.criterion.state_dict(), saved["criterion"])
    assert_state_identical(fresh.optimizer.state_dict()["state"],
                           saved["last_optimizer_state"]["state"])
    assert fresh.get_num_updates() == 2 and type(fresh.get_num_updates()) is int
    assert (type(extra["best_loss"]), extra["best_loss"]) == (float, 1.5)
    assert (type(extra["step"]), extra["step"]) == (int, 2)
    assert extra["train_iterator"] == {"epoch": 1, "iterations_in_epoch": 2, "version": 2}
    assert fresh.lr_scheduler.last_epoch == 2


def test_fairseq_pt_with_a_class_outside_the_allow_list_is_refused(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    fairseq_file(path, sampler=NotAllowed())
    fresh = make_checkpointer(7)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(UnsafePickleError) as e:
        fresh.load_checkpoint(path)
    assert str(e.value).startswith(
        f"{path}: refusing to unpickle global test_legacy_restore.NotAllowed: outside the "
        "allow-list of xla_ckpt.format.legacy")
    assert_state_identical(dict(fresh.model.state_dict()), before)  # nothing was applied


def test_missing_pt_file_is_no_checkpoint(tmp_path):
    fresh = make_checkpointer(7)
    assert fresh.load_checkpoint(os.path.join(tmp_path, "checkpoint_last.pt")) is None
