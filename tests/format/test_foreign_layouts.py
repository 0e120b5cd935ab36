"""CASES C24: a ``torch.save`` training dict is never taken for a fairseq checkpoint.

MAE, DeiT and DINO save ``{"model", "optimizer", "epoch", "args", ...}``; fairseq's own
layout detection (``model`` plus ``args``/``cfg``) is loose.  ``xla_ckpt.load``,
``xla-ckpt convert`` (default layout) and ``xla-ckpt inspect`` return what was saved, key
for key and type for type; the fairseq upgrade runs only on a file fairseq wrote, and only
when asked by name (issue 25 defect 1).
"""

import argparse
import io
import json
import logging
from collections import OrderedDict

import pytest
import torch

import xla_ckpt
from xla_ckpt.cli.main import main
from xla_ckpt.errors import ConfigError
from xla_ckpt.format.legacy import fairseq_vintage, load_legacy
from xla_ckpt.testing.asserts import assert_state_identical


def _trained(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(3, 2)).sum().backward()
    opt.step()
    return m, opt


def mae_state():
    """The issue's input: MAE's ``misc.save_model`` layout."""
    m, opt = _trained()
    return {"model": m.state_dict(), "optimizer": opt.state_dict(), "epoch": 5,
            "args": argparse.Namespace(lr=0.1, blr=1e-3)}


def deit_state():
    """DeiT's layout, with a ``cfg`` dict in place of ``args`` (and a model_ema, a scaler)."""
    m, opt = _trained(1)
    return {"model": m.state_dict(), "optimizer": opt.state_dict(),
            "lr_scheduler": {"last_epoch": 3, "base_lrs": [0.1]}, "epoch": 3,
            "model_ema": m.state_dict(), "scaler": {"scale": 65536.0, "_growth_tracker": 7},
            "cfg": {"lr": 0.1, "model": "deit_tiny", "epochs": [300]}}


def dino_state():
    """DINO's layout: student/teacher, no ``model``."""
    m, opt = _trained(2)
    return {"student": m.state_dict(), "teacher": m.state_dict(), "optimizer": opt.state_dict(),
            "epoch": 7, "args": argparse.Namespace(lr=0.0005, arch="vit_small"),
            "dino_loss": {"center": torch.zeros(1, 4)}}


def near_miss_state():
    """MAE plus a ``best_loss``: still short of fairseq's 2017 layout (no batch_offset ...)."""
    return {**mae_state(), "best_loss": 1.5}


def fake_history_state():
    """An ``optimizer_history`` that is not fairseq's shape (a list of losses)."""
    return {**mae_state(), "optimizer_history": [0.9, 0.8]}


FOREIGN = {"mae": mae_state, "deit_cfg": deit_state, "dino": dino_state,
           "near_miss": near_miss_state, "fake_history": fake_history_state}


def _bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def assert_same(got, saved):
    """Key for key, type for type; Namespaces compared by their fields and field types."""
    assert type(got) is type(saved) and list(got) == list(saved)
    for k, v in saved.items():
        if isinstance(v, argparse.Namespace):
            assert isinstance(got[k], argparse.Namespace)
            assert vars(got[k]) == vars(v)
            assert {n: type(x) for n, x in vars(got[k]).items()} == \
                {n: type(x) for n, x in vars(v).items()}
        else:
            assert_state_identical(got[k], v)


@pytest.mark.parametrize("name", sorted(FOREIGN))
def test_load_returns_what_was_saved(tmp_path, name):
    saved = FOREIGN[name]()
    path = tmp_path / f"{name}.pt"
    torch.save(saved, path)
    got = xla_ckpt.load(str(path))
    assert_same(got, saved)
    assert fairseq_vintage(saved) is None
    legacy = load_legacy(_bytes(saved), where=name)
    assert not legacy.fairseq and legacy.upgraded == []
    assert legacy.metadata == {"source_format": "torch_zip"}


