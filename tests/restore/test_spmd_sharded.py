"""torch_xla SPMD state saved by device shard and restored onto other device counts and layouts.

Real parts only: the XLA CPU runtime (``PJRT_DEVICE=CPU``, ``CPU_NUM_DEVICES=N``,
``xr.use_spmd()`` before the first XLA tensor), one worker process per device count (XLA
fixes the device count at start-up), real files, real gloo ranks for the multi-host
emulation.  See ``spmd_workers.py`` for the state and its layouts: a 4-way uneven (10, 6)
tensor, a 2x2-tiled tensor, a replicated one, an (8, 4) tensor sharded ``("dp", None)`` over
a 2x2 mesh (CASES C18, pytorch/xla#7919: torch_xla's own planner drops it), a parameter
annotated in place (what a module's ``state_dict`` holds), and optimizer-like state (a step
and two moments, one bf16).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import spmd_workers as W
import torch

from xla_ckpt.sharded import spmd
from xla_ckpt.testing.asserts import tensor_bits
from xla_ckpt.testing.launcher import launch

pytestmark = pytest.mark.timeout(300)

#: Device boxes of the 4-device save (SAVE_LAYOUT), in device order 0..3, as (offsets, sizes).
#: mesh2 is devices [[0, 1], [2, 3]] over ("dp", "tp").
SAVE_DEVICE_BOXES: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]] | None]] = {
    "uneven": [((0, 0), (3, 6)), ((3, 0), (3, 6)), ((6, 0), (3, 6)), ((9, 0), (1, 6))],
    "tiled": [((0, 0), (3, 5)), ((0, 5), (3, 5)), ((3, 0), (3, 5)), ((3, 5), (3, 5))],
    "replicated": [((0, 0), (3, 5))] * 4,
    "dp_rep": [((0, 0), (4, 4)), ((0, 0), (4, 4)), ((4, 0), (4, 4)), ((4, 0), (4, 4))],
    "exp_avg": [((0, 0), (3, 6)), ((3, 0), (3, 6)), ((6, 0), (3, 6)), ((9, 0), (1, 6))],
    "exp_avg_sq": [((0, 0), (10, 3)), ((0, 3), (10, 3)), ((0, 0), (10, 3)), ((0, 3), (10, 3))],
    "step_t": [((), ())] * 4,
    "mask": [((0, 0), (2, 3)), ((2, 0), (2, 3)), ((4, 0), (2, 3)), ((6, 0), (1, 3))],
    "empty": [None] * 4,
    "param": [((0, 0), (5, 3)), ((0, 3), (5, 3)), ((0, 6), (5, 3)), None],   # device 3: padding
}


def _boxes_of(key: str, devices: list[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Distinct non-empty boxes of ``devices``, first occurrence order (what for_save gives)."""
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for d in devices:
        b = SAVE_DEVICE_BOXES[key][d]
        if b is not None and b not in out:
            out.append(b)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (dtype and shape included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(tensor_bits(a),
                                                                     tensor_bits(b))


def _spmd_env(devices: int) -> dict[str, str]:
    return {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)}


def _one(fn: Any, devices: int, *args: Any) -> Any:
    [res] = launch(fn, 1, args=args, env=_spmd_env(devices), xla=False, timeout_s=240)
    return res.unwrap()


def _assert_restored(report: dict[str, Any], what: str) -> None:
    values = W.global_values()
    for k in W.SHAPES:
        got = report["values"][k]
        assert got.dtype == values[k].dtype, (what, k)
        assert _same(got, values[k]), f"{what}: {k} differs after restore"
        assert all(ok for _, ok in report["shards"][k]), (what, k, report["shards"][k])
        # Restoring in place keeps the target's sharding (copy_ would make it replicated).
        assert report["specs"][k] == report["target_specs"][k], (what, k)
        assert report["same_object"][k], f"{what}: restored state's {k} is not the live target"
    # The module parameter behind the state_dict() alias holds the restored value too.
    assert _same(report["module_weight"], values["param"]), what
    assert report["step"] == W.STEP
    assert report["param_groups"] == W.PARAM_GROUPS


# ---- no XLA runtime needed --------------------------------------------------------------------

