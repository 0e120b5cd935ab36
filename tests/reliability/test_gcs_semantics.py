"""The emulator fixture keeps GCS's generation semantics (xla_ckpt/testing/gcs_semantics.py).

Checked with the real ``google-cloud-storage`` client (and raw ``requests`` where the
client hides the wire) against the documented behaviour:
https://cloud.google.com/storage/docs/request-preconditions (412 for a failed ``...Match``,
304 for a failed ``...NotMatch``, ``ifGenerationMatch=0`` = "must not exist") and
https://cloud.google.com/storage/docs/metadata#generation-number (a new, larger generation
per write; without versioning only the live generation can be read).
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Iterator
from urllib.parse import quote

import pytest
import requests
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage as gcs

from xla_ckpt.errors import CheckpointNotFoundError
from xla_ckpt.storage import StorageConfig
from xla_ckpt.testing.fault_proxy import downloads
from xla_ckpt.testing.gcs_emulator import GCSEmulator

SMALL_PARTS = StorageConfig(max_workers=4, slice_size_bytes=64 * 1024, max_attempts=3,
                            parallel_upload_threshold_bytes=100_000,
                            upload_part_size_bytes=32 * 1024, initial_backoff_s=0.001,
                            max_backoff_s=0.01, retry_deadline_s=20.0)


@pytest.fixture
def stem(gcs_emulator: GCSEmulator) -> Iterator[str]:
    s = f"sem-{uuid.uuid4().hex[:12]}"
    yield s
    gcs_emulator.delete_prefix(s + "/")


@pytest.fixture
def bucket(gcs_emulator: GCSEmulator, monkeypatch: pytest.MonkeyPatch) -> gcs.Bucket:
    for k, v in gcs_emulator.env().items():
        monkeypatch.setenv(k, v)
    client = gcs.Client(project=gcs_emulator.project, credentials=AnonymousCredentials())
    return client.bucket(gcs_emulator.bucket)


def _object_url(emu: GCSEmulator, name: str, *, download_path: bool = False) -> str:
    base = f"{emu.host}/download" if download_path else emu.host
    return f"{base}/storage/v1/b/{emu.bucket}/o/{quote(name, safe='')}"


def _upload_url(emu: GCSEmulator) -> str:
    return f"{emu.host}/upload/storage/v1/b/{emu.bucket}/o"


# ---- generations -------------------------------------------------------------------------------
def test_every_write_makes_a_new_larger_generation_with_metageneration_1(bucket, stem):
    blob = bucket.blob(f"{stem}/o")
    blob.upload_from_string(b"one")
    g1 = blob.generation
    fresh = bucket.blob(f"{stem}/o")
    fresh.reload()
    assert (fresh.generation, fresh.metageneration) == (g1, 1)
    assert f"generation={g1}&" in fresh.media_link and fresh.id.endswith(f"/{g1}")
    gens = [g1]
    for i in range(5):  # back to back: strictly larger every time
        blob.upload_from_string(b"again %d" % i)
        gens.append(blob.generation)
    assert gens == sorted(set(gens)) and len(gens) == 6
    with pytest.raises(gexc.NotFound):  # ``fresh`` now names generation g1, which is gone
        fresh.reload()
    fresh = bucket.blob(f"{stem}/o")
    fresh.reload()
    assert (fresh.generation, fresh.metageneration) == (gens[-1], 1)
    assert fresh.download_as_bytes() == b"again 4"  # through the (re-pinned) mediaLink
    listed = {b.name: b.generation for b in bucket.list_blobs(prefix=f"{stem}/")}
    assert listed == {f"{stem}/o": gens[-1]}


def test_metadata_update_bumps_metageneration_only(bucket, stem):
    blob = bucket.blob(f"{stem}/o")
    blob.upload_from_string(b"x")
    gen = blob.generation
    blob.metadata = {"k": "v"}
    blob.patch()
    assert (blob.generation, blob.metageneration) == (gen, 2)
    with pytest.raises(gexc.PreconditionFailed):
        blob.patch(if_metageneration_match=1)
    blob.reload(if_metageneration_match=2)
    assert blob.metadata == {"k": "v"}


def test_resumable_upload_gets_its_generation_when_it_completes(gcs_emulator, stem):
    name = f"{stem}/o"
    start = requests.post(_upload_url(gcs_emulator),
                          params={"uploadType": "resumable", "name": name}, json={"name": name})
    assert start.status_code == 200
    other = requests.post(_upload_url(gcs_emulator), params={"uploadType": "media", "name": name},
                          data=b"meanwhile")
    assert other.status_code == 200
    done = requests.put(start.headers["Location"], data=b"resumable bytes",
                        headers={"Content-Range": "bytes 0-14/15"})
    assert done.status_code == 200
    assert int(done.json()["generation"]) > int(other.json()["generation"])
    assert done.json()["metageneration"] == "1"


# ---- pinned reads ------------------------------------------------------------------------------
def test_read_pinned_to_an_overwritten_generation_is_404(bucket, stem):
    blob = bucket.blob(f"{stem}/o")
    blob.upload_from_string(b"first")
    old = blob.generation
    blob.upload_from_string(b"second")
    new = blob.generation
    assert new > old
    with pytest.raises(gexc.NotFound):
        bucket.blob(f"{stem}/o", generation=old).download_as_bytes()
    with pytest.raises(gexc.NotFound):
        bucket.blob(f"{stem}/o", generation=old).reload()
    assert bucket.blob(f"{stem}/o", generation=new).download_as_bytes() == b"second"
    pinned = bucket.blob(f"{stem}/o", generation=new)
    pinned.reload()
    assert pinned.generation == new


def test_read_pinned_to_a_deleted_generation_is_404(bucket, stem):
    blob = bucket.blob(f"{stem}/o")
    blob.upload_from_string(b"gone soon")
    gen = blob.generation
    blob.delete()
    with pytest.raises(gexc.NotFound):
        bucket.blob(f"{stem}/o", generation=gen).download_as_bytes()
    blob.upload_from_string(b"back")  # same name, new generation: the old one stays gone
    assert blob.generation > gen
    with pytest.raises(gexc.NotFound):
        bucket.blob(f"{stem}/o", generation=gen).download_as_bytes()


def test_ranged_read_pinned_to_the_live_generation_works(bucket, gcs_emulator, stem):
    data = os.urandom(5000)
    blob = bucket.blob(f"{stem}/o")
    blob.upload_from_string(data)
    gen = blob.generation
    assert bucket.blob(f"{stem}/o", generation=gen).download_as_bytes(start=100, end=199) \
        == data[100:200]
    r = requests.get(_object_url(gcs_emulator, f"{stem}/o", download_path=True),
                     params={"alt": "media", "generation": str(gen)},
                     headers={"Range": "bytes=4990-"})
    assert r.status_code == 206
    assert r.headers["Content-Range"] == "bytes 4990-4999/5000"
    assert r.content == data[4990:]
    assert r.headers["x-goog-generation"] == str(gen)


def test_media_answers_carry_the_generation_headers(bucket, gcs_emulator, stem):
    blob = bucket.blob(f"{stem}/o")
    blob.upload_from_string(b"payload")
    for download_path in (False, True):
        r = requests.get(_object_url(gcs_emulator, f"{stem}/o", download_path=download_path),
                         params={"alt": "media"})
        assert r.status_code == 200 and r.content == b"payload"
        assert r.headers["x-goog-generation"] == str(blob.generation)
        assert r.headers["x-goog-metageneration"] == "1"
    meta = requests.get(_object_url(gcs_emulator, f"{stem}/o")).json()
    assert (meta["generation"], meta["metageneration"]) == (str(blob.generation), "1")


def test_pinned_read_through_the_fault_proxy(fault_proxy, gcs_emulator, stem):
    """The library's own reads, through the proxy: pinned to a replaced generation -> not found."""
    with fault_proxy.storage(gcs_emulator.uri(stem), SMALL_PARTS) as st:
        first = st.write_atomic("o", [b"a" * 1000])
        assert first.generation == st.stat("o").generation
        second = st.write_atomic("o", [b"b" * 200_000])  # composite: parts, then compose
        assert second.generation is not None and first.generation is not None
        assert second.generation > first.generation == int(first.generation)
        assert st.stat("o").generation == second.generation
        out = bytearray(100)
        st.read_range("o", 0, memoryview(out), second.generation)
        assert bytes(out) == b"b" * 100
        with pytest.raises(CheckpointNotFoundError, match=f"generation {first.generation}"):
            st.read_range("o", 0, memoryview(out), first.generation)
    statuses = [r.status for r in fault_proxy.records(downloads("o"))]
    assert statuses == [206, 404]


