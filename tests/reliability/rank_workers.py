"""What each rank runs in the rank-failure tests (module level: the launcher imports it).

One rank (the victim) fails during a restore of 4 gloo ranks, in one of four
ways; every rank reports how its restore ended and how long it took:

* ``raise``: the victim's storage reads fail for real: the fault proxy answers
  them with HTTP 403, so its read raises :class:`StoragePermissionError`;
* ``kill``: the victim SIGKILLs itself at a fault hook: its first storage read
  (``all_ranks``), its second data-plane bucket (``broadcast``, every byte
  over the collective), or its mapping of rank 0's host shared memory
  (``broadcast_host_memory``, the broadcast strategy's default on one host);
* ``stall``: the victim sleeps at that hook for ``timeout_s + STALL_EXTRA_S``;
* ``coordinator``: the victim is rank 0 -- the rank that decides what to
  restore and (broadcast) sends the bytes -- and it is killed at the hook
  (``all_ranks``: while reading the manifest to decide, the others waiting
  for the decision; ``broadcast``: while sending the second bucket;
  ``broadcast_host_memory``: while reading into its shared segment, the
  others waiting to hear how the read went).

The hooks replace a method of the real storage backend or of the rank's own
:class:`~xla_ckpt.comm.TorchDist` (a fault a real part cannot produce on demand
at that point); the rest is the real library.
"""

from __future__ import annotations

import threading
import time

import torch

from xla_ckpt.testing.launcher import kill_self

STALL_EXTRA_S = 6.0
BUCKET_BYTES = 64 * 1024


def checkpoint_state() -> tuple[dict, dict[int, dict]]:
    """The replicated state (4 tensors of 256 KiB) and every rank's private state."""
    g = torch.Generator().manual_seed(4)
    state = {"t": [torch.randn(64 * 1024, generator=g) for _ in range(4)], "step": 9}
    ranks = {r: {"rng": torch.full((64,), r, dtype=torch.int64)} for r in range(4)}
    return state, ranks


def _hook_storage_reads(action) -> None:
    """Run ``action()`` at this rank's first ranged read (local or GCS backend)."""
    from xla_ckpt.storage.gcs import GCSStorage
    from xla_ckpt.storage.local import LocalStorage

    fired = threading.Lock()  # reads run in parallel threads: act once

    for cls in (LocalStorage, GCSStorage):
        real = cls.read_range

        def hooked(self, *a, _real=real, **kw):
            if fired.acquire(blocking=False):
                action()
            return _real(self, *a, **kw)

        cls.read_range = hooked  # type: ignore[method-assign]  # the fault hook, on purpose


def _hook_host_memory_map(action) -> None:
    """Run ``action()`` when this rank starts mapping its host leader's sealed segment."""
    from xla_ckpt.restore import blobs

    real = blobs.map_private

    def hooked(*a, **kw):
        action()
        return real(*a, **kw)

    blobs.map_private = hooked  # the fault hook, on purpose


def _hook_second_bucket(d, action) -> None:
    """Run ``action()`` when this rank enters its second data-plane broadcast."""
    real = d._data_broadcast
    calls = []

    def hooked(t, src):
        calls.append(1)
        if len(calls) == 2:
            action()
        real(t, src)

    d._data_broadcast = hooked


