"""What a live tensor value holds of its global tensor: the boxes a rank saves or restores.

One description for every kind of tensor a training state holds, so save-by-owner and
restore-by-byte-range deal only with boxes (:class:`~xla_ckpt.format.chunks.Box`):

* a plain tensor (CPU, CUDA or XLA): one box covering the whole tensor, held by every rank
  (``replicated``);
* a ``DTensor`` (FSDP2, tensor parallel, HSDP): the box of its local shard, from
  ``compute_local_shape_and_global_offset`` (torch's own rule, uneven and empty shards
  included); replicated across the mesh dims with a ``Replicate()`` placement;
* a torch_xla ``XLAShardedTensor`` (SPMD), or an XLA tensor ``xs.mark_sharding`` annotated in
  place: one box per addressable device shard, from its ``local_shards``' ``indices``
  (:mod:`xla_ckpt.sharded.spmd`).  It is checked *before* DTensor because it subclasses
  DTensor and its ``placements`` are wrong for named axes.

Which rank calls what: every rank describes its own values; nothing here communicates.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeGuard

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from xla_ckpt.format.chunks import Box
from xla_ckpt.sharded import spmd
from xla_ckpt.sharded.value import LocalShard, ShardedValue


def _is_xla_sharded(value: Any) -> bool:
    # An XLAShardedTensor, or an XLA tensor annotated in place by ``xs.mark_sharding`` (what a
    # module's state_dict() holds): both are sharded (see spmd.is_xla_sharded).
    return spmd.is_xla_sharded(value)


def _is_dtensor(value: Any) -> TypeGuard[DTensor]:
    return isinstance(value, DTensor)


def is_sharded(value: Any) -> bool:
    """True for a ``DTensor``, a torch_xla ``XLAShardedTensor`` or an SPMD-annotated XLA tensor."""
    return _is_xla_sharded(value) or _is_dtensor(value)


def _placement_name(p: Any) -> str:
    """``Shard(0)``, ``_StridedShard(0, sf=2)``, ``Replicate()``, ``Partial(sum)`` (torch's own
    ``str`` is ``S(0)`` / ``R``)."""
    if isinstance(p, _StridedShard):
        return f"_StridedShard({p.dim}, sf={p.split_factor})"
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Replicate):
        return "Replicate()"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op})"
    return repr(p)


def describe_placements(mesh_shape: Sequence[int], placements: Sequence[Any]) -> str:
    """``"Shard(0),Replicate() on mesh (2, 2)"``: what the structure agreement compares."""
    names = ",".join(_placement_name(p) for p in placements)
    return f"{names} on mesh {tuple(int(s) for s in mesh_shape)}"


def _dtensor_box(value: Any) -> tuple[Box, str, bool]:
    shape = tuple(int(s) for s in value.shape)
    local_shape, offsets = compute_local_shape_and_global_offset(
        shape, value.device_mesh, value.placements)
    box = Box(tuple(int(o) for o in offsets), tuple(int(s) for s in local_shape))
    placement = describe_placements(value.device_mesh.shape, value.placements)
    replicated = all(isinstance(p, Replicate) for p in value.placements)
    return box, placement, replicated


def local_tensor(value: Any, box: Box, placement: str) -> torch.Tensor:
    """``value.to_local()``, checked against ``box`` (its shard's box by DTensor's own rule).

    A byte-free shard (``box`` has no elements) takes whatever shape the local tensor
    reports, as long as it holds no element either: FSDP2 keeps a ``(0, 0)`` local tensor
    for a ``(3, 0)`` parameter on every rank, where the rule gives ``(1, 0)`` to ranks 0..2;
    there is nothing to save or fill either way (DCP saves and loads it too).

    Raises:
        ValueError: the local tensor's shape differs from ``box.sizes`` and either holds
            elements (a hand-built DTensor with inconsistent metadata), naming both.
    """
    local = value.to_local()
    shape = tuple(int(s) for s in local.shape)
    if shape != box.sizes and (box.numel or local.numel()):
        raise ValueError(f"DTensor local shard has shape {shape}, but its placements "
                         f"{placement} give {box.sizes}")
    return local


def for_save(value: torch.Tensor, *, owned_devices: Sequence[int] | None = None
             ) -> ShardedValue:
    """What this rank holds of ``value`` for a save (its boxes and readable tensors).

    ``owned_devices``: torch_xla SPMD only; the global device ids whose shards this
    process writes (multi-host emulation; default every addressable device).

    Raises:
        ValueError: a DTensor whose local tensor does not have the shape DTensor's own
            rule gives (a hand-built DTensor with inconsistent metadata; a byte-free shard
            may report any byte-free shape: :func:`local_tensor`), naming both; a DTensor
            with a ``Partial`` placement (its local tensors are pending a reduction).
    """
    if _is_xla_sharded(value):
        return spmd.for_save(value, owned_devices=owned_devices)
    if _is_dtensor(value):
        box, placement, replicated = _dtensor_box(value)
        if any(isinstance(p, Partial) for p in value.placements):
            raise ValueError(f"a DTensor placed {placement} holds partial values (a reduction "
                             "is pending): its local tensors are not its data; redistribute "
                             "it to Shard/Replicate placements before saving")
        local = local_tensor(value, box, placement)
        shards = [LocalShard(box, local.detach())] if box.numel else []
        return ShardedValue(tuple(int(s) for s in value.shape), value.dtype, shards, "dtensor",
                            placement, replicated)
    box = Box.whole(value.shape)
    shards = [LocalShard(box, value.detach())] if box.numel else []
    return ShardedValue(tuple(int(s) for s in value.shape), value.dtype, shards, "plain",
                        "replicated", True)


def _destination(live: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """A CPU tensor to fill for ``live`` (itself when it is dense CPU memory) and the copy-back."""
    if live.device.type == "cpu" and live.is_contiguous():
        return live, None
    staged = torch.empty(tuple(live.shape), dtype=live.dtype)

    def finish() -> None:
        with torch.no_grad():
            live.copy_(staged)

    return staged, finish


def for_restore(value: torch.Tensor) -> ShardedValue:
    """The boxes this rank must fill to restore ``value`` in place, with CPU destinations.

    A CPU plain tensor or CPU DTensor is filled in place (its local tensor is the
    destination, no copy); anything else (CUDA, XLA, non-contiguous) gets a CPU staging
    tensor per box and :attr:`ShardedValue.finish` copies it into the live tensor.
    """
    if _is_xla_sharded(value):
        return spmd.for_restore(value)
    if _is_dtensor(value):
        box, placement, replicated = _dtensor_box(value)
        local = local_tensor(value, box, placement)
        if not box.numel:  # byte-free: nothing to fill, nothing to copy back
            return ShardedValue(tuple(int(s) for s in value.shape), value.dtype, [], "dtensor",
                                placement, replicated)
        dest, finish = _destination(local.detach())
        shards = [LocalShard(box, dest)]
        return ShardedValue(tuple(int(s) for s in value.shape), value.dtype, shards, "dtensor",
                            placement, replicated, finish)
    dest, finish = _destination(value.detach())
    box = Box.whole(value.shape)
    shards = [LocalShard(box, dest)] if box.numel else []
    return ShardedValue(tuple(int(s) for s in value.shape), value.dtype, shards, "plain",
                        "replicated", True, finish)
