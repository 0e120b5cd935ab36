"""Optimizer state onto the live parameters (C5 on CPU) and optimizer-state dtypes (C10)."""

from typing import Any

import pytest
import torch
from trainer_utils import refused

import xla_ckpt
from xla_ckpt.errors import StateMismatchError
from xla_ckpt.testing.asserts import assert_state_identical, tensors_identical
from xla_ckpt.trainer import Checkpointer, CheckpointerConfig, load_optimizer_state


def adam(params):
    return torch.optim.Adam(params, lr=0.1, betas=(0.8, 0.9))


def one_step(model: torch.nn.Linear, optimizer: torch.optim.Optimizer, k: int) -> None:
    g = torch.Generator().manual_seed(k)
    x = torch.randn(3, model.in_features, generator=g).to(model.weight.dtype)
    optimizer.zero_grad()
    model(x).float().pow(2).sum().backward()
    optimizer.step()


def trained(seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = torch.nn.Linear(2, 2).to(dtype)
    ckpt = Checkpointer(model=model, build_optimizer=adam)
    one_step(model, ckpt.optimizer, 1)
    return model, ckpt


def test_c5_state_lands_on_live_parameters_and_next_step_is_bitwise(local_dir):
    model, ckpt = trained()
    ckpt.save_checkpoint(local_dir)
    one_step(model, ckpt.optimizer, 2)
    expected = {"model": model.state_dict(), "opt": ckpt.optimizer.state_dict()}

    torch.manual_seed(99)
    fresh = torch.nn.Linear(2, 2)
    restored = Checkpointer(model=fresh, build_optimizer=adam)
    restored.load_checkpoint(local_dir)
    opt = restored.optimizer
    held = [p for g in opt.param_groups for p in g["params"]]
    assert all(a is b for a, b in zip(held, fresh.parameters(), strict=True)) and len(held) == 2
    for p in fresh.parameters():
        st = opt.state[p]
        assert sorted(st) == ["exp_avg", "exp_avg_sq", "step"]
        for name in ("exp_avg", "exp_avg_sq"):
            assert st[name].device == p.device and st[name].shape == p.shape
        assert st["step"].device.type == "cpu" and st["step"].item() == 1.0
    one_step(fresh, opt, 2)
    assert_state_identical({"model": fresh.state_dict(), "opt": opt.state_dict()}, expected)


def test_optimizer_built_before_the_parameters_were_replaced_is_refused(local_dir):
    _, ckpt = trained()
    ckpt.save_checkpoint(local_dir)
    model = torch.nn.Linear(2, 2)
    stale = adam(model.parameters())
    # What model.to(xla_device) does: new Parameter objects replace the old ones.
    model.weight = torch.nn.Parameter(model.weight.detach().clone())
    restored = Checkpointer(model=model, optimizer=stale)
    with pytest.raises(StateMismatchError) as e:
        restored.load_checkpoint(local_dir)
    assert str(e.value) == refused(
        f"{local_dir}: the optimizer holds 1 tensor(s) that are not the model's live parameters "
        "(first: param group 0, index 0); it was probably built before the model moved to its "
        "device (moving to an XLA device replaces the parameter objects). Build the optimizer "
        "after model.to(device), or pass build_optimizer so the restore rebuilds it.")


def test_given_optimizer_over_live_parameters_is_loaded_in_place(local_dir):
    model, ckpt = trained()
    ckpt.save_checkpoint(local_dir)
    fresh = torch.nn.Linear(2, 2)
    opt = adam(fresh.parameters())
    Checkpointer(model=fresh, optimizer=opt).load_checkpoint(local_dir)
    assert_state_identical(opt.state_dict(), ckpt.optimizer.state_dict())


def test_c10_fp32_moments_of_fp16_parameters_keep_dtype_and_bits(local_dir):
    model, ckpt = trained(dtype=torch.float16)
    for st in ckpt.optimizer.state.values():  # an optimizer that keeps fp32 moments
        st["exp_avg"] = st["exp_avg"].float() / 3
        st["exp_avg_sq"] = st["exp_avg_sq"].float() / 7
    saved = ckpt.optimizer.state_dict()
    ckpt.save_checkpoint(local_dir)

    plain = adam(torch.nn.Linear(2, 2).half().parameters())
    plain.load_state_dict(xla_ckpt.load(local_dir)["last_optimizer_state"])
    assert plain.state_dict()["state"][0]["exp_avg"].dtype == torch.float16  # torch casts

    fresh = torch.nn.Linear(2, 2).half()
    restored = Checkpointer(model=fresh, build_optimizer=adam)
    restored.load_checkpoint(local_dir)
    got = restored.optimizer.state_dict()
    assert got["state"][0]["exp_avg"].dtype == torch.float32
    assert_state_identical(got, saved)


def test_state_follows_a_parameter_whose_dtype_was_cast(local_dir):
    _, ckpt = trained()
    ckpt.save_checkpoint(local_dir)
    fresh = torch.nn.Linear(2, 2).to(torch.bfloat16)
    restored = Checkpointer(model=fresh, build_optimizer=adam,
                            config=CheckpointerConfig(dtype_policy="cast"))
    restored.load_checkpoint(local_dir)
    st = restored.optimizer.state[fresh.weight]
    assert st["exp_avg"].dtype == torch.bfloat16
    saved = ckpt.optimizer.state[ckpt.model.weight]["exp_avg"]
    assert tensors_identical(st["exp_avg"], saved.to(torch.bfloat16))


def test_param_group_count_mismatch_suggests_reset_optimizer():
    model = torch.nn.Linear(2, 2)
    saved = adam(model.parameters()).state_dict()
    groups: list[dict[str, Any]] = [{"params": [model.weight]}, {"params": [model.bias]}]
    two_groups = torch.optim.Adam(groups)
    with pytest.raises(StateMismatchError) as e:
        load_optimizer_state(two_groups, saved, where="/ckpt/x")
    assert str(e.value) == (
        "/ckpt/x: the saved optimizer has 1 param group(s), the live one 2; pass "
        "reset_optimizer=True to start the optimizer afresh (the model weights are still "
        "restored)")


def test_param_group_size_mismatch():
    model = torch.nn.Linear(2, 2)
    saved = adam([model.weight]).state_dict()
    with pytest.raises(StateMismatchError, match=r"param group 0 holds 1 parameters in the "
                                                 r"checkpoint and 2 in the live optimizer"):
        load_optimizer_state(adam(model.parameters()), saved)


def test_parameters_in_another_order_are_refused():
    model = torch.nn.Linear(3, 2)
    opt = adam(model.parameters())
    one_step(model, opt, 1)
    saved = opt.state_dict()
    reordered = adam([model.bias, model.weight])
    with pytest.raises(StateMismatchError) as e:
        load_optimizer_state(reordered, saved)
    assert str(e.value).startswith(
        "optimizer state 'exp_avg' of parameter 0 has shape [2, 3] but the live parameter has "
        "shape [2]; the model's parameters changed or are in another order; pass "
        "reset_optimizer=True")


def test_factored_state_of_adafactor_is_accepted():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adafactor(model.parameters(), lr=0.01)
    one_step(model, opt, 1)
    saved = opt.state_dict()
    assert saved["state"][0]["row_var"].shape == (2, 1)
    fresh = torch.optim.Adafactor(model.parameters(), lr=0.01)
    load_optimizer_state(fresh, saved)
    assert_state_identical(fresh.state_dict(), saved)


def test_overrides_replace_param_group_values():
    model = torch.nn.Linear(2, 2)
    opt = adam(model.parameters())
    saved = opt.state_dict()
    load_optimizer_state(opt, saved, overrides={"lr": 0.5, "betas": (0.5, 0.6)})
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"]) == (0.5, (0.5, 0.6), 1e-8)


def test_state_keys_that_no_param_group_lists_are_refused_naming_them():
    """A stray key (DCP/JSON flattening turns int ids into '0', '1') would be kept by torch as
    dead state and the parameters would restart from zero moments: refused, never silent."""
    model, ckpt = trained()
    saved = ckpt.optimizer.state_dict()
    stringified = {"state": {str(k): v for k, v in saved["state"].items()},
                   "param_groups": saved["param_groups"]}
    fresh = adam(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(StateMismatchError) as e:
        load_optimizer_state(fresh, stringified, where="/ckpt/x")
    assert str(e.value) == (
        "/ckpt/x: the saved optimizer state holds 2 key(s) that no saved param group lists "
        "('0', '1'; the param groups list [0, 1]); their state would be silently dropped. The "
        "keys are parameter ids written as strings (DCP and JSON flattening stringify int "
        "keys); convert them back with {int(k): v for k, v in state_dict['state'].items()} or "
        "read the checkpoint with xla_ckpt.load, which restores them. Otherwise pass "
        "reset_optimizer=True to start the optimizer afresh (the model weights are still "
        "restored)")
    assert fresh.state == {}  # nothing half-loaded

    unlisted = {"state": {**saved["state"], 7: saved["state"][0]},
                "param_groups": saved["param_groups"]}
    with pytest.raises(StateMismatchError, match=r"holds 1 key\(s\) that no saved param group "
                                                 r"lists \(7; the param groups list \[0, 1\]\)"):
        load_optimizer_state(fresh, unlisted)


class _OwnStateSGD(torch.optim.SGD):
    """An optimizer outside torch.optim that keeps an entry of its own in ``state``."""


_OwnStateSGD.__module__ = "my_project.optim"


def test_an_optimizer_of_its_own_keeps_non_id_state_keys_but_not_stray_ids():
    model = torch.nn.Linear(2, 2)
    opt = _OwnStateSGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.state["ema_decay"] = 0.99  # type: ignore[index]  # torch keeps non-tensor keys of optimizer.state as they are
    saved = opt.state_dict()
    assert saved["state"] == {"ema_decay": 0.99}
    fresh = _OwnStateSGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)
    load_optimizer_state(fresh, saved)
    assert fresh.state["ema_decay"] == 0.99  # type: ignore[index]  # a non-param key
    with pytest.raises(StateMismatchError, match=r"holds 1 key\(s\) that no saved param group "
                                                 r"lists \('0'; the param groups list \[0, 1\]\)"):
        load_optimizer_state(fresh, {"state": {"0": {"momentum_buffer": torch.zeros(2, 2)}},
                                     "param_groups": saved["param_groups"]})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_load_hook_that_casts_the_state_is_undone_too(dtype):
    """With every saved state tensor in its parameter's dtype nothing is undone after
    torch's load, unless a load hook (or an override) may have changed it: then the saved
    dtype and bits come back as for a cast torch made itself."""
    src = torch.nn.Linear(2, 3).to(dtype)
    opt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    src(torch.ones(1, 2, dtype=dtype)).sum().backward()
    opt.step()
    saved = opt.state_dict()

    live = torch.nn.Linear(2, 3).to(dtype)
    target = torch.optim.AdamW(live.parameters(), lr=1e-2)

    def halve_precision(optimizer):
        for st in optimizer.state.values():
            st["exp_avg"] = st["exp_avg"].to(torch.float16)

    target.register_load_state_dict_post_hook(halve_precision)
    load_optimizer_state(target, saved)
    got = target.state_dict()
    assert got["state"][0]["exp_avg"].dtype == dtype
    assert_state_identical(got, saved)

    plain = torch.optim.AdamW(torch.nn.Linear(2, 3).to(dtype).parameters(), lr=1e-2)
    load_optimizer_state(plain, saved)
    assert_state_identical(plain.state_dict(), saved)
