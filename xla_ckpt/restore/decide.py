"""Decide once: rank 0 picks the checkpoint and sends it, with its manifest, to every rank.

DESIGN decision 2: listings of a bucket may disagree between ranks, so only
rank 0 looks.  It resolves ``uri`` with the one resolver,
:func:`xla_ckpt.run.resolve.resolve` (a checkpoint folder; a run folder's latest
committed checkpoint; ``<run>/checkpoint_last`` / ``<run>/checkpoint_best``),
which reads and validates that checkpoint's manifest, and broadcasts the
outcome: the checkpoint URI plus the manifest bytes, or "nothing committed",
or the error it hit.  Every rank then restores exactly that checkpoint, from
that manifest, and every rank raises the same error class when there is none.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from xla_ckpt.comm.base import Dist, decode_object, describe_error, encode_object
from xla_ckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    DistributedError,
    NothingCommittedError,
    UncommittedCheckpointError,
)
from xla_ckpt.format.manifest import MANIFEST_NAME, Manifest
from xla_ckpt.run.resolve import resolve
from xla_ckpt.run.sniff import XLA_CKPT
from xla_ckpt.storage import Storage, StorageConfig, open_storage

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class Decision:
    """Which checkpoint a restore reads, decided once on one rank and the same on every rank:
    ``checkpoint`` (its URI) described by ``manifest`` (parsed and validated from the
    ``manifest_bytes`` bytes rank 0 read).

    The one decision type: :func:`decide` makes it for :func:`xla_ckpt.restore.restore`,
    :class:`~xla_ckpt.manager.CheckpointManager` makes it for its restores (with the best
    score and step rules of the run folder) and passes it to ``restore()``, which then
    decides nothing again.
    """

    checkpoint: str
    manifest: Manifest
    manifest_bytes: int
    #: Where the bytes come from when not ``checkpoint`` itself: ``source(config)`` opens
    #: this rank's storage for the checkpoint folder (a restore from the local tier: this
    #: host's copy, the durable one behind it; :mod:`xla_ckpt.storage.tiered`).
    source: Callable[[StorageConfig | None], Storage] | None = field(default=None,
                                                                       compare=False)

    def open(self, config: StorageConfig | None) -> Storage:
        """This rank's storage rooted at the checkpoint folder (every reader opens it here)."""
        if self.source is not None:
            return self.source(config)
        return open_storage(self.checkpoint, config)

    @property
    def name(self) -> str:
        """Last segment of :attr:`checkpoint` (its folder name in a run folder)."""
        return self.checkpoint.rstrip("/").rsplit("/", 1)[-1]

    @property
    def save_id(self) -> str:
        return self.manifest.save_id

    @classmethod
    def from_bytes(cls, checkpoint: str, data: bytes, parsed: Manifest | None = None
                   ) -> Decision:
        """The decision to read ``checkpoint`` whose manifest is ``data`` (as rank 0 read it
        and sent it): ``parsed`` when the caller parsed those bytes already (rank 0), else
        parsed and validated here.

        Raises:
            CheckpointCorruptError: ``data`` is not a valid manifest.
        """
        manifest = parsed if parsed is not None else \
            Manifest.from_json_bytes(data, where=f"{checkpoint}/{MANIFEST_NAME}",
                                     require_crc=True)
        return cls(checkpoint, manifest, len(data))


def _resolve(uri: str, config: StorageConfig | None) -> tuple[str, bytes, Manifest | None]:
    """On rank 0: the checkpoint URI to restore, its manifest bytes and the manifest the
    resolver parsed and validated from those bytes (so rank 0 does not parse it again).

    Raises:
        what :func:`xla_ckpt.run.resolve.resolve` raises; ConfigError for a legacy file.
    """
    r = resolve(uri, config)
    if r.kind != XLA_CKPT:
        raise ConfigError(f"{r.checkpoint} is {r.what}; restore() reads "
                          f"xla_ckpt checkpoints: convert it with `xla-ckpt convert "
                          f"{r.checkpoint} DST`, or read it on one process with "
                          "xla_ckpt.trainer.SingleProcessRestorer")
    return r.checkpoint, r.manifest_bytes, r.manifest


def _status_of(e: BaseException) -> dict[str, Any]:
    if isinstance(e, UncommittedCheckpointError):
        return {"status": "uncommitted", "message": str(e), "uri": e.uri,
                "incomplete": list(e.incomplete)}
    if isinstance(e, NothingCommittedError):
        return {"status": "nothing", "message": str(e), "uri": e.uri}
    if isinstance(e, CheckpointNotFoundError):
        return {"status": "not_found", "message": str(e)}
    if isinstance(e, ConfigError):
        return {"status": "config", "message": str(e)}
    return {"status": "error", "message": describe_error(e)}


def decide(uri: str, dist: Dist, *, config: StorageConfig | None = None,
           context: str = "") -> Decision:
    """Every rank calls this; rank 0 decides, every rank returns the same :class:`Decision`.

    Args:
        uri: a checkpoint folder or a run folder (local path or ``gs://``), or a
            ``<run>/checkpoint_last`` / ``<run>/checkpoint_best`` pointer.
        dist: the job's :class:`~xla_ckpt.comm.Dist`.
        config: storage knobs for rank 0's look-up.
        context: appended to error messages (which strategy runs and why).

    Raises:
        NothingCommittedError / UncommittedCheckpointError: on every rank, when nothing is
            committed at ``uri`` (the same class on every rank, so a trainer can start fresh).
        CheckpointNotFoundError: on every rank, for a typo'd path, a missing pointer, a file
            that is not a checkpoint (not a fresh start).
        ConfigError: on every rank, ``uri`` names a legacy ``.pt`` file.
        DistributedError: on every rank when rank 0 could not decide (storage
            error, corrupt manifest); ``failures`` names rank 0 and the cause.
        CollectiveTimeoutError: the decision did not arrive (rank 0 died or hung).
    """
    status: dict = {}
    payload = b""
    local_error: BaseException | None = None
    parsed: Manifest | None = None
    if dist.rank == 0:
        try:
            ckpt, payload, parsed = _resolve(uri, config)
            status = {"status": "ok", "checkpoint": ckpt}
        except Exception as e:  # noqa: BLE001 - sent to every rank, then raised everywhere
            status, local_error = _status_of(e), e
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
    if kind in ("uncommitted", "nothing"):
        cls = UncommittedCheckpointError if kind == "uncommitted" else NothingCommittedError
        raise cls(status["message"] + suffix, uri=status.get("uri", ""),
                  incomplete=tuple(status.get("incomplete", ()))) from local_error
    if kind == "not_found":
        raise CheckpointNotFoundError(status["message"] + suffix) from local_error
    if kind == "config":
        raise ConfigError(status["message"] + suffix) from local_error
    if kind != "ok":
        raise DistributedError(f"restore: rank 0 could not decide which checkpoint to restore "
                               f"from {uri}{suffix}", {0: status.get("message", "?")}) \
            from local_error
    # the other ranks parse and validate the bytes they got (rank 0's resolver already did)
    decision = Decision.from_bytes(status["checkpoint"], data, parsed)
    if dist.rank == 0:
        logger.info("rank 0: restoring %s (save %s, %d bytes of data, manifest %d bytes)%s",
                    decision.checkpoint, decision.save_id, decision.manifest.nbytes, len(data),
                    suffix)
    return decision
