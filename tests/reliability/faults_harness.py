"""Faults under load: 8 ranks restore (every rank reads) through the fault-injecting proxy.

Each *round*, every rank of an 8-process gloo job restores the same
checkpoint with the ``all_ranks`` strategy (the TPU path: every rank fetches
its bytes from GCS by byte range) through one
:class:`~xla_ckpt.testing.fault_proxy.FaultProxy`, which answers a seeded
random share of the requests with HTTP 503 or 429, a connection reset after
a random number of body bytes, a short body, or a flipped body byte.  Every
rank then compares what it got with what was saved, bit for bit.

Per rank and round the outcome is one of:

* ``correct``: the restore returned and every tensor and value is identical;
* ``clean_error``: the restore raised a library error (an ``XlaCkptError``);
  then every rank must raise the same class naming the same failed ranks;
* ``silent_corruption``: the restore returned but something differs -- the
  failure this suite exists to catch;
* ``other_error`` / ``hang``: anything else, or a rank the launcher had to kill.

Status faults go to object requests only: the google client also GETs the
bucket's metadata in a background thread (span attributes for tracing) and
swallows its failures, so a fault there would test nothing of ours.

Retries are counted on the reader side from the library's own log records
(``xla_ckpt.storage.retry`` "attempt N failed"; crc32c re-reads of
``xla_ckpt.io.reader`` and ``xla_ckpt.storage.gcs``; fallbacks of a small
object's one-request read to ranged reads) and the faults on the proxy side.
Used by ``test_faults_under_load.py`` and ``benchmarks/reliability.py``.

The sharded rounds (:func:`sharded_restore_round`) restore a chunked checkpoint of DTensors
into DTensor targets of another layout on 3 ranks, each reading only its byte ranges.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from typing import Any

import torch

WORLD = 8
CHUNK_SIZE_BYTES = 256 * 1024
FAULT_KINDS = ("status_503", "status_429", "reset", "short", "flip")


def object_requests(r) -> bool:
    """Object requests (stat, list, media GET): not the google client's background GET of
    bucket metadata (for tracing span attributes), whose failures it swallows."""
    return re.search(r"/b/[^/]+/o(/|$)", r.path) is not None


def fault_state() -> dict:
    """About 3.5 MiB: 12 tensors of 128 KiB (one crc32c each) and one of 2 MiB (8 chunk crc32c)."""
    g = torch.Generator().manual_seed(77)
    layers = {f"layer{i}.w": torch.randn(128, 256, generator=g) for i in range(12)}
    return {"model": layers, "emb": torch.randn(512, 1024, generator=g),
            "extra_state": {"num_updates": 77, "lr": 0.000123, "betas": (0.9, 0.98)}}


def save_fault_checkpoint(uri: str) -> int:
    """Write :func:`fault_state` at ``uri`` with 256 KiB crc32c chunks; returns its data bytes."""
    from xla_ckpt.format.manifest import STATE_ITEM
    from xla_ckpt.io import commit, new_save_id, write_item
    from xla_ckpt.storage import open_storage

    with open_storage(uri) as st:
        sid = new_save_id()
        part = write_item(st, sid, STATE_ITEM, fault_state(), chunk_size_bytes=CHUNK_SIZE_BYTES)
        m = commit(st, sid, [part], metadata={"num_updates": 77})
    return m.nbytes


class _Counts(logging.Handler):
    """Counts the library's retry and crc32c re-read log records, by cause."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: Counter = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if record.name == "xla_ckpt.storage.retry" and "failed" in msg and "retrying" in msg:
            self.counts["retries"] += 1
            self.counts["retry:" + _cause(msg)] += 1
        elif "mismatch on a one-request read" in msg:
            self.counts["fallbacks"] += 1  # a small object's GET mismatched: read by range
        elif "crc32c mismatch" in msg:
            self.counts["crc_rereads"] += 1


def _cause(msg: str) -> str:
    for key in ("HTTP 503", "HTTP 429", "HTTP 5", "connection broke", "body ended",
                "empty body", "request failed", "crc32c"):
        if key in msg:
            return key.lower().replace(" ", "_")
    return "other"


_HANDLER: _Counts | None = None


def _counter() -> _Counts:
    global _HANDLER
    if _HANDLER is None:
        _HANDLER = _Counts()
        log = logging.getLogger("xla_ckpt")
        log.setLevel(logging.INFO)
        log.addHandler(_HANDLER)
        log.propagate = False  # counted, not printed
    _HANDLER.counts.clear()
    return _HANDLER


