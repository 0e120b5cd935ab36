"""A trainer restore builds its optimizer probe and checks the optimizer state once (issue 25
defect 3: the linear trainer-side work at 80,000 tensors), and leaves the garbage collector as
it found it.

The checks made on the manifest's records before the read serve the state the default
restorer read from that same item; a restorer that does not say which state it read from the
checked item gets every check again on the state it returns.
"""

import dataclasses
import gc

import pytest
import torch

import xla_ckpt.trainer.optimizer_state as optimizer_state_mod
import xla_ckpt.trainer.restore_state as restore_state_mod
from xla_ckpt.errors import StateMismatchError
from xla_ckpt.trainer import Checkpointer
from xla_ckpt.trainer.restore_checks import NOTHING_RESTORED
from xla_ckpt.trainer.sources import RestoreRequest, SingleProcessRestorer


class Net(torch.nn.Module):
    def __init__(self, seed: int, width: int = 4) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(3, width)
        self.b = torch.nn.Linear(width, 2)


class ScaledLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))


def one_group(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def two_groups(params):
    params = list(params)
    return torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}], lr=1e-2)


INPUTS = {  # the benchmark's kind (one group, no criterion) and one more of it
    "one_group": (one_group, False),
    "two_groups_with_criterion": (two_groups, True),
}


def saved(tmp_path, build, with_criterion):
    model = Net(0)
    crit = ScaledLoss() if with_criterion else None
    ck = Checkpointer(model=model, criterion=crit, build_optimizer=build)
    params = ck.live_parameters()
    for _ in range(2):
        loss = model.b(torch.relu(model.a(torch.ones(2, 3)))).sum()
        if crit is not None:
            loss = loss * crit.scale.sum()
        ck.optimizer.zero_grad()
        loss.backward()
        ck.optimizer.step()
        ck.set_num_updates(ck.get_num_updates() + 1)
    uri = str(tmp_path / "run" / "checkpoint_1_2")
    ck.save_checkpoint(uri, {})
    return uri, model.state_dict(), ck.optimizer.state_dict(), len(params)


@pytest.fixture
def counted(monkeypatch):
    """Counts of check_optimizer_state calls, wherever the restore makes them."""
    calls = {"check": 0}
    real = optimizer_state_mod.check_optimizer_state

    def counting(*args, **kwargs):
        calls["check"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(optimizer_state_mod, "check_optimizer_state", counting)
    monkeypatch.setattr(restore_state_mod, "check_optimizer_state", counting)
    return calls


def counting_build(build, calls):
    def wrapped(params):
        calls["build"] = calls.get("build", 0) + 1
        return build(params)
    return wrapped


def assert_restored(ck, model_state, opt_state):
    for k, v in model_state.items():
        assert torch.equal(ck.model.state_dict()[k], v), k
    got = ck.optimizer.state_dict()
    assert got["param_groups"] == opt_state["param_groups"]
    assert got["state"].keys() == opt_state["state"].keys()
    for pid, st in opt_state["state"].items():
        for name, v in st.items():
            assert torch.equal(got["state"][pid][name], v) and \
                got["state"][pid][name].dtype == v.dtype, (pid, name)


@pytest.mark.parametrize("case", sorted(INPUTS))
def test_the_default_restore_builds_and_checks_the_optimizer_once(tmp_path, counted, case):
    build, with_criterion = INPUTS[case]
    uri, model_state, opt_state, _ = saved(tmp_path, build, with_criterion)
    ck = Checkpointer(model=Net(7), criterion=ScaledLoss() if with_criterion else None,
                      build_optimizer=counting_build(build, counted))
    ck.load_checkpoint(uri)
    assert counted == {"check": 1, "build": 1}
    assert_restored(ck, model_state, opt_state)
    assert ck.get_num_updates() == 2


class _Unreported:
    """The trainer's targets, with the read never reported back (``read_back`` does nothing)."""

    def __init__(self, targets) -> None:
        self.targets = targets

    def __call__(self, item):
        return self.targets(item)

    def read_back(self, item, state) -> None:
        pass


class PlainTargetsRestorer:
    """Fills the trainer's targets but never reports the read back, so the restore cannot
    know which state was read from the item it checked."""

    def __init__(self) -> None:
        self.inner = SingleProcessRestorer()

    def __call__(self, request: RestoreRequest):
        targets = _Unreported(request.targets) if request.targets is not None else None
        return self.inner(dataclasses.replace(request, targets=targets))


@pytest.mark.parametrize("case", sorted(INPUTS))
def test_a_restorer_without_read_back_gets_every_check_again(tmp_path, counted, case):
    build, with_criterion = INPUTS[case]
    uri, model_state, opt_state, _ = saved(tmp_path, build, with_criterion)
    ck = Checkpointer(model=Net(7), criterion=ScaledLoss() if with_criterion else None,
                      build_optimizer=counting_build(build, counted),
                      restorer=PlainTargetsRestorer())
    ck.load_checkpoint(uri)
    assert counted == {"check": 2, "build": 2}  # on the records, then on the state read
    assert_restored(ck, model_state, opt_state)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_garbage_collector_is_left_as_it_was(tmp_path, enabled):
    uri, model_state, opt_state, _ = saved(tmp_path, one_group, False)
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        ck = Checkpointer(model=Net(7), build_optimizer=one_group)
        ck.load_checkpoint(uri)
        assert gc.isenabled() is enabled
        assert_restored(ck, model_state, opt_state)
        # and after a refusal (another architecture: a wider model)
        wide = Checkpointer(model=Net(7, width=5), build_optimizer=one_group)
        with pytest.raises(StateMismatchError) as e:
            wide.load_checkpoint(uri)
        assert "shape mismatch in a.weight (saved [4, 3], live [5, 3])" in str(e.value)
        assert str(e.value).endswith(NOTHING_RESTORED)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
