"""The local tier (issue 24) with real worker processes: 2 emulated hosts x 2 gloo workers.

Every job is 4 real ranks forked from one zygote (``local_tier_workers``), each host with its
own local folder (on ``/dev/shm`` when there is one: tmpfs, as on a TPU VM), local saves every
update and durable saves every 4.  Every outcome below is checked against an uninterrupted
reference run, bit for bit (``local_tier_workers.reference``); every job runs under a hard
timeout (a hang fails the test); no resume may start from scratch.

* **crash mid-epoch** (durable on the GCS emulator behind the fault proxy): every worker is
  SIGKILLed after update 10 (durable holds 4 and 8); the relaunch restores update 10 from the
  local tier with 0 data bytes from durable storage (the proxy's log and the restore's own
  counters), goes on bitwise and is SIGKILLed after update 12 (durable 12 committed); one
  byte of host 1's local copy of ``model.w`` is flipped; the next relaunch restores 12
  with that tensor's bytes (and only those) from the durable tier, read by host 1 only,
  everything else local, and ends at update 14 bitwise.
* **SIGKILL at each place of a save** (:data:`CASES`, durable on local disk): one rank
  pauses at a place of the local save (data file, host manifest, host markers) or of the
  durable upload from the local tier (the copy, the durable commit, its pointer, rotation),
  is SIGKILLed, then every other rank; the relaunch must restore the newest step that is
  intact on every host (or in the durable tier), bitwise, keep every committed durable
  checkpoint, and train on bitwise through saves into the folders the crash left.
* **a stale incarnation's local folder**: steps 6 and 7 in the local tier are of lease epoch
  1, a successor (epoch 2, on other hosts) committed update 5 to the durable tier; the
  relaunch on the first hosts restores 5 from durable, never the fenced 7.
* **two jobs on one host** with different run folders (same last path segment) share one
  ``local_dir``, run and are killed at the same time; each resumes its own newest step
  (its own values), never the other's.
* **corrupt, truncated and deleted local files** in a multi-host restore: a byte flipped in
  host 1's state file, host 0's copy of rank 1's file truncated, host 1's copy of rank 3's
  file deleted: right values on every rank, each fallback reported by host, file and tensor,
  only those bytes read from durable; the next restore does not trust those copies again.
* **a replaced host** (host 1's local folder gone): the relaunch restores the newest durable
  step, not host 0's newer local one.
* **a full local tier**: host 1's local folder a real 400 KiB tmpfs (room for 2 steps, not 3;
  needs the right to mount, skipped otherwise), or ``local_max_bytes`` of 400 KiB on every
  host: a save makes room first (the oldest step goes when the new one would not fit beside
  the kept ones), the tier stays within its limit at its fullest, and a relaunch restores the
  newest step from it; a 96 KiB tmpfs (smaller than one step): every local copy fails with
  ENOSPC, every durable save still commits, the relaunch restores the newest durable step.

RELIABILITY.md section 9 has the counts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import uuid

import local_tier_workers as W
import pytest

from xla_ckpt.testing.fault_proxy import FaultProxy, downloads, from_address, host_address
from xla_ckpt.testing.launcher import WorkerPool

pytestmark = [pytest.mark.slow]

JOB_TIMEOUT_S = 120.0  # one job: a hang is killed and fails the test after this


@pytest.fixture(scope="module")
def zygote(gcs_emulator):
    """One clean worker process; every job's ranks are forked from it."""
    pool = WorkerPool(1, xla=False, env=gcs_emulator.env())
    (ok,) = pool.run(W.warm, "gcs", timeout_s=120)
    ok.unwrap()
    yield pool
    pool.close()


@pytest.fixture
def base(tmp_path):
    """A fresh folder for a test's local tiers and local run folders: on ``/dev/shm`` (tmpfs)
    when it is writable, else under ``tmp_path``; removed afterwards."""
    root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    d = tempfile.mkdtemp(prefix="xla-ckpt-local-tier-test-", dir=root)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _jobs(zygote, specs: list[dict], env: dict | None = None) -> list[dict]:
    (res,) = zygote.run(W.run_jobs, specs, JOB_TIMEOUT_S, timeout_s=JOB_TIMEOUT_S + 60,
                        env=env)
    outs = res.unwrap()
    for out in outs:
        assert W.errors_of(out) == [], W.errors_of(out)
    return outs


