"""Functions the sharded-save tests run on every rank of a launcher pool (module level: importable).

Each rank joins the pool's gloo group (``env://``), builds the same small FSDP2 model on
``init_device_mesh("cpu", (world,))`` (CASES C17: a (10, 6) and a (3, 6) weight, shards
3,3,3,1 and 1,1,1,0 on 4 ranks) and saves it with :func:`xla_ckpt.restore.save_distributed`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import xla_ckpt
from xla_ckpt.comm import get_dist
from xla_ckpt.restore import save_distributed
from xla_ckpt.restore.owners import plan_chunked_save


class Net(nn.Module):
    """Weights (10, 6) and (3, 6): FSDP2 over 4 ranks shards them 3,3,3,1 and 1,1,1,0."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 10)
        self.l2 = nn.Linear(10, 3)
        self.register_buffer("seen", torch.tensor([3, -1, 2**40], dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


def _join() -> int:
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://")
    return dist.get_world_size()


def fsdp_state(seed: int = 0) -> dict[str, Any]:
    """The FSDP2 model's state dict (DTensor parameters, a plain int64 buffer)."""
    world = _join()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = Net()
    fully_shard(model.l1, mesh=mesh)
    fully_shard(model.l2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return dict(get_model_state_dict(model))


def _boxes_from_dtensor(state: dict[str, Any]) -> dict[str, tuple[tuple, tuple]]:
    """key -> (global offset, local shape) as DTensor itself gives them."""
    out = {}
    for k, v in state.items():
        if isinstance(v, DTensor):
            shape, off = compute_local_shape_and_global_offset(v.shape, v.device_mesh,
                                                               v.placements)
            out[f"state[{k!r}]"] = (tuple(int(o) for o in off), tuple(int(s) for s in shape))
    return out


def _local_bits(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {f"state[{k!r}]": (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in state.items()}


def plan_fsdp() -> dict[str, Any]:
    """Plan (no I/O) the FSDP2 state's save; what the plan and DTensor say."""
    state = fsdp_state()
    plan = plan_chunked_save(get_dist(), state)
    return {"specs": plan.specs, "assignment": plan.assignment,
            "owned": [tuple(t.shape) for t in plan.owned], "dtensor": _boxes_from_dtensor(state),
            "bytes_per_rank": plan.bytes_per_rank}


def save_fsdp(uri: str) -> dict[str, Any]:
    """Save the FSDP2 state with save_distributed; this rank's boxes and local values."""
    state = fsdp_state()
    m = save_distributed(state, uri, metadata={"step": 1},
                         rank_state={"rank": dist.get_rank()})
    return {"dtensor": _boxes_from_dtensor(state), "local": _local_bits(state),
            "version": m.version}


def plain_state(rank: int, *, differ_at: int | None = None) -> dict[str, Any]:
    """Eight plain tensors of 8..1 KiB (the same on every rank, unless ``differ_at``)."""
    state: dict[str, Any] = {}
    for i, kib in enumerate(range(8, 0, -1)):
        t = torch.arange(kib * 256, dtype=torch.float32) + i
        if differ_at is not None and i == 3 and rank == differ_at:
            t[7] += 1.0
        state[f"t{i}"] = t
    state["step"] = 7
    return state


def save_balanced(uri: str) -> dict[str, Any]:
    """A replicated plain state saved with balance_replicated=True; the plan's bytes per rank."""
    _join()
    d = get_dist()
    state = plain_state(d.rank)
    plan = plan_chunked_save(d, state)
    m = save_distributed(state, uri, balance_replicated=True)
    return {"bytes_per_rank": plan.bytes_per_rank, "assignment": plan.assignment,
            "version": m.version}


def _dtensor(full: torch.Tensor, placements: list) -> DTensor:
    """This rank's DTensor of ``full`` (rows divide by the world), without communication
    (``distribute_tensor`` scatters from rank 0: a collective the other ranks may not join)."""
    world = _join()
    mesh = init_device_mesh("cpu", (world,))
    rank = dist.get_rank()
    if isinstance(placements[0], Shard):
        n = full.shape[0] // world
        local = full[rank * n:(rank + 1) * n].clone()
    else:
        local = full.clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape,
                              stride=full.stride())


def save_disagreeing(uri: str, case: str) -> Any:
    """Rank 1 passes a different structure (``case``); returns nothing (every rank raises)."""
    _join()
    d = get_dist()
    if case == "extra_key":
        state = fsdp_state()
        if d.rank == 1:
            state["4.weight"] = torch.zeros(2, 2)
            state["4.bias"] = torch.zeros(2)
    elif case == "dtensor_alone":
        w = torch.arange(12.0).reshape(4, 3)
        state = {"w": _dtensor(w, [Shard(0)]) if d.rank == 1 else w, "b": w[0]}
    elif case == "placement":
        w = torch.arange(12.0).reshape(4, 3)
        state = {"w": _dtensor(w, [Replicate() if d.rank == 1 else Shard(0)])}
    elif case == "shape":
        state = plain_state(d.rank)
        if d.rank == 1:
            state["t2"] = state["t2"][:-1].clone()
        save_distributed(state, uri, balance_replicated=True)  # plain: agreement opted in
        return None
    elif case in ("plain_shape", "plain_extra_key"):
        # the plain path (rank 0 writes the state alone) compares the ranks' tensors too
        state = plain_state(d.rank)
        if d.rank == 1 and case == "plain_shape":
            state["t2"] = state["t2"][:-1].clone()
        elif d.rank == 1:
            state["extra"] = torch.zeros(2)
        save_distributed(state, uri)
        return None
    elif case == "shards_alone":
        state = plain_state(d.rank)
        shards = {"exp_avg": torch.zeros(5)} if d.rank == 1 else None
        save_distributed(state, uri, shards=shards)
        return None
    elif case == "replica":
        state = plain_state(d.rank, differ_at=2)
        save_distributed(state, uri, check_replicas=True)
        return None
    else:
        raise ValueError(case)
    save_distributed(state, uri)
    return None


def xla_ckpt_save_dtensor(uri: str) -> dict[str, Any]:
    """``xla_ckpt.save`` of a DTensor state on every rank (the default Dist)."""
    world = _join()
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(70.0).reshape(10, 7)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.arange(3),
             "lr": 0.5}
    m = xla_ckpt.save(state, uri, metadata={"step": 3})
    return {"version": m.version, "rank": dist.get_rank(), "pid": os.getpid()}


def xla_ckpt_save_dtensor_rank_states(uri: str, other: str) -> dict[str, Any]:
    """``xla_ckpt.save`` of a DTensor state with each rank's own ``rank_states`` entry (saved
    as its ``rank/<r>``), then with rank 1 passing every rank's entries (refused)."""
    world = _join()
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.arange(70.0).reshape(10, 7), mesh, [Shard(0)])}
    m = xla_ckpt.save(state, uri, rank_states={rank: {"pos": 10 + rank}})
    out: dict[str, Any] = {"items": sorted(m.items)}
    every = {r: {"pos": r} for r in range(world)} if rank == 1 else {rank: {"pos": rank}}
    out["other"] = _error(lambda: xla_ckpt.save(state, other, rank_states=every))
    return out


def xla_ckpt_save_dtensor_without_group(uri: str) -> str:
    """One process: a DTensor, then the process group destroyed; ``xla_ckpt.save`` refuses."""
    _join()
    mesh = init_device_mesh("cpu", (1,))
    state = {"model": {"w": distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])}}
    dist.destroy_process_group()
    try:
        xla_ckpt.save(state, uri)
    except Exception as e:  # noqa: BLE001 - the test checks the type and message
        return f"{type(e).__name__}: {e}"
    return "saved"


