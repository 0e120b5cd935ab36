""":class:`FaultProxy`: start and stop the proxy, queue faults, read its log and counters; and
its HTTP server.

The server: one thread per client connection, each request forwarded upstream.
:class:`_Handler` reads a request, classifies it (:class:`RequestInfo`: object
name, download or upload), asks its :class:`FaultProxy` for a fault,
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
import random
import re
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Sequence
from urllib.parse import unquote, urlsplit

from xla_ckpt.testing.fault_proxy.faults import (
    Fault,
    Matcher,
    ProxyStats,
    RequestInfo,
    RequestRecord,
    _RandomRule,
    _Rule,
    any_request,
    downloads,
)
from xla_ckpt.testing.fault_proxy.hosts import bind_session
from xla_ckpt.testing.fault_proxy.shaping import Shaping, _Shaper

if TYPE_CHECKING:
    from xla_ckpt.storage.base import StorageConfig
    from xla_ckpt.storage.gcs import GCSStorage

_ANY_DOWNLOAD = downloads()  # default body-fault matcher of random_faults


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


class FaultProxy:
    """HTTP proxy on 127.0.0.1 (free port) in front of ``upstream`` (see the package docstring).

    Args:
        upstream: ``http://host:port`` of the emulator.
        shaping: latency/throughput model; None for none.  May be replaced later
            (``proxy.shaping = Shaping(...)``), e.g. on the ``fault_proxy`` fixture.
        seed: seed of the random fault schedule and of random fault positions.
        host: address to bind (loopback).  Clients may connect from any loopback
            source address; emulated host ``h`` uses ``127.0.0.(10+h)``
            (:func:`~xla_ckpt.testing.fault_proxy.host_address`), and ``host_mib_s``
            shaping and :meth:`bytes_served_by_address` are per source address.

    Thread-safe: rules may be added while requests are served.
    """

    def __init__(self, upstream: str, *, shaping: Shaping | None = None, seed: int = 0,
                 host: str = "127.0.0.1") -> None:
        u = urlsplit(upstream if "://" in upstream else f"http://{upstream}")
        self.upstream_host = u.hostname or "127.0.0.1"
        self.upstream_port = u.port or 80
        self._shaper = _Shaper(shaping or Shaping())
        self._up_shaper = _Shaper(self._shaper.shaping)  # request bodies (shape_uploads)
        self._stopping = threading.Event()
        self.stats = ProxyStats()
        self._bind = host
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._random: _RandomRule | None = None
        self._records: list[RequestRecord] = []
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()

    @property
    def shaping(self) -> Shaping:
        """The latency/throughput model in force."""
        return self._shaper.shaping

    @shaping.setter
    def shaping(self, shaping: Shaping) -> None:
        """Replace the model; the caps' schedules and per-address counts start afresh."""
        self._shaper = _Shaper(shaping)
        self._up_shaper = _Shaper(shaping)

    # ---- lifecycle ---------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the proxy is not running; call start() or use `with`")
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``: the endpoint (or ``STORAGE_EMULATOR_HOST``) to use."""
        return f"http://{self._bind}:{self.port}"

    def start(self) -> "FaultProxy":
        if self._server is not None:
            return self
        self._stopping.clear()
        self._server = _Server((self._bind, 0), _Handler, self)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.1},
                                        name=f"fault-proxy-{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and drop every open client connection."""
        if self._server is None:
            return
        self._stopping.set()  # ends injected stalls
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._server = None
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def env(self) -> dict[str, str]:
        """Environment for a (child) process whose GCS traffic should go through this proxy."""
        return {"STORAGE_EMULATOR_HOST": self.url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def storage(self, uri: str, config: "StorageConfig | None" = None, *,
                source_address: str | None = None) -> "GCSStorage":
        """A :class:`~xla_ckpt.storage.gcs.GCSStorage` for ``uri`` that goes through this proxy.

        ``source_address``: bind its client sockets to this loopback address (an emulated
        host's, :func:`~xla_ckpt.testing.fault_proxy.host_address`), so the proxy counts and
        shapes its traffic as that host's.
        """
        # Lazy: the GCS client stack (google-auth, google-cloud-storage) is not needed by the
        # proxy or its CLI.
        from xla_ckpt.storage.gcs import GCSStorage  # noqa: PLC0415 - heavy, needed here only

        storage = GCSStorage(uri, config, endpoint=self.url)
        if source_address is not None:
            bind_session(storage._conn.session, source_address,
                         pool_maxsize=max(32, 2 * storage.config.max_workers))
        return storage

    # ---- faults --------------------------------------------------------------------------
    def inject(self, *faults: Fault, match: Matcher = any_request, times: int = 1) -> None:
        """Queue faults: each applies to the next ``times`` requests ``match`` accepts, in order."""
        with self._lock:
            for f in faults:
                self._rules.append(_Rule(f, match, times))

    def random_faults(self, probability: float, faults: Sequence[Fault], *,
                      match: Matcher = _ANY_DOWNLOAD, status_match: Matcher | None = any_request,
                      limit: int | None = None) -> None:
        """Seeded random schedule: each matching request gets a random fault with ``probability``.

        Body faults (reset/short/flip) apply to requests ``match`` accepts
        (media downloads by default); status faults to those ``status_match``
        accepts (every request by default).  At most ``limit`` faults in all.
        """
        with self._lock:
            self._random = _RandomRule(probability, tuple(faults), match, limit, status_match)

    def clear_faults(self) -> None:
        with self._lock:
            self._rules.clear()
            self._random = None

    def pending_faults(self) -> int:
        """Queued deterministic faults not yet used."""
        with self._lock:
            return sum(r.times for r in self._rules)

    def records(self, match: Matcher | None = None) -> list[RequestRecord]:
        """Logged requests (in arrival order), optionally filtered."""
        with self._lock:
            recs = list(self._records)
        if match is None:
            return recs
        return [r for r in recs if match(r.info)]

    def snapshot(self) -> ProxyStats:
        """A copy of the counters."""
        with self._lock:
            st = self.stats
            return ProxyStats(st.requests, st.connections, st.bytes_served, Counter(st.faults),
                              Counter(st.bytes_by_address), Counter(st.connections_by_address),
                              st.bytes_received, Counter(st.bytes_received_by_address))

    def bytes_served_by_address(self) -> dict[str, int]:
        """Response body bytes sent so far, per client source address (``{"127.0.0.10": n}``).

        With emulated hosts bound to ``127.0.0.(10+h)`` this is the bytes each host fetched
        from storage; the values sum to ``snapshot().bytes_served``.
        """
        with self._lock:
            return dict(self.stats.bytes_by_address)

    def bytes_received_by_address(self) -> dict[str, int]:
        """Request body bytes read so far (uploads, JSON bodies), per client source address."""
        with self._lock:
            return dict(self.stats.bytes_received_by_address)

    def reset_log(self) -> None:
        """Forget logged requests and zero the counters."""
        with self._lock:
            self._records.clear()
            self.stats = ProxyStats()

    def _choose(self, info: RequestInfo) -> Fault | None:
        with self._lock:
            for i, rule in enumerate(self._rules):
                if rule.match(info):
                    rule.times -= 1
                    if rule.times <= 0:
                        del self._rules[i]
                    return rule.fault
            rr = self._random
            if rr is None or (rr.limit is not None and sum(self.stats.faults.values()) >= rr.limit):
                return None
            body_ok = rr.match(info)
            status_ok = rr.status_match is not None and rr.status_match(info)
            if not (body_ok or status_ok) or self._rng.random() >= rr.probability:
                return None
            choices = [f for f in rr.faults
                       if (body_ok if f.needs_body else (status_ok or body_ok))]
            return self._rng.choice(choices) if choices else None

    def _randint(self, lo: int, hi: int) -> int:
        with self._lock:
            return self._rng.randint(lo, hi)
