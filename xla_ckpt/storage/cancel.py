"""Stopping storage requests that are in flight: total deadlines and cancel scopes.

A network request can block in a socket read for as long as the server keeps sending a
few bytes now and then: a per-read socket timeout never fires on a trickle, and a thread
blocked there ignores a Ctrl-C sent to the main thread.  Both are stopped the same way
here, by shutting down the connection the request is reading from, which ends the blocked
read at once:

* :class:`RequestClock`: one logical request's **total deadline**
  (:attr:`StorageConfig.request_deadline_s <xla_ckpt.storage.base.StorageConfig>`), retries
  and backoff included.  While an attempt runs (:meth:`RequestClock.attempt`), the
  connection it reads from is registered (:func:`watch_connection`, called by the network
  backend once the answer's headers arrived) and shut down by a watchdog thread when the
  deadline passes; the backend then raises :class:`~xla_ckpt.errors.StorageDeadlineError`.
* :class:`CancelScope`: a group of requests running on several threads (the slices of one
  parallel read).  :meth:`CancelScope.cancel` shuts down the connections its requests are
  reading from, wakes their backoff sleeps, and makes them raise :class:`Abandoned` instead
  of retrying.  :func:`run_all` runs tasks on a thread pool in one scope and cancels it on
  the first failure, or at once on a ``KeyboardInterrupt``, which it raises within
  :data:`INTERRUPT_WAIT_S` instead of waiting for the slices in flight.

A thread's current scope is thread-local (:func:`current_scope`, entered with
:func:`in_scope`); scopes nest (cancelling one cancels those opened inside it).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import heapq
import itertools
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Iterator, Sequence

from xla_ckpt.errors import StorageError

logger = logging.getLogger(__name__)

INTERRUPT_WAIT_S = 0.5
"""After a ``KeyboardInterrupt`` during :func:`run_all`, how long it waits for the tasks in
flight to notice their cancelled connections before it raises anyway (seconds)."""

Closer = Callable[[], None]


class Abandoned(StorageError):
    """A request stopped because its :class:`CancelScope` was cancelled (another slice of the
    same read failed, or the read was interrupted); never retried, never what a caller sees:
    :func:`run_all` raises the failure or the interrupt that cancelled the scope."""


class CancelScope:
    """Cancellation of a group of storage requests running on any threads.

    Args:
        parent: a scope whose cancellation cancels this one too (None: none).

    Thread-safe.  Requests register the connection they read from (:meth:`add`) and take it
    back when their attempt ends (:meth:`discard`).
    """

    def __init__(self, parent: CancelScope | None = None) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._closers: dict[int, Closer] = {}
        self._ids = itertools.count()
        self._children: set[CancelScope] = set()
        self._parent = parent
        if parent is not None:
            with parent._lock:
                parent._children.add(self)
            if parent.cancelled:
                self.cancel()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        """Stop every request of this scope (and of the scopes inside it): their connections
        are shut down now, their backoff sleeps end, their next attempt raises
        :class:`Abandoned`."""
        with self._lock:
            self._event.set()
            closers = list(self._closers.values())
            self._closers.clear()
            children = list(self._children)
        for close in closers:
            _quietly(close)
        for child in children:
            child.cancel()

    def close(self) -> None:
        """Detach from the parent scope (the group is done)."""
        if self._parent is not None:
            with self._parent._lock:
                self._parent._children.discard(self)

    def sleep(self, seconds: float) -> bool:
        """Sleep ``seconds`` unless cancelled first; True when cancelled."""
        return self._event.wait(seconds) if seconds > 0 else self.cancelled

    def add(self, close: Closer) -> int | None:
        """Register a connection's closer; None (and it is called now) if already cancelled."""
        with self._lock:
            if not self._event.is_set():
                key = next(self._ids)
                self._closers[key] = close
                return key
        _quietly(close)
        return None

    def discard(self, key: int | None) -> None:
        if key is not None:
            with self._lock:
                self._closers.pop(key, None)


_local = threading.local()


def current_scope() -> CancelScope | None:
    """The cancel scope of the calling thread (None outside :func:`in_scope`)."""
    return getattr(_local, "scope", None)


@contextlib.contextmanager
def in_scope(scope: CancelScope | None) -> Iterator[CancelScope | None]:
    """Make ``scope`` the calling thread's current scope for the block."""
    previous = getattr(_local, "scope", None)
    _local.scope = scope
    try:
        yield scope
    finally:
        _local.scope = previous


