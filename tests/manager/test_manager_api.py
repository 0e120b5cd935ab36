"""CheckpointManager API parity with Orbax / torch_xla: all_steps, latest_step, best_step,
restore(step=...), restore(keys=...) (partial, only the selected bytes read), best_fn/best_mode.

One process for most cases; the collective behaviour (rank 0 decides, every rank restores the
same checkpoint or raises the same error) runs on 2 real gloo ranks.
"""

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from manager_helpers import committed, folders, make_cfg, pointer

from xla_ckpt.errors import (
    CheckpointNotFoundError,
    CheckpointReplacedError,
    CheckpointSaveError,
    ConfigError,
    NothingCommittedError,
    StepNotFoundError,
    UnknownKeyError,
)
from xla_ckpt.manager import CheckpointManager

NUMEL = 256


def w_at(n: int) -> torch.Tensor:
    return torch.arange(NUMEL, dtype=torch.float32) * n + 0.5


def state_at(n: int, tag: str = "") -> dict:
    return {"model": {"w": w_at(n), "b": torch.full((NUMEL,), float(n))},
            "optimizer": {"state": {0: {"exp_avg": torch.full((4,), n / 10)}},
                          "param_groups": [{"lr": 0.1 * n, "params": [0]}]},
            "num_updates": n, "tag": tag}


def save_steps(run_dir, steps, *, metrics=None, **cfg):
    mgr = CheckpointManager(make_cfg(run_dir, **cfg))
    for n in steps:
        mgr.save(state_at(n), epoch=1, num_updates=n, rank_state={"seen": n},
                 metrics=metrics.get(n) if metrics else None)
    mgr.close()


def test_all_steps_latest_step_and_restore_by_step(run_dir):
    save_steps(run_dir, [2, 4, 6])
    with CheckpointManager(make_cfg(run_dir)) as mgr:
        assert mgr.all_steps() == [2, 4, 6]
        assert mgr.latest_step() == 6
        r = mgr.restore(step=4)
        assert (r.checkpoint, r.num_updates, r.epoch) == ("checkpoint_1_4", 4, 1)
        assert r.uri == os.path.join(run_dir, "checkpoint_1_4")
        assert torch.equal(r.state["model"]["w"], w_at(4)) and r.rank_state == {"seen": 4}
        assert r.restored is not None and r.partial is None
        assert mgr.restored_from == "checkpoint_1_4"
        latest = mgr.restore()  # step=None: the latest, as restore_or_initialize
        assert latest.checkpoint == "checkpoint_1_6"
        assert torch.equal(latest.state["model"]["w"], w_at(6))
        with pytest.raises(StepNotFoundError) as ei:
            mgr.restore(step=5)
        e = ei.value
        assert (e.step, e.steps, e.run) == (5, (2, 4, 6), run_dir)
        assert str(e) == (f"{run_dir}: no committed checkpoint at step 5 (num_updates); steps "
                          "there: 2, 4, 6")
        assert isinstance(e, FileNotFoundError) and not isinstance(e, NothingCommittedError)
        with pytest.raises(ConfigError, match="step must be an int >= 0"):
            mgr.restore(step=-1)
        with pytest.raises(ConfigError, match="step must be an int >= 0"):
            mgr.restore(step=True)


def test_incomplete_saves_have_no_step(run_dir):
    save_steps(run_dir, [2])
    os.makedirs(os.path.join(run_dir, "checkpoint_1_8"))
    with open(os.path.join(run_dir, "checkpoint_1_8", "data-abc-state.safetensors"), "wb") as f:
        f.write(b"partial")
    with CheckpointManager(make_cfg(run_dir)) as mgr:
        assert mgr.all_steps() == [2] and mgr.latest_step() == 2
        with pytest.raises(StepNotFoundError, match="steps there: 2$"):
            mgr.restore(step=8)


def test_empty_run_folder_has_no_steps_and_restore_never_starts_fresh(tmp_path):
    run_dir = str(tmp_path / "not-yet")
    with CheckpointManager(make_cfg(run_dir)) as mgr:
        assert mgr.all_steps() == []
        assert mgr.latest_step() is None and mgr.best_step() is None
        with pytest.raises(NothingCommittedError):
            mgr.restore()
        with pytest.raises(StepNotFoundError, match="steps there: none$"):
            mgr.restore(step=0)


