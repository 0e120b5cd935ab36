"""Backends the conformance suite runs against.

Each entry of BACKENDS is a context-manager factory ``make(tmp_path) -> Storage``
whose storage is rooted at a fresh, empty location.  Add a backend here and the
whole suite in test_conformance.py runs against it.
"""

import contextlib
import uuid

import pytest

from xla_ckpt.storage import StorageConfig
from xla_ckpt.storage.local import LocalStorage


@pytest.fixture
def stem(gcs_emulator):
    """A fresh object-name prefix in the emulator's bucket (``t-<12 hex>``), deleted after
    the test; a test module may override it to fill the prefix first."""
    s = f"t-{uuid.uuid4().hex[:12]}"
    yield s
    gcs_emulator.delete_prefix(s + "/")


SMALL = StorageConfig(max_workers=4, slice_size_bytes=1024, retry_deadline_s=10.0)


@contextlib.contextmanager
def _local(tmp_path, request):
    root = tmp_path / "local-root"
    with LocalStorage(str(root), SMALL) as st:
        yield st


GCS_SMALL = StorageConfig(max_workers=4, slice_size_bytes=1024, retry_deadline_s=10.0,
                          initial_backoff_s=0.001, max_backoff_s=0.01,
                          parallel_upload_threshold_bytes=100_000, upload_part_size_bytes=64 * 1024)


@contextlib.contextmanager
def _gcs(tmp_path, request):
    """GCS on the emulator (objects of >= 100 kB go up as composed parts)."""
    emu = request.getfixturevalue("gcs_emulator")
    stem = f"conformance-{uuid.uuid4().hex[:12]}"
    with emu.storage(stem, GCS_SMALL) as st:
        yield st
    emu.delete_prefix(stem + "/")


@contextlib.contextmanager
def _gcs_faulty(tmp_path, request):
    """GCS through the fault proxy: seeded random 503/429/resets/short bodies, ~20% of requests."""
    from xla_ckpt.testing.fault_proxy import Fault, FaultProxy

    emu = request.getfixturevalue("gcs_emulator")
    stem = f"conformance-{uuid.uuid4().hex[:12]}"
    with FaultProxy(emu.host, seed=len(request.node.name)) as proxy:
        proxy.random_faults(0.2, [Fault.error(503), Fault.error(429, retry_after=0),
                                  Fault.reset(rst=True), Fault.reset(rst=False), Fault.short()])
        with proxy.storage(emu.uri(stem), GCS_SMALL) as st:
            yield st
    emu.delete_prefix(stem + "/")


BACKENDS = {"local": _local, "gcs": _gcs, "gcs-faulty": _gcs_faulty}


@pytest.fixture(params=sorted(BACKENDS))
def storage(request, tmp_path):
    with BACKENDS[request.param](tmp_path, request) as st:
        yield st
