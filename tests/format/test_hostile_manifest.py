"""Hostile checkpoint folders: a tampered manifest or data-file header never escapes the library.

Each case takes a real saved checkpoint, tampers with its manifest (or a data
file's safetensors header) the way an attacker or a broken tool would, and
checks that load gives ``CheckpointCorruptError`` naming the manifest and
what is wrong -- before any byte outside the folder is read and before any
buffer is sized from the tampered numbers.
"""

import json
from typing import Any

import pytest
import torch

import xla_ckpt
from xla_ckpt.errors import CheckpointCorruptError
from xla_ckpt.format import manifest as manifest_mod
from xla_ckpt.format.manifest import CRC_FIELD, MANIFEST_NAME, Manifest, seal
from xla_ckpt.io.verify import verify_checkpoint
from xla_ckpt.storage.local import LocalStorage

STATE: dict[str, Any] = {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
                   "b": torch.ones(4, dtype=torch.bfloat16)}, "step": 7}


@pytest.fixture
def ck(tmp_path):
    folder = tmp_path / "run" / "checkpoint_1"
    xla_ckpt.save(STATE, str(folder))
    (tmp_path / "run" / "secret.txt").write_text("outside the checkpoint")
    return folder


def _doc(folder):
    doc = json.loads((folder / MANIFEST_NAME).read_text())
    doc.pop(CRC_FIELD)  # _write seals the edited document again
    return doc


def _write(folder, doc=None, raw: bytes | None = None):
    (folder / MANIFEST_NAME).write_bytes(raw if raw is not None else seal(json.dumps(doc).encode()))


def _expect(folder, match):
    with pytest.raises(CheckpointCorruptError, match=match) as err:
        xla_ckpt.load(str(folder))
    assert MANIFEST_NAME in str(err.value) or str(folder) in str(err.value)
    return err


def _blob(doc, i=0):
    return doc["items"]["state"]["blobs"][i]


def _tensor(doc, i=0):
    return doc["items"]["state"]["tensors"][i]


@pytest.mark.parametrize("name", ["../secret.txt", "../../etc/passwd", "/etc/passwd", "a/b",
                                  "..", ".", "manifest.json", "x\x00y", "c:\\x", ""])
def test_file_names_escaping_the_folder_are_refused(ck, name):
    doc = _doc(ck)
    old = _blob(doc)["file"]
    doc["files"][name] = doc["files"].pop(old)
    for b in doc["items"]["state"]["blobs"]:
        b["file"] = name
    _write(ck, doc)
    _expect(ck, "escapes the checkpoint folder or is not a plain name")


def test_negative_offset_is_refused(ck):
    doc = _doc(ck)
    _blob(doc)["offset"] = -8
    _write(ck, doc)
    _expect(ck, "offset must be an integer >= 0, got -8")


def test_blob_beyond_its_file_is_refused(ck):
    doc = _doc(ck)
    _blob(doc)["length"] += 10**6
    _write(ck, doc)
    _expect(ck, r"lies beyond the end of")


def test_overlapping_blobs_are_refused(ck):
    doc = _doc(ck)
    _blob(doc, 1)["offset"] = _blob(doc, 0)["offset"] + 1
    _write(ck, doc)
    _expect(ck, "blobs overlap in")


@pytest.mark.parametrize("dtype", ["float128", "object", "Tensor", 5, None, "qint8"])
def test_unknown_dtype_is_refused(ck, dtype):
    doc = _doc(ck)
    _tensor(doc)["dtype"] = dtype
    _write(ck, doc)
    _expect(ck, f"unknown dtype {dtype!r}")


def test_shape_disagreeing_with_byte_length_is_refused(ck):
    doc = _doc(ck)
    _tensor(doc)["shape"] = [30, 4]
    _tensor(doc)["stride"] = [4, 1]
    _write(ck, doc)
    _expect(ck, r"shape \[30, 4\] of float32 needs 480 bytes from offset 0 but its blob holds 48")


