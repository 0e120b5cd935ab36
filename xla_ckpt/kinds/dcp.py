"""PyTorch DCP checkpoints in and out: read by byte range without unrestricted pickle; write by DCP.

A DCP checkpoint is a folder (local or ``gs://``) holding ``.distcp`` data files and the
``.metadata`` commit marker written last (``torch.distributed.checkpoint.FileSystemWriter``).
Keys are DCP's flattened dotted names (``"model.layer.weight"``,
``"optim.state.layer.weight.exp_avg"``, ``"optim.param_groups.0.lr"``).

Read side (any rank, any number of ranks, no collectives: each caller reads what it needs):

* :func:`read_dcp_metadata` -- the ``.metadata`` through the allow-list
  (:mod:`xla_ckpt.format.dcp.metadata`);
* :func:`read_dcp` -- flat ``{key: value}``: full global tensors on CPU assembled from their
  chunks, non-tensor items through ``torch.load(weights_only=True)`` only;
* :func:`read_dcp_into` -- fill existing tensors or DTensors in place; a DTensor target reads
  only the overlap of the saved chunks with its local shard (box overlap, offsets from
  ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, as DCP's own
  planner computes them), and a box of contiguous rows is one byte range;
* :func:`unflatten_dcp_state` -- the nested state from the flat keys (DCP's own
  ``unflatten_state_dict`` with the checkpoint's mapping).

Each chunk's bytes are located inside its ``torch.save`` zip by byte range
(:mod:`xla_ckpt.format.dcp.zip_member`: two small requests for the zip structure, then the
tensor bytes needed, straight into the destination's memory where it is a contiguous CPU
tensor), every object's generation is pinned across its reads, and a chunk read whole is
checked against the zip's CRC-32 (re-read once, then
:class:`~xla_ckpt.errors.IntegrityError`; :class:`~xla_ckpt.errors.PartiallyOverwrittenError`
when the bytes already landed in a live target).  A sub-box read cannot be checked: DCP records
no checksum of parts of a chunk.

Write side: :func:`write_dcp` writes with DCP's own ``dcp.save(..., no_dist=True)`` and
``FileSystemWriter`` into a temporary folder, then uploads each file with
:meth:`Storage.write_atomic`, ``.metadata`` last (it is DCP's commit marker), so
``torch.distributed.checkpoint.load`` reads the result on any world size.
"""

from __future__ import annotations

import concurrent.futures as cf
import difflib
import io
import itertools
import logging
import math
import mmap
import os
import tempfile
import threading
import time
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import torch

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    DataFileMissingError,
    IncompleteCheckpointError,
    IntegrityError,
    MetaTensorError,
    PartiallyOverwrittenError,
    StateMismatchError,
    UnknownKeyError,
    UnsupportedTypeError,
)
from xla_ckpt.format.dcp import (
    METADATA_NAME,
    DcpBytesEntry,
    DcpChunk,
    DcpMetadata,
    DcpTensorEntry,
    TensorMember,
    load_bytes_item,
    load_dcp_metadata,
    locate_tensor_member,
)
from xla_ckpt.format.dtypes import dtype_name, itemsize
from xla_ckpt.storage import ObjectInfo, RangeRead, Storage, StorageConfig, open_storage

logger = logging.getLogger(__name__)

#: A box whose overlap with a chunk needs more byte ranges than this is read as the span of
#: whole rows (dimension 0) it touches, in one request, and sliced in memory.
MAX_RANGES_PER_CHUNK = 16
#: Tensor bytes read into staging buffers before they are copied out (bounds extra memory).
GROUP_BYTES = 256 * 1024 * 1024
#: Chunks located (zip structure fetched, a few KiB each) before their tensor bytes are read.
GROUP_JOBS = 4096