def _foreign(run_dir: str, kind: str) -> str:
    """Put a checkpoint of another kind into ``run_dir``; its name in the run folder."""
    os.makedirs(run_dir, exist_ok=True)
    if kind == "dcp":  # torch_xla / torchtitan style: <run>/<step>/.metadata
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"w": torch.arange(4.0)}, checkpoint_id=os.path.join(run_dir, "100"),
                     no_dist=True)
        return "100"
    torch.save({"model": {"w": torch.arange(4.0)}, "optimizer_history": [],
                "extra_state": {}, "last_optimizer_state": None},
               os.path.join(run_dir, "checkpoint_last.pt"))
    return "checkpoint_last.pt"


@pytest.mark.parametrize("kind", ["dcp", "fairseq"])
def test_step_queries_next_to_a_foreign_checkpoint_raise_what_restore_raises(tmp_path, kind):
    """The Orbax idiom ``if mgr.latest_step() is None: start fresh`` must not skip a checkpoint
    of another kind: every step query raises restore()'s CheckpointNotFoundError."""
    run_dir = str(tmp_path / "run")
    name = _foreign(run_dir, kind)
    with CheckpointManager(make_cfg(run_dir, no_save=True)) as mgr:
        with pytest.raises(CheckpointNotFoundError) as restored:
            mgr.restore()
        assert not isinstance(restored.value, NothingCommittedError)
        assert f"holds no xla_ckpt checkpoint, but checkpoints of another kind: {name} (" in \
            str(restored.value)
        for query in (mgr.latest_step, mgr.all_steps, mgr.best_step):
            with pytest.raises(CheckpointNotFoundError) as e:
                query()
            assert type(e.value) is type(restored.value) and str(e.value) == str(restored.value)


@pytest.mark.parametrize("order", ["update-first", "epoch-first"])
def test_two_checkpoints_of_one_step_restore_the_newest_committed(run_dir, order):
    names = ["checkpoint_1_6", "checkpoint1"]
    if order == "epoch-first":
        names.reverse()
    with CheckpointManager(make_cfg(run_dir)) as mgr:
        for name in names:
            mgr.save(state_at(6, tag=name), epoch=1, num_updates=6, name=name,
                     end_of_epoch=name == "checkpoint1")
    assert committed(run_dir) == sorted(names)
    with CheckpointManager(make_cfg(run_dir)) as mgr:
        assert mgr.all_steps() == [6] and mgr.latest_step() == 6
        r = mgr.restore(step=6)
        assert r.checkpoint == names[-1] and r.state["tag"] == names[-1]
        assert mgr.restore().checkpoint == names[-1]  # the same rule as "latest"


def test_partial_restore_reads_only_the_selected_tensors(run_dir):
    save_steps(run_dir, [2, 4])
    with CheckpointManager(make_cfg(run_dir)) as mgr:
        r = mgr.restore(step=2, keys=["model.w", "optimizer.param_groups"])
        assert r.state == {"model": {"w": r.state["model"]["w"]},
                           "optimizer": {"param_groups": [{"lr": 0.2, "params": [0]}]}}
        assert torch.equal(r.state["model"]["w"], w_at(2))
        assert r.rank_state is None and r.restored is None
        assert (r.checkpoint, r.num_updates) == ("checkpoint_1_2", 2)
        assert r.partial is not None and r.partial.bytes_read == NUMEL * 4
        assert r.partial.selection.nbytes == NUMEL * 4
        opt = mgr.restore(keys="optimizer")  # latest
        assert opt.checkpoint == "checkpoint_1_4"
        assert torch.equal(opt.state["optimizer"]["state"][0]["exp_avg"], torch.full((4,), 0.4))
        assert opt.partial is not None and opt.partial.bytes_read == 4 * 4
        with pytest.raises(UnknownKeyError) as ei:
            mgr.restore(step=4, keys=["model.weight"])
        assert ei.value.key == "model.weight" and ei.value.closest[0] == "model.w"
        assert ei.value.checkpoint == os.path.join(run_dir, "checkpoint_1_4")
        empty: list | tuple
        for empty in ([], ()):  # never the internal "nothing selected" marker as the state
            with pytest.raises(ValueError) as ev:
                mgr.restore(step=2, keys=empty)
            assert str(ev.value) == "keys is empty; pass None to load everything"
        both = mgr.restore(step=2, keys=["model", "model.w"])  # a key under another: found
        assert list(both.state) == ["model"] and list(both.state["model"]) == ["w", "b"]


