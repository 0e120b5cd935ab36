"""Functions the restore tests run on every rank of a launcher pool (module level: importable)."""

from __future__ import annotations

import os
import re
import time
from typing import Any, Literal

import torch

from xla_ckpt.comm import DistConfig, TorchDist, get_dist
from xla_ckpt.format.crc import crc32c
from xla_ckpt.restore import (
    RestoreConfig,
    make_saver,
    partition_bounds,
    restore,
    save_distributed,
)
from xla_ckpt.testing.asserts import assert_state_identical, tensor_bits
from xla_ckpt.testing.launcher import kill_self

#: The ``backend`` values of :class:`DistConfig` (the tests pass "gloo" or "xla").
Kind = Literal["auto", "single", "gloo", "nccl", "xla"]

# ---- helpers ----------------------------------------------------------------------------


def dist_for(kind: Kind, world: int | None = None, timeout_s: float = 60.0):
    """The Dist of this rank: the whole pool (``world`` None) or a subgroup of ranks 0..world-1."""
    d = get_dist(DistConfig(backend=kind, timeout_s=timeout_s))
    if world is None or world == d.world_size:
        return d
    return TorchDist.new_subgroup(range(world), timeout_s=timeout_s)


def digest(state) -> dict:
    """crc32c of every tensor (CPU bits) and repr of every other leaf, by key path."""
    out: dict = {}

    def walk(x, path):
        if isinstance(x, torch.Tensor):
            out[path] = (str(x.dtype), tuple(x.shape), crc32c(tensor_bits(x)))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}[{k!r}]")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")
        else:
            out[path] = repr(x)

    walk(state, "state")
    return out


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(key + r":\s+(\d+)", f.read())
    assert m is not None, key
    return int(m.group(1)) * 1024


# ---- a tiny training set-up (deterministic) ----------------------------------------------

def build_model(device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4)).to(device)


def build_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.01)


def build_scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))


def make_checkpointer(device, dist, strategy: str):
    from xla_ckpt.trainer import Checkpointer, make_restorer

    return Checkpointer(model=build_model(device), build_optimizer=build_optimizer,
                        build_lr_scheduler=build_scheduler, args={"arch": "mlp", "lr": 1e-2},
                        saver=make_saver(dist=dist),
                        restorer=make_restorer(dist=dist, strategy=strategy, map_location=device),
                        rank=dist.rank)


def train_step(ckpt, step: int, device) -> None:
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(16, 8, generator=g).to(device), torch.randn(16, 4, generator=g).to(device)
    ckpt.optimizer.zero_grad()
    loss = ((ckpt.model(x) - y) ** 2).mean()
    loss.backward()
    ckpt.optimizer.step()
    ckpt.lr_scheduler.step()
    ckpt.set_num_updates(ckpt.get_num_updates() + 1)
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


def trainer_resume(uri: str, kind: Kind, strategy: str) -> dict:
    """Train 2 steps, save (every rank), train 1 more; a fresh Checkpointer restores and trains 1.

    Returns what the parent compares: the state saved, the state restored (by
    ``restore`` directly, CPU tensors) and whether the resumed step equals the
    uninterrupted one bitwise.
    """
    d = dist_for(kind)
    dev = d.device
    ck = make_checkpointer(dev, d, strategy)
    for s in range(2):
        train_step(ck, s, dev)
    extra = {"train_iterator": {"epoch": 1, "iterations_in_epoch": 2, "version": 2},
             "val_loss": 0.25}
    ck.save_checkpoint(uri, extra, rank_extra_state={"rank_rng": torch.get_rng_state(),
                                                     "shard_pos": 100 + d.rank})
    saved = ck.state_dict(extra)
    saved_digest = digest(saved)
    train_step(ck, 2, dev)
    uninterrupted = {k: v.detach().cpu().clone() for k, v in ck.model.state_dict().items()}

    fresh = make_checkpointer(dev, d, strategy)
    extra_state = fresh.load_checkpoint(uri)
    train_step(fresh, 2, dev)
    resumed = {k: v.detach().cpu().clone() for k, v in fresh.model.state_dict().items()}
    assert_state_identical(resumed, uninterrupted)

    direct = restore(uri, dist=d, strategy=strategy)
    other = restore(uri, dist=d, strategy="broadcast" if strategy == "all_ranks" else "all_ranks")
    return {"strategy": direct.strategy, "reason": direct.reason, "saved": saved_digest,
            "restored": digest(direct.state), "restored_other": digest(other.state),
            "other_rank_state": digest(other.rank_state), "rank_state": digest(direct.rank_state),
            "shard_pos": extra_state["shard_pos"], "iterator": extra_state["train_iterator"],
            "num_updates": fresh.get_num_updates(), "device": str(dev),
            "param_device": str(next(fresh.model.parameters()).device),
            "stats": (direct.stats.bytes_read, direct.stats.bytes_received)}


