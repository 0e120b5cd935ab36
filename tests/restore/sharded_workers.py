"""Functions the sharded-restore tests run on every rank of a launcher pool (module level).

Each rank joins the pool's gloo group (``env://``) and builds the same small model, wrapped
as the case needs:

* ``fsdp``: FSDP2 (``fully_shard``) on ``init_device_mesh("cpu", (world,))``;
* ``2d``: tensor parallel (``parallelize_module``: Colwise ``l1``, Rowwise ``l2``; ``l3``
  replicated over ``tp``) on the ``tp`` dim of a ``(2, world // 2)`` mesh, then
  ``fully_shard`` on ``dp``;
* ``ddp``: plain replicated modules (the same on every rank; what a DDP job saves).

Row counts 10, 7 and 3 divide by neither 4 nor 3 (FSDP2 shards 3,3,3,1 / 2,2,2,1 / 1,1,1,0
on 4 ranks: an empty shard; 4,4,2 / 3,3,1 / 1,1,1 on 3).  DCP is the reference: the same
state is saved with ``dcp.save`` and loaded with ``dcp.load`` onto the new mesh; tests
compare local shards and their global offsets bitwise, never ``full_tensor()`` (wrong for
uneven ``_StridedShard`` in torch 2.9).
"""

from __future__ import annotations

import logging
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
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from xla_ckpt.io.chunked import plan_box_reads
from xla_ckpt.io.manifest_file import read_manifest
from xla_ckpt.restore import RestoreConfig, restore, save_distributed
from xla_ckpt.restore.targets import plan_rank_requests, saved_tensors, tensor_leaves
from xla_ckpt.storage import open_storage
from xla_ckpt.testing.asserts import tensor_bits

IN_FEATURES = 8192
#: crc32c chunk size of the saves: small, so partial (row-range) reads are checked and cheap.
CHUNK_SIZE_BYTES = 4096


class Net(nn.Module):
    """Rows 10, 7 and 3: uneven shards everywhere, and an empty one (3 rows on 4 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(IN_FEATURES, 10)
        self.l2 = nn.Linear(10, 7)
        self.l3 = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


def _join() -> int:
    if not tdist.is_initialized():
        tdist.init_process_group("gloo", init_method="env://")
    return tdist.get_world_size()


def build(kind: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model of ``kind`` (see the module docstring) and its AdamW, weights from ``seed``."""
    world = _join()
    torch.manual_seed(seed)
    model = Net()
    if kind == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model.l1, mesh=mesh)
        fully_shard(model.l2, mesh=mesh)
        fully_shard(model.l3, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "2d":
        mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh2["tp"], {"l1": ColwiseParallel(),
                                                "l2": RowwiseParallel()})
        fully_shard(model.l1, mesh=mesh2["dp"])
        fully_shard(model.l2, mesh=mesh2["dp"])
        fully_shard(model.l3, mesh=mesh2["dp"])  # not tensor parallel: replicated over tp
        fully_shard(model, mesh=mesh2["dp"])
    elif kind != "ddp":
        raise ValueError(kind)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, IN_FEATURES, generator=g)
    model(x).square().sum().backward()
    optim.step()
    optim.zero_grad()


