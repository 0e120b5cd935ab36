"""Write checkpoints: data files first, the manifest (commit marker) last.

Single writer::

    save(state, "gs://bucket/run/checkpoint_10")

Several writers (each rank writes its own item, one coordinator commits)::

    part = write_item(storage, save_id, rank_item(rank), rank_state)   # every rank
    parts = exchange(part)                                             # dist layer
    commit(storage, save_id, parts, metadata=..., world_size=...)      # coordinator only

Data file names carry the save id, so saving over an existing checkpoint never
touches the bytes its committed manifest points at; files of the replaced save
are deleted only after the new manifest has committed.

**The commit marker is a conditional write.**  :func:`commit` passes
``if_generation_match`` to the store: the manager creates its manifests with ``0``
(create only; see :mod:`xla_ckpt.io.fencing`), so a committed checkpoint is never
replaced by a stale writer; :func:`save` replaces an existing checkpoint only if its
manifest is still the generation it saw when it started (compare-and-swap), so of two
concurrent saves to one path exactly one commits and the other raises.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from xla_ckpt.errors import CheckpointNotFoundError, PreconditionFailedError
from xla_ckpt.format import typed
from xla_ckpt.format.manifest import (
    DEFAULT_CHUNK_SIZE_BYTES,
    MANIFEST_NAME,
    STATE_ITEM,
    Item,
    Manifest,
    rank_item,
)
from xla_ckpt.format.plan import blob_record, plan_item, tensor_bytes
from xla_ckpt.format.safetensors_layout import build_header
from xla_ckpt.storage import Storage, StorageConfig, open_storage

logger = logging.getLogger(__name__)

DATA_PREFIX = "data-"


def new_save_id() -> str:
    """A fresh save id (12 hex digits); data file names carry it."""
    return uuid.uuid4().hex[:12]


def data_file_name(save_id: str, item_name: str) -> str:
    slug = item_name.replace("/", "-")
    return f"{DATA_PREFIX}{save_id}-{slug}.safetensors"


@dataclass
class WrittenItem:
    """One writer's contribution to a checkpoint (small; safe to send to the coordinator)."""

    name: str
    item: Item
    files: dict[str, int]

    def to_json(self) -> dict:
        return {"name": self.name, "item": self.item.to_json(), "files": self.files}


def write_item(storage: Storage, save_id: str, item_name: str, state: Any, *,
               chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES) -> WrittenItem:
    """Write one item's tensors as one safetensors-layout data file (atomically).

    Any rank may call this for the item it owns.  Nothing is committed until
    :func:`commit` writes the manifest.

    Raises:
        MetaTensorError, UnsupportedTypeError: the state cannot be saved (names the key).
        StorageError: the backend failed.
    """
    t0 = time.perf_counter()
    plan = plan_item(state, chunk_size_bytes=chunk_size_bytes)
    fname = data_file_name(save_id, item_name)
    header, offsets = build_header(plan.blobs, {"format": "pt", "xla_ckpt_save_id": save_id,
                                                "xla_ckpt_item": item_name})
    blobs = [blob_record(b, fname, off, chunk_size_bytes)
             for b, off in zip(plan.blobs, offsets, strict=True)]
    info = storage.write_atomic(fname, [header] + [tensor_bytes(b.data) for b in plan.blobs])
    item = Item(state=plan.state, tensors=plan.tensors, blobs=blobs)
    dt = time.perf_counter() - t0
    logger.debug("wrote %s (%d bytes, %d tensors) in %.3f s (%.1f MiB/s)", storage.url(fname),
                 info.size, len(plan.tensors), dt, info.size / max(dt, 1e-9) / 2**20)
    return WrittenItem(item_name, item, {fname: info.size})


