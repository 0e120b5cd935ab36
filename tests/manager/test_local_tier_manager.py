"""The manager with a local tier, in one process (SingleProcess dist, temp folders): what each
save leaves in the local and durable tiers, and which tier a restore of ``checkpoint_last``
reads, with which values, when the local copy is damaged, full or foreign; and, counted in
GCS requests on the emulator, what a restore and a local-only save ask of the durable tier.

Every test asserts the restored tensors bitwise, the chosen checkpoint and tier
(``RestoreResult.tier``), and the folders on disk.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import uuid
from collections import Counter
from typing import Any

import pytest
import torch
from manager_helpers import committed, kind, make_cfg

import xla_ckpt
from xla_ckpt.errors import FencedError
from xla_ckpt.format.manifest import DEFAULT_CHUNK_SIZE_BYTES, MANIFEST_NAME, STATE_ITEM
from xla_ckpt.io.manifest_file import SAVE_ID_METADATA, read_manifest
from xla_ckpt.manager import CheckpointManager
from xla_ckpt.run.local_tier import LocalTier, marker_name, untrusted_name
from xla_ckpt.storage import open_storage
from xla_ckpt.storage.local import LocalStorage

W_KEY = "state['model']['w']"
TENSOR_BYTES = 2048 * 4 + 300 * 8 + 8  # w, b and the rank state's tensor
B_KEY = "state['model']['b']"


def w_at(n: int, numel: int = 2048) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) * 0.5 + n


def b_at(n: int) -> torch.Tensor:
    return torch.full((300,), float(n), dtype=torch.float64)


def state_at(n: int, numel: int = 2048) -> dict:
    return {"model": {"w": w_at(n, numel), "b": b_at(n)}, "num_updates": n}


def train(mgr: CheckpointManager, first: int, last: int, *, numel=None, hook=None) -> list:
    """after_update for updates ``first..last``; ``numel(n)``: w's size at update n."""
    results = []
    for n in range(first, last + 1):
        size = numel(n) if numel is not None else 2048

        def state(n=n, size=size):
            if hook is not None:
                hook(n)
            return state_at(n, size)
        results.append(mgr.after_update(epoch=1, num_updates=n, state=state,
                                        rank_state={"seen": torch.tensor([n])}))
    return results


def assert_restored(res, n: int, *, numel: int = 2048) -> None:
    assert res is not None
    assert res.checkpoint == f"checkpoint_1_{n}" and res.num_updates == n
    assert torch.equal(res.state["model"]["w"], w_at(n, numel))
    assert torch.equal(res.state["model"]["b"], b_at(n))
    assert res.state["num_updates"] == n
    assert torch.equal(res.rank_state["seen"], torch.tensor([n]))


def restore(cfg):
    mgr = CheckpointManager(cfg)
    try:
        return mgr.restore_or_initialize()
    finally:
        mgr.close()


@pytest.fixture
def dirs(tmp_path):
    run = tmp_path / "run"
    local = tmp_path / "local"
    run.mkdir()
    return str(run), str(local)


def tier_of(run: str, local: str) -> LocalTier:
    return LocalTier(local, os.path.abspath(run))


def local_steps(run: str, local: str) -> list[str]:
    """Checkpoint folders in the run's local folder (committed or not), sorted by update."""
    tier = tier_of(run, local)
    names = tier.folders()
    return sorted(names, key=lambda n: int(n.rsplit("_", 1)[1]))


def flip_in(folder: str, key: str, item_name: str = STATE_ITEM) -> None:
    """Flip one byte in the middle of tensor ``key``'s blob in a checkpoint folder."""
    m = read_manifest(LocalStorage(folder))
    item = m.item(item_name)
    (rec,) = [t for t in item.tensors if t.key == key]
    blob = item.blobs[rec.blob]
    path = os.path.join(folder, blob.file)
    at = blob.offset + blob.length // 2
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))


def state_bytes(folder: str) -> int:
    m = read_manifest(LocalStorage(folder))
    return sum(m.files.values())


