"""The one storage-URI parser (xla_ckpt.storage.uri) and every entry point that goes through it.

Issue "URI typos write to the wrong place": ``gs:/bucket/run`` used to become a local folder
``./gs:/bucket/run``, and ``s3://`` was "no such folder" for ``ls`` but "unsupported URI scheme"
for ``verify``.  Every malformed or unknown form is now one StorageURIError naming the URI.
"""

import os
import pickle

import pytest
import torch

import xla_ckpt
from xla_ckpt.cli.main import main as cli_main
from xla_ckpt.errors import ConfigError, StorageURIError, XlaCkptError
from xla_ckpt.storage import StorageURI, is_gcs_uri, open_storage, parse_uri
from xla_ckpt.storage.gcs import parse_gcs_uri
from xla_ckpt.storage.local import LocalStorage

VALID = [
    # local, relative
    ("runs/a", StorageURI("file", "", "runs/a")),
    ("ck", StorageURI("file", "", "ck")),
    (".", StorageURI("file", "", ".")),
    ("./", StorageURI("file", "", ".")),
    ("../up/ck", StorageURI("file", "", "../up/ck")),
    ("~/ck", StorageURI("file", "", "~/ck")),
    ("gs/b/x", StorageURI("file", "", "gs/b/x")),  # a folder named gs: one slash is a path
    ("./gs:/b/x", StorageURI("file", "", "./gs:/b/x")),  # explicit ./: a local folder "gs:"
    ("out//ck", StorageURI("file", "", "out//ck")),  # inner // of a local path: the OS's
    # local, absolute
    ("/data/run", StorageURI("file", "", "/data/run")),
    ("/", StorageURI("file", "", "/")),
    ("/tmp/gs:/x", StorageURI("file", "", "/tmp/gs:/x")),
    # file://
    ("file:///data/run", StorageURI("file", "", "/data/run")),
    ("file:///", StorageURI("file", "", "/")),
    # gs://
    ("gs://bkt", StorageURI("gs", "bkt", "")),
    ("gs://bkt/a/b", StorageURI("gs", "bkt", "a/b")),
    ("gs://my-bucket_1.example.com/run/ck_1", StorageURI("gs", "my-bucket_1.example.com",
                                                         "run/ck_1")),
    # trailing slashes: dropped, the same way for every scheme
    ("runs/a/", StorageURI("file", "", "runs/a")),
    ("runs/a//", StorageURI("file", "", "runs/a")),
    ("/data/run/", StorageURI("file", "", "/data/run")),
    ("file:///data/run/", StorageURI("file", "", "/data/run")),
    ("gs://bkt/", StorageURI("gs", "bkt", "")),
    ("gs://bkt//", StorageURI("gs", "bkt", "")),
    ("gs://bkt/a/b/", StorageURI("gs", "bkt", "a/b")),
]


@pytest.mark.parametrize("uri, want", VALID, ids=[u for u, _ in VALID])
def test_valid_forms_parse_into_their_parts(uri, want):
    got = parse_uri(uri)
    assert got == want
    assert (got.scheme, got.bucket, got.path) == (want.scheme, want.bucket, want.path)
    assert got.is_gcs == (want.scheme == "gs") and got.is_local == (want.scheme == "file")
    assert parse_uri(str(got)) == got  # str() is the canonical text, and it parses back


def test_canonical_text():
    assert str(parse_uri("gs://bkt/a/b/")) == "gs://bkt/a/b"
    assert str(parse_uri("gs://bkt/")) == "gs://bkt"
    assert str(parse_uri("file:///data/run/")) == "/data/run"
    assert str(parse_uri("runs/a/")) == "runs/a"


