"""A host's :class:`PeerServer` serving byte ranges of its local tier's files, read by other
hosts through :class:`PeerStorage`.

Real sockets on 127.0.0.1 and real files in temp folders, no mocks.  Each test asserts the
bytes a read returns against the file's, or the error (its class, and that it names the peer
host, the file and the range), and that nothing hangs: failures come back within the small
``timeout_s`` the tests use.
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import logging
import os
import random
import socket
import threading
import time
from pathlib import Path

import pytest

from xla_ckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    StorageError,
    StoragePermissionError,
    StorageURIError,
)
from xla_ckpt.storage import RangeRead, StorageConfig
from xla_ckpt.storage.peer import PIECE_BYTES, TOKEN_HEADER, PeerServer, PeerStorage

MiB = 1024 * 1024
BIG = "data/rank-00001.bin"
SMALL = "state-0.bin"
TOKEN = "job-1234"
HOST = 3


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A ~20 MiB file (three send pieces) and a small one, random bytes."""
    root = tmp_path_factory.mktemp("tier")
    big = root / "data" / "rank-00001.bin"
    big.parent.mkdir()
    big.write_bytes(random.Random(1).randbytes(20 * MiB + 12345))
    small = root / "state-0.bin"
    small.write_bytes(b"0123456789" * 100)
    return {BIG: big, SMALL: small}


@pytest.fixture
def server(files: dict[str, Path]):
    with PeerServer({n: str(p) for n, p in files.items()}, token=TOKEN) as srv:
        yield srv


@pytest.fixture
def peer(server: PeerServer):
    with PeerStorage(server.url, host=HOST, token=TOKEN, timeout_s=2.0) as st:
        yield st


def read(st: PeerStorage, name: str, offset: int, n: int) -> bytes:
    buf = bytearray(n)
    st.read_range(name, offset, memoryview(buf))
    return bytes(buf)


def raw(server: PeerServer, method: str, path: str,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=2.0)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


# ---- bytes -------------------------------------------------------------------------------------
def test_ranges_round_trip(files: dict[str, Path], peer: PeerStorage) -> None:
    data = files[BIG].read_bytes()
    size = len(data)
    assert peer.stat(BIG).size == size
    assert peer.stat(SMALL).size == 1000
    for offset, n in [(0, 100), (size // 2 - 7, 4097), (size - 100, 100), (size - 1, 1),
                      (PIECE_BYTES - 10, 20), (2 * PIECE_BYTES - 1, 2),
                      (1, size - 2),  # three pieces each way
                      (0, size)]:
        assert read(peer, BIG, offset, n) == data[offset:offset + n], (offset, n)
    assert read(peer, SMALL, 10, 10) == b"0123456789"
    peer.read_range(BIG, 5, memoryview(bytearray(0)))  # nothing asked, nothing sent


def test_reads_through_the_storage_helpers(files: dict[str, Path], server: PeerServer) -> None:
    """read_ranges (parallel slices) and read_bytes work on a PeerStorage as on any Storage."""
    data = files[BIG].read_bytes()
    cfg = StorageConfig(max_workers=4, slice_size_bytes=3 * MiB)
    with PeerStorage(server.url, host=HOST, token=TOKEN, timeout_s=2.0, config=cfg) as st:
        out = bytearray(len(data))
        st.read_ranges([RangeRead(BIG, 0, memoryview(out))])
        assert out == data
        assert st.read_bytes(SMALL) == files[SMALL].read_bytes()
        with st.child("data") as sub:
            assert sub.stat("rank-00001.bin").size == len(data)
            assert read(sub, "rank-00001.bin", 100, 50) == data[100:150]
            assert sub.url("rank-00001.bin") == f"{server.url}/data/rank-00001.bin"


def test_many_threads_one_storage(files: dict[str, Path], peer: PeerStorage) -> None:
    data = files[BIG].read_bytes()
    rng = random.Random(7)
    ranges = []
    for _ in range(64):
        n = rng.choice([1, 4096, 300_000, 3 * MiB])
        offset = rng.randrange(0, len(data) - n)
        ranges.append((offset, n))
    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda r: read(peer, BIG, *r), ranges))
    for (offset, n), b in zip(ranges, got, strict=True):
        assert b == data[offset:offset + n]
    assert 1 <= len(peer._conns) <= 8  # one kept-alive connection per thread


