"""Writes of the GCS backend: multipart and composite uploads, compose.

:meth:`_GCSWrites.write_atomic`: up to :data:`MULTIPART_MAX_BYTES` in one
multipart upload carrying the crc32c (the service refuses mismatching bytes,
so the object is verified before it becomes visible); larger objects as parts
uploaded in parallel under in-flight names (``<name>.tmp-<id>-part-<n>``),
each checked against its crc32c, then composed (at most 32 sources per
compose, in a tree above that) into the final name in one atomic step, then
the parts are deleted.  A failed write deletes its parts and leaves the
previous object as it was.  What happens to the parts of a write that does not
finish (interrupted, abandoned, killed) is :mod:`.in_flight`'s.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from xla_ckpt.errors import CheckpointNotFoundError, PreconditionFailedError, StorageError
from xla_ckpt.format.crc import crc32c, crc32c_combine
from xla_ckpt.storage.base import MiB, ObjectInfo, check_generation_match, precondition_failed
from xla_ckpt.storage.gcs.in_flight import (
    _ACTIVE,
    _ACTIVE_LOCK,
    CLEANUP_ON_INTERRUPT_S,
    TMP_MARK,
    _Abandoned,
    _further_interrupts_deferred,
    _GCSInFlight,
    _Upload,
)
from xla_ckpt.storage.gcs.reads import _GCSReads
from xla_ckpt.storage.gcs.transport import (
    _bytes_view,
    _int_header,
    _PreconditionNotMet,
    crc32c_b64,
    crc32c_from_b64,
)

logger = logging.getLogger(__name__)

MULTIPART_MAX_BYTES = 8 * MiB
"""Objects up to this size go up in one multipart request that carries their crc32c."""

MAX_COMPOSE_SOURCES = 32
"""GCS composes at most 32 source objects per request."""

SEND_BLOCK_BYTES = 1 * MiB
"""A part's body is handed to the HTTP stack in blocks of at most this many bytes; between
blocks an abandoned write stops sending (the service never stores a body cut short)."""


@dataclass(frozen=True)
class _Part:
    name: str
    pieces: tuple[memoryview, ...]
    size: int


class _BodyReader:
    """A file-like request body over several buffers (sent without joining them).

    ``read(n)`` returns up to ``max(n, SEND_BLOCK_BYTES)`` bytes (http.client and urllib3
    send each block as it comes); with ``cancelled`` set it raises :class:`_Abandoned`.
    """

    def __init__(self, pieces: Sequence[memoryview],
                 cancelled: threading.Event | None = None) -> None:
        self._pieces = list(pieces)
        self._len = sum(len(p) for p in pieces)
        self._i = 0
        self._pos = 0
        self._cancelled = cancelled

    def __len__(self) -> int:
        return self._len

    def read(self, n: int = -1) -> memoryview | bytes:
        if self._cancelled is not None and self._cancelled.is_set():
            raise _Abandoned("the write was abandoned; the rest of this body is not sent")
        while self._i < len(self._pieces):
            p = self._pieces[self._i]
            if self._pos < len(p):
                left = len(p) - self._pos
                k = left if n is None or n < 0 else min(max(n, SEND_BLOCK_BYTES), left)
                view = p[self._pos:self._pos + k]
                self._pos += k
                return view
            self._i += 1
            self._pos = 0
        return b""


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


class _GCSWrites(_GCSInFlight, _GCSReads):
    """The write half of :class:`~xla_ckpt.storage.gcs.GCSStorage` (it stats what it wrote)."""

    def write_atomic(self, name: str, buffers: Iterable[memoryview | bytes], *,
                     if_generation_match: int | None = None,
                     metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        """Write the concatenation of ``buffers`` as ``name``, all or nothing.

        ``buffers`` is consumed first (no upload starts before it is), then:
        objects of at least ``config.parallel_upload_threshold_bytes`` go up
        as parts of ``config.upload_part_size_bytes`` in parallel, each
        crc32c-checked, then composed into ``name``; smaller ones up to
        :data:`MULTIPART_MAX_BYTES` in one multipart upload with the crc32c,
        and the rest as one checked part composed into ``name``.  Parts are deleted in
        every case (after an interrupt within :data:`CLEANUP_ON_INTERRUPT_S`); a failure
        leaves any previous ``name`` untouched.

        ``if_generation_match`` (see :meth:`Storage.write_atomic`) goes on the request
        that makes ``name`` (the multipart upload, or the last compose) as
        ``ifGenerationMatch``; parts and intermediate composes are unconditional.  A
        composite write checks it once before uploading its parts too.  A 412 answer to a
        request that had been retried counts as success when the live object has this
        write's size and crc32c (the earlier attempt did write it).  ``metadata`` becomes
        the object's custom metadata, on the same request.

        Returns:
            The new object's :class:`ObjectInfo` (size in bytes, generation).

        Raises:
            PreconditionFailedError: ``if_generation_match`` did not hold (nothing written).
            StoragePermissionError / StorageError: the upload failed (nothing
                new is visible under ``name``), or the storage was closed.
        """
        expected = check_generation_match(if_generation_match)
        full = self._full(name)
        if self._writes_closed:
            raise StorageError(f"upload {self._gs(full)}: the storage was closed")
        pieces = [_bytes_view(b) for b in buffers]
        pieces = [p for p in pieces if len(p)]
        size = sum(len(p) for p in pieces)
        if size < self.config.parallel_upload_threshold_bytes and size <= MULTIPART_MAX_BYTES:
            crc = 0
            for p in pieces:
                crc = crc32c(p, crc)
            res = self._upload_multipart(full, pieces, size, crc, expected, metadata)
        else:
            if expected is not None:  # fail before uploading the parts, not after
                live = self._live(full)
                if (live[1] if live is not None else None) != (expected or None):
                    raise self._not_written(full, expected, live)
            res = self._upload_composite(full, pieces, size, expected, metadata)
        return ObjectInfo(name=name.strip("/"), size=int(res.get("size", size)),
                          generation=int(res["generation"]) if res.get("generation") else None)

    def _live(self, full: str) -> tuple[int, int | None, int | None] | None:
        """(size, generation, crc32c) of the live ``full``; None if absent; raises if unknown."""
        try:
            return self._stat_full(full)
        except CheckpointNotFoundError:
            return None

    def _not_written(self, full: str, expected: int,
                     live: tuple[int, int | None, int | None] | None, *,
                     known: bool = True) -> PreconditionFailedError:
        name = full[len(self.prefix) + 1:] if self.prefix else full
        return precondition_failed(self._gs(full), name, "written", expected,
                                   live[1] if live is not None else None, known=known)

    def _unless_ours(self, e: _PreconditionNotMet, full: str, expected: int, size: int,
                     crc: int) -> dict[str, Any]:
        """After HTTP 412 to the write of ``full``: the answer it would have had, when an
        earlier attempt of the same request may have written it and the live object has
        its size and crc32c; else raises PreconditionFailedError naming the live generation."""
        try:
            live = self._live(full)
        except StorageError as err:
            logger.warning("%s: stat after HTTP 412 failed: %s", self._gs(full), err)
            raise self._not_written(full, expected, None, known=False) from None
        if e.retried and live is not None and live[0] == size and live[2] == crc:
            logger.info("%s: HTTP 412 to a retried write, and the live object (generation %s) "
                        "has its %d bytes and crc32c: an earlier attempt wrote it",
                        self._gs(full), live[1], size)
            return {"size": size, "generation": live[1], "crc32c": crc32c_b64(crc)}
        raise self._not_written(full, expected, live) from None

    def _upload_multipart(self, full: str, pieces: Sequence[memoryview], size: int,
                          crc: int, expected: int | None = None,
                          metadata: Mapping[str, str] | None = None) -> dict[str, Any]:
        """One multipart upload carrying the crc32c: the service checks it before it is visible.

        ``expected``: its ``ifGenerationMatch`` (None: unconditional); ``metadata``: the
        object's custom metadata."""
        boundary = f"==xla_ckpt_{uuid.uuid4().hex}=="
        resource: dict[str, Any] = {"name": full, "contentType": "application/octet-stream",
                                    "crc32c": crc32c_b64(crc)}
        if metadata:
            resource["metadata"] = dict(metadata)
        meta = json.dumps(resource).encode()
        head = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                ).encode() + meta + (f"\r\n--{boundary}\r\nContent-Type: application/"
                                     "octet-stream\r\n\r\n").encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        url = f"{self._conn.endpoint}/upload/storage/v1/b/{self.bucket_name}/o"
        params = {"uploadType": "multipart"}
        if expected is not None:
            params["ifGenerationMatch"] = str(expected)
        try:
            res = self._send(f"upload {self._gs(full)} ({size} bytes)", "POST", url,
                             params=params,
                             headers={"Content-Type": f"multipart/related; boundary={boundary}"},
                             body=lambda: _BodyReader([memoryview(head), *pieces,
                                                       memoryview(tail)]))
        except _PreconditionNotMet as e:
            if expected is None:  # no precondition was sent: nothing to judge
                raise
            return self._unless_ours(e, full, expected, size, crc)
        self._check_written(full, res, size, crc)
        return res

    def _upload_part(self, part: _Part, up: _Upload | None = None) -> int:
        """Upload one in-flight part; returns its crc32c after the service confirmed it.

        With ``up``: refused once the write is abandoned, the body stops between blocks when
        it is, and a part that lands after that deletes itself.
        """
        if up is not None:
            up.begin(part.name)
        cancelled = up.cancelled if up is not None else None
        crc = 0
        for p in part.pieces:
            crc = crc32c(p, crc)
        url = f"{self._conn.endpoint}/upload/storage/v1/b/{self.bucket_name}/o"
        what = f"upload part {self._gs(part.name)} ({part.size} bytes)"
        backoff = self._backoff(what)
        while True:
            res = self._send(what, "POST", url, params={"uploadType": "media", "name": part.name},
                             headers={"Content-Type": "application/octet-stream"},
                             body=lambda: _BodyReader(part.pieces, cancelled))
            if cancelled is not None and cancelled.is_set():
                self._delete_one_quietly(part.name)
                raise _Abandoned(f"{what}: the write was abandoned; the part was deleted")
            served = crc32c_from_b64(res.get("crc32c"))
            if _int_header(str(res.get("size"))) == part.size and served in (None, crc):
                return crc
            backoff.failed(f"the service stored {res.get('size')} bytes with crc32c "
                           f"{res.get('crc32c')}, sent {part.size} bytes with crc32c "
                           f"{crc32c_b64(crc)}")

    def _upload_composite(self, full: str, pieces: Sequence[memoryview], size: int,
                          expected: int | None = None,
                          metadata: Mapping[str, str] | None = None) -> dict[str, Any]:
        up = _Upload(self, full)
        up.metadata = metadata  # the last compose gives the object its custom metadata
        with _ACTIVE_LOCK:
            _ACTIVE.add(up)
        try:
            try:
                cfg = self.config
                part_size = cfg.upload_part_size_bytes \
                    if size >= cfg.parallel_upload_threshold_bytes else size
                uid = uuid.uuid4().hex[:12]
                parts = [_Part(f"{full}{TMP_MARK}{uid}-part-{i:05d}", tuple(ps), n)
                         for i, (ps, n) in enumerate(_split(pieces, part_size))]
                pool = up.pool = self._uploads()
                for p in parts:
                    if up.cancelled.is_set():
                        raise _Abandoned(f"{self._gs(full)}: the write was abandoned")
                    try:
                        fut = pool.submit(self._upload_part, p, up)
                    except RuntimeError:  # another write's interrupt dropped the pool
                        pool = up.pool = self._uploads()
                        fut = pool.submit(self._upload_part, p, up)
                    up.futures.append(fut)
                crcs = [f.result() for f in up.futures]
                sources = [(p.name, p.size, c) for p, c in zip(parts, crcs, strict=True)]
                res = self._compose_tree(full, sources, uid, up, expected)
                self._delete_quietly(up.made())
            except BaseException as e:
                interrupted = not isinstance(e, Exception)
                if interrupted:
                    with _further_interrupts_deferred():
                        self._abandon(up, deadline=time.monotonic() + CLEANUP_ON_INTERRUPT_S)
                else:
                    self._abandon(up, deadline=None)
                if up.abandoned_by_close and not interrupted:
                    raise StorageError(f"upload {self._gs(full)} ({size} bytes): abandoned, the "
                                       "storage was closed while it ran; nothing new is "
                                       "visible") from e
                raise
        finally:
            with _ACTIVE_LOCK:
                _ACTIVE.discard(up)
        return res

    def _compose_tree(self, full: str, sources: list[tuple[str, int, int]], uid: str,
                      up: _Upload, expected: int | None = None) -> dict[str, Any]:
        """Compose ``sources`` into ``full``: in a tree of unconditional intermediate composes
        above :data:`MAX_COMPOSE_SOURCES`, the last one with ``ifGenerationMatch=expected``."""
        level = 0
        while len(sources) > MAX_COMPOSE_SOURCES:
            grouped = []
            for j in range(0, len(sources), MAX_COMPOSE_SOURCES):
                group = sources[j:j + MAX_COMPOSE_SOURCES]
                if len(group) == 1:
                    grouped.append(group[0])
                    continue
                name = f"{full}{TMP_MARK}{uid}-compose-{level}-{j // MAX_COMPOSE_SOURCES:05d}"
                up.begin(name)
                size, crc, _gen = self._compose(name, group)
                grouped.append((name, size, crc))
            sources, level = grouped, level + 1
        if up.cancelled.is_set():
            raise _Abandoned(f"{self._gs(full)}: the write was abandoned")
        size, crc, gen = self._compose(full, sources, expected, up.metadata)
        return {"size": size, "generation": gen, "crc32c": crc32c_b64(crc)}

    def _compose(self, dest: str, sources: list[tuple[str, int, int]],
                 expected: int | None = None,
                 metadata: Mapping[str, str] | None = None) -> tuple[int, int, int | None]:
        """Compose ``sources`` (name, size, crc32c) into ``dest``: (size, crc32c, generation).

        ``expected``: the destination's ``ifGenerationMatch`` (None: unconditional);
        ``metadata``: its custom metadata."""
        size, crc = 0, 0
        for _name, n, c in sources:
            crc = crc32c_combine(crc, c, n)
            size += n
        blob = self._bucket.blob(dest)
        blob.content_type = "application/octet-stream"
        blob.crc32c = crc32c_b64(crc)
        if metadata:
            blob.metadata = dict(metadata)
        srcs = [self._bucket.blob(name) for name, _n, _c in sources]
        try:
            self._api(f"compose {self._gs(dest)} from {len(srcs)} parts",
                      lambda timeout: blob.compose(srcs, if_generation_match=expected,
                                                   retry=None, timeout=timeout))
        except _PreconditionNotMet as e:
            if expected is None:  # no precondition was sent: nothing to judge
                raise
            res = self._unless_ours(e, dest, expected, size, crc)
            return size, crc, res["generation"]
        served = crc32c_from_b64(blob.crc32c)
        if int(blob.size or 0) != size or served not in (None, crc):
            raise StorageError(f"compose {self._gs(dest)}: the service reports {blob.size} bytes "
                               f"with crc32c {blob.crc32c}, expected {size} bytes with crc32c "
                               f"{crc32c_b64(crc)}; write it again")
        gen = int(blob.generation) if blob.generation else None
        self._conn.remember(dest, gen, size, crc)
        return size, crc, gen

    def _check_written(self, full: str, res: dict[str, Any], size: int, crc: int) -> None:
        served = crc32c_from_b64(res.get("crc32c"))
        if _int_header(str(res.get("size"))) != size or served not in (None, crc):
            raise StorageError(f"upload {self._gs(full)}: the service stored {res.get('size')} "
                               f"bytes with crc32c {res.get('crc32c')}, sent {size} bytes with "
                               f"crc32c {crc32c_b64(crc)}; write it again")
        gen = res.get("generation")
        self._conn.remember(full, int(gen) if gen else None, size, crc)
