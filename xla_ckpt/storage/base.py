"""The storage interface: a handful of primitives every backend implements.

Modelled on fsspec's ``cat_file(path, start, end)`` and PyTorch DCP's
``StorageReader``/``StorageWriter`` split: a backend only moves bytes.  It
knows nothing about ranks, tensors or manifests.

A :class:`Storage` is rooted at a URI (a local folder or ``gs://bucket/prefix``)
and addresses objects by *names* relative to that root, ``/``-separated
(``"checkpoint_100/manifest.json"``).  Primitives:

=====================  ======================================================
``stat(name)``         size (bytes) and generation; CheckpointNotFoundError
``read_range(...)``    fill a writable buffer from ``[offset, offset+len)``
``write_atomic(...)``  all-or-nothing object write (temp+fsync+rename / one
                       GCS upload or compose); readers never see half an object
``list(prefix)``       names under a prefix, recursive, sorted
``delete(name)``       remove; a missing object is not an error
=====================  ======================================================

**Custom metadata.**  ``write_atomic(..., metadata={...})`` stores a few short string
pairs with the object (GCS custom metadata; a local file's extended attribute where the
file system keeps one), and :meth:`Storage.list_in_subfolders` returns them with each
object it lists (:attr:`ObjectInfo.metadata`; None where the backend kept none): a run
folder's catalog reads what it orders checkpoints by from one listing instead of every
manifest.

**Preconditions.**  ``write_atomic`` and ``delete`` take ``if_generation_match``
(GCS's ``ifGenerationMatch``): ``None`` -- unconditional; ``0`` -- only if no
object of that name exists (create only); ``N > 0`` -- only if the live object
is generation ``N`` (compare-and-swap on :attr:`ObjectInfo.generation`).  When
it does not hold nothing is written or deleted and
:class:`~xla_ckpt.errors.PreconditionFailedError` is raised; a delete of an
absent object stays a no-op whatever the precondition.

Everything else (:meth:`Storage.read_ranges` in parallel slices,
:meth:`Storage.read_bytes`, :meth:`Storage.child`) is built on them here, so a
new backend gets parallel byte-range reads for free.  ``tests/storage/`` holds
the conformance suite every backend must pass.
"""

from __future__ import annotations

import abc
import builtins
import concurrent.futures as cf
import ipaddress
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from xla_ckpt.errors import CheckpointNotFoundError, ConfigError, PreconditionFailedError
from xla_ckpt.storage.cancel import run_all

logger = logging.getLogger(__name__)

MiB = 1024 * 1024


@dataclass(frozen=True)
class ObjectInfo:
    """What :meth:`Storage.stat` returns.

    Attributes:
        name: object name relative to the storage root.
        size: object size in bytes.
        generation: the object's version: a GCS object generation (pinned
            across the slices of one read), a local file's modification time in
            ns (see :mod:`xla_ckpt.storage.local`); every replace by
            ``write_atomic`` gives a new one.  What ``if_generation_match`` compares.
        metadata: the custom metadata ``write_atomic`` stored with it, as
            :meth:`Storage.list_in_subfolders` returns it; None when not known (not asked
            for, or the backend kept none).
    """

    name: str
    size: int
    generation: int | None = None
    metadata: Mapping[str, str] | None = None


@dataclass(frozen=True)
class InFlightObject:
    """An object an unfinished write left behind (an upload part, a temporary file).

    What :meth:`Storage.list_in_flight` returns: the backend recognised its own
    in-flight mark in the name (``<target>.tmp-<upload id>...``).

    Attributes:
        name: object name relative to the storage root.
        target: the name the write was producing (relative to the root).
        upload_id: the write's random id from the mark; every object one write left shares it.
        size: bytes.
        created_unix_s: when the store created it, by the store's clock (compare it with
            :meth:`Storage.now_unix_s`, never with this host's); None if it does not say.
    """

    name: str
    target: str
    upload_id: str
    size: int
    created_unix_s: float | None


@dataclass(frozen=True)
class RangeRead:
    """One byte-range read: ``len(out)`` bytes of ``name`` starting at ``offset`` into ``out``.

    ``out`` is a writable, C-contiguous ``memoryview`` of format ``"B"``
    (e.g. over a preallocated uint8 tensor); the read writes straight into it.
    ``generation`` pins the object version (GCS); ``None`` means "current".
    """

    name: str
    offset: int
    out: memoryview
    generation: int | None = None


