"""PyTorch DCP checkpoints in and out: read by byte range without unrestricted pickle; write by DCP.

A DCP checkpoint is a folder (local or ``gs://``) holding ``.distcp`` data files and the
``.metadata`` commit marker written last (``torch.distributed.checkpoint.FileSystemWriter``).
Keys are DCP's flattened dotted names (``"model.layer.weight"``,
``"optim.state.layer.weight.exp_avg"``, ``"optim.param_groups.0.lr"``).

Read side (any rank, any number of ranks, no collectives: each caller reads what it needs):

* :func:`read_dcp_metadata` -- the ``.metadata`` through the allow-list
  (:mod:`xla_ckpt.format.dcp.metadata`);
* :func:`read_dcp` -- flat ``{key: value}``: full global tensors on CPU assembled from their
  chunks, non-tensor items through ``torch.load(weights_only=True)`` only;
* :func:`read_dcp_into` -- fill existing tensors or DTensors in place; a DTensor target reads
  only the overlap of the saved chunks with its local shard (box overlap, offsets from
  ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, as DCP's own
  planner computes them), and a box of contiguous rows is one byte range;
* :func:`unflatten_dcp_state` -- the nested state from the flat keys (DCP's own
  ``unflatten_state_dict`` with the checkpoint's mapping).

Every tensor key is read as boxes with file byte ranges by xla_ckpt's one chunk reader
(:mod:`xla_ckpt.kinds.dcp_boxes` describes the located zip members as blobs and chunks for
:func:`xla_ckpt.io.chunked.read_boxes`): each chunk's bytes are located inside its
``torch.save`` zip by byte range (:mod:`xla_ckpt.format.dcp.zip_member`: two small requests
for the zip structure, which hold a small tensor whole), then only the tensor bytes needed are
fetched, straight into the destination's memory where it is a contiguous CPU tensor; every
object's generation is pinned across its reads, and a chunk read whole is checked against the
zip's CRC-32 (re-read once, then :class:`~xla_ckpt.errors.IntegrityError`;
:class:`~xla_ckpt.errors.PartiallyOverwrittenError` when the bytes already landed in a live
target).  A sub-box read cannot be checked: DCP records no checksum of parts of a chunk.

Write side: :mod:`xla_ckpt.kinds.dcp_write`.
"""

from __future__ import annotations

import difflib
import logging
import math
import time
from typing import Any, Iterable, Mapping

import torch

from xla_ckpt.errors import MetaTensorError, StateMismatchError, UnknownKeyError
from xla_ckpt.format.dcp import (
    METADATA_NAME,
    DcpBytesEntry,
    DcpMetadata,
    DcpTensorEntry,
    load_bytes_item,
)
from xla_ckpt.format.dtypes import dtype_name
from xla_ckpt.io.chunked import fresh_tensor
from xla_ckpt.kinds.dcp_boxes import (
    DcpBox,
    DcpReadStats,
    DcpSource,
    load_metadata,
    read_dcp_boxes,
)
from xla_ckpt.storage import Storage, StorageConfig, open_storage

logger = logging.getLogger(__name__)


# ---- public read API -----------------------------------------------------------------------


def is_dcp_checkpoint(storage: Storage) -> bool:
    """True if the folder ``storage`` is rooted at holds a DCP ``.metadata`` (a committed DCP
    checkpoint).  One ``stat``; reads nothing else."""
    return storage.exists(METADATA_NAME)


def read_dcp_metadata(uri: str, *, config: StorageConfig | None = None) -> DcpMetadata:
    """The checked ``.metadata`` of the DCP checkpoint folder at ``uri`` (local or ``gs://``).

    Raises:
        CheckpointNotFoundError: no ``.metadata`` there (IncompleteCheckpointError if
            ``.distcp`` files are there without it).
        UnsafePickleError / CheckpointCorruptError: see
            :func:`xla_ckpt.format.dcp.load_dcp_metadata`.
    """
    storage = open_storage(uri, config)
    try:
        return load_metadata(storage, DcpReadStats())
    finally:
        storage.close()


