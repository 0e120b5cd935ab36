"""Peer replicas of the local tier (issue 26), below the manager: placement, the decision with
replicas, replica markers in a host's tier, and the checked transfer over real gloo ranks.

The end-to-end cases (a replaced host resuming from its peer, a corrupt replica) run real
4-rank jobs in ``tests/reliability/test_peer_replicas.py``.
"""

from __future__ import annotations

import json
import os

import pytest
import replica_workers as RW
import torch

import xla_ckpt
from xla_ckpt.run.local_tier import LocalStep, LocalTier, choose_local
from xla_ckpt.run.replicas import place_replicas
from xla_ckpt.testing.launcher import WorkerPool

# ---- placement --------------------------------------------------------------------------------


def test_placement_is_a_ring_outside_the_sources_domain():
    assert place_replicas([0, 1]) == {0: (1,), 1: (0,)}
    assert place_replicas([0, 1, 2, 3]) == {0: (1,), 1: (2,), 2: (3,), 3: (0,)}
    assert place_replicas([0, 1, 2, 3], replicas=2) == {0: (1, 2), 1: (3, 0), 2: (3, 0),
                                                        3: (1, 2)}
    assert place_replicas([0, 1], replicas=0) == {0: (), 1: ()}
    assert place_replicas([0]) == {0: ()}  # one host: nowhere to put a replica


def _loads(placement: dict[int, tuple[int, ...]]) -> dict[int, int]:
    out = dict.fromkeys(placement, 0)
    for holders in placement.values():
        for h in holders:
            out[h] += 1
    return out


@pytest.mark.parametrize("hosts,replicas,domains", [
    (8, 1, {h: "a" if h < 4 else "b" for h in range(8)}),      # 2 slices of 4 hosts
    (32, 1, {h: f"s{h // 16}" for h in range(32)}),             # 2 slices of 16 hosts
    (12, 2, {h: f"pool{h // 4}" for h in range(12)}),           # 3 node pools of 4
    (6, 2, None),                                               # every host its own domain
])
def test_placement_never_shares_a_domain_and_spreads_the_load(hosts, replicas, domains):
    got = place_replicas(range(hosts), replicas=replicas, domains=domains)
    dom = domains or {h: str(h) for h in range(hosts)}
    for src, holders in got.items():
        assert len(holders) == replicas and src not in holders
        assert all(dom[h] != dom[src] for h in holders)
        assert len({dom[h] for h in holders}) == len(holders)  # distinct domains
    # Every host holds exactly `replicas` other parts: never a whole slice's on one host.
    assert set(_loads(got).values()) == {replicas}, _loads(got)


def test_placement_with_unequal_or_too_few_domains():
    slices = {0: "a", 1: "a", 2: "b", 3: "b"}
    assert place_replicas([0, 1, 2, 3], domains=slices) == {0: (2,), 1: (3,), 2: (0,),
                                                            3: (1,)}
    # More replicas than other domains: every host outside the source's domain, no more.
    assert place_replicas([0, 1, 2], replicas=3, domains={0: "a", 1: "a", 2: "b"}) == \
        {0: (2,), 1: (2,), 2: (0, 1)}
    assert place_replicas([0, 1], domains={0: "a", 1: "a"}) == {0: (), 1: ()}


# ---- the decision with replicas ----------------------------------------------------------------


def mk(n: int, host: int, *, save: str | None = None, lease: int = 1,
       missing: tuple[str, ...] = ()) -> LocalStep:
    return LocalStep(name=f"checkpoint_1_{n}", save_id=save or f"s{n}", host=host,
                     ranks=(host,), world_size=2, lease_epoch=lease, epoch=1, num_updates=n,
                     files={f"data-s{n}-rank-{host:05d}": 10}, complete=not missing,
                     missing=missing)


def decide(own: dict, held: dict, *, lease_epoch: int = 1, durable_saves: dict | None = None):
    saves = durable_saves or {}
    return choose_local(own, world_size=2, lease_epoch=lease_epoch, durable=None,
                        durable_save_id=saves.get, replicas=held)


def test_a_replaced_host_reads_its_part_from_the_holder_of_its_replica():
    choice, why = decide({0: [mk(4, 0), mk(5, 0)], 1: []}, {0: [mk(4, 1), mk(5, 1)], 1: []})
    assert choice is not None and why == ""
    assert (choice.name, choice.replaced, choice.durable) == ("checkpoint_1_5", ((1, 0),), False)
    assert "host 1's part from host 0's replica" in choice.reason
    # Each data file's holders: host 0 holds its own and host 1's (its replica).
    assert choice.sources == {"data-s5-rank-00000": (0,), "data-s5-rank-00001": (0,)}
    # Both hosts hold their own parts: no transfer, whatever replicas exist.
    choice, _ = decide({0: [mk(5, 0)], 1: [mk(5, 1)]}, {0: [mk(5, 1)], 1: [mk(5, 0)]})
    assert choice is not None and choice.replaced == () and choice.sources is None
    # Every host replaced but one holds everything: each empty host from that holder.
    choice, _ = decide({0: [], 1: [], 2: [mk(5, 2)]}, {2: [mk(5, 0), mk(5, 1)]})
    assert choice is not None and choice.replaced == ((0, 2), (1, 2))


