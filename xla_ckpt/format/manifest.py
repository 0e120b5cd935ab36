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

Version 2 (chunked tensors, :mod:`xla_ckpt.format.chunks`) adds *global* tensors, each
stored as chunks (boxes of its global index space) that ranks wrote as ordinary tensor
records of their own items.  A manifest is version 2 only when it has global tensors
(or chunked items); everything else is written as version 1, byte for byte as before::

    "version": 2,
    "global_tensors": [                       # index g = position
      {"key": "state['model']['w']", "dtype": "float32", "shape": [10, 6],
       "placement": "Shard(0) on mesh (4,)",  # informational, optional
       "chunks": [{"item": "chunks/00000", "tensor": 0,    # record 0 of that item
                   "offsets": [0, 0], "sizes": [3, 6]}, ...]}],
    "items": {
      "state": {"state": <typed tree, {"$tensor": g} = global_tensors[g]>,
                "tensors": [], "blobs": [], "chunked": true},
      "chunks/00000": {<an ordinary item: the chunk tensors rank 0 wrote>}, ...}

A chunk's record has the global dtype, shape ``sizes`` and C-contiguous strides.  The
chunks of a global tensor tile it exactly (inside its shape, no overlap, no gap); a
tensor with no elements has none.  All of that is checked when the manifest is parsed,
before anything is allocated from it.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any, NoReturn

from xla_ckpt.errors import CheckpointCorruptError
from xla_ckpt.format import typed
from xla_ckpt.format.chunks import (
    MAX_CHUNKS_PER_TENSOR,
    ChunkRecord,
    GlobalTensor,
    LayoutTooIrregularError,
    first_overlap,
)
from xla_ckpt.format.crc import crc32c
from xla_ckpt.format.dtypes import check_dtype_name, itemsize_of
from xla_ckpt.format.gc_pause import gc_paused

FORMAT_NAME = "xla_ckpt"
FORMAT_VERSION = 1
"""The version written for a checkpoint without global tensors."""
CHUNKED_FORMAT_VERSION = 2
"""The version written when a manifest has global (chunked) tensors."""
SUPPORTED_VERSIONS = (FORMAT_VERSION, CHUNKED_FORMAT_VERSION)
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
        isz = itemsize_of(check_dtype_name(self.dtype))
        last = sum((s - 1) * st for s, st in zip(self.shape, self.stride, strict=True))
        return (last + 1) * isz

    def to_json(self) -> dict:
        return {"key": self.key, "blob": self.blob, "byte_offset": self.byte_offset,
                "dtype": self.dtype, "shape": list(self.shape), "stride": list(self.stride)}


