"""Writes of the GCS backend: multipart and composite uploads, compose, cleanup of parts.

:meth:`_GCSWrites.write_atomic`: up to :data:`MULTIPART_MAX_BYTES` in one
multipart upload carrying the crc32c (the service refuses mismatching bytes,
so the object is verified before it becomes visible); larger objects as parts
uploaded in parallel under in-flight names (``<name>.tmp-<id>-part-<n>``),
each checked against its crc32c, then composed (at most 32 sources per
compose, in a tree above that) into the final name in one atomic step, then
the parts are deleted.  A failed write deletes its parts and leaves the
previous object as it was.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from xla_ckpt.errors import CheckpointNotFoundError, StorageError
from xla_ckpt.format.crc import crc32c, crc32c_combine
from xla_ckpt.storage.base import MiB, ObjectInfo
from xla_ckpt.storage.gcs.transport import (
    _bytes_view,
    _GCSBase,
    _int_header,
    crc32c_b64,
    crc32c_from_b64,
)

logger = logging.getLogger(__name__)

TMP_MARK = ".tmp-"
"""In-flight objects (upload parts) carry this in their name; :meth:`GCSStorage.list` hides them."""

MULTIPART_MAX_BYTES = 8 * MiB
"""Objects up to this size go up in one multipart request that carries their crc32c."""

MAX_COMPOSE_SOURCES = 32
"""GCS composes at most 32 source objects per request."""


@dataclass(frozen=True)
class _Part:
    name: str
    pieces: tuple[memoryview, ...]
    size: int


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


class _GCSWrites(_GCSBase):
    """The write half of :class:`~xla_ckpt.storage.gcs.GCSStorage`."""

    _upload_pool: cf.ThreadPoolExecutor | None

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

    def _upload_multipart(self, full: str, pieces: Sequence[memoryview], size: int,
                          crc: int) -> dict[str, Any]:
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

    def _upload_composite(self, full: str, pieces: Sequence[memoryview],
                          size: int) -> dict[str, Any]:
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
            sources = [(p.name, p.size, c) for p, c in zip(parts, crcs, strict=True)]
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
                      temps: list[str]) -> dict[str, Any]:
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

    def _check_written(self, full: str, res: dict[str, Any], size: int, crc: int) -> None:
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
