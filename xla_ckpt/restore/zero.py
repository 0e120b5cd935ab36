"""A torch optimizer state dict <-> flat sharded tensors (ZeRO optimizer-state sharding).

:func:`split_optimizer_state` cuts a full ``optimizer.state_dict()`` into

* a small replicated part: ``param_groups``, per-parameter scalars
  (``step``) and a layout record saying where each parameter's buffers sit in
  the flat tensors;
* flat tensors, one per (state name, dtype) — e.g. ``optimizer.exp_avg.float32``
  — the concatenation of every parameter's buffer in parameter-index order,
  of which each rank keeps only its :func:`partition_bounds` range.

Save with :func:`xla_ckpt.restore.save_distributed` (replicated part in the
state, partitions as ``shards``); restore with ``zero_sharding="os"`` to get
only this rank's partition back (resharded exactly to the current world
size), or ``"none"`` to get the whole flat tensors and rebuild the full state
dict with :func:`join_optimizer_state`.  Bitwise: values are only sliced and
concatenated, never converted.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from xla_ckpt.errors import CheckpointCorruptError
from xla_ckpt.format.dtypes import dtype_name
from xla_ckpt.restore.sharding import partition_bounds

FLAT_LAYOUT = "flat_layout"
DEFAULT_PREFIX = "optimizer."


def _is_flat(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def flat_key(prefix: str, name: str, dtype: torch.dtype) -> str:
    return f"{prefix}{name}.{dtype_name(dtype)}"


def split_optimizer_state(optim_state: Mapping[str, Any], *, rank: int, world_size: int,
                          prefix: str = DEFAULT_PREFIX
                          ) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(replicated, partitions)`` of a full torch optimizer state dict for ``rank``.

    Args:
        optim_state: ``optimizer.state_dict()`` (``{"state": {idx: {...}},
            "param_groups": [...]}``), the same on every rank.
        rank, world_size: whose partition to cut.
        prefix: prefix of the flat tensor keys.

    Returns:
        ``replicated``: the state dict with every non-scalar per-parameter
        tensor removed, plus ``flat_layout`` ({key: [[param_idx, name, shape,
        offset], ...]}); ``partitions``: {key: 1-D tensor, this rank's range}.
    """
    state = optim_state.get("state", {})
    layout: dict[str, list] = {}
    pieces: dict[str, list[torch.Tensor]] = {}
    offsets: dict[str, int] = {}
    kept: dict = {}
    for idx in sorted(state):
        kept[idx] = {}
        for name, value in state[idx].items():
            if not _is_flat(value):
                kept[idx][name] = value
                continue
            key = flat_key(prefix, name, value.dtype)
            off = offsets.get(key, 0)
            layout.setdefault(key, []).append([idx, name, list(value.shape), off])
            pieces.setdefault(key, []).append(value.detach().reshape(-1))
            offsets[key] = off + value.numel()
    replicated = {k: (kept if k == "state" else v) for k, v in optim_state.items()}
    replicated.setdefault("state", kept)
    replicated[FLAT_LAYOUT] = layout
    partitions = {}
    for key, ps in pieces.items():
        flat = torch.cat([p.cpu() for p in ps]) if len(ps) > 1 else ps[0].cpu()
        lo, hi = partition_bounds(flat.numel(), world_size)[rank]
        partitions[key] = flat[lo:hi].clone()
    return replicated, partitions


def join_optimizer_state(replicated: Mapping[str, Any],
                         flat: Mapping[str, torch.Tensor]) -> dict:
    """The full optimizer state dict from the replicated part and *whole* flat tensors.

    Raises:
        CheckpointCorruptError: a flat tensor named in the layout is missing or
            shorter than the layout needs.
    """
    layout = replicated.get(FLAT_LAYOUT, {})
    state = {idx: dict(entries) for idx, entries in replicated.get("state", {}).items()}
    for key, records in layout.items():
        t = flat.get(key)
        if t is None:
            raise CheckpointCorruptError(f"optimizer flat tensor {key!r} is missing; restore with "
                                         "zero_sharding='none' to get whole flat tensors")
        for idx, name, shape, off in records:
            n = 1
            for s in shape:
                n *= s
            if off + n > t.numel():
                raise CheckpointCorruptError(f"optimizer flat tensor {key!r} has {t.numel()} "
                                             f"elements, the layout needs {off + n}")
            state.setdefault(idx, {})[name] = t[off:off + n].reshape(shape)
    rebuilt = {idx: state[idx] for idx in sorted(state)}
    return {k: (rebuilt if k == "state" else v) for k, v in replicated.items() if k != FLAT_LAYOUT}