@pytest.mark.parametrize("replica,why", [
    (mk(5, 1, save="other"), "committed on hosts [0] of [0, 1]"),          # another save
    (mk(5, 1, missing=("data-s5-rank-00001",)), "committed on hosts [0]"),  # a file gone
    (mk(5, 1, lease=0), "committed on hosts [0] of [0, 1]"),               # fenced lineage
])
def test_a_replica_that_cannot_serve_is_never_chosen(replica, why):
    choice, reason = decide({0: [mk(5, 0)], 1: []}, {0: [replica]})
    assert choice is None and why in reason, reason


def test_a_holder_not_in_the_job_and_the_newest_healable_step():
    # Host 2's replica does not count: host 2 is not in this job.
    choice, reason = decide({0: [mk(5, 0)], 1: []}, {2: [mk(5, 1)]})
    assert choice is None and "committed on hosts [0] of [0, 1]" in reason
    # Step 6 lacks host 1 entirely; step 5 is healable: 5 wins.
    choice, _ = decide({0: [mk(5, 0), mk(6, 0)], 1: []}, {0: [mk(5, 1)]})
    assert choice is not None and (choice.name, choice.replaced) == ("checkpoint_1_5", ((1, 0),))


# ---- replica markers in a host's tier ----------------------------------------------------------


def put_part(tier: LocalTier, n: int, host: int, lease_epoch: int = 1) -> LocalStep:
    """A real checkpoint of update ``n`` in ``tier``'s folder, described as host ``host``'s
    part (no marker written)."""
    name = f"checkpoint_1_{n}"
    folder = tier.path(name)
    m = xla_ckpt.save({"w": torch.arange(64, dtype=torch.float32) + n}, folder)
    files = {f: os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
             if f.startswith("data-")}
    return LocalStep(name=name, save_id=m.save_id, host=host, ranks=(2 * host, 2 * host + 1),
                     world_size=4, lease_epoch=lease_epoch, epoch=1, num_updates=n,
                     files=files, complete=True)


def test_replica_markers_are_listed_untrusted_and_kept_by_keep_last(tmp_path, caplog):
    tier = LocalTier(str(tmp_path), "/runs/r", host=0, keep_last=2)
    steps = [put_part(tier, n, host=1) for n in (1, 2, 3)]
    for s in steps:
        tier.commit_replica(s)
    assert tier.inventory() == []  # not this host's own parts
    got = tier.replicas()
    assert [(s.name, s.host, s.complete, s.missing) for s in got] == \
        [(f"checkpoint_1_{n}", 1, True, ()) for n in (1, 2, 3)]
    with pytest.raises(ValueError, match="its own part"):
        tier.commit_replica(LocalStep(**{**steps[0].__dict__, "host": 0}))
    tier.untrust_replica("checkpoint_1_3", 1, steps[2].save_id, "crc32c mismatch")
    assert "not trusted from now on: crc32c mismatch" in caplog.text
    assert [s.name for s in tier.replicas()] == ["checkpoint_1_1", "checkpoint_1_2"]
    tier.prune()  # the newest 2 trusted replicas stay, the rest goes
    assert tier.folders() == ["checkpoint_1_1", "checkpoint_1_2"]
    # A vanished file makes the replica incomplete (never chosen to heal).
    os.unlink(os.path.join(tier.path("checkpoint_1_2"), sorted(steps[1].files)[0]))
    (s2,) = [s for s in tier.replicas() if s.name == "checkpoint_1_2"]
    assert not s2.complete and s2.missing == tuple(sorted(steps[1].files))


def test_a_failed_own_save_in_a_folder_with_a_replica_keeps_the_replica(tmp_path):
    tier = LocalTier(str(tmp_path), "/runs/r", host=0)
    rep = put_part(tier, 4, host=1)
    tier.commit_replica(rep)
    own = os.path.join(tier.path("checkpoint_1_4"), f"data-{rep.save_id}-rank-00000.safetensors")
    with open(own, "wb") as f:  # this host's own data file of the same save, not committed
        f.write(b"x" * 100)
    tier.discard("checkpoint_1_4", rep.save_id)
    assert not os.path.exists(own)
    assert [s.name for s in tier.replicas()] == ["checkpoint_1_4"]
    assert torch.equal(xla_ckpt.load(tier.path("checkpoint_1_4"))["w"],
                       torch.arange(64, dtype=torch.float32) + 4)
    # Another job's steps (a lease epoch this job has just taken) go, replicas too.
    tier.commit_replica(put_part(tier, 5, host=1, lease_epoch=3))
    assert tier.discard_foreign(3) == ["checkpoint_1_5"]
    assert tier.folders() == ["checkpoint_1_4"]


