"""GCS backend specifics beyond the conformance suite: composite uploads, crc32c on writes and
whole-object reads, generation pinning, error mapping and request counts, listing, sharing."""

import os
import re
from typing import Any

import pytest

from xla_ckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    IntegrityError,
    StorageError,
    StoragePermissionError,
)
from xla_ckpt.format.crc import crc32c, crc32c_combine
from xla_ckpt.storage import StorageConfig, open_storage
from xla_ckpt.storage.gcs import (
    MAX_COMPOSE_SOURCES,
    TMP_MARK,
    WHOLE_OBJECT_CRC_READS,
    GCSStorage,
    parse_gcs_uri,
)
from xla_ckpt.testing.fault_proxy import Fault, downloads, requests_to, uploads

FAST: dict[str, Any] = dict(initial_backoff_s=0.001, max_backoff_s=0.01, retry_deadline_s=20.0)
SMALL_PARTS = StorageConfig(max_workers=4, slice_size_bytes=64 * 1024, max_attempts=3,
                            parallel_upload_threshold_bytes=100_000,
                            upload_part_size_bytes=32 * 1024, **FAST)



def _storage_requests(proxy):
    """Requests our storage made (the client's own background bucket-metadata GET left out)."""
    return [r for r in proxy.records() if not re.fullmatch(r"/storage/v1/b/[^/]+", r.path)]


def _compose_requests(proxy):
    return [r for r in proxy.records() if r.method == "POST" and r.path.endswith("/compose")]


@pytest.mark.parametrize("uri, err", [("gs://", "bucket"), ("gs:///x", "bucket"),
                                      ("s3://b/x", "gs://"), ("gs://Bad_Bucket/x", "bucket")])
def test_bad_uris_are_config_errors(uri, err):
    with pytest.raises(ConfigError, match=err):
        parse_gcs_uri(uri)


def test_uri_parts():
    assert parse_gcs_uri("gs://bkt") == ("bkt", "")
    assert parse_gcs_uri("gs://bkt/run/ck_1/") == ("bkt", "run/ck_1")


@pytest.mark.parametrize("n1, n2", [(0, 0), (1, 0), (0, 7), (1000, 777), (4096, 1 << 20)])
def test_crc32c_combine_equals_crc_of_concatenation(n1, n2):
    a, b = os.urandom(n1), os.urandom(n2)
    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


def test_open_storage_routes_gs_uris_to_the_emulator(gcs_uri):
    with open_storage(gcs_uri + "/x") as st:
        assert isinstance(st, GCSStorage)
        st.write_atomic("obj", [b"payload"])
        assert st.read_bytes("obj") == b"payload"
        assert st.url("obj") == gcs_uri + "/x/obj"


def test_large_write_goes_up_as_parallel_parts_composed_and_parts_are_deleted(
        fault_proxy, gcs_emulator, stem):
    data = os.urandom(300_000)   # 10 parts of 32 KiB
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        info = st.write_atomic("ck/data", [data[:1000], memoryview(data)[1000:]])
        assert info.size == len(data) and info.generation == st.stat("ck/data").generation
        assert st.read_bytes("ck/data") == data
    part_uploads = [r for r in fault_proxy.records(uploads(TMP_MARK)) if r.status == 200]
    assert len(part_uploads) == 10
    (compose,) = _compose_requests(fault_proxy)
    assert compose.object_name == f"{stem}/ck/data"
    assert len(compose.request_body["sourceObjects"]) == 10
    assert compose.request_body["destination"]["crc32c"]  # the service can verify the result
    assert gcs_emulator.object_names(stem + "/") == [f"{stem}/ck/data"]


def test_more_than_32_parts_are_composed_in_a_tree(fault_proxy, gcs_emulator, stem):
    data = os.urandom(70 * 8192 + 5)   # 71 parts
    cfg = StorageConfig(max_workers=8, parallel_upload_threshold_bytes=1,
                        upload_part_size_bytes=8192, **FAST)
    with fault_proxy.storage(gcs_emulator.uri(stem), cfg) as st:
        st.write_atomic("big", [data])
        assert st.read_bytes("big") == data
    composes = _compose_requests(fault_proxy)
    sizes = sorted(len(c.request_body["sourceObjects"]) for c in composes)
    assert sizes == [3, 7, 32, 32]   # 32 + 32 + 7 parts, then the three into the object
    assert all(n <= MAX_COMPOSE_SOURCES for n in sizes)
    assert composes[-1].object_name == f"{stem}/big"
    assert gcs_emulator.object_names(stem + "/") == [f"{stem}/big"]


