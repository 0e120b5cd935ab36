"""Writes of the GCS backend: multipart and composite uploads, compose, cleanup of parts.

:meth:`_GCSWrites.write_atomic`: up to :data:`MULTIPART_MAX_BYTES` in one
multipart upload carrying the crc32c (the service refuses mismatching bytes,
so the object is verified before it becomes visible); larger objects as parts
uploaded in parallel under in-flight names (``<name>.tmp-<id>-part-<n>``),
each checked against its crc32c, then composed (at most 32 sources per
compose, in a tree above that) into the final name in one atomic step, then
the parts are deleted.  A failed write deletes its parts and leaves the
previous object as it was.

Interrupted writes (Ctrl-C, a closed storage, the interpreter exiting):

* everything from naming the parts to the last compose runs inside the
  cleanup, so an interrupt at any point (even while the upload threads start)
  stops submitting parts, cancels those not started, stops the bodies being
  sent, and deletes the parts already written;
* after a ``KeyboardInterrupt`` (a first or a second one) that deletion is
  bounded by :data:`CLEANUP_ON_INTERRUPT_S`, then the interrupt is raised
  again: the upload threads are daemon threads, so part uploads still in
  flight never keep the process alive; one that lands afterwards deletes
  itself while the process lives;
* :meth:`_GCSWrites.close` abandons the writes still running on that storage
  (the manager closes the storage of a save it abandons), and at interpreter
  exit every write still running is abandoned the same way;
* what is still left (the process was killed) keeps its in-flight name:
  :meth:`_GCSWrites.list_in_flight` reports it, ``xla-ckpt ls`` shows it and
  ``xla-ckpt gc --in-flight`` deletes it once it is older than the grace period.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import datetime as _dt
import json
import logging
import queue
import re
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

from xla_ckpt.errors import CheckpointNotFoundError, StorageError
from xla_ckpt.format.crc import crc32c, crc32c_combine
from xla_ckpt.storage.base import InFlightObject, MiB, ObjectInfo, join
from xla_ckpt.storage.gcs.transport import (
    _bytes_view,
    _GCSBase,
    _int_header,
    crc32c_b64,
    crc32c_from_b64,
)

logger = logging.getLogger(__name__)

TMP_MARK = ".tmp-"
"""In-flight objects (upload parts) carry this in their name; :meth:`GCSStorage.list` hides them."""

IN_FLIGHT_NAME = re.compile(
    r"(?P<target>.+)\.tmp-(?P<upload_id>[0-9a-f]{12})-(?:part-\d{5,}|compose-\d+-\d{5,})")
"""The full name of an in-flight object this backend writes: ``<target>.tmp-<id>-part-<n>``
(an uploaded part) or ``<target>.tmp-<id>-compose-<level>-<n>`` (an intermediate compose)."""

MULTIPART_MAX_BYTES = 8 * MiB
"""Objects up to this size go up in one multipart request that carries their crc32c."""

MAX_COMPOSE_SOURCES = 32
"""GCS composes at most 32 source objects per request."""

CLEANUP_ON_INTERRUPT_S = 0.5
"""After a ``KeyboardInterrupt`` (or at interpreter exit), how long a composite write waits for
the deletion of its parts before it raises again; what is not deleted by then is listed by
``xla-ckpt ls`` and collected by ``xla-ckpt gc``."""

SEND_BLOCK_BYTES = 1 * MiB
"""A part's body is handed to the HTTP stack in blocks of at most this many bytes; between
blocks an abandoned write stops sending (the service never stores a body cut short)."""


@dataclass(frozen=True)
class _Part:
    name: str
    pieces: tuple[memoryview, ...]
    size: int


class _Abandoned(Exception):
    """A part upload stopped because its write was abandoned (interrupted, storage closed)."""


class _BodyReader:
    """A file-like request body over several buffers (sent without joining them).

    ``read(n)`` returns up to ``max(n, SEND_BLOCK_BYTES)`` bytes (http.client and urllib3
    send each block as it comes); with ``cancelled`` set it raises :class:`_Abandoned`.
    """

    def __init__(self, pieces: Sequence[memoryview],
                 cancelled: threading.Event | None = None) -> None:
        self._pieces = list(pieces)
        self._len = sum(len(p) for p in pieces)
        self._i = 0
        self._pos = 0
        self._cancelled = cancelled

    def __len__(self) -> int:
        return self._len

    def read(self, n: int = -1) -> memoryview | bytes:
        if self._cancelled is not None and self._cancelled.is_set():
            raise _Abandoned("the write was abandoned; the rest of this body is not sent")
        while self._i < len(self._pieces):
            p = self._pieces[self._i]
            if self._pos < len(p):
                left = len(p) - self._pos
                k = left if n is None or n < 0 else min(max(n, SEND_BLOCK_BYTES), left)
                view = p[self._pos:self._pos + k]
                self._pos += k
                return view
            self._i += 1
            self._pos = 0
        return b""


def _split(pieces: Sequence[memoryview], part_size: int) -> Iterable[tuple[list[memoryview], int]]:
    """Cut a sequence of buffers into parts of ``part_size`` bytes (the last may be shorter)."""
    cur: list[memoryview] = []
    n = 0
    for p in pieces:
        while len(p):
            k = min(len(p), part_size - n)
            cur.append(p[:k])
            n += k
            p = p[k:]
            if n == part_size:
                yield cur, n
                cur, n = [], 0
    if n:
        yield cur, n


class _DaemonPool:
    """A small thread pool (``submit`` -> :class:`concurrent.futures.Future`) of daemon threads.

    ``concurrent.futures.ThreadPoolExecutor`` threads are joined when the
    interpreter exits, so an interrupted save would wait for every part upload
    in flight; these never keep the process alive.
    """

    def __init__(self, max_workers: int, name: str) -> None:
        self._max = max_workers
        self._name = name
        self._queue: queue.SimpleQueue[tuple[cf.Future, Callable[..., Any], tuple] | None] = \
            queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> cf.Future:
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            fut: cf.Future = cf.Future()
            self._queue.put((fut, fn, args))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max:
                t = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}",
                                     daemon=True)
                t.start()
                self._threads.append(t)
            return fut

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            del item
            if fut.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as e:  # noqa: BLE001 - handed to the future's owner
                    fut.set_exception(e)
                else:
                    fut.set_result(result)
            del fut
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new work; queued work still runs (unless ``cancel_futures``); ``wait``: join."""
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            for _ in self._threads:
                self._queue.put(None)
            threads = list(self._threads)
        if wait:
            for t in threads:
                t.join()