def commit(storage: Storage, save_id: str, parts: Iterable[WrittenItem], *,
           metadata: Any = None, world_size: int | None = None,
           cleanup: bool = True, if_generation_match: int | None = None) -> Manifest:
    """Write the manifest (the commit marker) for ``parts``; called by one rank only.

    ``if_generation_match`` goes to the manifest write (``None``: replace whatever is
    there; ``0``: create only; ``N``: replace only generation ``N``).  After the manifest
    is in place, data files of earlier saves in the same folder (``data-<other id>-*``)
    are deleted when ``cleanup`` is true (see :func:`remove_other_data_files`).

    Raises:
        PreconditionFailedError: the condition did not hold; nothing was committed.
    """
    items: dict[str, Item] = {}
    files: dict[str, int] = {}
    for p in parts:
        items[p.name] = p.item
        files.update(p.files)
    manifest = Manifest(save_id=save_id, items=items, files=files,
                        metadata=typed.encode(metadata) if metadata is not None else None,
                        world_size=world_size, created_unix_s=time.time())
    body = [manifest.to_json_bytes()]
    if if_generation_match is None:
        storage.write_atomic(MANIFEST_NAME, body)
    else:
        storage.write_atomic(MANIFEST_NAME, body, if_generation_match=if_generation_match)
    if cleanup:
        remove_other_data_files(storage, files)
    return manifest


def remove_other_data_files(storage: Storage, keep: Iterable[str]) -> int:
    """Delete the data files at the top of ``storage`` (a checkpoint folder) not in ``keep``.

    What a commit does once its manifest landed: files of the save it replaced, and of
    saves into that folder that never committed.  Returns how many were deleted.
    """
    keep = set(keep)
    n = 0
    for name in storage.list(""):
        if "/" not in name and name.startswith(DATA_PREFIX) and name not in keep:
            storage.delete(name)
            n += 1
    return n


def discard(storage: Storage, save_id: str) -> None:
    """Best-effort removal of the data files of an uncommitted save ``save_id``."""
    try:
        for name in storage.list(""):
            if "/" not in name and name.startswith(f"{DATA_PREFIX}{save_id}-"):
                storage.delete(name)
    except Exception as e:  # noqa: BLE001 - cleanup must not mask the original error
        logger.warning("could not remove stray data files of save %s under %s: %s", save_id,
                       storage.uri, e)


def save(state: Any, uri: str, *, metadata: Any = None,
         rank_states: Mapping[int, Any] | None = None,
         config: StorageConfig | None = None, storage: Storage | None = None) -> Manifest:
    """Save ``state`` as a checkpoint folder at ``uri`` (local path or ``gs://``), atomically.

    Called by one process.  Saving over an existing checkpoint replaces it, if no
    other save committed there after this one started (compare-and-swap on the
    manifest's generation; see the module docstring).  Tensors on any device (CPU, CUDA, XLA) are
    written as host data with their dtype, shape and aliasing; non-tensor
    values use the typed encoding (:mod:`xla_ckpt.format.typed`).  The
    manifest is written last; until it lands, an existing checkpoint at
    ``uri`` stays intact and loadable.

    Args:
        state: nested dict/list/tuple of tensors and plain values.
        uri: checkpoint folder.
        metadata: small summary (step, epoch, ...) shown by ``xla-ckpt ls``.
        rank_states: optional per-rank private state, stored as items
            ``rank/<r>`` (see :func:`xla_ckpt.format.manifest.rank_item`).
        config: storage knobs (parallelism, slice size, retries).

    Returns:
        The committed :class:`Manifest`.

    Raises:
        MetaTensorError: a tensor is on the meta device (names its key).
        UnsupportedTypeError: a value cannot be encoded (names its key and type).
        PreconditionFailedError: another save committed at ``uri`` after this one
            started; nothing of this one was committed.
        StorageError: the backend failed; nothing was committed.
    """
    own = storage is None
    st = storage or open_storage(uri, config)
    try:
        # Compare-and-swap on the manifest seen now: a save that committed here meanwhile
        # makes this one fail instead of both silently winning.
        try:
            seen: int | None = st.stat(MANIFEST_NAME).generation
        except CheckpointNotFoundError:
            seen = 0
        save_id = new_save_id()
        try:
            parts = [write_item(st, save_id, STATE_ITEM, state)]
            for r, rs in sorted((rank_states or {}).items()):
                parts.append(write_item(st, save_id, rank_item(r), rs))
            try:
                return commit(st, save_id, parts, metadata=metadata, if_generation_match=seen)
            except PreconditionFailedError as e:
                raise PreconditionFailedError(
                    f"{st.uri}: not saved: another save committed this checkpoint after this "
                    f"one started (manifest generation {seen or 'none'} when it started, now "
                    f"{e.actual_generation or 'none'}); this save's data files were removed and "
                    "nothing of it was committed", name=e.name,
                    expected_generation=e.expected_generation,
                    actual_generation=e.actual_generation) from e
        except BaseException:
            discard(st, save_id)
            raise
    finally:
        if own:
            st.close()
