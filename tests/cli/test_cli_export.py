"""``xla-ckpt export``: .pt, HF safetensors and DCP, each checked with the consumer's own loader.

CASES C23: an int64 and a bool buffer and a tied embedding/output weight keep their dtype,
values and tie (kept in .pt; dropped after an equality check, recorded and re-tied by
``from_pretrained`` in safetensors; written under each key in DCP); a fairseq .pt converted
and exported back gives the same dict to ``torch.load(weights_only=True)``.
"""

import argparse
import io
import json
import os
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from test_cli_convert import _put  # type: ignore[import-not-found]  # a sibling test module on sys.path

import xla_ckpt
from xla_ckpt.testing.asserts import assert_state_identical

torch.set_num_threads(1)


def tied_state():
    torch.manual_seed(0)
    emb = torch.randn(10, 4)
    return {"model": {"embed.weight": emb, "pos": torch.arange(6, dtype=torch.int64) - 3,
                      "mask": torch.tensor([True, False, True]),
                      "half": torch.tensor([1.0009765625, 3.14159], dtype=torch.bfloat16),
                      "out.weight": emb},
            "num_updates": 5}


def test_c23_pt_keeps_dtypes_and_the_tie(cli, root, tmp_path):
    xla_ckpt.save(tied_state(), f"{root}/ck")
    r = cli("export", f"{root}/ck", f"{root}/out.pt", "--format", "pt")
    assert r.code == 0, r.err
    assert r.out.splitlines()[0].startswith(
        f"exported {root}/ck -> {root}/out.pt (pt): 4 tensors (bfloat16 1, bool 1, float32 1, "
        "int64 1), 215 B, 1 file; ")  # 40 x 4 + 6 x 8 + 3 x 1 + 2 x 2 bytes
    assert r.out.splitlines()[1] == "  tie: model.out.weight: kept tied to model.embed.weight"
    local = tmp_path / "out.pt"
    with xla_ckpt.storage.open_storage(root) as st:
        local.write_bytes(st.read_bytes("out.pt"))
    got = torch.load(str(local), weights_only=True)  # plain: no extra globals needed
    assert_state_identical(got, tied_state())
    assert got["model"]["out.weight"].data_ptr() == got["model"]["embed.weight"].data_ptr()
    r = cli("export", f"{root}/ck", f"{root}/out.pt", "--format", "pt")
    assert r.code == 2 and "out.pt" in r.err and "already holds" in r.err
    assert "pass --overwrite (overwrite=True) to replace it" in r.err


def test_c23_safetensors_drops_the_tie_after_checking_it(cli, root, tmp_path):
    xla_ckpt.save(tied_state(), f"{root}/ck")
    r = cli("export", f"{root}/ck", f"{root}/hf", "--format", "safetensors")
    assert r.code == 0, r.err
    assert r.out.splitlines()[1] == "  tie: out.weight: dropped, tied to embed.weight"
    with xla_ckpt.storage.open_storage(f"{root}/hf") as st:
        assert st.list("") == ["model.safetensors"]
        (tmp_path / "model.safetensors").write_bytes(st.read_bytes("model.safetensors"))
    path = str(tmp_path / "model.safetensors")
    with safetensors.safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt", "out.weight": "embed.weight"}
    got = safetensors.torch.load_file(path)
    want = dict(tied_state()["model"])
    del want["out.weight"]
    assert_state_identical({k: got[k] for k in want}, want)
    r = cli("export", f"{root}/ck", f"{root}/hf2", "--format", "safetensors", "--key", "")
    assert r.code == 2 and "'num_updates' is a int, not a tensor" in r.err


def test_c23_dcp_loads_back_with_dcp(cli, tmp_path):
    import torch.distributed.checkpoint as dcp

    xla_ckpt.save(tied_state(), str(tmp_path / "ck"))
    r = cli("export", str(tmp_path / "ck"), str(tmp_path / "dcp"), "--format", "dcp")
    assert r.code == 0, r.err
    assert ("  tie: model.out.weight: written as its own copy of memory shared with "
            "model.embed.weight") in r.out
    target = {"model": {k: torch.zeros_like(v) for k, v in tied_state()["model"].items()},
              "num_updates": 0}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp")), no_dist=True)
    assert_state_identical(target, tied_state())
    assert_state_identical(xla_ckpt.load(str(tmp_path / "dcp")), tied_state())


