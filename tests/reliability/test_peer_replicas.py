"""Peer replicas of the local tier (issue 26) with real worker processes: 2 emulated hosts x 2
gloo workers (``local_tier_workers``), each host with its own local folder (on ``/dev/shm``),
local saves every update, durable saves every 4 (to a run folder on local disk),
``local_replicas=1``: after each local commit, each host's leader copies its host's part to
the other host's tier in the background, over the job's gloo data plane.

* **a replaced host resumes from its peer**: every worker is SIGKILLed after update 10 (its
  replicas committed: ``replicated`` on both leaders), host 1's local folder is deleted (a
  replaced VM); the relaunch restores update 10 (newer than durable 8) from the local tier:
  host 1's ranks read their boxes from host 0's replica over the network (host 0's peer
  server), every crc32c checked by the reader, with 0 bytes from the durable tier, and
  training goes on bitwise against an uninterrupted run.
* **a corrupt replica is never used**: the same, but one byte of host 1's file in host 0's
  replica of update 10 is flipped: the reader's check rejects it (naming the file and the
  tensor), host 0 marks that replica untrusted, the manager decides again and restores
  update 9 the same way (host 0's replica of it), bitwise; the next relaunch does not offer
  the bad replica again.
* SIGKILL at each step of a replication, and while a peer serves a restore (the whole job, or
  the serving host alone: every survivor raises naming it).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import local_tier_workers as W
import pytest

from xla_ckpt.testing.launcher import WorkerPool

pytestmark = [pytest.mark.slow]

JOB_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def zygote():
    """One clean worker process; every job's ranks are forked from it."""
    pool = WorkerPool(1, xla=False)
    (ok,) = pool.run(W.warm, "local", timeout_s=120)
    ok.unwrap()
    yield pool
    pool.close()


@pytest.fixture
def base(tmp_path):
    root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    d = tempfile.mkdtemp(prefix="xla-ckpt-replica-test-", dir=root)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _job(zygote, spec: dict) -> dict:
    (res,) = zygote.run(W.run_jobs, [spec], JOB_TIMEOUT_S, timeout_s=JOB_TIMEOUT_S + 60)
    (out,) = res.unwrap()
    assert W.errors_of(out) == [], W.errors_of(out)
    return out


def _spec(run: str, local: str, upto: int, end: str = "close", **kw) -> dict:
    return {"run": run, "local": local, "upto": upto, "end": end, "replicas": 1, **kw}


def _die_replicated(zygote, run: str, local: str, upto: int) -> None:
    """Train to ``upto`` with replicas, wait for them, SIGKILL every rank."""
    out = _job(zygote, _spec(run, local, upto, "die", wait_replicas=True))
    assert out["killed"]
    dying = W.lines_of(out, "dying")
    for r in (0, 2):  # the host leaders
        status = dying[r]["replication"]
        for u in (upto - 1, upto):
            st = status[f"checkpoint_1_{u}"]
            assert st["state"] == "replicated", (r, u, st)
            assert st["holders"] == {"0": [1], "1": [0]}, (r, u, st)  # JSON keys
        assert status[f"checkpoint_1_{upto}"]["bytes_sent"] > 0
    for r in (1, 3):
        assert dying[r]["replication"] is None


def _replica_marker(local: str, holder: int, run: str, name: str, source: int) -> dict:
    p = os.path.join(W.tier_folder(local, holder, run), name,
                     f"replica-{source}.commit.json")
    with open(p) as f:
        return json.load(f)


def _restored(out: dict, name: str) -> dict[int, dict]:
    got = W.lines_of(out, "restored")
    assert sorted(got) == list(range(W.WORLD))
    for r, msg in got.items():
        assert msg["checkpoint"] == name, (r, msg)
        assert msg["diff"] == "" and msg["rank_diff"] == "", (r, msg)
        assert msg["tier"]["tier"] == "local", (r, msg["tier"])
        assert msg["tier"]["durable_bytes"] == 0 and msg["tier"]["fallbacks"] == [], msg["tier"]
    return got


def _bitwise_at_end(out: dict, upto: int) -> None:
    done = W.lines_of(out, "done")
    assert sorted(done) == list(range(W.WORLD))
    for r, msg in done.items():
        assert msg["at"] == upto and msg["diff"] == "", (r, msg)