def test_local_every_update_durable_every_4(dirs):
    run, local = dirs
    cfg = make_cfg(run, local_dir=local, local_interval_updates=1, save_interval_updates=4,
                   keep_local_checkpoints=3)
    mgr = CheckpointManager(cfg)
    results = train(mgr, 1, 10)
    mgr.close()
    assert [r.saved for r in results] == [f"checkpoint_1_{n}" for n in range(1, 11)]
    assert mgr.local_committed == [f"checkpoint_1_{n}" for n in range(1, 11)]
    assert committed(run) == ["checkpoint_1_4", "checkpoint_1_8"]
    assert local_steps(run, local) == ["checkpoint_1_8", "checkpoint_1_9", "checkpoint_1_10"]
    tier = tier_of(run, local)
    assert [s.name for s in tier.inventory()] == local_steps(run, local)
    for s in tier.inventory():
        assert s.complete and s.missing == () and s.lease_epoch == 1
        assert sorted(os.listdir(tier.path(s.name))) == sorted(
            [*s.files, MANIFEST_NAME, marker_name(0)])
    # The durable copy of 8 is the same save as the local one (uploaded from its bytes).
    assert read_manifest(LocalStorage(os.path.join(run, "checkpoint_1_8"))).save_id == \
        read_manifest(LocalStorage(tier.path("checkpoint_1_8"))).save_id
    res = restore(cfg)
    assert_restored(res, 10)
    assert res.tier["tier"] == "local" and res.tier["host"] == 0
    assert res.tier["durable_bytes"] == 0 and res.tier["fallbacks"] == []
    assert res.tier["local_bytes"] == TENSOR_BYTES  # every tensor byte, from the local copy
    # keep_local_checkpoints=1: one step on disk after each commit.
    run1, local1 = run + "-k1", local + "-k1"
    cfg1 = make_cfg(run1, local_dir=local1, local_interval_updates=1, save_interval_updates=4,
                    keep_local_checkpoints=1)
    mgr = CheckpointManager(cfg1)
    train(mgr, 1, 6)
    mgr.close()
    assert local_steps(run1, local1) == ["checkpoint_1_6"]
    assert_restored(restore(cfg1), 6)


def test_durable_only_restore_reports_the_durable_tier(dirs):
    run, local = dirs
    cfg = make_cfg(run, local_dir=local, local_interval_updates=1, save_interval_updates=4)
    mgr = CheckpointManager(cfg)
    train(mgr, 1, 8)
    mgr.close()
    shutil.rmtree(local)  # the host was replaced: its memory is gone
    res = restore(cfg)
    assert_restored(res, 8)
    assert res.tier["tier"] == "durable" and res.tier["local_bytes"] == 0
    assert res.tier["durable_bytes"] > 0


@pytest.mark.parametrize("where", ["state", "state into=", "rank state"])
def test_flipped_byte_in_a_step_also_durable_reads_that_range_from_durable(dirs, caplog,
                                                                           where):
    caplog.set_level(logging.ERROR, logger="xla_ckpt.io.blob_reader")
    run, local = dirs
    cfg = make_cfg(run, local_dir=local, local_interval_updates=1, save_interval_updates=4)
    mgr = CheckpointManager(cfg)
    train(mgr, 1, 8)
    mgr.close()
    tier = tier_of(run, local)
    folder = tier.path("checkpoint_1_8")
    total = state_bytes(folder)
    key = "rank/00000:state['seen']" if where == "rank state" else B_KEY
    if where == "rank state":
        flip_in(folder, "state['seen']", "rank/00000")
    else:
        flip_in(folder, B_KEY)
    into: Any = {"model": {"w": torch.zeros(2048), "b": torch.zeros(300, dtype=torch.float64)},
                 "num_updates": 0} if where == "state into=" else None
    with caplog.at_level(logging.WARNING, logger="xla_ckpt.storage.tiered"):
        mgr = CheckpointManager(cfg)
        res: Any = mgr.restore_or_initialize(into=into)
        mgr.close()
    assert_restored(res, 8)
    if into is not None:  # read in place, the bad range again from durable storage
        assert res.state["model"]["b"] is into["model"]["b"]
    t = res.tier
    assert t["tier"] == "local"
    # Every tensor byte read locally once; the failed blob (one crc32c chunk) again from
    # durable storage, nothing else.
    assert t["local_bytes"] == TENSOR_BYTES
    assert t["durable_bytes"] == (8 if where == "rank state" else 300 * 8) < total
    (why,) = t["fallbacks"]
    assert why.startswith(f"crc32c mismatch in local file {folder}/") and f"(tensor {key})" in why
    assert "come from the durable tier" in why
    assert f"host 0: {why}" in caplog.text
    # Never trusted again: the next restore reads the durable 8 (the local 7 is older).
    assert os.path.exists(os.path.join(folder, untrusted_name(0)))
    assert [s.name for s in tier.inventory()] == ["checkpoint_1_7"]
    res = restore(cfg)
    assert_restored(res, 8)
    assert res.tier["tier"] == "durable" and res.tier["local_bytes"] == 0


