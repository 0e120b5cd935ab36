"""The one resolver (xla_ckpt.run.resolve): every entry point resolves a URI the same way.

Entry points: ``xla_ckpt.load``, the trainer's default restorer, ``restore()``, the CLI's
``resolve_checkpoint`` and the CheckpointManager.  Run folders give the latest committed
checkpoint everywhere; "nothing committed" (the one fresh-start answer) is
NothingCommittedError and nothing else is; a checkpoint replaced while read is read once more.
"""

from __future__ import annotations

import io
import logging

import pytest
import torch

import xla_ckpt
from xla_ckpt.cli.common import resolve_checkpoint
from xla_ckpt.comm import SingleProcess
from xla_ckpt.errors import (
    BucketNotFoundError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    IncompleteCheckpointError,
    NothingCommittedError,
    UncommittedCheckpointError,
)
from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.manager import CheckpointConfig, CheckpointManager
from xla_ckpt.restore import restore
from xla_ckpt.run.catalog import write_pointer
from xla_ckpt.run.resolve import resolve
from xla_ckpt.run.sniff import ACCEPTED, LEGACY, XLA_CKPT
from xla_ckpt.storage import StorageConfig, open_storage
from xla_ckpt.testing.asserts import assert_state_identical


def state(n: int) -> dict:
    return {"model": {"w": torch.full((3, 4), float(n))}, "a": torch.arange(n + 2.0),
            "b": torch.ones(n + 1, dtype=torch.int64), "num_updates": n}


def make_run(run: str, updates=(2, 4), *, incomplete=("checkpoint_1_6",), last=None) -> None:
    for n in updates:
        xla_ckpt.save(state(n), f"{run}/checkpoint_1_{n}", metadata={"num_updates": n,
                                                                    "epoch": 1})
    with open_storage(run) as st:
        for name in incomplete:
            st.write_atomic(f"{name}/data-0123456789ab-state.safetensors", [b"\0" * 64])
        if last:
            write_pointer(st, "last", last)


def mgr_cfg(save_dir: str, **kw) -> CheckpointConfig:
    return CheckpointConfig(save_dir=save_dir, handle_sigterm=False, async_save=False,
                            save_interval_epochs=0, **kw)


def test_a_run_folder_resolves_to_its_latest_in_every_entry_point(tmp_path):
    run = str(tmp_path / "run")
    make_run(run, last="checkpoint_1_2")  # the pointer lags: the newest committed wins
    latest = f"{run}/checkpoint_1_4"
    r = resolve(run)
    assert (r.kind, r.checkpoint, r.run, r.name) == (XLA_CKPT, latest, run, "checkpoint_1_4")
    assert r.manifest is not None and r.manifest.metadata is not None
    assert_state_identical(xla_ckpt.load(run), state(4))
    got = restore(run, dist=SingleProcess())
    assert got.checkpoint == latest
    assert_state_identical(got.state, state(4))
    target = resolve_checkpoint(run)
    try:
        assert (target.uri, target.run_uri) == (latest, run)
    finally:
        target.storage.close()
    with CheckpointManager(mgr_cfg(run)) as mgr:
        res = mgr.restore_or_initialize()
    assert res is not None and (res.checkpoint, res.num_updates) == ("checkpoint_1_4", 4)
    assert_state_identical(res.state, state(4))


def test_pointer_forms(tmp_path):
    run = str(tmp_path / "run")
    make_run(run, updates=(2, 4, 6), incomplete=())
    assert resolve(f"{run}/checkpoint_last").checkpoint == f"{run}/checkpoint_1_6"
    with pytest.raises(CheckpointNotFoundError) as e:
        xla_ckpt.load(f"{run}/checkpoint_best")
    assert str(e.value) == (f"{run}/checkpoint_best.json: no checkpoint_best pointer; restore "
                            "checkpoint_last or name a checkpoint folder")
    assert not isinstance(e.value, NothingCommittedError)
    with open_storage(run) as st:
        write_pointer(st, "best", "checkpoint_1_4")
    assert_state_identical(xla_ckpt.load(f"{run}/checkpoint_best"), state(4))
    assert restore(f"{run}/checkpoint_best", dist=SingleProcess()).checkpoint == \
        f"{run}/checkpoint_1_4"
    with open_storage(run) as st:
        write_pointer(st, "best", "checkpoint_1_9")
    with pytest.raises(CheckpointNotFoundError, match="names 'checkpoint_1_9', which is not a "
                                                      "committed checkpoint"):
        resolve(f"{run}/checkpoint_best")
    # a folder really named checkpoint_last is an explicit checkpoint, not the pointer
    xla_ckpt.save(state(1), f"{run}/checkpoint_last")
    assert resolve(f"{run}/checkpoint_last").checkpoint == f"{run}/checkpoint_last"


