"""Helpers for the ``xla-ckpt`` command tests: training states, run folders, byte flips."""

import argparse

import numpy as np
import torch

import xla_ckpt
from xla_ckpt.run.catalog import write_pointer
from xla_ckpt.storage import open_storage


def training_state(seed: int = 0, num_updates: int = 100) -> dict:
    """A small fairseq-layout training state (what the trainer saves)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.98))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {
        "args": argparse.Namespace(lr=[0.01], arch="tiny"),
        "cfg": None,
        "model": model.state_dict(),
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion",
                               "optimizer_name": "AdamW",
                               "lr_scheduler_state": {"best": 1.5, "last_epoch": 2},
                               "num_updates": num_updates}],
        "last_optimizer_state": opt.state_dict(),
        "extra_state": {"train_iterator": {"epoch": 2, "iterations_in_epoch": 7, "version": 2},
                        "previous_training_time": 12.5, "val_loss": np.float64(1.25),
                        "metrics": {"train": {}}},
    }


def make_run(root: str, specs, *, last=None, best=None, incomplete=()) -> dict:
    """Save one checkpoint per ``(name, num_updates, epoch, loss)`` under ``root``; set pointers."""
    states = {}
    for name, updates, epoch, loss in specs:
        state = training_state(seed=updates, num_updates=updates)
        xla_ckpt.save(state, f"{root}/{name}", metadata={
            "num_updates": updates, "epoch": epoch, "iterations_in_epoch": 7, "loss": loss})
        states[name] = state
    with open_storage(root) as run:
        if last:
            write_pointer(run, "last", last)
        if best:
            write_pointer(run, "best", best)
        for name in incomplete:
            run.write_atomic(f"{name}/data-0123456789ab-state.safetensors", [b"\0" * 64])
    return states


def flip_byte(folder_uri: str, name: str, offset: int) -> None:
    """Flip one bit of object ``name`` at ``offset`` (rewrites the object; any backend)."""
    with open_storage(folder_uri) as st:
        data = bytearray(st.read_bytes(name))
        data[offset] ^= 0x01
        st.write_atomic(name, [bytes(data)])


def exists(uri: str, name: str) -> bool:
    with open_storage(uri) as st:
        return st.exists(name)


def listing(uri: str) -> list:
    with open_storage(uri) as st:
        return st.list("")
