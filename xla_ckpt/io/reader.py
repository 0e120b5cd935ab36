"""Read checkpoints: manifest, byte-range reads into preallocated buffers, crc32c on every byte.

:class:`CheckpointReader` is what every restore strategy uses on the rank(s)
that touch storage.  Reads are planned across blobs (:func:`plan_spans`): a
run of blobs that lie next to each other in a data file is fetched with one
request per ``slice_size_bytes`` (one ranged GET on GCS, crossing blob
boundaries); small blobs whose buffers are apart are fetched together through
a staging buffer and split back by offset.  Every chunk-aligned piece is
checked against its own crc32c from the manifest (the per-chunk crc32c, or
the whole-blob crc32c for small blobs) by the thread that read it, right
after the read, so verification overlaps I/O and every byte handed back has
been checked.  A mismatch re-reads that piece alone up to ``crc_retries``
times, then :class:`IntegrityError` names the object, the byte range and the
tensor.

Fresh buffers (:meth:`CheckpointReader.read_blobs`, :meth:`~CheckpointReader.load`)
are views into a few host arenas laid out like the data file
(:func:`host_arenas`), backed by transparent huge pages where the kernel
offers them (:func:`host_buffer`): one page fault per 2 MiB instead of per
4 KiB, which was most of the cost of reading into fresh memory here.
:meth:`~CheckpointReader.load` with ``into`` reads blobs straight into
existing CPU tensors (a trainer's live parameters) when their dtype, shape and
strides match (:func:`in_place_buffers`); everything else (other devices,
casts, tensor subclasses, aliasing the live tensors do not share) takes the
fresh-buffer path.

A data file the manifest lists that the storage says does not exist (404,
``ENOENT``; before or during the read) raises :class:`DataFileMissingError`:
the checkpoint is committed but this process cannot see that file.  It is
never a :class:`CheckpointNotFoundError`, which callers take to mean "nothing
committed here, start fresh".  A file that is there with the wrong size is a
plain :class:`CheckpointCorruptError` naming expected and actual sizes.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import logging
import mmap
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import torch

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConfigError,
    DataFileMissingError,
    IntegrityError,
    PartiallyOverwrittenError,
    StateMismatchError,
)
from xla_ckpt.format import typed
from xla_ckpt.format.crc import crc32c
from xla_ckpt.format.dtypes import dtype_from_name, dtype_name, itemsize
from xla_ckpt.format.gc_pause import gc_paused
from xla_ckpt.format.manifest import (
    STATE_ITEM,
    BlobRecord,
    Item,
    Manifest,
    TensorRecord,
)
from xla_ckpt.format.plan import MapLocation, materialize_item, resolve_device, tensor_bytes
from xla_ckpt.io.manifest_file import read_manifest
from xla_ckpt.storage import ObjectInfo, Storage, StorageConfig, open_storage
from xla_ckpt.storage.cancel import run_all
from xla_ckpt.storage.local import LocalStorage

if TYPE_CHECKING:
    from xla_ckpt.io.chunked import BoxRequest

logger = logging.getLogger(__name__)

DEFAULT_CRC_RETRIES = 2

COALESCE_BLOB_BYTES = 1024 * 1024
"""Blobs of at most this many bytes whose buffers are not adjacent in memory are read together
(one request for a run of them, through a staging buffer) rather than one request each."""

MAX_GAP_BYTES = 64 * 1024
"""Bytes between two coalesced small blobs in a data file that are read and dropped rather than
starting another request."""

ARENA_MAX_BYTES = 24 * 1024 * 1024
"""Adjacent blobs share one host arena up to this many bytes (a single blob may be larger): the
most memory a tensor the caller keeps can hold alive beyond its own bytes.  Below glibc's largest
mmap threshold (32 MiB), so once a restore's arenas are freed the next restore in the process gets
that memory back from the heap, already faulted in, as ``torch.load``'s buffers do."""

