"""Fencing between incarnations of one job (C15, C22): lease epochs, create-only commit markers,
pointers by compare-and-swap that never go backwards, rotation that deletes only what its own
epoch may delete, and ``FencedError`` for the stale incarnation.

Real files in a temporary folder and the real GCS emulator (412 on failed preconditions);
real processes for the predecessor that is SIGKILLed mid-save or left running.  Every test
asserts the run folder's contents afterwards: which checkpoints are committed, their bytes,
both pointers, and the ``(lease_epoch, num_updates)`` of ``checkpoint_last`` observed after
every step.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import threading

import pytest
import torch
from manager_helpers import REPO, make_cfg, wait_for_files
from manager_workers import predecessor_rank, state_at

import xla_ckpt
from xla_ckpt.errors import (
    CheckpointSaveError,
    FencedError,
    PreconditionFailedError,
)
from xla_ckpt.format.manifest import MANIFEST_NAME, STATE_ITEM
from xla_ckpt.io import write_item
from xla_ckpt.io.writer import commit, new_save_id
from xla_ckpt.manager import CheckpointManager
from xla_ckpt.manager.rotation import rotate
from xla_ckpt.run.catalog import (
    LEASE_EPOCH_KEY,
    list_checkpoints,
    pointer_order,
    read_pointer,
    read_pointer_doc,
    resolve_latest,
    write_pointer,
)
from xla_ckpt.run.fencing import LEASE_NAME, acquire_lease, check_lease, read_lease
from xla_ckpt.storage import open_storage
from xla_ckpt.testing.launcher import shared_pool

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "manager_workers.py")


@pytest.fixture(params=["local", "gcs"])
def run_uri(request, tmp_path):
    """A run folder: a local path, or a gs:// prefix on the emulator."""
    if request.param == "local":
        return str(tmp_path / "run")
    return request.getfixturevalue("gcs_uri") + "/run"


def w_at(n: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32) * n + 0.25


def save(mgr: CheckpointManager, n: int, **kw) -> str:
    return mgr.save({"model": {"w": w_at(n)}, "num_updates": n}, epoch=1, num_updates=n,
                    rank_state={"n": n}, **kw)


def manager(run_uri: str, **kw) -> CheckpointManager:
    kw.setdefault("keep_interval_updates", 1)
    return CheckpointManager(make_cfg(run_uri, **kw))


def committed(run_uri: str) -> list[str]:
    with open_storage(run_uri) as st:
        return [e.name for e in list_checkpoints(st) if e.committed]


def objects(run_uri: str, prefix: str = "") -> list[str]:
    with open_storage(run_uri) as st:
        return st.list(prefix)


def digest(run_uri: str, folder: str) -> dict[str, str]:
    """sha256 of every object of a checkpoint folder."""
    with open_storage(run_uri) as st:
        return {n: hashlib.sha256(st.read_bytes(n)).hexdigest() for n in st.list(folder + "/")}


def last_doc(run_uri: str, which: str = "last") -> dict:
    """The pointer's document ({} when absent)."""
    with open_storage(run_uri) as st:
        return read_pointer_doc(st, which)[0] or {}


class PointerLog:
    """The ``(lease_epoch, num_updates)`` of checkpoint_last, observed after every step."""

    def __init__(self, run_uri: str) -> None:
        self.run_uri = run_uri
        self.seen: list[tuple[str, tuple[int, int]]] = []

    def __call__(self, step: str) -> None:
        self.seen.append((step, pointer_order(last_doc(self.run_uri))))

    def assert_never_backwards(self) -> None:
        orders = [o for _, o in self.seen]
        assert orders == sorted(orders), self.seen


def assert_fenced(err: FencedError, run_uri: str, own: int, current: int) -> None:
    assert isinstance(err, CheckpointSaveError)  # code stopping on a failed save stops here
    assert (err.own_epoch, err.current_epoch) == (own, current)
    msg = str(err)
    assert msg.startswith(f"{run_uri}: this incarnation of the job (lease epoch {own} (host ")
    assert f"a newer incarnation (lease epoch {current}" in msg
    assert msg.endswith("This incarnation stops saving: nothing more is committed, pointed to or "
                        "deleted by it")


# ---- C15: the stale incarnation, in one process ----------------------------------------------

