"""Verify a committed checkpoint end to end and collect *every* problem (``xla-ckpt verify``).

Unlike :class:`~xla_ckpt.io.reader.CheckpointReader`, which stops at the first
bad byte (a restore must not continue), verification reads every blob of
every item and reports all that is wrong:

* a data file listed in the manifest is missing (``"missing"``: the storage
  says it does not exist for this process, before or while it is read), or
  shorter or longer than the manifest says (``"size"``: it is there with the
  wrong size, or shrank while read; blobs that still lie inside a short file
  are checked);
* the safetensors header of a data file is unreadable (standard tools would
  fail on it, though xla_ckpt itself trusts only the manifest);
* a chunk's crc32c or a blob's whole crc32c differs from the manifest; the
  report names every tensor whose bytes overlap the bad range;
* an item's typed state tree is malformed.

Version-2 checkpoints (chunked tensors) need nothing more: every chunk is a tensor record
of an ordinary ``chunks/<rank>`` item, so its bytes are checked here like any other; a
problem names the chunk (``state['model']['w'][0:3,0:6]``, global key and box); the
chunk table itself was checked when the manifest was parsed.

Blobs are read in chunk-aligned slices of about ``slice_size_bytes`` on the
storage's thread pool (``max_workers`` at a time, so memory stays near
``max_workers * slice_size_bytes``); each slice is checked by the thread that
read it, and the whole-blob crc32c is combined from the slices' values.
Any single process may call it; it touches nothing but reads.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Collection

from xla_ckpt.errors import CheckpointCorruptError, CheckpointNotFoundError
from xla_ckpt.format import typed
from xla_ckpt.format.crc import crc32c, crc32c_chunks, crc32c_combine
from xla_ckpt.format.manifest import BlobRecord, Item, Manifest
from xla_ckpt.format.safetensors_layout import parse_header_length
from xla_ckpt.io.manifest_file import read_manifest
from xla_ckpt.storage import ObjectInfo, Storage

logger = logging.getLogger(__name__)

Progress = Callable[[int], object]  # called with a byte count; what it returns is ignored

# One slice to check: (item name, item, blob index, blob record, blob-relative start, length,
# generation of the data file as stat'ed).
_Task = tuple[str, Item, int, BlobRecord, int, int, int | None]
# What checking one slice found: (crc32c of the slice, blob-relative bad chunk ranges).
_SliceResult = tuple[int, list[tuple[int, int]]]


@dataclass(frozen=True)
class _Failed:
    """A slice that could not be read because its file went away or shrank after the stat."""

    kind: str  # "missing" or "size", as Problem.kind
    detail: str


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint.

    Attributes:
        kind: ``"missing"``, ``"size"``, ``"header"``, ``"crc32c"`` or ``"state"``.
        file: data file name (``""`` for a state problem).
        item: manifest item (``"state"``, ``"rank/00003"``) or ``""``.
        keys: state keys of the tensors affected (empty for file-level problems).
        detail: one line saying what is wrong (byte ranges in bytes, expected vs actual).
    """

    kind: str
    file: str
    item: str
    keys: tuple[str, ...]
    detail: str


@dataclass
class VerifyReport:
    """Result of :func:`verify_checkpoint`; ``ok`` is True when nothing is wrong.

    ``tensors`` counts tensor records (chunks included), ``global_tensors`` the chunked
    tensors of a version-2 manifest (their chunks are verified as the records they are).
    """

    uri: str
    files: int = 0
    blobs: int = 0
    tensors: int = 0
    global_tensors: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bad_keys(self) -> list[str]:
        """Every bad tensor's state key, item-qualified for per-rank items, in report order."""
        out: list[str] = []
        for p in self.problems:
            for k in p.keys:
                name = k if p.item in ("", "state") else f"{p.item}:{k}"
                if name not in out:
                    out.append(name)
        return out