# ---- preconditions: uploads ----------------------------------------------------------------
def test_if_generation_match_0_creates_only_once(bucket, stem):
    blob = bucket.blob(f"{stem}/o")
    blob.upload_from_string(b"first", if_generation_match=0)
    gen = blob.generation
    with pytest.raises(gexc.PreconditionFailed) as e:
        bucket.blob(f"{stem}/o").upload_from_string(b"second", if_generation_match=0)
    assert e.value.code == 412
    check = bucket.blob(f"{stem}/o")
    check.reload()
    assert check.generation == gen and check.download_as_bytes() == b"first"


def test_upload_preconditions_on_the_live_object(bucket, gcs_emulator, stem):
    blob = bucket.blob(f"{stem}/o")
    with pytest.raises(gexc.PreconditionFailed):  # no live object: generation 0
        blob.upload_from_string(b"x", if_generation_match=123)
    with pytest.raises(gexc.PreconditionFailed):  # ...and no metageneration
        blob.upload_from_string(b"x", if_metageneration_match=1)
    with pytest.raises(gexc.PreconditionFailed):  # NotMatch=0: must exist
        blob.upload_from_string(b"x", if_generation_not_match=0)
    assert not blob.exists()
    blob.upload_from_string(b"v1")
    g1 = blob.generation
    with pytest.raises(gexc.PreconditionFailed):
        blob.upload_from_string(b"v2", if_generation_match=g1 + 1)
    with pytest.raises(gexc.NotModified) as e:  # documented: 304 when the NotMatch value matches
        blob.upload_from_string(b"v2", if_generation_not_match=g1)
    assert e.value.code == 304
    # Raw: the client's multipart upload spells this one ``ifMetaGenerationNotMatch``.
    r = requests.post(_upload_url(gcs_emulator), data=b"v2",
                      params={"uploadType": "media", "name": f"{stem}/o",
                              "ifMetagenerationNotMatch": "1"})
    assert (r.status_code, r.content) == (304, b"")
    blob.upload_from_string(b"v2", if_generation_match=g1, if_metageneration_match=1)
    assert blob.generation > g1
    blob.upload_from_string(b"v3", if_generation_not_match=g1)
    assert blob.download_as_bytes() == b"v3"