@pytest.mark.parametrize("bad,want,tier_name", [
    ((10,), 9, "local"),  # decides again: the older local step
    ((10, 9), 8, "durable"),  # twice: the durable step
])
def test_flipped_byte_in_a_local_only_step_decides_again(dirs, caplog, bad, want, tier_name):
    caplog.set_level(logging.CRITICAL, logger="xla_ckpt.io.blob_reader")
    run, local = dirs
    cfg = make_cfg(run, local_dir=local, local_interval_updates=1, save_interval_updates=4)
    mgr = CheckpointManager(cfg)
    train(mgr, 1, 10)
    mgr.close()
    assert committed(run) == ["checkpoint_1_4", "checkpoint_1_8"]
    tier = tier_of(run, local)
    assert [s.name for s in tier.inventory()] == ["checkpoint_1_9", "checkpoint_1_10"]
    for n in bad:
        flip_in(tier.path(f"checkpoint_1_{n}"), W_KEY)
    with caplog.at_level(logging.WARNING, logger="xla_ckpt.manager"):
        res = restore(cfg)
    assert_restored(res, want)  # never a fresh start, never damaged values
    assert res.tier["tier"] == tier_name
    again = [r.getMessage() for r in caplog.records if "deciding once more" in r.getMessage()]
    assert len(again) == len(bad)
    for n, msg in zip(bad, again, strict=True):
        assert msg.startswith(f"[rank 0] the local copy of checkpoint_1_{n} failed its checks")
        assert f"IntegrityError: {tier.path(f'checkpoint_1_{n}')}/" in msg
        assert "replaced while reading" not in msg  # the local copy's own failure
    for n in bad:
        assert os.path.exists(os.path.join(tier.path(f"checkpoint_1_{n}"), untrusted_name(0)))
    assert [s.name for s in tier.inventory()] == [
        f"checkpoint_1_{n}" for n in (9, 10) if n not in bad]


@pytest.mark.parametrize("damage", ["not json", "flipped byte"])
def test_a_damaged_local_manifest_is_skipped_and_untrusted(dirs, caplog, damage):
    run, local = dirs
    cfg = make_cfg(run, local_dir=local, local_interval_updates=1, save_interval_updates=4)
    mgr = CheckpointManager(cfg)
    train(mgr, 1, 10)
    mgr.close()
    tier = tier_of(run, local)
    path = os.path.join(tier.path("checkpoint_1_10"), MANIFEST_NAME)
    with open(path, "rb") as f:
        body = bytearray(f.read())
    if damage == "not json":
        body[:1] = b"#"
    else:
        at = body.index(b'"num_updates"') + 3
        body[at] ^= 0x01
    with open(path, "wb") as f:
        f.write(bytes(body))
    with caplog.at_level(logging.WARNING, logger="xla_ckpt.run.local_tier"):
        res = restore(cfg)
    assert_restored(res, 9)
    assert res.tier["tier"] == "local"
    assert f"unusable manifest: {path}" in caplog.text
    assert [s.name for s in tier.inventory()] == ["checkpoint_1_9"]


def test_local_max_bytes_too_small_skips_the_local_copy(dirs, caplog):
    run, local = dirs
    cfg = make_cfg(run, local_dir=local, local_interval_updates=1, save_interval_updates=3,
                   local_max_bytes=1000)
    mgr = CheckpointManager(cfg)
    with caplog.at_level(logging.WARNING, logger="xla_ckpt.manager"):
        results = train(mgr, 1, 7)
    mgr.close()
    assert [r.saved for r in results][2::3] == ["checkpoint_1_3", "checkpoint_1_6"]
    assert mgr.local_committed == []
    assert committed(run) == ["checkpoint_1_3", "checkpoint_1_6"]
    assert local_steps(run, local) == []
    skips = [r.getMessage() for r in caplog.records
             if "skipping the local copy of" in r.getMessage()]
    assert len(skips) == 7
    nbytes = TENSOR_BYTES
    assert skips[0] == ("local tier: skipping the local copy of checkpoint_1_1 (host 0: "
                        f"{nbytes} bytes new + 0 bytes kept > local_max_bytes 1000); training "
                        "and the durable schedule go on")
    res = restore(cfg)
    assert_restored(res, 6)
    assert res.tier["tier"] == "durable"


@contextlib.contextmanager
def small_tmpfs(path: str, size: str):
    os.makedirs(path, exist_ok=True)
    try:
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs at {path}: {e}")
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {path}: {out.stderr.strip() or out.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)


