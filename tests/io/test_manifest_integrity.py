"""The manifest checks its own bytes: no single-bit flip of a committed manifest loads wrong
values."""

import os

import pytest
import torch

import xla_ckpt
from xla_ckpt.errors import CheckpointCorruptError
from xla_ckpt.format.manifest import CRC_FIELD, MANIFEST_NAME, Manifest, seal


@pytest.fixture
def saved(local_dir):
    uri = os.path.join(local_dir, "ck")
    state = {"w": torch.arange(6, dtype=torch.float32).view(2, 3), "step": 7, "name": "adam",
             "betas": (0.9, 0.98)}
    xla_ckpt.save(state, uri, metadata={"num_updates": 7})
    return uri, state


def test_every_single_bit_flip_of_the_manifest_is_refused(saved):
    uri, _ = saved
    raw = open(os.path.join(uri, MANIFEST_NAME), "rb").read()
    assert raw.endswith(b'"}') and f'"{CRC_FIELD}":"'.encode() in raw
    Manifest.from_json_bytes(raw, require_crc=True)  # the intact one parses
    accepted = []
    for i in range(len(raw)):
        for bit in range(8):
            bad = bytearray(raw)
            bad[i] ^= 1 << bit
            try:
                Manifest.from_json_bytes(bytes(bad), where="m", require_crc=True)
            except CheckpointCorruptError:
                continue
            accepted.append((i, bit))
    assert accepted == []


def test_flipped_manifest_on_disk_fails_load_naming_the_manifest(saved):
    uri, _ = saved
    path = os.path.join(uri, MANIFEST_NAME)
    raw = bytearray(open(path, "rb").read())
    i = raw.index(b'"step":7') + len(b'"step":')
    raw[i] ^= 0x01  # 7 -> 6: still valid JSON and a valid structure; only the crc32c catches it
    open(path, "wb").write(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match=r"manifest\.json: manifest crc32c mismatch"):
        xla_ckpt.load(uri)


def test_manifest_without_trailer_is_refused_by_readers(saved):
    uri, state = saved
    path = os.path.join(uri, MANIFEST_NAME)
    raw = open(path, "rb").read()
    body = raw[:raw.index(f',"{CRC_FIELD}"'.encode())] + b"}"
    Manifest.from_json_bytes(body)  # parsing alone does not insist ...
    open(path, "wb").write(body)
    with pytest.raises(CheckpointCorruptError, match="has no manifest_crc32c trailer"):
        xla_ckpt.load(uri)  # ... a reader of a stored checkpoint does
    open(path, "wb").write(seal(body))
    restored = xla_ckpt.load(uri)
    assert torch.equal(restored["w"], state["w"]) and restored["betas"] == (0.9, 0.98)
