"""Write checkpoints: data files first, the manifest (commit marker) last.

Single writer::

    write_checkpoint(state, "gs://bucket/run/checkpoint_10")   # what xla_ckpt.save runs

Several writers (each rank writes its own items, one coordinator commits)::

    mine = write_items(storage, save_id, [(rank_item(rank), rank_state)])  # every rank
    parts = exchange(mine)                                                # dist layer
    commit(storage, save_id, parts, metadata=..., world_size=...)         # coordinator only

One writer's items share one data file (one object, one fsync); the manifest names
each blob's file and byte range, so checkpoints with one file per item (what earlier
versions wrote) load the same.  Each byte goes out in one pass: a helper thread
crc32c-checksums every chunk just ahead of the storage write (no separate checksum
pass, no copy of the state), and the local backend writes in large sequential writes
while write-back of what it already wrote runs (:mod:`xla_ckpt.storage.local`).
Durability is unchanged: every data file is fsynced and renamed before the manifest
is written, the manifest is fsynced, renamed, and its folder fsynced.

Data file names carry the save id, so saving over an existing checkpoint never
touches the bytes its committed manifest points at; files of the replaced save
are deleted only after the new manifest has committed.

**The commit marker is a conditional write.**  :func:`commit` passes
``if_generation_match`` to the store: the manager creates its manifests with ``0``
(create only; see :mod:`xla_ckpt.run.fencing`), so a committed checkpoint is never
replaced by a stale writer; :func:`write_checkpoint` replaces an existing checkpoint only if its
manifest is still the generation it saw when it started (compare-and-swap), so of two
concurrent saves to one path exactly one commits and the other raises.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Generator, Iterable, Mapping, Sequence, overload

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    PreconditionFailedError,
    StorageNotSharedError,
)
from xla_ckpt.format import typed
from xla_ckpt.format.chunks import GlobalTensor
from xla_ckpt.format.crc import crc32c
from xla_ckpt.format.gc_pause import gc_paused
from xla_ckpt.format.manifest import (
    CHUNKED_FORMAT_VERSION,
    DEFAULT_CHUNK_SIZE_BYTES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    STATE_ITEM,
    Item,
    Manifest,
    check_global_tensors,
    rank_item,
)
from xla_ckpt.format.plan import ItemPlan, PlannedBlob, blob_pieces, blob_record, plan_item
from xla_ckpt.format.safetensors_layout import build_header
from xla_ckpt.io.manifest_file import order_metadata
from xla_ckpt.io.names import DATA_PREFIX
from xla_ckpt.storage import Storage, StorageConfig, open_storage
from xla_ckpt.storage.local import LocalStorage

logger = logging.getLogger(__name__)


def new_save_id() -> str:
    """A fresh save id (12 hex digits); data file names carry it."""
    return uuid.uuid4().hex[:12]


def data_file_name(save_id: str, item_name: str) -> str:
    slug = item_name.replace("/", "-")
    return f"{DATA_PREFIX}{save_id}-{slug}.safetensors"


@dataclass
class WrittenItem:
    """One writer's contribution to a checkpoint (small; safe to send to the coordinator)."""

    name: str
    item: Item
    files: dict[str, int]

    def to_json(self) -> dict:
        """``{"name", "item", "files"}``: plain JSON values (:meth:`from_json` undoes it)."""
        return {"name": self.name, "item": self.item.to_json(), "files": self.files}

    @classmethod
    def from_json(cls, doc: Any, *, rank: int | None = None, save_id: str = "") -> "WrittenItem":
        """Rebuild (and validate) a written item from its :meth:`to_json` document.

        ``doc`` came from another rank (``rank``, named in errors); it is checked as a
        manifest's item is (:meth:`~xla_ckpt.format.manifest.Manifest.from_json_bytes`:
        file names, byte ranges inside their files, dtypes, shapes, the typed tree), so a
        commit never writes a manifest readers would refuse.  ``save_id``: the save it
        belongs to (for the check only).

        Raises:
            CheckpointCorruptError: ``doc`` is not such a document; the message names the
                rank, the item and the field (``item 'rank/00001' written by rank 1: 'files'
                must be an object``).
        """
        who = f"written by rank {rank}" if rank is not None else "written by a writer"
        if not isinstance(doc, dict):
            raise CheckpointCorruptError(f"item document {who} must be an object with 'name', "
                                         f"'item' and 'files', got {type(doc).__name__}")
        name = doc.get("name")
        if not isinstance(name, str) or not name:
            raise CheckpointCorruptError(f"item document {who}: 'name' must be a non-empty "
                                         f"string, got {name!r}")
        where = f"item {name!r} {who}"
        missing = [k for k in ("item", "files") if k not in doc]
        if missing:
            raise CheckpointCorruptError(f"{where}: field {missing[0]!r} is missing")
        if not isinstance(doc["item"], dict):
            raise CheckpointCorruptError(f"{where}: 'item' must be an object, got "
                                         f"{type(doc['item']).__name__}")
        if not isinstance(doc["files"], dict):
            raise CheckpointCorruptError(f"{where}: 'files' must be an object, got "
                                         f"{type(doc['files']).__name__}")
        version = CHUNKED_FORMAT_VERSION if doc["item"].get("chunked") else FORMAT_VERSION
        wrapped = {"format": FORMAT_NAME, "version": version, "save_id": save_id,
                   "files": doc["files"], "items": {name: doc["item"]}}
        try:
            body = json.dumps(wrapped, allow_nan=False).encode("utf-8")
        except (TypeError, ValueError) as e:
            raise CheckpointCorruptError(f"{where}: not plain JSON ({e})") from None
        m = Manifest.from_json_bytes(body, where=f"the items {who}:")
        return cls(name, m.items[name], dict(m.files))


