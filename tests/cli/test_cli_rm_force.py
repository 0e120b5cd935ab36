"""Recovery from a corrupt newest checkpoint (issue 25 defect 7, CASES C7) and the folders ``rm``
and ``gc`` empty (defect 8; never anything else: C22).

* The restore error (manager, ``Checkpointer``, ``xla_ckpt.load``) names the previous intact
  committed checkpoint and the option of each entry point that restores it.
* ``xla-ckpt rm`` refuses the checkpoint ``checkpoint_last`` names, saying ``--force``;
  ``rm --force`` removes it and moves ``checkpoint_last`` back (by compare-and-swap, no
  lease taken), and a save that moved the pointer meanwhile wins.

Real files and the GCS emulator; the run folders are written by a real ``CheckpointManager``.
"""

from __future__ import annotations

import os

import pytest
import torch
from cli_helpers import flip_byte

import xla_ckpt
from xla_ckpt.errors import CheckpointCorruptError, DistributedError
from xla_ckpt.manager import CheckpointConfig, CheckpointManager
from xla_ckpt.run.catalog import read_pointer_doc, write_pointer
from xla_ckpt.run.fencing import read_lease
from xla_ckpt.run.prune import remove_checkpoints
from xla_ckpt.storage import open_storage
from xla_ckpt.storage.local import LocalStorage
from xla_ckpt.trainer import Checkpointer


def w_at(n: int) -> list[float]:
    return [n + 0.25, n + 0.5, n + 0.75, n + 1.0]


def cfg(root: str, **kw) -> CheckpointConfig:
    kw.setdefault("handle_sigterm", False)
    kw.setdefault("keep_interval_updates", -1)
    return CheckpointConfig(save_dir=root, **kw)


def checkpointer() -> tuple[Checkpointer, torch.nn.Linear]:
    model = torch.nn.Linear(2, 2)
    return Checkpointer(model=model, build_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)), model


def train(root: str, steps: list[int]) -> None:
    """A trainer saving a Checkpointer state at each of ``steps`` (weight :func:`w_at`)."""
    ckpt, model = checkpointer()
    with CheckpointManager(cfg(root)) as mgr:
        for n in steps:
            with torch.no_grad():
                model.weight.copy_(torch.tensor(w_at(n)).view(2, 2))
            ckpt.set_num_updates(n)
            mgr.save(ckpt.state_dict(), epoch=1, num_updates=n, metrics={"loss": 1.0 / n})


def data_file(root: str, name: str) -> str:
    with open_storage(root) as st:
        return next(n for n in st.list(f"{name}/") if "/data-" in n).split("/", 1)[1]


def truncate(root: str, name: str, nbytes: int) -> None:
    """Cut ``nbytes`` off the end of the checkpoint's data file (any backend)."""
    f = data_file(root, name)
    with open_storage(f"{root}/{name}") as st:
        st.write_atomic(f, [st.read_bytes(f)[:-nbytes]])


def drop_data(root: str, name: str) -> None:
    with open_storage(f"{root}/{name}") as st:
        st.delete(data_file(root, name))


def last_doc(root: str, which: str = "last") -> dict | None:
    with open_storage(root) as st:
        return read_pointer_doc(st, which)[0]


def hint(root: str, prev: int, doomed: list[int]) -> str:
    uri = f"{root}/checkpoint_1_{prev}"
    names = " ".join(f"checkpoint_1_{n}" for n in doomed)
    them = "them" if len(doomed) > 1 else names
    return (f" The previous intact committed checkpoint of {root} is checkpoint_1_{prev} (step "
            f"{prev}, lease epoch 1): restore it with CheckpointConfig.restore_file="
            f"'checkpoint_1_{prev}' (CheckpointManager.restore_or_initialize) or "
            f"CheckpointManager.restore(step={prev}), Checkpointer.load_checkpoint('{uri}') or "
            f"xla_ckpt.load('{uri}'); or make it the latest again with `xla-ckpt rm --force "
            f"{root} {names}`, which removes {them} and moves checkpoint_last back to "
            f"checkpoint_1_{prev}.")