# ---- decide once --------------------------------------------------------------------------

def restore_digest(uri: str, kind: Kind, strategy: str, **kwargs) -> dict:
    d = dist_for(kind)
    r = restore(uri, dist=d, strategy=strategy, **kwargs)
    return {"checkpoint": r.checkpoint, "save_id": r.manifest.save_id, "digest": digest(r.state),
            "rank_state": digest(r.rank_state) if r.rank_state is not None else None,
            "strategy": r.strategy, "metadata": r.metadata}


# ---- C2: each rank's tensors on CPU or on its own device -----------------------------------

def c2_devices(uri: str) -> dict:
    import torch_xla

    d = dist_for("xla")
    own = torch_xla.device()
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    # every rank passes the same state (C16 refuses ranks that disagree); rank 0's is written
    state = {"w": w.to(own)}
    save_distributed(state, uri, dist=d)
    out: dict[str, Any] = {"own": str(own)}
    for strategy in ("all_ranks", "broadcast"):
        cpu = restore(uri, dist=d, strategy=strategy).state["w"]
        dev = restore(uri, dist=d, strategy=strategy, map_location=d.device).state["w"]
        per_key = restore(uri, dist=d, strategy=strategy,
                          map_location=lambda key: own).state["w"]
        out[strategy] = {"cpu": str(cpu.device), "dev": str(dev.device),
                         "dev_is_own": dev.device == own and per_key.device == own,
                         "values": [cpu.tolist(), dev.cpu().tolist(), per_key.cpu().tolist()]}
    return out


# ---- C6: broadcast without receiver input, bounded extra memory ----------------------------

def c6_broadcast(uri: str, bucket_size_bytes: int, host_shared_memory: bool) -> dict:
    d = dist_for("gloo")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark to the current RSS
    base = _status("VmRSS")
    r = restore(uri, dist=d, strategy="broadcast",
                config=RestoreConfig(bucket_size_bytes=bucket_size_bytes,
                                     host_shared_memory=host_shared_memory))
    for t in r.state["t"]:  # fault in every page (a mapped one is resident once read)
        tensor_bits(t)[::4096].sum()
    peak = _status("VmHWM")
    crcs = [crc32c(tensor_bits(t)) for t in r.state["t"]]
    return {"peak_over_base": peak - base, "received": r.stats.bytes_received,
            "mapped": r.stats.bytes_mapped, "read": r.stats.bytes_read, "crcs": crcs,
            "data_path": r.stats.data_path}


# ---- host shared memory: one copy per host -----------------------------------------------

def hs_save(uri: str) -> None:
    """Replicated tensors (aliasing, dtypes, empty), each rank's own item and flat ZeRO shards."""
    d = dist_for("gloo")
    g = torch.Generator().manual_seed(11)
    base = torch.randn(300_000, generator=g)
    state = {"t": [base, base[10:20], torch.randint(0, 9, (1000,), dtype=torch.int8),
                   torch.randn(33, generator=g).to(torch.bfloat16), torch.empty(0, 3),
                   torch.randn(70_000, generator=g).double()],
             "step": 7}
    flat = torch.arange(1000, dtype=torch.float32)
    lo, hi = partition_bounds(1000, d.world_size)[d.rank]
    save_distributed(state, uri, dist=d, rank_state={"pos": 100 + d.rank},
                     shards={"exp_avg": flat[lo:hi]})


