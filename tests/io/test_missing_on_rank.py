"""A data file the committed manifest lists but this process cannot see: DataFileMissingError.

Told apart from "corrupt" (a file there with the wrong size stays a plain CheckpointCorruptError
naming both sizes) and from "nothing committed" (never a CheckpointNotFoundError or
FileNotFoundError, which callers take as "start fresh"), on the local disk and on gs://, whether
the file is absent at the stat or goes away during the read; ``verify`` reports the same split as
"missing" and "size" problems.
"""

import os
import pickle

import pytest
import torch

import xla_ckpt
from xla_ckpt.cli.common import exit_code_for
from xla_ckpt.comm import SingleProcess
from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DataFileMissingError,
    DistributedError,
    XlaCkptError,
)
from xla_ckpt.format.manifest import STATE_ITEM
from xla_ckpt.io import CheckpointReader, read_manifest
from xla_ckpt.io.verify import verify_checkpoint
from xla_ckpt.restore import restore
from xla_ckpt.storage import LocalStorage, StorageConfig, open_storage

STATE = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int64),
         "lr": 0.1}
SMALL_SLICES = StorageConfig(slice_size_bytes=4096, max_workers=2)


def advice(uri: str) -> str:
    return (f"Checkpoint {uri} is committed, but this process cannot see the file; its bytes are "
            "not known to be bad. Check that every host reads the same storage (is the checkpoint "
            "on another host's local disk? a filesystem not mounted here?) and that the "
            "checkpoint was not deleted or replaced while it was read (rotation, a save to the "
            "same folder).")


@pytest.fixture
def saved(root):
    """A committed checkpoint at ``<root>/ck`` (local or gs://): (uri, data file name, size)."""
    uri = f"{root}/ck"
    xla_ckpt.save(STATE, uri)
    with open_storage(uri) as st:
        ((name, size),) = read_manifest(st).files.items()
    return uri, name, size


