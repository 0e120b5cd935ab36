"""The opt-in XLA data plane of XlaDist: the plane choice, bucket plans, and what runs here.

XLA collectives do not complete across CPU processes (each ``PJRT_DEVICE=CPU`` process is an
XLA world of one), so the multi-rank exchange cannot run here.  What is tested:

* the choice of plane and its logged reason (pure function, and in a real XlaDist);
* the all-gather round plan and the pack / gather / unpack loop, with 3 ranks emulated
  by threads whose "collective" concatenates their buffers (a fake only for the one thing
  a single process cannot do: reach other XLA replicas);
* the real XLA ops on one XLA CPU device (world size 1): ``xm.all_gather`` and
  ``xm.collective_broadcast`` (its all-reduce forced with ``XLA_ALWAYS_ALLREDUCE=1``) return
  the bytes bit for bit, in a real XlaDist in a launcher worker.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from xla_ckpt.comm.buckets import byte_view
from xla_ckpt.comm.xla_dist import (
    DATA_PLANE_ENV,
    AllGatherPlan,
    GatherPiece,
    choose_data_plane,
    padded_broadcast_bytes,
    plan_all_gather,
    run_all_gather,
)
from xla_ckpt.errors import ConfigError
from xla_ckpt.testing.launcher import launch

MiB = 1024 * 1024


# ---- the choice of plane ----------------------------------------------------------------
def test_xla_plane_only_when_requested_and_the_xla_world_spans_the_job() -> None:
    assert choose_data_plane("xla", 8, {}) == (
        "xla", ("XLA tensor collectives (data_plane='xla'; torch_xla.runtime world size 8; "
                "xm.collective_broadcast / xm.all_gather, unverified on TPU)"))
    assert choose_data_plane(None, 8, {DATA_PLANE_ENV: "1"})[0] == "xla"
    assert choose_data_plane(None, 8, {DATA_PLANE_ENV: " XLA "})[0] == "xla"
    assert choose_data_plane("xla", 1, {}) == (
        "gloo", ("host buffers over gloo: the XLA data plane was requested (data_plane='xla') "
                 "but torch_xla.runtime reports world size 1 (CPU emulation or one device), so "
                 "XLA collectives cannot reach the other processes"))
    assert choose_data_plane(None, 1, {DATA_PLANE_ENV: "true"})[1].startswith(
        f"host buffers over gloo: the XLA data plane was requested ({DATA_PLANE_ENV}=true) but ")
    assert choose_data_plane(None, 8, {}) == (
        "gloo", (f"host buffers over gloo (the XLA data plane is opt-in: XlaDist(data_plane="
                 f"'xla') or {DATA_PLANE_ENV}=1)"))
    assert choose_data_plane(None, 8, {DATA_PLANE_ENV: "0"})[0] == "gloo"
    assert choose_data_plane("gloo", 8, {DATA_PLANE_ENV: "1"}) == (
        "gloo", "host buffers over gloo (data_plane='gloo')")  # the argument wins


def test_bad_plane_values_name_the_setting() -> None:
    with pytest.raises(ConfigError) as ei:
        choose_data_plane("nccl", 8, {})
    assert str(ei.value) == ("XlaDist data_plane must be one of gloo, xla or None (read "
                             f"{DATA_PLANE_ENV}), got 'nccl'")
    with pytest.raises(ConfigError) as ei:
        choose_data_plane(None, 8, {DATA_PLANE_ENV: "maybe"})
    assert str(ei.value) == (f"environment variable {DATA_PLANE_ENV}='maybe' must be 1/true/xla "
                             "(XLA tensor collectives) or 0/false/gloo (host buffers over gloo)")


# ---- plans ------------------------------------------------------------------------------
def test_broadcast_buckets_pad_to_few_sizes() -> None:
    got = [padded_broadcast_bytes(n) for n in (0, 1, 4, 5, 1000, MiB, MiB + 1, 32 * MiB,
                                               32 * MiB - 3)]
    assert got == [4, 4, 4, 8, 1024, MiB, 2 * MiB, 32 * MiB, 32 * MiB]
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        padded_broadcast_bytes(-1)


def test_all_gather_plan_cuts_every_stream_into_equal_slots() -> None:
    plan = plan_all_gather([[10, 0, 7], [3], []], bucket_size_bytes=24)
    assert (plan.slot_bytes, plan.rounds, plan.wire_bytes) == (8, 3, 72)
    P = GatherPiece
    assert plan.pieces == (
        ((P(0, 0, 8, 0),), (P(0, 8, 2, 0), P(2, 0, 6, 2)), (P(2, 6, 1, 0),)),
        ((P(0, 0, 3, 0),), (), ()),
        ((), (), ()),
    )
    assert plan_all_gather([[5], [5], [5]], bucket_size_bytes=1).slot_bytes == 4  # one word
    assert plan_all_gather([[], []], 1024) == AllGatherPlan(512, 0, ((), ()))
    with pytest.raises(ValueError, match="bucket_size_bytes must be >= 1"):
        plan_all_gather([[1]], 0)
    with pytest.raises(ValueError, match="rank 1's tensor 0 has negative size -2"):
        plan_all_gather([[1], [-2]], 64)


def test_rounds_move_every_rank_s_bytes_to_every_other_rank() -> None:
    """3 ranks as threads; uneven, empty and odd-sized tensors; many small rounds."""
    world = 3
    gen = torch.Generator().manual_seed(13)
    shapes: list[list[tuple[int, ...]]] = [[(7,), (0,), (5, 3)], [(33,)], []]  # rank 2: none
    dtypes = [torch.float32, torch.int16, torch.uint8]
    data = [[torch.randint(0, 255, s, generator=gen, dtype=torch.uint8).to(dt)
             for s, dt in zip(shp, dtypes, strict=False)] for shp in shapes]
    slots: list[torch.Tensor | None] = [None] * world
    barrier = threading.Barrier(world, timeout=30)
    results: dict[int, tuple[int, list[list[torch.Tensor]]]] = {}

    def rank_main(me: int) -> None:
        parts = [[t.clone() if r == me else torch.full_like(t, 0) for t in ts]
                 for r, ts in enumerate(data)]
        views = [[byte_view(t) for t in ts] for ts in parts]
        plan = plan_all_gather([[v.numel() for v in vs] for vs in views], bucket_size_bytes=40)
        assert plan.rounds > 3

        def gather(k: int, rounds: int, send: torch.Tensor) -> torch.Tensor:
            slots[me] = send.clone()
            barrier.wait()
            got = torch.cat([s for s in slots if s is not None])
            barrier.wait()  # nobody overwrites its slot before every rank read the round
            return got

        results[me] = (run_all_gather(plan, views, me, gather), parts)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    sizes = [sum(t.numel() * t.element_size() for t in ts) for ts in data]
    for me in range(world):
        received, parts = results[me]
        assert received == sum(sizes) - sizes[me]
        for r in range(world):
            for got, want in zip(parts[r], data[r], strict=True):
                assert got.dtype == want.dtype and torch.equal(got, want)


# ---- the real XLA ops in one process (a launcher worker with its own XLA CPU device) ------
def xla_plane_worker() -> dict:
    import os

    from xla_ckpt.comm.xla_dist import XlaDist

    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Collect()
    log = logging.getLogger("xla_ckpt.comm.xla_dist")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    d = XlaDist(data_plane="xla", timeout_s=60)
    out: dict = {"plane": d.data_plane, "reason": d.data_plane_reason, "backend": d.backend,
                 "logged": [m for m in records if "data plane" in m]}
    # Force the XLA plane to run its real ops on this one device (world size 1).
    d.data_plane = "xla"
    gen = torch.Generator().manual_seed(7)
    payload = torch.randint(0, 256, (4 * 1000,), generator=gen, dtype=torch.uint8)
    out["gather_round"] = torch.equal(d._xla_gather_round(0, 1, payload.clone()), payload)
    os.environ["XLA_ALWAYS_ALLREDUCE"] = "1"  # collective_broadcast's all-reduce runs at world 1
    try:
        got = d._xla_broadcast_bytes(payload.clone(), 0, "test broadcast")
        out["broadcast_root"] = torch.equal(got, payload)
        # not the root: collective_broadcast multiplied this rank's words by 0 first
        zeros = d._xla_broadcast_bytes(payload.clone(), 1, "test broadcast")
        out["broadcast_not_root"] = bool((zeros == 0).all()) and zeros.numel() == 4000
        t = payload[:999].clone()
        d._data_broadcast(t, 0)  # the bucket path: padded to 1000 -> 1024 bytes and back
        out["bucket_kept"] = torch.equal(t, payload[:999])
    finally:
        del os.environ["XLA_ALWAYS_ALLREDUCE"]
    mine = [payload[:10].clone().view(torch.int16), torch.empty(0), payload[10:17].clone()]
    out["all_gather_received"] = d.all_gather_tensors([mine], bucket_size_bytes=8)
    out["all_gather_kept"] = (torch.equal(mine[0].view(torch.uint8), payload[:10])
                              and torch.equal(mine[2], payload[10:17]))
    out["backend_forced"] = d.backend
    os.environ[DATA_PLANE_ENV] = "1"
    try:
        e = XlaDist(timeout_s=60)
        out["env_reason"] = e.data_plane_reason
    finally:
        del os.environ[DATA_PLANE_ENV]
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_real_xla_ops_round_trip_on_one_xla_cpu_device() -> None:
    (res,) = launch(xla_plane_worker, 1, timeout_s=180)
    out = res.unwrap()
    assert out["plane"] == "gloo" and out["backend"] == "gloo"
    assert out["reason"] == choose_data_plane("xla", 1, {})[1]
    assert out["logged"] == [f"rank 0: data plane: {out['reason']}"]
    assert out["gather_round"] and out["broadcast_root"] and out["bucket_kept"]
    assert out["broadcast_not_root"]
    assert out["all_gather_received"] == 0 and out["all_gather_kept"]
    assert out["backend_forced"] == "xla"
    assert out["env_reason"] == choose_data_plane(None, 1, {DATA_PLANE_ENV: "1"})[1]