def test_quoted_names(tmp_path: Path) -> None:
    name = "odd dir/a%20b?#é.bin"
    path = tmp_path / "odd"
    path.write_bytes(b"abcdef")
    with PeerServer({name: str(path)}) as srv, PeerStorage(srv.url, host=0) as st:
        assert st.stat(name).size == 6
        assert read(st, name, 2, 3) == b"cde"
        with pytest.raises(CheckpointNotFoundError):
            st.stat("odd dir/a b?#é.bin")


# ---- errors ------------------------------------------------------------------------------------
def test_not_served_and_deleted_files(files: dict[str, Path], tmp_path: Path) -> None:
    gone = tmp_path / "gone.bin"
    gone.write_bytes(b"x" * 10)
    served = {n: str(p) for n, p in files.items()} | {"gone.bin": str(gone)}
    with PeerServer(served, token=TOKEN) as srv, \
            PeerStorage(srv.url, host=HOST, token=TOKEN, timeout_s=2.0) as st:
        assert read(st, "gone.bin", 0, 10) == b"x" * 10
        gone.unlink()
        for name in ("data/rank-00002.bin", "gone.bin"):
            with pytest.raises(CheckpointNotFoundError) as e:
                st.stat(name)
            assert f"peer host {HOST} ({srv.url})" in str(e.value) and name in str(e.value)
            with pytest.raises(StorageError) as r:
                read(st, name, 0, 4)
            assert f"peer host {HOST}" in str(r.value) and name in str(r.value)
            assert "bytes [0, 4)" in str(r.value) and "404" in str(r.value)
        assert not st.exists("gone.bin")
        assert read(st, SMALL, 0, 4) == b"0123"  # the connection is still good


def test_range_past_the_end(peer: PeerStorage, files: dict[str, Path]) -> None:
    size = files[SMALL].stat().st_size
    for offset, n in [(size - 5, 6), (size, 1), (size + 100, 10)]:
        with pytest.raises(StorageError) as e:
            read(peer, SMALL, offset, n)
        msg = str(e.value)
        assert f"peer host {HOST}" in msg and SMALL in msg
        assert f"bytes [{offset}, {offset + n})" in msg and f"file of {size} bytes" in msg
    assert read(peer, SMALL, size - 5, 5) == b"56789"


def test_wrong_token(server: PeerServer) -> None:
    for token in ("job-9999", ""):
        with PeerStorage(server.url, host=HOST, token=token, timeout_s=2.0) as st:
            with pytest.raises(StoragePermissionError) as e:
                read(st, BIG, 0, 10)
            assert f"peer host {HOST}" in str(e.value) and "403" in str(e.value)
            with pytest.raises(StoragePermissionError):
                st.stat(BIG)
    status, _, _ = raw(server, "GET", "/" + SMALL, {TOKEN_HEADER: "nope", "Range": "bytes=0-1"})
    assert status == 403


def test_protocol(server: PeerServer, files: dict[str, Path]) -> None:
    auth = {TOKEN_HEADER: TOKEN}
    status, headers, body = raw(server, "HEAD", "/" + BIG, auth)
    assert status == 200 and int(headers["Content-Length"]) == files[BIG].stat().st_size
    assert body == b""
    status, headers, body = raw(server, "GET", "/" + SMALL, auth)  # no Range: the whole file
    assert status == 200 and body == files[SMALL].read_bytes()
    status, headers, body = raw(server, "GET", "/" + SMALL, auth | {"Range": "bytes=3-5"})
    assert status == 206 and body == b"345" and headers["Content-Range"] == "bytes 3-5/1000"
    for bad in ("bytes=5-3", "bytes=0-1,4-5", "items=0-1", "bytes=-5"):
        status, _, _ = raw(server, "GET", "/" + SMALL, auth | {"Range": bad})
        assert status == 400, bad
    status, headers, _ = raw(server, "GET", "/" + SMALL, auth | {"Range": "bytes=990-1000"})
    assert status == 416 and headers["Content-Range"] == "bytes */1000"
    status, _, _ = raw(server, "GET", "/nope.bin", auth)
    assert status == 404


