"""``Checkpointer(...)`` refuses at construction what its first save or restore would refuse
(issue 25 defect 8: ``cfg=<dataclass>`` failed only at the first scheduled save)."""

import argparse
import dataclasses
import re

import pytest
import torch

from xla_ckpt.errors import ConfigError
from xla_ckpt.trainer import Checkpointer


@dataclasses.dataclass
class TrainCfg:
    lr: float = 0.1
    epochs: int = 3


def build(params):
    return torch.optim.SGD(params, lr=0.1)


def make(**kwargs):
    kwargs.setdefault("model", torch.nn.Linear(2, 2))
    kwargs.setdefault("build_optimizer", build)
    return Checkpointer(**kwargs)


def test_a_dataclass_cfg_is_refused_naming_its_type_and_what_to_pass():
    with pytest.raises(ConfigError) as e:
        make(cfg=TrainCfg())
    msg = str(e.value)
    assert msg.startswith(f"cfg: a {__name__}.TrainCfg cannot be saved in a checkpoint, and "
                          "every save writes cfg (")
    assert msg.endswith("pass dataclasses.asdict(cfg) (a dict), or an argparse.Namespace; "
                        "rebuild the dataclass from it after a restore")


def test_a_value_the_checkpoint_cannot_hold_deep_in_args_is_refused_naming_its_path():
    args = argparse.Namespace(lr=0.1, sched={"warmup": TrainCfg()})
    with pytest.raises(ConfigError, match=re.escape("args: a argparse.Namespace cannot be "
                                                    "saved in a checkpoint")) as e:
        make(args=args)
    assert "TrainCfg" in str(e.value) and "sched" in str(e.value)


def test_what_the_checkpoint_holds_is_accepted_and_saved(tmp_path):
    cfg = dataclasses.asdict(TrainCfg())
    ck = make(cfg=cfg, args=argparse.Namespace(lr=0.1, betas=(0.9, 0.98)))
    ck.save_checkpoint(str(tmp_path / "ck"), {})
    assert ck.state_dict()["cfg"] == {"lr": 0.1, "epochs": 3}


@pytest.mark.parametrize("kwargs, message", [
    ({"model": {"w": torch.ones(1)}}, "model: must be a torch.nn.Module, got a dict"),
    ({"criterion": lambda out: out.sum()}, ("criterion: must be a torch.nn.Module or None, got a "
                                           "function")),
    ({"build_optimizer": None, "optimizer": {"lr": 0.1}},
     "optimizer: must be a torch.optim.Optimizer or None (or pass build_optimizer), got a dict"),
    ({"build_optimizer": torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)},
     "build_optimizer: must be callable or None, got a SGD"),
    ({"metrics": {}}, ("metrics: must be an object with state_dict() and load_state_dict() (or "
                      "None), got a dict")),
    ({"config": {"dtype_policy": "error"}}, ("config: must be a CheckpointerConfig (or None), "
                                            "got a dict")),
    ({"rank": -1}, "rank: must be an int >= 0, got -1"),
    ({"device": "gpu:0"}, "device: not a torch device: 'gpu:0'"),
])
def test_other_arguments_that_would_fail_later_are_refused_now(kwargs, message):
    with pytest.raises(ConfigError) as e:
        make(**kwargs)
    assert str(e.value).startswith(message)
