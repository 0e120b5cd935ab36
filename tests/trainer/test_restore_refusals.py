"""A refused restore leaves every live object as it was, and says so (issue 25 defect 5);
a plain ``torch.save`` training dict restores without a made-up fairseq history (defect 1,
CASES C24).

Every check that could fail after the model load (optimizer class and history, param
group count and sizes, state shapes, criterion, lr_scheduler state) runs before the first
byte lands in a live tensor, on the in-place read path (xla_ckpt checkpoints) and on the
ordinary one (legacy ``.pt`` files) alike.
"""

import argparse
import copy
import logging

import pytest
import torch
from trainer_utils import refused

from xla_ckpt.errors import StateMismatchError
from xla_ckpt.trainer import Checkpointer
from xla_ckpt.trainer.restore_checks import NOTHING_RESTORED


class Net(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(3, 4)
        self.b = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class ScaledLoss(torch.nn.Module):
    """A criterion with a parameter (its state is saved and restored)."""

    def __init__(self, size: int = 1) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(size))

    def forward(self, out):
        return (out.sum() * self.scale).sum()


def _step(model, opt, crit=None):
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7
    loss = crit(model(x)) if crit is not None else model(x).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def snapshot(*modules):
    return [copy.deepcopy(m.state_dict()) for m in modules]


def assert_untouched(before, *modules):
    for saved, m in zip(before, modules, strict=True):
        now = m.state_dict()
        assert list(now) == list(saved)
        for k, v in saved.items():
            assert torch.equal(now[k], v) and now[k].dtype == v.dtype, k


@pytest.fixture
def saved_run(tmp_path):
    """A checkpoint saved by the Checkpointer from AdamW over one param group, 2 updates."""
    model, crit = Net(0), ScaledLoss()
    ck = Checkpointer(model=model, criterion=crit, build_optimizer=adamw)
    for _ in range(2):
        _step(model, ck.optimizer, crit)
        ck.set_num_updates(ck.get_num_updates() + 1)
    uri = str(tmp_path / "run" / "checkpoint_1_2")
    ck.save_checkpoint(uri, {})
    return uri, model


def fresh(build, *, criterion=None, seed=7, **kwargs):
    model = Net(seed)
    ck = Checkpointer(model=model, criterion=criterion or ScaledLoss(),
                      build_optimizer=build, **kwargs)
    return ck, model


def two_groups(params):
    params = list(params)
    return torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)


REFUSED = {
    # the cases: another optimizer class; 2 param groups against 1
    "sgd": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "optimizer does not match the checkpoint: saved AdamW, live SGD"),
    "adam": (lambda p: torch.optim.Adam(p, lr=1e-2),
             "optimizer does not match the checkpoint: saved AdamW, live Adam"),
    "two_groups": (two_groups, "the saved optimizer has 1 param group(s), the live one 2"),
    # more of the kind: a group of another size
    "group_size": (lambda p: adamw(list(p)[:3]),
                   ("param group 0 holds 5 parameters in the checkpoint and 3 in the live "
                   "optimizer")),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_an_optimizer_mismatch_leaves_the_live_model_untouched(saved_run, case):
    uri, _ = saved_run
    build, message = REFUSED[case]
    ck, model = fresh(build)
    live_opt = ck.optimizer  # built before the restore, used by the loop
    before = snapshot(model, ck.criterion)
    with pytest.raises(StateMismatchError) as e:
        ck.load_checkpoint(uri)
    assert message in str(e.value)
    assert str(e.value).endswith(NOTHING_RESTORED)
    assert_untouched(before, model, ck.criterion)
    assert ck.optimizer is live_opt and not live_opt.state
    assert ck.get_num_updates() == 0


def test_a_criterion_mismatch_leaves_the_live_model_untouched(saved_run):
    uri, _ = saved_run
    ck, model = fresh(adamw, criterion=ScaledLoss(size=3))
    before = snapshot(model, ck.criterion)
    with pytest.raises(StateMismatchError) as e:
        ck.load_checkpoint(uri)
    assert ("cannot load the criterion state: the architectures differ; shape mismatch in "
            "scale (saved [1], live [3])") in str(e.value)
    assert str(e.value).endswith(NOTHING_RESTORED)
    assert_untouched(before, model, ck.criterion)


