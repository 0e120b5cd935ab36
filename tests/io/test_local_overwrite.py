"""Saving over a committed local checkpoint: the old one stays loadable until the new one
commits."""

import os

import pytest
import torch

import xla_ckpt
from xla_ckpt.errors import StorageError
from xla_ckpt.format.manifest import MANIFEST_NAME, STATE_ITEM
from xla_ckpt.io import commit, new_save_id, write_item
from xla_ckpt.storage.local import LocalStorage
from xla_ckpt.testing.asserts import assert_state_identical

OLD = {"w": torch.full((64,), 1.0), "step": 1}
NEW = {"w": torch.full((64,), 2.0), "step": 2}


class FailingWrites(LocalStorage):
    """The real local backend, failing the write of one object (a crash the disk cannot fake)."""

    def __init__(self, uri: str, fail_on: str) -> None:
        super().__init__(uri)
        self.fail_on = fail_on

    def write_atomic(self, name, buffers, **kw):
        if name == self.fail_on or (self.fail_on == "data" and name.endswith(".safetensors")):
            raise StorageError(f"{self.url(name)}: write failed: injected")
        return super().write_atomic(name, buffers, **kw)


def files(folder: str) -> set[str]:
    return set(os.listdir(folder))


def test_overwrite_replaces_and_removes_the_old_data_files(local_dir):
    xla_ckpt.save(OLD, local_dir)
    old_files = files(local_dir)
    xla_ckpt.save(NEW, local_dir)
    assert_state_identical(xla_ckpt.load(local_dir), NEW)
    new_files = files(local_dir)
    assert len(new_files) == 2 and MANIFEST_NAME in new_files
    assert not (old_files - {MANIFEST_NAME}) & new_files


@pytest.mark.parametrize("fail_on", [MANIFEST_NAME, "data"])
def test_failed_overwrite_leaves_the_old_checkpoint_intact(local_dir, fail_on):
    xla_ckpt.save(OLD, local_dir)
    before = files(local_dir)
    manifest_before = open(os.path.join(local_dir, MANIFEST_NAME), "rb").read()
    with pytest.raises(StorageError, match="write failed: injected"):
        xla_ckpt.save(NEW, local_dir, storage=FailingWrites(local_dir, fail_on))
    assert_state_identical(xla_ckpt.load(local_dir), OLD)
    assert files(local_dir) == before  # the new save's data files were discarded
    assert open(os.path.join(local_dir, MANIFEST_NAME), "rb").read() == manifest_before


def test_crash_between_data_and_commit_then_a_later_save_cleans_up(local_dir):
    xla_ckpt.save(OLD, local_dir)
    storage = LocalStorage(local_dir)
    write_item(storage, new_save_id(), STATE_ITEM, NEW)  # data written, process "dies"
    assert len(files(local_dir)) == 3
    assert_state_identical(xla_ckpt.load(local_dir), OLD)
    xla_ckpt.save(NEW, local_dir)
    assert_state_identical(xla_ckpt.load(local_dir), NEW)
    assert len(files(local_dir)) == 2


def test_reader_of_the_old_manifest_keeps_its_bytes_until_commit(local_dir):
    xla_ckpt.save(OLD, local_dir)
    storage = LocalStorage(local_dir)
    save_id = new_save_id()
    part = write_item(storage, save_id, STATE_ITEM, NEW)
    assert_state_identical(xla_ckpt.load(local_dir), OLD)  # still the committed one
    commit(storage, save_id, [part])
    assert_state_identical(xla_ckpt.load(local_dir), NEW)


def test_no_temporary_files_are_left_behind(local_dir):
    for state in (OLD, NEW, OLD):
        xla_ckpt.save(state, local_dir)
    assert not [f for f in files(local_dir) if ".tmp-" in f]
