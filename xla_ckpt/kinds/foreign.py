"""Read a checkpoint of another kind (legacy ``.pt``/safetensors, HF index, DCP) whole.

The kinds are told apart by :func:`xla_ckpt.run.resolve.resolve`; this module sends each to
its reader in :mod:`xla_ckpt.kinds`.
"""

from __future__ import annotations

from typing import Any

from xla_ckpt.errors import ConfigError
from xla_ckpt.kinds.hf import load_hf_index
from xla_ckpt.kinds.legacy import Progress, load_legacy_file
from xla_ckpt.run.resolve import Resolved
from xla_ckpt.run.sniff import DCP, HF_INDEX, LEGACY
from xla_ckpt.storage import StorageConfig


def read_foreign(resolved: Resolved, *, config: StorageConfig | None = None,
                 progress: Progress | None = None) -> Any:
    """The whole state of a resolved source that is not an xla_ckpt checkpoint; CPU tensors.

    Legacy ``.pt``/safetensors: :func:`~xla_ckpt.kinds.legacy.load_legacy_file` (allow-list,
    fairseq upgrade); HF index: :func:`~xla_ckpt.kinds.hf.load_hf_index`; DCP:
    :func:`xla_ckpt.kinds.dcp.read_dcp`, nested by :func:`~xla_ckpt.kinds.dcp.unflatten_dcp_state`.
    ``progress`` gets byte counts (legacy and HF).

    Raises:
        ConfigError: ``resolved`` is an xla_ckpt checkpoint (read it with
            :func:`xla_ckpt.kinds.opener.read_items`).
    """
    if resolved.kind == LEGACY:
        return load_legacy_file(resolved.checkpoint, config=config, progress=progress).state
    if resolved.kind == HF_INDEX:
        return load_hf_index(resolved.checkpoint, config=config, progress=progress)
    if resolved.kind == DCP:
        from xla_ckpt.kinds.dcp import (  # noqa: PLC0415 - DCP support loads torch.distributed
            read_dcp,
            read_dcp_metadata,
            unflatten_dcp_state,
        )

        mapping = read_dcp_metadata(resolved.checkpoint, config=config).mapping
        return unflatten_dcp_state(read_dcp(resolved.checkpoint, config=config), mapping)
    raise ConfigError(f"{resolved.checkpoint} is {resolved.what}; read it with read_items")