@pytest.mark.parametrize("async_save", [False, True])
def test_enospc_mid_write_keeps_the_previous_local_step(tmp_path, async_save, caplog):
    run = str(tmp_path / "run")
    mount = str(tmp_path / f"shm-{uuid.uuid4().hex[:6]}")
    with small_tmpfs(mount, "256k"):
        cfg = make_cfg(run, local_dir=mount, local_interval_updates=1, save_interval_updates=2,
                       keep_local_checkpoints=2, async_save=async_save)
        mgr = CheckpointManager(cfg)
        # Updates 1..2: 10 KiB states; 3..6: 400 KiB (w), more than the whole tmpfs.
        with caplog.at_level(logging.WARNING, logger="xla_ckpt.manager"):
            results = train(mgr, 1, 6, numel=lambda n: 2048 if n <= 2 else 100_000)
            mgr.close()
        assert [r.saved for r in results] == [f"checkpoint_1_{n}" for n in range(1, 7)]
        assert mgr.local_committed == ["checkpoint_1_1", "checkpoint_1_2"]
        assert committed(run) == ["checkpoint_1_2", "checkpoint_1_4", "checkpoint_1_6"]
        assert "the local copy of checkpoint_1_3 failed" in caplog.text
        assert "No space left on device" in caplog.text or "ENOSPC" in caplog.text
        # The previous local step is intact; nothing of the failed ones is left (every
        # folder is a committed step; no temporary file).
        tier = tier_of(run, mount)
        steps = tier.inventory()
        assert local_steps(run, mount) == [s.name for s in steps]
        assert steps[-1].name == "checkpoint_1_2" and steps[-1].complete
        everything = [f for _, _, files in os.walk(mount) for f in files]
        assert not [f for f in everything if ".tmp-" in f]
        got = xla_ckpt.load(tier.path("checkpoint_1_2"))
        assert torch.equal(got["model"]["w"], w_at(2))
        # Durable 4 and 6 hold the big states, written directly; 6 is restored from there.
        for n in (4, 6):
            got = xla_ckpt.load(os.path.join(run, f"checkpoint_1_{n}"))
            assert torch.equal(got["model"]["w"], w_at(n, 100_000))
        res = restore(cfg)
        assert_restored(res, 6, numel=100_000)
        assert res.tier["tier"] == "durable"


def test_continuous_policy_saves_at_every_update_when_idle(dirs):
    run, local = dirs
    cfg = make_cfg(run, local_dir=local, local_policy="continuous", local_min_interval_s=0,
                   save_interval_updates=0, keep_local_checkpoints=2)
    mgr = CheckpointManager(cfg)
    results = train(mgr, 1, 6)
    mgr.close()
    names = [f"checkpoint_1_{n}" for n in range(1, 7)]
    assert [r.saved for r in results] == names
    assert mgr.local_committed == names
    assert committed(run) == []  # local only
    assert local_steps(run, local) == names[-2:]
    res = restore(cfg)
    assert_restored(res, 6)
    assert res.tier["tier"] == "local"


def test_continuous_policy_with_a_long_interval_saves_the_first_only(dirs):
    run, local = dirs
    cfg = make_cfg(run, local_dir=local, local_policy="continuous",
                   local_min_interval_s=1e9, save_interval_updates=0)
    mgr = CheckpointManager(cfg)
    results = train(mgr, 1, 5)
    mgr.close()
    assert [r.saved for r in results] == ["checkpoint_1_1", None, None, None, None]
    assert mgr.local_committed == ["checkpoint_1_1"]
    assert_restored(restore(cfg), 1)


def test_continuous_policy_async_never_overlaps_saves(dirs):
    run, local = dirs
    cfg = make_cfg(run, local_dir=local, local_policy="continuous", local_min_interval_s=0,
                   save_interval_updates=0, async_save=True, keep_local_checkpoints=1)
    mgr = CheckpointManager(cfg)
    results = train(mgr, 1, 8)
    mgr.close()
    saved = [r.saved for r in results if r.saved is not None]
    assert saved[0] == "checkpoint_1_1"
    assert mgr.local_committed == saved  # every save started was committed, in order
    n = int(saved[-1].rsplit("_", 1)[1])
    assert local_steps(run, local) == [saved[-1]]
    res = restore(cfg)
    assert_restored(res, n)
    assert res.tier["tier"] == "local"