def test_a_criterion_class_mismatch_leaves_the_live_model_untouched(saved_run):
    uri, _ = saved_run

    class OtherLoss(ScaledLoss):
        pass

    ck, model = fresh(adamw, criterion=OtherLoss())
    before = snapshot(model, ck.criterion)
    with pytest.raises(StateMismatchError) as e:
        ck.load_checkpoint(uri)
    assert str(e.value) == refused(
        f"{uri}: criterion does not match the checkpoint: saved ScaledLoss, live OtherLoss; "
        "pass reset_optimizer=True to restore the weights with a fresh optimizer")
    assert_untouched(before, model, ck.criterion)


def test_an_lr_scheduler_mismatch_leaves_the_live_model_untouched(tmp_path):
    model = Net(0)
    ck = Checkpointer(model=model, build_optimizer=adamw,
                      build_lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2))
    _step(model, ck.optimizer)
    uri = str(tmp_path / "ck")
    ck.save_checkpoint(uri, {})
    live = Net(7)
    other = Checkpointer(model=live, build_optimizer=adamw,
                         build_lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(
                             o, lambda s: 1.0))
    before = snapshot(live)
    with pytest.raises(StateMismatchError) as e:
        other.load_checkpoint(uri)
    assert "lr_scheduler does not match the checkpoint: live LambdaLR needs keys" in str(e.value)
    assert str(e.value).endswith(NOTHING_RESTORED)
    assert_untouched(before, live)


class RefusingSchedule:
    """A fairseq-style scheduler (``step_update``) whose own load_state_dict refuses the
    saved state: only trying the load can find that out."""

    def __init__(self, optimizer, refuse: bool) -> None:
        self.optimizer, self.refuse, self.best = optimizer, refuse, None

    def state_dict(self):
        return {"best": self.best}

    def load_state_dict(self, state):
        if self.refuse:
            raise KeyError("warmup_updates")
        self.best = state["best"]

    def step(self, epoch, val_loss=None):
        return self.optimizer.param_groups[0]["lr"]

    def step_update(self, num_updates):
        return self.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("fmt", ["xla_ckpt", "pt"])
def test_a_scheduler_whose_own_load_refuses_leaves_every_live_object_untouched(tmp_path, fmt):
    """The scheduler's own load_state_dict is tried on the one built for the restore before
    anything live changes (on the in-place read path and on a .pt read into fresh memory)."""
    model = Net(0)
    ck = Checkpointer(model=model, build_optimizer=adamw,
                      build_lr_scheduler=lambda o: RefusingSchedule(o, refuse=False))
    _step(model, ck.optimizer)
    ck.set_num_updates(1)
    uri = str(tmp_path / "ck")
    ck.save_checkpoint(uri, {})
    if fmt == "pt":
        import xla_ckpt

        torch.save(xla_ckpt.load(uri), uri + ".pt")
        uri += ".pt"
    live = Net(7)
    other = Checkpointer(model=live, build_optimizer=adamw,
                         build_lr_scheduler=lambda o: RefusingSchedule(o, refuse=True))
    for _ in range(2):  # the live loop has trained: its Adam moments must survive
        _step(live, other.optimizer)
    live_opt, live_sched = other.optimizer, other.lr_scheduler
    moments = copy.deepcopy(live_opt.state_dict()["state"])
    before = snapshot(live)
    with pytest.raises(StateMismatchError) as e:
        other.load_checkpoint(uri)
    assert ("could not load the saved lr_scheduler_state (keys ['best']): KeyError: "
            "'warmup_updates'") in str(e.value)
    assert str(e.value).endswith(NOTHING_RESTORED)
    assert_untouched(before, live)
    assert other.optimizer is live_opt and other.lr_scheduler is live_sched
    for i, st in moments.items():
        for k, v in st.items():
            assert torch.equal(live_opt.state_dict()["state"][i][k], v), (i, k)


def test_a_scheduler_state_of_another_class_is_named_in_a_warning(tmp_path, caplog):
    """StepLR's state loaded into an ExponentialLR: torch takes the extra keys as attributes
    (gamma changes, step_size appears); the restore says so, naming both."""
    model = Net(0)
    ck = Checkpointer(model=model, build_optimizer=adamw,
                      build_lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5))
    _step(model, ck.optimizer)
    uri = str(tmp_path / "ck")
    ck.save_checkpoint(uri, {})
    other = Checkpointer(model=Net(7), build_optimizer=adamw,
                         build_lr_scheduler=lambda o: torch.optim.lr_scheduler.ExponentialLR(
                             o, 0.9))
    with caplog.at_level(logging.WARNING, logger="xla_ckpt.trainer.lr_scheduler"):
        other.load_checkpoint(uri)
    assert (f"{uri}: the saved lr_scheduler_state has keys the live ExponentialLR lacks "
            "(step_size)") in caplog.text


