"""Partial restore (xla_ckpt.kinds.partial): only the asked keys come back, and only their bytes
are read (counted by the reader and, on gs://, by the bytes the server sent)."""

import argparse
import os
from collections import OrderedDict
from typing import Any

import pytest
import torch

import xla_ckpt
from xla_ckpt.errors import UnknownKeyError
from xla_ckpt.io import CheckpointReader
from xla_ckpt.kinds.partial import PROGRESS_STEP_BYTES, load_partial, read_partial, select_state
from xla_ckpt.testing.fault_proxy import downloads

LAYERS = 12
NUMEL = 4096  # fp32: 16 KiB per tensor


def layer(i: int, kind: str) -> torch.Tensor:
    return torch.arange(NUMEL, dtype=torch.float32) + 1000 * i + (0.5 if kind == "bias" else 0)


def make_state() -> dict:
    model = OrderedDict((f"encoder.layer.{i}.{k}", layer(i, k))
                        for i in range(LAYERS) for k in ("weight", "bias"))
    model["encoder.layer.10.extra"] = torch.ones(3, dtype=torch.int64)
    model._metadata = OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]  # torch's state_dict metadata attribute
    return {
        "model": model,
        "optimizer": {"state": {0: {"exp_avg": torch.full((5,), 2.0), "step": torch.tensor(3.0)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}, {"lr": 0.2, "params": [1]}]},
        "args": argparse.Namespace(lr=0.1, arch="tiny"),
        "extra_state": {"epoch": 2, "history": (1.5, 2.5, 3.5)},
        "num_updates": 700,
    }


@pytest.fixture
def ckpt(tmp_path):
    uri = str(tmp_path / "checkpoint_2_700")
    xla_ckpt.save(make_state(), uri)
    return uri


def test_dotted_prefix_selects_that_layer_only_and_reads_only_its_blobs(ckpt):
    reader = CheckpointReader.open(ckpt)
    try:
        got = read_partial(reader, ["model.encoder.layer.1"])
    finally:
        reader.storage.close()
    model = got.state["model"]
    assert list(got.state) == ["model"]
    # "layer.1" is not "layer.10"/"layer.11": dotted keys match at part boundaries
    assert list(model) == ["encoder.layer.1.weight", "encoder.layer.1.bias"]
    assert isinstance(model, OrderedDict)
    assert model._metadata == {"": {"version": 1}}  # type: ignore[attr-defined]  # torch sets it
    assert torch.equal(model["encoder.layer.1.weight"], layer(1, "weight"))
    assert torch.equal(model["encoder.layer.1.bias"], layer(1, "bias"))
    item = reader.manifest.item("state")
    total = sum(b.length for b in item.blobs)
    assert got.bytes_read == got.selection.nbytes == 2 * NUMEL * 4
    assert len(got.selection.blob_ids) == 2 and total > 12 * got.bytes_read


def test_whole_subtrees_exact_keys_and_non_tensor_values(ckpt):
    opt = load_partial(ckpt, "optimizer")
    assert list(opt) == ["optimizer"]
    assert torch.equal(opt["optimizer"]["state"][0]["exp_avg"], torch.full((5,), 2.0))
    assert opt["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]},
                                                {"lr": 0.2, "params": [1]}]
    got = load_partial(ckpt, ["model.encoder.layer.10.extra", "num_updates", "args.arch",
                              "extra_state.history.1", "optimizer.param_groups.1.lr"])
    assert list(got["model"]) == ["encoder.layer.10.extra"]
    assert got["model"]["encoder.layer.10.extra"].dtype == torch.int64
    assert got["num_updates"] == 700
    assert got["args"] == argparse.Namespace(arch="tiny")
    assert got["extra_state"] == {"history": {1: 2.5}}  # a partly selected tuple: {index: value}
    assert got["optimizer"] == {"param_groups": {1: {"lr": 0.2}}}