def test_shape_overflowing_int64_is_refused(ck):
    doc = _doc(ck)
    _tensor(doc)["shape"] = [0, 2**64]
    _tensor(doc)["stride"] = [1, 1]
    _write(ck, doc)
    _expect(ck, "exceed what a tensor can address")


def test_duplicate_json_keys_are_refused(ck):
    raw = (ck / MANIFEST_NAME).read_bytes()
    tampered = raw.replace(b'"save_id":', b'"save_id":"evil","save_id":', 1)
    _write(ck, raw=tampered)
    _expect(ck, "duplicate key 'save_id'")


def test_duplicate_tensor_keys_are_refused(ck):
    doc = _doc(ck)
    _tensor(doc, 1)["key"] = _tensor(doc, 0)["key"]
    _write(ck, doc)
    _expect(ck, r"duplicate tensor key state\['model'\]\['w'\]")


def test_deep_json_nesting_is_refused(ck):
    raw = b'{"format":"xla_ckpt","version":1,"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    _write(ck, raw=raw)
    _expect(ck, "not a valid JSON manifest")


def test_deep_typed_state_is_refused(ck):
    doc = _doc(ck)
    node: Any = 1
    for _ in range(500):
        node = [node]
    doc["items"]["state"]["state"]["deep"] = node
    _write(ck, doc)
    _expect(ck, "nesting deeper than 128")


def test_absurd_manifest_length_is_refused_before_parsing(ck, monkeypatch):
    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", 64)  # a 256 MiB file is the real one
    _expect(ck, "exceeds the 64-byte limit")


def test_absurd_sizes_do_not_allocate(tmp_path):
    ck = tmp_path / "one"
    xla_ckpt.save({"w": torch.ones(4)}, str(ck))
    doc = _doc(ck)
    name = _blob(doc)["file"]
    doc["files"][name] += 2**42  # 4 TiB: allocating it would fail or exhaust memory
    for b in doc["items"]["state"]["blobs"]:
        b.pop("chunk_crc32c", None)
    _blob(doc)["length"] += 2**42
    _tensor(doc)["shape"] = [2**40]
    _tensor(doc)["stride"] = [1]
    _write(ck, doc)
    err = _expect(ck, r"expected \d+ bytes, found \d+ bytes \(truncated\)")
    assert name in str(err.value)


def test_hostile_values_in_the_typed_state_are_refused(ck):
    doc = _doc(ck)
    doc["items"]["state"]["state"]["evil"] = {"$np": "O", "v": 1}
    _write(ck, doc)
    _expect(ck, "numpy dtype 'O' not allowed")


def test_malformed_metadata_is_refused_at_parse(ck):
    doc = _doc(ck)
    doc["metadata"] = {"$complex": "x"}
    _write(ck, doc)
    _expect(ck, r"metadata: malformed typed state: \$complex needs \[re, im\]")


def test_absurd_safetensors_header_length_is_reported_by_verify(ck):
    doc = _doc(ck)
    path = ck / _blob(doc)["file"]
    data = bytearray(path.read_bytes())
    data[:8] = (2**62).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with LocalStorage(str(ck)) as st:
        report = verify_checkpoint(st)
    assert [(p.kind, p.file) for p in report.problems] == [("header", path.name)]
    assert "safetensors header length 4611686018427387904 is impossible" in \
        report.problems[0].detail
    # The manifest is the authority on byte ranges: the tensors themselves are intact.
    assert torch.equal(xla_ckpt.load(str(ck))["model"]["w"], STATE["model"]["w"])


def test_parser_accepts_the_untampered_manifest(ck):
    m = Manifest.from_json_bytes((ck / MANIFEST_NAME).read_bytes())
    assert sorted(t.key for t in m.item().tensors) == ["state['model']['b']",
                                                       "state['model']['w']"]
