"""``xla-ckpt export`` never drops the per-rank items ``rank/<r>`` silently (issue 25).

pt and dcp refuse a checkpoint holding them (naming them and ``--rank-states``), nest them as
``state["rank_states"][r]`` (read back by ``torch.load`` / ``dcp.load``), or drop them with a
note; safetensors writes the weights only and names what it left out.
"""

import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import xla_ckpt
from xla_ckpt.errors import RankItemsNotExportedError
from xla_ckpt.kinds.export import export


def _state() -> dict:
    return {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
            "optimizer": {"lr": 0.5}, "num_updates": 4}


RANKS: dict[int, dict[str, Any]] = {
    0: {"iterator": {"epoch": 1, "offset": 3}, "rng": torch.tensor([1, 2], dtype=torch.int64)},
    1: {"iterator": {"epoch": 1, "offset": 7}, "rng": torch.tensor([5, 6], dtype=torch.int64)}}


def _save(root: str, ranks: dict | None = RANKS) -> str:
    ck = f"{root}/ck"
    xla_ckpt.save(_state(), ck, rank_states=ranks)
    return ck


@pytest.mark.parametrize("fmt,dst", [("pt", "out.pt"), ("dcp", "out-dcp")])
def test_pt_and_dcp_refuse_per_rank_items_naming_them_and_the_option(cli, root, fmt, dst):
    ck = _save(root)
    r = cli("export", ck, f"{root}/{dst}", "--format", fmt)
    assert r.code == 2 and r.out == ""
    assert r.err == (f"xla-ckpt export: error: {ck} holds per-rank items (rank/00000, rank/00001: "
                     "each rank's own state, e.g. its iterator position and RNG state) that a "
                     f"--format {fmt} export has no place of its own for; pass --rank-states "
                     "nest (rank_states='nest') to write them as state['rank_states'][rank], or "
                     "--rank-states drop to leave them out\n")
    with pytest.raises(RankItemsNotExportedError) as e:
        export(ck, f"{root}/{dst}", fmt=fmt)
    assert e.value.items == ["rank/00000", "rank/00001"]


def test_pt_nests_per_rank_items_for_torch_load(cli, root, tmp_path):
    ck = _save(tmp_path.as_posix())
    out = tmp_path / "out.pt"
    r = cli("export", ck, str(out), "--format", "pt", "--rank-states", "nest")
    assert r.code == 0, r.err
    assert ("  note: the per-rank items rank/00000, rank/00001 are written as "
            "state['rank_states'][rank] (ranks [0, 1])") in r.out.splitlines()
    got = torch.load(out, weights_only=True)
    assert sorted(got) == ["model", "num_updates", "optimizer", "rank_states"]
    assert torch.equal(got["model"]["w"], _state()["model"]["w"])
    assert sorted(got["rank_states"]) == [0, 1]
    for rank, want in RANKS.items():
        assert got["rank_states"][rank]["iterator"] == want["iterator"]
        assert torch.equal(got["rank_states"][rank]["rng"], want["rng"])
        assert got["rank_states"][rank]["rng"].dtype == torch.int64


def test_drop_leaves_them_out_with_a_note_and_no_ranks_needs_no_option(cli, root):
    ck = _save(root, {3: {"seed": torch.tensor([9])}})  # another input: one rank, rank 3
    r = cli("export", ck, f"{root}/out.pt", "--format", "pt", "--rank-states", "drop")
    assert r.code == 0, r.err
    assert "  note: not exported: the per-rank items rank/00003 (each rank's own state)" \
        in r.out.splitlines()
    plain = _save(f"{root}/plain", None)
    r = cli("export", plain, f"{root}/plain.pt", "--format", "pt")
    assert r.code == 0 and "note" not in r.out


def test_dcp_nests_per_rank_items(root, tmp_path):
    ck = _save(tmp_path.as_posix())
    report = export(ck, str(tmp_path / "out-dcp"), fmt="dcp", rank_states="nest")
    assert any("state['rank_states'][rank]" in n for n in report.notes)
    target: dict[str, Any] = {"model": {"w": torch.zeros(2, 3)},
                              "rank_states": {0: {"rng": torch.zeros(2, dtype=torch.int64)},
                                              1: {"rng": torch.zeros(2, dtype=torch.int64)}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(tmp_path / "out-dcp"))
    assert torch.equal(target["model"]["w"], _state()["model"]["w"])
    assert torch.equal(target["rank_states"][1]["rng"], RANKS[1]["rng"])


def test_safetensors_names_what_it_leaves_out(cli, root):
    ck = _save(root)
    r = cli("export", ck, f"{root}/hf", "--format", "safetensors")
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert ("  note: not exported (safetensors holds the model weights only): optimizer, "
            "num_updates") in lines
    assert ("  note: not exported: the per-rank items rank/00000, rank/00001 (each rank's own "
            "state)") in lines
    r = cli("export", ck, f"{root}/hf2", "--format", "safetensors", "--rank-states", "nest")
    assert r.code == 2 and "--rank-states nest applies to --format pt and dcp" in r.err


def test_nest_refuses_a_state_that_has_no_room(tmp_path):
    ck = str(tmp_path / "ck")
    xla_ckpt.save({"rank_states": 1, "w": torch.ones(1)}, ck, rank_states={0: {"a": 1}})
    with pytest.raises(RankItemsNotExportedError, match=(
            r"cannot nest the per-rank items rank/00000: its state already has a "
            r"'rank_states' entry; pass --rank-states drop")):
        export(ck, str(tmp_path / "o.pt"), fmt="pt", rank_states="nest")


def test_convert_to_dcp_takes_the_same_choice(cli, tmp_path):
    ck = _save(tmp_path.as_posix())
    r = cli("convert", ck, str(tmp_path / "d1"), "--to", "dcp")
    assert r.code == 2 and "holds per-rank items (rank/00000, rank/00001" in r.err
    r = cli("convert", ck, str(tmp_path / "d2"), "--to", "dcp", "--rank-states", "drop")
    assert r.code == 0, r.err
    assert ("  note: not exported: the per-rank items rank/00000, rank/00001 (each rank's own "
            "state)") in r.out.splitlines()
