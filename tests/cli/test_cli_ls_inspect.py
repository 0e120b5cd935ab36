"""``xla-ckpt ls`` and ``xla-ckpt inspect`` on local folders and ``gs://`` (emulator)."""

import json
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from cli_helpers import exists, flip_byte, make_run, training_state

import xla_ckpt
from xla_ckpt.storage import open_storage

SPECS = [("checkpoint_1_100", 100, 1, 2.5), ("checkpoint_2_200", 200, 2, 1.5),
         ("checkpoint_3_300", 300, 3, 1.75)]


def test_ls_lists_committed_with_fields_and_pointers_and_incomplete_apart(cli, root):
    make_run(root, SPECS, last="checkpoint_3_300", best="checkpoint_2_200",
             incomplete=["checkpoint_4_400"])
    r = cli("ls", root)
    assert r.code == 0 and r.err == ""
    lines = r.out.splitlines()
    assert lines[0].endswith(": 3 committed, 1 incomplete")
    assert lines[1].split() == ["NAME", "EPOCH", "STEP", "ITER", "LOSS", "SIZE", "SAVED",
                                "(UTC)", "POINTERS"]
    rows = [ln.split() for ln in lines[2:5]]
    assert [r_[:5] for r_ in rows] == [["checkpoint_1_100", "1", "100", "7", "2.5"],
                                       ["checkpoint_2_200", "2", "200", "7", "1.5"],
                                       ["checkpoint_3_300", "3", "300", "7", "1.75"]]
    assert rows[1][-1] == "best" and rows[2][-1] == "last" and rows[0][-1] != "best"
    assert all(row[6] == "KiB" for row in rows)  # SIZE "x.y KiB"
    assert lines[5:] == ["incomplete (no commit marker; never restored):", "  checkpoint_4_400"]


def test_ls_json(cli, root):
    make_run(root, SPECS[:2], last="checkpoint_2_200", incomplete=["checkpoint_9_900"])
    r = cli("ls", root, "--json")
    assert r.code == 0
    doc = json.loads(r.out)
    assert doc["pointers"] == {"last": "checkpoint_2_200", "best": None}
    assert [(c["name"], c["num_updates"], c["epoch"], c["step"], c["iterations_in_epoch"],
             c["loss"], c["pointers"])
            for c in doc["committed"]] == [("checkpoint_1_100", 100, 1, 100, 7, 2.5, []),
                                           ("checkpoint_2_200", 200, 2, 200, 7, 1.5, ["last"])]
    assert all(c["nbytes"] > 0 and len(c["save_id"]) == 12 for c in doc["committed"])
    assert doc["incomplete"] == [{"name": "checkpoint_9_900", "error": ""}]


def test_ls_flags_a_corrupt_manifest_and_a_dangling_pointer(cli, root):
    make_run(root, SPECS[:2], last="checkpoint_7_700")
    with open_storage(root) as st:
        st.write_atomic("checkpoint_2_200/manifest.json", [b"{not json"])
    r = cli("ls", root)
    assert r.code == 0
    assert r.out.splitlines()[0].endswith(
        "1 committed, 0 incomplete, 1 committed but unreadable")
    assert ("warning: pointer checkpoint_last names 'checkpoint_7_700', which is not a committed "
            "checkpoint (restores ignore it)") in r.out
    bad = [ln for ln in r.out.splitlines() if ln.startswith("  checkpoint_2_200")]
    assert len(bad) == 1 and "(unreadable: " in bad[0] and "not a valid JSON manifest" in bad[0]