def host_share_restore(uri: str, enabled: bool = True, hosts: int = 1, *, poke: bool = False,
                       cannot_open_rank: int | None = None, off_rank: int | None = None,
                       zero_sharding: str = "none") -> dict:
    """Broadcast restore; ``hosts`` > 1 emulates that many hosts (torchrun GROUP_RANK)."""
    from xla_ckpt.comm.host_memory import HostMemoryError
    from xla_ckpt.restore import host_share

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    launcher_value = os.environ["GROUP_RANK"]
    os.environ["GROUP_RANK"] = str(rank * hosts // world)
    try:  # its own Dist (another timeout is another cache key): topology from GROUP_RANK
        d = get_dist(DistConfig(backend="gloo", timeout_s=60.0 + hosts))
    finally:
        os.environ["GROUP_RANK"] = launcher_value
    real_open = host_share.open_segment
    if cannot_open_rank == d.rank:
        def refuse(handle, **_):  # a fault no same-host process produces: another PID namespace
            raise HostMemoryError(f"cannot open /proc/{handle['pid']}/fd/{handle['fd']}: "
                                  "[Errno 13] Permission denied")

        host_share.open_segment = refuse
    try:
        r = restore(uri, dist=d, strategy="broadcast", zero_sharding=zero_sharding,
                    config=RestoreConfig(host_shared_memory=enabled and off_rank != d.rank,
                                         bucket_size_bytes=1 << 20))
    finally:
        host_share.open_segment = real_open
    out = {"digest": digest(r.state), "shards": {k: crc32c(tensor_bits(v))
                                                 for k, v in r.shards.items()},
           "rank_state": digest(r.rank_state) if r.rank_state is not None else None,
           "received": r.stats.bytes_received, "mapped": r.stats.bytes_mapped,
           "read": r.stats.bytes_read, "data_path": r.stats.data_path,
           "host_id": d.topology.host_id}
    if poke:  # copy-on-write: rank 1 changes its tensors in place, the others must not see it
        if d.rank == 1:
            for t in r.state["t"]:
                t.add_(1)
        d.barrier()
        out["after"] = digest(r.state)
    return out


def leader_dies_before_sealing(uri: str, timeout_s: float) -> str:
    """Rank 0 (the host's leader) dies after reading, before sealing its segment."""
    from xla_ckpt.comm.host_memory import Segment

    d = get_dist(DistConfig(backend="gloo", timeout_s=timeout_s))
    if d.rank == 0:
        # A fault through the same interface.
        Segment.seal = lambda self: kill_self()  # type: ignore[method-assign]  # fault injection
    restore(uri, dist=d, strategy="broadcast")
    return "restored"


# ---- C9: flat shards saved by 4 ranks, restored by another world size ---------------------

C9_SIZES = [4, 1, 3, 2]  # uneven on purpose


def c9_values() -> dict[str, torch.Tensor]:
    return {"exp_avg": torch.arange(10, dtype=torch.float32) * 1.5 - 3,
            "exp_avg_sq": (torch.arange(10, dtype=torch.float64) + 0.25) ** 2}


def c9_save(uri: str) -> dict:
    d = dist_for("gloo")
    lo = sum(C9_SIZES[:d.rank])
    mine = {k: v[lo:lo + C9_SIZES[d.rank]].clone() for k, v in c9_values().items()}
    m = save_distributed({"step": 7} if d.rank == 0 else None, uri, dist=d, shards=mine)
    return {"world_size": m.world_size, "items": sorted(m.items)}


def c9_restore(uri: str, world: int, strategy: str, zero_sharding: str = "os",
               allow_reshard: bool = True):
    d = dist_for("gloo", world)
    if d is None:
        return None
    r = restore(uri, dist=d, strategy=strategy,
                config=RestoreConfig(zero_sharding=zero_sharding, allow_reshard=allow_reshard))
    return {"bounds": r.shard_bounds, "numel": r.shard_numel,
            "shards": {k: (str(t.dtype), t.tolist()) for k, t in r.shards.items()},
            "state": r.state, "received": r.stats.bytes_received, "sent": r.stats.bytes_sent}


# ---- C12: per-rank iterator / RNG state ----------------------------------------------------

class RankStream:
    """Rank ``rank``'s shuffled share of 20 items, batches of 2; resumable from its state."""

    N, BATCH = 20, 2

    def __init__(self, rank: int, world: int, gen_state: torch.Tensor | None = None,
                 pos: int = 0) -> None:
        self.rank = rank
        self.items = list(range(rank, self.N, world))
        g = torch.Generator()
        if gen_state is None:
            g.manual_seed(1234 + 17 * rank)
        else:
            g.set_state(gen_state)
        self.epoch_gen_state = g.get_state()
        self.perm = torch.randperm(len(self.items), generator=g).tolist()
        self.pos = pos

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        if self.pos * self.BATCH >= len(self.items):
            raise StopIteration
        idx = self.perm[self.pos * self.BATCH:(self.pos + 1) * self.BATCH]
        self.pos += 1
        return [self.items[i] for i in idx]

    def state_dict(self) -> dict:
        return {"epoch_gen_state": self.epoch_gen_state, "iterations_in_epoch": self.pos}


def c12_resume(uri: str, world: int, strategy: str) -> dict | None:
    d = dist_for("gloo", world)
    if d is None:
        return None
    stream = RankStream(d.rank, d.world_size)
    seen = [next(stream) for _ in range(3)]
    torch.manual_seed(99 + d.rank)  # per-rank global RNG (dropout masks...)
    rank_state: dict[str, Any] = {"iterator": stream.state_dict(),
                                  "torch_rng": torch.get_rng_state()}
    save_distributed({"epoch": 1}, uri, dist=d, rank_state=rank_state)
    rest = list(stream)
    noise = torch.rand(4)

    r = restore(uri, dist=d, strategy=strategy)
    st = r.rank_state
    resumed = RankStream(d.rank, d.world_size, st["iterator"]["epoch_gen_state"],
                         st["iterator"]["iterations_in_epoch"])
    torch.set_rng_state(st["torch_rng"])
    return {"seen": seen, "rest": rest, "resumed": list(resumed),
            "noise_equal": torch.equal(torch.rand(4), noise),
            "rank_state_is_own": torch.equal(st["torch_rng"], rank_state["torch_rng"]),
            "strategy": r.strategy}


# ---- failures -------------------------------------------------------------------------------

def save_with_rank_states(uri: str) -> None:
    d = dist_for("gloo")
    state = {"w": torch.arange(4096, dtype=torch.float32), "step": 3}
    save_distributed(state if d.rank == 0 else None, uri, dist=d,
                     rank_state={"rng": torch.full((256,), d.rank, dtype=torch.int64)})


def restore_expect_failure(uri: str, kind: Kind, strategy: str):
    d = dist_for(kind)
    t0 = time.monotonic()
    restore(uri, dist=d, strategy=strategy)
    return time.monotonic() - t0


def killed_mid_broadcast(uri: str, timeout_s: float) -> str:
    """Rank 2 dies while receiving the second bucket; the others must raise, not hang."""
    d = get_dist(DistConfig(backend="gloo", timeout_s=timeout_s))
    if d.rank == 2:
        calls = []
        real = d._data_broadcast

        def dying(t, src):
            calls.append(1)
            if len(calls) == 2:
                kill_self()
            real(t, src)

        # A fault through the same interface.
        d._data_broadcast = dying  # type: ignore[method-assign]  # fault injection
    restore(uri, dist=d, strategy="broadcast",  # every byte through the collective
            config=RestoreConfig(bucket_size_bytes=64 * 1024, host_shared_memory=False))
    return "restored"


def pid() -> int:
    return os.getpid()


def rank0_cannot_open_storage(uri: str) -> str:
    """Rank 0 decides, then fails to open storage for the read (before any byte is filled)."""
    from xla_ckpt.errors import StorageError
    from xla_ckpt.restore.decide import Decision

    d = get_dist(DistConfig(backend="gloo", timeout_s=120.0))  # far past the launcher's limit
    real = Decision.open
    if d.rank == 0:
        def refuse(*a, **kw):  # a fault at this exact point: the storage was fine a moment ago
            raise StorageError(f"{uri}: connection refused")

        Decision.open = refuse  # type: ignore[method-assign]  # a fault a real store cannot give
    try:
        restore(uri, dist=d, strategy="broadcast")
    finally:
        Decision.open = real  # type: ignore[method-assign]  # undo the fault above
    return "restored"