def restore_errors(root: str, newest: str) -> dict[str, str]:
    """The message of each entry point's restore of the run folder's latest (and of
    ``xla_ckpt.load`` naming the checkpoint folder itself)."""
    out = {}
    with CheckpointManager(cfg(root)) as mgr:
        with pytest.raises(DistributedError) as e1:
            mgr.restore_or_initialize()
        out["manager"] = str(e1.value)
    ckpt, _ = checkpointer()
    with pytest.raises(CheckpointCorruptError) as e2:
        ckpt.load_checkpoint(root)
    out["checkpointer"] = str(e2.value)
    with pytest.raises(CheckpointCorruptError) as e3:
        xla_ckpt.load(root)
    out["load"] = str(e3.value)
    with pytest.raises(CheckpointCorruptError) as e4:
        xla_ckpt.load(f"{root}/{newest}")
    out["load_named"] = str(e4.value)
    return out


# (how the newest is damaged, what else is damaged, the previous intact one)
CASES = {
    "issue: checkpoint_1_12 truncated": ([10, 12], {12: "truncate"}, 10),
    "crc32c flip in 14, 12's data file gone": ([10, 12, 14], {14: "flip", 12: "drop"}, 10),
}


@pytest.mark.parametrize("case", list(CASES))
def test_restore_error_names_the_previous_intact_checkpoint_and_rm_force_goes_back(cli, root,
                                                                                    case):
    steps, damage, prev = CASES[case]
    train(root, steps)
    for n, how in damage.items():
        name = f"checkpoint_1_{n}"
        if how == "truncate":
            truncate(root, name, 3)
        elif how == "flip":
            flip_byte(f"{root}/{name}", data_file(root, name), -5)
        else:
            drop_data(root, name)
    newest = f"checkpoint_1_{steps[-1]}"
    doomed = [n for n in steps if n > prev]
    errors = restore_errors(root, newest)
    for where, msg in errors.items():
        assert msg.endswith(hint(root, prev, doomed)), (where, msg)
        assert f"{root}/{newest}/data-" in msg, (where, msg)  # the read's own error is kept

    # rm refuses what checkpoint_last names, and says what to do instead.
    r = cli("rm", root, newest)
    assert r.code == 1
    stay = f"checkpoint_1_{prev}"
    assert r.out.splitlines()[0] == (
        f"kept {newest}: named by the checkpoint_last pointer; pass --force to remove it anyway: "
        f"checkpoint_last then moves back to {stay} (the newest intact committed checkpoint "
        f"that stays); or restore {stay} without removing anything: CheckpointConfig."
        f"restore_file='{stay}' (CheckpointManager), Checkpointer.load_checkpoint("
        f"'{root}/{stay}')")
    before = last_doc(root)
    r = cli("rm", "--force", "--dry-run", root, *(f"checkpoint_1_{n}" for n in doomed))
    assert r.code == 0 and last_doc(root) == before
    r = cli("rm", "--force", root, *(f"checkpoint_1_{n}" for n in doomed))
    assert r.code == 0, r.out
    assert r.out.splitlines()[:-1] == [
        *(f"deleted checkpoint_1_{n}" for n in doomed),
        f"moved checkpoint_last from {newest} back to {stay}",
        f"removed checkpoint_best (it named {newest})"]
    assert last_doc(root) == {"checkpoint": stay, "epoch": 1, "lease_epoch": 1,
                              "num_updates": prev, "moved_back_from": newest}
    assert last_doc(root, "best") is None
    with open_storage(root) as st:
        assert sorted({n.split("/")[0] for n in st.list("")}) == \
            [stay, "checkpoint_last.json", "lease.json"]
        lease = read_lease(st)
    assert lease is not None and lease.epoch == 1  # rm took no lease
    if not root.startswith("gs://"):
        assert sorted(os.listdir(root)) == [stay, "checkpoint_last.json", "lease.json"]
    # Every entry point now restores the previous intact one, bitwise; the next save goes on.
    with CheckpointManager(cfg(root)) as mgr:
        r0 = mgr.restore_or_initialize()
        assert r0 is not None and (r0.checkpoint, r0.num_updates) == (stay, prev)
        assert r0.state["model"]["weight"].flatten().tolist() == w_at(prev)
        mgr.save(r0.state, epoch=1, num_updates=prev + 1)
    assert last_doc(root) == {"checkpoint": f"checkpoint_1_{prev + 1}", "epoch": 1,
                              "lease_epoch": 2, "num_updates": prev + 1}
    ckpt, model = checkpointer()
    assert ckpt.load_checkpoint(root) is not None
    assert model.weight.detach().flatten().tolist() == w_at(prev)


