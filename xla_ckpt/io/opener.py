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
from typing import Any, Callable, Sequence, TypeVar

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
from xla_ckpt.io.legacy import Progress, load_legacy_file, split_uri
from xla_ckpt.io.reader import CheckpointReader
from xla_ckpt.io.recovery import note_for_read
from xla_ckpt.io.resolve import (
    DCP,
    DCP_METADATA,
    HF_INDEX,
    LEGACY,
    XLA_CKPT,
    Resolved,
    committed_manifest,
    resolve,
)
from xla_ckpt.storage import StorageConfig, open_storage
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
        ConfigError: ``resolved`` is another kind (a legacy file, an HF index, a DCP
            folder: read it with :func:`read_items`).
    """
    if resolved.kind != XLA_CKPT or resolved.manifest is None:
        raise ConfigError(f"{resolved.checkpoint} is {resolved.what}, not an xla_ckpt "
                          "checkpoint folder; read it with xla_ckpt.load or convert it with "
                          f"`xla-ckpt convert {resolved.checkpoint} DST`")
    return CheckpointReader(open_storage(resolved.checkpoint, config), resolved.manifest)


def read_items(resolved: Resolved, item: str = STATE_ITEM, *, optional: tuple[str, ...] = (),
               map_location: MapLocation = None, config: StorageConfig | None = None,
               mmap: bool = False) -> dict[str, Any]:
    """Read ``item`` and those of the ``optional`` items there are: ``{item name: state}``.

    An xla_ckpt checkpoint is read with :class:`CheckpointReader` (crc32c checked);
    a legacy file is imported through the allow-list of :mod:`xla_ckpt.io.legacy`
    (fairseq files upgraded to the current layout), a sharded HF safetensors
    checkpoint through :mod:`xla_ckpt.io.hf` (``{tensor name: tensor}``), a DCP
    folder through :mod:`xla_ckpt.io.dcp` (nested back as it was given to ``dcp.save``).
    Those hold only the ``state`` item; their tensors are read on CPU and then placed as
    ``map_location`` says (:func:`place_tensors`), as for an xla_ckpt checkpoint.

    ``mmap``: tensors are checked views of private maps of the data files, as :func:`load`
    describes; local xla_ckpt checkpoints only.

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

    ``map_location`` as :func:`load` takes it (a device, ``{"cpu": device}``, a callable
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


def read_foreign(resolved: Resolved, *, config: StorageConfig | None = None,
                 progress: Progress | None = None) -> Any:
    """The whole state of a resolved source that is not an xla_ckpt checkpoint; CPU tensors.

    Legacy ``.pt``/safetensors: :func:`~xla_ckpt.io.legacy.load_legacy_file` (allow-list,
    fairseq upgrade); HF index: :func:`~xla_ckpt.io.hf.load_hf_index`; DCP:
    :func:`xla_ckpt.io.dcp.read_dcp`, nested by :func:`~xla_ckpt.io.dcp.unflatten_dcp_state`.
    ``progress`` gets byte counts (legacy and HF).

    Raises:
        ConfigError: ``resolved`` is an xla_ckpt checkpoint (read it with :func:`read_items`).
    """
    if resolved.kind == LEGACY:
        return load_legacy_file(resolved.checkpoint, config=config, progress=progress).state
    if resolved.kind == HF_INDEX:
        from xla_ckpt.io.hf import load_hf_index  # noqa: PLC0415 - hf imports legacy

        return load_hf_index(resolved.checkpoint, config=config, progress=progress)
    if resolved.kind == DCP:
        from xla_ckpt.io.dcp import (  # noqa: PLC0415 - DCP support loads torch.distributed
            read_dcp,
            read_dcp_metadata,
            unflatten_dcp_state,
        )

        mapping = read_dcp_metadata(resolved.checkpoint, config=config).mapping
        return unflatten_dcp_state(read_dcp(resolved.checkpoint, config=config), mapping)
    raise ConfigError(f"{resolved.checkpoint} is {resolved.what}; read it with read_items")


def load(uri: str, *, map_location: MapLocation = None, item: str = STATE_ITEM,
         config: StorageConfig | None = None, keys: Sequence[str] | str | None = None,
         mmap: bool = False) -> Any:
    """Load the state saved by :func:`xla_ckpt.save` from ``uri`` (``xla_ckpt.load``).

    ``uri`` is a checkpoint folder, a run folder (its latest committed checkpoint), a
    ``<run>/checkpoint_last`` / ``<run>/checkpoint_best`` pointer, a legacy
    ``.pt``/safetensors file (imported through the allow-list; CPU tensors), an HF
    ``model.safetensors.index.json`` (or a folder holding it or ``model.safetensors``:
    ``{tensor name: tensor}``), or a PyTorch DCP checkpoint folder (the state nested as
    it was given to ``dcp.save``: ``{"model": {...}, "optim": {...}}``); the rules are
    :func:`xla_ckpt.io.resolve.resolve`'s.  Tensors
    come back on CPU (``map_location=None``, as ``torch.load``) with the saved dtype,
    shape, strides and aliasing; ``map_location`` may be a device, a ``{"cpu": device}``
    dict or a callable ``key -> device``, for every kind of source (a foreign one is read
    on CPU, then moved: :func:`place_tensors`).  Pickle-free for xla_ckpt checkpoints.

    ``keys`` (a dotted key or prefix such as ``"model.encoder"``, or a list of them)
    loads only those parts of the state, reading only the blobs that hold them
    (:func:`xla_ckpt.io.partial.load_partial`).

    ``mmap=True`` (a local xla_ckpt checkpoint only, as ``torch.load(mmap=True)``): CPU
    tensors are views of private (copy-on-write) memory maps of the data files instead of
    fresh copies: no copy and no fresh memory, pages are read in by the kernel, and every
    byte is still crc32c-checked before this returns.  Writing a tensor copies the pages it
    touches into this process; the file never changes.  The trade-off: pages not yet
    written follow the file, so a process that writes a data file *in place* would change
    the tensors, and one that truncates it would make touching them raise ``SIGBUS``.
    xla_ckpt itself never writes a data file in place (a save writes new files and renames;
    rotation deletes, which leaves mapped pages readable), so this holds for files only
    xla_ckpt writes.  Keep the default (fresh copies) when other tools may rewrite them.

    Raises:
        ConfigError: ``mmap=True`` for a ``gs://`` checkpoint, a foreign source (legacy
            ``.pt``, HF, DCP) or together with ``keys``.
        UnknownKeyError: a key of ``keys`` matches nothing (names the closest keys).
        NothingCommittedError: nothing committed at ``uri`` (a ``CheckpointNotFoundError``,
            hence a ``FileNotFoundError``); :class:`UncommittedCheckpointError` when saves
            began there and none committed.
        CheckpointNotFoundError: a typo'd path (its parent folder is missing too), a file
            that is not a checkpoint (the message lists the kinds accepted), a run folder
            holding only checkpoints of other kinds (named).
        CheckpointReplacedError: the checkpoint was replaced while it was read, twice.
        CheckpointCorruptError: truncated or malformed files, a data file missing (names
            the path, expected vs actual size), no item ``item``.
        IntegrityError: crc32c mismatch after bounded re-reads (names object and tensor).
    """
    if keys is not None and mmap:
        raise ConfigError("xla_ckpt.load: mmap=True reads whole items; it cannot be combined "
                          f"with keys={keys!r} (load {uri} without mmap, or without keys)")
    if keys is not None:
        # Lazy: xla_ckpt.io.partial builds on this module.
        from xla_ckpt.io.partial import load_partial  # noqa: PLC0415 - partial imports opener

        return load_partial(uri, keys, map_location=map_location, config=config, item=item)

    def read(resolved: Resolved) -> Any:
        return read_items(resolved, item, map_location=map_location, config=config,
                          mmap=mmap)[item]

    return read_checkpoint(uri, read, config=config)
