"""Byte ranges of checkpoint files served from one host's local tier to the other hosts
(resharding from the tiers).

During a restore, each host's leader runs a :class:`PeerServer` over the checkpoint files its
local tier holds (host memory: a folder under ``/dev/shm``).  A rank on another host that needs
boxes of those files reads them through a :class:`PeerStorage` pointed at that server, from the
peer's memory instead of from GCS.  Only ``stat`` (``HEAD``) and ``read_range`` (``GET`` with one
``Range: bytes=a-b``) exist; nothing is written, listed or deleted.

**Trust model.**  Plain HTTP/1.1 inside the cluster's network, as torchft's ``HTTPTransport``
and Orbax's peer-to-peer sidecar use: no TLS, no authentication beyond a shared token.  The
token (header :data:`TOKEN_HEADER`, compared in constant time) keeps one job's ranks from
reading another job's server by mistake (a reused port, a stale address); it is not a defence
against an adversary on the network.  The server checks nothing about the bytes it sends:
every byte a rank reads is checked by its chunk reader against the manifest's crc32c, and a
range that fails (or any error here: a refused connection, a timeout, a short body, a status
other than 206) makes the caller read it from another tier.  :class:`PeerStorage` therefore
never retries, except to reconnect once when a kept-alive connection turns out to be stale.

**Server side.**  A :class:`http.server.ThreadingHTTPServer` on ``(address, ephemeral port)``,
one daemon thread per connection, ``TCP_NODELAY``; bodies are sent with ``sendfile`` in pieces
of at most :data:`PIECE_BYTES` (8 MiB) straight from the page cache (a tmpfs file's pages), never
read whole into this process.  Which rank calls what: the host's leader constructs the server
with the files its local tier holds and closes it when the restore ends; ranks of other hosts
construct a :class:`PeerStorage` per peer host with the server's :attr:`PeerServer.url`.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import socket
import socketserver
import threading
from http import HTTPStatus
from http.client import HTTPConnection, HTTPException, HTTPResponse, RemoteDisconnected
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, BinaryIO, Mapping, Sequence
from urllib.parse import quote, unquote, urlsplit

from xla_ckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    StorageDeadlineError,
    StorageError,
    StoragePermissionError,
    StorageURIError,
)
from xla_ckpt.storage.base import ObjectInfo, Storage, StorageConfig, join
from xla_ckpt.storage.cancel import Abandoned, RequestClock, watch_connection

logger = logging.getLogger(__name__)

TOKEN_HEADER = "X-Xla-Ckpt-Token"
"""Request header carrying the shared token; a server answers 403 when it differs from its own."""

PIECE_BYTES = 8 * 1024 * 1024
"""A body is sent (``sendfile``) and received (``readinto``) in pieces of at most this many
bytes."""

IDLE_TIMEOUT_S = 120.0
"""A server connection with no request (or no progress sending) for this many seconds is
closed; a client whose kept-alive connection was closed so reconnects once."""

_MAX_ERROR_BODY = 4096
"""An error answer's body up to this many bytes is read (its text goes into the message)."""

_RANGE = re.compile(r"bytes=(\d+)-(\d+)")


