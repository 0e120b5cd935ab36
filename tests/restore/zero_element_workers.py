"""Functions the zero-element FSDP2 tests run on every rank of a launcher pool (module level).

Each rank joins the pool's gloo group (``env://``) and builds :class:`ZeroNet` under FSDP2
(``fully_shard`` on ``init_device_mesh("cpu", (world,))``) with an AdamW after one step, so
the state holds byte-free shards of two kinds:

* shards whose local tensor has another byte-free shape than DTensor's rule gives: the
  ``(3, 0)`` parameter of the issue (FSDP2 keeps a ``(0, 0)`` local tensor on every rank,
  the rule gives ``(1, 0)`` to ranks 0..2 on 4 ranks, ``(2, 0)`` on 2) and a ``(5, 0, 2)``
  one, and their AdamW ``exp_avg`` / ``exp_avg_sq`` (the same layout);
* shards that are byte-free with the rule's shape: a ``(0, 5)`` parameter and its state;

plus a normal ``(10, 6)`` weight (uneven shards) and its bias.  DCP is the reference: the
same state is saved with ``dcp.save`` and loaded with ``dcp.load`` onto the new mesh.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import xla_ckpt
from xla_ckpt.kinds.dcp import read_dcp_into
from xla_ckpt.restore import restore, save_distributed
from xla_ckpt.restore.targets import tensor_leaves
from xla_ckpt.testing.asserts import tensor_bits


class ZeroNet(nn.Module):
    """Byte-free parameters (3, 0), (4, 0) and (0, 5) beside a (10, 6) linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Parameter(torch.empty(3, 0))
        self.v = nn.Parameter(torch.empty(4, 0))
        self.z = nn.Parameter(torch.empty(0, 5))
        self.lin = nn.Linear(6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    if not tdist.is_initialized():
        tdist.init_process_group("gloo", init_method="env://")
    mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
    torch.manual_seed(seed)
    model = ZeroNet()
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + seed)
    model(torch.randn(4, 6, generator=g)).square().sum().backward()
    # FSDP2's reduce-scatter refuses empty gradients: give the byte-free parameters theirs by
    # hand, so AdamW keeps (byte-free) state for them as well
    for p in (model.e, model.v, model.z):
        p.grad = torch.zeros_like(p)
    optim.step()
    optim.zero_grad()
    return model, optim


def _state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}


def _shards(tree: Any) -> dict[str, Any]:
    """Key path -> (global shape, local shape, dtype, local bytes) of every tensor leaf."""
    out: dict[str, Any] = {}
    for key, v in tensor_leaves(tree).items():
        loc = v.to_local() if isinstance(v, DTensor) else v
        out[key] = (tuple(v.shape), tuple(loc.shape), str(loc.dtype),
                    bytes(tensor_bits(loc.contiguous()).numpy()))
    return out


def save_both(root: str) -> dict[str, Any]:
    """Save the state with xla_ckpt (``{root}/ours``) and DCP (``{root}/dcp``); this rank's
    local shards of what was saved."""
    model, optim = _build(seed=0)
    state = _state(model, optim)
    save_distributed(state, f"{root}/ours", metadata={"step": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=f"{root}/dcp")
    tdist.barrier()
    return _shards(state)


def restore_both(root: str, strategies: tuple[str, ...] = ("all_ranks", "broadcast")
                 ) -> dict[str, Any]:
    """Restore onto this world (fresh targets from another seed) with DCP and with xla_ckpt
    (each strategy); this rank's local shards after ``set_state_dict``, and the whole load."""
    out: dict[str, Any] = {}
    model, optim = _build(seed=1)
    state = _state(model, optim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=f"{root}/dcp")
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["dcp"] = _shards(_state(model, optim))
    for s in strategies:
        model, optim = _build(seed=2)
        r = restore(f"{root}/ours", into=_state(model, optim), strategy=s)
        set_state_dict(model, optim, model_state_dict=r.state["model"],
                       optim_state_dict=r.state["optim"])
        out[s] = _shards(_state(model, optim))
    # DCP's own checkpoint read into the live (FSDP2) targets by xla_ckpt's DCP reader
    model, optim = _build(seed=3)
    read_dcp_into(f"{root}/dcp", {f"model.{k}": v for k, v in get_model_state_dict(model).items()
                                  if isinstance(v, torch.Tensor)})
    out["dcp_into"] = _shards({"model": get_model_state_dict(model)})
    whole = xla_ckpt.load(f"{root}/ours")
    out["whole"] = {k: (tuple(v.shape), str(v.dtype)) for k, v in tensor_leaves(whole).items()}
    tdist.barrier()
    return out
