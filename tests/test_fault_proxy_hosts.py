"""The fault proxy's emulated hosts: per-source-address counting, shaping and fault targeting.

Emulated host ``h`` binds its client sockets to 127.0.0.(10+h).  Real clients (the
google-cloud-storage client, xla_ckpt's GCSStorage, a plain http.client connection) talk to
the emulator through the proxy; the proxy must count each host's bytes apart and shape each
host's link apart.  The shaping schedule itself is checked on an injected clock (no timing).
"""

from __future__ import annotations

import http.client
import io
import uuid
from typing import Any, Iterator
from urllib.parse import quote

import pytest

from xla_ckpt.testing.fault_proxy import (
    Fault,
    FaultProxy,
    MiB,
    Shaping,
    bind_session,
    downloads,
    from_address,
    host_address,
)
from xla_ckpt.testing.fault_proxy.shaping import _Shaper
from xla_ckpt.testing.gcs_emulator import GCSEmulator

H0, H1, H2 = host_address(0), host_address(1), host_address(2)
BODY = bytes(range(256)) * 1024  # 256 KiB


@pytest.fixture
def stem(gcs_emulator: GCSEmulator) -> Iterator[str]:
    s = f"hosts-{uuid.uuid4().hex[:12]}"
    with gcs_emulator.storage(s) as st:
        st.write_atomic("blob", [BODY])
    yield s
    gcs_emulator.delete_prefix(s + "/")


def _gcs_client(proxy: FaultProxy, address: str) -> Any:
    """The real google-cloud-storage client, its connections bound to ``address``."""
    from google.auth.credentials import AnonymousCredentials
    from google.auth.transport.requests import AuthorizedSession
    from google.cloud import storage as gcs

    session = bind_session(AuthorizedSession(AnonymousCredentials()), address)
    return gcs.Client(project="test", credentials=AnonymousCredentials(), _http=session,
                      client_options={"api_endpoint": proxy.url})


def test_host_addresses() -> None:
    assert (H0, H1, host_address(244)) == ("127.0.0.10", "127.0.0.11", "127.0.0.254")
    for bad in (-1, 245, True, 1.0):
        with pytest.raises(ValueError, match="emulated host id"):
            host_address(bad)  # type: ignore[arg-type]  # wrong types on purpose


def test_gcs_clients_of_two_hosts_are_counted_and_shaped_apart(
        fault_proxy: FaultProxy, gcs_emulator: GCSEmulator, stem: str) -> None:
    fault_proxy.shaping = Shaping(host_mib_s=1024, stream_mib_s=1024)
    name = f"{stem}/blob"
    c0, c1 = _gcs_client(fault_proxy, H0), _gcs_client(fault_proxy, H1)
    whole = c0.bucket(gcs_emulator.bucket).blob(name).download_as_bytes()
    part = c1.bucket(gcs_emulator.bucket).blob(name).download_as_bytes(
        start=1000, end=1000 + 4095)
    assert whole == BODY and part == BODY[1000:5096]
    by_address = fault_proxy.bytes_served_by_address()
    media = {a: sum(r.body_bytes for r in fault_proxy.records(downloads(name))
                    if r.client_address == a) for a in (H0, H1)}
    assert media == {H0: len(BODY), H1: 4096}
    assert set(by_address) == {H0, H1}  # nothing came from 127.0.0.1
    assert by_address[H0] >= len(BODY) and by_address[H1] >= 4096  # + metadata answers
    assert sum(by_address.values()) == fault_proxy.snapshot().bytes_served
    # Each host's bytes went through its own link's schedule, and only its own.
    assert dict(fault_proxy._shaper.scheduled_bytes) == by_address
    snap = fault_proxy.snapshot()
    assert snap.bytes_by_address == by_address and set(snap.connections_by_address) == {H0, H1}


def test_xla_ckpt_storage_and_http_client_from_host_addresses(
        fault_proxy: FaultProxy, gcs_emulator: GCSEmulator, stem: str) -> None:
    with fault_proxy.storage(gcs_emulator.uri(stem), source_address=H1) as st:
        out = bytearray(8192)
        st.read_range("blob", 100, memoryview(out))
    assert bytes(out) == BODY[100:8292]
    path = (f"/download/storage/v1/b/{gcs_emulator.bucket}/o/{quote(stem + '/blob', safe='')}"
            "?alt=media")
    conn = http.client.HTTPConnection("127.0.0.1", fault_proxy.port, timeout=30,
                                      source_address=(H2, 0))
    try:
        conn.request("GET", path, headers={"Range": "bytes=0-511"})
        resp = conn.getresponse()
        assert resp.status == 206 and resp.read() == BODY[:512]
    finally:
        conn.close()
    media = {r.client_address: r.body_bytes for r in fault_proxy.records(downloads("blob"))}
    assert media == {H1: 8192, H2: 512}
    assert fault_proxy.bytes_served_by_address()[H2] == 512


