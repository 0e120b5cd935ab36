"""DCP reads go through xla_ckpt's one chunk reader (xla_ckpt.kinds.dcp_boxes).

A DCP checkpoint's located zip members become blobs, chunks and global tensors of
:mod:`xla_ckpt.io.chunked`; these tests pin what that route must keep: only the tensor bytes
a read needs are fetched (the zip bytes that located a small tensor serve it, no second
fetch), targets of any strides get the saved values, and a member whose CRC-32 fails is read
again from storage, not from the bytes fetched while locating it.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from xla_ckpt.errors import IntegrityError
from xla_ckpt.format.dcp import DcpTensorEntry
from xla_ckpt.kinds.dcp import read_dcp, read_dcp_into, read_dcp_metadata
from xla_ckpt.kinds.dcp_boxes import DcpBlobReader

pytestmark = pytest.mark.timeout(120)


def _save(state: dict, path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)


def _state(big_rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(big_rows)
    out = {f"small{i}": torch.randn(16, generator=g) for i in range(12)}
    out["big"] = torch.randn(big_rows, 256, generator=g)
    out["ids"] = torch.arange(5, dtype=torch.int64) * (2**40 + big_rows)
    return out


@pytest.mark.parametrize("big_rows", [64, 300])
def test_only_the_big_tensor_bytes_are_fetched_and_values_are_bitwise(tmp_path, big_rows):
    path = str(tmp_path / "ck")
    state = _state(big_rows)
    _save(state, path)
    targets = {k: torch.full_like(v, 7) for k, v in state.items()}
    stats = read_dcp_into(path, targets)
    for k, v in state.items():
        assert torch.equal(targets[k], v), k
    # Small tensors lie whole in the zip bytes fetched to locate them: no second fetch.
    assert stats.tensor_bytes == state["big"].numel() * 4
    assert stats.keys == len(state)
    flat = read_dcp(path, keys=["big", "small3"])
    assert list(flat) == ["big", "small3"]
    assert torch.equal(flat["big"], state["big"]) and torch.equal(flat["small3"], state["small3"])


def test_targets_with_other_strides_get_the_saved_values(tmp_path):
    path = str(tmp_path / "ck")
    state = {"w": torch.arange(600.0).reshape(20, 30), "c": torch.arange(24.0).reshape(2, 3, 4)}
    _save(state, path)
    w_t = torch.zeros(30, 20).t()                 # a transposed target
    c_stepped = torch.zeros(2, 3, 8)[..., ::2]    # a stepped slice of a larger tensor
    read_dcp_into(path, {"w": w_t, "c": c_stepped})
    assert torch.equal(w_t, state["w"]) and torch.equal(c_stepped, state["c"])


def test_a_crc_mismatch_is_read_again_from_storage(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    state = _state(300)
    _save(state, path)
    md = read_dcp_metadata(path)
    fetched: list[tuple[int, int]] = []
    real = DcpBlobReader._fetch
    flips = [True]

    def flaky(self, file, offset, out, generation):  # the first storage read comes back bad
        real(self, file, offset, out, generation)
        if len(out) >= 4096 and flips and (offset, len(out)) not in fetched:
            flips.clear()
            out[17] ^= 0x40
        fetched.append((offset, len(out)))

    monkeypatch.setattr(DcpBlobReader, "_fetch", flaky)
    got = read_dcp(path, keys=["big"])
    assert torch.equal(got["big"], state["big"]) and not flips
    assert len(fetched) == len(set(fetched)) + 1              # the bad range, fetched twice
    # A file corrupt on disk fails both reads: IntegrityError naming the key.
    entry = md.entries["big"]
    assert isinstance(entry, DcpTensorEntry)
    chunk = entry.chunks[0]
    with open(os.path.join(path, chunk.file), "r+b") as f:
        f.seek(chunk.offset)
        at = f.read(chunk.length).find(state["big"].numpy().tobytes()[:64])
        assert at > 0
        f.seek(chunk.offset + at + 1000)                          # inside the tensor bytes
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))
    monkeypatch.setattr(DcpBlobReader, "_fetch", real)
    with pytest.raises(IntegrityError, match=r"key 'big'.*CRC-32 of the tensor bytes read"):
        read_dcp(path, keys=["big"])