def restore_round(uri: str, storage_kwargs: dict, timeout_s: float, *,
                  host_shared_memory: bool | None = None) -> dict:
    """On every rank: restore ``uri`` (all_ranks), compare bitwise; never raises.

    ``host_shared_memory``: None, the library's default (True: the ranks of a host share one
    read, so on one host rank 0 alone reads); False: every rank reads the whole checkpoint
    itself (8 readers: 8 times the requests of a round)."""
    from xla_ckpt.comm import DistConfig, get_dist
    from xla_ckpt.errors import XlaCkptError
    from xla_ckpt.restore import RestoreConfig, restore
    from xla_ckpt.storage import StorageConfig
    from xla_ckpt.testing.asserts import assert_state_identical

    counter = _counter()
    d = get_dist(DistConfig(backend="gloo", timeout_s=timeout_s))
    t0 = time.monotonic()
    out: dict[str, Any] = {"rank": d.rank}
    try:
        config = None if host_shared_memory is None else RestoreConfig(
            host_shared_memory=host_shared_memory)
        r = restore(uri, dist=d, strategy="all_ranks", config=config,
                    storage_config=StorageConfig(**storage_kwargs))
    except XlaCkptError as e:
        out.update(outcome="clean_error", error=type(e).__name__, message=str(e)[:2000],
                   failed_ranks=sorted(getattr(e, "failures", {}) or {}))
    except Exception as e:  # noqa: BLE001 - what must never happen is recorded, not raised
        out.update(outcome="other_error", error=type(e).__name__, message=str(e)[:400])
    else:
        try:
            assert_state_identical(r.state, fault_state())
            out["outcome"] = "correct"
        except AssertionError as e:
            out.update(outcome="silent_corruption", message=str(e)[:400])
        out["bytes_read"] = r.stats.bytes_read
        out["plan"] = r.stats.plan  # per_host: the host shared one read; all_ranks: it did not
    out["seconds"] = time.monotonic() - t0
    out["counts"] = dict(counter.counts)
    return out


def run_rounds(pool, proxy, uri: str, *, min_faults: int, probability: float,
               storage_kwargs: dict, max_rounds: int = 1000, seed_note: str = "",
               round_timeout_s: float = 180.0, collective_timeout_s: float = 120.0,
               round_fn=None) -> dict:
    """Restore rounds until the proxy injected ``min_faults`` faults; returns the tally.

    ``pool`` is a :class:`~xla_ckpt.testing.launcher.WorkerPool` (:data:`WORLD`
    ranks for :func:`restore_round`); ``proxy`` a started :class:`FaultProxy` in front of
    the emulator holding ``uri``; ``round_fn`` what each rank runs per round
    (:func:`restore_round`, or :func:`sharded_restore_round`).
    """
    round_fn = round_fn or restore_round
    from xla_ckpt.testing.fault_proxy import Fault, downloads

    proxy.reset_log()
    proxy.random_faults(probability, [Fault.error(503), Fault.error(429, retry_after="0"),
                                      Fault.reset(), Fault.reset(rst=False), Fault.short(),
                                      Fault.flip()],
                        match=downloads(), status_match=object_requests)
    outcomes: Counter = Counter()
    plans: Counter = Counter()  # the plans the correct restores ran (where a round reports it)
    errors: Counter = Counter()
    counts: Counter = Counter()
    problems: list[str] = []
    samples: list[str] = []
    rounds = hangs = named = 0
    t0 = time.perf_counter()
    try:
        while sum(proxy.snapshot().faults.values()) < min_faults and rounds < max_rounds:
            rounds += 1
            results = pool.run(round_fn, uri, storage_kwargs, collective_timeout_s,
                               timeout_s=round_timeout_s, env=proxy.env())
            for res in results:
                if res.timed_out:
                    hangs += 1
                    outcomes["hang"] += 1
                    problems.append(f"round {rounds}: rank {res.rank} hung")
                    continue
                if res.error is not None:
                    outcomes["other_error"] += 1
                    problems.append(f"round {rounds}: rank {res.rank} died: {res.error}")
                    continue
                v = res.value
                outcomes[v["outcome"]] += 1
                counts.update(v["counts"])
                if v["outcome"] == "clean_error":
                    errors[v["error"]] += 1
                    named += bool(v.get("failed_ranks"))
                    if v["rank"] == 0 and len(samples) < 10:
                        samples.append(f"round {rounds}: {v['error']}: {v['message']}")
                elif v["outcome"] == "correct":
                    plans.update([v["plan"]] if "plan" in v else [])
                else:
                    problems.append(f"round {rounds}: rank {v['rank']}: {v['outcome']}: "
                                    f"{v.get('error', '')} {v['message']}")
            verdicts = {(r.value["outcome"], r.value.get("error"),
                         tuple(r.value.get("failed_ranks", ())))
                        for r in results if r.error is None}
            if any(v[0] == "clean_error" for v in verdicts) and len(verdicts) > 1:
                problems.append(f"round {rounds}: ranks disagree on the outcome: {verdicts}")
            if pool.broken:
                problems.append(f"round {rounds}: the worker pool broke")
                break
    finally:
        proxy.clear_faults()
    snap = proxy.snapshot()
    faults = {k: snap.faults.get(k, 0) for k in FAULT_KINDS}
    # Body faults on one-request reads of small objects (no Range header: manifests).
    one_request = {k: sum(1 for r in proxy.records() if r.fault == k and r.range is None)
                   for k in ("flip", "short")}
    return {"rounds": rounds, "restores": rounds * pool.world_size, "outcomes": dict(outcomes),
            "plans": dict(plans), "clean_errors": dict(errors), "errors_naming_ranks": named,
            "faults": faults,
            "faults_total": sum(snap.faults.values()), "requests": snap.requests,
            "retries": counts.get("retries", 0), "crc_rereads": counts.get("crc_rereads", 0),
            "fallbacks": counts.get("fallbacks", 0), "one_request_faults": one_request,
            "retry_causes": {k[6:]: v for k, v in counts.items() if k.startswith("retry:")},
            "hangs": hangs, "silent_corruptions": outcomes.get("silent_corruption", 0),
            "problems": problems[:20], "error_samples": samples, "probability": probability,
            "seconds": time.perf_counter() - t0, "note": seed_note}