def test_no_stderr_lines(server: PeerServer, peer: PeerStorage,
                         capfd: pytest.CaptureFixture[str]) -> None:
    read(peer, SMALL, 0, 5)
    with pytest.raises(StorageError):
        read(peer, "missing.bin", 0, 5)
    # A client that goes away in the middle of a large answer.
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(f"GET /{BIG} HTTP/1.1\r\nHost: x\r\n{TOKEN_HEADER}: {TOKEN}\r\n\r\n".encode())
    sock.recv(1000)
    sock.close()
    time.sleep(0.2)
    assert capfd.readouterr().err == ""


def test_read_only(peer: PeerStorage) -> None:
    with pytest.raises(StorageError, match="read-only"):
        peer.write_atomic("x.bin", [b"abc"])
    with pytest.raises(StorageError, match="read-only"):
        peer.delete(SMALL)
    assert peer.list() == [] and peer.list("data") == []
    assert not peer.memory_bound_reads and peer.read_concurrency() == peer.config.max_workers


def test_bad_arguments(files: dict[str, Path]) -> None:
    for url in ("127.0.0.1:80", "https://127.0.0.1:80", "http://127.0.0.1", "http://h:1/?q"):
        with pytest.raises(StorageURIError):
            PeerStorage(url, host=0)
    for t in (0, -1.0, float("inf")):
        with pytest.raises(ConfigError):
            PeerStorage("http://127.0.0.1:80", host=0, timeout_s=t)
    with pytest.raises(ValueError, match="not absolute"):
        PeerServer({SMALL: "relative/state-0.bin"})


# ---- a peer that goes away or stalls -----------------------------------------------------------
def test_stale_kept_alive_connection_is_reopened(server: PeerServer, peer: PeerStorage,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="xla_ckpt.storage.peer")
    assert read(peer, SMALL, 0, 4) == b"0123"
    server._server.end_connections()  # as the server's idle timeout would
    time.sleep(0.05)
    assert read(peer, SMALL, 4, 4) == b"4567"
    server._server.end_connections()
    time.sleep(0.05)
    assert peer.stat(SMALL).size == 1000
    assert sum("reconnecting" in r.getMessage() for r in caplog.records) == 2


def test_server_closed_between_reads(files: dict[str, Path]) -> None:
    srv = PeerServer({n: str(p) for n, p in files.items()}, token=TOKEN)
    with PeerStorage(srv.url, host=5, token=TOKEN, timeout_s=1.0) as st:
        assert read(st, SMALL, 0, 4) == b"0123"
        srv.close()
        t0 = time.monotonic()
        with pytest.raises(StorageError) as e:
            read(st, BIG, 10, 20)
        assert time.monotonic() - t0 < 1.0
        msg = str(e.value)
        assert f"peer host 5 ({srv.url})" in msg and BIG in msg and "bytes [10, 30)" in msg
        with pytest.raises(StorageError, match="peer host 5"):
            st.stat(BIG)