def state_of(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` from ``torch.distributed.checkpoint.state_dict``."""
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}


def local_shards(tree: Any) -> dict[str, Any]:
    """Key path -> (global offsets, local shape, dtype, local bytes) of every tensor leaf."""
    out: dict[str, Any] = {}
    for key, v in tensor_leaves(tree).items():
        if isinstance(v, DTensor):
            shape, off = compute_local_shape_and_global_offset(v.shape, v.device_mesh,
                                                               v.placements)
            loc = v.to_local()
            assert tuple(loc.shape) == tuple(shape), key
            out[key] = (tuple(int(o) for o in off), tuple(loc.shape), str(loc.dtype),
                        bytes(tensor_bits(loc).numpy()))
        else:
            out[key] = ((0,) * v.dim(), tuple(v.shape), str(v.dtype),
                        bytes(tensor_bits(v).numpy()))
    return out


def param_shards(model: nn.Module) -> dict[str, Any]:
    return local_shards({n: p for n, p in model.named_parameters()})


def _data_seed(kind: str, step: int) -> int:
    # a DDP job's replicas see the same (all-reduced) update: the same data on every rank
    return 100 * step + (0 if kind == "ddp" else tdist.get_rank())


def save_case(root: str, kind: str, *, rank_state: bool = False) -> dict[str, Any]:
    """Build ``kind``, one AdamW step, save with xla_ckpt (``{root}/ours_{kind}``) and with
    DCP (``{root}/dcp_{kind}``), then one more step: the uninterrupted reference.

    Returns this rank's local shards of the saved state, and its parameter shards after
    the second step."""
    model, optim = build(kind, seed=0)
    train_step(model, optim, _data_seed(kind, 1))
    state = state_of(model, optim)
    rs = {"iterator": {"epoch": 1, "offset": 10 * tdist.get_rank()},
          "rng": torch.tensor([tdist.get_rank()], dtype=torch.int64)} if rank_state else None
    save_distributed(state, f"{root}/ours_{kind}", rank_state=rs,
                     chunk_size_bytes=CHUNK_SIZE_BYTES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=f"{root}/dcp_{kind}")
    saved = local_shards(state)
    train_step(model, optim, _data_seed(kind, 2))
    tdist.barrier()
    return {"saved": saved, "after_step2": param_shards(model)}


def _dcp_reference(root: str, saved_kind: str, target_kind: str) -> dict[str, Any]:
    model, optim = build(target_kind, seed=2)
    state = state_of(model, optim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=f"{root}/dcp_{saved_kind}")
    set_state_dict(model, optim, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return local_shards(state_of(model, optim))


def _ours(root: str, saved_kind: str, target_kind: str, strategy: str,
          resume_kind: str | None = None, whole: bool = False, ours_root: str | None = None,
          **kw: Any) -> dict[str, Any]:
    model, optim = build(target_kind, seed=1)
    into = state_of(model, optim)
    uri = f"{ours_root or root}/ours_{saved_kind}"
    saved = saved_tensors(read_manifest(open_storage(uri)), "state")
    planned = sum(rd.length for rd in plan_box_reads(
        saved.manifest, plan_rank_requests(saved, into).requests))
    r = restore(uri, into=into, strategy=strategy, **kw)
    set_state_dict(model, optim, model_state_dict=r.state["model"],
                   optim_state_dict=r.state["optim"])
    out = {"shards": local_shards(state_of(model, optim)), "into": local_shards(into),
           "bytes_read": r.stats.bytes_read, "shard_bytes": r.stats.shard_bytes,
           "planned_bytes": planned,
           "received": r.stats.bytes_received, "strategy": r.strategy, "reason": r.reason,
           "rank_state": r.rank_state,
           "param_groups": [{k: v for k, v in g.items() if k != "params"}
                            for g in r.state["optim"]["param_groups"]]}
    if resume_kind is not None:
        train_step(model, optim, _data_seed(resume_kind, 2))
        out["after_step2"] = param_shards(model)
    if whole:  # without into=: every tensor whole; this rank's shards are slices of it
        w = tensor_leaves(restore(uri, strategy=strategy, **kw).state)
        out["whole_differs"] = []
        for k, (off, shape, _, bits) in out["into"].items():
            part = w[k][tuple(slice(o, o + n) for o, n in zip(off, shape, strict=True))]
            if bytes(tensor_bits(part).numpy()) != bits:
                out["whole_differs"].append(k)
    return out


def restore_cases(root: str, cases: list[tuple[str, str]], *, resume: bool = False,
                  strategies: tuple[str, ...] = ("all_ranks", "broadcast"),
                  whole: bool = False, ours_root: str | None = None,
                  **kw: Any) -> dict[str, Any]:
    """For each ``(saved kind, target kind)``: restore into fresh targets with each strategy
    (then ``set_state_dict``) and ``dcp.load`` the DCP save of the same state onto the same
    targets.  ``resume``: also one more step after our restore (same world size).
    ``whole``: also restore without ``into`` and compare this rank's shards with the slices
    of the whole tensors.  ``ours_root``: where our checkpoints are, when not beside DCP's
    (a ``gs://`` prefix).  ``kw`` go to ``restore``."""
    out: dict[str, Any] = {}
    for saved_kind, target_kind in cases:
        case: dict[str, Any] = {"dcp": _dcp_reference(root, saved_kind, target_kind)}
        for s in strategies:
            case[s] = _ours(root, saved_kind, target_kind, s,
                            resume_kind=saved_kind if resume else None, whole=whole,
                            ours_root=ours_root, **kw)
        out[f"{saved_kind}->{target_kind}"] = case
    tdist.barrier()
    return out


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def rank_item_cases(root: str, kind: str = "fsdp") -> dict[str, Any]:
    """A checkpoint saved by 2 ranks with per-rank items, restored here (3 ranks):
    the default error, ``rank_state_on_resize="drop"`` (and its warning), a remap hook
    (both strategies), and ``rank_item=False``."""
    uri = f"{root}/ours_{kind}"
    out: dict[str, Any] = {}
    model, optim = build("fsdp", seed=1)
    try:
        restore(uri, into=state_of(model, optim))
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - the test checks type and text
        out["error"] = (type(e).__name__, str(e))
    cap = _Capture()
    logging.getLogger("xla_ckpt").addHandler(cap)
    try:
        r = restore(uri, into=state_of(model, optim),
                    config=RestoreConfig(rank_state_on_resize="drop"))
    finally:
        logging.getLogger("xla_ckpt").removeHandler(cap)
    out["drop"] = {"rank_state": r.rank_state, "warnings": cap.lines}
    calls: list[Any] = []

    def remap(saved: dict[int, Any], rank: int, world_size: int) -> Any:
        calls.append((sorted(saved), rank, world_size))
        src = saved[rank % len(saved)]
        return {"iterator": dict(src["iterator"], remapped_from=rank % len(saved)),
                "rng": src["rng"].tolist()}

    for s in ("all_ranks", "broadcast"):
        r = restore(uri, into=state_of(model, optim), rank_state_remap=remap, strategy=s)
        out[f"remap_{s}"] = r.rank_state
    out["remap_calls"] = calls
    r = restore(uri, into=state_of(model, optim), rank_item=False)
    out["rank_item_false"] = r.rank_state
    tdist.barrier()
    return out


def same_size_rank_item(root: str) -> Any:
    """Saved by this many ranks: each rank gets its own per-rank item back."""
    model, optim = build("fsdp", seed=1)
    r = restore(f"{root}/ours_fsdp", into=state_of(model, optim))
    return {"iterator": r.rank_state["iterator"], "rng": r.rank_state["rng"].tolist()}


def _errors(e: BaseException) -> tuple[str, str, dict[int, str]]:
    return type(e).__name__, str(e), dict(getattr(e, "failures", {}) or {})


def _overwritten(name: str, uri: str, into: Any, out: dict[str, Any], **kw: Any) -> None:
    """``out[name]``: the error of ``restore(uri, into=into)`` (class names of its MRO, text,
    failures, ``overwritten``, ``keys``) and this rank's target keys whose values changed."""
    before = local_shards(into)
    try:
        restore(uri, into=into, **kw)
        out[name] = None
        return
    except Exception as e:  # noqa: BLE001 - the test checks type, text and failures
        err = e
    after = local_shards(into)
    out[name] = {"mro": [c.__name__ for c in type(err).__mro__], "text": str(err),
                 "failures": dict(getattr(err, "failures", {}) or {}),
                 "overwritten": dict(getattr(err, "overwritten", {}) or {}),
                 "keys": sorted(getattr(err, "keys", ()) or ()),
                 "changed": sorted(k for k in before if before[k] != after[k])}


def _staged_like(tree: Any) -> Any:
    """Plain CPU targets of the global shapes and dtypes of ``tree``'s tensors that are not
    contiguous (so a restore stages them and copies only at the end), filled with 7."""
    def one(v: torch.Tensor) -> torch.Tensor:
        t = torch.full((*v.shape, 2), 7, dtype=v.dtype)[..., 0]
        assert v.dim() == 0 or not t.is_contiguous()
        return t
    return {k: one(v) if isinstance(v, torch.Tensor) else v for k, v in tree.items()}


def overwrite_cases(corrupt_uri: str) -> dict[str, Any]:
    """A chunk with a flipped byte, read into live targets, both strategies: the error on
    every rank says whose targets were overwritten; then the same into non-contiguous
    (staged) model targets only: nothing is overwritten anywhere (a plain DistributedError,
    targets unchanged)."""
    model, optim = build("fsdp", seed=1)
    out: dict[str, Any] = {}
    for s in ("all_ranks", "broadcast"):
        _overwritten(s, corrupt_uri, state_of(model, optim), out, strategy=s)
        staged = {"model": _staged_like(get_model_state_dict(model))}
        _overwritten(f"staged_{s}", corrupt_uri, staged, out, strategy=s)
    tdist.barrier()
    return out


def failure_cases(root: str, corrupt_uri: str) -> dict[str, Any]:
    """Failures reach every rank: a key only rank 1's targets have, a target of another
    shape (every rank), ``into`` on rank 0 only, and a corrupt chunk only rank 1 reads
    (both strategies)."""
    model, optim = build("fsdp", seed=1)
    out: dict[str, Any] = {}

    def attempt(name: str, uri: str, into: Any, **kw: Any) -> None:
        try:
            restore(uri, into=into, **kw)
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the test checks type, text and failures
            out[name] = _errors(e)

    extra = state_of(model, optim)
    if tdist.get_rank() == 1:
        extra["model"]["extra.weight"] = torch.zeros(3)
    attempt("extra_key", f"{root}/ours_ddp", extra)
    shape = state_of(model, optim)
    shape["model"]["l2.bias"] = torch.zeros(8)
    attempt("shape", f"{root}/ours_ddp", shape)
    odd = state_of(model, optim)
    if tdist.get_rank() == 1:
        odd["model"]["hook"] = object()  # a value no checkpoint holds
    attempt("unsupported_on_rank1", f"{root}/ours_ddp", odd)
    attempt("into_on_rank0_only", f"{root}/ours_ddp",
            state_of(model, optim) if tdist.get_rank() == 0 else None)
    for s in ("all_ranks", "broadcast"):
        _overwritten(f"corrupt_{s}", corrupt_uri, state_of(model, optim), out, strategy=s)
    tdist.barrier()
    return out
