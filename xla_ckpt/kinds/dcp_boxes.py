"""A DCP checkpoint's tensors as boxes with file byte ranges, read by xla_ckpt's one chunk reader.

Each saved chunk of a DCP tensor is a ``torch.save`` zip inside a ``.distcp`` file; its
tensor bytes are one stored member of that zip, found by byte range
(:func:`~xla_ckpt.format.dcp.locate_tensor_member`: two small requests of zip structure).
:func:`read_dcp_boxes` locates the members the requested boxes overlap and describes them as
the tables :mod:`xla_ckpt.io.chunked` reads: one blob per member (its bytes in the data
file), one chunk record per member, one global tensor per DCP key, so each box is filled by
:func:`~xla_ckpt.io.chunked.read_boxes` exactly as a box of an xla_ckpt sharded checkpoint:
only the overlapping byte ranges are fetched (a box of whole trailing dimensions is one range
per chunk), contiguous runs straight into the destination, the rest through its staging.

:class:`DcpBlobReader` is the :class:`~xla_ckpt.io.blob_reader.BlobReader` of such tables.
DCP records no checksum of parts of a chunk, only the zip's CRC-32 of each whole member, so
ranges are not widened (:meth:`~DcpBlobReader.check_grain` is one byte), a range that is a
whole member is checked against that CRC-32 (read twice, then
:class:`~xla_ckpt.errors.IntegrityError`, or :class:`~xla_ckpt.errors.PartiallyOverwrittenError`
when the bytes went straight into a caller's tensor), and a part of a member is read as it
is.  Bytes the member's location already fetched (the zip of a small tensor lies whole in its
structure requests) are taken from there, once, without another request.

No ranks here: each caller reads its own boxes (:mod:`xla_ckpt.kinds.dcp`).
"""

from __future__ import annotations

import bisect
import logging
import threading
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import torch

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DataFileMissingError,
    IncompleteCheckpointError,
    IntegrityError,
    PartiallyOverwrittenError,
)
from xla_ckpt.format.chunks import Box, ChunkRecord, GlobalTensor
from xla_ckpt.format.dcp import (
    METADATA_NAME,
    DcpChunk,
    DcpMetadata,
    DcpTensorEntry,
    TensorMember,
    load_dcp_metadata,
    locate_tensor_member,
)
from xla_ckpt.format.dtypes import dtype_name, itemsize
from xla_ckpt.format.manifest import BlobRecord, Item, Manifest, TensorRecord
from xla_ckpt.io.blob_reader import BlobReader
from xla_ckpt.io.buffers import shared_pool
from xla_ckpt.io.chunked import BoxRequest, read_boxes
from xla_ckpt.storage import ObjectInfo, Storage, StorageConfig, open_storage
from xla_ckpt.storage.cancel import run_all

logger = logging.getLogger(__name__)

ITEM = "dcp"
"""The one item name of the tables a DCP read is described by."""

#: Chunks located (zip structure fetched, a few KiB each) before their tensor bytes are read.
GROUP_JOBS = 4096
#: Bytes of destinations off the CPU staged on CPU at a time (bounds extra memory).
GROUP_BYTES = 256 * 1024 * 1024


@dataclass
class DcpReadStats:
    """What one :func:`~xla_ckpt.kinds.dcp.read_dcp` /
    :func:`~xla_ckpt.kinds.dcp.read_dcp_into` call fetched from storage.

    Attributes:
        bytes_read: every byte fetched (``.metadata``, zip structure, tensor data).
        tensor_bytes: of which tensor data.
        requests: byte-range requests issued (before the storage layer's slicing).
        keys: keys filled.
        seconds: wall time of the call.
    """

    bytes_read: int = 0
    tensor_bytes: int = 0
    requests: int = 0
    keys: int = 0
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, nbytes: int, *, tensor: bool = False, requests: int = 1) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.requests += requests
            if tensor:
                self.tensor_bytes += nbytes