def _job(zygote, spec: dict, env: dict | None = None) -> dict:
    return _jobs(zygote, [spec], env)[0]


def _spec(run: str, local: str, upto: int, end: str = "close", **kw) -> dict:
    return {"run": run, "local": local, "upto": upto, "end": end, **kw}


def _died_everywhere(out: dict) -> None:
    assert out["killed"]
    assert {r: row["exitcode"] for r, row in out["ranks"].items()} == {r: -9 for r in
                                                                         range(W.WORLD)}


def _assert_restored(out: dict, name: str, tier: str, *, durable_bytes: int | None = 0,
                     fallbacks: bool = False) -> dict[int, dict]:
    """Every rank restored ``name`` from ``tier``, bitwise (state and its own rank state)."""
    got = W.lines_of(out, "restored")
    assert sorted(got) == list(range(W.WORLD))
    for r, msg in got.items():
        assert msg["checkpoint"] == name, (r, msg)  # never None: no start from scratch
        assert msg["diff"] == "" and msg["rank_diff"] == "", (r, msg)
        assert msg["tier"]["tier"] == tier, (r, msg["tier"])
        assert msg["tier"]["host"] == msg["host"] == r * W.HOSTS // W.WORLD
        if durable_bytes is not None:
            assert msg["tier"]["durable_bytes"] == durable_bytes, (r, msg["tier"])
        if not fallbacks:
            assert msg["tier"]["fallbacks"] == [], (r, msg["tier"])
    return got


def _assert_bitwise_at_end(out: dict, upto: int) -> None:
    done = W.lines_of(out, "done")
    assert sorted(done) == list(range(W.WORLD))
    for r, msg in done.items():
        assert msg["at"] == upto and msg["diff"] == "", (r, msg)


def _blob(local: str, host: int, run: str, name: str, key: str) -> tuple[str, int, int]:
    """(path, offset, length) of tensor ``key``'s bytes in host ``host``'s local copy of
    checkpoint ``name`` (from the local manifest)."""
    folder = os.path.join(W.tier_folder(local, host, run), name)
    with open(os.path.join(folder, "manifest.json")) as f:
        doc = json.load(f)
    for item in doc["items"].values():
        for t in item.get("tensors", ()):
            if t["key"] == key:
                b = item["blobs"][t["blob"]]
                return os.path.join(folder, b["file"]), b["offset"], b["length"]
    raise AssertionError(f"{key} not in {folder}/manifest.json")


def _data_file(local: str, host: int, run: str, name: str, suffix: str) -> str:
    """The path of the data file of checkpoint ``name`` ending in ``suffix`` in host
    ``host``'s local tier."""
    (f,) = [f for f in W.step_files(local, host, run, name) if f.endswith(suffix)]
    return os.path.join(W.tier_folder(local, host, run), name, f)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _markers(local: str, run: str, name: str) -> dict[int, dict | None]:
    """Each host's commit marker of ``name`` in its local tier (None: absent)."""
    out: dict[int, dict | None] = {}
    for h in range(W.HOSTS):
        p = os.path.join(W.tier_folder(local, h, run), name, f"host-{h}.commit.json")
        try:
            with open(p) as f:
                out[h] = json.load(f)
        except FileNotFoundError:
            out[h] = None
    return out