# ---- sharded: every rank reads only the byte ranges of its own shards --------------------------
#
# A checkpoint saved by ``SHARDED_WORLD`` ranks with ``save_distributed`` from DTensor state
# (chunked, manifest v2: each rank wrote its own chunks, the replicated tensor was written
# once) is restored by the same ranks into DTensor targets of *another* layout, so each rank
# reads only byte ranges, through the proxy: ``a`` Shard(0) -> Shard(0) (its own chunk's
# ranges), ``b`` saved Shard(1) -> Shard(0) (a run of rows of every saved column chunk: a
# sub-range of each), ``c`` Shard(0) -> Replicate() (every chunk, whole), ``r`` Replicate() ->
# Shard(1) (strided pieces of the one chunk).  Every rank compares its local shards bitwise.

SHARDED_WORLD = 3
SHARDED_CHUNK_BYTES = 32 * 1024  # crc32c chunk size: a sub-range read is checked piecewise


def sharded_fault_state() -> dict:
    """About 3.7 MiB of global tensors (rows and columns uneven on 2, 3 and 4 ranks)."""
    g = torch.Generator().manual_seed(78)
    return {"model": {"a": torch.randn(1001, 512, generator=g),
                      "b": torch.randn(384, 999, generator=g),
                      "c": torch.randn(65_537, generator=g),
                      "r": torch.randn(128, 130, generator=g).to(torch.bfloat16)},
            "optim": {"step": torch.tensor(78.0)},
            "extra_state": {"num_updates": 78, "lr": 0.000123, "betas": (0.9, 0.98)}}


def sharded_layouts() -> tuple[dict, dict]:
    """(saved placements, restore-target placements) by leaf path."""
    from torch.distributed.tensor import Replicate, Shard

    saved = {"model.a": Shard(0), "model.b": Shard(1), "model.c": Shard(0),
             "model.r": Replicate()}
    target = {"model.a": Shard(0), "model.b": Shard(0), "model.c": Replicate(),
              "model.r": Shard(1)}
    return saved, target


_MESH: dict[int, Any] = {}


def _dist_and_mesh(timeout_s: float) -> tuple[Any, Any]:
    """This rank's Dist (the pool's gloo group) and a 1-D CPU mesh over it (made once)."""
    from torch.distributed.device_mesh import init_device_mesh

    from xla_ckpt.comm import DistConfig, get_dist

    d = get_dist(DistConfig(backend="gloo", timeout_s=timeout_s))
    if d.world_size not in _MESH:
        _MESH[d.world_size] = init_device_mesh("cpu", (d.world_size,))
    return d, _MESH[d.world_size]


def save_sharded_fault_checkpoint(uri: str) -> int:
    """On every rank: save :func:`sharded_fault_state` as DTensors of the saved layout;
    returns the checkpoint's data bytes."""
    import crash_harness as H

    from xla_ckpt.restore import save_distributed

    d, mesh = _dist_and_mesh(120.0)
    state = H.distribute_state(sharded_fault_state(), mesh, sharded_layouts()[0])
    m = save_distributed(state, uri, dist=d, metadata={"num_updates": 78},
                         chunk_size_bytes=SHARDED_CHUNK_BYTES)
    return m.nbytes


