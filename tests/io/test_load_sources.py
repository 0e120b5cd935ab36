"""``xla_ckpt.load`` opens every source kind through the one resolver, and says what it found.

Kinds: a sharded HF checkpoint written by ``transformers`` ``save_pretrained`` (the folder or
its ``model.safetensors.index.json``), an HF folder holding ``model.safetensors``, a DCP folder
written by ``torch.distributed.checkpoint.save`` (nested back as saved).  "None of these" is a
clear error naming what is there and the kinds accepted; a run folder holding only foreign
checkpoints is never "nothing committed" (a trainer would start fresh next to them).
"""

import json

import pytest
import safetensors.torch
import torch

import xla_ckpt
from xla_ckpt.errors import CheckpointCorruptError, CheckpointNotFoundError, NothingCommittedError
from xla_ckpt.run.resolve import resolve
from xla_ckpt.run.sniff import ACCEPTED, DCP, HF_INDEX, LEGACY
from xla_ckpt.storage import open_storage
from xla_ckpt.testing.asserts import assert_state_identical

torch.set_num_threads(1)


def tiny_bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16, type_vocab_size=2)
    return BertModel(cfg)


def test_a_sharded_hf_checkpoint_loads_from_its_folder_or_its_index(tmp_path):
    model = tiny_bert()
    folder = tmp_path / "hf"
    model.save_pretrained(str(folder), max_shard_size="20KB")
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (folder / "model.safetensors.index.json").exists()
    ref = {}
    for s in shards:
        ref.update(safetensors.torch.load_file(str(folder / s)))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    for uri in (str(folder), str(folder / "model.safetensors.index.json")):
        r = resolve(uri)
        assert (r.kind, r.checkpoint) == (HF_INDEX, str(folder / "model.safetensors.index.json"))
        got = xla_ckpt.load(uri)
        assert list(got) == list(index["weight_map"])
        assert_state_identical(got, {k: ref[k] for k in got})
    # the tensors are the model's own
    for k, v in model.state_dict().items():
        assert torch.equal(got[k], v), k


def test_an_hf_folder_with_one_model_safetensors(tmp_path):
    model = tiny_bert()
    model.save_pretrained(str(tmp_path / "hf"))
    r = resolve(str(tmp_path / "hf"))
    assert (r.kind, r.checkpoint) == (LEGACY, str(tmp_path / "hf" / "model.safetensors"))
    assert_state_identical(xla_ckpt.load(str(tmp_path / "hf")),
                           safetensors.torch.load_file(str(tmp_path / "hf" / "model.safetensors")))


def _write_index(folder, weight_map):
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))


def test_broken_hf_indexes_are_named_errors(tmp_path):
    folder = tmp_path / "hf"
    _write_index(folder, {"a": "../secret.safetensors"})
    index = folder / "model.safetensors.index.json"
    with pytest.raises(CheckpointCorruptError) as e:
        xla_ckpt.load(str(folder))
    assert str(e.value) == (f"{index}: weight_map['a'] = '../secret.safetensors' is not a file "
                            "name next to the index (no '/', no '..')")
    _write_index(folder, {"a": "s1.safetensors", "b": "s2.safetensors"})
    safetensors.torch.save_file({"a": torch.ones(2)}, str(folder / "s1.safetensors"))
    with pytest.raises(CheckpointNotFoundError) as e2:
        xla_ckpt.load(str(folder))
    assert str(e2.value).startswith(f"{index} names shard s2.safetensors, which is missing")
    safetensors.torch.save_file({"c": torch.ones(2)}, str(folder / "s2.safetensors"))
    with pytest.raises(CheckpointCorruptError) as e:
        xla_ckpt.load(str(folder))
    assert str(e.value) == (f"{folder}/s2.safetensors holds tensor 'c', which the index "
                            f"{index} does not list")
    index.write_text("{not json")
    with pytest.raises(CheckpointCorruptError, match="safetensors index is not valid JSON"):
        xla_ckpt.load(str(index))


def test_a_dcp_folder_loads_nested_as_saved(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.randn(3, 4), "n": torch.arange(5), "mask": torch.ones(2,
                       dtype=torch.bool)}, "optim": {"step": torch.tensor(7.0), "lr": 0.5}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    r = resolve(str(tmp_path / "dcp"))
    assert (r.kind, r.checkpoint) == (DCP, str(tmp_path / "dcp"))
    assert resolve(str(tmp_path / "dcp" / ".metadata")).checkpoint == str(tmp_path / "dcp")
    got = xla_ckpt.load(str(tmp_path / "dcp"))
    assert_state_identical(got, state)