CHECKSUM_AHEAD_BYTES = 16 * 1024 * 1024
"""How far (bytes) the checksum thread of :func:`write_items` may run ahead of the storage
write: far enough to keep both busy, near enough that the bytes are still in cache when the
write copies them."""


class _ChecksummedPieces(Sequence[memoryview]):
    """The pieces of one data file, each crc32c-checksummed before storage is handed it.

    ``pieces[i]`` is checksummed (unless ``check[i]`` is false: the header) by the time
    ``self[i]`` returns, so every byte the storage writes was checksummed as it was then.
    Iterating runs the checksums on one helper thread up to :data:`CHECKSUM_AHEAD_BYTES`
    ahead of the consumer (the native crc32c releases the GIL), so checksumming overlaps
    the write instead of adding a pass over the state; indexing computes a missing value
    on the caller's thread.  :meth:`crcs` gives every value (computing what the consumer
    never touched).
    """

    def __init__(self, pieces: list[memoryview], check: list[bool],
                 progress: Callable[[int], object] | None = None) -> None:
        self._pieces = pieces
        self._check = check
        self._crcs: list[int | None] = [None] * len(pieces)
        self._lock = threading.Lock()
        self._progress = progress
        self._handed = [False] * len(pieces) if progress is not None else []

    def __len__(self) -> int:
        return len(self._pieces)

    @overload
    def __getitem__(self, i: int) -> memoryview: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[memoryview]: ...

    def __getitem__(self, i: int | slice) -> memoryview | Sequence[memoryview]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        self._ensure(i)
        if self._progress is not None and not self._handed[i]:
            self._handed[i] = True  # each piece counted once, however often storage asks
            self._progress(len(self._pieces[i]))
        return self._pieces[i]

    def _ensure(self, i: int) -> None:
        if self._check[i] and self._crcs[i] is None:
            value = crc32c(self._pieces[i])
            with self._lock:
                self._crcs[i] = value

    def _batches(self) -> list[range]:
        """Runs of consecutive pieces of about 1 MiB or more each (one task per run)."""
        out: list[range] = []
        start, acc = 0, 0
        for i, p in enumerate(self._pieces):
            acc += len(p)
            if acc >= 2**20:
                out.append(range(start, i + 1))
                start, acc = i + 1, 0
        if start < len(self._pieces):
            out.append(range(start, len(self._pieces)))
        return out

    def _run(self, batch: range) -> None:
        for i in batch:
            self._ensure(i)

    def __iter__(self) -> Generator[memoryview, None, None]:
        batches = self._batches()
        if len(batches) < 2:
            for i in range(len(self)):
                yield self[i]
            return
        sizes = [sum(len(self._pieces[j]) for j in b) for b in batches]
        with ThreadPoolExecutor(1, thread_name_prefix="xla_ckpt-crc32c") as pool:
            pending: deque[Future[None]] = deque()
            nxt = 0
            ahead = 0  # bytes submitted to the checksum thread and not yet handed out
            try:
                for k, batch in enumerate(batches):
                    while nxt < len(batches) and (nxt <= k or ahead < CHECKSUM_AHEAD_BYTES):
                        pending.append(pool.submit(self._run, batches[nxt]))
                        ahead += sizes[nxt]
                        nxt += 1
                    pending.popleft().result()
                    ahead -= sizes[k]
                    for i in batch:
                        yield self[i]
            finally:
                for fut in pending:
                    fut.cancel()

    def crcs(self, start: int, stop: int) -> list[int]:
        """crc32c of pieces ``[start, stop)`` (each computed now if it was not yet)."""
        out = []
        for i in range(start, stop):
            self._ensure(i)
            value = self._crcs[i]
            assert value is not None  # _ensure filled it
            out.append(value)
        return out