def test_resumable_upload_preconditions(bucket, stem):
    blob = bucket.blob(f"{stem}/o", chunk_size=256 * 1024)  # chunk_size: resumable upload
    data = os.urandom(600 * 1024)
    blob.upload_from_string(data, if_generation_match=0)
    gen = blob.generation
    again = bucket.blob(f"{stem}/o", chunk_size=256 * 1024)
    with pytest.raises(gexc.PreconditionFailed):
        again.upload_from_string(os.urandom(600 * 1024), if_generation_match=0)
    again.upload_from_string(b"z" * (300 * 1024), if_generation_match=gen)
    assert again.generation > gen
    assert bucket.blob(f"{stem}/o").download_as_bytes() == b"z" * (300 * 1024)


def test_resumable_precondition_is_checked_again_when_the_upload_completes(gcs_emulator, stem):
    name = f"{stem}/o"
    start = requests.post(_upload_url(gcs_emulator),
                          params={"uploadType": "resumable", "name": name,
                                  "ifGenerationMatch": "0"}, json={"name": name})
    assert start.status_code == 200  # no object yet: the session starts
    other = requests.post(_upload_url(gcs_emulator), params={"uploadType": "media", "name": name},
                          data=b"the other writer")
    assert other.status_code == 200
    late = requests.put(start.headers["Location"], data=b"late",
                        headers={"Content-Range": "bytes 0-3/4"})
    assert late.status_code == 412
    assert late.json()["error"]["errors"][0]["reason"] == "conditionNotMet"
    again = requests.put(start.headers["Location"], data=b"late",
                         headers={"Content-Range": "bytes 0-3/4"})
    assert again.status_code == 404  # the failed session is over
    r = requests.get(_object_url(gcs_emulator, name), params={"alt": "media"})
    assert r.content == b"the other writer"
    assert r.headers["x-goog-generation"] == other.json()["generation"]
    refused = requests.post(_upload_url(gcs_emulator),
                            params={"uploadType": "resumable", "name": name,
                                    "ifGenerationMatch": "0"}, json={"name": name})
    assert refused.status_code == 412 and "Location" not in refused.headers