def plan_split(split_bytes: int) -> dict[str, Any]:
    """Plan the plain state with a small split threshold; the owned pieces' values."""
    _join()
    d = get_dist()
    plan = plan_chunked_save(d, plain_state(d.rank), split_bytes=split_bytes)
    return {"assignment": plan.assignment, "specs": plan.specs,
            "owned": [t.clone() for t in plan.owned]}


def save_2d(uri: str) -> dict[str, Any]:
    """Mesh (2, 2) = (dp, tp): ``w`` placed [Shard(0), Replicate()], ``v`` [Replicate(),
    Shard(1)] (each box held by two ranks), saved with save_distributed."""
    _join()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # every rank is in the mesh
    dp, tp = coordinate
    w = torch.arange(60.0).reshape(10, 6)
    v = torch.arange(35.0).reshape(5, 7)
    state = {
        "w": DTensor.from_local(torch.chunk(w, 2)[dp].clone(), mesh, [Shard(0), Replicate()],
                                run_check=False, shape=w.shape, stride=w.stride()),
        "v": DTensor.from_local(torch.chunk(v, 2, dim=1)[tp].contiguous(), mesh,
                                [Replicate(), Shard(1)], run_check=False, shape=v.shape,
                                stride=v.stride()),
    }
    plan = plan_chunked_save(get_dist(), state)
    save_distributed(state, uri)
    return {"assignment": plan.assignment, "bytes_per_rank": plan.bytes_per_rank,
            "specs": plan.specs}


def save_failing_on(uri: str, bad_rank: int) -> Any:
    """The FSDP2 save, with ``bad_rank``'s data file write failing midway (injected through
    the writer's progress hook, which storage calls as it is handed each piece)."""
    state = fsdp_state()
    rank = dist.get_rank()

    def progress(nbytes: int) -> None:
        if rank == bad_rank:
            raise OSError(f"disk full (injected on rank {rank})")

    save_distributed(state, uri, rank_state={"rank": rank}, progress=progress)