def write_items(storage: Storage, save_id: str, items: Sequence[tuple[str, Any]], *,
                chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES,
                progress: Callable[[int], object] | None = None) -> list[WrittenItem]:
    """Write several items of one writer as one safetensors-layout data file (atomically).

    The items' blobs lie one after another in one file named after the first item
    (``data-<save id>-<item>.safetensors``), so a writer saving its replicated state and
    its ``rank/<r>`` item makes one object (one upload, one fsync), not one per item; the
    manifest records each blob's file and byte range as before (format unchanged).
    Each byte is read once on the way out: a helper thread crc32c-checksums each chunk
    of ``chunk_size_bytes`` just ahead of the storage write (see :class:`_ChecksummedPieces`),
    and the blob's whole crc32c is combined from its chunks.

    Any rank may call this for the items it owns.  Nothing is committed until
    :func:`commit` writes the manifest.  Tensors are read from their memory while the
    write runs: the caller must not change them until it returns (the async save path
    passes a staged copy, :mod:`xla_ckpt.manager.staging`).

    Args:
        items: ``(item name, state)`` pairs, at least one, names unique.
        progress: called with the bytes of each piece as it is handed to the storage
            (each piece once), e.g. a progress bar's ``update``.

    Returns:
        One :class:`WrittenItem` per item, in order (every one lists the shared file).

    Raises:
        ValueError: no items, or a name given twice.
        MetaTensorError, UnsupportedTypeError: a state cannot be saved (names the key).
        StorageError: the backend failed.
    """
    t0 = time.perf_counter()
    fp = plan_file(save_id, items, chunk_size_bytes=chunk_size_bytes)
    written = write_planned(storage, fp, progress=progress)
    dt = time.perf_counter() - t0
    size = written[0].files[fp.fname]
    logger.debug("wrote %s (%d bytes, items %s) in %.3f s (%.1f MiB/s)", storage.url(fp.fname),
                 size, fp.names, dt, size / max(dt, 1e-9) / 2**20)
    return written


@dataclass
class FilePlan:
    """One data file laid out before any byte is written: what :func:`plan_file` returns.

    ``labelled``: every item's blobs in file order (``data``: the bytes to write, a
    contiguous uint8 tensor; on a device when planned with ``to_host=False``); ``offsets``:
    each blob's absolute byte offset in the file; ``header``: the safetensors header (with
    its 8-byte length prefix) that opens the file.
    """

    fname: str
    names: list[str]
    plans: list[ItemPlan]
    labelled: list[PlannedBlob]
    header: bytes
    offsets: list[int]
    chunk_size_bytes: int

    @property
    def size(self) -> int:
        """Bytes of the whole file."""
        return len(self.header) + sum(b.data.numel() for b in self.labelled)

    def pieces(self) -> tuple[list[memoryview], list[tuple[int, int]]]:
        """The file's bytes in order (header, then each blob cut at its crc32c chunks), and
        each blob's ``[first, stop)`` in that list.  The blobs' ``data`` must be on the host."""
        pieces: list[memoryview] = [memoryview(self.header)]
        spans: list[tuple[int, int]] = []
        for b in self.labelled:
            first = len(pieces)
            pieces.extend(blob_pieces(b, self.chunk_size_bytes))
            spans.append((first, len(pieces)))
        return pieces, spans

    def written(self, size: int, piece_crcs: Callable[[int, int], list[int]],
                spans: Sequence[tuple[int, int]]) -> list[WrittenItem]:
        """The :class:`WrittenItem` of each item once the file holds ``size`` bytes;
        ``piece_crcs(lo, hi)``: the crc32c of pieces ``[lo, hi)`` of :meth:`pieces`."""
        out: list[WrittenItem] = []
        k = 0
        with gc_paused():
            for name, plan in zip(self.names, self.plans, strict=True):
                blobs = []
                for b in plan.blobs:
                    lo, hi = spans[k]
                    blobs.append(blob_record(b, self.fname, self.offsets[k],
                                             self.chunk_size_bytes, piece_crcs=piece_crcs(lo, hi)))
                    k += 1
                out.append(WrittenItem(name, Item(state=plan.state, tensors=plan.tensors,
                                                  blobs=blobs), {self.fname: size}))
        return out


