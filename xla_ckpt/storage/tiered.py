"""One checkpoint folder read from two tiers: this host's local copy first, the durable copy
for whatever the local one lacks or fails (DESIGN "tiers").

A :class:`TieredStorage` is what a restore from the local tier reads through
(:class:`~xla_ckpt.restore.decide.Decision` ``source``).  Each file the host's local tier
holds with the size the manifest names is read from there; a file that is missing or has
another size (vanished, truncated) is read from the durable folder.  When a crc32c check
of local bytes fails, the chunk reader calls :meth:`TieredStorage.crc_mismatch`: that byte
range (and only it) is read from durable storage from then on, the failure is reported by
host, file and tensor, and ``on_failure`` is called once (the manager marks the host's copy
untrusted, so no later restore picks it again).  Without a durable copy of the same save the
failure stays an error (the restore fails on every rank and the manager decides again).

Writes are refused: a restore only reads.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from xla_ckpt.errors import CheckpointNotFoundError, StorageError
from xla_ckpt.storage.base import ObjectInfo, Storage, StorageConfig
from xla_ckpt.storage.local import LocalStorage

logger = logging.getLogger(__name__)


@dataclass
class TierCounters:
    """Bytes (and requests) read from each tier by every :class:`TieredStorage` of one
    restore on this rank; ``fallbacks`` names each local range that failed and why."""

    local_bytes: int = 0
    durable_bytes: int = 0
    local_requests: int = 0
    durable_requests: int = 0
    local_seconds: float = 0.0  # summed over the reading threads (not wall time)
    durable_seconds: float = 0.0
    fallbacks: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, local: bool, n: int, seconds: float = 0.0) -> None:
        with self.lock:
            if local:
                self.local_bytes += n
                self.local_requests += 1
                self.local_seconds += seconds
            else:
                self.durable_bytes += n
                self.durable_requests += 1
                self.durable_seconds += seconds


class TieredStorage(Storage):
    """Reads ``files`` from ``local`` when it holds them whole and intact, else ``durable``.

    Args:
        local: this host's local copy of the checkpoint folder.
        durable: a factory of the durable checkpoint folder's storage, or None when the
            durable tier does not hold this save (then nothing can fall back).
        files: the manifest's files and sizes (what "whole" means).
        host: this host's index (in messages).
        counters: where byte counts go (shared by a restore's storages).
        on_failure: called with a reason the first time a local byte fails a check.
        tensors_at: ``(file, offset, n) -> names`` of the tensors whose bytes lie in that
            byte range of ``file`` (from the manifest); the reader's own names otherwise
            (a blob of several tensors reads as one).
    """

    memory_bound_reads = True

    def __init__(self, local: LocalStorage, durable: Callable[[], Storage] | None, *,
                 files: Mapping[str, int], host: int, counters: TierCounters,
                 on_failure: Callable[[str], None] | None = None,
                 config: StorageConfig | None = None,
                 tensors_at: Callable[[str, int, int], list[str]] | None = None) -> None:
        super().__init__(local.uri, config or local.config)
        self.local = local
        self._durable_factory = durable
        self._durable: Storage | None = None
        self.files = dict(files)
        self.host = host
        self.counters = counters
        self._on_failure = on_failure
        self._tensors_at = tensors_at
        self._failed_once = False
        self._not_local: set[str] = set()
        self._bad: dict[str, list[tuple[int, int]]] = {}
        self._reported: set[object] = set()  # failures without a durable copy, reported
        self._lock = threading.Lock()

    @property
    def has_durable(self) -> bool:
        return self._durable_factory is not None

    def durable(self) -> Storage:
        with self._lock:
            if self._durable is None:
                if self._durable_factory is None:
                    raise StorageError(f"host {self.host}: no durable copy of {self.local.uri}")
                self._durable = self._durable_factory()
            return self._durable

    def _report(self, reason: str) -> None:
        with self.counters.lock:
            self.counters.fallbacks.append(reason)
        logger.warning("host %d: %s", self.host, reason)
        if self._on_failure is not None and not self._failed_once:
            self._failed_once = True
            try:
                self._on_failure(reason)
            except Exception as e:  # noqa: BLE001 - a report must not fail the read
                logger.warning("host %d: could not record the failure: %s", self.host, e)

    def _report_once(self, key: object, reason: str) -> None:
        with self._lock:
            seen = key in self._reported
            self._reported.add(key)
        if not seen:
            self._report(reason)

    # ---- reads -------------------------------------------------------------------------
    def stat(self, name: str) -> ObjectInfo:
        if name not in self._not_local:
            want = self.files.get(name)
            try:
                info = self.local.stat(name)
                if want is None or info.size == want:
                    return ObjectInfo(name=name, size=info.size)
                why = f"has {info.size} bytes, the manifest says {want}"
            except CheckpointNotFoundError:
                if not self.has_durable:
                    self._report_once(name, f"local file {self.local.url(name)} is missing, "
                                      "and the durable tier does not hold this save")
                    raise  # the reader's own error (DataFileMissingError names the file)
                why = "is missing"
            if not self.has_durable:
                self._report_once(name, f"local file {self.local.url(name)} {why}, and the "
                                  "durable tier does not hold this save")
                return ObjectInfo(name=name, size=info.size)  # the reader names the sizes
            with self._lock:
                self._not_local.add(name)
            self._report(f"local file {self.local.url(name)} {why}; its bytes come from "
                         "the durable tier")
        info = self.durable().stat(name)
        return ObjectInfo(name=name, size=info.size)

    def _local_ok(self, name: str, offset: int, n: int) -> bool:
        if name in self._not_local:
            return False
        for a, b in self._bad.get(name, ()):
            if a < offset + n and offset < b:
                return False
        return True

    def read_range(self, name: str, offset: int, out: memoryview,
                   generation: int | None = None) -> None:
        if self._local_ok(name, offset, len(out)):
            t0 = time.perf_counter()
            self.local.read_range(name, offset, out)
            self.counters.add(True, len(out), time.perf_counter() - t0)
        else:
            t0 = time.perf_counter()
            self.durable().read_range(name, offset, out)
            self.counters.add(False, len(out), time.perf_counter() - t0)

    def crc_mismatch(self, name: str, offset: int, n: int, tensors: Sequence[str]) -> bool:
        """The chunk reader: bytes ``[offset, offset + n)`` of ``name`` failed their crc32c.
        Returns True when a re-read will come from the durable tier (it holds this save)."""
        if not self._local_ok(name, offset, n):
            return False  # the durable bytes failed: the reader's own retries and error
        names = self._tensors_at(name, offset, n) if self._tensors_at is not None else []
        names = names or list(tensors)
        what = ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
        what = what or "?"
        if self.has_durable:
            with self._lock:
                self._bad.setdefault(name, []).append((offset, offset + n))
            self._report(f"crc32c mismatch in local file {self.local.url(name)} bytes "
                         f"[{offset}, {offset + n}) (tensor {what}); those bytes come from "
                         "the durable tier")
            return True
        # Nothing to fall back to: the reader re-reads the local bytes, then raises its
        # IntegrityError naming the tensor (each range reported once, not per re-read).
        self._report_once((name, offset, n), f"crc32c mismatch in local file "
                          f"{self.local.url(name)} bytes [{offset}, {offset + n}) (tensor "
                          f"{what}), and the durable tier does not hold this save")
        return False

    # ---- a restore only reads ------------------------------------------------------------
    def write_atomic(self, name: str, buffers: Sequence[memoryview | bytes], *,
                     if_generation_match: int | None = None,
                     metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        raise StorageError(f"{self.uri}: a tiered restore source is read-only")

    def list(self, prefix: str = "") -> list[str]:
        return sorted(set(self.local.list(prefix)) | set(self.files))

    def delete(self, name: str, *, if_generation_match: int | None = None) -> None:
        raise StorageError(f"{self.uri}: a tiered restore source is read-only")

    def close(self) -> None:
        self.local.close()
        if self._durable is not None:
            self._durable.close()
        super().close()
