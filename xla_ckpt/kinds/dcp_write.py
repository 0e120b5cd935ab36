"""Write PyTorch DCP checkpoints: DCP's own ``dcp.save`` into a temporary folder, then upload.

:func:`write_dcp` writes with DCP's own ``dcp.save(..., no_dist=True)`` and
``FileSystemWriter`` into a temporary folder, then uploads each file with
:meth:`Storage.write_atomic`, ``.metadata`` last (it is DCP's commit marker), so
``torch.distributed.checkpoint.load`` reads the result on any world size.  Reading is
:mod:`xla_ckpt.kinds.dcp`.
"""

from __future__ import annotations

import io
import logging
import mmap
import os
import tempfile
import time
import warnings
from typing import Any, Mapping

import torch

from xla_ckpt.errors import CheckpointExistsError, MetaTensorError, UnsupportedTypeError
from xla_ckpt.format.dcp import METADATA_NAME
from xla_ckpt.storage import Storage, StorageConfig, open_storage

logger = logging.getLogger(__name__)


def write_dcp(state: Mapping[str, Any], uri: str, *, config: StorageConfig | None = None,
              overwrite: bool = False) -> None:
    """Write ``state`` as a DCP checkpoint folder that ``torch.distributed.checkpoint.load`` reads.

    Written by torch's own ``dcp.save(state, storage_writer=FileSystemWriter(tmp),
    no_dist=True)`` into a temporary folder, then each file is uploaded to ``uri`` (local or
    ``gs://``) with :meth:`Storage.write_atomic`, the ``.distcp`` data files first and the
    ``.metadata`` commit marker last.  Called by one process (one rank) for the whole state;
    DCP's loader can then reshard it onto any world size.  Dtypes and shapes are kept exactly
    (int64 and bool buffers included, CASES C23); tensors that share storage (a tied
    embedding/output weight) are each written under their key and logged as ties, so they
    load back equal.

    Args:
        state: nested dicts/lists of CPU tensors and plain values, as ``dcp.save`` takes it;
            non-tensor values must load with ``torch.load(weights_only=True)`` (xla_ckpt reads
            them back no other way).
        uri: the checkpoint folder.
        config: storage knobs.
        overwrite: replace a DCP checkpoint already committed at ``uri``; its ``.metadata`` is
            removed first (its data files keep DCP's fixed names, so it cannot stay readable
            while they are replaced), and its ``.distcp`` files the new one does not reuse are
            deleted after the new ``.metadata`` is written.

    Raises:
        CheckpointExistsError: ``uri`` already holds a DCP ``.metadata`` and ``overwrite`` is
            False; nothing is written.
        UnsupportedTypeError: a DTensor (write full tensors; every rank's shard is not here),
            or a value ``weights_only`` cannot load back (names the key).
        MetaTensorError: a tensor on the meta device (names the key).
        StorageError: an upload failed after its retries (``.metadata`` is then not written).
    """
    flat = _check_writable(state)
    _log_ties(flat)
    target = open_storage(uri, config)
    try:
        if target.exists(METADATA_NAME):
            if not overwrite:
                raise CheckpointExistsError(f"{target.url(METADATA_NAME)}: a DCP checkpoint is "
                                            "already committed there; pass overwrite=True to "
                                            "replace it, or write to an empty folder")
            logger.warning("%s: replacing the DCP checkpoint there (its .metadata is removed "
                           "first)", target.uri)
            target.delete(METADATA_NAME)
            stale = [n for n in target.list("") if "/" not in n and n.endswith(".distcp")]
        else:
            stale = []
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="xla_ckpt-dcp-",
                                         dir=_local_temp_parent(target)) as tmp:
            _dcp_save(state, tmp)
            names = sorted(n for n in os.listdir(tmp) if n != METADATA_NAME)
            total = 0
            for name in names + [METADATA_NAME]:
                total += _upload(target, tmp, name)
        for name in sorted(set(stale) - set(names)):  # the replaced checkpoint's other files
            target.delete(name)
        dt = time.perf_counter() - t0
        logger.info("wrote DCP checkpoint %s: %d keys, %d files, %d bytes in %.2f s "
                    "(%.1f MiB/s)", target.uri, len(flat), len(names) + 1, total, dt,
                    total / max(dt, 1e-9) / 2**20)
    finally:
        target.close()


def _local_temp_parent(target: Storage) -> str | None:
    """For a local target, stage next to it (same filesystem, not a small /tmp)."""
    if target.uri.startswith("gs://"):
        return None
    parent = os.path.dirname(os.path.abspath(target.uri.removeprefix("file://")))
    return parent if os.path.isdir(parent) else None


def _dcp_save(state: Mapping[str, Any], folder: str) -> None:
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 - torch.distributed

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
        dcp.save(dict(state), storage_writer=dcp.FileSystemWriter(folder, sync_files=False),
                 no_dist=True)


def _upload(target: Storage, folder: str, name: str) -> int:
    path = os.path.join(folder, name)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size == 0:
            target.write_atomic(name, [b""])
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                target.write_atomic(name, [view])
            finally:
                view.release()
    return size


def _check_writable(state: Mapping[str, Any]) -> dict[str, Any]:
    """DCP's flattened items of ``state``, after refusing what could not be read back."""
    from torch.distributed.checkpoint._nested_dict import (  # noqa: PLC0415 - torch.distributed
        flatten_state_dict,
    )
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - torch.distributed

    if not isinstance(state, Mapping):
        raise UnsupportedTypeError(f"write_dcp takes a dict state, not {type(state).__name__}")
    flat, _ = flatten_state_dict(dict(state))
    for key, value in flat.items():
        if isinstance(value, DTensor):
            raise UnsupportedTypeError(
                f"key {key!r} is a DTensor: write_dcp writes one process's full tensors; "
                "gather it (or save from every rank with torch.distributed.checkpoint.save)")
        if isinstance(value, torch.Tensor):
            if value.device.type == "meta":
                raise MetaTensorError(f"key {key!r}: tensor on the meta device has no data to "
                                      "save")
            continue
        buf = io.BytesIO()
        try:
            torch.save(value, buf)
            buf.seek(0)
            torch.load(buf, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure means "cannot be read back"
            raise UnsupportedTypeError(
                f"key {key!r}: a {type(value).__name__} cannot be read back with "
                f"torch.load(weights_only=True) ({str(e).splitlines()[0] if str(e) else e!r}); "
                "store it as tensors or plain Python values") from None
    return flat


def _log_ties(flat: Mapping[str, Any]) -> None:
    groups: dict[tuple[Any, ...], list[str]] = {}
    for key, v in flat.items():
        if isinstance(v, torch.Tensor) and v.layout == torch.strided and v.numel():
            sig = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape),
                   v.stride(), v.dtype, v.device)
            groups.setdefault(sig, []).append(key)
    for keys in groups.values():
        if len(keys) > 1:
            logger.info("tied tensors %s share one storage: each is written under its key "
                        "(equal values; re-tie them after loading)", ", ".join(keys))