def read_dcp(uri: str, *, keys: Iterable[str] | None = None,
             config: StorageConfig | None = None) -> DcpState:
    """Read a DCP checkpoint folder into a flat dict, one process, every byte by range.

    Args:
        uri: the checkpoint folder (local path or ``gs://bucket/prefix``).
        keys: DCP's flattened keys to read (default: all).
        config: storage knobs (parallel requests, slice size, retries).

    Returns:
        ``{key: value}`` in the checkpoint's order, keys as DCP names them: every tensor the
        full global tensor on CPU, in its saved dtype and shape (assembled from all chunks;
        a 0-d tensor such as an optimizer ``step`` stays 0-d); every non-tensor item as
        ``torch.load(weights_only=True)`` gives it.  A :class:`DcpState` (a ``dict``) that
        carries the checkpoint's key mapping: nest it with ``unflatten_dcp_state(flat)``.

    Raises:
        CheckpointNotFoundError / IncompleteCheckpointError: no committed DCP checkpoint.
        UnknownKeyError: a requested key is not in the checkpoint (names it and the closest).
        UnsafePickleError: ``.metadata`` or an item needs a global outside the allow-lists.
        CheckpointCorruptError / DataFileMissingError / IntegrityError: malformed metadata,
            missing or short data files, a zip that is not what the metadata says, a CRC-32
            mismatch (each names the file and key).
    """
    stats = DcpReadStats()
    t0 = time.perf_counter()
    src = DcpSource(uri, config, stats)
    try:
        md = src.metadata
        wanted = list(md.entries) if keys is None else list(dict.fromkeys(keys))
        _check_known(src, wanted)
        out = DcpState()
        out.mapping = md.mapping
        boxes: list[DcpBox] = []
        for key in wanted:
            entry = md.entries[key]
            if isinstance(entry, DcpBytesEntry):
                out[key] = _read_bytes_item(src, entry)
                continue
            dest = fresh_tensor(entry.shape, entry.dtype)
            out[key] = dest
            boxes.append(DcpBox(entry, (0,) * len(entry.shape), dest, fresh=True))
        read_dcp_boxes(src, boxes)
        stats.keys = len(out)
    finally:
        src.close()
    stats.seconds = time.perf_counter() - t0
    _log_done("read", uri, stats)
    return out


def read_dcp_into(uri: str, targets: Mapping[str, torch.Tensor], *,
                  config: StorageConfig | None = None) -> DcpReadStats:
    """Fill existing tensors (plain or DTensor) in place from a DCP checkpoint folder.

    Called by every rank that holds targets, each for its own (no collectives).  A plain
    tensor must have the saved global shape; a ``DTensor`` must have it as its global shape,
    and only its local shard is filled: this rank reads the overlap of each saved chunk with
    the shard's box (``compute_local_shape_and_global_offset``, as DCP itself uses), and
    only those byte ranges (a box of whole trailing dimensions is one range per chunk).
    Targets may live on any device (bytes are staged on CPU, then copied).

    Args:
        uri: the checkpoint folder (local path or ``gs://``).
        targets: DCP key -> tensor or DTensor to fill; its dtype must equal the saved one
            (never a silent cast, CASES C10).
        config: storage knobs.

    Returns:
        :class:`DcpReadStats` of this call (bytes read by this rank, requests, keys).

    Raises:
        UnknownKeyError: a key the checkpoint does not hold (names the closest).
        StateMismatchError: a key of a non-tensor item, a shape or
            dtype differing from the saved one, a DTensor whose local shard is not one box
            (names the key and what to do).
        MetaTensorError: a target on the meta device (materialise it with ``to_empty`` first).
        CheckpointNotFoundError / UnsafePickleError / CheckpointCorruptError /
            DataFileMissingError / IntegrityError: as :func:`read_dcp`.
        PartiallyOverwrittenError: a chunk read straight into a target failed its CRC-32
            twice; that target now holds the unchecked bytes (names the key).
    """
    stats = DcpReadStats()
    t0 = time.perf_counter()
    src = DcpSource(uri, config, stats)
    try:
        _check_known(src, list(targets))
        boxes: list[DcpBox] = []
        for key, target in targets.items():
            entry = src.metadata.entries[key]
            if not isinstance(entry, DcpTensorEntry):
                raise StateMismatchError(f"{src.storage.uri}: key {key!r} is a non-tensor item; "
                                         "read it with read_dcp(uri, keys=[...])")
            local, box_off = _target_box(src, key, entry, target)
            boxes.append(DcpBox(entry, box_off, local))
        read_dcp_boxes(src, boxes)
        stats.keys = len(targets)
    finally:
        src.close()
    stats.seconds = time.perf_counter() - t0
    _log_done("read_into", uri, stats)
    return stats