def test_stale_incarnation_is_fenced_and_the_successor_survives(run_uri):
    """A saves 10, B starts and restores 10, B saves 20, A saves 15 (keep-last 1 for A, 2 for
    B).  B's restore takes no lease; its first save does (C25), and fences A."""
    log = PointerLog(run_uri)
    a = manager(run_uri)
    assert a.restore_or_initialize() is None  # fresh: no lease yet
    save(a, 10)  # the first save takes lease epoch 1
    log("A saved 10")
    b = manager(run_uri, keep_interval_updates=2)
    r = b.restore_or_initialize()  # no lease: a restore only reads
    assert r is not None and (r.checkpoint, r.num_updates) == ("checkpoint_1_10", 10)
    assert torch.equal(r.state["model"]["w"], w_at(10))
    with open_storage(run_uri) as st:
        held = read_lease(st)
    assert held is not None and held.epoch == 1
    log("B restored 10")
    save(b, 20)  # lease epoch 2
    log("B saved 20")
    kept = {f: digest(run_uri, f) for f in ("checkpoint_1_10", "checkpoint_1_20")}
    assert committed(run_uri) == ["checkpoint_1_10", "checkpoint_1_20"]

    before = objects(run_uri)
    with pytest.raises(FencedError) as ei:
        save(a, 15)
    log("A tried 15")
    assert_fenced(ei.value, run_uri, 1, 2)
    assert "refused to save checkpoint_1_15" in str(ei.value)
    # A wrote nothing: it looked at the lease before any data went out.
    assert objects(run_uri) == before
    # ... and every later save of A raises at once, writing nothing.
    with pytest.raises(FencedError) as again:
        save(a, 16)
    log("A tried 16")
    assert (again.value.own_epoch, again.value.current_epoch) == (1, 2)
    assert objects(run_uri) == before
    a.close()
    b.close()
    assert committed(run_uri) == ["checkpoint_1_10", "checkpoint_1_20"]
    assert {f: digest(run_uri, f) for f in kept} == kept  # byte for byte
    doc = last_doc(run_uri)
    assert doc == {"checkpoint": "checkpoint_1_20", "epoch": 1, "num_updates": 20,
                   LEASE_EPOCH_KEY: 2}
    with open_storage(run_uri) as st:
        assert resolve_latest(st) == "checkpoint_1_20"
        lease = read_lease(st)
    assert lease is not None and lease.epoch == 2
    log.assert_never_backwards()
    assert [o for _, o in log.seen] == [(1, 10), (1, 10), (2, 20), (2, 20), (2, 20)]


def test_async_save_in_flight_when_the_successor_starts_is_fenced_at_its_commit(run_uri,
                                                                                 tmp_path):
    """A's async upload is under way when B takes over: A's commit is refused, its data
    files are removed, B's checkpoints and pointer stay."""
    log = PointerLog(run_uri)
    a = manager(run_uri, async_save=True)
    a.restore_or_initialize()
    save(a, 10, block=True)
    log("A saved 10")
    save(a, 15, block=False)  # staged, uploading (or uploaded) in the background
    b = manager(run_uri, keep_interval_updates=2)
    b.restore_or_initialize()
    save(b, 20)  # its first save takes the lease
    log("B saved 20")
    kept = {f: digest(run_uri, f) for f in ("checkpoint_1_10", "checkpoint_1_20")}
    with pytest.raises(FencedError) as ei:
        a.wait()
    log("A's commit refused")
    assert_fenced(ei.value, run_uri, 1, 2)
    assert "refused to commit checkpoint_1_15" in str(ei.value)
    assert objects(run_uri, "checkpoint_1_15/") == []  # its data files were removed
    a.after_update(epoch=1, num_updates=16, state={"x": 1})  # nothing scheduled: no error
    with pytest.raises(FencedError):
        save(a, 16)
    assert objects(run_uri, "checkpoint_1_16/") == []
    a.close()
    b.close()
    assert committed(run_uri) == ["checkpoint_1_10", "checkpoint_1_20"]
    assert {f: digest(run_uri, f) for f in kept} == kept
    assert read_pointer_from(run_uri) == "checkpoint_1_20"
    log.assert_never_backwards()


def read_pointer_from(run_uri: str, which: str = "last") -> str | None:
    with open_storage(run_uri) as st:
        return read_pointer(st, which)