class DcpSource:
    """A DCP folder opened for reading: its metadata, pinned file versions, counted reads."""

    def __init__(self, uri: str, config: StorageConfig | None, stats: DcpReadStats) -> None:
        self.uri = uri
        self.stats = stats
        self.storage: Storage = open_storage(uri, config)
        self._files: dict[str, ObjectInfo] = {}
        self._lock = threading.Lock()
        try:
            self.metadata = load_metadata(self.storage, stats)
        except BaseException:
            self.storage.close()
            raise

    def close(self) -> None:
        self.storage.close()

    def file(self, name: str, key: str) -> ObjectInfo:
        with self._lock:
            info = self._files.get(name)
        if info is None:
            try:
                info = self.storage.stat(name)
            except CheckpointNotFoundError:
                url = self.storage.url(name)
                raise DataFileMissingError(
                    f"{url}: data file of key {key!r} is missing, though the DCP .metadata "
                    "lists it; the checkpoint was deleted, partly copied, or is on another "
                    "host's disk", path=url, checkpoint=self.storage.uri) from None
            with self._lock:
                info = self._files.setdefault(name, info)
        return info

    def check_range(self, key: str, name: str, offset: int, length: int) -> ObjectInfo:
        info = self.file(name, key)
        if offset + length > info.size:
            raise CheckpointCorruptError(
                f"{self.storage.url(name)}: key {key!r}: its bytes [{offset}, {offset + length}) "
                f"run past the end of the {info.size}-byte file; the checkpoint is truncated or "
                "its .metadata does not belong to these files")
        return info

    def files(self) -> dict[str, ObjectInfo]:
        """The data files stat'ed so far (name -> object info, generation pinned)."""
        with self._lock:
            return dict(self._files)

    def read(self, name: str, offset: int, n: int, *, tensor: bool = False) -> bytes:
        """Bytes ``[offset, offset + n)`` of data file ``name`` (stat'ed first), counted."""
        buf = bytearray(n)
        if n:
            info = self._files[name]
            self.storage.read_range(name, offset, memoryview(buf), info.generation)
        self.stats.add(n, tensor=tensor)
        return bytes(buf)


def load_metadata(storage: Storage, stats: DcpReadStats) -> DcpMetadata:
    try:
        info = storage.stat(METADATA_NAME)
    except CheckpointNotFoundError:
        try:
            names = storage.list("")
        except CheckpointNotFoundError:
            names = []
        if any(n.endswith(".distcp") for n in names):
            raise IncompleteCheckpointError(
                f"{storage.uri}: DCP data files without the .metadata commit marker: a DCP save "
                "did not finish there; use another checkpoint") from None
        raise CheckpointNotFoundError(f"{storage.uri}: no DCP checkpoint (no {METADATA_NAME} "
                                      "object)") from None
    buf = bytearray(info.size)
    if info.size:
        storage.read_range(METADATA_NAME, 0, memoryview(buf), info.generation)
    stats.add(info.size)
    return load_dcp_metadata(bytes(buf), source=storage.url(METADATA_NAME))


@dataclass
class DcpBox:
    """Fill ``out`` with the saved values of ``entry`` in the box at ``offsets`` of its shape.

    Attributes:
        entry: the DCP tensor key.
        offsets: the box's first index in each dimension (global index space).
        out: the destination, of the box's shape and the saved dtype, on any device.
        fresh: ``out`` is a buffer nobody uses if the read fails (``read_dcp``), so a CRC-32
            failure in bytes read straight into it is a plain IntegrityError.
    """

    entry: DcpTensorEntry
    offsets: tuple[int, ...]
    out: torch.Tensor
    fresh: bool = False

    @property
    def box(self) -> Box:
        return Box(self.offsets, tuple(self.out.shape))


@dataclass
class _Located:
    """A chunk's member in its zip, and the zip bytes its location fetched."""

    entry: DcpTensorEntry
    chunk: DcpChunk
    member: TensorMember | None = None
    pieces: list[tuple[int, bytes]] = field(default_factory=list)  # (file offset, bytes)


def where(url: str, key: str, chunk: DcpChunk) -> str:
    """How errors name one saved chunk: its file, key, offsets and zip's byte range."""
    return (f"{url}: key {key!r} (chunk at offsets {chunk.offsets}, bytes [{chunk.offset}, "
            f"{chunk.offset + chunk.length}))")


