"""README command 1 in small: `xla-ckpt demo --model tiny` end to end, as a real subprocess.

Real parts only: the GCS emulator subprocess and the shaped fault proxy in front of it, 2 worker
processes on 2 emulated hosts (each its own loopback source address) with gloo and their own XLA
CPU devices, a real SIGTERM, two resumes (every-rank reads, rank-0 broadcast) and the
restore-only plans (per_host, striped, auto), the bytes served to each host counted by the
proxy; the same run goes on with the local-tier leg (SIGKILL, relaunches from host memory, a
flipped byte, a replaced host), judged against the same reference.  Then the sharded leg on 2
emulated hosts x 2 workers: the same run with FSDP2 and a local tier with peer replicas,
preempted, restored on 4 workers (and trained on) and resharded onto 2 from GCS, then
resharded onto 2 workers (one per host) from the tiers, each checked against the saved global
tensors and DCP's restore of the same state.
"""

import json
import os
import subprocess
import sys
from typing import Any

import pytest

UPDATES = 10
"""``train.max_updates`` of the replicated demo run: the local leg's crash at update 5, its
relaunch to the durable step 8 and the flipped-byte relaunch to 10 need that many."""


@pytest.fixture(scope="module")
def replicated_demo() -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    """One `xla-ckpt demo --legs ddp,local --workers 2` run, shared by the ddp and local tests
    below (the README's order: the local leg reuses the ddp leg's uninterrupted reference
    rather than training one of its own).  Returns the finished process and its --json report
    (empty when it failed: each test then fails on the exit code with the log's tail)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "xla_ckpt.cli.main", "demo", "--model", "tiny", "--workers", "2",
         "--legs", "ddp,local",  # the fsdp leg (4 workers) has a test of its own (below)
         "--json", f"train.max_updates={UPDATES}", "checkpoint.save_interval_updates=2"],
        capture_output=True, text=True, env=env, timeout=1100)
    report = json.loads(proc.stdout) if proc.returncode == 0 else {}
    return proc, report


VERDICT = ("PASS: every restore bitwise identical: ddp (all_ranks, broadcast, per_host, striped, "
           "auto), local (crash, flipped, replaced); 8 restores in ")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_demo_tiny_resumes_bitwise_with_every_plan(replicated_demo):
    proc, report = replicated_demo
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(proc.stdout.strip().splitlines()) == 1  # --json: one object on stdout
    # One verdict, last, naming every restore by leg; on stderr too (stdout is the JSON).
    assert report["verdict"].startswith(VERDICT)
    err = proc.stderr.splitlines()
    assert [ln for ln in err if ln.startswith(("PASS", "FAIL"))] == [report["verdict"]]
    # Progress: one prefix on every line, a start and an end line for every leg and phase.
    progress = [ln for ln in err if ln.startswith("xla-ckpt demo: ")]
    assert progress and "xla-ckpt demo: demo:" not in proc.stderr
    assert all(ln.startswith("xla-ckpt demo: [") for ln in progress)
    messages = [ln.split("] ", 1)[1] for ln in progress]
    for what in ("leg ddp", "phase reference", "phase train", "phase resume-all_ranks",
                 "phase resume-broadcast", "leg local", "phase local-train",
                 "phase local-crash", "phase local-flipped", "phase local-replaced"):
        assert sum(m.startswith(f"{what}: started") for m in messages) == 1, what
        assert sum(m.startswith(f"{what}: done in ") for m in messages) == 1, what
    # The local leg judged its relaunches against the ddp leg's reference: none of its own.
    assert not any(m.startswith("phase local-reference") for m in messages)
    assert report["bitwise_identical"] == {
        "all_ranks": True, "broadcast": True, "per_host": True, "striped": True, "auto": True,
        "local_crash": True, "local_flipped": True, "local_replaced": True}
    assert report["workers"] == 2 and report["updates"] == UPDATES
    assert report["hosts"] == 2  # the default: 2 emulated hosts (here of 1 worker each)
    assert report["restore_link"]["stream_mib_s"] == 32.0
    assert 1 <= report["preempted_at_update"] < UPDATES
    assert report["checkpoint"].endswith(f"_{report['preempted_at_update']}")
    assert [r["strategy"] for r in report["restores"]] == [
        "all_ranks", "broadcast", "per_host", "striped", "auto"]
    assert [r["kind"] for r in report["restores"]] == ["resume"] * 2 + ["restore"] * 3
    by = {r["strategy"]: r for r in report["restores"]}
    for r in report["restores"]:
        assert r["resumed_at_update"] == report["preempted_at_update"]
        assert r["state_identical"] is True and r["verdict"] == "bitwise identical"
        assert r["state_devices"] == ["xla:0"]  # restored onto each worker's own XLA device
        # Every byte came from one of the two hosts' own source addresses.
        assert r["served_bytes_other"] == 0 and len(r["served_bytes_per_host"]) == 2
        assert r["predicted_s"] > 0 and r["predicted_s"] == round(r["predictions"][r["plan"]], 3)
    for r in (by["all_ranks"], by["broadcast"]):
        assert r["losses_identical"] and r["params_identical"]
    # Only the all_ranks resume's own restore runs without host shared memory.
    assert [r["host_shared_memory"] for r in report["restores"]] == [False] + [True] * 4
    # The every-rank read: each host fetches the whole checkpoint; nothing is exchanged.
    ar = by["all_ranks"]
    assert (ar["plan"], ar["host_shared_memory"]) == ("all_ranks", False)
    size = ar["bytes_read_per_rank"][0]
    assert size > 0 and ar["bytes_read_per_rank"] == [size, size]
    assert ar["bytes_received_per_rank"] == [0, 0]
    assert all(size <= b <= 1.01 * size for b in ar["served_bytes_per_host"])
    # Broadcast: rank 0 reads; rank 1, alone on the other host, receives over the data plane.
    bc = by["broadcast"]
    assert bc["bytes_read_per_rank"][1] == 0 and bc["bytes_read_per_rank"][0] >= 0.99 * size
    assert 0.99 * size < bc["bytes_received_per_rank"][1] <= size
    assert bc["served_bytes_per_host"][1] == 0
    # One host of one rank: its one read per host is the rank's own read.
    ph = by["per_host"]
    assert ph["bytes_read_per_rank"] == [size, size] and ph["bytes_received_per_rank"] == [0, 0]
    # Striped: every byte fetched once per job, split over the two hosts, then exchanged.
    st = by["striped"]
    assert st["plan"] == "striped"
    assert size <= sum(st["served_bytes_per_host"]) <= 1.01 * size
    assert all(0 < b < size for b in st["served_bytes_per_host"])
    assert all(b > 0 for b in st["bytes_received_per_rank"])
    # auto ran the plan the cost model predicted fastest, and restored the same state.
    auto = by["auto"]
    assert auto["plan"] == min(auto["predictions"], key=auto["predictions"].get)


FSDP_UPDATES = 6
"""``train.max_updates`` of the fsdp leg's run: SIGTERM once update 3 is done, after the
scheduled save of update 2 (its phases' time is mostly the 4 workers' start-up; more updates
add nothing the assertions look at)."""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_tiny_fsdp_leg_reshards_from_the_tiers():
    """`xla-ckpt demo --legs fsdp --workers 4`: FSDP2 on 2 emulated hosts x 2 workers with a
    local tier (each host's part replicated to the other host), SIGTERM; restored on 4 workers
    and trains on, resharded onto 2 from GCS, and resharded onto 2 (one per host) from the
    tiers with no checkpoint byte from GCS; every restore bitwise like DCP's."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "xla_ckpt.cli.main", "demo", "--model", "tiny", "--workers", "4",
         "--legs", "fsdp", "--json", f"train.max_updates={FSDP_UPDATES}",
         "checkpoint.save_interval_updates=2"],
        capture_output=True, text=True, env=env, timeout=580)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["verdict"].startswith(
        "PASS: every restore bitwise identical: fsdp (same_size, resharded, tier_resharded); "
        "3 restores in ")
    assert report["bitwise_identical"] == {
        "fsdp_same_size": True, "fsdp_resharded": True, "fsdp_tier_resharded": True}
    messages = [ln.split("] ", 1)[1] for ln in proc.stderr.splitlines()
                if ln.startswith("xla-ckpt demo: [")]
    for what in ("leg fsdp", "phase fsdp-reference", "phase fsdp-train", "phase fsdp-same_size",
                 "phase fsdp-resharded", "phase fsdp-tier_resharded"):
        assert sum(m.startswith(f"{what}: started") for m in messages) == 1, what
        assert sum(m.startswith(f"{what}: done in ") for m in messages) == 1, what
    sh = report["sharded"]
    assert (sh["workers"], sh["hosts"], sh["local_replicas"]) == (4, 2, 1)
    assert sh["saved_shards_match"] is True and "tier_resharded_skipped" not in sh
    assert 1 <= sh["preempted_at_update"] < FSDP_UPDATES
    name = sh["checkpoint_name"]
    assert name == f"checkpoint_1_{sh['preempted_at_update']}"
    assert sh["checkpoint"].endswith(f"-fsdp/{name}")
    assert sh["local_dir"].endswith("/fsdp-host-{host}")
    assert not os.path.exists(sh["local_dir"].rsplit("/", 1)[0])  # removed at the end
    # The preemption save's part of each host's leader (ranks 0 and 2) went to the other host.
    for rank in ("0", "2"):
        rep = sh["replication"][rank]
        assert (rep["state"], rep["holders"], rep["problems"]) == (
            "replicated", {"0": [1], "1": [0]}, [])
        assert rep["bytes_sent"] > 0 and rep["bytes_received"] > 0
    same, half, tier = sh["restores"]
    assert (same["restore"], same["saved_workers"], same["workers"]) == ("same_size", 4, 4)
    assert (half["restore"], half["saved_workers"], half["workers"]) == ("resharded", 4, 2)
    assert (tier["restore"], tier["saved_workers"], tier["workers"]) == ("tier_resharded", 4, 2)
    for r in (same, half, tier):
        assert r["resumed_at_update"] == sh["preempted_at_update"]
        assert r["shards_equal_saved"] and r["shards_equal_dcp"] and r["mismatched_shards"] == []
        assert r["strategy"] == "all_ranks" and r["verdict"] == "bitwise identical"
        # Every rank reads at least its own shards' byte ranges (plus the small state item).
        for read, shard in zip(r["bytes_read_per_rank"], r["shard_bytes_per_rank"], strict=True):
            assert shard <= read
    for read, shard in zip(same["bytes_read_per_rank"], same["shard_bytes_per_rank"],
                           strict=True):
        assert read <= 1.05 * shard  # the saved boxes: no more than its own
    # Four ranks each hold a quarter of the state, two ranks a half; only the replicated AdamW
    # ``step`` scalars (4 bytes each) are held by every rank.
    extra = sum(same["shard_bytes_per_rank"]) - sum(half["shard_bytes_per_rank"])
    assert 0 < extra < 2048 and extra % 4 == 0
    assert same["rank_state_kept"] is True and half["rank_state_kept"] is False
    assert same["losses_identical"] and same["shards_identical"]
    assert "losses_identical" not in half  # a resharded run has other batches: no resume check
    # From the tiers: the same shards and bytes as the resharded restore from GCS.
    assert tier["shard_bytes_per_rank"] == half["shard_bytes_per_rank"]
    assert tier["bytes_read_per_rank"] == half["bytes_read_per_rank"]
    assert tier["rank_state_kept"] is False and tier["restored"] == name
    assert all(tier["checks"].values()) and tier["failed_checks"] == []
    assert tier["tiers_per_rank"] == ["local", "local"] and tier["gcs_counted_by"] == "proxy"
    assert tier["gcs_bytes_other"] == 0
    assert tier["bytes_by_tier"] == {"local_bytes": sum(tier["bytes_read_per_rank"]),
                                     "peer_bytes": 0, "durable_bytes": 0}
    h0, h1 = tier["hosts"]
    assert (h0["host"], h0["ranks"], h1["host"], h1["ranks"]) == (0, [0], 1, [1])
    for h, read in zip((h0, h1), tier["bytes_read_per_rank"], strict=True):
        assert (h["tier"], h["restored"], h["local_bytes"], h["peer_bytes"], h["durable_bytes"],
                h["gcs_data_bytes"], h["fallbacks"]) == ("local", name, read, 0, 0, 0, [])
    # Only rank 0's decision reads GCS (listing, lease, best pointer); host 1 reads nothing.
    assert 0 < h0["gcs_bytes"] == h0["gcs_metadata_bytes"] < 16 * 1024
    assert h1["gcs_bytes"] == 0
    # Host 0's new shards lie in its own saved part; host 1's new rank starts one row before
    # the saved boundary of the 30522-row embedding tensors: that row (weight, exp_avg,
    # exp_avg_sq) is in host 0's part, read from the replica host 1 holds in its own folder.
    shard = tier["shard_bytes_per_rank"][0]
    assert h0["shard_bytes_by_saving_host"][1] == 0
    assert 0 < h1["shard_bytes_by_saving_host"][0] < 4096
    for h in (h0, h1):
        assert shard - 1024 < sum(h["shard_bytes_by_saving_host"]) <= shard


