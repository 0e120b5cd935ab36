"""CheckpointManager on gs:// (the real google-cloud-storage client against the emulator):
async saves, rotation, pointers and restore behave as on a local folder."""

import torch
from manager_helpers import make_cfg

import xla_ckpt
from xla_ckpt.manager import CheckpointManager
from xla_ckpt.run.catalog import list_checkpoints, read_pointer
from xla_ckpt.storage import open_storage


def test_async_saves_rotation_and_restore_on_gcs(gcs_uri):
    run = f"{gcs_uri}/run"
    cfg = make_cfg(run, save_interval_updates=2, keep_interval_updates=2, async_save=True)
    emb = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    snapshots = {}
    with CheckpointManager(cfg) as mgr:
        for n in range(1, 9):
            emb.add_(1.0)
            snapshots[n] = emb.clone()
            mgr.after_update(epoch=1, num_updates=n, rank_state={"n": n},
                             state=lambda n=n: {"emb": emb, "tied": emb, "n": n},
                             metrics={"loss": float(10 - n)} if n % 2 == 0 else None)
    with open_storage(run) as st:
        entries = list_checkpoints(st)
        assert [(e.name, e.committed) for e in entries] == [("checkpoint_1_6", True),
                                                            ("checkpoint_1_8", True)]
        assert read_pointer(st, "last") == read_pointer(st, "best") == "checkpoint_1_8"
    for name, n in (("checkpoint_1_6", 6), ("checkpoint_1_8", 8)):
        state = xla_ckpt.load(f"{run}/{name}")
        assert torch.equal(state["emb"], snapshots[n]) and state["n"] == n
        assert state["tied"].data_ptr() == state["emb"].data_ptr()

    with CheckpointManager(make_cfg(run)) as mgr:
        r = mgr.restore_or_initialize()
    assert r is not None and r.restored is not None
    assert (r.checkpoint, r.uri, r.num_updates) == ("checkpoint_1_8", f"{run}/checkpoint_1_8", 8)
    assert torch.equal(r.state["emb"], snapshots[8]) and r.rank_state == {"n": 8}
    assert r.restored.stats.bytes_read == 64 * 32 * 4  # the tied tensor is stored once