def test_faults_target_one_host(fault_proxy: FaultProxy, gcs_emulator: GCSEmulator,
                                stem: str) -> None:
    """A fault rule for host 1's downloads leaves host 0's alone; a stall keeps the body whole."""
    fault_proxy.inject(Fault.error(404), match=from_address(H1, downloads("blob")))
    fault_proxy.inject(Fault.stall(0.05, after_bytes=1000), match=from_address(H0, downloads()))
    name = f"{stem}/blob"
    c0, c1 = _gcs_client(fault_proxy, H0), _gcs_client(fault_proxy, H1)
    from google.api_core.exceptions import NotFound

    assert c0.bucket(gcs_emulator.bucket).blob(name).download_as_bytes() == BODY
    with pytest.raises(NotFound):
        c1.bucket(gcs_emulator.bucket).blob(name).download_as_bytes()
    faults = {(r.client_address, r.fault, r.status, r.body_bytes)
              for r in fault_proxy.records(downloads(name))}
    assert (H0, "stall", 200, len(BODY)) in faults
    assert any(a == H1 and f == "status_404" for a, f, _, _ in faults)
    assert fault_proxy.pending_faults() == 0


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_host_cap_schedules_each_address_apart() -> None:
    clock = _Clock()
    shaper = _Shaper(Shaping(host_mib_s=1.0), clock)
    assert shaper.wait_s(H0, MiB, stream_start=clock.t, stream_sent=0) == 0.0
    # The same host's next MiB waits for its link; another host's link is free.
    assert shaper.wait_s(H0, MiB, stream_start=clock.t, stream_sent=0) == pytest.approx(1.0)
    assert shaper.wait_s(H1, MiB, stream_start=clock.t, stream_sent=0) == 0.0
    clock.t += 2.0  # both links idle again: no credit is banked for the idle time
    assert shaper.wait_s(H0, MiB, stream_start=clock.t, stream_sent=0) == 0.0
    assert shaper.wait_s(H0, MiB, stream_start=clock.t, stream_sent=0) == pytest.approx(1.0)
    assert dict(shaper.scheduled_bytes) == {H0: 4 * MiB, H1: MiB}


def test_stream_host_and_total_caps_combine() -> None:
    clock = _Clock()
    shaper = _Shaper(Shaping(stream_mib_s=2.0, host_mib_s=4.0, total_mib_s=4.0), clock)
    t0 = clock.t
    # One stream of host 0: paced at 2 MiB/s (the stream cap binds, not the host's 4).
    assert shaper.wait_s(H0, MiB, stream_start=t0, stream_sent=0) == 0.0
    assert shaper.wait_s(H0, MiB, stream_start=t0, stream_sent=MiB) == pytest.approx(0.5)
    # Host 1 shares only the aggregate, booked until host 0's second MiB is through (0.75 s).
    assert shaper.wait_s(H1, MiB, stream_start=t0, stream_sent=0) == pytest.approx(0.75)
    # A new stream of host 0: its own link is free at 0.75 s, the aggregate only at 1.0 s.
    assert shaper.wait_s(H0, 2 * MiB, stream_start=t0, stream_sent=0) == pytest.approx(1.0)
    # Host 1's link is free at 1.0 s, but the aggregate is booked to 1.5 s.
    assert shaper.wait_s(H1, MiB, stream_start=t0, stream_sent=0) == pytest.approx(1.5)
    assert dict(shaper.scheduled_bytes) == {H0: 4 * MiB, H1: 2 * MiB}


def test_shaping_rejects_bad_caps() -> None:
    from xla_ckpt.errors import ConfigError

    with pytest.raises(ConfigError, match="shaping.host_mib_s must be > 0"):
        Shaping(host_mib_s=0)
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        Fault.stall(-1)


class _RecordingShaper(_Shaper):
    """The proxy's upload schedule on a frozen clock: each wait is recorded, none is slept."""

    def __init__(self, shaping: Shaping) -> None:
        self.clock = _Clock()
        super().__init__(shaping, self.clock)
        self.waits: list[tuple[str, int, float]] = []

    def wait_s(self, address: str, n: int, *, stream_start: float, stream_sent: int) -> float:
        w = super().wait_s(address, n, stream_start=stream_start, stream_sent=stream_sent)
        self.waits.append((address, n, w))
        return 0.0


def _upload_shaped(proxy: FaultProxy, shaping: Shaping) -> _RecordingShaper:
    proxy.shaping = shaping
    rec = _RecordingShaper(shaping)
    proxy._up_shaper = rec
    return rec


def _streams(waits: list[tuple[str, int, float]]) -> list[list[tuple[int, float]]]:
    """Split a frozen-clock record into streams: each request body restarts at wait 0."""
    out: list[list[tuple[int, float]]] = []
    for _a, n, w in waits:
        if w == 0.0:
            out.append([])
        out[-1].append((n, w))
    return out