def test_local_only_save_does_not_count_as_the_preemption_save(dirs):
    run, local = dirs
    cfg = make_cfg(run, local_dir=local, local_interval_updates=1, save_interval_updates=100,
                   exit_on_preemption=False)
    mgr = CheckpointManager(cfg)
    train(mgr, 1, 2)
    # SIGTERM lands while update 3's local-only save gathers its state: the ranks agree on
    # it in that save; the next boundary must still write a durable checkpoint.
    results = train(mgr, 3, 4, hook=lambda n: mgr.request_preemption() if n == 3 else None)
    assert results[0].saved == "checkpoint_1_3" and not results[0].preempted
    assert results[1].preempted and results[1].saved == "checkpoint_1_4"
    assert results[1].committed == ("checkpoint_1_4",)
    # Asked before update 5, a local-due update: the durable preemption save at 5.
    mgr.request_preemption()
    (r5,) = train(mgr, 5, 5)
    assert r5.preempted and r5.committed == ("checkpoint_1_5",)
    mgr.close()
    assert committed(run) == ["checkpoint_1_4", "checkpoint_1_5"]
    assert mgr.local_committed == [f"checkpoint_1_{n}" for n in (1, 2, 3, 4, 5)]
    for n in (4, 5):
        got = xla_ckpt.load(os.path.join(run, f"checkpoint_1_{n}"))
        assert torch.equal(got["model"]["w"], w_at(n)) and got["num_updates"] == n
    assert_restored(restore(cfg), 5)


def test_another_jobs_local_folder_is_never_used(tmp_path):
    local = str(tmp_path / "local")
    other_run = str(tmp_path / "other" / "run")
    cfg = make_cfg(other_run, local_dir=local, local_interval_updates=1,
                   save_interval_updates=0)
    mgr = CheckpointManager(cfg)
    train(mgr, 1, 5)
    mgr.close()
    assert tier_of(other_run, local).inventory()[-1].name == "checkpoint_1_5"
    # A fresh job whose run folder has the same last segment, on the same host.
    run = str(tmp_path / "mine" / "run")
    os.makedirs(run)
    cfg = make_cfg(run, local_dir=local, local_interval_updates=1, save_interval_updates=0)
    mgr = CheckpointManager(cfg)
    assert mgr.restore_or_initialize() is None
    train(mgr, 1, 2)
    mgr.close()
    assert local_steps(run, local) == ["checkpoint_1_1", "checkpoint_1_2"]
    assert local_steps(other_run, local) == ["checkpoint_1_4", "checkpoint_1_5"]  # untouched
    assert_restored(restore(cfg), 2)


def test_a_run_folder_made_anew_does_not_restore_the_old_jobs_local_copy(tmp_path,
                                                                         caplog):
    """The same run URI, deleted and started again (the host's local tier still holds the
    old job's steps): a fresh start, not the old job's state."""
    local = str(tmp_path / "local")
    run = str(tmp_path / "run")
    cfg = make_cfg(run, local_dir=local, local_interval_updates=1, save_interval_updates=0)
    mgr = CheckpointManager(cfg)
    train(mgr, 1, 5)
    mgr.close()
    assert local_steps(run, local) == ["checkpoint_1_4", "checkpoint_1_5"]
    shutil.rmtree(run)
    mgr = CheckpointManager(cfg)
    assert mgr.restore_or_initialize() is None
    with caplog.at_level(logging.WARNING, logger="xla_ckpt.run.local_tier"):
        train(mgr, 1, 2)  # its first save takes lease epoch 1 anew: the old steps go
    mgr.close()
    assert "removed checkpoint_1_4, checkpoint_1_5 from the local tier" in caplog.text
    assert local_steps(run, local) == ["checkpoint_1_1", "checkpoint_1_2"]
    res = restore(cfg)
    assert_restored(res, 2)
    assert res.tier["tier"] == "local"


def test_an_unreadable_lease_restores_from_durable(dirs, caplog):
    run, local = dirs
    cfg = make_cfg(run, local_dir=local, local_interval_updates=1, save_interval_updates=2)
    mgr = CheckpointManager(cfg)
    train(mgr, 1, 5)
    mgr.close()
    with open(os.path.join(run, "lease.json"), "w") as f:
        f.write("not json")
    with caplog.at_level(logging.WARNING, logger="xla_ckpt.manager"):
        res = restore(cfg)  # a restore only reads: never fails on the lease
    assert_restored(res, 4)
    assert res.tier["tier"] == "durable"
    assert "the run folder's lease is unreadable" in caplog.text