# (uri, a fragment the message must hold besides the URI: the form expected)
MALFORMED = [
    # unknown schemes
    ("s3://b/x", "unsupported URI scheme 's3://'"),
    ("hdfs://namenode/x", "unsupported URI scheme 'hdfs://'"),
    ("http://host/x", "unsupported URI scheme 'http://'"),
    ("https://storage.googleapis.com/b/x", "unsupported URI scheme 'https://'"),
    ("gcs://bkt/x", "unsupported URI scheme 'gcs://'"),
    # schemes not in lowercase
    ("GS://bkt/x", "write gs://"),
    ("Gs://bkt/x", "write gs://"),
    ("FILE:///data/x", "write file://"),
    # malformed gs forms: each of these used to become a local folder
    ("gs:/bkt/run/ck", "did you mean 'gs://bkt/run/ck'?"),
    ("gs//bkt/run/ck", "did you mean 'gs://bkt/run/ck'?"),
    ("gs:bkt/run/ck", "did you mean 'gs://bkt/run/ck'?"),
    ("gs:", "expected gs://BUCKET/PATH"),
    ("gs:/", "expected gs://BUCKET/PATH"),
    ("Gs:/bkt", "expected gs://BUCKET/PATH"),
    ("gs://", "no bucket name"),
    ("gs:///x", "no bucket name"),
    # bad bucket names
    ("gs://Bad_Bucket/x", "invalid bucket name 'Bad_Bucket'"),
    ("gs://ab/x", "at least 3 characters"),
    ("gs://-bkt/x", "start and end with a letter or digit"),
    ("gs://bkt-/x", "start and end with a letter or digit"),
    ("gs://b kt/x", "invalid bucket name"),
    ("gs://" + "a" * 64, "at most 63 characters"),
    ("gs://a..b/x", "dot-separated part"),
    ("gs://192.168.0.1/x", "IP address"),
    # empty, '.' or '..' segments inside a gs object path
    ("gs://bkt//x", "empty, '.' or '..' segment"),
    ("gs://bkt/a//x", "empty, '.' or '..' segment"),
    ("gs://bkt/a/./x", "empty, '.' or '..' segment"),
    ("gs://bkt/a/../x", "empty, '.' or '..' segment"),
    # malformed file forms
    ("file://rel/x", "file:///ABS/PATH"),
    ("file://", "file:///ABS/PATH"),
    ("file:/data/x", "file:///ABS/PATH"),
    ("file:data/x", "file:///ABS/PATH"),
    # local paths that look like a mangled URI
    ("s3:/b/x", "not a supported scheme"),
    ("foo:bar", "write ./foo:bar"),
    ("s3//b/x", "s3:// URI with its ':' missing"),
    ("runs/s3://b/x", "unsupported URI scheme"),
    ("file:///data/s3://x", "unsupported URI scheme"),
    # empty and whitespace
    ("", "empty storage URI"),
    ("   ", "empty storage URI"),
    (" gs://bkt/x", "whitespace"),
    ("gs://bkt/x ", "whitespace"),
    ("runs/a\n", "whitespace"),
]


@pytest.mark.parametrize("uri, fragment", MALFORMED, ids=[repr(u) for u, _ in MALFORMED])
def test_malformed_and_unknown_forms_are_storage_uri_errors(uri, fragment):
    with pytest.raises(StorageURIError) as info:
        parse_uri(uri)
    e = info.value
    assert type(e) is StorageURIError
    assert isinstance(e, ConfigError) and isinstance(e, ValueError) and isinstance(e, XlaCkptError)
    msg = str(e)
    assert repr(uri) in msg and e.uri == uri
    assert fragment in msg
    assert "expected" in msg or "write" in msg  # says what form is wanted


@pytest.mark.parametrize("uri", ["gs:/bkt/x", "s3://b/x", "gs://bkt//x", "gs://Bad/x", ""])
def test_every_backend_entry_point_refuses_alike(uri):
    for call in (parse_uri, is_gcs_uri, open_storage, LocalStorage):
        with pytest.raises(StorageURIError) as info:
            call(uri)
        assert repr(uri) in str(info.value)


def test_is_gcs_uri():
    assert is_gcs_uri("gs://bkt/x") and is_gcs_uri("gs://bkt")
    assert not is_gcs_uri("runs/a") and not is_gcs_uri("/data") and not is_gcs_uri("file:///x")
    with pytest.raises(StorageURIError):  # never "False, so it is local"
        is_gcs_uri("gs:/bkt/x")


def test_parse_gcs_uri_keeps_its_shape():
    assert parse_gcs_uri("gs://bkt") == ("bkt", "")
    assert parse_gcs_uri("gs://bkt/run/ck_1/") == ("bkt", "run/ck_1")
    for uri in ("/data/x", "runs/a", "file:///x"):
        with pytest.raises(StorageURIError, match="is not a gs:// URI"):
            parse_gcs_uri(uri)
    with pytest.raises(StorageURIError, match="unsupported URI scheme"):
        parse_gcs_uri("s3://b/x")


