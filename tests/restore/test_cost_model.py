"""The restore cost model (xla_ckpt.restore.cost): which plan ``auto`` picks, and why.

Pure arithmetic: no I/O, no timing.  Each case gives a topology and asserts the plan, the
excluded plans and the predicted storage bytes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest

from xla_ckpt.config.loading import config_from_dict
from xla_ckpt.errors import ConfigError
from xla_ckpt.restore.cost import (
    ALL_RANKS,
    BROADCAST,
    PER_HOST,
    PLANS,
    STRIPED,
    Bandwidths,
    RestoreSizes,
    RestoreTopology,
    choose_plan,
    estimate,
    needs_data_plane,
    predict,
)

MiB = 1024 * 1024
GiB = 1024 * MiB
EVERY = set(PLANS)

# The emulation of benchmarks/striped_restore.py: 64 MiB/s per host link, 32 MiB/s per stream,
# 30 ms first byte, loopback gloo as the data plane.
EMULATED = Bandwidths(storage_stream_bytes_per_s=32 * MiB, storage_host_bytes_per_s=64 * MiB,
                      first_byte_latency_s=0.03, data_plane_cross_host_bytes_per_s=1 * GiB,
                      data_plane_intra_host_bytes_per_s=4 * GiB)


def _choose(topology: RestoreTopology, size: int, bw: Bandwidths | None = None, *,
            backend: str, allow: bool = False, runnable: set[str] = EVERY) -> Any:
    return choose_plan(topology, RestoreSizes(state_bytes=size), bw or Bandwidths(),
                       runnable=runnable, allow_xla_data_plane=allow, backend_kind=backend)


@pytest.mark.parametrize("backend", ["xla", "gloo", "nccl", "single"])
def test_one_process_picks_all_ranks(backend: str) -> None:
    plan, predicted, reason = _choose(RestoreTopology(hosts=1, ranks_per_host=1), 1 * GiB,
                                      backend=backend)
    assert plan == ALL_RANKS
    assert len(set(predicted.values())) == 1  # every plan is the same read on one process
    assert reason.startswith("auto: all_ranks has the lowest predicted time")


def test_tpu_pod_without_xla_data_plane_reads_once_per_host() -> None:
    """v5p-like: 64 hosts x 4 chips, replicated state; no XLA collective allowed."""
    pod = RestoreTopology(hosts=64, ranks_per_host=4)
    choice = _choose(pod, 2 * GiB, backend="xla")
    assert choice.plan == PER_HOST
    assert "broadcast (needs an XLA collective (restore.allow_xla_data_plane is false))" \
        in choice.reason
    assert "striped (needs an XLA collective" in choice.reason
    # Striped would have been faster: the exclusion, not the prediction, decided.
    assert choice.predicted_s[STRIPED] < choice.predicted_s[PER_HOST] \
        < choice.predicted_s[ALL_RANKS]


def test_tpu_pod_with_xla_data_plane_stripes() -> None:
    pod = RestoreTopology(hosts=64, ranks_per_host=4)
    choice = _choose(pod, 2 * GiB, backend="xla", allow=True)
    assert choice.plan == STRIPED
    assert "excluded" not in choice.reason


def test_gpu_cluster_replicated_stripes() -> None:
    choice = _choose(RestoreTopology(hosts=4, ranks_per_host=8), 8 * GiB, backend="nccl")
    assert choice.plan == STRIPED


def test_single_host_stripes_on_xla_without_a_collective() -> None:
    """Within one host stripes travel through host shared memory, so XLA may stripe."""
    host = RestoreTopology(hosts=1, ranks_per_host=4)
    assert not needs_data_plane(STRIPED, host) and needs_data_plane(BROADCAST, host)
    # Stream-bound leader (4 x 32 MiB/s streams, 1 GiB/s link): four readers fill the link.
    bw = Bandwidths(storage_stream_bytes_per_s=32 * MiB, streams_per_reader=4,
                    storage_host_bytes_per_s=1 * GiB)
    assert _choose(host, 1 * GiB, bw, backend="xla").plan == STRIPED


def test_sharded_state_without_replicas_reads_on_every_rank() -> None:
    """Each chunk needed by one rank: nothing to share, every plan but all_ranks adds work."""
    t = RestoreTopology(hosts=4, ranks_per_host=2, replicas=1)
    for backend in ("xla", "gloo"):
        choice = _choose(t, 1 * GiB, EMULATED, backend=backend, allow=True)
        assert choice.plan == ALL_RANKS
        assert choice.predicted_s[STRIPED] == choice.predicted_s[ALL_RANKS]


def test_no_host_shared_memory_falls_back() -> None:
    """per_host and striped need the sealed memfd copy; without it the rest compete."""
    t = RestoreTopology(hosts=4, ranks_per_host=2)
    runnable = {ALL_RANKS, BROADCAST}
    assert _choose(t, 256 * MiB, EMULATED, backend="gloo", runnable=runnable).plan == BROADCAST
    xla = _choose(t, 256 * MiB, EMULATED, backend="xla", runnable=runnable)
    assert xla.plan == ALL_RANKS
    assert "per_host (not runnable here)" in xla.reason
    assert "striped (not runnable here)" in xla.reason


def test_tiny_state_reads_on_every_rank() -> None:
    """A few KiB: one latency wave for everyone, any exchange only adds."""
    choice = _choose(RestoreTopology(hosts=4, ranks_per_host=2), 4096, EMULATED, backend="gloo")
    assert choice.plan == ALL_RANKS


def test_emulated_benchmark_topology() -> None:
    """4 emulated hosts x 2 ranks, 256 MiB replicated (benchmarks/striped_restore.py)."""
    t, sizes = RestoreTopology(hosts=4, ranks_per_host=2), RestoreSizes(state_bytes=256 * MiB)
    est = predict(t, sizes, EMULATED, backend_kind="gloo")
    assert _choose(t, 256 * MiB, EMULATED, backend="gloo").plan == STRIPED
    # (How much faster striped is belongs to benchmarks/, measured, not to a unit test.)
    # Storage bytes per job: striped 1x, per_host 1x per host, all_ranks 1x per rank.
    assert est[STRIPED].storage_bytes == 256 * MiB
    assert est[BROADCAST].storage_bytes == 256 * MiB
    assert est[PER_HOST].storage_bytes == 4 * 256 * MiB
    assert est[PER_HOST].storage_bytes_per_host == 256 * MiB
    assert est[ALL_RANKS].storage_bytes == 8 * 256 * MiB
    assert est[STRIPED].storage_bytes_per_host == 64 * MiB


def test_estimate_arithmetic() -> None:
    """all_ranks on one rank: the fixed term + latency waves + bytes over the binding cap +
    the aggregate term."""
    bw = Bandwidths(storage_stream_bytes_per_s=100.0, streams_per_reader=2,
                    storage_host_bytes_per_s=150.0, storage_total_bytes_per_s=1000.0,
                    first_byte_latency_s=0.5, restore_fixed_s=0.25)
    e = estimate(ALL_RANKS, RestoreTopology(hosts=1, ranks_per_host=1),
                 RestoreSizes(state_bytes=1000, request_bytes=100), bw, backend_kind="gloo")
    # 10 requests on 2 streams = 5 waves; the host cap (150 B/s) binds below 2 x 100 B/s.
    assert e.latency_s == pytest.approx(2.5)
    assert e.read_s == pytest.approx(2.5 + 1000 / 150 + 1000 / 1000)
    assert e.fixed_s == 0.25
    assert e.seconds == pytest.approx(0.25 + 2.5 + 1000 / 150 + 1000 / 1000)
    assert e.exchange_s == 0.0 and e.storage_bytes == 1000


def test_striped_arithmetic_with_every_term() -> None:
    """4 hosts x 2 ranks, 256 units of state, gloo: fixed + read (each rank 1/8, one latency
    wave, the host link, the job's bytes in series) + all-gather across hosts (3/4 of a
    host's bytes over the link, one round per bucket) + the handover of the host's copy."""
    bw = Bandwidths(storage_stream_bytes_per_s=32.0, storage_host_bytes_per_s=64.0,
                    storage_total_bytes_per_s=512.0, first_byte_latency_s=0.03,
                    data_plane_cross_host_bytes_per_s=128.0,
                    data_plane_intra_host_bytes_per_s=1024.0, data_plane_latency_s=0.002,
                    streams_per_reader=32, restore_fixed_s=0.4)
    e = estimate(STRIPED, RestoreTopology(hosts=4, ranks_per_host=2),
                 RestoreSizes(state_bytes=256, request_bytes=8, bucket_bytes=32), bw,
                 backend_kind="gloo")
    read = 0.03 + 64 / 64 + 256 / 512  # 4 requests of 8 per rank: one wave
    exchange = 3 / 4 * 256 / 128 + 8 * 0.002 + (256 / 1024 + 0.002)
    assert e.read_s == pytest.approx(read)
    assert e.exchange_s == pytest.approx(exchange)
    assert e.seconds == pytest.approx(0.4 + read + exchange)
    assert e.storage_bytes == 256 and e.storage_bytes_per_host == 64


def test_fixed_term_adds_to_every_plan_and_never_changes_the_choice() -> None:
    """restore_fixed_s: the same seconds on every plan (decision, agreements, clients, seal)."""
    sizes = RestoreSizes(state_bytes=256 * MiB)
    for t in (RestoreTopology(hosts=4, ranks_per_host=2), RestoreTopology(hosts=1,
                                                                          ranks_per_host=4),
              RestoreTopology(hosts=64, ranks_per_host=4)):
        for backend in ("gloo", "nccl", "xla"):
            base = predict(t, sizes, dataclasses.replace(EMULATED, restore_fixed_s=0.0),
                           backend_kind=backend)
            more = predict(t, sizes, dataclasses.replace(EMULATED, restore_fixed_s=2.0),
                           backend_kind=backend)
            for p in PLANS:
                assert more[p].seconds - base[p].seconds == pytest.approx(2.0)
                assert (more[p].fixed_s, base[p].fixed_s) == (2.0, 0.0)
            picks = [choose_plan(t, sizes, dataclasses.replace(EMULATED, restore_fixed_s=f),
                                 runnable=EVERY, allow_xla_data_plane=True,
                                 backend_kind=backend).plan for f in (0.0, 2.0)]
            assert picks[0] == picks[1]
    assert Bandwidths().restore_fixed_s == 0.5  # the documented default
    with pytest.raises(ConfigError, match=r"restore.cost_model.restore_fixed_s must be a finite "
                                          r"number >= 0 \(seconds\), got -0.1"):
        Bandwidths(restore_fixed_s=-0.1)
    with pytest.raises(ConfigError, match="restore.cost_model.restore_fixed_s"):
        Bandwidths(restore_fixed_s=math.inf)


def test_emulated_benchmark_with_probed_parameters_picks_striped() -> None:
    """The parameters benchmarks/striped_restore.py probes on 4 emulated hosts x 2 ranks (host
    memory mapped at about 1.3 GiB/s with 8 ranks on 2 cores, gloo at about 500 MiB/s, the
    series term, 0.35 s fixed): striped still wins, per_host beats every rank reading."""
    probed = dataclasses.replace(EMULATED, data_plane_intra_host_bytes_per_s=1.3 * GiB,
                                 data_plane_cross_host_bytes_per_s=500 * MiB,
                                 storage_total_bytes_per_s=2 * GiB, restore_fixed_s=0.35,
                                 streams_per_reader=32)
    t = RestoreTopology(hosts=4, ranks_per_host=2)
    choice = _choose(t, 256 * MiB, probed, backend="gloo")
    assert choice.plan == STRIPED
    p = choice.predicted_s
    assert p[STRIPED] < p[PER_HOST] < p[ALL_RANKS] and p[STRIPED] < p[BROADCAST]
    est = predict(t, RestoreSizes(state_bytes=256 * MiB), probed, backend_kind="gloo")
    # every plan but all_ranks hands each rank its host's copy: 256 MiB at 1.3 GiB/s + a round
    for plan in (PER_HOST, BROADCAST, STRIPED):
        handover = 256 * MiB / (1.3 * GiB) + 0.002
        assert est[plan].exchange_s >= handover - 1e-12
    assert est[ALL_RANKS].exchange_s == 0.0


@pytest.mark.parametrize(("backend", "factor"), [("xla", 2 * 3 / 4), ("gloo", 2.0),
                                                 ("nccl", 1.0)])
def test_broadcast_cost_follows_the_backend(backend: str, factor: float) -> None:
    """XLA broadcasts by all-reduce, gloo by a binomial tree, NCCL by a pipelined ring."""
    bw = Bandwidths(data_plane_cross_host_bytes_per_s=1 * GiB, data_plane_latency_s=0.001)
    e = estimate(BROADCAST, RestoreTopology(hosts=4, ranks_per_host=1),
                 RestoreSizes(state_bytes=1 * GiB, bucket_bytes=64 * MiB), bw,
                 backend_kind=backend)
    assert e.exchange_s == pytest.approx(factor + 16 * 0.001)  # 16 buckets, one round each


def test_replicas_of_a_dp_outermost_mesh() -> None:
    t = RestoreTopology(hosts=8, ranks_per_host=4, replicas=2)
    assert (t.holders, t.holder_hosts, t.sharing_ranks_per_host) == (2, 2, 1)
    sizes = RestoreSizes(state_bytes=32 * MiB)
    assert t.rank_bytes(sizes) == 2 * MiB and t.host_bytes(sizes) == 8 * MiB
    replicated = RestoreTopology(hosts=8, ranks_per_host=4)
    assert (replicated.holders, replicated.holder_hosts) == (32, 8)


def test_bad_inputs_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"topology.replicas \(9\) cannot exceed the world size"):
        RestoreTopology(hosts=2, ranks_per_host=4, replicas=9)
    with pytest.raises(ConfigError, match="topology.replica_hosts"):
        RestoreTopology(hosts=2, ranks_per_host=4, replicas=8, replica_hosts=1)
    with pytest.raises(ConfigError, match="topology.hosts must be an integer >= 1"):
        RestoreTopology(hosts=0, ranks_per_host=1)
    with pytest.raises(ConfigError, match="sizes.state_bytes must be an integer >= 0"):
        RestoreSizes(state_bytes=-1)
    with pytest.raises(ConfigError,
                       match=r"restore.cost_model.storage_host_bytes_per_s must be a finite"):
        Bandwidths(storage_host_bytes_per_s=0)
    with pytest.raises(ConfigError, match="restore.cost_model.first_byte_latency_s"):
        Bandwidths(first_byte_latency_s=math.nan)
    one = RestoreTopology(hosts=1, ranks_per_host=1)
    with pytest.raises(ConfigError, match=r"runnable names unknown restore plan\(s\) ring"):
        _choose(one, 1, backend="gloo", runnable={"ring"})
    with pytest.raises(ConfigError, match="backend_kind must be one of"):
        _choose(one, 1, backend="mpi")
    with pytest.raises(ConfigError, match="no restore plan is allowed"):
        _choose(RestoreTopology(hosts=2, ranks_per_host=1), 1, backend="xla",
                runnable={BROADCAST})


def test_config_overrides_the_defaults() -> None:
    bw = config_from_dict({"storage_host_bytes_per_s": 64 * MiB, "streams_per_reader": 4},
                          Bandwidths, where="restore.yaml", prefix="restore.cost_model")
    assert bw.storage_host_bytes_per_s == 64 * MiB and bw.streams_per_reader == 4
    assert bw.first_byte_latency_s == Bandwidths().first_byte_latency_s
    with pytest.raises(ConfigError, match="unknown key 'restore.cost_model.host_mib_s'"):
        config_from_dict({"host_mib_s": 1}, Bandwidths, prefix="restore.cost_model")


def test_scale_model_predicts_orbax_within_30_percent() -> None:
    """benchmarks/scale_model.py: 3 parameters fitted on n=2, 32; n=4, 16 predicted."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "scale_model.py"
    spec = importlib.util.spec_from_file_location("scale_model_under_test", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sizes = RestoreSizes(state_bytes=mod.STATE_BYTES)
    bw = mod.calibrate(sizes)
    rows = {r["n"]: r for r in mod.orbax_rows(bw, sizes)}
    assert rows[2]["every_replica_error"] == pytest.approx(0, abs=1e-3)
    assert rows[32]["every_replica_error"] == pytest.approx(0, abs=1e-3)
    for n in (4, 16):
        assert abs(rows[n]["every_replica_error"]) <= 0.30
        assert abs(rows[n]["broadcast_error"]) <= 0.30
    for r in rows.values():  # ours fetches the state once and beats both of Orbax's methods
        assert r["striped_storage_bytes_x_state"] == 1.0
        assert r["striped_predicted_s"] < min(r["every_replica_measured_s"],
                                              r["broadcast_measured_s"])