HUGE_PAGE_BYTES = 2 * 1024 * 1024
"""Host buffers of at least this many bytes ask the kernel for transparent huge pages."""


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
        most :data:`COALESCE_BLOB_BYTES` each) whose buffers are apart are read
        together into a staging buffer and copied out once every one of them
        passed its crc32c.  Every chunk-aligned piece is checked against its
        own crc32c by the thread that read it; a mismatch re-reads that piece
        alone, up to ``crc_retries`` times.

        ``live``: blob indices whose buffers are memory the caller already uses
        (parameters restored in place).  Small ones (at most
        :data:`COALESCE_BLOB_BYTES`) always go through a staging buffer and
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

    def read_into_file(self, item_name: str, fd: int, offsets: dict[int, int], *,
                       staging_buffers: int = 2,
                       on_written: Callable[[int], None] | None = None,
                       ranges: Mapping[int, Sequence[tuple[int, int]]] | None = None) -> None:
        """Read blobs into a file at ``offsets`` (blob index -> byte offset in ``fd``), checked.

        ``ranges`` (blob index -> ``[(start, length), ...]`` bytes of that blob, each start a
        multiple of the blob's crc32c chunk size and each end a chunk boundary or the blob's
        end) reads only those byte ranges, written at ``offsets[blob] + start``; blobs
        without per-chunk crc32c can only be read whole (``[(0, length)]``).  Default: every
        blob of ``offsets``, whole.  The striped restore reads its stripes this way.

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
        wanted = ranges if ranges is not None else \
            {i: [(0, item.blobs[i].length)] for i in offsets}
        self.check_files({item.blobs[i].file for i in wanted})
        tasks: list[tuple[Item, int, BlobRecord, int, int]] = []  # (item, blob, rec, start, n)
        nbytes = 0
        for i, spans in wanted.items():
            rec = item.blobs[i]
            for lo, length in spans:
                if length == 0 and rec.length == 0:
                    continue
                _check_range(rec, i, lo, length)
                nbytes += length
                tasks.extend((item, i, rec, lo + s, n)
                             for s, n in _slice_ranges(rec, length, self.storage.config))
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

        groups = _coalesce(tasks, self.storage.config.slice_size_bytes)
        t0 = time.perf_counter()
        self.stats = ReadStats()
        if tasks:
            free: queue.SimpleQueue = queue.SimpleQueue()
            size = max(sum(tasks[i][4] for i in g) for g in groups)
            for _ in range(max(1, staging_buffers)):
                free.put(memoryview(bytearray(size)))

            def one(group: list[int]) -> None:
                buf = free.get()
                try:
                    parts = [tasks[i] for i in group]
                    if len(parts) == 1:
                        _, item, blob_id, rec, start, n = (0,) + parts[0]
                        self._read_slice(item, blob_id, rec, start, buf[:n])
                    else:  # small pieces side by side in one file: one request for them all
                        self._read_adjacent(parts, buf)
                    pos = 0
                    for _, blob_id, _, start, n in parts:
                        view, at = buf[pos:pos + n], offsets[blob_id] + start
                        pos += n
                        while view:
                            k = os.pwrite(fd, view, at)
                            view, at = view[k:], at + k
                finally:
                    free.put(buf)
                for i in group:
                    written(i)

            self._run([(g,) for g in groups], fn=one)
        self.stats.seconds = time.perf_counter() - t0
        self.stats.bytes_read = nbytes

    def read_ranges_into(self, item_name: str, buffers: Mapping[int, torch.Tensor],
                         ranges: Mapping[int, Sequence[tuple[int, int]]]) -> int:
        """Fill byte ranges of blob buffers, every byte crc32c-checked, all in one thread pool.

        ``buffers[blob]`` is a fresh (not live) contiguous CPU ``uint8[blob length]`` tensor;
        ``ranges[blob]`` lists ``(start, length)`` byte ranges of that blob, aligned as for
        :meth:`read_into_file`.  Bytes land in place and are checked there (a mismatch is
        re-read; the buffer is the caller's staging, never a live tensor); small pieces side
        by side in one file share one request, through a staging buffer.

        Returns:
            Bytes fetched (the sum of the ranges).

        Raises:
            IntegrityError / CheckpointCorruptError / DataFileMissingError: as :meth:`read_into`.
            ValueError: a buffer of another size, or a range that is not chunk-aligned.
        """
        item = self.manifest.item(item_name)
        self.check_files({item.blobs[i].file for i in ranges})
        tasks: list[tuple] = []
        nbytes = 0
        for i, spans in ranges.items():
            rec, buf = item.blobs[i], buffers[i]
            if buf.numel() != rec.length or buf.dtype != torch.uint8 or not buf.is_contiguous() \
                    or buf.device.type != "cpu":
                raise ValueError(f"buffer for blob {i} must be a contiguous CPU "
                                 f"uint8[{rec.length}] tensor")
            for lo, length in spans:
                _check_range(rec, i, lo, length)
                nbytes += length
                tasks.extend((item, i, rec, lo + st, n)
                             for st, n in _slice_ranges(rec, length, self.storage.config))
        dests = [tensor_bytes(buffers[i]) for _, i, _, _, _ in tasks]

        def one(group: list[int]) -> None:
            if len(group) == 1:  # in place
                item, i, rec, start, n = tasks[group[0]]
                self._read_slice(item, i, rec, start, dests[group[0]][start:start + n])
                return
            # small pieces side by side in one file: one request into staging, then copied
            staging = memoryview(bytearray(sum(tasks[k][4] for k in group)))
            self._read_adjacent([tasks[k] for k in group], staging)
            pos = 0
            for k in group:
                _, _, _, start, n = tasks[k]
                dests[k][start:start + n] = staging[pos:pos + n]
                pos += n

        t0 = time.perf_counter()
        self.stats = ReadStats()
        self._run([(g,) for g in _coalesce(tasks, self.storage.config.slice_size_bytes)], fn=one)
        self.stats.seconds = time.perf_counter() - t0
        self.stats.bytes_read = nbytes
        return nbytes

    def _read_adjacent(self, parts: Sequence[tuple[Item, int, BlobRecord, int, int]],
                       buf: memoryview) -> None:
        """Read file-adjacent pieces ``(item, blob, rec, start, n)`` with one ranged request
        into ``buf`` (back to back), then check each against its own crc32c; a piece that
        fails is read again alone (:meth:`_read_slice`: its retries and its error)."""
        _, _, rec0, start0, _ = parts[0]
        total = sum(p[4] for p in parts)
        info = self._infos.get(rec0.file)
        try:
            self.storage.read_range(rec0.file, rec0.offset + start0, buf[:total],
                                    info.generation if info else None)
        except CheckpointNotFoundError as e:  # deleted or replaced after check_files
            raise data_file_missing(self.storage, rec0.file,
                                    self.manifest.files.get(rec0.file), during=str(e)) from e
        self.stats.requests += 1
        pos = 0
        for item, blob_id, rec, start, n in parts:
            out = buf[pos:pos + n]
            bad = _first_bad_chunk(rec, start, out)
            if bad is not None:
                self.stats.crc_retries += 1
                logger.warning("crc32c mismatch in %s bytes [%d, %d) (a read of %d adjacent "
                               "pieces); re-reading that piece alone",
                               self.storage.url(rec.file), rec.offset + bad[0],
                               rec.offset + bad[1], len(parts))
                self._read_slice(item, blob_id, rec, start, out)
            pos += n

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

    @gc_paused()  # many small objects, no cycles (CASES C26)
    def load(self, item_name: str = STATE_ITEM, map_location: MapLocation = None, *,
             into: Mapping[str, torch.Tensor] | None = None, mmap: bool = False) -> Any:
        """Read and rebuild one item's state (CPU tensors unless ``map_location``).

        ``mmap`` (local storage only; ignored elsewhere): the CPU tensors are
        views of private memory maps of the data files instead of fresh copies
        (as ``torch.load(mmap=True)``), every byte crc32c-checked before this
        returns; writing a tensor copies its pages and never touches the file.
        No copy and no fresh memory is made, but the bytes stay tied to the
        files: a process that writes a data file in place changes the tensors,
        and one that truncates it makes touching them raise ``SIGBUS``
        (xla_ckpt never writes a data file in place; it writes a new one and
        renames).  A blob that fails its check is read again the ordinary way
        (re-reads, then :class:`IntegrityError`).

        ``into``: tensors that already exist, by tensor key (the manifest's
        ``TensorRecord.key``, e.g. ``state['model']['fc.weight']``; see
        :func:`in_place_buffers`).  A blob whose tensors all have a target of
        the saved dtype, shape and strides on CPU, covering the blob exactly, is
        read straight into the targets' memory (no fresh buffer, no copy); the
        returned state then holds views of that memory.  Every other tensor
        (other devices, another dtype, tensor subclasses, targets sharing memory
        with another blob's targets) is read into fresh buffers as without
        ``into`` (and all of them when ``map_location`` is given).  The caller
        checks keys, shapes and dtypes before calling
        (:func:`xla_ckpt.trainer.module_load.in_place_targets` does for a
        module); the autograd version counter of every target filled is bumped.

        A chunked item (manifest version 2: sharded state saved by its owners) comes back
        with every global tensor assembled whole on CPU from its chunks
        (:func:`xla_ckpt.io.chunked.read_boxes`: crc32c-checked in staging buffers, then
        copied), then placed as ``map_location`` says; ``into`` is then keyed by global
        tensor key (the same tree path) and every target is filled in place and returned
        as the leaf: a plain CPU tensor of the saved dtype and shape whose elements fill
        their memory once (any order of strides) directly, any other plain tensor of the
        saved dtype and shape (stepped slices, other devices) through a checked staging
        copy; a target the item lacks, or of another dtype or shape, or a tensor subclass,
        raises instead (never a stale target); ``mmap`` does not apply.  What DCP's
        ``dcp_to_torch_save`` gives, without a second copy.

        Raises:
            StateMismatchError: chunked item: an ``into`` key that is not one of its
                tensors, or a target of another dtype or shape, or a tensor subclass
                (names the key); before anything is read.
            ConfigError: chunked item: ``into`` together with ``map_location``.
            PartiallyOverwrittenError: a crc32c failure after the re-reads in the bytes
                of a target (its key is named; the target holds unchecked bytes).
            IntegrityError / CheckpointCorruptError: as :meth:`read_into`.
        """
        item = self.manifest.item(item_name)
        if item.chunked:
            return self._load_chunked(item, map_location, into)
        live = in_place_buffers(item, into) if into and map_location is None else {}
        self.check_files({b.file for b in item.blobs})
        rest = [i for i in range(len(item.blobs)) if i not in live]
        bufs: dict[int, torch.Tensor] = {}
        if mmap and isinstance(self.storage, LocalStorage):
            bufs.update(self._mapped(item, rest))
            rest = [i for i in rest if i not in bufs]
        bufs.update(host_arenas(item, rest))
        bufs.update(live)
        unread = set(rest) | set(live)
        self.read_into(item_name, {i: b for i, b in bufs.items() if i in unread}, live=live)
        if live and into:
            _bump_versions([into[t.key] for t in item.tensors if t.blob in live])
        return materialize_item(item, bufs, map_location)

    def read_boxes(self, requests: Sequence[BoxRequest]) -> int:
        """Fill boxes of global (chunked) tensors; returns the bytes fetched (``self.stats``).

        :func:`xla_ckpt.io.chunked.read_boxes` with this reader: each request's ``out``
        (a CPU tensor of the box's shape and the global dtype) gets the saved elements of
        its box, fetched by byte range (row sub-ranges of saved chunks), every byte
        crc32c-checked in a staging buffer before it lands in ``out``.

        Raises:
            ValueError / CheckpointCorruptError / IntegrityError: as
                :func:`~xla_ckpt.io.chunked.read_boxes`.
        """
        from xla_ckpt.io.chunked import read_boxes  # noqa: PLC0415 - chunked builds on this module

        return read_boxes(self, requests)

    def _load_chunked(self, item: Item, map_location: MapLocation,
                      into: Mapping[str, torch.Tensor] | None) -> Any:
        """:meth:`load` of a chunked item: every global tensor it refers to, assembled whole.

        ``into`` is keyed by global tensor key; every target is filled in place (a plain
        CPU tensor of the saved dtype and shape whose elements fill their memory once
        directly, any other plain tensor of that dtype and shape through a checked staging
        copy) and returned as its leaf; the other tensors get fresh ones.

        Raises:
            StateMismatchError: an ``into`` key the item lacks, another dtype or shape, or
                a tensor subclass (names the key); before anything is read.
            ConfigError: ``into`` together with ``map_location``.
        """
        from xla_ckpt.io.chunked import (  # noqa: PLC0415 - chunked builds on this module
            read_boxes,
            whole_tensor_request,
        )

        refs: set[int] = set()
        typed.decode(item.state, refs.add)
        gts = self.manifest.global_tensors
        if into and map_location is not None:
            raise ConfigError("CheckpointReader.load: into= targets keep their own devices; "
                              "pass into= or map_location=, not both")
        _check_chunked_targets(into or {}, {gts[g].key: gts[g] for g in refs})
        requests = []
        live: list[torch.Tensor] = []
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target, checked staging)
        for g in sorted(refs):
            gt = gts[g]
            target = into.get(gt.key) if into else None
            if target is not None and _fits_box(target, gt.dtype, gt.shape):
                live.append(target)
                requests.append(whole_tensor_request(self.manifest, g, target))
            else:
                requests.append(whole_tensor_request(self.manifest, g))
                if target is not None:
                    staged.append((target, requests[-1].out))
        try:
            read_boxes(self, requests)
        except PartiallyOverwrittenError:
            raise  # names the into= targets holding unchecked bytes
        except IntegrityError as e:
            if not live:
                raise
            raise IntegrityError(
                f"{e} (targets given in into= may already hold some of the checkpoint's "
                "values, checked ones only: restore again or re-initialise them)",
                path=e.path, key=e.key) from e
        with torch.no_grad():
            for target, checked in staged:
                target.copy_(checked)
        staged_out = {id(checked): target for target, checked in staged}
        _bump_versions(live)
        placed: dict[int, torch.Tensor] = {}
        for req in requests:
            if id(req.out) in staged_out:
                placed[req.tensor] = staged_out[id(req.out)]
                continue
            dev = resolve_device(map_location, gts[req.tensor].key)
            placed[req.tensor] = req.out if dev is None or dev.type == "cpu" else req.out.to(dev)
        return typed.decode(item.state, placed.__getitem__)

    def _mapped(self, item: Item, blob_ids: Sequence[int]) -> dict[int, torch.Tensor]:
        """Blobs as checked views of private maps of their data files; failed ones left out."""
        storage = self.storage
        assert isinstance(storage, LocalStorage)
        t0 = time.perf_counter()
        bufs: dict[int, torch.Tensor] = {}
        for name in sorted({item.blobs[i].file for i in blob_ids if item.blobs[i].length}):
            base = torch.frombuffer(storage.map_private(name, self.manifest.files[name]),
                                    dtype=torch.uint8)
            for i in blob_ids:
                rec = item.blobs[i]
                if rec.file == name and rec.length:
                    bufs[i] = base[rec.offset:rec.offset + rec.length]
        bad: set[int] = set()
        step = self.storage.config.slice_size_bytes

        def check(span: Span) -> None:
            assert span.out is not None  # spans of one map are always in place
            for p in span.pieces:
                at = p.file_offset - span.offset
                if crc32c(span.out[at:at + p.length]) != p.crc32c:
                    bad.add(p.blob_id)

        self._run([(sp,) for sp in plan_spans(item, bufs, step)], fn=check)
        if bad:
            logger.warning("crc32c mismatch in the mapped bytes of %d blob(s) of %s; reading "
                           "them again", len(bad), self.storage.uri)
        self.stats.seconds += time.perf_counter() - t0
        return {i: b for i, b in bufs.items() if i not in bad}

    def _read_span(self, item: Item, span: "Span", live: frozenset[int]) -> None:
        """Read one span, check each piece's crc32c, re-read bad pieces; copy staged pieces out.

        On storage whose reads are memory copies (:attr:`Storage.memory_bound_reads`: a
        local file), an in-place span is read in steps of whole pieces of about
        :data:`CACHE_STEP_BYTES`: each step's fresh destination pages are prefaulted in one
        call (:func:`prefault`), then it is read and its pieces checked at once, while
        their bytes are still in cache.  Elsewhere the span is one request (one ranged
        GET) and its pieces are checked after it.
        """
        info = self._infos.get(span.file)
        generation = info.generation if info else None
        out = span.out if span.out is not None else memoryview(bytearray(span.length))
        if span.out is not None and self.storage.memory_bound_reads:
            crcs: list[int] = []
            for step in _cache_steps(span.pieces):
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
                for s, n in _slice_ranges(rec, len(out), self.storage.config)]

    def _run(self, tasks: list[tuple], fn: Callable[..., None] | None = None) -> None:
        fn = fn or self._read_slice
        if not tasks:
            return
        if len(tasks) == 1:
            fn(*tasks[0])
            return
        # The first failure stops the slices in flight; a Ctrl-C is raised within about
        # storage.cancel.INTERRUPT_WAIT_S, their connections shut down (not waited for).
        run_all(_shared_pool(self.storage.read_concurrency()), fn, tasks)

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


_POOLS: dict[int, cf.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _forget_pools_in_child() -> None:
    """A forked child has none of the parent's threads: it starts pools of its own."""
    global _POOLS_LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_in_child)


def _shared_pool(max_workers: int) -> cf.ThreadPoolExecutor:
    """One I/O thread pool per worker count for every reader of the process.

    Readers come and go with each restore (every ``xla_ckpt.load`` opens its
    own storage); starting the threads of a fresh pool each time cost more
    than the reads of a small checkpoint on a busy host.  Tasks in this pool
    never wait on other tasks of it, so sharing it cannot deadlock.
    """
    with _POOLS_LOCK:
        pool = _POOLS.get(max_workers)
        if pool is None:
            pool = _POOLS[max_workers] = cf.ThreadPoolExecutor(
                max_workers, thread_name_prefix="xla_ckpt-read")
            # Start every thread now, while no read competes for the GIL and the cores: a
            # thread started mid-read waits for both (0.6 s for 11 threads on a busy 2-core VM).
            ready = threading.Barrier(max_workers + 1)
            for _ in range(max_workers):
                pool.submit(ready.wait)
            ready.wait()
        return pool


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


def _coalesce(tasks: Sequence[tuple[Item, int, BlobRecord, int, int]],
              limit: int) -> list[list[int]]:
    """Group indices of read tasks ``(item, blob, rec, start, n)``: pieces of at most
    :data:`COALESCE_BLOB_BYTES` that sit back to back in one data file share one request of
    at most ``limit`` bytes; larger pieces (the slices of big blobs) go alone."""
    order = sorted(range(len(tasks)), key=lambda i: (tasks[i][2].file,
                                                    tasks[i][2].offset + tasks[i][3]))
    groups: list[list[int]] = []
    end, file, size = -1, "", 0
    for i in order:
        _, _, rec, start, n = tasks[i]
        at = rec.offset + start
        small = n <= COALESCE_BLOB_BYTES
        if small and groups and rec.file == file and at == end and size + n <= limit:
            groups[-1].append(i)
            size += n
        else:
            groups.append([i])
            size = n if small else limit  # a large piece takes no company
        end, file = at + n, rec.file
    return groups


CACHE_STEP_BYTES = 4 * 1024 * 1024
"""On memory-bound storage an in-place span is read in steps of whole pieces of about this
many bytes (one crc32c chunk by default), each checked right after its read, while it is
still in cache."""


def _cache_steps(pieces: Sequence["Piece"]) -> list[list["Piece"]]:
    """``pieces`` (adjacent in the file) cut into runs of at most :data:`CACHE_STEP_BYTES`
    (a larger piece is a run of its own)."""
    steps: list[list[Piece]] = []
    size = 0
    for p in pieces:
        if steps and size + p.length <= CACHE_STEP_BYTES:
            steps[-1].append(p)
            size += p.length
        else:
            steps.append([p])
            size = p.length
    return steps


def _check_range(rec: BlobRecord, blob_id: int, start: int, length: int) -> None:
    """Raise unless ``[start, start+length)`` of blob ``rec`` can be read and checked alone."""
    end = start + length
    if start < 0 or length < 1 or end > rec.length:
        raise ValueError(f"range [{start}, {end}) of blob {blob_id} is outside its "
                         f"{rec.length} bytes (or empty)")
    if not rec.chunk_crc32c:
        if (start, length) != (0, rec.length):
            raise ValueError(f"blob {blob_id} has one crc32c for all its {rec.length} bytes; "
                             f"it can only be read whole, not [{start}, {end})")
        return
    c = rec.chunk_size
    if start % c or (end % c and end != rec.length):
        raise ValueError(f"range [{start}, {end}) of blob {blob_id} is not aligned to its "
                         f"crc32c chunks of {c} bytes")


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


# ---- read planning: spans over blobs, host arenas, in-place targets ---------------------
@dataclass(frozen=True)
class Piece:
    """A crc32c-checkable piece of one blob: a chunk, or the whole blob when it has no chunks.

    ``file_offset``/``length`` in bytes of the data file; ``dest`` is where the
    piece's bytes go when its span is staged (None when the span reads in place).
    """

    blob_id: int
    file_offset: int
    length: int
    crc32c: int
    dest: memoryview | None = None


@dataclass(frozen=True)
class Span:
    """One byte-range read: ``length`` bytes of ``file`` from ``offset``, covering ``pieces``.

    ``out`` is the destination of all of it (blob buffers adjacent in one
    storage as in the file), or None: read into a staging buffer, then each
    piece copied to its ``dest`` once every piece passed its crc32c.
    """

    file: str
    offset: int
    length: int
    pieces: tuple[Piece, ...]
    out: memoryview | None
    addr: int = 0  # address of ``out``'s first byte (0 when staged)


@dataclass(slots=True)  # not frozen: a frozen __init__ costs 2x, and one is made per chunk
class _Unit:
    blob_id: int
    file: str
    file_offset: int
    length: int
    crc32c: int
    addr: int           # address of the piece's first destination byte
    storage: int        # address of the destination's storage
    buf: torch.Tensor   # the blob's buffer; the piece starts ``at`` bytes in
    at: int
    small: bool         # its blob is at most COALESCE_BLOB_BYTES


def plan_spans(item: Item, buffers: Mapping[int, torch.Tensor], slice_size_bytes: int,
               stage: frozenset[int] = frozenset()) -> list[Span]:
    """Plan the reads that fill ``buffers`` (blob index -> contiguous uint8 CPU tensor).

    Pieces (chunks) are taken in file order and packed into spans of at most
    ``slice_size_bytes`` (a piece larger than that is a span of its own):

    * in place, when the next piece follows in the file with no gap and its
      buffer follows in the same storage at the same distance (the chunks of
      one blob; adjacent blobs of an :func:`host_arenas` arena);
    * staged, when the pieces are of small blobs (at most
      :data:`COALESCE_BLOB_BYTES`) at most :data:`MAX_GAP_BYTES` apart in the file
      but not adjacent in memory (separate tensors): one request for all of them.

    Small blobs in ``stage`` are always staged (a span of them never reads in
    place): their bytes reach the buffer only after they passed the check.
    """
    units: list[_Unit] = []
    for i, buf in buffers.items():
        rec = item.blobs[i]
        if rec.length == 0:
            continue
        addr = buf.data_ptr()
        st = addr - int(buf.storage_offset()) * buf.element_size()  # its storage's first byte
        small = rec.length <= COALESCE_BLOB_BYTES
        if not rec.chunk_crc32c:
            units.append(_Unit(i, rec.file, rec.offset, rec.length, rec.crc32c, addr, st, buf, 0,
                               small))
            continue
        c = rec.chunk_size
        units.extend(_Unit(i, rec.file, rec.offset + at, min(c, rec.length - at), crc,
                           addr + at, st, buf, at, small)
                     for crc, at in zip(rec.chunk_crc32c, range(0, rec.length, c), strict=False))
    units.sort(key=lambda u: (u.file, u.file_offset))
    spans: list[Span] = []
    group: list[_Unit] = []
    staged = False
    # Whether every unit of ``group`` is of a small blob, kept as the group grows: a test
    # over the whole group per unit made planning quadratic in the number of blobs.
    all_small = False
    views: dict[int, memoryview] = {}  # storage address -> its bytes (one view per arena)

    def dest(u: _Unit) -> memoryview:
        view = views.get(u.storage)
        if view is None:
            st = u.buf.untyped_storage()
            whole = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))
            view = views[u.storage] = tensor_bytes(whole)
        at = u.addr - u.storage
        return view[at:at + u.length]

    def close() -> None:
        g0, gl = group[0], group[-1]
        length = gl.file_offset + gl.length - g0.file_offset
        if staged or all(u.small and u.blob_id in stage for u in group):
            spans.append(Span(g0.file, g0.file_offset, length, tuple(
                Piece(u.blob_id, u.file_offset, u.length, u.crc32c, dest(u)) for u in group),
                None))
            return
        st = g0.buf.untyped_storage()
        out = torch.empty(0, dtype=torch.uint8).set_(st, g0.addr - g0.storage, (length,), (1,))
        spans.append(Span(g0.file, g0.file_offset, length, tuple(
            Piece(u.blob_id, u.file_offset, u.length, u.crc32c) for u in group),
            tensor_bytes(out), g0.addr))

    for u in units:
        if group:
            g0, gl = group[0], group[-1]
            gap = u.file_offset - (gl.file_offset + gl.length)
            fits = (u.file == g0.file and gap >= 0
                    and u.file_offset + u.length - g0.file_offset <= slice_size_bytes)
            if fits and not staged and gap == 0 and u.storage == g0.storage \
                    and u.addr - g0.addr == u.file_offset - g0.file_offset:
                group.append(u)
                all_small = all_small and u.small
                continue
            if fits and gap <= MAX_GAP_BYTES and u.small and all_small:
                group.append(u)
                staged = True
                continue
            close()
        group, staged, all_small = [u], False, u.small
    if group:
        close()
    return spans


