"""Checkpoint names and the save schedule follow fairseq checkpoint_utils.save_checkpoint."""

import pytest

from xla_ckpt.manager import (
    CheckpointConfig,
    checkpoint_kind,
    epoch_checkpoint_name,
    scheduled_name,
    update_checkpoint_name,
)
from xla_ckpt.manager.naming import preemption_name


def names(cfg, updates_per_epoch, epochs):
    out, n = [], 0
    for epoch in range(1, epochs + 1):
        for i in range(updates_per_epoch):
            n += 1
            name = scheduled_name(cfg, epoch=epoch, num_updates=n,
                                  end_of_epoch=i == updates_per_epoch - 1)
            if name:
                out.append(name)
    return out


def test_names_and_kinds():
    assert epoch_checkpoint_name(3) == "checkpoint3"
    assert update_checkpoint_name(2, 1500) == "checkpoint_2_1500"
    assert [checkpoint_kind(n) for n in ("checkpoint3", "checkpoint_2_1500", "checkpoint_last",
                                         "checkpoint_best", "my-export", "checkpoint_1")] == \
        ["epoch", "update", None, None, None, None]


def test_interval_updates_and_epoch_end():
    cfg = CheckpointConfig(save_interval_updates=2)
    # update 4 and 8 end an epoch: fairseq writes the epoch checkpoint there instead
    assert names(cfg, 4, 2) == ["checkpoint_1_2", "checkpoint1", "checkpoint_2_6", "checkpoint2"]


def test_save_interval_epochs_and_no_epoch_checkpoints():
    assert names(CheckpointConfig(save_interval_epochs=2), 2, 4) == ["checkpoint2", "checkpoint4"]
    assert names(CheckpointConfig(no_epoch_checkpoints=True, save_interval_updates=3), 2, 3) == \
        ["checkpoint_2_3"]
    assert names(CheckpointConfig(save_interval_epochs=0), 2, 2) == []


def test_no_save_disables_everything():
    assert names(CheckpointConfig(no_save=True, save_interval_updates=1), 3, 2) == []


@pytest.mark.parametrize("kw,end,expected", [
    ({}, False, "checkpoint_1_7"),
    ({}, True, "checkpoint1"),
    ({"save_interval_epochs": 2}, True, "checkpoint_1_7"),
])
def test_preemption_name(kw, end, expected):
    cfg = CheckpointConfig(**kw)
    assert preemption_name(cfg, epoch=1, num_updates=7, end_of_epoch=end) == expected
