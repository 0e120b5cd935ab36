"""Read a checkpoint's commit marker: ``manifest.json``, parsed and validated.

Kept apart from :mod:`xla_ckpt.io.reader` (the tensor reader) so that what only lists and
reads manifests (the run-folder catalog, ``xla-ckpt ls``/``rm``/``gc``) needs no torch.
"""

from __future__ import annotations

from typing import Any, Mapping

from xla_ckpt.errors import CheckpointNotFoundError, IncompleteCheckpointError
from xla_ckpt.format import typed
from xla_ckpt.format.manifest import MANIFEST_NAME, Manifest
from xla_ckpt.storage import Storage

LEASE_EPOCH_KEY = "lease_epoch"
"""Key of the writer's lease epoch in a manifest's metadata and in a pointer document."""

ORDER_METADATA = ("xla_ckpt-lease-epoch", "xla_ckpt-num-updates", "xla_ckpt-created-unix-s")
"""Custom metadata keys the commit stores with ``manifest.json`` (:func:`order_metadata`):
what a run folder's catalog orders its checkpoints by, read from one listing."""

SAVE_ID_METADATA = "xla_ckpt-save-id"
"""Custom metadata key of the manifest's save id, stored beside :data:`ORDER_METADATA`: a
local-tier restore learns from the same listing whether the durable tier holds the very save
a host holds (:func:`xla_ckpt.manager.local_restore.decide_local_fast`)."""

Order = tuple[int, int, float]
"""``(lease_epoch, num_updates, created_unix_s)`` of a committed checkpoint (module
:mod:`xla_ckpt.run.catalog`, "Order")."""


def _count(v: Any, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default


def order_of(manifest: Manifest) -> Order:
    """What ``manifest`` says about its checkpoint's place in a run folder: the lease epoch
    (0: written without a lease) and ``num_updates`` (-1: none) of its metadata summary,
    and its creation time (Unix seconds)."""
    md = typed.decode(manifest.metadata) if manifest.metadata is not None else None
    md = md if isinstance(md, dict) else {}
    n = md.get("num_updates")
    return (_count(md.get(LEASE_EPOCH_KEY), 0),
            n if isinstance(n, int) and not isinstance(n, bool) else -1,
            float(manifest.created_unix_s or 0.0))


def order_metadata(manifest: Manifest) -> dict[str, str]:
    """:func:`order_of` as the custom metadata the commit stores with the manifest."""
    epoch, updates, created = order_of(manifest)
    out = dict(zip(ORDER_METADATA, (str(epoch), str(updates), repr(created)), strict=True))
    if manifest.save_id:
        out[SAVE_ID_METADATA] = manifest.save_id
    return out


def save_id_from_metadata(metadata: Mapping[str, str] | None) -> str | None:
    """The save id :func:`order_metadata` stored, or None (committed by an earlier
    xla_ckpt, or a backend that keeps no metadata: read the manifest to learn it)."""
    v = (metadata or {}).get(SAVE_ID_METADATA)
    return v if isinstance(v, str) and v else None


def order_from_metadata(metadata: Mapping[str, str] | None) -> Order | None:
    """The :data:`Order` custom metadata records; None when it lacks it (a checkpoint
    committed by an earlier xla_ckpt, a backend that keeps no metadata) or is malformed."""
    if not metadata:
        return None
    try:
        epoch, updates, created = (metadata[k] for k in ORDER_METADATA)
        return int(epoch), int(updates), float(created)
    except (KeyError, ValueError, TypeError):
        return None


def read_manifest(storage: Storage) -> Manifest:
    """Read and validate ``manifest.json`` at the storage root.

    Raises:
        IncompleteCheckpointError: data files exist but no manifest (the save
            never committed).
        CheckpointNotFoundError: nothing is there.
        CheckpointCorruptError: the manifest is malformed.
    """
    try:
        data = storage.read_bytes(MANIFEST_NAME)
    except CheckpointNotFoundError:
        if storage.list(""):
            raise IncompleteCheckpointError(
                f"{storage.uri}: checkpoint is incomplete (no {MANIFEST_NAME} commit marker); "
                "the save that wrote it did not finish. Restore an earlier checkpoint.") from None
        raise CheckpointNotFoundError(f"{storage.uri}: no checkpoint here "
                                      f"({MANIFEST_NAME} not found)") from None
    return Manifest.from_json_bytes(data, where=storage.url(MANIFEST_NAME), require_crc=True)
