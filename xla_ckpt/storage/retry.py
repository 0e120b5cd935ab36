"""Retry budget for one storage request: capped exponential backoff, full jitter, a deadline.

DESIGN decision 7: transient failures (HTTP 408/429/5xx, connection resets,
timeouts, truncated bodies) are retried; everything else fails at once.  One
:class:`Backoff` is made per logical request (one byte range, one upload, one
metadata call) and is told about each failure; it sleeps before the next
attempt or raises :class:`~xla_ckpt.errors.StorageError` once the budget is
spent.

* delay before attempt ``n + 1``: uniform in ``[0, min(max_backoff_s,
  initial_backoff_s * 2**(n - 1))]`` ("full jitter"), and never less than the
  server's ``Retry-After``;
* the deadline (``retry_deadline_s``) starts at the first failure, so a long
  healthy transfer does not eat the retry budget;
* ``max_attempts`` counts failed attempts in a row that made no progress: a
  broken body that delivered bytes resumes from the last good byte and starts
  a fresh count (the deadline still bounds the whole request);
* with a :class:`~xla_ckpt.storage.cancel.RequestClock` the request's total deadline
  (``request_deadline_s``, from its start) bounds the backoff too, and a cancelled
  request stops sleeping at once (:class:`~xla_ckpt.storage.cancel.Abandoned`).
"""

from __future__ import annotations

import email.utils
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from xla_ckpt.errors import StorageDeadlineError, StorageError
from xla_ckpt.storage.base import StorageConfig
from xla_ckpt.storage.cancel import RequestClock

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryEvent:
    """One retried failure, as recorded in :class:`RetryLog`.

    Attributes:
        what: the request, e.g. ``"read gs://b/o bytes [0, 1048576)"``.
        attempt: failed attempts in a row so far (1 = first failure).
        delay_s: seconds slept before the next attempt.
        retry_after_s: the server's ``Retry-After`` in seconds, if it sent one.
        cause: one-line cause.
    """

    what: str
    attempt: int
    delay_s: float
    retry_after_s: float | None
    cause: str


class RetryLog:
    """Thread-safe, bounded record of retries (for ``xla-ckpt`` diagnostics and tests)."""

    def __init__(self, maxlen: int = 10_000) -> None:
        self._events: deque[RetryEvent] = deque(maxlen=maxlen)
        self._lock = threading.Lock()
        self.total = 0

    def add(self, event: RetryEvent) -> None:
        with self._lock:
            self._events.append(event)
            self.total += 1

    def events(self) -> list[RetryEvent]:
        with self._lock:
            return list(self._events)

    def clear(self) -> None:
        with self._lock:
            self._events.clear()
            self.total = 0


def parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` (delta-seconds or HTTP-date); None if absent/bad.

    Fractional seconds (``"0.5"``) are accepted although HTTP only defines
    integers; negative values count as 0.
    """
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - time.time())


class TransientFault(Exception):
    """A retryable failure whose message says all there is to say about it.

    Backends raise subclasses for failures they word themselves (an HTTP
    status, a short answer); :meth:`Backoff.failed` logs and reports their
    message without the class name, which would only name library internals.
    """


class Backoff:
    """The retry budget of one logical request (see the module docstring).

    Args:
        config: ``initial_backoff_s``, ``max_backoff_s``, ``max_attempts``,
            ``retry_deadline_s`` are read from it.
        what: names the request in log lines and in the final error.
        log: where each retry is recorded (optional).
        rng / sleep / clock: injectable for tests of the policy itself; ``clock`` may
            instead be the request's :class:`~xla_ckpt.storage.cancel.RequestClock`: its
            total deadline then bounds the backoff, and its sleeps end when its scope is
            cancelled.
    """

    def __init__(self, config: StorageConfig, what: str, *, log: RetryLog | None = None,
                 rng: random.Random | None = None, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] | RequestClock | None = None) -> None:
        self.config = config
        self.what = what
        self.log = log
        self._rng = rng or random
        self._request: RequestClock | None = None
        if isinstance(clock, RequestClock):
            self._request = clock
            if sleep is time.sleep:
                sleep = clock.sleep
            clock = None
        self._sleep = sleep
        self._clock: Callable[[], float] = clock or time.monotonic
        self._deadline: float | None = None
        self.attempt = 0          # failures in a row without progress
        self.failures = 0         # all failures of this request

    def failed(self, cause: BaseException | str, *, retry_after_s: float | None = None,
               progressed: bool = False) -> None:
        """Record a retryable failure, then sleep before the next attempt.

        Args:
            cause: the transient error (its text goes into logs and the final error).
            retry_after_s: the server's ``Retry-After``, honoured as a lower
                bound on the delay.
            progressed: the failed attempt delivered bytes (resets the attempt count).

        Raises:
            StorageError: ``max_attempts`` failures in a row without progress,
                or the next attempt would start after the deadline.  The
                message names the request, the attempts and the last cause.
            StorageDeadlineError: the next attempt would start after the request's total
                deadline (with a :class:`~xla_ckpt.storage.cancel.RequestClock`).
            Abandoned: the request's cancel scope was cancelled during the backoff.
        """
        now = self._clock()
        if self._deadline is None:
            self._deadline = now + self.config.retry_deadline_s
        self.failures += 1
        self.attempt = 1 if progressed else self.attempt + 1
        text = _one_line(cause)
        if self.attempt >= self.config.max_attempts:
            raise StorageError(
                f"{self.what}: gave up after {self.failures} failed attempts "
                f"({self.attempt} in a row without progress, storage.max_attempts="
                f"{self.config.max_attempts}); last error: {text}. The storage service is "
                "unavailable or overloaded: retry later or raise storage.max_attempts")
        cfg = self.config
        cap = min(cfg.max_backoff_s, cfg.initial_backoff_s * 2 ** (self.attempt - 1))
        delay = self._rng.uniform(0.0, cap)
        if retry_after_s is not None:
            delay = max(delay, retry_after_s)
        if now + delay > self._deadline:
            raise StorageError(
                f"{self.what}: gave up after {self.failures} failed attempts: the next attempt "
                f"(in {delay:.2f} s) would pass the retry deadline of "
                f"{self.config.retry_deadline_s:.1f} s (storage.retry_deadline_s); last error: "
                f"{text}. Retry later or raise storage.retry_deadline_s")
        req = self._request
        if req is not None and req.remaining_s() < delay:
            raise StorageDeadlineError(
                f"{self.what}: gave up after {self.failures} failed attempts: the next attempt "
                f"(in {delay:.2f} s) would pass the request's total deadline of "
                f"{req.deadline_s:g} s (storage.request_deadline_s); last error: {text}. Retry "
                "later or raise storage.request_deadline_s", deadline_s=req.deadline_s)
        logger.info("%s: attempt %d failed (%s); retrying in %.3f s", self.what, self.failures,
                    text, delay)
        if self.log is not None:
            self.log.add(RetryEvent(self.what, self.attempt, delay, retry_after_s, text))
        if delay > 0:
            self._sleep(delay)


def _one_line(cause: BaseException | str) -> str:
    if isinstance(cause, TransientFault):
        text = str(cause)
    elif isinstance(cause, BaseException):
        text = f"{type(cause).__name__}: {cause}"
    else:
        text = str(cause)
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."
