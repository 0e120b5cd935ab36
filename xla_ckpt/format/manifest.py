"""The manifest: the versioned JSON document that describes one checkpoint.

A checkpoint is a folder (local path or ``gs://`` prefix) holding data files
in safetensors layout and one ``manifest.json``.  The manifest is the
**commit marker**: it is written last, atomically, and a folder without it is
an incomplete checkpoint that readers never trust.

Schema (``version`` 1)::

    {
      "format": "xla_ckpt", "version": 1,
      "save_id": "<hex>",            # unique per save; data file names carry it
      "created_unix_s": 1732960000.0,
      "world_size": 4 | null,        # world size of the job that saved
      "metadata": {...},             # typed-encoded summary (step, epoch, ...)
      "files": {"<name>": <size in bytes>},
      "items": {
        "<item name>": {             # "state" = replicated state; "rank/00003" = rank 3's own
          "state": <typed tree, tensors as {"$tensor": i}>,
          "tensors": [{"key": "state['model']['w']", "blob": b, "byte_offset": 0,
                       "dtype": "float32", "shape": [2, 2], "stride": [2, 1]}],
          "blobs": [{"file": "<name>", "offset": o, "length": n, "crc32c": c,
                     "chunk_size": k, "chunk_crc32c": [c0, c1, ...]}]
        }
      }
    }

A *blob* is a contiguous byte range of a data file; one or more tensors view
it (tensors that shared storage at save time share a blob, so aliasing comes
back).  ``crc32c`` covers the whole blob; ``chunk_crc32c`` covers each
``chunk_size``-byte chunk so a byte-range read of part of a blob is checked too.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, NoReturn

from xla_ckpt.errors import CheckpointCorruptError
from xla_ckpt.format import typed
from xla_ckpt.format.crc import crc32c
from xla_ckpt.format.dtypes import dtype_from_name, dtype_name, itemsize

FORMAT_NAME = "xla_ckpt"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
CRC_FIELD = "manifest_crc32c"
STATE_ITEM = "state"
DEFAULT_CHUNK_SIZE_BYTES = 4 * 1024 * 1024

# Hostile-input bounds: a manifest larger than this, or with more entries, is refused.
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_ENTRIES = 10_000_000
MAX_NDIM = 64
_INT64_LIMIT = 2**63


def rank_item(rank: int) -> str:
    """Item name for state private to ``rank`` (iterator/RNG state, optimizer shard)."""
    return f"rank/{rank:05d}"


@dataclass(frozen=True)
class BlobRecord:
    """A contiguous byte range ``[offset, offset + length)`` of data file ``file``."""

    file: str
    offset: int
    length: int
    crc32c: int
    chunk_size: int = DEFAULT_CHUNK_SIZE_BYTES
    chunk_crc32c: tuple[int, ...] = ()

    def to_json(self) -> dict:
        d = {"file": self.file, "offset": self.offset, "length": self.length,
             "crc32c": self.crc32c, "chunk_size": self.chunk_size}
        if self.chunk_crc32c:
            d["chunk_crc32c"] = list(self.chunk_crc32c)
        return d


@dataclass(frozen=True)
class TensorRecord:
    """One tensor: a strided view of ``blob`` starting ``byte_offset`` bytes in."""

    key: str
    blob: int
    byte_offset: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def span_bytes(self) -> int:
        """Bytes from the first to one past the last element addressed by this view."""
        if self.numel == 0:
            return 0
        isz = itemsize(dtype_from_name(self.dtype))
        last = sum((s - 1) * st for s, st in zip(self.shape, self.stride, strict=True))
        return (last + 1) * isz

    def to_json(self) -> dict:
        return {"key": self.key, "blob": self.blob, "byte_offset": self.byte_offset,
                "dtype": self.dtype, "shape": list(self.shape), "stride": list(self.stride)}


@dataclass
class Item:
    """A self-contained piece of state: typed tree, its tensors and their blobs."""

    state: Any
    tensors: list[TensorRecord] = field(default_factory=list)
    blobs: list[BlobRecord] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(b.length for b in self.blobs)

    def to_json(self) -> dict:
        return {"state": self.state, "tensors": [t.to_json() for t in self.tensors],
                "blobs": [b.to_json() for b in self.blobs]}


@dataclass
class Manifest:
    """Parsed, validated manifest.  See the module docstring for the schema."""

    save_id: str
    items: dict[str, Item]
    files: dict[str, int]
    metadata: Any = None
    world_size: int | None = None
    created_unix_s: float = 0.0
    version: int = FORMAT_VERSION

    @property
    def nbytes(self) -> int:
        """Total bytes of all data files (what a full read moves)."""
        return sum(self.files.values())

    def item(self, name: str = STATE_ITEM) -> Item:
        try:
            return self.items[name]
        except KeyError:
            raise CheckpointCorruptError(
                f"checkpoint has no item {name!r} (items: {sorted(self.items)[:8]})") from None

    def to_json_bytes(self) -> bytes:
        doc = {"format": FORMAT_NAME, "version": self.version, "save_id": self.save_id,
               "created_unix_s": self.created_unix_s, "world_size": self.world_size,
               "metadata": self.metadata, "files": self.files,
               "items": {k: v.to_json() for k, v in self.items.items()}}
        body = json.dumps(doc, ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode("utf-8")
        return seal(body)

    @classmethod
    def from_json_bytes(cls, data: bytes, *, where: str = "manifest",
                        require_crc: bool = False) -> "Manifest":
        """Parse and validate untrusted manifest bytes.

        The manifest's own integrity: :meth:`to_json_bytes` ends the document with
        ``"manifest_crc32c":"<8 hex digits>"``, the crc32c of the bytes with those digits
        zeroed.  A present trailer must match; ``require_crc`` (what readers of a stored
        checkpoint pass) also refuses a manifest without one.  Structure is validated
        first, so a tampered field is named before the checksum is.

        Raises:
            CheckpointCorruptError: naming ``where`` and what is wrong (bad
                JSON, wrong format/version, out-of-range offsets, shapes that
                disagree with byte lengths, file names escaping the folder,
                unknown dtypes).
        """
        if len(data) > MAX_MANIFEST_BYTES:
            raise CheckpointCorruptError(f"{where}: manifest of {len(data)} bytes exceeds the "
                                         f"{MAX_MANIFEST_BYTES}-byte limit")
        try:
            doc = json.loads(data.decode("utf-8"), parse_constant=_reject_constant,
                             object_pairs_hook=_unique_keys)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise CheckpointCorruptError(f"{where}: not a valid JSON manifest ({e})") from None
        if isinstance(doc, dict):
            doc.pop(CRC_FIELD, None)
        manifest = _validate(doc, where)
        _check_crc(data, where, require_crc)
        return manifest


_CRC_STUB = b',"manifest_crc32c":"00000000"}'
_CRC_TRAILER = re.compile(rb',"manifest_crc32c":"([0-9a-f]{8})"\}\s*$')


def seal(body: bytes) -> bytes:
    """Append the ``manifest_crc32c`` trailer to a JSON object's bytes (which end in ``}``).

    The crc32c covers the whole document with the trailer's 8 hex digits zeroed; it guards
    against damaged bytes (a checksum, not a signature).
    """
    body = body.rstrip()
    if not body.endswith(b"}"):
        raise ValueError("seal() needs the bytes of a JSON object")
    stub = body[:-1] + _CRC_STUB
    return stub[:-len(_CRC_STUB)] + b',"%s":"%08x"}' % (CRC_FIELD.encode(), crc32c(stub))


def _check_crc(data: bytes, where: str, required: bool) -> None:
    m = _CRC_TRAILER.search(data)
    if m is None:
        if required:
            raise CheckpointCorruptError(
                f"{where}: manifest has no {CRC_FIELD} trailer, so its own bytes cannot be "
                "checked (damaged, or not written by xla_ckpt); restore another checkpoint")
        return
    stub = data[:m.start(1)] + b"00000000" + data[m.end(1):]
    if crc32c(stub) != int(m.group(1), 16):
        raise CheckpointCorruptError(
            f"{where}: manifest crc32c mismatch (stored {m.group(1).decode()}, computed "
            f"{crc32c(stub):08x}): the manifest is corrupt; restore another checkpoint")


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"non-standard JSON constant {name}")


def _unique_keys(pairs: list) -> dict:
    """JSON object hook: a key given twice is refused (json.loads would keep the last silently)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {k!r} in one JSON object")
            seen.add(k)
    return d