@pytest.mark.parametrize("replacements", [1, 2])
def test_partial_restore_of_a_checkpoint_replaced_mid_read(run_dir, monkeypatch, replacements):
    """C14: another incarnation saves over the folder between rank 0's decision and the read:
    read once more (its new bytes), or, replaced again, one error naming the race."""
    import xla_ckpt.manager.restoring as restoring

    save_steps(run_dir, [2])
    real = restoring.read_partial
    calls = []

    def replaced_first(reader, keys, **kw):
        calls.append(reader.manifest.save_id)
        if len(calls) <= replacements:
            with CheckpointManager(make_cfg(run_dir)) as other:  # a newer incarnation
                other.save(state_at(20 + len(calls)), epoch=1, num_updates=2,
                           name="checkpoint_1_2")
        return real(reader, keys, **kw)

    monkeypatch.setattr(restoring, "read_partial", replaced_first)
    with CheckpointManager(make_cfg(run_dir, no_save=True)) as mgr:
        if replacements == 1:
            r = mgr.restore(step=2, keys="model.w")
            assert torch.equal(r.state["model"]["w"], w_at(21))
            assert len(calls) == 2 and calls[0] != calls[1]
        else:
            with pytest.raises(CheckpointReplacedError) as ei:
                mgr.restore(step=2, keys="model.w")
            e = ei.value
            assert e.uri == os.path.join(run_dir, "checkpoint_1_2") and e.before == calls[1]
            assert str(e).startswith(f"{e.uri} was replaced while reading (save id {calls[1]} "
                                     "-> ")
            assert list(e.failures) == [0] and "DataFileMissingError" in e.failures[0]


def accuracy_minus_loss(metrics):
    return metrics["acc"] - metrics["loss"]


def test_best_fn_and_best_mode_drive_the_best_pointer_and_keep_best(run_dir):
    metrics = {1: {"acc": 0.5, "loss": 0.1}, 2: {"acc": 0.9, "loss": 0.1},
               3: {"acc": 0.7, "loss": 0.0}, 4: {"acc": 0.6, "loss": 0.4}, 5: None}
    cfg = dict(keep_interval_updates=1, keep_best_checkpoints=1)
    mgr = CheckpointManager(make_cfg(run_dir, **cfg), best_fn=accuracy_minus_loss,
                            best_mode="max")
    for n in range(1, 6):
        mgr.save(state_at(n), epoch=1, num_updates=n, metrics=metrics[n])
    assert mgr.best_step() == 2
    mgr.close()
    # the built-in metric ("loss", min) would have kept checkpoint_1_3
    assert folders(run_dir) == ["checkpoint_1_2", "checkpoint_1_5"]
    doc = pointer(run_dir, "best")
    assert doc["checkpoint"] == "checkpoint_1_2" and doc["num_updates"] == 2
    assert doc["metric"] == "best_fn:accuracy_minus_loss"
    assert doc["value"] == pytest.approx(0.8)
    # a new incarnation re-scores the pointer's checkpoint: a worse save does not move it,
    # a better one does
    mgr = CheckpointManager(make_cfg(run_dir, **cfg), best_fn=accuracy_minus_loss,
                            best_mode="max")
    assert mgr.restore().checkpoint == "checkpoint_1_5"
    mgr.save(state_at(6), epoch=1, num_updates=6, metrics={"acc": 0.8, "loss": 0.1})
    assert pointer(run_dir, "best")["checkpoint"] == "checkpoint_1_2"
    mgr.save(state_at(7), epoch=1, num_updates=7, metrics={"acc": 1.0, "loss": 0.05})
    assert pointer(run_dir, "best")["checkpoint"] == "checkpoint_1_7"
    assert mgr.best_step() == 7
    mgr.close()