def test_uploads_of_the_gcs_client_are_shaped_per_stream(
        fault_proxy: FaultProxy, gcs_emulator: GCSEmulator, stem: str) -> None:
    """Multipart and resumable uploads of the real client go through the upload schedule:
    every body byte is scheduled on host 1's address, each piece of a body paced at the
    stream cap (1 MiB/s: the k-th 256 KiB piece of a body may be read k * 0.25 s after its
    start), downloads' schedule untouched; the objects arrive whole."""
    rec = _upload_shaped(fault_proxy, Shaping(stream_mib_s=1.0, shape_uploads=True))
    data = bytes(range(256)) * (4 * 1024 + 3)  # 1 MiB + 768 bytes
    bucket = _gcs_client(fault_proxy, H1).bucket(gcs_emulator.bucket)
    bucket.blob(f"{stem}/multipart").upload_from_string(data)
    resumable = bucket.blob(f"{stem}/resumable", chunk_size=256 * 1024)
    resumable.upload_from_file(io.BytesIO(data))  # no size given: a resumable upload
    check = _gcs_client(fault_proxy, H0).bucket(gcs_emulator.bucket)
    assert check.blob(f"{stem}/multipart").download_as_bytes() == data
    assert check.blob(f"{stem}/resumable").download_as_bytes() == data
    received = fault_proxy.bytes_received_by_address()
    assert set(received) == {H1} and received[H1] > 2 * len(data)  # + multipart framing
    assert dict(rec.scheduled_bytes) == received
    assert {a for a, _, _ in rec.waits} == {H1}
    for stream in _streams(rec.waits):
        assert [w for _, w in stream] == pytest.approx([0.25 * k for k in range(len(stream))])
        assert all(n == 256 * 1024 for n, _ in stream[:-1])
    # The multipart body (5 pieces), the resumable session's JSON metadata, then its 256 KiB
    # chunks, each a PUT of its own (a body of one piece) through the proxy.
    streams = _streams(rec.waits)
    assert len(streams[0]) == 5 and len(streams[1]) == 1 and streams[1][0][0] < 1024
    assert [n for s in streams[2:] for n, _ in s] == [256 * 1024] * 4 + [768]
    puts = [r for r in fault_proxy.records() if r.method == "PUT"]
    assert len(puts) == 5 and all("upload_id=" in r.query for r in puts)
    assert fault_proxy._shaper.scheduled_bytes.get(H1, 0) == \
        fault_proxy.bytes_served_by_address().get(H1, 0)  # only answers went out to host 1
    snap = fault_proxy.snapshot()
    assert snap.bytes_received == received[H1] and snap.bytes_received_by_address == received


def test_xla_ckpt_composite_upload_shaped_per_host(
        fault_proxy: FaultProxy, gcs_emulator: GCSEmulator, stem: str) -> None:
    """A parallel composite upload of GCSStorage from host 2 books host 2's upload link: its
    parts' pieces follow one another at the host cap (2 MiB/s: 0.125 s per 256 KiB piece)
    whichever stream carries them; the object is whole."""
    from xla_ckpt.storage.base import StorageConfig

    rec = _upload_shaped(fault_proxy, Shaping(host_mib_s=2.0, shape_uploads=True))
    data = bytes(range(256)) * (12 * 1024)  # 3 MiB: three 1 MiB parts
    cfg = StorageConfig(parallel_upload_threshold_bytes=MiB, upload_part_size_bytes=MiB)
    with fault_proxy.storage(gcs_emulator.uri(stem), cfg, source_address=H2) as st:
        st.write_atomic("big", [data])
        out = bytearray(len(data))
        st.read_range("big", 0, memoryview(out))
    assert bytes(out) == data
    received = fault_proxy.bytes_received_by_address()
    assert received[H2] >= len(data) and dict(rec.scheduled_bytes) == received
    host2 = [(n, w) for a, n, w in rec.waits if a == H2]
    # Back to back on one link: each piece starts when the bytes booked before it are through.
    booked = 0
    for n, w in host2:
        assert w == pytest.approx(booked / (2.0 * MiB))
        booked += n
    assert booked == received[H2]


def test_uploads_unshaped_by_default(fault_proxy: FaultProxy, gcs_emulator: GCSEmulator,
                                     stem: str) -> None:
    """Without shape_uploads the upload schedule is never consulted; bodies are still counted."""
    rec = _upload_shaped(fault_proxy, Shaping(stream_mib_s=1.0, host_mib_s=1.0))
    bucket = _gcs_client(fault_proxy, H0).bucket(gcs_emulator.bucket)
    bucket.blob(f"{stem}/plain").upload_from_string(BODY)
    assert rec.waits == [] and not rec.scheduled_bytes
    assert fault_proxy.bytes_received_by_address()[H0] >= len(BODY)
    assert bucket.blob(f"{stem}/plain").download_as_bytes() == BODY