def verify_checkpoint(storage: Storage, manifest: Manifest | None = None, *,
                      progress: Progress | None = None,
                      files: Collection[str] | None = None) -> VerifyReport:
    """Check every byte of the committed checkpoint rooted at ``storage``.

    Args:
        storage: storage rooted at the checkpoint folder.
        manifest: an already-read manifest; read (and validated) when None.
        progress: called with the byte count of each verified slice.
        files: check only these data files (None: every file the manifest lists); a local
            tier's host holds only its own part (:mod:`xla_ckpt.run.local_tier`).

    Returns:
        A :class:`VerifyReport` listing every problem (empty when intact).

    Raises:
        CheckpointNotFoundError / IncompleteCheckpointError: no commit marker.
        CheckpointCorruptError: the manifest itself is malformed.
        StorageError: the backend failed (access, not corruption).
    """
    t0 = time.perf_counter()
    m = manifest if manifest is not None else read_manifest(storage)
    report = VerifyReport(uri=storage.uri, files=len(m.files))
    report.global_tensors = len(m.global_tensors)
    for name, item in m.items.items():
        report.blobs += len(item.blobs)
        report.tensors += len(item.tensors)
        _check_state(name, item, report, len(m.global_tensors) if item.chunked else None)
    sizes = _check_files(storage, m, report, files)
    tasks: list[_Task] = []
    for iname, item in m.items.items():
        for b, rec in enumerate(item.blobs):
            actual = sizes.get(rec.file)
            if actual is None:
                continue
            if rec.offset + rec.length > actual.size:
                report.problems.append(Problem(
                    "size", rec.file, iname, _keys(item, b),
                    f"bytes [{rec.offset}, {rec.offset + rec.length}) lie beyond the end of the "
                    f"{actual.size}-byte file (truncated)"))
                continue
            tasks.extend((iname, item, b, rec, start, n, actual.generation)
                         for start, n in _slices(rec, storage.config.slice_size_bytes))
    results = _run(storage, tasks, progress)
    report.bytes_read = sum(n for (_i, _it, _b, _r, _s, n, _g), res in zip(tasks, results,
                                                                          strict=True)
                            if not isinstance(res, _Failed))
    _judge(m, tasks, results, report)
    report.seconds = time.perf_counter() - t0
    logger.debug("verified %s: %d blobs, %d bytes in %.3f s (%.1f MiB/s), %d problems",
                 storage.uri, report.blobs, report.bytes_read, report.seconds,
                 report.bytes_read / max(report.seconds, 1e-9) / 2**20, len(report.problems))
    return report


def _keys(item: Item, blob: int, lo: int | None = None, hi: int | None = None) -> tuple[str, ...]:
    """Keys of tensors viewing blob ``blob`` (only those overlapping ``[lo, hi)`` if given)."""
    out = []
    for t in item.tensors:
        if t.blob != blob:
            continue
        if lo is not None and hi is not None:
            span = t.span_bytes()
            if not (t.byte_offset < hi and lo < t.byte_offset + span):
                continue
        out.append(t.key)
    return tuple(out) or (f"<blob {blob}: bytes no tensor views>",)


def _check_state(name: str, item: Item, report: VerifyReport, n_global: int | None) -> None:
    """A chunked item's ``{"$tensor": g}`` index the manifest's ``n_global`` global tensors."""
    n = len(item.tensors) if n_global is None else n_global
    what = "tensor" if n_global is None else "global tensor"

    def lookup(i: int) -> None:
        if not 0 <= i < n:
            raise CheckpointCorruptError(f"typed state refers to {what} {i} but only {n} exist")

    try:
        typed.decode(item.state, lookup)
    except CheckpointCorruptError as e:
        report.problems.append(Problem("state", "", name, (), str(e)))