# ---- server ------------------------------------------------------------------------------------
class _Handler(BaseHTTPRequestHandler):
    """One connection's requests: ``HEAD /<name>`` and ``GET /<name>`` with one byte range."""

    protocol_version = "HTTP/1.1"  # keep-alive: one connection per client thread
    server_version = "xla_ckpt-peer"
    sys_version = ""
    disable_nagle_algorithm = True  # TCP_NODELAY: small answers are not held back
    timeout = IDLE_TIMEOUT_S
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # no line on stderr per request

    def log_error(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        logger.debug("peer server %s, client %s: %s", self.server.url, self.client_address,
                     format % args)

    def do_HEAD(self) -> None:  # the name http.server dispatches to
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _reply(self, status: int, text: str, headers: Mapping[str, str] | None = None) -> None:
        """An error answer with a short text body; the connection stays open."""
        data = text.encode("utf-8", "replace")
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _serve(self, body: bool) -> None:
        token = self.headers.get(TOKEN_HEADER, "")
        if not hmac.compare_digest(token.encode("utf-8", "replace"), self.server.token):
            self._reply(HTTPStatus.FORBIDDEN, f"wrong or missing {TOKEN_HEADER}")
            return
        name = unquote(urlsplit(self.path).path).lstrip("/")
        path = self.server.files.get(name)
        if path is None:
            self._reply(HTTPStatus.NOT_FOUND, f"{name}: not served here")
            return
        try:
            f = open(path, "rb", buffering=0)  # closed by the with below
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            self._reply(HTTPStatus.NOT_FOUND, f"{name}: no file {path} on this host")
            return
        except OSError as e:
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, f"{name}: cannot open {path}: {e}")
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            if not body:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Length", str(size))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                return
            spec = self.headers.get("Range")
            if spec is None:
                start, end, status = 0, size, HTTPStatus.OK
            else:
                m = _RANGE.fullmatch(spec.strip())
                if m is None or int(m[1]) > int(m[2]):
                    self._reply(HTTPStatus.BAD_REQUEST,
                                f"{name}: Range must be one 'bytes=FIRST-LAST', got {spec!r}")
                    return
                start, end, status = int(m[1]), int(m[2]) + 1, HTTPStatus.PARTIAL_CONTENT
                if end > size:  # never a clamped range: the client wants exactly these bytes
                    self._reply(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE,
                                f"{name}: bytes [{start}, {end}) asked, the file has {size}",
                                {"Content-Range": f"bytes */{size}"})
                    return
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start))
            if status == HTTPStatus.PARTIAL_CONTENT:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            self.end_headers()
            self._send_file(f, name, start, end)

    def _send_file(self, f: BinaryIO, name: str, start: int, end: int) -> None:
        """Bytes ``[start, end)`` of ``f`` to the client, ``sendfile`` in pieces of at most
        :data:`PIECE_BYTES` (a ``send`` loop where the platform has no ``sendfile``)."""
        at = start
        while at < end:
            n = self.connection.sendfile(f, at, min(PIECE_BYTES, end - at))
            if n == 0:  # the file shrank since its size was sent: the client sees a short body
                logger.debug("peer server %s: %s ended at byte %d, %d promised",
                             self.server.url, name, at, end)
                self.close_connection = True
                return
            at += n