@dataclass
class DcpReadStats:
    """What one :func:`read_dcp` / :func:`read_dcp_into` call fetched from storage.

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


# ---- the open checkpoint -------------------------------------------------------------------


class _Source:
    """A DCP folder opened for reading: its metadata, pinned file versions, counted reads."""

    def __init__(self, uri: str, config: StorageConfig | None, stats: DcpReadStats) -> None:
        self.uri = uri
        self.stats = stats
        self.storage: Storage = open_storage(uri, config)
        self._files: dict[str, ObjectInfo] = {}
        self._lock = threading.Lock()
        try:
            self.metadata = _load_metadata(self.storage, stats)
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

    def read(self, name: str, offset: int, n: int, *, tensor: bool = False) -> bytes:
        buf = _buffer(n)
        if n:
            info = self._files[name]
            self.storage.read_range(name, offset, _writable(buf), info.generation)
        self.stats.add(n, tensor=tensor)
        return buf.numpy().tobytes()


def _load_metadata(storage: Storage, stats: DcpReadStats) -> DcpMetadata:
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


# ---- public read API -----------------------------------------------------------------------


def is_dcp_checkpoint(storage: Storage) -> bool:
    """True if the folder ``storage`` is rooted at holds a DCP ``.metadata`` (a committed DCP
    checkpoint).  One ``stat``; reads nothing else."""
    return storage.exists(METADATA_NAME)


def read_dcp_metadata(uri: str, *, config: StorageConfig | None = None) -> DcpMetadata:
    """The checked ``.metadata`` of the DCP checkpoint folder at ``uri`` (local or ``gs://``).

    Raises:
        CheckpointNotFoundError: no ``.metadata`` there (IncompleteCheckpointError if
            ``.distcp`` files are there without it).
        UnsafePickleError / CheckpointCorruptError: see
            :func:`xla_ckpt.format.dcp.load_dcp_metadata`.
    """
    storage = open_storage(uri, config)
    try:
        return _load_metadata(storage, DcpReadStats())
    finally:
        storage.close()


def read_dcp(uri: str, *, keys: Iterable[str] | None = None,
             config: StorageConfig | None = None) -> DcpState:
    """Read a DCP checkpoint folder into a flat dict, one process, every byte by range.

    Args:
        uri: the checkpoint folder (local path or ``gs://bucket/prefix``).
        keys: DCP's flattened keys to read (default: all).
        config: storage knobs (parallel requests, slice size, retries).

    Returns:
        ``{key: value}`` in the checkpoint's order, keys as DCP names them: every tensor the
        full global tensor on CPU, in its saved dtype and shape (assembled from all chunks;
        a 0-d tensor such as an optimizer ``step`` stays 0-d); every non-tensor item as
        ``torch.load(weights_only=True)`` gives it.  A :class:`DcpState` (a ``dict``) that
        carries the checkpoint's key mapping: nest it with ``unflatten_dcp_state(flat)``.

    Raises:
        CheckpointNotFoundError / IncompleteCheckpointError: no committed DCP checkpoint.
        UnknownKeyError: a requested key is not in the checkpoint (names it and the closest).
        UnsafePickleError: ``.metadata`` or an item needs a global outside the allow-lists.
        CheckpointCorruptError / DataFileMissingError / IntegrityError: malformed metadata,
            missing or short data files, a zip that is not what the metadata says, a CRC-32
            mismatch (each names the file and key).
    """
    stats = DcpReadStats()
    t0 = time.perf_counter()
    src = _Source(uri, config, stats)
    try:
        md = src.metadata
        wanted = list(md.entries) if keys is None else list(dict.fromkeys(keys))
        _check_known(src, wanted)
        out = DcpState()
        out.mapping = md.mapping
        jobs: list[_Job] = []
        for key in wanted:
            entry = md.entries[key]
            if isinstance(entry, DcpBytesEntry):
                out[key] = _read_bytes_item(src, entry)
                continue
            dest = torch.empty(entry.shape, dtype=entry.dtype)
            out[key] = dest
            jobs.extend(_jobs_for(entry, dest, (0,) * len(entry.shape), live=False))
        _run_jobs(src, jobs)
        stats.keys = len(out)
    finally:
        src.close()
    stats.seconds = time.perf_counter() - t0
    _log_done("read", uri, stats)
    return out


def read_dcp_into(uri: str, targets: Mapping[str, torch.Tensor], *,
                  config: StorageConfig | None = None) -> DcpReadStats:
    """Fill existing tensors (plain or DTensor) in place from a DCP checkpoint folder.

    Called by every rank that holds targets, each for its own (no collectives).  A plain
    tensor must have the saved global shape; a ``DTensor`` must have it as its global shape,
    and only its local shard is filled: this rank reads the overlap of each saved chunk with
    the shard's box (``compute_local_shape_and_global_offset``, as DCP itself uses), and
    only those byte ranges (a box of whole trailing dimensions is one range per chunk).
    Targets may live on any device (bytes are staged on CPU, then copied).

    Args:
        uri: the checkpoint folder (local path or ``gs://``).
        targets: DCP key -> tensor or DTensor to fill; its dtype must equal the saved one
            (never a silent cast, CASES C10).
        config: storage knobs.

    Returns:
        :class:`DcpReadStats` of this call (bytes read by this rank, requests, keys).

    Raises:
        UnknownKeyError: a key the checkpoint does not hold (names the closest).
        StateMismatchError: a key of a non-tensor item, a shape or
            dtype differing from the saved one, a DTensor whose local shard is not one box
            (names the key and what to do).
        MetaTensorError: a target on the meta device (materialise it with ``to_empty`` first).
        CheckpointNotFoundError / UnsafePickleError / CheckpointCorruptError /
            DataFileMissingError / IntegrityError: as :func:`read_dcp`.
        PartiallyOverwrittenError: a chunk read straight into a target failed its CRC-32
            twice; that target now holds the unchecked bytes (names the key).
    """
    stats = DcpReadStats()
    t0 = time.perf_counter()
    src = _Source(uri, config, stats)
    try:
        _check_known(src, list(targets))
        jobs: list[_Job] = []
        for key, target in targets.items():
            entry = src.metadata.entries[key]
            if not isinstance(entry, DcpTensorEntry):
                raise StateMismatchError(f"{src.storage.uri}: key {key!r} is a non-tensor item; "
                                         "read it with read_dcp(uri, keys=[...])")
            local, box_off = _target_box(src, key, entry, target)
            jobs.extend(_jobs_for(entry, local, box_off, live=True))
        _run_jobs(src, jobs)
        stats.keys = len(targets)
    finally:
        src.close()
    stats.seconds = time.perf_counter() - t0
    _log_done("read_into", uri, stats)
    return stats


class DcpState(dict[str, Any]):
    """What :func:`read_dcp` returns: a plain ``dict`` of DCP's flat keys, plus :attr:`mapping`
    (the checkpoint's flat key -> nested path, :attr:`DcpMetadata.mapping`) for
    :func:`unflatten_dcp_state`."""

    mapping: Mapping[str, tuple[str | int, ...]] = {}


def unflatten_dcp_state(flat: Mapping[str, Any],
                        mapping: Mapping[str, tuple[str | int, ...]] | None = None
                        ) -> dict[str, Any]:
    """The nested state of DCP's flat keys (``{"model": {...}, "optim": {"state": ...,
    "param_groups": [...]}}``), by torch's own ``unflatten_state_dict``.

    Args:
        flat: ``{key: value}`` as :func:`read_dcp` returns it.
        mapping: flat key -> path in the nested state; default: the one :func:`read_dcp`
            attached to ``flat`` (:attr:`DcpState.mapping`), else pass
            ``read_dcp_metadata(uri).mapping``.  A key it lacks stays at the top level under
            its flat name (so does every key of a checkpoint whose planner recorded none).

    Returns:
        The nested state.  Dict keys come back as DCP stored them (strings), except the
        ``state`` keys of an optimizer state dict (a mapping with ``state`` and
        ``param_groups`` whose ``params`` are ints), which become the int parameter ids
        ``optimizer.state_dict()`` had (DCP records only their string form).
    """
    from torch.distributed.checkpoint._nested_dict import (  # noqa: PLC0415 - torch.distributed
        unflatten_state_dict,
    )

    if mapping is None:
        mapping = getattr(flat, "mapping", None) or {}
    full = {k: tuple(mapping.get(k, (k,))) for k in flat}
    nested = unflatten_state_dict(dict(flat), full)
    _restore_optimizer_int_keys(nested)
    return nested


def _restore_optimizer_int_keys(obj: Any) -> None:
    """Give every optimizer state dict in ``obj`` back its int parameter-id keys, in place.

    DCP's flattening writes every dict key as a string (``_traverse.traverse_state_dict``:
    ``path + (str(k),)``), and ``.metadata``'s ``planner_data`` records the stringified path,
    so the types are lost on disk; ``dcp.load`` gets them back only because it fills a
    template.  Without one, an ``optimizer.state_dict()`` would come back with ``state`` keys
    ``'0', '1'`` that ``Optimizer.load_state_dict`` keeps as dead entries (the parameters'
    state silently lost).  A mapping with a ``state`` dict and ``param_groups`` whose
    ``params`` are ints is an optimizer state dict: each ``state`` key that is the decimal
    form of one of those ids becomes that int.  Keys that are not (FQN-keyed optimizer state
    such as ``get_optimizer_state_dict`` writes) stay as they are.
    """
    if isinstance(obj, list):
        for v in obj:
            _restore_optimizer_int_keys(v)
        return
    if not isinstance(obj, dict):
        return
    state, groups = obj.get("state"), obj.get("param_groups")
    if isinstance(state, dict) and isinstance(groups, list) and state and all(
            isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
        ids = {pid for g in groups for pid in g["params"]
               if isinstance(pid, int) and not isinstance(pid, bool)}
        if ids and not any(isinstance(k, int) for k in state):
            def as_id(k: Any) -> Any:
                if isinstance(k, str) and k.isdigit() and str(int(k)) == k and int(k) in ids:
                    return int(k)
                return k
            converted = {as_id(k): v for k, v in state.items()}
            state.clear()
            state.update(converted)
    for v in obj.values():
        _restore_optimizer_int_keys(v)


def _check_known(src: _Source, keys: list[str]) -> None:
    missing = [k for k in keys if k not in src.metadata.entries]
    if missing:
        closest = tuple(difflib.get_close_matches(missing[0], list(src.metadata.entries), n=3))
        hint = f"; closest: {', '.join(repr(k) for k in closest)}" if closest else ""
        raise UnknownKeyError(
            f"{src.storage.uri}: key{'s' if len(missing) > 1 else ''} "
            f"{', '.join(repr(k) for k in missing[:10])} not in the DCP checkpoint (it holds "
            f"{len(src.metadata.entries)} keys{hint}); DCP keys are flattened dotted names such "
            "as 'model.layer.weight'", key=missing[0], closest=closest,
            checkpoint=src.storage.uri)


def _read_bytes_item(src: _Source, entry: DcpBytesEntry) -> Any:
    src.check_range(entry.key, entry.file, entry.offset, entry.length)
    data = src.read(entry.file, entry.offset, entry.length)
    return load_bytes_item(data, where=f"{src.storage.url(entry.file)}: key {entry.key!r}")


def _target_box(src: _Source, key: str, entry: DcpTensorEntry, target: torch.Tensor
                ) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(local tensor to fill, its first index in the global tensor)."""
    where = f"{src.storage.uri}: key {key!r}"
    if not isinstance(target, torch.Tensor):
        raise StateMismatchError(f"{where}: target is a {type(target).__name__}, not a tensor")
    if tuple(target.shape) != entry.shape:
        raise StateMismatchError(f"{where}: saved global shape {entry.shape}, target "
                                 f"{tuple(target.shape)}")
    if target.dtype != entry.dtype:
        raise StateMismatchError(f"{where}: saved dtype {dtype_name(entry.dtype)}, target "
                                 f"{dtype_name(target.dtype)}; xla_ckpt never casts silently: "
                                 "build the target in the saved dtype and cast afterwards")
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - torch.distributed

    if isinstance(target, DTensor):
        from torch.distributed.tensor._utils import (  # noqa: PLC0415 - torch.distributed
            compute_local_shape_and_global_offset,
        )

        local = target.to_local()
        shape, offset = compute_local_shape_and_global_offset(
            target.shape, target.device_mesh, target.placements)
        if tuple(local.shape) != tuple(shape):
            raise StateMismatchError(
                f"{where}: the DTensor's local shard has shape {tuple(local.shape)} but its "
                f"placements {target.placements} give a box of {tuple(shape)}; read it with "
                "torch.distributed.checkpoint.load")
        box_off = tuple(int(o) for o in offset)
    else:
        local, box_off = target, (0,) * len(entry.shape)
    if local.device.type == "meta":
        raise MetaTensorError(f"{where}: the target is on the meta device and has no memory to "
                              "fill; materialise it first (module.to_empty(device=...))")
    return local, box_off