def restore_with_victim(uri: str, strategy: str, scenario: str, victim: int,
                        timeout_s: float) -> dict:
    """Every rank: restore ``uri``; the victim fails as ``scenario`` says.  Never raises."""
    from xla_ckpt.comm import DistConfig, TorchDist, get_dist
    from xla_ckpt.errors import XlaCkptError
    from xla_ckpt.restore import RestoreConfig, restore
    from xla_ckpt.storage import StorageConfig

    get_dist(DistConfig(backend="gloo", timeout_s=120.0))  # the job's process group
    d = TorchDist.new_subgroup(range(4), timeout_s=timeout_s)  # fresh groups for this case
    assert d is not None  # every rank of the 4 is a member
    host_memory = strategy == "broadcast_host_memory"
    strategy = "broadcast" if host_memory else strategy
    if d.rank == victim and scenario != "raise":
        action = kill_self if scenario in ("kill", "coordinator") else \
            (lambda: time.sleep(timeout_s + STALL_EXTRA_S))
        if host_memory and victim != 0:
            _hook_host_memory_map(action)  # a rank mapping rank 0's segment
        elif strategy == "broadcast" and not host_memory:
            _hook_second_bucket(d, action)  # receiving (rank 2) or sending (rank 0) bytes
        else:
            _hook_storage_reads(action)  # rank 0: its manifest read, or its read into memory
    t0 = time.monotonic()
    out: dict = {"rank": d.rank}
    try:
        restore(uri, dist=d, strategy=strategy,
                config=RestoreConfig(bucket_size_bytes=BUCKET_BYTES,
                                     host_shared_memory=host_memory),
                storage_config=StorageConfig(max_attempts=2, initial_backoff_s=0.01,
                                             max_backoff_s=0.05))
        out.update(outcome="restored")
    except XlaCkptError as e:
        out.update(outcome="error", error=type(e).__name__, message=str(e),
                   failures={int(k): v for k, v in getattr(e, "failures", {}).items()})
    except Exception as e:  # noqa: BLE001 - recorded: the test fails on it
        out.update(outcome="foreign_error", error=type(e).__name__, message=str(e))
    out["seconds"] = time.monotonic() - t0
    return out


def preload() -> None:
    """Import in a zygote what its forked ranks use, so that no fork imports on its own
    (``crash_harness.preload`` does the same for the crash campaigns; ``torch._dynamo``:
    ``distribute_tensor`` imports it on its first call, seconds in every fork)."""
    import crash_harness as H
    import torch._dynamo
    import torch.distributed.device_mesh
    import torch.distributed.tensor  # noqa: F401 - imported to warm the forks

    import xla_ckpt.comm
    import xla_ckpt.storage.gcs  # noqa: F401 - imported to warm the forks

    H.preload("local")


def in_job(fn, args: tuple, rank: int, *, env: dict[str, str] | None = None) -> dict:
    """A rank of a job forked from a zygote (``crash_harness.run_jobs``): ``fn(*args)``, with
    ``env`` added to its environment (as ``WorkerPool.run(env=...)`` does).  The rank's
    environment is the launcher's (``RANK``, ``WORLD_SIZE``, the job's store), so ``fn`` runs
    as it does in a :class:`~xla_ckpt.testing.launcher.WorkerPool` worker."""
    import os

    os.environ.update(env or {})
    return fn(*args)


def exchange_cost(n: int) -> dict:
    """Seconds for ``n`` small control-plane exchanges with and without progress marks.

    The marks (:mod:`xla_ckpt.comm.liveness`) cost one store write per
    collective; this measures that against the same exchanges without them,
    in the same processes.
    """
    from xla_ckpt.comm import DistConfig, TorchDist, get_dist

    get_dist(DistConfig(backend="gloo", timeout_s=120.0))
    d = TorchDist.new_subgroup(range(4), timeout_s=60.0)
    assert d is not None  # every rank of the 4 is a member
    marks = d._liveness
    out = {}
    for label, lv in (("warm_up", marks), ("with_marks", marks), ("without_marks", None),
                      ("with_marks_again", marks)):
        d._liveness = lv
        d.barrier()
        t0 = time.perf_counter()
        for i in range(n):
            d.exchange({"i": i, "rank": d.rank})
        out[label] = time.perf_counter() - t0
    d._liveness = marks
    return out


# ---- sharded save and restore (DTensor state, chunked layout) ---------------------------------
#
# A job of ``SHARDED_WORLD`` ranks (forked from a zygote by ``crash_harness.run_job``: a death
# retires nothing, so every case is cheap) saves or restores the sharded state of
# ``crash_harness`` (uneven Shard(0), Shard(1), Replicate(), plain tensors, per-rank items) on
# local disk, with a 3-second collective timeout; one rank fails:
#
# * save, ``agree`` (the structure agreement before anything is written): ``raise`` -- the
#   victim's state has a key the others lack (a real disagreement); ``stall`` / ``kill`` at
#   its entry into the agreement (``plan_chunked_save``);
# * save, ``write`` (its chunk item's data file): ``raise`` -- the write fails with ENOSPC;
#   ``stall`` / ``kill`` as it starts writing;
# * save, ``commit`` (rank 0 writes the v2 manifest): the same three at rank 0's manifest write;
# * restore, ``all_ranks`` (every rank reads its own byte ranges) and ``broadcast`` (rank 0
#   reads every rank's boxes and sends each its own): ``raise`` -- the victim's reads fail with
#   EIO (rank 0's under broadcast, the only reader); ``stall`` / ``kill`` at its first read
#   (``all_ranks``, and rank 0 under broadcast: ``coordinator``) or its first point-to-point
#   receive (``broadcast``).
#
# The hooks replace a method of the real storage backend, of the save module or of the rank's
# own Dist, in the forked rank only; the rest is the real library.