class DcpBlobReader(BlobReader):
    """:class:`BlobReader` over the members of a DCP checkpoint (module docstring).

    Args:
        src: the open DCP checkpoint (its storage; files already stat'ed).
        manifest: the tables of the located members (:func:`read_dcp_boxes`).
        pieces: file -> sorted ``(offset, bytes)`` of zip bytes already fetched.
    """

    def __init__(self, src: DcpSource, manifest: Manifest,
                 pieces: dict[str, list[tuple[int, bytes]]]) -> None:
        super().__init__(src.storage, manifest, crc_retries=1)
        self._infos.update(src.files())
        self._pieces = pieces
        self._starts = {f: [p[0] for p in ps] for f, ps in pieces.items()}
        self._served: set[tuple[str, int, int]] = set()
        self._lock = threading.Lock()
        self.served_bytes = 0

    def check_grain(self, blob: BlobRecord) -> int:
        return 1

    def range_checks(self, blob: BlobRecord, start: int,
                     length: int) -> list[tuple[int, int, int]]:
        if start == 0 and length == blob.length:
            return [(0, blob.length, blob.crc32c)]
        return []

    def checksum(self, data: memoryview) -> int:
        return zlib.crc32(data)

    def range_integrity_error(self, item: str, blob: BlobRecord, start: int, n: int, got: int,
                              want: int, *, chunks: Sequence[str], tensors: Sequence[str],
                              live: bool) -> IntegrityError:
        msg = (f"{chunks[0]}: CRC-32 of the tensor bytes read is {got:08x}, the zip records "
               f"{want:08x} (read twice); the file is corrupt")
        path, key = self.storage.url(blob.file), tensors[0]
        if live:
            return PartiallyOverwrittenError(
                f"{msg}; the tensor of key {key!r} now holds these unchecked bytes: restore it "
                "from another checkpoint", path=path, key=key, keys=(key,))
        return IntegrityError(msg, path=path, key=key)

    def _fetch(self, file: str, offset: int, out: memoryview, generation: int | None) -> None:
        """Zip bytes the member's location fetched serve the first read of them; every other
        read (a re-read after a CRC-32 mismatch included) goes to storage."""
        n = len(out)
        starts = self._starts.get(file)
        if starts:
            at = bisect.bisect_right(starts, offset)
            for k in range(max(0, at - 3), at):
                start, data = self._pieces[file][k]
                if start <= offset and offset + n <= start + len(data):
                    with self._lock:
                        fresh = (file, offset, n) not in self._served
                        self._served.add((file, offset, n))
                        if fresh:
                            self.served_bytes += n
                    if fresh:
                        out[:] = data[offset - start:offset - start + n]
                        return
                    break
        super()._fetch(file, offset, out, generation)


def read_dcp_boxes(src: DcpSource, boxes: Sequence[DcpBox]) -> None:
    """Fill every box from the DCP checkpoint ``src``, by byte range, in groups of at most
    :data:`GROUP_JOBS` chunks (and :data:`GROUP_BYTES` bytes staged for other devices).

    Raises:
        DataFileMissingError / CheckpointCorruptError: a data file missing or too short, a
            zip that is not what the ``.metadata`` says (names the file and key).
        UnsafePickleError: a zip's ``data.pkl`` names a global outside the allow-list.
        IntegrityError / PartiallyOverwrittenError: a whole member failed its CRC-32 twice.
    """
    todo = [(b, _overlaps(b)) for b in boxes if b.out.numel()]
    for b, chunks in todo:  # every file stat'ed and every range checked before any read
        for c in chunks:
            src.check_range(b.entry.key, c.file, c.offset, c.length)
    group: list[tuple[DcpBox, list[DcpChunk]]] = []
    jobs = staged = 0
    for b, chunks in todo:
        size = b.out.numel() * b.out.element_size() if b.out.device.type != "cpu" else 0
        if group and (jobs + len(chunks) > GROUP_JOBS or staged + size > GROUP_BYTES):
            _read_group(src, group)
            group, jobs, staged = [], 0, 0
        group.append((b, chunks))
        jobs += len(chunks)
        staged += size
    if group:
        _read_group(src, group)


def _overlaps(b: DcpBox) -> list[DcpChunk]:
    box = b.box
    return [c for c in b.entry.chunks if c.numel and all(
        co < bo + bs and bo < co + cs
        for co, cs, bo, bs in zip(c.offsets, c.sizes, box.offsets, box.sizes, strict=True))]


