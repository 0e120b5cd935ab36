"""Functions the dist tests run on every rank of a launcher pool (module level: importable)."""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from xla_ckpt.comm import DistConfig, TorchDist, get_dist
from xla_ckpt.testing.asserts import tensor_bits


def _dist(kind: str, timeout_s: float = 60.0):
    cfg = DistConfig(backend=kind,  # type: ignore[arg-type]  # a test's str: checked at run time
                     timeout_s=timeout_s)
    return get_dist(cfg)


def topology(kind: str) -> dict:
    d = _dist(kind)
    t = d.topology
    return {"rank": t.rank, "world_size": t.world_size, "local_rank": t.local_rank,
            "local_world_size": t.local_world_size, "host_id": t.host_id, "kind": d.kind,
            "device": str(d.device), "data_device": str(d.data_device), "backend": d.backend}


def exchange_objects(kind: str) -> dict:
    d = _dist(kind)
    mine = {"rank": d.rank, "tuple": (d.rank, 2.0, None), "int_vs_float": [1, 1.0],
            "ns": argparse.Namespace(lr=0.1 * d.rank), "np": np.int64(d.rank),
            "bytes": bytes([d.rank]) * 3, "nan": float("nan")}
    every = d.exchange(mine)
    src2 = d.broadcast_object({"from": d.rank, "set": {1, 2}} if d.rank == 2 else None, src=2)
    raw = d.broadcast_bytes(b"\x00manifest\xff" if d.rank == 1 else None, src=1)
    return {"every": every, "src2": src2, "raw": raw}


def make_tensors(rank: int, src: int) -> list[torch.Tensor]:
    """The same shapes on every rank; data only on ``src``."""
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(300, generator=g), torch.randint(0, 2, (17,), generator=g).bool(),
          torch.randn(5, 7, generator=g).to(torch.bfloat16), torch.empty(0, 4),
          torch.tensor(7, dtype=torch.int64), torch.randn(5_000, generator=g).double(),
          torch.randint(-100, 100, (3, 3), generator=g, dtype=torch.int8)]
    return ts if rank == src else [torch.zeros_like(t) for t in ts]


def broadcast_tensors(kind: str, src: int, bucket_size_bytes: int) -> list[bytes]:
    d = _dist(kind)
    ts = make_tensors(d.rank, src)
    ptrs = [t.data_ptr() for t in ts]
    moved = d.broadcast_tensors(ts, src=src, bucket_size_bytes=bucket_size_bytes)
    assert [t.data_ptr() for t in ts] == ptrs  # filled in place, not replaced
    assert moved == sum(t.numel() * t.element_size() for t in ts)
    return [tensor_bits(t).numpy().tobytes() for t in ts]


def broadcast_mismatch(kind: str) -> None:
    d = _dist(kind)
    n = 10 if d.rank != 3 else 11
    d.broadcast_tensors([torch.zeros(n)], src=0)


def scatter(kind: str, bucket_size_bytes: int) -> list[list]:
    d = _dist(kind)
    outs = [torch.zeros(d.rank + 1), torch.zeros(2_000 * d.rank, dtype=torch.int16)]
    inputs = None
    if d.rank == 0:
        inputs = {r: [torch.arange(r + 1, dtype=torch.float32) + 10 * r,
                      torch.full((2_000 * r,), r, dtype=torch.int16)] for r in range(d.world_size)}
    d.scatter_tensors(outs, inputs, src=0, bucket_size_bytes=bucket_size_bytes)
    return [outs[0].tolist(), outs[1].unique().tolist(), outs[1].numel()]


def run_collectively_failing(kind: str, failing: list[int]) -> str:
    d = _dist(kind)

    def step():
        if d.rank in failing:
            raise FileNotFoundError(f"gs://b/ckpt/data-1.safetensors seen from rank {d.rank}")
        return "ok"

    return d.run_collectively(step, "reading the shard")


def run_collectively_ok(kind: str) -> int:
    d = _dist(kind)
    d.barrier(30)
    return d.run_collectively(lambda: d.rank * 2, "doubling")


def subgroup(ranks: list[int]) -> dict | None:
    d = TorchDist.new_subgroup(ranks, timeout_s=30)
    if d is None:
        return None
    every = d.exchange(os.environ["RANK"])
    t = torch.tensor([float(d.rank)]) if d.rank == 0 else torch.zeros(1)
    t[0] += 41 if d.rank == 0 else 0
    d.broadcast_tensors([t], src=0)
    return {"rank": d.rank, "world": d.world_size, "every": every, "t": t.item()}


# ---- for the launcher tests (no torch.distributed needed) ----------------------------------

def env_and_rank(name: str) -> tuple:
    return os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ.get(name), \
        os.environ["MASTER_ADDR"], os.environ["PJRT_DEVICE"]


def raise_on(rank: int) -> int:
    from xla_ckpt.errors import DistributedError

    if int(os.environ["RANK"]) == rank:
        raise DistributedError("restore failed", {rank: "IntegrityError: bad bytes"})
    return int(os.environ["RANK"])


def sleep_on(rank: int, seconds: float) -> int:
    if int(os.environ["RANK"]) == rank:
        time.sleep(seconds)
    return int(os.environ["RANK"])


def late_barrier(late_rank: int, delay_s: float, timeout_s: float) -> str:
    d = get_dist(DistConfig(backend="gloo", timeout_s=timeout_s))
    if d.rank == late_rank:
        time.sleep(delay_s)
    d.barrier(timeout_s)
    return "passed"


def exchange_with_dead_peer(dead_rank: int, timeout_s: float) -> str:
    from xla_ckpt.testing.launcher import kill_self

    d = get_dist(DistConfig(backend="gloo", timeout_s=timeout_s))
    d.exchange("hello")  # everyone is connected
    if d.rank == dead_rank:
        kill_self()
    d.exchange("second")
    return "passed"


def all_gather_tensors(kind: str, bucket_size_bytes: int, rounds: bool = False) -> dict:
    """Every rank's uneven parts (one rank has none, some tensors empty) reach every rank."""
    d = _dist(kind)

    def part(r: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(100 + r)
        if r == 1:
            return []
        return [torch.randn(37 * (r + 1), generator=g), torch.empty(0),
                torch.randint(0, 255, (1000 + r,), dtype=torch.uint8, generator=g),
                torch.randn(3, 5, generator=g).double()]

    parts = [part(r) if r == d.rank else [torch.zeros_like(t) for t in part(r)]
             for r in range(d.world_size)]
    gather = d.all_gather_rounds if rounds else d.all_gather_tensors
    got = gather(parts, bucket_size_bytes=bucket_size_bytes)
    same = all(torch.equal(a, b) for r in range(d.world_size)
               for a, b in zip(parts[r], part(r), strict=True))
    expected = sum(t.numel() * t.element_size() for r in range(d.world_size) if r != d.rank
                   for t in part(r))
    return {"same": same, "received": got, "expected": expected}
