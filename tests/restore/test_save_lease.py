"""``save_distributed(lease=...)`` commits under a CheckpointManager's lease, checked as the
manager's own commit is (issue 23: it committed unfenced).

Real gloo ranks (the launcher's shared 2-worker pool), a real manager's lease, a real second
``acquire_lease`` on the same run folder for the newer incarnation; plain and DTensor state.
"""

from __future__ import annotations

import os

import pytest
import save_lease_workers as W
import torch

import xla_ckpt
from xla_ckpt.testing.launcher import shared_pool


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "dtensor"])
def test_a_stale_lease_is_refused_on_every_rank_and_nothing_is_committed(tmp_path, sharded):
    run = str(tmp_path / "run")
    got = [r.unwrap() for r in shared_pool(2, xla=False).run(W.fenced_saves, run, sharded,
                                                              timeout_s=240)]
    for rank, g in enumerate(got):
        assert g["epoch"] == 1, rank
        # committed under the lease, its epoch recorded as the manager's saves record it
        assert g["a_metadata"]["lease_epoch"] == 1 and g["a_metadata"]["num_updates"] == 1
        # a second commit into a folder this epoch committed: refused (create-only marker)
        kind, msg, failures, _ = g["again"]
        assert kind == "DistributedError", g["again"]
        assert "already holds a committed checkpoint" in failures[0]
        assert "never replaced by its own incarnation" in failures[0]
        # a newer incarnation took the lease while the data files were written: the commit
        # check refuses, on every rank, naming both epochs; nothing of ckpt_b stays
        assert g["newer_epoch"] == 2 if rank == 0 else g["newer_epoch"] is None
        kind, msg, _, epochs = g["during_write"]
        assert kind == "FencedError", g["during_write"]
        assert epochs == (1, 2)
        assert "is fenced: a newer incarnation (lease epoch 2" in msg
        assert "refused to commit" in msg and "ckpt_b" in msg
        assert g["b_files"] == []
        # the next save is refused before any rank writes
        kind, msg, _, epochs = g["before_write"]
        assert kind == "FencedError" and epochs == (1, 2), g["before_write"]
        assert "refused to save" in msg and "ckpt_c" in msg
        assert g["c_files"] == []
    assert got[0]["during_write"] == got[1]["during_write"]
    assert got[0]["before_write"] == got[1]["before_write"]
    assert got[0]["again"][2] == got[1]["again"][2]  # the message names the reporting rank
    # what was committed is whole and unchanged
    a = xla_ckpt.load(os.path.join(run, "ckpt_a"))
    assert torch.equal(a["w"], torch.arange(24, dtype=torch.float32).reshape(6, 4))
    assert a["step"] == 7
    assert sorted(os.listdir(os.path.join(run, "ckpt_a"))) == sorted(
        ["manifest.json", *xla_ckpt.io.read_manifest(
            xla_ckpt.storage.open_storage(os.path.join(run, "ckpt_a"))).files])


@pytest.mark.parametrize("where", ["sub-folder", "another folder", "relative spelling"])
def test_a_lease_commits_only_directly_under_its_own_run_folder(tmp_path, monkeypatch, where):
    # A fenced lease must not escape its fence by saving where its lease.json is not looked at:
    # a folder below a checkpoint folder, or a folder outside the run.  The same run folder
    # spelled another way (relative) is the same place and is fenced as usual.
    from xla_ckpt.errors import ConfigError, FencedError
    from xla_ckpt.manager import CheckpointConfig, CheckpointManager
    from xla_ckpt.restore import save_distributed

    run = tmp_path / "run"
    old = CheckpointManager(CheckpointConfig(save_dir=str(run)))
    old.take_over()
    new = CheckpointManager(CheckpointConfig(save_dir=str(run)))
    new.take_over()  # epoch 2: the old incarnation is fenced
    assert old.lease is not None and old.lease.run.rstrip("/") == str(run)
    if where == "relative spelling":
        monkeypatch.chdir(tmp_path)
        with pytest.raises(FencedError, match="epoch"):
            save_distributed({"w": torch.ones(2)}, "run/checkpoint_1_45", lease=old.lease)
        assert not (run / "checkpoint_1_45" / "manifest.json").exists()
        return
    uri = str(run / "checkpoint_1_45" / "extra") if where == "sub-folder" else \
        str(tmp_path / "elsewhere" / "ck")
    with pytest.raises((ConfigError, xla_ckpt.errors.DistributedError)) as e:
        save_distributed({"w": torch.ones(2)}, uri, lease=old.lease)
    assert "is not a folder directly under it" in str(e.value)
    assert str(run) in str(e.value)
    assert not os.path.exists(os.path.join(uri, "manifest.json"))
    # the current incarnation's own lease saves there (directly under the run) as before
    m = save_distributed({"w": torch.ones(2)}, str(run / "checkpoint_1_46"), lease=new.lease)
    assert m.metadata["lease_epoch"] == 2
