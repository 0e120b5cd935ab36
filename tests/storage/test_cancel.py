"""The machinery under request deadlines and interrupted reads (xla_ckpt.storage.cancel), on real
sockets and threads: a connection registered by a request is shut down when its deadline passes
or its scope is cancelled (ending a blocked read at once), never after its attempt ended; a
group of tasks stops on its first failure."""

import concurrent.futures as cf
import socket
import threading
import time

import pytest

from xla_ckpt.storage.cancel import (
    Abandoned,
    CancelScope,
    RequestClock,
    current_scope,
    in_scope,
    run_all,
    watch_connection,
)

NO_HANG_S = 10.0


def _blocked_read(clock, sock, out):
    with clock.attempt():
        watch_connection(sock)
        out.append(sock.recv(10))   # the peer never sends: only a shutdown ends this


def test_a_request_past_its_deadline_has_its_connection_shut_down():
    a, b = socket.socketpair()
    try:
        clock = RequestClock(0.3)
        got: list[bytes] = []
        t0 = time.monotonic()
        _blocked_read(clock, a, got)
        assert got == [b""] and clock.expired() and not clock.cancelled
        assert time.monotonic() - t0 < NO_HANG_S
    finally:
        a.close()
        b.close()


def test_cancelling_a_scope_shuts_down_its_requests_connections():
    a, b = socket.socketpair()
    try:
        scope = CancelScope()
        got: list[bytes] = []
        with in_scope(scope):
            clock = RequestClock(300.0)
        assert clock.scope is scope
        t = threading.Thread(target=_blocked_read, args=(clock, a, got))
        t.start()
        time.sleep(0.1)
        scope.cancel()
        t.join(NO_HANG_S)
        assert not t.is_alive() and got == [b""] and clock.cancelled
        with pytest.raises(Abandoned):
            clock.sleep(30.0)   # a backoff of a cancelled request ends at once
    finally:
        a.close()
        b.close()


def test_a_connection_is_never_shut_down_after_its_attempt_ended():
    a, b = socket.socketpair()
    try:
        clock = RequestClock(0.2)
        with clock.attempt():
            watch_connection(a)
        time.sleep(0.4)     # past the deadline: the (pooled, reused) connection stays usable
        b.sendall(b"hi")
        assert a.recv(10) == b"hi"
    finally:
        a.close()
        b.close()


def test_cancelling_a_scope_cancels_the_scopes_opened_inside_it():
    outer = CancelScope()
    inner = CancelScope(outer)
    late = CancelScope(outer)
    outer.cancel()
    assert inner.cancelled and late.cancelled
    assert CancelScope(outer).cancelled   # opened after: cancelled from the start


def test_run_all_raises_the_first_failure_and_stops_the_other_tasks():
    seen: list[str] = []
    lock = threading.Lock()

    def task(i):
        if i == 3:
            time.sleep(0.1)
            raise ValueError("task 3 failed")
        scope = current_scope()
        assert scope is not None
        stopped = scope.sleep(30.0)   # a slow request, woken by the cancel
        with lock:
            seen.append("stopped" if stopped else "finished")

    with cf.ThreadPoolExecutor(8) as pool:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="task 3 failed"):
            run_all(pool, task, [(i,) for i in range(6)])
        assert time.monotonic() - t0 < NO_HANG_S
    assert seen == ["stopped"] * 5


def test_run_all_returns_when_every_task_succeeds():
    out = [0] * 20
    with cf.ThreadPoolExecutor(4) as pool:
        run_all(pool, out.__setitem__, [(i, i * i) for i in range(20)])
    assert out == [i * i for i in range(20)]
