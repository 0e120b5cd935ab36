"""Functions the sharded CheckpointManager tests run on every rank (launcher workers).

Each rank joins the pool's gloo group, builds the same small FSDP2 model on
``init_device_mesh("cpu", (world,))`` (rows 7 and 3: uneven shards 4,3 and 2,1 on 2 ranks,
an int64 buffer held whole by every rank) with AdamW, and saves or restores it through
:class:`xla_ckpt.manager.CheckpointManager`.  DCP (``dcp.save`` / ``dcp.load`` of the same
``get_state_dict`` state) is the reference for every restored shard.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import Any

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from xla_ckpt.storage.local import LocalStorage


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 7)
        self.l2 = nn.Linear(7, 3)
        self.register_buffer("seen", torch.tensor([3, -1, 2**40], dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


def _join() -> int:
    if not tdist.is_initialized():
        tdist.init_process_group("gloo", init_method="env://")
    return tdist.get_world_size()


def _dist() -> Any:
    from xla_ckpt.comm import DistConfig, get_dist

    _join()
    return get_dist(DistConfig(backend="gloo", timeout_s=60))


def fsdp_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    world = _join()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = Net()
    fully_shard(model.l1, mesh=mesh)
    fully_shard(model.l2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    """One update on an input that depends on the step and the rank only."""
    g = torch.Generator().manual_seed(1000 * step + tdist.get_rank())
    x = torch.randn(5, 6, generator=g)
    model(x).square().sum().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def state_of(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def shards(state: Any) -> dict[str, Any]:
    """key -> (global offsets, local tensor clone) of every tensor; other leaves as they are."""
    flat, _ = flatten_state_dict(state)
    out: dict[str, Any] = {}
    for k, v in flat.items():
        if isinstance(v, DTensor):
            _, off = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
            out[k] = (tuple(int(o) for o in off), v.to_local().detach().clone())
        elif isinstance(v, torch.Tensor):
            out[k] = ((0,) * v.dim(), v.detach().clone())
        else:
            out[k] = v
    return out


class HeldWrites(LocalStorage):
    """A real local storage whose data-file writes wait for ``release`` (a slow upload)."""

    release = threading.Event()
    started: list = []

    def write_atomic(self, name: str, buffers: Any, **kw: Any) -> Any:
        if name.startswith("data-"):
            self.started.append(name)
            self.release.wait(30)
        return super().write_atomic(name, buffers, **kw)


def _cfg(run_dir: str, **kw: Any) -> Any:
    from xla_ckpt.manager import CheckpointConfig

    kw.setdefault("handle_sigterm", False)
    kw.setdefault("save_interval_epochs", 0)
    return CheckpointConfig(save_dir=run_dir, **kw)


def save_run(run_dir: str, dcp_dir: str, hold: bool = True) -> dict[str, Any]:
    """2 ranks: one AdamW step, DCP's save of that state (the reference), then:

    * an async manager save of it (``checkpoint_1_1``) whose upload is held while the next
      step changes every parameter and moment in place (C20: the checkpoint must hold the
      values of the call);
    * that next step (the uninterrupted run's step 2) and a sync save of it
      (``checkpoint_1_2``).

    Returns this rank's shards at step 1 and 2, whether the upload was still held when
    save() returned, and the per-rank state saved.  ``hold=False`` (a ``gs://`` run folder):
    the real storage, uploads not held.
    """
    from xla_ckpt.manager import CheckpointManager

    dist = _dist()
    model, optim = fsdp_model(seed=0)
    train_step(model, optim, 1)
    state = state_of(model, optim)
    at_1 = shards(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=dcp_dir)
    HeldWrites.release.clear()
    HeldWrites.started.clear()
    run = HeldWrites(run_dir) if hold else None  # gs://: the real client, uploads not held
    mgr = CheckpointManager(_cfg(run_dir, async_save=True), dist=dist, storage=run)
    rank_state = {"rank": dist.rank, "position": 10 + dist.rank}
    mgr.save(lambda: state_of(model, optim), epoch=1, num_updates=1, rank_state=rank_state)
    held = mgr.in_flight
    train_step(model, optim, 2)  # changes the live shards while the upload waits
    HeldWrites.release.set()
    mgr.wait()
    at_2 = shards(state_of(model, optim))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state_of(model, optim), checkpoint_id=f"{dcp_dir}-2")
    mgr.save(lambda: state_of(model, optim), epoch=1, num_updates=2, rank_state=rank_state,
             block=True)
    mgr.close()
    if run is not None:
        run.close()
    tdist.barrier()
    return {"at_1": at_1, "at_2": at_2, "held": held, "rank_state": rank_state}


def restore_same_world(run_dir: str, dcp_dir: str) -> dict[str, Any]:
    """2 ranks: restore step 1 into a fresh FSDP2 model + AdamW with ``restore(step=1,
    into=...)``, DCP's ``dcp.load`` of its own save into another fresh one, then the next step
    from ours; and ``restore_or_initialize(into=...)`` of the latest (step 2).

    Returns shards of ours (step 1), DCP's (step 1), after our next step, of the latest and
    DCP's restore of step 2, the rank states and the restore figures.
    """
    from xla_ckpt.manager import CheckpointManager

    dist = _dist()
    model, optim = fsdp_model(seed=1)
    target = state_of(model, optim)
    with CheckpointManager(_cfg(run_dir), dist=dist) as mgr:
        r1 = mgr.restore(step=1, into=target)
        set_state_dict(model, optim, model_state_dict=r1.state["model"],
                       optim_state_dict=r1.state["optim"])
        ours = shards(state_of(model, optim))
        same_objects = all(r1.state["model"][k] is target["model"][k] for k in target["model"])
        train_step(model, optim, 2)
        next_step = shards(state_of(model, optim))

        ref_model, ref_optim = fsdp_model(seed=2)
        ref = state_of(ref_model, ref_optim)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(ref, checkpoint_id=dcp_dir)
        theirs = shards(ref)

        m3, o3 = fsdp_model(seed=3)
        t3 = state_of(m3, o3)
        latest = mgr.restore_or_initialize(into=t3)
        assert latest is not None
        set_state_dict(m3, o3, model_state_dict=latest.state["model"],
                       optim_state_dict=latest.state["optim"])
        at_latest = shards(state_of(m3, o3))

        m4, o4 = fsdp_model(seed=7)
        ref2 = state_of(m4, o4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(ref2, checkpoint_id=f"{dcp_dir}-2")
        theirs_latest = shards(ref2)
    tdist.barrier()
    return {"ours": ours, "theirs": theirs, "next_step": next_step, "latest": at_latest,
            "theirs_latest": theirs_latest,
            "latest_name": latest.checkpoint, "rank_state_1": r1.rank_state,
            "rank_state_latest": latest.rank_state, "same_objects": same_objects,
            "bytes_read": r1.restored.stats.bytes_read if r1.restored else -1}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def restore_resized(run_dir: str, dcp_dir: str) -> dict[str, Any]:
    """Another world size than the 2 saving ranks: the per-rank item rule.

    1. default: the error (its type and message);
    2. ``rank_state_on_resize="drop"``: restored without rank state, with the WARNING lines;
    3. ``rank_state_remap``: the hook's answer as rank_state (it gets every saved rank's);
    and DCP's own ``dcp.load`` onto this mesh for comparison with 2.
    """
    from xla_ckpt.manager import CheckpointManager
    from xla_ckpt.restore import RestoreConfig

    dist = _dist()
    out: dict[str, Any] = {}
    model, optim = fsdp_model(seed=4)
    with CheckpointManager(_cfg(run_dir), dist=dist) as mgr:
        try:
            mgr.restore(step=1, into=state_of(model, optim))
            out["default"] = None
        except Exception as e:  # noqa: BLE001 - the test asserts type and message
            out["default"] = (type(e).__name__, str(e))
    records = _Records()
    logging.getLogger("xla_ckpt").addHandler(records)
    try:
        with CheckpointManager(_cfg(run_dir), dist=dist,
                               restore_config=RestoreConfig(rank_state_on_resize="drop")) as mgr:
            dropped = mgr.restore(step=1, into=state_of(model, optim))
    finally:
        logging.getLogger("xla_ckpt").removeHandler(records)
    set_state_dict(model, optim, model_state_dict=dropped.state["model"],
                   optim_state_dict=dropped.state["optim"])
    out["dropped"] = shards(state_of(model, optim))
    out["dropped_rank_state"] = dropped.rank_state
    out["warnings"] = records.lines

    seen: dict[str, Any] = {}

    def remap(saved: dict[int, Any], rank: int, world_size: int) -> Any:
        seen["saved"] = saved
        return {"rank": rank, "position": sum(s["position"] for s in saved.values()),
                "world_size": world_size}

    m2, o2 = fsdp_model(seed=5)
    with CheckpointManager(_cfg(run_dir), dist=dist) as mgr:
        remapped = mgr.restore_or_initialize(into=state_of(m2, o2), rank_state_remap=remap)
    assert remapped is not None
    out["remapped_rank_state"] = remapped.rank_state
    out["remap_saw"] = seen.get("saved")

    ref_model, ref_optim = fsdp_model(seed=6)
    ref = state_of(ref_model, ref_optim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(ref, checkpoint_id=dcp_dir)
    out["theirs"] = shards(ref)
    tdist.barrier()
    return out


def save_disagreeing(run_dir: str) -> dict[str, Any]:
    """2 ranks holding different state save through one manager: every case must raise on
    every rank before anything is written.  Returns ``case -> (error type, message)``."""
    from xla_ckpt.manager import CheckpointManager

    dist = _dist()
    world = dist.world_size
    rank = dist.rank
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)]
    if rank == 1:
        layers += [nn.ReLU(), nn.Linear(2, 2)]  # keys 4.weight, 4.bias only rank 1 has
    plain = nn.Sequential(*layers)
    w = torch.arange(12, dtype=torch.float32).reshape(6, 2)

    def sharded_w() -> DTensor:  # no communication (distribute_tensor is a collective)
        return DTensor.from_local(w[3 * rank:3 * rank + 3].clone(), mesh, [Shard(0)],
                                  run_check=False, shape=w.shape, stride=w.stride())

    cases = {
        "plain_extra_keys": lambda: {"model": plain.state_dict()},
        "sharded_vs_plain": lambda: {"w": sharded_w() if rank == 1 else w},
        "sharded_extra_key": lambda: dict({"w": sharded_w()},
                                          **({"extra": torch.ones(2)} if rank == 1 else {})),
    }
    out: dict[str, Any] = {}
    with CheckpointManager(_cfg(run_dir), dist=dist) as mgr:
        for n, (case, state) in enumerate(cases.items(), start=1):
            try:
                mgr.save(state, epoch=1, num_updates=n)
                out[case] = None
            except Exception as e:  # noqa: BLE001 - the test asserts type and message
                out[case] = (type(e).__name__, str(e))
        try:
            mgr.save({"step": 9}, epoch=1, num_updates=9,
                     shards={"exp_avg": torch.ones(3)} if rank == 1 else None)
            out["shards_on_one_rank"] = None
        except Exception as e:  # noqa: BLE001 - as above
            out["shards_on_one_rank"] = (type(e).__name__, str(e))
        # The manager still saves what the ranks agree on.
        mgr.save({"w": sharded_w()}, epoch=1, num_updates=10)
    tdist.barrier()
    return out


def _caught(fn: Any) -> tuple[str, str, dict[int, str]] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts type, message and failures
        return type(e).__name__, str(e), dict(getattr(e, "failures", {}) or {})
    return None


def _sharded_w(rank: int) -> DTensor:
    """A (6, 2) weight, rows 3 and 3 on 2 ranks, without communication."""
    mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
    w = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    return DTensor.from_local(w[3 * rank:3 * rank + 3].clone(), mesh, [Shard(0)],
                              run_check=False, shape=w.shape, stride=w.stride())


def save_per_rank_run(root: str) -> Any:
    """Each rank's manager has its own run folder ``<root>/run<rank>`` (a bug): the sharded
    save is refused on every rank before anything is written."""
    from xla_ckpt.manager import CheckpointManager

    dist = _dist()
    with CheckpointManager(_cfg(f"{root}/run{dist.rank}"), dist=dist) as mgr:
        return _caught(lambda: mgr.save({"w": _sharded_w(dist.rank)}, epoch=1, num_updates=1))


def save_node_local_run(root: str) -> Any:
    """One run folder string, ``/proc/self/cwd/run``, every rank in the same working directory
    ``<root>/shared`` for the first save (committed), then rank 1 in ``<root>/host1`` (its own
    "node-local" disk) for the second: that save must fail on every rank and commit nothing,
    and retention (keep 1) must not delete the first checkpoint.  Returns what the second save
    raised."""
    from xla_ckpt.manager import CheckpointManager

    dist = _dist()
    shared, own = f"{root}/shared", f"{root}/host{dist.rank}"
    os.makedirs(shared, exist_ok=True)
    os.makedirs(own, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(shared)
    try:
        with CheckpointManager(_cfg("/proc/self/cwd/run", keep_interval_updates=1),
                               dist=dist) as mgr:
            mgr.save({"w": _sharded_w(dist.rank)}, epoch=1, num_updates=1, block=True)
            if dist.rank == 1:
                os.chdir(own)
            tdist.barrier()
            err = _caught(lambda: mgr.save({"w": _sharded_w(dist.rank) * 2}, epoch=1,
                                           num_updates=2, block=True))
            os.chdir(shared)
            tdist.barrier()
    finally:
        os.chdir(cwd)
    return err