def test_ls_lists_committed_but_unreadable_apart_from_incomplete_with_the_reason(cli, root):
    """A manifest present but unusable (crc mismatch, a hostile chunk table, a newer format
    version) is not an incomplete save: its own heading and reason, in text and --json; gc
    keeps it."""
    from xla_ckpt.format.manifest import seal

    names = ["checkpoint_1_100", "checkpoint_2_200", "checkpoint_3_300"]
    make_run(root, [(n, 100, 1, 1.0) for n in names] + [("checkpoint_4_400", 400, 4, 1.0)],
             incomplete=["checkpoint_9_900"])
    with open_storage(root) as st:
        raw = st.read_bytes(f"{names[0]}/manifest.json")
    at = raw.index(b'"created_unix_s":') + len(b'"created_unix_s":') + 2
    flip_byte(f"{root}/{names[0]}", "manifest.json", at)  # a digit: the crc32c fails

    def reseal(name: str, change) -> None:
        with open_storage(root) as st:
            doc = json.loads(st.read_bytes(f"{name}/manifest.json"))
            doc.pop("manifest_crc32c")
            change(doc)
            st.write_atomic(f"{name}/manifest.json", [seal(json.dumps(doc).encode())])

    def hostile(doc: dict) -> None:  # a chunk pointing at an item that does not exist
        doc["version"] = 2
        doc["global_tensors"] = [{"key": "state['x']", "dtype": "float32", "shape": [4],
                                  "placement": "Shard(0)",
                                  "chunks": [{"item": "chunks/00007", "tensor": 0,
                                              "offsets": [0], "sizes": [4]}]}]

    reseal(names[1], hostile)
    reseal(names[2], lambda doc: doc.update(version=3))
    r = cli("ls", root)
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[0].endswith(": 1 committed, 1 incomplete, 3 committed but unreadable"), lines
    at = lines.index(next(ln for ln in lines if ln.startswith("committed but unreadable")))
    rows = lines[at + 1:at + 4]
    assert [row.split()[0] for row in rows] == names
    assert "(unreadable: manifest crc32c mismatch" in rows[0]
    assert "(unreadable: " in rows[1] and "chunks/00007" in rows[1]
    assert rows[2] == ("  checkpoint_3_300  (unreadable: manifest version 3 is newer than this "
                       "xla_ckpt reads (versions 1, 2); upgrade xla_ckpt)")
    assert lines[at + 4:at + 6] == ["incomplete (no commit marker; never restored):",
                                    "  checkpoint_9_900"]
    doc = json.loads(cli("ls", root, "--json").out)
    assert [u["name"] for u in doc["unreadable"]] == names
    assert doc["unreadable"][2]["reason"] == rows[2].split("(", 1)[1][:-1]
    assert all(u["reason"].startswith("unreadable: ") and u["error"] for u in doc["unreadable"])
    assert doc["incomplete"] == [{"name": "checkpoint_9_900", "error": ""}]
    r = cli("gc", root, "--keep-last", "1")
    assert all(exists(root, f"{n}/manifest.json") for n in names), r.out


def test_ls_empty_and_missing(cli, root, tmp_path):
    r = cli("ls", root)
    assert r.code == 0 and r.out.splitlines()[0].endswith(": 0 committed, 0 incomplete")
    r = cli("ls", str(tmp_path / "nope"))
    assert r.code == 2 and r.out == ""
    assert r.err == f"xla-ckpt ls: error: {tmp_path / 'nope'}: no such folder\n"


def test_inspect_checkpoint_folder_shows_tree_and_summary(cli, root):
    make_run(root, SPECS[:1])
    r = cli("inspect", f"{root}/checkpoint_1_100")
    assert r.code == 0 and r.err == ""
    out = r.out.splitlines()
    assert out[0].startswith("checkpoint  ") and out[0].endswith("/checkpoint_1_100")
    assert "latest in" not in out[0]
    body = "\n".join(out)
    for line in ["      weight  float32[3, 4]  48 B", "      bias  float32[3]  12 B",
                 "          exp_avg_sq  float32[3, 4]  48 B",
                 "          betas  (0.9, 0.98)",
                 "      train_iterator  {'epoch': 2, 'iterations_in_epoch': 7, 'version': 2}",
                 "  model          2 tensors, 15 elements, 60 B (float32)",
                 "  lr_scheduler   {'best': 1.5, 'last_epoch': 2}",
                 "  num_updates    100",
                 "  training_time  12.5 s before this save",
                 "  metrics        train"]:
        assert line in out, line
    opt = next(ln for ln in out if ln.startswith("  optimizer "))
    assert opt == ("  optimizer      AdamW (criterion CrossEntropyCriterion), 1 param groups, "
                   "lr 0.01")
    assert "state for 2 params (exp_avg, exp_avg_sq, step)" in body