# ---- the read plan -------------------------------------------------------------------------


@dataclass
class _Job:
    """One chunk's overlap with one destination box."""

    entry: DcpTensorEntry
    chunk: DcpChunk
    lo: tuple[int, ...]  # overlap, chunk-local index space
    hi: tuple[int, ...]
    dest: torch.Tensor  # the destination view of exactly the overlap's shape
    member: TensorMember | None = None
    pieces: list[tuple[int, bytes]] = field(default_factory=list)  # zip bytes already fetched
    live: bool = False  # dest is the caller's tensor (read_dcp_into), not a fresh one

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(h - lo for lo, h in zip(self.lo, self.hi, strict=True))


def _jobs_for(entry: DcpTensorEntry, dest: torch.Tensor, box_off: tuple[int, ...], *,
              live: bool) -> Iterator[_Job]:
    box_hi = tuple(o + s for o, s in zip(box_off, dest.shape, strict=True))
    for chunk in entry.chunks:
        if not chunk.numel:
            continue
        lo = tuple(max(co, bo) for co, bo in zip(chunk.offsets, box_off, strict=True))
        hi = tuple(min(co + cs, bh)
                   for co, cs, bh in zip(chunk.offsets, chunk.sizes, box_hi, strict=True))
        if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
            continue
        view = dest[tuple(slice(a - b, z - b) for a, z, b in zip(lo, hi, box_off, strict=True))]
        yield _Job(entry, chunk, tuple(a - c for a, c in zip(lo, chunk.offsets, strict=True)),
                   tuple(z - c for z, c in zip(hi, chunk.offsets, strict=True)), view,
                   live=live)