_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)


def _load_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux") or _MADV_HUGEPAGE is None:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()

MADV_POPULATE_WRITE = 23
"""Linux >= 5.14: fault pages in writable in one call, as writing each would (no data
changes).  Older kernels answer EINVAL and the pages fault in one by one as before."""

PAGE_BYTES = mmap.PAGESIZE


def prefault(addr: int, nbytes: int) -> None:
    """Fault in the pages of ``[addr, addr + nbytes)`` before a read fills them.

    One ``madvise(MADV_POPULATE_WRITE)`` call instead of one page fault per 4 KiB page
    as the read's copy first touches each: the kernel still allocates and zeroes the
    pages, but without a trap per page (benchmarks/README.md, "Local restore").  Pages
    already present are left as they are; the range is widened to whole pages, which
    changes no byte.  Best effort: any failure (old kernel, not Linux) leaves the
    ordinary faults to the read.
    """
    if _madvise is None or nbytes <= 0 or not addr:
        return
    start = addr - addr % PAGE_BYTES
    end = -(-(addr + nbytes) // PAGE_BYTES) * PAGE_BYTES
    _madvise(start, end - start, MADV_POPULATE_WRITE)

HUGE_PAGES: bool | None = None
"""Whether :func:`host_buffer` asks for transparent huge pages: ``True`` always, ``False``
never, ``None`` (default) when the kernel gives them without stalling the fault (see
:func:`huge_pages_stall_free`)."""


def _sysfs_choice(path: str) -> str:
    """The ``[selected]`` word of a sysfs multiple-choice file; ``""`` if unreadable."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def huge_pages_stall_free() -> bool:
    """True when ``MADV_HUGEPAGE`` cannot make a page fault wait for compaction or reclaim.

    With ``transparent_hugepage/defrag`` set to ``madvise``, ``defer+madvise`` or
    ``always`` (the usual defaults), a fault in a region marked ``MADV_HUGEPAGE``
    compacts or reclaims memory until a huge page is free: measured here on a
    busy host with fragmented memory, a 260 MiB restore then took 0.4-0.9 s
    instead of 0.1 s.  Only ``defer`` and ``never`` leave that to the
    background (the fault takes small pages instead).
    """
    base = "/sys/kernel/mm/transparent_hugepage/"
    return (_sysfs_choice(base + "enabled") in ("always", "madvise")
            and _sysfs_choice(base + "defrag") in ("defer", "never"))


_HUGE_STALL_FREE = huge_pages_stall_free()


def host_buffer(nbytes: int) -> torch.Tensor:
    """A fresh uint8 CPU tensor of ``nbytes`` bytes, backed by huge pages where that is safe.

    When :data:`HUGE_PAGES` allows it (by default: the kernel's THP settings
    cannot stall a fault, :func:`huge_pages_stall_free`), buffers of at least
    :data:`HUGE_PAGE_BYTES` start on a 2 MiB boundary (2 MiB more address
    space is reserved, never touched) and are marked ``MADV_HUGEPAGE`` before
    their first touch: filling them takes one page fault per 2 MiB instead of
    per 4 KiB, which is most of the cost of reading into fresh memory on the
    project's VMs (benchmarks/README.md, "Local restore").  Otherwise, and off
    Linux, the buffer is an ordinary one.
    """
    huge = HUGE_PAGES if HUGE_PAGES is not None else _HUGE_STALL_FREE
    if nbytes < HUGE_PAGE_BYTES or not huge or _madvise is None or _MADV_HUGEPAGE is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    lead = -raw.data_ptr() % HUGE_PAGE_BYTES
    buf = raw[lead:lead + nbytes]
    if _madvise(buf.data_ptr(), nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    return buf


def _top_key(key: str) -> str:
    """``state['model']`` of ``state['model']['fc.weight']``: arenas never span two of these."""
    cut = key.find("][")
    return key if cut < 0 else key[:cut + 1]


def host_arenas(item: Item, blob_ids: Iterable[int]) -> dict[int, torch.Tensor]:
    """Fresh uint8 buffers for ``blob_ids``, as views into arenas laid out like the data file.

    Blobs that follow each other in one data file (no gap), belong to the same
    top-level entry of the state (``state['model']``, ``state['optimizer']``)
    and keep their tensors' alignment share one :func:`host_buffer` of at most
    :data:`ARENA_MAX_BYTES`, at the same distances as in the file, so
    :func:`plan_spans` reads them with one request per slice.  The tensors
    rebuilt from a blob keep its arena alive (memory is freed per arena, not
    per tensor); a model state the caller drops is never in an arena with
    optimizer state it keeps.
    """
    align: dict[int, int] = {}
    group: dict[int, str] = {}
    for t in item.tensors:
        align[t.blob] = max(align.get(t.blob, 1), itemsize(dtype_from_name(t.dtype, where=t.key)))
        group.setdefault(t.blob, _top_key(t.key))
    ids = sorted(set(blob_ids), key=lambda i: (item.blobs[i].file, item.blobs[i].offset))
    out: dict[int, torch.Tensor] = {}
    runs: list[list[int]] = []
    for i in ids:
        rec = item.blobs[i]
        if rec.length == 0:
            out[i] = torch.empty(0, dtype=torch.uint8)
            continue
        if runs:
            first, last = item.blobs[runs[-1][0]], item.blobs[runs[-1][-1]]
            if (rec.file == first.file and rec.offset == last.offset + last.length
                    and group.get(i) == group.get(runs[-1][0])
                    and (rec.offset - first.offset) % align.get(i, 1) == 0
                    and rec.offset + rec.length - first.offset <= ARENA_MAX_BYTES):
                runs[-1].append(i)
                continue
        runs.append([i])
    for run in runs:
        first, last = item.blobs[run[0]], item.blobs[run[-1]]
        arena = host_buffer(last.offset + last.length - first.offset)
        for i in run:
            rec = item.blobs[i]
            out[i] = arena[rec.offset - first.offset:rec.offset - first.offset + rec.length]
    return out


def _bump_versions(tensors: Iterable[torch.Tensor]) -> None:
    """Tell autograd that tensors written behind its back changed (as ``copy_`` would)."""
    seen: set[int] = set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            try:
                torch.autograd.graph.increment_version(t)
            except RuntimeError:  # inference tensors have no version counter
                pass


def _fits_in_place(t: torch.Tensor, rec: TensorRecord) -> bool:
    """Whether live tensor ``t`` can take the saved bytes of ``rec`` as they are."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"
            and t.layout == torch.strided and not t.is_quantized and not t.is_conj()
            and not t.is_neg() and t.numel() > 0 and dtype_name(t.dtype) == rec.dtype
            and tuple(t.shape) == rec.shape and tuple(t.stride()) == rec.stride
            and _dense_layout(t))


