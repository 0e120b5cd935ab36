"""Truncated and bit-flipped local checkpoints: the library's error naming the path, never wrong
values."""

import logging
import os

import pytest
import torch

import xla_ckpt
from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DataFileMissingError,
    IncompleteCheckpointError,
    IntegrityError,
    XlaCkptError,
)
from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.testing.asserts import assert_state_identical

STATE = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.tensor([1, 2, 3]),
         "lr": 0.1}


@pytest.fixture
def saved(local_dir):
    xla_ckpt.save(STATE, local_dir)
    (name,) = [f for f in os.listdir(local_dir) if f.endswith(".safetensors")]
    return local_dir, os.path.join(local_dir, name)


@pytest.fixture(autouse=True)
def quiet_crc_retries(caplog):
    caplog.set_level(logging.ERROR, logger="xla_ckpt.io.blob_reader")


@pytest.mark.parametrize("cut", ["0", "1", "n/2", "n-1"])
def test_truncated_data_file_names_path_and_sizes(saved, cut):
    folder, path = saved
    n = os.path.getsize(path)
    keep = {"0": 0, "1": 1, "n/2": n // 2, "n-1": n - 1}[cut]
    os.truncate(path, keep)
    with pytest.raises(CheckpointCorruptError) as e:
        xla_ckpt.load(folder)
    assert str(e.value) == f"{path}: expected {n} bytes, found {keep} bytes (truncated)"


def test_data_file_with_extra_bytes_is_refused(saved):
    folder, path = saved
    n = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(CheckpointCorruptError, match=rf"expected {n} bytes, found {n + 1} bytes "
                                                     r"\(extra bytes\)"):
        xla_ckpt.load(folder)


def test_missing_data_file_names_it(saved):
    folder, path = saved
    n = os.path.getsize(path)
    os.unlink(path)
    with pytest.raises(DataFileMissingError) as e:  # a CheckpointCorruptError, never "not found"
        xla_ckpt.load(folder)
    assert isinstance(e.value, CheckpointCorruptError)
    assert not isinstance(e.value, CheckpointNotFoundError)
    assert str(e.value).startswith(f"{path}: data file listed in the manifest is missing (expected "
                                   f"{n} bytes). Checkpoint {folder} is committed, but this "
                                   "process cannot see the file")


@pytest.mark.parametrize("keep", [0, 1, "half"])
def test_truncated_manifest_is_refused_naming_it(saved, keep):
    folder, _ = saved
    mpath = os.path.join(folder, MANIFEST_NAME)
    size = os.path.getsize(mpath)
    os.truncate(mpath, size // 2 if keep == "half" else keep)
    with pytest.raises(CheckpointCorruptError) as e:
        xla_ckpt.load(folder)
    assert str(e.value).startswith(f"{mpath}: not a valid JSON manifest")


def test_a_bit_flip_at_every_byte_of_the_data_file_errors_or_reads_right(saved):
    folder, path = saved
    original = open(path, "rb").read()
    header_len = 8 + int.from_bytes(original[:8], "little")
    outcomes = {"IntegrityError": 0, "identical": 0}
    for i in range(len(original)):
        data = bytearray(original)
        data[i] ^= 1 << (i % 8)
        with open(path, "wb") as f:
            f.write(data)
        try:
            got = xla_ckpt.load(folder)
        except IntegrityError as e:
            assert e.path == path and e.key in ("state['w']", "state['b']")
            assert str(e).startswith(f"{path}: crc32c mismatch in bytes [")
            assert i >= header_len  # only payload bytes are read
            outcomes["IntegrityError"] += 1
            continue
        assert i < header_len  # the safetensors header is not what a load trusts
        assert_state_identical(got, STATE)
        outcomes["identical"] += 1
    assert outcomes == {"IntegrityError": len(original) - header_len, "identical": header_len}


def test_bit_flip_error_names_the_tensor(saved):
    folder, path = saved
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0x10  # last byte of the last blob
    open(path, "wb").write(bytes(data))
    with pytest.raises(IntegrityError) as e:
        xla_ckpt.load(folder)
    assert "of tensor state[" in str(e.value) and "after 3 reads" in str(e.value)
    assert "run `xla-ckpt verify`" in str(e.value)


def test_folder_without_commit_marker_is_incomplete(saved):
    folder, _ = saved
    os.unlink(os.path.join(folder, MANIFEST_NAME))
    with pytest.raises(IncompleteCheckpointError) as e:
        xla_ckpt.load(folder)
    assert str(e.value) == (f"{folder}: checkpoint is incomplete (no {MANIFEST_NAME} commit "
                            "marker); the save that wrote it did not finish. Restore an earlier "
                            "checkpoint.")


def test_nothing_there(local_dir):
    with pytest.raises(CheckpointNotFoundError) as e:
        xla_ckpt.load(os.path.join(local_dir, "absent"))
    assert not isinstance(e.value, IncompleteCheckpointError)
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, XlaCkptError)
