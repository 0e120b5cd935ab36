"""Reads of the GCS backend: stat, ranged reads, response bodies, short answers.

:meth:`_GCSReads.read_range`: one ``GET ...?alt=media`` with a ``Range``
header per slice, pinned to the object generation, streamed with ``readinto``
straight into the caller's buffer (no intermediate copy of the slice).  A
read that covers a whole object is checked against the object's crc32c; the
per-tensor crc32c of checkpoints is checked by
:class:`xla_ckpt.io.reader.CheckpointReader` on top.

Short answers are transient faults, never data: a body that breaks or ends
early, a ``206`` whose ``Content-Length`` or ``Content-Range`` covers less than
was asked, a ``200`` that ignored the ``Range`` header.  The bytes that did
arrive in order from the asked offset are kept and the rest is asked for again
("resume from the last good byte"): at once when the answer's headers said it
was short, after a backoff of :mod:`xla_ckpt.storage.retry` when the body
broke or the answer gave nothing usable, so an answer that stays short ends in
a :class:`StorageError` naming the sizes (asked, arrived, the object's from a
stat) instead of a loop.  An object is only called truncated
(:class:`CheckpointCorruptError`) on the word of its metadata: the total of a
``Content-Range``, ``x-goog-stored-content-length``, or :meth:`_GCSReads.stat`;
never on the length of one answer.

A ``200`` to a ranged request is the whole object from byte 0 (HTTP's meaning
of 200).  At offset 0 its first bytes are the ones asked for, so they are used
(and a short one resumed).  At an offset > 0 it is retried, not used: reading
and dropping the prefix would make every slice of a large object re-download
everything before it (quadratic traffic through a path that ignores ``Range``),
while a glitch is cured by one more request and a path that keeps ignoring
``Range`` ends in a clear :class:`StorageError`.

Whole-object reads (:meth:`~xla_ckpt.storage.gcs.GCSStorage.read_bytes`) build on
these in :mod:`.whole_reads`.
"""

from __future__ import annotations

import http.client
import logging
import re
from dataclasses import dataclass
from typing import Callable

import requests

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    IntegrityError,
    StorageError,
    XlaCkptError,
)
from xla_ckpt.format.crc import crc32c
from xla_ckpt.storage.base import ObjectInfo
from xla_ckpt.storage.cancel import RequestClock
from xla_ckpt.storage.gcs.transport import (
    _TRANSIENT_EXC,
    _bytes_view,
    _GCSBase,
    _int_header,
    _Transient,
    crc32c_from_b64,
)

logger = logging.getLogger(__name__)

WHOLE_OBJECT_CRC_READS = 3
"""Reads of a whole object whose crc32c mismatches before :class:`IntegrityError`."""

_READ_PIECE_BYTES = 256 * 1024  # bytes per readinto call: the granularity of resume on a reset

_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$")
_UNSATISFIED_RANGE = re.compile(r"^\s*bytes\s+\*/(\d+)\s*$")

_STORED_LENGTH = "x-goog-stored-content-length"
_STAT = "stat"


class _ShortAnswer(_Transient):
    """The service answered, but with fewer of the asked bytes than the object holds.

    ``progress`` bytes from the asked offset were good.  Retried like any
    transient failure; when the budget runs out the error names the object's
    real size (from a stat).
    """


@dataclass
class _Size:
    """What one read has learned of its object's size (bytes) and from where."""

    bytes: int | None = None
    source: str = ""

    def learn(self, size: int, source: str) -> None:
        self.bytes, self.source = size, source




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
    breaks, ``_ShortAnswer`` when the body ends early.
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
            raise _ShortAnswer(f"body ended after {got} of {n} bytes", progress=got)
        got += k
    return got


def _header_generation(resp: requests.Response) -> int | None:
    served = resp.headers.get("x-goog-generation")
    return int(served) if served and served.isdigit() else None


def _check_encoding(what: str, resp: requests.Response) -> None:
    """Refuse an answer that is (or was stored) content-encoded: its bytes are not the object's."""
    for header in ("Content-Encoding", "x-goog-stored-content-encoding"):
        enc = resp.headers.get(header, "").strip().lower()
        if enc not in ("", "identity"):
            raise StorageError(f"{what}: the service sent {header} {enc!r}; objects must be "
                               "stored without content encoding")



