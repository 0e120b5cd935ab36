r"""Striped restore benchmark: every read plan on emulated hosts, each behind its own shaped link.

``--hosts`` (4) emulated hosts x ``--ranks-per-host`` (2) gloo ranks (real processes from
:mod:`xla_ckpt.testing.launcher`, ``WorkerPool(world, hosts=H)``; loopback only) restore one
``--size-mib`` (256) MiB replicated state from the GCS emulator
(:mod:`xla_ckpt.testing.gcs_emulator`) through the shaping proxy
(:class:`xla_ckpt.testing.fault_proxy.FaultProxy`): ``Shaping(first_byte_latency_s=0.03,
stream_mib_s=32, host_mib_s=64)``.  Emulated host ``h`` connects from its own loopback
address ``127.0.0.(10+h)`` (``XLA_CKPT_GCS_SOURCE_ADDRESS``, set per rank by the launcher), so
the proxy caps each host's link at 64 MiB/s and counts the bytes it serves to each host.

The state is a realistic mix (:func:`state_layout`): an embedding (1/4 of the state), an output
head (1/8), four large MLP matrices (1/16 each) and 24 attention-sized matrices (fp32), plus
many small tensors: per layer LayerNorm weights/biases (fp32), bias vectors (bf16) and int64
step counters (0-d), an empty tensor, an int64 table, and two plain Python values.  It is saved
once (``xla_ckpt.save`` from the parent, through the proxy, uploads unshaped).

Plans (``RestoreConfig(strategy=...)``), run interleaved (each repeat runs every plan once, the
order rotated by one each repeat), ``--repeats`` (3) runs each, medians:

  all_ranks  ``strategy="all_ranks", host_shared_memory=False``: every rank fetches everything
             (the every-replica read: hosts x ranks_per_host x the state from storage)
  per_host   ``strategy="per_host"``: the host leader fetches, the host's other ranks map its
             sealed copy (host x the state)
  broadcast  ``strategy="broadcast"``: rank 0 fetches; the data plane (gloo) fans out to the
             other hosts' leaders; ranks of a host share their leader's copy
  striped    ``strategy="striped"``: every byte fetched once per job, in crc32c-chunk-aligned
             stripes spread over every rank; exchanged through host shared memory within a
             host and an all-gather over the host leaders across hosts
  auto       ``strategy="auto"`` with ``RestoreConfig.cost_model`` = the bandwidths below:
             the line says which plan it picked (``plan_ran``) and why

Before the timed runs every plan restores a small checkpoint once (untimed: first use of gloo,
the GCS client, host shared memory), and four probes run, all before any timed run and none
fitted to the timed runs; each gives one parameter of the cost model (``setup`` line,
``*_source`` says which came from a probe and which from a command-line override):

* the data plane: an all-gather of ``--probe-mib`` MiB (default: the state's size, what the
  striped exchange moves) over the host leaders (``Dist.all_gather_tensors`` on their
  subgroup, the striped exchange's collective, one contiguous range per leader as the
  exchange sends it; on gloo one bucketed broadcast per source), into buffers allocated once
  and reused (every page already touched), median of 3 after one untimed round.
  ``(P-1)/P x bytes / seconds`` is ``data_plane_cross_host_bytes_per_s``
  (``--data-plane-mib-s`` overrides it); the same probe times a broadcast from rank 0,
  reported beside it;
* host shared memory: each host leader fills and seals a memfd segment of the same size, and
  every rank maps it (``map_private``: every page mapped in, as every host-sharing plan ends),
  all ranks at once, median of 3 after one untimed round; bytes over the slowest rank's
  seconds is ``data_plane_intra_host_bytes_per_s`` (``--intra-host-mib-s``).  With 8 ranks on
  2 cores this is far below one rank's memory bandwidth (the model's default, 8 GiB/s);
* storage (``storage_probe``), shaping on as in the timed runs: every rank reads
  ``--storage-probe-mib`` (32) MiB of the checkpoint's largest data file with
  ``Storage.read_ranges`` (its own client, 32 streams, 8 MiB slices); each of 3 rounds times
  host 0's ranks reading alone, then every rank reading at once.  The extra bytes the whole
  job fetched over the extra seconds the slowest rank took (medians) is the model's series
  term ``storage_total_bytes_per_s``: what each byte the job fetches adds to every host's
  read (``--storage-total-mib-s``; if every host was not slower, the default is kept);
* the fixed cost: every plan restores the small checkpoint 3 more times, timed as the timed
  runs are; the median over plans of (median seconds minus the model's seconds for those
  bytes, with the other probed parameters) is ``restore_fixed_s`` (``--fixed-s``): deciding,
  control-plane agreements, storage clients, negotiating and sealing host shared memory.

Every striped run also times its steps on every rank (``striped_steps_s_per_rank``, wrappers
around ``xla_ckpt.restore.blobs``' ``negotiate``, ``_allocate``, ``_seal_and_map`` and
``materialize_item`` and ``xla_ckpt.restore.box_striped``'s ``read_requests`` and
``_exchange_flat``; timing only), beside ``RestoreStats.read_seconds``
(``stats_read_seconds_per_rank``) and the wall time of ``restore`` itself
(``restore_seconds_per_rank``; ``seconds`` adds the touch of every page).

**Clock**: on every rank from a barrier until ``restore`` returned and every page of the state
is resident (one read per 4 KiB page, so a lazily mapped page is paid for); ``seconds`` is the
slowest rank.

One JSON line per plan (``"kind": "plan"``):

* ``seconds`` (median), ``seconds_all`` (every run), ``seconds_per_rank`` (the median run);
* ``bytes_served_per_host``: response bytes the proxy served to each emulated host (its counters
  reset before every run; the median run), ``bytes_served_other`` (any other source address:
  should be 0), ``bytes_per_job`` and ``bytes_per_job_x_checkpoint`` (over the checkpoint's
  objects: data files + manifest);
* ``peak_host_memory_mib`` (and ``_x_state``): the peak over the restore of the sum over
  every rank of ``/proc/<pid>/smaps_rollup`` Pss (a page k ranks map counts 1/k in each),
  sampled by the parent every 50 ms, minus that sum just before the run.  Reading
  smaps_rollup walks every mapping of the process: about 20 ms of CPU per rank here, a core's
  worth at that rate, so it is sampled in ``--memory-runs`` (1) extra, untimed runs of each
  plan after the timed ones (``memory_run_seconds``), never during a timed run;
* ``predicted_s``: ``xla_ckpt.restore.cost.predict`` on ``RestoreTopology(hosts,
  ranks_per_host)``, ``RestoreSizes`` from the manifest and the bandwidths of the ``setup``
  line; ``prediction_error`` = predicted / measured - 1; ``stats_predicted_s``: what the
  restore itself reported (``RestoreStats.predicted_s``);
* ``bitwise_ok``: every rank's restored state has the saved state's digest (crc32c of every
  tensor's bytes, dtype, shape and key path, and every plain value), in every run (timed and
  memory runs: ``runs_checked_bitwise``);
* ``requests``: requests the proxy served in the run (GETs of data and metadata);
  ``load_average_1m_all``: the machine's 1-minute load average as each timed run started
  (other work on the machine slows every plan; the ``setup`` line has the CPU count);
* ``ratio_vs_<plan>``: this plan's seconds over that plan's (striped: < 1 is faster).

The first line (``"kind": "setup"``) has the topology, sizes, shaping and every cost-model
parameter (``benchmarks/scale_model.py --check-emulation`` recomputes the predictions from it);
the last (``"kind": "summary"``) the targets (issue 13), each with the measured figure and
``met``: striped <= 0.5x all_ranks and <= 0.5x broadcast, striped bytes per job 1.0x, every
plan's prediction within +-30 %.  Exit status 1 if any plan's state differs from the saved one
on any rank or a plan failed; targets not met do not change it.

Cost-model parameters (``Bandwidths``): the shaping's figures (``storage_stream_bytes_per_s``
32 MiB/s, ``storage_host_bytes_per_s`` 64 MiB/s, ``first_byte_latency_s`` 0.03 s);
``streams_per_reader`` = the GCS ``StorageConfig.max_workers`` (32) and ``request_bytes`` =
its ``slice_size_bytes`` (8 MiB); the four probes above (cross-host rate, intra-host rate,
series storage term, fixed seconds); the documented default for the rest
(``data_plane_latency_s`` 2 ms).

**Balance** (``--balance on``, the default, before the timed plans; ``only``: nothing else;
issue 23): ``--balance-ranks`` (4) gloo ranks on one host restore the issue's 36 MiB
replicated state (48 fp32 vectors of 256 KiB and 6 matrices of 4 MiB, the default 4 MiB
crc32c chunks) from a local folder, saved twice: vectors stored first and matrices first.
Each of ``all_ranks`` (host shared memory off), ``per_host``, ``broadcast`` and ``striped``
restores it plainly and into live zero targets (``restore(into=...)``).  One line per case
(``"kind": "balance"``): ``bytes_read_per_rank`` (``RestoreStats.bytes_read``),
``mb_read_per_rank``, ``max_over_mean`` over every rank and ``readers_max_over_mean`` over the
ranks that read (the plan's readers: each within 25 % of their mean share, ``balanced``), and
``bitwise_ok``; then one ``"kind": "balance_summary"`` line.  Counts, not timings.

``--all-gather broadcast`` is an A/B knob of this script: every rank's
``TorchDist.all_gather_tensors`` is replaced by the base ``Dist`` path (one bucketed broadcast
per source rank), to compare the striped exchange's two implementations.

  .venv/bin/python benchmarks/striped_restore.py                      # 4 x 2 ranks, 256 MiB
  .venv/bin/python benchmarks/striped_restore.py --repeats 5 > striped.jsonl
  .venv/bin/python benchmarks/scale_model.py --no-grid --check-emulation striped.jsonl
  .venv/bin/python benchmarks/striped_restore.py --size-mib 8 --hosts 2 --ranks-per-host 2 \
      --repeats 1                                                     # seconds: the test's run
  .venv/bin/python benchmarks/striped_restore.py --balance only      # bytes per rank, 1 min
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import math
import os
import re
import statistics
import sys
import threading
import time
from typing import Any, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

MiB = 1024 * 1024
GiB = 1024 * MiB
PLANS = ("all_ranks", "per_host", "broadcast", "striped", "auto")
TARGET_RATIO = 0.5
TARGET_ERROR = 0.30
WARM_MIB = 2
STORAGE_PROBE_ROUNDS = 3
FIXED_PROBE_ROUNDS = 3
#: What runs each plan (``auto`` picks one of the others).
_STRATEGY: dict[str, dict[str, Any]] = {
    "all_ranks": {"strategy": "all_ranks", "host_shared_memory": False},
    "per_host": {"strategy": "per_host"}, "broadcast": {"strategy": "broadcast"},
    "striped": {"strategy": "striped"}, "auto": {"strategy": "auto"}}


# ---- the state -------------------------------------------------------------------------------
def state_layout(size_mib: int) -> list[tuple[str, tuple[int, ...], str]]:
    """``(key path, shape, dtype)`` of the benchmark's tensors, about ``size_mib`` MiB in all.

    A few large fp32 matrices (embedding 1/4, head 1/8, four MLP matrices 1/16 each, 24
    attention-sized ones sharing the rest) and many small tensors (per layer: LayerNorm
    weights/biases fp32, biases bf16, a 0-d int64 step; an empty tensor; an int64 table).
    Row width 1024 and 32 layers from 64 MiB up, 128 and 8 below.
    """
    h = 1024 if size_mib >= 64 else 128
    layers = 32 if size_mib >= 64 else 8
    small: list[tuple[str, tuple[int, ...], str]] = []
    for i in range(layers):
        small += [(f"model/layers.{i}.ln1.weight", (h,), "float32"),
                  (f"model/layers.{i}.ln1.bias", (h,), "float32"),
                  (f"model/layers.{i}.ln2.weight", (h,), "float32"),
                  (f"model/layers.{i}.ln2.bias", (h,), "float32"),
                  (f"model/layers.{i}.attn.qkv.bias", (3 * h,), "bfloat16"),
                  (f"model/layers.{i}.mlp.fc1.bias", (4 * h,), "bfloat16"),
                  (f"optim/state.{i}.step", (), "int64")]
    small += [("model/rotary.inv_freq", (h // 2,), "float32"),
              ("model/unused_adapter", (0, h), "float32"),
              ("data/token_counts", (h, 8), "int64")]
    row = 4 * h
    rest = size_mib * MiB - sum(_nbytes(s, d) for _, s, d in small)
    large = [("model/embed.weight", (max(1, rest // 4 // row), h), "float32"),
             ("model/head.weight", (max(1, rest // 8 // row), h), "float32")]
    large += [(f"model/mlp_big.{i}.weight", (max(1, rest // 16 // row), h), "float32")
              for i in range(4)]
    left = rest - sum(_nbytes(s, d) for _, s, d in large)
    medium = [(f"model/layers.{i}.attn.out.weight", (max(1, left // 24 // row), h), "float32")
              for i in range(24)]
    return large + medium + small


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "int64": 8}


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * _ITEMSIZE[dtype]


def make_state(size_mib: int, seed: int = 0) -> dict[str, Any]:
    """The nested state of :func:`state_layout` (random values, fixed seed) plus plain values."""
    import torch

    g = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {"step": 1000 + seed, "note": f"striped benchmark {size_mib} MiB"}
    for key, shape, dtype in state_layout(size_mib):
        top, name = key.split("/", 1)
        if dtype == "int64":
            t = torch.randint(0, 1 << 40, shape, generator=g, dtype=torch.int64)
        else:
            t = torch.randn(shape, generator=g).to(getattr(torch, dtype))
        state.setdefault(top, {})[name] = t
    return state


def _walk(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for k in sorted(tree, key=str):
            yield from _walk(tree[k], f"{path}/{k}")
    else:
        yield path, tree


def digest(state: Any) -> str:
    """crc32c over every leaf in key order: key path, dtype, shape and bytes of each tensor,
    ``repr`` of every other value.  Equal digests: bitwise the same state."""
    import torch

    from xla_ckpt.format.crc import crc32c
    from xla_ckpt.testing.asserts import tensor_bits

    c = 0
    n = 0
    for path, v in _walk(state):
        if isinstance(v, torch.Tensor):
            c = crc32c(f"{path}:{v.dtype}:{tuple(v.shape)}".encode(), c)
            c = crc32c(tensor_bits(v), c)
        else:
            c = crc32c(f"{path}={v!r}".encode(), c)
        n += 1
    return f"{c:08x}/{n}"


# ---- on every rank ----------------------------------------------------------------------------
#: What a rank keeps between calls (the pool reuses its processes).
_HELD: dict[str, Any] = {}
#: Seconds this rank spent in each step of the striped plan in the last restore (see
#: :func:`_time_striped_steps`).
_PHASES: dict[str, float] = {}


def _time_striped_steps() -> None:
    """Wrap the steps of the replicated state's restore (``xla_ckpt.restore.blobs``) to time
    them on this rank (wall seconds, summed per step into ``_PHASES``): ``negotiate`` (host
    shared memory), ``allocate``, ``read`` (this rank's own reads, without waiting for the
    others), ``exchange`` (the cross-host collective, waiting included), ``finish`` (unmap,
    seal and map the host's copy), ``rebuild`` (``materialize_item``).  Timing only: every
    call goes through unchanged."""
    import functools

    from xla_ckpt.restore import blobs, box_striped

    def timed(step: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _PHASES[step] = _PHASES.get(step, 0.0) + time.perf_counter() - t0
        return wrapper

    cls = blobs._Blobs
    cls._allocate = timed("allocate", cls._allocate)  # type: ignore[method-assign]  # timing wrapper, this run only
    cls._seal_and_map = timed("finish", cls._seal_and_map)  # type: ignore[method-assign]  # same
    box_striped.read_requests = timed("read", box_striped.read_requests)  # same
    box_striped._exchange_flat = timed("exchange", box_striped._exchange_flat)  # same
    blobs.negotiate = timed("negotiate", blobs.negotiate)  # same
    blobs.materialize_item = timed("rebuild", blobs.materialize_item)  # same


def _join(spec: dict) -> Any:
    """This rank's Dist (gloo).  On first use: stdout goes to stderr (gloo's connection lines
    would mix with the parent's JSON lines) and, if the launcher cannot, this rank's emulated
    host's environment is set as ``WorkerPool(hosts=H)`` sets it."""
    from xla_ckpt.comm import DistConfig, get_dist

    if not _HELD.get("joined"):
        sys.stdout.flush()
        os.dup2(2, 1)
        if spec["set_host_env"]:
            from xla_ckpt.testing.fault_proxy import host_address

            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            hosts = spec["hosts"]
            host = rank * hosts // world
            os.environ.update(GROUP_RANK=str(host), LOCAL_RANK=str(rank % (world // hosts)),
                              LOCAL_WORLD_SIZE=str(world // hosts))
            if hosts > 1:
                os.environ["XLA_CKPT_GCS_SOURCE_ADDRESS"] = host_address(host)
        if spec.get("all_gather") == "broadcast":  # the experiment of --all-gather broadcast
            from xla_ckpt.comm.base import Dist
            from xla_ckpt.comm.torch_dist import TorchDist

            TorchDist.all_gather_tensors = Dist.all_gather_tensors  # type: ignore[method-assign]  # an A/B knob of this benchmark only
        _time_striped_steps()
        _HELD["joined"] = True
    return get_dist(DistConfig(backend="gloo", timeout_s=spec["dist_timeout_s"]))


def _trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _touch(state: Any) -> None:
    """Read one byte per 4 KiB page of every tensor (a lazily mapped page is paid for)."""
    import torch

    for _, v in _walk(state):
        if isinstance(v, torch.Tensor) and v.numel():
            v.detach().reshape(-1).view(torch.uint8).numpy()[::4096].sum()


def _config(plan: str, spec: dict) -> Any:
    from xla_ckpt.restore import RestoreConfig
    from xla_ckpt.restore.cost import Bandwidths

    return RestoreConfig(**_STRATEGY[plan], cost_model=Bandwidths(**spec["bandwidths"]))


def _restore_once(plan: str, uri: str, spec: dict, d: Any) -> tuple[dict, Any]:
    from xla_ckpt.restore import restore

    _trim()
    d.barrier()
    _PHASES.clear()
    t0 = time.perf_counter()
    res = restore(uri, dist=d, config=_config(plan, spec))
    t_restore = time.perf_counter() - t0
    _touch(res.state)
    seconds = time.perf_counter() - t0
    st = res.stats
    out = {"seconds": seconds, "digest": digest(res.state),
           "plan_ran": getattr(st, "plan", "") or res.strategy, "strategy": res.strategy,
           "reason": str(res.reason)[:600],
           "bytes_read": st.bytes_read, "bytes_received": st.bytes_received,
           "bytes_mapped": st.bytes_mapped, "read_seconds": st.read_seconds,
           "restore_seconds": t_restore, "stats_seconds": st.seconds,
           "striped_steps_s": {k: round(v, 3) for k, v in _PHASES.items()},
           "stats_plan": getattr(st, "plan", ""), "stats_predicted_s": getattr(st, "predicted_s",
                                                                                0.0),
           "stats_predictions": dict(getattr(st, "predictions", {}) or {})}
    return out, res


def setup(spec: dict) -> dict:
    """Join, warm every plan up on the small checkpoint (digest checked), then the probes of
    this rank's side: the data plane, host shared memory and the fixed cost of a restore.

    * data plane: the host leaders (lowest rank of each host) all-gather ``probe_bytes`` (each
      contributes 1/hosts of it, one contiguous range, as the striped exchange does) with
      ``Dist.all_gather_tensors`` on their subgroup, then rank 0 broadcasts ``probe_bytes`` to
      them; seconds of 3 rounds after one untimed round;
    * host shared memory: each host leader fills and seals a memfd segment of
      ``intra_probe_bytes``; then every rank maps it (``map_private``, every page mapped in, as
      the end of every host-sharing restore does), all ranks at once; seconds of 3 rounds
      after one untimed round;
    * fixed cost: every plan but ``auto`` restores the small checkpoint again,
      ``fixed_probe_rounds`` times, timed as the timed runs are (``seconds``).
    """
    import torch

    from xla_ckpt.comm.host_memory import Segment, WritableMapping, map_private, open_segment

    torch.set_num_threads(1)
    d = _join(spec)
    warm = {}
    for plan in spec["plans"]:
        out, res = _restore_once(plan, spec["warm_uri"], spec, d)
        del res
        _trim()
        if out["digest"] != spec["warm_digest"]:
            raise RuntimeError(f"rank {d.rank}: warm-up restore with {plan} gave digest "
                               f"{out['digest']}, saved {spec['warm_digest']}")
        warm[plan] = out["plan_ran"]
    topo = d.topology
    probe: dict[str, Any] = {}
    hosts, rph = spec["hosts"], spec["ranks_per_host"]
    if hosts > 1:
        leaders = [h * rph for h in range(hosts)]
        sub = d.subgroup(leaders)
        if sub is not None:
            part = spec["probe_bytes"] // hosts
            mine = sub.rank
            flat = torch.zeros(part * hosts, dtype=torch.uint8)
            flat[mine * part:(mine + 1) * part] = mine + 1
            parts = [[flat[r * part:(r + 1) * part]] for r in range(hosts)]
            whole = torch.full((part * hosts,), 7 if sub.rank == 0 else 0, dtype=torch.uint8)
            gather_s, bcast_s = [], []
            for i in range(4):
                sub.barrier()
                t0 = time.perf_counter()
                sub.all_gather_tensors(parts, spec["bucket_bytes"])
                t = time.perf_counter() - t0
                sub.barrier()
                t1 = time.perf_counter()
                sub.broadcast_tensors([whole], src=0, bucket_size_bytes=spec["bucket_bytes"])
                b = time.perf_counter() - t1
                if i:
                    gather_s.append(t)
                    bcast_s.append(b)
            ok = all(bool((parts[r][0] == r + 1).all()) for r in range(hosts)) \
                and bool((whole == 7).all())
            probe = {"all_gather_s": gather_s, "broadcast_s": bcast_s, "ok": ok}
            del parts, whole, flat
        d.barrier()
    _trim()
    # host shared memory: every rank maps its leader's sealed segment, all at once
    n = spec["intra_probe_bytes"]
    leader = d.rank // rph * rph
    seg = None
    if d.rank == leader:
        seg = Segment("xla_ckpt-probe")
        seg.size_for([n])
        mapping = WritableMapping(seg.fd, [n])
        mapping.data.fill_(d.rank % 251 + 1)
        mapping.close()
        seg.seal()
    handles = d.exchange(seg.handle if seg is not None else None)
    fd = seg.fd if seg is not None else open_segment(handles[leader])
    map_s: list[float] = []
    try:
        for i in range(4):
            d.barrier()
            t0 = time.perf_counter()
            views = map_private(fd, [n])
            t = time.perf_counter() - t0
            if i:
                map_s.append(t)
            if i == 0 and int(views[0][n // 2]) != leader % 251 + 1:
                raise RuntimeError(f"rank {d.rank}: host shared-memory probe mapped wrong bytes")
            del views
            gc.collect()
    finally:
        if seg is not None:
            seg.close()
        else:
            os.close(fd)
    d.barrier()
    # the fixed cost: the small checkpoint again, every first use done
    fixed: dict[str, list[float]] = {}
    for _ in range(spec["fixed_probe_rounds"]):
        for plan in spec["plans"]:
            if plan != "auto":
                out, res = _restore_once(plan, spec["warm_uri"], spec, d)
                del res
                _trim()
                fixed.setdefault(plan, []).append(out["seconds"])
    d.barrier()
    return {"pid": os.getpid(), "rank": d.rank, "host_id": topo.host_id,
            "local_rank": topo.local_rank, "local_world_size": topo.local_world_size,
            "source_address": os.environ.get("XLA_CKPT_GCS_SOURCE_ADDRESS", ""),
            "warm_plans": warm, "probe": probe, "map_s": map_s, "fixed_s": fixed}


def storage_probe(spec: dict) -> dict:
    """How much longer the hosts' reads take when every host reads than when one does.

    Shaping on, as in the timed runs.  Every rank reads ``storage_probe_bytes`` of the
    checkpoint's largest data file (rank ``r`` from offset ``r x size / world``, wrapping) with
    its own GCS client and the library's ``Storage.read_ranges`` (``max_workers`` streams,
    ``slice_size_bytes`` slices).  Each round has two legs, each after a barrier: ``one``,
    only the ranks of host 0 read; ``all``, every rank reads.  One untimed ``all`` leg first
    (connections), then ``storage_probe_rounds`` rounds.  Returns this rank's seconds per leg
    (None for a leg it sat out) and the bytes it read; the parent turns the difference of the
    slowest ranks' seconds into the cost model's ``storage_total_bytes_per_s``.
    """
    import torch

    from xla_ckpt.storage import open_storage
    from xla_ckpt.storage.base import RangeRead

    d = _join(spec)
    name, size = spec["probe_file"], spec["probe_file_bytes"]
    n = min(spec["storage_probe_bytes"], size)
    buf = torch.empty(n, dtype=torch.uint8)
    out = memoryview(buf.numpy().data).cast("B")
    start = d.rank * size // d.world_size
    first = min(n, size - start)
    reads = [RangeRead(name, start, out[:first])]
    if first < n:
        reads.append(RangeRead(name, 0, out[first:]))
    in_one = d.rank < spec["ranks_per_host"]  # host 0's ranks
    st = open_storage(spec["uri"])
    secs: dict[str, list[float | None]] = {"one": [], "all": []}
    try:
        d.barrier()
        st.read_ranges(reads)
        for _ in range(spec["storage_probe_rounds"]):
            for leg in ("one", "all"):
                d.barrier()
                if leg == "all" or in_one:
                    t0 = time.perf_counter()
                    st.read_ranges(reads)
                    secs[leg].append(time.perf_counter() - t0)
                else:
                    secs[leg].append(None)
    finally:
        st.close()
    del buf, out, reads
    _trim()
    d.barrier()
    return {"seconds": secs, "bytes": n}


def run_plan(plan: str, spec: dict) -> dict:
    """One timed restore of ``plan`` on every rank; the restored state is dropped after."""
    d = _join(spec)
    out, res = _restore_once(plan, spec["uri"], spec, d)
    out["ok"] = out["digest"] == spec["digest"]
    del res
    _trim()
    d.barrier()  # every rank has let its copy go before the parent's next baseline
    return out


# ---- balance: bytes read per rank (issue 23) --------------------------------------------------
BALANCE_PLANS = ("all_ranks", "per_host", "broadcast", "striped")
BALANCE_TOLERANCE = 0.25


def balance_state(vectors_first: bool, *, empty: bool = False) -> dict[str, Any]:
    """The issue's state: 48 fp32 vectors of 256 KiB and 6 matrices of 4 MiB (zeros:
    ``empty``), the vectors first or the matrices first."""
    import torch

    def value(i: int, shape: tuple[int, ...]) -> Any:
        if empty:
            return torch.zeros(shape)
        return (torch.arange(math.prod(shape), dtype=torch.float32) * 0.5 + i).reshape(shape)

    vecs = {f"v{i:02d}": value(i, (65536,)) for i in range(48)}
    mats = {f"m{j}": value(100 + j, (1024, 1024)) for j in range(6)}
    return {**vecs, **mats} if vectors_first else {**mats, **vecs}


def balance_save(uri: str, vectors_first: bool) -> None:
    from xla_ckpt.restore import save_distributed

    save_distributed(balance_state(vectors_first), uri, dist=_join_plain())


def _join_plain() -> Any:
    from xla_ckpt.comm import DistConfig, get_dist

    if not _HELD.get("quiet"):
        sys.stdout.flush()
        os.dup2(2, 1)  # gloo's connection lines would mix with the parent's JSON lines
        _HELD["quiet"] = True
    return get_dist(DistConfig(backend="gloo"))


def balance_restore(uri: str, vectors_first: bool, into: bool, plan: str) -> dict:
    """One restore on this rank: its bytes read and whether it holds the saved values."""
    import torch

    from xla_ckpt.restore import RestoreConfig, restore

    d = _join_plain()
    targets = balance_state(vectors_first, empty=True) if into else None
    res = restore(uri, dist=d, into=targets, config=RestoreConfig(**_STRATEGY[plan]))
    got = targets if targets is not None else res.state
    want = balance_state(vectors_first)
    ok = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    return {"read": res.stats.bytes_read, "plan_ran": res.stats.plan, "ok": ok}


def balance_lines(ranks: int, plans: list[str]) -> list[dict]:
    """Every case of the balance part (see the module docstring), as JSON-ready lines."""
    import tempfile

    from xla_ckpt.testing.launcher import WorkerPool

    out: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, WorkerPool(ranks, xla=False) as pool:
        for vectors_first in (True, False):
            uri = os.path.join(tmp, "vectors_first" if vectors_first else "matrices_first")
            for r in pool.run(balance_save, uri, vectors_first):
                r.unwrap()
            for plan in plans:
                for into in (False, True):
                    got = [r.unwrap() for r in pool.run(balance_restore, uri, vectors_first,
                                                        into, plan)]
                    reads = [g["read"] for g in got]
                    mean = sum(reads) / len(reads)
                    readers = [n for n in reads if n]
                    rmean = sum(readers) / len(readers) if readers else 0.0
                    out.append({
                        "kind": "balance", "plan": plan, "plan_ran": got[0]["plan_ran"],
                        "into": into, "order": "vectors_first" if vectors_first
                        else "matrices_first", "ranks": ranks,
                        "bytes_read_per_rank": reads,
                        "mb_read_per_rank": [round(n / 1e6, 1) for n in reads],
                        "bytes_read_job": sum(reads),
                        "max_over_mean": round(max(reads) / mean, 3) if mean else None,
                        "readers": len(readers),
                        "readers_max_over_mean": round(max(readers) / rmean, 3)
                        if rmean else None,
                        "balanced": bool(readers) and all(abs(n - rmean) <= BALANCE_TOLERANCE
                                                          * rmean for n in readers),
                        "bitwise_ok": all(g["ok"] for g in got)})
                    print(f"# balance {plan} into={into} {out[-1]['order']}: "
                          f"{out[-1]['mb_read_per_rank']} MB", file=sys.stderr, flush=True)
    return out


# ---- parent ----------------------------------------------------------------------------------
class PssSampler:
    """Sum over ``pids`` of ``/proc/<pid>/smaps_rollup`` Pss (bytes), peak over a window.

    ``with sampler.window() as w: ...`` samples every ``interval_s`` on a thread; ``w.peak``
    and ``w.base`` (the sum just before) are bytes.
    """

    def __init__(self, pids: list[int], interval_s: float = 0.05) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.base = 0
        self.peak = 0

    def read(self) -> int:
        total = 0
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    m = re.search(r"^Pss:\s+(\d+)", f.read(), re.M)
            except OSError:
                continue
            if m:
                total += int(m.group(1)) * 1024
        return total

    @contextlib.contextmanager
    def window(self, *, active: bool = True) -> Iterator[PssSampler]:
        if not active:  # a timed run: no sampling (one read of 8 ranks costs ~0.2 s of CPU)
            self.base = self.peak = 0
            yield self
            return
        stop = threading.Event()
        self.base = self.peak = self.read()

        def loop() -> None:
            while not stop.wait(self.interval_s):
                self.peak = max(self.peak, self.read())

        th = threading.Thread(target=loop, name="pss-sampler", daemon=True)
        th.start()
        try:
            yield self
        finally:
            stop.set()
            th.join(5)
            self.peak = max(self.peak, self.read())


def _launcher_has_hosts() -> bool:
    from xla_ckpt.testing.launcher import WorkerPool

    return "hosts" in {f.name for f in dataclasses.fields(WorkerPool)}


def _pool(world: int, hosts: int, env: dict[str, str], has_hosts: bool) -> Any:
    from xla_ckpt.testing.launcher import WorkerPool

    kw: dict[str, Any] = {"hosts": hosts} if has_hosts else {}
    return WorkerPool(world, xla=False, env=env, **kw)


def bandwidths(a: argparse.Namespace, cross_bytes_per_s: float | None,
               total_bytes_per_s: float | None = None, intra_bytes_per_s: float | None = None,
               fixed_s: float | None = None) -> dict[str, Any]:
    """The cost model's parameters (``Bandwidths`` fields) for this run (see the docstring)."""
    from xla_ckpt.restore.cost import Bandwidths
    from xla_ckpt.storage.gcs import DEFAULT_CONFIG

    bw = Bandwidths(storage_stream_bytes_per_s=a.stream_mib_s * MiB,
                    storage_host_bytes_per_s=a.host_mib_s * MiB,
                    first_byte_latency_s=a.first_byte_latency_ms / 1000,
                    streams_per_reader=DEFAULT_CONFIG.max_workers)
    if cross_bytes_per_s is not None:
        bw = dataclasses.replace(bw, data_plane_cross_host_bytes_per_s=cross_bytes_per_s)
    if total_bytes_per_s is not None:
        bw = dataclasses.replace(bw, storage_total_bytes_per_s=total_bytes_per_s)
    if intra_bytes_per_s is not None:
        bw = dataclasses.replace(bw, data_plane_intra_host_bytes_per_s=intra_bytes_per_s)
    if fixed_s is not None:
        bw = dataclasses.replace(bw, restore_fixed_s=fixed_s)
    return dataclasses.asdict(bw)


def predictions(setup_line: dict) -> dict[str, Any]:
    """``cost.predict`` on the setup line's topology, sizes and bandwidths: plan -> estimate."""
    from xla_ckpt.restore.cost import Bandwidths, RestoreSizes, RestoreTopology, predict

    topo = RestoreTopology(hosts=setup_line["hosts"], ranks_per_host=setup_line["ranks_per_host"])
    sizes = RestoreSizes(**setup_line["sizes"])
    return predict(topo, sizes, Bandwidths(**setup_line["bandwidths"]),
                   backend_kind=setup_line["backend_kind"])


def summarise(plan: str, runs: list[dict], mem_runs: list[dict], setup_line: dict,
              est: dict[str, Any]) -> dict:
    """The JSON line of one plan from its timed runs and its (untimed) memory runs (each:
    per-rank results + proxy figures; memory runs also the PSS peak)."""
    secs = [r["seconds"] for r in runs]
    med = runs[secs.index(statistics.median_low(secs))]
    ckpt = setup_line["checkpoint_bytes"]
    ran = sorted({v["plan_ran"] for r in runs for v in r["ranks"]})
    model_plan = ran[0] if len(ran) == 1 else plan  # the plan that ran (a fallback too)
    line: dict[str, Any] = {
        "kind": "plan", "plan": plan, "plan_ran": ran[0] if len(ran) == 1 else ran,
        "seconds": round(statistics.median(secs), 3), "seconds_all": [round(s, 3) for s in secs],
        "seconds_per_rank": [round(v["seconds"], 3) for v in med["ranks"]],
        "bytes_served_per_host": med["per_host"], "bytes_served_other": med["other"],
        "bytes_per_job": med["job"],
        "bytes_per_job_x_checkpoint": round(med["job"] / ckpt, 3),
        "bytes_per_job_x_checkpoint_all": [round(r["job"] / ckpt, 3) for r in runs],
        "bytes_per_host_x_checkpoint": [round(b / ckpt, 3) for b in med["per_host"]],
        "requests": med["requests"],
        "load_average_1m_all": [round(r["load_1m"], 1) for r in runs],
        "stats_bytes_read_per_rank": [v["bytes_read"] for v in med["ranks"]],
        "stats_bytes_received_per_rank": [v["bytes_received"] for v in med["ranks"]],
        "stats_bytes_mapped_per_rank": [v["bytes_mapped"] for v in med["ranks"]],
        "stats_read_seconds_per_rank": [round(v["read_seconds"], 3) for v in med["ranks"]],
        "stats_seconds_per_rank": [round(v["stats_seconds"], 3) for v in med["ranks"]],
        "restore_seconds_per_rank": [round(v["restore_seconds"], 3) for v in med["ranks"]],
        "striped_steps_s_per_rank": [v["striped_steps_s"] for v in med["ranks"]],
        "bitwise_ok": all(v["ok"] for r in [*runs, *mem_runs] for v in r["ranks"]),
        "runs_checked_bitwise": len(runs) + len(mem_runs),
    }
    if mem_runs:
        peak = max(r["pss_peak_over_base"] for r in mem_runs)
        line["peak_host_memory_mib"] = round(peak / MiB, 1)
        line["peak_host_memory_x_state"] = round(peak / setup_line["sizes"]["state_bytes"], 2)
        line["memory_run_seconds"] = [round(r["seconds"], 3) for r in mem_runs]
    if model_plan in est:
        p = est[model_plan]
        line["predicted_s"] = round(p.seconds, 3)
        line["predicted_read_s"] = round(p.read_s, 3)
        line["predicted_exchange_s"] = round(p.exchange_s, 3)
        line["prediction_error"] = round(p.seconds / line["seconds"] - 1, 3)
    stats_pred = [v["stats_predicted_s"] for v in med["ranks"] if v["stats_predicted_s"]]
    if stats_pred:
        line["stats_predicted_s"] = round(stats_pred[0], 3)
    if plan == "auto":
        line["auto_reason"] = med["ranks"][0]["reason"]
        line["auto_predictions_s"] = {k: round(v, 3) for k, v in
                                      med["ranks"][0]["stats_predictions"].items()}
    return line


def targets(lines: dict[str, dict]) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": "summary", "summary": "targets (issue 13)"}
    s = lines.get("striped")
    for peer in ("all_ranks", "broadcast"):
        if s is not None and peer in lines:
            r = round(s["seconds"] / lines[peer]["seconds"], 3)
            out[f"striped_vs_{peer}"] = {"ratio": r, "target": f"<= {TARGET_RATIO}",
                                         "met": r <= TARGET_RATIO}
    if s is not None:
        x = s["bytes_per_job_x_checkpoint"]
        out["striped_bytes_per_job"] = {"x_checkpoint": x, "target": "1.0x",
                                        "met": round(x, 2) == 1.0}
    if "per_host" in lines:
        worst = max(lines["per_host"]["bytes_per_host_x_checkpoint"])
        out["per_host_bytes_per_host"] = {"x_checkpoint_max": worst, "target": "<= 1.0x",
                                          "met": round(worst, 2) <= 1.0}
    errs = {p: v["prediction_error"] for p, v in lines.items() if "prediction_error" in v}
    if errs:
        worst_p = max(errs, key=lambda p: abs(errs[p]))
        out["predictions_within_30_percent"] = {
            "errors": errs, "worst": {worst_p: errs[worst_p]},
            "target": f"+-{TARGET_ERROR:.0%}",
            "met": all(abs(e) <= TARGET_ERROR for e in errs.values())}
    out["bitwise_ok"] = {p: v["bitwise_ok"] for p, v in lines.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256, help="state size, MiB (default 256)")
    ap.add_argument("--hosts", type=int, default=4, help="emulated hosts (default 4)")
    ap.add_argument("--ranks-per-host", type=int, default=2, help="ranks per host (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each plan (default 3)")
    ap.add_argument("--plans", default=",".join(PLANS),
                    help=f"plans, in run order (of {', '.join(PLANS)})")
    ap.add_argument("--first-byte-latency-ms", type=float, default=30.0)
    ap.add_argument("--stream-mib-s", type=float, default=32.0)
    ap.add_argument("--host-mib-s", type=float, default=64.0,
                    help="each emulated host's link to storage, MiB/s")
    ap.add_argument("--probe-mib", type=int, default=0,
                    help="bytes of the data-plane probe (all-gather over host leaders) and of the "
                         "host shared-memory probe, MiB (default 0: the state's size, what the "
                         "striped exchange moves and every rank maps)")
    ap.add_argument("--data-plane-mib-s", type=float, default=None,
                    help="cost model's cross-host data-plane rate, MiB/s (default: the probe's)")
    ap.add_argument("--intra-host-mib-s", type=float, default=None,
                    help="cost model's intra-host rate (a rank mapping its host's copy, every "
                         "rank at once), MiB/s (default: the probe's)")
    ap.add_argument("--storage-probe-mib", type=int, default=32,
                    help="MiB each rank reads in the storage probe (shaping on: host 0's ranks "
                         "alone, then every rank): how much longer every host takes is the "
                         "cost model's storage_total_bytes_per_s (default 32; 0: no probe, "
                         "GCS's 25e9)")
    ap.add_argument("--storage-total-mib-s", type=float, default=None,
                    help="cost model's storage_total_bytes_per_s, MiB/s (default: the probe's)")
    ap.add_argument("--fixed-s", type=float, default=None,
                    help="cost model's restore_fixed_s, seconds (default: the probe's, from "
                         "timed restores of the small warm-up checkpoint)")
    ap.add_argument("--memory-runs", type=int, default=1,
                    help="untimed runs of each plan, after the timed ones, with host memory "
                         "(PSS) sampled (default 1; 0: no memory figures)")
    ap.add_argument("--all-gather", choices=("default", "broadcast"), default="default",
                    help="experiment: 'broadcast' replaces TorchDist.all_gather_tensors in every "
                         "rank by the base Dist path (one bucketed broadcast per source rank), "
                         "for an A/B of the striped exchange; default: the library's own")
    ap.add_argument("--balance", choices=("on", "off", "only"), default="on",
                    help="bytes read per rank of the issue-23 state, every plan, plain and "
                         "into live targets (default on: before the timed plans; only: "
                         "nothing else)")
    ap.add_argument("--balance-ranks", type=int, default=4,
                    help="gloo ranks of the balance part (one host; default 4)")
    ap.add_argument("--run-timeout-s", type=float, default=600.0,
                    help="limit of one restore call on the ranks (they are killed past it)")
    a = ap.parse_args(argv)
    plans = [p for p in a.plans.split(",") if p]
    for p in plans:
        if p not in PLANS:
            ap.error(f"unknown plan {p!r}; choose from {', '.join(PLANS)}")
    if a.hosts < 1 or a.ranks_per_host < 1 or a.repeats < 1 or a.size_mib < 1:
        ap.error("--hosts, --ranks-per-host, --repeats and --size-mib must be >= 1")
    if a.memory_runs < 0 or a.storage_probe_mib < 0 or a.probe_mib < 0:
        ap.error("--memory-runs, --probe-mib and --storage-probe-mib must be >= 0")
    world = a.hosts * a.ranks_per_host
    if a.balance != "off":
        bal = balance_lines(a.balance_ranks, [p for p in BALANCE_PLANS if p in plans]
                            or list(BALANCE_PLANS))
        for line in bal:
            print(json.dumps(line), flush=True)
        print(json.dumps({
            "kind": "balance_summary", "target": "every reader within 25 % of the readers' "
            "mean share, plain and into live targets (issue 23)",
            "striped_max_over_mean": max(x["max_over_mean"] or 0 for x in bal
                                         if x["plan"] == "striped") if any(
                x["plan"] == "striped" for x in bal) else None,
            "met": all(x["balanced"] for x in bal),
            "bitwise_ok": all(x["bitwise_ok"] for x in bal)}), flush=True)
        if a.balance == "only":
            return 0 if all(x["bitwise_ok"] for x in bal) else 1

    import torch

    from xla_ckpt.api import save
    from xla_ckpt.format import MANIFEST_NAME
    from xla_ckpt.restore import RestoreConfig
    from xla_ckpt.storage import open_storage
    from xla_ckpt.storage.gcs import DEFAULT_CONFIG
    from xla_ckpt.testing.fault_proxy import FaultProxy, Shaping, host_address
    from xla_ckpt.testing.gcs_emulator import GCSEmulator

    torch.set_num_threads(1)
    shaping = Shaping(first_byte_latency_s=a.first_byte_latency_ms / 1000,
                      stream_mib_s=a.stream_mib_s, host_mib_s=a.host_mib_s)
    has_hosts = _launcher_has_hosts()
    failed: dict[str, str] = {}
    lines: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        emu = stack.enter_context(GCSEmulator())
        proxy = stack.enter_context(FaultProxy(emu.host, shaping=shaping))
        os.environ.update(emu.env())
        os.environ.update(proxy.env())  # the parent saves through the proxy (uploads unshaped)
        os.environ.pop("XLA_CKPT_GCS_SOURCE_ADDRESS", None)
        base = emu.unique_uri("striped")
        uri, warm_uri = f"{base}/ckpt", f"{base}/warm"
        t0 = time.perf_counter()
        state = make_state(a.size_mib)
        expected = digest(state)
        manifest = save(state, uri)
        del state
        warm = make_state(WARM_MIB, seed=1)
        warm_digest = digest(warm)
        warm_manifest = save(warm, warm_uri)
        del warm
        gc.collect()
        st = open_storage(uri)
        try:
            manifest_bytes = st.stat(MANIFEST_NAME).size
        finally:
            st.close()
        data_bytes = sum(manifest.files.values())
        state_bytes = manifest.item().nbytes
        n_tensors = len(manifest.item().tensors)
        print(f"# saved {state_bytes / MiB:.1f} MiB ({n_tensors} tensors) in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

        env = {**emu.env(), **proxy.env(), "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        pool = _pool(world, a.hosts, env, has_hosts)
        stack.callback(lambda: pool.close())
        bucket = RestoreConfig().bucket_size_bytes
        probe_bytes = max(a.hosts, min(a.probe_mib * MiB, state_bytes) if a.probe_mib
                          else state_bytes)
        probe_bytes -= probe_bytes % a.hosts  # each leader sends an equal part
        spec: dict[str, Any] = {
            "hosts": a.hosts, "ranks_per_host": a.ranks_per_host, "set_host_env": not has_hosts,
            "dist_timeout_s": a.run_timeout_s, "plans": plans, "uri": uri, "digest": expected,
            "warm_uri": warm_uri, "warm_digest": warm_digest, "bucket_bytes": bucket,
            "probe_bytes": probe_bytes, "bandwidths": bandwidths(a, None),
            "intra_probe_bytes": probe_bytes, "fixed_probe_rounds": FIXED_PROBE_ROUNDS,
            "all_gather": a.all_gather}
        t0 = time.perf_counter()
        info = [r.unwrap() for r in pool.run(setup, spec, timeout_s=a.run_timeout_s * 2)]
        pids = [i["pid"] for i in info]
        probe = info[0]["probe"]
        cross: float | None = None
        probe_line: dict[str, Any] = {}
        if probe:
            if not probe["ok"]:
                raise SystemExit("data-plane probe moved wrong bytes")
            g = statistics.median(probe["all_gather_s"])
            b = statistics.median(probe["broadcast_s"])
            pb = spec["probe_bytes"]
            cross = (a.hosts - 1) / a.hosts * pb / g
            probe_line = {"probe_bytes": pb, "all_gather_s": round(g, 4),
                          "all_gather_host_link_mib_s": round(cross / MiB, 1),
                          "broadcast_s": round(b, 4),
                          "broadcast_mib_s": round(pb / b / MiB, 1)}
        if a.data_plane_mib_s is not None:
            cross = a.data_plane_mib_s * MiB
        # host shared memory: the slowest rank's seconds to map its host's copy, per round
        map_s = statistics.median(max(i["map_s"][k] for i in info)
                                  for k in range(len(info[0]["map_s"])))
        intra = probe_bytes / map_s
        intra_line = {"probe_bytes": probe_bytes, "map_s": round(map_s, 4),
                      "intra_host_mib_s": round(intra / MiB, 1), "ranks_mapping_at_once": world}
        if a.intra_host_mib_s is not None:
            intra = a.intra_host_mib_s * MiB
        total: float | None = None
        storage_line: dict[str, Any] = {}
        if a.storage_probe_mib > 0:  # the series term: every host reading vs one host reading
            probe_file = max(manifest.files, key=lambda f: manifest.files[f])
            spec.update(probe_file=probe_file, probe_file_bytes=manifest.files[probe_file],
                        storage_probe_bytes=a.storage_probe_mib * MiB,
                        storage_probe_rounds=STORAGE_PROBE_ROUNDS)
            got = [r.unwrap() for r in pool.run(storage_probe, spec, timeout_s=a.run_timeout_s)]
            n_rank = got[0]["bytes"]
            legs = {leg: [max(x for g in got if (x := g["seconds"][leg][k]) is not None)
                          for k in range(STORAGE_PROBE_ROUNDS)] for leg in ("one", "all")}
            one, every = (statistics.median(legs[leg]) for leg in ("one", "all"))
            extra_bytes = n_rank * (world - a.ranks_per_host)
            slower = every - one
            total = extra_bytes / slower if slower > 0 else None
            storage_line = {"bytes_per_rank": n_rank, "streams_per_rank":
                            DEFAULT_CONFIG.max_workers, "ranks_one_host": a.ranks_per_host,
                            "ranks_every_host": world, "shaping": "on (as in the timed runs)",
                            "one_host_s": [round(x, 3) for x in legs["one"]],
                            "every_host_s": [round(x, 3) for x in legs["all"]],
                            "slower_s": round(slower, 3), "extra_job_bytes": extra_bytes,
                            "marginal_mib_s": round(total / MiB, 1) if total else None}
            if total is None:
                print("# storage probe: every host reading was not slower than one host "
                      "reading; storage_total_bytes_per_s keeps its default", file=sys.stderr,
                      flush=True)
        if a.storage_total_mib_s is not None:
            total = a.storage_total_mib_s * MiB
        # the fixed cost: the small checkpoint's restores minus what the model gives their
        # bytes (every other parameter as probed above)
        partial = bandwidths(a, cross, total, intra, 0.0)
        warm_sizes = {"state_bytes": warm_manifest.item().nbytes,
                      "request_bytes": DEFAULT_CONFIG.slice_size_bytes, "bucket_bytes": bucket}
        warm_est = predictions({"hosts": a.hosts, "ranks_per_host": a.ranks_per_host,
                                "sizes": warm_sizes, "bandwidths": partial,
                                "backend_kind": "gloo"})
        small = {p: statistics.median(max(i["fixed_s"][p][k] for i in info)
                                      for k in range(FIXED_PROBE_ROUNDS))
                 for p in info[0]["fixed_s"]}
        residual = {p: t - warm_est[p].seconds for p, t in small.items() if p in warm_est}
        fixed: float | None = max(0.0, statistics.median(residual.values())) if residual \
            else None  # (--plans auto alone: no plan of the model to probe with)
        fixed_line = {"state_bytes": warm_sizes["state_bytes"], "rounds": FIXED_PROBE_ROUNDS,
                      "seconds": {p: round(t, 3) for p, t in small.items()},
                      "model_without_fixed_s": {p: round(warm_est[p].seconds, 3)
                                                for p in small},
                      "fixed_s": round(fixed, 3) if fixed is not None else None}
        if a.fixed_s is not None:
            fixed = a.fixed_s
        spec["bandwidths"] = bandwidths(a, cross, total, intra, fixed)
        addresses = {host_address(h): h for h in range(a.hosts)} if a.hosts > 1 else {}
        bound = [i["source_address"] for i in info]
        setup_line: dict[str, Any] = {
            "kind": "setup", "hosts": a.hosts, "ranks_per_host": a.ranks_per_host,
            "world_size": world, "repeats": a.repeats, "plans": plans,
            "state_mib": round(state_bytes / MiB, 1), "tensors": n_tensors,
            "checkpoint_bytes": data_bytes + manifest_bytes, "data_bytes": data_bytes,
            "manifest_bytes": manifest_bytes,
            "shaping": {"first_byte_latency_s": shaping.first_byte_latency_s,
                        "stream_mib_s": shaping.stream_mib_s, "host_mib_s": shaping.host_mib_s},
            "sizes": {"state_bytes": state_bytes,
                      "request_bytes": DEFAULT_CONFIG.slice_size_bytes, "bucket_bytes": bucket},
            "bandwidths": spec["bandwidths"], "backend_kind": "gloo",
            "data_plane_probe": probe_line, "storage_probe": storage_line,
            "intra_host_probe": intra_line, "fixed_probe": fixed_line,
            "storage_total_source": ("--storage-total-mib-s" if a.storage_total_mib_s
                                     is not None else "probe" if total is not None
                                     else "default"),
            "intra_host_source": ("--intra-host-mib-s" if a.intra_host_mib_s is not None
                                  else "probe"),
            "fixed_source": ("--fixed-s" if a.fixed_s is not None else "probe"
                             if fixed_line["fixed_s"] is not None else "default"),
            "data_plane_source": ("--data-plane-mib-s" if a.data_plane_mib_s is not None
                                  else "probe" if probe_line else "default"),
            "host_of_rank": [i["host_id"] for i in info],
            "source_address_of_rank": bound,
            "launcher_hosts_argument": has_hosts,
            "warm_up_plans_ran": info[0]["warm_plans"], "all_gather": a.all_gather,
            "cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 1),
            "setup_seconds": round(time.perf_counter() - t0, 1)}
        print(json.dumps(setup_line), flush=True)
        if a.hosts > 1 and any(x != host_address(i["host_id"]) for x, i in zip(bound, info,
                                                                            strict=True)):
            print("# WARNING: ranks are not bound to their host's source address; bytes per "
                  "host and the host caps are wrong", file=sys.stderr, flush=True)
        est = predictions(setup_line)

        state_of = {"pool": pool, "sampler": PssSampler(pids)}

        def one_run(plan: str, *, sample: bool) -> dict | None:
            """One run of ``plan`` on every rank; its figures, or None if it failed."""
            proxy.reset_log()
            load = os.getloadavg()[0]
            sampler = state_of["sampler"]
            with sampler.window(active=sample) as w:
                res = state_of["pool"].run(run_plan, plan, spec, timeout_s=a.run_timeout_s)
            bad = [r for r in res if not r.ok]
            if bad:
                failed[plan] = f"rank {bad[0].rank}: {bad[0].error!r}"[:1500]
                print(json.dumps({"kind": "plan", "plan": plan, "failed": failed[plan]}),
                      flush=True)
                if state_of["pool"].broken:
                    state_of["pool"] = _pool(world, a.hosts, env, has_hosts)
                    again = [r.unwrap() for r in state_of["pool"].run(
                        setup, spec, timeout_s=a.run_timeout_s * 2)]
                    state_of["sampler"] = PssSampler([x["pid"] for x in again])
                return None
            ranks = [r.unwrap() for r in res]
            served = proxy.bytes_served_by_address()
            per_host = [served.get(host_address(h), 0) for h in range(a.hosts)] \
                if addresses else [sum(served.values())]
            other = sum(v for k, v in served.items() if k not in addresses) if addresses else 0
            run = {"ranks": ranks, "seconds": max(v["seconds"] for v in ranks),
                   "per_host": per_host, "other": other, "requests": proxy.snapshot().requests,
                   "job": sum(served.values()), "load_1m": load,
                   "pss_peak_over_base": w.peak - w.base if sample else None}
            print(f"# {plan}{' (memory run, untimed)' if sample else ''}: "
                  f"{run['seconds']:.2f} s, {run['job'] / MiB:.1f} MiB served in "
                  f"{run['requests']} requests, ran {ranks[0]['plan_ran']}, bitwise "
                  f"{all(v['ok'] for v in ranks)}", file=sys.stderr, flush=True)
            return run

        runs: dict[str, list[dict]] = {p: [] for p in plans}
        mem_runs: dict[str, list[dict]] = {p: [] for p in plans}
        for i in range(a.repeats + a.memory_runs):
            order = plans[i % len(plans):] + plans[:i % len(plans)]
            for plan in order:
                if plan not in failed:
                    memory = i >= a.repeats
                    run = one_run(plan, sample=memory)
                    if run is not None:
                        (mem_runs if memory else runs)[plan].append(run)
        pool = state_of["pool"]
        for plan in plans:
            if runs[plan] and plan not in failed:
                lines[plan] = summarise(plan, runs[plan], mem_runs[plan], setup_line, est)
    for plan, line in lines.items():
        for peer in ("all_ranks", "broadcast", "per_host"):
            if peer != plan and peer in lines:
                line[f"ratio_vs_{peer}"] = round(line["seconds"] / lines[peer]["seconds"], 3)
        print(json.dumps(line), flush=True)
    summary = targets(lines)
    summary["failed"] = failed
    print(json.dumps(summary), flush=True)
    _print_table(lines, summary)
    bitwise = all(v["bitwise_ok"] for v in lines.values())
    return 0 if bitwise and not failed else 1


def _print_table(lines: dict[str, dict], summary: dict) -> None:
    """A human-readable recap on stderr (stdout is JSON lines only)."""
    w = sys.stderr
    print("\n| plan | ran | seconds: median (runs) | predicted | error | MiB served per host "
          "| job x ckpt | peak PSS MiB | bitwise |", file=w)
    print("|---|---|---|---|---|---|---|---|---|", file=w)
    for p, v in lines.items():
        per_host = "/".join(f"{b / MiB:.0f}" for b in v["bytes_served_per_host"])
        runs = ", ".join(f"{s:.2f}" for s in v["seconds_all"])
        err = f"{v['prediction_error'] * 100:+.0f} %" if "prediction_error" in v else "-"
        print(f"| {p} | {v['plan_ran']} | {v['seconds']:.2f} ({runs}) | "
              f"{v.get('predicted_s', '-')} | {err} | {per_host} | "
              f"{v['bytes_per_job_x_checkpoint']} | {v.get('peak_host_memory_mib', '-')} | "
              f"{'yes' if v['bitwise_ok'] else 'NO'} |", file=w)
    for k, v in summary.items():
        if isinstance(v, dict) and "met" in v:
            print(f"# {k}: {'met' if v['met'] else 'NOT MET'} "
                  f"({ {x: y for x, y in v.items() if x != 'met'} })", file=w)
    w.flush()


if __name__ == "__main__":
    raise SystemExit(main())
