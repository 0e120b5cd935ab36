"""The local tier's folder and markers (:class:`LocalTier`) and the decision across tiers
(:func:`choose_local`), without a manager: real files in a temp folder, real checkpoints
written with ``xla_ckpt.save``.

Each test asserts what the tier lists (names, fields, ``missing``, ``complete``), what is left
on disk, or which step the decision picks and why it skips the others.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import xla_ckpt
from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.run.local_tier import (
    DurableLatest,
    LocalChoice,
    LocalStep,
    LocalTier,
    choose_local,
    marker_name,
    run_key,
    untrusted_name,
)

# ---- LocalTier ------------------------------------------------------------------------------


def tensor_at(n: int, numel: int = 64) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float32) + n


def data_files(folder: str) -> dict[str, int]:
    return {f: os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
            if f.startswith("data-")}


def put_step(tier: LocalTier, n: int, *, numel: int = 64, lease_epoch: int = 1,
             marker: bool = True) -> LocalStep:
    """A real checkpoint of update ``n`` in ``tier`` (data files and manifest), then this
    host's commit marker (unless ``marker=False``)."""
    name = f"checkpoint_1_{n}"
    folder = tier.path(name)
    manifest = xla_ckpt.save({"w": tensor_at(n, numel), "n": n}, folder)
    step = LocalStep(name=name, save_id=manifest.save_id, host=tier.host, ranks=(0,),
                     world_size=1, lease_epoch=lease_epoch, epoch=1, num_updates=n,
                     files=data_files(folder), complete=True)
    if marker:
        tier.commit(step, None)
    return step


def test_run_key_separates_runs_and_is_stable(tmp_path):
    a = LocalTier(str(tmp_path), "gs://bucket-a/jobs/run")
    b = LocalTier(str(tmp_path), "gs://bucket-b/jobs/run")  # same last segment, other bucket
    c = LocalTier(str(tmp_path), "/mnt/jobs/run")
    again = LocalTier(str(tmp_path), "gs://bucket-a/jobs/run/")  # trailing slash: same run
    assert len({a.folder, b.folder, c.folder}) == 3
    assert again.folder == a.folder
    assert os.path.basename(a.folder) == run_key("gs://bucket-a/jobs/run")
    assert os.path.basename(a.folder).startswith("run-")
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(t.folder) for t in (a, b, c))
    put_step(a, 3)
    assert [s.name for s in a.inventory()] == ["checkpoint_1_3"]
    assert b.inventory() == [] and c.inventory() == []
    assert [s.name for s in again.inventory()] == ["checkpoint_1_3"]


def test_commit_then_inventory_lists_the_step_with_its_fields(tmp_path):
    tier = LocalTier(str(tmp_path), "/runs/a", host=3)
    written = put_step(tier, 7, lease_epoch=4)
    folder = tier.path("checkpoint_1_7")
    assert sorted(os.listdir(folder)) == sorted([*written.files, MANIFEST_NAME, marker_name(3)])
    with open(os.path.join(folder, marker_name(3))) as f:
        doc = json.load(f)
    assert doc["format"] == "xla_ckpt-local-tier" and doc["save_id"] == written.save_id
    (step,) = tier.inventory()
    assert step == written
    assert (step.name, step.host, step.ranks, step.world_size) == ("checkpoint_1_7", 3, (0,), 1)
    assert (step.lease_epoch, step.epoch, step.num_updates) == (4, 1, 7)
    assert step.complete and step.missing == ()
    assert step.nbytes == sum(written.files.values()) > 64 * 4
    # The bytes in the folder are the checkpoint: it loads as any checkpoint folder does.
    assert torch.equal(xla_ckpt.load(folder)["w"], tensor_at(7))


