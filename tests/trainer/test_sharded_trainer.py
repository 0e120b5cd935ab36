"""Checkpointer with an FSDP2 model (DTensor parameters) on 2 real gloo ranks.

Model and AdamW state go through DCP's ``get_state_dict`` / ``set_state_dict``; the fairseq
semantics stay: ``num_updates``, the lr_scheduler, ``extra_state`` with this rank's own values,
``reset_optimizer`` and ``optimizer_overrides``.  After a restore the next update is bitwise the
uninterrupted run's.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import sharded_trainer_workers as W
import torch

from xla_ckpt.testing.asserts import tensor_bits
from xla_ckpt.testing.launcher import shared_pool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _same(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert sorted(a) == sorted(b), what
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, f"{what}: {k}"
            assert torch.equal(tensor_bits(a[k]), tensor_bits(b[k])), f"{what}: {k} differs"
        else:
            assert a[k] == b[k], f"{what}: {k}"


def test_fsdp2_checkpointer_save_restore_with_fairseq_semantics(tmp_path):
    folder, run_dir = str(tmp_path / "ckpt"), str(tmp_path / "run")
    got = [r.unwrap() for r in shared_pool(2, xla=False).run(
        W.save_and_restore, folder, run_dir, timeout_s=300)]
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["version"] == 2 and {"chunks/00000", "chunks/00001"} <= set(
        manifest["items"])
    assert manifest["metadata"] is not None
    for rank, g in enumerate(got):
        what = f"rank {rank}"
        assert g["dtensor_params"]
        _same(g["restored"], g["saved"], f"{what}: restored vs saved")
        _same(g["next_step"], g["reference"], f"{what}: next update vs uninterrupted")
        assert g["num_updates"] == 2
        assert g["lr"] == g["saved_lr"]
        assert g["extra"] == {"train_iterator": {"epoch": 1, "iterations_in_epoch": 2,
                                                 "version": 2},
                              "val_loss": 0.5, "position": 100 + rank}
        # reset_optimizer: the weights, a fresh optimizer, num_updates 0 (fairseq)
        assert g["reset_num_updates"] == 0 and g["reset_optimizer_state"] == 0
        _same(g["reset_model"], {k: v for k, v in g["saved"].items() if k.startswith("model.")},
              f"{what}: reset_optimizer weights")
        assert g["reset_position"] == 100 + rank
        assert g["override_lr"] == [1e-4]
        # through the manager: restore_or_initialize(into=restore_targets()) + load_state
        _same(g["via_manager"], g["saved"], f"{what}: via the manager")
        assert g["via_manager_position"] == 200 + rank
        assert g["via_manager_num_updates"] == 2
        assert g["reset_via_manager"] == (0, 0)
        kind, msg, state_len = g["sgd"]
        assert kind == "StateMismatchError" and "reset_optimizer=True" in msg, msg
        assert state_len == 0  # the optimizer prepared for the read was discarded
        # nothing committed: None, and an optimizer as fresh as without the attempt
        assert g["fresh"] == (True, 0)
        assert g["fresh_via_manager"] == (True, True, 0, 0)


def test_tensor_parallel_checkpointer_restores_and_steps_bitwise(tmp_path):
    folder = str(tmp_path / "tp")
    got = [r.unwrap() for r in shared_pool(2, xla=False).run(
        W.tp_save_and_restore, folder, timeout_s=300)]
    for rank, g in enumerate(got):
        assert g["dtensor_params"]
        _same(g["restored"], g["saved"], f"rank {rank}: restored vs saved")
        _same(g["next_step"], g["reference"], f"rank {rank}: next update vs uninterrupted")
        assert g["num_updates"] == 2
        assert g["itr"] == {"epoch": 1, "iterations_in_epoch": 2}
    # column-wise l1.weight (8, 6): 4 rows each; row-wise l2.weight (3, 8): 4 columns each
    assert [tuple(g["saved"]["model.l1.weight"].shape) for g in got] == [(4, 6), (4, 6)]
    assert [tuple(g["saved"]["model.l2.weight"].shape) for g in got] == [(3, 4), (3, 4)]
    assert not torch.equal(got[0]["saved"]["model.l2.weight"], got[1]["saved"]["model.l2.weight"])


def test_fsdp2_checkpointer_2_to_3_ranks_and_the_per_rank_extra_state(tmp_path):
    """Saved by 2 FSDP2 ranks with ``rank_extra_state``, loaded by 3: the default error names
    the Checkpointer's own options; ``rank_state_on_resize="drop"`` and ``rank_state_remap``
    (per call, in CheckpointerConfig, through make_restorer, which takes ``into=``) restore
    values bitwise equal to DCP's on the new mesh."""
    folder, ref = str(tmp_path / "ckpt"), str(tmp_path / "dcp")
    for r in shared_pool(2, xla=False).run(W.resize_save, folder, ref, timeout_s=300):
        r.unwrap()
    got = [r.unwrap() for r in shared_pool(3, xla=False).run(
        W.resize_load, folder, ref, timeout_s=300)]
    for rank, g in enumerate(got):
        kind, msg = g["default"]
        assert kind == "WorldSizeMismatchError", msg
        assert "load_checkpoint(uri, rank_state_remap=fn(saved, rank, world_size))" in msg
        assert "load_checkpoint(uri, rank_state_on_resize='drop')" in msg
        assert "CheckpointerConfig" in msg
        dcp_ref = g["dcp"]
        assert dcp_ref
        extra, shards, updates = g["drop"]
        assert "position" not in extra and extra["train_iterator"]["iterations_in_epoch"] == 1
        assert updates == 1
        _same(shards, dcp_ref, f"rank {rank}: drop vs DCP")
        want = {"position": 100 + min(rank, 1), "world": 3}
        for mode in ("remap", "remap_config", "make_restorer"):
            extra, shards = g[mode][0], g[mode][1]
            assert {k: extra.get(k) for k in want} == want, (mode, extra)
            _same(shards, dcp_ref, f"rank {rank}: {mode} vs DCP")
        assert g["make_restorer_takes_into"] is True


