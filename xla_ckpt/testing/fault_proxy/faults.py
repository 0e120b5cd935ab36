"""The fault model: what a fault is, what a rule sees of a request, what the proxy logs.

:class:`Fault` (built with its class methods) is one injected fault; a
:data:`Matcher` (:func:`downloads`, :func:`uploads`, :func:`requests_to`,
:func:`from_address`, :func:`any_request` or any callable) picks the requests it applies to, from
the :class:`RequestInfo` of each.  :class:`RequestRecord` and
:class:`ProxyStats` are what :class:`~xla_ckpt.testing.fault_proxy.FaultProxy`
logs and counts.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault.  Build with the class methods.

    Attributes:
        kind: ``"status"``, ``"reset"``, ``"short"``, ``"flip"`` (a response
            body byte), ``"stall"`` (the body stops for ``stall_s`` seconds
            after ``after_bytes``, then goes on), ``"trickle"`` (after ``after_bytes``
            the body goes on ``trickle_bytes`` bytes every ``stall_s`` seconds: a
            server that keeps a slow answer alive), ``"lost_answer"`` (the request
            reaches the service, which acts on it, then the connection drops before
            any of the answer is sent) or ``"flip_request"`` (a request body byte, e.g.
            of an upload, before it is forwarded).
        status: HTTP status sent instead of the real answer (``status``).
        retry_after: ``Retry-After`` header value to send with it, if any.
        after_bytes: ``reset``: body bytes sent before the connection drops;
            ``stall``: before the pause (None: random in ``[0, body length)``);
            ``trickle``: sent at full speed before the trickle (None: 0).
        rst: ``reset`` and ``lost_answer``: drop with a TCP RST (True) or an orderly
            FIN (False).
        drop_bytes: ``short``: body bytes left out at the end, Content-Length
            cut to match, Content-Range kept (None: random).
        flip_at: ``flip``: body byte index to invert (None: random);
            ``flip_request``: request body byte index (None: the middle).
        stall_s: ``stall``: seconds the body stops (cut short when the proxy stops);
            ``trickle``: seconds between two pieces.
        trickle_bytes: ``trickle``: bytes per piece.
    """

    kind: str
    status: int = 503
    retry_after: str | None = None
    after_bytes: int | None = None
    rst: bool = True
    drop_bytes: int | None = None
    flip_at: int | None = None
    stall_s: float = 0.0
    trickle_bytes: int = 0

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

    @classmethod
    def stall(cls, seconds: float, after_bytes: int | None = None) -> "Fault":
        """The body stops for ``seconds`` after ``after_bytes`` bytes (a stalled reader's
        stream), then the rest follows if the client is still there."""
        if seconds < 0:
            raise ValueError(f"Fault.stall: seconds must be >= 0, got {seconds}")
        return cls(kind="stall", after_bytes=after_bytes, stall_s=float(seconds))

    @classmethod
    def trickle(cls, bytes_per_step: int = 4, every_s: float = 0.05, *,
                after_bytes: int = 0) -> "Fault":
        """After ``after_bytes`` bytes at full speed, the body goes on ``bytes_per_step``
        bytes every ``every_s`` seconds until it is all sent, the client leaves or the proxy
        stops: a server that keeps an answer alive with a few bytes now and then, so no
        socket read timeout of the client ever fires."""
        if bytes_per_step < 1 or every_s <= 0 or after_bytes < 0:
            raise ValueError(f"Fault.trickle: bytes_per_step must be >= 1, every_s > 0 and "
                             f"after_bytes >= 0, got {bytes_per_step}, {every_s}, {after_bytes}")
        return cls(kind="trickle", after_bytes=after_bytes, stall_s=float(every_s),
                   trickle_bytes=int(bytes_per_step))

    @classmethod
    def lost_answer(cls, *, rst: bool = True) -> "Fault":
        """The request is forwarded and the service acts on it (writes, deletes); then the
        connection drops before any byte of the answer is sent, as when a network path
        fails after the request got through.  A client cannot tell this from a request
        that never arrived: it retries, and the retry meets the state its first attempt
        made (a 404 for a delete, a 412 for a create-only write)."""
        return cls(kind="lost_answer", rst=rst)

    @property
    def needs_body(self) -> bool:
        return self.kind in ("reset", "short", "flip", "stall", "trickle")


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
    client_address: str = ""  # the connection's source IP (emulated host h: 127.0.0.(10+h))


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
        client_address: source IP of the client connection (an emulated host's address).
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
    client_address: str = ""


@dataclass
class ProxyStats:
    """Counters of what the proxy served (read under :meth:`FaultProxy.snapshot`).

    Attributes:
        requests, connections: counts.
        bytes_served: response body bytes sent to clients, in all.
        faults: injected faults by kind.
        bytes_by_address: response body bytes sent, per client source address
            (``{"127.0.0.10": n, ...}``; sums to ``bytes_served``).
        connections_by_address: client connections accepted, per source address.
        bytes_received: request body bytes read from clients (uploads and JSON
            bodies), in all.
        bytes_received_by_address: request body bytes read, per client source address
            (sums to ``bytes_received``).
    """

    requests: int = 0
    connections: int = 0
    bytes_served: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    bytes_by_address: Counter[str] = field(default_factory=Counter)
    connections_by_address: Counter[str] = field(default_factory=Counter)
    bytes_received: int = 0
    bytes_received_by_address: Counter[str] = field(default_factory=Counter)


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


def from_address(address: str, match: Matcher | None = None) -> Matcher:
    """Match requests from client source address ``address`` (one emulated host) that
    ``match`` (default: any) accepts."""
    return lambda r: r.client_address == address and (match is None or match(r))


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
