"""CheckpointReader.read_into_file: checked slices written into a file (the host-memory fill)."""

import logging
import os

import pytest
import torch

from xla_ckpt.api import save
from xla_ckpt.errors import IntegrityError
from xla_ckpt.io import CheckpointReader, read_manifest
from xla_ckpt.storage import StorageConfig, open_storage


@pytest.fixture
def checkpoint(tmp_path):
    g = torch.Generator().manual_seed(3)
    # a multi-chunk blob (several slices), a small one, an empty one
    state = {"big": torch.randn(3 * 1024 * 1024 + 5, generator=g), "small": torch.arange(7),
             "empty": torch.empty(0)}
    uri = str(tmp_path / "c")
    save(state, uri)
    return uri


def _reader(uri):
    st = open_storage(uri, StorageConfig(slice_size_bytes=4 * 1024 * 1024, max_workers=4))
    return CheckpointReader(st, read_manifest(st))


def test_file_holds_exactly_the_blobs_at_their_offsets(checkpoint, tmp_path):
    reader = _reader(checkpoint)
    item = reader.manifest.item()
    want = reader.read_blobs()
    offsets, at = {}, 100  # anywhere in the file, unaligned
    for i, b in enumerate(item.blobs):
        offsets[i] = at
        at += b.length + 3
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    ends: list[int] = []
    try:
        reader.read_into_file("state", fd, offsets, staging_buffers=2, on_written=ends.append)
    finally:
        os.close(fd)
    data = path.read_bytes()
    # progress: strictly increasing, and the last one is the end of the last blob with bytes.
    # How many marks there are depends on the order the slices finish in (one, if the first
    # slice finishes last), so only the order and the final mark are fixed.
    assert ends and ends == sorted(set(ends))
    assert ends[-1] == max(offsets[i] + b.length for i, b in enumerate(item.blobs) if b.length)
    for i, b in enumerate(item.blobs):
        assert data[offsets[i]:offsets[i] + b.length] == want[i].numpy().tobytes()
    assert reader.stats.bytes_read == sum(b.length for b in item.blobs)
    assert max(b.length for b in item.blobs) > 3 * 4 * 1024 * 1024  # several slices


def test_a_corrupt_slice_is_never_written(checkpoint, tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="xla_ckpt.io.blob_reader")
    reader = _reader(checkpoint)
    item = reader.manifest.item()
    big = max(range(len(item.blobs)), key=lambda i: item.blobs[i].length)
    rec = item.blobs[big]
    data_file = os.path.join(checkpoint, rec.file)
    with open(data_file, "r+b") as f:  # flip one byte in the blob's second 4 MiB slice
        f.seek(rec.offset + 5 * 1024 * 1024)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(IntegrityError, match="crc32c mismatch in bytes"):
            reader.read_into_file("state", fd, {big: 0}, staging_buffers=1)
    finally:
        os.close(fd)
    written = path.read_bytes()
    bad_slice = range(4 * 1024 * 1024, 8 * 1024 * 1024)
    assert len(written) <= bad_slice.start or not any(written[bad_slice.start:bad_slice.stop])
