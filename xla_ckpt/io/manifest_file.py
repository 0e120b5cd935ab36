"""Read a checkpoint's commit marker: ``manifest.json``, parsed and validated.

Kept apart from :mod:`xla_ckpt.io.reader` (the tensor reader) so that what only lists and
reads manifests (the run-folder catalog, ``xla-ckpt ls``/``rm``/``gc``) needs no torch.
"""

from __future__ import annotations

from xla_ckpt.errors import CheckpointNotFoundError, IncompleteCheckpointError
from xla_ckpt.format.manifest import MANIFEST_NAME, Manifest
from xla_ckpt.storage import Storage


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