def test_best_mode_default_follows_the_config_and_min_by_default(run_dir):
    losses = {1: 3.0, 2: 1.0, 3: 2.0}
    with CheckpointManager(make_cfg(run_dir), best_fn=lambda m: m["loss"] * 2) as mgr:
        for n in (1, 2, 3):
            mgr.save(state_at(n), epoch=1, num_updates=n, metrics={"loss": losses[n]})
        assert mgr.best_step() == 2
    assert pointer(run_dir, "best")["value"] == 2.0
    with CheckpointManager(make_cfg(run_dir, maximize_best_checkpoint_metric=True)) as mgr:
        assert mgr.best_step() == 1  # no best_fn: the built-in "loss", maximised
    with pytest.raises(ConfigError, match="best_mode must be 'min' or 'max'"):
        CheckpointManager(make_cfg(run_dir), best_mode="lowest")
    with pytest.raises(ConfigError, match="best_fn must be a callable"):
        CheckpointManager(make_cfg(run_dir), best_fn="loss")  # type: ignore[arg-type]  # on purpose


def test_a_raising_best_fn_fails_the_save_before_anything_is_written(run_dir):
    with CheckpointManager(make_cfg(run_dir), best_fn=lambda m: m["bleu"]) as mgr:
        mgr.save(state_at(1), epoch=1, num_updates=1)  # no metrics: no score, fn not called
        with pytest.raises(CheckpointSaveError) as ei:
            mgr.save(state_at(2), epoch=1, num_updates=2, metrics={"loss": 1.0})
        assert ei.value.failures == {0: "KeyError: 'bleu'"}
        assert "best_fn raised on its metrics (nothing was written)" in str(ei.value)
        assert mgr.all_steps() == [1]
    assert folders(run_dir) == ["checkpoint_1_1"]
    assert not os.path.exists(os.path.join(run_dir, "checkpoint_best.json"))


# ---- two real gloo ranks ------------------------------------------------------------------------

def _rank_restores(run_dir: str) -> dict:
    """On every rank: the step API and restores; errors reported as (type, attrs)."""
    from xla_ckpt.comm import DistConfig, get_dist
    from xla_ckpt.manager import CheckpointConfig

    dist = get_dist(DistConfig(backend="gloo", timeout_s=60))
    cfg = CheckpointConfig(save_dir=run_dir, handle_sigterm=False, async_save=False)
    out: dict = {"rank": dist.rank}
    with CheckpointManager(cfg, dist=dist) as mgr:
        for n in (3, 6):
            mgr.save(state_at(n), epoch=1, num_updates=n, rank_state={"rank": dist.rank, "n": n})
        out["steps"] = mgr.all_steps()
        out["latest"] = mgr.latest_step()
        r = mgr.restore(step=3)
        out["full"] = (r.checkpoint, r.state["model"]["w"].tolist() == w_at(3).tolist(),
                       r.rank_state)
        p = mgr.restore(keys=["model.b"])
        assert p.partial is not None
        out["partial"] = (p.checkpoint, sorted(p.state["model"]), p.partial.bytes_read,
                          p.state["model"]["b"].tolist() == [6.0] * NUMEL)
        try:
            mgr.restore(step=4)
        except StepNotFoundError as e:
            out["missing"] = (type(e).__name__, e.step, list(e.steps), str(e))
        try:
            mgr.restore(step=6, keys=["model.x"])
        except UnknownKeyError as e:
            out["unknown"] = (type(e).__name__, e.key, list(e.closest))
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_rank_restores_the_step_rank0_chose(tmp_path):
    from xla_ckpt.testing.launcher import shared_pool

    run_dir = str(tmp_path / "run")
    got = [r.unwrap() for r in shared_pool(2, xla=False).run(_rank_restores, run_dir,
                                                              timeout_s=180)]
    for rank, g in enumerate(got):
        assert g["rank"] == rank
        assert g["steps"] == [3, 6] and g["latest"] == 6
        assert g["full"] == ("checkpoint_1_3", True, {"rank": rank, "n": 3})
        assert g["partial"] == ("checkpoint_1_6", ["b"], NUMEL * 4, True)
        assert g["missing"] == ("StepNotFoundError", 4, [3, 6], (
            f"{run_dir}: no committed checkpoint at step 4 (num_updates); steps there: 3, 6"))
        assert g["unknown"][:2] == ("UnknownKeyError", "model.x")
        assert g["unknown"] == got[0]["unknown"]
