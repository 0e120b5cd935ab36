"""A threaded HTTP proxy in front of the GCS emulator that shapes traffic and injects faults.

Real GCS gives one stream roughly 200 MiB/s after a first-byte latency of
tens of milliseconds, and many parallel streams several GiB/s per VM.  The
emulator is one single-threaded Python process, so parallel streams alone do
not make it faster; this proxy models the real service in front of it:

* every client connection is served by its own thread (HTTP/1.1 keep-alive);
* each response body is fetched from the emulator at full speed, then sent to
  the client after ``first_byte_latency_s`` and at most ``stream_mib_s`` per
  connection (and ``total_mib_s`` across all of them, the VM's NIC);
* faults from a deterministic queue (:meth:`FaultProxy.inject`) or a seeded
  random schedule (:meth:`FaultProxy.random_faults`) replace or damage
  responses: HTTP 503/429 (with ``Retry-After``) or any status, a connection
  reset after ``k`` body bytes (TCP RST or FIN), a short body (Content-Length
  cut, Content-Range kept), flipped bytes;
* counters (:attr:`FaultProxy.stats`) and a request log
  (:meth:`FaultProxy.records`) let tests assert what went over the wire: the
  ``Range`` header of a resumed request, how many requests an error caused,
  how many body bytes were served.

::

    with GCSEmulator() as emu, FaultProxy(emu.host, shaping=Shaping(stream_mib_s=32)) as proxy:
        proxy.inject(Fault.error(503), Fault.error(503), match=downloads("data-"))
        storage = proxy.storage(emu.uri("run/ck"))
"""

from __future__ import annotations

import argparse
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence
from urllib.parse import unquote, urlsplit

if TYPE_CHECKING:
    from xla_ckpt.storage.base import StorageConfig
    from xla_ckpt.storage.gcs import GCSStorage

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
               "trailers", "transfer-encoding", "upgrade", "content-length"}
_SEND_CHUNK_BYTES = 256 * 1024


