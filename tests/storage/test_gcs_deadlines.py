"""Every GCS request has a total deadline (issue 25, defect 9: "a read that makes slow progress
has no total deadline").

A server that sends a few bytes per answer keeps every socket read within its timeout, so only a
total deadline ends the request: ``StorageConfig.request_deadline_s``.  The fault proxy trickles
the answer (``Fault.trickle``: a few bytes every 50 ms, for ever at that pace) in front of the
real emulator; each kind of request -- a ranged read, a whole-object read, a listing, a metadata
call, a checkpoint load -- ends in one :class:`StorageDeadlineError` naming the request (object,
byte range), the bytes that arrived, the deadline and the setting to raise.  The bounds on
elapsed time here only catch a hang (the trickles would run for minutes).
"""

import os
import re
import time
from typing import Any

import pytest
import torch

import xla_ckpt
from xla_ckpt.errors import ConfigError, StorageDeadlineError
from xla_ckpt.storage import StorageConfig
from xla_ckpt.testing.fault_proxy import Fault, downloads, requests_to

FAST: dict[str, Any] = dict(initial_backoff_s=0.001, max_backoff_s=0.01, retry_deadline_s=30.0)
NO_HANG_S = 20.0  # the trickles below would take minutes to finish; the deadlines are 1-2 s


def cfg(deadline_s, **kw):
    return StorageConfig(max_workers=4, slice_size_bytes=1 << 20, request_deadline_s=deadline_s,
                         **FAST, **kw)



def _deadline_error(fn):
    t0 = time.monotonic()
    with pytest.raises(StorageDeadlineError) as ei:
        fn()
    assert time.monotonic() - t0 < NO_HANG_S
    return ei.value


@pytest.mark.parametrize("offset, n, deadline_s, step, after", [
    (0, 65536, 1.5, 4, 1000),          # the case: a few bytes per answer
    (4096, 20000, 1.0, 1, 0),          # another range: one byte at a time from the first
])
def test_a_trickling_ranged_read_ends_at_its_deadline_naming_range_bytes_and_setting(
        fault_proxy, gcs_emulator, stem, offset, n, deadline_s, step, after):
    data = os.urandom(100_000)
    with gcs_emulator.storage(stem) as direct:
        info = direct.write_atomic("obj", [data])
    fault_proxy.inject(Fault.trickle(step, 0.05, after_bytes=after), match=downloads("obj"),
                       times=1000)
    with fault_proxy.storage(gcs_emulator.uri(stem), cfg(deadline_s)) as st:
        out = bytearray(n)
        e = _deadline_error(lambda: st.read_range("obj", offset, memoryview(out),
                                                  info.generation))
    got = e.received_bytes
    assert after < got < n  # the first bytes came at full speed, the rest trickled
    assert bytes(out[:got]) == data[offset:offset + got]   # what arrived is kept, and right
    text = str(e)
    assert text.startswith(f"read gs://{gcs_emulator.bucket}/{stem}/obj bytes "
                           f"[{offset}, {offset + n}) (generation {info.generation}): ")
    assert (f"not finished within its total deadline of {deadline_s:g} s "
            "(storage.request_deadline_s; retries and slow answers included)") in text
    assert f"; {got} of the {n} bytes asked for arrived." in text
    assert "raise storage.request_deadline_s" in text
    assert e.deadline_s == deadline_s
    assert [r.fault for r in fault_proxy.records(downloads("obj"))][:1] == ["trickle"]


def test_a_trickling_whole_object_read_ends_at_its_deadline(fault_proxy, gcs_emulator, stem):
    with gcs_emulator.storage(stem) as direct:
        direct.write_atomic("pointer.json", [b"{" + b" " * 5000 + b"}"])
    fault_proxy.inject(Fault.trickle(2, 0.05), match=downloads("pointer.json"), times=1000)
    with fault_proxy.storage(gcs_emulator.uri(stem), cfg(1.0)) as st:
        e = _deadline_error(lambda: st.read_bytes("pointer.json"))
    text = str(e)
    assert text.startswith(f"read gs://{gcs_emulator.bucket}/{stem}/pointer.json: not finished "
                           "within its total deadline of 1 s (storage.request_deadline_s;")
    assert "raise storage.request_deadline_s" in text


@pytest.mark.parametrize("what", ["list", "stat"])
def test_a_trickling_listing_or_metadata_answer_ends_at_its_deadline(fault_proxy, gcs_emulator,
                                                                     stem, what):
    with gcs_emulator.storage(stem) as direct:
        for i in range(20):
            direct.write_atomic(f"d/obj-{i:03d}", [b"x" * i])
    if what == "list":
        match = requests_to(method="GET", path_regex=r"/b/[^/]+/o$")
    else:
        match = requests_to("obj-007", method="GET", path_regex=r"^/storage/v1/")
    fault_proxy.inject(Fault.trickle(3, 0.05), match=match, times=1000)
    with fault_proxy.storage(gcs_emulator.uri(stem), cfg(1.0)) as st:
        call = (lambda: st.list("d")) if what == "list" else (lambda: st.stat("d/obj-007"))
        e = _deadline_error(call)
    text = str(e)
    where = f"gs://{gcs_emulator.bucket}/{stem}/d" + ("/obj-007" if what == "stat" else "")
    assert text.startswith(f"{what} {where}: not finished within its total deadline of 1 s "
                           "(storage.request_deadline_s;")
    assert [r.fault for r in fault_proxy.records(match)][:1] == ["trickle"]


def test_a_checkpoint_load_whose_data_trickles_fails_at_the_deadline(fault_proxy, gcs_emulator,
                                                                     stem, monkeypatch):
    state = {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(7)}
    uri = gcs_emulator.uri(f"{stem}/ck")
    with gcs_emulator.storage() as direct:
        xla_ckpt.save(state, uri, storage=direct.child(f"{stem}/ck"))
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fault_proxy.url)
    fault_proxy.inject(Fault.trickle(8, 0.05, after_bytes=4096), match=downloads("data-"),
                       times=1000)
    e = _deadline_error(lambda: xla_ckpt.load(uri, config=cfg(2.0)))
    m = re.search(r"^read (gs://\S+/data-[0-9a-f]{12}-state\.safetensors) bytes \[(\d+), (\d+)\)",
                  str(e))
    assert m is not None, str(e)
    assert m.group(1).startswith(uri + "/")
    assert "(storage.request_deadline_s;" in str(e) and e.deadline_s == 2.0
    fault_proxy.clear_faults()
    got = xla_ckpt.load(uri, config=cfg(30.0))   # no trickle: the same load is whole
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "10", True])
def test_request_deadline_must_be_a_finite_positive_number(bad):
    with pytest.raises(ConfigError, match="storage.request_deadline_s must be a finite number"):
        StorageConfig(request_deadline_s=bad)