def test_bracketed_keys_and_none_means_everything(ckpt):
    got = load_partial(ckpt, ["state['model']['encoder.layer.3.bias']"])
    assert list(got["model"]) == ["encoder.layer.3.bias"]
    assert torch.equal(got["model"]["encoder.layer.3.bias"], layer(3, "bias"))
    everything = load_partial(ckpt, None)
    full = xla_ckpt.load(ckpt)
    assert list(everything["model"]) == list(full["model"])
    assert all(torch.equal(everything["model"][k], full["model"][k]) for k in full["model"])
    assert everything["args"] == full["args"] and everything["num_updates"] == 700


def test_tied_weights_read_once_and_still_alias(tmp_path):
    emb = torch.randn(8, 4)
    uri = str(tmp_path / "tied")
    xla_ckpt.save({"model": {"embed.weight": emb, "out.weight": emb, "other": torch.ones(64)}},
                  uri)
    reader = CheckpointReader.open(uri)
    try:
        got = read_partial(reader, ["model.embed.weight", "model.out.weight"])
    finally:
        reader.storage.close()
    m = got.state["model"]
    assert sorted(m) == ["embed.weight", "out.weight"]
    assert torch.equal(m["embed.weight"], emb)
    assert m["embed.weight"].data_ptr() == m["out.weight"].data_ptr()
    assert got.bytes_read == 8 * 4 * 4


def test_unknown_key_names_it_and_the_closest(ckpt):
    with pytest.raises(UnknownKeyError) as ei:
        load_partial(ckpt, ["model.encoder.layer.1", "optimzer"])
    e = ei.value
    assert e.key == "optimzer" and e.checkpoint == ckpt
    assert e.closest[0] == "optimizer"
    assert str(e).startswith(f"{ckpt}: no key 'optimzer' in the saved state; closest keys "
                             "there: 'optimizer', ")
    with pytest.raises(UnknownKeyError) as ei:
        load_partial(ckpt, "model.encoder.layer.12")
    assert ei.value.key == "model.encoder.layer.12"
    assert all(c.startswith("model.encoder.layer.1") for c in ei.value.closest)
    with pytest.raises(ValueError, match="non-empty dotted path"):
        load_partial(ckpt, [""])


def test_progress_hook_counts_every_byte_read(tmp_path, monkeypatch):
    import xla_ckpt.kinds.partial as partial

    monkeypatch.setattr(partial, "PROGRESS_STEP_BYTES", 3 * NUMEL * 4)
    assert PROGRESS_STEP_BYTES == 64 * 2**20  # the default a CLI bar sees
    uri = str(tmp_path / "c")
    xla_ckpt.save(make_state(), uri)
    calls: list[int] = []
    got = load_partial(uri, "model", progress=calls.append)
    assert len(got["model"]) == 2 * LAYERS + 1
    assert sum(calls) == 2 * LAYERS * NUMEL * 4 + 3 * 8
    assert calls[0] == 3 * NUMEL * 4 and len(calls) == 9  # groups of 3 blobs, then the rest


def test_run_folder_and_legacy_file_through_the_one_resolver(tmp_path):
    run = tmp_path / "run"
    xla_ckpt.save({"model": {"w": torch.ones(2)}}, str(run / "checkpoint_1_1"),
                  metadata={"epoch": 1, "num_updates": 1})
    xla_ckpt.save({"model": {"w": torch.full((2,), 7.0)}, "n": 2}, str(run / "checkpoint_1_2"),
                  metadata={"epoch": 1, "num_updates": 2})
    assert torch.equal(load_partial(str(run), "model.w")["model"]["w"], torch.full((2,), 7.0))
    pt = str(tmp_path / "legacy.pt")
    torch.save({"model": {"w": torch.arange(3.0), "b": torch.zeros(1)}, "args": None}, pt)
    got = load_partial(pt, "model.w")
    assert list(got) == ["model"] and list(got["model"]) == ["w"]
    assert torch.equal(got["model"]["w"], torch.arange(3.0))


def test_select_state_is_pure_and_keeps_order():
    state = {"b": {"x": 1, "y": [1, 2, 3]}, "a": 2}
    assert select_state(state, ["a", "b.y"]) == {"b": {"y": [1, 2, 3]}, "a": 2}
    assert select_state(state, ["b.y.0", "b.y.1", "b.y.2"]) == {"b": {"y": [1, 2, 3]}}
    assert state == {"b": {"x": 1, "y": [1, 2, 3]}, "a": 2}


