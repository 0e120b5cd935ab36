"""The two ways in: :func:`load` and :func:`save` (``xla_ckpt.load`` / ``xla_ckpt.save``).

They only dispatch:

* :func:`load` reads what :func:`xla_ckpt.run.resolve.resolve` names: an xla_ckpt checkpoint
  through :mod:`xla_ckpt.kinds.opener`, only some keys through :mod:`xla_ckpt.kinds.partial`,
  another kind (legacy ``.pt``, HF, DCP) through :mod:`xla_ckpt.kinds.foreign`;
* :func:`save` writes a plain state from one process (:func:`xla_ckpt.io.writer.write_checkpoint`)
  and a sharded one from every rank together (:func:`xla_ckpt.restore.save_distributed`).

This module imports torch (as the modules it dispatches to do); ``import xla_ckpt`` stays
torch-free because it loads this module on first use of ``xla_ckpt.load`` / ``xla_ckpt.save``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch.distributed as tdist

from xla_ckpt.comm import SingleProcess, get_dist
from xla_ckpt.errors import ConfigError, ShardedStateError
from xla_ckpt.format import typed
from xla_ckpt.format.manifest import STATE_ITEM, Manifest
from xla_ckpt.format.plan import MapLocation
from xla_ckpt.io.writer import write_checkpoint
from xla_ckpt.kinds.opener import read_checkpoint, read_items
from xla_ckpt.kinds.partial import load_partial
from xla_ckpt.restore.save import save_distributed
from xla_ckpt.run.resolve import Resolved
from xla_ckpt.sharded import spmd, views
from xla_ckpt.storage import Storage, StorageConfig

__all__ = ["load", "save"]


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
    :func:`xla_ckpt.run.resolve.resolve`'s.  Tensors
    come back on CPU (``map_location=None``, as ``torch.load``) with the saved dtype,
    shape, strides and aliasing; ``map_location`` may be a device, a ``{"cpu": device}``
    dict or a callable ``key -> device``, for every kind of source (a foreign one is read
    on CPU, then moved: :func:`xla_ckpt.kinds.opener.place_tensors`).  Pickle-free for
    xla_ckpt checkpoints.

    ``keys`` (a dotted key or prefix such as ``"model.encoder"``, or a list of them)
    loads only those parts of the state, reading only the blobs that hold them
    (:func:`xla_ckpt.kinds.partial.load_partial`).

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
            hence a ``FileNotFoundError``);
            :class:`~xla_ckpt.errors.UncommittedCheckpointError` when saves began there and
            none committed.
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
        return load_partial(uri, keys, map_location=map_location, config=config, item=item)

    def read(resolved: Resolved) -> Any:
        return read_items(resolved, item, map_location=map_location, config=config,
                          mmap=mmap)[item]

    return read_checkpoint(uri, read, config=config)


def save(state: Any, uri: str, *, metadata: Any = None,
         rank_states: Mapping[int, Any] | None = None,
         config: StorageConfig | None = None, storage: Storage | None = None,
         progress: Callable[[int], object] | None = None) -> Manifest:
    """Save ``state`` as a checkpoint folder at ``uri`` (local path or ``gs://``), atomically.

    Called by one process -- except for a sharded state, below.  Saving over an existing
    checkpoint replaces it, if no other save committed there after this one started
    (compare-and-swap on the manifest's generation; see :mod:`xla_ckpt.io.writer`).  Tensors
    on any device (CPU, CUDA, XLA) are written as host data with their dtype, shape and
    aliasing; non-tensor values use the typed encoding (:mod:`xla_ckpt.format.typed`).  The
    manifest is written last; until it lands, an existing checkpoint at ``uri`` stays intact
    and loadable.

    **Sharded state** (a ``DTensor`` from FSDP2 / tensor parallel, a torch_xla SPMD tensor):
    with ``torch.distributed`` initialised this is a COLLECTIVE -- every rank calls it, in the
    same order, with its own shards and the same ``uri`` (one folder on storage every rank
    shares; different URIs are refused before anything is written) -- and runs
    :func:`xla_ckpt.restore.save_distributed` with the default
    :func:`~xla_ckpt.comm.get_dist`: the ranks agree on the structure, each
    writes the boxes it owns, rank 0 commits (chunked global tensors, manifest version 2;
    it replaces an existing checkpoint without the compare-and-swap).  Each rank may pass its
    own private state as ``rank_states={its rank: value}`` (item ``rank/<rank>``, as
    ``save_distributed(rank_state=...)``).  A single process
    without a process group may save SPMD tensors (it addresses every device), not a
    DTensor.  :func:`xla_ckpt.load` of the result gives the full tensors on one process.

    Args:
        state: nested dict/list/tuple of tensors and plain values.
        uri: checkpoint folder.
        metadata: small summary (step, epoch, ...) shown by ``xla-ckpt ls``.
        rank_states: optional per-rank private state, stored as items
            ``rank/<r>`` (see :func:`xla_ckpt.format.manifest.rank_item`).  The data
            files are those :func:`xla_ckpt.restore.save_distributed` writes: one per
            rank, rank 0's item in the state's file.  A sharded state: only this rank's
            own entry (every rank writes its own).
        config: storage knobs (parallelism, slice size, retries).
        progress: called with bytes as the data files are handed to the storage (e.g.
            :func:`xla_ckpt.cli.common.progress_bar`'s ``update``).

    Returns:
        The committed :class:`Manifest`.

    Raises:
        MetaTensorError: a tensor is on the meta device (names its key).
        UnsupportedTypeError: a value cannot be encoded (names its key and type).
        PreconditionFailedError: another save committed at ``uri`` after this one
            started; nothing of this one was committed.
        StorageError: the backend failed; nothing was committed.
        StorageNotSharedError: a data file just written is not there (with its size) when
            the manifest is about to be written (see :func:`xla_ckpt.io.writer.commit`);
            nothing committed.
        ShardedStateError: a ``DTensor`` while ``torch.distributed`` is not initialised, or
            a sharded state with ``storage`` (names the key, says what to do).
        DistributedError: sharded state: the ranks pass different URIs or disagree on its
            structure, a rank's ``rank_states`` holds another rank's entry (its failure a
            ``ShardedStateError`` naming the ranks), or a write or the commit failed on some
            rank (a rank's data file not visible to rank 0: storage not shared; see
            ``save_distributed``); nothing committed.
    """
    candidates: list[tuple[str, Any]] = []

    def spot(t: Any, path: tuple) -> int:
        # A DTensor (XLAShardedTensor subclasses it) or an XLA tensor (SPMD annotates those in
        # place), told apart by device and class name: one cheap test per tensor.  Only these
        # candidates go to xla_ckpt.sharded.views.is_sharded, which tells which are sharded.
        if t.device.type == "xla" or any(c.__name__ == "DTensor" for c in type(t).__mro__):
            candidates.append((typed.format_path(path), t))
        return 0

    typed.encode(state, spot)  # what plan_item encodes below: the same errors, in the same order
    if candidates:
        sharded = [(k, v) for k, v in candidates if views.is_sharded(v)]
        if sharded:
            key, value = sharded[0]
            if storage is not None:
                raise ShardedStateError(
                    f"{key} is a sharded tensor ({type(value).__name__}): a sharded state is "
                    "saved by every rank together, each opening the checkpoint folder, so "
                    "storage does not apply; pass uri only")
            if tdist.is_available() and tdist.is_initialized():
                dist = get_dist()
            else:
                dtensors = [k for k, v in sharded if not spmd.is_xla_sharded(v)]
                if dtensors:
                    raise ShardedStateError(
                        f"{dtensors[0]} is a DTensor, but torch.distributed is not "
                        "initialised: its other shards live on the other ranks of its device "
                        "mesh, so every rank must save together; call xla_ckpt.save(state, "
                        "uri) on every rank with the process group initialised (it then runs "
                        "xla_ckpt.restore.save_distributed), or save plain tensors")
                dist = SingleProcess()  # one process addresses every SPMD device
            rank = dist.rank

            def own_rank_state() -> Any:  # called inside the save's agreement: a refusal on
                return _own_rank_state(rank_states, rank, key)  # one rank fails every rank

            return save_distributed(state, uri, dist=dist, metadata=metadata,
                                    rank_state=own_rank_state if rank_states else None,
                                    storage_config=config, progress=progress)
    return write_checkpoint(state, uri, metadata=metadata, rank_states=rank_states,
                            config=config, storage=storage, progress=progress)


def _own_rank_state(rank_states: Mapping[int, Any] | None, rank: int, key: str) -> Any:
    """This rank's entry of ``rank_states`` for a sharded save (each rank writes its own).

    Raises:
        ShardedStateError: ``rank_states`` holds another rank's entry (``key``: the first
            sharded tensor, named in the message).
    """
    if not rank_states:
        return None
    others = sorted(r for r in rank_states if r != rank)
    if others:
        raise ShardedStateError(
            f"{key} is a sharded tensor: a sharded state is saved by every rank together, "
            f"each writing its own rank_state, but rank_states on rank {rank} holds the "
            f"state of rank(s) {others}; pass rank_states={{{rank}: ...}} on rank {rank} "
            "(its own only)")
    return rank_states[rank]
