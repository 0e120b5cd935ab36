"""safetensors-layout data files: 8-byte little-endian header length, JSON header, raw bytes.

Every data file xla_ckpt writes opens with ``safetensors.safe_open``; the
entry names are the first state key that used each blob (made unique, and
never ``__metadata__``), so standard tools show readable names.  The manifest,
not these names, is the authority on what each byte range means.
"""

from __future__ import annotations

import json
import struct
from typing import TYPE_CHECKING, Sequence

from xla_ckpt.errors import CheckpointCorruptError

if TYPE_CHECKING:  # the blobs' type only: parsing a header needs no torch
    from xla_ckpt.format.plan import PlannedBlob

DATA_ALIGN = 64
"""The header is padded with spaces (as safetensors allows) so that the data section, and
with it each blob whose predecessors' sizes are multiples of 64 bytes, starts on a 64-byte
boundary: a copy into or out of the file's pages then runs on aligned cache lines (an 8-byte
misaligned destination made the local save's staging copy ~1.7x slower,
:mod:`xla_ckpt.io.mapped_writer`)."""
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


def build_header(blobs: Sequence[PlannedBlob], metadata: dict[str, str]) -> tuple[bytes, list[int]]:
    """Return (header bytes incl. the 8-byte length prefix, absolute file offset of each blob)."""
    entries: dict[str, dict] = {"__metadata__": dict(metadata)}
    used = set(entries)
    cursor = 0
    rel: list[int] = []
    for b in blobs:
        name = b.name if b.name not in used else None
        k = 1
        while name is None or name in used:
            name = f"{b.name}#{k}"
            k += 1
        used.add(name)
        n = b.data.numel()
        entries[name] = {"dtype": b.dtype_code, "shape": list(b.shape),
                         "data_offsets": [cursor, cursor + n]}
        rel.append(cursor)
        cursor += n
    body = json.dumps(entries, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    body += b" " * (-(8 + len(body)) % DATA_ALIGN)
    header = struct.pack("<Q", len(body)) + body
    return header, [len(header) + r for r in rel]


def parse_header_length(prefix: bytes, *, where: str, file_size: int) -> int:
    """Validate the 8-byte prefix of a data file and return the JSON header length."""
    if len(prefix) < 8:
        raise CheckpointCorruptError(f"{where}: file is {len(prefix)} bytes, shorter than the "
                                     "8-byte safetensors prefix")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise CheckpointCorruptError(f"{where}: safetensors header length {n} is impossible for a "
                                     f"{file_size}-byte file")
    return n
