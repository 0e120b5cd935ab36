"""GCS backend (``gs://bucket/prefix``) on the official google-cloud-storage client.

Control plane (stat, list, delete, compose) goes through
:class:`google.cloud.storage.Client`; the data plane (ranged GETs and uploads)
goes through the same client's authorised HTTP session, so both share one
connection pool and one set of credentials:

* Credentials: Application Default Credentials; when ``STORAGE_EMULATOR_HOST``
  is set (or an ``endpoint`` is passed) anonymous credentials against that
  endpoint, project from ``GOOGLE_CLOUD_PROJECT`` or a default.
* **Reads** (:meth:`GCSStorage.read_range`): one ``GET ...?alt=media`` with a
  ``Range`` header per slice, pinned to the object generation, streamed with
  ``readinto`` straight into the caller's buffer (no intermediate copy of the
  slice).  A broken or short body resumes from the last good byte.  A read
  that covers a whole object is checked against the object's crc32c; the
  per-tensor crc32c of checkpoints is checked by
  :class:`xla_ckpt.io.reader.CheckpointReader` on top.
* **Writes** (:meth:`GCSStorage.write_atomic`): up to
  :data:`MULTIPART_MAX_BYTES` in one multipart upload carrying the crc32c (the
  service refuses mismatching bytes, so the object is verified before it
  becomes visible); larger objects as parts uploaded in parallel under
  in-flight names (``<name>.tmp-<id>-part-<n>``), each checked against its
  crc32c, then composed (at most 32 sources per compose, in a tree above that)
  into the final name in one atomic step, then the parts are deleted.  A
  failed write deletes its parts and leaves the previous object as it was.
* **Retries** (:mod:`xla_ckpt.storage.retry`): 408/429/5xx and connection
  errors with capped exponential backoff, full jitter, ``Retry-After`` and a
  deadline; 401/403 -> :class:`StoragePermissionError`, 404 ->
  :class:`CheckpointNotFoundError`, other 4xx -> :class:`StorageError`, never
  retried.
* **Listing** never shows in-flight parts.

The backend knows nothing about ranks or tensors; any rank may use it.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import dataclasses
import http.client
import json
import logging
import os
import re
import socket
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence
from urllib.parse import quote

import requests
import urllib3
from google.auth import exceptions as auth_exc

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConfigError,
    IntegrityError,
    StorageError,
    StoragePermissionError,
    XlaCkptError,
)
from xla_ckpt.format.crc import crc32c, crc32c_combine
from xla_ckpt.storage.base import MiB, ObjectInfo, RangeRead, Storage, StorageConfig, join
from xla_ckpt.storage.retry import Backoff, RetryLog, parse_retry_after

logger = logging.getLogger(__name__)

TMP_MARK = ".tmp-"
"""In-flight objects (upload parts) carry this in their name; :meth:`GCSStorage.list` hides them."""

MULTIPART_MAX_BYTES = 8 * MiB
"""Objects up to this size go up in one multipart request that carries their crc32c."""

MAX_COMPOSE_SOURCES = 32
"""GCS composes at most 32 source objects per request."""

CONNECT_TIMEOUT_S = 20.0
READ_TIMEOUT_S = 60.0
"""Socket timeouts, seconds: connecting, and waiting for the next bytes of a response."""

WHOLE_OBJECT_CRC_READS = 3
"""Reads of a whole object whose crc32c mismatches before :class:`IntegrityError`."""

_READ_PIECE_BYTES = 256 * 1024  # bytes per readinto call: the granularity of resume on a reset

DEFAULT_PROJECT = "xla-ckpt"

DEFAULT_CONFIG = StorageConfig(max_workers=32, slice_size_bytes=8 * MiB)
"""Defaults measured against the shaped emulator (see benchmarks/README.md, ``--sweep``)."""

_RETRYABLE_STATUS = frozenset({408, 429})
_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$")
_UNSATISFIED_RANGE = re.compile(r"^\s*bytes\s+\*/(\d+)\s*$")

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


def parse_gcs_uri(uri: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` -> ``("bucket", "a/b")``.

    Raises:
        ConfigError: not a ``gs://`` URI or no bucket name.
    """
    if not uri.startswith("gs://"):
        raise ConfigError(f"{uri!r} is not a gs:// URI")
    rest = uri[len("gs://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket or not re.fullmatch(r"[a-z0-9][-a-z0-9_.]{1,220}[a-z0-9]", bucket):
        raise ConfigError(f"{uri!r}: missing or invalid bucket name; use gs://BUCKET/PATH")
    return bucket, prefix.strip("/")


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




class _Transient(Exception):
    """A retryable failure of one attempt; ``progress`` bytes of the body had landed."""

    def __init__(self, message: str, *, retry_after_s: float | None = None,
                 progress: int = 0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.progress = progress


@dataclass(frozen=True)
class _Part:
    name: str
    pieces: tuple[memoryview, ...]
    size: int


class _Connection:
    """Client, HTTP session (connection pool) and caches, shared by a storage and its children."""

    def __init__(self, config: StorageConfig, endpoint: str | None, project: str | None,
                 credentials: Any) -> None:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage as gcs

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
        # The client's authorised session; enlarge its pool so every I/O thread keeps a connection.
        self.session: requests.Session = self.client._http
        pool = max(32, 2 * config.max_workers)
        adapter = requests.adapters.HTTPAdapter(pool_connections=8, pool_maxsize=pool,
                                                max_retries=0)
        self.session.mount("https://", adapter)
        self.session.mount("http://", adapter)
        self.retries = RetryLog()
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


class GCSStorage(Storage):
    """Storage rooted at ``gs://bucket/prefix``.  See the module docstring.

    Args:
        uri: ``gs://bucket`` or ``gs://bucket/prefix``.
        config: parallelism, slice size, retry and upload knobs; defaults to
            :data:`DEFAULT_CONFIG`.
        endpoint: talk to this endpoint (an emulator or a proxy in front of
            one, e.g. ``http://127.0.0.1:9023``) with anonymous credentials,
            instead of ``STORAGE_EMULATOR_HOST`` / the real service.
        project: billing project (default: ``GOOGLE_CLOUD_PROJECT`` or ADC's).
        credentials: explicit ``google.auth`` credentials instead of ADC.

    Attributes:
        retries: :class:`~xla_ckpt.storage.retry.RetryLog` of every retried
            failure (shared with :meth:`child` storages).

    Raises:
        ConfigError: the URI is not ``gs://bucket[/prefix]``.
    """

    def __init__(self, uri: str, config: StorageConfig | None = None, *,
                 endpoint: str | None = None, project: str | None = None,
                 credentials: Any = None, _shared: _Connection | None = None) -> None:
        bucket, prefix = parse_gcs_uri(uri)
        super().__init__(f"gs://{bucket}" + (f"/{prefix}" if prefix else ""),
                         config or dataclasses.replace(DEFAULT_CONFIG))
        self.bucket_name = bucket
        self.prefix = prefix
        self._owns_connection = _shared is None
        self._conn = _shared or _Connection(self.config, endpoint, project, credentials)
        self._bucket = self._conn.client.bucket(bucket)
        self.retries = self._conn.retries
        self._upload_pool: cf.ThreadPoolExecutor | None = None
        self._timeout = (CONNECT_TIMEOUT_S, READ_TIMEOUT_S)

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

    def child(self, prefix: str) -> "GCSStorage":
        """A storage rooted at ``prefix`` under this one, sharing its client and connection pool."""
        return GCSStorage(self.uri.rstrip("/") + "/" + prefix.strip("/"), self.config,
                          _shared=self._conn)

    # ---- primitives ----------------------------------------------------------------------
    def stat(self, name: str) -> ObjectInfo:
        """Size (bytes) and generation of ``name``; remembers its crc32c for whole-object reads.

        Raises:
            CheckpointNotFoundError: no such object.
            StoragePermissionError: HTTP 401/403.
            StorageError: the service failed after retries.
        """
        full = self._full(name)
        blob = self._api(f"stat {self._gs(full)}",
                         lambda: self._bucket.get_blob(full, retry=None, timeout=self._timeout))
        if blob is None:
            raise CheckpointNotFoundError(f"{self._gs(full)}: no such object")
        size, generation = int(blob.size or 0), int(blob.generation) if blob.generation else None
        self._conn.remember(full, generation, size, crc32c_from_b64(blob.crc32c))
        return ObjectInfo(name=name.strip("/"), size=size, generation=generation)

    def read_range(self, name: str, offset: int, out: memoryview,
                   generation: int | None = None) -> None:
        """Fill ``out`` with bytes ``[offset, offset + len(out))`` of ``name`` (one ranged GET).

        Called from I/O threads; bytes land straight in ``out``.  ``generation``
        pins the object version.  When the range is the whole object and its
        crc32c is known (from :meth:`stat`), the bytes are checked against it.

        Raises:
            CheckpointNotFoundError: the object or the pinned generation is gone (404).
            CheckpointCorruptError: the object ends before ``offset + len(out)``
                (names the object, expected vs actual size).
            IntegrityError: a whole-object read mismatched the object's crc32c
                :data:`WHOLE_OBJECT_CRC_READS` times.
            StoragePermissionError: HTTP 401/403.
            StorageError: other HTTP errors, or retries exhausted.
        """
        out = _bytes_view(out)
        want = len(out)
        if want == 0:
            return
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        full = self._full(name)
        url = self._object_url(full, download=True)
        params = {"alt": "media"}
        if generation is not None:
            params["generation"] = str(generation)
        what = (f"read {self._gs(full)} bytes [{offset}, {offset + want})"
                + (f" (generation {generation})" if generation is not None else ""))
        known = self._conn.recall(full, generation) if offset == 0 else None
        check_crc = known is not None and known[0] == want and known[1] is not None
        backoff = self._backoff(what)
        crc_reads = 0
        while True:
            got = 0
            while got < want:
                try:
                    got += self._get_once(what, url, params, offset + got, out[got:], generation)
                except _Transient as e:
                    got += e.progress
                    backoff.failed(e, retry_after_s=e.retry_after_s, progressed=e.progress > 0)
            if not check_crc or crc32c(out) == known[1]:
                return
            crc_reads += 1
            if crc_reads >= WHOLE_OBJECT_CRC_READS:
                raise IntegrityError(
                    f"{self._gs(full)}: crc32c of the {want} bytes read differs from the object's "
                    f"crc32c after {crc_reads} reads; the object or the network path corrupts data",
                    path=self._gs(full))
            logger.warning("%s: crc32c mismatch on a whole-object read; re-reading", what)

    def read_bytes(self, name: str) -> bytes:
        """Whole object as bytes, checked against the object's crc32c.

        Small objects (manifests, pointers: up to ``config.slice_size_bytes``)
        come in one GET that also carries the crc32c (``X-Goog-Hash``), one
        round trip instead of stat + read; larger ones -- and a small one
        whose one-request answer mismatched (flipped bytes, or a body cut
        short) -- as ranged slices pinned to the generation :meth:`stat`
        returned, short answers resumed.

        Raises:
            CheckpointNotFoundError: no such object.
            IntegrityError: the bytes mismatched the object's crc32c
                :data:`WHOLE_OBJECT_CRC_READS` times.
            StoragePermissionError / StorageError: as :meth:`read_range`.
        """
        full = self._full(name)
        url = self._object_url(full, download=True)
        what = f"read {self._gs(full)}"
        backoff = self._backoff(what)
        while True:
            try:
                got = self._get_whole(what, url)
            except _Transient as e:
                backoff.failed(e, retry_after_s=e.retry_after_s)
                continue
            if got is None:
                return self._read_bytes_sliced(name)
            data, served_crc = got
            if served_crc is None or crc32c(data) == served_crc:
                return bytes(data)
            # Flipped bytes, or a body cut short with a matching Content-Length: one un-ranged
            # GET cannot tell which.  The sliced path stats the object (its size and crc32c),
            # resumes short answers by byte range and re-reads bad ones a bounded number of times.
            logger.warning("%s: crc32c mismatch on a one-request read of %d bytes; reading it by "
                           "byte range", what, len(data))
            return self._read_bytes_sliced(name)

    def _get_whole(self, what: str, url: str) -> tuple[bytearray, int | None] | None:
        """One un-ranged GET of a small object: (bytes, served crc32c), or None if it is large."""
        resp = self._request(what, "GET", url, params={"alt": "media"},
                             headers={"Accept-Encoding": "identity"}, stream=True)
        reusable = False
        try:
            if resp.status_code != 200:
                raise self._http_error(what, resp)
            enc = resp.headers.get("Content-Encoding", "").strip().lower()
            length = _int_header(resp.headers.get("Content-Length"))
            if enc not in ("", "identity") or length is None \
                    or length > self.config.slice_size_bytes:
                return None
            buf = bytearray(length)
            view = memoryview(buf)
            readinto = _body_reader(resp)
            got = 0
            while got < length:
                try:
                    k = readinto(view[got:min(length, got + _READ_PIECE_BYTES)])
                except _TRANSIENT_EXC as e:
                    raise _Transient(f"connection broke after {got} of {length} bytes: "
                                     f"{type(e).__name__}: {e}") from None
                if not k:
                    raise _Transient(f"body ended after {got} of {length} bytes")
                got += k
            reusable = True
            return buf, _served_crc32c(resp.headers.get("X-Goog-Hash"))
        finally:
            if reusable:
                resp.raw.release_conn()
            else:
                resp.close()

    def _read_bytes_sliced(self, name: str) -> bytes:
        info = self.stat(name)
        buf = bytearray(info.size)
        if not info.size:
            return b""
        full = self._full(name)
        known = self._conn.recall(full, info.generation)
        for attempt in range(WHOLE_OBJECT_CRC_READS):
            self.read_ranges([RangeRead(name, 0, memoryview(buf), info.generation)])
            if known is None or known[1] is None or crc32c(buf) == known[1]:
                return bytes(buf)
            logger.warning("%s: crc32c mismatch on a whole-object read (attempt %d); re-reading",
                           self._gs(full), attempt + 1)
        raise IntegrityError(f"{self._gs(full)}: crc32c of the bytes read differs from the "
                             f"object's crc32c after {WHOLE_OBJECT_CRC_READS} reads",
                             path=self._gs(full))

    def write_atomic(self, name: str, buffers: Iterable[memoryview | bytes]) -> ObjectInfo:
        """Write the concatenation of ``buffers`` as ``name``, all or nothing.

        ``buffers`` is consumed first (no upload starts before it is), then:
        objects of at least ``config.parallel_upload_threshold_bytes`` go up
        as parts of ``config.upload_part_size_bytes`` in parallel, each
        crc32c-checked, then composed into ``name``; smaller ones up to
        :data:`MULTIPART_MAX_BYTES` in one multipart upload with the crc32c,
        and the rest as one checked part composed into ``name``.  Parts are deleted in
        every case; a failure leaves any previous ``name`` untouched.

        Returns:
            The new object's :class:`ObjectInfo` (size in bytes, generation).

        Raises:
            StoragePermissionError / StorageError: the upload failed (nothing
                new is visible under ``name``).
        """
        full = self._full(name)
        pieces = [_bytes_view(b) for b in buffers]
        pieces = [p for p in pieces if len(p)]
        size = sum(len(p) for p in pieces)
        if size < self.config.parallel_upload_threshold_bytes and size <= MULTIPART_MAX_BYTES:
            crc = 0
            for p in pieces:
                crc = crc32c(p, crc)
            res = self._upload_multipart(full, pieces, size, crc)
        else:
            res = self._upload_composite(full, pieces, size)
        return ObjectInfo(name=name.strip("/"), size=int(res.get("size", size)),
                          generation=int(res["generation"]) if res.get("generation") else None)

    def list(self, prefix: str = "", *, include_in_flight: bool = False) -> list[str]:
        """Sorted names under ``prefix`` (a "folder": ``a`` lists ``a/...``, never ``ab``).

        In-flight upload parts (names with ``.tmp-``) are hidden unless
        ``include_in_flight`` (for cleanup tools and tests).
        """
        p = prefix.strip("/")
        base = join(self.prefix, p)
        strip = len(self.prefix) + 1 if self.prefix else 0

        def run() -> list[str]:
            return [b.name for b in self._conn.client.list_blobs(
                self.bucket_name, prefix=base or None, retry=None, timeout=self._timeout)]

        names = self._api(f"list {self._gs(base)}", run)
        out = []
        for n in names:
            if base and not (n == base or n.startswith(base + "/")):
                continue
            if n.endswith("/") or (TMP_MARK in n and not include_in_flight):
                continue
            out.append(n[strip:])
        if p and p in out:
            return [p]
        return sorted(out)

    def delete(self, name: str) -> None:
        """Delete ``name``; a missing object is not an error."""
        full = self._full(name)
        try:
            self._api(f"delete {self._gs(full)}",
                      lambda: self._bucket.delete_blob(full, retry=None, timeout=self._timeout))
        except CheckpointNotFoundError:
            return

    def close(self) -> None:
        super().close()
        if self._upload_pool is not None:
            self._upload_pool.shutdown(wait=True)
            self._upload_pool = None
        if self._owns_connection:
            self._conn.close()

    # ---- reads -----------------------------------------------------------------------------
    def _get_once(self, what: str, url: str, params: dict, start: int, out: memoryview,
                  generation: int | None) -> int:
        """One ranged GET of ``[start, start + len(out))`` into ``out``; returns bytes written.

        May return fewer bytes than asked when the server sends a shorter range
        than asked (the caller asks again for the rest).  Raises ``_Transient``
        (carrying the bytes that landed) for retryable failures.
        """
        want = len(out)
        end = start + want
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        resp = self._request(what, "GET", url, params=params, headers=headers, stream=True)
        reusable = False
        try:
            status = resp.status_code
            if status not in (200, 206):
                if status == 416:
                    m = _UNSATISFIED_RANGE.match(resp.headers.get("Content-Range", ""))
                    actual = f"{m.group(1)} bytes" if m else f"fewer than {start + 1} bytes"
                    raise CheckpointCorruptError(
                        f"{what}: truncated: expected at least {end} bytes, object has {actual}")
                raise self._http_error(what, resp, generation=generation)
            enc = resp.headers.get("Content-Encoding", "").strip().lower()
            if enc not in ("", "identity"):
                raise StorageError(f"{what}: the service sent Content-Encoding {enc!r}; objects "
                                   "must be stored without content encoding")
            served_gen = resp.headers.get("x-goog-generation")
            if generation is not None and served_gen and served_gen.isdigit() \
                    and int(served_gen) != generation:
                raise CheckpointNotFoundError(
                    f"{what}: generation {generation} was replaced by {served_gen} while reading; "
                    "the checkpoint was overwritten, restore again")
            length = _int_header(resp.headers.get("Content-Length"))
            if status == 206:
                cr = _CONTENT_RANGE.match(resp.headers.get("Content-Range", ""))
                if cr is None:
                    raise _Transient(f"206 response without a valid Content-Range "
                                     f"({resp.headers.get('Content-Range')!r})")
                first, last = int(cr.group(1)), int(cr.group(2))
                total = int(cr.group(3)) if cr.group(3) != "*" else None
                if first != start:
                    raise _Transient(f"asked for bytes from {start}, the service sent bytes "
                                     f"from {first}")
                span = last - first + 1
            else:
                if start != 0:
                    raise StorageError(f"{what}: the service ignored the Range header (HTTP 200 "
                                       f"for a read from byte {start})")
                total, span = length, length
            if total is not None and total < end:
                raise CheckpointCorruptError(
                    f"{what}: truncated: expected at least {end} bytes, object has {total} bytes")
            n = want
            if span is not None:
                n = min(n, span)
            if length is not None:
                n = min(n, length)
            if n <= 0:
                raise _Transient(f"empty body (Content-Length {length}, Content-Range "
                                 f"{resp.headers.get('Content-Range')!r})")
            readinto = _body_reader(resp)
            got = 0
            while got < n:
                try:
                    k = readinto(out[got:min(n, got + _READ_PIECE_BYTES)])
                except _TRANSIENT_EXC as e:
                    raise _Transient(f"connection broke after {got} of {n} body bytes: "
                                     f"{type(e).__name__}: {e}", progress=got) from None
                if not k:
                    raise _Transient(f"body ended after {got} of {n} bytes", progress=got)
                got += k
            reusable = length is not None and got == length
            return got
        finally:
            if reusable:
                resp.raw.release_conn()
            else:
                resp.close()

    # ---- writes ----------------------------------------------------------------------------
    def _upload_multipart(self, full: str, pieces: Sequence[memoryview], size: int,
                          crc: int) -> dict:
        """One multipart upload carrying the crc32c: the service checks it before it is visible."""
        boundary = f"==xla_ckpt_{uuid.uuid4().hex}=="
        meta = json.dumps({"name": full, "contentType": "application/octet-stream",
                           "crc32c": crc32c_b64(crc)}).encode()
        head = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                ).encode() + meta + (f"\r\n--{boundary}\r\nContent-Type: application/"
                                     "octet-stream\r\n\r\n").encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        url = f"{self._conn.endpoint}/upload/storage/v1/b/{self.bucket_name}/o"
        res = self._send(f"upload {self._gs(full)} ({size} bytes)", "POST", url,
                         params={"uploadType": "multipart"},
                         headers={"Content-Type": f"multipart/related; boundary={boundary}"},
                         body=lambda: _BodyReader([memoryview(head), *pieces, memoryview(tail)]))
        self._check_written(full, res, size, crc)
        return res

    def _upload_part(self, part: _Part) -> int:
        """Upload one in-flight part; returns its crc32c after the service confirmed it."""
        crc = 0
        for p in part.pieces:
            crc = crc32c(p, crc)
        url = f"{self._conn.endpoint}/upload/storage/v1/b/{self.bucket_name}/o"
        what = f"upload part {self._gs(part.name)} ({part.size} bytes)"
        backoff = self._backoff(what)
        while True:
            res = self._send(what, "POST", url, params={"uploadType": "media", "name": part.name},
                             headers={"Content-Type": "application/octet-stream"},
                             body=lambda: (part.pieces[0] if len(part.pieces) == 1
                                           else _BodyReader(part.pieces)))
            served = crc32c_from_b64(res.get("crc32c"))
            if _int_header(str(res.get("size"))) == part.size and served in (None, crc):
                return crc
            backoff.failed(f"the service stored {res.get('size')} bytes with crc32c "
                           f"{res.get('crc32c')}, sent {part.size} bytes with crc32c "
                           f"{crc32c_b64(crc)}")

    def _upload_composite(self, full: str, pieces: Sequence[memoryview], size: int) -> dict:
        cfg = self.config
        part_size = cfg.upload_part_size_bytes if size >= cfg.parallel_upload_threshold_bytes \
            else size
        uid = uuid.uuid4().hex[:12]
        parts = [_Part(f"{full}{TMP_MARK}{uid}-part-{i:05d}", tuple(ps), n)
                 for i, (ps, n) in enumerate(_split(pieces, part_size))]
        temps = [p.name for p in parts]
        pool = self._uploads()
        futures = [pool.submit(self._upload_part, p) for p in parts]
        try:
            crcs = [f.result() for f in futures]
            sources = [(p.name, p.size, c) for p, c in zip(parts, crcs)]
            res = self._compose_tree(full, sources, uid, temps)
        except BaseException:
            for f in futures:
                f.cancel()
            cf.wait(futures)
            self._delete_quietly(temps)
            raise
        self._delete_quietly(temps)
        return res

    def _compose_tree(self, full: str, sources: list[tuple[str, int, int]], uid: str,
                      temps: list[str]) -> dict:
        level = 0
        while len(sources) > MAX_COMPOSE_SOURCES:
            grouped = []
            for j in range(0, len(sources), MAX_COMPOSE_SOURCES):
                group = sources[j:j + MAX_COMPOSE_SOURCES]
                if len(group) == 1:
                    grouped.append(group[0])
                    continue
                name = f"{full}{TMP_MARK}{uid}-compose-{level}-{j // MAX_COMPOSE_SOURCES:05d}"
                temps.append(name)
                size, crc, _gen = self._compose(name, group)
                grouped.append((name, size, crc))
            sources, level = grouped, level + 1
        size, crc, gen = self._compose(full, sources)
        return {"size": size, "generation": gen, "crc32c": crc32c_b64(crc)}

    def _compose(self, dest: str, sources: list[tuple[str, int, int]]
                 ) -> tuple[int, int, int | None]:
        """Compose ``sources`` (name, size, crc32c) into ``dest``: (size, crc32c, generation)."""
        size, crc = 0, 0
        for _name, n, c in sources:
            crc = crc32c_combine(crc, c, n)
            size += n
        blob = self._bucket.blob(dest)
        blob.content_type = "application/octet-stream"
        blob.crc32c = crc32c_b64(crc)
        srcs = [self._bucket.blob(name) for name, _n, _c in sources]
        self._api(f"compose {self._gs(dest)} from {len(srcs)} parts",
                  lambda: blob.compose(srcs, retry=None, timeout=self._timeout))
        served = crc32c_from_b64(blob.crc32c)
        if int(blob.size or 0) != size or served not in (None, crc):
            raise StorageError(f"compose {self._gs(dest)}: the service reports {blob.size} bytes "
                               f"with crc32c {blob.crc32c}, expected {size} bytes with crc32c "
                               f"{crc32c_b64(crc)}; write it again")
        gen = int(blob.generation) if blob.generation else None
        self._conn.remember(dest, gen, size, crc)
        return size, crc, gen

    def _check_written(self, full: str, res: dict, size: int, crc: int) -> None:
        served = crc32c_from_b64(res.get("crc32c"))
        if _int_header(str(res.get("size"))) != size or served not in (None, crc):
            raise StorageError(f"upload {self._gs(full)}: the service stored {res.get('size')} "
                               f"bytes with crc32c {res.get('crc32c')}, sent {size} bytes with "
                               f"crc32c {crc32c_b64(crc)}; write it again")
        gen = res.get("generation")
        self._conn.remember(full, int(gen) if gen else None, size, crc)

    def _delete_quietly(self, names: Sequence[str]) -> None:
        def one(full: str) -> None:
            try:
                self._api(f"delete {self._gs(full)}",
                          lambda: self._bucket.delete_blob(full, retry=None, timeout=self._timeout))
            except CheckpointNotFoundError:
                pass
            except Exception as e:  # noqa: BLE001 - cleanup must not mask the real outcome
                logger.warning("could not delete in-flight object %s: %s; it is never listed as "
                               "a checkpoint file, remove it by hand", self._gs(full), e)

        if not names:
            return
        pool = self._uploads()
        cf.wait([pool.submit(one, n) for n in names])

    def _uploads(self) -> cf.ThreadPoolExecutor:
        with self._pool_lock:
            if self._upload_pool is None:
                self._upload_pool = cf.ThreadPoolExecutor(self.config.max_workers,
                                                          thread_name_prefix="xla_ckpt-upload")
            return self._upload_pool

    # ---- HTTP plumbing ---------------------------------------------------------------------
    def _backoff(self, what: str) -> Backoff:
        return Backoff(self.config, what, log=self._conn.retries)

    def _request(self, what: str, method: str, url: str, **kwargs: Any) -> requests.Response:
        """One HTTP request on the shared session; transport and credential failures mapped.

        Raises:
            _Transient: connection errors, timeouts, a credential service unreachable.
            StoragePermissionError: credentials could not be obtained or refreshed
                (e.g. after HTTP 401 with credentials that cannot refresh).
        """
        try:
            return self._conn.session.request(method, url, timeout=self._timeout, **kwargs)
        except _TRANSIENT_EXC as e:
            raise _Transient(f"request failed: {type(e).__name__}: {e}") from None
        except auth_exc.TransportError as e:
            raise _Transient(f"credential refresh failed: {e}") from None
        except auth_exc.GoogleAuthError as e:
            raise StoragePermissionError(
                f"{what}: could not obtain or refresh credentials ({type(e).__name__}: {e}); "
                "check Application Default Credentials / GOOGLE_APPLICATION_CREDENTIALS") from None

    def _send(self, what: str, method: str, url: str, *, params: dict, headers: dict,
              body: Callable[[], Any]) -> dict:
        """A data-plane request with a JSON answer (uploads), retried on transient failures."""
        backoff = self._backoff(what)
        while True:
            try:
                resp = self._request(what, method, url, params=params, headers=headers,
                                     data=body())
                try:
                    if resp.status_code < 300:
                        return resp.json()
                    if resp.status_code == 400 and "crc32c" in resp.text.lower():
                        raise _Transient(f"HTTP 400: the service computed another crc32c "
                                         f"({resp.text[:200]})")
                    raise self._http_error(what, resp)
                finally:
                    resp.close()
            except _Transient as e:
                backoff.failed(e, retry_after_s=e.retry_after_s)
            except XlaCkptError:
                raise
            except (json.JSONDecodeError, *_TRANSIENT_EXC) as e:
                backoff.failed(e)

    def _http_error(self, what: str, resp: requests.Response, *,
                    generation: int | None = None) -> Exception:
        """Map an HTTP error answer to a library error, or ``_Transient`` when it may be retried."""
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
            gen = f" generation {generation}" if generation is not None else ""
            return CheckpointNotFoundError(f"{what}: object{gen} not found (HTTP 404)")
        return StorageError(f"{what}: HTTP {status}: {detail} (not retried)")

    def _api(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run a control-plane client call with our retry policy and error mapping."""
        from google.api_core import exceptions as gexc

        backoff = self._backoff(what)
        while True:
            try:
                return fn()
            except XlaCkptError:
                raise
            except gexc.NotFound:
                raise CheckpointNotFoundError(f"{what}: not found (HTTP 404)") from None
            except auth_exc.TransportError as e:
                backoff.failed(f"credential refresh failed: {e}")
                continue
            except auth_exc.GoogleAuthError as e:
                raise StoragePermissionError(
                    f"{what}: could not obtain or refresh credentials ({type(e).__name__}: {e}); "
                    "check Application Default Credentials / GOOGLE_APPLICATION_CREDENTIALS"
                ) from None
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
                    backoff.failed(f"HTTP {code} {e.message}", retry_after_s=ra)
                    continue
                raise StorageError(f"{what}: HTTP {code}: {e.message} (not retried)") from None
            except (json.JSONDecodeError, *_TRANSIENT_EXC) as e:
                # JSONDecodeError: a JSON answer cut short by a broken connection.
                backoff.failed(e)


class _BodyReader:
    """A file-like request body over several buffers (sent without joining them)."""

    def __init__(self, pieces: Sequence[memoryview]) -> None:
        self._pieces = list(pieces)
        self._len = sum(len(p) for p in pieces)
        self._i = 0
        self._pos = 0

    def __len__(self) -> int:
        return self._len

    def read(self, n: int = -1) -> memoryview | bytes:
        while self._i < len(self._pieces):
            p = self._pieces[self._i]
            if self._pos < len(p):
                k = len(p) - self._pos if n is None or n < 0 else min(n, len(p) - self._pos)
                view = p[self._pos:self._pos + k]
                self._pos += k
                return view
            self._i += 1
            self._pos = 0
        return b""


def _bytes_view(buf: Any) -> memoryview:
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _split(pieces: Sequence[memoryview], part_size: int) -> Iterable[tuple[list[memoryview], int]]:
    """Cut a sequence of buffers into parts of ``part_size`` bytes (the last may be shorter)."""
    cur: list[memoryview] = []
    n = 0
    for p in pieces:
        while len(p):
            k = min(len(p), part_size - n)
            cur.append(p[:k])
            n += k
            p = p[k:]
            if n == part_size:
                yield cur, n
                cur, n = [], 0
    if n:
        yield cur, n


def _body_reader(resp: requests.Response) -> Callable[[memoryview], int]:
    """``readinto`` of the response body, straight from the socket into the caller's buffer.

    urllib3's own ``readinto`` reads into a temporary ``bytes`` and copies;
    the ``http.client`` response underneath reads into the buffer itself.
    """
    raw = resp.raw
    fp = getattr(raw, "_fp", None)
    if isinstance(fp, http.client.HTTPResponse):
        return fp.readinto
    return raw.readinto


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