def test_server_closed_during_reads(files: dict[str, Path]) -> None:
    """Reads in flight when the server closes either finish with the right bytes or fail with a
    StorageError naming the host; none hangs."""
    data = files[BIG].read_bytes()
    srv = PeerServer({n: str(p) for n, p in files.items()}, token=TOKEN)
    errors: list[BaseException] = []
    done = 0
    started = threading.Event()

    def reader(st: PeerStorage) -> None:
        nonlocal done
        while True:
            try:
                b = read(st, BIG, 0, len(data))
            except StorageError as e:
                errors.append(e)
                return
            assert b == data
            done += 1
            started.set()

    with PeerStorage(srv.url, host=6, token=TOKEN, timeout_s=1.0) as st:
        threads = [threading.Thread(target=reader, args=(st,), daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        assert started.wait(5.0)
        t0 = time.monotonic()
        srv.close()
        assert time.monotonic() - t0 < 2.0
        for t in threads:
            t.join(3.0)
            assert not t.is_alive()
    assert len(errors) == 4 and done >= 1
    for e in errors:
        assert "peer host 6" in str(e) and BIG in str(e)


def test_a_peer_that_never_answers_times_out() -> None:
    """A server that accepts connections (the kernel's backlog) but never answers."""
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        port = lsock.getsockname()[1]
        with PeerStorage(f"http://127.0.0.1:{port}", host=7, timeout_s=0.3) as st:
            t0 = time.monotonic()
            with pytest.raises(StorageError) as e:
                read(st, SMALL, 0, 8)
            assert time.monotonic() - t0 < 2.0
            msg = str(e.value)
            assert "peer host 7" in msg and SMALL in msg and "0.3 s (timeout_s)" in msg
            with pytest.raises(StorageError, match="peer host 7"):
                st.stat(SMALL)


def test_request_deadline(files: dict[str, Path], server: PeerServer) -> None:
    """A read stops at config.request_deadline_s however the bytes trickle."""
    cfg = StorageConfig(request_deadline_s=0.2)
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        port = lsock.getsockname()[1]
        stop = threading.Event()

        def trickle() -> None:
            conn, _ = lsock.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 100\r\n\r\n")
                while not stop.wait(0.05):
                    try:
                        conn.sendall(b"x")
                    except OSError:
                        return

        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        with PeerStorage(f"http://127.0.0.1:{port}", host=8, timeout_s=5.0, config=cfg) as st:
            t0 = time.monotonic()
            with pytest.raises(StorageError) as e:
                read(st, SMALL, 0, 100)
            assert time.monotonic() - t0 < 2.0
            assert "peer host 8" in str(e.value) and "request_deadline_s" in str(e.value)
        stop.set()
        t.join(2.0)


# ---- closing -----------------------------------------------------------------------------------
def test_close_is_idempotent_and_frees_the_port(files: dict[str, Path]) -> None:
    srv = PeerServer({n: str(p) for n, p in files.items()})
    port = srv.port
    assert srv.url == f"http://127.0.0.1:{port}"
    st = PeerStorage(srv.url, host=1)
    assert read(st, SMALL, 0, 2) == b"01"  # a kept-alive connection is open
    srv.close()
    srv.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    assert not any(t.name == "xla_ckpt-peer-server" and t.is_alive()
                   for t in threading.enumerate())
    st.close()
    st.close()
    assert not st._conns
    with pytest.raises(StorageError, match="this PeerStorage is closed"):
        read(st, SMALL, 0, 2)


def test_closed_storage_refuses_reads(server: PeerServer) -> None:
    st = PeerStorage(server.url, host=1, token=TOKEN)
    assert read(st, SMALL, 0, 2) == b"01"  # this thread keeps a connection
    st.close()
    with pytest.raises(StorageError, match="this PeerStorage is closed"):
        read(st, SMALL, 0, 2)  # the server is still up: no reopened connection
    with pytest.raises(StorageError, match="this PeerStorage is closed"):
        st.stat(SMALL)
    assert not st._conns


def test_ipv6(files: dict[str, Path]) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        srv = PeerServer({SMALL: str(files[SMALL])}, address="::1")
    except StorageError:
        pytest.skip("::1 not available here")
    with srv, PeerStorage(srv.url, host=2) as st:
        assert srv.url.startswith("http://[::1]:")
        assert read(st, SMALL, 1, 3) == b"123"


def test_open_file_descriptors_do_not_leak(files: dict[str, Path], server: PeerServer,
                                           peer: PeerStorage) -> None:
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("no /proc")
    read(peer, SMALL, 0, 1)
    before = len(os.listdir("/proc/self/fd"))
    for i in range(50):
        read(peer, SMALL, i, 1)
    with pytest.raises(StorageError):
        read(peer, SMALL, 2000, 1)
    assert len(os.listdir("/proc/self/fd")) <= before + 2