class _Hooked:
    """Wraps a run folder storage's class: ``hook(name)`` runs before the named write."""

    @staticmethod
    def install(st, hook):
        base = type(st)

        class Hooked(base):  # type: ignore[misc, valid-type]  # a subclass of the backend's
            def write_atomic(self, name, buffers, **kw):
                hook(self, name)
                return super().write_atomic(name, buffers, **kw)

            def child(self, prefix):
                c = super().child(prefix)
                c.__class__ = Hooked
                return c

        st.__class__ = Hooked
        return st


def test_residual_window_a_stale_commit_lands_in_a_new_folder_never_pointed_to(run_uri):
    """B takes the lease between A's last check and A's manifest write: A's checkpoint
    commits (in a new folder), but A is fenced before the pointers and rotation, and B
    later replaces that stale checkpoint under the same name."""
    log = PointerLog(run_uri)
    b_mgr: list[CheckpointManager] = []

    def between_check_and_manifest(st, name):
        if name == MANIFEST_NAME and st.uri.endswith("/checkpoint_1_15") and not b_mgr:
            b = manager(run_uri, keep_interval_updates=2)
            r = b.restore_or_initialize()
            assert r is not None and r.checkpoint == "checkpoint_1_12"
            assert b.take_over() == 2  # lease epoch 2 on purpose, while A is past its check
            b_mgr.append(b)

    run = _Hooked.install(open_storage(run_uri), between_check_and_manifest)
    a = CheckpointManager(make_cfg(run_uri, keep_interval_updates=1), storage=run)
    a.restore_or_initialize()
    save(a, 10)
    save(a, 12)
    log("A saved 12")
    assert committed(run_uri) == ["checkpoint_1_12"]  # keep-last 1
    with pytest.raises(FencedError) as ei:
        save(a, 15)
    log("A's 15 committed, not pointed to")
    assert_fenced(ei.value, run_uri, 1, 2)
    assert ("refused to move the pointers to checkpoint_1_15 (it is committed, but nothing "
            "points to it)") in str(ei.value)
    # The window: A's 15 committed in a new folder; nothing points to it, A did not rotate.
    assert committed(run_uri) == ["checkpoint_1_12", "checkpoint_1_15"]
    assert read_pointer_from(run_uri) == "checkpoint_1_12"
    with pytest.raises(FencedError):
        save(a, 16)
    assert objects(run_uri, "checkpoint_1_16/") == []
    a.close()
    run.close()
    (b,) = b_mgr
    # B trains from 12 and saves 15 too: it replaces A's stale 15 (epoch 1 < 2), atomically.
    b.save({"model": {"w": w_at(150)}, "num_updates": 15}, epoch=1, num_updates=15,
           rank_state={"n": 15})
    log("B saved 15")
    save(b, 20)
    log("B saved 20")
    b.close()
    assert committed(run_uri) == ["checkpoint_1_15", "checkpoint_1_20"]  # B's, keep-last 2
    assert last_doc(run_uri)["checkpoint"] == "checkpoint_1_20"
    log.assert_never_backwards()
    assert [o for _, o in log.seen] == [(1, 12), (1, 12), (2, 15), (2, 20)]


def test_successor_replaces_a_stale_checkpoint_of_the_same_name(run_uri):
    """B restored 12 and saves 15 over A's committed 15 (epoch 1): CAS-replaced, A's data files
    removed, the checkpoint is B's; A cannot replace it back."""
    a = manager(run_uri, keep_interval_updates=-1)
    a.restore_or_initialize()
    save(a, 12)
    save(a, 15)
    a_files = set(objects(run_uri, "checkpoint_1_15/"))
    b = manager(run_uri, keep_interval_updates=-1, restore_file="checkpoint_1_12")
    r = b.restore_or_initialize()
    assert r is not None and r.checkpoint == "checkpoint_1_12"
    b.save({"model": {"w": w_at(150)}, "num_updates": 15}, epoch=1, num_updates=15,
           rank_state={"n": 15})
    state = xla_ckpt.load(f"{run_uri}/checkpoint_1_15")
    assert torch.equal(state["model"]["w"], w_at(150))
    b_files = set(objects(run_uri, "checkpoint_1_15/"))
    assert a_files & b_files == {"checkpoint_1_15/manifest.json"}  # A's data files are gone
    with pytest.raises(FencedError):
        save(a, 15)
    a.close()
    b.close()
    assert torch.equal(xla_ckpt.load(f"{run_uri}/checkpoint_1_15")["model"]["w"], w_at(150))
    assert last_doc(run_uri)["checkpoint"] == "checkpoint_1_15"
    assert pointer_order(last_doc(run_uri)) == (2, 15)


