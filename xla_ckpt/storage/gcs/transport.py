"""HTTP plumbing of the GCS backend: connection, requests, retries, error mapping, headers.

* :class:`_Connection`: the ``google-cloud-storage`` client, its authorised
  HTTP session (one connection pool) and the size/crc32c cache, shared by a
  storage and its :meth:`~xla_ckpt.storage.gcs.GCSStorage.child` storages.
* :class:`_GCSBase`: what the read and the write halves of
  :class:`~xla_ckpt.storage.gcs.GCSStorage` build on: object naming and URLs,
  one data-plane request (:meth:`_GCSBase._request`), an uploaded JSON answer
  retried (:meth:`_GCSBase._send`), HTTP answers mapped to library errors
  (:meth:`_GCSBase._http_error`) and control-plane client calls retried
  (:meth:`_GCSBase._api`).
* :class:`SourceAddressAdapter`: a ``requests`` transport adapter whose connections
  leave from one local address (:attr:`StorageConfig.source_address
  <xla_ckpt.storage.base.StorageConfig>`, else ``XLA_CKPT_GCS_SOURCE_ADDRESS``;
  :func:`source_address_for`).
* Helpers: crc32c in GCS's base64 form, header parsing, byte views.

**Source address.**  When one is set, :class:`_Connection` mounts a
:class:`SourceAddressAdapter` on the client's authorised session
(``google.cloud.storage.Client._http``).  That one session carries every request of
this backend: the JSON API calls of the client (stat, list, delete, compose: its
``Connection.api_request`` sends through ``client._http``), the client's own media
up/downloads (``Blob`` methods take ``client._http`` as their transport), and our
ranged GETs and uploads (:meth:`_GCSBase._request`).  So every data-plane and JSON-API
byte of a :class:`~xla_ckpt.storage.gcs.GCSStorage` (and of its children, which share
the connection) leaves from that address.  Not bound: credential refreshes, which
``google-auth`` sends on a session of its own (the metadata server or the OAuth
endpoint keep the default route), and a mutual-TLS channel, for which ``google-auth``
mounts an adapter of its own.  What it is for: on a multi-NIC host, pinning
checkpoint traffic to one NIC; under emulation, each emulated host ``h`` uses its
own loopback address ``127.0.0.(10+h)``, so the fault proxy shapes and counts each
host's traffic separately (:mod:`xla_ckpt.testing.fault_proxy.hosts`).

Retries (:mod:`xla_ckpt.storage.retry`): 408/429/5xx, connection errors and
short answers (:mod:`.reads`) with capped exponential backoff, full jitter,
``Retry-After`` and a deadline;
401/403 -> :class:`StoragePermissionError`, 404 ->
:class:`CheckpointNotFoundError`, 412 (an ``ifGenerationMatch`` that did not
hold) -> :class:`_PreconditionNotMet`, which says whether an earlier attempt of
the same request failed (and so may have been applied: :mod:`.writes` then looks
at the live object), other 4xx -> :class:`StorageError`, never retried.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import socket
import threading
from collections import OrderedDict
from typing import Any, Callable
from urllib.parse import quote

import requests
import requests.adapters
import urllib3
from google.auth import exceptions as auth_exc

from xla_ckpt.errors import (
    BucketNotFoundError,
    CheckpointNotFoundError,
    ConfigError,
    StorageDeadlineError,
    StorageError,
    StoragePermissionError,
    XlaCkptError,
)
from xla_ckpt.storage.base import (
    SOURCE_ADDRESS_ENV,
    Storage,
    StorageConfig,
    check_source_address,
    join,
)
from xla_ckpt.storage.cancel import Abandoned, RequestClock, watch_connection
from xla_ckpt.storage.retry import Backoff, RetryLog, TransientFault, parse_retry_after

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 20.0
READ_TIMEOUT_S = 60.0
"""Socket timeouts, seconds: connecting, and waiting for the next bytes of a response.  A
request's total time is bounded by ``StorageConfig.request_deadline_s`` on top
(:mod:`xla_ckpt.storage.cancel`): a server that sends a few bytes before each read
timeout would otherwise keep it alive for ever."""

DEFAULT_PROJECT = "xla-ckpt"

_RETRYABLE_STATUS = frozenset({408, 429})

_TRANSIENT_EXC: tuple[type[BaseException], ...] = (
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    requests.exceptions.ChunkedEncodingError,
    requests.exceptions.ContentDecodingError,
    urllib3.exceptions.HTTPError,
    http.client.HTTPException,
    ConnectionError,
    TimeoutError,
    socket.timeout,
)

_TRANSIENT_OR_CUT_JSON: tuple[type[BaseException], ...] = (json.JSONDecodeError, *_TRANSIENT_EXC)
"""Transient failures of a request whose answer is JSON (a JSON answer cut short counts too)."""


def crc32c_b64(value: int) -> str:
    """A crc32c as GCS writes it in object metadata: base64 of 4 big-endian bytes."""
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def crc32c_from_b64(text: str | None) -> int | None:
    if not text:
        return None
    try:
        raw = base64.b64decode(text)
    except ValueError:
        return None
    return int.from_bytes(raw, "big") if len(raw) == 4 else None


def _served_crc32c(x_goog_hash: str | None) -> int | None:
    """The crc32c in an ``X-Goog-Hash: crc32c=<b64>,md5=<b64>`` header, if any."""
    for part in (x_goog_hash or "").split(","):
        k, _, v = part.strip().partition("=")
        if k == "crc32c":
            return crc32c_from_b64(v)
    return None


def _int_header(value: str | None) -> int | None:
    if value is None:
        return None
    value = value.strip()
    return int(value) if value.isdigit() else None


def _bytes_view(buf: Any) -> memoryview:
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


class _Transient(TransientFault):
    """A retryable failure of one attempt; ``progress`` bytes of the body had landed."""

    def __init__(self, message: str, *, retry_after_s: float | None = None,
                 progress: int = 0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.progress = progress


class _PreconditionNotMet(StorageError):
    """HTTP 412: the request's ``ifGenerationMatch`` did not hold; never retried.

    ``retried``: an earlier attempt of the same request failed (a timeout, a reset, a
    5xx), so it may have been applied and this 412 be its own doing.  The callers
    turn it into :class:`~xla_ckpt.errors.PreconditionFailedError`.
    """

    def __init__(self, message: str, *, retried: bool = False) -> None:
        super().__init__(message)
        self.retried = retried


def _socket_of(resp: requests.Response) -> Any:
    """The socket an answer's body is read from (None when it cannot be found)."""
    conn = getattr(resp.raw, "connection", None) or getattr(resp.raw, "_connection", None)
    return getattr(conn, "sock", None)