def plan_file(save_id: str, items: Sequence[tuple[str, Any]], *,
              chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES, to_host: bool = True) -> FilePlan:
    """Lay out ``items`` (``(item name, state)`` pairs, names unique) as one data file named
    after the first item; nothing is written.  The typed encoding of each state is done
    here (non-tensor values are frozen now).  ``to_host=False`` leaves CUDA and CPU tensors
    where they are (the blobs are views of their storage: a caller copies them into the
    file's pages, :mod:`xla_ckpt.io.mapped_writer`); XLA tensors come to the host either way.

    Raises:
        ValueError: no items, or a name given twice.
        MetaTensorError, UnsupportedTypeError: a state cannot be saved (names the key).
    """
    names = [n for n, _ in items]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"write_items needs at least one item and unique names, got {names}")
    with gc_paused():  # CPU-bound planning; not held over the write (async saves run it)
        plans = [plan_item(state, chunk_size_bytes=chunk_size_bytes, to_host=to_host)
                 for _, state in items]
        fname = data_file_name(save_id, names[0])
        labelled: list[PlannedBlob] = []
        for (name, _), plan in zip(items, plans, strict=True):
            prefix = "" if len(items) == 1 or name == STATE_ITEM else f"{name}/"
            labelled.extend(replace(b, name=prefix + b.name) if prefix else b
                            for b in plan.blobs)
        meta = {"format": "pt", "xla_ckpt_save_id": save_id, "xla_ckpt_item": names[0]}
        if len(items) > 1:
            meta["xla_ckpt_items"] = ",".join(names)
        header, offsets = build_header(labelled, meta)
    return FilePlan(fname, names, plans, labelled, header, offsets, chunk_size_bytes)


def write_planned(storage: Storage, fp: FilePlan, *,
                  progress: Callable[[int], object] | None = None) -> list[WrittenItem]:
    """Write the data file ``fp`` (blobs on the host) atomically, each piece crc32c-checked
    just ahead of the write (:class:`_ChecksummedPieces`); one :class:`WrittenItem` per item.

    Raises:
        StorageError: the backend failed.
    """
    pieces, spans = fp.pieces()
    stream = _ChecksummedPieces(pieces, [False] + [True] * (len(pieces) - 1), progress)
    info = storage.write_atomic(fp.fname, stream)
    return fp.written(info.size, stream.crcs, spans)


def write_item(storage: Storage, save_id: str, item_name: str, state: Any, *,
               chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES) -> WrittenItem:
    """Write one item's tensors as one safetensors-layout data file (atomically).

    Any rank may call this for the item it owns.  Nothing is committed until
    :func:`commit` writes the manifest.  :func:`write_items` with one item.

    Raises:
        MetaTensorError, UnsupportedTypeError: the state cannot be saved (names the key).
        StorageError: the backend failed.
    """
    return write_items(storage, save_id, [(item_name, state)],
                       chunk_size_bytes=chunk_size_bytes)[0]


