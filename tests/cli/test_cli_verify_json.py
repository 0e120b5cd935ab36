"""``xla-ckpt verify --json``: stdout is exactly one JSON object on every path, failures included.

A failure before a report (nothing there, incomplete, unreadable manifest, bad URI, legacy file,
storage refusal while resolving or while reading, an interruption, a bug) prints
``{"uri", "ok": false, "error": {"type", "message"}}``; the exit code is the one the command has
without ``--json`` and the one-line reason still goes to stderr.
"""

import json

import pytest
import safetensors.torch
import torch
from cli_helpers import make_run

from xla_ckpt import errors
from xla_ckpt.cli import verify as verify_cmd
from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.io import read_manifest
from xla_ckpt.storage import open_storage
from xla_ckpt.testing.fault_proxy.faults import Fault, downloads


def run_json(cli, *argv):
    """Run ``verify --json``; stdout must parse as one JSON document (json.loads refuses more)."""
    r = cli("verify", "--json", *argv)
    return r, json.loads(r.out)


def assert_failure(r, doc, *, uri, type_name, message, code):
    """The failure document, the exit code, and stderr's one line agreeing with the document."""
    assert r.code == code
    assert doc == {"uri": uri, "ok": False, "error": {"type": type_name, "message": message}}
    assert r.err == f"xla-ckpt verify: error: {message.splitlines()[0]}\n"


def test_nothing_there(cli, root):
    uri = f"{root}/nothing"
    r, doc = run_json(cli, uri)
    assert_failure(r, doc, uri=uri, type_name="CheckpointNotFoundError", code=2,
                   message=f"{uri}: no checkpoint here ({MANIFEST_NAME} not found)")


def test_nothing_there_with_debug_still_one_document_and_the_traceback_on_stderr(cli, tmp_path):
    uri = str(tmp_path / "nothing")
    r = cli("verify", "--json", uri, "--debug")
    assert r.code == 2
    assert json.loads(r.out)["error"]["type"] == "CheckpointNotFoundError"
    assert "Traceback (most recent call last)" in r.err
    assert r.err.rstrip().splitlines()[-1].startswith("xla-ckpt verify: error: ")


def test_incomplete_checkpoint_and_run_folder_of_incomplete_ones(cli, root):
    make_run(root, [], incomplete=["checkpoint_1_1"])
    uri = f"{root}/checkpoint_1_1"
    r, doc = run_json(cli, uri)
    assert_failure(r, doc, uri=uri, type_name="IncompleteCheckpointError", code=1,
                   message=(f"{uri}: checkpoint is incomplete (no {MANIFEST_NAME} commit marker); "
                            "the save that wrote it did not finish. Restore an earlier "
                            "checkpoint."))
    r, doc = run_json(cli, root)  # run folder -> latest: none committed
    assert_failure(r, doc, uri=root, type_name="IncompleteCheckpointError", code=1,
                   message=(f"{root}: run folder has no committed checkpoint (incomplete: "
                            "checkpoint_1_1); their saves did not finish"))


def test_unreadable_manifest_names_the_resolved_checkpoint(cli, root):
    make_run(root, [("checkpoint_1_100", 100, 1, 1.0)], last="checkpoint_1_100")
    uri = f"{root}/checkpoint_1_100"
    with open_storage(uri) as st:
        st.write_atomic(MANIFEST_NAME, [b'{"format": "xla_ckpt", "version": 1, "files": 3}'])
    r, doc = run_json(cli, uri)
    assert r.code == 1 and doc["ok"] is False and doc["uri"] == uri
    assert doc["error"]["type"] == "CheckpointCorruptError"
    assert "'files' must be an object" in doc["error"]["message"]
    assert set(doc) == {"uri", "ok", "error"}
    assert r.err == f"xla-ckpt verify: error: {doc['error']['message'].splitlines()[0]}\n"


def test_bad_uri_scheme(cli):
    r, doc = run_json(cli, "s3://bucket/x")
    assert r.code == 2 and doc["ok"] is False and doc["uri"] == "s3://bucket/x"
    assert issubclass(getattr(errors, doc["error"]["type"]), errors.ConfigError)
    assert "s3://bucket/x" in doc["error"]["message"]
    assert r.err == f"xla-ckpt verify: error: {doc['error']['message'].splitlines()[0]}\n"


def test_legacy_file(cli, root):
    with open_storage(root) as st:
        st.write_atomic("x.safetensors", [safetensors.torch.save({"w": torch.ones(2)})])
    uri = f"{root}/x.safetensors"
    r, doc = run_json(cli, uri)
    assert_failure(r, doc, uri=uri, type_name="UsageError", code=2,
                   message=(f"{uri} is a legacy torch.save/fairseq .pt or safetensors file, not "
                            "an xla_ckpt checkpoint folder; read it with xla_ckpt.load or import "
                            f"it with `xla-ckpt convert {uri} DST`"))