def _check_files(storage: Storage, m: Manifest, report: VerifyReport,
                 only: Collection[str] | None = None) -> dict[str, ObjectInfo]:
    sizes: dict[str, ObjectInfo] = {}
    by_file: dict[str, list[tuple[str, Item, int]]] = {}
    for iname, item in m.items.items():
        for b, rec in enumerate(item.blobs):
            by_file.setdefault(rec.file, []).append((iname, item, b))
    for name, expected in m.files.items():
        if only is not None and name not in only:
            continue
        users = by_file.get(name, [])
        try:
            info = storage.stat(name)
        except CheckpointNotFoundError:
            missing = (f"data file is missing (expected {expected} bytes): the committed "
                       "manifest lists it, but the storage says it does not exist for this "
                       "process")
            if not users:  # a listed file no blob lives in: one problem for the file itself
                report.problems.append(Problem("missing", name, "", (), missing))
            for iname, item, b in users:
                report.problems.append(Problem("missing", name, iname, _keys(item, b), missing))
            continue
        sizes[name] = info
        if info.size != expected:
            report.problems.append(Problem(
                "size", name, "", (),
                f"expected {expected} bytes, found {info.size} bytes "
                f"({'truncated' if info.size < expected else 'extra bytes'})"))
        _check_header(storage, name, info, report)
    return sizes


def _check_header(storage: Storage, name: str, info: ObjectInfo, report: VerifyReport) -> None:
    where = storage.url(name)
    try:
        prefix = bytearray(min(8, info.size))
        if prefix:
            storage.read_range(name, 0, memoryview(prefix), info.generation)
        n = parse_header_length(bytes(prefix), where=where, file_size=info.size)
        body = bytearray(n)
        storage.read_range(name, 8, memoryview(body), info.generation)
        doc = json.loads(body.decode("utf-8"))
        if not isinstance(doc, dict):
            raise ValueError("header is not a JSON object")
    except CheckpointNotFoundError as e:  # there at the stat, gone (or replaced) at the read
        report.problems.append(Problem("missing", name, "", (),
                                       f"data file vanished while being verified: {e}"))
    except (CheckpointCorruptError, ValueError, UnicodeDecodeError, RecursionError) as e:
        report.problems.append(Problem("header", name, "", (),
                                       f"safetensors header unreadable: {e}"))