def sharded_restore_round(uri: str, storage_kwargs: dict, timeout_s: float) -> dict:
    """On every rank: restore ``uri`` (all_ranks) into DTensor targets of the target layout,
    compare this rank's shards bitwise; never raises (the outcome of :func:`restore_round`)."""
    import crash_harness as H

    from xla_ckpt.errors import XlaCkptError
    from xla_ckpt.restore import restore
    from xla_ckpt.storage import StorageConfig

    counter = _counter()
    d, mesh = _dist_and_mesh(timeout_s)
    target = sharded_layouts()[1]
    t0 = time.monotonic()
    out: dict[str, Any] = {"rank": d.rank}
    try:
        r = restore(uri, dist=d, strategy="all_ranks",
                    into=H.zero_targets(sharded_fault_state(), mesh, target),
                    storage_config=StorageConfig(**storage_kwargs))
    except XlaCkptError as e:
        out.update(outcome="clean_error", error=type(e).__name__, message=str(e)[:2000],
                   failed_ranks=sorted(getattr(e, "failures", {}) or {}))
    except Exception as e:  # noqa: BLE001 - what must never happen is recorded, not raised
        out.update(outcome="other_error", error=type(e).__name__, message=str(e)[:400])
    else:
        diff = H.shard_diff(r.state, sharded_fault_state(), mesh, target)
        out["outcome"] = "silent_corruption" if diff else "correct"
        if diff:
            out["message"] = diff
        out["bytes_read"] = r.stats.bytes_read
    out["seconds"] = time.monotonic() - t0
    out["counts"] = dict(counter.counts)
    return out


# ---- the per-host and striped plans: every byte fetched once per host / per job -----------------
#
# The same 8 ranks run as ``hosts`` emulated hosts (consecutive ranks; torchrun ``GROUP_RANK`` /
# ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` and each host's own GCS source address), and restore
# with ``per_host`` (one read per host into host shared memory) or ``striped`` (each stripe
# read by one rank, exchanged over host shared memory and the leaders' all-gather) through the
# same random faults.  A fault that survives its retries on one reader must fail the restore on
# every rank with the same error; a restore that returns must be bitwise right on every rank.


def plan_restore_round(strategy: str, hosts: int, uri: str, storage_kwargs: dict,
                       timeout_s: float) -> dict:
    """On every rank: restore ``uri`` with ``strategy`` on ``hosts`` emulated hosts, compare
    bitwise; never raises (the outcome of :func:`restore_round`).  Bind with
    ``functools.partial(plan_restore_round, strategy, hosts)`` for :func:`run_rounds`."""
    import os

    from xla_ckpt.comm import DistConfig, get_dist
    from xla_ckpt.errors import XlaCkptError
    from xla_ckpt.restore import RestoreConfig, restore
    from xla_ckpt.storage import StorageConfig
    from xla_ckpt.storage.base import SOURCE_ADDRESS_ENV
    from xla_ckpt.testing.asserts import assert_state_identical
    from xla_ckpt.testing.fault_proxy import host_address

    counter = _counter()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    per = world // hosts
    env = {"GROUP_RANK": str(rank // per), "LOCAL_RANK": str(rank % per),
           "LOCAL_WORLD_SIZE": str(per), SOURCE_ADDRESS_ENV: host_address(rank // per)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    out: dict[str, Any] = {"rank": rank}
    try:
        # its own Dist (another timeout is another cache key): the topology of these hosts
        d = get_dist(DistConfig(backend="gloo", timeout_s=timeout_s + hosts / 1000))
        t0 = time.monotonic()
        try:
            r = restore(uri, dist=d, config=RestoreConfig(strategy=strategy,
                                                          bucket_size_bytes=256 * 1024),
                        storage_config=StorageConfig(**storage_kwargs))
        except XlaCkptError as e:
            out.update(outcome="clean_error", error=type(e).__name__, message=str(e)[:2000],
                       failed_ranks=sorted(getattr(e, "failures", {}) or {}))
        except Exception as e:  # noqa: BLE001 - what must never happen is recorded, not raised
            out.update(outcome="other_error", error=type(e).__name__, message=str(e)[:400])
        else:
            try:
                assert_state_identical(r.state, fault_state())
                out["outcome"] = "correct"
            except AssertionError as e:
                out.update(outcome="silent_corruption", message=str(e)[:400])
            out["bytes_read"] = r.stats.bytes_read
            out["plan"] = r.stats.plan
        out["seconds"] = time.monotonic() - t0
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out["counts"] = dict(counter.counts)
    return out
