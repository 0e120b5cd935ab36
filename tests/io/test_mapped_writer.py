"""Staging a data file straight into its pages (xla_ckpt.io.mapped_writer): the file is the one
``write_items`` writes, byte for byte; it is a snapshot; a recycled file keeps its pages and
this process's mapping; a full tmpfs is an ENOSPC before the copy, never a SIGBUS."""

import errno
import os
import subprocess

import pytest
import torch

import xla_ckpt
from xla_ckpt.format.manifest import STATE_ITEM, rank_item
from xla_ckpt.io import commit
from xla_ckpt.io.mapped_writer import MappedPages, stage_file
from xla_ckpt.io.writer import plan_file, write_items
from xla_ckpt.storage.local import LocalStorage
from xla_ckpt.testing.asserts import assert_state_identical

SAVE_ID = "0123456789ab"


def awkward_state(seed: int = 0, n: int = 4096) -> dict:
    """Tied weights, a strided view kept with its strides, a thin view written densely, an
    empty tensor, a 0-d tensor, bf16 and int values, and plain values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n // 64, 64, generator=g)
    base = torch.randn(64, 64, generator=g)
    return {"model": {"emb": w, "out": w, "t": w.t(), "half": base[:, :40],
                      "thin": torch.randn(512, 64, generator=g)[:, ::16],
                      "empty": torch.empty(0, 3), "scalar": torch.tensor(3.5),
                      "bf16": torch.randn(300, generator=g).to(torch.bfloat16),
                      "ids": torch.randint(0, 1000, (77,), generator=g)},
            "step": seed, "names": ["a", "b"]}


def items_of(state: dict) -> list[tuple[str, object]]:
    return [(STATE_ITEM, state), (rank_item(0), {"rng": torch.arange(10), "n": 3})]


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_a_staged_file_is_the_written_file_byte_for_byte(tmp_path):
    state = awkward_state()
    ref = LocalStorage(str(tmp_path / "ref"))
    want = write_items(ref, SAVE_ID, items_of(state))
    storage = LocalStorage(str(tmp_path / "staged"))
    os.makedirs(storage.root)
    pages = MappedPages()
    try:
        staged = stage_file(storage, plan_file(SAVE_ID, items_of(state), to_host=False), pages)
        assert [f for f in os.listdir(storage.root) if ".tmp-" in f]  # unfinished: a temp name
        got = staged.finish()
        assert [g.to_json() for g in got] == [w.to_json() for w in want]
        (fname,) = want[0].files
        assert os.listdir(storage.root) == [fname]
        assert read(os.path.join(storage.root, fname)) == read(os.path.join(ref.root, fname))
        commit(storage, SAVE_ID, got)
        assert_state_identical(xla_ckpt.load(storage.root), state)
        loaded = xla_ckpt.load(storage.root)
        assert loaded["model"]["emb"].untyped_storage().data_ptr() == \
            loaded["model"]["out"].untyped_storage().data_ptr()  # aliasing kept
    finally:
        pages.close()


def test_the_staged_pages_are_a_snapshot(tmp_path):
    """The copy happens in stage_file: the live tensors change after it, the file does not."""
    state = awkward_state(1)
    want = {k: v.clone() for k, v in state["model"].items()}
    storage = LocalStorage(str(tmp_path))
    pages = MappedPages()
    try:
        staged = stage_file(storage, plan_file(SAVE_ID, [(STATE_ITEM, state)], to_host=False),
                            pages)
        for t in state["model"].values():
            if t.numel():
                t.fill_(7)  # the optimizer steps them in place
        state["step"] = 99  # plain values were frozen by the plan's typed encoding
        commit(storage, SAVE_ID, staged.finish())
        got = xla_ckpt.load(str(tmp_path))
        assert got["step"] == 1
        assert_state_identical(got["model"], want)
    finally:
        pages.close()


def test_a_recycled_file_keeps_its_inode_and_this_process_mapping(tmp_path):
    storage = LocalStorage(str(tmp_path / "step"))
    os.makedirs(storage.root)
    spare = str(tmp_path / "spare")
    pages = MappedPages()
    try:
        first = stage_file(storage, plan_file("aaaaaaaaaaaa", items_of(awkward_state(2)),
                                              to_host=False), pages)
        (path,) = [os.path.join(storage.root, f) for f in first.finish()[0].files]
        ino, mapped = os.stat(path).st_ino, pages.nbytes
        assert mapped == os.path.getsize(path)
        os.replace(path, spare)  # keep-last-K evicted it: a spare
        for k, (seed, n) in enumerate([(3, 4096), (4, 8192), (5, 1024)]):
            state = awkward_state(seed, n)  # the same size, bigger, smaller
            sid = f"{k:012x}"
            staged = stage_file(storage, plan_file(sid, items_of(state), to_host=False), pages,
                                spare=spare)
            assert not os.path.exists(spare)
            parts = staged.finish()
            (name,) = parts[0].files
            assert os.stat(os.path.join(storage.root, name)).st_ino == ino  # recycled
            commit(storage, sid, parts)
            assert_state_identical(xla_ckpt.load(storage.root), state)
            assert pages.nbytes >= os.path.getsize(os.path.join(storage.root, name))
            assert pages.nbytes <= max(mapped, os.path.getsize(os.path.join(storage.root, name)))
            mapped = pages.nbytes
            os.replace(os.path.join(storage.root, name), spare)
        # A spare that is gone (taken, or dropped for room): a fresh file, same bytes.
        os.unlink(spare)
        staged = stage_file(storage, plan_file("bbbbbbbbbbbb", items_of(awkward_state(6)),
                                               to_host=False), pages, spare=spare)
        parts = staged.finish()
        commit(storage, "bbbbbbbbbbbb", parts)
        assert_state_identical(xla_ckpt.load(storage.root), awkward_state(6))
        # The mapping of the unlinked spare was closed at that open: only the new file's left.
        (name,) = parts[0].files
        assert pages.nbytes == os.path.getsize(os.path.join(storage.root, name))
        os.unlink(os.path.join(storage.root, name))  # pruned: its pages go once unmapped
        pages.forget_unlinked()
        assert pages.nbytes == 0
    finally:
        pages.close()
    assert pages.nbytes == 0


def _mount_tmpfs(path: str, size: int) -> bool:
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                       capture_output=True, check=False)
    return r.returncode == 0


def test_a_full_tmpfs_is_enospc_before_the_copy_and_leaves_nothing(tmp_path):
    """A real 256 KiB tmpfs and a 1 MiB file: the pages are reserved first, so the process
    gets ENOSPC (an OSError the save reports), not a SIGBUS in the middle of the copy."""
    mount = str(tmp_path / "tmpfs")
    if not _mount_tmpfs(mount, 256 * 1024):
        pytest.skip("cannot mount a tmpfs here (needs CAP_SYS_ADMIN)")
    pages = MappedPages()
    try:
        storage = LocalStorage(mount)
        big = {"w": torch.randn(256, 1024)}
        with pytest.raises(OSError) as e:
            stage_file(storage, plan_file(SAVE_ID, [(STATE_ITEM, big)], to_host=False), pages)
        assert e.value.errno == errno.ENOSPC
        assert os.listdir(mount) == []
        assert pages.nbytes == 0
        small = {"w": torch.randn(16, 1024)}  # what fits still goes
        staged = stage_file(storage, plan_file(SAVE_ID, [(STATE_ITEM, small)], to_host=False),
                            pages)
        commit(storage, SAVE_ID, staged.finish())
        assert_state_identical(xla_ckpt.load(mount), small)
    finally:
        pages.close()
        subprocess.run(["umount", mount], check=False)
