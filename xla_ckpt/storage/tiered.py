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

A restore onto another mesh (issue 26, resharding from the tiers) adds a tier between the
two: the tiers of other hosts of the job (``peers``: each holder's
:class:`~xla_ckpt.storage.peer.PeerStorage`), for the files this host's tier does not hold.
A range is read from the first source that has not failed for it: this host's tier, each
listed peer in order, the durable tier.  A peer that fails a read (gone, refused, a short
body) is not asked again in this restore; one whose bytes fail their crc32c is not asked
again for that range; both are reported by peer host, file and tensor
(:attr:`TierCounters.peer_failures`, so the holder can mark its copy untrusted).

Writes are refused: a restore only reads.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

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
    peer_bytes: int = 0
    peer_requests: int = 0
    peer_seconds: float = 0.0
    peer_by_host: dict[int, int] = field(default_factory=dict)
    """Bytes read from each peer host's tier."""
    fallbacks: list[str] = field(default_factory=list)
    peer_failures: list[tuple[int, str, str]] = field(default_factory=list)
    """``(peer host, file, why)`` of each peer read or check that failed."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, local: bool, n: int, seconds: float = 0.0, peer: int | None = None) -> None:
        with self.lock:
            if peer is not None:
                self.peer_bytes += n
                self.peer_requests += 1
                self.peer_seconds += seconds
                self.peer_by_host[peer] = self.peer_by_host.get(peer, 0) + n
            elif local:
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
        local_files: the files read from ``local`` (None: any it holds with the right size).
        peers: ``{file: [(peer host, its storage), ...]}``, the other hosts' tiers that hold
            each file, in the order to ask them (module docstring).
        on_file_failure: ``(file, reason)`` instead of ``on_failure``, for each local file
            that fails (the caller knows whose part the file is).
    """

    memory_bound_reads = True

    def __init__(self, local: LocalStorage, durable: Callable[[], Storage] | None, *,
                 files: Mapping[str, int], host: int, counters: TierCounters,
                 on_failure: Callable[[str], None] | None = None,
                 config: StorageConfig | None = None,
                 tensors_at: Callable[[str, int, int], list[str]] | None = None,
                 local_files: Iterable[str] | None = None,
                 peers: Mapping[str, Sequence[tuple[int, Storage]]] | None = None,
                 on_file_failure: Callable[[str, str], None] | None = None) -> None:
        super().__init__(local.uri, config or local.config)
        self.local_files = set(local_files) if local_files is not None else None
        self.peers = {f: list(v) for f, v in (peers or {}).items()}
        self._on_file_failure = on_file_failure
        self._dead_peers: dict[int, str] = {}
        self._served: dict[tuple[str, int, int], object] = {}  # range: the source that read it
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

    def _report(self, reason: str, file: str | None = None, local: bool = True) -> None:
        """Record and log a failure; ``local``: of this host's own tier (then the caller's
        ``on_failure`` / ``on_file_failure`` marks the copy untrusted), else of a peer's
        (:attr:`TierCounters.peer_failures` carries it to the holder)."""
        with self.counters.lock:
            self.counters.fallbacks.append(reason)
        logger.warning("host %d: %s", self.host, reason)
        if not local:
            return
        if self._on_file_failure is not None and file is not None:
            try:
                self._on_file_failure(file, reason)
            except Exception as e:  # noqa: BLE001 - a report must not fail the read
                logger.warning("host %d: could not record the failure: %s", self.host, e)
            return
        if self._on_failure is not None and not self._failed_once:
            self._failed_once = True
            try:
                self._on_failure(reason)
            except Exception as e:  # noqa: BLE001 - a report must not fail the read
                logger.warning("host %d: could not record the failure: %s", self.host, e)

    def _report_once(self, key: object, reason: str, file: str | None = None,
                     local: bool = True) -> None:
        with self._lock:
            seen = key in self._reported
            self._reported.add(key)
        if not seen:
            self._report(reason, file, local)

    def _local_allowed(self, name: str) -> bool:
        return self.local_files is None or name in self.local_files

    def _live_peers(self, name: str) -> list[tuple[int, Storage]]:
        with self._lock:
            return [(h, st) for h, st in self.peers.get(name, ()) if h not in self._dead_peers]

    def _bad_for(self, source: object, name: str, offset: int, n: int) -> bool:
        for a, b in self._bad.get(f"{source}:{name}", ()):
            if a < offset + n and offset < b:
                return True
        return False

    def _chain(self, name: str, offset: int, n: int) -> list[object]:
        """The sources left for a byte range, in order: "local", peer hosts, "durable"."""
        out: list[object] = []
        if self._local_allowed(name) and self._local_ok(name, offset, n):
            out.append("local")
        out.extend(h for h, _ in self._live_peers(name)
                   if not self._bad_for(h, name, offset, n))
        if self.has_durable:
            out.append("durable")
        return out

    def _other_tier(self, name: str) -> str:
        if self._live_peers(name):
            return "another host's tier" + (" or the durable tier" if self.has_durable else "")
        return "the durable tier" if self.has_durable else \
            "nowhere else (no other tier holds this save: the read fails)"

    # ---- reads -------------------------------------------------------------------------
    def stat(self, name: str) -> ObjectInfo:
        if self._local_allowed(name) and name not in self._not_local:
            want = self.files.get(name)
            try:
                info = self.local.stat(name)
                if want is None or info.size == want:
                    return ObjectInfo(name=name, size=info.size)
                why = f"has {info.size} bytes, the manifest says {want}"
            except CheckpointNotFoundError:
                if not self.has_durable and not self._live_peers(name):
                    self._report_once(name, f"local file {self.local.url(name)} is missing, "
                                      "and the durable tier does not hold this save", name)
                    raise  # the reader's own error (DataFileMissingError names the file)
                why = "is missing"
            if not self.has_durable and not self._live_peers(name):
                self._report_once(name, f"local file {self.local.url(name)} {why}, and the "
                                  "durable tier does not hold this save", name)
                return ObjectInfo(name=name, size=info.size)  # the reader names the sizes
            with self._lock:
                self._not_local.add(name)
            self._report(f"local file {self.local.url(name)} {why}; its bytes come from "
                         f"{self._other_tier(name)}", name)
        if name in self.files and self._live_peers(name):
            return ObjectInfo(name=name, size=self.files[name])  # each peer read checks it
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
        n = len(out)
        tried: list[str] = []
        for source in self._chain(name, offset, n):
            t0 = time.perf_counter()
            if source == "local":
                self.local.read_range(name, offset, out)
                self.counters.add(True, n, time.perf_counter() - t0)
            elif source == "durable":
                self.durable().read_range(name, offset, out)
                self.counters.add(False, n, time.perf_counter() - t0)
            else:
                assert isinstance(source, int)
                peer = dict(self._live_peers(name)).get(source)
                if peer is None:
                    continue  # it failed on another thread meanwhile
                try:
                    peer.read_range(name, offset, out)
                except StorageError as e:
                    self._peer_failed(source, name, f"{e}")
                    tried.append(f"peer host {source}: {e}")
                    continue
                self.counters.add(False, n, time.perf_counter() - t0, peer=source)
            with self._lock:
                self._served[(name, offset, n)] = source
            return
        raise StorageError(f"host {self.host}: no tier left to read {name} bytes [{offset}, "
                           f"{offset + n}) from: " + ("; ".join(tried) or "no peer holds it "
                           "and the durable tier does not hold this save"))

    def _peer_failed(self, host: int, name: str, why: str) -> None:
        with self._lock:
            first = host not in self._dead_peers
            self._dead_peers.setdefault(host, why)
        if first:
            with self.counters.lock:
                self.counters.peer_failures.append((host, name, why))
            self._report(f"reading {name} from peer host {host}'s tier failed ({why}); it is "
                         f"not asked again in this restore, the bytes come from "
                         f"{self._other_tier(name)}", local=False)

    def crc_mismatch(self, name: str, offset: int, n: int, tensors: Sequence[str]) -> bool:
        """The chunk reader: bytes ``[offset, offset + n)`` of ``name`` failed their crc32c.
        Returns True when a re-read will come from another source (another host's tier or
        the durable tier, which holds this save)."""
        with self._lock:
            source = self._served.get((name, offset, n))
        if source is None:  # not read through read_range (whole-file reads): the first source
            chain = self._chain(name, offset, n)
            source = chain[0] if chain else None
        if source in (None, "durable"):
            return False  # the durable bytes failed: the reader's own retries and error
        names = self._tensors_at(name, offset, n) if self._tensors_at is not None else []
        names = names or list(tensors)
        what = ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
        what = what or "?"
        where = f"local file {self.local.url(name)}" if source == "local" else \
            f"peer host {source}'s copy of {name}"
        key = "local" if source == "local" else source
        fallback = [s for s in self._chain(name, offset, n) if s != key]
        if fallback:
            with self._lock:
                self._bad.setdefault(f"{key}:{name}", []).append((offset, offset + n))
                if source == "local":
                    self._bad.setdefault(name, []).append((offset, offset + n))
            rest = "the durable tier" if fallback == ["durable"] else \
                ("peer host " + str(fallback[0]) + "'s tier" if fallback[0] != "local"
                 else "this host's tier")
            reason = (f"crc32c mismatch in {where} bytes [{offset}, {offset + n}) (tensor "
                      f"{what}); those bytes come from {rest}")
            if source == "local":
                self._report(reason, name)
            else:
                assert isinstance(source, int)
                with self.counters.lock:
                    self.counters.peer_failures.append((source, name, reason))
                self._report(reason, local=False)
            return True
        # Nothing to fall back to: the reader re-reads the same bytes, then raises its
        # IntegrityError naming the tensor (each range reported once, not per re-read).
        if isinstance(source, int):
            why = f"crc32c mismatch in bytes [{offset}, {offset + n}) (tensor {what})"
            with self.counters.lock:
                failures = self.counters.peer_failures
                if not any(h == source and f == name for h, f, _ in failures):
                    failures.append((source, name, why))
        self._report_once((name, offset, n), f"crc32c mismatch in {where} bytes [{offset}, "
                          f"{offset + n}) (tensor {what}), and the durable tier does not "
                          "hold this save" + (" (nor another peer)" if self.peers.get(name)
                                              else ""),
                          name if source == "local" else None, local=source == "local")
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
        for st in {id(st): st for v in self.peers.values() for _, st in v}.values():
            st.close()
        if self._durable is not None:
            self._durable.close()
        super().close()