def test_rm_force_without_an_intact_checkpoint_to_go_back_to_refuses(cli, root):
    train(root, [10])
    truncate(root, "checkpoint_1_10", 1)
    r = cli("rm", "--force", root, "checkpoint_1_10")
    assert r.code == 1
    assert r.out.splitlines()[0] == (
        "kept checkpoint_1_10: named by the checkpoint_last pointer; not removed even with "
        "--force: no intact committed checkpoint would stay to resume from (to start the run "
        "from scratch, remove the run folder)")
    assert (last_doc(root) or {}).get("checkpoint") == "checkpoint_1_10"
    with CheckpointManager(cfg(root)) as mgr:
        with pytest.raises(DistributedError) as ei:
            mgr.restore_or_initialize()
    assert str(ei.value).endswith(
        f" No intact committed checkpoint older than checkpoint_1_10 is in {root}: nothing to "
        f"fall back to (`xla-ckpt ls {root}` lists what is there).")


def test_rm_force_leaves_a_pointer_a_save_moved_meanwhile(tmp_path):
    """A save moves checkpoint_last to its new checkpoint while ``rm --force`` uncommits the
    bad one: the compare-and-swap sees it and leaves the save's pointer alone."""
    root = str(tmp_path / "run")
    train(root, [10, 12])
    truncate(root, "checkpoint_1_12", 3)

    class SaveMeanwhile(LocalStorage):
        moved = False

        def delete(self, name, **kw):
            super().delete(name, **kw)
            if name == "checkpoint_1_12/manifest.json" and not SaveMeanwhile.moved:
                SaveMeanwhile.moved = True
                with CheckpointManager(cfg(root)) as mgr:
                    mgr.save({"w": torch.ones(2)}, epoch=1, num_updates=14)

    with SaveMeanwhile(root) as run:
        result = remove_checkpoints(run, ["checkpoint_1_12"], force=True)
    assert result.deleted == ["checkpoint_1_12"] and result.repointed == [
        "removed checkpoint_best (it named checkpoint_1_12)"]
    assert last_doc(root) == {"checkpoint": "checkpoint_1_14", "epoch": 1, "lease_epoch": 2,
                              "num_updates": 14}


def test_rm_force_of_a_checkpoint_only_checkpoint_best_names(cli, tmp_path):
    root = str(tmp_path / "run")
    train(root, [10, 12, 14])
    with open_storage(root) as st:
        write_pointer(st, "best", "checkpoint_1_10")
    r = cli("rm", "--force", root, "checkpoint_1_10")
    assert r.code == 0 and r.out.splitlines()[:2] == [
        "deleted checkpoint_1_10", "removed checkpoint_best (it named checkpoint_1_10)"]
    assert last_doc(root, "best") is None
    assert last_doc(root) == {"checkpoint": "checkpoint_1_14", "epoch": 1, "lease_epoch": 1,
                              "num_updates": 14}