def _run_jobs(src: _Source, jobs: list[_Job]) -> None:
    """Locate and read ``jobs`` in groups of at most :data:`GROUP_BYTES` staged bytes (and
    :data:`GROUP_JOBS` chunks), so staging and zip-structure bytes stay bounded."""
    if not jobs:
        return
    for job in jobs:
        src.check_range(job.entry.key, job.chunk.file, job.chunk.offset, job.chunk.length)
    workers = max(1, min(src.storage.config.max_workers, len(jobs)))
    with cf.ThreadPoolExecutor(workers, thread_name_prefix="xla_ckpt-dcp") as pool:
        group: list[_Job] = []
        size = 0
        for job in jobs:
            group.append(job)
            size += math.prod(job.shape) * itemsize(job.entry.dtype)
            if size >= GROUP_BYTES or len(group) >= GROUP_JOBS:
                _run_group(src, group, pool)
                group, size = [], 0
        _run_group(src, group, pool)


def _run_group(src: _Source, group: list[_Job], pool: cf.ThreadPoolExecutor) -> None:
    if not group:
        return
    list(pool.map(lambda j: _locate(src, j), group))
    _read_group(src, group, pool)
    for job in group:
        job.pieces = []  # zip-structure bytes: no longer needed


def _where(src: _Source, job: _Job) -> str:
    return (f"{src.storage.url(job.chunk.file)}: key {job.entry.key!r} (chunk at offsets "
            f"{job.chunk.offsets}, bytes [{job.chunk.offset}, "
            f"{job.chunk.offset + job.chunk.length}))")