def test_a_second_commit_to_the_same_folder_raises(run_uri):
    """The commit marker is created only if absent: never replaced."""
    with open_storage(run_uri) as run:
        folder = run.child("checkpoint_1_5")
        first = new_save_id()
        commit(folder, first, [write_item(folder, first, STATE_ITEM, {"w": torch.ones(3)})],
               if_generation_match=0)
        marker = folder.read_bytes(MANIFEST_NAME)
        second = new_save_id()
        part = write_item(folder, second, STATE_ITEM, {"w": torch.zeros(3)})
        with pytest.raises(PreconditionFailedError) as ei:
            commit(folder, second, [part], if_generation_match=0)
        assert ei.value.expected_generation == 0 and ei.value.actual_generation is not None
        assert folder.read_bytes(MANIFEST_NAME) == marker
    assert torch.equal(xla_ckpt.load(f"{run_uri}/checkpoint_1_5")["w"], torch.ones(3))
    # The manager: the same incarnation saving one name twice is refused, the first stays.
    mgr = manager(run_uri, keep_interval_updates=-1)
    mgr.restore_or_initialize()
    save(mgr, 7, name="checkpoint_best_so_far")
    kept = digest(run_uri, "checkpoint_best_so_far")
    with pytest.raises(CheckpointSaveError) as ei2:
        save(mgr, 8, name="checkpoint_best_so_far")
    assert isinstance(ei2.value.__cause__, PreconditionFailedError)
    assert "already holds a committed checkpoint" in str(ei2.value)
    assert "never replaced by its own incarnation" in str(ei2.value)
    mgr.close()
    assert digest(run_uri, "checkpoint_best_so_far") == kept


def test_plain_save_over_a_path_is_compare_and_swap(run_uri):
    """Two xla_ckpt.save to one path: the one that commits second loses, nothing of it stays."""
    uri = f"{run_uri}/ckpt"
    xla_ckpt.save({"w": torch.full((4,), 1.0)}, uri)
    sneaked: list = []

    def rival_commits_first(st, name):
        if name == MANIFEST_NAME and not sneaked:
            sneaked.append(xla_ckpt.save({"w": torch.full((4,), 3.0)}, uri))

    st = _Hooked.install(open_storage(uri), rival_commits_first)
    with pytest.raises(PreconditionFailedError) as ei:
        xla_ckpt.save({"w": torch.full((4,), 2.0)}, uri, storage=st)
    st.close()
    assert "another save committed this checkpoint after this one started" in str(ei.value)
    state = xla_ckpt.load(uri)
    assert torch.equal(state["w"], torch.full((4,), 3.0))
    files = objects(uri)
    assert len(files) == 2 and MANIFEST_NAME in files  # the loser's data file was removed
    assert sneaked[0].save_id in next(f for f in files if f != MANIFEST_NAME)
    # Without a rival, saving over the path still replaces it.
    xla_ckpt.save({"w": torch.full((4,), 4.0)}, uri)
    assert torch.equal(xla_ckpt.load(uri)["w"], torch.full((4,), 4.0))


# ---- pointers ------------------------------------------------------------------------------

@pytest.mark.parametrize("rival", [(3, 40), (1, 40), (2, 5)])
def test_pointer_cas_losing_to_a_concurrent_writer_retries(run_uri, rival):
    """Our pointer write (epoch 2, update 30) loses its compare-and-swap to a rival that moved
    the pointer in between: it reads again, and the pointer ends on the higher of the two."""
    with open_storage(run_uri) as st:
        assert write_pointer(st, "last", "checkpoint_1_10", lease_epoch=1, num_updates=10)
    attempts = []

    def rival_moves_it(st, name):
        if name == "checkpoint_last.json":
            attempts.append(pointer_order(last_doc(run_uri)))
            if len(attempts) == 1:
                with open_storage(run_uri) as other:
                    assert write_pointer(other, "last", f"checkpoint_1_{rival[1]}",
                                         lease_epoch=rival[0], num_updates=rival[1])

    st = _Hooked.install(open_storage(run_uri), rival_moves_it)
    moved = write_pointer(st, "last", "checkpoint_1_30", lease_epoch=2, num_updates=30)
    st.close()
    ours_higher = (2, 30) >= rival
    assert moved is ours_higher
    # First try refused by the store (the rival moved it); a second try only when ours is higher.
    assert attempts == ([(1, 10), rival] if ours_higher else [(1, 10)])
    doc = last_doc(run_uri)
    want = (2, 30) if ours_higher else rival
    assert pointer_order(doc) == want and doc["checkpoint"] == f"checkpoint_1_{want[1]}"


