"""A committed checkpoint is never read as "no checkpoint": the trainer starts over only when
storage says nothing was ever committed at the URI.

The reported case: a trainer checkpoint of ``Linear(2048, 2048, bias=False)`` read with 4 MiB
slices on one worker (the weight in 4 slices), while another ``save_checkpoint`` writes to the
same path between slice 1 and slice 2.  The vanished data file must lead to the new save being
read (resolved once more), or, when it happens again, to an error naming the race; never to
``None`` and num_updates 0.  The second save is triggered from inside the real
``LocalStorage.read_range`` (a fault the real storage cannot produce on demand).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from xla_ckpt.comm import SingleProcess
from xla_ckpt.errors import (
    CheckpointNotFoundError,
    CheckpointReplacedError,
    DataFileMissingError,
    DistributedError,
    NothingCommittedError,
    UncommittedCheckpointError,
)
from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.restore import restore
from xla_ckpt.run.catalog import write_pointer
from xla_ckpt.storage import StorageConfig, open_storage
from xla_ckpt.storage.local import LocalStorage
from xla_ckpt.trainer import Checkpointer, SingleProcessRestorer, make_restorer

SLICE = 4 * 2**20
READ_CONFIG = StorageConfig(slice_size_bytes=SLICE, max_workers=1)
TRAINER_LOG = "xla_ckpt.trainer.checkpointer"


def linear_checkpointer(seed: int, num_updates: int = 0, **kwargs) -> Checkpointer:
    torch.manual_seed(seed)
    model = torch.nn.Linear(2048, 2048, bias=False)
    ck = Checkpointer(model=model, build_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                      **kwargs)
    ck.set_num_updates(num_updates)
    return ck


def weight_of(ck: Checkpointer) -> torch.Tensor:
    w = ck.model.weight
    assert isinstance(w, torch.Tensor)
    return w


def save_linear(uri: str, seed: int, num_updates: int):
    """Save a Linear(2048, 2048) trainer checkpoint; returns (manifest, weight)."""
    ck = linear_checkpointer(seed, num_updates)
    manifest = ck.save_checkpoint(uri, {"train_iterator": {"epoch": 1,
                                                           "iterations_in_epoch": num_updates,
                                                           "version": 2}})
    return manifest, weight_of(ck).detach().clone()


def reader(**kwargs) -> Checkpointer:
    return linear_checkpointer(99, restorer=SingleProcessRestorer(config=READ_CONFIG), **kwargs)


class SaveBetweenSlices:
    """Wraps the real ``LocalStorage.read_range``: after the first 4 MiB slice of a data file
    (one per read attempt), another save commits to ``uri``, ``times`` times in all."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, uri: str, *, times: int,
                 first_seed: int = 10) -> None:
        self.uri, self.times = uri, times
        self.saves: list = []  # (manifest, weight) of each save made mid-read
        self.slices: list[tuple[str, int]] = []
        self._seen: set[str] = set()
        self._seed = first_seed
        original = LocalStorage.read_range

        def read_range(storage, name, offset, out, generation=None):
            original(storage, name, offset, out, generation)
            if not name.startswith("data-") or len(out) != SLICE:
                return
            self.slices.append((name, offset))
            if name not in self._seen and len(self.saves) < self.times:
                self._seen.add(name)
                self._seed += 1
                self.saves.append(save_linear(self.uri, self._seed, 100 * self._seed))

        monkeypatch.setattr(LocalStorage, "read_range", read_range)


def test_the_reported_case_reads_the_new_save(tmp_path, monkeypatch, caplog):
    uri = str(tmp_path / "checkpoint_1_5")
    first, _ = save_linear(uri, seed=1, num_updates=5)
    ((data, size),) = first.files.items()
    assert size > 4 * SLICE  # the weight alone is 4 slices
    hook = SaveBetweenSlices(monkeypatch, uri, times=1)
    ck = reader()
    with caplog.at_level(logging.WARNING):
        extra = ck.load_checkpoint(uri)
    ((second, weight),) = hook.saves
    assert second.save_id != first.save_id
    assert extra is not None and extra["train_iterator"]["iterations_in_epoch"] == 1100
    assert ck.get_num_updates() == 1100  # the new save's, not 0 and not the old 5
    assert torch.equal(weight_of(ck), weight)
    # attempt 1 stopped after its first slice of the old file; attempt 2 read the new file whole
    old = [o for n, o in hook.slices if n == data]
    assert len(old) == 1
    assert len([o for n, o in hook.slices if n != data]) == 4
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        (f"{uri} was replaced while reading (save id {first.save_id} -> {second.save_id}); "
         f"resolving {uri} again and reading it once more")]