class DcpState(dict[str, Any]):
    """What :func:`read_dcp` returns: a plain ``dict`` of DCP's flat keys, plus :attr:`mapping`
    (the checkpoint's flat key -> nested path, :attr:`DcpMetadata.mapping`) for
    :func:`unflatten_dcp_state`."""

    mapping: Mapping[str, tuple[str | int, ...]] = {}


def unflatten_dcp_state(flat: Mapping[str, Any],
                        mapping: Mapping[str, tuple[str | int, ...]] | None = None
                        ) -> dict[str, Any]:
    """The nested state of DCP's flat keys (``{"model": {...}, "optim": {"state": ...,
    "param_groups": [...]}}``), by torch's own ``unflatten_state_dict``.

    Args:
        flat: ``{key: value}`` as :func:`read_dcp` returns it.
        mapping: flat key -> path in the nested state; default: the one :func:`read_dcp`
            attached to ``flat`` (:attr:`DcpState.mapping`), else pass
            ``read_dcp_metadata(uri).mapping``.  A key it lacks stays at the top level under
            its flat name (so does every key of a checkpoint whose planner recorded none).

    Returns:
        The nested state.  Dict keys come back as DCP stored them (strings), except the
        ``state`` keys of an optimizer state dict (a mapping with ``state`` and
        ``param_groups`` whose ``params`` are ints), which become the int parameter ids
        ``optimizer.state_dict()`` had (DCP records only their string form).
    """
    from torch.distributed.checkpoint._nested_dict import (  # noqa: PLC0415 - torch.distributed
        unflatten_state_dict,
    )

    if mapping is None:
        mapping = getattr(flat, "mapping", None) or {}
    full = {k: tuple(mapping.get(k, (k,))) for k in flat}
    nested = unflatten_state_dict(dict(flat), full)
    _restore_optimizer_int_keys(nested)
    return nested


