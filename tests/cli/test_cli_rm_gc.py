"""``xla-ckpt rm`` / ``xla-ckpt gc``: retention applied safely on local folders and ``gs://``.

Never deleted: a checkpoint a pointer names, the newest committed one, and
(for ``gc``) incomplete folders unless ``--incomplete``.  The manifest goes
first so an interrupted deletion leaves an incomplete folder.
"""

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from cli_helpers import exists, listing, make_run

from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.run.catalog import list_checkpoints, write_pointer
from xla_ckpt.run.prune import delete_checkpoint
from xla_ckpt.storage import open_storage
from xla_ckpt.storage.local import LocalStorage

SPECS = [("checkpoint_1_100", 100, 1, 2.5), ("checkpoint_2_200", 200, 2, 1.5),
         ("checkpoint_3_300", 300, 3, 1.75), ("checkpoint_4_400", 400, 4, 1.9)]


def names(root):
    with open_storage(root) as st:
        return [(e.name, e.committed) for e in list_checkpoints(st)]


def test_rm_deletes_named_and_keeps_protected(cli, root):
    make_run(root, SPECS, last="checkpoint_3_300", best="checkpoint_2_200")
    r = cli("rm", root, "checkpoint_1_100", "checkpoint_2_200", "checkpoint_4_400",
            "checkpoint_9_900")
    assert r.code == 1 and r.err == ""
    assert r.out.splitlines() == [
        "deleted checkpoint_1_100",
        "kept checkpoint_9_900: no such checkpoint in this run folder",
        ("kept checkpoint_2_200: named by the checkpoint_best pointer; pass --force to remove "
         "it anyway (checkpoint_best, which names checkpoint_2_200, is removed with it)"),
        ("kept checkpoint_4_400: the newest committed checkpoint; pass --force to remove it "
         "anyway: checkpoint_last then moves back to checkpoint_3_300 (the newest intact "
         "committed checkpoint that stays); or restore checkpoint_3_300 without removing "
         "anything: CheckpointConfig.restore_file='checkpoint_3_300' (CheckpointManager), "
         f"Checkpointer.load_checkpoint('{root}/checkpoint_3_300')"),
        r.out.splitlines()[-1],
    ]
    assert r.out.splitlines()[-1].startswith("freed ") and "(1 checkpoints)" in r.out
    assert names(root) == [("checkpoint_2_200", True), ("checkpoint_3_300", True),
                           ("checkpoint_4_400", True)]
    assert listing(f"{root}/checkpoint_1_100") == []


def test_rm_single_checkpoint_uri_and_dry_run(cli, root):
    make_run(root, SPECS[:3], last="checkpoint_3_300")
    r = cli("rm", f"{root}/checkpoint_2_200", "--dry-run")
    assert r.code == 0 and r.out.splitlines()[0] == "would delete checkpoint_2_200"
    assert "(1 checkpoints, dry run)" in r.out
    assert len(names(root)) == 3
    r = cli("rm", f"{root}/checkpoint_2_200")
    assert r.code == 0 and r.out.splitlines()[0] == "deleted checkpoint_2_200"
    assert [n for n, _ in names(root)] == ["checkpoint_1_100", "checkpoint_3_300"]
    r = cli("rm", f"{root}/checkpoint_3_300")
    assert r.code == 1 and r.out.splitlines()[0] == (
        "kept checkpoint_3_300: named by the checkpoint_last pointer; pass --force to remove it "
        "anyway: checkpoint_last then moves back to checkpoint_1_100 (the newest intact "
        "committed checkpoint that stays); or restore checkpoint_1_100 without removing "
        "anything: CheckpointConfig.restore_file='checkpoint_1_100' (CheckpointManager), "
        f"Checkpointer.load_checkpoint('{root}/checkpoint_1_100')")


def test_rm_may_delete_an_incomplete_folder_by_name(cli, root):
    make_run(root, SPECS[:1], incomplete=["checkpoint_2_200"])
    r = cli("rm", root, "checkpoint_2_200")
    assert r.code == 0
    assert names(root) == [("checkpoint_1_100", True)]


def test_gc_keep_last_respects_pointers_and_incomplete(cli, root):
    make_run(root, SPECS, last="checkpoint_4_400", best="checkpoint_1_100",
             incomplete=["checkpoint_5_500"])
    r = cli("gc", root, "--keep-last", "1", "--dry-run")
    assert r.code == 0
    assert r.out.splitlines()[:2] == ["would delete checkpoint_2_200",
                                      "would delete checkpoint_3_300"]
    assert len(names(root)) == 5
    r = cli("gc", root, "--keep-last", "1")
    assert r.code == 0
    assert names(root) == [("checkpoint_5_500", False), ("checkpoint_1_100", True),
                           ("checkpoint_4_400", True)]  # incomplete ones sort first
    r = cli("gc", root, "--keep-last", "1", "--incomplete")
    assert r.code == 0 and r.out.splitlines()[0] == "deleted checkpoint_5_500"
    assert [n for n, _ in names(root)] == ["checkpoint_1_100", "checkpoint_4_400"]