def _check_chunked_targets(into: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    """Every ``into`` target of a chunked load names one of the item's global tensors
    (``saved``: key -> GlobalTensor) and has its dtype and shape, as a plain tensor.

    Raises:
        StateMismatchError: the first few that do not (names the keys, what to do).
    """
    bad = []
    for key, t in into.items():
        gt = saved.get(key)
        if gt is None:
            bad.append(f"{key} is not a tensor of this item (keys look like "
                       f"{next(iter(saved), 'state[...]')})")
        elif not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor,
                                                                 torch.nn.Parameter):
            bad.append(f"{key} is a {type(t).__name__}, not a plain tensor (restore sharded "
                       "targets with xla_ckpt.restore.restore(uri, into=...))")
        elif dtype_name(t.dtype) != gt.dtype or tuple(t.shape) != tuple(gt.shape):
            bad.append(f"{key} is {gt.dtype}{list(gt.shape)} in the checkpoint but "
                       f"{dtype_name(t.dtype)}{list(t.shape)} in the target")
    if bad:
        more = f"; ... ({len(bad) - 8} more)" if len(bad) > 8 else ""
        raise StateMismatchError(
            f"CheckpointReader.load(into=...): {'; '.join(bad[:8])}{more}. Pass targets of the "
            "saved keys, dtypes and shapes (or leave a tensor out of into= to get a fresh "
            "one); nothing was read")