@dataclass
class Item:
    """A self-contained piece of state: typed tree, its tensors and their blobs.

    ``chunked`` (manifest version 2): the tree's ``{"$tensor": g}`` nodes index
    :attr:`Manifest.global_tensors`, and the item has no tensors or blobs of its own.
    """

    state: Any
    tensors: list[TensorRecord] = field(default_factory=list)
    blobs: list[BlobRecord] = field(default_factory=list)
    chunked: bool = False

    @property
    def nbytes(self) -> int:
        return sum(b.length for b in self.blobs)

    def to_json(self) -> dict:
        d = {"state": self.state, "tensors": [t.to_json() for t in self.tensors],
             "blobs": [b.to_json() for b in self.blobs]}
        if self.chunked:
            d["chunked"] = True
        return d


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
    global_tensors: list[GlobalTensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Total bytes of all data files (what a full read moves)."""
        return sum(self.files.values())

    @property
    def written_version(self) -> int:
        """The version :meth:`to_json_bytes` writes: 2 with global tensors or chunked items."""
        if self.global_tensors or any(it.chunked for it in self.items.values()):
            return max(self.version, CHUNKED_FORMAT_VERSION)
        return self.version

    def item(self, name: str = STATE_ITEM) -> Item:
        try:
            return self.items[name]
        except KeyError:
            raise CheckpointCorruptError(
                f"checkpoint has no item {name!r} (items: {sorted(self.items)[:8]})") from None

    def to_json_bytes(self) -> bytes:
        version = self.written_version
        doc: dict[str, Any] = {
            "format": FORMAT_NAME, "version": version, "save_id": self.save_id,
            "created_unix_s": self.created_unix_s, "world_size": self.world_size,
            "metadata": self.metadata, "files": self.files}
        if version >= CHUNKED_FORMAT_VERSION:
            doc["global_tensors"] = [g.to_json() for g in self.global_tensors]
        doc["items"] = {k: v.to_json() for k, v in self.items.items()}
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
        with gc_paused():  # millions of acyclic objects: collections would only rescan them
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
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise CheckpointCorruptError(
            f"{where}: manifest version {version!r} is not supported by this xla_ckpt "
            f"(reads versions {', '.join(map(str, SUPPORTED_VERSIONS))}); upgrade xla_ckpt")
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
        chunked = idoc.get("chunked", False)
        if type(chunked) is not bool:
            raise CheckpointCorruptError(f"{where}: item {iname!r}: 'chunked' must be true or "
                                         f"false, got {chunked!r}")
        if chunked:
            if version < CHUNKED_FORMAT_VERSION:
                raise CheckpointCorruptError(
                    f"{where}: item {iname!r} is chunked, which needs manifest version "
                    f"{CHUNKED_FORMAT_VERSION} (this one says {version})")
            if blobs_doc or tensors_doc:
                raise CheckpointCorruptError(
                    f"{where}: chunked item {iname!r} has tensors/blobs of its own; its "
                    "tensors are the manifest's global_tensors")
            items[iname] = Item(state=idoc.get("state"), chunked=True)
            continue
        total += len(blobs_doc) + len(tensors_doc)
        if total > MAX_ENTRIES:
            raise CheckpointCorruptError(f"{where}: more than {MAX_ENTRIES} entries")
        # The common case is checked inline (_fast_blob, _fast_tensor: a manifest can hold
        # millions of records); anything they do not accept is checked again one field at a
        # time, which names what is wrong.
        blobs = [_fast_blob(b, files) or _blob(b, files, f"{where} item {iname!r} blob {i}")
                 for i, b in enumerate(blobs_doc)]
        _check_overlaps(blobs, f"{where} item {iname!r}")
        tensors = [_fast_tensor(t, blobs)
                   or _tensor(t, blobs, f"{where} item {iname!r} tensor {i}")
                   for i, t in enumerate(tensors_doc)]
        keys = [t.key for t in tensors]
        if len(set(keys)) != len(keys):
            dup = next(k for k in keys if keys.count(k) > 1)
            raise CheckpointCorruptError(f"{where}: item {iname!r} has duplicate tensor key {dup}")
        _check_state(idoc.get("state"), len(tensors), f"{where} item {iname!r}")
        items[iname] = Item(state=idoc.get("state"), tensors=tensors, blobs=blobs)
    gdoc = doc.get("global_tensors")
    if gdoc is not None and version < CHUNKED_FORMAT_VERSION:
        raise CheckpointCorruptError(f"{where}: 'global_tensors' needs manifest version "
                                     f"{CHUNKED_FORMAT_VERSION} (this one says {version})")
    global_tensors = _global_tensors([] if gdoc is None else gdoc, items, where, total)
    for iname, it in items.items():
        if it.chunked:
            _check_state(it.state, len(global_tensors), f"{where} chunked item {iname!r}",
                         what="global tensor")
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
                    world_size=ws, created_unix_s=float(created), version=version,
                    global_tensors=global_tensors)


def _check_state(state: Any, n_tensors: int, where: str, what: str = "tensor") -> None:
    """Decode the typed state once (tensors as None) so a malformed tree names the manifest."""
    def lookup(i: int) -> None:
        if not 0 <= i < n_tensors:
            raise CheckpointCorruptError(f"typed state refers to {what} {i} but only "
                                         f"{n_tensors} exist")

    try:
        typed.decode(state, lookup)
    except CheckpointCorruptError as e:
        raise CheckpointCorruptError(f"{where}: {e}") from None


_DTYPES: dict[str, tuple[str, int]] = {}  # manifest dtype name -> (canonical name, itemsize)


def _dtype_info(name: Any) -> tuple[str, int] | None:
    """(canonical name, itemsize) of a valid dtype name, else None (cached per name)."""
    info = _DTYPES.get(name) if type(name) is str else None
    if info is None and type(name) is str:
        try:
            n = check_dtype_name(name)
        except CheckpointCorruptError:
            return None
        info = _DTYPES[name] = (n, itemsize_of(n))
    return info


def _fast_blob(b: Any, files: dict[str, int]) -> BlobRecord | None:
    """The blob record when ``b`` passes every check of :func:`_blob`, else None."""
    if type(b) is not dict:
        return None
    fname, off, length, crc = b.get("file"), b.get("offset"), b.get("length"), b.get("crc32c")
    chunk, chunks = b.get("chunk_size", DEFAULT_CHUNK_SIZE_BYTES), b.get("chunk_crc32c", [])
    if type(fname) is not str:
        return None
    size = files.get(fname)
    if (size is None or type(off) is not int or type(length) is not int or off < 0
            or length < 0 or off + length > size or type(crc) is not int
            or not 0 <= crc < 2**32 or type(chunk) is not int or chunk < 1
            or type(chunks) is not list):
        return None
    if chunks and (len(chunks) != -(-length // chunk)
                   or not all(type(c) is int and c >= 0 for c in chunks)):
        return None
    return BlobRecord(fname, off, length, crc, chunk, tuple(chunks))


def _fast_tensor(t: Any, blobs: list[BlobRecord]) -> TensorRecord | None:
    """The tensor record when ``t`` passes every check of :func:`_tensor`, else None."""
    if type(t) is not dict:
        return None
    key, blob, off = t.get("key"), t.get("blob"), t.get("byte_offset")
    shape, stride = t.get("shape"), t.get("stride")
    info = _dtype_info(t.get("dtype"))
    if (type(key) is not str or type(blob) is not int or not 0 <= blob < len(blobs)
            or info is None or type(off) is not int or off < 0 or type(shape) is not list
            or type(stride) is not list or len(shape) != len(stride) or len(shape) > MAX_NDIM
            or not all(type(v) is int and 0 <= v < _INT64_LIMIT for v in shape)
            or not all(type(v) is int and 0 <= v < _INT64_LIMIT for v in stride)):
        return None
    name, isz = info
    if math.prod(d for d in shape if d) * isz >= _INT64_LIMIT:
        return None
    span = ((sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) + 1) * isz
            if 0 not in shape else 0)
    if off + span > blobs[blob].length:
        return None
    return TensorRecord(key, blob, off, name, tuple(shape), tuple(stride))


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
    name = check_dtype_name(dtype, where=where)
    shape, stride = t.get("shape"), t.get("stride")
    if not isinstance(shape, list) or not isinstance(stride, list) or len(shape) != len(stride) \
            or len(shape) > MAX_NDIM:
        raise CheckpointCorruptError(f"{where}: shape/stride must be lists of equal length <= "
                                     f"{MAX_NDIM}")
    shape_t = tuple(_int(s, "shape entry", where) for s in shape)
    stride_t = tuple(_int(s, "stride entry", where) for s in stride)
    if any(v >= _INT64_LIMIT for v in shape_t + stride_t) \
            or math.prod(d for d in shape_t if d) * itemsize_of(name) >= _INT64_LIMIT:
        raise CheckpointCorruptError(f"{where}: shape {list(shape_t)} / stride {list(stride_t)} "
                                     "exceed what a tensor can address (int64)")
    rec = TensorRecord(key, blob, _int(t.get("byte_offset"), "byte_offset", where),
                       name, shape_t, stride_t)
    if rec.byte_offset + rec.span_bytes() > blobs[blob].length:
        raise CheckpointCorruptError(
            f"{where}: shape {list(shape_t)} of {dtype} needs {rec.span_bytes()} bytes from "
            f"offset {rec.byte_offset} but its blob holds {blobs[blob].length}")
    return rec


def check_global_tensors(manifest: Manifest, where: str = "manifest") -> list[GlobalTensor]:
    """Run the version-2 checks of a parse on an in-memory manifest (what a writer commits).

    The chunk tables (:func:`_global_tensors`, from their JSON form) against the items'
    tensor records, and every chunked item's ``{"$tensor": g}`` against the table; the
    items themselves are taken as they are.  Returns the tables as a parse gives them.

    Raises:
        CheckpointCorruptError: what a reader would refuse (names the global tensor).
    """
    tables = _global_tensors([g.to_json() for g in manifest.global_tensors], manifest.items,
                             where, 0)
    for iname, it in manifest.items.items():
        if it.chunked:
            if it.tensors or it.blobs:
                raise CheckpointCorruptError(f"{where}: chunked item {iname!r} has tensors/blobs "
                                             "of its own")
            _check_state(it.state, len(tables), f"{where} chunked item {iname!r}",
                         what="global tensor")
    return tables


def _global_tensors(gdoc: Any, items: dict[str, Item], where: str,
                    entries: int) -> list[GlobalTensor]:
    """Parse and check the chunk tables (manifest version 2); ``entries`` counted so far.

    Counts are bounded before anything is looked at (:data:`MAX_ENTRIES` in all,
    :data:`~xla_ckpt.format.chunks.MAX_CHUNKS_PER_TENSOR` per tensor), then each chunk is
    checked against its record and the tensor's shape, then the chunks' volumes must sum
    to the tensor's elements and no two may overlap (:func:`first_overlap`): together that
    is "they tile it".  Work and memory are linear in the table's size (n log n for the
    overlap check), never in the tensors' elements.
    """
    if not isinstance(gdoc, list):
        raise CheckpointCorruptError(f"{where}: 'global_tensors' must be a list")
    entries += len(gdoc)
    if entries > MAX_ENTRIES:
        raise CheckpointCorruptError(f"{where}: more than {MAX_ENTRIES} entries")
    out: list[GlobalTensor] = []
    keys: set[str] = set()
    for g, t in enumerate(gdoc):
        gt = _global_tensor(t, items, f"{where} global tensor {g}", entries)
        entries += len(gt.chunks)
        if gt.key in keys:
            raise CheckpointCorruptError(f"{where} global tensor {g}: duplicate key {gt.key}")
        keys.add(gt.key)
        out.append(gt)
    return out


def _global_tensor(t: Any, items: dict[str, Item], where: str, entries: int) -> GlobalTensor:
    if not isinstance(t, dict):
        raise CheckpointCorruptError(f"{where}: must be an object")
    key = t.get("key")
    if not isinstance(key, str):
        raise CheckpointCorruptError(f"{where}: key must be a string")
    where = f"{where} ({key})"
    dtype = t.get("dtype")
    name = check_dtype_name(dtype, where=where)
    shape = t.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise CheckpointCorruptError(f"{where}: shape must be a list of at most {MAX_NDIM} "
                                     "integers")
    shape_t = tuple(_int(s, "shape entry", where) for s in shape)
    numel = math.prod(shape_t)
    if any(v >= _INT64_LIMIT for v in shape_t) \
            or math.prod(d for d in shape_t if d) * itemsize_of(name) >= _INT64_LIMIT:
        raise CheckpointCorruptError(f"{where}: shape {list(shape_t)} exceeds what a tensor can "
                                     "address (int64)")
    placement = t.get("placement", "")
    if not isinstance(placement, str):
        raise CheckpointCorruptError(f"{where}: placement must be a string")
    chunks_doc = t.get("chunks")
    if not isinstance(chunks_doc, list):
        raise CheckpointCorruptError(f"{where}: chunks must be a list")
    n = len(chunks_doc)
    if n > MAX_CHUNKS_PER_TENSOR:
        raise CheckpointCorruptError(f"{where}: {n} chunks, more than the "
                                     f"{MAX_CHUNKS_PER_TENSOR} a global tensor may have")
    if entries + n > MAX_ENTRIES:
        raise CheckpointCorruptError(f"{where}: more than {MAX_ENTRIES} entries")
    ndim = len(shape_t)
    chunks: list[ChunkRecord] = []
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    volume = 0
    fast = _fast_chunks(chunks_doc, items, shape_t, name, ndim)
    if fast is not None:
        chunks, boxes, volume = fast
    else:  # one at a time, to name what is wrong
        for j, c in enumerate(chunks_doc):
            rec = _chunk(c, items, shape_t, name, ndim, where, j)
            chunks.append(rec)
            boxes.append((rec.offsets, tuple(map(operator.add, rec.offsets, rec.sizes))))
            volume += math.prod(rec.sizes)
    if volume != numel:
        how = ("they leave a gap" if volume < numel else "they overlap")
        raise CheckpointCorruptError(f"{where}: chunks hold {volume} elements of a tensor of "
                                     f"{numel} (shape {list(shape_t)}): {how}; they must tile it")
    try:
        pair = first_overlap(boxes)
    except LayoutTooIrregularError:
        raise CheckpointCorruptError(
            f"{where}: the layout of its {n} chunks is too irregular to check for overlaps "
            "within the work budget; refused as hostile") from None
    if pair is not None:
        a, b = (chunks[i] for i in pair)
        raise CheckpointCorruptError(
            f"{where}: chunks {pair[0]} (offsets {list(a.offsets)}, sizes {list(a.sizes)}) and "
            f"{pair[1]} (offsets {list(b.offsets)}, sizes {list(b.sizes)}) overlap; chunks must "
            "tile the tensor")
    return GlobalTensor(key=key, dtype=name, shape=shape_t, chunks=tuple(chunks),
                        placement=placement)


_Boxes = list[tuple[tuple[int, ...], tuple[int, ...]]]
_INT_ONLY = {int}


def _fast_chunks(chunks_doc: list, items: dict[str, Item], shape: tuple[int, ...], dtype: str,
                 ndim: int) -> tuple[list[ChunkRecord], _Boxes, int] | None:
    """(chunks, their boxes, sum of their volumes) when every entry passes every check of
    :func:`_chunk`; None as soon as one does not (or may not: then :func:`_chunk` decides).

    The table of a large job has hundreds of thousands of entries: the checks here are
    the same as :func:`_chunk`'s, made with as few Python-level steps as possible.
    """
    chunks: list[ChunkRecord] = []
    boxes: _Boxes = []
    volume = 0
    add, le, prod = operator.add, operator.le, math.prod
    contiguous: dict[tuple[tuple[int, ...], tuple[int, ...]], bool] = {}
    if ndim == 0:
        return None
    for c in chunks_doc:
        try:
            iname, k, offs, sizes = c["item"], c["tensor"], c["offsets"], c["sizes"]
            it = items[iname]
        except (KeyError, TypeError):  # not an object, a field or the item missing
            return None
        if (type(iname) is not str or type(k) is not int or type(offs) is not list
                or type(sizes) is not list or it.chunked or not 0 <= k < len(it.tensors)):
            return None
        rec = it.tensors[k]
        sizes_t = tuple(sizes)
        if (rec.shape != sizes_t or len(offs) != ndim or rec.dtype != dtype
                or set(map(type, offs + sizes)) != _INT_ONLY or min(offs) < 0 or 0 in sizes_t
                or not all(map(le, map(add, offs, sizes_t), shape))):
            return None
        ok = contiguous.get((sizes_t, rec.stride))
        if ok is None:
            ok = contiguous[(sizes_t, rec.stride)] = _c_contiguous(sizes_t, rec.stride)
        if not ok:
            return None
        offs_t = tuple(offs)
        chunks.append(ChunkRecord(iname, k, offs_t, sizes_t))
        boxes.append((offs_t, tuple(map(add, offs_t, sizes_t))))
        volume += prod(sizes_t)
    return chunks, boxes, volume


def _chunk(c: Any, items: dict[str, Item], shape: tuple[int, ...], dtype: str, ndim: int,
           where_tensor: str, j: int) -> ChunkRecord:
    """Chunk entry ``j`` of a global tensor, checked against its record and the global shape."""
    if type(c) is dict:
        iname, k, offs, sizes = c.get("item"), c.get("tensor"), c.get("offsets"), c.get("sizes")
        it = items.get(iname) if isinstance(iname, str) else None
        if (isinstance(iname, str) and it is not None and not it.chunked
                and type(k) is int and 0 <= k < len(it.tensors)
                and type(offs) is list and type(sizes) is list and len(offs) == ndim
                and len(sizes) == ndim and all(type(o) is int and o >= 0 for o in offs)
                and all(type(n) is int and n > 0 for n in sizes)):
            rec = it.tensors[k]
            sizes_t = tuple(sizes)
            if (all(map(operator.le, map(operator.add, offs, sizes_t), shape))
                    and rec.dtype == dtype
                    and rec.shape == sizes_t and _c_contiguous(sizes_t, rec.stride)):
                return ChunkRecord(iname, k, tuple(offs), sizes_t)  # the common case
    return _bad_chunk(c, items, shape, dtype, ndim, f"{where_tensor} chunk {j}")


def _bad_chunk(c: Any, items: dict[str, Item], shape: tuple[int, ...], dtype: str, ndim: int,
               where: str) -> ChunkRecord:
    """:func:`_chunk` again, one check at a time, to say what is wrong."""
    if not isinstance(c, dict):
        raise CheckpointCorruptError(f"{where}: must be an object")
    iname = c.get("item")
    it = items.get(iname) if isinstance(iname, str) else None
    if it is None or it.chunked or not isinstance(iname, str):
        raise CheckpointCorruptError(f"{where}: item {iname!r} is not a (non-chunked) item of "
                                     "this manifest")
    k = c.get("tensor")
    if type(k) is not int or not 0 <= k < len(it.tensors):
        raise CheckpointCorruptError(f"{where}: tensor {k!r} is not a record of item {iname!r} "
                                     f"({len(it.tensors)} records)")
    offs, sizes = c.get("offsets"), c.get("sizes")
    if type(offs) is not list or type(sizes) is not list or len(offs) != ndim \
            or len(sizes) != ndim:
        raise CheckpointCorruptError(f"{where}: offsets and sizes must be lists of {ndim} "
                                     "integers (the tensor's rank)")
    for d in range(ndim):
        o, s = offs[d], sizes[d]
        if type(o) is not int or type(s) is not int or o < 0 or s <= 0 or o + s > shape[d]:
            raise CheckpointCorruptError(
                f"{where}: box offsets {offs} sizes {sizes} is empty or lies outside the "
                f"tensor's shape {list(shape)} (dim {d})")
    rec = it.tensors[k]
    sizes_t = tuple(sizes)
    if rec.dtype != dtype or rec.shape != sizes_t or not _c_contiguous(rec.shape, rec.stride):
        raise CheckpointCorruptError(
            f"{where}: record {k} of item {iname!r} ({rec.key}: {rec.dtype}{list(rec.shape)} "
            f"stride {list(rec.stride)}) is not a C-contiguous {dtype}{list(sizes_t)} tensor")
    return ChunkRecord(iname, k, tuple(offs), sizes_t)


def _c_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Row-major contiguous (strides of size-1 dims do not matter, as for torch)."""
    expected = 1
    for d in range(len(shape) - 1, -1, -1):
        if shape[d] != 1 and stride[d] != expected:
            return False
        expected *= shape[d]
    return True
