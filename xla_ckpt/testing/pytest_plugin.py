"""pytest fixtures for users and for our own tests (registered in tests/conftest.py).

Usable from any project: add ``pytest_plugins = ["xla_ckpt.testing.pytest_plugin"]``.

=================  ========  =====================================================
fixture            scope     what
=================  ========  =====================================================
``gcs_emulator``   session   a running :class:`~xla_ckpt.testing.gcs_emulator.GCSEmulator`
``gcs_uri``        function  a fresh ``gs://bucket/t-<random>`` prefix; the test's
                             environment points at the emulator
                             (``STORAGE_EMULATOR_HOST``), the prefix is deleted after
``gcs_env``        function  ``os.environ`` plus the emulator variables, for child
                             processes (``subprocess.run(..., env=gcs_env)``)
``fault_proxy``    function  a fresh :class:`~xla_ckpt.testing.fault_proxy.FaultProxy`
                             in front of the emulator; ``fault_proxy.storage(uri)``
                             gives a ``GCSStorage`` whose traffic goes through it,
                             ``fault_proxy.env()`` the variables for a child process
=================  ========  =====================================================

The emulator starts once per session, on first use, in a subprocess on a free
loopback port.
"""

from __future__ import annotations

import os
import uuid
from typing import Iterator

import pytest

from xla_ckpt.testing.fault_proxy import FaultProxy
from xla_ckpt.testing.gcs_emulator import GCSEmulator


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[GCSEmulator]:
    """The session's GCS emulator (one subprocess, one bucket, in memory)."""
    with GCSEmulator() as emu:
        yield emu


@pytest.fixture
def gcs_uri(gcs_emulator: GCSEmulator, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh, empty ``gs://`` prefix on the emulator; ``xla_ckpt.save/load`` reach it by URI."""
    for k, v in gcs_emulator.env().items():
        monkeypatch.setenv(k, v)
    stem = f"t-{uuid.uuid4().hex[:12]}"
    yield gcs_emulator.uri(stem)
    gcs_emulator.delete_prefix(stem + "/")


@pytest.fixture
def gcs_env(gcs_emulator: GCSEmulator) -> dict[str, str]:
    """Environment for a child process that uses the emulator."""
    return {**os.environ, **gcs_emulator.env()}


@pytest.fixture
def fault_proxy(gcs_emulator: GCSEmulator) -> Iterator[FaultProxy]:
    """A fresh fault-injecting proxy in front of the session's emulator (no shaping)."""
    with FaultProxy(gcs_emulator.host) as proxy:
        yield proxy