@dataclass(kw_only=True)
class Shaping:
    """Latency and throughput of the modelled service (defaults: none).

    Attributes:
        first_byte_latency_s: seconds before the first byte of every response.
        stream_mib_s: body throughput cap per connection, MiB/s (None: uncapped).
        total_mib_s: body throughput cap across all connections, MiB/s (None: uncapped).
    """

    first_byte_latency_s: float = 0.0
    stream_mib_s: float | None = None
    total_mib_s: float | None = None

    def __post_init__(self) -> None:
        from xla_ckpt.errors import ConfigError

        if self.first_byte_latency_s < 0:
            raise ConfigError(f"shaping.first_byte_latency_s must be >= 0, got "
                              f"{self.first_byte_latency_s}")
        for name in ("stream_mib_s", "total_mib_s"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"shaping.{name} must be > 0 or None, got {v}")


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault.  Build with the class methods.

    Attributes:
        kind: ``"status"``, ``"reset"``, ``"short"``, ``"flip"`` (a response
            body byte) or ``"flip_request"`` (a request body byte, e.g. of an
            upload, before it is forwarded).
        status: HTTP status sent instead of the real answer (``status``).
        retry_after: ``Retry-After`` header value to send with it, if any.
        after_bytes: ``reset``: body bytes sent before the connection drops
            (None: random in ``[0, body length)``).
        rst: ``reset``: drop with a TCP RST (True) or an orderly FIN (False).
        drop_bytes: ``short``: body bytes left out at the end, Content-Length
            cut to match, Content-Range kept (None: random).
        flip_at: ``flip``: body byte index to invert (None: random);
            ``flip_request``: request body byte index (None: the middle).
    """

    kind: str
    status: int = 503
    retry_after: str | None = None
    after_bytes: int | None = None
    rst: bool = True
    drop_bytes: int | None = None
    flip_at: int | None = None

    @classmethod
    def error(cls, status: int = 503, *, retry_after: str | float | None = None) -> "Fault":
        return cls(kind="status", status=status,
                   retry_after=None if retry_after is None else str(retry_after))

    @classmethod
    def reset(cls, after_bytes: int | None = None, *, rst: bool = True) -> "Fault":
        return cls(kind="reset", after_bytes=after_bytes, rst=rst)

    @classmethod
    def short(cls, drop_bytes: int | None = None) -> "Fault":
        return cls(kind="short", drop_bytes=drop_bytes)

    @classmethod
    def flip(cls, at: int | None = None) -> "Fault":
        return cls(kind="flip", flip_at=at)

    @classmethod
    def flip_request(cls, at: int | None = None) -> "Fault":
        return cls(kind="flip_request", flip_at=at)

    @property
    def needs_body(self) -> bool:
        return self.kind in ("reset", "short", "flip")


@dataclass(frozen=True)
class RequestInfo:
    """What a fault rule sees of a request."""

    method: str
    path: str          # URL path, percent-decoded
    query: str
    range: str | None  # the Range header
    object_name: str   # decoded object name for object URLs, else ""
    is_download: bool  # a media GET (alt=media or /download/)
    is_upload: bool


@dataclass
class RequestRecord:
    """One proxied request, as logged.

    Attributes:
        method, path, query, range: of the request (path percent-decoded).
        object_name: object the request addressed ("" for bucket calls).
        status: status sent to the client.
        body_bytes: response body bytes actually sent to the client.
        fault: kind of fault injected ("" for none).
        request_body: the request body when it is JSON (compose, metadata), else None.
    """

    method: str
    path: str
    query: str
    range: str | None
    object_name: str
    info: RequestInfo
    status: int = 0
    body_bytes: int = 0
    fault: str = ""
    request_body: object = None


@dataclass
class ProxyStats:
    """Counters of what the proxy served (read under :meth:`FaultProxy.snapshot`)."""

    requests: int = 0
    connections: int = 0
    bytes_served: int = 0
    faults: Counter = field(default_factory=Counter)


Matcher = Callable[[RequestInfo], bool]


def downloads(object_contains: str = "") -> Matcher:
    """Match media GETs of objects whose name contains ``object_contains``."""
    return lambda r: r.is_download and object_contains in r.object_name


def uploads(object_contains: str = "") -> Matcher:
    """Match uploads of objects whose name contains ``object_contains``."""
    return lambda r: r.is_upload and object_contains in r.object_name


def requests_to(object_contains: str = "", method: str | None = None,
                path_regex: str | None = None) -> Matcher:
    """Match requests on objects whose name contains ``object_contains`` (and method/path)."""
    rx = re.compile(path_regex) if path_regex else None
    return lambda r: (object_contains in r.object_name
                      and (method is None or r.method == method)
                      and (rx is None or bool(rx.search(r.path))))


def any_request(_r: RequestInfo) -> bool:
    return True


@dataclass
class _Rule:
    fault: Fault
    match: Matcher
    times: int


@dataclass
class _RandomRule:
    probability: float
    faults: tuple[Fault, ...]
    match: Matcher
    limit: int | None
    status_match: Matcher | None


class _TokenBucket:
    """Shared throughput cap: bytes are scheduled back to back at ``rate`` bytes/s."""

    def __init__(self, rate_bytes_s: float) -> None:
        self.rate = rate_bytes_s
        self._next = 0.0
        self._lock = threading.Lock()

    def reserve(self, n: int) -> float:
        """Seconds to wait before sending ``n`` more bytes."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
            return start - now