class WatchedAdapter(requests.adapters.HTTPAdapter):
    """A ``requests`` transport adapter that hands each answer's connection to the request's
    deadline and cancel scope (:func:`xla_ckpt.storage.cancel.watch_connection`), so a body
    that trickles or a read that is interrupted is stopped by shutting the connection down.

    Every request of a :class:`~xla_ckpt.storage.gcs.GCSStorage` goes through it: our ranged
    GETs and uploads, and the client's JSON-API calls (stat, list, delete, compose), whose
    bodies ``requests`` reads after this returns.
    """

    def send(self, request: requests.PreparedRequest,  # type: ignore[override] # kwargs as given
             **kwargs: Any) -> requests.Response:
        resp = super().send(request, **kwargs)
        watch_connection(_socket_of(resp))
        return resp


class SourceAddressAdapter(WatchedAdapter):
    """A ``requests`` transport adapter whose connections all leave from ``address``.

    urllib3 binds each new socket to ``(address, 0)`` (port chosen by the kernel) before
    connecting.  Mounted by :class:`_Connection` when a source address is set, and by
    :func:`xla_ckpt.testing.fault_proxy.bind_session` on any session.

    Args:
        address: local IP address literal (IPv4 or IPv6) of this machine.
        **kwargs: :class:`requests.adapters.HTTPAdapter` arguments (``pool_maxsize``...).
    """

    def __init__(self, address: str, **kwargs: Any) -> None:
        self.source_address = (address, 0)
        super().__init__(**kwargs)

    def init_poolmanager(self, connections: int, maxsize: int, block: bool = False,
                         **pool_kwargs: Any) -> None:
        pool_kwargs["source_address"] = self.source_address
        super().init_poolmanager(connections, maxsize, block, **pool_kwargs)


