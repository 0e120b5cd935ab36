"""Checkpointer: every load_checkpoint flag and fairseq rule, asserted on values."""

import logging
import os

import numpy as np
import pytest
import torch
from trainer_utils import (
    BETAS,
    LR,
    WARMUP,
    TemperatureMSE,
    build_adamw,
    inverse_sqrt,
    make_checkpointer,
    refused,
    train_step,
)

import xla_ckpt
from xla_ckpt.errors import ConfigError, MetaTensorError, StateMismatchError
from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.io import CheckpointReader
from xla_ckpt.testing.asserts import assert_state_identical
from xla_ckpt.trainer import (
    Checkpointer,
    CheckpointerConfig,
    InverseSquareRootSchedule,
    Metrics,
    RestoredState,
    RestoreRequest,
    SingleProcessRestorer,
    TimeMeter,
)

ITER_MID_EPOCH = {"epoch": 2, "iterations_in_epoch": 3, "version": 2}


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def save_trained(uri: str, *, steps: int = 3, itr: dict | None = None, **kwargs) -> Checkpointer:
    ckpt = make_checkpointer(0, **kwargs)
    for s in range(steps):
        train_step(ckpt, s)
    ckpt.save_checkpoint(uri, {"train_iterator": dict(itr or ITER_MID_EPOCH),
                               "val_loss": np.float64(1.25)},
                         rank_extra_state={"rng": torch.get_rng_state()})
    return ckpt


def test_default_restore_brings_back_everything(local_dir):
    saved = save_trained(local_dir)
    fresh = make_checkpointer(7)
    extra = fresh.load_checkpoint(local_dir)
    sd, want = fresh.state_dict(), saved.state_dict()
    for key in ("model", "criterion", "last_optimizer_state", "args", "cfg"):
        assert_state_identical(sd[key], want[key], key)
    assert fresh.get_num_updates() == 3
    assert fresh.lr_scheduler.last_epoch == 3
    assert fresh.get_lr() == LR * inverse_sqrt(3)
    assert sorted(extra) == ["metrics", "previous_training_time", "rng", "train_iterator",
                             "val_loss"]
    assert extra["train_iterator"] == ITER_MID_EPOCH and type(extra["val_loss"]) is np.float64
    assert_state_identical(extra["rng"], want_rng(local_dir))
    assert fresh.rank_state.keys() == {"rng"}
    assert float(fresh.metrics.get_meter("train", "loss").sum) == \
        float(saved.metrics.get_meter("train", "loss").sum)
    assert len(fresh.state_dict()["optimizer_history"]) == 2  # the loaded entry + this one


def want_rng(uri: str) -> torch.Tensor:
    return xla_ckpt.load(uri, item="rank/00000")["rng"]


def test_save_writes_optimizer_history_and_metadata(local_dir):
    saved = save_trained(local_dir)
    state = xla_ckpt.load(local_dir)
    assert [sorted(h) for h in state["optimizer_history"]] == [
        ["criterion_name", "lr_scheduler_state", "num_updates", "optimizer_name"]]
    entry = state["optimizer_history"][0]
    assert (entry["criterion_name"], entry["optimizer_name"], entry["num_updates"]) == \
        ("TemperatureMSE", "AdamW", 3)
    assert entry["lr_scheduler_state"] == saved.lr_scheduler.state_dict()
    assert state["last_optimizer_state"]["param_groups"][0]["betas"] == BETAS
    assert CheckpointReader.open(local_dir).metadata == {
        "num_updates": 3, "epoch": 2, "iterations_in_epoch": 3, "loss": 1.25}


def test_extra_metadata_becomes_plain_numbers(local_dir):
    ckpt = make_checkpointer(0)
    ckpt.save_checkpoint(local_dir, {}, metadata={"best_loss": np.float32(0.5),
                                                  "loss": torch.tensor(2.0)})
    assert CheckpointReader.open(local_dir).metadata == {
        "num_updates": 0, "best_loss": 0.5, "loss": 2.0}


def test_reset_optimizer_keeps_a_fresh_optimizer_and_zero_updates(local_dir):
    saved = save_trained(local_dir)
    fresh = make_checkpointer(7)
    fresh.load_checkpoint(local_dir, reset_optimizer=True)
    assert_state_identical(fresh.state_dict()["model"], saved.state_dict()["model"])
    assert fresh.optimizer.state_dict()["state"] == {}
    assert fresh.get_num_updates() == 0  # fairseq sets num_updates only with the optimizer
    assert fresh.lr_scheduler.last_epoch == 0
    assert fresh.get_lr() == LR * inverse_sqrt(0)
    assert len(fresh._optim_history) == 1