def test_a_legacy_pt_is_recognised_and_imported(tmp_path):
    path = tmp_path / "model.pt"
    buf = io.BytesIO()
    torch.save({"w": torch.arange(4.0), "step": 3}, buf)
    path.write_bytes(buf.getvalue())
    r = resolve(str(path))
    assert (r.kind, r.checkpoint, r.manifest) == (LEGACY, str(path), None)
    assert_state_identical(xla_ckpt.load(str(path)), {"w": torch.arange(4.0), "step": 3})
    other = tmp_path / "notes.txt"
    other.write_text("not a checkpoint at all")
    with pytest.raises(CheckpointNotFoundError) as e:
        xla_ckpt.load(str(other))
    assert str(e.value) == (f"{other} is a file that is not a checkpoint (it starts with "
                            f"b'not a ch'); xla_ckpt reads {ACCEPTED}")
    assert not isinstance(e.value, NothingCommittedError)


def test_nothing_committed_is_one_class_everywhere(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "events.txt").write_text("tensorboard")
    for uri in (tmp_path / "empty", tmp_path / "absent", tmp_path / "logs"):
        uri = str(uri)
        with pytest.raises(NothingCommittedError) as e:
            xla_ckpt.load(uri)
        held = (f" (it holds 1 other object: events.txt; xla_ckpt reads {ACCEPTED})"
                if uri.endswith("logs") else "")
        assert str(e.value) == f"{uri}: no committed checkpoint here{held}" and e.value.uri == uri
        assert not isinstance(e.value, IncompleteCheckpointError)
        assert isinstance(e.value, FileNotFoundError)  # existing "start fresh" callers work
        with pytest.raises(NothingCommittedError):
            restore(uri, dist=SingleProcess())
        # the CLI has no fresh start: its own words and classes (exit 2)
        with pytest.raises(CheckpointNotFoundError) as cli_e:
            resolve_checkpoint(uri)
        assert type(cli_e.value) is CheckpointNotFoundError
        assert str(cli_e.value) == f"{uri}: no checkpoint here ({MANIFEST_NAME} not found)"


def test_incomplete_only_is_uncommitted_and_the_cli_keeps_its_words(tmp_path):
    run = str(tmp_path / "run")
    make_run(run, updates=(), incomplete=("checkpoint_1_2", "checkpoint_1_4"))
    with pytest.raises(UncommittedCheckpointError) as e:
        xla_ckpt.load(run)
    assert e.value.incomplete == ("checkpoint_1_2", "checkpoint_1_4")
    assert isinstance(e.value, IncompleteCheckpointError)
    with pytest.raises(IncompleteCheckpointError) as cli_e:
        resolve_checkpoint(run)
    assert type(cli_e.value) is IncompleteCheckpointError
    assert str(cli_e.value) == (f"{run}: run folder has no committed checkpoint (incomplete: "
                            "checkpoint_1_2, checkpoint_1_4); their saves did not finish")


def test_unreadable_commit_markers_only_are_corrupt_not_nothing(tmp_path):
    run = str(tmp_path / "run")
    make_run(run, updates=(2,), incomplete=())
    with open(f"{run}/checkpoint_1_2/{MANIFEST_NAME}", "r+b") as f:
        f.write(b"}")
    with pytest.raises(CheckpointCorruptError) as e:
        xla_ckpt.load(run)
    assert str(e.value).startswith(f"{run}: no readable committed checkpoint: checkpoint_1_2 "
                                   "has a commit marker that cannot be read (")


def test_a_typo_is_an_error_in_every_entry_point(tmp_path):
    uri = str(tmp_path / "rnu" / "checkpoint_1_2")
    for call in (lambda: xla_ckpt.load(uri), lambda: restore(uri, dist=SingleProcess()),
                 lambda: resolve_checkpoint(uri)):
        with pytest.raises(CheckpointNotFoundError) as e:
            call()
        assert not isinstance(e.value, NothingCommittedError)
        assert "does not exist either; check the path" in str(e.value)


def test_manager_fresh_start_warns_and_named_misses_are_errors(tmp_path, caplog):
    save_dir = str(tmp_path / "new" / "job" / "run")  # a first start: the manager creates it
    with caplog.at_level(logging.WARNING, logger="xla_ckpt.manager.core"):
        with CheckpointManager(mgr_cfg(save_dir)) as mgr:
            calls = []
            assert mgr.restore_or_initialize(lambda: calls.append(1)) is None
    assert calls == [1]
    assert [r.getMessage() for r in caplog.records] == [
        f"[rank 0] {save_dir}: no committed checkpoint here: training starts from scratch"]
    run = str(tmp_path / "run")
    make_run(run, updates=(2,), incomplete=("checkpoint_1_4",))
    with pytest.raises(CheckpointNotFoundError) as e:
        with CheckpointManager(mgr_cfg(run, restore_file="checkpoint_1_3")) as mgr:
            mgr.restore_or_initialize()
    assert type(e.value) is CheckpointNotFoundError  # not the fresh-start class
    with pytest.raises(IncompleteCheckpointError) as e:
        with CheckpointManager(mgr_cfg(run, restore_file="checkpoint_1_4")) as mgr:
            mgr.restore_or_initialize()
    assert not isinstance(e.value, NothingCommittedError)


