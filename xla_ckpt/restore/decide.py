"""Decide once: rank 0 picks the checkpoint and sends it, with its manifest, to every rank.

DESIGN decision 2: listings of a bucket may disagree between ranks, so only
rank 0 looks.  It resolves ``uri`` (a checkpoint folder, or a run folder whose
latest committed checkpoint it picks with
:func:`xla_ckpt.io.catalog.resolve_latest`), reads and validates that
checkpoint's manifest, and broadcasts the outcome: the checkpoint URI plus the
manifest bytes, or "nothing committed", or the error it hit.  Every rank
then restores exactly that checkpoint, from that manifest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from xla_ckpt.comm.base import Dist, decode_object, describe_error, encode_object
from xla_ckpt.errors import CheckpointNotFoundError, DistributedError, IncompleteCheckpointError
from xla_ckpt.format.manifest import MANIFEST_NAME, Manifest
from xla_ckpt.io.catalog import list_checkpoints, resolve_latest
from xla_ckpt.io.writer import DATA_PREFIX
from xla_ckpt.storage import StorageConfig, open_storage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """What every rank restores: ``checkpoint`` (URI) described by ``manifest``."""

    checkpoint: str
    manifest: Manifest
    manifest_bytes: int


def _resolve(uri: str, config: StorageConfig | None) -> tuple[str, bytes]:
    """On rank 0: the checkpoint URI to restore and its manifest bytes.

    Raises:
        IncompleteCheckpointError: ``uri`` is a checkpoint folder without its
            commit marker.
        CheckpointNotFoundError: nothing committed at or under ``uri``.
    """
    storage = open_storage(uri, config)
    try:
        if storage.exists(MANIFEST_NAME):
            return storage.uri, storage.read_bytes(MANIFEST_NAME)
        names = storage.list("")
        if any("/" not in n and n.startswith(DATA_PREFIX) for n in names):
            raise IncompleteCheckpointError(
                f"{storage.uri}: checkpoint is incomplete (no {MANIFEST_NAME} commit marker); "
                "the save that wrote it did not finish. Restore an earlier checkpoint.")
        name = resolve_latest(storage)
        if name is None:
            skipped = [e.name for e in list_checkpoints(storage) if not e.committed]
            extra = f" (skipped incomplete: {', '.join(skipped[:5])})" if skipped else ""
            raise CheckpointNotFoundError(f"{storage.uri}: no committed checkpoint here{extra}")
        child = storage.child(name)
        try:
            return child.uri, child.read_bytes(MANIFEST_NAME)
        finally:
            child.close()
    finally:
        storage.close()


def decide(uri: str, dist: Dist, *, config: StorageConfig | None = None,
           context: str = "") -> Decision:
    """Every rank calls this; rank 0 decides, every rank returns the same :class:`Decision`.

    Args:
        uri: a checkpoint folder or a run folder (local path or ``gs://``).
        dist: the job's :class:`~xla_ckpt.comm.Dist`.
        config: storage knobs for rank 0's look-up.
        context: appended to error messages (which strategy runs and why).

    Raises:
        IncompleteCheckpointError / CheckpointNotFoundError: on every rank,
            when nothing committed is there (the same class on every rank, so a
            trainer can start fresh).
        DistributedError: on every rank when rank 0 could not decide (storage
            error, corrupt manifest); ``failures`` names rank 0 and the cause.
        CollectiveTimeoutError: the decision did not arrive (rank 0 died or hung).
    """
    status: dict = {}
    payload = b""
    local_error: BaseException | None = None
    if dist.rank == 0:
        try:
            ckpt, payload = _resolve(uri, config)
            Manifest.from_json_bytes(payload, where=f"{ckpt}/{MANIFEST_NAME}")
            status = {"status": "ok", "checkpoint": ckpt}
        except IncompleteCheckpointError as e:
            status, local_error = {"status": "incomplete", "message": str(e)}, e
        except CheckpointNotFoundError as e:
            status, local_error = {"status": "not_found", "message": str(e)}, e
        except Exception as e:  # noqa: BLE001 - sent to every rank, then raised everywhere
            status, local_error = {"status": "error", "message": describe_error(e)}, e
    # One message: the typed status, then the manifest bytes (one control-plane round).
    message = None
    if dist.rank == 0:
        head = encode_object(status)
        message = len(head).to_bytes(8, "little") + head + payload
    message = dist.broadcast_bytes(message, src=0)
    n = int.from_bytes(message[:8], "little")
    status, data = decode_object(message[8:8 + n]), message[8 + n:]
    kind = status.get("status")
    suffix = f" [{context}]" if context else ""
    if kind == "incomplete":
        raise IncompleteCheckpointError(status["message"] + suffix) from local_error
    if kind == "not_found":
        raise CheckpointNotFoundError(status["message"] + suffix) from local_error
    if kind != "ok":
        raise DistributedError(f"restore: rank 0 could not decide which checkpoint to restore "
                               f"from {uri}{suffix}", {0: status.get("message", "?")}) \
            from local_error
    ckpt = status["checkpoint"]
    manifest = Manifest.from_json_bytes(data, where=f"{ckpt}/{MANIFEST_NAME}")
    if dist.rank == 0:
        logger.info("rank 0: restoring %s (save %s, %d bytes of data, manifest %d bytes)%s", ckpt,
                    manifest.save_id, manifest.nbytes, len(data), suffix)
    return Decision(ckpt, manifest, len(data))