def test_a_step_without_marker_or_manifest_is_not_listed(tmp_path):
    tier = LocalTier(str(tmp_path), "/runs/a")
    put_step(tier, 1)
    put_step(tier, 2, marker=False)  # the save stopped before its host commit
    committed = put_step(tier, 3)
    os.unlink(os.path.join(tier.path(committed.name), MANIFEST_NAME))
    other_host = put_step(tier, 4)  # a marker of another host is not this host's commit
    os.rename(os.path.join(tier.path(other_host.name), marker_name(0)),
              os.path.join(tier.path(other_host.name), marker_name(1)))
    assert [s.name for s in tier.inventory()] == ["checkpoint_1_1"]


def test_an_unreadable_marker_is_skipped_with_a_warning(tmp_path, caplog):
    tier = LocalTier(str(tmp_path), "/runs/a")
    put_step(tier, 1)
    bad = put_step(tier, 2)
    path = os.path.join(tier.path(bad.name), marker_name(0))
    with open(path, "w") as f:
        f.write('{"format": "xla_ckpt-local-tier", "name": 5}')
    with caplog.at_level("WARNING", logger="xla_ckpt.run.local_tier"):
        assert [s.name for s in tier.inventory()] == ["checkpoint_1_1"]
    assert f"skipping local checkpoint {tier.path(bad.name)}" in caplog.text
    assert "field 'files'" in caplog.text or "field 'name'" in caplog.text


@pytest.mark.parametrize("damage", ["vanished", "truncated", "grown"])
def test_a_vanished_or_resized_file_is_missing_and_the_step_incomplete(tmp_path, damage):
    tier = LocalTier(str(tmp_path), "/runs/a")
    step = put_step(tier, 5)
    name = sorted(step.files)[0]
    path = os.path.join(tier.path(step.name), name)
    if damage == "vanished":
        os.unlink(path)
    elif damage == "truncated":
        os.truncate(path, step.files[name] - 1)
    else:
        with open(path, "ab") as f:
            f.write(b"x")
    (listed,) = tier.inventory()
    assert listed.missing == (name,)
    assert listed.complete is False
    assert listed.files == step.files  # the marker's sizes (what the manifest says)


def test_untrust_hides_the_step_on_this_host_only(tmp_path, caplog):
    tier = LocalTier(str(tmp_path), "/runs/a", host=0)
    other = LocalTier(str(tmp_path), "/runs/a", host=1)  # a second host sharing the folder
    s = put_step(tier, 1)
    other.commit(LocalStep(**{**s.__dict__, "host": 1}), None)
    s2 = put_step(tier, 2)
    tier.untrust("checkpoint_1_2", s.save_id, "names another save")  # not this one's
    assert [x.name for x in tier.inventory()] == ["checkpoint_1_1", "checkpoint_1_2"]
    with caplog.at_level("WARNING", logger="xla_ckpt.run.local_tier"):
        tier.untrust("checkpoint_1_2", s2.save_id, "crc32c mismatch in bytes [0, 8)")
    assert "host 0: local copy of checkpoint_1_2" in caplog.text
    assert "crc32c mismatch in bytes [0, 8)" in caplog.text
    assert [x.name for x in tier.inventory()] == ["checkpoint_1_1"]
    assert os.path.exists(os.path.join(tier.path("checkpoint_1_2"), untrusted_name(0)))
    tier.untrust("checkpoint_1_1", s.save_id, "bad")
    assert tier.inventory() == []
    assert [x.name for x in other.inventory()] == ["checkpoint_1_1"]


