"""Reads of the GCS backend: stat, ranged reads, whole-object reads, response bodies.

:meth:`_GCSReads.read_range`: one ``GET ...?alt=media`` with a ``Range``
header per slice, pinned to the object generation, streamed with ``readinto``
straight into the caller's buffer (no intermediate copy of the slice).  A
broken or short body resumes from the last good byte.  A read that covers a
whole object is checked against the object's crc32c; the per-tensor crc32c of
checkpoints is checked by :class:`xla_ckpt.io.reader.CheckpointReader` on top.
"""

from __future__ import annotations

import http.client
import logging
import re
from typing import Callable

import requests

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    IntegrityError,
    StorageError,
)
from xla_ckpt.format.crc import crc32c
from xla_ckpt.storage.base import ObjectInfo, RangeRead
from xla_ckpt.storage.gcs.transport import (
    _TRANSIENT_EXC,
    _bytes_view,
    _GCSBase,
    _int_header,
    _served_crc32c,
    _Transient,
    crc32c_from_b64,
)

logger = logging.getLogger(__name__)

WHOLE_OBJECT_CRC_READS = 3
"""Reads of a whole object whose crc32c mismatches before :class:`IntegrityError`."""

_READ_PIECE_BYTES = 256 * 1024  # bytes per readinto call: the granularity of resume on a reset

_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$")
_UNSATISFIED_RANGE = re.compile(r"^\s*bytes\s+\*/(\d+)\s*$")


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


def _read_body(resp: requests.Response, out: memoryview, n: int, unit: str) -> int:
    """Read ``n`` body bytes into ``out`` (``unit`` names them in messages); returns ``n``.

    Raises ``_Transient`` (carrying the bytes that landed) when the connection
    breaks or the body ends early.
    """
    readinto = _body_reader(resp)
    got = 0
    while got < n:
        try:
            k = readinto(out[got:min(n, got + _READ_PIECE_BYTES)])
        except _TRANSIENT_EXC as e:
            raise _Transient(f"connection broke after {got} of {n} {unit}: "
                             f"{type(e).__name__}: {e}", progress=got) from None
        if not k:
            raise _Transient(f"body ended after {got} of {n} bytes", progress=got)
        got += k
    return got


class _GCSReads(_GCSBase):
    """The read half of :class:`~xla_ckpt.storage.gcs.GCSStorage`."""

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
        # The object's crc32c when this read covers all of it, else None (nothing to check).
        whole_crc = known[1] if known is not None and known[0] == want else None
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
            if whole_crc is None or crc32c(out) == whole_crc:
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
            _read_body(resp, memoryview(buf), length, "bytes")
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

    def _get_once(self, what: str, url: str, params: dict[str, str], start: int,
                  out: memoryview, generation: int | None) -> int:
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
            total: int | None
            span: int | None
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
            got = _read_body(resp, out, n, "body bytes")
            reusable = length is not None and got == length
            return got
        finally:
            if reusable:
                resp.raw.release_conn()
            else:
                resp.close()