@dataclass(kw_only=True)
class StorageConfig:
    """Knobs shared by all backends.

    Attributes:
        max_workers: concurrent byte-range requests per process.
        slice_size_bytes: large reads are split into slices of this many bytes,
            each fetched by one request.
        retry_deadline_s: overall time budget for retrying one request
            (408/429/5xx and connection errors only), from its first failure.
        request_deadline_s: total time one request may take from its start, retries,
            backoff and slow answers included (one byte range of at most
            ``slice_size_bytes``, one whole-object read, one listing, one metadata call,
            one upload): a server that keeps a request alive by sending a few bytes at a
            time is cut off then, with :class:`~xla_ckpt.errors.StorageDeadlineError`
            naming the request, the bytes received and this setting.  The default (300 s)
            lets a 16 MiB slice arrive at 55 KiB/s; raise it for slower links.
        initial_backoff_s / max_backoff_s: capped exponential backoff with
            full jitter between attempts.
        max_attempts: attempts per request before giving up (within the deadline).
        parallel_upload_threshold_bytes: objects at least this large are
            uploaded in parallel parts and composed (GCS).
        upload_part_size_bytes: size of each such part.
        source_address: local IP address (an IPv4 or IPv6 literal, no port) every
            connection of a network backend (GCS) is bound to before connecting, or
            None: the environment variable :data:`SOURCE_ADDRESS_ENV`
            (``XLA_CKPT_GCS_SOURCE_ADDRESS``) when it is set and non-empty, read when the
            backend opens its connection (so a launcher can set it per process), else
            the kernel's choice.  What it is for: on a machine with several NICs, pin
            checkpoint traffic to one of them; in tests and the demo, each emulated host
            ``h`` binds to its own loopback address ``127.0.0.(10+h)``
            (:func:`xla_ckpt.testing.fault_proxy.host_address`), so the fault proxy can
            shape and count each host's traffic as that host's network link.  The local
            backend ignores it.  See :mod:`xla_ckpt.storage.gcs.transport`.

    Raises:
        ConfigError: a value out of range, naming the key (``storage.<field>``).
    """

    max_workers: int = 16
    slice_size_bytes: int = 16 * MiB
    retry_deadline_s: float = 120.0
    request_deadline_s: float = 300.0
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 8.0
    max_attempts: int = 8
    parallel_upload_threshold_bytes: int = 64 * MiB
    upload_part_size_bytes: int = 32 * MiB
    source_address: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_workers", "slice_size_bytes", "max_attempts",
                     "parallel_upload_threshold_bytes", "upload_part_size_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"storage.{name} must be a positive integer, got {v!r}")
        for name in ("retry_deadline_s", "initial_backoff_s", "max_backoff_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"storage.{name} must be a number >= 0, got {v!r}")
        v = self.request_deadline_s
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 \
                or v == float("inf"):
            raise ConfigError(f"storage.request_deadline_s must be a finite number of seconds "
                              f"> 0, got {v!r}")
        if self.source_address is not None:
            check_source_address(self.source_address, "storage.source_address")


SOURCE_ADDRESS_ENV = "XLA_CKPT_GCS_SOURCE_ADDRESS"
"""Environment variable naming the local address GCS connections leave from, when
:attr:`StorageConfig.source_address` is None (set per emulated host by the test launcher)."""


def check_source_address(value: object, what: str) -> str:
    """``value`` as given, after checking it is an IPv4 or IPv6 address literal.

    ``what`` names the setting in the error (``storage.source_address`` or the
    environment variable).  Host names are refused: a bind address must not depend on
    name resolution.

    Raises:
        ConfigError: not a string holding an IP address literal.
    """
    if not isinstance(value, str):
        raise ConfigError(f"{what} must be an IP address string such as '10.0.0.2' or "
                          f"'127.0.0.11', got {value!r} ({type(value).__name__})")
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ConfigError(f"{what} must be an IPv4 or IPv6 address literal of this machine "
                          f"(e.g. '10.0.0.2', '127.0.0.11', 'fd00::2'), got {value!r}; "
                          "host names and ports are not accepted") from None
    return value


def join(*parts: str) -> str:
    """Join name parts with ``/``, dropping empty parts and duplicate slashes."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def check_generation_match(value: int | None) -> int | None:
    """``if_generation_match`` as given, after checking it is None or an int >= 0."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"if_generation_match must be None or an integer >= 0, got {value!r}")
    return value


def precondition_failed(uri: str, name: str, op: str, expected: int,
                        actual: int | None, *, known: bool = True) -> PreconditionFailedError:
    """The error of a ``write_atomic``/``delete`` (``op``: "written"/"deleted") of ``name`` at
    ``uri`` whose ``if_generation_match=expected`` did not hold; ``actual``: the live
    generation (None: no live object, or unknown when not ``known``)."""
    if not known:
        found = "its live generation could not be read"
    elif actual is None:
        found = "there is no live object"
    else:
        found = f"the live object has generation {actual}"
    wanted = "0 (create only: no object may exist)" if expected == 0 else \
        f"{expected} (only generation {expected})"
    return PreconditionFailedError(
        f"{uri}: not {op}: precondition if_generation_match={wanted} does not hold: {found}",
        name=name, expected_generation=expected, actual_generation=actual)


class Storage(abc.ABC):
    """A byte store rooted at :attr:`uri`.  Thread-safe; share one per process.

    Subclasses implement the five primitives; callers on any rank may use any
    method (the backend has no notion of ranks).
    """

    def __init__(self, uri: str, config: StorageConfig | None = None) -> None:
        self.uri = uri.rstrip("/") if uri not in ("/",) else uri
        self.config = config or StorageConfig()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # ---- primitives -------------------------------------------------------------
    @abc.abstractmethod
    def stat(self, name: str) -> ObjectInfo:
        """Size and generation of ``name``; raises CheckpointNotFoundError if absent."""

    @abc.abstractmethod
    def read_range(self, name: str, offset: int, out: memoryview,
                   generation: int | None = None) -> None:
        """Fill ``out`` with bytes ``[offset, offset + len(out))`` of ``name``.

        Raises:
            CheckpointNotFoundError: the object (or pinned generation) is gone.
            CheckpointCorruptError: the object ends before ``offset + len(out)``
                (names the object, expected vs actual size).
            StorageError: the backend failed after its retries.
        """

    @abc.abstractmethod
    def write_atomic(self, name: str, buffers: Sequence[memoryview | bytes], *,
                     if_generation_match: int | None = None,
                     metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        """Write the concatenation of ``buffers`` as ``name``, all or nothing.

        An existing object of that name is replaced atomically; on failure it
        is left as it was and no partial object is visible.

        Args:
            if_generation_match: ``None`` replaces whatever is there; ``0`` creates
                only (fails if ``name`` exists); ``N > 0`` replaces only generation ``N``.
            metadata: custom metadata (a few short ``str -> str`` pairs) stored with the
                object, visible at once with it; a backend that cannot keep it writes the
                object without (readers then find ``ObjectInfo.metadata`` None).

        Returns:
            The new object's size and generation.

        Raises:
            PreconditionFailedError: ``if_generation_match`` did not hold; nothing written.
        """

    lists_in_flight: bool = False
    """True when :meth:`list_in_flight` reports what this backend's interrupted writes leave."""

    memory_bound_reads: bool = False
    """True when a ranged read costs a memory copy and no wait (a local file in the page
    cache): readers then use :meth:`read_concurrency` threads and check each crc32c chunk
    right after its own read, while its bytes are still in the core's cache.  False (network
    backends): a request costs a round trip, so readers make few large ones, many at once."""

    def read_concurrency(self) -> int:
        """How many byte-range reads a reader of this storage should run at once.

        ``config.max_workers`` for backends whose reads wait on the network; backends with
        :attr:`memory_bound_reads` cap it at the CPUs this process may run on, since more
        copying threads than cores only take turns (and each costs a thread start).
        """
        if not self.memory_bound_reads:
            return self.config.max_workers
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        return max(1, min(self.config.max_workers, cpus))

    def now_unix_s(self) -> float:
        """The store's current time in Unix seconds: the clock that stamps
        :attr:`InFlightObject.created_unix_s`, so an age is one clock minus itself.

        Grace periods (``xla-ckpt ls/gc/rm``, :mod:`xla_ckpt.run.prune`) compare creation
        times with this, never with this host's clock, which may be skewed against the
        store's.  This default is this host's clock (a local filesystem stamps files with
        it); network backends ask the service.

        Raises:
            StorageError: the service could not be asked (network backends).
        """
        return time.time()

    def list_in_flight(self, prefix: str = "") -> list[InFlightObject]:
        """Objects unfinished writes left under ``prefix`` (recursive), sorted by name.

        :meth:`list` never shows them; cleanup tools (``xla-ckpt ls``/``gc``) do, and
        :meth:`delete` removes them by ``name``.  This default reports none (see
        :attr:`lists_in_flight`).
        """
        return []

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Sorted names of committed objects under ``prefix`` (recursive).

        Temporary/in-flight objects of interrupted writes are never listed.
        """

    def list_in_subfolders(self, prefix: str, name: str) -> builtins.list[ObjectInfo]:
        """Every object ``<folder>/<name>`` one level below ``prefix``, with its custom
        metadata, sorted by name (``ObjectInfo.name`` relative to ``prefix``).

        What a run folder's catalog lists: ``list_in_subfolders("", "manifest.json")`` is
        every committed checkpoint and what :meth:`write_atomic` stored with its manifest,
        without listing the data files.  Backends answer it in one listing (GCS:
        ``matchGlob``, one request per 1,000 objects; local: one directory scan); this
        default is built on :meth:`list` and :meth:`stat` (no metadata).
        """
        base = prefix.strip("/")
        out = []
        for n in self.list(base):
            rel = n[len(base) + 1:] if base else n
            parts = rel.split("/")
            if len(parts) == 2 and parts[1] == name:
                try:
                    info = self.stat(n)
                except CheckpointNotFoundError:
                    continue  # deleted since the listing
                out.append(ObjectInfo(rel, info.size, info.generation, info.metadata))
        return out

    @abc.abstractmethod
    def delete(self, name: str, *, if_generation_match: int | None = None) -> None:
        """Delete ``name``; a missing object is not an error.

        With ``if_generation_match`` (see :meth:`write_atomic`) only that generation is
        deleted; another one raises PreconditionFailedError and is kept.
        """

    # ---- built on the primitives -----------------------------------------------
    def child(self, prefix: str) -> "Storage":
        """A storage of the same kind rooted at ``prefix`` under this one."""
        return type(self)(self.uri.rstrip("/") + "/" + prefix.strip("/"), self.config)

    def url(self, name: str = "") -> str:
        """Full URI of ``name`` (for messages)."""
        return self.uri.rstrip("/") + ("/" + name if name else "")

    def exists(self, name: str) -> bool:
        try:
            self.stat(name)
        except CheckpointNotFoundError:
            return False
        return True

    def read_bytes(self, name: str) -> bytes:
        """Whole object as bytes (for small objects: manifests, pointers)."""
        info = self.stat(name)
        buf = bytearray(info.size)
        if info.size:
            self.read_ranges([RangeRead(name, 0, memoryview(buf), info.generation)])
        return bytes(buf)

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix``; returns how many were deleted."""
        names = self.list(prefix)
        for n in names:
            self.delete(n)
        return len(names)

    def _executor(self) -> cf.ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(self.config.max_workers,
                                                   thread_name_prefix="xla_ckpt-io")
            return self._pool

    def read_ranges(self, reads: Iterable[RangeRead]) -> None:
        """Run many byte-range reads concurrently, each split into slices.

        Slices of at most ``config.slice_size_bytes`` run on a pool of
        ``config.max_workers`` threads and write straight into each read's
        ``out`` buffer (no intermediate copy).  The first failure stops the slices
        in flight (:func:`xla_ckpt.storage.cancel.run_all`) and is raised; a
        ``KeyboardInterrupt`` is raised within about
        :data:`~xla_ckpt.storage.cancel.INTERRUPT_WAIT_S`, the slices in flight stopped.
        """
        slices: list[tuple[str, int, memoryview, int | None]] = []
        step = self.config.slice_size_bytes
        for r in reads:
            n = len(r.out)
            for start in range(0, n, step):
                slices.append((r.name, r.offset + start, r.out[start:start + step], r.generation))
        if not slices:
            return
        if len(slices) == 1:
            self.read_range(*slices[0])
            return
        run_all(self._executor(), self.read_range, slices)

    def close(self) -> None:
        """Release threads and connections; the object must not be used after."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def __enter__(self) -> "Storage":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"