def _int(v: Any, what: str, where: str, lo: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise CheckpointCorruptError(f"{where}: {what} must be an integer >= {lo}, got {v!r}")
    return v


def valid_file_name(name: Any) -> bool:
    """A data file name is one plain path segment: no separators, no '..', no control chars."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and name not in (".", "..")
            and "/" not in name and "\\" not in name and not any(ord(c) < 32 for c in name)
            and name != MANIFEST_NAME)


def _validate(doc: Any, where: str) -> Manifest:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CheckpointCorruptError(f"{where}: not an xla_ckpt manifest (format field missing)")
    version = doc.get("version")
    if version != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{where}: manifest version {version!r} is not supported by this xla_ckpt "
            f"(reads version {FORMAT_VERSION}); upgrade xla_ckpt")
    files_doc = doc.get("files")
    if not isinstance(files_doc, dict):
        raise CheckpointCorruptError(f"{where}: 'files' must be an object")
    files: dict[str, int] = {}
    for name, size in files_doc.items():
        if not valid_file_name(name):
            raise CheckpointCorruptError(f"{where}: data file name {name!r} escapes the checkpoint "
                                         "folder or is not a plain name")
        files[name] = _int(size, f"size of {name!r}", where)
    items_doc = doc.get("items")
    if not isinstance(items_doc, dict) or not items_doc:
        raise CheckpointCorruptError(f"{where}: 'items' must be a non-empty object")
    items: dict[str, Item] = {}
    total = 0
    for iname, idoc in items_doc.items():
        if not isinstance(idoc, dict):
            raise CheckpointCorruptError(f"{where}: item {iname!r} must be an object")
        blobs_doc, tensors_doc = idoc.get("blobs", []), idoc.get("tensors", [])
        if not isinstance(blobs_doc, list) or not isinstance(tensors_doc, list):
            raise CheckpointCorruptError(f"{where}: item {iname!r} blobs/tensors must be lists")
        total += len(blobs_doc) + len(tensors_doc)
        if total > MAX_ENTRIES:
            raise CheckpointCorruptError(f"{where}: more than {MAX_ENTRIES} entries")
        blobs = [_blob(b, files, f"{where} item {iname!r} blob {i}")
                 for i, b in enumerate(blobs_doc)]
        _check_overlaps(blobs, f"{where} item {iname!r}")
        tensors = [_tensor(t, blobs, f"{where} item {iname!r} tensor {i}")
                   for i, t in enumerate(tensors_doc)]
        keys = [t.key for t in tensors]
        if len(set(keys)) != len(keys):
            dup = next(k for k in keys if keys.count(k) > 1)
            raise CheckpointCorruptError(f"{where}: item {iname!r} has duplicate tensor key {dup}")
        _check_state(idoc.get("state"), len(tensors), f"{where} item {iname!r}")
        items[iname] = Item(state=idoc.get("state"), tensors=tensors, blobs=blobs)
    ws = doc.get("world_size")
    if ws is not None:
        _int(ws, "world_size", where, lo=1)
    save_id = doc.get("save_id")
    if not isinstance(save_id, str):
        raise CheckpointCorruptError(f"{where}: save_id must be a string")
    created = doc.get("created_unix_s", 0.0)
    if not isinstance(created, (int, float)) or isinstance(created, bool) \
            or not -1e12 < created < 1e12:
        raise CheckpointCorruptError(f"{where}: created_unix_s must be a number of seconds")
    if doc.get("metadata") is not None:
        try:
            typed.decode(doc["metadata"])
        except CheckpointCorruptError as e:
            raise CheckpointCorruptError(f"{where}: metadata: {e}") from None
    return Manifest(save_id=save_id, items=items, files=files, metadata=doc.get("metadata"),
                    world_size=ws, created_unix_s=float(created), version=version)


def _check_state(state: Any, n_tensors: int, where: str) -> None:
    """Decode the typed state once (tensors as None) so a malformed tree names the manifest."""
    def lookup(i: int) -> None:
        if not 0 <= i < n_tensors:
            raise CheckpointCorruptError(f"typed state refers to tensor {i} but only "
                                         f"{n_tensors} exist")

    try:
        typed.decode(state, lookup)
    except CheckpointCorruptError as e:
        raise CheckpointCorruptError(f"{where}: {e}") from None


def _blob(b: Any, files: dict[str, int], where: str) -> BlobRecord:
    if not isinstance(b, dict):
        raise CheckpointCorruptError(f"{where}: must be an object")
    fname = b.get("file")
    if not isinstance(fname, str) or fname not in files:
        raise CheckpointCorruptError(f"{where}: file {fname!r} is not listed in 'files'")
    offset = _int(b.get("offset"), "offset", where)
    length = _int(b.get("length"), "length", where)
    if offset + length > files[fname]:
        raise CheckpointCorruptError(
            f"{where}: byte range [{offset}, {offset + length}) lies beyond the end of "
            f"{fname!r} ({files[fname]} bytes)")
    crc = _int(b.get("crc32c"), "crc32c", where)
    if crc >= 2**32:
        raise CheckpointCorruptError(f"{where}: crc32c out of range")
    chunk = _int(b.get("chunk_size", DEFAULT_CHUNK_SIZE_BYTES), "chunk_size", where, lo=1)
    chunks_doc = b.get("chunk_crc32c", [])
    if not isinstance(chunks_doc, list):
        raise CheckpointCorruptError(f"{where}: chunk_crc32c must be a list")
    n_chunks = -(-length // chunk) if chunks_doc else 0
    if chunks_doc and len(chunks_doc) != n_chunks:
        raise CheckpointCorruptError(f"{where}: {len(chunks_doc)} chunk crc32c values for "
                                     f"{n_chunks} chunks")
    chunks = tuple(_int(c, "chunk crc32c", where) for c in chunks_doc)
    return BlobRecord(fname, offset, length, crc, chunk, chunks)


def _check_overlaps(blobs: list[BlobRecord], where: str) -> None:
    by_file: dict[str, list[tuple[int, int]]] = {}
    for b in blobs:
        if b.length:
            by_file.setdefault(b.file, []).append((b.offset, b.offset + b.length))
    for fname, spans in by_file.items():
        spans.sort()
        for (_s0, e0), (s1, _e1) in itertools.pairwise(spans):
            if s1 < e0:
                raise CheckpointCorruptError(
                    f"{where}: blobs overlap in {fname!r} at bytes [{s1}, {e0})")


def _tensor(t: Any, blobs: list[BlobRecord], where: str) -> TensorRecord:
    if not isinstance(t, dict):
        raise CheckpointCorruptError(f"{where}: must be an object")
    key = t.get("key")
    if not isinstance(key, str):
        raise CheckpointCorruptError(f"{where}: key must be a string")
    where = f"{where} ({key})"
    blob = _int(t.get("blob"), "blob", where)
    if blob >= len(blobs):
        raise CheckpointCorruptError(f"{where}: blob index {blob} out of range "
                                     f"({len(blobs)} blobs)")
    dtype = t.get("dtype")
    torch_dtype = dtype_from_name(dtype, where=where)
    shape, stride = t.get("shape"), t.get("stride")
    if not isinstance(shape, list) or not isinstance(stride, list) or len(shape) != len(stride) \
            or len(shape) > MAX_NDIM:
        raise CheckpointCorruptError(f"{where}: shape/stride must be lists of equal length <= "
                                     f"{MAX_NDIM}")
    shape_t = tuple(_int(s, "shape entry", where) for s in shape)
    stride_t = tuple(_int(s, "stride entry", where) for s in stride)
    if any(v >= _INT64_LIMIT for v in shape_t + stride_t) \
            or math.prod(d for d in shape_t if d) * itemsize(torch_dtype) >= _INT64_LIMIT:
        raise CheckpointCorruptError(f"{where}: shape {list(shape_t)} / stride {list(stride_t)} "
                                     "exceed what a tensor can address (int64)")
    rec = TensorRecord(key, blob, _int(t.get("byte_offset"), "byte_offset", where),
                       dtype_name(torch_dtype), shape_t, stride_t)
    if rec.byte_offset + rec.span_bytes() > blobs[blob].length:
        raise CheckpointCorruptError(
            f"{where}: shape {list(shape_t)} of {dtype} needs {rec.span_bytes()} bytes from "
            f"offset {rec.byte_offset} but its blob holds {blobs[blob].length}")
    return rec
