"""torch_xla SPMD (``XLAShardedTensor``): local device shards as boxes, for save and restore.

A torch_xla SPMD tensor lives as one shard per device; this process addresses some of the
devices (all of them on one host, its own chips on each host of a pod).  For a save or a
restore, :mod:`xla_ckpt.sharded.views` asks this module what the process holds:

* boxes come from ``XLAShardedTensor.local_shards``' ``indices`` (per-dimension slices into
  the global tensor, ``Ellipsis`` for a replicated tensor), never from ``placements``
  (wrong for named mesh axes) nor from DTensor's ``compute_local_shape_and_global_offset``
  (it crashes on this DTensor subclass);
* one box per *distinct* ``indices`` within the process: devices holding the same box
  (replicas: a tensor sharded on one mesh axis and replicated on another, e.g. ``("dp",
  None)`` over a 2x2 mesh) give it once, from the first device in device order.  This is
  the case torch_xla's own SPMD save planner loses (pytorch/xla#7919); here every distinct
  box is kept, and the save planner (:mod:`xla_ckpt.restore.owners`) then gives each box
  across processes exactly one writer;
* the placement is the tensor's XLA sharding (``sharding_spec``, e.g.
  ``"xla {devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}"``), the same string on every
  process of a job;
* shard data from torch_xla carries padding for uneven shards (a (10, 6) tensor 4-way on
  dim 0 has device shards of 3 rows, the last holding 1 real row); boxes are the real,
  unpadded extents, and a zero-size box (a device holding only padding) is left out.

Pending work must be materialised before shards are read or loaded: a tensor whose value
is still a lazy graph reports whole-tensor indices and refuses ``load_local_shards_``, so
both :func:`for_save` and :func:`for_restore` run ``torch_xla.sync()`` and
``xm.wait_device_ops()`` first.

Multi-host emulation: ``owned_devices`` (global device ids, as in ``Mesh(device_ids, ...)``)
restricts what this process writes and reads to those devices' shards.  On a real pod each
process addresses only its own devices and the default (every addressable device) is right;
in a test, gloo ranks each run the same single-process SPMD program over ``N`` CPU devices
and rank ``r`` owns devices ``[r*k, (r+1)*k)``.  Pass it per call, or set a process-wide
default with :func:`owning_devices` (a context manager) so callers that do not thread the
argument (``restore(into=...)``) pick it up.

torch_xla is imported lazily inside the functions: importing this module (and
:mod:`~xla_ckpt.sharded.views`) never initialises an XLA runtime.  Nothing here
communicates; every process describes its own values.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator, Sequence

import torch

from xla_ckpt.errors import UnsupportedTypeError
from xla_ckpt.format.chunks import Box
from xla_ckpt.sharded.value import LocalShard, ShardedValue

__all__ = ["for_restore", "for_save", "is_xla_sharded", "owning_devices"]

#: torch_xla ``ShardingType`` values (``torch_xla.distributed.spmd.ShardingType``), kept here so
#: that reading them needs no import.
_REPLICATED, _TILED, _PARTIAL = 0, 3, 5

_DEFAULT_OWNED: frozenset[int] | None = None

_DEVICE_RE = re.compile(r":(\d+)$")


@contextlib.contextmanager
def owning_devices(device_ids: Sequence[int] | None) -> Iterator[None]:
    """Within the block, this process saves and restores only these devices' SPMD shards.

    ``device_ids``: global device ids (what ``Mesh(device_ids, ...)`` and the ``CPU:<id>`` /
    ``TPU:<id>`` device names use); ``None`` restores the default, every addressable device.
    Multi-host emulation only (see the module docstring); an explicit ``owned_devices=``
    argument to :func:`for_save` / :func:`for_restore` takes precedence.  Not thread-local:
    set it around the whole save or restore of one process.
    """
    global _DEFAULT_OWNED
    previous = _DEFAULT_OWNED
    _DEFAULT_OWNED = None if device_ids is None else frozenset(int(d) for d in device_ids)
    try:
        yield
    finally:
        _DEFAULT_OWNED = previous


def is_xla_sharded(value: Any) -> bool:
    """True for an ``XLAShardedTensor``, or an XLA tensor carrying an SPMD sharding annotation.

    ``xs.mark_sharding(t, mesh, spec)`` annotates ``t`` in place and returns a wrapper; a
    module's ``state_dict()`` then holds the plain annotated tensor, which is sharded all the
    same.  A plain XLA tensor without annotation is not (it is a plain tensor to
    :mod:`~xla_ckpt.sharded.views`).  Never imports torch_xla for a non-XLA value.
    """
    cls = type(value)
    if cls.__name__ == "XLAShardedTensor" and cls.__module__.startswith("torch_xla"):
        return True
    if not isinstance(value, torch.Tensor) or value.device.type != "xla":
        return False
    import torch_xla  # noqa: PLC0415 - optional dependency; already loaded for an XLA tensor

    return torch_xla._XLAC._get_xla_sharding_type(value) is not None


def _wrap(value: Any) -> Any:
    """The ``XLAShardedTensor`` of ``value`` (itself, or a wrapper sharing its XLA tensor)."""
    from torch_xla.distributed.spmd import XLAShardedTensor  # noqa: PLC0415 - optional dependency

    if isinstance(value, XLAShardedTensor):
        return value
    if not is_xla_sharded(value):
        raise TypeError(f"expected an XLAShardedTensor or an SPMD-annotated XLA tensor, got "
                        f"{type(value).__name__} on {getattr(value, 'device', '?')}")
    return XLAShardedTensor(value)


def _materialise() -> None:
    """Run pending XLA work and wait for it: shards of a lazy value are not readable."""
    import torch_xla  # noqa: PLC0415 - optional dependency
    import torch_xla.core.xla_model as xm  # noqa: PLC0415 - optional dependency

    torch_xla.sync()
    xm.wait_device_ops()


def _device_id(name: str) -> int:
    """Global device id of a torch_xla shard device name (``"CPU:3"``, ``"TPU:12"``)."""
    m = _DEVICE_RE.search(name)
    if m is None:
        raise ValueError(f"cannot read a device id from torch_xla device name {name!r}")
    return int(m.group(1))


def _owned(owned_devices: Sequence[int] | None) -> frozenset[int] | None:
    """The owned device set in force (explicit argument, else :func:`owning_devices`)."""
    owned = _DEFAULT_OWNED if owned_devices is None else frozenset(int(d) for d in owned_devices)
    if owned is None:
        return None
    import torch_xla.runtime as xr  # noqa: PLC0415 - optional dependency

    count = int(xr.global_runtime_device_count())
    bad = sorted(d for d in owned if not 0 <= d < count)
    if bad:
        raise ValueError(f"owned_devices {bad} are not devices of this SPMD runtime "
                         f"(global device ids 0..{count - 1}); pass ids from the Mesh's "
                         "device_ids")
    return owned


def _box(indices: Any, shape: tuple[int, ...]) -> Box:
    """The box of a shard's ``indices`` (``Ellipsis``: the whole tensor)."""
    if indices is Ellipsis:
        return Box.whole(shape)
    if len(indices) != len(shape):
        raise ValueError(f"torch_xla shard indices {indices} do not match shape {shape}")
    offsets, sizes = [], []
    for sl, dim in zip(indices, shape, strict=True):
        start = 0 if sl.start is None else int(sl.start)
        stop = dim if sl.stop is None else min(int(sl.stop), dim)
        if sl.step not in (None, 1) or start < 0 or start > dim:
            raise ValueError(f"torch_xla shard indices {indices} are not a box of shape {shape}")
        offsets.append(start)
        sizes.append(max(stop - start, 0))
    return Box(tuple(offsets), tuple(sizes))