def test_hf_from_pretrained_reads_the_sharded_export(cli, tmp_path):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=32,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()
    xla_ckpt.save({"model": sd, "num_updates": 3}, str(tmp_path / "ck"))
    config.save_pretrained(str(tmp_path / "cfg"))
    for shard in ("20KB", None):
        dst = tmp_path / f"hf-{shard}"
        argv = ["export", str(tmp_path / "ck"), str(dst), "--format", "safetensors",
                "--hf-config", str(tmp_path / "cfg" / "config.json")]
        r = cli(*argv, *(["--max-shard-size", shard] if shard else []))
        assert r.code == 0, r.err
        assert "  tie: lm_head.weight: dropped, tied to transformer.wte.weight" in r.out
        names = sorted(os.listdir(dst))
        if shard:
            assert names == ["config.json", "model-00001-of-00002.safetensors",
                             "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
            index = json.loads((dst / "model.safetensors.index.json").read_text())
            assert index["metadata"]["total_size"] == sum(
                v.numel() * v.element_size() for k, v in sd.items() if k != "lm_head.weight")
        else:
            assert names == ["config.json", "model.safetensors"]
        loaded = AutoModelForCausalLM.from_pretrained(str(dst))
        wte: Any = loaded.transformer.wte.weight  # type: ignore[union-attr]  # HF module attrs
        head: Any = loaded.lm_head.weight
        assert head.data_ptr() == wte.data_ptr()
        for k, v in sd.items():
            assert torch.equal(loaded.state_dict()[k], v), k


def fairseq_current_layout():
    """A fairseq checkpoint as fairseq's save_state writes it today (nothing to upgrade)."""
    torch.manual_seed(1)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return {
        "args": argparse.Namespace(arch="lin", lr=[0.1], task="translation", seed=1),
        "cfg": None,
        "model": model.state_dict(),
        "criterion": {},
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion",
                               "optimizer_name": "Adam",
                               "lr_scheduler_state": {"best": 2.5}, "num_updates": 9}],
        "task_state": {},
        "extra_state": {"train_iterator": {"epoch": 2, "iterations_in_epoch": 4, "version": 2,
                                           "shuffle": True},
                        "val_loss": 2.5, "previous_training_time": 1.5,
                        "metrics": {}},
        "last_optimizer_state": opt.state_dict(),
    }


def test_fairseq_pt_round_trip_keeps_the_layout(cli, root, tmp_path):
    original = fairseq_current_layout()
    buf = io.BytesIO()
    torch.save(original, buf)
    src = _put(root, "checkpoint_last.pt", buf.getvalue())
    assert cli("convert", src, f"{root}/ck").code == 0
    converted = xla_ckpt.load(f"{root}/ck")
    assert list(converted) == list(original)  # converted as saved (C24): no cfg made up
    r = cli("export", f"{root}/ck", f"{root}/back.pt", "--format", "pt")
    assert r.code == 0, r.err
    assert "note: cfg" not in r.out
    assert r.out.splitlines()[-1] == ("  read it with: with torch.serialization.safe_globals("
                                      "[argparse.Namespace]): torch.load(PATH, weights_only=True)")
    with xla_ckpt.storage.open_storage(root) as st:
        (tmp_path / "back.pt").write_bytes(st.read_bytes("back.pt"))
    with pytest.raises(Exception, match="argparse.Namespace"):
        torch.load(str(tmp_path / "back.pt"), weights_only=True)
    with torch.serialization.safe_globals([argparse.Namespace]):
        got = torch.load(str(tmp_path / "back.pt"), weights_only=True)
    assert list(got) == list(original)
    assert vars(got["args"]) == vars(original["args"])
    got["args"] = original["args"]
    assert_state_identical(got, original)