@pytest.mark.timeout(300)
def test_a_replaced_host_resumes_from_its_peers_replica(zygote, base):
    run, local = os.path.join(base, "run"), W.local_template(base)
    _die_replicated(zygote, run, local, 10)
    marker = _replica_marker(local, 0, run, "checkpoint_1_10", 1)
    assert marker["host"] == 1 and marker["ranks"] == [2, 3] and marker["num_updates"] == 10
    for f, size in marker["files"].items():  # host 1's files, every one, in host 0's folder
        assert W.step_files(local, 0, run, "checkpoint_1_10")[f] == size
    with open(os.path.join(W.tier_folder(local, 1, run), "checkpoint_1_10",
                           "host-1.commit.json")) as fh:
        own1 = json.load(fh)["files"]  # host 1's own part (its folder holds host 0's too)
    assert own1 == marker["files"]
    shutil.rmtree(W.host_folder(local, 1))  # host 1 is replaced: its memory is gone
    out = _job(zygote, _spec(run, local, 11))
    got = _restored(out, "checkpoint_1_10")
    for r in (2, 3):  # host 1's ranks read their boxes from host 0's tier, none from their own
        t = got[r]["tier"]
        assert t["local_bytes"] == 0 and t["peer_bytes"] > 0, t
        assert t["healed_from"] == 0 and {int(h) for h in t["peer_bytes_by_host"]} == {0}, t
    for r in (0, 1):  # host 0 read its own memory only
        assert got[r]["tier"]["peer_bytes"] == 0 and got[r]["tier"]["local_bytes"] > 0
    # The next local save (update 11) gave host 1 its own part again.
    assert "host-1.commit.json" in W.step_files(local, 1, run, "checkpoint_1_11")
    _bitwise_at_end(out, 11)


@pytest.mark.timeout(300)
def test_a_corrupt_replica_is_rejected_and_an_older_replica_restores(zygote, base):
    run, local = os.path.join(base, "run"), W.local_template(base)
    _die_replicated(zygote, run, local, 10)
    marker = _replica_marker(local, 0, run, "checkpoint_1_10", 1)
    (f,) = [f for f in marker["files"] if f.endswith("rank-00002.safetensors")]
    path = os.path.join(W.tier_folder(local, 0, run), "checkpoint_1_10", f)
    with open(path, "r+b") as fh:  # one byte near the end: tensor bytes, not the header
        fh.seek(-5, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-5, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0x01]))
    shutil.rmtree(W.host_folder(local, 1))
    out = _job(zygote, _spec(run, local, 9))  # restore only: no save moves the folders
    _restored(out, "checkpoint_1_9")  # newer than durable 8: the previous step's replica
    untrusted = os.path.join(W.tier_folder(local, 0, run), "checkpoint_1_10",
                             "untrusted-replica-1.json")
    with open(untrusted) as fh:
        why = json.load(fh)["reason"]
    assert f in why and "crc32c" in why and "rng" in why, why
    assert not os.path.exists(os.path.join(W.tier_folder(local, 1, run), "checkpoint_1_10",
                                           "host-1.commit.json"))  # nothing bad committed
    out = _job(zygote, _spec(run, local, 12))  # 10's replica is not offered again
    _restored(out, "checkpoint_1_9")
    _bitwise_at_end(out, 12)


# ---- SIGKILL at each step of a replication ----------------------------------------------------
def _newest_intact_after_wipe(local: str, run: str) -> tuple[str, str]:
    """What a relaunch with host 1's folder gone must restore: the newest step host 0 holds
    both its own part and a committed, complete replica of host 1's part of, when not older
    than the newest durable step; else the newest durable step.  ``(name, tier)``."""
    folder = W.tier_folder(local, 0, run)
    local_best = None
    for name in os.listdir(folder):
        p = os.path.join(folder, name)
        if not os.path.exists(os.path.join(p, "host-0.commit.json")):
            continue
        try:
            with open(os.path.join(p, "replica-1.commit.json")) as fh:
                files = json.load(fh)["files"]
        except FileNotFoundError:
            continue
        if all(os.path.exists(os.path.join(p, f)) and os.path.getsize(os.path.join(p, f)) == n
               for f, n in files.items()):
            u = int(name.rsplit("_", 1)[1])
            local_best = max(local_best or (0, ""), (u, name))
    durable = [int(n.rsplit("_", 1)[1]) for n in W.catalog(run)["committed"]]
    if local_best is not None and local_best[0] >= max(durable, default=0):
        return local_best[1], "local"
    return f"checkpoint_1_{max(durable)}", "durable"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point,victim", [("replica-send", 2), ("replica-mid-send", 2),
                                          ("replica-received", 0),
                                          ("replica-committed", 0)])