def test_a_fallback_names_the_tensor_inside_a_blob_of_several(dirs):
    """Views of one storage are saved as one blob; a flipped byte in the second view's crc32c
    chunk is reported as that tensor (from the manifest's byte ranges), not the blob's
    first one.  (Within one crc32c chunk, every tensor the chunk holds is named.)"""
    run, local = dirs
    cfg = make_cfg(run, local_dir=local, local_interval_updates=1, save_interval_updates=1)
    half = DEFAULT_CHUNK_SIZE_BYTES // 4  # float32 elements: one crc32c chunk each
    flat = torch.arange(2 * half, dtype=torch.float32)
    mgr = CheckpointManager(cfg)
    mgr.after_update(epoch=1, num_updates=1, state={"a": flat[:half], "b": flat[half:]})
    mgr.close()
    folder = tier_of(run, local).path("checkpoint_1_1")
    m = read_manifest(LocalStorage(folder))
    item = m.item(STATE_ITEM)
    assert len(item.blobs) == 1  # both views in one blob
    (rec,) = [t for t in item.tensors if t.key == "state['b']"]
    blob = item.blobs[rec.blob]
    at = blob.offset + rec.byte_offset + 100 * 4
    with open(os.path.join(folder, blob.file), "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    res = restore(cfg)
    assert res is not None and res.tier["tier"] == "local"
    assert torch.equal(res.state["a"], flat[:half]) and torch.equal(res.state["b"], flat[half:])
    (why,) = res.tier["fallbacks"]
    assert "(tensor state['b'])" in why, why


# ---- time to resume, counted in requests (never seconds) --------------------------------
# A restore that a local step wins asks the durable tier for its lease, its best pointer and
# one listing of its commit markers, at once, and nothing else; a local-only save asks nothing
# of it on the training thread, and a fenced incarnation is still stopped (the background
# lease read, or on its own host the newer incarnation's local steps).  GCS cases on the
# emulator through the fault proxy's request log.


def gcs_tier_of(run: str, local: str) -> LocalTier:
    """The host's tier the manager of run folder ``run`` (a gs:// URI) uses."""
    with open_storage(run) as st:
        return LocalTier(local, st.uri)


def restore_counted(cfg, proxy, monkeypatch):
    """A fresh manager's ``restore_or_initialize()`` through ``proxy``: the result and its
    control requests by kind (data ranges left out)."""
    with monkeypatch.context() as m:
        m.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        proxy.reset_log()
        mgr = CheckpointManager(cfg)
        try:
            res = mgr.restore_or_initialize()
        finally:
            mgr.close()
    return res, Counter(kind(r) for r in proxy.records() if kind(r) != "data")


def test_a_local_win_asks_gcs_for_the_lease_the_best_pointer_and_one_listing(
        gcs_uri, fault_proxy, monkeypatch, tmp_path):
    run, local = f"{gcs_uri}/run", str(tmp_path / "local")
    cfg = make_cfg(run, local_dir=local, local_interval_updates=1, save_interval_updates=4)
    with CheckpointManager(cfg) as mgr:
        train(mgr, 1, 6)
    res, c = restore_counted(cfg, fault_proxy, monkeypatch)
    assert_restored(res, 6)
    assert res.tier["tier"] == "local" and res.tier["durable_bytes"] == 0
    # checkpoint_1_4 (durable) is older: no manifest, no checkpoint_last chase, no stat.
    assert c == Counter({"lease": 1, "pointer": 1, "list": 1}), c


def test_the_listing_tells_which_local_step_gcs_holds_too(gcs_uri, fault_proxy, monkeypatch,
                                                          tmp_path):
    """checkpoint_1_4 is in both tiers: the save id in its marker's listed metadata says so
    without reading its manifest, so a flipped byte in the host's copy is read back from GCS
    (that byte range only)."""
    run, local = f"{gcs_uri}/run", str(tmp_path / "local")
    cfg = make_cfg(run, local_dir=local, local_interval_updates=1, save_interval_updates=4)
    with CheckpointManager(cfg) as mgr:
        train(mgr, 1, 4)
    with open_storage(run) as st:
        (marker,) = st.list_in_subfolders("", MANIFEST_NAME)
    assert marker.metadata is not None
    assert marker.metadata[SAVE_ID_METADATA] == gcs_tier_of(run, local).inventory()[-1].save_id
    flip_in(gcs_tier_of(run, local).path("checkpoint_1_4"), "state['model']['w']")
    res, c = restore_counted(cfg, fault_proxy, monkeypatch)
    assert_restored(res, 4)
    assert res.tier["tier"] == "local"
    (why,) = res.tier["fallbacks"]
    assert why.startswith("crc32c mismatch") and "(tensor state['model']['w'])" in why
    assert res.tier["durable_bytes"] == 2048 * 4  # that blob's one crc32c chunk, nothing else
    assert c == Counter({"lease": 1, "pointer": 1, "list": 1}), c


def test_markers_without_the_save_id_are_read_once(gcs_uri, fault_proxy, monkeypatch,
                                                   tmp_path):
    """Durable checkpoints committed by an earlier xla_ckpt (no order or save id in the
    markers' metadata): each listed marker is read once to learn them, and the local step
    still wins when it is the newest."""
    run, local = f"{gcs_uri}/run", str(tmp_path / "local")
    cfg = make_cfg(run, local_dir=local, local_interval_updates=1, save_interval_updates=2,
                   keep_interval_updates=10)
    with CheckpointManager(cfg) as mgr:
        train(mgr, 1, 5)
    with open_storage(run) as st:
        for n in (2, 4):
            name = f"checkpoint_1_{n}/{MANIFEST_NAME}"
            st.write_atomic(name, [st.read_bytes(name)])
        assert [o.metadata for o in st.list_in_subfolders("", MANIFEST_NAME)] == [None] * 2
    res, c = restore_counted(cfg, fault_proxy, monkeypatch)
    assert_restored(res, 5)
    assert res.tier["tier"] == "local"
    assert c == Counter({"lease": 1, "pointer": 1, "list": 1, "manifest": 2}), c


def test_a_durable_step_newer_than_every_local_one_wins(gcs_uri, fault_proxy, monkeypatch,
                                                        tmp_path):
    """Host memory lost its newest steps (the tier folder replaced by an older copy): the
    durable checkpoint_1_6 is newer than the local 1_5, so the restore resolves it in GCS."""
    run, local = f"{gcs_uri}/run", str(tmp_path / "local")
    cfg = make_cfg(run, local_dir=local, local_interval_updates=1, save_interval_updates=3)
    with CheckpointManager(cfg) as mgr:
        train(mgr, 1, 5)
        tier = gcs_tier_of(run, local)
        os.rename(tier.folder, tier.folder + ".kept")
        train(mgr, 6, 6)
    os.rename(tier.folder, tier.folder + ".newer")
    os.rename(tier.folder + ".kept", tier.folder)
    assert [s.name for s in tier.inventory()] == ["checkpoint_1_4", "checkpoint_1_5"]
    res, c = restore_counted(cfg, fault_proxy, monkeypatch)
    assert_restored(res, 6)
    assert res.tier["tier"] == "durable"
    # Then checkpoint_last is resolved in GCS; the best pointer is not read a second time.
    best = [r for r in fault_proxy.records() if r.object_name.endswith("checkpoint_best.json")]
    assert len(best) == 1, [(r.method, r.query) for r in best]
    assert c["lease"] == 1 and c["list"] == 2, c


def test_local_only_saves_read_no_lease_yet_a_fenced_incarnation_is_stopped(tmp_path):
    """Incarnation A saves locally only; B takes the run folder's lease.  A's next local-only
    saves do not wait for the lease, but the read one of them starts in the background
    reaches every rank at the following save: FencedError names both epochs."""
    run, local = str(tmp_path / "run"), str(tmp_path / "local")
    os.makedirs(run)
    cfg = make_cfg(run, local_dir=local, local_interval_updates=1, save_interval_updates=0)
    a = CheckpointManager(cfg)
    train(a, 1, 3)
    b = CheckpointManager(make_cfg(run, save_interval_updates=0))
    assert b.take_over() == 2
    with pytest.raises(FencedError) as err:
        for n in range(4, 40):
            train(a, n, n)
            a.wait()
            if a._lease_check is not None:
                a._lease_check.result(timeout=30)  # let the background read finish
    assert (err.value.own_epoch, err.value.current_epoch) == (1, 2)
    assert n <= 6, f"fenced only at update {n}"
    a._shutdown()
    b.close()


def test_a_fenced_incarnation_on_the_same_host_never_commits_over_the_newer_one(tmp_path,
                                                                                 caplog):
    """B restored A's checkpoint_1_3 and saved its own 1_4 (lease epoch 2) while A, not yet
    told, saves 1_4 too in the same host folder: A's commit is refused by B's marker there,
    only A's own data files are removed, and B's 1_4 restores bitwise."""
    run, local = str(tmp_path / "run"), str(tmp_path / "local")
    os.makedirs(run)
    cfg = make_cfg(run, local_dir=local, local_interval_updates=1, save_interval_updates=0)
    a = CheckpointManager(cfg)
    train(a, 1, 3)
    b = CheckpointManager(cfg)
    assert_restored(b.restore_or_initialize(), 3)

    def b_state(n):
        st = state_at(n)
        st["model"]["w"] = w_at(n + 100)
        return st
    b.after_update(epoch=1, num_updates=4, state=b_state(4), rank_state={"seen":
                                                                          torch.tensor([4])})
    b.wait()
    tier = tier_of(run, local)
    b_marker = open(os.path.join(tier.path("checkpoint_1_4"), marker_name(0))).read()
    with caplog.at_level(logging.WARNING, logger="xla_ckpt"):
        train(a, 4, 4)
        a.wait()
    assert "newer than this incarnation's 1" in caplog.text
    assert open(os.path.join(tier.path("checkpoint_1_4"), marker_name(0))).read() == b_marker
    b_save = json.loads(b_marker)["save_id"]
    data = [f for f in os.listdir(tier.path("checkpoint_1_4")) if f.startswith("data-")]
    assert data and all(b_save in f for f in data), (b_save, data)  # A's own files went
    a._shutdown()
    b.close()
    res = CheckpointManager(cfg)
    got = res.restore_or_initialize()
    res.close()
    assert got is not None and got.tier is not None
    assert got.checkpoint == "checkpoint_1_4" and got.tier["tier"] == "local"
    assert torch.equal(got.state["model"]["w"], w_at(104))


def _file_inodes(tier: LocalTier, step) -> dict[str, int]:
    """Each data file of ``step`` by its name without the save id, with its inode."""
    return {f.split("-", 2)[2]: os.stat(os.path.join(tier.path(step.name), f)).st_ino
            for f in step.files}


@pytest.mark.parametrize("room", ["spare", "tight"])
def test_steady_local_saves_recycle_the_evicted_steps_files(dirs, room, capsys):
    """keep_local_checkpoints=2, a local save every update.  With room for a spare, from the
    4th save on each save's data files are the files of the step the save before evicted
    (their inodes: their pages, and this process's mapping of them, are reused, so the
    save's one copy faults no page in), holding the new bytes; the spares stay one step's
    worth.  With local_max_bytes for 2 steps only, no spare is kept (fresh files)."""
    run, local = dirs
    numel = 65536  # 256 KiB of w: the files' headers, manifest and markers are small beside it
    extra = {"local_max_bytes": 5 * numel * 4 // 2} if room == "tight" else {}  # 2.5 steps
    cfg = make_cfg(run, local_dir=local, local_interval_updates=1, save_interval_updates=0,
                   keep_local_checkpoints=2, **extra)
    tier = tier_of(run, local)
    inodes = {}
    with CheckpointManager(cfg) as mgr:
        for n in range(1, 8):
            train(mgr, n, n, numel=lambda _: numel)
            mgr.wait()
            steps = tier.inventory()
            assert [s.name for s in steps] == [f"checkpoint_1_{k}" for k in (n - 1, n) if k]
            inodes[n] = _file_inodes(tier, steps[-1])
            assert len(inodes[n]) == 2  # the state's file and the rank state's
            if room == "spare" and n >= 3:
                assert 0 < tier.spare_bytes() <= max(s.nbytes for s in steps)
            else:
                assert tier.spare_bytes() == 0
            # This process maps what it wrote and what waits to be recycled, nothing pruned
            # (an unlinked file's pages would stay allocated while it is mapped).
            assert mgr._pages.nbytes == sum(s.nbytes for s in steps) + tier.spare_bytes()
    assert mgr.local_committed == [f"checkpoint_1_{n}" for n in range(1, 8)]
    if room == "spare":  # (a tight tier's fresh files may get freed inode numbers again)
        for n in range(4, 8):
            assert inodes[n] == inodes[n - 3]
    res = restore(cfg)
    assert_restored(res, 7, numel=numel)
    assert res.tier["tier"] == "local"
    if room == "spare":  # the tools show the spares and gc deletes them, never a step
        from xla_ckpt.cli.main import main

        spare = tier.spare_bytes()
        assert main(["ls", run, "--local-dir", local]) == 0
        assert "of spare files (the next save recycles them)" in capsys.readouterr().out
        assert main(["gc", run, "--keep-last", "2", "--local-dir", local]) == 0
        assert f"deleted 0 folder(s); and {spare} bytes of spare files" in \
            capsys.readouterr().out
        assert tier.spare_bytes() == 0 and not os.path.exists(os.path.join(tier.folder, ".spare"))
        assert [s.name for s in tier.inventory()] == ["checkpoint_1_6", "checkpoint_1_7"]
        assert_restored(restore(cfg), 7, numel=numel)
