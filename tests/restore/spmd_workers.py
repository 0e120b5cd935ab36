"""Functions the torch_xla SPMD tests run in launcher workers (module level: importable).

Each worker process is one SPMD program over ``CPU_NUM_DEVICES`` XLA CPU devices
(``PJRT_DEVICE=CPU``; the pool is started with ``xla=False`` so that nothing touches XLA
before :func:`_spmd` calls ``xr.use_spmd()``).  Multi-host emulation: a 2-rank gloo pool
whose ranks each run the same program over 4 devices, rank ``r`` owning devices
``[2r, 2r + 2)`` (:func:`owned_devices`).

The saved values are :func:`global_values` (CPU, deterministic); every worker returns CPU
copies so the test compares them bitwise in the parent.
"""

from __future__ import annotations

from typing import Any

import torch

SHAPES: dict[str, tuple[int, ...]] = {"uneven": (10, 6), "tiled": (6, 10), "replicated": (3, 5),
                                      "dp_rep": (8, 4), "exp_avg": (10, 6),
                                      "exp_avg_sq": (10, 6), "step_t": (), "param": (5, 9),
                                      "mask": (7, 3), "empty": (0, 4)}
DTYPES: dict[str, torch.dtype] = {"exp_avg_sq": torch.bfloat16, "step_t": torch.int64,
                                  "mask": torch.bool}

#: The layouts of the save (4 devices): key -> (mesh name, partition spec).
#: ``mesh1`` is ``(4,)`` with axis ``"x"``; ``mesh2`` is ``(2, 2)`` with axes ``("dp", "tp")``
#: over devices ``[[0, 1], [2, 3]]``.  ``param`` is the weight of an ``nn.Linear(9, 5)``
#: annotated in place, taken from the module's ``state_dict()`` (a plain XLA tensor).
SAVE_LAYOUT: dict[str, tuple[str, tuple]] = {
    "uneven": ("mesh1", ("x", None)),          # (10, 6): rows 3, 3, 3, 1
    "tiled": ("mesh2", ("dp", "tp")),           # (6, 10): 2x2 tiles of 3x5
    "replicated": ("mesh2", (None, None)),      # (3, 5): one whole box
    "dp_rep": ("mesh2", ("dp", None)),          # (8, 4): sharded on dp, replicated on tp (C18)
    "exp_avg": ("mesh1", ("x", None)),          # (10, 6)
    "exp_avg_sq": ("mesh2", (None, "tp")),      # (10, 6) bf16: columns 3, 3, replicated on dp
    "step_t": ("mesh1", ()),                    # 0-d int64 (an AdamW step): replicated
    "param": ("mesh1", (None, "x")),            # (5, 9): columns 3, 3, 3, 0
    "mask": ("mesh1", ("x", None)),             # (7, 3) bool: rows 2, 2, 2, 1
    "empty": ("mesh1", ("x", None)),            # (0, 4): no element, no chunk
}

#: Other layouts to restore into, by device count (``mesh1`` = all devices on ``"x"``).
RESTORE_LAYOUT: dict[int, dict[str, tuple[str, tuple]]] = {
    4: {"uneven": ("mesh1", (None, "x")),       # columns 2, 2, 2, 0 (an empty device shard)
        "tiled": ("mesh2", ("tp", "dp")),
        "replicated": ("mesh1", ("x", None)),
        "dp_rep": ("mesh2", (None, "dp")),
        "exp_avg": ("mesh2", ("tp", None)),
        "exp_avg_sq": ("mesh1", ("x", None)),
        "step_t": ("mesh1", ()),
        "param": ("mesh1", ("x", None)),
        "mask": ("mesh1", (None, "x")),         # columns 1, 1, 1, 0
        "empty": ("mesh1", (None, "x"))},
    2: {"uneven": ("mesh1", (None, "x")),
        "tiled": ("mesh1", ("x", None)),
        "replicated": ("mesh1", ("x", None)),   # rows 2, 1
        "dp_rep": ("mesh1", (None, "x")),
        "exp_avg": ("mesh1", ("x", None)),
        "exp_avg_sq": ("mesh1", (None, None)),
        "step_t": ("mesh1", ()),
        "param": ("mesh1", (None, "x")),
        "mask": ("mesh1", ("x", None)),         # rows 4, 3
        "empty": ("mesh1", (None, "x"))},
    1: {k: ("mesh1", tuple("x" if d == 0 else None for d in range(len(shape))))
        for k, shape in SHAPES.items()},
}

