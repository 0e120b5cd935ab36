"""The GCS storage: a ``gs://`` URI, its reads and writes, listing, deleting, child storages."""

from __future__ import annotations

import builtins
import dataclasses
from typing import Any

from xla_ckpt.errors import (
    CheckpointNotFoundError,
    PreconditionFailedError,
    StorageError,
    StorageURIError,
)
from xla_ckpt.storage.base import (
    MiB,
    ObjectInfo,
    StorageConfig,
    check_generation_match,
    join,
    precondition_failed,
)
from xla_ckpt.storage.gcs.in_flight import TMP_MARK
from xla_ckpt.storage.gcs.transport import (
    CONNECT_TIMEOUT_S,
    READ_TIMEOUT_S,
    _Connection,
    _PreconditionNotMet,
)
from xla_ckpt.storage.gcs.whole_reads import _GCSWholeReads
from xla_ckpt.storage.gcs.writes import _GCSWrites
from xla_ckpt.storage.uri import parse_uri

_GLOB_CHARS = frozenset("*?[]{}\\")
"""Characters a ``matchGlob`` pattern treats as special."""

DEFAULT_CONFIG = StorageConfig(max_workers=32, slice_size_bytes=8 * MiB)
"""Defaults measured against the shaped emulator (see benchmarks/README.md, ``--sweep``)."""


def parse_gcs_uri(uri: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` -> ``("bucket", "a/b")``; a trailing ``/`` is dropped.

    :func:`xla_ckpt.storage.uri.parse_uri` with the scheme required to be ``gs``.

    Raises:
        StorageURIError: (a ``ConfigError``) not a ``gs://`` URI, no bucket or an invalid
            bucket name, an empty/``.``/``..`` segment in the path.
    """
    parsed = parse_uri(uri)
    if not parsed.is_gcs:
        raise StorageURIError(f"{uri!r} is not a gs:// URI; expected gs://BUCKET/PATH", uri=uri)
    return parsed.bucket, parsed.path


class GCSStorage(_GCSWholeReads, _GCSWrites):
    """Storage rooted at ``gs://bucket/prefix``.  See :mod:`xla_ckpt.storage.gcs`.

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
        StorageURIError: (a ``ConfigError``) the URI is not ``gs://bucket[/prefix]``.
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
        self._upload_pool = None
        self._timeout = (CONNECT_TIMEOUT_S, READ_TIMEOUT_S)

    def child(self, prefix: str) -> GCSStorage:
        """A storage rooted at ``prefix`` under this one, sharing its client and connection pool."""
        return GCSStorage(self.uri.rstrip("/") + "/" + prefix.strip("/"), self.config,
                          _shared=self._conn)

    def list(self, prefix: str = "", *, include_in_flight: bool = False) -> list[str]:
        """Sorted names under ``prefix`` (a "folder": ``a`` lists ``a/...``, never ``ab``).

        In-flight upload parts (names with ``.tmp-``) are hidden unless
        ``include_in_flight`` (for cleanup tools and tests).
        """
        p = prefix.strip("/")
        base = join(self.prefix, p)
        strip = len(self.prefix) + 1 if self.prefix else 0

        def run(timeout: tuple[float, float]) -> list[str]:
            return [b.name for b in self._conn.client.list_blobs(
                self.bucket_name, prefix=base or None, retry=None, timeout=timeout)]

        names = self._api(f"list {self._gs(base)}", run, bucket_404=True)
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

    def list_in_subfolders(self, prefix: str, name: str) -> builtins.list[ObjectInfo]:
        """:meth:`Storage.list_in_subfolders` in one listing (``matchGlob``
        ``<prefix>/*/<name>``: one request per 1,000 objects found; data files are not
        listed), each object with its custom metadata.  A prefix or name holding glob
        characters is listed the default way (:meth:`list`, then a stat each)."""
        base = join(self.prefix, prefix.strip("/"))
        if any(c in base + name for c in _GLOB_CHARS):
            return super().list_in_subfolders(prefix, name)
        head = base + "/" if base else ""

        def run(timeout: tuple[float, float]) -> builtins.list[ObjectInfo]:
            out = []
            for b in self._conn.client.list_blobs(self.bucket_name, prefix=head or None,
                                                  match_glob=f"{head}*/{name}", retry=None,
                                                  timeout=timeout):
                rel = b.name[len(head):]
                if TMP_MARK in rel or rel.count("/") != 1:
                    continue
                meta = b.metadata
                out.append(ObjectInfo(rel, int(b.size or 0),
                                      int(b.generation) if b.generation else None,
                                      {str(k): str(v) for k, v in meta.items()}
                                      if isinstance(meta, dict) else None))
            return out

        return sorted(self._api(f"list {self._gs(head)}*/{name}", run, bucket_404=True),
                      key=lambda o: o.name)

    def delete(self, name: str, *, if_generation_match: int | None = None) -> None:
        """Delete ``name``; a missing object is not an error.

        ``if_generation_match`` (see :meth:`Storage.write_atomic`) is sent as
        ``ifGenerationMatch``: only that generation is deleted.

        A retry of a delete whose first answer was lost (a timeout, a reset after the
        service acted) that meets 404 is success: the object is gone, by this delete.

        Raises:
            PreconditionFailedError: HTTP 412, the live object is another generation; kept
                (after a retry, the message says the first attempt may have deleted
                generation ``if_generation_match`` before another writer made this one).
        """
        expected = check_generation_match(if_generation_match)
        full = self._full(name)
        try:
            self._api(f"delete {self._gs(full)}",
                      lambda timeout: self._bucket.delete_blob(
                          full, if_generation_match=expected, retry=None, timeout=timeout))
        except CheckpointNotFoundError:
            return
        except _PreconditionNotMet as e:
            if expected is None:  # no precondition was sent: nothing to judge
                raise
            try:
                live, known = self._live(full), True
            except StorageError:
                live, known = None, False
            err = precondition_failed(self._gs(full), name.strip("/"), "deleted", expected,
                                      live[1] if live is not None else None, known=known)
            if e.retried and live is not None:
                # A 412 to a retry: our first attempt may have deleted generation `expected`
                # (its answer lost), and another writer created the name again since.  Either
                # way the live object is not the one we were asked to delete: it is kept.
                err = PreconditionFailedError(
                    f"{err}; an earlier attempt of this delete, whose answer was lost, may have "
                    f"deleted generation {expected} before another writer created generation "
                    f"{live[1]}, which is kept", name=err.name, expected_generation=expected,
                    actual_generation=live[1])
            raise err from None

    def close(self) -> None:
        super().close()
        if self._upload_pool is not None:
            self._upload_pool.shutdown(wait=True)
            self._upload_pool = None
        if self._owns_connection:
            self._conn.close()