def test_importing_spmd_and_views_does_not_load_torch_xla() -> None:
    code = ("import sys, torch; import xla_ckpt.sharded.spmd, xla_ckpt.sharded.views, "
            "xla_ckpt.restore.owners\n"
            "from xla_ckpt.sharded import spmd\n"
            "assert not spmd.is_xla_sharded(torch.ones(2))\n"
            "assert not spmd.is_xla_sharded(3)\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch_xla')))")
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "XLA_USE_SPMD")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_shard_indices_become_boxes() -> None:
    shape = (10, 6)
    assert spmd._box(Ellipsis, shape).to_json() == {"offsets": [0, 0], "sizes": [10, 6]}
    assert spmd._box([slice(9, 10, 1), slice(0, 6, 1)], shape).to_json() == {
        "offsets": [9, 0], "sizes": [1, 6]}
    # A device holding only padding (5 columns 4-way: ceil 2, the last device starts at 6).
    assert spmd._box([slice(0, 10, 1), slice(6, 6, 1)], shape).numel == 0
    with pytest.raises(ValueError, match="not a box"):
        spmd._box([slice(0, 10, 2), slice(0, 6, 1)], shape)
    with pytest.raises(ValueError, match="do not match shape"):
        spmd._box([slice(0, 10, 1)], shape)
    assert spmd._device_id("CPU:3") == 3 and spmd._device_id("TPU:12") == 12


# ---- one SPMD process per device count --------------------------------------------------------

