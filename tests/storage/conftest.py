"""Backends the conformance suite runs against.

Each entry of BACKENDS is a context-manager factory ``make(tmp_path) -> Storage``
whose storage is rooted at a fresh, empty location.  Add a backend here and the
whole suite in test_conformance.py runs against it.
"""

import contextlib

import pytest

from xla_ckpt.storage import StorageConfig
from xla_ckpt.storage.local import LocalStorage

SMALL = StorageConfig(max_workers=4, slice_size_bytes=1024, retry_deadline_s=10.0)


@contextlib.contextmanager
def _local(tmp_path, request):
    root = tmp_path / "local-root"
    with LocalStorage(str(root), SMALL) as st:
        yield st


BACKENDS = {"local": _local}


@pytest.fixture(params=sorted(BACKENDS))
def storage(request, tmp_path):
    with BACKENDS[request.param](tmp_path, request) as st:
        yield st