class _Upload:
    """One composite write in progress: its futures, the in-flight objects it may have made."""

    def __init__(self, owner: _GCSWrites, full: str) -> None:
        self.owner = owner
        self.full = full
        self.cancelled = threading.Event()
        self.futures: list[cf.Future] = []
        self.abandoned_by_close = False
        self.pool: _DaemonPool | None = None  # the pool its parts went to
        self._made: list[str] = []  # in-flight names whose creation started
        self._lock = threading.Lock()
        self._cleaning = False

    def begin(self, name: str) -> None:
        """About to create in-flight object ``name``; raises :class:`_Abandoned` once cancelled."""
        with self._lock:
            if self.cancelled.is_set():
                raise _Abandoned(f"{self.owner._gs(self.full)}: the write was abandoned")
            self._made.append(name)

    def made(self) -> list[str]:
        with self._lock:
            return list(self._made)

    def cancel(self) -> bool:
        """Stop: nothing new starts, bodies being sent stop.  True for the first caller only."""
        with self._lock:
            self.cancelled.set()
            first, self._cleaning = not self._cleaning, True
        for f in self.futures:
            f.cancel()
        return first


_ACTIVE: set[_Upload] = set()
_ACTIVE_LOCK = threading.Lock()


def _abandon_all_at_exit() -> None:
    """At interpreter exit: abandon the composite writes still running (daemon threads)."""
    with _ACTIVE_LOCK:
        ups = list(_ACTIVE)
    deadline = time.monotonic() + CLEANUP_ON_INTERRUPT_S
    try:
        with _further_interrupts_deferred():
            for up in ups:
                up.owner._abandon(up, deadline=deadline)
    except BaseException:  # noqa: BLE001 - at exit nothing is left to tell
        return


