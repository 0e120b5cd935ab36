"""Issue 15: fairseq checkpoints resume into torch optimizers and schedulers.

Each checkpoint is a ``.pt`` written with ``torch.save`` in the dict layout
fairseq's ``Trainer.state_dict`` writes (``args`` Namespace era, ``cfg`` dict era,
FP16 wrappers with ``loss_scale``, the oldest layout), restored through
``Checkpointer.load_checkpoint``.  The next optimizer step must equal, bitwise,
one taken after loading the same tensors by hand.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math

import pytest
import torch
from trainer_utils import refused

from xla_ckpt.config.sections import TrainConfig
from xla_ckpt.errors import ConfigError, StateMismatchError
from xla_ckpt.trainer import Checkpointer, CheckpointerConfig, InverseSquareRootSchedule

LR = 2e-4
NUM_UPDATES = 7
BETAS = (0.9, 0.98)
SAVED_CRITERION = "LabelSmoothedCrossEntropyCriterion"


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


def step_lr(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)


def linear_lr(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LinearLR:
    return torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, end_factor=1.0,
                                             total_iters=16)


def lr_after(build_sched, steps: int) -> float:
    """The learning rate an uninterrupted torch scheduler gives after ``steps`` steps."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = build_sched(opt)
    for _ in range(steps):
        opt.step()
        sched.step()
    return sched.get_last_lr()[0]


def adam_state(params, *, step=NUM_UPDATES, weight_decay=0.01, seed=1) -> dict:
    """fairseq ``fairseq.optim.adam.Adam.state_dict()``: int step, fp32 moments."""
    g = torch.Generator().manual_seed(seed)
    state = {i: {"step": step,
                 "exp_avg": torch.randn(p.shape, generator=g) * 1e-2,
                 "exp_avg_sq": torch.rand(p.shape, generator=g) * 1e-4}
             for i, p in enumerate(params)}
    return {"state": state, "param_groups": [{
        "lr": LR, "betas": BETAS, "eps": 1e-8, "weight_decay": weight_decay, "amsgrad": False,
        "adaptive_adam": False, "params": list(range(len(params)))}]}


def fairseq_file(path, model, *, era: str, optimizer_name: str, optim_state: dict,
                 optimizer: str = "adam", lr_scheduler_state=None, fp16: bool = False) -> dict:
    """A fairseq Trainer checkpoint: ``args`` (Namespace era) or ``cfg`` (dict era)."""
    weights = {k: (v.half() if fp16 else v).clone() for k, v in model.state_dict().items()}
    if era == "none":  # neither says which optimizer a wrapper holds
        args = cfg = None
    elif era == "args":
        args = argparse.Namespace(arch="tiny", task="translation", optimizer=optimizer,
                                  lr=[LR], lr_scheduler="inverse_sqrt", fp16=fp16,
                                  criterion="label_smoothed_cross_entropy")
        cfg = None
    else:
        args = None
        cfg = {"common": {"fp16": fp16}, "optimizer": {"_name": optimizer, "lr": [LR]},
               "lr_scheduler": {"_name": "inverse_sqrt", "warmup_updates": 4000}}
    state = {
        "args": args, "cfg": cfg, "model": weights, "criterion": None,
        "optimizer_history": [{
            "criterion_name": SAVED_CRITERION, "optimizer_name": optimizer_name,
            "lr_scheduler_state": ({"best": 2.5} if lr_scheduler_state is None
                                   else lr_scheduler_state),
            "num_updates": NUM_UPDATES}],
        "task_state": {},
        "extra_state": {"metrics": {}, "previous_training_time": 12.5, "val_loss": 2.5,
                        "train_iterator": {"epoch": 2, "iterations_in_epoch": 3, "version": 2}},
        "last_optimizer_state": optim_state,
    }
    torch.save(state, path)
    return state


def live(build_optimizer, build_lr_scheduler=step_lr, *, criterion="ce", **kwargs):
    crit = torch.nn.CrossEntropyLoss() if criterion == "ce" else criterion
    return Checkpointer(model=make_model(seed=9), criterion=crit, build_optimizer=build_optimizer,
                        build_lr_scheduler=build_lr_scheduler, **kwargs)