class _Watchdog:
    """One daemon thread that calls closers when their deadline (``time.monotonic()``) passes.

    Arming and disarming cost a dict entry and a heap push; the thread is woken only when a
    new deadline comes before every other one.  Disarmed entries leave the heap when they
    reach its top, or all at once when they outnumber the armed ones."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._armed: dict[int, tuple[float, Closer]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, at: float, close: Closer) -> int:
        with self._cond:
            key = next(self._ids)
            self._armed[key] = (at, close)
            if len(self._heap) > 4096 and len(self._heap) > 2 * len(self._armed):
                self._heap = [(t, k) for k, (t, _) in self._armed.items()]
                heapq.heapify(self._heap)
            else:
                heapq.heappush(self._heap, (at, key))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="xla_ckpt-deadlines",
                                                daemon=True)
                self._thread.start()
            if self._heap[0][1] == key:
                self._cond.notify()
            return key

    def disarm(self, key: int) -> None:
        with self._cond:
            self._armed.pop(key, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][1] not in self._armed:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                at, key = self._heap[0]
                wait = at - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
                _, close = self._armed.pop(key)
            _quietly(close)


_WATCHDOG = _Watchdog()


def _after_fork_in_child() -> None:
    global _WATCHDOG
    _WATCHDOG = _Watchdog()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class RequestClock:
    """The total deadline of one logical storage request, retries and backoff included.

    Args:
        deadline_s: seconds from now (:attr:`StorageConfig.request_deadline_s
            <xla_ckpt.storage.base.StorageConfig>`).
        scope: the cancel scope its attempts belong to (default: the calling thread's).

    Use :meth:`attempt` around each attempt; the backend calls :func:`watch_connection`
    inside it with the connection the attempt reads from.
    """

    def __init__(self, deadline_s: float, scope: CancelScope | None = None) -> None:
        self.deadline_s = float(deadline_s)
        self.started = time.monotonic()
        self.deadline_at = self.started + self.deadline_s
        self.scope = scope if scope is not None else current_scope()
        self._keys: list[tuple[int | None, int]] = []
        self._lock = threading.Lock()

    def remaining_s(self) -> float:
        return self.deadline_at - time.monotonic()

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline_at

    @property
    def cancelled(self) -> bool:
        return self.scope is not None and self.scope.cancelled

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def timeout(self, connect_s: float, read_s: float) -> tuple[float, float]:
        """``(connect, read)`` socket timeouts for the next attempt: the usual ones, cut to
        what is left of the deadline (at least 0.05 s, so an attempt is never refused at once)."""
        left = max(0.05, self.remaining_s())
        return min(connect_s, left), min(read_s, left)

    def sleep(self, seconds: float) -> None:
        """Back off ``seconds``; raises :class:`Abandoned` when the scope is cancelled meanwhile."""
        if self.scope is not None:
            if self.scope.sleep(seconds):
                raise Abandoned("the read this request belongs to was stopped")
        elif seconds > 0:
            time.sleep(seconds)

    @contextlib.contextmanager
    def attempt(self) -> Iterator[RequestClock]:
        """One attempt: connections registered inside are shut down at the deadline or when the
        scope is cancelled, and taken back (never shut down) once the block ends."""
        if self.cancelled:
            raise Abandoned("the read this request belongs to was stopped")
        previous = getattr(_local, "attempt", None)
        _local.attempt = self
        try:
            yield self
        finally:
            _local.attempt = previous
            with self._lock:
                keys, self._keys = self._keys, []
            for scope_key, dog_key in keys:
                if self.scope is not None:
                    self.scope.discard(scope_key)
                _WATCHDOG.disarm(dog_key)

    def _watch(self, close: Closer) -> None:
        done = threading.Event()

        def once() -> None:  # the deadline and the scope may both fire: shut down once
            if not done.is_set():
                done.set()
                close()

        scope_key = self.scope.add(once) if self.scope is not None else None
        dog_key = _WATCHDOG.arm(self.deadline_at, once)
        with self._lock:
            self._keys.append((scope_key, dog_key))


def watch_connection(sock: Any) -> None:
    """Register ``sock`` (the socket an answer is being read from) with the calling thread's
    current attempt, if any: it is shut down when that request's deadline passes or its scope
    is cancelled.  Called by the network backend's transport after each answer's headers."""
    clock: RequestClock | None = getattr(_local, "attempt", None)
    if clock is None or sock is None:
        return

    def shut() -> None:
        sock.shutdown(socket.SHUT_RDWR)

    clock._watch(shut)


def run_all(pool: cf.Executor, fn: Callable[..., None], tasks: Sequence[tuple]) -> None:
    """Run ``fn(*task)`` for every task on ``pool``, all in one :class:`CancelScope`.

    Returns when all have succeeded.  On the first failure the scope is cancelled (the
    requests still running stop reading and raise :class:`Abandoned`), tasks not started are
    cancelled, the running ones are waited for (they end at once now, so the buffers they
    write into are the caller's again), and the failure is raised.  On a ``KeyboardInterrupt``
    (or another ``BaseException``) in the waiting thread the same happens, but the wait for
    the running tasks is bounded by :data:`INTERRUPT_WAIT_S`: the interrupt is raised within
    about that long, whatever the requests in flight were doing.
    """
    scope = CancelScope(current_scope())

    def run(task: tuple) -> None:
        with in_scope(scope):
            if scope.cancelled:
                raise Abandoned("the read this slice belongs to was stopped")
            fn(*task)

    futures: list[cf.Future] = []
    try:
        for t in tasks:
            futures.append(pool.submit(run, t))
        for f in cf.as_completed(futures):
            f.result()
    except BaseException as e:
        scope.cancel()
        for f in futures:
            f.cancel()
        if isinstance(e, Exception):
            cf.wait(futures)
        else:
            left = cf.wait(futures, timeout=INTERRUPT_WAIT_S).not_done
            if left:
                logger.info("interrupted: %d read(s) still stopping in the background", len(left))
        raise
    finally:
        scope.close()


def _quietly(close: Closer) -> None:
    try:
        close()
    except OSError:
        pass  # already closed, or never connected
    except Exception:  # a closer must never break the thread that stops a request
        logger.debug("closing a connection failed", exc_info=True)