@gc_paused()  # many small objects, no cycles (CASES C26)
def commit(storage: Storage, save_id: str, parts: Iterable[WrittenItem], *,
           metadata: Any = None, world_size: int | None = None,
           cleanup: bool = True, if_generation_match: int | None = None,
           global_tensors: Sequence[GlobalTensor] = (), check_files: bool = True) -> Manifest:
    """Write the manifest (the commit marker) for ``parts``; called by one rank only.

    ``if_generation_match`` goes to the manifest write (``None``: replace whatever is
    there; ``0``: create only; ``N``: replace only generation ``N``).  After the manifest
    is in place, data files of earlier saves in the same folder (``data-<other id>-*``)
    are deleted when ``cleanup`` is true (see :func:`remove_other_data_files`).

    ``global_tensors`` (sharded state, :mod:`xla_ckpt.format.chunks`): the chunk tables of
    the global tensors that chunked items (``Item(chunked=True)``, ``{"$tensor": g}`` =
    ``global_tensors[g]``) refer to; each chunk names a tensor record of one of ``parts``
    (``chunks/<rank>`` items).  With any, the manifest is version 2, and its chunk tables
    get the readers' checks before it is written
    (:func:`~xla_ckpt.format.manifest.check_global_tensors`), so a table readers would
    refuse (a gap, an overlap, a record of the wrong dtype or shape) is never committed.
    Without, the manifest is version 1, byte for byte what earlier versions wrote.

    Before the manifest is written, every data file the parts list is checked to be there
    for this process with the size its writer reported (one ``stat`` per file, in parallel
    for several files; :func:`check_files_visible`): a file another rank wrote to storage
    this process does not share (a node-local path on another host, another folder) is
    never committed as if it were part of the checkpoint.  ``check_files=False`` skips it:
    a host's local-tier copy (:mod:`xla_ckpt.run.local_tier`) holds only its own files.

    Raises:
        PreconditionFailedError: the condition did not hold; nothing was committed.
        StorageNotSharedError: a data file of ``parts`` is missing here or has another size
            than its writer reported (names the file and the rank that wrote it); nothing
            was committed.
        ValueError: the chunk table does not describe the parts (names the global
            tensor and what is wrong); nothing was committed.
    """
    items: dict[str, Item] = {}
    files: dict[str, int] = {}
    writers: dict[str, int | None] = {}
    for p in parts:
        items[p.name] = p.item
        files.update(p.files)
        rank = writer_rank(p.name)
        for f in p.files:
            if writers.get(f) is None:
                writers[f] = rank
    manifest = Manifest(save_id=save_id, items=items, files=files,
                        metadata=typed.encode(metadata) if metadata is not None else None,
                        world_size=world_size, created_unix_s=time.time(),
                        global_tensors=list(global_tensors))
    if manifest.written_version != FORMAT_VERSION:
        try:
            manifest.global_tensors = check_global_tensors(
                manifest, where=f"manifest of save {save_id}")
        except CheckpointCorruptError as e:
            raise ValueError(f"{storage.uri}: not committed: the manifest would not be "
                             f"readable: {e}") from None
        manifest.version = manifest.written_version
    if check_files:
        check_files_visible(storage, files, writers)
    body = [manifest.to_json_bytes()]
    order = order_metadata(manifest)  # what the run folder's catalog orders by, unread
    if if_generation_match is None:
        storage.write_atomic(MANIFEST_NAME, body, metadata=order)
    else:
        storage.write_atomic(MANIFEST_NAME, body, if_generation_match=if_generation_match,
                             metadata=order)
    if cleanup:
        remove_other_data_files(storage, files)
    return manifest


_WRITER_ITEM_RE = re.compile(r"(?:rank|chunks|shard)/(\d+)")

#: At most this many files are named in a :class:`StorageNotSharedError` message.
MAX_LISTED_FILES = 8


def writer_rank(item_name: str) -> int | None:
    """The rank that writes item ``item_name`` (``rank/<r>``, ``chunks/<r>``, ``shard/<r>``),
    or None for an item no rank is named in (``state``)."""
    m = _WRITER_ITEM_RE.fullmatch(item_name)
    return int(m.group(1)) if m else None


def check_files_visible(storage: Storage, files: Mapping[str, int],
                        writers: Mapping[str, int | None] | None = None) -> None:
    """Check that every data file of ``files`` (name -> size in bytes its writer reported) is
    in ``storage`` for this process, with that size.

    One ``stat`` per file (a metadata GET on gs://, several at once on a small thread pool; a
    local ``stat`` syscall each, in turn); called by
    :func:`commit` right before the manifest is written.  ``writers``: file -> the rank that
    wrote it (None: not known), for the message.

    Raises:
        StorageNotSharedError: some file is missing or has another size (names up to
            :data:`MAX_LISTED_FILES` of them with their writers and sizes, and says the
            storage must be one every rank shares).
        StorageError: a ``stat`` failed for another reason (permissions, the service).
    """
    if not files:
        return
    names = sorted(files)

    def look(name: str) -> int | None:
        try:
            return storage.stat(name).size
        except CheckpointNotFoundError:
            return None

    if len(names) == 1 or isinstance(storage, LocalStorage):  # a stat is a syscall: ~10 us
        sizes = [look(n) for n in names]
    else:
        with ThreadPoolExecutor(min(len(names), storage.config.max_workers),
                                thread_name_prefix="xla_ckpt-stat") as pool:
            sizes = list(pool.map(look, names))
    writers = writers or {}
    bad: list[str] = []
    first: tuple[str, int | None] | None = None
    for name, size in zip(names, sizes, strict=True):
        want = files[name]
        if size == want:
            continue
        rank = writers.get(name)
        who = f"written by rank {rank}" if rank is not None else "written"
        seen = "not found" if size is None else f"has {size} bytes"
        bad.append(f"{name} ({who}, {want} bytes): {seen}")
        if first is None:
            first = (name, rank)
    if first is None:
        return
    shown = "; ".join(bad[:MAX_LISTED_FILES]) + (
        f" (+{len(bad) - MAX_LISTED_FILES} more)" if len(bad) > MAX_LISTED_FILES else "")
    raise StorageNotSharedError(
        f"{storage.uri}: not committed: {len(bad)} of {len(names)} data files are not there "
        f"as their writers wrote them, for the committing process: {shown}. Every rank must "
        "write to storage the committing rank (rank 0) reads too: one folder shared by all "
        "hosts (a shared filesystem, not a node-local path such as /tmp) or gs://, and the "
        "same uri on every rank; or the file was deleted meanwhile. Nothing was committed",
        path=storage.url(first[0]), rank=first[1], checkpoint=storage.uri)