class _Server(ThreadingHTTPServer):
    """The listening socket; tracks open connections so :meth:`PeerServer.close` can end them."""

    daemon_threads = True
    block_on_close = True  # server_close() joins the connection threads
    request_queue_size = 512  # every reading thread of every other host may connect at once

    def __init__(self, address: str, files: Mapping[str, str], token: str) -> None:
        if ":" in address:
            self.address_family = socket.AF_INET6
        self.files = dict(files)
        self.token = token.encode("utf-8")
        self.url = ""
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__((address, 0), _Handler)
        host, port = self.socket.getsockname()[:2]
        self.url = f"http://[{host}]:{port}" if ":" in str(host) else f"http://{host}:{port}"

    def server_bind(self) -> None:
        # HTTPServer.server_bind would resolve the address's fully qualified name (a DNS query).
        socketserver.TCPServer.server_bind(self)
        host, port = self.socket.getsockname()[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def end_connections(self) -> None:
        """Shut down every open connection: a thread waiting for the next request or sending
        a body returns at once."""
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its client

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away mid-answer (its read failed over to another tier): not ours
        # to report loudly.
        logger.debug("peer server %s, client %s: request failed", self.url, client_address,
                     exc_info=True)


class PeerServer:
    """Serves read-only byte ranges of a fixed set of files over HTTP/1.1 on
    ``(address, ephemeral port)``.

    Run by a host's leader over the files of its local tier; listens from construction until
    :meth:`close`, on daemon threads (one per client connection).  ``HEAD /<name>`` answers 200
    with ``Content-Length`` = the file's size in bytes; ``GET /<name>`` with
    ``Range: bytes=FIRST-LAST`` answers 206 and exactly those bytes (without ``Range``: 200
    and the whole file).  A name not in ``files``, or whose file is missing on disk: 404.  A
    range that does not lie wholly inside the file: 416 (``Content-Range: bytes */SIZE``).  A
    request without the right token: 403.  Names in the request path are percent-encoded.

    Args:
        files: ``{name as in the manifest ("data/rank-00001.bin", "state-0.bin"): absolute
            path of the file on this host}``.  Each file is opened per request, so one
            replaced or deleted meanwhile is served as it is then (or 404).
        address: the local IPv4 or IPv6 address to listen on (the host's address on the
            cluster network; the port is chosen by the kernel).
        token: shared secret every request must carry in :data:`TOKEN_HEADER` (see the
            module docstring); ``""`` accepts requests without the header.

    Raises:
        ValueError: a path in ``files`` is not absolute.
        StorageError: the server cannot listen on ``address``.
    """

    def __init__(self, files: Mapping[str, str], *, address: str = "127.0.0.1",
                 token: str = "") -> None:
        for name, path in files.items():
            if not os.path.isabs(path):
                raise ValueError(f"peer server: file {name!r}: path {path!r} is not absolute")
        try:
            self._server = _Server(address, {n.strip("/"): p for n, p in files.items()}, token)
        except OSError as e:
            raise StorageError(f"peer server: cannot listen on {address}: {e}") from e
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name="xla_ckpt-peer-server", daemon=True)
        self._thread.start()
        logger.debug("peer server %s: serving %d file(s)", self.url, len(files))

    @property
    def url(self) -> str:
        """``http://<address>:<port>`` (IPv6 addresses in brackets)."""
        return self._server.url

    @property
    def port(self) -> int:
        """The port the kernel chose."""
        return int(self._server.server_address[1])

    def close(self) -> None:
        """Stop serving: stop accepting, shut down open connections (a client reading gets a
        short body or a refused connection, a StorageError on its side), close the port and
        join every thread.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._server.shutdown()  # serve_forever returns: nothing new is accepted
        self._server.end_connections()
        self._server.server_close()  # closes the listening socket, joins connection threads
        self._thread.join()

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PeerServer({self.url!r})"


# ---- client ------------------------------------------------------------------------------------
class PeerStorage(Storage):
    """Read-only Storage over one peer's :class:`PeerServer`: :meth:`stat` and
    :meth:`read_range` only.

    Used by ranks of other hosts than the peer's during a restore.  Each calling thread gets
    its own keep-alive connection (``http.client.HTTPConnection`` with ``timeout_s`` on every
    socket operation), closed by :meth:`close`.  No retries: a failure is a
    :class:`~xla_ckpt.errors.StorageError` naming ``peer host <host> (<url>)``, the file and the
    byte range, and the caller reads those bytes from another tier; the one exception is a
    kept-alive connection found closed by the server (its idle timeout) on the first attempt,
    which is reopened once.  A read also stops at ``config.request_deadline_s`` from its start
    (:class:`~xla_ckpt.errors.StorageDeadlineError`) and when the parallel read it belongs to
    is cancelled (:mod:`xla_ckpt.storage.cancel`).

    Args:
        url: the server's :attr:`PeerServer.url` (``http://ADDRESS:PORT``); with a path
            (``http://ADDRESS:PORT/PREFIX``, what :meth:`child` makes) names are under it.
        host: the peer's host index (in every message).
        token: the server's token.
        timeout_s: seconds any one socket operation (connect, a send, a receive) may wait.
        config: storage knobs (``max_workers``, ``request_deadline_s``).

    Raises:
        StorageURIError: ``url`` is not ``http://ADDRESS:PORT[/PREFIX]``.
        ConfigError: ``timeout_s`` is not a number > 0.
    """

    memory_bound_reads = False
    """A read is a network round trip (a peer on another host), so readers make few large
    requests, ``config.max_workers`` at once (see :attr:`Storage.memory_bound_reads`)."""

    def __init__(self, url: str, *, host: int, token: str = "", timeout_s: float = 30.0,
                 config: StorageConfig | None = None) -> None:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            parts, port = None, None
        if parts is None or parts.scheme != "http" or not parts.hostname or port is None \
                or parts.query or parts.fragment:
            raise StorageURIError(f"peer host {host}: {url!r} is not a peer server's URL "
                                  "(http://ADDRESS:PORT, optionally /PREFIX)", uri=url)
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) \
                or not 0 < timeout_s < float("inf"):
            raise ConfigError(f"peer host {host}: timeout_s must be a number of seconds > 0, "
                              f"got {timeout_s!r}")
        super().__init__(url.rstrip("/"), config)
        self.host = host
        self.token = token
        self.timeout_s = float(timeout_s)
        self._address = parts.hostname
        self._port = port
        self._prefix = unquote(parts.path).strip("/")
        self._root = f"http://{parts.netloc}"
        self._local = threading.local()
        self._conns: set[HTTPConnection] = set()
        self._conns_lock = threading.Lock()
        self._closed = False

    @property
    def where(self) -> str:
        """``peer host <host> (<url>)``: how messages name the peer."""
        return f"peer host {self.host} ({self._root})"

    def _name(self, name: str) -> str:
        return join(self._prefix, name)

    # ---- connections -------------------------------------------------------------------------
    def _connection(self) -> tuple[HTTPConnection, bool]:
        """This thread's connection, and whether it was used before."""
        if self._closed:
            raise StorageError(f"{self.where}: this PeerStorage is closed")
        conn: HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, True
        with self._conns_lock:
            if self._closed:
                raise StorageError(f"{self.where}: this PeerStorage is closed")
            conn = HTTPConnection(self._address, self._port, timeout=self.timeout_s)
            self._conns.add(conn)
        self._local.conn = conn
        return conn, False

    def _drop(self, conn: HTTPConnection) -> None:
        """Close ``conn`` (its state is unknown after an error); the next request reconnects."""
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._conns_lock:
            self._conns.discard(conn)
        conn.close()

    def _request(self, method: str, name: str, headers: Mapping[str, str],
                 clock: RequestClock) -> tuple[HTTPConnection, HTTPResponse]:
        """Send one request and read the answer's headers; reopens a stale kept-alive
        connection once.  Raises what ``http.client`` raises (the caller words it)."""
        path = "/" + quote(self._name(name), safe="/")
        all_headers = {TOKEN_HEADER: self.token, **headers}
        while True:
            conn, reused = self._connection()
            try:
                conn.request(method, path, headers=all_headers)
                watch_connection(conn.sock)  # shut down at the deadline, or when cancelled
                return conn, conn.getresponse()
            except (RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                self._drop(conn)
                if not reused or clock.expired() or clock.cancelled:
                    raise
                logger.debug("%s: kept-alive connection was closed (%s); reconnecting",
                             self.where, e)
            except BaseException:
                self._drop(conn)
                raise

    def _failure(self, what: str, e: BaseException, clock: RequestClock,
                 received: int | None = None) -> StorageError:
        """The error of a request for ``what`` that failed with ``e``."""
        if clock.cancelled:
            return Abandoned(f"{self.where}: {what}: the read it belongs to was stopped")
        got = "" if received is None else f" ({received} bytes received)"
        if clock.expired():
            return StorageDeadlineError(
                f"{self.where}: {what}: not done within {clock.deadline_s:g} s{got} "
                "(storage.request_deadline_s)", deadline_s=clock.deadline_s,
                received_bytes=received or 0)
        if isinstance(e, TimeoutError):
            why = f"no progress within {self.timeout_s:g} s (timeout_s)"
        elif isinstance(e, ConnectionRefusedError):
            why = "connection refused (is its server closed?)"
        else:
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return StorageError(f"{self.where}: {what}: {why}{got}")

    def _status_error(self, conn: HTTPConnection, resp: HTTPResponse, what: str,
                      name: str, *, head: bool = False) -> OSError:
        """The error of an answer with an unexpected status (the body's text in it)."""
        text = ""
        try:
            length = int(resp.getheader("Content-Length") or -1)
            if 0 <= length <= _MAX_ERROR_BODY:
                text = resp.read().decode("utf-8", "replace").strip()
            else:
                self._drop(conn)
        except (OSError, HTTPException, ValueError):
            self._drop(conn)
        said = f": {text}" if text else ""
        status = f"HTTP {resp.status} {resp.reason}".rstrip()
        if resp.status == HTTPStatus.FORBIDDEN:
            return StoragePermissionError(
                f"{self.where}: {what}: refused ({status}): the token does not match the "
                f"server's (another job's peer server?){said}")
        if resp.status == HTTPStatus.NOT_FOUND and head:
            return CheckpointNotFoundError(f"{self.where}: {self.url(name)}: not served by "
                                           f"this peer ({status}){said}")
        if resp.status == HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE:
            size = (resp.getheader("Content-Range") or "").rpartition("/")[2]
            return StorageError(f"{self.where}: {what}: outside the peer's file of {size or '?'} "
                                f"bytes ({status})")
        return StorageError(f"{self.where}: {what}: {status}{said}")

    # ---- reads -------------------------------------------------------------------------------
    def stat(self, name: str) -> ObjectInfo:
        """Size of ``name`` on the peer (``HEAD``); generation None.

        Raises:
            CheckpointNotFoundError: the peer does not serve ``name`` or its file is gone
                (names the peer host and the file).
            StoragePermissionError: the token does not match (403).
            StorageError: no answer (connection refused, timeout) or another status.
        """
        what = f"{self.url(name)}: stat"
        clock = RequestClock(self.config.request_deadline_s)
        try:
            with clock.attempt():
                conn, resp = self._request("HEAD", name, {}, clock)
                try:
                    resp.read()
                except BaseException:
                    self._drop(conn)
                    raise
        except StorageError:
            raise
        except (OSError, HTTPException) as e:
            raise self._failure(what, e, clock) from e
        if resp.status != HTTPStatus.OK:
            raise self._status_error(conn, resp, what, name, head=True)
        try:
            size = int(resp.getheader("Content-Length") or "")
        except ValueError:
            raise StorageError(f"{self.where}: {what}: answer without a Content-Length") from None
        return ObjectInfo(name=name, size=size)

    def read_range(self, name: str, offset: int, out: memoryview,
                   generation: int | None = None) -> None:
        """Fill ``out`` with bytes ``[offset, offset + len(out))`` of ``name`` from the peer
        (one ``GET`` with a ``Range``, received straight into ``out`` in pieces of at most
        :data:`PIECE_BYTES`).  ``generation`` is ignored (a peer serves one version).

        Raises:
            StoragePermissionError: the token does not match (403).
            StorageDeadlineError: not done within ``config.request_deadline_s``.
            StorageError: anything else: not served (404), outside the file (416), another
                status, a short body, a refused or broken connection, ``timeout_s`` without
                progress.  Each names the peer host, the file and the byte range.
        """
        if out.format != "B" or out.ndim != 1:
            out = out.cast("B")
        n = len(out)
        if n == 0:
            return
        what = f"{self.url(name)} bytes [{offset}, {offset + n})"
        clock = RequestClock(self.config.request_deadline_s)
        got: int | None = None
        try:
            with clock.attempt():
                rng = {"Range": f"bytes={offset}-{offset + n - 1}"}
                conn, resp = self._request("GET", name, rng, clock)
                if resp.status != HTTPStatus.PARTIAL_CONTENT:
                    raise self._status_error(conn, resp, what, name)
                try:
                    length = resp.getheader("Content-Length")
                    if length != str(n):
                        raise StorageError(f"{self.where}: {what}: the answer has "
                                           f"Content-Length {length}, {n} asked")
                    got = 0
                    while got < n:
                        k = resp.readinto(out[got:got + PIECE_BYTES])
                        if not k:
                            raise StorageError(f"{self.where}: {what}: the answer ended after "
                                               f"{got} of {n} bytes")
                        got += k
                except BaseException:
                    self._drop(conn)
                    raise
        except StorageError as e:
            if got is not None and (clock.cancelled or clock.expired()):
                raise self._failure(what, e, clock, got) from e
            raise
        except (OSError, HTTPException) as e:
            raise self._failure(what, e, clock, got) from e

    # ---- a peer is read-only -----------------------------------------------------------------
    def write_atomic(self, name: str, buffers: Sequence[memoryview | bytes], *,
                     if_generation_match: int | None = None,
                     metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        """Always raises StorageError: a peer is read-only."""
        raise StorageError(f"{self.where}: {name}: a peer's storage is read-only")

    def delete(self, name: str, *, if_generation_match: int | None = None) -> None:
        """Always raises StorageError: a peer is read-only."""
        raise StorageError(f"{self.where}: {name}: a peer's storage is read-only")

    def list(self, prefix: str = "") -> list[str]:
        """Always ``[]``: a peer lists nothing (readers know the names from the manifest)."""
        return []

    def child(self, prefix: str) -> PeerStorage:
        """A PeerStorage of the same peer whose names are under ``prefix`` (own connections)."""
        return PeerStorage(self.url(quote(prefix.strip("/"), safe="/")), host=self.host,
                           token=self.token, timeout_s=self.timeout_s, config=self.config)

    def close(self) -> None:
        """Close every connection this storage opened (any thread's); idempotent.  Later
        requests raise StorageError."""
        with self._conns_lock:
            self._closed = True
            conns, self._conns = list(self._conns), set()
        for c in conns:
            c.close()
        super().close()

    def __enter__(self) -> PeerStorage:
        return self

    def __repr__(self) -> str:
        return f"PeerStorage({self.uri!r}, host={self.host})"
