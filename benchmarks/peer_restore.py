"""A replaced host resumes from its peer's replica: against our GCS restore, torchft's
HTTPTransport from a live peer, and the data plane's own rate (issue 26, item 7).

One run, one state (``--size-mib``, default 512 MiB of fp32 tensors laid out like a
transformer, ``gcs_restore.make_state``), 2 emulated hosts x 1 gloo worker
(:class:`~xla_ckpt.testing.launcher.WorkerPool` with ``hosts=2``: each rank its own GCS source
address), the durable tier on the GCS emulator behind the shaping proxy of
``gcs_restore.py`` (30 ms first byte, 32 MiB/s per stream); the local tiers under ``/dev/shm``
(a folder per host); rank-to-rank traffic on loopback (not shaped).  Every figure is the
slowest rank's, the median of ``--repeat`` round-robin runs; every restore is checked bitwise
(crc32c of every tensor) after the clock stops.

The state is saved once by a manager with ``local_dir`` and ``local_replicas=1``: both tiers
hold it, and each host's tier holds a replica of the other host's part.  Then, per run:

* ``replaced_host_restore``: host 1's local folder is deleted (before the clock), then a fresh
  manager on each rank runs ``restore_or_initialize()``: host 0's leader serves its tier (its
  own part and host 1's replica) and host 1's rank reads every box it needs from there by
  byte range straight into its tensors, every crc32c checked by the reader; host 0 reads its
  own tier.  ``transfer_s`` is host 1's read (the transfer and its checks); ``peer_mib`` what
  host 1 read from host 0; ``durable_mib`` must be 0;
* ``gcs_restore``: a fresh manager without ``local_dir`` (the whole job from GCS);
* ``torchft_http``: torchft 0.2.0 ``HTTPTransport`` (the ``bench`` extra): rank 0, a live
  peer, serves the same state dict (``send_checkpoint``, before the clock); rank 1
  ``recv_checkpoint``s it (``--torchft-chunks`` parallel chunks, 0: one stream), no check;
* ``data_plane``: rank 0 ``Dist.send_tensors`` the same bytes to rank 1, which receives them
  into preallocated, touched tensors (the gloo data plane's own rate).

The last line is a ``summary`` with each target's ratio and ``met``: the replaced-host restore
at least 5x faster than our GCS restore with 0 GCS bytes; no slower than torchft's transport
(at least 1.0x) while checking every byte; its transfer (``transfer_s``) at least 0.8 of the
data plane's rate.  Host memory per host (its own part, the replica it holds) is reported against
``local_max_bytes``.

    .venv/bin/python benchmarks/peer_restore.py --repeat 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MiB = 1024 * 1024
METHODS = ("replaced_host_restore", "gcs_restore", "torchft_http", "data_plane")
TARGETS = {
    "replaced_vs_gcs_restore": (">=", 5.0),
    "replaced_vs_torchft_http": (">=", 1.0),
    "transfer_vs_data_plane": (">=", 0.8),
}
INSTALL_TORCHFT = "pip install -e '.[bench]'  (torchft==0.2.0)"
TIMEOUT_S = 300.0


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


def note(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


# ---- on every rank -------------------------------------------------------------------------
_CACHE: dict[str, Any] = {}


def _dist() -> Any:
    from xla_ckpt.comm import DistConfig, get_dist

    return get_dist(DistConfig(backend="gloo", timeout_s=TIMEOUT_S))


def _state(size_mib: int) -> dict:
    if _CACHE.get("size") != size_mib:
        from benchmarks.gcs_restore import make_state

        _CACHE.update(size=size_mib, state=make_state(size_mib))
    return _CACHE["state"]


def _crc(tree: dict) -> int:
    from xla_ckpt.format.crc import crc32c
    from xla_ckpt.testing.asserts import tensor_bits

    value = 0
    for k in sorted(tree):
        value = crc32c(tensor_bits(tree[k]), value)
    return value


def _config(save_dir: str, local_root: str | None, max_bytes: int) -> Any:
    from xla_ckpt.manager import CheckpointConfig

    kw: dict[str, Any] = {}
    if local_root is not None:
        kw = {"local_dir": os.path.join(local_root, "host-{host}"), "keep_local_checkpoints": 1,
              "local_max_bytes": max_bytes, "local_replicas": 1}
    return CheckpointConfig(save_dir=save_dir, save_interval_epochs=0, save_interval_updates=1,
                            handle_sigterm=False, **kw)


def _host_bytes(local_root: str, host: int) -> int:
    folder = os.path.join(local_root, f"host-{host}")
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def save_once(save_dir: str, local_root: str, size_mib: int, max_bytes: int) -> dict:
    """Every rank: save the state once (local tier, replicas, GCS) and wait for the replicas."""
    import torch

    from xla_ckpt.manager import CheckpointManager

    torch.set_num_threads(1)
    d = _dist()
    state = _state(size_mib)
    with CheckpointManager(_config(save_dir, local_root, max_bytes), dist=d) as m:
        m.after_update(epoch=1, num_updates=1, state={"model": state})
        m.wait()
        rep = m.wait_for_replicas(TIMEOUT_S)
    d.barrier()
    host = d.topology.host_id
    return {"host": host, "replication": rep, "host_bytes": _host_bytes(local_root, host),
            "crc": _crc(state)}


def run_method(method: str, save_dir: str, local_root: str, size_mib: int, max_bytes: int,
               chunks: int) -> dict:
    """Every rank: one timed run of ``method``; this rank's seconds and what it saw."""
    import torch

    from xla_ckpt.manager import CheckpointManager

    torch.set_num_threads(1)
    d = _dist()
    host = d.topology.host_id
    gc.collect()
    if method in ("replaced_host_restore", "gcs_restore"):
        local = local_root if method == "replaced_host_restore" else None
        if local is not None and host == 1:
            shutil.rmtree(os.path.join(local_root, "host-1"), ignore_errors=True)
        d.barrier()
        m = CheckpointManager(_config(save_dir, local, max_bytes), dist=d)
        try:
            t = time.perf_counter()
            res = m.restore_or_initialize()
            secs = time.perf_counter() - t
        finally:
            m.close()
        assert res is not None
        tier = res.tier or {}
        out = {"seconds": secs, "crc": _crc(res.state["model"]), "tier": tier.get("tier"),
               "durable_bytes": tier.get("durable_bytes"), "peer_bytes": tier.get("peer_bytes"),
               "read_s": tier.get("read_s"),
               "decide_s": tier.get("decide_s"),
               "host_bytes": _host_bytes(local_root, host) if local else None}
        if res.restored is not None and local is None:
            out["durable_bytes"] = res.restored.stats.bytes_read
        return out
    state = _state(size_mib)
    if method == "torchft_http":
        from torchft.checkpointing.http_transport import HTTPTransport

        tr = HTTPTransport(timedelta(seconds=TIMEOUT_S), num_chunks=chunks)
        try:
            meta = None
            if d.rank == 0:  # the live peer: its state served before the clock
                tr.send_checkpoint([1], 1, {"model": state}, timedelta(seconds=TIMEOUT_S))
                port = tr.metadata().rsplit(":", 1)[1]
                meta = f"http://127.0.0.1:{port}"
            meta = d.broadcast_object(meta, src=0)
            out = {"seconds": 0.0, "crc": None}
            if d.rank == 1:
                t = time.perf_counter()
                got = tr.recv_checkpoint(0, meta, 1, timedelta(seconds=TIMEOUT_S))
                out["seconds"] = time.perf_counter() - t
                out["crc"] = _crc(got["model"])
                del got
            d.barrier()
        finally:
            tr.shutdown(wait=True)
        return out
    if method == "data_plane":
        if d.rank == 0:
            tensors = [state[k] for k in sorted(state)]
        else:
            tensors = [torch.zeros_like(state[k]) for k in sorted(state)]  # touched
        d.barrier()
        t = time.perf_counter()
        if d.rank == 0:
            d.send_tensors(tensors, 1)
        else:
            d.recv_tensors(tensors, 0)
        secs = time.perf_counter() - t
        crc = _crc(dict(zip(sorted(state), tensors, strict=True))) if d.rank == 1 else None
        del tensors
        return {"seconds": secs if d.rank == 1 else 0.0, "crc": crc}
    raise ValueError(f"unknown method {method!r}")