def remove_other_data_files(storage: Storage, keep: Iterable[str]) -> int:
    """Delete the data files at the top of ``storage`` (a checkpoint folder) not in ``keep``.

    What a commit does once its manifest landed: files of the save it replaced, and of
    saves into that folder that never committed.  Returns how many were deleted.
    """
    keep = set(keep)
    n = 0
    for name in storage.list(""):
        if "/" not in name and name.startswith(DATA_PREFIX) and name not in keep:
            storage.delete(name)
            n += 1
    return n


def discard(storage: Storage, save_id: str) -> None:
    """Best-effort removal of the data files of an uncommitted save ``save_id``."""
    try:
        for name in storage.list(""):
            if "/" not in name and name.startswith(f"{DATA_PREFIX}{save_id}-"):
                storage.delete(name)
    except Exception as e:  # noqa: BLE001 - cleanup must not mask the original error
        logger.warning("could not remove stray data files of save %s under %s: %s", save_id,
                       storage.uri, e)


@gc_paused()  # many small objects, no cycles (CASES C26)
def write_checkpoint(state: Any, uri: str, *, metadata: Any = None,
                     rank_states: Mapping[int, Any] | None = None,
                     config: StorageConfig | None = None, storage: Storage | None = None,
                     progress: Callable[[int], object] | None = None) -> Manifest:
    """One process writes and commits the whole checkpoint at ``uri``, atomically.

    The single-process half of :func:`xla_ckpt.api.save` (which sends a sharded state to
    :func:`xla_ckpt.restore.save_distributed` instead); the arguments, the compare-and-swap
    on the manifest's generation and the errors are that function's.  ``state`` holds no
    sharded tensor (a DTensor or an SPMD-sharded XLA tensor is written whole as a plain
    tensor by no one: pass it through :func:`xla_ckpt.api.save`).
    """
    own = storage is None
    st = storage or open_storage(uri, config)
    try:
        # Compare-and-swap on the manifest seen now: a save that committed here meanwhile
        # makes this one fail instead of both silently winning.
        try:
            seen: int | None = st.stat(MANIFEST_NAME).generation
        except CheckpointNotFoundError:
            seen = 0
        save_id = new_save_id()
        try:
            # The files save_distributed writes: one per rank, rank 0's holding the state
            # too (one object, one fsync for a single-process trainer's save).
            ranks = sorted((rank_states or {}).items())
            first = [(rank_item(r), rs) for r, rs in ranks if r == 0]
            parts = write_items(st, save_id, [(STATE_ITEM, state)] + first, progress=progress)
            for r, rs in ranks:
                if r != 0:
                    parts += write_items(st, save_id, [(rank_item(r), rs)], progress=progress)
            try:
                return commit(st, save_id, parts, metadata=metadata, if_generation_match=seen)
            except PreconditionFailedError as e:
                raise PreconditionFailedError(
                    f"{st.uri}: not saved: another save committed this checkpoint after this "
                    f"one started (manifest generation {seen or 'none'} when it started, now "
                    f"{e.actual_generation or 'none'}); this save's data files were removed and "
                    "nothing of it was committed", name=e.name,
                    expected_generation=e.expected_generation,
                    actual_generation=e.actual_generation) from e
        except BaseException:
            discard(st, save_id)
            raise
    finally:
        if own:
            st.close()