def test_gc_keep_best_by_metric(cli, root):
    make_run(root, SPECS)
    r = cli("gc", root, "--keep-best", "1")
    assert r.code == 0
    # best loss is checkpoint_2_200; checkpoint_4_400 is the newest committed.
    assert [n for n, _ in names(root)] == ["checkpoint_2_200", "checkpoint_4_400"]
    make_run(root, SPECS[:1])
    r = cli("gc", root, "--keep-best", "1", "--maximize")
    assert r.code == 0
    assert [n for n, _ in names(root)] == ["checkpoint_1_100", "checkpoint_4_400"]


def test_gc_needs_a_policy_and_validates_it(cli, root):
    r = cli("gc", root)
    assert r.code == 2 and r.err == ("xla-ckpt gc: error: nothing to do: pass --keep-last N, "
                                     "--keep-best N, --incomplete and/or --in-flight\n")
    r = cli("gc", root, "--keep-last", "-5")
    assert r.code == 2 and "retention.keep_last must be an integer >= -1, got -5" in r.err


def test_pointer_moved_after_planning_is_still_honoured(tmp_path):
    root = str(tmp_path / "run")
    make_run(root, SPECS)

    class MovesPointer(LocalStorage):
        """A concurrent save repoints checkpoint_last while the first checkpoint is deleted."""

        moved = False

        def delete(self, name, **kw):
            if not MovesPointer.moved:
                MovesPointer.moved = True
                write_pointer(LocalStorage(root), "last", "checkpoint_2_200")
            super().delete(name, **kw)

    from xla_ckpt.run.prune import remove_checkpoints

    with MovesPointer(root) as run:
        result = remove_checkpoints(run, ["checkpoint_1_100", "checkpoint_2_200"])
    assert result.deleted == ["checkpoint_1_100"]
    assert list(result.refused) == ["checkpoint_2_200"]
    assert result.refused["checkpoint_2_200"].startswith(
        "named by the checkpoint_last pointer; pass --force to remove it anyway: checkpoint_last "
        "then moves back to checkpoint_4_400")
    assert exists(root, f"checkpoint_2_200/{MANIFEST_NAME}")


def test_delete_removes_the_commit_marker_first(tmp_path):
    root = str(tmp_path / "run")
    make_run(root, SPECS[:2])
    order = []

    class Recording(LocalStorage):
        def delete(self, name, **kw):
            order.append(name)
            super().delete(name, **kw)

    with Recording(root) as run:
        n = delete_checkpoint(run, "checkpoint_1_100")
    assert n == 2 and order[0] == f"checkpoint_1_100/{MANIFEST_NAME}"
    assert order[1].startswith("checkpoint_1_100/data-")
    assert names(root) == [("checkpoint_2_200", True)]
    assert sorted(os.listdir(root)) == ["checkpoint_2_200"]  # the emptied folder went too


def _add_foreign(run_dir: str) -> None:
    """A torch_xla/torchtitan DCP step folder and a fairseq ``.pt`` copied into a run folder."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=os.path.join(run_dir, "100"),
                 no_dist=True)
    torch.save({"model": {"w": torch.arange(4.0)}}, os.path.join(run_dir, "checkpoint_last.pt"))


def test_rm_and_gc_never_delete_a_checkpoint_of_another_kind(cli, tmp_path):
    root = str(tmp_path / "run")
    make_run(root, SPECS[:2], last="checkpoint_2_200")
    _add_foreign(root)
    before = sorted(listing(f"{root}/100"))
    assert before == [".metadata", "__0_0.distcp"]
    r = cli("rm", root, "100", "checkpoint_last.pt", "checkpoint_1_100")
    assert r.code == 1 and r.err == ""
    assert r.out.splitlines()[:3] == [
        "deleted checkpoint_1_100",
        ("kept 100: 100 is a PyTorch DCP checkpoint folder (.metadata), which xla_ckpt did not "
         "write; rm and gc delete only what xla_ckpt wrote. Left alone: remove it by hand if "
         "you mean to (xla_ckpt.load and `xla-ckpt convert` read it)"),
        ("kept checkpoint_last.pt: checkpoint_last.pt is a legacy torch.save/fairseq .pt or "
         "safetensors file, which xla_ckpt did not write; rm and gc delete only what xla_ckpt "
         "wrote. Left alone: remove it by hand if you mean to (xla_ckpt.load and `xla-ckpt "
         "convert` read it)")]
    r = cli("rm", f"{root}/100")
    assert r.code == 1 and r.out.splitlines()[0].startswith("kept 100: 100 is a PyTorch DCP")
    r = cli("gc", root, "--keep-last", "1", "--incomplete")
    assert r.code == 0
    assert r.out.splitlines()[0].startswith("kept 100: 100 is a PyTorch DCP checkpoint folder")
    assert "deleted" not in r.out
    assert sorted(listing(f"{root}/100")) == before and exists(root, "checkpoint_last.pt")
    assert not exists(root, "lease.json")  # rm/gc take no lease
