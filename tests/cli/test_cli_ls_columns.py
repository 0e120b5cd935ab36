"""``xla-ckpt ls`` columns for every kind of saver: the manager, the fairseq-style Checkpointer,
plain ``xla_ckpt.save`` (with and without metadata, under the manager's names or others)."""

import json

import torch

import xla_ckpt
from xla_ckpt.io.names import name_fields
from xla_ckpt.manager import CheckpointConfig, CheckpointManager
from xla_ckpt.trainer import Checkpointer


def _rows(out: str) -> dict[str, list[str]]:
    lines = out.splitlines()
    assert lines[1].split() == ["NAME", "EPOCH", "STEP", "ITER", "LOSS", "SIZE", "SAVED",
                                "(UTC)", "POINTERS"]
    rows = {}
    for ln in lines[2:]:
        if not ln.startswith("checkpoint") and not ln.startswith("plain"):
            break
        parts = ln.split()
        # NAME EPOCH STEP ITER LOSS SIZE(2) SAVED(2) [POINTERS]
        rows[parts[0]] = parts[1:5] + [parts[9] if len(parts) > 9 else ""]
    return rows


def test_ls_shows_epoch_and_step_for_the_manager_checkpointer_and_plain_saves(cli, root):
    cfg = CheckpointConfig(save_dir=root, handle_sigterm=False, async_save=False,
                           save_interval_epochs=0)
    with CheckpointManager(cfg) as mgr:
        mgr.save({"w": torch.ones(3)}, epoch=1, num_updates=4, metrics={"loss": 0.5})
        mgr.save({"w": torch.zeros(3)}, epoch=2, num_updates=8)
    model = torch.nn.Linear(2, 2)
    ck = Checkpointer(model=model, build_optimizer=lambda p: torch.optim.AdamW(p))
    ck.save_checkpoint(f"{root}/checkpoint_3_12", extra_state={
        "train_iterator": {"epoch": 3, "iterations_in_epoch": 5, "version": 2},
        "val_loss": 1.25})
    xla_ckpt.save({"w": torch.ones(2)}, f"{root}/plain")
    xla_ckpt.save({"w": torch.ones(2)}, f"{root}/checkpoint_4_20")
    xla_ckpt.save({"w": torch.ones(2)}, f"{root}/checkpoint5")
    xla_ckpt.save({"w": torch.ones(2)}, f"{root}/plain_step", metadata={"step": 33})
    r = cli("ls", root)
    assert r.code == 0 and r.err == ""
    assert _rows(r.out) == {
        # the manager: epoch and step from its metadata, loss from its metrics, the pointers
        "checkpoint_1_4": ["1", "4", "-", "0.5", "best"],
        "checkpoint_2_8": ["2", "8", "-", "-", "last"],
        # the Checkpointer: num_updates (0: no optimizer step yet), iterations, val_loss
        "checkpoint_3_12": ["3", "0", "5", "1.25", ""],
        # plain saves: the manager's names give epoch (and step); a `step` metadata is the step
        "checkpoint_4_20": ["4", "20", "-", "-", ""],
        "checkpoint5": ["5", "-", "-", "-", ""],
        "plain": ["-", "-", "-", "-", ""],
        "plain_step": ["-", "33", "-", "-", ""],
    }
    doc = json.loads(cli("ls", root, "--json").out)
    by = {c["name"]: c for c in doc["committed"]}
    assert [(by[n]["epoch"], by[n]["step"], by[n]["num_updates"], by[n]["iterations_in_epoch"])
            for n in ("checkpoint_1_4", "checkpoint_3_12", "checkpoint_4_20", "plain")] == [
        (1, 4, 4, None), (3, 0, 0, 5), (4, 20, None, None), (None, None, None, None)]


def test_name_fields_reads_only_the_managers_names():
    assert name_fields("checkpoint_2_200") == (2, 200)
    assert name_fields("checkpoint7") == (7, None)
    for other in ("checkpoint_last", "checkpoint_1_2_3", "checkpoint", "ckpt_1_2", "plain"):
        assert name_fields(other) is None