def test_bad_precondition_value_is_400(gcs_emulator, stem):
    r = requests.post(_upload_url(gcs_emulator),
                      params={"uploadType": "media", "name": f"{stem}/o", "ifGenerationMatch": "x"},
                      data=b"x")
    assert r.status_code == 400
    assert gcs_emulator.object_names(f"{stem}/") == []


# ---- preconditions: reads, delete ------------------------------------------------------------
def test_read_preconditions(bucket, gcs_emulator, stem):
    blob = bucket.blob(f"{stem}/o")
    blob.upload_from_string(b"data")
    gen = blob.generation
    assert blob.download_as_bytes(if_generation_match=gen) == b"data"
    with pytest.raises(gexc.PreconditionFailed):
        blob.download_as_bytes(if_generation_match=gen - 1)
    with pytest.raises(gexc.PreconditionFailed):
        blob.reload(if_generation_match=gen - 1)
    with pytest.raises(gexc.PreconditionFailed):
        blob.reload(if_metageneration_match=2)
    with pytest.raises(gexc.NotModified):
        blob.reload(if_generation_not_match=gen)
    with pytest.raises(gexc.NotModified):
        blob.reload(if_metageneration_not_match=1)
    r = requests.get(_object_url(gcs_emulator, f"{stem}/o"),
                     params={"alt": "media", "ifGenerationNotMatch": str(gen)})
    assert (r.status_code, r.content) == (304, b"")
    r = requests.get(_object_url(gcs_emulator, f"{stem}/o", download_path=True),
                     params={"alt": "media", "ifGenerationMatch": str(gen + 1)})
    assert r.status_code == 412
    assert r.json()["error"]["code"] == 412
    absent = requests.get(_object_url(gcs_emulator, f"{stem}/absent"),
                          params={"alt": "media", "ifGenerationMatch": "0"})
    assert absent.status_code == 404  # a read of an absent object: 404 before preconditions


def test_delete_with_a_wrong_generation_is_412_and_keeps_the_object(bucket, stem):
    blob = bucket.blob(f"{stem}/o")
    blob.upload_from_string(b"keep me")
    gen = blob.generation
    with pytest.raises(gexc.PreconditionFailed) as e:
        blob.delete(if_generation_match=gen + 1)
    assert e.value.code == 412
    with pytest.raises(gexc.PreconditionFailed):
        blob.delete(if_generation_match=0)
    with pytest.raises(gexc.NotFound):
        bucket.blob(f"{stem}/o", generation=gen - 1).delete()
    check = bucket.blob(f"{stem}/o")
    check.reload()
    assert check.generation == gen and check.download_as_bytes() == b"keep me"
    blob.delete(if_generation_match=gen)
    assert not bucket.blob(f"{stem}/o").exists()
    with pytest.raises(gexc.NotFound):
        blob.delete(if_generation_match=gen)