# ---- the orchestrator ------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3, help="round-robin runs (median reported)")
    ap.add_argument("--torchft-chunks", type=int, default=8,
                    help="HTTPTransport num_chunks (parallel HTTP streams; 0: one stream)")
    ap.add_argument("--local-max-gib", type=float, default=4.0,
                    help="local_max_bytes of every host (host memory is reported against it)")
    ap.add_argument("--first-byte-latency-ms", type=float, default=30.0)
    ap.add_argument("--stream-mib-s", type=float, default=32.0)
    ap.add_argument("--shm", default="/dev/shm")
    a = ap.parse_args(argv)

    methods = list(METHODS)
    try:
        import torchft.checkpointing.http_transport  # noqa: F401 - the import is the check
    except Exception as e:  # noqa: BLE001 - a missing or broken extra raises anything
        methods.remove("torchft_http")
        emit({"method": "torchft_http", "skipped": f"install with: {INSTALL_TORCHFT}",
              "reason": f"{type(e).__name__}: {e}".splitlines()[0]})
    from xla_ckpt.testing.fault_proxy import FaultProxy, Shaping
    from xla_ckpt.testing.gcs_emulator import GCSEmulator
    from xla_ckpt.testing.launcher import WorkerPool

    max_bytes = int(a.local_max_gib * 2**30)
    local_root = tempfile.mkdtemp(prefix="xla_ckpt_peer_", dir=a.shm)
    shaping = Shaping(first_byte_latency_s=a.first_byte_latency_ms / 1000,
                      stream_mib_s=a.stream_mib_s)
    print("# " + " ".join([os.path.relpath(sys.executable, os.path.dirname(HERE)), *sys.argv]),
          file=sys.stderr)
    try:
        with GCSEmulator() as emu, FaultProxy(emu.host, shaping=shaping) as proxy:
            env = {**emu.env(), **proxy.env()}
            save_dir = emu.unique_uri("peer_restore") + "/run"
            pool = WorkerPool(2, xla=False, env=env, hosts=2)
            try:
                t0 = time.perf_counter()
                saved = [r.unwrap() for r in pool.run(save_once, save_dir, local_root,
                                                      a.size_mib, max_bytes,
                                                      timeout_s=TIMEOUT_S * 2)]
                expected = saved[0]["crc"]
                for s in saved:
                    rep = s["replication"] or {}
                    note(f"host {s['host']}: saved, {s['host_bytes'] / MiB:.1f} MiB in its "
                         f"tier, replication {[v.get('state') for v in rep.values()]}")
                note(f"saved {a.size_mib} MiB to both tiers in {time.perf_counter() - t0:.1f} s")
                runs: dict[str, list[list[dict]]] = {m: [] for m in methods}
                for _ in range(a.repeat):
                    for m in methods:
                        per_rank = [r.unwrap() for r in pool.run(
                            run_method, m, save_dir, local_root, a.size_mib, max_bytes,
                            a.torchft_chunks, timeout_s=TIMEOUT_S * 2)]
                        runs[m].append(per_rank)
                        note(f"{m}: {max(r['seconds'] for r in per_rank):.3f} s")
            finally:
                pool.close()
            out = report(runs, expected, a, saved, max_bytes)
            emit(out)
    finally:
        shutil.rmtree(local_root, ignore_errors=True)
    return 0


