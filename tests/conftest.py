"""Shared test set-up: XLA on CPU, quiet logs, deterministic torch."""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def local_dir(tmp_path):
    """A fresh local folder (as a string path)."""
    d = tmp_path / "store"
    d.mkdir()
    return str(d)


pytest_plugins = ["xla_ckpt.testing.pytest_plugin"]