def test_reset_lr_scheduler_loads_optimizer_but_starts_the_schedule_afresh(local_dir):
    saved = save_trained(local_dir)
    fresh = make_checkpointer(7)
    fresh.load_checkpoint(local_dir, reset_lr_scheduler=True)
    want = saved.optimizer.state_dict()
    got = fresh.optimizer.state_dict()
    assert_state_identical(got["state"], want["state"])
    assert fresh.lr_scheduler.last_epoch == 0
    assert fresh.get_lr() == LR * inverse_sqrt(0) != want["param_groups"][0]["lr"]
    assert fresh.get_num_updates() == 3


def test_optimizer_overrides_replace_param_group_values(local_dir):
    save_trained(local_dir)
    fresh = make_checkpointer(7)
    fresh.load_checkpoint(local_dir, optimizer_overrides={"lr": 0.5, "betas": (0.5, 0.6)})
    g = fresh.optimizer.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (0.5, (0.5, 0.6), 1e-7, 0.05)


def test_reset_meters_leaves_meters_unloaded(local_dir):
    save_trained(local_dir)
    fresh = make_checkpointer(7)
    fresh.load_checkpoint(local_dir, reset_meters=True)
    assert fresh.metrics.get_meters("train") is None
    assert "loss" not in fresh.metrics.get_meters("default")


@pytest.mark.parametrize("itr, loaded", [
    ({"epoch": 3, "iterations_in_epoch": 0, "version": 2}, False),  # epoch boundary
    ({"epoch": 3, "iterations_in_epoch": 0}, True),                 # version 1: no auto reset
    ({"epoch": 3, "iterations_in_epoch": 0, "version": 1}, True),
    ({"epoch": 2, "iterations_in_epoch": 3, "version": 2}, True),   # mid-epoch
])
def test_meters_reset_automatically_at_an_epoch_boundary(local_dir, itr, loaded):
    save_trained(local_dir, itr=itr)
    fresh = make_checkpointer(7)
    extra = fresh.load_checkpoint(local_dir)
    assert extra["train_iterator"] == itr
    assert (fresh.metrics.get_meters("train") is not None) is loaded


def test_time_meters_are_always_reset_other_meters_kept(local_dir):
    saved = save_trained(local_dir)
    assert saved.metrics.get_meter("train", "wps").n == 40
    fresh = make_checkpointer(7)
    fresh.load_checkpoint(local_dir)
    for agg in ("default", "train"):
        wps = fresh.metrics.get_meter(agg, "wps")
        assert type(wps) is TimeMeter and (wps.init, wps.n) == (0, 0)
    bsz = fresh.metrics.get_meter("train", "bsz")
    assert (type(bsz.sum), bsz.sum, bsz.count) == (np.float64, 12.0, 3)
    wall = fresh.metrics.get_meter("train", "train_wall")
    assert wall.sum == saved.metrics.get_meter("train", "train_wall").sum


class RecordingSchedule(InverseSquareRootSchedule):
    """fairseq's inverse_sqrt schedule that records how the trainer drives it."""

    def __init__(self, optimizer) -> None:
        super().__init__(optimizer, lr=LR, warmup_updates=WARMUP)
        self.calls: list[tuple] = []

    def step(self, epoch, val_loss=None):
        self.calls.append(("step", epoch, val_loss))
        return super().step(epoch, val_loss)

    def step_update(self, num_updates):
        self.calls.append(("step_update", num_updates))
        return super().step_update(num_updates)


def test_fairseq_scheduler_gets_lr_step_of_the_restored_epoch(local_dir):
    ckpt = make_checkpointer(0, build_lr_scheduler=RecordingSchedule)
    for s in range(5):
        train_step_fairseq(ckpt, s)
    ckpt.lr_scheduler.step(1, val_loss=0.75)  # end of epoch 1: best = 0.75
    ckpt.save_checkpoint(local_dir, {"train_iterator": {"epoch": 2, "iterations_in_epoch": 2,
                                                        "version": 2}})
    fresh = make_checkpointer(7, build_lr_scheduler=RecordingSchedule)
    fresh.load_checkpoint(local_dir)
    sched = fresh.lr_scheduler
    assert sched.calls == [("step_update", 0), ("step_update", 5), ("step", 2, None),
                           ("step_update", 5)]
    assert sched.best == 0.75
    assert fresh.get_lr() == LR * WARMUP ** 0.5 * 5 ** -0.5  # fairseq inverse_sqrt at 5
    assert fresh.metrics.get_meter("default", "lr").val == fresh.get_lr()


def train_step_fairseq(ckpt: Checkpointer, step: int) -> None:
    from trainer_utils import batch

    x, y = batch(step)
    assert ckpt.criterion is not None
    ckpt.optimizer.zero_grad()
    ckpt.criterion(ckpt.model(x), y).backward()
    ckpt.optimizer.step()
    ckpt.set_num_updates(ckpt.get_num_updates() + 1)  # fairseq: the schedule follows