def test_replaced_during_both_reads_is_an_error_naming_the_race(tmp_path, monkeypatch):
    uri = str(tmp_path / "checkpoint_1_5")
    save_linear(uri, seed=1, num_updates=5)
    hook = SaveBetweenSlices(monkeypatch, uri, times=2)
    ck = reader()
    with pytest.raises(CheckpointReplacedError) as e:
        ck.load_checkpoint(uri)
    (b, _), (c, _) = hook.saves
    assert str(e.value) == (f"{uri} was replaced while reading (save id {b.save_id} -> "
                            f"{c.save_id}); retry or pause the other writer")
    assert (e.value.uri, e.value.before, e.value.after) == (uri, b.save_id, c.save_id)
    assert isinstance(e.value.__cause__, DataFileMissingError)
    assert not isinstance(e.value, CheckpointNotFoundError)
    assert ck.get_num_updates() == 0


@pytest.mark.parametrize("strategy", ["all_ranks", "broadcast"])
def test_restore_re_decides_once_then_names_the_race(tmp_path, monkeypatch, strategy):
    uri = str(tmp_path / "run")
    first, _ = save_linear(f"{uri}/checkpoint_1_5", seed=1, num_updates=5)
    target = f"{uri}/checkpoint_1_5"
    hook = SaveBetweenSlices(monkeypatch, target, times=1)
    r = restore(uri, dist=SingleProcess(), strategy=strategy, storage_config=READ_CONFIG)
    ((second, weight),) = hook.saves
    assert r.checkpoint == target and r.manifest.save_id == second.save_id
    assert torch.equal(r.state["model"]["weight"], weight)
    assert r.metadata["num_updates"] == 1100

    hook = SaveBetweenSlices(monkeypatch, target, times=2, first_seed=20)
    with pytest.raises(CheckpointReplacedError) as e:
        restore(uri, dist=SingleProcess(), strategy=strategy, storage_config=READ_CONFIG)
    (b, _), (c, _) = hook.saves
    assert isinstance(e.value, DistributedError)
    assert str(e.value).startswith(f"{target} was replaced while reading (save id {b.save_id} "
                                   f"-> {c.save_id}); retry or pause the other writer [rank 0: "
                                   "DataFileMissingError: ")
    assert list(e.value.failures) == [0]


def test_trainer_through_restore_agrees(tmp_path, monkeypatch):
    uri = str(tmp_path / "checkpoint_1_5")
    save_linear(uri, seed=1, num_updates=5)
    hook = SaveBetweenSlices(monkeypatch, uri, times=1)
    ck = linear_checkpointer(99, restorer=make_restorer(dist=SingleProcess(),
                                                        storage_config=READ_CONFIG))
    assert ck.load_checkpoint(uri) is not None
    assert ck.get_num_updates() == 1100 and torch.equal(weight_of(ck), hook.saves[0][1])


def test_a_data_file_gone_mid_read_without_a_new_save_is_an_error(tmp_path, monkeypatch):
    uri = str(tmp_path / "ck")
    manifest, _ = save_linear(uri, seed=1, num_updates=5)
    ((data, _),) = manifest.files.items()
    original = LocalStorage.read_range

    def read_range(storage, name, offset, out, generation=None):
        original(storage, name, offset, out, generation)
        if name == data and len(out) == SLICE and os.path.exists(os.path.join(uri, data)):
            os.unlink(os.path.join(uri, data))  # deleted, nothing committed in its place

    monkeypatch.setattr(LocalStorage, "read_range", read_range)
    ck = reader()
    with pytest.raises(DataFileMissingError):
        ck.load_checkpoint(uri)
    assert ck.get_num_updates() == 0


