"""Whole-object reads of the GCS backend: one request for a small object, checked.

:meth:`_GCSWholeReads.read_bytes` of a small object is one un-ranged GET, checked
against the crc32c the service sends (``X-Goog-Hash``), else against the
object's size (``x-goog-stored-content-length``, else a stat, whose crc32c is
checked too); an answer that fails either is read again by byte range
(:mod:`.reads`, pinned to the generation of a stat and checked against its crc32c).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from xla_ckpt.errors import IntegrityError, StorageError
from xla_ckpt.format.crc import crc32c
from xla_ckpt.storage.base import ObjectInfo, RangeRead
from xla_ckpt.storage.cancel import RequestClock
from xla_ckpt.storage.gcs.reads import (
    _STORED_LENGTH,
    WHOLE_OBJECT_CRC_READS,
    _GCSReads,
    _header_generation,
    _read_body,
    _ShortAnswer,
    _Size,
)
from xla_ckpt.storage.gcs.transport import _int_header, _served_crc32c, _Transient

logger = logging.getLogger(__name__)


@dataclass
class _WholeAnswer:
    """One un-ranged GET's body and what its headers say about the object."""

    data: bytearray
    crc: int | None           # X-Goog-Hash crc32c
    stored_size: int | None   # x-goog-stored-content-length
    generation: int | None    # x-goog-generation


class _GCSWholeReads(_GCSReads):
    """The read half of :class:`~xla_ckpt.storage.gcs.GCSStorage`: ranged and whole reads."""

    def read_bytes(self, name: str) -> bytes:
        """Whole object as bytes, checked against the object's crc32c or at least its size.

        Small objects (manifests, pointers: up to ``config.slice_size_bytes``)
        come in one GET that also carries the crc32c (``X-Goog-Hash``), one
        round trip instead of stat + read.  Without a served crc32c the body's
        length is checked against ``x-goog-stored-content-length``, else
        against a stat (size and crc32c).  Larger objects -- and a small one
        whose one-request answer failed a check (flipped bytes, or a body cut
        short) -- are read as ranged slices pinned to the generation
        :meth:`stat` returned, short answers resumed.

        Raises:
            CheckpointNotFoundError: no such object.
            IntegrityError: the bytes mismatched the object's crc32c
                :data:`WHOLE_OBJECT_CRC_READS` times.
            StoragePermissionError / StorageDeadlineError / StorageError: as
                :meth:`read_range`.
        """
        full = self._full(name)
        url = self._object_url(full, download=True)
        what = f"read {self._gs(full)}"
        clock = self._clock()
        backoff = self._backoff(what, clock)
        while True:
            try:
                with clock.attempt():
                    got = self._get_whole(what, url, clock)
            except _Transient as e:
                self._stop_if_over(what, clock, received=e.progress)
                try:
                    backoff.failed(e, retry_after_s=e.retry_after_s)
                except StorageError as gave_up:
                    raise self._gave_up(gave_up, full, None, _Size(),
                                        short=isinstance(e, _ShortAnswer)) from None
                continue
            if got is None:
                return self._read_bytes_sliced(name)
            n = len(got.data)
            if got.crc is not None:
                if crc32c(got.data) == got.crc:
                    return bytes(got.data)
                # Flipped bytes, or a body cut short with a matching Content-Length: one un-ranged
                # GET cannot tell which.  The sliced path stats the object (its size and crc32c),
                # resumes short answers by byte range and re-reads bad ones a bounded number of
                # times.
                logger.warning("%s: crc32c mismatch on a one-request read of %d bytes; reading it "
                               "by byte range", what, n)
                return self._read_bytes_sliced(name)
            # No crc32c served: the length of the body is all there is to check, against the
            # object's size from its metadata (never against this answer's Content-Length).
            if got.stored_size is not None:
                if got.stored_size == n:
                    return bytes(got.data)
                logger.warning("%s: a one-request read sent %d bytes of an object of %d bytes "
                               "(%s); reading it by byte range", what, n, got.stored_size,
                               _STORED_LENGTH)
                return self._read_bytes_sliced(name)
            size, generation, crc = self._stat_full(full)
            if size == n and (got.generation is None or got.generation == generation) \
                    and (crc is None or crc32c(got.data) == crc):
                return bytes(got.data)
            logger.warning("%s: a one-request read sent %d bytes without a crc32c; the object "
                           "has %d bytes (stat); reading it by byte range", what, n, size)
            return self._read_bytes_sliced(name, ObjectInfo(name.strip("/"), size, generation))

    def _get_whole(self, what: str, url: str, clock: RequestClock) -> _WholeAnswer | None:
        """One un-ranged GET of a small object, or None if it is large (or of unknown length)."""
        resp = self._request(what, "GET", url, clock, params={"alt": "media"},
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
            return _WholeAnswer(buf, _served_crc32c(resp.headers.get("X-Goog-Hash")),
                                _int_header(resp.headers.get(_STORED_LENGTH)),
                                _header_generation(resp))
        finally:
            if reusable:
                resp.raw.release_conn()
            else:
                resp.close()

    def _read_bytes_sliced(self, name: str, info: ObjectInfo | None = None) -> bytes:
        """Whole object by pinned byte ranges, checked against the crc32c of a stat."""
        if info is None:
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