def test_gcs_serves_only_the_selected_blobs(gcs_uri, fault_proxy):
    uri = f"{gcs_uri}/checkpoint_2_700"
    xla_ckpt.save(make_state(), uri)
    with fault_proxy.storage(uri) as st:
        reader = CheckpointReader(st)
        fault_proxy.reset_log()
        got = read_partial(reader, ["model.encoder.layer.4", "optimizer.state"])
    served = sum(r.body_bytes for r in fault_proxy.records(downloads("data-")))
    assert sorted(got.state["model"]) == ["encoder.layer.4.bias", "encoder.layer.4.weight"]
    assert torch.equal(got.state["optimizer"]["state"][0]["exp_avg"], torch.full((5,), 2.0))
    assert served == got.bytes_read == got.selection.nbytes == 2 * NUMEL * 4 + 5 * 4 + 4
    total = sum(b.length for b in reader.manifest.item("state").blobs)
    assert served * 10 < total
    assert os.environ.get("STORAGE_EMULATOR_HOST")  # the real client, against the emulator


def test_xla_ckpt_load_with_keys_is_the_partial_load(ckpt):
    got = xla_ckpt.load(ckpt, keys="model.encoder.layer.1")
    assert list(got) == ["model"]
    assert list(got["model"]) == ["encoder.layer.1.weight", "encoder.layer.1.bias"]
    assert torch.equal(got["model"]["encoder.layer.1.weight"], layer(1, "weight"))
    with pytest.raises(UnknownKeyError, match="model.encoder.layer.99"):
        xla_ckpt.load(ckpt, keys=["model.encoder.layer.99"])


def test_an_empty_key_list_is_refused_not_a_sentinel(ckpt):
    empty: list | tuple
    for empty in ([], ()):
        with pytest.raises(ValueError) as ei:
            xla_ckpt.load(ckpt, keys=empty)
        assert str(ei.value) == "keys is empty; pass None to load everything"
        with pytest.raises(ValueError, match="^keys is empty; pass None to load everything$"):
            select_state(make_state(), empty)


def test_a_key_under_another_selected_key_counts_as_found(ckpt):
    got = load_partial(ckpt, ["model", "model.encoder.layer.2"])
    assert list(got) == ["model"] and len(got["model"]) == 2 * LAYERS + 1
    assert torch.equal(got["model"]["encoder.layer.2.bias"], layer(2, "bias"))
    both = load_partial(ckpt, ["optimizer.param_groups", "optimizer"])
    assert both["optimizer"]["param_groups"][1] == {"lr": 0.2, "params": [1]}
    with pytest.raises(UnknownKeyError) as ei:  # naming nothing is still an error
        load_partial(ckpt, ["model", "model.encoder.layer.99"])
    assert ei.value.key == "model.encoder.layer.99"


def test_a_dotted_key_splits_at_container_boundaries_first(tmp_path):
    """``"model"`` selects state["model"] only, not a top-level state["model.extra"]; a key
    with no container boundary to split at still matches inside a dict key."""
    uri = str(tmp_path / "ck")
    state: dict[str, Any] = {"model": {"w": torch.arange(3.0), "layer.1.w": torch.ones(2)},
             "model.extra": torch.zeros(2), "model.extra2": 7, "opt": 1}
    xla_ckpt.save(state, uri)
    got = xla_ckpt.load(uri, keys="model")
    assert list(got) == ["model"] and list(got["model"]) == ["w", "layer.1.w"]
    assert list(select_state(state, "model.extra")) == ["model.extra"]
    layer_1: Any = select_state(state, "model.layer.1")
    assert layer_1 == {"model": {"layer.1.w": state["model"]["layer.1.w"]}}
    flat = {"model.w": 1, "model.b": 2, "other": 3}  # no state["model"]: matches inside keys
    assert select_state(flat, "model") == {"model.w": 1, "model.b": 2}