def test_prune_keeps_the_newest_k_and_a_protected_one(tmp_path):
    tier = LocalTier(str(tmp_path), "/runs/a", keep_last=2)
    for n in (1, 2, 3, 4):
        put_step(tier, n)
    put_step(tier, 5, marker=False)  # an uncommitted leftover
    os.makedirs(tier.path("checkpoint_1_6"))  # a save in flight (protected)
    two = tier.inventory()[1]
    held = {f: open(os.path.join(tier.path(two.name), f), "rb").read() for f in two.files}
    gone = tier.prune(protect=["checkpoint_1_6"])
    assert sorted(gone) == ["checkpoint_1_1", "checkpoint_1_2", "checkpoint_1_5"]
    assert sorted(os.listdir(tier.folder)) == [".spare", "checkpoint_1_3", "checkpoint_1_4",
                                               "checkpoint_1_6"]
    # The newest evicted step's own files wait as spares, under their names without the
    # save id (the next save's file of that name recycles them); nothing else is kept.
    spares = sorted(os.listdir(os.path.join(tier.folder, ".spare")))
    assert spares == sorted(os.path.basename(tier.spare_path(f)) for f in held)
    assert all(two.save_id not in f for f in spares)
    for f, data in held.items():
        assert open(tier.spare_path(f), "rb").read() == data
    assert tier.spare_bytes() == two.nbytes
    assert tier.used_bytes() == sum(s.nbytes for s in tier.inventory()) + \
        sum(os.path.getsize(os.path.join(tier.path(s.name), f)) for s in tier.inventory()
            for f in os.listdir(tier.path(s.name)) if f not in s.files)
    assert [s.name for s in tier.inventory()] == ["checkpoint_1_3", "checkpoint_1_4"]
    assert torch.equal(xla_ckpt.load(tier.path("checkpoint_1_4"))["w"], tensor_at(4))
    # keep_last=1 and a step of a newer lease epoch: the epoch orders before num_updates.
    one = LocalTier(str(tmp_path), "/runs/a", keep_last=1)
    put_step(one, 2, lease_epoch=2)
    one.prune()
    assert [s.name for s in one.inventory()] == ["checkpoint_1_2"]
    assert sorted(os.listdir(one.folder)) == [".spare", "checkpoint_1_2"]


def test_room_for_counts_what_keep_last_leaves(tmp_path):
    tier = LocalTier(str(tmp_path), "/runs/a", keep_last=2)
    s1 = put_step(tier, 1, numel=256)
    s2 = put_step(tier, 2, numel=256)
    size = s2.nbytes
    assert tier.room_for(10**12, "checkpoint_1_3") == (True, 0)  # max_bytes=0: no limit
    tier.max_bytes = 2 * size
    # keep_last=2: the new step plus the newest older one stay.
    assert tier.room_for(size, "checkpoint_1_3") == (True, s2.nbytes)
    assert tier.room_for(size + 1, "checkpoint_1_3") == (False, s2.nbytes)
    # Saving over an existing name: that step does not count as an older one.
    assert tier.room_for(size, "checkpoint_1_2") == (True, s1.nbytes)
    tier.keep_last = 1
    assert tier.room_for(2 * size, "checkpoint_1_3") == (True, 0)
    assert tier.room_for(2 * size + 1, "checkpoint_1_3") == (False, 0)
    tier.keep_last = 3
    assert tier.room_for(0, "checkpoint_1_3") == (True, s1.nbytes + s2.nbytes)
    assert tier.room_for(1, "checkpoint_1_3") == (False, s1.nbytes + s2.nbytes)


def test_discard_foreign_removes_steps_of_the_new_epoch_and_later(tmp_path, caplog):
    tier = LocalTier(str(tmp_path), "/runs/a", host=2)
    put_step(tier, 3, lease_epoch=1)
    put_step(tier, 4, lease_epoch=2)
    put_step(tier, 5, lease_epoch=3)
    with caplog.at_level("WARNING", logger="xla_ckpt.run.local_tier"):
        assert tier.discard_foreign(2) == ["checkpoint_1_4", "checkpoint_1_5"]
    assert sorted(os.listdir(tier.folder)) == ["checkpoint_1_3"]
    assert "host 2: removed checkpoint_1_4, checkpoint_1_5 from the local tier" in caplog.text
    assert tier.discard_foreign(2) == []


def test_discard_and_bad_names(tmp_path):
    tier = LocalTier(str(tmp_path), "/runs/a")
    put_step(tier, 1)
    tier.discard("checkpoint_1_1")
    assert os.listdir(tier.folder) == [] and tier.inventory() == []
    for bad in ("", "../x", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="bad checkpoint name"):
            tier.path(bad)


