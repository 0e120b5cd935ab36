"""The proxy's HTTP server: one thread per client connection, each request forwarded upstream.

:class:`_Handler` reads a request, classifies it (:class:`RequestInfo`: object
name, download or upload), asks its :class:`~.proxy.FaultProxy` for a fault,
forwards the request to the emulator and sends the answer back, shaped
(:class:`~.shaping.Shaping`: per connection, per client source address, in all) and
damaged as the fault says.  Body bytes are counted per client source address
(:attr:`~.faults.ProxyStats.bytes_by_address`), and so are request body bytes
(:attr:`~.faults.ProxyStats.bytes_received_by_address`); with ``Shaping.shape_uploads``
request bodies are read under the same caps.
"""

from __future__ import annotations

import http.client
import http.server
import json
import logging
import re
import socket
import socketserver
import struct
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from xla_ckpt.testing.fault_proxy.faults import Fault, RequestInfo, RequestRecord

if TYPE_CHECKING:
    from xla_ckpt.testing.fault_proxy.proxy import FaultProxy

logger = logging.getLogger(__name__)

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
               "trailers", "transfer-encoding", "upgrade", "content-length"}
_SEND_CHUNK_BYTES = 256 * 1024


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256

    def __init__(self, addr: tuple[str, int], handler: type[http.server.BaseHTTPRequestHandler],
                 proxy: FaultProxy) -> None:
        self.proxy = proxy
        super().__init__(addr, handler)

    def handle_error(self, request: object, client_address: object) -> None:
        # Clients drop connections on purpose (injected faults, exit): not worth a traceback.
        logger.debug("proxy: connection from %s ended with an error", client_address, exc_info=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        p = self.server.proxy
        with p._lock:
            p.stats.connections += 1
            p.stats.connections_by_address[self._address] += 1
            p._conns.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        p = self.server.proxy
        with p._lock:
            p._conns.discard(self.connection)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        logger.debug("proxy: " + format, *args)

    @property
    def _address(self) -> str:
        """Source IP of this client connection (an emulated host's own loopback address)."""
        return str(self.client_address[0])

    def do_GET(self) -> None:
        self._proxy()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_GET

    # ---- one request ---------------------------------------------------------------------
    def _proxy(self) -> None:
        p = self.server.proxy
        body = self._read_body()
        split = urlsplit(self.path)
        path = unquote(split.path)
        info = RequestInfo(self.command, path, split.query, self.headers.get("Range"),
                           _object_name(path, split.query) or _multipart_name(path, body),
                           _is_download(self.command, path, split.query),
                           _is_upload(self.command, path), self._address)
        rec = RequestRecord(self.command, path, split.query, info.range, info.object_name, info,
                            client_address=self._address)
        if body and (self.headers.get("Content-Type") or "").startswith("application/json"):
            try:
                rec.request_body = json.loads(body)
            except ValueError:
                rec.request_body = None
        with p._lock:
            p.stats.requests += 1
            p._records.append(rec)
        fault = p._choose(info)
        if fault is not None and fault.kind == "flip_request":
            if body:
                at = fault.flip_at if fault.flip_at is not None else len(body) // 2
                buf = bytearray(body)
                buf[min(max(at, 0), len(buf) - 1)] ^= 0xFF
                body = bytes(buf)
                rec.fault = fault.kind
                with p._lock:
                    p.stats.faults[fault.kind] += 1
            fault = None
        if p.shaping.first_byte_latency_s:
            time.sleep(p.shaping.first_byte_latency_s)
        if fault is not None and fault.kind == "status":
            self._send_error(rec, fault)
            return
        try:
            status, reason, headers, payload = self._forward(body)
        except OSError as e:
            rec.status = 502
            self._send_simple(502, f"upstream failed: {e}".encode())
            return
        if fault is not None and fault.kind == "lost_answer":  # the service has acted
            rec.fault = fault.kind
            rec.status = 0  # nothing was sent
            with p._lock:
                p.stats.faults[fault.kind] += 1
            self._drop(fault.rst)
            return
        self._respond(rec, status, reason, headers, payload, fault)

    def _read_body(self) -> bytes:
        """The request body (Content-Length or chunked), read under upload shaping if on.

        With ``Shaping.shape_uploads`` each piece of at most ``_SEND_CHUNK_BYTES`` is read
        no earlier than the proxy's upload schedule allows (per connection, per source
        address, in all); the client's sends block meanwhile once the socket buffers fill.
        Body bytes are counted in ``stats.bytes_received`` (per source address too).
        """
        p = self.server.proxy
        shaper = p._up_shaper if p.shaping.shape_uploads else None
        t0 = shaper.now() if shaper is not None else 0.0
        got = 0

        def read(n: int) -> bytes:
            nonlocal got
            parts = []
            while n > 0:
                k = min(n, _SEND_CHUNK_BYTES)
                if shaper is not None:
                    wait = shaper.wait_s(self._address, k, stream_start=t0, stream_sent=got)
                    if wait > 0:
                        time.sleep(wait)
                piece = self.rfile.read(k)
                if not piece:
                    break
                parts.append(piece)
                got += len(piece)
                n -= len(piece)
            return b"".join(parts)

        n = self.headers.get("Content-Length")
        if n is not None:
            body = read(int(n)) if int(n) else b""
        elif (self.headers.get("Transfer-Encoding") or "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(read(size))
                self.rfile.readline()
            body = b"".join(chunks)
        else:
            body = b""
        if body:
            with p._lock:
                p.stats.bytes_received += len(body)
                p.stats.bytes_received_by_address[self._address] += len(body)
        return body

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        p = self.server.proxy
        conn = http.client.HTTPConnection(p.upstream_host, p.upstream_port, timeout=120)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body if body else None, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
            return resp.status, resp.reason, resp.getheaders(), payload
        finally:
            conn.close()

    def _respond(self, rec: RequestRecord, status: int, reason: str,
                 headers: list[tuple[str, str]], payload: bytes, fault: Fault | None) -> None:
        p = self.server.proxy
        n = len(payload)
        length = n
        cut = None  # bytes after which the connection drops
        pause = None  # bytes after which the body stalls
        slow = None  # bytes after which the body trickles
        if fault is not None and n > 0:
            if fault.kind == "flip":
                at = fault.flip_at if fault.flip_at is not None else p._randint(0, n - 1)
                at = min(max(at, 0), n - 1)
                buf = bytearray(payload)
                buf[at] ^= 0xFF
                payload = bytes(buf)
            elif fault.kind == "short":
                drop = fault.drop_bytes if fault.drop_bytes is not None else p._randint(1, n)
                length = n - min(max(drop, 1), n)
            elif fault.kind == "reset":
                cut = fault.after_bytes if fault.after_bytes is not None else p._randint(0, n - 1)
                cut = min(max(cut, 0), n)
            elif fault.kind == "stall":
                at = fault.after_bytes if fault.after_bytes is not None else p._randint(0, n - 1)
                pause = min(max(at, 0), length)
            elif fault.kind == "trickle":
                slow = min(max(fault.after_bytes or 0, 0), length)
        if fault is not None and n > 0:
            rec.fault = fault.kind
            with p._lock:
                p.stats.faults[fault.kind] += 1
        rec.status = status
        self.send_response_only(status, reason)
        for k, v in headers:
            if k.lower() not in _HOP_BY_HOP:
                self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        body = memoryview(payload)[:length]
        if cut is not None:
            body = body[:cut]
        if pause is not None and fault is not None:
            if self._send_shaped(body[:pause], rec) == pause \
                    and not p._stopping.wait(fault.stall_s):
                self._send_shaped(body[pause:], rec)
        elif slow is not None and fault is not None:
            if self._send_shaped(body[:slow], rec) == slow:
                self._trickle(body[slow:], rec, fault.trickle_bytes, fault.stall_s)
        else:
            self._send_shaped(body, rec)
        if cut is not None and fault is not None:  # a cut is only ever set by a reset fault
            self._drop(fault.rst)

    def _send_shaped(self, body: memoryview, rec: RequestRecord | None = None) -> int:
        """Send ``body`` under the proxy's shaping; returns the bytes sent.

        Each chunk is counted (``stats``, ``rec.body_bytes``) just before it goes to the
        socket, so a client that has read some bytes always finds them counted; a chunk
        whose send fails is taken back out.
        """
        p = self.server.proxy
        shaper = p._shaper
        address = self._address
        t0 = shaper.now()
        sent = 0
        try:
            self.wfile.flush()
        except OSError:
            self.close_connection = True
            return 0
        while sent < len(body):
            chunk = body[sent:sent + _SEND_CHUNK_BYTES]
            n = len(chunk)
            wait = shaper.wait_s(address, n, stream_start=t0, stream_sent=sent)
            if wait > 0:
                time.sleep(wait)
            self._count(address, n, rec)
            try:
                self.connection.sendall(chunk)
            except OSError:
                self._count(address, -n, rec)
                self.close_connection = True
                break
            sent += n
        return sent

    def _trickle(self, body: memoryview, rec: RequestRecord, step: int, every_s: float) -> None:
        """Send ``body`` ``step`` bytes at a time, ``every_s`` seconds apart, until it is all
        sent, the client leaves (a failed send) or the proxy stops."""
        address = self._address
        sent = 0
        while sent < len(body) and not self.server.proxy._stopping.is_set():
            if sent and self.server.proxy._stopping.wait(every_s):
                break
            chunk = body[sent:sent + step]
            self._count(address, len(chunk), rec)
            try:
                self.connection.sendall(chunk)
            except OSError:
                self._count(address, -len(chunk), rec)
                self.close_connection = True
                return
            sent += len(chunk)
        if sent < len(body):
            self.close_connection = True
            self._drop(True)

    def _count(self, address: str, n: int, rec: RequestRecord | None) -> None:
        p = self.server.proxy
        with p._lock:
            p.stats.bytes_served += n
            p.stats.bytes_by_address[address] += n
            if rec is not None:
                rec.body_bytes += n

    def _drop(self, rst: bool) -> None:
        self.close_connection = True
        try:
            if rst:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))
            else:
                self.connection.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        if rst:
            try:
                self.connection.close()
            except OSError:
                pass

    def _send_error(self, rec: RequestRecord, fault: Fault) -> None:
        p = self.server.proxy
        rec.status = fault.status
        rec.fault = f"status_{fault.status}"
        with p._lock:
            p.stats.faults[rec.fault] += 1
        msg = json.dumps({"error": {"code": fault.status, "message": "injected by FaultProxy",
                                    "errors": [{"message": "injected by FaultProxy",
                                                "reason": "injected"}]}}).encode()
        self.send_response_only(fault.status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        if fault.retry_after is not None:
            self.send_header("Retry-After", fault.retry_after)
        self.send_header("Content-Length", str(len(msg)))
        self.end_headers()
        self._send_shaped(memoryview(msg), rec)

    def _send_simple(self, status: int, msg: bytes) -> None:
        self.send_response_only(status)
        self.send_header("Content-Length", str(len(msg)))
        self.end_headers()
        self.wfile.write(msg)


_OBJECT_PATH = re.compile(r"^(?:/download|/upload)?/storage/v1/b/[^/]+/o/(.+?)"
                          r"(?:/compose|/copyTo/.*|/rewriteTo/.*)?$")


def _object_name(path: str, query: str) -> str:
    m = _OBJECT_PATH.match(path)
    if m:
        return m.group(1)
    if "/upload/" in path:
        for kv in query.split("&"):
            if kv.startswith("name="):
                return unquote(kv[5:].replace("+", " "))
    return ""


_MULTIPART_NAME = re.compile(rb'"name"\s*:\s*("(?:[^"\\]|\\.)*")')


def _multipart_name(path: str, body: bytes) -> str:
    """The object name in the JSON metadata part of a multipart upload (its URL has none)."""
    if not path.startswith("/upload/") or not body:
        return ""
    m = _MULTIPART_NAME.search(body[:8192])
    if m is None:
        return ""
    try:
        name = json.loads(m.group(1))
    except ValueError:
        return ""
    return name if isinstance(name, str) else ""


def _is_download(method: str, path: str, query: str) -> bool:
    return method == "GET" and (path.startswith("/download/") or "alt=media" in query)


def _is_upload(method: str, path: str) -> bool:
    return method in ("POST", "PUT") and path.startswith("/upload/")