def _restore_optimizer_int_keys(obj: Any) -> None:
    """Give every optimizer state dict in ``obj`` back its int parameter-id keys, in place.

    DCP's flattening writes every dict key as a string (``_traverse.traverse_state_dict``:
    ``path + (str(k),)``), and ``.metadata``'s ``planner_data`` records the stringified path,
    so the types are lost on disk; ``dcp.load`` gets them back only because it fills a
    template.  Without one, an ``optimizer.state_dict()`` would come back with ``state`` keys
    ``'0', '1'`` that ``Optimizer.load_state_dict`` keeps as dead entries (the parameters'
    state silently lost).  A mapping with a ``state`` dict and ``param_groups`` whose
    ``params`` are ints is an optimizer state dict: each ``state`` key that is the decimal
    form of one of those ids becomes that int.  Keys that are not (FQN-keyed optimizer state
    such as ``get_optimizer_state_dict`` writes) stay as they are.
    """
    if isinstance(obj, list):
        for v in obj:
            _restore_optimizer_int_keys(v)
        return
    if not isinstance(obj, dict):
        return
    state, groups = obj.get("state"), obj.get("param_groups")
    if isinstance(state, dict) and isinstance(groups, list) and state and all(
            isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
        ids = {pid for g in groups for pid in g["params"]
               if isinstance(pid, int) and not isinstance(pid, bool)}
        if ids and not any(isinstance(k, int) for k in state):
            def as_id(k: Any) -> Any:
                if isinstance(k, str) and k.isdigit() and str(int(k)) == k and int(k) in ids:
                    return int(k)
                return k
            converted = {as_id(k): v for k, v in state.items()}
            state.clear()
            state.update(converted)
    for v in obj.values():
        _restore_optimizer_int_keys(v)


def _check_known(src: DcpSource, keys: list[str]) -> None:
    missing = [k for k in keys if k not in src.metadata.entries]
    if missing:
        closest = tuple(difflib.get_close_matches(missing[0], list(src.metadata.entries), n=3))
        hint = f"; closest: {', '.join(repr(k) for k in closest)}" if closest else ""
        raise UnknownKeyError(
            f"{src.storage.uri}: key{'s' if len(missing) > 1 else ''} "
            f"{', '.join(repr(k) for k in missing[:10])} not in the DCP checkpoint (it holds "
            f"{len(src.metadata.entries)} keys{hint}); DCP keys are flattened dotted names such "
            "as 'model.layer.weight'", key=missing[0], closest=closest,
            checkpoint=src.storage.uri)


def _read_bytes_item(src: DcpSource, entry: DcpBytesEntry) -> Any:
    src.check_range(entry.key, entry.file, entry.offset, entry.length)
    data = src.read(entry.file, entry.offset, entry.length)
    return load_bytes_item(data, where=f"{src.storage.url(entry.file)}: key {entry.key!r}")


def _target_box(src: DcpSource, key: str, entry: DcpTensorEntry, target: torch.Tensor
                ) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(local tensor to fill, its first index in the global tensor)."""
    where = f"{src.storage.uri}: key {key!r}"
    if not isinstance(target, torch.Tensor):
        raise StateMismatchError(f"{where}: target is a {type(target).__name__}, not a tensor")
    if tuple(target.shape) != entry.shape:
        raise StateMismatchError(f"{where}: saved global shape {entry.shape}, target "
                                 f"{tuple(target.shape)}")
    if target.dtype != entry.dtype:
        raise StateMismatchError(f"{where}: saved dtype {dtype_name(entry.dtype)}, target "
                                 f"{dtype_name(target.dtype)}; xla_ckpt never casts silently: "
                                 "build the target in the saved dtype and cast afterwards")
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - torch.distributed

    if isinstance(target, DTensor):
        from torch.distributed.tensor._utils import (  # noqa: PLC0415 - torch.distributed
            compute_local_shape_and_global_offset,
        )

        local = target.to_local()
        shape, offset = compute_local_shape_and_global_offset(
            target.shape, target.device_mesh, target.placements)
        if tuple(local.shape) != tuple(shape) and (local.numel() or math.prod(shape)):
            # (a byte-free shard may report any byte-free shape: FSDP2's (3, 0) parameter)
            raise StateMismatchError(
                f"{where}: the DTensor's local shard has shape {tuple(local.shape)} but its "
                f"placements {target.placements} give a box of {tuple(shape)}; read it with "
                "torch.distributed.checkpoint.load")
        box_off = tuple(int(o) for o in offset)
    else:
        local, box_off = target, (0,) * len(entry.shape)
    if local.device.type == "meta":
        raise MetaTensorError(f"{where}: the target is on the meta device and has no memory to "
                              "fill; materialise it first (module.to_empty(device=...))")
    return local, box_off



def _log_done(what: str, uri: str, stats: DcpReadStats) -> None:
    logger.debug("dcp %s %s: %d keys, %d bytes (%d tensor) in %d requests, %.3f s (%.1f MiB/s)",
                 what, uri, stats.keys, stats.bytes_read, stats.tensor_bytes, stats.requests,
                 stats.seconds, stats.bytes_read / max(stats.seconds, 1e-9) / 2**20)