def _row(strategy, plan, kind, read, recv, mapped, served, predicted, seconds, verdict,
         host_shared_memory=True):
    MiB = 2**20
    return {"strategy": strategy, "plan": plan, "kind": kind,
            "checkpoint": "gs://b/run/checkpoint_1_4", "host_shared_memory": host_shared_memory,
            "bytes_read_per_rank": [b * MiB for b in read],
            "bytes_received_per_rank": [b * MiB for b in recv],
            "bytes_mapped_per_rank": [b * MiB for b in mapped],
            "served_bytes_per_host": None if served is None else [b * MiB for b in served],
            "predicted_s": predicted, "restore_seconds": seconds, "seconds": seconds + 0.1,
            "mib_per_s": 2.0, "state_devices": ["xla:0"], "verdict": verdict}


def test_demo_table_lists_every_plan_with_bytes_per_host_and_predictions():
    from xla_ckpt.demo.report import format_table

    report = {"workers": 4, "hosts": 2, "model": "tiny", "updates": 8,
              "storage": "GCS emulator on http://127.0.0.1:1",
              "restore_link": {"first_byte_latency_s": 0.03, "stream_mib_s": 32.0,
                               "host_mib_s": 64.0},
              "preempted_at_update": 4, "checkpoint": "checkpoint_1_4",
              "restores": [
                  _row("all_ranks", "all_ranks", "resume", [8] * 4, [0] * 4, [0] * 4, [16, 16],
                       0.5, 0.75, "bitwise identical", host_shared_memory=False),
                  _row("broadcast", "broadcast", "resume", [8, 0, 0, 0], [0, 0, 8, 0],
                       [0, 8, 0, 8], [8, 0], 0.25, 0.5, "bitwise identical"),
                  _row("per_host", "per_host", "restore", [8, 0, 8, 0], [0] * 4, [0, 8, 0, 8],
                       [8, 8], 0.25, 0.4, "bitwise identical"),
                  _row("striped", "striped", "restore", [2] * 4, [6, 0, 6, 0], [0, 8, 0, 8],
                       [4, 4], 0.125, 0.3, "MISMATCH"),
                  _row("auto", "striped", "restore", [2] * 4, [6, 0, 6, 0], [0, 8, 0, 8],
                       None, 0.0, 0.3, "bitwise identical")]}
    table = format_table(report).splitlines()
    assert table[0] == ("xla_ckpt demo: 4 workers, model tiny, 8 updates, storage GCS emulator "
                        "on http://127.0.0.1:1")
    assert table[1] == ("2 emulated host(s) x 2 workers; preempted (SIGTERM) after update 4; "
                        "restoring checkpoint_1_4 through a link per host (30 ms first byte, "
                        "32 MiB/s per stream, 64 MiB/s per host)")
    assert table[2].split() == ["strategy", "plan", "MiB", "read/rank", "MiB", "recv/rank",
                                "MiB", "mapped/rank", "MiB", "served/host", "predicted", "s",
                                "seconds", "on", "device", "checked", "verdict"]
    rows = [line.split() for line in table[4:9]]
    assert rows[0] == ["all_ranks*", "all_ranks", "8/8/8/8", "0/0/0/0", "0/0/0/0", "16/16",
                       "0.50", "0.75", "xla:0", "resume", "bitwise", "identical"]
    assert rows[1] == ["broadcast", "broadcast", "8/0/0/0", "0/0/8/0", "0/8/0/8", "8/0", "0.25",
                       "0.50", "xla:0", "resume", "bitwise", "identical"]
    assert rows[2][:7] == ["per_host", "per_host", "8/0/8/0", "0/0/0/0", "0/8/0/8", "8/8",
                           "0.25"]
    assert rows[2][-3:] == ["state", "bitwise", "identical"]
    assert rows[3][:6] == ["striped", "striped", "2/2/2/2", "6/0/6/0", "0/8/0/8", "4/4"]
    assert rows[3][-2:] == ["state", "MISMATCH"]
    # auto shows the plan it chose; no proxy count or prediction is shown as "-".
    assert rows[4][:2] == ["auto", "striped"] and rows[4][5:8] == ["-", "-", "0.30"]
    assert table[9] == "* restore.host_shared_memory=false: every rank reads everything"