atexit.register(_abandon_all_at_exit)


@contextlib.contextmanager
def _further_interrupts_deferred() -> Iterator[None]:
    """While a write cleans up after an interrupt on the main thread, a further Ctrl-C is
    absorbed instead of cutting the (bounded) cleanup short: the first interrupt is raised
    again right after it anyway.  Only when SIGINT has Python's default handler."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda _signum, _frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _created_unix_s(value: Any) -> float | None:
    return value.timestamp() if isinstance(value, _dt.datetime) else None


class _GCSWrites(_GCSBase):
    """The write half of :class:`~xla_ckpt.storage.gcs.GCSStorage`."""

    _upload_pool: _DaemonPool | None
    _writes_closed: bool = False
    lists_in_flight = True

    def write_atomic(self, name: str, buffers: Iterable[memoryview | bytes]) -> ObjectInfo:
        """Write the concatenation of ``buffers`` as ``name``, all or nothing.

        ``buffers`` is consumed first (no upload starts before it is), then:
        objects of at least ``config.parallel_upload_threshold_bytes`` go up
        as parts of ``config.upload_part_size_bytes`` in parallel, each
        crc32c-checked, then composed into ``name``; smaller ones up to
        :data:`MULTIPART_MAX_BYTES` in one multipart upload with the crc32c,
        and the rest as one checked part composed into ``name``.  Parts are deleted in
        every case (after an interrupt within :data:`CLEANUP_ON_INTERRUPT_S`); a failure
        leaves any previous ``name`` untouched.

        Returns:
            The new object's :class:`ObjectInfo` (size in bytes, generation).

        Raises:
            StoragePermissionError / StorageError: the upload failed (nothing
                new is visible under ``name``), or the storage was closed.
        """
        full = self._full(name)
        if self._writes_closed:
            raise StorageError(f"upload {self._gs(full)}: the storage was closed")
        pieces = [_bytes_view(b) for b in buffers]
        pieces = [p for p in pieces if len(p)]
        size = sum(len(p) for p in pieces)
        if size < self.config.parallel_upload_threshold_bytes and size <= MULTIPART_MAX_BYTES:
            crc = 0
            for p in pieces:
                crc = crc32c(p, crc)
            res = self._upload_multipart(full, pieces, size, crc)
        else:
            res = self._upload_composite(full, pieces, size)
        return ObjectInfo(name=name.strip("/"), size=int(res.get("size", size)),
                          generation=int(res["generation"]) if res.get("generation") else None)

    def list_in_flight(self, prefix: str = "") -> list[InFlightObject]:
        """In-flight objects (parts, intermediate composes) under ``prefix``, sorted by name.

        Only names of the form :data:`IN_FLIGHT_NAME` are reported; each with its size and
        the service's creation time.
        """
        p = prefix.strip("/")
        base = join(self.prefix, p)
        strip = len(self.prefix) + 1 if self.prefix else 0

        def run() -> list[tuple[str, int, float | None]]:
            return [(b.name, int(b.size or 0), _created_unix_s(b.time_created))
                    for b in self._conn.client.list_blobs(self.bucket_name, prefix=base or None,
                                                          retry=None, timeout=self._timeout)]

        out = []
        for n, size, created in self._api(f"list {self._gs(base)}", run):
            if base and not n.startswith(base + "/"):
                continue
            m = IN_FLIGHT_NAME.fullmatch(n)
            if m is None or len(n) <= strip:
                continue
            out.append(InFlightObject(name=n[strip:], target=m["target"][strip:],
                                      upload_id=m["upload_id"], size=size,
                                      created_unix_s=created))
        return sorted(out, key=lambda o: o.name)

    def close(self) -> None:
        """Abandon the composite writes still running on this storage, then release threads."""
        self._writes_closed = True
        with _ACTIVE_LOCK:
            mine = [up for up in _ACTIVE if up.owner is self]
        deadline = time.monotonic() + CLEANUP_ON_INTERRUPT_S
        with _further_interrupts_deferred():
            for up in mine:
                up.abandoned_by_close = True
                self._abandon(up, deadline=deadline)
        with self._pool_lock:
            pool, self._upload_pool = self._upload_pool, None
        if pool is not None:
            pool.shutdown(wait=not mine)
        super().close()

    def _upload_multipart(self, full: str, pieces: Sequence[memoryview], size: int,
                          crc: int) -> dict[str, Any]:
        """One multipart upload carrying the crc32c: the service checks it before it is visible."""
        boundary = f"==xla_ckpt_{uuid.uuid4().hex}=="
        meta = json.dumps({"name": full, "contentType": "application/octet-stream",
                           "crc32c": crc32c_b64(crc)}).encode()
        head = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                ).encode() + meta + (f"\r\n--{boundary}\r\nContent-Type: application/"
                                     "octet-stream\r\n\r\n").encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        url = f"{self._conn.endpoint}/upload/storage/v1/b/{self.bucket_name}/o"
        res = self._send(f"upload {self._gs(full)} ({size} bytes)", "POST", url,
                         params={"uploadType": "multipart"},
                         headers={"Content-Type": f"multipart/related; boundary={boundary}"},
                         body=lambda: _BodyReader([memoryview(head), *pieces, memoryview(tail)]))
        self._check_written(full, res, size, crc)
        return res

    def _upload_part(self, part: _Part, up: _Upload | None = None) -> int:
        """Upload one in-flight part; returns its crc32c after the service confirmed it.

        With ``up``: refused once the write is abandoned, the body stops between blocks when
        it is, and a part that lands after that deletes itself.
        """
        if up is not None:
            up.begin(part.name)
        cancelled = up.cancelled if up is not None else None
        crc = 0
        for p in part.pieces:
            crc = crc32c(p, crc)
        url = f"{self._conn.endpoint}/upload/storage/v1/b/{self.bucket_name}/o"
        what = f"upload part {self._gs(part.name)} ({part.size} bytes)"
        backoff = self._backoff(what)
        while True:
            res = self._send(what, "POST", url, params={"uploadType": "media", "name": part.name},
                             headers={"Content-Type": "application/octet-stream"},
                             body=lambda: _BodyReader(part.pieces, cancelled))
            if cancelled is not None and cancelled.is_set():
                self._delete_one_quietly(part.name)
                raise _Abandoned(f"{what}: the write was abandoned; the part was deleted")
            served = crc32c_from_b64(res.get("crc32c"))
            if _int_header(str(res.get("size"))) == part.size and served in (None, crc):
                return crc
            backoff.failed(f"the service stored {res.get('size')} bytes with crc32c "
                           f"{res.get('crc32c')}, sent {part.size} bytes with crc32c "
                           f"{crc32c_b64(crc)}")

    def _upload_composite(self, full: str, pieces: Sequence[memoryview],
                          size: int) -> dict[str, Any]:
        up = _Upload(self, full)
        with _ACTIVE_LOCK:
            _ACTIVE.add(up)
        try:
            try:
                cfg = self.config
                part_size = cfg.upload_part_size_bytes \
                    if size >= cfg.parallel_upload_threshold_bytes else size
                uid = uuid.uuid4().hex[:12]
                parts = [_Part(f"{full}{TMP_MARK}{uid}-part-{i:05d}", tuple(ps), n)
                         for i, (ps, n) in enumerate(_split(pieces, part_size))]
                pool = up.pool = self._uploads()
                for p in parts:
                    if up.cancelled.is_set():
                        raise _Abandoned(f"{self._gs(full)}: the write was abandoned")
                    try:
                        fut = pool.submit(self._upload_part, p, up)
                    except RuntimeError:  # another write's interrupt dropped the pool
                        pool = up.pool = self._uploads()
                        fut = pool.submit(self._upload_part, p, up)
                    up.futures.append(fut)
                crcs = [f.result() for f in up.futures]
                sources = [(p.name, p.size, c) for p, c in zip(parts, crcs, strict=True)]
                res = self._compose_tree(full, sources, uid, up)
                self._delete_quietly(up.made())
            except BaseException as e:
                interrupted = not isinstance(e, Exception)
                if interrupted:
                    with _further_interrupts_deferred():
                        self._abandon(up, deadline=time.monotonic() + CLEANUP_ON_INTERRUPT_S)
                else:
                    self._abandon(up, deadline=None)
                if up.abandoned_by_close and not interrupted:
                    raise StorageError(f"upload {self._gs(full)} ({size} bytes): abandoned, the "
                                       "storage was closed while it ran; nothing new is "
                                       "visible") from e
                raise
        finally:
            with _ACTIVE_LOCK:
                _ACTIVE.discard(up)
        return res

    def _abandon(self, up: _Upload, *, deadline: float | None) -> None:
        """Stop ``up`` and delete what it wrote.  Once per write; the first caller cleans.

        ``deadline`` (``time.monotonic()``): after an interrupt, stop waiting then; the
        pool, whose threads may still send abandoned parts, is dropped, never waited for.
        ``None``: wait until the running part uploads ended, then delete (with retries).
        """
        if not up.cancel():
            return
        if deadline is None:
            try:
                cf.wait(up.futures)
                self._delete_quietly(up.made())
                return
            except BaseException:  # an interrupt while cleaning up: the bounded way, then raise
                with _further_interrupts_deferred():
                    self._abandon_within(up, time.monotonic() + CLEANUP_ON_INTERRUPT_S)
                raise
        self._abandon_within(up, deadline)

    def _abandon_within(self, up: _Upload, deadline: float) -> None:
        with self._pool_lock:
            detach = up.pool is not None and self._upload_pool is up.pool \
                and any(f.running() for f in up.futures)
            if detach:  # its threads may still be sending abandoned parts: never wait for them
                self._upload_pool = None
        if detach and up.pool is not None:
            up.pool.shutdown(wait=False)
        left = self._delete_within(up.made(), up.futures, deadline)
        if left:
            logger.warning("interrupted upload of %s: %d in-flight object(s) may be left (e.g. "
                           "%s); `xla-ckpt ls` lists them and `xla-ckpt gc --in-flight` deletes "
                           "them", self._gs(up.full), len(left), self._gs(left[0]))

    def _delete_within(self, names: list[str], running: list[cf.Future],
                       deadline: float) -> list[str]:
        """Delete ``names`` on fresh daemon threads, waiting for them (and for ``running``,
        part uploads that stop or delete themselves) until ``deadline``; a further
        ``KeyboardInterrupt`` does not cut the wait short.  Returns the names not known gone."""
        done: set[str] = set()
        lock = threading.Lock()
        todo: queue.SimpleQueue[str] = queue.SimpleQueue()
        for n in names:
            todo.put(n)

        def work() -> None:
            while True:
                try:
                    n = todo.get_nowait()
                except queue.Empty:
                    return
                if self._delete_one_quietly(n):
                    with lock:
                        done.add(n)

        threads = [threading.Thread(target=work, name=f"xla_ckpt-cleanup_{i}", daemon=True)
                   for i in range(min(len(names), max(4, self.config.max_workers)))]
        for t in threads:
            t.start()
        waiting = [f for f in running if not f.done()]
        while time.monotonic() < deadline:
            try:
                for t in threads:
                    t.join(max(0.0, deadline - time.monotonic()))
                cf.wait(waiting, timeout=max(0.0, deadline - time.monotonic()))
                break
            except KeyboardInterrupt:
                continue  # a second Ctrl-C: the cleanup is bounded anyway, finish it
        with lock:
            return [n for n in names if n not in done]

    def _compose_tree(self, full: str, sources: list[tuple[str, int, int]], uid: str,
                      up: _Upload) -> dict[str, Any]:
        level = 0
        while len(sources) > MAX_COMPOSE_SOURCES:
            grouped = []
            for j in range(0, len(sources), MAX_COMPOSE_SOURCES):
                group = sources[j:j + MAX_COMPOSE_SOURCES]
                if len(group) == 1:
                    grouped.append(group[0])
                    continue
                name = f"{full}{TMP_MARK}{uid}-compose-{level}-{j // MAX_COMPOSE_SOURCES:05d}"
                up.begin(name)
                size, crc, _gen = self._compose(name, group)
                grouped.append((name, size, crc))
            sources, level = grouped, level + 1
        if up.cancelled.is_set():
            raise _Abandoned(f"{self._gs(full)}: the write was abandoned")
        size, crc, gen = self._compose(full, sources)
        return {"size": size, "generation": gen, "crc32c": crc32c_b64(crc)}

    def _compose(self, dest: str, sources: list[tuple[str, int, int]]
                 ) -> tuple[int, int, int | None]:
        """Compose ``sources`` (name, size, crc32c) into ``dest``: (size, crc32c, generation)."""
        size, crc = 0, 0
        for _name, n, c in sources:
            crc = crc32c_combine(crc, c, n)
            size += n
        blob = self._bucket.blob(dest)
        blob.content_type = "application/octet-stream"
        blob.crc32c = crc32c_b64(crc)
        srcs = [self._bucket.blob(name) for name, _n, _c in sources]
        self._api(f"compose {self._gs(dest)} from {len(srcs)} parts",
                  lambda: blob.compose(srcs, retry=None, timeout=self._timeout))
        served = crc32c_from_b64(blob.crc32c)
        if int(blob.size or 0) != size or served not in (None, crc):
            raise StorageError(f"compose {self._gs(dest)}: the service reports {blob.size} bytes "
                               f"with crc32c {blob.crc32c}, expected {size} bytes with crc32c "
                               f"{crc32c_b64(crc)}; write it again")
        gen = int(blob.generation) if blob.generation else None
        self._conn.remember(dest, gen, size, crc)
        return size, crc, gen

    def _check_written(self, full: str, res: dict[str, Any], size: int, crc: int) -> None:
        served = crc32c_from_b64(res.get("crc32c"))
        if _int_header(str(res.get("size"))) != size or served not in (None, crc):
            raise StorageError(f"upload {self._gs(full)}: the service stored {res.get('size')} "
                               f"bytes with crc32c {res.get('crc32c')}, sent {size} bytes with "
                               f"crc32c {crc32c_b64(crc)}; write it again")
        gen = res.get("generation")
        self._conn.remember(full, int(gen) if gen else None, size, crc)

    def _delete_one_quietly(self, full: str) -> bool:
        """Delete in-flight object ``full``; True when it is gone (deleted, or never there)."""
        try:
            self._api(f"delete {self._gs(full)}",
                      lambda: self._bucket.delete_blob(full, retry=None, timeout=self._timeout))
        except CheckpointNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - cleanup must not mask the real outcome
            logger.warning("could not delete in-flight object %s: %s; `xla-ckpt ls` lists it and "
                           "`xla-ckpt gc --in-flight` deletes it", self._gs(full), e)
            return False
        return True

    def _delete_quietly(self, names: Sequence[str]) -> None:
        if not names:
            return
        pool = self._uploads()
        cf.wait([pool.submit(self._delete_one_quietly, n) for n in names])

    def _uploads(self) -> _DaemonPool:
        with self._pool_lock:
            if self._upload_pool is None:
                self._upload_pool = _DaemonPool(self.config.max_workers, "xla_ckpt-upload")
            return self._upload_pool