def test_none_of_these_is_a_clear_error(tmp_path):
    run = tmp_path / "fairseq_run"
    run.mkdir()
    torch.save({"model": {"w": torch.ones(1)}}, str(run / "checkpoint_last.pt"))
    (run / "train.log").write_text("log")
    (run / "200").mkdir()
    (run / "200" / ".metadata").write_bytes(b"x")
    with pytest.raises(CheckpointNotFoundError) as e:
        xla_ckpt.load(str(run))
    assert not isinstance(e.value, NothingCommittedError)  # never a fresh start here
    assert str(e.value) == (
        f"{run} holds no xla_ckpt checkpoint, but checkpoints of another kind: 200 (a PyTorch "
        "DCP checkpoint folder (.metadata)), checkpoint_last.pt (a legacy torch.save/fairseq .pt "
        f"or safetensors file). Name one ({run}/200; xla_ckpt.load reads it), or convert the run "
        f"folder with `xla-ckpt convert {run} DST_RUN`, or convert each one into a run folder, "
        f"e.g. `xla-ckpt convert {run}/200 DST_RUN/checkpoint_200`; this is not read as 'no "
        "checkpoint yet'")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "a.txt").write_text("a")
    with pytest.raises(NothingCommittedError) as e:
        xla_ckpt.load(str(logs))
    assert str(e.value) == (f"{logs}: no committed checkpoint here (it holds 1 other object: "
                            f"a.txt; xla_ckpt reads {ACCEPTED})")


def test_gcs_index_and_dcp(gcs_uri, tmp_path):
    import torch.distributed.checkpoint as dcp

    model = tiny_bert()
    model.save_pretrained(str(tmp_path / "hf"), max_shard_size="20KB")
    dcp.save({"model": model.state_dict()},
             storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    with open_storage(gcs_uri) as st:
        for sub in ("hf", "dcp"):
            for p in sorted((tmp_path / sub).iterdir()):
                st.write_atomic(f"{sub}/{p.name}", [p.read_bytes()])
    ref = dict(model.state_dict())
    for uri in (f"{gcs_uri}/hf", f"{gcs_uri}/hf/model.safetensors.index.json"):
        got = xla_ckpt.load(uri)  # weight-map order (sorted names)
        assert sorted(got) == sorted(ref)
        assert_state_identical({k: got[k] for k in ref}, ref)
    assert_state_identical(xla_ckpt.load(f"{gcs_uri}/dcp"), {"model": ref})


@pytest.mark.parametrize("map_location", ["cpu", torch.device("cpu"), {"cpu": "cpu"},
                                          lambda key: "cpu", "meta", {"cpu": "meta"}])
def test_map_location_applies_to_every_source_kind(tmp_path, map_location):
    """Defect 14: a .pt, an HF folder and a DCP folder take map_location as an xla_ckpt
    checkpoint does: CPU ones keep the tensors (and a tie) as read; another device gets them
    moved there after loading."""
    import torch.distributed.checkpoint as dcp

    w = torch.arange(6.0).reshape(2, 3)
    torch.save({"model": {"w": w, "tied": w}, "step": 3}, str(tmp_path / "a.pt"))
    (tmp_path / "hf").mkdir()
    safetensors.torch.save_file({"w": w}, str(tmp_path / "hf" / "model.safetensors"))
    dcp.save({"model": {"w": w}}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")),
             no_dist=True)
    device = "meta" if "meta" in str(map_location) else "cpu"
    for uri, path in ((tmp_path / "a.pt", ("model", "w")), (tmp_path / "hf", ("w",)),
                      (tmp_path / "dcp", ("model", "w"))):
        got = xla_ckpt.load(str(uri), map_location=map_location)
        t = got
        for k in path:
            t = t[k]
        assert t.device.type == device, uri
        assert t.shape == (2, 3) and t.dtype == torch.float32
        if device == "cpu":
            assert torch.equal(t, w)
    got = xla_ckpt.load(str(tmp_path / "a.pt"), map_location=map_location)
    assert got["model"]["tied"] is got["model"]["w"] and got["step"] == 3