@pytest.mark.parametrize("where", ["part-upload-403", "compose-503"])
def test_failed_composite_write_keeps_previous_object_and_deletes_parts(
        fault_proxy, gcs_emulator, stem, where):
    old, new = os.urandom(200_000), os.urandom(250_000)
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        st.write_atomic("obj", [old])
        if where == "part-upload-403":
            fault_proxy.inject(Fault.error(403), match=uploads("part-00003"))
            with pytest.raises(StoragePermissionError, match="part-00003.*HTTP 403"):
                st.write_atomic("obj", [new])
        else:
            fault_proxy.inject(Fault.error(503), times=100,
                               match=requests_to("obj", method="POST", path_regex="/compose$"))
            with pytest.raises(StorageError, match="compose .*obj.*gave up after 3 failed"):
                st.write_atomic("obj", [new])
        assert st.read_bytes("obj") == old
        assert st.list("") == ["obj"]
        assert st.list("", include_in_flight=True) == ["obj"]
    assert gcs_emulator.object_names(stem + "/") == [f"{stem}/obj"]


def test_single_part_write_between_multipart_limit_and_threshold(fault_proxy, gcs_emulator, stem,
                                                                 monkeypatch):
    import xla_ckpt.storage.gcs.writes as gcs_writes

    monkeypatch.setattr(gcs_writes, "MULTIPART_MAX_BYTES", 1000)
    data = os.urandom(5000)
    cfg = StorageConfig(parallel_upload_threshold_bytes=1 << 20, **FAST)
    with fault_proxy.storage(gcs_emulator.uri(stem), cfg) as st:
        st.write_atomic("mid", [data])
        assert st.read_bytes("mid") == data
    (compose,) = _compose_requests(fault_proxy)
    assert len(compose.request_body["sourceObjects"]) == 1
    assert gcs_emulator.object_names(stem + "/") == [f"{stem}/mid"]


@pytest.mark.parametrize("size", [50_000, 300_000], ids=["multipart", "composite"])
def test_bytes_damaged_on_the_way_up_are_sent_again(fault_proxy, gcs_emulator, stem, size):
    """A flipped byte in an upload never becomes the object: the crc32c catches it, we resend."""
    data = os.urandom(size)
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        fault_proxy.inject(Fault.flip_request(), match=uploads())
        st.write_atomic("obj", [data])
        assert st.read_bytes("obj") == data
    ups = fault_proxy.records(uploads())
    assert ups[0].fault == "flip_request"
    assert fault_proxy.snapshot().faults["flip_request"] == 1
    if size == 50_000:   # the service refused the multipart upload (crc32c mismatch), we resent
        assert [r.status for r in ups] == [400, 200]
    else:                # the part was stored damaged, its crc32c differed, we resent the part
        assert len(ups) == 11 and all(r.status == 200 for r in ups)
    assert gcs_emulator.object_names(stem + "/") == [f"{stem}/obj"]


def test_reads_are_pinned_to_the_generation_from_stat(fault_proxy, gcs_emulator, stem):
    data = os.urandom(10_000)
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        st.write_atomic("o", [data])
        info = st.stat("o")
        out = bytearray(100)
        st.read_range("o", 50, memoryview(out), info.generation)
        assert bytes(out) == data[50:150]
    (get,) = fault_proxy.records(downloads("o"))
    assert f"generation={info.generation}" in get.query
    assert get.range == "bytes=50-149"


def test_whole_object_read_is_checked_against_the_object_crc32c(fault_proxy, gcs_emulator, stem):
    data = os.urandom(20_000)
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        st.write_atomic("m.json", [data])
        fault_proxy.inject(Fault.flip(at=123), match=downloads("m.json"))
        assert st.read_bytes("m.json") == data
        assert [r.fault for r in fault_proxy.records(downloads("m.json"))] == ["flip", ""]
        # One bad one-request answer, then WHOLE_OBJECT_CRC_READS bad ranged re-reads: give up.
        fault_proxy.inject(Fault.flip(), match=downloads("m.json"),
                           times=1 + WHOLE_OBJECT_CRC_READS)
        with pytest.raises(IntegrityError, match=f"gs://.*/{stem}/m.json: crc32c") as ei:
            st.read_bytes("m.json")
        assert ei.value.path.endswith(f"{stem}/m.json")