def _read_group(src: DcpSource, group: list[tuple[DcpBox, list[DcpChunk]]]) -> None:
    located: dict[tuple[str, int], _Located] = {}
    for b, chunks in group:
        for c in chunks:
            located.setdefault((b.entry.key, id(c)), _Located(b.entry, c))
    jobs = list(located.values())

    def locate(job: _Located) -> None:
        def read(off: int, n: int) -> bytes:
            data = src.read(job.chunk.file, job.chunk.offset + off, n)
            job.pieces.append((job.chunk.offset + off, data))
            return data

        job.member = locate_tensor_member(
            read, job.chunk.length, where=where(src.storage.url(job.chunk.file), job.entry.key,
                                                 job.chunk),
            dtype=job.entry.dtype, sizes=job.chunk.sizes)

    run_all(shared_pool(src.storage.read_concurrency()), locate, [(j,) for j in jobs])
    manifest, index, raw = _tables(src, jobs)
    requests: list[BoxRequest] = []
    after: list[tuple[torch.Tensor, torch.Tensor]] = []  # (checked bytes, where they go)
    # (request, chunk, destination, its first global index): members saved with strides
    strided: list[tuple[int, _Located, torch.Tensor, tuple[int, ...]]] = []
    for b, chunks in group:
        out = b.out.detach()
        fresh = b.fresh
        if out.device.type != "cpu":
            cpu = torch.empty(out.shape, dtype=out.dtype)
            after.append((cpu, out))
            out, fresh = cpu, True
        box = b.box
        for c in chunks:
            job = located[(b.entry.key, id(c))]
            lo = tuple(max(co, bo) for co, bo in zip(c.offsets, box.offsets, strict=True))
            hi = tuple(min(co + cs, be) for co, cs, be in
                       zip(c.offsets, c.sizes, box.ends, strict=True))
            view = out[tuple(slice(a - o, z - o) for a, z, o in
                             zip(lo, hi, box.offsets, strict=True))]
            r = raw.get(id(job))
            if r is not None:  # a member saved with strides: read whole, viewed, copied
                m = job.member
                assert m is not None
                buf = torch.empty(m.nbytes, dtype=torch.uint8)
                requests.append(BoxRequest(r, Box((0,), (m.nbytes,)), buf, fresh=True))
                strided.append((len(requests) - 1, job, view, lo))
                continue
            requests.append(BoxRequest(index[job.entry.key], Box(lo, tuple(
                z - a for a, z in zip(lo, hi, strict=True))), view, fresh=fresh))
    pieces: dict[str, list[tuple[int, bytes]]] = {}
    for job in jobs:
        pieces.setdefault(job.chunk.file, []).extend(job.pieces)
        job.pieces = []
    for ps in pieces.values():
        ps.sort(key=lambda p: p[0])
    reader = DcpBlobReader(src, manifest, pieces)
    read_boxes(reader, requests)
    src.stats.add(reader.stats.bytes_read - reader.served_bytes, tensor=True,
                  requests=reader.stats.requests)
    with torch.no_grad():
        for k, job, dest, first in strided:
            m = job.member
            assert m is not None
            region = requests[k].out.view(m.dtype).as_strided(m.sizes, m.stride,
                                                              m.storage_offset)
            dest.copy_(region[tuple(slice(a - c, a - c + n) for a, c, n in
                                    zip(first, job.chunk.offsets, dest.shape, strict=True))])
        for cpu, dest in after:
            dest.copy_(cpu)


def _tables(src: DcpSource, jobs: list[_Located]
            ) -> tuple[Manifest, dict[str, int], dict[int, int]]:
    """The tables of the located members: (manifest, DCP key -> global tensor, id(job) ->
    global tensor of its raw bytes for a member saved with strides)."""
    blobs: list[BlobRecord] = []
    tensors: list[TensorRecord] = []
    chunks: dict[str, list[ChunkRecord]] = {}
    entries: dict[str, DcpTensorEntry] = {}
    raw_gts: list[GlobalTensor] = []
    raw: dict[int, int] = {}
    for job in jobs:
        m, c = job.member, job.chunk
        assert m is not None
        name = where(src.storage.url(c.file), job.entry.key, c)
        # crc32c holds the zip's CRC-32 of the member (DcpBlobReader.checksum is zlib's).
        blobs.append(BlobRecord(c.file, c.offset + m.data_offset, m.nbytes, m.crc32,
                                chunk_size=1))
        entries.setdefault(job.entry.key, job.entry)
        if not m.contiguous:
            tensors.append(TensorRecord(name, len(blobs) - 1, 0, "uint8", (m.nbytes,), (1,)))
            raw[id(job)] = len(raw_gts)
            raw_gts.append(GlobalTensor(job.entry.key, "uint8", (m.nbytes,), (
                ChunkRecord(ITEM, len(tensors) - 1, (0,), (m.nbytes,)),)))
            continue
        isz = itemsize(m.dtype)
        tensors.append(TensorRecord(name, len(blobs) - 1, m.storage_offset * isz,
                                    dtype_name(m.dtype), tuple(c.sizes), tuple(m.stride)))
        chunks.setdefault(job.entry.key, []).append(
            ChunkRecord(ITEM, len(tensors) - 1, tuple(c.offsets), tuple(c.sizes)))
    gts: list[GlobalTensor] = []
    index: dict[str, int] = {}
    for key, entry in entries.items():
        index[key] = len(gts)
        gts.append(GlobalTensor(key, dtype_name(entry.dtype), tuple(entry.shape),
                                tuple(chunks.get(key, ()))))
    base = len(gts)
    gts.extend(raw_gts)
    raw = {j: base + g for j, g in raw.items()}
    files = {name: info.size for name, info in src.files().items()}
    manifest = Manifest(save_id=ITEM, items={ITEM: Item(state=None, tensors=tensors,
                                                        blobs=blobs, chunked=False)},
                        files=files, global_tensors=gts)
    return manifest, index, raw