def test_pointer_never_goes_backwards_under_concurrent_writers(tmp_path):
    """Six threads move checkpoint_last with random (epoch, update) orders while a reader
    watches: every observed value is at least the previous one, and the highest wins."""
    import random

    run_uri = str(tmp_path / "run")
    rng = random.Random(7)
    orders = [(rng.randint(1, 4), rng.randint(1, 60)) for _ in range(60)]
    seen: list[tuple[int, int]] = []
    stop = threading.Event()

    def reader():
        with open_storage(run_uri) as st:
            while not stop.is_set():
                seen.append(pointer_order(read_pointer_doc(st, "last")[0]))

    def writer(mine):
        with open_storage(run_uri) as st:
            for e, n in mine:
                write_pointer(st, "last", f"checkpoint_{e}_{n}", lease_epoch=e, num_updates=n)

    os.makedirs(run_uri)
    threads = [threading.Thread(target=writer, args=(orders[i::6],)) for i in range(6)]
    watch = threading.Thread(target=reader)
    watch.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    watch.join(10)
    seen.append(pointer_order(last_doc(run_uri)))
    assert seen == sorted(seen)
    top = max(orders)
    assert seen[-1] == top and last_doc(run_uri)["checkpoint"] == f"checkpoint_{top[0]}_{top[1]}"


def test_a_tool_write_without_an_epoch_moves_the_pointer_by_cas(run_uri):
    with open_storage(run_uri) as st:
        assert write_pointer(st, "last", "checkpoint_1_20", lease_epoch=2, num_updates=20)
        assert write_pointer(st, "last", "checkpoint_1_10")  # an operator's choice wins
        assert read_pointer_doc(st, "last")[0] == {"checkpoint": "checkpoint_1_10"}


# ---- the lease ---------------------------------------------------------------------------------

def test_lease_epochs_are_unique_and_increase_under_concurrent_starts(run_uri):
    with open_storage(run_uri) as st:
        assert read_lease(st) is None
        first = acquire_lease(st)
        assert first.epoch == 1
        doc = json.loads(st.read_bytes(LEASE_NAME))
        assert doc["epoch"] == 1 and doc["owner"]["pid"] == os.getpid()
        assert set(doc["owner"]) == {"host", "pid", "started_unix_s"}
    got = []
    lock = threading.Lock()

    def start():
        with open_storage(run_uri) as own:
            lease = acquire_lease(own)
        with lock:
            got.append(lease.epoch)

    threads = [threading.Thread(target=start) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(got) == [2, 3, 4, 5, 6]  # every start got its own epoch
    with open_storage(run_uri) as st:
        now = read_lease(st)
        assert now is not None and now.epoch == 6
        check_lease(st, now)  # the holder is not fenced
        with pytest.raises(FencedError) as ei:
            check_lease(st, first, what="to test")
    assert (ei.value.own_epoch, ei.value.current_epoch) == (1, 6)
    assert "refused to test" in str(ei.value)


def test_a_damaged_lease_is_replaced_above_every_pointer(run_uri, caplog):
    with open_storage(run_uri) as st:
        write_pointer(st, "last", "checkpoint_1_20", lease_epoch=7, num_updates=20)
        st.write_atomic(LEASE_NAME, [b"{not json"])
        lease = acquire_lease(st)
        assert lease.epoch == 8
        now = read_lease(st)
        assert now is not None and now.epoch == 8
    assert "not a lease document" in caplog.text


def test_a_manager_that_only_restores_fences_nobody(run_uri):
    a = manager(run_uri)
    a.restore_or_initialize()
    save(a, 10)
    reader = CheckpointManager(make_cfg(run_uri, no_save=True))
    r = reader.restore_or_initialize()
    assert r is not None and r.checkpoint == "checkpoint_1_10"
    reader.close()
    save(a, 12)  # not fenced
    a.close()
    with open_storage(run_uri) as st:
        lease = read_lease(st)
    assert lease is not None and lease.epoch == 1
    assert committed(run_uri) == ["checkpoint_1_12"]


def test_fenced_error_survives_pickling():
    e = FencedError("gs://b/run: fenced", own_epoch=3, current_epoch=5, run="gs://b/run")
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), str(back), back.own_epoch, back.current_epoch, back.run) == \
        (FencedError, "gs://b/run: fenced", 3, 5, "gs://b/run")