def test_unusable_root_is_a_config_error(tmp_path):
    from xla_ckpt.errors import ConfigError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"checkpoint.local_dir .*cannot create"):
        LocalTier(str(blocker), "/runs/a")


# ---- choose_local ---------------------------------------------------------------------------


def mk(n: int, host: int = 0, *, save: str | None = None, lease: int = 1, world: int = 2,
       complete: bool = True) -> LocalStep:
    """Host ``host``'s marker of checkpoint_1_<n> (save id ``s<n>`` unless given)."""
    return LocalStep(name=f"checkpoint_1_{n}", save_id=save or f"s{n}", host=host,
                     ranks=(host,), world_size=world, lease_epoch=lease, epoch=1,
                     num_updates=n, files={f"data-{save or f's{n}'}-rank-{host:05d}": 10},
                     complete=complete, missing=() if complete else (f"data-s{n}",))


def invs(*per_host: list[LocalStep]) -> dict[int, list[LocalStep]]:
    return {h: sorted(steps, key=lambda s: (s.lease_epoch, s.num_updates))
            for h, steps in enumerate(per_host)}


def decide(inventories, *, world_size=2, lease_epoch=1, durable=None, durable_saves=None):
    saves = dict(durable_saves or {})
    if durable is not None:
        saves.setdefault(durable.name, durable.save_id)
    asked: list[str] = []

    def durable_save_id(name: str) -> str | None:
        asked.append(name)
        return saves.get(name)
    choice, why = choose_local(inventories, world_size=world_size, lease_epoch=lease_epoch,
                               durable=durable, durable_save_id=durable_save_id)
    return choice, why


def test_newest_step_every_host_committed():
    choice, why = decide(invs([mk(3, 0), mk(4, 0), mk(5, 0)], [mk(3, 1), mk(4, 1), mk(5, 1)]))
    assert isinstance(choice, LocalChoice) and why == ""
    assert (choice.name, choice.save_id, choice.num_updates, choice.durable) == \
        ("checkpoint_1_5", "s5", 5, False)
    assert "every host committed checkpoint_1_5 (update 5, lease epoch 1)" in choice.reason


def test_a_host_lacking_the_newest_step():
    choice, _ = decide(invs([mk(4, 0), mk(5, 0)], [mk(4, 1)]))
    assert choice is not None and choice.name == "checkpoint_1_4"
    choice, why = decide(invs([mk(5, 0)], [mk(4, 1)]))
    assert choice is None
    assert "checkpoint_1_5: committed on hosts [0] of [0, 1]" in why
    assert "checkpoint_1_4: committed on hosts [1] of [0, 1]" in why
    choice, why = decide(invs([mk(5, 0)], []))  # a host with nothing at all
    assert choice is None and "committed on hosts [0] of [0, 1]" in why
    assert decide({}) == (None, "no host has a local tier")


def test_different_save_ids_on_hosts():
    choice, _ = decide(invs([mk(4, 0), mk(5, 0, save="a")], [mk(4, 1), mk(5, 1, save="b")]))
    assert choice is not None and choice.name == "checkpoint_1_4"
    choice, why = decide(invs([mk(5, 0, save="a")], [mk(5, 1, save="b")]))
    assert choice is None and why == "checkpoint_1_5: hosts hold different saves"


def test_stale_lease_epoch():
    # Epoch 5 saved up to update 100; its successor (epoch 6) restored from update 70 and
    # saved 80: the lineage is epoch 6, update 100 is a fenced incarnation's.
    old, new = mk(100, lease=5), mk(80, lease=6)
    choice, _ = decide(invs([old, new], [mk(100, 1, lease=5), mk(80, 1, lease=6)]),
                       lease_epoch=6)
    assert choice is not None and (choice.name, choice.num_updates) == ("checkpoint_1_80", 80)
    assert "lease epoch 6" in choice.reason
    # The run folder's lease is already at 7 (a newer incarnation took over): nothing local.
    choice, why = decide(invs([old, new], [mk(100, 1, lease=5), mk(80, 1, lease=6)]),
                         lease_epoch=7)
    assert choice is None
    assert "checkpoint_1_80: written by lease epoch 6, the lineage is epoch 7" in why
    assert "checkpoint_1_100: written by lease epoch 5, the lineage is epoch 7" in why
    # Hosts that disagree on the epoch of one step: not the lineage on every host.
    choice, why = decide(invs([mk(9, 0, lease=2)], [mk(9, 1, lease=1)]), lease_epoch=2)
    assert choice is None and why == ("checkpoint_1_9: written by lease epoch 2, the lineage is "
                                      "epoch 2 (a stale incarnation's copy)")