def _error(fn: Any) -> tuple[str, str, dict[int, str]] | None:
    """``(type name, message, failures)`` of what ``fn()`` raised; None if it returned."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test checks type, message and failures
        return type(e).__name__, str(e), dict(getattr(e, "failures", {}) or {})
    return None


def _small_dtensor_state() -> dict[str, Any]:
    """A (6, 4) weight sharded over the ranks, a plain buffer, a plain value."""
    w = torch.arange(24.0).reshape(6, 4)
    return {"w": _dtensor(w, [Shard(0)]), "b": torch.arange(3), "lr": 0.5}


def save_per_rank_uri(root: str, case: str) -> Any:
    """Every rank saves to its own folder ``<root>/u<rank>`` (a bug: one checkpoint, one
    folder): the sharded state (``xla_ckpt.save``), or a plain state with ``rank_state=``
    (``save_distributed``, manifest v1).  Returns what was raised."""
    _join()
    rank = dist.get_rank()
    uri = f"{root}/u{rank}"
    if case == "sharded":
        return _error(lambda: xla_ckpt.save(_small_dtensor_state(), uri))
    return _error(lambda: save_distributed({"w": torch.ones(3)}, uri,
                                           rank_state={"pos": rank}))


def save_node_local(root: str, case: str) -> Any:
    """Every rank passes the SAME uri, ``/proc/self/cwd/ckpt``, from its own working directory
    ``<root>/host<rank>``: one path string, a different folder per process -- what a
    node-local path (``/tmp/ckpt``, local NVMe) is on several hosts.  Returns what was raised
    and what each rank's folder holds afterwards."""
    _join()
    rank = dist.get_rank()
    here = os.path.join(root, f"host{rank}")
    os.makedirs(here, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(here)
    try:
        uri = "/proc/self/cwd/ckpt"
        if case == "sharded":
            err = _error(lambda: save_distributed(_small_dtensor_state(), uri,
                                                  rank_state={"pos": rank}))
        else:
            err = _error(lambda: save_distributed({"w": torch.ones(3)}, uri,
                                                  rank_state={"pos": rank}))
        dist.barrier()
    finally:
        os.chdir(cwd)
    folder = os.path.join(here, "ckpt")
    return err, sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def save_tied(uri: str) -> dict[str, Any]:
    """Tied tensors saved on every rank with ``xla_ckpt.save``: one DTensor object under
    "emb" and "head", its ``detach()`` (another DTensor over the same local tensor) under
    "head2"; a plain tensor "a" under "b" too, "c" = ``a.view(12)`` (same memory, another
    object) and "view" = ``a[4:8]`` (another shape: its own global tensor)."""
    _join()
    full = torch.arange(24.0).reshape(6, 4)
    t = _dtensor(full, [Shard(0)])
    a = torch.arange(12.0)
    state = {"emb": t, "head": t, "head2": t.detach(), "a": a, "b": a, "c": a.view(12),
             "view": a[4:8], "step": torch.tensor(3.0)}
    m = xla_ckpt.save(state, uri)
    return {"version": m.version, "local": t.to_local().clone()}


def restore_tied(uri: str) -> dict[str, Any]:
    """``restore(into=)`` of the tied checkpoint: one DTensor target under both tied keys, and
    separate plain targets for "a" and "b"; what every target holds afterwards."""
    from xla_ckpt.restore import restore

    _join()
    target = _dtensor(torch.zeros(6, 4), [Shard(0)])
    ta, tb = torch.zeros(12), torch.zeros(12)
    res = restore(uri, into={"emb": target, "head": target, "a": ta, "b": tb})
    return {"local": target.to_local().clone(), "a": ta, "b": tb,
            "same": res.state["emb"] is target and res.state["head"] is target}


def save_meta_differs(uri: str) -> Any:
    """Rank 0's non-tensor ``meta`` has an int key (typed-encoded as ``$dict``) and a key
    rank 1 lacks; rank 1's "step" value differs (values are rank 0's: not a difference)."""
    _join()
    rank = dist.get_rank()
    state = _small_dtensor_state()
    state["meta"] = {"step": 5, "name": "x", 3: "intkey"} if rank == 0 else {"step": 6}
    return _error(lambda: xla_ckpt.save(state, uri))


def save_values_differ(uri: str) -> dict[str, Any]:
    """Same structure, other non-tensor values on rank 1: saved, rank 0's values committed."""
    _join()
    rank = dist.get_rank()
    state = _small_dtensor_state()
    state["meta"] = {"step": 5 + rank, 3: ["x", rank]}
    m = xla_ckpt.save(state, uri)
    return {"version": m.version}