def test_host_env_spreads_workers_over_emulated_hosts():
    from xla_ckpt.demo.phase import host_env

    envs = [host_env(r, 4, 2) for r in range(4)]
    assert [(e["GROUP_RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "2"), ("0", "1", "2"), ("1", "0", "2"), ("1", "1", "2")]
    assert [e["XLA_CKPT_GCS_SOURCE_ADDRESS"] for e in envs] == [
        "127.0.0.10", "127.0.0.10", "127.0.0.11", "127.0.0.11"]
    # One host: torchrun's single-node variables, no source address (today's environment).
    assert host_env(3, 4, 1) == {"GROUP_RANK": "0", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}
    assert [host_env(r, 6, 3)["GROUP_RANK"] for r in range(6)] == ["0", "0", "1", "1", "2", "2"]
    for workers, hosts in ((3, 2), (4, 0), (4, 8)):
        with pytest.raises(ValueError) as e:
            host_env(0, workers, hosts)
        assert str(e.value) == (f"train.workers={workers} must be a multiple of "
                                f"train.hosts={hosts} (>= 1); set train.hosts to a divisor of "
                                f"train.workers")


def test_demo_rejects_workers_not_a_multiple_of_hosts():
    from xla_ckpt.config import load_config
    from xla_ckpt.demo.run import default_config_path, run_demo
    from xla_ckpt.errors import ConfigError

    assert load_config(default_config_path(), environ={}).train.hosts == 2  # the default
    cases: list[dict[str, Any]] = [{"workers": 3}, {"workers": 4, "hosts": 3}]
    for kw in cases:
        with pytest.raises(ConfigError) as e:
            run_demo(model="tiny", uri="/nonexistent", legs=["ddp"], **kw)
        hosts = kw.get("hosts", 2)
        assert str(e.value).endswith(f"train.workers={kw['workers']} is not a multiple of "
                                     f"train.hosts={hosts}; set train.hosts to a divisor of "
                                     "train.workers (1 = one host)")


def test_demo_config_cost_model_is_the_restore_link():
    from xla_ckpt.config import load_config
    from xla_ckpt.demo.link import RESTORE_SHAPING_FIGURES
    from xla_ckpt.demo.run import default_config_path

    cm = load_config(default_config_path(), environ={}).restore.cost_model
    link = RESTORE_SHAPING_FIGURES
    assert (cm.storage_stream_bytes_per_s, cm.storage_host_bytes_per_s,
            cm.first_byte_latency_s) == (link["stream_mib_s"] * 2**20,
                                         link["host_mib_s"] * 2**20,
                                         link["first_byte_latency_s"])
    assert link == {"first_byte_latency_s": 0.03, "stream_mib_s": 32.0, "host_mib_s": 64.0}
    assert cm.streams_per_reader == load_config(default_config_path(),
                                                environ={}).storage.max_workers == 8


def test_served_counter_counts_each_restore_per_host(gcs_emulator, tmp_path):
    """Real downloads from two emulated hosts' source addresses through a real proxy."""
    from xla_ckpt.demo.link import ServedCounter
    from xla_ckpt.demo.phase import DemoError
    from xla_ckpt.testing.fault_proxy import FaultProxy, host_address

    stem = f"served-{os.getpid()}"
    with gcs_emulator.storage(stem) as st:
        st.write_atomic("a", [b"x" * 1000])
        st.write_atomic("b", [b"y" * 300])
    with FaultProxy(gcs_emulator.host) as proxy:
        counter = ServedCounter(proxy, hosts=2)
        h0 = proxy.storage(gcs_emulator.uri(stem), source_address=host_address(0))
        h1 = proxy.storage(gcs_emulator.uri(stem), source_address=host_address(1))
        counter.reset()
        assert h0.read_bytes("a") == b"x" * 1000 and h1.read_bytes("b") == b"y" * 300
        counter.poll(str(tmp_path))  # the workers have not finished restore 0: nothing counted
        assert counter.counts == [] and not (tmp_path / "counted0").exists()
        (tmp_path / "restored0").write_text("0")
        counter.poll(str(tmp_path))
        assert (tmp_path / "counted0").read_text() == "0"
        first = counter.served(0)
        # Both reads' bodies (plus any metadata responses) went to their own host's address.
        assert first["served_bytes_other"] == 0
        assert first["served_bytes_per_host"][0] >= 1000
        assert first["served_bytes_per_host"][1] >= 300
        assert proxy.bytes_served_by_address() == {}  # zeroed for the next restore
        assert h1.read_bytes("a") == b"x" * 1000
        (tmp_path / "restored1").write_text("1")
        counter.poll(str(tmp_path))
        second = counter.served(1)
        assert second["served_bytes_per_host"][0] == 0
        assert second["served_bytes_per_host"][1] == first["served_bytes_per_host"][0]
        with pytest.raises(DemoError, match="restore 2 was not counted"):
            counter.served(2)
        h0.close()
        h1.close()
    gcs_emulator.delete_prefix(stem + "/")


def _state_row(strategy, kind, digests, ok=True):
    return {"strategy": strategy, "kind": kind, "state_digests": digests,
            "bitwise_identical": ok if kind == "resume" else False, "verdict": "?"}


def test_every_plan_must_restore_the_all_ranks_state_bitwise():
    from xla_ckpt.demo.report import check_states

    rows = [_state_row("all_ranks", "resume", ["a0", "a1"]),
            _state_row("broadcast", "resume", ["a0", "a1"], ok=False),  # its resume diverged
            _state_row("per_host", "restore", ["a0", "a1"]),
            _state_row("striped", "restore", ["a0", "b1"]),  # rank 1 got other bytes
            _state_row("auto", "restore", ["a0", "a1"])]
    check_states(rows)
    assert [(r["state_identical"], r["bitwise_identical"], r["verdict"]) for r in rows] == [
        (True, True, "bitwise identical"), (True, False, "MISMATCH"),
        (True, True, "bitwise identical"), (False, False, "MISMATCH"),
        (True, True, "bitwise identical")]
    # A restore-only plan equal to a wrong all_ranks restore proves nothing.
    rows = [_state_row("all_ranks", "resume", ["a0", "a1"], ok=False),
            _state_row("per_host", "restore", ["a0", "a1"])]
    check_states(rows)
    assert [r["verdict"] for r in rows] == ["MISMATCH", "MISMATCH"]
    # No digest (a worker that did not report one) is never a match.
    rows = [_state_row("all_ranks", "resume", ["", ""]),
            _state_row("per_host", "restore", ["", ""])]
    check_states(rows)
    assert [r["state_identical"] for r in rows] == [False, False]


def test_state_digest_sees_every_byte_key_and_dtype():
    import torch

    from xla_ckpt.demo.worker import state_digest

    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    base: dict[str, Any] = {"model": {"w": w, "e": torch.empty(0)}, "num_updates": 4,
                            "rank_state": None}
    d = state_digest(base)
    assert d == state_digest({"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                                        "e": torch.empty(0)}, "num_updates": 4,
                              "rank_state": None})
    flipped = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    flipped.view(torch.int32)[1, 2] ^= 1  # one bit of one element
    variants = [
        {**base, "model": {"w": flipped, "e": torch.empty(0)}},
        {**base, "model": {"w": w.reshape(3, 2), "e": torch.empty(0)}},
        {**base, "model": {"w": w.view(torch.int32), "e": torch.empty(0)}},
        {**base, "model": {"v": w, "e": torch.empty(0)}},
        {**base, "num_updates": 5},
    ]
    assert len({d, *(state_digest(v) for v in variants)}) == 1 + len(variants)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_command_restores_latest_and_continues(tmp_path):
    """`xla-ckpt train` (one rank of a real job, here single-process) resumes where it stopped."""
    run = tmp_path / "run"
    out1, out2 = tmp_path / "o1", tmp_path / "o2"
    base = [sys.executable, "-m", "xla_ckpt.cli.main", "train", "--config",
            "configs/cpu-emulation.yaml", "--device", "cpu"]
    settings = ["train.model=tiny",
            "dist.backend=single", f"checkpoint.save_dir={run}",
            "checkpoint.save_interval_updates=2", "checkpoint.async_save=false"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p1 = subprocess.run(base + ["--out", str(out1)] + settings + ["train.max_updates=3"],
                        cwd=root, env=env, capture_output=True, text=True, timeout=280)
    assert p1.returncode == 0, p1.stderr[-2000:]
    first = json.loads((out1 / "rank0.json").read_text())
    assert first["restore"] is None and sorted(map(int, first["losses"])) == [1, 2, 3]
    assert sorted(os.listdir(run)) == ["checkpoint_1_2", "checkpoint_last.json", "lease.json"]
    p2 = subprocess.run(base + ["--out", str(out2)] + settings + ["train.max_updates=5"],
                        cwd=root, env=env, capture_output=True, text=True, timeout=280)
    assert p2.returncode == 0, p2.stderr[-2000:]
    second = json.loads((out2 / "rank0.json").read_text())
    assert second["restore"]["checkpoint"] == "checkpoint_1_2"
    assert second["restore"]["num_updates"] == 2
    assert sorted(map(int, second["losses"])) == [3, 4, 5]
    # update 3 is recomputed from the checkpoint exactly as the first run computed it
    assert second["losses"]["3"] == first["losses"]["3"]


def _sharded_report():
    return {"workers": 4, "model": "minilm", "updates": 12, "storage": "local path",
            "legs": ["fsdp"], "restores": [], "bitwise_identical": {},
            "sharded": {"workers": 4, "checkpoint_name": "checkpoint_1_7",
                        "preempted_at_update": 7, "restores": [
                            {"restore": "same_size", "saved_workers": 4, "workers": 4,
                             "bytes_read_per_rank": [65 * 2**20] * 4,
                             "shard_bytes_per_rank": [65 * 2**20] * 4, "seconds": 1.5,
                             "shards_equal_saved": True, "shards_equal_dcp": True,
                             "losses_identical": True, "shards_identical": True,
                             "verdict": "bitwise identical"},
                            {"restore": "resharded", "saved_workers": 4, "workers": 2,
                             "bytes_read_per_rank": [130 * 2**20] * 2,
                             "shard_bytes_per_rank": [130 * 2**20] * 2, "seconds": 0.75,
                             "shards_equal_saved": True, "shards_equal_dcp": False,
                             "verdict": "MISMATCH"}]}}


def _tier_host(host, *, local, peer=0, durable=0, gcs_data=0, gcs=0, fallbacks=()):
    return {"host": host, "ranks": [host], "tier": "local", "restored": "checkpoint_1_7",
            "local_bytes": local, "peer_bytes": peer, "durable_bytes": durable,
            "gcs_bytes": gcs, "gcs_data_bytes": gcs_data, "fallbacks": list(fallbacks),
            "shard_bytes_by_saving_host": [130 * 2**20, 0] if host == 0 else [2**19, 2**20]}


def _tier_row(failed=()):
    return {"restore": "tier_resharded", "saved_workers": 4, "workers": 2,
            "bytes_read_per_rank": [130 * 2**20, 139 * 2**20],
            "shard_bytes_per_rank": [130 * 2**20] * 2, "seconds": 0.5,
            "shards_equal_saved": True, "shards_equal_dcp": True, "restored": "checkpoint_1_7",
            "gcs_counted_by": "proxy", "failed_checks": list(failed),
            "verdict": "MISMATCH" if failed else "bitwise identical",
            "hosts": [_tier_host(0, local=130 * 2**20, gcs=2048),
                      _tier_host(1, local=135 * 2**20, durable=4 * 2**20,
                                 gcs_data=4 * 2**20, gcs=4 * 2**20 + 1024,
                                 fallbacks=["x"])]}


def test_demo_table_of_the_sharded_leg():
    from xla_ckpt.demo.report import format_table

    table = format_table(_sharded_report()).splitlines()
    assert table[0] == "xla_ckpt demo: 4 workers, model minilm, 12 updates, storage local path"
    assert table[1] == ("FSDP2 (fully_shard per layer, 4 workers): preempted (SIGTERM) after "
                        "update 7; restoring checkpoint_1_7")
    assert table[2].split() == ["restore", "workers", "MiB", "read/rank", "MiB", "shards/rank",
                                "seconds", "=", "saved", "=", "DCP", "resume", "verdict"]
    assert table[4].split() == ["same", "size", "4->4", "65/65/65/65", "65/65/65/65", "1.50",
                                "yes", "yes", "bitwise", "bitwise", "identical"]
    assert table[5].split() == ["resharded", "4->2", "130/130", "130/130", "0.75", "yes", "NO",
                                "-", "MISMATCH"]
    assert len(table) == 6  # no restore from the tiers, nothing said about one

    # The restore from the tiers: its row, then its bytes per host and tier.
    report = _sharded_report()
    sh = report["sharded"]
    sh.update(local_dir="/dev/shm/x/fsdp-host-{host}", local_replicas=1)
    sh["restores"].append(_tier_row(failed=["no_durable_bytes", "no_gcs_data_bytes"]))
    table = format_table(report).splitlines()
    assert table[6].split() == ["tier", "resharded", "4->2", "130/139", "130/130", "0.50", "yes",
                                "yes", "-", "FAIL:", "no_durable_bytes,", "no_gcs_data_bytes"]
    assert table[8] == ("tier resharded (4 workers on 2 emulated hosts -> 2 on 2; local tier "
                        "/dev/shm/x/fsdp-host-{host}, local_replicas=1): restored "
                        "checkpoint_1_7, GCS counted by proxy")
    assert table[9].split() == ["host", "ranks", "tier", "MiB", "shards", "by", "saving", "host",
                                "MiB", "local", "MiB", "peer", "MiB", "durable", "MiB", "GCS",
                                "data", "KiB", "GCS", "all", "fallbacks"]
    assert table[11].split() == ["0", "0", "local", "130.000/0.000", "130.0", "0.0", "0.0", "0.0",
                                 "2", "0"]
    assert table[12].split() == ["1", "1", "local", "0.500/1.000", "135.0", "0.0", "4.0", "4.0",
                                 "4097", "1"]
    assert len(table) == 13
    # Not run (fewer than one worker per host after halving): the table says why.
    report = _sharded_report()
    report["sharded"]["tier_resharded_skipped"] = "why"
    assert format_table(report).splitlines()[6] == "tier resharded: not run (why)"


def _shard(t, offsets, sizes):
    from xla_ckpt.format.crc import crc32c
    from xla_ckpt.testing.asserts import tensor_bits

    box = t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
    return {"offsets": list(offsets), "sizes": list(sizes),
            "crc32c": crc32c(tensor_bits(box.contiguous())), "nbytes": box.numel() * 4}


def test_sharded_verdict_names_every_wrong_shard_and_each_failed_check():
    import torch

    from xla_ckpt.demo.report import sharded_verdict

    w = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)
    step = torch.tensor(3.0)
    saved = {"model.w": w, "optim.state.w.step": step}

    def table(rows, corrupt=False):
        t = {"model.w": _shard(w, (rows[0], 0), (rows[1], 6)),
             "optim.state.w.step": _shard(step, (), ())}
        if corrupt:
            t["model.w"] = dict(t["model.w"], crc32c=t["model.w"]["crc32c"] ^ 1)
        return t

    def rank(rows, *, corrupt=False, dcp_differs=False, losses=None, digest="d"):
        shards = table(rows, corrupt)  # ours
        # DCP's restore: the true bytes, unless this case makes DCP the one that differs.
        theirs = table(rows, corrupt=dcp_differs)
        return {"restore": {"saved_world_size": 4, "strategy": "all_ranks", "num_updates": 2,
                            "bytes_read": 100, "shard_bytes": 96, "seconds": 0.5,
                            "rank_state_kept": False, "shards": shards, "dcp_shards": theirs},
                "losses": losses or {"3": "0x1p+0"}, "digest": digest}

    good = [rank((0, 5)), rank((5, 5))]
    ok = sharded_verdict("resharded", good, saved, [], ref=None, pre=[])
    assert ok["bitwise_identical"] is True and ok["verdict"] == "bitwise identical"
    assert (ok["workers"], ok["saved_workers"], ok["bytes_read_per_rank"]) == (2, 4, [100, 100])
    assert ok["mismatched_shards"] == [] and ok["shards_equal_dcp"] is True

    bad = sharded_verdict("resharded", [rank((0, 5)), rank((5, 5), corrupt=True)], saved, [],
                          ref=None, pre=[])
    assert bad["verdict"] == "MISMATCH" and bad["shards_equal_saved"] is False
    assert bad["mismatched_shards"] == ["rank 1: model.w"]
    assert bad["shards_equal_dcp"] is False  # DCP restored the true bytes, we did not

    # Rank 0 claims rows 5..10 where it holds rows 0..5: its box does not match the saved one.
    wrong_box = [rank((0, 5)), rank((5, 5))]
    wrong_box[0]["restore"]["shards"]["model.w"]["offsets"] = [5, 0]
    wrong_box[0]["restore"]["dcp_shards"] = wrong_box[0]["restore"]["shards"]
    assert sharded_verdict("resharded", wrong_box, saved, [], ref=None,
                           pre=[])["mismatched_shards"] == ["rank 0: model.w"]

    missing = sharded_verdict("resharded", good, {"model.w": w}, ["rank 2: model.w"], ref=None,
                              pre=[])
    assert missing["mismatched_shards"] == ["rank 0: optim.state.w.step (not in the checkpoint)",
                                            "rank 1: optim.state.w.step (not in the checkpoint)",
                                            "rank 2: model.w"]

    dcp = sharded_verdict("resharded", [rank((0, 5)), rank((5, 5), dcp_differs=True)], saved, [],
                          ref=None, pre=[])
    assert (dcp["shards_equal_saved"], dcp["shards_equal_dcp"], dcp["verdict"]) == \
        (True, False, "MISMATCH")

    # Same size: the resumed losses after update 2 plus the preempted run's up to it must be the
    # reference's, and each rank's final shards the reference rank's.
    pre = [{"losses": {"1": "0x1.8p+0", "2": "0x1.4p+0", "3": "0x1p+1"}}] * 2
    ref = [{"losses": {"1": "0x1.8p+0", "2": "0x1.4p+0", "3": "0x1p+0"}, "digest": "d"}] * 2
    same = sharded_verdict("same_size", good, saved, [], ref=ref, pre=pre)
    assert (same["losses_identical"], same["shards_identical"], same["verdict"]) == \
        (True, True, "bitwise identical")
    drift = sharded_verdict("same_size", [rank((0, 5), losses={"3": "0x1.0000000000001p+0"}),
                                          rank((5, 5), losses={"3": "0x1.0000000000001p+0"})],
                            saved, [], ref=ref, pre=pre)
    assert (drift["losses_identical"], drift["verdict"]) == (False, "MISMATCH")
    other = sharded_verdict("same_size", [rank((0, 5)), rank((5, 5), digest="e")], saved, [],
                            ref=ref, pre=pre)
    assert (other["losses_identical"], other["shards_identical"], other["verdict"]) == \
        (True, False, "MISMATCH")


def test_tier_resharded_verdict_fails_each_broken_promise():
    from xla_ckpt.demo.phase import PhaseResult
    from xla_ckpt.demo.report import tier_resharded_verdict

    row = {"restore": "tier_resharded", "workers": 2, "saved_workers": 4,
           "resumed_at_update": 7, "shards_equal_saved": True, "shards_equal_dcp": True,
           "bitwise_identical": True, "verdict": "bitwise identical"}

    def run(*, tier=("local", "local"), durable=(0, 0), peer=(0, 0), fallbacks=((), ()),
            name="checkpoint_1_7"):
        reports = [{"restore": {
            "checkpoint": f"gs://b/run/{name}", "checkpoint_name": name, "num_updates": 7,
            "tier": {"tier": tier[r], "host": r, "local_bytes": 1000 + r,
                     "durable_bytes": durable[r], "peer_bytes": peer[r],
                     "fallbacks": list(fallbacks[r]), "decide_s": 0.25, "read_s": 0.5,
                     "total_s": 1.0}}, "losses": {}} for r in range(2)]
        return PhaseResult("reshard", reports, [0, 0], 9.0, started_unix=100.0)

    def judge(res, gcs_data=(0, 0), served=True, **kw):
        counts = {"served_bytes_per_host": [3000 + gcs_data[0], gcs_data[1]],
                  "served_bytes_other": 0, "served_data_bytes_per_host": list(gcs_data)}
        return tier_resharded_verdict(dict(row, **kw), res, hosts=2,
                                      served=counts if served else None,
                                      checkpoint_name="checkpoint_1_7", preempted_at=7)

    ok = judge(run(peer=(0, 24)))
    assert ok["bitwise_identical"] and ok["failed_checks"] == [], ok["checks"]
    assert ok["verdict"] == "bitwise identical" and ok["restored"] == "checkpoint_1_7"
    assert ok["tiers_per_rank"] == ["local", "local"] and ok["gcs_counted_by"] == "proxy"
    assert ok["bytes_by_tier"] == {"local_bytes": 2001, "peer_bytes": 24, "durable_bytes": 0}
    h0, h1 = ok["hosts"]
    # Per host: its ranks, the bytes by tier, what GCS served (the decision's metadata allowed).
    assert (h0["ranks"], h0["restored"], h0["local_bytes"], h0["gcs_metadata_bytes"]) == \
        ([0], "checkpoint_1_7", 1000, 3000)
    assert (h1["ranks"], h1["local_bytes"], h1["peer_bytes"], h1["gcs_bytes"]) == ([1], 1001,
                                                                                  24, 0)
    assert judge(run(tier=("local", "durable")))["failed_checks"] == [
        "tier_local_on_every_rank"]
    assert judge(run(durable=(0, 4096)), gcs_data=(0, 4096))["failed_checks"] == [
        "no_durable_bytes", "no_gcs_data_bytes"]
    assert judge(run(), gcs_data=(8, 0))["failed_checks"] == ["no_gcs_data_bytes"]
    # Without a proxy the library's durable_bytes stand in for GCS's count.
    assert judge(run(durable=(4096, 0)), served=False)["failed_checks"] == [
        "no_durable_bytes", "no_gcs_data_bytes"]
    assert judge(run(fallbacks=((), ("crc32c mismatch",))))["failed_checks"] == ["no_fallback"]
    assert judge(run(name="checkpoint_1_4"))["failed_checks"] == ["resumed_at_preempted_update"]
    assert judge(run(), resumed_at_update=4)["failed_checks"] == ["resumed_at_preempted_update"]
    assert judge(run(), shards_equal_dcp=False)["failed_checks"] == ["shards_equal_dcp"]
    assert judge(run(), shards_equal_saved=False)["failed_checks"] == ["shards_equal_saved"]
    one = run()
    one.reports[1]["restore"]["tier"]["host"] = 0  # both ranks on host 0: host 1 took no part
    assert judge(one)["failed_checks"] == ["every_host_restored"]


def test_demo_legs_option():
    import argparse

    from xla_ckpt.cli.demo import _legs
    from xla_ckpt.demo.run import LEGS

    assert LEGS == ("ddp", "fsdp", "local")
    assert _legs("ddp,fsdp") == ["ddp", "fsdp"] and _legs(" local ") == ["local"]
    for bad in ("", ",", "ddp,zero3"):
        with pytest.raises(argparse.ArgumentTypeError) as e:
            _legs(bad)
        assert str(e.value) == ("expected a comma-separated subset of ddp,fsdp,local, got "
                                f"{bad!r}")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_demo_tiny_local_leg_restores_a_crash_from_host_memory(replicated_demo):
    """The local leg of the shared `--legs ddp,local` run: SIGKILL, a relaunch from every
    host's local folder with no checkpoint byte from GCS, then a flipped byte whose tensor
    alone comes from GCS, then a replaced host whose part comes from its peer's replica, again
    with no byte from GCS."""
    proc, report = replicated_demo
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["verdict"].startswith(VERDICT)
    loc = report["local"]
    assert (loc["hosts"], loc["local_interval_updates"], loc["save_interval_updates"]) == (2, 1, 4)
    assert not os.path.exists(loc["local_dir"].rsplit("/", 1)[0])  # removed at the end
    crash, flipped, replaced = loc["restores"]
    # Killed mid-epoch after update 5's local commit: restored from host memory, newer than GCS.
    assert crash["restored"] == crash["newest_local"] == "checkpoint_1_5"
    assert crash["newest_durable"] == "checkpoint_1_4" and crash["stopped_at_update"] == 8
    for h in crash["hosts"]:
        assert (h["tier"], h["gcs_data_bytes"], h["durable_bytes"], h["fallbacks"]) == \
            ("local", 0, 0, [])
        assert h["local_bytes"] > 0
        t = h["times"]
        assert 0 <= t["process_start_s"] <= t["dist_init_s"] <= t["restore_start_s"] \
            <= t["restore_end_s"] <= t["first_step_s"]
        assert 0 < t["decide_s"] + t["read_s"] <= t["restore_s"]
    # Only rank 0's decision reads GCS: the listing, pointers, lease and manifest.
    assert crash["hosts"][1]["gcs_bytes"] == 0 and crash["hosts"][0]["gcs_metadata_bytes"] > 0
    # The byte flipped in host 1's copy of checkpoint_1_8: that tensor's chunk from GCS.
    f = flipped["flipped"]
    assert (f["host"], f["checkpoint"], flipped["restored"]) == (1, "checkpoint_1_8",
                                                                "checkpoint_1_8")
    h0, h1 = flipped["hosts"]
    assert h0["fallbacks"] == [] and h0["gcs_data_bytes"] == 0
    assert len(h1["fallbacks"]) == 1 and f"(tensor {f['tensor']});" in h1["fallbacks"][0]
    assert h1["gcs_data_bytes"] == h1["durable_bytes"] == f["chunk"][1] - f["chunk"][0]
    # Host 1's tier deleted after the run ended at update 10: its part from host 0's replica.
    assert replaced["replaced_host"] == 1 and replaced["restored"] == "checkpoint_1_10"
    h0, h1 = replaced["hosts"]
    assert (h0["healed_from"], h0["peer_bytes"], h1["healed_from"]) == (None, 0, 0)
    # Host 1 read every box from host 0's tier (its own part is gone), host 0 its own memory.
    assert h1["peer_bytes"] > 0 and h1["local_bytes"] == 0 and h0["local_bytes"] > 0
    for h in (h0, h1):
        assert (h["tier"], h["gcs_data_bytes"], h["durable_bytes"], h["fallbacks"]) == \
            ("local", 0, 0, [])
    for r in (crash, flipped, replaced):
        assert all(r["checks"].values()) and r["failed_checks"] == []


def _local_run(*, tier=("local", "local"), restored="checkpoint_1_6", losses=None, digest="d8",
               fallbacks=((), ())):
    from xla_ckpt.demo.phase import PhaseResult

    start = int(restored.rsplit("_", 1)[1])
    if losses is None:  # the reference's, of the updates trained (to 8)
        losses = {u: v for u, v in {"7": "0x1p+0", "8": "0x1p-1"}.items() if int(u) > start}
    reports = []
    for rank in range(4):
        h = rank // 2
        reports.append({
            "restore": {"checkpoint": restored, "num_updates": start,
                        "tier": {"tier": tier[h], "host": h, "local_bytes": 100,
                                 "durable_bytes": 0, "decide_s": 0.5, "read_s": 1.0,
                                 "total_s": 1.75,
                                 "fallbacks": list(fallbacks[h]) if rank % 2 == 0 else []}},
            "timeline": {"process_start": 100.01, "dist_init": 105.0 + rank,
                         "restore_start": 110.0, "restore_end": 112.0,
                         "count_wait_s": 0.5 if rank == 0 else 0.0, "first_step": 114.0},
            "losses": losses, "num_updates": 8,
            "digest": digest})
    return PhaseResult("resume", reports, [0] * 4, 20.0, started_unix=100.0)


def test_local_verdict_fails_each_broken_promise():
    from xla_ckpt.demo.phase import PhaseResult
    from xla_ckpt.demo.report import local_verdict

    ref = PhaseResult("reference", [{"losses": {"6": "0x1p+1", "7": "0x1p+0", "8": "0x1p-1"},
                                     "num_updates": 12, "digest": "d12",
                                     "digests": {"4": "d4", "8": "d8"}}] * 4, [0] * 4, 30.0)

    def judge(res, kind="crash", gcs=(0, 0), expect="checkpoint_1_6", durable=4, flipped=None,
              replaced=None):
        served = {"served_bytes_per_host": [50_000 + gcs[0], gcs[1]], "served_bytes_other": 0,
                  "served_data_bytes_per_host": list(gcs)}
        return local_verdict(kind, res, ref, served=served, hosts=2, expect=expect,
                             expect_updates=int(expect.rsplit("_", 1)[1]),
                             newest_durable=f"checkpoint_1_{durable}",
                             newest_durable_updates=durable, flipped=flipped,
                             replaced=replaced)

    ok = judge(_local_run())
    assert ok["bitwise_identical"] and ok["failed_checks"] == [], ok["checks"]
    h0, h1 = ok["hosts"]
    assert (h0["ranks"], h0["local_bytes"], h0["gcs_metadata_bytes"]) == ([0, 1], 200, 50_000)
    # Seconds from the relaunch, the host's slowest rank; rank 0's wait for the count is out.
    assert (h1["times"]["dist_init_s"], h1["times"]["first_step_s"]) == (8.0, 13.5)
    assert (h1["times"]["decide_s"], h1["times"]["restore_s"]) == (0.5, 1.75)
    assert judge(_local_run(tier=("local", "durable")))["failed_checks"] == [
        "tier_local_on_every_host"]
    assert judge(_local_run(), gcs=(0, 4096))["failed_checks"] == ["no_gcs_data_bytes"]
    assert judge(_local_run(restored="checkpoint_1_5"),  # not the newest local step
                 expect="checkpoint_1_6")["failed_checks"][0] == "restored_newest_local"
    assert judge(_local_run(restored="checkpoint_1_4"), expect="checkpoint_1_4")[
        "failed_checks"][0] == "restored_newest_local"  # not newer than the durable step
    assert judge(_local_run(losses={"7": "0x1p+0", "8": "0x1p-2"}))["failed_checks"] == [
        "losses_identical"]
    assert judge(_local_run(digest="d9"))["failed_checks"] == ["params_identical"]
    # A replaced host: its part must have come from another host's replica, and only its.
    healed = _local_run()
    for rank in (2, 3):
        healed.reports[rank]["restore"]["tier"].update(healed_from=0, peer_bytes=512 * rank)
    assert judge(healed, "replaced", replaced=1)["failed_checks"] == []
    assert judge(_local_run(), "replaced", replaced=1)["failed_checks"] == [
        "healed_from_a_replica"]  # read from its own tier: it was not replaced after all
    assert judge(healed, "replaced", replaced=0)["failed_checks"] == ["healed_from_a_replica"]

    t = "state['model']['w']"
    msg = ("crc32c mismatch in local file /x/data-1-state.safetensors bytes [0, 4) (tensor "
           "{}); those bytes come from the durable tier")
    flip = {"host": 1, "tensor": t}

    def flipped(fallbacks, gcs=(0, 4096)):
        return judge(_local_run(restored="checkpoint_1_8", fallbacks=fallbacks), "flipped",
                     gcs=gcs, expect="checkpoint_1_8", durable=8, flipped=flip)["failed_checks"]
    assert flipped(((), (msg.format(t),))) == []
    assert flipped(((), (msg.format("state['model']['v']"),))) == ["fallback_names_the_tensor"]
    assert flipped(((msg.format(t),), (msg.format(t),))) == ["fallback_names_the_tensor"]
    assert flipped(((), (msg.format(t),)), gcs=(0, 0)) == ["gcs_data_bytes_only_for_it"]
    assert flipped(((), (msg.format(t),)), gcs=(8, 4096)) == ["gcs_data_bytes_only_for_it"]


def test_flip_one_byte_damages_one_chunk_of_the_biggest_tensor(tmp_path):
    import torch

    import xla_ckpt
    from xla_ckpt.demo.local_leg import flip_one_byte
    from xla_ckpt.errors import XlaCkptError
    from xla_ckpt.io.writer import write_checkpoint

    folder = tmp_path / "host-1" / "run-0123" / "checkpoint_1_8"
    big = torch.arange(3 * 2**20, dtype=torch.float32)  # 12 MiB: whole 4 MiB chunks of its own
    write_checkpoint({"model": {"w": big, "b": torch.ones(3)}}, str(folder))
    own = {p.name: p.stat().st_size for p in folder.iterdir() if p.name.startswith("data-")}
    # Host 1's marker lists its own files (only those are damaged, never a replica's).
    (folder / "host-1.commit.json").write_text(json.dumps({"files": own}))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    where = flip_one_byte(str(tmp_path), 1, "checkpoint_1_8")
    after = {p.name: p.read_bytes() for p in folder.iterdir()}
    diff = [(n, i) for n in before for i in range(len(before[n]))
            if n.endswith(".safetensors") and before[n][i] != after[n][i]]
    assert diff == [(where["file"], where["file_offset"])]
    assert where["tensor"] == "state['model']['w']"
    lo, hi = where["chunk"]
    assert lo < where["file_offset"] < hi and hi - lo == 4 * 2**20
    with pytest.raises(XlaCkptError, match=r"state\['model'\]\['w'\]"):
        xla_ckpt.load(str(folder))


def test_a_phase_whose_rendezvous_port_was_taken_starts_again(tmp_path):
    """The rendezvous port is picked below the ephemeral range (where outgoing connections
    cannot take it), and a phase whose rank 0 could not listen on it before any update is
    recognised (run_phase then starts it again on another port)."""
    from xla_ckpt.demo.phase import _free_port, _port_taken

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    port = _free_port()
    assert 20000 <= port < low if low > 20000 else port > 0
    out = str(tmp_path)
    with open(os.path.join(out, "log0.txt"), "w") as f:
        f.write("torch.distributed.DistNetworkError: The server socket has failed to listen on "
                "any local network address. port: 53071, useIpv6: false, code: -98, name: "
                "EADDRINUSE, message: address already in use\n")
    assert _port_taken(out, [1, -9, -9, -9])
    assert not _port_taken(out, [0, 1])  # rank 0 did not fail there
    with open(os.path.join(out, "progress0"), "w") as f:
        f.write("3")
    assert not _port_taken(out, [1, -9])  # updates ran: never started again
    os.unlink(os.path.join(out, "progress0"))
    with open(os.path.join(out, "log0.txt"), "w") as f:
        f.write("RuntimeError: something else\n")
    assert not _port_taken(out, [1, -9])