def test_sigkill_at_each_step_of_a_replication_then_a_replaced_host(zygote, base, point,
                                                                     victim):
    """The job is SIGKILLed while a host leader's background thread is at ``point`` of the
    replication of update 10 (or the first one after it), host 1's folder is then deleted:
    the relaunch restores the newest step whose replica had committed (a replica in flight is
    never chosen), or the newest durable one, bitwise; never from scratch."""
    run, local = os.path.join(base, "run"), W.local_template(base)
    out = _job(zygote, _spec(run, local, 14, point=point, victim=victim, at=10))
    assert out["killed"] and out["paused"]["point"] == point, out["paused"]
    want, tier = _newest_intact_after_wipe(local, run)
    assert int(want.rsplit("_", 1)[1]) >= 8  # replicas of the steps before 10 had committed
    if point in ("replica-send", "replica-mid-send", "replica-received"):
        step = out["paused"].get("step")
        if step is not None:  # the replica in flight was never committed, so never chosen
            assert not os.path.exists(os.path.join(W.tier_folder(local, 0, run), step,
                                                   "replica-1.commit.json"))
    print(f"{point}: paused at {out['paused'].get('step')}; restoring {want} from {tier}")
    shutil.rmtree(W.host_folder(local, 1))
    relaunch = _job(zygote, _spec(run, local, 14))
    got = W.lines_of(relaunch, "restored")
    assert sorted(got) == list(range(W.WORLD))
    for r, msg in got.items():
        assert msg["checkpoint"] == want, (r, msg, point)
        assert msg["diff"] == "" and msg["rank_diff"] == "", (r, msg)
        assert msg["tier"]["tier"] == tier, (r, msg["tier"])
    _bitwise_at_end(relaunch, 14)


@pytest.mark.timeout(300)
def test_a_restore_killed_while_a_peer_serves_a_replaced_host_resumes_next_time(zygote, base):
    """Every worker is SIGKILLed while host 0's leader serves host 1's ranks their first data
    range from its tier: nobody restored or started fresh, host 1 holds nothing of update
    10; the next relaunch reads host 1's boxes from host 0 again and restores update 10,
    bitwise."""
    run, local = os.path.join(base, "run"), W.local_template(base)
    _die_replicated(zygote, run, local, 10)
    shutil.rmtree(W.host_folder(local, 1))
    out = _job(zygote, _spec(run, local, 11, point="peer-mid-read", victim=0, at=10))
    assert out["killed"] and out["paused"]["point"] == "peer-mid-read", out["paused"]
    assert W.lines_of(out, "restored") == {}  # nobody restored, nobody started fresh
    left = W.step_files(local, 1, run, "checkpoint_1_10")
    assert "host-1.commit.json" not in left and not any(f.endswith(".safetensors")
                                                        for f in left), left
    relaunch = _job(zygote, _spec(run, local, 11))
    got = _restored(relaunch, "checkpoint_1_10")
    assert got[2]["tier"]["healed_from"] == 0 and got[2]["tier"]["peer_bytes"] > 0
    _bitwise_at_end(relaunch, 11)


@pytest.mark.timeout(300)
def test_a_peer_dying_alone_while_it_serves_fails_every_survivor_naming_it(zygote, base):
    """Host 0's leader (rank 0, the holder of host 1's replica) is SIGKILLed alone while it
    serves host 1's ranks their boxes during a restore: the three survivors each raise a
    DistributedError naming rank 0 (never a hang, never a restore of a mix, never a fresh
    start), host 1 commits nothing."""
    run, local = os.path.join(base, "run"), W.local_template(base)
    _die_replicated(zygote, run, local, 10)
    shutil.rmtree(W.host_folder(local, 1))
    (res,) = zygote.run(W.run_jobs, [_spec(run, local, 11, point="peer-mid-read", victim=0,
                                           at=10, kill="victim")], JOB_TIMEOUT_S,
                        timeout_s=JOB_TIMEOUT_S + 60)
    (out,) = res.unwrap()
    assert out["paused"]["point"] == "peer-mid-read"
    assert W.lines_of(out, "restored") == {}
    errors = W.lines_of(out, "error")
    assert sorted(errors) == [1, 2, 3], W.errors_of(out)
    rows = {int(k): v for k, v in out["ranks"].items()}
    for r, e in errors.items():
        print(f"rank {r}: {e['error']}: {e['message'][:300]}")
        assert not rows[r]["hang"], r
        assert e["error"] in ("DistributedError", "CollectiveTimeoutError"), (r, e)
        assert "rank 0" in e["message"], (r, e["message"][:500])
    left = W.step_files(local, 1, run, "checkpoint_1_10")
    assert "host-1.commit.json" not in left, left
    relaunch = _job(zygote, _spec(run, local, 11))
    _restored(relaunch, "checkpoint_1_10")
    _bitwise_at_end(relaunch, 11)
