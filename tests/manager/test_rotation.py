"""Rotation: keep-last-N per kind, keep-best-N, and the safety rules (pure planning + deletes)."""

import os

from xla_ckpt.api import save
from xla_ckpt.format.manifest import Manifest
from xla_ckpt.manager import CheckpointConfig
from xla_ckpt.manager.rotation import delete_checkpoint, plan_rotation
from xla_ckpt.run.catalog import CheckpointEntry, list_checkpoints
from xla_ckpt.storage.local import LocalStorage


def entry(name, n, loss=None, committed=True):
    md = {"num_updates": n}
    if loss is not None:
        md["loss"] = loss
    m = Manifest(save_id="x", items={}, files={}, created_unix_s=float(n)) if committed else None
    return CheckpointEntry(name, committed, m, md if committed else None)


RUN = [entry("checkpoint_1_2", 2, 3.0), entry("checkpoint_1_4", 4, 1.0), entry("checkpoint1", 5),
       entry("checkpoint_2_7", 7, 2.0), entry("checkpoint_2_9", 9, 5.0), entry("checkpoint2", 10),
       entry("checkpoint_3_12", 12, committed=False), entry("exported", 3, 0.5)]


def test_keep_last_per_kind():
    cfg = CheckpointConfig(keep_interval_updates=1, keep_last_epochs=1)
    assert plan_rotation(RUN, cfg) == ["checkpoint_1_2", "checkpoint_1_4", "checkpoint1",
                                       "checkpoint_2_7"]


def test_keep_best_overrides_keep_last():
    cfg = CheckpointConfig(keep_interval_updates=1, keep_best_checkpoints=2)
    # best by loss (minimise): exported 0.5 (not ours, never deleted anyway), checkpoint_1_4 1.0
    assert plan_rotation(RUN, cfg) == ["checkpoint_1_2", "checkpoint_2_7"]
    cfg = CheckpointConfig(keep_interval_updates=0, keep_best_checkpoints=1,
                           maximize_best_checkpoint_metric=True)
    assert plan_rotation(RUN, cfg) == ["checkpoint_1_2", "checkpoint_1_4", "checkpoint_2_7"]


def test_protect_newest_and_keep_all():
    cfg = CheckpointConfig(keep_interval_updates=0, keep_last_epochs=0)
    # checkpoint2 is the newest committed; checkpoint_1_4 is protected (being restored)
    assert plan_rotation(RUN, cfg, protect={"checkpoint_1_4"}) == [
        "checkpoint_1_2", "checkpoint1", "checkpoint_2_7"]
    assert plan_rotation(RUN, CheckpointConfig()) == []
    assert plan_rotation([e for e in RUN if not e.committed], cfg) == []


def test_delete_removes_commit_marker_first(local_dir):
    import torch

    run = LocalStorage(local_dir)
    save({"w": torch.ones(2)}, os.path.join(local_dir, "checkpoint_1_2"))
    save({"w": torch.zeros(2)}, os.path.join(local_dir, "checkpoint_1_4"))
    seen = []

    class Recording(LocalStorage):
        def delete(self, name, **kw):
            seen.append(name)
            super().delete(name, **kw)

    n = delete_checkpoint(Recording(local_dir), "checkpoint_1_2")
    assert n == 2 and seen[0] == "checkpoint_1_2/manifest.json" and seen[1].startswith(
        "checkpoint_1_2/data-")
    assert [e.name for e in list_checkpoints(run)] == ["checkpoint_1_4"]
    assert sorted(os.listdir(local_dir)) == ["checkpoint_1_4"]


def test_keep_best_minus_one_keeps_every_checkpoint_with_the_metric():
    cfg = CheckpointConfig(keep_interval_updates=0, keep_last_epochs=0, keep_best_checkpoints=-1)
    assert plan_rotation(RUN, cfg) == ["checkpoint1"]