def test_the_same_checks_run_on_a_legacy_pt_read_into_fresh_memory(saved_run, tmp_path):
    import xla_ckpt

    uri, _ = saved_run
    path = str(tmp_path / "legacy.pt")
    torch.save(xla_ckpt.load(uri), path)
    ck, model = fresh(REFUSED["sgd"][0])
    before = snapshot(model, ck.criterion)
    with pytest.raises(StateMismatchError) as e:
        ck.load_checkpoint(path)
    assert str(e.value) == refused(
        f"{path}: optimizer does not match the checkpoint: saved AdamW, live SGD; pass "
        "reset_optimizer=True to restore the weights with a fresh optimizer")
    assert_untouched(before, model, ck.criterion)
    # The way out the message names works, and then the weights are restored.
    ck.load_checkpoint(path, reset_optimizer=True)
    assert torch.equal(model.a.weight, saved_run[1].a.weight)


# ---- plain torch.save training dicts (C24) ------------------------------------------------


def mae_file(tmp_path, build=adamw, **extra):
    """The issue's input: MAE's ``{"model", "optimizer", "epoch", "args"}``."""
    model = Net(0)
    opt = build(model.parameters())
    _step(model, opt)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 5,
             "args": argparse.Namespace(lr=0.1, blr=1e-3), **extra}
    path = str(tmp_path / "mae_style.pt")
    torch.save(state, path)
    return path, model, opt


def test_a_plain_dict_restores_model_and_optimizer_with_nothing_made_up(tmp_path, caplog):
    path, model, opt = mae_file(tmp_path)
    ck, live = fresh(adamw, criterion=None)
    ck.criterion = None
    with caplog.at_level(logging.INFO, logger="xla_ckpt.trainer.checkpointer"):
        extra = ck.load_checkpoint(path)
    assert extra is not None
    assert sorted(extra) == ["args", "epoch"]  # no train_iterator made up (epoch 1 was wrong)
    assert extra["epoch"] == 5 and vars(extra["args"]) == {"lr": 0.1, "blr": 1e-3}
    assert type(extra["args"].lr) is float
    assert ck.get_num_updates() == 0 and ck._optim_history == []
    for k, v in model.state_dict().items():
        assert torch.equal(live.state_dict()[k], v)
    # The optimizer continues exactly: one more step on both is bitwise equal.
    _step(model, opt)
    _step(live, ck.optimizer)
    for a, b in zip(live.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert ("a plain torch.save training dict (no optimizer_history): restored the model and "
            "the optimizer from 'optimizer'; returned as saved in extra_state: epoch, args") \
        in logged
    assert "FairseqNAG" not in logged
    assert f"loaded checkpoint {path} (epoch 5 @ 0 updates)" in logged  # the file's own epoch


def test_a_plain_dict_with_a_cfg_dict_and_other_entries_returns_them_as_saved(tmp_path):
    path, model, _ = mae_file(tmp_path, cfg={"lr": 0.1, "epochs": [300]},
                              scaler={"scale": 65536.0}, lr_scheduler={"last_epoch": 3})
    ck, live = fresh(adamw, criterion=None)
    ck.criterion = None
    extra = ck.load_checkpoint(path)
    assert extra["cfg"] == {"lr": 0.1, "epochs": [300]}
    assert extra["scaler"] == {"scale": 65536.0} and extra["lr_scheduler"] == {"last_epoch": 3}
    assert torch.equal(live.b.bias, model.b.bias)


@pytest.mark.parametrize("live_build, named", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "amsgrad, betas, capturable"),
    (lambda p: torch.optim.Adam(p, lr=1e-2), "decoupled_weight_decay=True (torch.optim.AdamW)"),
])
def test_a_plain_dict_from_another_optimizer_class_is_refused_untouched(tmp_path, live_build,
                                                                         named):
    path, _, _ = mae_file(tmp_path)
    ck, live = fresh(live_build, criterion=None)
    ck.criterion = None
    before = snapshot(live)
    with pytest.raises(StateMismatchError) as e:
        ck.load_checkpoint(path)
    assert f"{path}: the saved optimizer state names no optimizer class" in str(e.value)
    assert named in str(e.value) and str(e.value).endswith(NOTHING_RESTORED)
    assert "FairseqNAG" not in str(e.value)
    assert_untouched(before, live)