# ---- 1. the crash scenario ------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_crash_mid_epoch_resumes_from_the_local_tier_then_falls_back_per_tensor(
        zygote, gcs_emulator, base):
    stem = f"lt-{uuid.uuid4().hex[:12]}"
    run = gcs_emulator.uri(f"{stem}/run")
    local = W.local_template(base)
    try:
        with FaultProxy(gcs_emulator.host) as proxy:
            env = proxy.env()
            # Job 1: from scratch; every worker SIGKILLed mid-epoch after update 10.
            out = _job(zygote, _spec(run, local, 10, "die"), env)
            _died_everywhere(out)
            assert all(m["checkpoint"] is None for m in W.lines_of(out, "restored").values())
            (cat,) = zygote.run(W.catalog, run, env=env)
            assert cat.unwrap()["committed"] == ["checkpoint_1_4", "checkpoint_1_8"]

            # Job 2: restores update 10 (newer than durable 8) from the local tier, reading no
            # data byte from durable storage; trains on to 12 (a durable save) and dies.
            proxy.reset_log()
            out = _job(zygote, _spec(run, local, 12, "die"), env)
            _died_everywhere(out)
            got = _assert_restored(out, "checkpoint_1_10", "local", durable_bytes=0)
            assert all(m["tier"]["local_bytes"] > 0 for m in got.values())
            assert proxy.records(downloads("data-")) == []
            (cat,) = zygote.run(W.catalog, run, env=env)
            assert cat.unwrap()["committed"] == ["checkpoint_1_4", "checkpoint_1_8",
                                                 "checkpoint_1_12"]

            # One byte of host 1's local copy of model.w at update 12 flipped.
            path, off, length = _blob(local, 1, run, "checkpoint_1_12", "state['model']['w']")
            _flip(path, off + length // 2)
            proxy.reset_log()
            out = _job(zygote, _spec(run, local, 14), env)
            got = _assert_restored(out, "checkpoint_1_12", "local", durable_bytes=None,
                                   fallbacks=True)
            _assert_bitwise_at_end(out, 14)
            # Each host's leader reads the replicated state for its host (ranks 0 and 2), every
            # rank its own rank file.  Host 1's leader: model.w's bytes (its blob, one crc32c
            # chunk) from durable storage, the rest of the state from its local copy.
            fname = os.path.basename(path)
            t = {r: m["tier"] for r, m in got.items()}
            for r in (0, 1, 3):
                assert t[r]["fallbacks"] == [] and t[r]["durable_bytes"] == 0, (r, t[r])
            (f,) = t[2]["fallbacks"]
            assert "crc32c mismatch" in f and fname in f, f
            assert "state['model']['w']" in f and f"[{off}, {off + length})" in f, f
            # Every byte was read locally once (the bad range too, then dropped); that range
            # once more from durable storage.
            assert t[2]["durable_bytes"] == length, t[2]
            assert t[2]["local_bytes"] == t[0]["local_bytes"], (t[0], t[2])
            print(f"host 1's fallback: {f}; bytes local/durable by rank: "
                  f"{[(t[r]['local_bytes'], t[r]['durable_bytes']) for r in range(W.WORLD)]}")
            # The proxy saw exactly those bytes, from host 1's address only.
            recs = proxy.records(downloads("data-"))
            assert recs and {r.client_address for r in recs} == {host_address(1)}
            assert {r.object_name.rsplit("/", 1)[-1] for r in recs} == {fname}
            assert sum(r.body_bytes for r in recs) == length
            assert proxy.records(from_address(host_address(0), downloads("data-"))) == []
    finally:
        gcs_emulator.delete_prefix(stem + "/")


# ---- 2. SIGKILL at each place of a save -------------------------------------------------
#: (kill point, victim rank, update whose save it is).  Update 6: a local-only save (local
#: 4 and 5, durable 4 committed before it); update 8: a durable save through the local tier
#: (local 6 and 7, durable 4); update 3: a local save before the first durable one.
CASES = [
    ("local-write", 1, 6),
    ("local-write-torn", 0, 6),
    ("local-written", 1, 6),
    ("local-written", 0, 3),
    ("host-manifest", 0, 6),
    ("one-host-marker", 2, 6),
    ("host-markers", 2, 6),
    ("local-written", 3, 8),
    ("host-manifest", 2, 8),
    ("durable-copy", 0, 8),
    ("durable-commit", 0, 8),
    ("durable-pointer", 0, 8),
    ("durable-rotate", 0, 8),
]


def expected_after(point: str, at: int) -> tuple[int, list[int]]:
    """The step a relaunch must restore after a kill at ``point`` of the save of ``at``,
    and the durable steps that must be committed then."""
    step = at if point in W.COMMITTED_LOCALLY else at - 1
    durable = [n for n in range(W.DURABLE_EVERY, at, W.DURABLE_EVERY)]
    if point in W.COMMITTED_DURABLE:
        durable.append(at)
    return step, durable


@pytest.mark.timeout(180)
@pytest.mark.parametrize("point,victim,at", CASES,
                         ids=[f"{p}-rank{v}-update{a}" for p, v, a in CASES])
def test_sigkill_at_a_point_of_the_save_resumes_the_newest_intact_step(zygote, base, point,
                                                                        victim, at):
    run, local = os.path.join(base, "run"), W.local_template(base)
    out = _job(zygote, _spec(run, local, at + 3, point=point, victim=victim, at=at))
    assert out["paused"] is not None and out["paused"]["point"] == point, out["paused"]
    _died_everywhere(out)
    name = f"checkpoint_1_{at}"
    markers = _markers(local, run, name)
    # The point is where it says: which hosts committed the step when the job died.
    if point in W.COMMITTED_LOCALLY:
        assert all(markers.values()), markers
    elif point == "one-host-marker":
        assert markers[0] is not None and markers[1] is None, markers
    elif point in ("local-write", "local-write-torn", "local-written"):
        assert markers == {0: None, 1: None}, markers
        if point == "local-write-torn":  # the victim's file: a temporary one, half written
            files = W.step_files(local, victim * W.HOSTS // W.WORLD, run, name)
            torn = out["paused"]["file"]
            (tmp,) = [f for f in files if f.startswith(torn + ".tmp-")]
            assert torn not in files and files[tmp] >= W.TORN_AT_BYTES, files
    else:  # host-manifest: the victim's host has the manifest, not the marker
        host = victim * W.HOSTS // W.WORLD
        assert markers[host] is None
        assert os.path.exists(os.path.join(W.tier_folder(local, host, run), name,
                                           "manifest.json"))
    step, durable = expected_after(point, at)
    assert W.catalog(run)["committed"] == [f"checkpoint_1_{n}" for n in durable]

    # The relaunch: the newest intact step, from the local tier (it is never older than the
    # durable one here), bitwise; then training goes on through the folders the crash left.
    out = _job(zygote, _spec(run, local, at + 2))
    _assert_restored(out, f"checkpoint_1_{step}", "local", durable_bytes=0)
    _assert_bitwise_at_end(out, at + 2)
    assert W.catalog(run)["committed"][:len(durable)] == [f"checkpoint_1_{n}" for n in durable]
    for h, m in _markers(local, run, f"checkpoint_1_{at + 2}").items():
        assert m is not None and m["num_updates"] == at + 2, (h, m)
    print(f"{point} (rank {victim}, update {at}): host markers at the kill "
          f"{[h for h, m in markers.items() if m]}, durable {durable}; resumed update {step} "
          f"from the local tier bitwise, then {at + 2} bitwise")


# ---- 3. a stale incarnation, two jobs on one host ---------------------------------------
@pytest.mark.timeout(180)
def test_a_stale_incarnations_newer_local_steps_are_never_chosen(zygote, base):
    run, local = os.path.join(base, "run"), W.local_template(base)
    # Incarnation 1 (lease epoch 1): local 6 and 7, durable 4; SIGKILLed.
    _died_everywhere(_job(zygote, _spec(run, local, 7, "die")))
    # Incarnation 2 (epoch 2) on other hosts (their own local folders): restores durable 4,
    # commits update 5 to the durable tier.
    other = W.local_template(os.path.join(base, "other-hosts"))
    out = _job(zygote, _spec(run, other, 5, durable_every=1))
    _assert_restored(out, "checkpoint_1_4", "durable", durable_bytes=None)
    stale = _markers(local, run, "checkpoint_1_7")
    assert all(m is not None and m["lease_epoch"] == 1 for m in stale.values()), stale
    # Incarnation 3 on the first hosts: their local 6 and 7 are newer in step but of a fenced
    # lineage: update 5 from the durable tier, bitwise.
    out = _job(zygote, _spec(run, local, 8))
    _assert_restored(out, "checkpoint_1_5", "durable", durable_bytes=None)
    _assert_bitwise_at_end(out, 8)
    for h, m in _markers(local, run, "checkpoint_1_7").items():  # rewritten by incarnation 3
        assert m is not None and m["lease_epoch"] == 3 and m["num_updates"] == 7, (h, m)


@pytest.mark.timeout(180)
def test_two_jobs_on_one_host_never_see_each_others_local_steps(zygote, base):
    local = W.local_template(base)  # one local_dir for both jobs
    run_a, run_b = os.path.join(base, "a", "run"), os.path.join(base, "b", "run")
    outs = _jobs(zygote, [_spec(run_a, local, 6, "die"),
                          _spec(run_b, local, 5, "die", seed=25)])
    for out in outs:
        _died_everywhere(out)
    for h in range(W.HOSTS):  # same last path segment, one folder each
        assert sorted(os.listdir(W.host_folder(local, h))) == sorted(
            os.path.basename(W.tier_folder(local, h, r)) for r in (run_a, run_b))
    outs = _jobs(zygote, [_spec(run_a, local, 8), _spec(run_b, local, 7, seed=25)])
    _assert_restored(outs[0], "checkpoint_1_6", "local")  # its own values (seed 24) ...
    _assert_restored(outs[1], "checkpoint_1_5", "local")  # ... and the other's (seed 25)
    _assert_bitwise_at_end(outs[0], 8)
    _assert_bitwise_at_end(outs[1], 7)


# ---- 4. corrupt, truncated, deleted local files -----------------------------------------
@pytest.mark.timeout(180)
def test_damaged_local_files_fall_back_per_host_file_and_tensor(zygote, base):
    run, local = os.path.join(base, "run"), W.local_template(base)
    _died_everywhere(_job(zygote, _spec(run, local, 8, "die")))  # durable 8 == local 8
    name = "checkpoint_1_8"
    state, off, length = _blob(local, 1, run, name, "state['model']['b']")
    _flip(state, off + 3)
    rank1 = _data_file(local, 0, run, name, "-rank-00001.safetensors")
    size1 = os.path.getsize(rank1)
    os.truncate(rank1, size1 - 5)
    rank3 = _data_file(local, 1, run, name, "-rank-00003.safetensors")
    size3 = os.path.getsize(rank3)
    os.unlink(rank3)

    out = _job(zygote, _spec(run, local, 8))
    got = _assert_restored(out, name, "local", durable_bytes=None, fallbacks=True)
    t = {r: m["tier"] for r, m in got.items()}
    rank_bytes = W.rank_state(0, 0)["rng"].nbytes  # the tensor bytes of a rank's own item
    assert t[0]["fallbacks"] == [] and t[0]["durable_bytes"] == 0
    (f1,) = t[1]["fallbacks"]  # host 0: its copy of rank 1's file, truncated
    assert os.path.basename(rank1) in f1 and f"has {size1 - 5} bytes" in f1, f1
    assert f"the manifest says {size1}" in f1, f1
    assert t[1]["local_bytes"] == 0 and t[1]["durable_bytes"] == rank_bytes, t[1]
    (f2,) = t[2]["fallbacks"]  # host 1: model.b's bytes in its state file
    assert "crc32c mismatch" in f2 and os.path.basename(state) in f2, f2
    assert "state['model']['b']" in f2 and f"[{off}, {off + length})" in f2, f2
    assert t[2]["durable_bytes"] == length, t[2]  # (read locally too, then dropped)
    assert t[2]["local_bytes"] == t[0]["local_bytes"], (t[0], t[2])
    (f3,) = t[3]["fallbacks"]  # host 1: rank 3's file deleted
    assert os.path.basename(rank3) in f3 and "is missing" in f3, f3
    assert t[3]["local_bytes"] == 0 and t[3]["durable_bytes"] == rank_bytes, t[3]
    assert size3 > rank_bytes  # (a whole file is never read: only the item's bytes)
    print(f"fallbacks: rank 1: {f1}; rank 2: {f2}; rank 3: {f3}; bytes local/durable by "
          f"rank: {[(t[r]['local_bytes'], t[r]['durable_bytes']) for r in range(W.WORLD)]}")
    for h in range(W.HOSTS):  # neither host trusts its copy of update 8 again
        assert os.path.exists(os.path.join(W.tier_folder(local, h, run), name,
                                           f"untrusted-{h}.json"))
    out = _job(zygote, _spec(run, local, 10))
    _assert_restored(out, name, "durable", durable_bytes=None)
    _assert_bitwise_at_end(out, 10)


@pytest.mark.timeout(180)
def test_a_replaced_host_without_its_local_folder_resumes_from_durable(zygote, base):
    """Host 1 comes back empty (a replaced VM: its tmpfs is gone): no local step is on every
    host, so the relaunch restores the newest durable step, never host 0's newer local one."""
    run, local = os.path.join(base, "run"), W.local_template(base)
    _died_everywhere(_job(zygote, _spec(run, local, 10, "die")))
    shutil.rmtree(W.host_folder(local, 1))
    out = _job(zygote, _spec(run, local, 11))
    _assert_restored(out, "checkpoint_1_8", "durable", durable_bytes=None)
    _assert_bitwise_at_end(out, 11)


# ---- 5. a full tmpfs, a local_max_bytes budget --------------------------------------------
LIMIT_BYTES = 400 * 1024  # room for 2 steps of a host (about 150 KiB each), not for 3


def _mount_tmpfs(path: str, size: int) -> bool:
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                       capture_output=True, check=False)
    return r.returncode == 0


def _used_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("limit", ["tmpfs", "local_max_bytes"])
def test_a_full_local_tier_makes_room_and_keeps_saving(zygote, base, limit):
    """keep_local_checkpoints=2 and room for 2 steps: host 1's local folder is a real 400 KiB
    tmpfs (its writes fail with ENOSPC when full), or every host has local_max_bytes=400 KiB.
    Each save first removes the oldest step when the new one would not fit beside the two
    kept; killed when host 1's data files and manifest of update 10 are written (the most
    the tier holds), the tier is within its limit, and the relaunch restores update 9 from
    the local tier."""
    run, local = os.path.join(base, "run"), W.local_template(base)
    kw: dict = {}
    mounted = W.host_folder(local, 1)
    if limit == "tmpfs":
        if not _mount_tmpfs(mounted, LIMIT_BYTES):
            pytest.skip("cannot mount a tmpfs here (needs CAP_SYS_ADMIN)")
    else:
        kw["local_max_bytes"] = LIMIT_BYTES
    try:
        out = _job(zygote, _spec(run, local, 13, point="host-manifest", victim=2, at=10, **kw))
        assert out["paused"] is not None, out
        _died_everywhere(out)
        for h in ([1] if limit == "tmpfs" else range(W.HOSTS)):
            assert _used_bytes(W.host_folder(local, h)) <= LIMIT_BYTES
        assert W.catalog(run)["committed"] == ["checkpoint_1_4", "checkpoint_1_8"]
        out = _job(zygote, _spec(run, local, 12, **kw))
        _assert_restored(out, "checkpoint_1_9", "local")
        _assert_bitwise_at_end(out, 12)
    finally:
        if limit == "tmpfs":
            subprocess.run(["umount", mounted], check=False)


@pytest.mark.timeout(180)
def test_a_tmpfs_smaller_than_a_step_fails_only_the_local_copies(zygote, base):
    """Host 1's local folder is a real 96 KiB tmpfs: every local write there fails with ENOSPC.
    Each local save is dropped on every host; each durable save still commits (host 1's ranks
    write to durable storage directly, host 0's copy their local files); the relaunch after
    every worker was SIGKILLed restores the newest durable step."""
    run, local = os.path.join(base, "run"), W.local_template(base)
    mounted = W.host_folder(local, 1)
    if not _mount_tmpfs(mounted, 96 * 1024):
        pytest.skip("cannot mount a tmpfs here (needs CAP_SYS_ADMIN)")
    try:
        out = _job(zygote, _spec(run, local, 10, "die"))
        _died_everywhere(out)
        assert all(m["local_committed"] == [] for m in W.lines_of(out, "dying").values())
        assert W.catalog(run)["committed"] == ["checkpoint_1_4", "checkpoint_1_8"]
        out = _job(zygote, _spec(run, local, 12))
        _assert_restored(out, "checkpoint_1_8", "durable", durable_bytes=None)
        _assert_bitwise_at_end(out, 12)
    finally:
        subprocess.run(["umount", mounted], check=False)