def _fits_box(t: torch.Tensor, dtype: str, shape: Sequence[int]) -> bool:
    """Whether live tensor ``t`` can be filled in place with a ``dtype``/``shape`` global tensor."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"
            and t.layout == torch.strided and not t.is_quantized and not t.is_conj()
            and not t.is_neg() and dtype_name(t.dtype) == dtype
            and tuple(t.shape) == tuple(shape) and _dense_layout(t))


def _dense_layout(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span exactly once (contiguous or permuted).

    A transposed tensor qualifies; a tensor sliced with a step (gaps between its elements,
    which may belong to other live tensors) or expanded (a zero stride) does not.
    """
    expected = 1
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz > 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def in_place_buffers(item: Item, into: Mapping[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Blob index -> uint8 view of live memory, for the blobs that can be read into ``into``.

    ``into`` maps tensor keys (``TensorRecord.key``) to existing tensors.  A
    blob qualifies when every tensor record of it has a target that
    :func:`_fits_in_place` (CPU, plain tensor or Parameter, saved dtype,
    shape and strides, elements filling their span: contiguous or permuted),
    the targets sit in one storage at the saved distances (tied weights: the
    same tensor for several keys), they
    cover every byte of the blob (nothing else in that storage is
    overwritten), and no other blob's targets overlap that memory.  Every
    other blob is left out (the caller reads it into fresh memory).
    """
    records: dict[int, list[TensorRecord]] = {}
    for t in item.tensors:
        records.setdefault(t.blob, []).append(t)
    claims: list[tuple[int, int, int]] = []  # (first address, end address, blob)
    views: dict[int, torch.Tensor] = {}
    for b, recs in records.items():
        rec = item.blobs[b]
        targets = [into.get(r.key) for r in recs]
        if rec.length == 0 or not all(t is not None and _fits_in_place(t, r)
                                      for t, r in zip(targets, recs, strict=True)):
            continue
        live = [t for t in targets if t is not None]
        st = live[0].untyped_storage()
        base = live[0].data_ptr() - recs[0].byte_offset
        if any(t.untyped_storage().data_ptr() != st.data_ptr() or t.data_ptr() - base
               != r.byte_offset for t, r in zip(live, recs, strict=True)):
            continue
        if base < st.data_ptr() or base + rec.length > st.data_ptr() + st.nbytes():
            continue
        covered = 0
        for lo, hi in sorted((r.byte_offset, r.byte_offset + r.span_bytes()) for r in recs):
            if lo > covered:
                break
            covered = max(covered, hi)
        if covered < rec.length:
            continue
        claims.append((base, base + rec.length, b))
        views[b] = torch.empty(0, dtype=torch.uint8).set_(st, base - st.data_ptr(),
                                                           (rec.length,), (1,))
    claims.sort()
    clash: set[int] = set()
    for (_, end, b), (lo, _, c) in zip(claims, claims[1:], strict=False):
        if lo < end:
            clash.update((b, c))
    return {b: v for b, v in views.items() if b not in clash}