# ---- gs:// ----------------------------------------------------------------------------------


def test_gcs_nothing_committed_bad_bucket_run_folder_and_a_save_between_reads(gcs_uri, monkeypatch):
    from xla_ckpt.storage.gcs import GCSStorage

    with pytest.raises(NothingCommittedError):
        xla_ckpt.load(f"{gcs_uri}/run")
    with pytest.raises(BucketNotFoundError) as typo:  # a typo'd bucket: not a fresh start
        xla_ckpt.load("gs://no-such-bucket-h11/run")
    assert not isinstance(typo.value, CheckpointNotFoundError)   # never "nothing saved"
    assert "the bucket 'no-such-bucket-h11' does not exist" in str(typo.value)
    run = f"{gcs_uri}/run"
    make_run(run, updates=(2, 4), incomplete=("checkpoint_1_6",))
    assert_state_identical(xla_ckpt.load(run), state(4))
    target = f"{run}/checkpoint_1_4"
    saves: list = []
    seen: set[str] = set()  # data files whose first read triggered a save
    original = GCSStorage.read_range
    times = [1]

    def read_range(storage, name, offset, out, generation=None):
        # The save lands as the first read of each data file starts (one read may cover the
        # whole small file: the reader coalesces small blobs).
        if name.startswith("data-") and name not in seen and len(saves) < times[0]:
            seen.add(name)
            saves.append(xla_ckpt.save(state(40 + len(saves)), target,
                                       metadata={"num_updates": 40 + len(saves)}))
        original(storage, name, offset, out, generation)

    monkeypatch.setattr(GCSStorage, "read_range", read_range)
    config = StorageConfig(max_workers=1)
    # a pinned generation now answers 404: re-resolved, the new save is read
    assert_state_identical(xla_ckpt.load(run, config=config), state(40))
    times[0] = 3
    with pytest.raises(CheckpointReplacedError) as e:
        xla_ckpt.load(target, config=config)
    assert str(e.value) == (f"{target} was replaced while reading (save id {saves[1].save_id} -> "
                            f"{saves[2].save_id}); retry or pause the other writer")


def test_a_pointer_written_by_a_tool_is_outranked_only_by_a_manager_save(tmp_path):
    """Defect 6's rule: a checkpoint_last pointer xla-ckpt convert wrote (converted_from, no
    lease epoch) is followed even when checkpoints with more updates (and no lease epoch)
    are committed; a newer checkpoint a manager saved (lease epoch >= 1) outranks it; any
    other pointer lags only after a crash (the newest committed wins)."""
    run = tmp_path / "run"
    for name, n in (("checkpoint3", 300), ("checkpoint4", 400), ("checkpoint5", 500)):
        xla_ckpt.save(state(n), str(run / name), metadata={"num_updates": n})
    with open_storage(str(run)) as st:
        write_pointer(st, "last", "checkpoint3", num_updates=300, converted_from="x.pt")
        for uri in (str(run), str(run / "checkpoint_last")):
            assert resolve(uri).name == "checkpoint3", uri
            assert_state_identical(xla_ckpt.load(uri), state(300))
        # the manager resumed from it and saved 350 with lease epoch 1; its pointer update
        # was lost (a crash): the manager's save is newer than the tool's pointer
        xla_ckpt.save(state(350), str(run / "checkpoint_3_350"),
                      metadata={"num_updates": 350, "lease_epoch": 1})
        assert resolve(str(run)).name == "checkpoint_3_350"
        # the manager's pointer (with an epoch) is never outranked by epoch-less checkpoints
        write_pointer(st, "last", "checkpoint_3_350", lease_epoch=1, num_updates=350)
        assert resolve(str(run / "checkpoint_last")).name == "checkpoint_3_350"
        # a pointer naming what is not committed is ignored: the newest committed wins
        write_pointer(st, "last", "gone", converted_from="x.pt")
        assert resolve(str(run)).name == "checkpoint_3_350"
        # an operator's pointer (no converted_from) lags as a manager's does
        write_pointer(st, "last", "checkpoint3")
        assert resolve(str(run)).name == "checkpoint_3_350"