def test_inspect_run_folder_picks_latest_and_json_summary(cli, root):
    make_run(root, SPECS, last="checkpoint_2_200")
    r = cli("inspect", root, "--json")
    assert r.code == 0
    doc = json.loads(r.out)
    # checkpoint_last names 200 but 300 is newer and committed: restores take 300, so does inspect.
    assert doc["uri"].endswith("/checkpoint_3_300") and doc["run"].rstrip("/") == root.rstrip("/")
    s = doc["summary"]
    assert s["num_updates"] == 300
    assert s["optimizer"]["name"] == "AdamW" and s["optimizer"]["lr"] == [0.01]
    assert s["optimizer"]["hyperparameters"]["betas"] == [0.9, 0.98]
    assert s["optimizer"]["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert s["train_iterator"] == {"epoch": 2, "iterations_in_epoch": 7, "version": 2}
    assert s["model"] == {"tensors": 2, "elements": 15, "nbytes": 60, "dtypes": ["float32"]}
    tree = doc["items"]["state"]["tree"]
    assert tree["model"]["weight"] == {"tensor": {"dtype": "float32", "shape": [3, 4],
                                                  "nbytes": 48}}
    assert tree["args"] == {"lr": [0.01], "arch": "tiny"}
    assert tree["extra_state"]["val_loss"] == 1.25
    assert doc["metadata"]["num_updates"] == 300


def test_inspect_rank_items_and_depth(cli, root):
    state = training_state()
    xla_ckpt.save(state, f"{root}/ck", rank_states={
        0: {"train_iterator": {"epoch": 2, "iterations_in_epoch": 3}},
        1: {"train_iterator": {"epoch": 2, "iterations_in_epoch": 4}}})
    r = cli("inspect", f"{root}/ck", "--depth", "1")
    assert r.code == 0
    assert "item 'rank/00001': 0 tensors, 0 B" in r.out
    assert "  rank/00001     iterator {'epoch': 2, 'iterations_in_epoch': 4}; no tensors" in \
        r.out.splitlines()
    assert "    model  (OrderedDict, 2 entries, 2 tensors, 60 B)" in r.out.splitlines()
    assert "      weight  float32[3, 4]  48 B" not in r.out.splitlines()


def test_inspect_errors_exit_codes(cli, root):
    r = cli("inspect", f"{root}/missing")
    assert r.code == 2 and r.out == ""
    assert r.err.startswith("xla-ckpt inspect: error: ") and "no checkpoint here" in r.err
    assert r.err.count("\n") == 1 and "Traceback" not in r.err
    make_run(root, [], incomplete=["checkpoint_5_500"])
    r = cli("inspect", root)
    assert r.code == 1
    assert "run folder has no committed checkpoint (incomplete: checkpoint_5_500)" in r.err


def test_inspect_a_legacy_pt_shows_the_import(cli, root):
    import io

    import torch

    buf = io.BytesIO()
    torch.save(training_state(num_updates=42), buf)
    with open_storage(root) as st:
        st.write_atomic("old/checkpoint_last.pt", [buf.getvalue()])
    r = cli("inspect", f"{root}/old/checkpoint_last.pt")
    assert r.code == 0 and r.err == ""
    lines = r.out.splitlines()
    assert lines[0] == (f"legacy file {root}/old/checkpoint_last.pt  (fairseq torch_zip; shown as "
                        "`xla-ckpt convert --layout auto` would import it)")
    assert "      weight  float32[3, 4]  48 B" in lines
    assert "  num_updates    42" in lines
    r = cli("inspect", f"{root}/old/checkpoint_last.pt", "--json", "--layout", "raw")
    doc = json.loads(r.out)
    assert doc["legacy"] == "torch_zip" and doc["tree"]["cfg"] is None  # raw: not upgraded
    assert doc["tree"]["model"]["bias"] == {"tensor": {"dtype": "float32", "shape": [3],
                                                       "nbytes": 12}}


def test_ls_lists_checkpoints_of_another_kind_apart_with_their_kind(cli, tmp_path):
    root = str(tmp_path / "run")
    make_run(root, SPECS[:1], incomplete=["checkpoint_4_400"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=os.path.join(root, "100"), no_dist=True)
    torch.save({"model": {}}, os.path.join(root, "checkpoint_last.pt"))
    r = cli("ls", root)
    assert r.code == 0
    lines = r.out.splitlines()
    assert lines[0] == f"{root}: 1 committed, 1 incomplete, 2 of another kind"
    assert lines[3:] == [
        "incomplete (no commit marker; never restored):", "  checkpoint_4_400",
        ("of another kind (not written by xla_ckpt; rm/gc never delete them; xla_ckpt.load and "
         "`xla-ckpt convert` read them):"),
        "  100  (a PyTorch DCP checkpoint folder (.metadata))",
        "  checkpoint_last.pt  (a legacy torch.save/fairseq .pt or safetensors file)"]
    doc = json.loads(cli("ls", root, "--json").out)
    assert doc["incomplete"] == [{"name": "checkpoint_4_400", "error": ""}]
    assert doc["other_kinds"] == [
        {"name": "100", "kind": "a PyTorch DCP checkpoint folder (.metadata)"},
        {"name": "checkpoint_last.pt",
         "kind": "a legacy torch.save/fairseq .pt or safetensors file"}]