def test_export_reads_any_source(cli, tmp_path):
    """A legacy .pt exported straight to safetensors (no convert step)."""
    sd = {"w": torch.randn(2, 3), "i": torch.arange(3)}
    torch.save({"model": sd}, str(tmp_path / "m.pt"))
    r = cli("export", str(tmp_path / "m.pt"), str(tmp_path / "w.safetensors"), "--format",
            "safetensors")
    assert r.code == 0, r.err
    got = safetensors.torch.load_file(str(tmp_path / "w.safetensors"))  # sorted names
    assert_state_identical({k: got[k] for k in sd}, sd)
    r = cli("export", str(tmp_path / "m.pt"), str(tmp_path / "w2.safetensors"), "--format",
            "safetensors", "--max-shard-size", "1KB")
    assert r.code == 2 and "a single .safetensors file cannot be sharded" in r.err


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_export_draws_progress_on_a_terminal(tmp_path, monkeypatch, capsys):
    from xla_ckpt.cli.main import main

    xla_ckpt.save({"model": {"w": torch.zeros(64, 1024)}}, str(tmp_path / "ck"))  # 256 KiB
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "w.pt"), "--format", "pt"]) == 0
    assert "export" in term.getvalue() and "KiB" in term.getvalue()
    assert "w.pt (pt): 1 tensors (float32 1), 256.0 KiB" in capsys.readouterr().out
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    assert main(["--no-progress", "export", str(tmp_path / "ck"), str(tmp_path / "w2.pt"),
                 "--format", "pt"]) == 0
    assert term.getvalue() == ""


def test_a_fairseq_state_exports_to_dcp_with_args_as_a_dict(cli, tmp_path):
    import torch.distributed.checkpoint as dcp

    state = fairseq_current_layout()
    xla_ckpt.save(state, str(tmp_path / "ck"))
    r = cli("export", str(tmp_path / "ck"), str(tmp_path / "dcp"), "--format", "dcp")
    assert r.code == 0, r.err
    assert ("  note: args: argparse.Namespace written as a dict (a DCP item must load with "
            "torch.load(weights_only=True))") in r.out
    got = xla_ckpt.load(str(tmp_path / "dcp"))
    assert got["args"] == vars(state["args"])
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp")), no_dist=True)
    assert_state_identical(target["model"], dict(state["model"]))


def test_the_printed_torch_load_recipe_reads_numpy_values_on_numpy_2(tmp_path):
    """Defect 15: the safe_globals printed for a .pt holding numpy values are exactly what
    torch.load(weights_only=True) needs (numpy 2: numpy.dtypes.<X>DType classes too)."""
    import importlib

    import numpy as np

    from xla_ckpt.cli.export import summary
    from xla_ckpt.kinds.export import export_pt

    state = {"best_loss": np.float32(1.5), "lr": np.float64(0.25), "step": np.int64(7),
             "half": np.dtype("float16"), "ids": np.arange(3, dtype=np.int32),
             "args": argparse.Namespace(lr=0.1), "w": torch.ones(2)}
    dst = str(tmp_path / "out.pt")
    report = export_pt(state, dst)
    if np.__version__.startswith("2."):
        assert {"numpy.dtypes.Float32DType", "numpy.dtypes.Float64DType",
                "numpy.dtypes.Int64DType", "numpy.dtypes.Float16DType",
                "numpy.dtypes.Int32DType"} <= set(report.safe_globals)
    assert "argparse.Namespace" in report.safe_globals
    line = summary("SRC", report, 1.0).splitlines()[-1]
    assert line == ("  read it with: with torch.serialization.safe_globals(["
                    f"{', '.join(report.safe_globals)}]): torch.load(PATH, weights_only=True)")

    def resolve(name):
        module, _, attr = name.rpartition(".")
        return getattr(importlib.import_module(module), attr)

    with torch.serialization.safe_globals([resolve(n) for n in report.safe_globals]):
        got = torch.load(dst, weights_only=True)
    assert got["best_loss"] == np.float32(1.5) and got["best_loss"].dtype == np.float32
    assert got["step"] == 7 and got["half"] == np.dtype("float16")
    assert np.array_equal(got["ids"], np.arange(3, dtype=np.int32))
    assert vars(got["args"]) == {"lr": 0.1} and torch.equal(got["w"], torch.ones(2))
    # a directory as DST is a usage error naming a file to pass, not "[Errno 21]"
    with pytest.raises(xla_ckpt.errors.ConfigError, match="is a folder; --format pt writes "
                       "one file"):
        export_pt(state, str(tmp_path), overwrite=True)