SHARDED_WORLD = 3
SHARDED_N = 5  # the update whose state is saved


def _act(scenario: str, timeout_s: float, what: str) -> None:
    import errno
    import os

    if scenario == "kill":
        kill_self()
    elif scenario == "stall":
        time.sleep(timeout_s + STALL_EXTRA_S)
    else:
        code = errno.ENOSPC if what == "write" else errno.EIO
        raise OSError(code, os.strerror(code), what)


def _hook_writes(match, action) -> None:
    """Run ``action()`` before this rank's first ``write_atomic`` of an object ``match``es."""
    from xla_ckpt.storage.local import LocalStorage

    real = LocalStorage.write_atomic
    fired = threading.Lock()

    def hooked(self, name, *a, **kw):
        if match(name) and fired.acquire(blocking=False):
            action()
        return real(self, name, *a, **kw)

    LocalStorage.write_atomic = hooked  # type: ignore[method-assign]  # the fault hook, on purpose


def _fail_storage_reads() -> None:
    """Every ranged read of this rank fails with EIO (a disk that returns read errors)."""
    import errno
    import os

    from xla_ckpt.storage.local import LocalStorage

    def failing(self, name, *a, **kw):
        raise OSError(errno.EIO, os.strerror(errno.EIO), name)

    LocalStorage.read_range = failing  # type: ignore[method-assign]  # the fault, on purpose


def _hook_agreement(action) -> None:
    """Run ``action()`` when this rank enters the structure agreement of a chunked save."""
    import xla_ckpt.restore.save_steps as save_module

    real = save_module.plan_chunked_save

    def hooked(*a, **kw):
        action()
        return real(*a, **kw)

    save_module.plan_chunked_save = hooked


def _hook_first_scatter(d, action) -> None:
    """Run ``action()`` when this rank enters its first point-to-point round (broadcast)."""
    real = d.scatter_tensors
    fired = threading.Lock()

    def hooked(*a, **kw):
        if fired.acquire(blocking=False):
            action()
        return real(*a, **kw)

    d.scatter_tensors = hooked


def _outcome(fn) -> dict:
    from xla_ckpt.errors import XlaCkptError

    t0 = time.monotonic()
    out: dict = {}
    try:
        fn()
        out.update(outcome="ok")
    except XlaCkptError as e:
        _last_error[:] = [e]
        out.update(outcome="error", error=type(e).__name__, message=str(e),
                   failures={int(k): v for k, v in getattr(e, "failures", {}).items()})
    except Exception as e:  # noqa: BLE001 - recorded: the test fails on it
        out.update(outcome="foreign_error", error=type(e).__name__, message=str(e))
    out["seconds"] = time.monotonic() - t0
    return out


def sharded_save_with_victim(rank: int, uri: str, phase: str, scenario: str, victim: int,
                             timeout_s: float) -> dict:
    """One rank of a sharded save in which ``victim`` fails at ``phase`` (see above)."""
    import crash_harness as H

    from xla_ckpt.restore import save_distributed

    d, mesh = H.join_job(timeout_s)
    state = H.distribute_state(H.sharded_full_state(SHARDED_N), mesh, H.sharded_placements())
    if rank == victim:
        def act() -> None:
            _act(scenario, timeout_s, phase)

        if phase == "agree" and scenario == "raise":
            state["model"]["only_on_rank_%d" % rank] = torch.zeros(3)
        elif phase == "agree":
            _hook_agreement(act)
        elif phase == "write":
            _hook_writes(lambda n: "chunks-" in n, act)
        else:
            _hook_writes(lambda n: n.endswith("manifest.json"), act)
    out = _outcome(lambda: save_distributed(
        state, uri, dist=d, metadata={"num_updates": SHARDED_N},
        rank_state=H.sharded_rank_state(SHARDED_N, rank),
        chunk_size_bytes=H.SHARDED_CHUNK_BYTES))
    out["rank"] = rank
    return out


