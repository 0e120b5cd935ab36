"""Functions the DCP tests run on every rank of a launcher pool (module level: importable).

Each rank joins the pool's gloo group (``env://``), builds the same small FSDP2 model on
``init_device_mesh("cpu", (world,))`` and works on a shared checkpoint folder.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from xla_ckpt.format.dcp import DcpTensorEntry
from xla_ckpt.kinds.dcp import read_dcp_into, read_dcp_metadata
from xla_ckpt.testing.asserts import tensor_bits

#: Input features of the first layer: wide, so the zip structure a rank reads is small next to
#: its tensor bytes.
IN_FEATURES = 20000


class Net(nn.Module):
    """Rows 10 and 7 (neither divides by 4: FSDP2 shards 3,3,3,1 and 2,2,2,1), plus an int64
    and a bool buffer (CASES C23)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(IN_FEATURES, 10)
        self.l2 = nn.Linear(10, 7)
        self.register_buffer("seen", torch.tensor([3, -1, 2**40], dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False, True, True, False, False, True]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x))) * self.mask


def _join() -> int:
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://")
    return dist.get_world_size()


def _fsdp_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    world = _join()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = Net()
    fully_shard(model.l1, mesh=mesh)
    fully_shard(model.l2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, optim


def _flat_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optim)  # initialises empty optimizer state (step 0 -> 1)
    flat, _ = flatten_state_dict({"model": msd, "optim": osd})
    return flat


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _shards(flat: dict[str, Any]) -> dict[str, Any]:
    """``tensors``: key -> (dtype, local shape, local bits); ``values``: the other items."""
    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for k, v in flat.items():
        if isinstance(v, torch.Tensor):
            loc = _local(v).detach()
            tensors[k] = (str(loc.dtype), tuple(loc.shape), tensor_bits(loc.contiguous()))
        else:
            values[k] = v
    return {"tensors": tensors, "values": values}


def save_fsdp_checkpoint(path: str) -> dict[str, Any]:
    """4 ranks: FSDP2 model, one AdamW step, ``dcp.save`` of ``get_state_dict``.

    Returns this rank's ``shards`` (key -> (global offset, local tensor); offset 0 for plain
    tensors) and non-tensor ``values``, for checking against what xla_ckpt reads."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    model, optim = _fsdp_model(seed=0)
    torch.manual_seed(100 + dist.get_rank())
    x = torch.randn(4, IN_FEATURES)
    model(x).square().sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    flat, _ = flatten_state_dict({"model": msd, "optim": osd})
    shards: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for k, v in flat.items():
        if isinstance(v, DTensor):
            _, off = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
            shards[k] = (tuple(off), v.to_local().detach().clone())
        elif isinstance(v, torch.Tensor):
            shards[k] = ((0,) * v.dim(), v.detach().clone())
        else:
            values[k] = v
    dist.barrier()
    return {"shards": shards, "values": values}


def restore_fsdp_two_ways(path: str, exported: str) -> dict[str, Any]:
    """2 ranks: ``read_dcp_into`` a fresh FSDP2 state vs ``dcp.load`` of the same checkpoint,
    and ``dcp.load`` of xla_ckpt's export of it.

    Returns shards of the three restores, the model's own parameter shards after
    ``read_dcp_into``, and this rank's bytes read vs the checkpoint's tensor bytes."""
    model, optim = _fsdp_model(seed=1)
    flat = _flat_state(model, optim)
    targets = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    stats = read_dcp_into(path, targets)
    ours = _shards(flat)["tensors"]
    params = {f"model.{n}": (str(p.dtype), tuple(_local(p).shape),
                             tensor_bits(_local(p).detach().contiguous()))
              for n, p in model.named_parameters()}

    model2, optim2 = _fsdp_model(seed=2)
    flat2 = _flat_state(model2, optim2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(flat2, checkpoint_id=path)
    theirs = _shards(flat2)

    model3, optim3 = _fsdp_model(seed=3)
    flat3 = _flat_state(model3, optim3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(flat3, checkpoint_id=exported)
    from_export = _shards(flat3)

    md = read_dcp_metadata(path)
    total = sum(e.nbytes for e in md.entries.values() if isinstance(e, DcpTensorEntry))
    dist.barrier()
    return {"ours": ours, "theirs": theirs, "from_export": from_export, "params": params,
            "bytes_read": stats.bytes_read, "tensor_bytes_total": total,
            "requests": stats.requests}


def restore_converted(converted: str) -> dict[str, Any]:
    """2 ranks: ``xla_ckpt.restore`` of the xla_ckpt checkpoint ``xla-ckpt convert`` made from
    the 4-rank DCP checkpoint (full tensors on every rank), applied to a fresh FSDP2 model and
    optimizer with DCP's own ``set_state_dict(full_state_dict=True)``.

    Returns the shards of the restored state, in the form of :func:`_shards`."""
    from xla_ckpt.comm import get_dist
    from xla_ckpt.restore import restore

    _join()
    state = restore(converted, dist=get_dist()).state
    model, optim = _fsdp_model(seed=4)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(full_state_dict=True))
    out = _shards(_flat_state(model, optim))
    out["restored_values"] = {k: v for k, v in flatten_state_dict(state)[0].items()
                              if not isinstance(v, torch.Tensor)}
    dist.barrier()
    return out


def read_column_shards(path: str) -> dict[str, Any]:
    """2 ranks: DTensors sharded on dim 1 (a column box: one range per row, or the rows'
    span when there are many rows) filled by ``read_dcp_into``; returns local bits."""
    world = _join()
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    targets: dict[str, DTensor] = {}
    for key, shape in (("few_rows", (8, 6)), ("many_rows", (40, 6)), ("cube", (4, 5, 6))):
        full = torch.zeros(shape)
        targets[key] = distribute_tensor(full, mesh, [Shard(1)])
    read_dcp_into(path, targets)
    for key, t in targets.items():
        out[key] = tensor_bits(t.to_local().contiguous())
    dist.barrier()
    return out