@pytest.fixture(scope="module")
def saved_4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The state saved by a 4-device SPMD process (and restored there into other layouts)."""
    path = tmp_path_factory.mktemp("spmd") / "ckpt"
    report = _one(W.save_and_restore_4, 4, str(path))
    return path, report


@pytest.mark.slow
def test_boxes_from_local_shards_four_devices(saved_4: tuple[Path, dict[str, Any]]) -> None:
    out = saved_4[1]["describe"]
    for k in W.SAVE_LAYOUT:
        # One box per distinct indices; replicas inside the process given once (C18: dp_rep
        # keeps both row halves); padding-only devices left out.
        assert out["save"][k] == _boxes_of(k, [0, 1, 2, 3]), k
        assert out["values_ok"][k], f"{k}: a CPU shard differs from the global tensor's box"
        assert out["save_owned"][k] == _boxes_of(k, [2, 3]), k
        assert out["restore_owned"][k] == _boxes_of(k, [0, 1]), k
    assert out["placement"]["uneven"] == "xla {devices=[4,1]0,1,2,3}"
    assert out["placement"]["dp_rep"] == "xla {devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}"
    assert out["placement"]["replicated"] == "xla {replicated}"
    assert out["replicated"] == {k: k in ("replicated", "step_t") for k in W.SAVE_LAYOUT}
    assert out["pending_ok"], "a pending (lazy) value was described before it was computed"
    assert out["pending_restore_ok"]


@pytest.mark.slow
def test_save_four_devices_keeps_every_box(saved_4: tuple[Path, dict[str, Any]]) -> None:
    path, report = saved_4
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["version"] == 2
    by_key = {gt["key"].split("[")[-1].strip("]'\""): gt for gt in manifest["global_tensors"]}
    assert set(by_key) == set(W.SHAPES)
    for k, gt in by_key.items():
        assert gt["shape"] == list(W.SHAPES[k])
        boxes = sorted((tuple(c["offsets"]), tuple(c["sizes"])) for c in gt["chunks"])
        assert boxes == sorted(_boxes_of(k, [0, 1, 2, 3])), k
        assert gt["placement"].startswith("xla {"), gt["placement"]
    # The torch_xla data-loss case (C18): present, both row halves.
    assert [c["sizes"] for c in by_key["dp_rep"]["chunks"]] == [[4, 4], [4, 4]]
    _assert_restored(report, "4 devices, other layouts")


@pytest.mark.slow
def test_load_gives_full_tensors(saved_4: tuple[Path, dict[str, Any]]) -> None:
    import xla_ckpt

    path, _ = saved_4
    state = xla_ckpt.load(str(path))
    values = W.global_values()
    for k in W.SHAPES:
        node = state
        for p in W.PATHS[k]:
            node = node[p]
        assert _same(node, values[k]), k
    assert state["optim"]["state"]["0"]["step"] == W.STEP


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 1])
def test_restore_onto_fewer_devices(saved_4: tuple[Path, dict[str, Any]], devices: int,
                                    tmp_path: Path) -> None:
    path, _ = saved_4
    plain = str(tmp_path / "plain") if devices == 2 else None
    report = _one(W.restore_n, devices, str(path), plain)
    assert report["devices"] == devices
    _assert_restored(report, f"{devices} devices")
    if plain is not None:
        # A version-1 checkpoint of plain CPU tensors restores into SPMD targets as well.
        assert json.loads((tmp_path / "plain" / "manifest.json").read_text())["version"] == 1
        _assert_restored(report["from_plain"], "plain v1 checkpoint into 2 devices")


# ---- multi-host emulation ---------------------------------------------------------------------

@pytest.mark.slow
def test_multihost_emulation_each_rank_writes_and_reads_its_devices(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    results = launch(W.multihost, 2, args=(str(path),), env=_spmd_env(4), xla=False,
                     timeout_s=240)
    reports = [r.unwrap() for r in results]
    manifest = json.loads((path / "manifest.json").read_text())
    values = W.global_values()
    for gt in manifest["global_tensors"]:
        k = gt["key"].split("[")[-1].strip("]'\"")
        writers: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {0: [], 1: []}
        for c in gt["chunks"]:
            writers[int(c["item"].rsplit("/", 1)[1])].append(
                (tuple(c["offsets"]), tuple(c["sizes"])))
        for rank, boxes in writers.items():
            mine = _boxes_of(k, W.owned_devices(rank))
            assert set(boxes) <= set(mine), f"{k}: rank {rank} wrote {boxes}, owns {mine}"
        all_boxes = sorted(b for bs in writers.values() for b in bs)
        assert all_boxes == sorted(_boxes_of(k, [0, 1, 2, 3])), k    # each box exactly once
        if k in ("uneven", "tiled", "dp_rep", "exp_avg", "param"):
            # No replica across ranks: each rank writes exactly its own devices' boxes.
            for rank in (0, 1):
                assert sorted(writers[rank]) == sorted(_boxes_of(k, W.owned_devices(rank))), k
    for rep in reports:
        rank, mine = rep["rank"], rep["owned"]
        for strategy, srep in rep["by_strategy"].items():
            what = f"rank {rank}, {strategy}"
            for k in W.SHAPES:
                owned_boxes: list[Any] = []
                for dev, idx, data in srep["per_device"][k]:
                    if idx == "all":
                        # A replicated target is one box, restored on every device (copy_).
                        assert _same(data, values[k]), (what, k, dev)
                        whole = (tuple([0] * data.dim()), tuple(data.shape))
                        if whole not in owned_boxes:
                            owned_boxes.append(whole)
                        continue
                    box = (tuple(a for a, _ in idx), tuple(b - a for a, b in idx))
                    sl = tuple(slice(a, b) for a, b in idx)
                    if dev in mine:
                        assert _same(data, values[k][sl]), (what, k, dev)
                        if all(box[1]) and box not in owned_boxes:
                            owned_boxes.append(box)
                    else:
                        # Not this rank's device: left as it was (the targets start as -1).
                        assert _same(data, torch.full(data.shape, -1.0).to(data.dtype)), (
                            what, k, dev)
                assert srep["restore_boxes"][k] == owned_boxes, (what, k)
            assert srep["step"] == W.STEP, what
            assert srep["param_groups"] == W.PARAM_GROUPS, what


def test_owning_devices_is_scoped() -> None:
    assert spmd._DEFAULT_OWNED is None
    with spmd.owning_devices([2, 3]):
        assert spmd._DEFAULT_OWNED == frozenset({2, 3})
        with spmd.owning_devices(None):
            assert spmd._DEFAULT_OWNED is None
        assert spmd._DEFAULT_OWNED == frozenset({2, 3})
    assert spmd._DEFAULT_OWNED is None
