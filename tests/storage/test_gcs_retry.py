"""The retry policy of the GCS backend: capped exponential backoff with full jitter, Retry-After,
max attempts without progress and an overall deadline (the policy alone, with a fake clock)."""

import email.utils
import random
import time

import pytest

from xla_ckpt.errors import StorageError
from xla_ckpt.storage import StorageConfig
from xla_ckpt.storage.retry import Backoff, RetryLog, TransientFault, parse_retry_after


class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.slept = []

    def clock(self):
        return self.now

    def sleep(self, s):
        self.slept.append(s)
        self.now += s


class Top(random.Random):
    """Jitter that always picks the top of the window, so delays are the caps."""

    def uniform(self, a: float, b: float) -> float:
        return b


def backoff(cfg, fc, log=None):
    return Backoff(cfg, "read gs://b/o bytes [0, 10)", log=log, rng=Top(), sleep=fc.sleep,
                   clock=fc.clock)


def test_delays_grow_exponentially_up_to_the_cap():
    fc = FakeClock()
    b = backoff(StorageConfig(initial_backoff_s=0.1, max_backoff_s=0.5, max_attempts=10,
                              retry_deadline_s=100.0), fc)
    for _ in range(6):
        b.failed("HTTP 503")
    assert fc.slept == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5, 0.5])


def test_jitter_stays_inside_the_window():
    fc = FakeClock()
    b = Backoff(StorageConfig(initial_backoff_s=1.0, max_backoff_s=1.0, max_attempts=100),
                "x", sleep=fc.sleep, clock=fc.clock)
    for _ in range(50):
        b.failed("HTTP 500")
    assert all(0.0 <= s <= 1.0 for s in fc.slept) and len(set(fc.slept)) > 1


def test_retry_after_is_a_lower_bound_and_logged():
    fc = FakeClock()
    log = RetryLog()
    b = backoff(StorageConfig(initial_backoff_s=0.1, max_backoff_s=8.0), fc, log)
    b.failed("HTTP 429", retry_after_s=3.0)
    b.failed("HTTP 429", retry_after_s=0.0)
    assert fc.slept == pytest.approx([3.0, 0.2])
    (e1, e2) = log.events()
    assert (e1.attempt, e1.delay_s, e1.retry_after_s, e1.cause) == (1, 3.0, 3.0, "HTTP 429")
    assert e2.attempt == 2 and log.total == 2


def test_gives_up_after_max_attempts_without_progress_naming_request_and_cause():
    fc = FakeClock()
    b = backoff(StorageConfig(max_attempts=3), fc)
    b.failed("HTTP 503")
    b.failed(ConnectionResetError(104, "Connection reset by peer"))
    with pytest.raises(StorageError) as e:
        b.failed("HTTP 503 backend error")
    assert str(e.value) == (
        "read gs://b/o bytes [0, 10): gave up after 3 failed attempts (3 in a row without "
        "progress, storage.max_attempts=3); last error: HTTP 503 backend error. The storage "
        "service is unavailable or overloaded: retry later or raise storage.max_attempts")
    assert len(fc.slept) == 2


def test_progress_resets_the_attempt_count_but_not_the_deadline():
    fc = FakeClock()
    b = backoff(StorageConfig(max_attempts=3, initial_backoff_s=0.1, retry_deadline_s=5.0), fc)
    for _ in range(10):                       # a body that keeps breaking after some bytes
        b.failed("connection broke after 4096 of 16384 body bytes", progressed=True)
    assert b.failures == 10 and b.attempt == 1 and fc.slept == pytest.approx([0.1] * 10)
    fc.now += 5.0
    with pytest.raises(StorageError, match=r"would pass the retry deadline of 5.0 s "
                                           r"\(storage.retry_deadline_s\)"):
        b.failed("HTTP 503")


def test_deadline_counts_from_the_first_failure():
    fc = FakeClock()
    fc.now = 1e6   # a long healthy transfer before the first failure costs nothing
    b = backoff(StorageConfig(retry_deadline_s=1.0, initial_backoff_s=0.4, max_backoff_s=0.4,
                              max_attempts=100), fc)
    b.failed("HTTP 503")
    b.failed("HTTP 503")
    with pytest.raises(StorageError, match="gave up after 3 failed attempts: the next attempt"):
        b.failed("HTTP 503")


def test_retry_after_beyond_the_deadline_fails_at_once():
    fc = FakeClock()
    b = backoff(StorageConfig(retry_deadline_s=10.0), fc)
    with pytest.raises(StorageError, match=r"in 60.00 s\) would pass the retry deadline"):
        b.failed("HTTP 429", retry_after_s=60.0)
    assert fc.slept == []


@pytest.mark.parametrize("value, seconds", [("3", 3.0), (" 0.5 ", 0.5), ("-2", 0.0),
                                            ("soon", None), ("", None), (None, None)])
def test_parse_retry_after_seconds(value, seconds):
    assert parse_retry_after(value) == seconds


def test_parse_retry_after_http_date():
    when = email.utils.formatdate(time.time() + 30, usegmt=True)
    delay = parse_retry_after(when)
    assert delay is not None and 25.0 <= delay <= 31.0
    assert parse_retry_after(email.utils.formatdate(time.time() - 30, usegmt=True)) == 0.0


def test_a_worded_transient_fault_is_reported_without_its_class_name():
    fc = FakeClock()
    log = RetryLog()
    b = backoff(StorageConfig(max_attempts=2), fc, log)
    b.failed(TransientFault("short answer: 993 of the 1000 bytes asked for"))
    assert log.events()[0].cause == "short answer: 993 of the 1000 bytes asked for"
    with pytest.raises(StorageError) as e:
        b.failed(ConnectionResetError(104, "Connection reset by peer"))
    assert "last error: ConnectionResetError: [Errno 104] Connection reset by peer." in str(e.value)
