"""Storage backends chosen by URI scheme: a local path / ``file://`` or ``gs://``.

Every URI is classified by :func:`~xla_ckpt.storage.uri.parse_uri` (rules in
:mod:`xla_ckpt.storage.uri`); unknown schemes and malformed forms raise
:class:`~xla_ckpt.errors.StorageURIError` before anything is read or written.
"""

from __future__ import annotations

from xla_ckpt.storage.base import ObjectInfo, RangeRead, Storage, StorageConfig, join
from xla_ckpt.storage.local import LocalStorage
from xla_ckpt.storage.uri import StorageURI, parse_uri

__all__ = [
    "ObjectInfo",
    "RangeRead",
    "Storage",
    "StorageConfig",
    "StorageURI",
    "is_gcs_uri",
    "join",
    "open_storage",
    "parse_uri",
]


def is_gcs_uri(uri: str) -> bool:
    """True for a ``gs://`` URI, False for a local path or ``file://`` URI.

    Raises:
        StorageURIError: ``uri`` is neither (``s3://...``, ``gs:/b/x``, ...): a malformed URI
            is refused here too, never taken for a local path.
    """
    return parse_uri(uri).is_gcs


def open_storage(uri: str, config: StorageConfig | None = None) -> Storage:
    """Storage rooted at ``uri``: ``gs://bucket/prefix`` -> GCS, local path / ``file://`` -> local.

    Raises:
        StorageURIError: unknown scheme or malformed URI (see :mod:`xla_ckpt.storage.uri`);
            nothing is created.
    """
    if parse_uri(uri).is_gcs:
        from xla_ckpt.storage.gcs import GCSStorage  # noqa: PLC0415 - imports google-cloud

        return GCSStorage(uri, config)
    return LocalStorage(uri, config)