class _GCSReads(_GCSBase):
    """Stat and ranged reads of :class:`~xla_ckpt.storage.gcs.GCSStorage`."""

    def stat(self, name: str) -> ObjectInfo:
        """Size (bytes) and generation of ``name``; remembers its crc32c for whole-object reads.

        Raises:
            CheckpointNotFoundError: no such object.
            StoragePermissionError: HTTP 401/403.
            StorageError: the service failed after retries.
        """
        size, generation, _ = self._stat_full(self._full(name))
        return ObjectInfo(name=name.strip("/"), size=size, generation=generation)

    def _stat_full(self, full: str,
                   generation: int | None = None) -> tuple[int, int | None, int | None]:
        """(size, generation, crc32c) of ``full`` (of ``generation`` if given), remembered."""
        gen = f" generation {generation}" if generation is not None else ""
        blob = self._api(f"stat {self._gs(full)}{gen}",
                         lambda timeout: self._bucket.get_blob(full, generation=generation,
                                                               retry=None, timeout=timeout))
        if blob is None:
            raise CheckpointNotFoundError(f"{self._gs(full)}{gen}: no such object")
        size, served = int(blob.size or 0), int(blob.generation) if blob.generation else None
        crc = crc32c_from_b64(blob.crc32c)
        self._conn.remember(full, served, size, crc)
        return size, served, crc

    def read_range(self, name: str, offset: int, out: memoryview,
                   generation: int | None = None) -> None:
        """Fill ``out`` with bytes ``[offset, offset + len(out))`` of ``name`` (one ranged GET).

        Called from I/O threads; bytes land straight in ``out``.  ``generation``
        pins the object version.  When the range is the whole object and its
        crc32c is known (from :meth:`stat`), the bytes are checked against it.
        Short and range-ignoring answers are resumed from the last good byte
        (see the module docstring).

        Raises:
            CheckpointNotFoundError: the object or the pinned generation is gone (404).
            CheckpointCorruptError: the object ends before ``offset + len(out)``
                (names the object, expected vs actual size).
            IntegrityError: a whole-object read mismatched the object's crc32c
                :data:`WHOLE_OBJECT_CRC_READS` times.
            StoragePermissionError: HTTP 401/403.
            StorageDeadlineError: the read (retries and slow answers included) was not done
                within ``config.request_deadline_s``; names the byte range, the bytes that
                arrived and the setting.
            StorageError: other HTTP errors, or retries exhausted (the message
                names the bytes asked for, those that arrived and, after short
                answers, the object's size from a stat).
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
        known = self._conn.recall(full, generation)
        size = _Size() if known is None else _Size(known[0], _STAT)
        # The object's crc32c when this read covers all of it, else None (nothing to check).
        whole_crc = known[1] if known is not None and offset == 0 and known[0] == want else None
        clock = self._clock()
        backoff = self._backoff(what, clock)
        crc_reads = 0
        while True:
            got = 0
            while got < want:
                try:
                    with clock.attempt():
                        got += self._get_once(what, full, url, params, offset + got, out[got:],
                                              generation, size, clock)
                except _Transient as e:
                    got += e.progress
                    self._stop_if_over(what, clock, received=got, asked=want)
                    try:
                        backoff.failed(e, retry_after_s=e.retry_after_s,
                                       progressed=e.progress > 0)
                    except StorageError as gave_up:
                        raise self._gave_up(gave_up, full, generation, size,
                                            short=isinstance(e, _ShortAnswer),
                                            asked=(offset, want, got)) from None
            if whole_crc is None or crc32c(out) == whole_crc:
                return
            crc_reads += 1
            if crc_reads >= WHOLE_OBJECT_CRC_READS:
                raise IntegrityError(
                    f"{self._gs(full)}: crc32c of the {want} bytes read differs from the object's "
                    f"crc32c after {crc_reads} reads; the object or the network path corrupts data",
                    path=self._gs(full))
            logger.warning("%s: crc32c mismatch on a whole-object read; re-reading", what)

    def _gave_up(self, gave_up: StorageError, full: str, generation: int | None, size: _Size,
                 *, short: bool, asked: tuple[int, int, int] | None = None) -> StorageError:
        """The retry budget's error, with the sizes: asked for, arrived, the object's own.

        ``asked``: (offset, bytes wanted, bytes that arrived) of a ranged read.
        After short answers (``short``) the object's size comes from a stat.
        """
        if short and size.source != _STAT:
            try:
                size.learn(self._stat_full(full, generation)[0], _STAT)
            except XlaCkptError as e:
                logger.warning("%s: stat after a failed read failed too: %s", self._gs(full), e)
        parts = []
        if asked is not None:
            offset, want, got = asked
            parts.append(f"Expected {want} bytes [{offset}, {offset + want}) of "
                         f"{self._gs(full)}, got {got}")
        if size.bytes is not None:
            parts.append(f"the object has {size.bytes} bytes ({size.source})")
        elif asked is not None:
            parts.append("the object's size is unknown")
        if not parts:
            return gave_up
        text = "; ".join(parts)
        return StorageError(f"{gave_up}. {text[0].upper()}{text[1:]}.")

    def _object_size(self, full: str, generation: int | None, stored: int | None,
                     size: _Size) -> _Size:
        """The object's size from its metadata: this answer's header, an earlier one, or a stat."""
        if stored is not None:
            size.learn(stored, _STORED_LENGTH)
        elif size.bytes is None:
            size.learn(self._stat_full(full, generation)[0], _STAT)
        return size

    def _truncated(self, what: str, end: int, size: _Size) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"{what}: truncated: expected at least {end} bytes, object has {size.bytes} bytes")

    def _get_once(self, what: str, full: str, url: str, params: dict[str, str], start: int,
                  out: memoryview, generation: int | None, size: _Size,
                  clock: RequestClock | None = None) -> int:
        """One ranged GET of ``[start, start + len(out))`` into ``out``; returns bytes written.

        ``size`` is what the read knows of the object's size; answers add to it.
        An answer whose headers promise fewer bytes than asked (a short
        ``Content-Length`` or ``Content-Range``; a ``200`` from byte 0) is
        read and its bytes returned: the caller asks for the rest at once,
        without a retry counted (the answer kept its own word; only its range
        fell short).  Raises ``_Transient`` (carrying the good bytes
        that landed, in order from ``start``) for retryable failures,
        ``_ShortAnswer`` for answers that gave none of the bytes the object has.
        """
        want = len(out)
        end = start + want
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        resp = self._request(what, "GET", url, clock, params=params, headers=headers,
                             stream=True)
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
            _check_encoding(what, resp)
            served_gen = _header_generation(resp)
            if generation is not None and served_gen is not None and served_gen != generation:
                raise CheckpointNotFoundError(
                    f"{what}: generation {generation} was replaced by {served_gen} while reading; "
                    "the checkpoint was overwritten, restore again")
            length = _int_header(resp.headers.get("Content-Length"))
            stored = _int_header(resp.headers.get(_STORED_LENGTH))
            if status == 206:
                content_range = resp.headers.get("Content-Range", "")
                cr = _CONTENT_RANGE.match(content_range)
                if cr is None:
                    raise _Transient(f"206 response without a valid Content-Range "
                                     f"({resp.headers.get('Content-Range')!r})")
                first, last = int(cr.group(1)), int(cr.group(2))
                if cr.group(3) != "*":
                    size.learn(int(cr.group(3)), "Content-Range")
                elif stored is not None:
                    size.learn(stored, _STORED_LENGTH)
                if first != start:
                    raise _Transient(f"asked for bytes from {start}, the service sent bytes "
                                     f"from {first}")
                if size.bytes is not None and size.bytes < end:
                    raise self._truncated(what, end, size)
                n = min(want, last - first + 1)
                if length is not None:
                    n = min(n, length)
                if n <= 0:
                    raise _ShortAnswer(f"empty body (Content-Length {length}, Content-Range "
                                       f"{content_range!r})")
                got = _read_body(resp, out, n, "body bytes")
                reusable = length is not None and got == length
                if got < want:
                    logger.info("%s: short answer: %d of the %d bytes asked for from byte %d "
                                "(HTTP 206, Content-Range %r, Content-Length %s); asking for the "
                                "rest", what, got, want, start, content_range, length)
                return got
            # HTTP 200: the service ignored the Range header and sent the object from byte 0.
            if start > 0:
                self._object_size(full, generation, stored, size)
                if size.bytes is not None and size.bytes < end:
                    raise self._truncated(what, end, size)
                raise _ShortAnswer(
                    f"HTTP 200 to a read of bytes [{start}, {end}): the service ignored the Range "
                    f"header and sent {length if length is not None else 'an unknown number of'} "
                    f"bytes from byte 0 of an object of {size.bytes} bytes ({size.source}); "
                    "not used")
            if length is not None and length < want:
                self._object_size(full, generation, stored, size)
                if size.bytes is not None and size.bytes < end:
                    raise self._truncated(what, end, size)
                if not length:
                    raise _ShortAnswer(f"empty body (HTTP 200, Range ignored) for a read of "
                                       f"bytes [0, {end}) of an object of {size.bytes} bytes "
                                       f"({size.source})")
                got = _read_body(resp, out, length, "body bytes")
                reusable = True
                logger.info("%s: short answer: HTTP 200 (Range ignored) with %d of the %d bytes "
                            "asked for from byte 0 of an object of %s bytes (%s); asking for the "
                            "rest", what, got, want, size.bytes, size.source)
                return got
            got = _read_body(resp, out, want, "body bytes")
            reusable = length == want
            return got
        finally:
            if reusable:
                resp.raw.release_conn()
            else:
                resp.close()