# ---- rotation (C22 too) ------------------------------------------------------------------------

def test_rotation_deletes_only_what_its_own_epoch_may_delete(run_uri):
    """keep-last 1 by a stale epoch: nothing of a newer epoch, nothing a pointer names, and
    only objects this library wrote go."""
    a = manager(run_uri, keep_interval_updates=-1)
    a.restore_or_initialize()  # epoch 1
    for n in (2, 4, 6):
        save(a, n)
    a.close()
    b = manager(run_uri, keep_interval_updates=-1)
    b.restore_or_initialize()  # epoch 2
    save(b, 8)
    save(b, 9)
    b.close()
    with open_storage(run_uri) as st:
        # Someone copied other files into an old checkpoint folder (a .pt, a DCP folder).
        st.write_atomic("checkpoint_1_2/model.pt", [b"not ours"])
        st.write_atomic("checkpoint_1_2/dcp/.metadata", [b"not ours either"])
        # An epoch-1 rotation keeping 1: B's 8 is neither the newest nor pointed to, yet it is
        # of a newer epoch, so it stays; epoch-1 checkpoints go, their foreign objects stay.
        deleted = rotate(st, make_cfg(run_uri, keep_interval_updates=1), own_epoch=1)
        assert deleted == ["checkpoint_1_2", "checkpoint_1_4", "checkpoint_1_6"]
        assert [e.name for e in list_checkpoints(st) if e.committed] == ["checkpoint_1_8",
                                                                         "checkpoint_1_9"]
        assert st.list("checkpoint_1_2/") == ["checkpoint_1_2/dcp/.metadata",
                                              "checkpoint_1_2/model.pt"]
        assert rotate(st, make_cfg(run_uri, keep_interval_updates=0), own_epoch=1) == []
        # B's own epoch may delete it.
        assert rotate(st, make_cfg(run_uri, keep_interval_updates=1), own_epoch=2) == \
            ["checkpoint_1_8"]
        assert [e.name for e in list_checkpoints(st) if e.committed] == ["checkpoint_1_9"]


def test_rotation_rereads_the_pointers_before_each_deletion(run_uri):
    a = manager(run_uri, keep_interval_updates=-1)
    a.restore_or_initialize()
    for n in (2, 4, 6):
        save(a, n)
    a.close()
    moved: list[str] = []
    with open_storage(run_uri) as st:
        real_delete = st.delete

        def delete(name, **kw):
            if not moved:  # a successor points checkpoint_best at 4 once 2's deletion began
                moved.append(name)
                with open_storage(run_uri) as other:
                    write_pointer(other, "best", "checkpoint_1_4", lease_epoch=1, num_updates=4,
                                  metric="loss", value=0.1)
            return real_delete(name, **kw)

        st.delete = delete  # type: ignore[method-assign]  # the interleaving, on purpose
        deleted = rotate(st, make_cfg(run_uri, keep_interval_updates=1), own_epoch=1)
    assert moved == ["checkpoint_1_2/manifest.json"]  # the commit marker goes first
    assert deleted == ["checkpoint_1_2"]
    assert committed(run_uri) == ["checkpoint_1_4", "checkpoint_1_6"]


# ---- real processes: the predecessor SIGKILLed mid-save, or left running -------------------------