@pytest.fixture
def through_proxy(gcs_uri, fault_proxy, monkeypatch):
    """A committed checkpoint on the emulator; the CLI's GCS traffic then goes through the proxy."""
    uri = f"{gcs_uri}/ck"
    make_run(gcs_uri, [("ck", 100, 1, 1.0)])
    with open_storage(uri) as st:
        data = read_manifest(st).item().blobs[0].file
    for k, v in fault_proxy.env().items():
        monkeypatch.setenv(k, v)
    return uri, data


def test_storage_refusal_while_resolving(cli, through_proxy, fault_proxy):
    uri, _ = through_proxy
    fault_proxy.inject(Fault.error(403), match=downloads(MANIFEST_NAME), times=10)
    r, doc = run_json(cli, uri)
    assert r.code == 2 and doc["ok"] is False and doc["uri"] == uri
    assert doc["error"]["type"] == "StoragePermissionError"
    assert MANIFEST_NAME in doc["error"]["message"] and "403" in doc["error"]["message"]
    assert r.err == f"xla-ckpt verify: error: {doc['error']['message'].splitlines()[0]}\n"


def test_storage_refusal_while_verifying(cli, through_proxy, fault_proxy):
    uri, data = through_proxy
    fault_proxy.inject(Fault.error(403), match=downloads(data), times=100)
    r, doc = run_json(cli, uri)
    assert r.code == 2 and doc["ok"] is False and doc["uri"] == uri
    assert doc["error"]["type"] == "StoragePermissionError"
    assert data in doc["error"]["message"] and "403" in doc["error"]["message"]
    assert r.err == f"xla-ckpt verify: error: {doc['error']['message'].splitlines()[0]}\n"
    fault_proxy.clear_faults()
    r, doc = run_json(cli, uri)  # the same checkpoint, once readable, is intact
    assert r.code == 0 and doc["ok"] is True and doc["error"] is None


def test_interrupted_prints_the_document_and_exits_130(cli, tmp_path, monkeypatch):
    uri = str(tmp_path / "ck")
    make_run(str(tmp_path), [("ck", 100, 1, 1.0)])

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(verify_cmd, "verify_checkpoint", interrupted)
    r, doc = run_json(cli, uri)
    assert r.code == 130 and r.err == "xla-ckpt verify: interrupted\n"
    assert doc == {"uri": uri, "ok": False,
                   "error": {"type": "KeyboardInterrupt", "message": "interrupted"}}


def test_internal_error_in_verify(cli, tmp_path, monkeypatch):
    uri = str(tmp_path / "ck")
    make_run(str(tmp_path), [("ck", 100, 1, 1.0)])

    def boom(*a, **k):
        raise ZeroDivisionError("bug")

    monkeypatch.setattr(verify_cmd, "verify_checkpoint", boom)
    r, doc = run_json(cli, uri)
    assert r.code == 1
    assert doc == {"uri": uri, "ok": False,
                   "error": {"type": "ZeroDivisionError", "message": "bug"}}
    assert r.err == ("xla-ckpt verify: error: internal error (ZeroDivisionError: bug); rerun "
                     "with --debug\n")


def test_reports_carry_a_null_error(cli, root):
    make_run(root, [("checkpoint_1_100", 100, 1, 1.0)], last="checkpoint_1_100")
    r, doc = run_json(cli, root)  # run folder -> latest
    assert r.code == 0 and r.err == ""
    assert doc["ok"] is True and doc["error"] is None and doc["problems"] == []
    assert doc["uri"] == f"{root}/checkpoint_1_100"
    assert (doc["files"], doc["tensors"]) == (1, 8)


@pytest.mark.parametrize("command", ["ls", "inspect", "verify"])
def test_every_json_command_prints_one_failure_document(cli, tmp_path, command):
    """The kind, not just verify: ls and inspect with --json keep their shape on failure too."""
    uri = str(tmp_path / "nothing")
    r = cli(command, "--json", uri)
    doc = json.loads(r.out)
    assert r.code == 2
    assert doc["uri"] == uri and doc["ok"] is False
    assert doc["error"]["type"] == "CheckpointNotFoundError"
    assert r.err == f"xla-ckpt {command}: error: {doc['error']['message'].splitlines()[0]}\n"


@pytest.mark.parametrize("argv", [("verify", "--json"), ("ls", "--json", "a", "b"),
                                  ("verify", "--json", "x", "--no-such-flag")])
def test_usage_errors_with_json_print_one_document(cli, argv):
    r = cli(*argv)
    doc = json.loads(r.out)
    assert r.code == 2
    assert doc["ok"] is False and doc["uri"] is None
    assert doc["error"]["type"] == "UsageError"
    given = " ".join(["--no-progress", *argv])  # the fixture's first argument
    assert doc["error"]["message"] == f"bad arguments {given!r}; see `xla-ckpt --help`"
    assert "usage: xla-ckpt" in r.err  # argparse's own explanation still goes to stderr