# ---- the transfer over real gloo ranks ----------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2, xla=False)
    yield p
    p.close()


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["", "flip", "delete"])
def test_transfer_checks_every_byte_on_arrival(pool, tmp_path, damage):
    src = LocalTier(str(tmp_path / "host-0"), "/runs/r", host=0)
    step = put_part(src, 7, host=1)
    files = sorted(step.files)
    results = [r.unwrap() for r in pool.run(RW.transfer, str(tmp_path), step.to_json(), files,
                                            damage, timeout_s=120)]
    sent, got = results
    assert sent["problems"] == [] and sent["nbytes"] == sum(step.files.values())
    if not damage:
        assert got["problems"] == [] and got["nbytes"] == sent["nbytes"]
        assert got["files"] == sorted([*files, "manifest.json", "replica-1.commit.json"])
        assert [r["host"] for r in got["replicas"]] == [1]
        folder = str(tmp_path / "host-1" / os.path.basename(src.folder) / step.name)
        assert torch.equal(xla_ckpt.load(folder)["w"], torch.arange(64, dtype=torch.float32)
                           + 7)
        return
    bad = [p for p in got["problems"] if p[0] == "crc32c"]
    assert [(p[1], p[2]) for p in bad] == [(files[0], ["state['w']"])], got["problems"]
    assert "host 1's part as received: crc32c of bytes" in bad[0][3]
    assert got["files"] == []  # the received files removed, no manifest, no marker
    assert got["replicas"] == []
    marker = tmp_path / "host-1" / os.path.basename(src.folder) / step.name / \
        "replica-1.commit.json"
    assert not marker.exists()
    assert json.loads(json.dumps(step.to_json()))["files"] == step.files


def test_ls_and_gc_of_a_local_tier_show_and_keep_the_replicas(tmp_path, capsys):
    from xla_ckpt.cli.local import collect_local, listing, print_listing

    tier = LocalTier(str(tmp_path), "/runs/r", host=0)
    own = put_part(tier, 5, host=0)
    tier.commit(own, None)
    tier.commit_replica(put_part(tier, 6, host=1))  # host 0 has no part of step 6
    tier.commit_replica(LocalStep(**{**own.__dict__, "host": 1}))  # beside its own step 5
    rows = {r["name"]: r for r in listing(tier)}
    assert (rows["checkpoint_1_5"]["state"], rows["checkpoint_1_5"]["replicas"]) == \
        ("committed", [1])
    assert (rows["checkpoint_1_6"]["state"], rows["checkpoint_1_6"]["replicas"],
            rows["checkpoint_1_6"]["step"]) == ("replica only", [1], 6)
    print_listing(tier, list(rows.values()))
    out = capsys.readouterr().out
    assert "REPLICAS" in out and "replica only" in out and "host 1" in out
    # keep-last 1: the newest own step (5) and the newest step held as a replica (6) stay.
    assert collect_local(tier, keep_last=1, incomplete=True, dry_run=False) == []
    put_part(tier, 7, host=0)  # an uncommitted leftover of this host
    assert collect_local(tier, keep_last=1, incomplete=True, dry_run=False) == [
        "checkpoint_1_7"]
    assert tier.folders() == ["checkpoint_1_5", "checkpoint_1_6"]


def test_an_untrusted_marker_condemns_only_the_save_it_names(tmp_path):
    """A later save committed in the folder of a rejected one is trusted again (the marker
    names the rejected save's id)."""
    tier = LocalTier(str(tmp_path), "/runs/r", host=0)
    old = put_part(tier, 10, host=1)
    tier.commit_replica(old)
    tier.untrust_replica("checkpoint_1_10", 1, old.save_id, "crc32c mismatch")
    assert tier.replicas() == []
    # A successor saves update 10 again (a new save id) and its replica commits there.
    new = LocalStep(**{**old.__dict__, "save_id": "feedfacecafe"})
    tier.commit_replica(new)
    assert [(s.name, s.save_id) for s in tier.replicas()] == [("checkpoint_1_10",
                                                               "feedfacecafe")]
    own = LocalStep(**{**old.__dict__, "host": 0})
    tier.commit(own, None)
    tier.untrust("checkpoint_1_10", "another-save", "not this one")
    assert [s.name for s in tier.inventory()] == ["checkpoint_1_10"]
    with open(os.path.join(tier.path("checkpoint_1_10"), "untrusted-0.json"), "w") as f:
        f.write("{not json")  # unreadable: condemns whatever is there
    assert tier.inventory() == []


def test_keep_last_counts_own_steps_and_lets_old_replicas_age_out(tmp_path):
    tier = LocalTier(str(tmp_path), "/runs/r", host=0, keep_last=2)
    for n in (1, 2):  # steps whose own part and replica both committed
        tier.commit(put_part(tier, n, host=0), None)
        tier.commit_replica(LocalStep(**{**put_part(tier, n, host=0).__dict__, "host": 1}))
    for n in (3, 4, 5):  # later steps: own parts only (replication lagging or skipped)
        tier.commit(put_part(tier, n, host=0), None)
        tier.prune()
    # The replicas of 1 and 2 did not pin their folders: keep-last 2 is 2 own steps.
    assert tier.folders() == ["checkpoint_1_4", "checkpoint_1_5"]
    assert tier.replicas() == []