def test_a_plain_dict_with_two_optimizer_states_is_ambiguous(tmp_path):
    model = Net(0)
    g, d = adamw(model.a.parameters()), adamw(model.b.parameters())
    path = str(tmp_path / "gan.pt")
    torch.save({"model": model.state_dict(), "opt_g": g.state_dict(), "opt_d": d.state_dict()},
               path)
    ck, live = fresh(adamw, criterion=None)
    ck.criterion = None
    before = snapshot(live)
    with pytest.raises(StateMismatchError, match="with 2 optimizer states \\(opt_g, opt_d\\): "
                                                 "which one is this optimizer's is ambiguous"):
        ck.load_checkpoint(path)
    assert_untouched(before, live)
    extra = ck.load_checkpoint(path, reset_optimizer=True)
    assert torch.equal(live.a.weight, model.a.weight) and "opt_g" not in extra


def test_a_dict_without_a_model_entry_names_its_keys(tmp_path):
    model = Net(0)
    path = str(tmp_path / "dino.pt")
    torch.save({"student": model.state_dict(), "teacher": model.state_dict(), "epoch": 7,
                "args": argparse.Namespace(lr=5e-4)}, path)
    ck, live = fresh(adamw)
    before = snapshot(live)
    with pytest.raises(StateMismatchError) as e:
        ck.load_checkpoint(path)
    assert str(e.value).startswith(f"{path}: not a trainer checkpoint: it holds keys args, "
                                   "epoch, student, teacher and no 'model' state_dict.")
    assert_untouched(before, live)


def test_a_genuine_old_fairseq_file_is_still_upgraded_on_the_trainer_path(tmp_path, caplog):
    model = Net(0)
    nag = {"state": {}, "param_groups": [{"lr": 0.25, "momentum": 0.99, "weight_decay": 0.0,
                                          "lr_old": 0.25, "params": [0, 1, 2, 3]}]}
    saved = {"args": argparse.Namespace(lr=0.25, arch="fconv"), "model": model.state_dict(),
             "optimizer": nag, "best_loss": 2.5, "epoch": 2, "batch_offset": 4,
             "val_loss": 2.75}
    path = str(tmp_path / "checkpoint2.pt")
    torch.save(saved, path)
    live = Net(7)
    ck = Checkpointer(model=live, build_optimizer=lambda p: torch.optim.SGD(
        p, lr=0.25, momentum=0.99, nesterov=True))
    with caplog.at_level(logging.INFO, logger="xla_ckpt.trainer.checkpointer"):
        extra = ck.load_checkpoint(path)
    assert extra is not None
    assert extra["train_iterator"] == {"epoch": 2, "iterations_in_epoch": 4}
    assert extra["val_loss"] == 2.75 and ck.get_num_updates() == 0
    assert torch.equal(live.a.weight, model.a.weight)
    assert ck.optimizer.param_groups[0]["nesterov"] is True
    logged = [r.getMessage() for r in caplog.records]
    assert any("old fairseq layout upgraded for the restore (the file is unchanged)" in m
               for m in logged)
    assert any(r.levelno == logging.WARNING and "'FairseqNAG' (the file names none; fairseq "
               "default)" in r.getMessage() for r in caplog.records)
    assert sorted(torch.load(path, weights_only=False)) == sorted(saved)  # file unchanged


def test_a_converted_plain_dict_is_checked_against_its_manifest_before_the_read(tmp_path):
    import xla_ckpt

    path, model, _ = mae_file(tmp_path)
    uri = str(tmp_path / "converted")
    xla_ckpt.save(xla_ckpt.load(path), uri)  # what `xla-ckpt convert` writes
    ck, live = fresh(lambda p: torch.optim.SGD(p, lr=0.1), criterion=None)
    ck.criterion = None
    before = snapshot(live)
    with pytest.raises(StateMismatchError, match="names no optimizer class") as e:
        ck.load_checkpoint(uri)
    assert str(e.value).endswith(NOTHING_RESTORED)
    assert_untouched(before, live)
    ok, live2 = fresh(adamw, criterion=None)
    ok.criterion = None
    extra = ok.load_checkpoint(uri)
    assert extra is not None and extra["epoch"] == 5
    assert torch.equal(live2.a.weight, model.a.weight)
    assert set(ok.optimizer.state_dict()["state"]) == {0, 1, 2, 3}