def test_the_issues_input_keeps_its_args_and_optimizer(tmp_path):
    saved = mae_state()
    torch.save(saved, tmp_path / "mae_style.pt")
    got = xla_ckpt.load(str(tmp_path / "mae_style.pt"))
    assert sorted(got) == ["args", "epoch", "model", "optimizer"]
    assert vars(got["args"]) == {"lr": 0.1, "blr": 1e-3} and type(got["args"].lr) is float
    assert got["epoch"] == 5
    assert got["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("name", ["mae", "deit_cfg"])
def test_fairseq_layout_by_name_is_refused_naming_the_keys(name):
    with pytest.raises(ConfigError) as e:
        load_legacy(_bytes(FOREIGN[name]()), where=f"{name}.pt", layout="fairseq")
    assert str(e.value).startswith(f"{name}.pt: --layout fairseq (layout='fairseq'): not a "
                                   "fairseq checkpoint (keys ")
    assert "Pass --layout auto or raw to import it as saved" in str(e.value)


def test_layout_model_refuses_a_training_dict_and_wraps_a_bare_state_dict():
    with pytest.raises(ConfigError, match=r"mae\.pt: is a training checkpoint \(keys args, "
                                          r"epoch, model, optimizer\)"):
        load_legacy(_bytes(mae_state()), where="mae.pt", layout="model")
    sd = OrderedDict(w=torch.ones(2))
    assert list(load_legacy(_bytes(sd), layout="model").state) == ["model"]


def genuine_fairseq_2017():
    """fairseq-py's first layout, with what its upgrade requires."""
    m, _ = _trained(3)
    nag = {"state": {}, "param_groups": [{"lr": 0.25, "momentum": 0.99, "weight_decay": 0.0,
                                          "lr_old": 0.25, "params": [0, 1]}]}
    return {"args": argparse.Namespace(lr=0.25, arch="fconv"), "model": m.state_dict(),
            "optimizer": nag, "best_loss": 2.5, "epoch": 2, "batch_offset": 4,
            "val_loss": 2.75}


def test_genuine_old_fairseq_is_recognised_and_upgraded_only_by_name(caplog):
    saved = genuine_fairseq_2017()
    data = _bytes(saved)
    assert fairseq_vintage(saved) == "old"
    auto = load_legacy(data, where="ck.pt")
    assert auto.fairseq and auto.upgraded == []
    assert_same(auto.state, saved)
    with caplog.at_level(logging.WARNING, logger="xla_ckpt.format.legacy"):
        up = load_legacy(data, where="ck.pt", layout="fairseq")
    assert up.state["last_optimizer_state"] == saved["optimizer"]
    assert up.state["optimizer_history"][-1]["optimizer_name"] == "FairseqNAG"
    assert vars(up.state["args"]) == {"lr": 0.25, "arch": "fconv"}
    assert len(up.upgraded) == len([r for r in caplog.records if "fairseq upgrade" in
                                    r.getMessage()]) == 7


def _put(tmp_path, name, obj):
    path = tmp_path / name
    torch.save(obj, path)
    return str(path)


@pytest.mark.parametrize("name", ["mae", "deit_cfg", "dino"])
def test_convert_default_layout_writes_what_was_saved(tmp_path, capsys, name):
    saved = FOREIGN[name]()
    src = _put(tmp_path, f"{name}.pt", saved)
    assert main(["--no-progress", "convert", src, str(tmp_path / "ck")]) == 0
    out = capsys.readouterr()
    assert f"converted {src} (torch_zip) -> " in out.out and out.err == ""
    assert_same(xla_ckpt.load(str(tmp_path / "ck")), saved)


@pytest.mark.parametrize("name", ["mae", "deit_cfg"])
def test_inspect_shows_what_was_saved(tmp_path, capsys, name):
    saved = FOREIGN[name]()
    src = _put(tmp_path, f"{name}.pt", saved)
    assert main(["inspect", src, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["legacy"] == "torch_zip"
    assert sorted(doc["tree"]) == sorted(saved)
    assert main(["inspect", src]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == (f"legacy file {src}  (torch_zip; shown as `xla-ckpt "
                                    "convert --layout auto` would import it)")
    for invented in ("optimizer_history", "last_optimizer_state", "FairseqNAG",
                     "CrossEntropyCriterion", "translation"):
        assert invented not in text