def _kind(x: Any) -> int:
    """The sharding type, checked to be one this module reads (replicated, tiled, partial)."""
    import torch_xla  # noqa: PLC0415 - optional dependency

    stype = torch_xla._XLAC._get_xla_sharding_type(x.global_tensor)
    if stype is None:
        return _REPLICATED
    stype = int(stype)
    if stype not in (_REPLICATED, _TILED, _PARTIAL):
        raise UnsupportedTypeError(
            f"torch_xla sharding type {stype} ({x.sharding_spec}) cannot be checkpointed: only "
            "replicated, tiled and partially replicated SPMD shardings have global boxes; "
            "re-shard the tensor with xs.mark_sharding over a Mesh first")
    return stype


def _unpadded(data: torch.Tensor, box: Box) -> torch.Tensor:
    """The real (unpadded) part of a padded device shard, as a view."""
    if tuple(data.shape) == box.sizes:
        return data
    return data[tuple(slice(0, s) for s in box.sizes)]


def for_save(value: Any, *, owned_devices: Sequence[int] | None = None) -> ShardedValue:
    """This process's device shards of ``value``: one box per distinct ``indices``.

    ``value``: an ``XLAShardedTensor`` or an SPMD-annotated XLA tensor.  Pending XLA work is
    run first (``torch_xla.sync()`` + ``xm.wait_device_ops()``).  Each returned
    :class:`~xla_ckpt.sharded.value.LocalShard` holds a C-contiguous CPU copy of shape
    ``box.sizes`` (padding removed); replicas inside the process are given once (the first
    device in device order; ``replica_id`` is that shard's torch_xla replica id), zero-size
    boxes are left out.  A fully replicated tensor is copied to the host once (one box
    covering it, ``replicated=True``).  ``owned_devices`` (global device ids; default
    :func:`owning_devices`, else every addressable device): only those devices' shards.

    Host memory: one CPU copy of every addressable device's shard while it runs (what
    ``local_shards`` transfers), then only the kept boxes.

    Raises:
        TypeError: ``value`` is not SPMD-sharded.
        ValueError: an owned device id outside the runtime's devices.
        UnsupportedTypeError: a manual or maximal sharding (no global boxes).
    """

    x = _wrap(value)
    owned = _owned(owned_devices)
    _materialise()
    shape = tuple(int(s) for s in x.shape)
    stype = _kind(x)
    placement = f"xla {x.sharding_spec or '{replicated}'}"
    shards: list[LocalShard] = []
    if stype == _REPLICATED:
        box = Box.whole(shape)
        if box.numel and (owned is None or owned):
            shards.append(LocalShard(box, x.global_tensor.detach().cpu().contiguous(),
                                     min(owned) if owned else 0))
        return ShardedValue(shape, x.dtype, shards, "xla", placement, True)
    seen: set[Box] = set()
    for shard in x.local_shards:
        if owned is not None and _device_id(shard.shard_device) not in owned:
            continue
        box = _box(shard.indices, shape)
        if box.numel == 0 or box in seen:
            continue
        seen.add(box)
        # torch_xla may hand back a wider host dtype (its MaybeUpcastToHostTorchType): the
        # chunk is stored in the tensor's own dtype (an exact round trip).
        data = _unpadded(shard.data, box).to(x.dtype).contiguous()
        shards.append(LocalShard(box, data, int(shard.replica_id)))
    return ShardedValue(shape, x.dtype, shards, "xla", placement, False)