def test_gc_and_rm_remove_the_folders_they_empty_and_nothing_else(cli, tmp_path):
    """Local disk: folders rm and gc emptied go; a folder still holding an object that is not
    ours stays (with only that object), and an empty folder they did not empty stays."""
    root = str(tmp_path / "run")
    train(root, [2, 4, 6, 8])
    os.makedirs(os.path.join(root, "notes"))  # someone's empty folder: not ours to remove
    with open(os.path.join(root, "checkpoint_1_4", "model.pt"), "wb") as f:
        f.write(b"not ours")
    r = cli("rm", root, "checkpoint_1_2")
    assert r.code == 0 and r.out.splitlines()[0] == "deleted checkpoint_1_2"
    assert not os.path.exists(os.path.join(root, "checkpoint_1_2"))
    r = cli("gc", root, "--keep-last", "1")
    assert r.code == 0
    assert r.out.splitlines()[:3] == ["deleted checkpoint_1_4", "deleted checkpoint_1_6",
                                      ("left 1 object(s) xla_ckpt did not write in "
                                       "checkpoint_1_4 (e.g. model.pt)")]
    assert sorted(os.listdir(root)) == ["checkpoint_1_4", "checkpoint_1_8",
                                        "checkpoint_best.json", "checkpoint_last.json",
                                        "lease.json", "notes"]
    assert os.listdir(os.path.join(root, "checkpoint_1_4")) == ["model.pt"]
    assert os.listdir(os.path.join(root, "notes")) == []


def test_a_checkpoint_outside_a_run_folder_gets_no_note(root):
    """Two checkpoints saved with xla_ckpt.save side by side (no pointer, no lease): the
    error of the bad one is the read's own, and nothing lists the parent folder for it."""
    xla_ckpt.save({"w": torch.ones(3)}, f"{root}/a")
    xla_ckpt.save({"w": torch.zeros(3)}, f"{root}/b")
    with open_storage(f"{root}/b") as st:
        f = next(n for n in st.list("") if n.startswith("data-"))
        st.write_atomic(f, [st.read_bytes(f)[:-2]])
    with pytest.raises(CheckpointCorruptError) as ei:
        xla_ckpt.load(f"{root}/b")
    assert str(ei.value).endswith("(truncated)")
    assert "previous intact" not in str(ei.value)


def _rank_restores_corrupt(root: str) -> dict:
    """One rank of 2: restore the run folder's latest (truncated) and its step 12."""
    from xla_ckpt.comm import DistConfig, get_dist

    dist = get_dist(DistConfig(backend="gloo", timeout_s=60))
    out: dict = {"rank": dist.rank}
    with CheckpointManager(cfg(root), dist=dist) as mgr:
        for what, call in (("latest", mgr.restore_or_initialize),
                           ("step", lambda: mgr.restore(step=12))):
            try:
                call()
                out[what] = "restored"
            except DistributedError as e:
                out[what] = (type(e).__name__, str(e))
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_rank_gets_the_same_note(tmp_path):
    from xla_ckpt.testing.launcher import shared_pool

    root = str(tmp_path / "run")
    train(root, [10, 12])
    truncate(root, "checkpoint_1_12", 3)
    got = [r.unwrap() for r in shared_pool(2, xla=False).run(_rank_restores_corrupt, root,
                                                              timeout_s=180)]
    assert [g["rank"] for g in got] == [0, 1]
    for what in ("latest", "step"):
        for g in got:  # the restore's own text says which rank reports it; the note is one
            kind, msg = g[what]
            assert kind == "DistributedError" and msg.endswith(hint(root, 10, [12])), msg
            # one host: its leader (rank 0) reads the one shared copy, so it alone meets the
            # truncated file, and rank 1 gets rank 0's error, named
            assert "failed on rank(s) 0 of 2" in msg, msg
            assert "[rank 0: CheckpointCorruptError:" in msg and "(truncated)" in msg, msg