#: Where each leaf sits in the saved tree.
PATHS: dict[str, tuple[str, ...]] = {
    "uneven": ("model", "uneven"), "tiled": ("model", "tiled"),
    "replicated": ("model", "replicated"), "dp_rep": ("model", "dp_rep"),
    "param": ("model", "param"),
    "exp_avg": ("optim", "state", "0", "exp_avg"),
    "exp_avg_sq": ("optim", "state", "0", "exp_avg_sq"),
    "step_t": ("optim", "state", "0", "step_t"),
    "mask": ("model", "mask"), "empty": ("model", "empty"),
}

#: Non-tensor state saved alongside (what an optimizer's state dict holds).
STEP = 7
PARAM_GROUPS = [{"lr": 0.01, "betas": [0.9, 0.999], "params": [0]}]


def global_values() -> dict[str, torch.Tensor]:
    """The global (unsharded) value of every saved leaf, on CPU."""
    g = torch.Generator().manual_seed(1234)
    out = {}
    for k, shape in SHAPES.items():
        out[k] = torch.randn(shape, generator=g).to(DTYPES.get(k, torch.float32))
    out["step_t"] = torch.tensor(STEP * 1000 + 3, dtype=torch.int64)
    out["mask"] = torch.randn(SHAPES["mask"], generator=g) > 0
    return out


def owned_devices(rank: int, per_rank: int = 2) -> list[int]:
    """Devices rank ``rank`` owns in the multi-host emulation: ``[r*k, (r+1)*k)``."""
    return list(range(rank * per_rank, (rank + 1) * per_rank))


# ---- inside a worker ---------------------------------------------------------------------------

def _spmd() -> dict[str, Any]:
    """Turn SPMD on (before the first XLA tensor) and build the meshes of this process."""
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    n = xr.global_runtime_device_count()
    meshes = {"mesh1": xs.Mesh(np.arange(n), (n,), ("x",))}
    if n == 4:
        meshes["mesh2"] = xs.Mesh(np.arange(n), (2, 2), ("dp", "tp"))
    return meshes


#: The module whose weight is the ``param`` leaf of the latest :func:`_leaves` call.
_MODULE: list[torch.nn.Linear] = []


def _place(key: str, value: torch.Tensor, meshes: dict[str, Any],
           layout: tuple[str, tuple]) -> Any:
    """``value`` on the XLA devices with ``layout``, as the XLAShardedTensor ``mark_sharding``
    returns; for ``param``, an ``nn.Linear(9, 5)`` weight annotated in place and taken from
    the module's ``state_dict()`` (a plain XLA tensor aliasing the parameter)."""
    import torch_xla.distributed.spmd as xs

    mesh, spec = layout
    if key == "param":
        module = torch.nn.Linear(9, 5, bias=False)
        with torch.no_grad():
            module.weight.copy_(value)
        module = module.to("xla")
        xs.mark_sharding(module.weight, meshes[mesh], spec)
        _MODULE[:] = [module]
        return module.state_dict()["weight"]
    return xs.mark_sharding(value.to("xla"), meshes[mesh], spec)


def _leaves(values: dict[str, torch.Tensor], meshes: dict[str, Any],
            layouts: dict[str, tuple[str, tuple]]) -> dict[str, Any]:
    """The state tree of ``values`` placed with ``layouts``."""
    return _tree({k: _place(k, values[k], meshes, layouts[k]) for k in SHAPES})


