"""Host shared-memory segments: sealed, copy-on-write, opened only by who may (real memfds)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch

from xla_ckpt.api import save
from xla_ckpt.comm.host_memory import (
    ALIGN_BYTES,
    HEADER_BYTES,
    HostMemoryError,
    Segment,
    WritableMapping,
    host_identity,
    map_private,
    open_segment,
    segment_layout,
)
from xla_ckpt.errors import CheckpointCorruptError
from xla_ckpt.format.manifest import STATE_ITEM
from xla_ckpt.format.plan import materialize_item
from xla_ckpt.io import CheckpointReader, read_manifest
from xla_ckpt.storage import open_storage

pytestmark = pytest.mark.skipif(host_identity() is None, reason="needs memfd_create and /proc")


def _filled(sizes, fill=None):
    seg = Segment("test")
    seg.size_for(sizes)
    mapping = WritableMapping(seg.fd, sizes)
    for i, v in enumerate(mapping.views):
        v.fill_(fill if fill is not None else i + 1)
    del v
    return seg, mapping


def test_layout_aligns_every_tensor():
    offsets, total = segment_layout([1, 0, 100, 64, 3])
    assert offsets == [0, 64, 64, 192, 256]  # 1 -> 64, 0 -> 0, 100 -> 128, 64 -> 64
    assert total == 320
    assert all(o % ALIGN_BYTES == 0 for o in offsets)


def test_sealed_segment_maps_copy_on_write_and_cannot_change():
    seg, mapping = _filled([10, 5000, 0])
    mapping.close()
    seg.seal()
    with pytest.raises(OSError) as e:  # sealed: not even the leader can write it
        os.pwrite(seg.fd, b"x", HEADER_BYTES)
    assert e.value.errno == errno.EPERM
    a = map_private(seg.fd, [10, 5000, 0])
    b = map_private(seg.fd, [10, 5000, 0])
    assert [t.tolist()[:3] for t in a] == [[1, 1, 1], [2, 2, 2], []]
    a[1].fill_(9)  # a private copy of the written pages
    assert int(b[1].sum()) == 2 * 5000 and int(a[1].sum()) == 9 * 5000
    assert int(map_private(seg.fd, [10, 5000, 0])[1].sum()) == 2 * 5000
    seg.close()
    assert int(b[1][0]) == 2  # mappings outlive the descriptor


def test_a_writable_mapping_blocks_the_seal_until_closed():
    seg, mapping = _filled([100])
    view = mapping.views[0]
    with pytest.raises(HostMemoryError, match="still alive"):
        mapping.close()
    assert int(view[0]) == 1  # and the view is still valid
    with pytest.raises(HostMemoryError, match="sealing the host shared-memory segment failed"):
        seg.seal()  # EBUSY: a writable shared mapping is still open
    del view
    mapping.close()
    seg.seal()
    seg.close()


def test_map_refuses_an_unsealed_or_wrongly_sized_segment():
    seg, mapping = _filled([100])
    with pytest.raises(HostMemoryError, match="not sealed"):
        map_private(seg.fd, [100])
    mapping.close()
    seg.seal()
    with pytest.raises(HostMemoryError, match="the manifest needs"):
        map_private(seg.fd, [100, 100])
    seg.close()


def test_open_checks_the_nonce_and_names_the_path():
    seg, _ = _filled([8])
    fd = open_segment(seg.handle)
    os.close(fd)
    wrong = dict(seg.handle, nonce="00" * 16)
    with pytest.raises(HostMemoryError, match="nonce differs"):
        open_segment(wrong)
    with pytest.raises(HostMemoryError, match=r"/proc/\d+/fd/999999"):
        open_segment(dict(seg.handle, fd=999999))
    seg.close()


def test_another_process_maps_the_sealed_bytes(tmp_path):
    seg, mapping = _filled([4096 * 3 + 5], fill=7)
    mapping.close()
    seg.seal()
    code = f"""
import json, os
from xla_ckpt.comm.host_memory import open_segment, map_private
fd = open_segment({seg.handle!r})
t = map_private(fd, [{4096 * 3 + 5}])[0]
os.close(fd)
before = int(t.sum())
t.zero_()  # its own copy
print(json.dumps([before, int(t.sum())]))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == f"[{7 * (4096 * 3 + 5)}, 0]"
    assert int(map_private(seg.fd, [4096 * 3 + 5])[0].sum()) == 7 * (4096 * 3 + 5)
    seg.close()


def test_materialize_from_blobs_that_are_views_of_one_segment(tmp_path):
    base = torch.arange(1000, dtype=torch.float32)
    state = {"a": base, "v": base[10:20], "h": torch.arange(7, dtype=torch.float16),
             "i": torch.arange(5, dtype=torch.int64), "e": torch.empty(0, 2)}
    save(state, str(tmp_path / "c"))
    storage = open_storage(str(tmp_path / "c"))
    reader = CheckpointReader(storage, read_manifest(storage))
    item = reader.manifest.item()
    blobs = reader.read_blobs(STATE_ITEM)
    storage.close()
    sizes = [b.length for b in item.blobs]
    seg = Segment("test")
    seg.size_for(sizes)
    mapping = WritableMapping(seg.fd, sizes)
    for i, v in enumerate(mapping.views):
        v.copy_(blobs[i])
    del v
    mapping.close()
    seg.seal()
    got = materialize_item(item, dict(enumerate(map_private(seg.fd, sizes))))
    seg.close()
    for k in state:
        assert got[k].dtype == state[k].dtype and torch.equal(got[k], state[k]), k
    assert got["v"].untyped_storage().data_ptr() == got["a"].untyped_storage().data_ptr()
    # a blob too short for its record is refused, not read past into the next blob
    short = {i: b[:max(b.numel() - 8, 0)] for i, b in blobs.items()}
    with pytest.raises(CheckpointCorruptError, match="needs bytes"):
        materialize_item(item, short)


# ---- several ranks of a host fill one segment --------------------------------------------------

def test_a_rank_of_the_host_fills_its_part_through_its_own_mapping():
    sizes = [3 * 4096 + 7, 5000, 0, 40000]
    seg = Segment("test")
    seg.size_for(sizes)
    leader = WritableMapping(seg.fd, sizes)
    fd = open_segment(seg.handle, writable=True)  # as another rank of the host opens it
    other = WritableMapping(fd, sizes)
    leader.views[0].fill_(1)
    other.views[1].fill_(2)
    other.views[3].fill_(4)
    assert int(leader.views[3].sum()) == 4 * 40000  # the same pages, no copy
    leader.close()
    with pytest.raises(HostMemoryError, match="sealing the host shared-memory segment failed"):
        seg.seal()  # the other rank's writable mapping is still open
    other.close()
    os.close(fd)
    seg.seal()
    got = map_private(seg.fd, sizes)
    assert [int(t.sum()) for t in got] == [3 * 4096 + 7, 2 * 5000, 0, 4 * 40000]
    seg.close()


def test_a_mapping_of_another_size_is_refused():
    seg = Segment("test")
    seg.size_for([100])
    with pytest.raises(HostMemoryError, match="the manifest needs"):
        WritableMapping(seg.fd, [100, 64])
    seg.close()