def _locate(src: _Source, job: _Job) -> None:
    def read(off: int, n: int) -> bytes:
        data = src.read(job.chunk.file, job.chunk.offset + off, n)
        job.pieces.append((off, data))
        return data

    job.member = locate_tensor_member(read, job.chunk.length, where=_where(src, job),
                                      dtype=job.entry.dtype, sizes=job.chunk.sizes)


@dataclass
class _Staged:
    job: _Job
    buf: torch.Tensor  # uint8, 1-D: the bytes of ``reads``, in order
    reads: list[tuple[int, int, int]]  # (offset in zip, length, offset in buf)
    rows: bool = False  # buf holds whole rows [lo0, hi0) of the chunk, to be sliced
    whole: bool = False  # buf is the whole member (CRC-32 checkable)
    direct: bool = False  # buf is the destination's own memory: nothing to copy out


def _buffer(nbytes: int) -> torch.Tensor:
    """A staging buffer: a 1-D uint8 CPU tensor (its memory outlives every view of it)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def _writable(buf: torch.Tensor) -> memoryview:
    """A writable byte view of a staging buffer, for the storage layer to read into."""
    return buf.numpy().data.cast("B")


def _plan(job: _Job) -> _Staged:
    m = job.member
    assert m is not None
    item = itemsize(m.dtype)
    sizes, lo, hi = job.chunk.sizes, job.lo, job.hi
    base = m.data_offset + m.storage_offset * item
    if not m.contiguous:  # the member whole, viewed with its strides
        return _Staged(job, _buffer(m.nbytes), [(m.data_offset, m.nbytes, 0)], whole=True)
    nd = len(sizes)
    strides = [math.prod(sizes[d + 1:]) for d in range(nd)]
    if nd == 0:
        runs = [(0, 1)]
    else:
        k = nd - 1
        while k > 0 and lo[k] == 0 and hi[k] == sizes[k]:
            k -= 1
        n_runs = math.prod(hi[d] - lo[d] for d in range(k))
        if n_runs > MAX_RANGES_PER_CHUNK:
            start, n = lo[0] * strides[0], (hi[0] - lo[0]) * strides[0]
            return _Staged(job, _buffer(n * item), [(base + start * item, n * item, 0)],
                           rows=True)
        run_len = (hi[k] - lo[k]) * strides[k]
        runs = []
        for idx in itertools.product(*(range(lo[d], hi[d]) for d in range(k))):
            start = sum(i * strides[d] for d, i in enumerate(idx)) + lo[k] * strides[k]
            runs.append((start, run_len))
    reads, pos = [], 0
    for start, n in runs:
        reads.append((base + start * item, n * item, pos))
        pos += n * item
    whole = pos == m.nbytes and m.storage_offset == 0
    dest = job.dest
    if dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == m.dtype:
        # the box's bytes in row-major order are the destination's memory: read straight in
        return _Staged(job, dest.detach().reshape(-1).view(torch.uint8), reads, whole=whole,
                       direct=True)
    return _Staged(job, _buffer(pos), reads, whole=whole)


def _read_group(src: _Source, group: list[_Job], pool: cf.ThreadPoolExecutor) -> None:
    if not group:
        return
    staged = [_plan(job) for job in group]
    ranges: list[RangeRead] = []
    for st in staged:
        view = _writable(st.buf)
        info = src.file(st.job.chunk.file, st.job.entry.key)
        for off, n, pos in st.reads:
            if not _from_pieces(st.job, off, view[pos:pos + n]):
                ranges.append(RangeRead(st.job.chunk.file, st.job.chunk.offset + off,
                                        view[pos:pos + n], info.generation))
    if ranges:
        src.storage.read_ranges(ranges)
        src.stats.add(sum(len(r.out) for r in ranges), tensor=True, requests=len(ranges))
    list(pool.map(lambda st: _check_crc(src, st), staged))  # zlib releases the GIL
    for st in staged:
        _copy_out(st)


def _from_pieces(job: _Job, off: int, out: memoryview) -> bool:
    """Fill ``out`` from zip bytes fetched while locating the member, if they hold it."""
    for start, data in job.pieces:
        if start <= off and off + len(out) <= start + len(data):
            out[:] = data[off - start:off - start + len(out)]
            return True
    return False


def _check_crc(src: _Source, st: _Staged) -> None:
    m = st.job.member
    if not st.whole or m is None or zlib.crc32(_writable(st.buf)) == m.crc32:
        return
    logger.warning("%s: CRC-32 mismatch, reading it again", _where(src, st.job))
    info = src.file(st.job.chunk.file, st.job.entry.key)
    view = _writable(st.buf)
    src.storage.read_ranges([RangeRead(st.job.chunk.file, st.job.chunk.offset + off,
                                       view[pos:pos + n], info.generation)
                             for off, n, pos in st.reads])
    src.stats.add(st.buf.numel(), tensor=True, requests=len(st.reads))
    got = zlib.crc32(_writable(st.buf))
    if got == m.crc32:
        return
    msg = (f"{_where(src, st.job)}: CRC-32 of the tensor bytes read is {got:08x}, the zip "
           f"records {m.crc32:08x} (read twice); the file is corrupt")
    path, key = src.storage.url(st.job.chunk.file), st.job.entry.key
    if st.direct and st.job.live:
        raise PartiallyOverwrittenError(f"{msg}; the tensor of key {key!r} now holds these "
                                        "unchecked bytes: restore it from another checkpoint",
                                        path=path, key=key, keys=(key,))
    raise IntegrityError(msg, path=path, key=key)


def _copy_out(st: _Staged) -> None:
    job, m = st.job, st.job.member
    assert m is not None
    if st.direct or not st.buf.numel():
        return
    flat = st.buf.view(m.dtype)
    if not m.contiguous:
        region = flat.as_strided(m.sizes, m.stride, m.storage_offset)
        region = region[tuple(slice(a, z) for a, z in zip(job.lo, job.hi, strict=True))]
    elif st.rows:
        rows = flat.reshape((job.hi[0] - job.lo[0],) + tuple(job.chunk.sizes[1:]))
        inner = tuple(slice(a, z) for a, z in zip(job.lo[1:], job.hi[1:], strict=True))
        region = rows[(slice(None),) + inner]
    else:
        region = flat.reshape(job.shape)
    with torch.no_grad():
        job.dest.copy_(region)


def _log_done(what: str, uri: str, stats: DcpReadStats) -> None:
    logger.debug("dcp %s %s: %d keys, %d bytes (%d tensor) in %d requests, %.3f s (%.1f MiB/s)",
                 what, uri, stats.keys, stats.bytes_read, stats.tensor_bytes, stats.requests,
                 stats.seconds, stats.bytes_read / max(stats.seconds, 1e-9) / 2**20)


# ---- write ---------------------------------------------------------------------------------


def write_dcp(state: Mapping[str, Any], uri: str, *, config: StorageConfig | None = None,
              overwrite: bool = False) -> None:
    """Write ``state`` as a DCP checkpoint folder that ``torch.distributed.checkpoint.load`` reads.

    Written by torch's own ``dcp.save(state, storage_writer=FileSystemWriter(tmp),
    no_dist=True)`` into a temporary folder, then each file is uploaded to ``uri`` (local or
    ``gs://``) with :meth:`Storage.write_atomic`, the ``.distcp`` data files first and the
    ``.metadata`` commit marker last.  Called by one process (one rank) for the whole state;
    DCP's loader can then reshard it onto any world size.  Dtypes and shapes are kept exactly
    (int64 and bool buffers included, CASES C23); tensors that share storage (a tied
    embedding/output weight) are each written under their key and logged as ties, so they
    load back equal.

    Args:
        state: nested dicts/lists of CPU tensors and plain values, as ``dcp.save`` takes it;
            non-tensor values must load with ``torch.load(weights_only=True)`` (xla_ckpt reads
            them back no other way).
        uri: the checkpoint folder.
        config: storage knobs.
        overwrite: replace a DCP checkpoint already committed at ``uri``; its ``.metadata`` is
            removed first (its data files keep DCP's fixed names, so it cannot stay readable
            while they are replaced), and its ``.distcp`` files the new one does not reuse are
            deleted after the new ``.metadata`` is written.

    Raises:
        CheckpointExistsError: ``uri`` already holds a DCP ``.metadata`` and ``overwrite`` is
            False; nothing is written.
        UnsupportedTypeError: a DTensor (write full tensors; every rank's shard is not here),
            or a value ``weights_only`` cannot load back (names the key).
        MetaTensorError: a tensor on the meta device (names the key).
        StorageError: an upload failed after its retries (``.metadata`` is then not written).
    """
    flat = _check_writable(state)
    _log_ties(flat)
    target = open_storage(uri, config)
    try:
        if target.exists(METADATA_NAME):
            if not overwrite:
                raise CheckpointExistsError(f"{target.url(METADATA_NAME)}: a DCP checkpoint is "
                                            "already committed there; pass overwrite=True to "
                                            "replace it, or write to an empty folder")
            logger.warning("%s: replacing the DCP checkpoint there (its .metadata is removed "
                           "first)", target.uri)
            target.delete(METADATA_NAME)
            stale = [n for n in target.list("") if "/" not in n and n.endswith(".distcp")]
        else:
            stale = []
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="xla_ckpt-dcp-",
                                         dir=_local_temp_parent(target)) as tmp:
            _dcp_save(state, tmp)
            names = sorted(n for n in os.listdir(tmp) if n != METADATA_NAME)
            total = 0
            for name in names + [METADATA_NAME]:
                total += _upload(target, tmp, name)
        for name in sorted(set(stale) - set(names)):  # the replaced checkpoint's other files
            target.delete(name)
        dt = time.perf_counter() - t0
        logger.info("wrote DCP checkpoint %s: %d keys, %d files, %d bytes in %.2f s "
                    "(%.1f MiB/s)", target.uri, len(flat), len(names) + 1, total, dt,
                    total / max(dt, 1e-9) / 2**20)
    finally:
        target.close()


def _local_temp_parent(target: Storage) -> str | None:
    """For a local target, stage next to it (same filesystem, not a small /tmp)."""
    if target.uri.startswith("gs://"):
        return None
    parent = os.path.dirname(os.path.abspath(target.uri.removeprefix("file://")))
    return parent if os.path.isdir(parent) else None


def _dcp_save(state: Mapping[str, Any], folder: str) -> None:
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 - torch.distributed

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
        dcp.save(dict(state), storage_writer=dcp.FileSystemWriter(folder, sync_files=False),
                 no_dist=True)


def _upload(target: Storage, folder: str, name: str) -> int:
    path = os.path.join(folder, name)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size == 0:
            target.write_atomic(name, [b""])
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                target.write_atomic(name, [view])
            finally:
                view.release()
    return size


def _check_writable(state: Mapping[str, Any]) -> dict[str, Any]:
    """DCP's flattened items of ``state``, after refusing what could not be read back."""
    from torch.distributed.checkpoint._nested_dict import (  # noqa: PLC0415 - torch.distributed
        flatten_state_dict,
    )
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - torch.distributed

    if not isinstance(state, Mapping):
        raise UnsupportedTypeError(f"write_dcp takes a dict state, not {type(state).__name__}")
    flat, _ = flatten_state_dict(dict(state))
    for key, value in flat.items():
        if isinstance(value, DTensor):
            raise UnsupportedTypeError(
                f"key {key!r} is a DTensor: write_dcp writes one process's full tensors; "
                "gather it (or save from every rank with torch.distributed.checkpoint.save)")
        if isinstance(value, torch.Tensor):
            if value.device.type == "meta":
                raise MetaTensorError(f"key {key!r}: tensor on the meta device has no data to "
                                      "save")
            continue
        buf = io.BytesIO()
        try:
            torch.save(value, buf)
            buf.seek(0)
            torch.load(buf, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure means "cannot be read back"
            raise UnsupportedTypeError(
                f"key {key!r}: a {type(value).__name__} cannot be read back with "
                f"torch.load(weights_only=True) ({str(e).splitlines()[0] if str(e) else e!r}); "
                "store it as tensors or plain Python values") from None
    return flat


def _log_ties(flat: Mapping[str, Any]) -> None:
    groups: dict[tuple[Any, ...], list[str]] = {}
    for key, v in flat.items():
        if isinstance(v, torch.Tensor) and v.layout == torch.strided and v.numel():
            sig = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape),
                   v.stride(), v.dtype, v.device)
            groups.setdefault(sig, []).append(key)
    for keys in groups.values():
        if len(keys) > 1:
            logger.info("tied tensors %s share one storage: each is written under its key "
                        "(equal values; re-tie them after loading)", ", ".join(keys))