def source_address_for(config: StorageConfig) -> str | None:
    """The local address GCS connections should leave from, or None (the kernel's choice).

    ``config.source_address`` when set; else the environment variable
    ``XLA_CKPT_GCS_SOURCE_ADDRESS`` when set and non-empty (read now, so a launcher can set
    it per process after the config was built).

    Raises:
        ConfigError: the environment variable does not hold an IP address literal
            (names the variable).
    """
    if config.source_address is not None:
        return config.source_address
    value = os.environ.get(SOURCE_ADDRESS_ENV, "").strip()
    if not value:
        return None
    return check_source_address(value, f"environment variable {SOURCE_ADDRESS_ENV}")


def _check_bindable(address: str, what: str) -> None:
    """Bind a throwaway socket to ``address``: a wrong address fails here, once, not as
    connection errors retried until the deadline."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
    except OSError as e:
        raise ConfigError(f"{what} {address!r} cannot be used as a source address: binding a "
                          f"socket to it failed ({e.strerror or e}); give an address of one of "
                          "this machine's interfaces, or unset it") from None


def _pool_adapter(config: StorageConfig, address: str | None) -> requests.adapters.HTTPAdapter:
    """The session's transport adapter: a pool large enough for every I/O thread, no
    urllib3 retries (ours are in :mod:`xla_ckpt.storage.retry`), bound to ``address``."""
    kwargs: dict[str, Any] = {"pool_connections": 8,
                              "pool_maxsize": max(32, 2 * config.max_workers), "max_retries": 0}
    if address is None:
        return WatchedAdapter(**kwargs)
    return SourceAddressAdapter(address, **kwargs)


class _Connection:
    """Client, HTTP session (connection pool) and caches, shared by a storage and its children.

    Attributes:
        source_address: the local address every connection of :attr:`session` is bound
            to (:func:`source_address_for`), or None.

    Raises:
        ConfigError: the source address (config or environment) is not an IP literal,
            or not an address of this machine.
    """

    def __init__(self, config: StorageConfig, endpoint: str | None, project: str | None,
                 credentials: Any) -> None:
        from google.auth.credentials import AnonymousCredentials  # noqa: PLC0415 - with the client
        from google.cloud import storage as gcs  # noqa: PLC0415 - heavy; loaded by the first client

        address = source_address_for(config)
        if address is not None:
            what = ("storage.source_address" if config.source_address is not None
                    else f"environment variable {SOURCE_ADDRESS_ENV}")
            _check_bindable(address, what)
        self.source_address = address
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        project = (project or os.environ.get("GOOGLE_CLOUD_PROJECT")
                   or os.environ.get("GCLOUD_PROJECT"))
        if endpoint:
            self.client = gcs.Client(project=project or DEFAULT_PROJECT,
                                     credentials=credentials or AnonymousCredentials(),
                                     client_options={"api_endpoint": endpoint.rstrip("/")})
        elif emulator:
            self.client = gcs.Client(project=project or DEFAULT_PROJECT,
                                     credentials=credentials or AnonymousCredentials())
        else:
            self.client = gcs.Client(project=project, credentials=credentials)
        self.endpoint = self.client.api_endpoint.rstrip("/")
        # google-cloud-storage 3.x fetches each bucket's metadata once per client, on a
        # thread of its own, only to label OpenTelemetry spans: one more GET per storage
        # opened, at an unpredictable moment.  Nothing here traces: no such fetch.
        if getattr(self.client, "_bucket_metadata_cache", None) is not None:
            self.client._bucket_metadata_cache = None
        # The client's authorised session, which carries the client's JSON-API calls and
        # media transfers as well as ours: enlarge its pool so every I/O thread keeps a
        # connection, and bind it to the source address (module docstring).
        self.session: requests.Session = self.client._http
        adapter = _pool_adapter(config, address)
        self.session.mount("https://", adapter)
        self.session.mount("http://", adapter)
        self.retries = RetryLog()
        self.buckets_seen: set[str] = set()  # buckets known to exist (or not checkable)
        self._meta: OrderedDict[tuple[str, int | None], tuple[int, int | None]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, full: str, generation: int | None, size: int, crc: int | None) -> None:
        with self._lock:
            self._meta[(full, generation)] = (size, crc)
            self._meta.move_to_end((full, generation))
            while len(self._meta) > 4096:
                self._meta.popitem(last=False)

    def recall(self, full: str, generation: int | None) -> tuple[int, int | None] | None:
        if generation is None:
            return None
        with self._lock:
            return self._meta.get((full, generation))

    def close(self) -> None:
        self.client.close()


def _credentials_error(what: str, e: BaseException) -> StoragePermissionError:
    return StoragePermissionError(
        f"{what}: could not obtain or refresh credentials ({type(e).__name__}: {e}); "
        "check Application Default Credentials / GOOGLE_APPLICATION_CREDENTIALS")


class _GCSBase(Storage):
    """Naming and HTTP plumbing under the reads and writes of a GCS storage.

    :class:`~xla_ckpt.storage.gcs.GCSStorage` sets the attributes below.
    """

    bucket_name: str
    prefix: str
    _conn: _Connection
    _bucket: Any  # google.cloud.storage.Bucket (the client ships no type information)
    _timeout: tuple[float, float]

    # ---- naming ----------------------------------------------------------------------
    def _full(self, name: str) -> str:
        name = name.strip("/")
        if not name:
            raise ValueError("object name must not be empty")
        if any(p in ("", ".", "..") for p in name.split("/")):
            raise ValueError(f"object name {name!r} must not contain empty, '.' or '..' segments")
        return join(self.prefix, name)

    def _gs(self, full: str) -> str:
        return f"gs://{self.bucket_name}/{full}"

    def _object_url(self, full: str, *, download: bool) -> str:
        base = f"{self._conn.endpoint}/download" if download else self._conn.endpoint
        return f"{base}/storage/v1/b/{self.bucket_name}/o/{quote(full, safe='')}"

    # ---- HTTP plumbing ---------------------------------------------------------------------
    def _clock(self) -> RequestClock:
        """The total deadline of one request (``config.request_deadline_s``), in the calling
        thread's cancel scope."""
        return RequestClock(self.config.request_deadline_s)

    def _backoff(self, what: str, clock: RequestClock | None = None) -> Backoff:
        return Backoff(self.config, what, log=self._conn.retries, clock=clock)

    def _timeouts(self, clock: RequestClock | None) -> tuple[float, float]:
        if clock is None:
            return self._timeout
        return clock.timeout(*self._timeout)

    def _deadline_error(self, what: str, clock: RequestClock, *, received: int | None = None,
                        asked: int | None = None) -> StorageDeadlineError:
        """The error of a request that passed its total deadline (``received`` of ``asked``
        bytes had arrived, for a read)."""
        got = ""
        if received is not None and asked is not None:
            got = f"; {received} of the {asked} bytes asked for arrived"
        elif received is not None:
            got = f"; {received} bytes arrived"
        return StorageDeadlineError(
            f"{what}: not finished within its total deadline of {clock.deadline_s:g} s "
            f"(storage.request_deadline_s; retries and slow answers included){got}. The service "
            "or the network sends too slowly (a stalled or trickling connection). Retry later, "
            "or raise storage.request_deadline_s if this link is really this slow",
            deadline_s=clock.deadline_s, received_bytes=received or 0)

    def _stop_if_over(self, what: str, clock: RequestClock, *, received: int | None = None,
                      asked: int | None = None) -> None:
        """After a failed attempt: raise :class:`Abandoned` when the request's scope was
        cancelled, the deadline error when its deadline passed."""
        if clock.cancelled:
            raise Abandoned(f"{what}: stopped (the read it belongs to was interrupted or failed)")
        if clock.expired():
            raise self._deadline_error(what, clock, received=received, asked=asked)

    def _request(self, what: str, method: str, url: str, clock: RequestClock | None = None,
                 **kwargs: Any) -> requests.Response:
        """One HTTP request on the shared session; transport and credential failures mapped.

        ``clock``: the request's total deadline; the socket timeouts are cut to what is left.

        Raises:
            _Transient: connection errors, timeouts, a credential service unreachable.
            StoragePermissionError: credentials could not be obtained or refreshed
                (e.g. after HTTP 401 with credentials that cannot refresh).
        """
        try:
            return self._conn.session.request(method, url, timeout=self._timeouts(clock),
                                              **kwargs)
        except _TRANSIENT_EXC as e:
            raise _Transient(f"request failed: {type(e).__name__}: {e}") from None
        except auth_exc.TransportError as e:
            raise _Transient(f"credential refresh failed: {e}") from None
        except auth_exc.GoogleAuthError as e:
            raise _credentials_error(what, e) from None

    def _send(self, what: str, method: str, url: str, *, params: dict[str, str],
              headers: dict[str, str], body: Callable[[], Any]) -> dict[str, Any]:
        """A data-plane request with a JSON answer (uploads), retried on transient failures,
        within ``config.request_deadline_s``."""
        clock = self._clock()
        backoff = self._backoff(what, clock)
        while True:
            try:
                with clock.attempt():
                    resp = self._request(what, method, url, clock, params=params,
                                         headers=headers, data=body())
                    try:
                        if resp.status_code < 300:
                            return resp.json()
                        if resp.status_code == 400 and "crc32c" in resp.text.lower():
                            raise _Transient(f"HTTP 400: the service computed another crc32c "
                                             f"({resp.text[:200]})")
                        raise self._http_error(what, resp, writing=True)
                    finally:
                        resp.close()
            except _Transient as e:
                self._stop_if_over(what, clock)
                backoff.failed(e, retry_after_s=e.retry_after_s)
            except _PreconditionNotMet as e:
                e.retried = backoff.failures > 0
                raise
            except XlaCkptError:
                raise
            except _TRANSIENT_OR_CUT_JSON as e:
                self._stop_if_over(what, clock)
                backoff.failed(e)

    def _http_error(self, what: str, resp: requests.Response, *,
                    generation: int | None = None, writing: bool = False) -> Exception:
        """Map an HTTP error answer to a library error, or ``_Transient`` when it may be retried.

        ``writing``: the request was an upload, to which only a missing bucket answers 404."""
        status = resp.status_code
        try:
            detail = " ".join(resp.text[:300].split())
        except Exception:  # noqa: BLE001 - the body of an error is best-effort detail
            detail = ""
        retry_after = parse_retry_after(resp.headers.get("Retry-After"))
        if status in _RETRYABLE_STATUS or status >= 500:
            return _Transient(f"HTTP {status} {detail}".strip(), retry_after_s=retry_after)
        if status in (401, 403):
            return StoragePermissionError(
                f"{what}: access denied (HTTP {status}): {detail}. Check the credentials (ADC, "
                "GOOGLE_APPLICATION_CREDENTIALS) and that they may read/write this bucket")
        if status == 404:
            if writing:
                missing = self._missing_bucket(what)
                if missing is not None:
                    return missing
                return StorageError(f"{what}: HTTP 404: {detail} (not retried)")
            gen = f" generation {generation}" if generation is not None else ""
            return CheckpointNotFoundError(f"{what}: object{gen} not found (HTTP 404)")
        if status == 412:
            return _PreconditionNotMet(f"{what}: precondition failed (HTTP 412): {detail}")
        return StorageError(f"{what}: HTTP {status}: {detail} (not retried)")

    def _missing_bucket(self, what: str) -> BucketNotFoundError | None:
        """After HTTP 404 to a request that only a missing bucket answers so (a listing, an
        upload, a compose): the error naming the bucket when a request for the bucket itself
        answers 404 too, else None (the bucket exists, or cannot be checked: HTTP 403 to a
        principal without ``storage.buckets.get``).  One check per bucket and connection."""
        bucket = self.bucket_name
        if bucket in self._conn.buckets_seen:
            return None
        url = f"{self._conn.endpoint}/storage/v1/b/{quote(bucket, safe='')}"
        try:
            resp = self._request(f"get bucket gs://{bucket}", "GET", url,
                                 params={"fields": "name"})
        except (_Transient, XlaCkptError) as e:
            logger.info("gs://%s: could not check whether the bucket exists: %s", bucket, e)
            return None
        status = resp.status_code
        resp.close()
        if status != 404:
            self._conn.buckets_seen.add(bucket)
            return None
        return BucketNotFoundError(
            f"{what}: the bucket {bucket!r} does not exist (HTTP 404 for gs://{bucket} "
            f"itself). Check the bucket name in the URI {self.uri} (a typo?), or create the "
            f"bucket first (gcloud storage buckets create gs://{bucket})",
            bucket=bucket, uri=self.uri)

    def _api(self, what: str, fn: Callable[[tuple[float, float]], Any], *,
             bucket_404: bool = False) -> Any:
        """Run a control-plane client call with our retry policy and error mapping, within
        ``config.request_deadline_s``.

        ``fn(timeout)`` makes the call with the ``(connect, read)`` socket timeouts given.
        ``bucket_404``: only a missing bucket answers this call 404 (a listing, a compose
        whose sources exist): a 404 is checked against the bucket and raised as
        :class:`~xla_ckpt.errors.BucketNotFoundError` when it is missing.
        """
        from google.api_core import exceptions as gexc  # noqa: PLC0415 - loaded with the client

        clock = self._clock()
        backoff = self._backoff(what, clock)
        while True:
            try:
                with clock.attempt():
                    return fn(self._timeouts(clock))
            except XlaCkptError:
                raise
            except gexc.NotFound:
                missing = self._missing_bucket(what) if bucket_404 else None
                if missing is not None:
                    raise missing from None
                raise CheckpointNotFoundError(f"{what}: not found (HTTP 404)") from None
            except auth_exc.TransportError as e:
                self._stop_if_over(what, clock)
                backoff.failed(f"credential refresh failed: {e}")
                continue
            except auth_exc.GoogleAuthError as e:
                raise _credentials_error(what, e) from None
            except gexc.PreconditionFailed as e:
                raise _PreconditionNotMet(f"{what}: precondition failed (HTTP 412): {e.message}",
                                          retried=backoff.failures > 0) from None
            except (gexc.Unauthorized, gexc.Forbidden) as e:
                raise StoragePermissionError(
                    f"{what}: access denied (HTTP {e.code}): {e.message}. Check the credentials "
                    "(ADC, GOOGLE_APPLICATION_CREDENTIALS) and the bucket's IAM") from None
            except gexc.GoogleAPICallError as e:
                code = e.code if isinstance(e.code, int) else 0
                if code in _RETRYABLE_STATUS or code >= 500:
                    resp = getattr(e, "response", None)
                    ra = parse_retry_after(resp.headers.get("Retry-After")) if resp is not None \
                        else None
                    self._stop_if_over(what, clock)
                    backoff.failed(f"HTTP {code} {e.message}", retry_after_s=ra)
                    continue
                raise StorageError(f"{what}: HTTP {code}: {e.message} (not retried)") from None
            except _TRANSIENT_OR_CUT_JSON as e:
                # JSONDecodeError: a JSON answer cut short by a broken connection.
                self._stop_if_over(what, clock)
                backoff.failed(e)