def for_restore(value: Any, *, owned_devices: Sequence[int] | None = None) -> ShardedValue:
    """CPU destinations for this process's device shards of ``value``; ``finish`` loads them.

    ``value`` (an ``XLAShardedTensor`` or an SPMD-annotated XLA tensor) is the live target:
    its sharding decides the boxes, and it is updated in place (the same XLA tensor, e.g. a
    module parameter, holds the restored value afterwards).  Pending XLA work is run first.

    * Tiled / partially replicated: one box per distinct ``indices`` of the owned devices
      (replicas share one CPU buffer, so a box is read once per process); each
      :class:`~xla_ckpt.sharded.value.LocalShard` ``tensor`` is a C-contiguous CPU tensor of
      shape ``box.sizes`` (a view into the padded device-shard buffer when that is
      contiguous).  ``finish`` copies any separate staging into the padded buffers and calls
      ``load_local_shards_`` with a buffer for every addressable device (torch_xla requires
      all of them): devices this process does not own keep their current values.
    * Replicated: one whole-tensor box; ``finish`` copies it in with ``copy_`` (torch_xla
      refuses ``load_local_shards_`` for a replicated tensor), which sets every device,
      owned or not (they all hold the same value).

    Host memory: one padded CPU shard per addressable device (``local_shards`` snapshot; the
    buffers that are filled), less the duplicates of in-process replicas.

    Raises:
        TypeError: ``value`` is not SPMD-sharded.
        ValueError: an owned device id outside the runtime's devices.
        UnsupportedTypeError: a manual or maximal sharding.
    """

    x = _wrap(value)
    owned = _owned(owned_devices)
    _materialise()
    shape = tuple(int(s) for s in x.shape)
    stype = _kind(x)
    placement = f"xla {x.sharding_spec or '{replicated}'}"
    if stype == _REPLICATED:
        box = Box.whole(shape)
        if not box.numel or (owned is not None and not owned):
            return ShardedValue(shape, x.dtype, [], "xla", placement, True)
        staged = torch.empty(shape, dtype=x.dtype)

        def finish_replicated() -> None:
            with torch.no_grad():
                x.global_tensor.copy_(staged)

        return ShardedValue(shape, x.dtype, [LocalShard(box, staged, min(owned) if owned else 0)],
                            "xla", placement, True, finish_replicated)

    device_shards = x.local_shards
    buffers: dict[Box, torch.Tensor] = {}
    shards: list[LocalShard] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []    # (staging, view in padded buffer)
    for shard in device_shards:
        if owned is not None and _device_id(shard.shard_device) not in owned:
            continue
        box = _box(shard.indices, shape)
        if box.numel == 0:
            continue
        if box in buffers:
            shard.data = buffers[box]
            continue
        buffers[box] = shard.data
        view = _unpadded(shard.data, box)
        if view.is_contiguous() and view.dtype == x.dtype:
            dest = view
        else:
            dest = torch.empty(box.sizes, dtype=x.dtype)
            copies.append((dest, view))
        shards.append(LocalShard(box, dest, int(shard.replica_id)))

    def finish() -> None:
        for staged, view in copies:
            view.copy_(staged)
        x.load_local_shards_(device_shards)

    return ShardedValue(shape, x.dtype, shards, "xla", placement, False, finish)

