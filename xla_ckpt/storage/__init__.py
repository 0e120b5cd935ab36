"""Storage backends chosen by URI scheme: a local path / ``file://`` or ``gs://``."""

from __future__ import annotations

from xla_ckpt.errors import ConfigError
from xla_ckpt.storage.base import ObjectInfo, RangeRead, Storage, StorageConfig, join
from xla_ckpt.storage.local import LocalStorage

__all__ = [
    "ObjectInfo",
    "RangeRead",
    "Storage",
    "StorageConfig",
    "is_gcs_uri",
    "join",
    "open_storage",
]


def is_gcs_uri(uri: str) -> bool:
    return uri.startswith("gs://")


def open_storage(uri: str, config: StorageConfig | None = None) -> Storage:
    """Storage rooted at ``uri``: ``gs://bucket/prefix`` -> GCS, anything else -> local folder."""
    if is_gcs_uri(uri):
        from xla_ckpt.storage.gcs import GCSStorage  # noqa: PLC0415 - imports google-cloud

        return GCSStorage(uri, config)
    if "://" in uri and not uri.startswith("file://"):
        raise ConfigError(f"unsupported URI scheme in {uri!r}: use a local path, file:// or gs://")
    return LocalStorage(uri, config)