def test_previous_training_time_restarts_the_wall_clock(local_dir):
    clock = Clock(1000.0)
    ckpt = make_checkpointer(0, clock=clock)
    clock.t = 1100.0
    ckpt.save_checkpoint(local_dir, {"train_iterator": ITER_MID_EPOCH})
    assert xla_ckpt.load(local_dir)["extra_state"]["previous_training_time"] == 100.0
    clock2 = Clock(5000.0)
    fresh = make_checkpointer(7, clock=clock2)
    clock2.t = 6000.0  # time before the restore does not count
    fresh.load_checkpoint(local_dir)
    assert fresh.cumulative_training_time() == 100.0
    clock2.t = 6007.5
    assert fresh.cumulative_training_time() == 107.5


def test_no_checkpoint_returns_none_and_logs(local_dir, caplog):
    fresh = make_checkpointer(7)
    before = fresh.state_dict()["model"]
    uri = os.path.join(local_dir, "checkpoint_last")
    with caplog.at_level(logging.INFO, logger="xla_ckpt.trainer.checkpointer"):
        assert fresh.load_checkpoint(uri) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"rank 0: no existing checkpoint found at {uri}"]
    assert fresh.get_num_updates() == 0 and fresh.rank_state is None
    assert_state_identical(fresh.state_dict()["model"], before)


def test_incomplete_checkpoint_counts_as_none_with_a_warning(local_dir, caplog):
    save_trained(local_dir)
    os.unlink(os.path.join(local_dir, MANIFEST_NAME))
    fresh = make_checkpointer(7)
    with caplog.at_level(logging.WARNING, logger="xla_ckpt.trainer.checkpointer"):
        assert fresh.load_checkpoint(local_dir) is None
    assert [r.getMessage() for r in caplog.records] == [
        (f"rank 0: ignoring {local_dir}: checkpoint is incomplete (no manifest.json commit "
         "marker); the save that wrote it did not finish. Restore an earlier checkpoint.; no "
         "existing checkpoint is used")]


def test_criterion_class_mismatch_names_both_and_suggests_reset(local_dir):
    save_trained(local_dir)

    class OtherMSE(TemperatureMSE):
        pass

    fresh = make_checkpointer(7)
    fresh.criterion = OtherMSE()
    with pytest.raises(StateMismatchError) as e:
        fresh.load_checkpoint(local_dir)
    assert str(e.value) == refused(
        f"{local_dir}: criterion does not match the checkpoint: saved TemperatureMSE, live "
        "OtherMSE; pass reset_optimizer=True to restore the weights with a fresh optimizer")
    fresh.load_checkpoint(local_dir, reset_optimizer=True)
    assert fresh.get_num_updates() == 0


def test_optimizer_class_mismatch_names_both_and_suggests_reset(local_dir):
    save_trained(local_dir)
    fresh = make_checkpointer(7)
    fresh.build_optimizer = lambda params: torch.optim.SGD(params, lr=0.1)
    fresh._optimizer = None
    with pytest.raises(StateMismatchError) as e:
        fresh.load_checkpoint(local_dir)
    assert str(e.value) == refused(
        f"{local_dir}: optimizer does not match the checkpoint: saved AdamW, live SGD; pass "
        "reset_optimizer=True to restore the weights with a fresh optimizer")


def test_model_mismatch_says_architectures_differ(local_dir):
    save_trained(local_dir)
    fresh = make_checkpointer(7)
    fresh.model.head = torch.nn.Linear(16, 8)
    with pytest.raises(StateMismatchError,
                       match=r"the architectures differ; shape mismatch in "
                             r"head.weight \(saved \[16, 16\], live \[8, 16\]\)"):
        fresh.load_checkpoint(local_dir)


def test_criterion_parameters_are_restored(local_dir):
    saved = save_trained(local_dir)
    assert isinstance(saved.criterion, TemperatureMSE)
    assert saved.criterion.log_temperature.item() != 0.0
    fresh = make_checkpointer(7)
    fresh.load_checkpoint(local_dir)
    assert fresh.criterion is not None
    assert_state_identical(fresh.criterion.state_dict(), saved.criterion.state_dict())


def test_no_save_optimizer_state_restores_weights_only(local_dir):
    saved = save_trained(local_dir, config=CheckpointerConfig(no_save_optimizer_state=True))
    assert "last_optimizer_state" not in xla_ckpt.load(local_dir)
    fresh = make_checkpointer(7)
    fresh.load_checkpoint(local_dir)
    assert_state_identical(fresh.state_dict()["model"], saved.state_dict()["model"])
    assert fresh.optimizer.state_dict()["state"] == {} and fresh.get_num_updates() == 0