def by_hand(saved: dict, build_optimizer, optim_state: dict, lr: float):
    """The same tensors loaded with plain ``optimizer.load_state_dict``, at the schedule's lr."""
    model = make_model(seed=9)
    model.load_state_dict(saved["model"])
    opt = build_optimizer(list(model.parameters()))
    opt.load_state_dict(copy.deepcopy(optim_state))
    for group in opt.param_groups:
        group["lr"] = lr
    return model, opt


def one_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    g = torch.Generator().manual_seed(77)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def assert_same_next_step(ckpt: Checkpointer, model: torch.nn.Module,
                          opt: torch.optim.Optimizer) -> None:
    one_step(ckpt.model, ckpt.optimizer)
    one_step(model, opt)
    for (name, a), b in zip(ckpt.model.state_dict().items(), model.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    live_state, hand_state = ckpt.optimizer.state_dict(), opt.state_dict()
    assert live_state["state"].keys() == hand_state["state"].keys()
    for pid, st in live_state["state"].items():
        assert st.keys() == hand_state["state"][pid].keys()
        for k, v in st.items():
            assert torch.equal(v, hand_state["state"][pid][k]), (pid, k)
            assert v.dtype == hand_state["state"][pid][k].dtype


def adamw(params):
    return torch.optim.AdamW(params, lr=LR)


@pytest.mark.parametrize("era", ["args", "cfg"])
def test_fairseq_adam_resumes_into_adamw_and_steplr(tmp_path, caplog, era):
    path = str(tmp_path / "checkpoint_last.pt")
    optim_state = adam_state(list(make_model().parameters()))
    saved = fairseq_file(path, make_model(), era=era, optimizer_name="FairseqAdam",
                         optim_state=optim_state)
    ckpt = live(adamw)
    with caplog.at_level(logging.WARNING, logger="xla_ckpt.trainer.checkpointer"):
        extra = ckpt.load_checkpoint(path)

    assert ckpt.get_num_updates() == NUM_UPDATES
    assert extra["train_iterator"] == {"epoch": 2, "iterations_in_epoch": 3, "version": 2}
    assert (extra["val_loss"], extra["previous_training_time"]) == (2.5, 12.5)
    assert "loss_scale" not in extra
    factor = 1 / math.sqrt(1 - BETAS[1] ** (NUM_UPDATES + 1))
    assert [r.getMessage() for r in caplog.records] == [(
        f"rank 0: {path}: criterion does not match the checkpoint: saved {SAVED_CRITERION}, live "
        "CrossEntropyLoss; the live criterion has no parameters, so no criterion state is "
        "restored and training continues (criterion_check='warn'; 'strict' refuses, 'off' skips "
        "the check)"), (
        f"rank 0: {path}: FairseqAdam state restored exactly into torch.optim.AdamW, but the "
        "update rule differs: fairseq adds eps before the bias correction, torch after it, so "
        "the next steps equal fairseq's with eps / sqrt(1 - beta2**t) in place of eps "
        f"(x{factor:.4g} at the next step, t=8, with beta2=0.98; it tends to 1 as t grows); "
        "this matters only where sqrt(exp_avg_sq) is not much larger than eps")]
    # the schedule continues at last_epoch = num_updates
    sched = ckpt.lr_scheduler
    assert (sched.last_epoch, sched.get_last_lr()) == (NUM_UPDATES, [lr_after(step_lr, 7)])
    assert ckpt.optimizer.param_groups[0]["lr"] == lr_after(step_lr, 7) == LR * 0.5
    group = ckpt.optimizer.param_groups[0]
    assert (group["betas"], group["weight_decay"], group["decoupled_weight_decay"]) == \
        (BETAS, 0.01, True)

    model, opt = by_hand(saved, adamw, optim_state, lr_after(step_lr, 7))
    assert_same_next_step(ckpt, model, opt)
    sched.step()
    assert sched.get_last_lr() == [lr_after(step_lr, 8)] == [LR * 0.25]


def test_fairseq_adam_with_weight_decay_into_torch_adam_decays_like_adamw(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    optim_state = adam_state(list(make_model().parameters()), weight_decay=0.1)
    saved = fairseq_file(path, make_model(), era="cfg", optimizer_name="FairseqAdam",
                         optim_state=optim_state)
    ckpt = live(lambda ps: torch.optim.Adam(ps, lr=LR), criterion=None)
    ckpt.load_checkpoint(path)  # criterion None vs saved LabelSmoothed...: "warn" passes
    assert ckpt.optimizer.param_groups[0]["decoupled_weight_decay"] is True
    # fairseq's Adam is AdamW: the same step as an AdamW loaded by hand
    model, opt = by_hand(saved, adamw, optim_state, lr_after(step_lr, 7))
    assert_same_next_step(ckpt, model, opt)


def split_flat(flat_state: dict, params) -> dict:
    """FP16Optimizer's flat fp32 state split per parameter, by hand."""
    st, offset, state = flat_state["state"][0], 0, {}
    for i, p in enumerate(params):
        n = p.numel()
        state[i] = {"step": st["step"], "exp_avg": st["exp_avg"][offset:offset + n].view(p.shape),
                    "exp_avg_sq": st["exp_avg_sq"][offset:offset + n].view(p.shape)}
        offset += n
    group = dict(flat_state["param_groups"][0], params=list(range(len(params))))
    return {"state": state, "param_groups": [group]}


@pytest.mark.parametrize("era", ["args", "cfg", "none"])
def test_fp16_optimizer_flat_fp32_state_is_split_and_loss_scale_kept(tmp_path, era):
    path = str(tmp_path / "checkpoint_last.pt")
    params = list(make_model().parameters())
    total = sum(p.numel() for p in params)
    g = torch.Generator().manual_seed(3)
    flat = {"state": {0: {"step": NUM_UPDATES, "exp_avg": torch.randn(total, generator=g) * 1e-2,
                          "exp_avg_sq": torch.rand(total, generator=g) * 1e-4}},
            "param_groups": [{"lr": LR, "betas": BETAS, "eps": 1e-8, "weight_decay": 0.01,
                              "amsgrad": False, "params": [0]}],
            "loss_scale": 128.0}
    saved = fairseq_file(path, make_model(), era=era, optimizer_name="FP16Optimizer",
                         optim_state=flat, fp16=True)
    ckpt = live(adamw, linear_lr)
    extra = ckpt.load_checkpoint(path)

    assert (type(extra["loss_scale"]), extra["loss_scale"]) == (float, 128.0)
    assert ckpt.get_num_updates() == NUM_UPDATES
    assert ckpt.model[0].weight.dtype == torch.float32  # fp16 weights widened, as fairseq does
    # LinearLR's closed form at last_epoch = num_updates (a chain of 7 step() calls rounds
    # differently in the last bit)
    closed_form = LR * (0.25 + (1.0 - 0.25) * min(16, NUM_UPDATES) / 16)
    assert ckpt.lr_scheduler.get_last_lr() == [closed_form]
    assert closed_form == pytest.approx(lr_after(linear_lr, 7), rel=1e-12)
    model, opt = by_hand(saved, adamw, split_flat(flat, params), closed_form)
    assert_same_next_step(ckpt, model, opt)


def test_memory_efficient_fp16_keeps_fp32_moments_and_loss_scale(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    optim_state = adam_state(list(make_model().parameters()))
    optim_state["loss_scale"] = 64.0
    saved = fairseq_file(path, make_model(), era="args",
                         optimizer_name="MemoryEfficientFP16Optimizer", optim_state=optim_state,
                         fp16=True)
    ckpt = live(adamw)
    extra = ckpt.load_checkpoint(path)
    assert extra["loss_scale"] == 64.0
    assert {v.dtype for st in ckpt.optimizer.state.values() for k, v in st.items()
            if k != "step"} == {torch.float32}
    hand = {k: v for k, v in optim_state.items() if k != "loss_scale"}
    model, opt = by_hand(saved, adamw, hand, lr_after(step_lr, 7))
    assert_same_next_step(ckpt, model, opt)


def nag_state(params, *, lr_old=LR, weight_decay=0.0) -> dict:
    g = torch.Generator().manual_seed(5)
    return {"state": {i: {"momentum_buffer": torch.randn(p.shape, generator=g) * 1e-3}
                      for i, p in enumerate(params)},
            "param_groups": [{"lr": LR, "lr_old": lr_old, "momentum": 0.99,
                              "weight_decay": weight_decay, "params": list(range(len(params)))}]}


def nesterov_sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.5, nesterov=True)


def test_fairseq_nag_resumes_into_nesterov_sgd(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    params = list(make_model().parameters())
    optim_state = nag_state(params, lr_old=4e-4)
    saved = fairseq_file(path, make_model(), era="args", optimizer_name="FairseqNAG",
                         optimizer="nag", optim_state=optim_state)
    ckpt = live(nesterov_sgd)
    ckpt.load_checkpoint(path)
    group = ckpt.optimizer.param_groups[0]
    assert (group["momentum"], group["nesterov"], group["dampening"], "lr_old" in group) == \
        (0.99, True, 0.0, False)
    # by hand: fairseq keeps the buffer scaled by -lr_old; torch in gradient units
    hand = {"state": {i: {"momentum_buffer": st["momentum_buffer"] / -4e-4}
                      for i, st in optim_state["state"].items()},
            "param_groups": [{"lr": LR, "momentum": 0.99, "weight_decay": 0.0, "nesterov": True,
                              "dampening": 0.0, "params": list(range(len(params)))}]}
    model, opt = by_hand(saved, nesterov_sgd, hand, lr_after(step_lr, 7))
    before = [p.detach().clone() for p in model.parameters()]
    assert_same_next_step(ckpt, model, opt)

    # and the torch step is fairseq's NAG step: p += m^2 buf - (1 + m) lr g (lr / lr_old scaling)
    lr, m = lr_after(step_lr, 7), 0.99
    ref = make_model(seed=9)
    ref.load_state_dict(saved["model"])
    ref.zero_grad()
    g = torch.Generator().manual_seed(77)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    for p0, p, pid in zip(before, ckpt.model.parameters(), range(len(params)), strict=True):
        buf = optim_state["state"][pid]["momentum_buffer"] * (lr / 4e-4)
        grad = list(ref.parameters())[pid].grad
        assert grad is not None
        expected = p0 + m * m * buf - (1 + m) * lr * grad
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-9)


def test_fairseq_nag_with_weight_decay_is_refused_naming_the_key(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    fairseq_file(path, make_model(), era="args", optimizer_name="FairseqNAG", optimizer="nag",
                 optim_state=nag_state(list(make_model().parameters()), weight_decay=1e-4))
    with pytest.raises(StateMismatchError) as e:
        live(nesterov_sgd).load_checkpoint(path)
    assert str(e.value) == refused(
        f"{path}: param group 0 of the saved fairseq NAG has weight_decay=0.0001: NAG decays "
        "weights decoupled (p *= 1 - lr*wd), torch's SGD as an L2 term in the momentum, so the "
        "next step would differ (key 'weight_decay'); pass reset_optimizer=True to restore the "
        "weights with a fresh optimizer")


def test_oldest_layout_upgrades_to_fairseq_nag_and_cross_entropy_criterion(tmp_path):
    """No optimizer_history: the upgrade names FairseqNAG / CrossEntropyCriterion."""
    path = str(tmp_path / "checkpoint_old.pt")
    params = list(make_model().parameters())
    optim_state = nag_state(params)
    model = make_model()
    torch.save({"model": model.state_dict(), "optimizer": optim_state, "best_loss": 3.0,
                "epoch": 4, "batch_offset": 0, "val_loss": 3.0,
                "args": argparse.Namespace(arch="fconv", optimizer="nag", lr=LR)}, path)
    ckpt = live(nesterov_sgd)
    extra = ckpt.load_checkpoint(path)
    assert ckpt.get_num_updates() == 0
    assert extra["train_iterator"]["epoch"] == 4
    assert ckpt.lr_scheduler.last_epoch == 0
    hand = {"state": {i: {"momentum_buffer": st["momentum_buffer"] / -LR}
                      for i, st in optim_state["state"].items()},
            "param_groups": [{"lr": LR, "momentum": 0.99, "weight_decay": 0.0, "nesterov": True,
                              "dampening": 0.0, "params": list(range(len(params)))}]}
    m, opt = by_hand({"model": model.state_dict()}, nesterov_sgd, hand, LR)
    assert_same_next_step(ckpt, m, opt)


def test_lambdalr_against_a_fairseq_scheduler_state_is_one_clear_error(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    fairseq_file(path, make_model(), era="cfg", optimizer_name="FairseqAdam",
                 optim_state=adam_state(list(make_model().parameters())))
    ckpt = live(adamw, lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    with pytest.raises(StateMismatchError) as e:
        ckpt.load_checkpoint(path)
    assert str(e.value) == refused(
        f"{path}: lr_scheduler does not match the checkpoint: live LambdaLR needs keys "
        "['_get_lr_called_within_step', '_is_initial', '_last_lr', '_step_count', 'base_lrs', "
        "'last_epoch', 'lr_lambdas'] that the saved lr_scheduler_state lacks (extra saved keys: "
        "['best']); a fairseq lr_scheduler_state (keys ['best']; fairseq schedules are functions "
        "of num_updates) maps only onto a fairseq-style scheduler "
        "(xla_ckpt.trainer.InverseSquareRootSchedule, FairseqLRScheduler) or a closed-form torch "
        "scheduler (StepLR, MultiStepLR, ConstantLR, LinearLR, ExponentialLR, PolynomialLR, "
        "CosineAnnealingLR, ReduceLROnPlateau); pass reset_lr_scheduler=True to keep the fresh "
        "lr_scheduler")
    # the way out it names works: the optimizer state still restores
    ckpt.load_checkpoint(path, reset_lr_scheduler=True)
    assert ckpt.get_num_updates() == NUM_UPDATES
    assert torch.equal(ckpt.optimizer.state[ckpt.model[0].weight]["exp_avg"],
                       adam_state(list(make_model().parameters()))["state"][0]["exp_avg"])


def test_fairseq_fixed_schedule_state_into_reduce_lr_on_plateau_and_fairseq_style(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    fairseq_file(path, make_model(), era="cfg", optimizer_name="FairseqAdam",
                 optim_state=adam_state(list(make_model().parameters())),
                 lr_scheduler_state={"best": 1.25, "last_epoch": 3})
    ckpt = live(adamw, lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    ckpt.load_checkpoint(path)
    assert (ckpt.lr_scheduler.best, ckpt.lr_scheduler.last_epoch) == (1.25, 3)
    assert ckpt.optimizer.param_groups[0]["lr"] == LR  # plateau keeps the saved lr

    fairseq_file(path, make_model(), era="cfg", optimizer_name="FairseqAdam",
                 optim_state=adam_state(list(make_model().parameters())),
                 lr_scheduler_state={"lr": [LR]})  # fairseq's "fixed" schedule saves its lr
    ckpt = live(adamw, lambda opt: InverseSquareRootSchedule(opt, 1e-3, warmup_updates=4))
    ckpt.load_checkpoint(path)
    assert ckpt.lr_scheduler.best is None
    assert ckpt.get_lr() == pytest.approx(1e-3 * (4 / NUM_UPDATES) ** 0.5)


@pytest.mark.parametrize("mode", ["strict", "warn", "off"])
def test_criterion_check_modes(tmp_path, caplog, mode):
    path = str(tmp_path / "checkpoint_last.pt")
    fairseq_file(path, make_model(), era="cfg", optimizer_name="FairseqAdam",
                 optim_state=adam_state(list(make_model().parameters())))
    ckpt = live(adamw, criterion_check=mode)
    message = (f"{path}: criterion does not match the checkpoint: saved {SAVED_CRITERION}, live "
               "CrossEntropyLoss; pass reset_optimizer=True to restore the weights with a fresh "
               "optimizer")
    with caplog.at_level(logging.WARNING, logger="xla_ckpt.trainer.checkpointer"):
        if mode == "strict":
            with pytest.raises(StateMismatchError) as e:
                ckpt.load_checkpoint(path)
            assert str(e.value) == refused(message)
            return
        ckpt.load_checkpoint(path)
    assert ckpt.get_num_updates() == NUM_UPDATES
    warned = [r.getMessage() for r in caplog.records if "criterion does not match" in r.message]
    assert len(warned) == (1 if mode == "warn" else 0)


def test_criterion_with_parameters_stays_strict_under_warn_but_not_off(tmp_path):
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(()))

    path = str(tmp_path / "checkpoint_last.pt")
    state = fairseq_file(path, make_model(), era="cfg", optimizer_name="FairseqAdam",
                         optim_state=adam_state(list(make_model().parameters())))
    state["criterion"] = {"scale": torch.tensor(2.0)}
    torch.save(state, path)

    def with_crit(params):  # the criterion's parameter in its own group: not in the checkpoint
        return torch.optim.AdamW(params[:4], lr=LR)

    ckpt = live(with_crit, criterion=Scaled())
    with pytest.raises(StateMismatchError, match="criterion does not match the checkpoint: "
                                                 f"saved {SAVED_CRITERION}, live Scaled; pass "):
        ckpt.load_checkpoint(path)
    ckpt = live(with_crit, criterion=Scaled(), criterion_check="off")
    ckpt.load_checkpoint(path)
    assert ckpt.criterion.scale.item() == 2.0


@pytest.mark.parametrize(("name", "reason"), [
    ("FairseqAdafactor", ("torch.optim.Adafactor's update differs from fairseq's (eps clamps "
                          "instead of adding, no beta1, no scale_parameter=False), so its next "
                          "step would not continue this state")),
    ("FairseqAdamax", ("torch.optim.Adamax takes eps inside the max and decays weights as L2; "
                       "fairseq's adds eps to the denominator and decays them AdamW-style")),
])
def test_fairseq_optimizers_without_an_exact_torch_counterpart_are_refused(tmp_path, name,
                                                                           reason):
    path = str(tmp_path / "checkpoint_last.pt")
    fairseq_file(path, make_model(), era="cfg", optimizer_name=name,
                 optim_state=adam_state(list(make_model().parameters())))
    with pytest.raises(StateMismatchError) as e:
        live(adamw).load_checkpoint(path)
    assert str(e.value) == refused(
        f"{path}: the checkpoint's optimizer {name} cannot continue in torch: {reason}; pass "
        "reset_optimizer=True to restore the weights with a fresh optimizer")


def test_a_state_key_that_cannot_map_names_the_key_and_reset_optimizer(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    optim_state = adam_state(list(make_model().parameters()))
    optim_state["param_groups"][0]["adaptive_adam"] = True
    fairseq_file(path, make_model(), era="cfg", optimizer_name="FairseqAdam",
                 optim_state=optim_state)
    with pytest.raises(StateMismatchError) as e:
        live(adamw).load_checkpoint(path)
    assert str(e.value) == refused(
        f"{path}: param group 0 of the saved fairseq Adam has adaptive_adam=True (fairseq's "
        "per-row weight decay); torch's Adam/AdamW cannot continue it (key 'adaptive_adam'); "
        "pass reset_optimizer=True to restore the weights with a fresh optimizer")


def test_a_live_optimizer_outside_the_map_names_what_the_saved_one_maps_to(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    fairseq_file(path, make_model(), era="cfg", optimizer_name="FairseqAdam",
                 optim_state=adam_state(list(make_model().parameters())))
    with pytest.raises(StateMismatchError) as e:
        live(nesterov_sgd).load_checkpoint(path)
    assert str(e.value) == refused(
        f"{path}: optimizer does not match the checkpoint: saved FairseqAdam, live SGD; "
        "fairseq's FairseqAdam restores into torch.optim.AdamW or torch.optim.Adam; build one "
        "of those or pass reset_optimizer=True to restore the weights with a fresh optimizer")


def test_fairseq_compat_off_keeps_fairseqs_exact_name_rule(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    fairseq_file(path, make_model(), era="cfg", optimizer_name="FairseqAdam",
                 optim_state=adam_state(list(make_model().parameters())))
    ckpt = live(adamw, config=CheckpointerConfig(fairseq_compat=False))
    with pytest.raises(StateMismatchError) as e:
        ckpt.load_checkpoint(path)
    assert str(e.value) == refused(
        f"{path}: optimizer does not match the checkpoint: saved FairseqAdam, live AdamW; pass "
        "reset_optimizer=True to restore the weights with a fresh optimizer")


def test_criterion_check_and_fairseq_compat_are_validated_config_fields():
    assert (TrainConfig().criterion_check, TrainConfig().fairseq_compat) == ("warn", True)
    assert (CheckpointerConfig().criterion_check, CheckpointerConfig().fairseq_compat) == \
        ("warn", True)
    with pytest.raises(ConfigError, match=r"^train\.criterion_check must be one of strict, warn, "
                                          r"off; got 'loose'$"):
        TrainConfig(criterion_check="loose")  # type: ignore[arg-type]  # the wrong value tested
    with pytest.raises(ConfigError, match=r"^criterion_check: must be one of strict, warn, off, "
                                          r"got 'loose'$"):
        CheckpointerConfig(criterion_check="loose")
    with pytest.raises(ConfigError, match=r"^fairseq_compat: must be true or false"):
        CheckpointerConfig(fairseq_compat=1)  # type: ignore[arg-type]  # the wrong value tested


def test_flat_fp32_state_that_does_not_cover_the_live_parameters_is_refused(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    flat = {"state": {0: {"step": 3, "exp_avg": torch.zeros(10), "exp_avg_sq": torch.zeros(10)}},
            "param_groups": [{"lr": LR, "betas": BETAS, "eps": 1e-8, "weight_decay": 0.0,
                              "params": [0]}], "loss_scale": 8.0}
    fairseq_file(path, make_model(), era="cfg", optimizer_name="FP16Optimizer",
                 optim_state=flat, fp16=True)
    with pytest.raises(StateMismatchError) as e:
        live(adamw).load_checkpoint(path)
    assert str(e.value) == refused(
        f"{path}: the saved optimizer holds 1 parameter(s) and the live one 4; a fairseq "
        "FP16Optimizer's flat fp32 state is split only when it is 1-D, in one param group, and "
        "its 10 elements equal the live parameters' 51; pass reset_optimizer=True to restore "
        "the weights with a fresh optimizer")


def test_fused_adam_fp16_stats_are_unscaled_to_fp32(tmp_path):
    """FusedAdamV1 (fairseq's Adam on CUDA) with --fp16-adam-stats: fp16 moments plus a scale."""
    path = str(tmp_path / "checkpoint_last.pt")
    params = list(make_model().parameters())
    g = torch.Generator().manual_seed(4)
    state: dict[int, dict] = {i: {
                 "step": NUM_UPDATES,
                 "exp_avg": (torch.randn(p.shape, generator=g) * 1e-2).half(),
                 "exp_avg_sq": (torch.rand(p.shape, generator=g) * 1e-2).half(),
                 "exp_avg_scale": 0.5, "exp_avg_sq_scale": 0.25} for i, p in enumerate(params)}
    optim_state = {"state": state, "param_groups": [{
        "lr": LR, "bias_correction": True, "betas": BETAS, "eps": 1e-8, "weight_decay": 0.0,
        "max_grad_norm": 0.0, "params": list(range(len(params)))}]}
    fairseq_file(path, make_model(), era="cfg", optimizer_name="FairseqAdam",
                 optim_state=optim_state)
    ckpt = live(adamw)
    ckpt.load_checkpoint(path)
    for i, p in enumerate(ckpt.model.parameters()):
        st = ckpt.optimizer.state[p]
        assert torch.equal(st["exp_avg"], state[i]["exp_avg"].float() * 0.5)
        assert torch.equal(st["exp_avg_sq"], state[i]["exp_avg_sq"].float() * 0.25)
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
        assert st["step"].item() == NUM_UPDATES


def test_fairseq_sgd_is_torch_sgd_and_restores_by_name(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    params = list(make_model().parameters())
    sgd_state = {"state": {i: {"momentum_buffer": torch.full(p.shape, 0.5)}
                           for i, p in enumerate(params)},
                 "param_groups": [{"lr": LR, "momentum": 0.9, "dampening": 0, "weight_decay": 0,
                                   "nesterov": False, "params": list(range(len(params)))}]}
    saved = fairseq_file(path, make_model(), era="args", optimizer_name="SGD", optimizer="sgd",
                         optim_state=sgd_state)

    def sgd(ps):
        return torch.optim.SGD(ps, lr=LR, momentum=0.9)

    ckpt = live(sgd, lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20))
    ckpt.load_checkpoint(path)
    sched = ckpt.lr_scheduler
    assert sched.last_epoch == NUM_UPDATES
    closed_form = LR * (1 + math.cos(math.pi * NUM_UPDATES / 20)) / 2
    assert sched.get_last_lr() == [pytest.approx(closed_form, rel=1e-12)]
    model, opt = by_hand(saved, sgd, sgd_state, sched.get_last_lr()[0])
    assert_same_next_step(ckpt, model, opt)


def test_fp16_optimizer_saved_before_its_first_step_restores_an_empty_state(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    flat = {"state": {}, "param_groups": [{"lr": LR, "betas": BETAS, "eps": 1e-8,
                                           "weight_decay": 0.01, "amsgrad": False,
                                           "params": [0]}], "loss_scale": 128.0}
    fairseq_file(path, make_model(), era="cfg", optimizer_name="FP16Optimizer",
                 optim_state=flat, fp16=True)
    ckpt = live(adamw)
    extra = ckpt.load_checkpoint(path)

    assert extra["loss_scale"] == 128.0
    assert ckpt.optimizer.state_dict()["state"] == {}
    groups = ckpt.optimizer.param_groups
    assert len(groups) == 1 and len(groups[0]["params"]) == 4
    assert (groups[0]["betas"], groups[0]["eps"], groups[0]["weight_decay"]) == (BETAS, 1e-8, 0.01)


def test_fairseq_state_keys_no_param_group_lists_are_refused(tmp_path):
    path = str(tmp_path / "checkpoint_last.pt")
    params = list(make_model().parameters())
    optim_state = adam_state(params)
    optim_state["state"] = {str(k): v for k, v in optim_state["state"].items()}
    fairseq_file(path, make_model(), era="cfg", optimizer_name="FairseqAdam",
                 optim_state=optim_state)
    with pytest.raises(StateMismatchError) as e:
        live(adamw).load_checkpoint(path)
    assert str(e.value).startswith(
        f"{path}: the saved optimizer state holds 4 key(s) that no saved param group lists "
        "('0', '1', '2', '3'; the param groups list [0, 1, 2, 3]); their state would be "
        "silently dropped.")


def test_fairseq_adam_update_rule_differs_from_torch_exactly_by_the_eps_placement():
    """The documented difference, as numbers: fairseq's Adam step (fairseq/optim/adam.py) on
    the restored state equals torch AdamW's step with eps / sqrt(1 - beta2**t), not with eps."""
    torch.manual_seed(0)
    t, lr, (b1, b2), eps = NUM_UPDATES, 1e-3, BETAS, 1e-3  # a large eps makes it visible
    p0 = torch.randn(64, dtype=torch.float64)
    grad = torch.randn(64, dtype=torch.float64) * 1e-3
    m0 = torch.randn(64, dtype=torch.float64) * 1e-3
    v0 = torch.rand(64, dtype=torch.float64) * 1e-6

    m = m0 * b1 + (1 - b1) * grad
    v = v0 * b2 + (1 - b2) * grad * grad
    fairseq_p = p0 - lr * math.sqrt(1 - b2 ** (t + 1)) / (1 - b1 ** (t + 1)) * m / (v.sqrt() + eps)

    def torch_step(eps_used: float) -> torch.Tensor:
        p = torch.nn.Parameter(p0.clone())
        opt = torch.optim.AdamW([p], lr=lr, betas=(b1, b2), eps=eps_used, weight_decay=0.0)
        opt.load_state_dict({"state": {0: {"step": torch.tensor(float(t)), "exp_avg": m0.clone(),
                                           "exp_avg_sq": v0.clone()}},
                             "param_groups": [{**opt.state_dict()["param_groups"][0],
                                               "params": [0]}]})
        p.grad = grad.clone()
        opt.step()
        return p.detach()

    assert not torch.allclose(torch_step(eps), fairseq_p, rtol=1e-6, atol=0)
    assert torch.allclose(torch_step(eps / math.sqrt(1 - b2 ** (t + 1))), fairseq_p, rtol=1e-12,
                          atol=0)