@pytest.fixture(params=["local", "gcs"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path)
    return request.getfixturevalue("gcs_uri")


def delete(uri: str, name: str) -> None:
    with open_storage(uri) as st:
        st.delete(name)


def load_or_start_fresh(uri: str):
    """What a training script does: nothing committed -> start fresh; anything else -> raise."""
    try:
        return xla_ckpt.load(uri)
    except FileNotFoundError:
        return "fresh"


def test_missing_at_the_stat_is_its_own_error_naming_file_and_checkpoint(saved):
    uri, name, size = saved
    delete(uri, name)
    with pytest.raises(DataFileMissingError) as e:
        xla_ckpt.load(uri)
    err = e.value
    assert str(err) == (f"{uri}/{name}: data file listed in the manifest is missing (expected "
                        f"{size} bytes). {advice(uri)}")
    assert (err.path, err.checkpoint) == (f"{uri}/{name}", uri)
    assert isinstance(err, CheckpointCorruptError) and isinstance(err, XlaCkptError)
    assert not isinstance(err, (CheckpointNotFoundError, FileNotFoundError))
    assert exit_code_for(err) == 1  # the CLI: a checkpoint that cannot be read whole, not usage
    back = pickle.loads(pickle.dumps(err))  # errors cross process boundaries
    assert type(back) is DataFileMissingError and str(back) == str(err)
    assert (back.path, back.checkpoint) == (err.path, err.checkpoint)


def test_a_start_fresh_caller_does_not_start_fresh_on_it(saved, root):
    uri, name, _ = saved
    assert load_or_start_fresh(f"{root}/nothing") == "fresh"
    delete(uri, name)
    with pytest.raises(DataFileMissingError):
        load_or_start_fresh(uri)


def test_missing_while_reading_is_the_same_error(saved):
    uri, name, size = saved
    with open_storage(uri, SMALL_SLICES) as st:
        reader = CheckpointReader(st)
        reader.check_files()  # stat'ed (and on gs:// the generation pinned): it was there
        st.delete(name)
        with pytest.raises(DataFileMissingError) as e:
            reader.load()
    msg = str(e.value)
    head = (f"{uri}/{name}: data file listed in the manifest is missing (expected {size} bytes; "
            "it was there when the read began, then: ")
    assert msg.startswith(head) and msg.endswith(f"). {advice(uri)}")
    assert name in msg[len(head):]  # the storage's own words name the object
    assert isinstance(e.value.__cause__, CheckpointNotFoundError)  # kept as the cause, not raised


def test_wrong_size_stays_a_plain_corrupt_error(saved):
    uri, name, size = saved
    with open_storage(uri) as st:
        data = st.read_bytes(name)
        st.write_atomic(name, [data[:size - 10]])
    with pytest.raises(CheckpointCorruptError) as e:
        xla_ckpt.load(uri)
    assert type(e.value) is CheckpointCorruptError
    assert str(e.value) == (f"{uri}/{name}: expected {size} bytes, found {size - 10} bytes "
                            "(truncated)")


def test_restore_reports_it_from_the_rank_that_read(saved):
    uri, name, _ = saved
    delete(uri, name)
    with pytest.raises(DistributedError) as e:
        restore(uri, dist=SingleProcess())
    assert isinstance(e.value.__cause__, DataFileMissingError)
    assert e.value.failures[0].startswith(f"DataFileMissingError: {uri}/{name}: data file listed "
                                          "in the manifest is missing")


# ---- verify: "missing" vs "size" ----------------------------------------------------------------


def test_verify_reports_missing_and_size_apart(saved):
    uri, name, size = saved
    with open_storage(uri) as st:
        delete(uri, name)
        missing = verify_checkpoint(st)
        st.write_atomic(name, [b"\0" * (size + 1)])
        longer = verify_checkpoint(st)
    detail = (f"data file is missing (expected {size} bytes): the committed manifest lists it, but "
              "the storage says it does not exist for this process")
    assert {(p.kind, p.file, p.item, p.detail) for p in missing.problems} == {
        ("missing", name, STATE_ITEM, detail)}
    assert missing.bad_keys == ["state['w']", "state['b']"]  # one problem per blob in the file
    assert missing.bytes_read == 0
    assert [(p.kind, p.detail) for p in longer.problems if p.kind != "crc32c"][0] == (
        "size", f"expected {size} bytes, found {size + 1} bytes (extra bytes)")


class ChangingStorage(LocalStorage):
    """Local storage where ``victim`` is deleted, or cut to ``keep`` bytes, at its first slice read
    (after verify stat'ed it and read its header)."""

    victim = ""
    keep: int | None = None

    def read_range(self, name, offset, out, generation=None):
        if name == self.victim and offset >= 8 + 64:  # past the header: a blob slice
            path = os.path.join(self.root, name)
            if self.keep is None:
                os.unlink(path)
            else:
                os.truncate(path, self.keep)
            type(self).victim = ""
        super().read_range(name, offset, out, generation)


@pytest.mark.parametrize("keep", [None, 100])
def test_verify_reports_a_file_that_changes_while_verified(tmp_path, keep):
    uri = str(tmp_path / "ck")
    xla_ckpt.save(STATE, uri)
    with open_storage(uri) as st:
        m = read_manifest(st)
    ((name, _size),) = m.files.items()
    blobs = m.items[STATE_ITEM].blobs
    assert min(b.offset for b in blobs) >= 8 + 64
    ChangingStorage.victim, ChangingStorage.keep = name, keep
    with ChangingStorage(uri, StorageConfig(max_workers=1)) as st:
        report = verify_checkpoint(st, m)
    kinds = {p.kind for p in report.problems}
    assert kinds == {"missing" if keep is None else "size"}
    assert {k for p in report.problems for k in p.keys} == {"state['w']", "state['b']"}
    for p in report.problems:
        assert p.file == name and p.item == STATE_ITEM
        if keep is None:
            assert p.detail == (f"data file vanished while being verified: {uri}/{name}: no "
                                "such file")
        else:
            assert p.detail.startswith(f"data file shrank while being verified: {uri}/{name}: "
                                       "truncated: expected at least ")
            assert p.detail.endswith(f"bytes, file has {keep} bytes")
