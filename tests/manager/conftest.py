"""Fixtures for the CheckpointManager tests (helpers live in manager_helpers.py)."""

import threading

import pytest
from manager_helpers import FailingWrites, HeldWrites


@pytest.fixture
def held_storage_cls():
    """A HeldWrites subclass with fresh events; released at teardown so no thread is left."""
    release = threading.Event()
    cls = type("Held", (HeldWrites,), {"release": release, "started": []})
    yield cls
    release.set()


@pytest.fixture
def failing_storage_cls():
    return type("Failing", (FailingWrites,), {"fail_in": set()})


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    return str(d)