def test_markers_newer_than_the_run_folders_lease_are_another_jobs():
    # The run folder at this URI was deleted and made anew: its lease is back at 1 (or
    # absent), and the host still holds the old job's steps of epoch 3 beside the new job's.
    old, new = mk(50, lease=3), mk(2, lease=1)
    choice, why = decide(invs([new, old], [mk(2, 1, lease=1), mk(50, 1, lease=3)]),
                         lease_epoch=1)
    assert choice is not None and (choice.name, choice.num_updates) == ("checkpoint_1_2", 2)
    choice, why = decide(invs([old], [mk(50, 1, lease=3)]), lease_epoch=1)
    assert choice is None
    assert why == ("checkpoint_1_50: written by lease epoch 3, the run folder's lease is at "
                   "epoch 1 (the run folder was made anew: another job's copy)")
    choice, why = decide(invs([mk(5, lease=1)], [mk(5, 1, lease=1)]), lease_epoch=0)
    assert choice is None and "the run folder's lease is at epoch 0" in why


def test_world_size_change():
    hosts = invs([mk(5, 0, world=4)], [mk(5, 1, world=4)])
    choice, why = decide(hosts, world_size=2)
    assert choice is None
    assert why == ("checkpoint_1_5: saved by 4 ranks, the job has 2; no host of the job "
                   "holds the part of saved ranks [2, 3] and the durable tier does not hold "
                   "this save")
    # The same save in the durable tier: another mesh reads what its hosts lack from there.
    choice, _ = decide(hosts, world_size=2, durable=DurableLatest("checkpoint_1_5", "s5", 1, 5))
    assert choice is not None and (choice.name, choice.durable) == ("checkpoint_1_5", True)
    assert choice.sources == {"data-s5-rank-00000": (0,), "data-s5-rank-00001": (1,)}


def test_another_mesh_from_own_parts_and_replicas():
    """Issue 26, resharding from the tiers: a step the durable tier lacks is restorable onto
    another mesh when the job's hosts hold every saved rank's part, own or replica; each
    file's sources list its own host first, then the replicas' holders."""
    parts = [mk(5, g, world=4) for g in range(4)]
    # 4 saved hosts; 2 remain (0 and 1), holding the replicas of 3 and 2.
    hosts = {0: [parts[0]], 1: [parts[1]]}
    reps = {0: [parts[3]], 1: [parts[2], parts[0]]}
    choice, why = choose_local(hosts, world_size=2, lease_epoch=1, durable=None,
                               durable_save_id=lambda n: None, replicas=reps)
    assert choice is not None, why
    assert (choice.name, choice.durable, choice.replaced) == ("checkpoint_1_5", False, ())
    assert choice.sources == {"data-s5-rank-00000": (0, 1), "data-s5-rank-00001": (1,),
                              "data-s5-rank-00002": (1,), "data-s5-rank-00003": (0,)}
    assert "saved by 4 ranks, restored onto 2" in choice.reason
    # A host new to the job (2, empty) is no obstacle: it reads from its peers.
    choice, _ = choose_local({**hosts, 2: []}, world_size=3, lease_epoch=1, durable=None,
                             durable_save_id=lambda n: None, replicas=reps)
    assert choice is not None and choice.sources is not None
    # Without the replica of host 2's part: saved rank 2 is nowhere, nothing local.
    choice, why = choose_local(hosts, world_size=2, lease_epoch=1, durable=None,
                               durable_save_id=lambda n: None, replicas={0: [parts[3]]})
    assert choice is None and "saved ranks [2]" in why
    # A replica of another save, or of a stale lease epoch, does not count.
    other = mk(5, 2, world=4, save="other")
    choice, why = choose_local(hosts, world_size=2, lease_epoch=1, durable=None,
                               durable_save_id=lambda n: None, replicas={0: [parts[3], other]})
    assert choice is None and "saved ranks [2]" in why
    stale = mk(5, 2, world=4, lease=0)
    stale = LocalStep(**{**stale.__dict__, "save_id": "s5"})
    choice, why = choose_local(hosts, world_size=2, lease_epoch=1, durable=None,
                               durable_save_id=lambda n: None,
                               replicas={0: [parts[3]], 1: [stale]})
    assert choice is None and "saved ranks [2]" in why
    # A replica with a file gone (missing) does not count either.
    gone = LocalStep(**{**parts[2].__dict__, "missing": ("data-s5-rank-00002",)})
    choice, why = choose_local(hosts, world_size=2, lease_epoch=1, durable=None,
                               durable_save_id=lambda n: None, replicas={0: [parts[3]], 1: [gone]})
    assert choice is None and "saved ranks [2]" in why