def _hf_files(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".safetensors", ".json")))


def test_safetensors_export_over_an_earlier_export_leaves_no_stale_file(cli, tmp_path):
    """Defect 3: --overwrite replaces the earlier export whole (no old shard, index or
    model.safetensors left for from_pretrained to load); without it the folder is refused."""
    torch.manual_seed(0)
    old = {"model": {f"layer{i}.weight": torch.randn(16, 16) for i in range(6)}}
    new = {"model": {f"layer{i}.weight": torch.randn(16, 16) + 10 for i in range(6)}}
    xla_ckpt.save(old, str(tmp_path / "old"))
    xla_ckpt.save(new, str(tmp_path / "new"))
    out = tmp_path / "hf"
    r = cli("export", str(tmp_path / "old"), str(out), "--format", "safetensors",
            "--max-shard-size", "1KB")
    assert r.code == 0, r.err
    assert len([n for n in _hf_files(out) if n.startswith("model-")]) == 6
    r = cli("export", str(tmp_path / "new"), str(out), "--format", "safetensors")
    assert r.code == 2 and f"{out} already holds HF safetensors weights" in r.err
    assert "pass --overwrite" in r.err
    r = cli("export", str(tmp_path / "new"), str(out), "--format", "safetensors", "--overwrite")
    assert r.code == 0, r.err
    assert _hf_files(out) == ["model.safetensors"]
    assert_state_identical(xla_ckpt.load(str(out)), new["model"])
    # and back to shards: model.safetensors goes, the new index names only new shards
    r = cli("export", str(tmp_path / "old"), str(out), "--format", "safetensors",
            "--max-shard-size", "3KB", "--overwrite")
    assert r.code == 0, r.err
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert _hf_files(out) == sorted([*shards, "model.safetensors.index.json"])
    assert len(shards) == 3 and all(s.endswith("-of-00003.safetensors") for s in shards)
    assert_state_identical(xla_ckpt.load(str(out)), old["model"])


def test_convert_draws_read_and_write_progress_on_a_terminal(tmp_path, monkeypatch, capsys):
    from xla_ckpt.cli.main import main

    torch.save({"model": {"w": torch.zeros(64, 1024)}}, str(tmp_path / "old.pt"))  # 256 KiB
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    assert main(["convert", str(tmp_path / "old.pt"), str(tmp_path / "ck")]) == 0
    drawn = term.getvalue()
    assert "\rread: " in drawn and "\rwrite: " in drawn and "KiB" in drawn
    assert torch.equal(xla_ckpt.load(str(tmp_path / "ck"))["model"]["w"], torch.zeros(64, 1024))
    capsys.readouterr()


def test_save_progress_counts_every_byte_of_every_data_file_once(tmp_path):
    counted: list[int] = []
    state = {"w": torch.randn(300, 1024), "b": torch.ones(3), "step": 7}  # 1.2 MiB + a tiny blob
    xla_ckpt.save(state, str(tmp_path / "ck"), rank_states={0: {"r": torch.ones(2)},
                                                                1: {"r": torch.zeros(5)}},
                     progress=counted.append)
    sizes = [os.path.getsize(p) for p in (tmp_path / "ck").glob("data-*.safetensors")]
    assert len(sizes) == 2  # rank 0's items share the state's file; rank 1 has its own
    assert sum(counted) == sum(sizes) and all(n > 0 for n in counted)