def _slices(rec: BlobRecord, slice_size: int) -> list[tuple[int, int]]:
    """(start, length) of blob-relative slices, each a whole number of chunks."""
    if rec.length == 0:
        return []
    step = max(rec.chunk_size, slice_size // rec.chunk_size * rec.chunk_size)
    return [(s, min(step, rec.length - s)) for s in range(0, rec.length, step)]


def _check_slice(storage: Storage, rec: BlobRecord, start: int, n: int,
                 generation: int | None) -> _SliceResult:
    """(crc32c of the slice, blob-relative bad chunk ranges)."""
    buf = bytearray(n)
    view = memoryview(buf)
    storage.read_range(rec.file, rec.offset + start, view, generation)
    bad: list[tuple[int, int]] = []
    if rec.chunk_crc32c:
        c = rec.chunk_size
        for off in range(0, n, c):
            part = view[off:off + c]
            if crc32c(part) != rec.chunk_crc32c[(start + off) // c]:
                bad.append((start + off, start + off + len(part)))
    return crc32c(view), bad


def _run(storage: Storage, tasks: list[_Task], progress: Progress | None) -> list:
    results: list = [None] * len(tasks)

    def one(i: int) -> tuple[int, _SliceResult | _Failed]:
        _iname, _item, _b, rec, start, n, gen = tasks[i]
        try:
            return i, _check_slice(storage, rec, start, n, gen)
        except CheckpointNotFoundError as e:  # deleted, or its generation replaced, since stat
            return i, _Failed("missing", f"data file vanished while being verified: {e}")
        except CheckpointCorruptError as e:  # shorter than at the stat
            return i, _Failed("size", f"data file shrank while being verified: {e}")

    if not tasks:
        return results
    pool = storage._executor()
    futures = [pool.submit(one, i) for i in range(len(tasks))]
    try:
        for f in cf.as_completed(futures):
            i, res = f.result()
            results[i] = res
            if progress:
                progress(tasks[i][5])
    except BaseException:
        for f in futures:
            f.cancel()
        cf.wait(futures)
        raise
    return results


def _judge(m: Manifest, tasks: list[_Task], results: list, report: VerifyReport) -> None:
    per_blob: dict[tuple[str, int], list[tuple[int, int, int, list]]] = {}
    failed: dict[tuple[str, int], _Failed] = {}
    for (iname, _item, b, _rec, start, n, _g), res in zip(tasks, results, strict=True):
        if isinstance(res, _Failed):
            failed.setdefault((iname, b), res)  # one problem per blob, the first slice's
            continue
        crc, bad = res
        per_blob.setdefault((iname, b), []).append((start, n, crc, bad))
    for (iname, b), f in failed.items():
        item = m.items[iname]
        report.problems.append(Problem(f.kind, item.blobs[b].file, iname, _keys(item, b),
                                       f.detail))
    for (iname, b), parts in per_blob.items():
        if (iname, b) in failed:
            continue  # part of the blob was never read: its crc32c says nothing
        item = m.items[iname]
        rec = item.blobs[b]
        parts.sort()
        whole = 0
        bad_ranges: list[tuple[int, int]] = []
        for i, (_start, n, crc, bad) in enumerate(parts):
            whole = crc if i == 0 else crc32c_combine(whole, crc, n)
            bad_ranges.extend(bad)
        for lo, hi in _merge(bad_ranges):
            report.problems.append(Problem(
                "crc32c", rec.file, iname, _keys(item, b, lo, hi),
                f"crc32c mismatch in bytes [{rec.offset + lo}, {rec.offset + hi})"))
        if whole != rec.crc32c and not bad_ranges:
            detail = (f"crc32c of bytes [{rec.offset}, {rec.offset + rec.length}) is "
                      f"{whole:#010x}, "
                      f"manifest says {rec.crc32c:#010x}")
            report.problems.append(Problem("crc32c", rec.file, iname, _keys(item, b), detail))


def check_file_bytes(m: Manifest, name: str, data: memoryview) -> list[Problem]:
    """Every blob of data file ``name`` against its crc32c records, from the file's bytes
    ``data`` already in memory (a replica received over the data plane: checked where it
    landed, not read back); the same problems :func:`verify_checkpoint` reports for them
    (size, crc32c with the bad byte ranges and the tensors there).  The safetensors header is
    not checked (nothing reads tensors through it)."""
    problems: list[Problem] = []
    want = m.files.get(name)
    if want is not None and want != len(data):
        problems.append(Problem("size", name, "", (), f"expected {want} bytes, found "
                                f"{len(data)} bytes"))
    for iname, item in m.items.items():
        for b, rec in enumerate(item.blobs):
            if rec.file != name:
                continue
            if rec.offset + rec.length > len(data):
                problems.append(Problem(
                    "size", name, iname, _keys(item, b),
                    f"bytes [{rec.offset}, {rec.offset + rec.length}) lie beyond the end of "
                    f"the {len(data)}-byte file (truncated)"))
                continue
            blob = data[rec.offset:rec.offset + rec.length]
            bad: list[tuple[int, int]] = []
            if rec.chunk_crc32c and rec.length:
                whole, chunks = crc32c_chunks(blob, rec.chunk_size)
                for k, (got, expect) in enumerate(zip(chunks, rec.chunk_crc32c, strict=False)):
                    if got != expect:
                        bad.append((k * rec.chunk_size,
                                    min((k + 1) * rec.chunk_size, rec.length)))
            else:
                whole = crc32c(blob)
            for lo, hi in _merge(bad):
                problems.append(Problem(
                    "crc32c", name, iname, _keys(item, b, lo, hi),
                    f"crc32c mismatch in bytes [{rec.offset + lo}, {rec.offset + hi})"))
            if whole != rec.crc32c and not bad:
                problems.append(Problem(
                    "crc32c", name, iname, _keys(item, b),
                    f"crc32c of bytes [{rec.offset}, {rec.offset + rec.length}) is "
                    f"{whole:#010x}, manifest says {rec.crc32c:#010x}"))
    return problems


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(hi, out[-1][1]))
        else:
            out.append((lo, hi))
    return out
