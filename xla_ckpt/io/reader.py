"""Read checkpoints: manifest, byte-range reads into preallocated buffers, crc32c on every byte.

:class:`CheckpointReader` is what every restore strategy uses on the rank(s)
that touch storage.  Reads are split into chunk-aligned slices that run in
parallel; each slice is checked against the manifest's per-chunk crc32c (or
the whole-blob crc32c for small blobs) by the thread that read it, right
after the read, so verification overlaps I/O and every byte handed back has
been checked.  A mismatch is re-read up to ``crc_retries`` times, then
:class:`IntegrityError` names the object and the tensor.

A data file the manifest lists that the storage says does not exist (404,
``ENOENT``; before or during the read) raises :class:`DataFileMissingError`:
the checkpoint is committed but this process cannot see that file.  It is
never a :class:`CheckpointNotFoundError`, which callers take to mean "nothing
committed here, start fresh".  A file that is there with the wrong size is a
plain :class:`CheckpointCorruptError` naming expected and actual sizes.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DataFileMissingError,
    IncompleteCheckpointError,
    IntegrityError,
)
from xla_ckpt.format import typed
from xla_ckpt.format.crc import crc32c
from xla_ckpt.format.manifest import MANIFEST_NAME, STATE_ITEM, BlobRecord, Item, Manifest
from xla_ckpt.format.plan import MapLocation, materialize_item, tensor_bytes
from xla_ckpt.storage import ObjectInfo, Storage, StorageConfig, open_storage

logger = logging.getLogger(__name__)

DEFAULT_CRC_RETRIES = 2


def read_manifest(storage: Storage) -> Manifest:
    """Read and validate ``manifest.json`` at the storage root.

    Raises:
        IncompleteCheckpointError: data files exist but no manifest (the save
            never committed).
        CheckpointNotFoundError: nothing is there.
        CheckpointCorruptError: the manifest is malformed.
    """
    try:
        data = storage.read_bytes(MANIFEST_NAME)
    except CheckpointNotFoundError:
        if storage.list(""):
            raise IncompleteCheckpointError(
                f"{storage.uri}: checkpoint is incomplete (no {MANIFEST_NAME} commit marker); "
                "the save that wrote it did not finish. Restore an earlier checkpoint.") from None
        raise CheckpointNotFoundError(f"{storage.uri}: no checkpoint here "
                                      f"({MANIFEST_NAME} not found)") from None
    return Manifest.from_json_bytes(data, where=storage.url(MANIFEST_NAME), require_crc=True)


@dataclass
class ReadStats:
    """Bytes read and wall time of the last :meth:`CheckpointReader.read_blobs` call."""

    bytes_read: int = 0
    seconds: float = 0.0
    crc_retries: int = 0

    @property
    def mib_per_s(self) -> float:
        return self.bytes_read / max(self.seconds, 1e-9) / 2**20


class CheckpointReader:
    """Reads one committed checkpoint folder.  Any rank may use one.

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

    @classmethod
    def open(cls, uri: str, config: StorageConfig | None = None) -> "CheckpointReader":
        return cls(open_storage(uri, config))

    @property
    def metadata(self) -> Any:
        """The typed-decoded ``metadata`` summary the saver passed."""
        m = self.manifest.metadata
        return typed.decode(m) if m is not None else None

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
        """Preallocated uint8 CPU buffers, one per blob (what :meth:`read_into` fills)."""
        item = self.manifest.item(item_name)
        ids = range(len(item.blobs)) if blob_ids is None else blob_ids
        # Stat first: never allocate for bytes a truncated or tampered checkpoint does not hold.
        self.check_files({item.blobs[i].file for i in ids})
        return {i: torch.empty(item.blobs[i].length, dtype=torch.uint8) for i in ids}

    def read_blobs(self, item_name: str = STATE_ITEM,
                   blob_ids: Sequence[int] | None = None) -> dict[int, torch.Tensor]:
        """Read blobs (all of the item's when ``blob_ids`` is None) into fresh buffers."""
        bufs = self.allocate(item_name, blob_ids)
        self.read_into(item_name, bufs)
        return bufs

    def read_into(self, item_name: str, buffers: dict[int, torch.Tensor]) -> None:
        """Fill ``buffers`` (blob index -> uint8 CPU tensor of the blob's length), crc32c-checked.
        """
        item = self.manifest.item(item_name)
        self.check_files({item.blobs[i].file for i in buffers})
        tasks = []
        for i, buf in buffers.items():
            rec = item.blobs[i]
            if buf.numel() != rec.length or buf.dtype != torch.uint8:
                raise ValueError(f"buffer for blob {i} must be uint8[{rec.length}]")
            tasks.extend(self._slices(item, i, rec, tensor_bytes(buf)))
        t0 = time.perf_counter()
        self.stats = ReadStats()
        self._run(tasks)
        self.stats.seconds = time.perf_counter() - t0
        self.stats.bytes_read = sum(b.numel() for b in buffers.values())

    def read_into_file(self, item_name: str, fd: int, offsets: dict[int, int], *,
                       staging_buffers: int = 2,
                       on_written: Callable[[int], None] | None = None) -> None:
        """Read blobs into a file at ``offsets`` (blob index -> byte offset in ``fd``), checked.

        Each chunk-aligned slice is read into one of ``staging_buffers``
        reusable buffers of the slice size, crc32c-checked there, and only
        then written with ``os.pwrite``: the file receives checked bytes
        only, and a file the kernel fills on ``write`` (a memfd, tmpfs) gets
        its pages without zeroing them first or taking a page fault each,
        which is what reading into a fresh mapping of it would cost.  At most
        ``staging_buffers`` slices are in flight, taken in file-offset order.

        ``on_written(end)``, if given, is called (from a worker thread, in
        increasing order) each time every requested byte below file offset
        ``end`` has been written and checked.

        Raises:
            IntegrityError / CheckpointCorruptError: as :meth:`read_into`.
            OSError: the write to ``fd`` failed (out of memory or space).
        """
        item = self.manifest.item(item_name)
        self.check_files({item.blobs[i].file for i in offsets})
        tasks: list[tuple[Item, int, BlobRecord, int, int]] = []  # (item, blob, rec, start, n)
        for i in offsets:
            rec = item.blobs[i]
            tasks.extend((item, i, rec, s, n) for s, n in _slice_ranges(rec, rec.length,
                                                                        self.storage.config))
        tasks.sort(key=lambda t: offsets[t[1]] + t[3])
        done = [False] * len(tasks)
        lock = threading.Lock()
        front = [0]  # tasks[:front] are all written

        def written(index: int) -> None:
            with lock:
                done[index] = True
                k = front[0]
                while k < len(tasks) and done[k]:
                    k += 1
                if k > front[0]:
                    front[0] = k
                    _, blob_id, _, start, n = tasks[k - 1]
                    if on_written is not None:
                        on_written(offsets[blob_id] + start + n)

        t0 = time.perf_counter()
        self.stats = ReadStats()
        if tasks:
            free: queue.SimpleQueue = queue.SimpleQueue()
            size = max(n for *_, n in tasks)
            for _ in range(max(1, staging_buffers)):
                free.put(memoryview(bytearray(size)))

            def one(index: int, item: Item, blob_id: int, rec: BlobRecord, start: int,
                    n: int) -> None:
                buf = free.get()
                try:
                    self._read_slice(item, blob_id, rec, start, buf[:n])
                    view, at = buf[:n], offsets[blob_id] + start
                    while view:
                        k = os.pwrite(fd, view, at)
                        view, at = view[k:], at + k
                finally:
                    free.put(buf)
                written(index)

            self._run([(i,) + t for i, t in enumerate(tasks)], fn=one)
        self.stats.seconds = time.perf_counter() - t0
        self.stats.bytes_read = sum(item.blobs[i].length for i in offsets)

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

    def load(self, item_name: str = STATE_ITEM, map_location: MapLocation = None) -> Any:
        """Read and rebuild one item's state (CPU tensors unless ``map_location``)."""
        item = self.manifest.item(item_name)
        return materialize_item(item, self.read_blobs(item_name), map_location)

    # ---- internals ------------------------------------------------------------------
    def _slices(self, item: Item, blob_id: int, rec: BlobRecord, out: memoryview,
                base: int = 0) -> list[tuple]:
        """Chunk-aligned slices of blob bytes ``[base, base+len(out))``."""
        if not len(out):
            return []
        return [(item, blob_id, rec, base + s, out[s:s + n])
                for s, n in _slice_ranges(rec, len(out), self.storage.config)]

    def _run(self, tasks: list[tuple], fn: Callable[..., None] | None = None) -> None:
        fn = fn or self._read_slice
        if not tasks:
            return
        if len(tasks) == 1:
            fn(*tasks[0])
            return
        pool = self.storage._executor()
        futures = [pool.submit(fn, *t) for t in tasks]
        try:
            for f in cf.as_completed(futures):
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            cf.wait(futures)
            raise

    def _read_slice(self, item: Item, blob_id: int, rec: BlobRecord, start: int,
                    out: memoryview) -> None:
        info = self._infos.get(rec.file)
        generation = info.generation if info else None
        bad: tuple[int, int] | None = None
        for attempt in range(self.crc_retries + 1):
            try:
                self.storage.read_range(rec.file, rec.offset + start, out, generation)
            except CheckpointNotFoundError as e:  # deleted or replaced after check_files
                raise data_file_missing(self.storage, rec.file, self.manifest.files.get(rec.file),
                                        during=str(e)) from e
            bad = _first_bad_chunk(rec, start, out)
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


def _slice_ranges(rec: BlobRecord, length: int, config: StorageConfig) -> list[tuple[int, int]]:
    """``(start, length)`` of the chunk-aligned slices of ``length`` bytes of blob ``rec``."""
    if length == 0:
        return []
    if not rec.chunk_crc32c:
        return [(0, length)]
    step = max(rec.chunk_size, config.slice_size_bytes // rec.chunk_size * rec.chunk_size)
    return [(s, min(step, length - s)) for s in range(0, length, step)]


def _first_bad_chunk(rec: BlobRecord, start: int, out: memoryview) -> tuple[int, int] | None:
    """None if ``out`` (blob bytes from ``start``) matches the manifest crc32c values."""
    if not rec.chunk_crc32c:
        return None if crc32c(out) == rec.crc32c else (0, rec.length)
    c = rec.chunk_size
    for off in range(0, len(out), c):
        idx = (start + off) // c
        if crc32c(out[off:off + c]) != rec.chunk_crc32c[idx]:
            return (start + off, start + off + len(out[off:off + c]))
    return None
