"""GCS backend (``gs://bucket/prefix``) on the official google-cloud-storage client.

Control plane (stat, list, delete, compose) goes through
:class:`google.cloud.storage.Client`; the data plane (ranged GETs and uploads)
goes through the same client's authorised HTTP session, so both share one
connection pool and one set of credentials:

* Credentials: Application Default Credentials; when ``STORAGE_EMULATOR_HOST``
  is set (or an ``endpoint`` is passed) anonymous credentials against that
  endpoint, project from ``GOOGLE_CLOUD_PROJECT`` or a default.
* **Listing** never shows in-flight parts.

The backend knows nothing about ranks or tensors; any rank may use it.

One module per concern (a constant is read where it is defined, so patch it there):

* :mod:`~xla_ckpt.storage.gcs.transport`: HTTP plumbing -- connection and
  session, one request, retries (408/429/5xx and connection errors) and the
  mapping of HTTP answers to library errors, header and crc32c helpers.
* :mod:`~xla_ckpt.storage.gcs.reads`: **ranged reads** -- stat, ranged reads
  pinned to a generation straight into the caller's buffer, resumed after a
  broken body or a short answer.
* :mod:`~xla_ckpt.storage.gcs.whole_reads`: **whole-object reads** --
  ``read_bytes``: one request for a small object, checked against its crc32c
  or size, else ranged reads checked against the crc32c of a stat.
* :mod:`~xla_ckpt.storage.gcs.writes`: **writes** -- ``write_atomic``: one
  multipart upload carrying the crc32c, or parts uploaded in parallel and
  composed into the final name in one atomic step.
* :mod:`~xla_ckpt.storage.gcs.in_flight`: **in-flight objects** -- their
  names, listing them, abandoning interrupted writes and deleting their parts,
  the daemon upload threads.
* :mod:`~xla_ckpt.storage.gcs.backend`: :class:`GCSStorage`, which composes
  them, with listing, deleting and child storages.
"""

from __future__ import annotations

from xla_ckpt.storage.gcs.backend import DEFAULT_CONFIG, GCSStorage, parse_gcs_uri
from xla_ckpt.storage.gcs.in_flight import TMP_MARK
from xla_ckpt.storage.gcs.reads import WHOLE_OBJECT_CRC_READS
from xla_ckpt.storage.gcs.transport import (
    CONNECT_TIMEOUT_S,
    DEFAULT_PROJECT,
    READ_TIMEOUT_S,
    crc32c_b64,
    crc32c_from_b64,
)
from xla_ckpt.storage.gcs.writes import MAX_COMPOSE_SOURCES, MULTIPART_MAX_BYTES

__all__ = [
    "CONNECT_TIMEOUT_S",
    "DEFAULT_CONFIG",
    "DEFAULT_PROJECT",
    "MAX_COMPOSE_SOURCES",
    "MULTIPART_MAX_BYTES",
    "READ_TIMEOUT_S",
    "TMP_MARK",
    "WHOLE_OBJECT_CRC_READS",
    "GCSStorage",
    "crc32c_b64",
    "crc32c_from_b64",
    "parse_gcs_uri",
]