def _tree(leaves: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for k, v in leaves.items():
        node = tree
        *head, last = PATHS[k]
        for p in head:
            node = node.setdefault(p, {})
        node[last] = v
    tree["optim"]["state"]["0"]["step"] = STEP
    tree["optim"]["param_groups"] = PARAM_GROUPS
    return tree


def _leaf(tree: Any, key: str) -> Any:
    for p in PATHS[key]:
        tree = tree[p]
    return tree


def _shard_report(value: Any) -> list[tuple[Any, bool]]:
    """Per addressable device: (indices as (start, stop) pairs, CPU shard == global box)."""
    import torch_xla.distributed.spmd as xs

    x = xs.wrap_if_sharded(value) if not isinstance(value, xs.XLAShardedTensor) else value
    full = x.global_tensor.cpu()
    out: list[tuple[Any, bool]] = []
    for s in x.local_shards:
        if s.indices is Ellipsis:
            out.append(("all", torch.equal(s.data, full)))
        else:
            idx = tuple(s.indices)
            out.append(([(i.start, i.stop) for i in idx], torch.equal(s.unpadded_data, full[idx])))
    return out


def _spec(value: Any) -> str:
    import torch_xla

    inner = getattr(value, "global_tensor", value)
    return str(torch_xla._XLAC._get_xla_sharding_spec(inner))


def _targets(meshes: dict[str, Any], layouts: dict[str, tuple[str, tuple]],
             fill: float = -1.0) -> dict[str, Any]:
    """Restore targets: every leaf filled with ``fill``, placed with ``layouts``."""
    return _leaves({k: torch.full(SHAPES[k], fill, dtype=DTYPES.get(k, torch.float32))
                    for k in SHAPES}, meshes, layouts)


def _restore(path: str, into: Any, **kwargs: Any) -> dict[str, Any]:
    """``restore(path, into=into, **kwargs)``, then the CPU values, specs (before and after)
    and device-shard checks of the targets."""
    from xla_ckpt.restore import restore

    specs_before = {k: _spec(_leaf(into, k)) for k in SHAPES}
    restored = restore(path, into=into, **kwargs)
    report = _report(restored.state, into)
    report["target_specs"] = specs_before
    return report


def _report(restored_state: Any, into: Any) -> dict[str, Any]:
    """CPU values, specs and device-shard checks of the restored targets."""
    report: dict[str, Any] = {"values": {}, "specs": {}, "shards": {}, "same_object": {}}
    for k in SHAPES:
        live = _leaf(into, k)
        report["values"][k] = getattr(live, "global_tensor", live).cpu()
        report["specs"][k] = _spec(live)
        report["shards"][k] = _shard_report(live)
        report["same_object"][k] = _leaf(restored_state, k) is live
    report["module_weight"] = _MODULE[0].weight.detach().cpu()
    report["step"] = restored_state["optim"]["state"]["0"]["step"]
    report["param_groups"] = restored_state["optim"]["param_groups"]
    return report


def describe_boxes(meshes: dict[str, Any]) -> dict[str, Any]:
    """4 devices, no storage: the boxes for_save / for_restore give, and their values."""
    from xla_ckpt.sharded import spmd

    values = global_values()
    out: dict[str, Any] = {"save": {}, "save_owned": {}, "restore_owned": {}, "placement": {},
                           "values_ok": {}, "replicated": {}}
    for k, layout in SAVE_LAYOUT.items():
        live = _place(k, values[k], meshes, layout)
        sv = spmd.for_save(live)
        out["save"][k] = [(s.box.offsets, s.box.sizes) for s in sv.shards]
        out["placement"][k] = sv.placement
        out["replicated"][k] = sv.replicated
        out["values_ok"][k] = all(torch.equal(s.tensor, values[k][s.box.slices()])
                                  and s.tensor.is_contiguous() and s.tensor.device.type == "cpu"
                                  for s in sv.shards)
        with spmd.owning_devices([2, 3]):
            owned = spmd.for_save(live)
        out["save_owned"][k] = [(s.box.offsets, s.box.sizes) for s in owned.shards]
        target = _place(k, torch.zeros(SHAPES[k], dtype=values[k].dtype), meshes, layout)
        rv = spmd.for_restore(target, owned_devices=[0, 1])
        out["restore_owned"][k] = [(s.box.offsets, s.box.sizes) for s in rv.shards]
    # A value still pending in the lazy graph: materialised first, so its boxes are those of
    # the computed value (without the sync, local_shards reports whole-tensor indices).
    import torch_xla.distributed.spmd as xs

    pending = values["uneven"].to("xla") * 2
    xs.mark_sharding(pending, meshes["mesh1"], ("x", None))
    sv = spmd.for_save(pending)
    covered = torch.zeros(SHAPES["uneven"], dtype=torch.int64)
    for sh in sv.shards:
        covered[sh.box.slices()] += 1
    out["pending_ok"] = (bool((covered == 1).all()) and all(
        torch.equal(sh.tensor, (values["uneven"] * 2)[sh.box.slices()]) for sh in sv.shards))
    target = torch.zeros(SHAPES["uneven"], device="xla") + 1
    xs.mark_sharding(target, meshes["mesh1"], ("x", None))
    rv = spmd.for_restore(target)
    for sh in rv.shards:
        sh.tensor.copy_(values["uneven"][sh.box.slices()])
    if rv.finish is not None:
        rv.finish()
    out["pending_restore_ok"] = torch.equal(target.cpu(), values["uneven"])
    return out


def save_and_restore_4(path: str) -> dict[str, Any]:
    """4 devices: :func:`describe_boxes` (under ``"describe"``), save the state with
    :func:`SAVE_LAYOUT`, then restore it in the same process into ``RESTORE_LAYOUT[4]``
    targets.  One process for all three: XLA start-up is the slow part.  Saved with the
    single-process entry point ``xla_ckpt.save`` (one TPU host needs no process group)."""
    import xla_ckpt

    meshes = _spmd()
    described = describe_boxes(meshes)
    values = global_values()
    state = _leaves(values, meshes, SAVE_LAYOUT)
    specs_before = {k: _spec(_leaf(state, k)) for k in SHAPES}
    xla_ckpt.save(state, path)
    report = _restore(path, _targets(meshes, RESTORE_LAYOUT[4]))
    report["saved_specs"] = specs_before
    report["describe"] = described
    return report


def restore_n(path: str, plain_path: str | None = None) -> dict[str, Any]:
    """``CPU_NUM_DEVICES`` (2 or 1) devices: restore into ``RESTORE_LAYOUT[n]`` targets.

    With ``plain_path``, also save :func:`global_values` as plain CPU tensors there first
    (a version-1 checkpoint, what a data-parallel job writes) and restore that into SPMD
    targets too (report under ``"from_plain"``).
    """
    import torch_xla.runtime as xr

    import xla_ckpt

    meshes = _spmd()
    n = xr.global_runtime_device_count()
    report = _restore(path, _targets(meshes, RESTORE_LAYOUT[n]))
    report["devices"] = n
    if plain_path is not None:
        xla_ckpt.save(_tree(global_values()), plain_path)
        report["from_plain"] = _restore(plain_path, _targets(meshes, RESTORE_LAYOUT[n]))
    return report


def multihost(path: str) -> dict[str, Any]:
    """Emulated 2 hosts: this gloo rank runs the 4-device program and owns 2 devices.

    Saves the :func:`SAVE_LAYOUT` state writing only its own devices' shards, then restores
    into ``RESTORE_LAYOUT[4]`` targets (filled with -1) reading only its own devices' boxes,
    once per restore strategy (``report["by_strategy"][strategy]``).
    """
    import torch.distributed as dist
    import torch_xla.distributed.spmd as xs

    from xla_ckpt.restore import save_distributed
    from xla_ckpt.sharded import spmd

    meshes = _spmd()
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    mine = owned_devices(rank)
    values = global_values()
    state = _leaves(values, meshes, SAVE_LAYOUT)
    with spmd.owning_devices(mine):
        save_distributed(state, path)
    out: dict[str, Any] = {"rank": rank, "owned": mine, "by_strategy": {}}
    for strategy in ("all_ranks", "broadcast"):
        into = _targets(meshes, RESTORE_LAYOUT[4])
        with spmd.owning_devices(mine):
            boxes = {k: [(s.box.offsets, s.box.sizes)
                         for s in spmd.for_restore(_leaf(into, k)).shards] for k in SHAPES}
            report = _restore(path, into, strategy=strategy)
        report["restore_boxes"] = boxes
        # Per device shard of each target: (device id, indices, values now on the device).
        per_device: dict[str, list[tuple[int, Any, torch.Tensor]]] = {}
        for k in SHAPES:
            live = _leaf(into, k)
            x = live if isinstance(live, xs.XLAShardedTensor) else xs.wrap_if_sharded(live)
            per_device[k] = [
                (int(s.shard_device.rsplit(":", 1)[1]),
                 "all" if s.indices is Ellipsis else [(i.start, i.stop) for i in s.indices],
                 s.unpadded_data.clone()) for s in x.local_shards]
        report["per_device"] = per_device
        out["by_strategy"][strategy] = report
    return out