def save_sharded_checkpoint(rank: int, uri: str) -> dict:
    """One rank of the save of the checkpoint the restore cases read."""
    return sharded_save_with_victim(rank, uri, "none", "none", -1, 60.0)


def sharded_restore_with_victim(rank: int, uri: str, strategy: str, scenario: str,
                                victim: int, timeout_s: float) -> dict:
    """One rank of a sharded restore (into DTensor targets) in which ``victim`` fails."""
    import crash_harness as H

    from xla_ckpt.restore import RestoreConfig, restore

    d, mesh = H.join_job(timeout_s)
    if rank == victim:
        def act() -> None:
            _act("kill" if scenario == "coordinator" else scenario, timeout_s, "read")

        if scenario == "raise":
            _fail_storage_reads()  # its own ranges, or (rank 0, broadcast) everyone's
        elif strategy == "broadcast" and rank != 0:
            _hook_first_scatter(d, act)  # receiving its boxes from rank 0
        else:
            _hook_storage_reads(act)  # reading its own ranges, or (rank 0) everyone's
    holder: dict = {}

    def run() -> None:
        holder["r"] = restore(uri, dist=d, strategy=strategy, into=H.sharded_targets(mesh),
                              config=RestoreConfig(bucket_size_bytes=BUCKET_BYTES))

    out = _outcome(run)
    if "r" in holder:
        out["diff"] = H.sharded_diff(holder["r"].state, SHARDED_N, mesh)
    out["rank"] = rank
    return out


# ---- the per-host and striped plans: 2 emulated hosts x 2 ranks ------------------------------
#
# The same 4 ranks run as 2 emulated hosts (ranks 0-1 and 2-3: torchrun ``GROUP_RANK`` /
# ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``, and each host's own GCS source address
# ``127.0.0.(10+h)`` so a proxy fault can target one host).  Plans: ``per_host`` (each host's
# leader -- rank 0, rank 2 -- reads into host shared memory, rank 1 / rank 3 map it),
# ``striped`` (every rank reads its stripes into its host's segment, the leaders all-gather)
# and ``striped_private`` (striped without host shared memory: all-gather over every rank).
# ``kill`` / ``stall`` hook the victim's first ranged read (its stripe; a per-host leader's
# read into shared memory) or, with ``follow``, a per-host follower's mapping of its leader's
# sealed copy; ``proxy``: nothing is hooked, the proxy fails or stalls the host's reads.

PLAN_HOSTS = 2


def plan_checkpoint_state() -> tuple[dict, dict[int, dict]]:
    """The replicated state of the plan cases: 4 tensors of 1.5 MiB, each one stripe (smaller
    blobs are grouped into one stripe, which one rank reads), so every rank of the 2 x 2 job
    reads a stripe of its own; and every rank's private state."""
    g = torch.Generator().manual_seed(6)
    state = {"t": [torch.randn(384 * 1024, generator=g) for _ in range(4)], "step": 10}
    ranks = {r: {"rng": torch.full((64,), r, dtype=torch.int64)} for r in range(4)}
    return state, ranks