def test_injected_restorer_and_per_rank_state(local_dir):
    source = make_checkpointer(0)
    train_step(source, 0)
    state = source.state_dict({"train_iterator": {"epoch": 1, "iterations_in_epoch": 9,
                                                  "version": 2}})
    xla_ckpt.save(state, local_dir, rank_states={
        0: {"train_iterator": {"epoch": 1, "iterations_in_epoch": 4, "version": 2}},
        1: {"train_iterator": {"epoch": 1, "iterations_in_epoch": 5, "version": 2}}})
    seen = []

    def restorer(request: RestoreRequest) -> RestoredState:
        seen.append(request.uri)
        return SingleProcessRestorer(rank=1)(request)

    fresh = make_checkpointer(7, restorer=restorer, rank=1)
    extra = fresh.load_checkpoint(local_dir)
    assert seen == [local_dir]
    assert extra["train_iterator"]["iterations_in_epoch"] == 5  # rank 1's own, not rank 0's
    assert fresh.rank_state == {"train_iterator": {"epoch": 1, "iterations_in_epoch": 5,
                                                   "version": 2}}
    assert fresh.get_num_updates() == 1


def test_load_state_applies_an_already_read_checkpoint(local_dir):
    saved = save_trained(local_dir)
    fresh = make_checkpointer(7)
    assert fresh.load_state(None, where=local_dir) is None
    extra = fresh.load_state(RestoredState(xla_ckpt.load(local_dir)), where=local_dir)
    assert extra["train_iterator"] == ITER_MID_EPOCH
    assert_state_identical(fresh.state_dict()["model"], saved.state_dict()["model"])
    with pytest.raises(TypeError, match=r"load_state: restored must be None or have \.state "
                                        r"and \.rank_state .*, got a tuple"):
        make_checkpointer(7).load_state((xla_ckpt.load(local_dir), None), where=local_dir)


def test_not_a_trainer_checkpoint(local_dir):
    xla_ckpt.save({"weights": torch.ones(2)}, local_dir)
    with pytest.raises(StateMismatchError) as e:
        make_checkpointer(7).load_checkpoint(local_dir)
    assert str(e.value) == refused(
        f"{local_dir}: not a trainer checkpoint: it holds keys weights and no 'model' "
        "state_dict. A Checkpointer restores fairseq's / its own layout or a torch.save dict "
        "with a 'model' entry (and at most one optimizer.state_dict()); load this one with "
        "xla_ckpt.load and pick its entries yourself (e.g. "
        "model.load_state_dict(state['student'])).")


def test_c11_meta_model_restores_through_the_checkpointer(local_dir):
    saved = save_trained(local_dir)
    torch.manual_seed(7)
    from trainer_utils import TinyTransformer

    with torch.device("meta"):
        model = TinyTransformer()
    fresh = Checkpointer(model=model, criterion=TemperatureMSE(), build_optimizer=build_adamw,
                         device="cpu")
    fresh.load_checkpoint(local_dir)
    assert not any(p.is_meta for p in model.parameters())
    assert_state_identical(fresh.state_dict()["model"], saved.state_dict()["model"])
    held = [p for g in fresh.optimizer.param_groups for p in g["params"]]
    assert all(a is b for a, b in zip(held, fresh.live_parameters(), strict=True))
    assert_state_identical(fresh.optimizer.state_dict()["state"],
                           saved.optimizer.state_dict()["state"])


def test_saving_a_meta_model_names_the_key(local_dir):
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    ckpt = Checkpointer(model=model, build_optimizer=build_adamw)
    with pytest.raises(MetaTensorError, match=r"tensor at state\['model'\]\['weight'\] is on the "
                                              r"meta device"):
        ckpt.save_checkpoint(local_dir)
    assert os.listdir(local_dir) == []


def test_wrapped_model_saves_and_restores_unprefixed_keys(local_dir):
    torch.manual_seed(0)
    ckpt = Checkpointer(model=torch.nn.DataParallel(torch.nn.Linear(2, 2)),
                        build_optimizer=build_adamw)
    ckpt.save_checkpoint(local_dir)
    saved = xla_ckpt.load(local_dir)["model"]
    assert list(saved) == ["weight", "bias"]
    wrapped = torch.nn.DataParallel(torch.nn.Linear(2, 2))
    fresh = Checkpointer(model=wrapped, build_optimizer=build_adamw)
    fresh.load_checkpoint(local_dir)
    assert_state_identical(dict(wrapped.module.state_dict()), dict(saved))


def test_constructor_checks():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="^build_optimizer: pass build_optimizer"):
        Checkpointer(model=model)
    opt = build_adamw(model.parameters())
    with pytest.raises(ConfigError, match="^build_lr_scheduler: the restore rebuilds"):
        Checkpointer(model=model, build_optimizer=build_adamw,
                     lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, inverse_sqrt))
    assert isinstance(Checkpointer(model=model, optimizer=opt).metrics, Metrics)