# ---- preconditions: compose, copy, rewrite ---------------------------------------------------
def test_compose_onto_an_existing_destination_with_if_generation_match_0_is_412(bucket, stem):
    a, b = bucket.blob(f"{stem}/a"), bucket.blob(f"{stem}/b")
    a.upload_from_string(b"AAA")
    b.upload_from_string(b"BB")
    dest = bucket.blob(f"{stem}/dest")
    dest.upload_from_string(b"old")
    old = dest.generation
    with pytest.raises(gexc.PreconditionFailed) as e:
        bucket.blob(f"{stem}/dest").compose([a, b], if_generation_match=0)
    assert e.value.code == 412
    assert bucket.blob(f"{stem}/dest").download_as_bytes() == b"old"
    with pytest.raises(gexc.PreconditionFailed):  # a source's own precondition
        bucket.blob(f"{stem}/dest").compose([a, b], if_generation_match=old,
                                            if_source_generation_match=[a.generation,
                                                                        b.generation + 1])
    new = bucket.blob(f"{stem}/dest")
    new.compose([a, b], if_generation_match=old)
    assert new.generation > old and new.metageneration == 1
    assert new.download_as_bytes() == b"AAABB"
    fresh = bucket.blob(f"{stem}/fresh")
    fresh.compose([a, b], if_generation_match=0)
    assert fresh.download_as_bytes() == b"AAABB"


def test_compose_source_pinned_to_a_replaced_generation_is_404(gcs_emulator, bucket, stem):
    a = bucket.blob(f"{stem}/a")
    a.upload_from_string(b"v1")
    old = a.generation
    a.upload_from_string(b"v2")
    url = f"{_object_url(gcs_emulator, f'{stem}/dest')}/compose"
    source: dict[str, Any] = {"name": f"{stem}/a", "generation": str(old)}
    body = {"sourceObjects": [source], "destination": {"contentType": "application/octet-stream"}}
    assert requests.post(url, json=body).status_code == 404
    source["generation"] = str(a.generation)
    ok = requests.post(url, json=body)
    assert ok.status_code == 200 and int(ok.json()["generation"]) > a.generation


def test_copy_and_rewrite_preconditions(bucket, stem):
    src = bucket.blob(f"{stem}/src")
    src.upload_from_string(b"v1")
    old = src.generation
    src.upload_from_string(b"v2")
    dest = bucket.blob(f"{stem}/dest")
    dest.upload_from_string(b"dest")
    with pytest.raises(gexc.PreconditionFailed):
        bucket.copy_blob(src, bucket, f"{stem}/dest", if_generation_match=0)
    with pytest.raises(gexc.PreconditionFailed):
        bucket.copy_blob(src, bucket, f"{stem}/new", if_source_generation_match=old)
    with pytest.raises(gexc.NotFound):
        bucket.copy_blob(src, bucket, f"{stem}/new", source_generation=old)
    copied = bucket.copy_blob(src, bucket, f"{stem}/dest", if_generation_match=dest.generation,
                              if_source_generation_match=src.generation)
    assert copied.generation > dest.generation and copied.download_as_bytes() == b"v2"
    target = bucket.blob(f"{stem}/rewritten")
    with pytest.raises(gexc.PreconditionFailed):
        target.rewrite(src, if_source_generation_match=old)
    target.rewrite(src, if_generation_match=0)
    assert target.download_as_bytes() == b"v2"
    with pytest.raises(gexc.PreconditionFailed):
        bucket.blob(f"{stem}/rewritten").rewrite(src, if_generation_match=0)
