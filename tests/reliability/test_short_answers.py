"""A short answer to a whole-object read is a transient fault, not corruption.

Found by the faults-under-load run: 1 round in ~50 failed at a 12 % fault
rate with ``IntegrityError: .../manifest.json: crc32c ... differs ... after 3
reads; the object or the network path corrupts data``.  The cause: small
objects (manifests, pointers) are read in one un-ranged GET, and a body cut
short with a matching ``Content-Length`` (what ``Fault.short`` sends) was
taken for the whole object, so its crc32c "mismatched"; three such answers
in a row made a healthy object look corrupt.  Ranged reads never had the
problem (``Content-Range`` tells them what is missing; they resume).
"""

from __future__ import annotations

import pytest

from xla_ckpt.api import save
from xla_ckpt.comm import SingleProcess
from xla_ckpt.restore import restore
from xla_ckpt.testing.asserts import assert_state_identical
from xla_ckpt.testing.fault_proxy import Fault, downloads

pytestmark = pytest.mark.timeout(120)


def _state():
    import torch

    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(1000, generator=g), "step": 3, "lr": 0.25}


@pytest.mark.parametrize("drop", [1, 100, None])
def test_short_answers_to_a_manifest_read_are_resumed(gcs_uri, fault_proxy, drop):
    save(_state(), gcs_uri)
    stem = gcs_uri.split("/", 3)[3]
    good = fault_proxy.storage(gcs_uri).read_bytes("manifest.json")
    # Three short answers in a row: as many as the old code tolerated before giving up.
    fault_proxy.inject(Fault.short(drop), match=downloads("manifest.json"), times=3)
    st = fault_proxy.storage(gcs_uri)
    assert st.read_bytes("manifest.json") == good
    assert fault_proxy.pending_faults() == 0
    shorts = [r for r in fault_proxy.records(downloads(f"{stem}/manifest.json"))
              if r.fault == "short"]
    assert len(shorts) == 3
    st.close()


def test_restore_through_short_answers_is_bitwise(gcs_uri, fault_proxy, monkeypatch):
    save(_state(), gcs_uri)
    fault_proxy.inject(Fault.short(), match=downloads("manifest.json"), times=5)
    for k, v in fault_proxy.env().items():
        monkeypatch.setenv(k, v)
    r = restore(gcs_uri, dist=SingleProcess())
    assert_state_identical(r.state, _state())
    assert fault_proxy.pending_faults() == 0