# ---- run folders resolve alike; nothing committed vs a typo ---------------------------------


def test_a_run_folder_restores_its_latest_committed_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    save_linear(f"{run}/checkpoint_1_2", seed=1, num_updates=2)
    _, w4 = save_linear(f"{run}/checkpoint_1_4", seed=2, num_updates=4)
    os.makedirs(f"{run}/checkpoint_1_6")  # a newer save that never committed
    with open(f"{run}/checkpoint_1_6/data-0123456789ab-state.safetensors", "wb") as f:
        f.write(b"\0" * 64)
    for uri in (run, f"{run}/checkpoint_last"):
        ck = reader()
        assert ck.load_checkpoint(uri) is not None
        assert ck.get_num_updates() == 4 and torch.equal(weight_of(ck), w4)
    with open_storage(run) as st:
        write_pointer(st, "best", "checkpoint_1_2")
    ck = reader()
    ck.load_checkpoint(f"{run}/checkpoint_best")
    assert ck.get_num_updates() == 2


def test_nothing_committed_starts_fresh_with_a_warning(tmp_path, caplog):
    empty = tmp_path / "empty"
    empty.mkdir()
    absent = tmp_path / "not_yet"
    for uri in (str(empty), str(absent), str(empty / "checkpoint_last")):
        caplog.clear()
        ck = reader()
        with caplog.at_level(logging.INFO, logger=TRAINER_LOG):
            assert ck.load_checkpoint(uri) is None
        assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
            (logging.WARNING, f"rank 0: no existing checkpoint found at {uri}")]
        assert ck.get_num_updates() == 0


def test_only_incomplete_checkpoints_start_fresh_with_a_warning_naming_them(tmp_path, caplog):
    run = tmp_path / "run"
    for name in ("checkpoint_1_2", "checkpoint_1_4"):
        (run / name).mkdir(parents=True)
        (run / name / "data-0123456789ab-state.safetensors").write_bytes(b"\0" * 64)
    in_run = (f"{run}: no committed checkpoint here (skipped incomplete: checkpoint_1_2, "
              "checkpoint_1_4)")
    named = (f"{run}/checkpoint_1_4: checkpoint is incomplete (no {MANIFEST_NAME} commit "
             "marker); the save that wrote it did not finish. Restore an earlier checkpoint.")
    for uri, why in ((str(run), in_run), (str(run / "checkpoint_1_4"), named)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=TRAINER_LOG):
            assert reader().load_checkpoint(uri) is None
        assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
            (logging.WARNING, f"rank 0: ignoring {why}; no existing checkpoint is used")]
        # restore() says the same (one class in every entry point)
        with pytest.raises(UncommittedCheckpointError) as e:
            restore(uri, dist=SingleProcess())
        assert str(e.value).startswith(why + " [strategy all_ranks: ")


def test_a_path_whose_parent_is_missing_too_is_an_error_not_a_fresh_start(tmp_path):
    uri = str(tmp_path / "rnu7" / "checkpoint_last")  # typo'd run folder
    ck = reader()
    with pytest.raises(CheckpointNotFoundError) as e:
        ck.load_checkpoint(uri)
    assert not isinstance(e.value, NothingCommittedError)
    assert str(e.value) == (f"{uri}: no such file or folder, and its parent folder "
                            f"{tmp_path / 'rnu7'} does not exist either; check the path (a "
                            "checkpoint URI whose folder is missing is not read as 'no "
                            "checkpoint yet')")
    with pytest.raises(CheckpointNotFoundError) as e:
        restore(uri, dist=SingleProcess())
    assert not isinstance(e.value, NothingCommittedError) and "check the path" in str(e.value)


def test_a_dangling_last_pointer_with_nothing_committed_is_an_error(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with open_storage(str(run)) as st:
        write_pointer(st, "last", "checkpoint_1_4")  # its checkpoint was deleted by hand
    with pytest.raises(CheckpointNotFoundError) as e:
        reader().load_checkpoint(str(run))
    assert not isinstance(e.value, NothingCommittedError)
    assert str(e.value).startswith(f"{run}/checkpoint_last.json names 'checkpoint_1_4', but no "
                                   "checkpoint is committed")