def test_rank_state_options_reach_the_restorer_in_its_one_request():
    """The per-rank item options (config or call) reach the restorer in the one request it
    gets, never dropped; a bad value is a ConfigError at construction; a restorer that
    returns anything but a RestoredState is named."""
    from xla_ckpt.errors import ConfigError, NothingCommittedError
    from xla_ckpt.trainer import Checkpointer, CheckpointerConfig, RestoreRequest

    with pytest.raises(ConfigError, match="rank_state_on_resize: must be one of error, drop"):
        CheckpointerConfig(rank_state_on_resize="keep")
    model = torch.nn.Linear(2, 2)
    calls: list[RestoreRequest] = []

    def nothing(request: RestoreRequest):
        calls.append(request)
        raise NothingCommittedError(f"{request.uri}: no committed checkpoint here")

    ck = Checkpointer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      restorer=nothing, config=CheckpointerConfig(rank_state_on_resize="drop"))
    assert ck.load_checkpoint("/nonexistent/run") is None
    remap = lambda s, r, w: None  # noqa: E731 - a stand-in hook, compared by identity
    assert ck.load_checkpoint("/nonexistent/run2", rank_state_remap=remap) is None
    ck.config = CheckpointerConfig()
    assert ck.load_checkpoint("/nonexistent/run3") is None  # nothing set: defaults
    assert [(c.uri, c.rank_state_on_resize, c.rank_state_remap, c.into) for c in calls] == [
        ("/nonexistent/run", "drop", None, None), ("/nonexistent/run2", "drop", remap, None),
        ("/nonexistent/run3", None, None, None)]
    assert all(c.targets is not None for c in calls)  # the live tensors, offered in place
    ck.restorer = lambda request: (None, None)  # type: ignore[assignment]  # the wrong return, tested
    with pytest.raises(TypeError, match=r"the Checkpointer's restorer function returned a "
                                        r"tuple: a restorer returns a "
                                        r"xla_ckpt.trainer.RestoredState\(state, rank_state\)"):
        ck.load_checkpoint("/nonexistent/run")
