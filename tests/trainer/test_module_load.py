"""Strict model/criterion loading: wrapper prefixes (C3), dtype policy (C10), meta models (C11)."""

import logging
import random
from collections import OrderedDict

import pytest
import torch

import xla_ckpt
from xla_ckpt.errors import ConfigError, StateMismatchError
from xla_ckpt.testing.asserts import assert_state_identical, tensors_identical
from xla_ckpt.trainer import CheckpointerConfig, best_prefix_strip, load_module_state, unwrap_module


def linear_state(seed: int = 0, prefix: str = "") -> "OrderedDict[str, torch.Tensor]":
    torch.manual_seed(seed)
    sd = torch.nn.Linear(2, 2).state_dict()
    return OrderedDict((prefix + k, v) for k, v in sd.items())


class Holder(torch.nn.Module):
    """A model whose genuine child is called ``module`` (keys ``module.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(2, 2)


# ---- C3: wrapper prefixes -----------------------------------------------------------------

@pytest.mark.parametrize("prefix, wrapper", [
    ("module.", "'module.' (DistributedDataParallel/DataParallel)"),
    ("_orig_mod.", "'_orig_mod.' (torch.compile)"),
    ("module._orig_mod.", ("'module.' (DistributedDataParallel/DataParallel) then '_orig_mod.' "
                           "(torch.compile)")),
    ("_orig_mod.module.", ("'_orig_mod.' (torch.compile) then 'module.' "
                           "(DistributedDataParallel/DataParallel)")),
])
def test_prefixed_state_strict_load_raises_one_clear_error(prefix, wrapper):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(StateMismatchError) as e:
        load_module_state(model, linear_state(1, prefix), where="/ckpt/c1")
    assert str(e.value) == (
        "/ckpt/c1: cannot load the model state: the architectures differ (strict load). "
        f"Missing keys (2): weight, bias. Unexpected keys (2): {prefix}weight, {prefix}bias. "
        f"The checkpoint's keys carry the wrapper prefix {wrapper}; pass strip_prefixes=True to "
        "remove it, or save the unwrapped model.")


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod.",
                                    "_orig_mod.module."])
def test_strip_prefixes_loads_bitwise(prefix):
    model = torch.nn.Linear(2, 2)
    weight_obj = model.weight
    report = load_module_state(model, linear_state(1, prefix), strip_prefixes=True)
    assert "".join(report.stripped_prefixes) == prefix
    assert_state_identical(OrderedDict(model.state_dict()), linear_state(1))
    assert model.weight is weight_obj  # the live parameter object is kept


def test_genuine_module_child_is_never_stripped():
    torch.manual_seed(3)
    saved = Holder().state_dict()
    assert list(saved) == ["module.weight", "module.bias"]
    for strip in (False, True):
        model = Holder()
        report = load_module_state(model, saved, strip_prefixes=strip)
        assert report.stripped_prefixes == ()
        assert_state_identical(model.state_dict(), saved)


def test_wrapped_model_with_genuine_module_child_strips_only_the_wrapper():
    torch.manual_seed(4)
    inner = Holder().state_dict()
    saved = OrderedDict(("module." + k, v) for k, v in inner.items())  # DDP(Holder)
    model = Holder()
    report = load_module_state(model, saved, strip_prefixes=True)
    assert report.stripped_prefixes == ("module.",)
    assert_state_identical(model.state_dict(), inner)


def test_prefix_on_only_some_keys_is_not_stripped():
    saved = linear_state(1)
    saved = OrderedDict([("module.weight", saved["weight"]), ("bias", saved["bias"])])
    with pytest.raises(StateMismatchError) as e:
        load_module_state(torch.nn.Linear(2, 2), saved, strip_prefixes=True)
    assert str(e.value) == (
        "cannot load the model state: the architectures differ (strict load). Missing keys (1): "
        "weight. Unexpected keys (1): module.weight. Build the same architecture that saved the "
        "checkpoint.")


def test_live_model_carrying_the_prefix_gets_the_other_hint():
    with pytest.raises(StateMismatchError, match=r"The live model's keys carry the wrapper prefix "
                                                 r"'module\.'; load into the unwrapped model"):
        load_module_state(Holder(), linear_state(1))


def test_best_prefix_strip_is_a_pure_function_of_the_key_sets():
    saved = [f"_orig_mod.module.layer{i}.weight" for i in range(20)]
    live = [f"layer{i}.weight" for i in range(20)]
    answers = set()
    for seed in range(5):
        random.Random(seed).shuffle(saved)
        random.Random(seed + 10).shuffle(live)
        answers.add(best_prefix_strip(saved, live))
    assert answers == {("_orig_mod.", "module.")}


def test_unwrap_module_goes_by_wrapper_type():
    inner = torch.nn.Linear(2, 2)
    wrapped = torch.nn.DataParallel(torch.compile(inner))  # type: ignore[type-var]  # compiles a Module
    assert unwrap_module(wrapped) is inner
    holder = Holder()
    assert unwrap_module(holder) is holder


def test_strip_also_renames_state_dict_metadata():
    torch.manual_seed(5)
    inner = Holder()
    saved = torch.nn.DataParallel(inner).state_dict()
    assert list(saved) == ["module.module.weight", "module.module.bias"]
    meta = saved._metadata  # type: ignore[attr-defined]  # state_dict() sets it
    assert list(meta) == ["", "module", "module.module"]
    model = Holder()
    load_module_state(model, saved, strip_prefixes=True)
    assert_state_identical(model.state_dict(), inner.state_dict())


# ---- shapes ---------------------------------------------------------------------------------

def test_shape_mismatch_lists_saved_and_live_shapes():
    with pytest.raises(StateMismatchError) as e:
        load_module_state(torch.nn.Linear(2, 3), linear_state(0), what="criterion")
    assert str(e.value) == (
        "cannot load the criterion state: the architectures differ; shape mismatch in weight "
        "(saved [2, 2], live [3, 2]), bias (saved [2], live [3])")


# ---- C10: dtype policy -----------------------------------------------------------------------

SAVED_FP32 = torch.tensor([[1.0009765625, 3.14159]], dtype=torch.float32)


def bf16_model() -> torch.nn.Linear:
    return torch.nn.Linear(2, 1, bias=False).to(torch.bfloat16)


def test_narrowing_cast_refused_by_default():
    model = bf16_model()
    before = model.weight.detach().clone()
    with pytest.raises(StateMismatchError) as e:
        load_module_state(model, {"weight": SAVED_FP32}, where="/ckpt/c10")
    assert str(e.value) == (
        "/ckpt/c10: loading the model state would narrow the dtype of 1 tensor(s): weight "
        "(float32 -> bfloat16); values would change. Build the model in the saved dtype, or pass "
        "dtype_policy='keep' (live tensors take the saved dtype), 'warn' or 'cast'.")
    assert tensors_identical(model.weight.detach(), before)  # nothing was written


def test_keep_policy_keeps_saved_dtype_and_bits():
    model = bf16_model()
    weight_obj = model.weight
    report = load_module_state(model, {"weight": SAVED_FP32}, dtype_policy="keep")
    assert report.kept_dtype_keys == ["weight"]
    assert model.weight is weight_obj
    assert model.weight.dtype == torch.float32
    assert tensors_identical(model.weight.detach(), SAVED_FP32)
    assert model.weight.tolist() == [[1.0009765625, 3.141590118408203]]


def test_warn_policy_casts_and_names_the_key(caplog):
    model = bf16_model()
    with caplog.at_level(logging.WARNING, logger="xla_ckpt.trainer.module_load"):
        report = load_module_state(model, {"weight": SAVED_FP32}, dtype_policy="warn",
                                   where="/ckpt/c10")
    assert report.cast_keys == {"weight": "float32"}
    assert [r.getMessage() for r in caplog.records] == [
        ("/ckpt/c10: narrowing cast while loading the model state (values change): weight "
         "(float32 -> bfloat16)")]
    assert model.weight.dtype == torch.bfloat16
    assert model.weight.tolist() == [[1.0, 3.140625]]


def test_cast_policy_casts_silently(caplog):
    model = bf16_model()
    with caplog.at_level(logging.WARNING):
        load_module_state(model, {"weight": SAVED_FP32}, dtype_policy="cast")
    assert caplog.records == []
    assert tensors_identical(model.weight.detach(), SAVED_FP32.to(torch.bfloat16))


def test_widening_cast_is_exact_and_allowed_by_default():
    saved = SAVED_FP32.to(torch.bfloat16)
    model = torch.nn.Linear(2, 1, bias=False)
    report = load_module_state(model, {"weight": saved})
    assert report.cast_keys == {"weight": "bfloat16"}
    assert model.weight.dtype == torch.float32
    assert tensors_identical(model.weight.detach().to(torch.bfloat16), saved)


def test_integer_buffer_narrowing_is_refused():
    class Counted(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("steps", torch.zeros(1, dtype=torch.int32))

    with pytest.raises(StateMismatchError, match=r"steps \(int64 -> int32\)"):
        load_module_state(Counted(), {"steps": torch.tensor([2**40])})


def test_unknown_dtype_policy_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        CheckpointerConfig(dtype_policy="lossy")
    assert str(e.value) == "dtype_policy: must be one of error, warn, cast, keep; got 'lossy'"
    with pytest.raises(ConfigError, match="strip_prefixes: must be true or false"):
        CheckpointerConfig(strip_prefixes="yes")  # type: ignore[arg-type]  # on purpose


def test_dtype_policy_through_a_real_checkpoint(local_dir):
    xla_ckpt.save({"model": {"weight": SAVED_FP32}}, local_dir)
    loaded = xla_ckpt.load(local_dir)["model"]
    model = bf16_model()
    load_module_state(model, loaded, dtype_policy="keep")
    assert tensors_identical(model.weight.detach(), SAVED_FP32)


# ---- C11: meta models -----------------------------------------------------------------------

def test_meta_model_is_materialised_with_the_saved_values():
    saved = linear_state(7)
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    assert model.weight.is_meta
    report = load_module_state(model, saved, device="cpu")
    assert report.materialized_device == torch.device("cpu")
    assert not model.weight.is_meta and model.weight.device.type == "cpu"
    assert_state_identical(OrderedDict(model.state_dict()), saved)


def test_meta_model_names_buffers_the_checkpoint_cannot_fill(caplog):
    class Rotary(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)
            self.register_buffer("inv_freq", torch.ones(2), persistent=False)

    torch.manual_seed(8)
    saved = Rotary().state_dict()
    with torch.device("meta"):
        model = Rotary()
    with caplog.at_level(logging.WARNING, logger="xla_ckpt.trainer.module_load"):
        load_module_state(model, saved)
    assert_state_identical(model.state_dict(), saved)
    assert [r.getMessage() for r in caplog.records] == [
        ("model was on the meta device; materialised on cpu, but inv_freq are not in the "
         "checkpoint (non-persistent buffers) and hold uninitialised memory: initialise them "
         "after the restore")]


# ---- in place (issue 16): checks against the manifest before any byte is read ----------------

def _saved_model_records(tmp_path, state):
    from xla_ckpt.io import CheckpointReader
    from xla_ckpt.trainer.module_load import saved_records

    xla_ckpt.save({"model": state}, str(tmp_path / "ck"))
    reader = CheckpointReader.open(str(tmp_path / "ck"))
    return saved_records(reader.manifest.item("state"))["model"]


def test_in_place_targets_are_the_live_tensors_by_manifest_key(tmp_path):
    from xla_ckpt.trainer.module_load import in_place_targets

    live = torch.nn.Linear(2, 2)
    targets = in_place_targets(live, _saved_model_records(tmp_path, linear_state(0)))
    assert sorted(targets) == ["state['model']['bias']", "state['model']['weight']"]
    assert targets["state['model']['weight']"].data_ptr() == live.weight.data_ptr()


@pytest.mark.parametrize("case", ["prefix", "meta", "narrowing", "missing_key"])
def test_in_place_targets_none_when_the_ordinary_path_must_decide(tmp_path, case):
    from xla_ckpt.trainer.module_load import in_place_targets

    state = linear_state(0, prefix="module." if case == "prefix" else "")
    if case == "missing_key":
        del state["bias"]
    records = _saved_model_records(tmp_path, state)
    live = torch.nn.Linear(2, 2)
    if case == "meta":
        live = torch.nn.Linear(2, 2, device="meta")
    if case == "narrowing":
        live = live.to(torch.bfloat16)
    assert in_place_targets(live, records, strip_prefixes=True) == {}


def test_in_place_targets_skip_keys_a_policy_casts(tmp_path):
    from xla_ckpt.trainer.module_load import in_place_targets

    records = _saved_model_records(tmp_path, linear_state(0))
    live = torch.nn.Linear(2, 2)
    live.bias.data = live.bias.data.to(torch.bfloat16)
    assert sorted(in_place_targets(live, records, dtype_policy="cast")) == [
        "state['model']['weight']"]


# ---- tied weights a checkpoint omits (HF model.safetensors drops lm_head.weight) --------------

def tiny_gpt2(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=8, n_layer=1, n_head=2,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def converted_gpt2(tmp_path) -> tuple[torch.nn.Module, str]:
    """A tiny GPT2 saved by HF (no lm_head.weight in model.safetensors), converted with the CLI."""
    from safetensors import safe_open

    from xla_ckpt.cli.main import main

    src = tiny_gpt2(0)
    src.save_pretrained(str(tmp_path / "hf"))
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names
    dst = str(tmp_path / "C")
    assert main(["convert", str(tmp_path / "hf"), dst, "--layout", "model",
                 "--no-progress"]) == 0
    return src, dst


def test_hf_gpt2_tied_lm_head_restores_through_its_partner(tmp_path, caplog):
    from xla_ckpt.trainer import Checkpointer

    src, ck_uri = converted_gpt2(tmp_path)
    model = tiny_gpt2(1)
    ck = Checkpointer(model=model, build_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    with caplog.at_level(logging.INFO, logger="xla_ckpt.trainer.module_load"):
        assert ck.load_checkpoint(ck_uri) == {}  # nothing made up: no train_iterator saved
    assert model.lm_head.weight is model.transformer.wte.weight          # still tied
    assert_state_identical(dict(model.state_dict()), dict(src.state_dict()))
    assert [r.getMessage() for r in caplog.records] == [
        (f"{ck_uri}: 1 model key(s) absent from the checkpoint are tied to saved ones (the "
         "same live tensor) and take their values: lm_head.weight = transformer.wte.weight")]


def test_tied_key_report_and_a_genuinely_missing_key_is_still_strict(tmp_path):
    src = tiny_gpt2(0)
    saved = {k: v for k, v in src.state_dict().items() if k != "lm_head.weight"}
    report = load_module_state(tiny_gpt2(1), saved)
    assert report.tied_keys == {"lm_head.weight": "transformer.wte.weight"}
    del saved["transformer.ln_f.bias"]
    live = tiny_gpt2(1)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(StateMismatchError, match=r"Missing keys \(1\): transformer\.ln_f\.bias\. "
                                                 r"Unexpected keys \(0\)"):
        load_module_state(live, saved)
    assert_state_identical(dict(live.state_dict()), before)
    untied = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
    state = untied.state_dict()
    del state["b.weight"]                               # same shape as a.weight, but not tied
    with pytest.raises(StateMismatchError, match=r"Missing keys \(1\): b\.weight"):
        load_module_state(untied, state)


def test_in_place_targets_fill_a_tied_key_through_its_saved_partner(tmp_path):
    from xla_ckpt.trainer.module_load import in_place_targets

    state = {k: v for k, v in tiny_gpt2(0).state_dict().items() if k != "lm_head.weight"}
    live = tiny_gpt2(1)
    targets = in_place_targets(live, _saved_model_records(tmp_path, state))
    assert len(targets) == len(state)
    assert targets["state['model']['transformer.wte.weight']"].data_ptr() == \
        live.lm_head.weight.data_ptr()
    del state["transformer.ln_f.bias"]
    assert in_place_targets(live, _saved_model_records(tmp_path / "b", state)) == {}
