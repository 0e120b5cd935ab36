"""The commit marker is written only over data files the committing process can see whole
(H9-6: ranks writing to storage they do not share must never commit).

Real parts: two local folders stand for two hosts' node-local disks (a writer's file lands in
one, the commit runs against the other), and the GCS emulator (two prefixes) through the
fault proxy, which logs each request so the cost of the check (one metadata GET per data file)
is a value.  Every case asserts that nothing was committed and that the error names the file
and the rank that wrote it.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import xla_ckpt
from xla_ckpt.errors import StorageError, StorageNotSharedError
from xla_ckpt.format.manifest import MANIFEST_NAME, STATE_ITEM, rank_item
from xla_ckpt.io import commit, new_save_id, read_manifest
from xla_ckpt.io.writer import check_files_visible, write_items, writer_rank
from xla_ckpt.storage import open_storage


def _two_hosts(tmp_path):
    """Rank 0's and rank 1's storage under the same checkpoint name, not shared."""
    return open_storage(str(tmp_path / "host0" / "ckpt")), open_storage(str(tmp_path / "host1"
                                                                             / "ckpt"))


def test_a_file_another_rank_wrote_elsewhere_is_named_and_nothing_is_committed(tmp_path):
    here, there = _two_hosts(tmp_path)
    sid = new_save_id()
    try:
        parts = write_items(here, sid, [(STATE_ITEM, {"w": torch.ones(4)}),
                                        (rank_item(0), {"pos": 0})])
        theirs = write_items(there, sid, [(rank_item(1), {"pos": 1})])
        with pytest.raises(StorageNotSharedError) as info:
            commit(here, sid, parts + theirs, world_size=2)
    finally:
        here.close()
        there.close()
    err = info.value
    name = next(iter(theirs[0].files))
    size = theirs[0].files[name]
    assert err.rank == 1 and err.path == os.path.join(here.uri, name)
    assert err.checkpoint == here.uri
    assert str(err).startswith(f"{here.uri}: not committed: 1 of 2 data files are not there as "
                               f"their writers wrote them, for the committing process: {name} "
                               f"(written by rank 1, {size} bytes): not found.")
    assert "one folder shared by all hosts" in str(err) and "Nothing was committed" in str(err)
    assert isinstance(err, StorageError)
    assert not (tmp_path / "host0" / "ckpt" / MANIFEST_NAME).exists()
    # It survives pickling (a collective sends errors between processes) with its fields.
    copy = pickle.loads(pickle.dumps(err))
    assert (str(copy), copy.rank, copy.path, copy.checkpoint) == (str(err), 1, err.path,
                                                                  err.checkpoint)


def test_a_short_file_is_refused_with_both_sizes(tmp_path):
    st = open_storage(str(tmp_path / "ckpt"))
    sid = new_save_id()
    try:
        parts = write_items(st, sid, [(STATE_ITEM, {"w": torch.ones(4)})])
        parts += write_items(st, sid, [("chunks/00003", [torch.arange(6.0)])])
        name = next(iter(parts[1].files))
        size = parts[1].files[name]
        with open(tmp_path / "ckpt" / name, "r+b") as f:
            f.truncate(size - 8)
        with pytest.raises(StorageNotSharedError,
                           match=rf"{name} \(written by rank 3, {size} bytes\): has "
                                 rf"{size - 8} bytes"):
            commit(st, sid, parts)
    finally:
        st.close()
    assert not (tmp_path / "ckpt" / MANIFEST_NAME).exists()


def test_a_single_process_save_still_commits_and_loads(tmp_path):
    path = str(tmp_path / "ckpt")
    m = xla_ckpt.save({"w": torch.arange(5.0)}, path, rank_states={0: {"r": 0}, 1: {"r": 1}})
    assert len(m.files) == 2
    assert torch.equal(xla_ckpt.load(path)["w"], torch.arange(5.0))


def test_writer_rank_comes_from_the_item_name():
    assert [writer_rank(n) for n in ("rank/00002", "chunks/00011", "shard/00000", "state",
                                     "rank/x", "chunks/00001/extra")] == [2, 11, 0, None, None,
                                                                          None]


def test_check_files_visible_lists_every_missing_file_of_many(tmp_path):
    st = open_storage(str(tmp_path / "ckpt"))
    try:
        parts = write_items(st, new_save_id(), [(STATE_ITEM, {"w": torch.ones(2)})])
        files = dict(parts[0].files)
        files.update({f"data-x-rank-{r:05d}.safetensors": 100 for r in range(1, 11)})
        writers = {f"data-x-rank-{r:05d}.safetensors": r for r in range(1, 11)}
        with pytest.raises(StorageNotSharedError) as info:
            check_files_visible(st, files, writers)
        check_files_visible(st, parts[0].files)  # the one real file: fine
    finally:
        st.close()
    msg = str(info.value)
    assert "10 of 11 data files" in msg and "(+2 more)" in msg
    assert info.value.rank == 1
    assert "data-x-rank-00001.safetensors (written by rank 1, 100 bytes): not found" in msg


def test_gcs_commit_stats_each_data_file_once_and_refuses_another_prefix(fault_proxy,
                                                                        gcs_emulator):
    stem = f"vis-{new_save_id()}"
    here = fault_proxy.storage(gcs_emulator.uri(f"{stem}/host0/ckpt"))
    there = fault_proxy.storage(gcs_emulator.uri(f"{stem}/host1/ckpt"))
    try:
        sid = new_save_id()
        parts = write_items(here, sid, [(STATE_ITEM, {"w": torch.ones(4)})])
        parts += write_items(here, sid, [(rank_item(1), {"pos": 1})])
        parts += write_items(here, sid, [(rank_item(2), {"pos": 2})])
        fault_proxy.reset_log()
        commit(here, sid, parts, world_size=3)
        stats = [r for r in fault_proxy.records() if r.method == "GET"
                 and r.object_name.rsplit("/", 1)[-1].startswith("data-")
                 and "alt=media" not in r.query]
        assert sorted(r.object_name.rsplit("/", 1)[-1] for r in stats) == sorted(
            f for p in parts for f in p.files)  # one metadata GET per data file
        sid2 = new_save_id()
        mine = write_items(here, sid2, [(STATE_ITEM, {"w": torch.zeros(4)})])
        theirs = write_items(there, sid2, [(rank_item(1), {"pos": 1})])
        with pytest.raises(StorageNotSharedError, match=r"written by rank 1, \d+ bytes\): "
                                                        r"not found") as info:
            commit(here, sid2, mine + theirs, world_size=2)
        assert info.value.path.startswith("gs://")
        assert read_manifest(here).save_id == sid  # the first save is still the committed one
    finally:
        here.close()
        there.close()
        gcs_emulator.delete_prefix(stem + "/")