def test_incomplete_host_needs_the_same_save_in_durable():
    hosts = invs([mk(4, 0), mk(5, 0)], [mk(4, 1), mk(5, 1, complete=False)])
    choice, _ = decide(hosts)
    assert choice is not None and (choice.name, choice.durable) == ("checkpoint_1_4", False)
    # The durable tier holds checkpoint_1_5 of the same save: its missing bytes come from there.
    d5 = DurableLatest("checkpoint_1_5", "s5", 1, 5)
    choice, _ = decide(hosts, durable=d5)
    assert choice is not None and (choice.name, choice.durable) == ("checkpoint_1_5", True)
    # ... of another save: not usable; update 4 is older than durable's 5, so nothing local.
    choice, why = decide(hosts, durable=DurableLatest("checkpoint_1_5", "other", 1, 5))
    assert choice is None and "newer than every local step" in why
    choice, why = decide(invs([mk(5, 0, complete=False)], [mk(5, 1)]))
    assert choice is None
    assert why == ("checkpoint_1_5: hosts [0] lack files and the durable tier does not hold "
                   "this save")


def test_durable_newer_than_every_local_step():
    hosts = invs([mk(8, 0), mk(9, 0)], [mk(8, 1), mk(9, 1)])
    choice, why = decide(hosts, durable=DurableLatest("checkpoint_1_12", "s12", 1, 12))
    assert choice is None
    assert why == ("the durable checkpoint_1_12 (update 12) is newer than every local step "
                   "(newest checkpoint_1_9, update 9)")
    # A durable checkpoint of a newer lease epoch than every local marker: durable wins.
    choice, why = decide(hosts, lease_epoch=2,
                         durable=DurableLatest("checkpoint_1_3", "s3", 2, 3))
    assert choice is None


def test_durable_same_step_and_save_is_read_locally():
    hosts = invs([mk(8, 0), mk(9, 0)], [mk(8, 1), mk(9, 1)])
    choice, _ = decide(hosts, durable=DurableLatest("checkpoint_1_9", "s9", 1, 9))
    assert choice is not None
    assert (choice.name, choice.save_id, choice.durable) == ("checkpoint_1_9", "s9", True)
    # The local step is newer than durable: local, and durable holds an older one only.
    choice, _ = decide(hosts, durable=DurableLatest("checkpoint_1_8", "s8", 1, 8))
    assert choice is not None and (choice.name, choice.durable) == ("checkpoint_1_9", False)
    # A durable step of the same name but another save: local is read with nothing behind it.
    choice, _ = decide(hosts, durable=DurableLatest("checkpoint_1_9", "other", 1, 9))
    assert choice is not None and (choice.name, choice.durable) == ("checkpoint_1_9", False)
