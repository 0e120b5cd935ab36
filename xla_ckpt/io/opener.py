"""One opener: read what :func:`~xla_ckpt.io.resolve.resolve` named, once more if it was replaced.

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

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    ConfigError,
    NothingCommittedError,
)
from xla_ckpt.format.manifest import STATE_ITEM
from xla_ckpt.format.plan import MapLocation
from xla_ckpt.io.legacy import load_legacy_file, split_uri
from xla_ckpt.io.reader import CheckpointReader
from xla_ckpt.io.resolve import LEGACY, XLA_CKPT, Resolved, committed_manifest, resolve
from xla_ckpt.storage import StorageConfig, open_storage

logger = logging.getLogger(__name__)

T = TypeVar("T")


def current_version(resolved: Resolved, config: StorageConfig | None = None) -> str:
    """What is now at ``resolved.checkpoint``: its save id (or generation); ``"none"`` if gone."""
    if resolved.kind == LEGACY:
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

    The single-process read path of every entry point (:func:`load`, the trainer's
    default restorer).  Raises what :func:`resolve`, ``read`` and :func:`read_resolved` raise.
    """
    return read_resolved(resolve(uri, config), read, again=lambda: resolve(uri, config),
                         config=config)


# ---- the opener -------------------------------------------------------------------------------

def open_reader(resolved: Resolved, config: StorageConfig | None = None) -> CheckpointReader:
    """A reader of the resolved xla_ckpt checkpoint (from the manifest already read).

    The caller closes ``reader.storage``.

    Raises:
        ConfigError: ``resolved`` is a legacy file (read it with :func:`read_items`).
    """
    if resolved.kind != XLA_CKPT or resolved.manifest is None:
        raise ConfigError(f"{resolved.checkpoint} is a legacy .pt/safetensors file, not an "
                          "xla_ckpt checkpoint folder; convert it with `xla-ckpt convert "
                          f"{resolved.checkpoint} DST`")
    return CheckpointReader(open_storage(resolved.checkpoint, config), resolved.manifest)


def read_items(resolved: Resolved, item: str = STATE_ITEM, *, optional: tuple[str, ...] = (),
               map_location: MapLocation = None,
               config: StorageConfig | None = None) -> dict[str, Any]:
    """Read ``item`` and those of the ``optional`` items there are: ``{item name: state}``.

    An xla_ckpt checkpoint is read with :class:`CheckpointReader` (crc32c checked);
    a legacy file is imported through the allow-list of :mod:`xla_ckpt.io.legacy`
    (fairseq files upgraded to the current layout): it holds only the ``state``
    item, and its tensors stay on CPU (``map_location`` must be None).

    Raises:
        CheckpointCorruptError: the checkpoint has no item ``item``.
        ConfigError: ``map_location`` with a legacy file.
    """
    if resolved.kind == LEGACY:
        if map_location is not None:
            raise ConfigError(f"{resolved.checkpoint}: map_location is not supported for a "
                              "legacy .pt/safetensors file; move the tensors after loading")
        if item != STATE_ITEM:
            raise CheckpointCorruptError(f"{resolved.checkpoint}: a legacy file holds only "
                                         f"the {STATE_ITEM!r} item, not {item!r}")
        return {STATE_ITEM: load_legacy_file(resolved.checkpoint, config=config).state}
    reader = open_reader(resolved, config)
    try:
        out = {item: reader.load(item, map_location)}
        for it in optional:
            if it in reader.manifest.items:
                out[it] = reader.load(it, map_location)
        return out
    finally:
        reader.storage.close()


def load(uri: str, *, map_location: MapLocation = None, item: str = STATE_ITEM,
         config: StorageConfig | None = None) -> Any:
    """Load the state saved by :func:`xla_ckpt.save` from ``uri`` (``xla_ckpt.load``).

    ``uri`` is a checkpoint folder, a run folder (its latest committed checkpoint), a
    ``<run>/checkpoint_last`` / ``<run>/checkpoint_best`` pointer, or a legacy
    ``.pt``/safetensors file (imported through the allow-list; CPU tensors).  Tensors
    come back on CPU (``map_location=None``, as ``torch.load``) with the saved dtype,
    shape, strides and aliasing; ``map_location`` may be a device, a ``{"cpu": device}``
    dict or a callable ``key -> device``.  Pickle-free for xla_ckpt checkpoints.

    Raises:
        NothingCommittedError: nothing committed at ``uri`` (a ``CheckpointNotFoundError``,
            hence a ``FileNotFoundError``); :class:`UncommittedCheckpointError` when saves
            began there and none committed.
        CheckpointNotFoundError: a typo'd path (its parent folder is missing too), a file
            that is not a checkpoint.
        CheckpointReplacedError: the checkpoint was replaced while it was read, twice.
        CheckpointCorruptError: truncated or malformed files, a data file missing (names
            the path, expected vs actual size), no item ``item``.
        IntegrityError: crc32c mismatch after bounded re-reads (names object and tensor).
    """
    def read(resolved: Resolved) -> Any:
        return read_items(resolved, item, map_location=map_location, config=config)[item]

    return read_checkpoint(uri, read, config=config)
