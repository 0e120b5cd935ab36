"""Read blobs by byte range into preallocated buffers, crc32c on every byte.

:class:`BlobReader` is the thin reader over storage under
:class:`~xla_ckpt.io.reader.CheckpointReader` (item assembly) and
:mod:`xla_ckpt.io.chunked` (boxes of chunked tensors).  Reads are planned across
blobs (:func:`~xla_ckpt.io.planning.plan_spans`): a run of blobs that lie next to
each other in a data file is fetched with one request per ``slice_size_bytes``
(one ranged GET on GCS, crossing blob boundaries); small blobs whose buffers are
apart are fetched together through a staging buffer and split back by offset.
Every chunk-aligned piece is checked against its own crc32c from the manifest (the
per-chunk crc32c, or the whole-blob crc32c for small blobs) by the thread that read
it, right after the read, so verification overlaps I/O and every byte handed back
has been checked.  A mismatch re-reads that piece alone up to ``crc_retries``
times, then :class:`IntegrityError` names the object, the byte range and the
tensor.

A data file the manifest lists that the storage says does not exist (404,
``ENOENT``; before or during the read) raises :class:`DataFileMissingError`:
the checkpoint is committed but this process cannot see that file.  It is
never a :class:`CheckpointNotFoundError`, which callers take to mean "nothing
committed here, start fresh".  A file that is there with the wrong size is a
plain :class:`CheckpointCorruptError` naming expected and actual sizes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DataFileMissingError,
    IntegrityError,
    PartiallyOverwrittenError,
)
from xla_ckpt.format.crc import crc32c
from xla_ckpt.format.manifest import STATE_ITEM, BlobRecord, Item, Manifest
from xla_ckpt.format.plan import tensor_bytes
from xla_ckpt.io.buffers import host_arenas, prefault, shared_pool
from xla_ckpt.io.manifest_file import read_manifest
from xla_ckpt.io.planning import (
    Piece,
    Span,
    cache_steps,
    first_bad_chunk,
    plan_spans,
    slice_ranges,
)
from xla_ckpt.storage import ObjectInfo, Storage
from xla_ckpt.storage.cancel import run_all

logger = logging.getLogger(__name__)

DEFAULT_CRC_RETRIES = 2

@dataclass
class ReadStats:
    """What the last :meth:`CheckpointReader.read_into` (or ``read_blobs``/``load``) call did.

    Attributes:
        bytes_read: blob bytes delivered.
        seconds: wall time of the reads and checks.
        crc_retries: pieces re-read after a crc32c mismatch.
        requests: byte-range reads issued (``read_range`` calls), re-reads included.
    """

    bytes_read: int = 0
    seconds: float = 0.0
    crc_retries: int = 0
    requests: int = 0

    @property
    def mib_per_s(self) -> float:
        return self.bytes_read / max(self.seconds, 1e-9) / 2**20


class BlobReader:
    """Reads blobs of one committed checkpoint folder by byte range, crc32c-checked.  Any rank.

    Args:
        storage: storage rooted at the checkpoint folder.
        manifest: an already-read manifest (e.g. received from rank 0); read
            from storage when None.
        crc_retries: re-reads of a slice whose crc32c mismatches before
            :class:`IntegrityError`.
    """

    def __init__(self, storage: Storage, manifest: Manifest | None = None, *,
                 crc_retries: int = DEFAULT_CRC_RETRIES) -> None:
        self.storage = storage
        self.manifest = manifest if manifest is not None else read_manifest(storage)
        self.crc_retries = crc_retries
        self.stats = ReadStats()
        self._infos: dict[str, ObjectInfo] = {}

    def check_files(self, names: Iterable[str] | None = None) -> dict[str, ObjectInfo]:
        """Stat data files and compare sizes with the manifest; pins GCS generations.

        Raises:
            DataFileMissingError: the storage says a listed file does not exist
                (names the file and the checkpoint; a CheckpointCorruptError).
            CheckpointCorruptError: a file has the wrong size (names the path,
                expected vs actual size).
        """
        for name in names if names is not None else self.manifest.files:
            if name in self._infos:
                continue
            expected = self.manifest.files[name]
            try:
                info = self.storage.stat(name)
            except CheckpointNotFoundError:
                raise data_file_missing(self.storage, name, expected) from None
            if info.size != expected:
                raise CheckpointCorruptError(
                    f"{self.storage.url(name)}: expected {expected} bytes, found {info.size} "
                    f"bytes ({'truncated' if info.size < expected else 'extra bytes'})")
            self._infos[name] = info
        return self._infos

    def allocate(self, item_name: str = STATE_ITEM,
                 blob_ids: Sequence[int] | None = None) -> dict[int, torch.Tensor]:
        """Preallocated uint8 CPU buffers, one per blob (what :meth:`read_into` fills).

        The buffers are views into a few host arenas laid out like the data
        file (see :func:`host_arenas`), so :meth:`read_into` fills runs of
        adjacent blobs with one large read each and takes huge pages where the
        kernel allows them.
        """
        item = self.manifest.item(item_name)
        ids = range(len(item.blobs)) if blob_ids is None else blob_ids
        # Stat first: never allocate for bytes a truncated or tampered checkpoint does not hold.
        self.check_files({item.blobs[i].file for i in ids})
        return host_arenas(item, ids)

    def read_blobs(self, item_name: str = STATE_ITEM,
                   blob_ids: Sequence[int] | None = None) -> dict[int, torch.Tensor]:
        """Read blobs (all of the item's when ``blob_ids`` is None) into fresh buffers."""
        bufs = self.allocate(item_name, blob_ids)
        self.read_into(item_name, bufs)
        return bufs

    def read_into(self, item_name: str, buffers: Mapping[int, torch.Tensor], *,
                  live: Iterable[int] = ()) -> None:
        """Fill ``buffers`` (blob index -> uint8 CPU tensor of the blob's length), crc32c-checked.

        Reads are planned across blobs (:func:`plan_spans`): a run of blobs
        that sit next to each other in the data file, and whose buffers sit
        the same way in one storage (what :meth:`allocate` gives), is read with
        one request per ``storage.config.slice_size_bytes``; small blobs (at
        most :data:`~xla_ckpt.io.planning.COALESCE_BLOB_BYTES` each) whose buffers are apart
        are read
        together into a staging buffer and copied out once every one of them
        passed its crc32c.  Every chunk-aligned piece is checked against its
        own crc32c by the thread that read it; a mismatch re-reads that piece
        alone, up to ``crc_retries`` times.

        ``live``: blob indices whose buffers are memory the caller already uses
        (parameters restored in place).  Small ones (at most
        :data:`~xla_ckpt.io.planning.COALESCE_BLOB_BYTES`) always go through a staging buffer and
        land only once checked; larger ones are read in place, and a crc32c
        failure that remains after the re-reads there raises
        :class:`~xla_ckpt.errors.PartiallyOverwrittenError`: bytes that failed
        the check are in the caller's tensor.

        Raises:
            IntegrityError: crc32c mismatch after the re-reads (names the object, the byte
                range and the tensor keys).
            PartiallyOverwrittenError: the same, in a ``live`` buffer.
            CheckpointCorruptError / DataFileMissingError: wrong sizes, files gone.
            ValueError: a buffer is not ``uint8[blob length]``.
        """
        item = self.manifest.item(item_name)
        self.check_files({item.blobs[i].file for i in buffers})
        for i, buf in buffers.items():
            rec = item.blobs[i]
            if buf.numel() != rec.length or buf.dtype != torch.uint8 or not buf.is_contiguous() \
                    or buf.device.type != "cpu":
                raise ValueError(f"buffer for blob {i} must be a contiguous CPU "
                                 f"uint8[{rec.length}] tensor")
        live_ids = frozenset(live)
        spans = plan_spans(item, buffers, self.storage.config.slice_size_bytes, stage=live_ids)
        # Longest first: the short spans (small blobs, the tails of large ones) fill the last
        # gaps of the pool instead of starting last and making everyone wait for them.
        spans.sort(key=lambda sp: -sp.length)
        t0 = time.perf_counter()
        self.stats = ReadStats()
        self._run([(item, sp, live_ids) for sp in spans], fn=self._read_span)
        self.stats.seconds = time.perf_counter() - t0
        self.stats.bytes_read = sum(item.blobs[i].length for i in buffers)

    def read_blob_range(self, item_name: str, blob_id: int, start: int,
                        length: int) -> torch.Tensor:
        """Bytes ``[start, start+length)`` of one blob, every byte crc32c-checked.

        Reads the covering chunk-aligned range (the granularity of the
        manifest's chunk crc32c) and returns a uint8 tensor of ``length`` bytes.
        """
        item = self.manifest.item(item_name)
        rec = item.blobs[blob_id]
        if start < 0 or length < 0 or start + length > rec.length:
            raise ValueError(
                f"range [{start}, {start + length}) outside blob of {rec.length} bytes")
        if not rec.chunk_crc32c:
            return self.read_blobs(item_name, [blob_id])[blob_id][start:start + length]
        c = rec.chunk_size
        lo, hi = (start // c) * c, min(rec.length, -(-(start + length) // c) * c)
        buf = torch.empty(hi - lo, dtype=torch.uint8)
        self.check_files([rec.file])
        self._run(self._slices(item, blob_id, rec, tensor_bytes(buf), lo))
        return buf[start - lo:start - lo + length]

    def _read_span(self, item: Item, span: "Span", live: frozenset[int]) -> None:
        """Read one span, check each piece's crc32c, re-read bad pieces; copy staged pieces out.

        On storage whose reads are memory copies (:attr:`Storage.memory_bound_reads`: a
        local file), an in-place span is read in steps of whole pieces of about
        :data:`~xla_ckpt.io.planning.CACHE_STEP_BYTES`: each step's fresh destination pages
        are prefaulted in one
        call (:func:`prefault`), then it is read and its pieces checked at once, while
        their bytes are still in cache.  Elsewhere the span is one request (one ranged
        GET) and its pieces are checked after it.
        """
        info = self._infos.get(span.file)
        generation = info.generation if info else None
        out = span.out if span.out is not None else memoryview(bytearray(span.length))
        if span.out is not None and self.storage.memory_bound_reads:
            crcs: list[int] = []
            for step in cache_steps(span.pieces):
                at = step[0].file_offset - span.offset
                n = step[-1].file_offset + step[-1].length - step[0].file_offset
                if not live.intersection(p.blob_id for p in step):
                    prefault(span.addr + at, n)
                self._fetch(span.file, step[0].file_offset, out[at:at + n], generation)
                crcs.extend(crc32c(out[p.file_offset - span.offset:
                                       p.file_offset - span.offset + p.length]) for p in step)
        else:
            self._fetch(span.file, span.offset, out, generation)
            crcs = [crc32c(out[p.file_offset - span.offset:p.file_offset - span.offset + p.length])
                    for p in span.pieces]
        for piece, got in zip(span.pieces, crcs, strict=True):
            at = piece.file_offset - span.offset
            view = out[at:at + piece.length]
            attempt = 0
            while got != piece.crc32c:
                if self.fall_back(span.file, piece.file_offset, piece.length,
                                  [t.key for t in item.tensors if t.blob == piece.blob_id]):
                    self._fetch(span.file, piece.file_offset, view, generation)
                    got = crc32c(view)
                    continue
                if attempt >= self.crc_retries:
                    raise self._integrity_error(item, piece,
                                                live if span.out is not None else frozenset())
                attempt += 1
                self.stats.crc_retries += 1
                logger.warning("crc32c mismatch in %s bytes [%d, %d) (attempt %d of %d); "
                               "re-reading", self.storage.url(span.file), piece.file_offset,
                               piece.file_offset + piece.length, attempt, self.crc_retries + 1)
                self._fetch(span.file, piece.file_offset, view, generation)
                got = crc32c(view)
        if span.out is None:
            for piece in span.pieces:
                at = piece.file_offset - span.offset
                dest = piece.dest
                assert dest is not None  # staged pieces always carry their destination
                dest[:] = out[at:at + piece.length]

    # ---- how the source's bytes are checked (xla_ckpt's crc32c; other formats override) -----
    def check_grain(self, blob: BlobRecord) -> int:
        """Bytes a range of ``blob`` is widened to on both ends so that it can be checked
        alone: its crc32c chunk, or the whole blob when it has one crc32c for all of it."""
        return blob.chunk_size if blob.chunk_crc32c else max(blob.length, 1)

    def range_checks(self, blob: BlobRecord, start: int,
                     length: int) -> list[tuple[int, int, int]]:
        """``(blob-relative start, length, expected checksum)`` of the checkable pieces of
        blob bytes ``[start, start + length)`` (a :meth:`check_grain`-aligned range)."""
        if not blob.chunk_crc32c:
            return [(0, blob.length, blob.crc32c)]
        c = blob.chunk_size
        return [(s, min(c, blob.length - s), blob.chunk_crc32c[s // c])
                for s in range(start, start + length, c)]

    def fall_back(self, file: str, offset: int, n: int, tensors: Sequence[str]) -> bool:
        """Bytes ``[offset, offset + n)`` of ``file`` failed their crc32c: True when the
        storage reads them from another copy from now on (a local tier's bytes, from the
        durable tier: :meth:`xla_ckpt.storage.tiered.TieredStorage.crc_mismatch`), so the
        caller re-reads them at once; False for the reader's own re-reads."""
        hook = getattr(self.storage, "crc_mismatch", None)
        return bool(hook(file, offset, n, tensors)) if hook is not None else False

    def checksum(self, data: memoryview) -> int:
        """The checksum :meth:`range_checks` values are of (crc32c)."""
        return crc32c(data)

    def range_integrity_error(self, item: str, blob: BlobRecord, start: int, n: int, got: int,
                              want: int, *, chunks: Sequence[str], tensors: Sequence[str],
                              live: bool) -> IntegrityError:
        """The error for blob bytes ``[start, start + n)`` of item ``item`` failing their check
        after ``crc_retries`` re-reads; ``chunks``/``tensors`` name the chunk records and
        global tensors they hold, ``live``: they were read straight into a caller's tensor
        (then :class:`PartiallyOverwrittenError`)."""
        url = self.storage.url(blob.file)
        text = (f"{url}: crc32c mismatch in bytes [{blob.offset + start}, "
                f"{blob.offset + start + n}) of chunk {', '.join(chunks[:3])} (item {item!r}) "
                f"of global tensor {', '.join(tensors[:3])} after {self.crc_retries + 1} "
                "reads; the stored object is corrupt (run `xla-ckpt verify`)")
        key = tensors[0] if tensors else ""
        if live:
            return PartiallyOverwrittenError(
                f"{text}. The bytes were read straight into the destination of "
                f"{', '.join(tensors[:3])}, which now holds bytes that failed the check "
                "(partially overwritten): restore another checkpoint into it or re-initialise "
                "it", path=url, key=key, keys=tuple(tensors))
        return IntegrityError(text, path=url, key=key)

    def _fetch(self, file: str, offset: int, out: memoryview, generation: int | None) -> None:
        self.stats.requests += 1
        try:
            self.storage.read_range(file, offset, out, generation)
        except CheckpointNotFoundError as e:  # deleted or replaced after check_files
            raise data_file_missing(self.storage, file, self.manifest.files.get(file),
                                    during=str(e)) from e

    def _integrity_error(self, item: Item, piece: "Piece", live: frozenset[int]) -> IntegrityError:
        keys = [t.key for t in item.tensors if t.blob == piece.blob_id] or [f"blob {piece.blob_id}"]
        url = self.storage.url(item.blobs[piece.blob_id].file)
        text = (f"{url}: crc32c mismatch in bytes [{piece.file_offset}, "
                f"{piece.file_offset + piece.length}) of tensor {', '.join(keys[:3])} after "
                f"{self.crc_retries + 1} reads; the stored object is corrupt (run `xla-ckpt "
                "verify`)")
        if piece.blob_id in live:
            return PartiallyOverwrittenError(
                f"{text}. The tensor(s) {', '.join(keys[:3])} were restored in place and now "
                "hold bytes that failed the check (partially overwritten): restore another "
                "checkpoint into them or re-initialise them before training", path=url,
                key=keys[0], keys=tuple(keys))
        return IntegrityError(text, path=url, key=keys[0])

    # ---- internals ------------------------------------------------------------------
    def _slices(self, item: Item, blob_id: int, rec: BlobRecord, out: memoryview,
                base: int = 0) -> list[tuple]:
        """Chunk-aligned slices of blob bytes ``[base, base+len(out))``."""
        if not len(out):
            return []
        return [(item, blob_id, rec, base + s, out[s:s + n])
                for s, n in slice_ranges(rec, len(out), self.storage.config)]

    def _run(self, tasks: list[tuple], fn: Callable[..., None] | None = None) -> None:
        fn = fn or self._read_slice
        if not tasks:
            return
        if len(tasks) == 1:
            fn(*tasks[0])
            return
        # The first failure stops the slices in flight; a Ctrl-C is raised within about
        # storage.cancel.INTERRUPT_WAIT_S, their connections shut down (not waited for).
        run_all(shared_pool(self.storage.read_concurrency()), fn, tasks)

    def _read_slice(self, item: Item, blob_id: int, rec: BlobRecord, start: int,
                    out: memoryview) -> None:
        info = self._infos.get(rec.file)
        generation = info.generation if info else None
        bad: tuple[int, int] | None = None
        for attempt in range(self.crc_retries + 1):
            self.stats.requests += 1
            try:
                self.storage.read_range(rec.file, rec.offset + start, out, generation)
            except CheckpointNotFoundError as e:  # deleted or replaced after check_files
                raise data_file_missing(self.storage, rec.file, self.manifest.files.get(rec.file),
                                        during=str(e)) from e
            bad = first_bad_chunk(rec, start, out)
            if bad is None:
                return
            self.stats.crc_retries += 1
            logger.warning("crc32c mismatch in %s bytes [%d, %d) (attempt %d of %d); re-reading",
                           self.storage.url(rec.file), rec.offset + bad[0], rec.offset + bad[1],
                           attempt + 1, self.crc_retries + 1)
        if bad is None:  # the loop above made no read at all
            raise ValueError(f"crc_retries must be >= 0, got {self.crc_retries}")
        keys = [t.key for t in item.tensors if t.blob == blob_id] or [f"blob {blob_id}"]
        raise IntegrityError(
            f"{self.storage.url(rec.file)}: crc32c mismatch in bytes [{rec.offset + bad[0]}, "
            f"{rec.offset + bad[1]}) of tensor {', '.join(keys[:3])} after "
            f"{self.crc_retries + 1} reads; the stored object is corrupt (run `xla-ckpt verify`)",
            path=self.storage.url(rec.file), key=keys[0])



def data_file_missing(storage: Storage, name: str, expected: int | None, *,
                      during: str | None = None) -> DataFileMissingError:
    """The error for data file ``name`` of the committed checkpoint at ``storage`` not being there.

    ``during``: the storage's own message when the file went away after it was stat'ed (the
    read itself got 404, or a GCS generation was replaced).
    """
    url = storage.url(name)
    size = f"expected {expected} bytes" if expected is not None else "size unknown"
    when = f"; it was there when the read began, then: {during}" if during else ""
    return DataFileMissingError(
        f"{url}: data file listed in the manifest is missing ({size}{when}). Checkpoint "
        f"{storage.uri} is committed, but this process cannot see the file; its bytes are not "
        "known to be bad. Check that every host reads the same storage (is the checkpoint on "
        "another host's local disk? a filesystem not mounted here?) and that the checkpoint was "
        "not deleted or replaced while it was read (rotation, a save to the same folder).",
        path=url, checkpoint=storage.uri)

