"""In-flight objects of the GCS backend: their names, interrupted and abandoned writes, cleanup.

A composite write (:mod:`.writes`) uploads its parts under in-flight names
(``<name>.tmp-<id>-part-<n>``, intermediate composes ``<name>.tmp-<id>-compose-<level>-<n>``,
:data:`IN_FLIGHT_NAME`); this module holds what happens to them when the write does
not finish (Ctrl-C, a closed storage, the interpreter exiting):

* everything from naming the parts to the last compose runs inside the
  cleanup, so an interrupt at any point (even while the upload threads start)
  stops submitting parts, cancels those not started, stops the bodies being
  sent, and deletes the parts already written;
* after a ``KeyboardInterrupt`` (a first or a second one) that deletion is
  bounded by :data:`CLEANUP_ON_INTERRUPT_S`, then the interrupt is raised
  again: the upload threads are daemon threads (:class:`_DaemonPool`), so part
  uploads still in flight never keep the process alive; one that lands
  afterwards deletes itself while the process lives;
* :meth:`_GCSInFlight.close` abandons the writes still running on that storage
  (the manager closes the storage of a save it abandons; a Ctrl-C during that
  bounded cleanup is raised once it is done, never lost), and at interpreter
  exit every write still running is abandoned the same way;
* what is still left (the process was killed) keeps its in-flight name:
  :meth:`_GCSInFlight.list_in_flight` reports it, ``xla-ckpt ls`` shows it and
  ``xla-ckpt gc --in-flight`` deletes it once it is older than the grace period.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import datetime as _dt
import email.utils
import logging
import queue
import re
import signal
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Sequence
from urllib.parse import quote

from xla_ckpt.errors import CheckpointNotFoundError
from xla_ckpt.storage.base import InFlightObject, join
from xla_ckpt.storage.gcs.transport import _GCSBase, _Transient

logger = logging.getLogger(__name__)

TMP_MARK = ".tmp-"
"""In-flight objects (upload parts) carry this in their name; :meth:`GCSStorage.list` hides them."""

IN_FLIGHT_NAME = re.compile(
    r"(?P<target>.+)\.tmp-(?P<upload_id>[0-9a-f]{12})-(?:part-\d{5,}|compose-\d+-\d{5,})")
"""The full name of an in-flight object this backend writes: ``<target>.tmp-<id>-part-<n>``
(an uploaded part) or ``<target>.tmp-<id>-compose-<level>-<n>`` (an intermediate compose)."""

CLEANUP_ON_INTERRUPT_S = 0.5
"""After a ``KeyboardInterrupt`` (or at interpreter exit), how long a composite write waits for
the deletion of its parts before it raises again; what is not deleted by then is listed by
``xla-ckpt ls`` and collected by ``xla-ckpt gc``."""


class _Abandoned(Exception):
    """A part upload stopped because its write was abandoned (interrupted, storage closed)."""


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

    def __init__(self, owner: _GCSInFlight, full: str) -> None:
        self.owner = owner
        self.full = full
        self.cancelled = threading.Event()
        self.futures: list[cf.Future] = []
        self.abandoned_by_close = False
        self.pool: _DaemonPool | None = None  # the pool its parts went to
        self._made: list[str] = []  # in-flight names whose creation started
        self._lock = threading.Lock()
        self._cleaning = False
        self.metadata: Mapping[str, str] | None = None  # the target's custom metadata

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
def _further_interrupts_deferred() -> Iterator[list[int]]:
    """While a write cleans up on the main thread, a Ctrl-C is absorbed instead of cutting
    the (bounded) cleanup short.  Only when SIGINT has Python's default handler.

    Yields the list of the signals absorbed: after an interrupt the first one is raised
    again right after the cleanup anyway; a caller with no interrupt of its own to raise
    (:meth:`_GCSInFlight.close`) raises KeyboardInterrupt when the list is not empty."""
    absorbed: list[int] = []
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield absorbed
        return
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: absorbed.append(signum))
    try:
        yield absorbed
    finally:
        signal.signal(signal.SIGINT, previous)


def _created_unix_s(value: Any) -> float | None:
    return value.timestamp() if isinstance(value, _dt.datetime) else None


class _GCSInFlight(_GCSBase):
    """The in-flight half of :class:`~xla_ckpt.storage.gcs.GCSStorage`: list, abandon, clean up."""

    _upload_pool: _DaemonPool | None
    _writes_closed: bool = False
    lists_in_flight = True

    def list_in_flight(self, prefix: str = "") -> list[InFlightObject]:
        """In-flight objects (parts, intermediate composes) under ``prefix``, sorted by name.

        Only names of the form :data:`IN_FLIGHT_NAME` are reported; each with its size and
        the service's creation time.
        """
        p = prefix.strip("/")
        base = join(self.prefix, p)
        strip = len(self.prefix) + 1 if self.prefix else 0

        def run(timeout: tuple[float, float]) -> list[tuple[str, int, float | None]]:
            return [(b.name, int(b.size or 0), _created_unix_s(b.time_created))
                    for b in self._conn.client.list_blobs(self.bucket_name, prefix=base or None,
                                                          retry=None, timeout=timeout)]

        out = []
        for n, size, created in self._api(f"list {self._gs(base)}", run, bucket_404=True):
            if base and not n.startswith(base + "/"):
                continue
            m = IN_FLIGHT_NAME.fullmatch(n)
            if m is None or len(n) <= strip:
                continue
            out.append(InFlightObject(name=n[strip:], target=m["target"][strip:],
                                      upload_id=m["upload_id"], size=size,
                                      created_unix_s=created))
        return sorted(out, key=lambda o: o.name)

    def now_unix_s(self) -> float:
        """The service's current time, Unix seconds, from the ``Date`` header of an answer
        about the bucket: the clock of ``timeCreated`` (:meth:`list_in_flight`), whatever
        this host's clock says.  ``Date`` has whole seconds; this is the end of its second,
        so an object created just before the call is never younger than 0 s (``--grace 0``
        collects it) and an age is at most 1 s more than exact (a grace period of an hour
        is cut short by at most that second).  Without a ``Date`` header (never seen from
        GCS or the emulator) this host's clock is used, with a warning.

        Raises:
            BucketNotFoundError: the bucket does not exist.
            StorageDeadlineError / StorageError: the service did not answer (after retries).
        """
        bucket = self.bucket_name
        what = f"read the clock of gs://{bucket}"
        url = f"{self._conn.endpoint}/storage/v1/b/{quote(bucket, safe='')}"
        clock = self._clock()
        backoff = self._backoff(what, clock)
        while True:
            try:
                with clock.attempt():
                    resp = self._request(what, "GET", url, clock, params={"fields": "name"})
                    try:
                        status, date = resp.status_code, resp.headers.get("Date")
                        if status in (408, 429) or status >= 500:
                            raise self._http_error(what, resp)
                    finally:
                        resp.close()
            except _Transient as e:
                self._stop_if_over(what, clock)
                backoff.failed(e, retry_after_s=e.retry_after_s)
                continue
            break
        if status == 404:
            missing = self._missing_bucket(what)
            if missing is not None:
                raise missing
        try:
            when = email.utils.parsedate_to_datetime(date) if date else None
        except (TypeError, ValueError):
            when = None
        if when is None:
            logger.warning("%s: the answer carried no usable Date header (%r); using this "
                           "host's clock for in-flight ages", what, date)
            return time.time()
        return when.timestamp() + 1.0

    def close(self) -> None:
        """Abandon the composite writes still running on this storage, then release threads.

        A Ctrl-C during that cleanup (bounded by :data:`CLEANUP_ON_INTERRUPT_S`) does not
        cut it short and is not lost: the storage is closed, then KeyboardInterrupt raised."""
        self._writes_closed = True
        with _ACTIVE_LOCK:
            mine = [up for up in _ACTIVE if up.owner is self]
        deadline = time.monotonic() + CLEANUP_ON_INTERRUPT_S
        interrupted = False
        with _further_interrupts_deferred() as absorbed:
            for up in mine:
                up.abandoned_by_close = True
                try:
                    self._abandon(up, deadline=deadline)
                except KeyboardInterrupt:  # the program's own SIGINT handler raised it
                    interrupted = True     # abandon the others too, close, then raise
        with self._pool_lock:
            pool, self._upload_pool = self._upload_pool, None
        if pool is not None:
            pool.shutdown(wait=not mine)
        super().close()
        if interrupted or absorbed:
            raise KeyboardInterrupt

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
        left, interrupted = self._delete_within(up.made(), up.futures, deadline)
        if left:
            logger.warning("interrupted upload of %s: %d in-flight object(s) may be left (e.g. "
                           "%s); `xla-ckpt ls` lists them and `xla-ckpt gc --in-flight` deletes "
                           "them", self._gs(up.full), len(left), self._gs(left[0]))
        if interrupted:
            raise KeyboardInterrupt

    def _delete_within(self, names: list[str], running: list[cf.Future],
                       deadline: float) -> tuple[list[str], bool]:
        """Delete ``names`` on fresh daemon threads, waiting for them (and for ``running``,
        part uploads that stop or delete themselves) until ``deadline``; a
        ``KeyboardInterrupt`` (from a SIGINT handler of the program's own) does not cut the
        wait short.  Returns the names not known gone, and whether one came (the caller
        raises it)."""
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
        interrupted = False
        while time.monotonic() < deadline:
            try:
                for t in threads:
                    t.join(max(0.0, deadline - time.monotonic()))
                cf.wait(waiting, timeout=max(0.0, deadline - time.monotonic()))
                break
            except KeyboardInterrupt:
                interrupted = True  # the cleanup is bounded anyway: finish it, then raise
        with lock:
            return [n for n in names if n not in done], interrupted

    def _delete_one_quietly(self, full: str) -> bool:
        """Delete in-flight object ``full``; True when it is gone (deleted, or never there)."""
        try:
            self._api(f"delete {self._gs(full)}",
                      lambda timeout: self._bucket.delete_blob(full, retry=None, timeout=timeout))
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
