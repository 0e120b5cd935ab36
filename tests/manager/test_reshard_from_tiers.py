"""Issue 26, resharding from the tiers: a restore onto another mesh takes every box from the
tier that holds it -- its own host's memory, a peer host's memory over the network, or the
durable tier -- with every byte checked, bitwise against DCP's restore of the same state.

One save (4 real gloo ranks on 2 emulated hosts, FSDP2 + AdamW, local saves every update with
a replica of each host's part on the other host, no durable save: the step exists only in
host memory), then restores onto other meshes:

* 3 hosts x 1 rank, host 2 new with an empty tier: it reads its boxes from hosts 0 and 1;
* 1 host x 2 ranks: host 0 alone holds its own part and host 1's replica: no network bytes;
* 3 hosts after one byte of each of host 1's own files was flipped: host 1's own ranks and
  host 2 read those ranges from host 0's replica instead, the failures are reported by peer
  host and file, and host 1 never trusts that copy again.
"""

from __future__ import annotations

import glob
import os

import pytest
import reshard_tier_workers as R
from test_sharded_manager import _same_shards

from xla_ckpt.testing.launcher import shared_pool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard_tiers")
    run_dir, dcp_dir = str(root / "run"), str(root / "dcp")
    os.makedirs(run_dir)
    out = [r.unwrap() for r in shared_pool(4, xla=False, hosts=2).run(
        R.save_local, run_dir, str(root), dcp_dir, timeout_s=300)]
    return run_dir, str(root), dcp_dir, out


def _copy_root(root: str, dst: str) -> str:
    import shutil

    for h in (0, 1):
        shutil.copytree(os.path.join(root, f"local-{h}"), os.path.join(dst, f"local-{h}"))
    return dst


def _check(results: list[dict]) -> None:
    for r in results:
        _same_shards(r["ours"], r["theirs"], what=f"host {r['host']}")
        assert r["tier"]["tier"] == "local", r["tier"]
        assert r["tier"]["durable_bytes"] == 0, r["tier"]
        assert r["restored_from"].endswith(f"checkpoint_1_{R.UPDATES}")


def test_the_save_is_replicated_and_not_durable(saved):
    run_dir, root, _, out = saved
    assert not glob.glob(os.path.join(run_dir, "checkpoint_*"))  # host memory only
    leaders = [o["replication"] for o in out if o["replication"] is not None]
    assert len(leaders) == 2
    for status in leaders:
        assert status[f"checkpoint_1_{R.UPDATES}"]["state"] == "replicated", status


def test_a_new_host_reads_its_boxes_from_its_peers(saved, tmp_path):
    run_dir, root, dcp_dir, _ = saved
    mine = _copy_root(root, str(tmp_path))
    res = [r.unwrap() for r in shared_pool(3, xla=False, hosts=3).run(
        R.restore_tiers, run_dir, mine, dcp_dir, timeout_s=300)]
    _check(res)
    by_host = {r["host"]: r["tier"] for r in res}
    # Host 2 holds nothing: every byte from hosts 0 and 1, none from its own memory.
    assert by_host[2]["local_bytes"] == 0 and by_host[2]["peer_bytes"] > 0
    assert set(by_host[2]["peer_bytes_by_host"]) <= {0, 1}
    assert by_host[2]["fallbacks"] == []
    # Hosts 0 and 1 each hold their own part and the other's replica: no network bytes.
    for h in (0, 1):
        assert by_host[h]["peer_bytes"] == 0 and by_host[h]["local_bytes"] > 0


def test_one_host_holding_every_part_reads_nothing_from_the_network(saved, tmp_path):
    run_dir, root, dcp_dir, _ = saved
    mine = _copy_root(root, str(tmp_path))
    import shutil

    shutil.rmtree(os.path.join(mine, "local-1"))  # host 1 is gone: host 0 holds its replica
    res = [r.unwrap() for r in shared_pool(2, xla=False).run(
        R.restore_tiers, run_dir, mine, dcp_dir, timeout_s=300)]
    _check(res)
    for r in res:
        assert r["tier"]["peer_bytes"] == 0 and r["tier"]["local_bytes"] > 0


def test_a_corrupt_peer_copy_is_read_from_another_replica_and_never_trusted_again(
        saved, tmp_path):
    run_dir, root, dcp_dir, _ = saved
    mine = _copy_root(root, str(tmp_path))
    res = [r.unwrap() for r in shared_pool(3, xla=False, hosts=3).run(
        R.restore_tiers, run_dir, mine, dcp_dir, "flip:1", timeout_s=300)]
    _check(res)  # bitwise anyway, 0 durable bytes: host 0's replica of host 1's part
    by_host = {r["host"]: r["tier"] for r in res}
    # Host 1's own ranks found their local bytes bad and read them from host 0's replica.
    assert any("crc32c mismatch in local file" in f for f in by_host[1]["fallbacks"])
    assert by_host[1]["peer_bytes_by_host"].get(0, 0) > 0
    # Host 2 asked host 1 first (the part's own host), then host 0's replica.
    bad = [f for f in by_host[2]["fallbacks"] if "peer host 1" in f]
    assert bad and all("crc32c mismatch" in f for f in bad), by_host[2]["fallbacks"]
    assert by_host[2]["peer_bytes_by_host"].get(0, 0) > 0
    # Host 1 marked its copy untrusted: no later restore reads it.
    assert glob.glob(os.path.join(mine, "local-1", "*", f"checkpoint_1_{R.UPDATES}",
                                  "untrusted-1.json"))