def restore_plan_with_victim(uri: str, plan: str, scenario: str, victim: int,
                             timeout_s: float) -> dict:
    """Every rank: restore ``uri`` with ``plan`` on 2 emulated hosts; the victim fails as
    ``scenario`` says (``kill``, ``stall``, ``kill_follow``, ``stall_follow``, ``proxy``).
    Never raises; the hooks are removed afterwards."""
    import os

    from xla_ckpt.comm import DistConfig, TorchDist, get_dist
    from xla_ckpt.errors import XlaCkptError
    from xla_ckpt.restore import RestoreConfig, blobs, restore
    from xla_ckpt.storage import StorageConfig
    from xla_ckpt.storage.base import SOURCE_ADDRESS_ENV
    from xla_ckpt.storage.gcs import GCSStorage
    from xla_ckpt.storage.local import LocalStorage
    from xla_ckpt.testing.fault_proxy import host_address

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    per = world // PLAN_HOSTS
    host = rank // per
    env = {"GROUP_RANK": str(host), "LOCAL_RANK": str(rank % per),
           "LOCAL_WORLD_SIZE": str(per), SOURCE_ADDRESS_ENV: host_address(host)}
    saved_env = {k: os.environ.get(k) for k in env}
    saved_attrs = [(LocalStorage, "read_range", LocalStorage.read_range),
                   (GCSStorage, "read_range", GCSStorage.read_range),
                   (blobs, "map_private", blobs.map_private)]
    os.environ.update(env)
    out: dict = {"rank": rank, "host": host}
    try:
        get_dist(DistConfig(backend="gloo", timeout_s=120.0))  # the job's process group
        d = TorchDist.new_subgroup(range(world), timeout_s=timeout_s)  # fresh groups
        assert d is not None and d.topology.host_id == host
        if d.rank == victim and scenario != "proxy":
            action = kill_self if scenario.startswith("kill") else \
                (lambda: time.sleep(timeout_s + STALL_EXTRA_S))
            if scenario.endswith("_follow"):
                _hook_host_memory_map(action)  # a per-host follower mapping its leader's copy
            else:
                _hook_storage_reads(action)  # its stripe, or a leader's read into the segment
        t0 = time.monotonic()
        try:
            r = restore(uri, dist=d, config=RestoreConfig(
                strategy="striped" if plan.startswith("striped") else plan,
                host_shared_memory=plan != "striped_private", bucket_size_bytes=BUCKET_BYTES),
                storage_config=StorageConfig(max_attempts=2, initial_backoff_s=0.01,
                                             max_backoff_s=0.05))
            state, _ = plan_checkpoint_state()
            same = all(torch.equal(a, b) for a, b in zip(r.state["t"], state["t"], strict=True))
            out.update(outcome="restored" if same else "silent_corruption", plan=r.stats.plan)
        except XlaCkptError as e:
            out.update(outcome="error", error=type(e).__name__, message=str(e),
                       failures={int(k): v for k, v in getattr(e, "failures", {}).items()})
        except Exception as e:  # noqa: BLE001 - recorded: the test fails on it
            out.update(outcome="foreign_error", error=type(e).__name__, message=str(e))
        out["seconds"] = time.monotonic() - t0
    finally:
        for cls, name, fn in saved_attrs:
            setattr(cls, name, fn)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out


# ---- the manager: rank 0 decides a restore alone and fails (issue 25, defect 9) ---------------
#
# Rank 0 resolves what to restore (``restore_or_initialize``) or lists the steps
# (``restore(step=...)``) for every rank; its storage fails there with ``fault``: a library
# error (``PreconditionFailedError``, the type of the case) or a plain ``OSError``.
# Every rank must raise one type: that library error, or a ``DistributedError`` naming rank 0.

def manager_restore_rank0_fails(run_dir: str, fault: str, call: str) -> dict:
    import errno
    import os

    from xla_ckpt.comm import DistConfig, get_dist
    from xla_ckpt.errors import PreconditionFailedError
    from xla_ckpt.manager import CheckpointConfig, CheckpointManager
    from xla_ckpt.storage.local import LocalStorage

    class Failing(LocalStorage):
        def list(self, prefix=""):
            if fault == "precondition":
                raise PreconditionFailedError(f"{self.url(prefix)}: the object changed (HTTP "
                                              "412)", name=prefix, expected_generation=7,
                                              actual_generation=9)
            raise OSError(errno.EIO, os.strerror(errno.EIO), self.url(prefix))

    _last_error.clear()
    d = get_dist(DistConfig(backend="gloo", timeout_s=60))
    rank = d.rank
    cfg = CheckpointConfig(save_dir=run_dir, handle_sigterm=False, async_save=False)
    storage = Failing(run_dir) if rank == 0 else LocalStorage(run_dir)
    out: dict = {}
    with CheckpointManager(cfg, dist=d, storage=storage) as mgr:
        if call == "restore_or_initialize":
            out = _outcome(mgr.restore_or_initialize)
        else:
            out = _outcome(lambda: mgr.restore(step=2))
        out["notes"] = list(getattr(_last_error[0], "__notes__", [])) if _last_error else []
        out["attrs"] = ({k: getattr(_last_error[0], k, None) for k in
                         ("name", "expected_generation", "actual_generation")}
                        if _last_error else {})
    storage.close()
    out["rank"] = rank
    return out


_last_error: list = []  # the exception _outcome saw last (for the notes and attributes)