def test_whole_object_read_in_slices_is_checked_too(fault_proxy, gcs_emulator, stem):
    data = os.urandom(200_000)   # larger than one slice: stat + parallel ranged reads
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        st.write_atomic("big", [data])
        fault_proxy.inject(Fault.flip(), match=lambda r: r.is_download and r.range is not None)
        assert st.read_bytes("big") == data
    assert fault_proxy.snapshot().faults["flip"] == 1


@pytest.mark.parametrize("op", ["stat", "read", "write", "list"])
def test_permission_denied_is_never_retried(fault_proxy, gcs_emulator, stem, op):
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        st.write_atomic("o", [b"x" * 100])
        fault_proxy.reset_log()
        fault_proxy.inject(Fault.error(403), times=5)
        with pytest.raises(StoragePermissionError, match="HTTP 403") as ei:
            {"stat": lambda: st.stat("o"),
             "read": lambda: st.read_range("o", 0, memoryview(bytearray(10))),
             "write": lambda: st.write_atomic("o", [b"y"]),
             "list": lambda: st.list("")}[op]()
        assert isinstance(ei.value, PermissionError)
    assert len(_storage_requests(fault_proxy)) == 1


def test_missing_object_and_other_4xx_are_not_retried(fault_proxy, gcs_emulator, stem):
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        with pytest.raises(CheckpointNotFoundError, match=f"{stem}/absent.*404"):
            st.read_range("absent", 0, memoryview(bytearray(4)))
        assert len(_storage_requests(fault_proxy)) == 1
        st.write_atomic("o", [b"x" * 100])
        fault_proxy.reset_log()
        fault_proxy.inject(Fault.error(400), times=5)
        with pytest.raises(StorageError, match="HTTP 400.*not retried"):
            st.read_range("o", 0, memoryview(bytearray(4)))
        assert len(_storage_requests(fault_proxy)) == 1


def test_persistent_503_gives_up_after_max_attempts_naming_the_request(fault_proxy, gcs_emulator,
                                                                       stem):
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        st.write_atomic("o", [b"x" * 100])
        fault_proxy.reset_log()
        fault_proxy.inject(Fault.error(503), times=100, match=downloads("o"))
        with pytest.raises(StorageError) as ei:
            st.read_range("o", 0, memoryview(bytearray(10)))
        msg = str(ei.value)
        assert f"read gs://{gcs_emulator.bucket}/{stem}/o bytes [0, 10)" in msg
        assert "gave up after 3 failed attempts" in msg and "HTTP 503" in msg
    assert len(_storage_requests(fault_proxy)) == 3


def test_list_hides_in_flight_parts(gcs_emulator, stem):
    with gcs_emulator.storage(stem, SMALL_PARTS) as st:
        st.write_atomic("ck/manifest.json", [b"{}"])
        st.write_atomic(f"ck/data{TMP_MARK}abc-part-00000", [b"part"])
        assert st.list("ck") == ["ck/manifest.json"]
        assert st.list("ck", include_in_flight=True) == [
            f"ck/data{TMP_MARK}abc-part-00000", "ck/manifest.json"]
        assert st.list("c") == []   # a prefix is a folder, not a string prefix


def test_child_shares_client_and_connection_pool(gcs_emulator, stem):
    with gcs_emulator.storage(stem, SMALL_PARTS) as st:
        child = st.child("run/ck")
        assert child._conn is st._conn and child.retries is st.retries
        child.write_atomic("a", [b"1"])
        child.close()                        # a child never closes the shared client
        assert st.read_bytes("run/ck/a") == b"1"
        assert child.uri == f"gs://{gcs_emulator.bucket}/{stem}/run/ck"


def test_invalid_object_names_are_refused(gcs_emulator, stem):
    with gcs_emulator.storage(stem, SMALL_PARTS) as st:
        for bad in ["", "a//b", "a/../b", "./a"]:
            with pytest.raises(ValueError):
                st.stat(bad)