def test_local_storage_roots(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert open_storage("runs/a/").uri == str(tmp_path / "runs" / "a")
    assert open_storage(str(tmp_path / "x") + "/").uri == str(tmp_path / "x")
    assert open_storage(f"file://{tmp_path}/y").uri == str(tmp_path / "y")
    assert open_storage("./gs:").uri == str(tmp_path / "gs:")  # explicit: a local folder gs:
    assert LocalStorage(str(tmp_path)).child("a/b").uri == str(tmp_path / "a" / "b")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert LocalStorage("~/ck").uri == str(tmp_path / "home" / "ck")
    assert os.listdir(tmp_path) == []  # opening creates nothing


def test_local_storage_refuses_gs_uris():
    with pytest.raises(StorageURIError, match="LocalStorage needs a local path"):
        LocalStorage("gs://bkt/x")


def test_join():
    assert parse_uri("gs://bkt/run").join("ck_1", "manifest.json") == \
        StorageURI("gs", "bkt", "run/ck_1/manifest.json")
    assert parse_uri("gs://bkt").join("/ck_1/") == StorageURI("gs", "bkt", "ck_1")
    assert parse_uri("gs://bkt/run").join("", "/") == parse_uri("gs://bkt/run")
    assert parse_uri("runs").join("a", "b") == StorageURI("file", "", "runs/a/b")
    assert parse_uri("/").join("a") == StorageURI("file", "", "/a")
    assert parse_uri("file:///d/").join("a/") == StorageURI("file", "", "/d/a")
    with pytest.raises(StorageURIError, match="segment"):
        parse_uri("gs://bkt/run").join("a//b")
    with pytest.raises(StorageURIError, match="segment"):
        parse_uri("gs://bkt/run").join("..")


@pytest.mark.parametrize("parts", [("gs", "", "x"), ("gs", "Bad", ""), ("gs", "bkt", "/x"),
                                   ("gs", "bkt", "x/"), ("file", "", ""), ("file", "b", "/x"),
                                   ("file", "", "gs:/b"), ("file", "", "x/"), ("s3", "b", "x")])
def test_constructing_an_invalid_uri_is_refused(parts):
    with pytest.raises(StorageURIError):
        StorageURI(*parts)


def test_error_pickles_with_its_uri():
    with pytest.raises(StorageURIError) as info:
        parse_uri("gs:/bkt/x")
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is StorageURIError and str(back) == str(info.value)
    assert back.uri == "gs:/bkt/x"


W = torch.arange(4, dtype=torch.float32)
STATE = {"w": W, "step": 3}


@pytest.mark.parametrize("uri", ["gs:/bucket/run/ck", "gs//bucket/run/ck", "gs:bucket/run/ck",
                                 "GS://bucket/run/ck", "s3://bucket/run/ck"])
def test_save_to_a_mistyped_uri_raises_and_writes_nothing(uri, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageURIError) as info:
        xla_ckpt.save(STATE, uri)
    assert repr(uri) in str(info.value)
    assert os.listdir(tmp_path) == []  # no ./gs:/bucket/run/ck, nothing at all


def test_load_of_an_unknown_scheme_raises_the_same_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageURIError, match="unsupported URI scheme") as info:
        xla_ckpt.load("s3://b/x")
    assert "'s3://b/x'" in str(info.value)
    with pytest.raises(StorageURIError):
        xla_ckpt.load("gs:/bucket/run/ck")
    assert os.listdir(tmp_path) == []


def test_valid_local_save_and_load_are_unchanged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    xla_ckpt.save(STATE, "run/ck_1/")
    assert os.path.isfile(tmp_path / "run" / "ck_1" / "manifest.json")
    for uri in ("run/ck_1", str(tmp_path / "run" / "ck_1"), f"file://{tmp_path}/run/ck_1/"):
        got = xla_ckpt.load(uri)
        assert torch.equal(got["w"], W) and got["step"] == 3


@pytest.mark.parametrize("uri, fragment", [("s3://b/x", "unsupported URI scheme 's3://'"),
                                           ("gs:/bkt/x", "malformed gs:// URI")])
@pytest.mark.parametrize("command", ["ls", "verify", "inspect"])
def test_cli_commands_agree_on_a_bad_uri(command, uri, fragment, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = cli_main(["--no-progress", command, uri])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"xla-ckpt {command}: error: ") and repr(uri) in err and fragment in err
    assert os.listdir(tmp_path) == []
