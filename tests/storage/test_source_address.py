"""GCS connections bound to a source address: ``StorageConfig.source_address`` or the env var.

The real google-cloud-storage client inside :class:`GCSStorage` talks to the emulator through
the real fault proxy, which records each connection's source IP.  Every request of the
storage (JSON API: stat, list, compose, delete; media: uploads, ranged and whole reads)
must come from the configured address, so the proxy counts the bytes under it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import uuid
from typing import Iterator

import pytest

from xla_ckpt.config import load_config
from xla_ckpt.errors import ConfigError
from xla_ckpt.storage import StorageConfig
from xla_ckpt.storage.base import SOURCE_ADDRESS_ENV, RangeRead
from xla_ckpt.storage.gcs import GCSStorage
from xla_ckpt.storage.gcs.transport import SourceAddressAdapter, source_address_for
from xla_ckpt.testing.fault_proxy import FaultProxy, downloads, host_address, uploads
from xla_ckpt.testing.fault_proxy import SourceAddressAdapter as ReExported
from xla_ckpt.testing.gcs_emulator import GCSEmulator

H1, H2 = host_address(1), host_address(2)
BODY = bytes(range(251)) * 1000  # 251 000 bytes: above the parallel-upload threshold below

SMALL = StorageConfig(max_workers=4, slice_size_bytes=64 * 1024, retry_deadline_s=10.0,
                      initial_backoff_s=0.001, max_backoff_s=0.01,
                      parallel_upload_threshold_bytes=100_000, upload_part_size_bytes=64 * 1024)


def small(source_address: str | None = None) -> StorageConfig:
    return dataclasses.replace(SMALL, source_address=source_address)


@pytest.fixture
def uri(gcs_emulator: GCSEmulator) -> Iterator[str]:
    stem = f"srcaddr-{uuid.uuid4().hex[:12]}"
    yield gcs_emulator.uri(stem)
    gcs_emulator.delete_prefix(stem + "/")


@pytest.fixture(autouse=True)
def _no_inherited_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SOURCE_ADDRESS_ENV, raising=False)


@contextlib.contextmanager
def _open(storage: GCSStorage) -> Iterator[GCSStorage]:
    with storage:
        yield storage


def _round_trip(storage: GCSStorage) -> None:
    """Every kind of request the backend sends: composed upload, small upload, stat, list,
    ranged read, whole read, delete."""
    storage.write_atomic("big", [BODY])
    storage.write_atomic("small", [b"tiny"])
    assert storage.stat("big").size == len(BODY)
    assert storage.list() == ["big", "small"]
    out = bytearray(200_000)
    storage.read_ranges([RangeRead("big", 1000, memoryview(out))])
    assert bytes(out) == BODY[1000:201_000]
    assert storage.read_bytes("small") == b"tiny"
    assert storage.child("x").list() == []
    storage.delete("small")
    assert storage.list() == ["big"]


def test_every_request_leaves_from_the_configured_address(fault_proxy: FaultProxy,
                                                         uri: str) -> None:
    cfg = small(H1)
    with _open(GCSStorage(uri, cfg, endpoint=fault_proxy.url)) as st:
        assert st._conn.source_address == H1
        assert isinstance(st._conn.session.adapters["http://"], SourceAddressAdapter)
        _round_trip(st)
    records = fault_proxy.records()
    methods = {r.method for r in records}
    assert {"GET", "POST", "DELETE"} <= methods  # JSON API and media both went through
    assert {r.info.client_address for r in records} == {H1}
    served = fault_proxy.bytes_served_by_address()
    assert set(served) == {H1}
    assert sum(r.body_bytes for r in fault_proxy.records(downloads())) == 200_000 + 4
    assert served[H1] == fault_proxy.snapshot().bytes_served >= 200_004
    received = fault_proxy.bytes_received_by_address()
    assert set(received) == {H1} and received[H1] >= len(BODY) + 4  # + JSON metadata
    assert len(fault_proxy.records(uploads())) >= 3  # 4 parts of "big" + "small"
    assert ReExported is SourceAddressAdapter  # the testing re-export is the same class


def test_environment_variable_is_used_when_the_config_says_none(
        fault_proxy: FaultProxy, uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = small()  # built before the variable is set: it is read at connection time
    monkeypatch.setenv(SOURCE_ADDRESS_ENV, H2)
    assert source_address_for(cfg) == H2
    with _open(GCSStorage(uri, cfg, endpoint=fault_proxy.url)) as st:
        _round_trip(st)
    assert set(fault_proxy.bytes_served_by_address()) == {H2}
    # an explicit config wins over the variable
    fault_proxy.reset_log()
    with _open(GCSStorage(uri, small(H1), endpoint=fault_proxy.url)) as st:
        assert st.read_bytes("big") == BODY
    assert set(fault_proxy.bytes_served_by_address()) == {H1}
    # empty means unset: the kernel picks 127.0.0.1 for a loopback endpoint
    monkeypatch.setenv(SOURCE_ADDRESS_ENV, "")
    fault_proxy.reset_log()
    with _open(GCSStorage(uri, small(), endpoint=fault_proxy.url)) as st:
        assert st._conn.source_address is None
        assert st.read_bytes("big") == BODY
    assert set(fault_proxy.bytes_served_by_address()) == {"127.0.0.1"}


@pytest.mark.parametrize("value", ["localhost", "127.0.0.11:80", "", "300.1.1.1", 5])
def test_bad_config_values_name_the_key(value: object) -> None:
    with pytest.raises(ConfigError) as ei:
        StorageConfig(source_address=value)  # type: ignore[arg-type]  # wrong types on purpose
    assert str(ei.value).startswith("storage.source_address must be ")
    assert repr(value) in str(ei.value)


def test_bad_environment_value_names_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                  uri: str) -> None:
    monkeypatch.setenv(SOURCE_ADDRESS_ENV, "host-1.internal")
    with pytest.raises(ConfigError) as ei:
        GCSStorage(uri, small(), endpoint="http://127.0.0.1:1")
    assert str(ei.value) == (
        f"environment variable {SOURCE_ADDRESS_ENV} must be an IPv4 or IPv6 address literal "
        "of this machine (e.g. '10.0.0.2', '127.0.0.11', 'fd00::2'), got 'host-1.internal'; "
        "host names and ports are not accepted")


def test_an_address_this_machine_lacks_fails_at_once(uri: str) -> None:
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): never an address of this machine
    with pytest.raises(ConfigError) as ei:
        GCSStorage(uri, small("192.0.2.1"),
                   endpoint="http://127.0.0.1:1")
    assert str(ei.value).startswith("storage.source_address '192.0.2.1' cannot be used as a "
                                    "source address: binding a socket to it failed (")
    assert "give an address of one of this machine's interfaces" in str(ei.value)


def test_yaml_and_override_fill_source_address(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("storage:\n  max_workers: 4\n  source_address: 127.0.0.11\n")
    assert load_config(p, environ={}).storage.source_address == "127.0.0.11"
    cfg = load_config(p, environ={}, overrides=["storage.source_address=127.0.0.12"])
    assert cfg.storage.source_address == "127.0.0.12"
    assert load_config(p, environ={}, overrides=["storage.source_address=null"]
                       ).storage.source_address is None
    p.write_text("storage:\n  source_address: ::1\n")
    assert load_config(p, environ={}).storage.source_address == "::1"
    p.write_text("storage:\n  source_address: gcs-nic\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p, environ={})
    assert str(ei.value).startswith(f"{p}: storage.source_address must be an IPv4 or IPv6 "
                                    "address literal of this machine")
