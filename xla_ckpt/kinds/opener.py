"""One opener: read what :func:`~xla_ckpt.run.resolve.resolve` named, once more if it was replaced.

**Replaced while reading.**  :func:`read_checkpoint` resolves, then reads; when a
read fails and the checkpoint it read is no longer the one resolved (its
manifest is gone or has another ``save_id``; a legacy ``gs://`` object has
another generation) it resolves again and reads once more; if that happens a
second time it raises :class:`CheckpointReplacedError` ("<uri> was replaced while
reading (save id A -> B); retry or pause the other writer").  ``restore()``
applies the same rule collectively (:mod:`xla_ckpt.restore.api`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, TypeVar

import torch

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    ConfigError,
    NothingCommittedError,
)
from xla_ckpt.format.manifest import STATE_ITEM
from xla_ckpt.format.plan import MapLocation, resolve_device
from xla_ckpt.io.reader import CheckpointReader
from xla_ckpt.kinds.foreign import read_foreign
from xla_ckpt.kinds.legacy import split_uri
from xla_ckpt.run.recovery import note_for_read
from xla_ckpt.run.resolve import Resolved, committed_manifest, resolve
from xla_ckpt.run.sniff import DCP, DCP_METADATA, XLA_CKPT
from xla_ckpt.storage import Storage, StorageConfig, open_storage
from xla_ckpt.storage.local import LocalStorage

logger = logging.getLogger(__name__)

T = TypeVar("T")


def current_version(resolved: Resolved, config: StorageConfig | None = None) -> str:
    """What is now at ``resolved.checkpoint``: its save id (or generation); ``"none"`` if gone.

    The generation is the legacy file's, the safetensors index's, or the DCP ``.metadata``'s.
    """
    if resolved.kind != XLA_CKPT:
        if resolved.kind == DCP:
            folder, name = resolved.checkpoint, DCP_METADATA
        else:
            folder, name = split_uri(resolved.checkpoint)
        with open_storage(folder, config) as st:
            try:
                return str(st.stat(name).generation)
            except CheckpointNotFoundError:
                return "none"
    with open_storage(resolved.checkpoint, config) as st:
        found = committed_manifest(st)
    return found[0].save_id if found is not None else "none"


def _probe(resolved: Resolved, config: StorageConfig | None) -> str | None:
    """:func:`current_version`, or None when even that fails (the read's error then stands)."""
    try:
        return current_version(resolved, config)
    except Exception as probe:  # noqa: BLE001 - the read's own error is the one to raise
        logger.debug("could not tell whether %s was replaced: %s", resolved.checkpoint, probe)
        return None


def replaced_error(resolved: Resolved, now: str,
                   failures: dict[int, str] | None = None) -> CheckpointReplacedError:
    """The error naming the race: ``<uri> was replaced while reading (save id A -> B)``."""
    what, before = resolved.version
    return CheckpointReplacedError(
        f"{resolved.checkpoint} was replaced while reading ({what} {before} -> {now}); retry or "
        "pause the other writer", failures, uri=resolved.checkpoint, before=before, after=now)


def read_resolved(first: Resolved, read: Callable[[Resolved], T], *,
                  again: Callable[[], Resolved], config: StorageConfig | None = None) -> T:
    """``read(first)``; if the checkpoint was replaced while it was read, ``read(again())`` once.

    A failure is a replacement when the checkpoint folder no longer holds the manifest
    that was resolved (another ``save_id``, or none: :func:`current_version`).  Any
    other failure is raised as it is.

    Raises:
        CheckpointReplacedError: replaced during both reads (or gone on the second look).
    """
    resolved = first
    for attempt in range(2):
        try:
            return read(resolved)
        except (CheckpointNotFoundError, CheckpointCorruptError) as e:
            now = _probe(resolved, config)
            if now is None or now == resolved.version[1]:
                if resolved.kind == XLA_CKPT:  # bad bytes: name the previous intact checkpoint
                    note_for_read(e, resolved.checkpoint, resolved.run, config)
                raise  # not replaced (or cannot tell): the read's own error
            if attempt == 1:
                raise replaced_error(resolved, now) from e
            what, before = resolved.version
            logger.warning("%s was replaced while reading (%s %s -> %s); resolving %s again and "
                           "reading it once more", resolved.checkpoint, what, before, now,
                           resolved.uri)
            try:
                resolved = again()
            except NothingCommittedError as gone:
                raise replaced_error(resolved, "none") from gone
    raise AssertionError("unreachable")  # pragma: no cover


def read_checkpoint(uri: str, read: Callable[[Resolved], T], *,
                    config: StorageConfig | None = None) -> T:
    """:func:`resolve` ``uri``, then ``read(resolved)``, once more if replaced meanwhile.

    The single-process read path of every entry point (:func:`xla_ckpt.load`, the trainer's
    default restorer).  Raises what :func:`resolve`, ``read`` and :func:`read_resolved` raise.
    """
    with open_storage(uri, config) as root:  # one storage: resolved, then read under it
        return read_resolved(resolve(root), read, again=lambda: resolve(root), config=config)


# ---- the opener -------------------------------------------------------------------------------

def open_reader(resolved: Resolved, config: StorageConfig | None = None) -> CheckpointReader:
    """A reader of the resolved xla_ckpt checkpoint (from the manifest already read).

    The caller closes ``reader.storage``.

    Raises:
        ConfigError: ``resolved`` is another kind (a legacy file, an HF index, a DCP
            folder: read it with :func:`read_items`).
    """
    if resolved.kind != XLA_CKPT or resolved.manifest is None:
        raise ConfigError(f"{resolved.checkpoint} is {resolved.what}, not an xla_ckpt "
                          "checkpoint folder; read it with xla_ckpt.load or convert it with "
                          f"`xla-ckpt convert {resolved.checkpoint} DST`")
    return CheckpointReader(_open_under(resolved, config), resolved.manifest)


def _open_under(resolved: Resolved, config: StorageConfig | None) -> Storage:
    """A storage rooted at ``resolved.checkpoint`` (the caller closes it): a child of the one
    the resolver used when the checkpoint is under it (a run folder's latest: no second
    client, no second connection pool), else a new one."""
    root = resolved.storage
    head = root.uri.rstrip("/") + "/" if root is not None else ""
    if root is not None and resolved.checkpoint.startswith(head):
        return root.child(resolved.checkpoint[len(head):])
    return open_storage(resolved.checkpoint, config)


def read_items(resolved: Resolved, item: str = STATE_ITEM, *, optional: tuple[str, ...] = (),
               map_location: MapLocation = None, config: StorageConfig | None = None,
               mmap: bool = False) -> dict[str, Any]:
    """Read ``item`` and those of the ``optional`` items there are: ``{item name: state}``.

    An xla_ckpt checkpoint is read with :class:`CheckpointReader` (crc32c checked);
    a legacy file is imported through the allow-list of :mod:`xla_ckpt.kinds.legacy`
    (fairseq files upgraded to the current layout), a sharded HF safetensors
    checkpoint through :mod:`xla_ckpt.kinds.hf` (``{tensor name: tensor}``), a DCP
    folder through :mod:`xla_ckpt.kinds.dcp` (nested back as it was given to ``dcp.save``).
    Those hold only the ``state`` item; their tensors are read on CPU and then placed as
    ``map_location`` says (:func:`place_tensors`), as for an xla_ckpt checkpoint.

    ``mmap``: tensors are checked views of private maps of the data files, as
    :func:`xla_ckpt.load` describes; local xla_ckpt checkpoints only.

    Raises:
        CheckpointCorruptError: the checkpoint has no item ``item``.
        ConfigError: ``mmap=True`` for a source that is not a local xla_ckpt checkpoint.
    """
    if mmap and resolved.kind != XLA_CKPT:
        raise ConfigError(f"{resolved.checkpoint} is {resolved.what}: mmap=True maps only the "
                          "data files of a local xla_ckpt checkpoint; load it without mmap, or "
                          f"convert it first (`xla-ckpt convert {resolved.checkpoint} DST`)")
    if resolved.kind != XLA_CKPT:
        if item != STATE_ITEM:
            raise CheckpointCorruptError(f"{resolved.checkpoint}: {resolved.what} holds only "
                                         f"the {STATE_ITEM!r} item, not {item!r}")
        state = read_foreign(resolved, config=config)
        return {STATE_ITEM: place_tensors(state, map_location)}
    reader = open_reader(resolved, config)
    try:
        if mmap and not isinstance(reader.storage, LocalStorage):
            raise ConfigError(f"{resolved.checkpoint}: mmap=True needs a checkpoint on a local "
                              "file system (memory maps of its data files); this one is on "
                              f"{type(reader.storage).__name__}: load it without mmap")
        out = {item: reader.load(item, map_location, mmap=mmap)}
        for it in optional:
            if it in reader.manifest.items:
                out[it] = reader.load(it, map_location, mmap=mmap)
        return out
    finally:
        reader.storage.close()


def place_tensors(state: Any, map_location: MapLocation) -> Any:
    """``state`` with each tensor moved to the device ``map_location`` gives for its key.

    ``map_location`` as :func:`xla_ckpt.load` takes it (a device, ``{"cpu": device}``, a callable
    ``dotted key -> device``; :func:`~xla_ckpt.format.plan.resolve_device`).  Tensors
    already there (CPU for ``None``, ``"cpu"``, ``torch.device("cpu")``,
    ``{"cpu": "cpu"}``) are returned as they are, without a copy; the very same tensor
    under two keys moves once and stays one tensor (a tie).  Dicts keep their type and
    order; lists and tuples are rebuilt only when something under them moved.
    """
    if map_location is None:
        return state
    moved: dict[int, torch.Tensor] = {}

    def walk(obj: Any, key: str) -> Any:
        if isinstance(obj, torch.Tensor):
            dev = resolve_device(map_location, key)
            if dev is None or obj.device == dev or (dev.type == obj.device.type == "cpu"):
                return obj
            if id(obj) not in moved:
                moved[id(obj)] = obj.to(dev)
            return moved[id(obj)]
        if isinstance(obj, dict):
            out = {k: walk(v, f"{key}.{k}" if key else str(k)) for k, v in obj.items()}
            if all(out[k] is obj[k] for k in obj):
                return obj
            if type(obj) is not dict:
                typed_out = type(obj)()
                typed_out.update(out)
                return typed_out
            return out
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            items = [walk(v, f"{key}.{i}" if key else str(i)) for i, v in enumerate(obj)]
            if all(a is b for a, b in zip(items, obj, strict=True)):
                return obj
            return type(obj)(items)
        return obj

    return walk(state, "")