def _start_predecessor(run_uri: str, events_dir: str, env: dict) -> subprocess.Popen:
    env = dict(env, PYTHONPATH=REPO + os.pathsep + HERE, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT"):
        env.pop(k, None)
    log = open(os.path.join(events_dir, "stderr.log"), "w")
    return subprocess.Popen([sys.executable, WORKER, "--run", run_uri, "--events-dir",
                             events_dir], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=log, cwd=REPO)


def _successor_saves(run_uri: str, log: PointerLog) -> dict[str, dict[str, str]]:
    b = CheckpointManager(make_cfg(run_uri, keep_interval_updates=2))
    r = b.restore_or_initialize()  # no lease: its save below takes it
    assert r is not None and r.checkpoint == "checkpoint_1_10"
    assert torch.equal(r.state["model"]["w"], state_at(10)["model"]["w"])
    log("B restored 10")
    b.save(state_at(20), epoch=1, num_updates=20, rank_state={"rank": 0})
    log("B saved 20")
    b.close()
    return {f: digest(run_uri, f) for f in ("checkpoint_1_10", "checkpoint_1_20")}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("fate", ["sigkill", "left_running"])
def test_predecessor_process_mid_save_when_the_successor_saves(run_uri, tmp_path, fate):
    env = dict(os.environ)  # on gs:// the gcs_uri fixture pointed it at the emulator
    ev = str(tmp_path / "ev")
    os.mkdir(ev)
    log = PointerLog(run_uri)
    proc = _start_predecessor(run_uri, ev, env)
    try:
        wait_for_files([os.path.join(ev, "ready-0")], lambda: proc.poll() is None)
        log("A saved 10")
        open(os.path.join(ev, "go-save"), "w").close()
        wait_for_files([os.path.join(ev, "uploading-0")], lambda: proc.poll() is None)
        # A is mid-save: its one data file of checkpoint_1_15 (state and rank item: a writer's
        # items share one object) is being written; nothing of it is committed.
        assert not any(n.endswith("manifest.json") for n in objects(run_uri, "checkpoint_1_15/"))
        if fate == "sigkill":
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(30) == -signal.SIGKILL
        kept = _successor_saves(run_uri, log)
        if fate == "left_running":
            open(os.path.join(ev, "go-upload"), "w").close()
            assert proc.wait(60) == 0, open(os.path.join(ev, "stderr.log")).read()
            log("A went on")
            with open(os.path.join(ev, "outcome-0.json")) as f:
                out = json.load(f)
            for key in ("saved_15", "saved_16"):
                assert out[key]["error"] == "FencedError", out
                assert (out[key]["own_epoch"], out[key]["current_epoch"]) == (1, 2)
                assert "This incarnation stops saving" in out[key]["message"]
            assert "refused to commit checkpoint_1_15" in out["saved_15"]["message"]
            assert out["written_by_16"] == []
            assert objects(run_uri, "checkpoint_1_15/") == []  # its data files were removed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert committed(run_uri) == ["checkpoint_1_10", "checkpoint_1_20"]
    assert {f: digest(run_uri, f) for f in kept} == kept
    assert last_doc(run_uri) == {"checkpoint": "checkpoint_1_20", "epoch": 1, "num_updates": 20,
                                 LEASE_EPOCH_KEY: 2}
    with open_storage(run_uri) as st:
        assert resolve_latest(st) == "checkpoint_1_20"
    assert not any(n.startswith(("checkpoint_1_16", "checkpoint_best")) for n in objects(run_uri))
    log.assert_never_backwards()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_rank_of_the_stale_job_raises_fenced_error(tmp_path):
    """A 2-rank predecessor mid-save while a successor saves: both ranks raise the same
    FencedError, and neither writes its next save."""
    run_uri, ev = str(tmp_path / "run"), str(tmp_path / "ev")
    os.mkdir(ev)
    pool = shared_pool(2)
    log = PointerLog(run_uri)
    results: list = []
    job = threading.Thread(target=lambda: results.extend(
        pool.run(predecessor_rank, run_uri, ev, timeout_s=150)))
    job.start()
    try:
        wait_for_files([os.path.join(ev, f"ready-{r}") for r in range(2)], job.is_alive)
        log("A saved 10")
        open(os.path.join(ev, "go-save"), "w").close()
        wait_for_files([os.path.join(ev, "uploading-0")], job.is_alive)
        kept = _successor_saves(run_uri, log)
    finally:
        open(os.path.join(ev, "go-upload"), "w").close()
        job.join(180)
    outs = [r.unwrap() for r in results]
    assert [o["rank"] for o in outs] == [0, 1]
    for key in ("saved_15", "saved_16"):
        assert outs[0][key] == outs[1][key]  # the same error on every rank
        assert outs[0][key]["error"] == "FencedError"
        assert (outs[0][key]["own_epoch"], outs[0][key]["current_epoch"]) == (1, 2)
    assert outs[0]["written_by_16"] == outs[1]["written_by_16"] == []
    assert committed(run_uri) == ["checkpoint_1_10", "checkpoint_1_20"]
    assert {f: digest(run_uri, f) for f in kept} == kept
    assert objects(run_uri, "checkpoint_1_15/") == []
    assert read_pointer_from(run_uri) == "checkpoint_1_20"
    log.assert_never_backwards()