def report(runs: dict[str, list[list[dict]]], expected: int, a: argparse.Namespace,
           saved: list[dict], max_bytes: int) -> dict:
    """Print one line per method; return the summary line."""
    size = a.size_mib * MiB
    lines: dict[str, dict] = {}
    for m, rs in runs.items():
        secs = [max(r["seconds"] for r in per) for per in rs]
        ok = all(r["crc"] == expected for per in rs for r in per if r.get("crc") is not None)
        line: dict[str, Any] = {"method": m, "size_mib": a.size_mib,
                                "seconds": round(statistics.median(secs), 4),
                                "runs_seconds": [round(s, 4) for s in secs], "bitwise_ok": ok}
        line["mib_s"] = round(size / MiB / line["seconds"], 1) if line["seconds"] else None
        if m in ("replaced_host_restore", "gcs_restore"):
            last = rs[-1]
            line["tier"] = sorted({str(r["tier"]) for r in last})
            line["durable_mib_per_host"] = [round((r["durable_bytes"] or 0) / MiB, 1)
                                            for r in last]
        if m == "replaced_host_restore":
            line["peer_mib_per_host"] = [round((r["peer_bytes"] or 0) / MiB, 1)
                                         for r in rs[-1]]
            line["transfer_s"] = round(statistics.median(
                max((r["read_s"] or 0.0 for r in per if r["peer_bytes"]), default=0.0)
                for per in rs), 4)
            line["read_s"] = round(statistics.median(
                max(r["read_s"] or 0.0 for r in per) for per in rs), 4)
            line["host_mib_after"] = [round((r["host_bytes"] or 0) / MiB, 1) for r in rs[-1]]
            line["per_rank_last"] = [{k: (round(r[k], 4) if isinstance(r[k], float) else r[k])
                                      for k in ("seconds", "decide_s", "read_s")}
                                     for r in rs[-1]]
        lines[m] = line
        emit(line)
    base = lines["replaced_host_restore"]
    targets: dict[str, dict] = {}

    def target(name: str, ratio: float | None, **extra: Any) -> None:
        op, want = TARGETS[name]
        met = ratio is not None and (ratio >= want if op == ">=" else ratio <= want)
        targets[name] = {"ratio": None if ratio is None else round(ratio, 3),
                         "target": f"{op} {want}", "met": met, **extra}

    gcs = lines.get("gcs_restore")
    zero_gcs = all(v == 0 for v in base["durable_mib_per_host"])
    target("replaced_vs_gcs_restore", gcs["seconds"] / base["seconds"] if gcs else None,
           zero_gcs_bytes=zero_gcs)
    if zero_gcs is False:
        targets["replaced_vs_gcs_restore"]["met"] = False
    tft = lines.get("torchft_http")
    target("replaced_vs_torchft_http", tft["seconds"] / base["seconds"] if tft else None,
           torchft_chunks=a.torchft_chunks, checks_every_byte=True,
           **({} if tft else {"skipped": f"install with: {INSTALL_TORCHFT}"}))
    dp = lines.get("data_plane")
    target("transfer_vs_data_plane", dp["seconds"] / base["transfer_s"]
           if dp and base["transfer_s"] else None, transfer_s=base["transfer_s"],
           data_plane_s=dp["seconds"] if dp else None)
    return {"method": "summary", "size_mib": a.size_mib, "repeat": a.repeat,
            "bitwise_ok": all(v["bitwise_ok"] for v in lines.values()),
            "host_memory": [{"host": s["host"], "mib_after_save": round(s["host_bytes"] / MiB, 1),
                             "local_max_bytes": max_bytes,
                             "share_of_limit": round(s["host_bytes"] / max_bytes, 3)}
                            for s in saved],
            "targets": targets}


if __name__ == "__main__":
    raise SystemExit(main())