class FaultProxy:
    """HTTP proxy on 127.0.0.1 (free port) in front of ``upstream`` (see module docstring).

    Args:
        upstream: ``http://host:port`` of the emulator.
        shaping: latency/throughput model; None for none.
        seed: seed of the random fault schedule and of random fault positions.
        host: address to bind (loopback).

    Thread-safe: rules may be added while requests are served.
    """

    def __init__(self, upstream: str, *, shaping: Shaping | None = None, seed: int = 0,
                 host: str = "127.0.0.1") -> None:
        u = urlsplit(upstream if "://" in upstream else f"http://{upstream}")
        self.upstream_host = u.hostname or "127.0.0.1"
        self.upstream_port = u.port or 80
        self.shaping = shaping or Shaping()
        self.stats = ProxyStats()
        self._bind = host
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._random: _RandomRule | None = None
        self._records: list[RequestRecord] = []
        self._total = _TokenBucket(self.shaping.total_mib_s * MiB) if self.shaping.total_mib_s \
            else None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()

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

    def __exit__(self, *exc) -> None:
        self.stop()

    def env(self) -> dict[str, str]:
        """Environment for a (child) process whose GCS traffic should go through this proxy."""
        return {"STORAGE_EMULATOR_HOST": self.url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def storage(self, uri: str, config: "StorageConfig | None" = None) -> "GCSStorage":
        """A :class:`~xla_ckpt.storage.gcs.GCSStorage` for ``uri`` that goes through this proxy."""
        from xla_ckpt.storage.gcs import GCSStorage

        return GCSStorage(uri, config, endpoint=self.url)

    # ---- faults --------------------------------------------------------------------------
    def inject(self, *faults: Fault, match: Matcher = any_request, times: int = 1) -> None:
        """Queue faults: each applies to the next ``times`` requests ``match`` accepts, in order."""
        with self._lock:
            for f in faults:
                self._rules.append(_Rule(f, match, times))

    def random_faults(self, probability: float, faults: Sequence[Fault], *,
                      match: Matcher = downloads(), status_match: Matcher | None = any_request,
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
            return ProxyStats(self.stats.requests, self.stats.connections,
                              self.stats.bytes_served, Counter(self.stats.faults))

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


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256

    def __init__(self, addr, handler, proxy: FaultProxy) -> None:
        self.proxy = proxy
        super().__init__(addr, handler)

    def handle_error(self, request, client_address) -> None:
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
            p._conns.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        p = self.server.proxy
        with p._lock:
            p._conns.discard(self.connection)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        logger.debug("proxy: " + format, *args)

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
                           _object_name(path, split.query),
                           _is_download(self.command, path, split.query),
                           _is_upload(self.command, path))
        rec = RequestRecord(self.command, path, split.query, info.range, info.object_name, info)
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
        self._respond(rec, status, reason, headers, payload, fault)

    def _read_body(self) -> bytes:
        n = self.headers.get("Content-Length")
        if n is not None:
            return self.rfile.read(int(n)) if int(n) else b""
        if (self.headers.get("Transfer-Encoding") or "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(parts)
        return b""

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
        sent = self._send_shaped(body)
        rec.body_bytes = sent
        if cut is not None:
            self._drop(fault.rst)

    def _send_shaped(self, body: memoryview) -> int:
        p = self.server.proxy
        rate = p.shaping.stream_mib_s * MiB if p.shaping.stream_mib_s else None
        t0 = time.monotonic()
        sent = 0
        try:
            self.wfile.flush()
            while sent < len(body):
                chunk = body[sent:sent + _SEND_CHUNK_BYTES]
                wait = p._total.reserve(len(chunk)) if p._total is not None else 0.0
                if rate is not None:
                    wait = max(wait, t0 + sent / rate - time.monotonic())
                if wait > 0:
                    time.sleep(wait)
                self.connection.sendall(chunk)
                sent += len(chunk)
        except OSError:
            self.close_connection = True
        finally:
            with p._lock:
                p.stats.bytes_served += sent
        return sent

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
        rec.body_bytes = self._send_shaped(memoryview(msg))

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


def _is_download(method: str, path: str, query: str) -> bool:
    return method == "GET" and (path.startswith("/download/") or "alt=media" in query)


def _is_upload(method: str, path: str) -> bool:
    return method in ("POST", "PUT") and path.startswith("/upload/")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m xla_ckpt.testing.fault_proxy --upstream URL [...]``: serve until Ctrl-C."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", required=True, help="emulator URL, e.g. http://127.0.0.1:9023")
    ap.add_argument("--first-byte-latency-ms", type=float, default=0.0)
    ap.add_argument("--stream-mib-s", type=float, default=None)
    ap.add_argument("--total-mib-s", type=float, default=None)
    a = ap.parse_args(argv)
    shaping = Shaping(first_byte_latency_s=a.first_byte_latency_ms / 1000,
                      stream_mib_s=a.stream_mib_s, total_mib_s=a.total_mib_s)
    with FaultProxy(a.upstream, shaping=shaping) as proxy:
        print(f"STORAGE_EMULATOR_HOST={proxy.url}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
