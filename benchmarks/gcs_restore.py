"""GCS restore benchmark: xla_ckpt against its peers on the shaped emulator.

Restores the same state (``--size-mib`` MiB of fp32 tensors laid out like a
transformer: per layer four 4 MiB attention matrices, two 16 MiB MLP matrices
and eight small bias/LayerNorm vectors, plus an embedding) from the GCS
emulator behind :class:`xla_ckpt.testing.fault_proxy.FaultProxy` with
first-byte latency and a per-stream throughput cap (how real GCS behaves),
and prints one JSON line per method:

  a  xla_ckpt.load: parallel ranged GETs into preallocated buffers, crc32c per chunk
  b  fairseq-style: blob.download_as_bytes() then torch.load(BytesIO)
  c  transfer_manager.download_chunks_concurrently (threads) to a file, then torch.load(mmap=True)
  d  PyTorch DCP FsspecReader over gcsfs into preallocated tensors
  e  ceiling: the same ranged GETs as (a) (its span plan, same threads), bytes discarded
  f  Orbax defaults (OCDBT, compression) over TensorStore's GCS driver, into jax.Array (CPU)
  g  Orbax with use_ocdbt=False (one TensorStore array per tensor), into jax.Array (CPU)
  h  GCS Connector for PyTorch: DatafluxCheckpoint.reader() then torch.load
  i  GCS Connector for PyTorch: DCP load through its GCSDistributedReader

f-i are optional peers that run under virtualenvs of their own (``.venv-orbax``,
``.venv-dataflux``, made by ``bash scripts/setup_peers.sh``; see
``benchmarks/peers/``), d needs gcsfs (``pip install -e '.[bench]'``).  A peer
that is missing or does not import prints one JSON line
``{"method": ..., "skipped": "install with: ..."}`` and the rest run; a method
whose run fails prints ``{"method": ..., "failed": ...}`` and the rest run.

Each method runs in a fresh subprocess, so its peak RSS is its own; every
result is checked bitwise (crc32c per tensor) after the clock stops.  With
``--repeat N`` the methods run round-robin N times.  Each line carries
``seconds`` (median of the runs) and ``runs_seconds``, ``mib_s``,
``peak_rss_mib``, ``rss_above_baseline_mib`` (peak minus the RSS after
imports), ``rss_ratio_to_state`` and ``ratio_vs_<m>`` (time of ``m`` / time of
this method, > 1 means this one is faster; ``ratio_vs_e`` is the fraction of
the ceiling's throughput a method reaches).  A last ``{"summary": ...}`` line
gives (a) against the issue-16 targets: Orbax's best configuration (the faster
of f and g) >= 3x, Orbax defaults (f) >= 5x, the GCS Connector (the faster of h
and i) >= 5x.

  .venv/bin/python benchmarks/gcs_restore.py                   # 512 MiB, all methods
  .venv/bin/python benchmarks/gcs_restore.py --size-mib 256 --repeat 3 --methods a,e,f,g,h,i
  .venv/bin/python benchmarks/gcs_restore.py --size-mib 256 --methods a,e
  .venv/bin/python benchmarks/gcs_restore.py --sweep           # max_workers x slice size for (a)
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

MiB = 1024 * 1024
METHODS = {
    "a": "xla_ckpt",
    "b": "download_as_bytes+torch.load",
    "c": "transfer_manager+torch.load(mmap)",
    "d": "dcp.FsspecReader(gcsfs)",
    "e": "ceiling(ranged GETs, discard)",
    "f": "orbax(defaults)",
    "g": "orbax(use_ocdbt=False)",
    "h": "gcs_connector(DatafluxCheckpoint.reader+torch.load)",
    "i": "gcs_connector(dcp GCSDistributedReader)",
}


# ---- peers: which methods can run here -------------------------------------------------------
@dataclass(frozen=True)
class Peer:
    """A method that runs in a virtualenv of its own (``venv`` is the key of ``--<venv>-venv``)."""

    venv: str           # "orbax" or "dataflux": scripts/setup_peers.sh target and venv suffix
    script: str         # path of the peer script, relative to benchmarks/
    modules: tuple[str, ...]  # what the peer imports; a probe imports them before any run


PEERS: dict[str, Peer] = {
    "f": Peer("orbax", "peers/orbax_peer.py",
              ("orbax.checkpoint", "jax", "tensorstore", "gcsfs", "numpy", "google_crc32c")),
    "g": Peer("orbax", "peers/orbax_peer.py",
              ("orbax.checkpoint", "jax", "tensorstore", "gcsfs", "numpy", "google_crc32c")),
    "h": Peer("dataflux", "peers/dataflux_peer.py",
              ("torch", "dataflux_pytorch.dataflux_checkpoint", "google.cloud.storage",
               "google_crc32c")),
    "i": Peer("dataflux", "peers/dataflux_peer.py",
              ("torch", "torch.distributed.checkpoint", "dataflux_pytorch.lightning",
               "google.cloud.storage", "google_crc32c")),
}
#: what to tell the user for a missing peer
INSTALL_HINT = {"orbax": "bash scripts/setup_peers.sh orbax",
                "dataflux": "bash scripts/setup_peers.sh dataflux",
                "gcsfs": ".venv/bin/pip install -e '.[bench]'"}


def default_venv(kind: str) -> str:
    """``$GCS_RESTORE_<KIND>_VENV`` or ``<repo>/.venv-<kind>`` (the set-up script's folder)."""
    return os.environ.get(f"GCS_RESTORE_{kind.upper()}_VENV") or os.path.join(ROOT, f".venv-{kind}")


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def _probe(python: str, modules: tuple[str, ...]) -> str | None:
    """None if ``python`` imports every module in ``modules``, else the reason (one line)."""
    if not os.access(python, os.X_OK):
        return f"{python} not found"
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    try:
        out = subprocess.run([python, "-c", code, *modules], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python}: {e}"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        return f"{python}: {last}"
    return None


def _gcsfs_missing() -> str | None:
    """None if gcsfs imports in this interpreter (method d), else the reason (one line)."""
    try:
        import gcsfs  # noqa: F401 - the import is the check
    except Exception as e:  # noqa: BLE001 - a broken install raises anything; d is optional
        return f"gcsfs does not import: {type(e).__name__}: {e}".splitlines()[0]
    return None


def discover_methods(methods: str, venvs: dict[str, str]) -> tuple[str, list[dict[str, str]]]:
    """Split ``methods`` into those that can run here and one skip line per missing peer.

    ``venvs`` maps a peer's venv key (``"orbax"``, ``"dataflux"``) to its virtualenv folder.
    A method is skipped when its interpreter is absent or does not import what the peer needs
    (d: gcsfs in this interpreter). Each probe runs once per (interpreter, modules).

    Returns:
        (the runnable methods in the given order, ``[{"method", "name", "skipped", "reason"}]``
        where ``skipped`` is ``"install with: <command>"``).
    """
    runnable: list[str] = []
    skipped: list[dict[str, str]] = []
    cache: dict[tuple[str, tuple[str, ...]], str | None] = {}
    for m in methods:
        if m == "d":
            why, hint = _gcsfs_missing(), INSTALL_HINT["gcsfs"]
        elif m in PEERS:
            peer = PEERS[m]
            key = (venv_python(venvs[peer.venv]), peer.modules)
            if key not in cache:
                cache[key] = _probe(*key)
            why, hint = cache[key], INSTALL_HINT[peer.venv]
        else:
            why, hint = None, ""
        if why is None:
            runnable.append(m)
        else:
            skipped.append({"method": m, "name": METHODS[m], "skipped": f"install with: {hint}",
                            "reason": why})
    return "".join(runnable), skipped


# ---- the state -----------------------------------------------------------------------------
def state_layout(size_mib: int) -> list[tuple[str, tuple[int, ...]]]:
    """(key, shape) of fp32 tensors adding up to ``size_mib`` MiB (within 1 MiB)."""
    hidden, ffn = 1024, 4096
    per_layer = 4 * hidden * hidden + 2 * hidden * ffn + 6 * hidden + 2 * ffn
    layers = (size_mib * MiB // 4) // per_layer
    out: list[tuple[str, tuple[int, ...]]] = []
    for i in range(layers):
        p = f"layers.{i}."
        for n in ("q", "k", "v", "o"):
            out.append((p + f"attn.{n}.weight", (hidden, hidden)))
            out.append((p + f"attn.{n}.bias", (hidden,)))
        out.append((p + "mlp.fc1.weight", (ffn, hidden)))
        out.append((p + "mlp.fc1.bias", (ffn,)))
        out.append((p + "mlp.fc2.weight", (hidden, ffn)))
        out.append((p + "mlp.fc2.bias", (hidden,)))
        out.append((p + "ln.weight", (ffn,)))
        out.append((p + "ln.bias", (hidden,)))
    rest = size_mib * MiB // 4 - layers * per_layer
    if rest > 0:
        out.append(("embed.weight", (rest // hidden, hidden)))
    return out


def make_state(size_mib: int):
    import torch

    g = torch.Generator().manual_seed(1234)
    return {k: torch.rand(shape, generator=g) for k, shape in state_layout(size_mib)}


def tensor_crcs(state) -> dict[str, int]:
    import torch

    from xla_ckpt.format.crc import crc32c

    return {k: crc32c(v.contiguous().view(-1).view(torch.uint8)) for k, v in state.items()}


# ---- rss ----------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


# ---- children: one method each -------------------------------------------------------------
def child(method: str, spec: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    bucket, prefix = spec["bucket"], spec["prefix"]
    phases: dict[str, float] = {}
    endpoint = spec["endpoint"]
    load = None
    if method == "a":
        from xla_ckpt.storage import StorageConfig
        from xla_ckpt.storage.gcs import DEFAULT_CONFIG

        cfg = DEFAULT_CONFIG
        if spec.get("max_workers") or spec.get("slice_mib"):
            cfg = StorageConfig(max_workers=spec.get("max_workers") or DEFAULT_CONFIG.max_workers,
                                slice_size_bytes=(spec.get("slice_mib") or
                                                  DEFAULT_CONFIG.slice_size_bytes // MiB) * MiB)

        from xla_ckpt.io import CheckpointReader
        from xla_ckpt.storage.gcs import GCSStorage

        # Like (b)-(d), the client exists before the clock starts; the manifest read,
        # the stat of the data file and every byte are timed.
        st = GCSStorage(f"gs://{bucket}/{prefix}/xla", cfg)

        def load():
            t = time.perf_counter()
            reader = CheckpointReader(st)      # GET manifest.json
            reader.check_files()                # stat the data file: size, generation
            phases["metadata_seconds"] = time.perf_counter() - t
            return reader.load()
    elif method == "b":
        from google.cloud import storage as gcs

        blob = gcs.Client().bucket(bucket).blob(f"{prefix}/fairseq/checkpoint.pt")

        def load():
            data = blob.download_as_bytes()
            return torch.load(io.BytesIO(data), weights_only=True)
    elif method == "c":
        from google.cloud import storage as gcs
        from google.cloud.storage import transfer_manager

        client = gcs.Client()
        workers = spec.get("max_workers") or 16
        tmpdir = tempfile.mkdtemp(prefix="gcs-bench-")
        path = os.path.join(tmpdir, "checkpoint.pt")

        def load():
            blob = client.bucket(bucket).get_blob(f"{prefix}/fairseq/checkpoint.pt")
            transfer_manager.download_chunks_concurrently(
                blob, path, max_workers=workers, worker_type=transfer_manager.THREAD)
            return torch.load(path, mmap=True, weights_only=True)
    elif method == "d":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        layout = state_layout(spec["size_mib"])
        dest = {k: torch.empty(shape) for k, shape in layout}

        def load():
            dcp.load(dest, storage_reader=FsspecReader(f"gs://{bucket}/{prefix}/dcp", token="anon",
                                                       endpoint_url=endpoint))
            return dest
    elif method == "e":
        import threading

        from xla_ckpt.format.manifest import MANIFEST_NAME, Manifest
        from xla_ckpt.io.buffers import host_arenas, shared_pool
        from xla_ckpt.io.planning import plan_spans
        from xla_ckpt.storage import StorageConfig
        from xla_ckpt.storage.gcs import DEFAULT_CONFIG, GCSStorage

        cfg = DEFAULT_CONFIG  # the config (a) reads with, sweeps included
        if spec.get("max_workers") or spec.get("slice_mib"):
            cfg = StorageConfig(max_workers=spec.get("max_workers") or DEFAULT_CONFIG.max_workers,
                                slice_size_bytes=(spec.get("slice_mib") or
                                                  DEFAULT_CONFIG.slice_size_bytes // MiB) * MiB)
        st = GCSStorage(f"gs://{bucket}/{prefix}/xla", cfg)
        manifest = Manifest.from_json_bytes(st.read_bytes(MANIFEST_NAME), where="bench")
        item = manifest.item("state")
        # The same GETs CheckpointReader.load issues: its span plan over its fresh arenas,
        # longest first (io/reader.py read_into); only the (offset, length) of each is kept.
        spans = plan_spans(item, host_arenas(item, range(len(item.blobs))), cfg.slice_size_bytes)
        slices = [(sp.file, sp.offset, sp.length)
                  for sp in sorted(spans, key=lambda sp: -sp.length)]
        del spans  # the arenas: (e) discards its bytes
        step = max(n for _, _, n in slices)
        gens = {f: st.stat(f).generation for f in {s[0] for s in slices}}
        local = threading.local()

        def fetch(name, off, n):
            buf = getattr(local, "buf", None)
            if buf is None or len(buf) < n:
                buf = local.buf = bytearray(max(n, step))
            st.read_range(name, off, memoryview(buf)[:n], gens[name])

        def load():
            pool = shared_pool(cfg.max_workers)  # the pool (a) reads with
            for f in [pool.submit(fetch, *s) for s in slices]:
                f.result()
            return None
    else:
        raise SystemExit(f"unknown method {method!r}")

    baseline_kib = _status_kib("VmRSS")
    t0 = time.perf_counter()
    state = load()
    seconds = time.perf_counter() - t0
    peak_kib = _status_kib("VmHWM")
    ok = None
    if state is not None:
        got = tensor_crcs(state)
        ok = got == spec["crcs"]
    del state
    if method == "c":
        shutil.rmtree(tmpdir, ignore_errors=True)
    return {"seconds": seconds, "baseline_rss_mib": baseline_kib / 1024,
            "peak_rss_mib": peak_kib / 1024, "bitwise_ok": ok, **phases}


# ---- parent -------------------------------------------------------------------------------
def prepare(emu, proxy, size_mib: int, prefix: str, methods: str, workdir: str,
            peer_env: dict, venvs: dict[str, str]) -> tuple[dict, list, dict[str, str]]:
    """Write the state in each method's layout (through the proxy, so the objects' media links,
    which some clients follow, point at the shaped endpoint too).

    Layouts: ``xla/`` (a, e), ``fairseq/checkpoint.pt`` (b, c, h), ``dcp/`` (d, i; written by
    DCP's ``FileSystemWriter`` to ``workdir`` and uploaded object by object, because the GCS
    Connector's writers need XML multipart uploads, which the emulator lacks), and the Orbax
    layouts (f, g; written by the Orbax peer itself from ``workdir/state.bin``).

    Returns:
        (``{key: crc32c}`` of the state, ``[[key, shape, byte_offset], ...]`` of ``state.bin``,
        ``{method: reason}`` of the methods whose set-up failed: the Orbax peer's save).
    """
    import torch

    import xla_ckpt
    from xla_ckpt.storage import StorageConfig
    from xla_ckpt.storage.gcs import GCSStorage

    t0 = time.perf_counter()
    state = make_state(size_mib)
    crcs = tensor_crcs(state)
    failed: dict[str, str] = {}
    layout, offset = [], 0
    for k, v in state.items():
        layout.append([k, list(v.shape), offset])
        offset += v.numel() * v.element_size()
    direct = GCSStorage(emu.uri(prefix), StorageConfig(max_workers=8), endpoint=proxy.url)
    if set(methods) & {"a", "e"}:
        xla_ckpt.save(state, emu.uri(f"{prefix}/xla"), storage=direct.child("xla"))
    if set(methods) & {"b", "c", "h"}:
        buf = io.BytesIO()
        torch.save(state, buf)
        direct.write_atomic("fairseq/checkpoint.pt", [buf.getbuffer()])
        del buf
    if set(methods) & {"d", "i"}:
        import torch.distributed.checkpoint as dcp

        local = os.path.join(workdir, "dcp")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(local))
        for name in sorted(os.listdir(local)):
            with open(os.path.join(local, name), "rb") as f:
                direct.write_atomic(f"dcp/{name}", [f.read()])
        shutil.rmtree(local)
    if set(methods) & {"f", "g"}:
        state_path = os.path.join(workdir, "state.bin")
        with open(state_path, "wb") as f:
            for v in state.values():
                f.write(memoryview(v.contiguous().view(-1).view(torch.uint8).numpy()))
        spec = {"bucket": emu.bucket, "prefix": prefix, "endpoint": proxy.url,
                "state_path": state_path, "layout": layout}
        try:
            _run(venv_python(venvs["orbax"]), PEERS["f"].script, ["--save"], spec, peer_env)
        except MethodFailed as e:  # report it on f and g, run the others
            failed.update({m: str(e) for m in "fg" if m in methods})
        finally:
            os.unlink(state_path)
    direct.close()
    print(f"# wrote {size_mib} MiB state as {methods} layouts in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return crcs, layout, failed


class MethodFailed(RuntimeError):
    """One method's subprocess failed; ``str()`` is its last stderr line."""


def _run(python: str, script: str, args: list[str], spec: dict, env: dict) -> dict | None:
    """Run ``python benchmarks/<script> --spec <file> *args``; its last stdout line as JSON."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
        path = f.name
    try:
        out = subprocess.run([python, os.path.join(HERE, script), "--spec", path, *args],
                             env=env, capture_output=True, text=True, timeout=1800)
    finally:
        os.unlink(path)
    if out.returncode != 0:
        print(out.stderr[-4000:], file=sys.stderr, flush=True)
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        raise MethodFailed(f"{os.path.basename(script)} {' '.join(args)}: {last}")
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else None


def run_child(method: str, spec: dict, env: dict, venvs: dict[str, str]) -> dict:
    """One timed run of ``method`` in a fresh subprocess (a peer's under its own venv).

    Raises:
        MethodFailed: the subprocess exited non-zero or printed no result.
    """
    if method in PEERS:
        peer = PEERS[method]
        r = _run(venv_python(venvs[peer.venv]), peer.script, ["--method", method],
                 {k: v for k, v in spec.items() if k != "crcs"}, env)
        if r is not None:
            r["bitwise_ok"] = r.pop("crcs") == spec["crcs"]
    else:
        r = _run(sys.executable, os.path.basename(__file__), ["--child", method], spec, env)
    if r is None:
        raise MethodFailed(f"method {method} printed no result")
    return r


#: issue 16: (a) against its peers, (name, peer methods (the fastest counts), target ratio)
TARGETS = (("orbax_best", "fg", 3.0), ("orbax_defaults", "f", 5.0),
           ("gcs_connector", "hi", 5.0))


def summary(results: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """(a)'s median against the fastest median of each target's peers (absent peers left out)."""
    if "a" not in results:
        return None
    out: dict[str, Any] = {"summary": "a vs peers (median seconds of peer / of a)"}
    for name, peers, target in TARGETS:
        have = [m for m in peers if m in results]
        if not have:
            continue
        best = min(have, key=lambda m: results[m]["seconds"])
        ratio = results[best]["seconds"] / results["a"]["seconds"]
        out[f"a_vs_{name}"] = {"peer": best, "ratio": round(ratio, 2), "target": target,
                               "met": ratio >= target}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--methods", default="".join(METHODS),
                    help="letters a-i in run order (default: all; missing peers are skipped)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per method (median reported)")
    ap.add_argument("--first-byte-latency-ms", type=float, default=30.0)
    ap.add_argument("--stream-mib-s", type=float, default=32.0,
                    help="per-connection cap (real GCS ~200 MiB/s, scaled down to this machine)")
    ap.add_argument("--total-mib-s", type=float, default=None, help="aggregate cap (VM NIC)")
    ap.add_argument("--max-workers", type=int, default=None, help="(a) and (c) threads")
    ap.add_argument("--slice-mib", type=int, default=None, help="(a) slice size")
    ap.add_argument("--sweep", action="store_true", help="(a) over max_workers x slice size")
    ap.add_argument("--sweep-workers", default="8,16,32")
    ap.add_argument("--sweep-slices-mib", default="4,8,16,32")
    ap.add_argument("--orbax-venv", default=default_venv("orbax"),
                    help="virtualenv of f, g (default $GCS_RESTORE_ORBAX_VENV or .venv-orbax)")
    ap.add_argument("--dataflux-venv", default=default_venv("dataflux"),
                    help="virtualenv of h, i (default $GCS_RESTORE_DATAFLUX_VENV or "
                         ".venv-dataflux)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.child:
        with open(a.spec) as f:
            spec = json.load(f)
        print(json.dumps(child(a.child, spec)))
        return 0

    import torch

    from xla_ckpt.testing.fault_proxy import FaultProxy, Shaping
    from xla_ckpt.testing.gcs_emulator import GCSEmulator

    torch.set_num_threads(1)
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # else gcsfs waits on gRPC timeouts
    unknown = sorted(set(a.methods.replace(",", "")) - set(METHODS))
    if unknown:
        ap.error(f"unknown methods {', '.join(unknown)} (expected letters of {''.join(METHODS)})")
    methods = "".join(dict.fromkeys(a.methods.replace(",", "")))
    if a.sweep:
        methods = "ae"
    venvs = {"orbax": a.orbax_venv, "dataflux": a.dataflux_venv}
    methods, skipped = discover_methods(methods, venvs)
    for line in skipped:
        print(json.dumps(line), flush=True)
    if not methods:
        print("# no method left to run", file=sys.stderr)
        return 1
    shaping = Shaping(first_byte_latency_s=a.first_byte_latency_ms / 1000,
                      stream_mib_s=a.stream_mib_s, total_mib_s=a.total_mib_s)
    with GCSEmulator() as emu, FaultProxy(emu.host, shaping=shaping) as proxy, \
            tempfile.TemporaryDirectory(prefix="gcs-bench-") as workdir:
        prefix = "bench"
        env = {**os.environ, **emu.env(), **proxy.env(), "OMP_NUM_THREADS": "1",
               # TensorStore's GCS driver (f, g) reaches the emulator through these.
               "TENSORSTORE_GCS_HTTP_URL": proxy.url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
               "JAX_PLATFORMS": "cpu"}
        crcs, layout, failed = prepare(emu, proxy, a.size_mib, prefix, methods, workdir, env,
                                       venvs)
        for m, why in failed.items():
            print(json.dumps({"method": m, "name": METHODS[m], "failed": why}), flush=True)
        base_spec = {"bucket": emu.bucket, "prefix": prefix, "endpoint": proxy.url,
                     "size_mib": a.size_mib, "crcs": crcs, "layout": layout,
                     "max_workers": a.max_workers, "slice_mib": a.slice_mib}
        common = {"size_mib": a.size_mib, "first_byte_latency_ms": a.first_byte_latency_ms,
                  "stream_mib_s": a.stream_mib_s, "total_mib_s": a.total_mib_s}
        if a.sweep:
            for workers in map(int, a.sweep_workers.split(",")):
                for slice_mib in map(int, a.sweep_slices_mib.split(",")):
                    spec = {**base_spec, "max_workers": workers, "slice_mib": slice_mib}
                    sweep_runs = [run_child("a", spec, env, venvs) for _ in range(a.repeat)]
                    secs = statistics.median(x["seconds"] for x in sweep_runs)
                    print(json.dumps({**common, "method": "a", "max_workers": workers,
                                      "slice_mib": slice_mib, "seconds": round(secs, 3),
                                      "mib_s": round(a.size_mib / secs, 1)}), flush=True)
            return 0
        # Round-robin (a b c d e ..., a b c d e ..., ...): load from elsewhere on the machine and
        # after-effects of the set-up spread over every method instead of hitting one.
        all_runs: dict[str, list[dict]] = {m: [] for m in methods}
        for _ in range(a.repeat):
            for m in methods:
                if m in failed:
                    continue
                proxy.reset_log()
                try:
                    r = run_child(m, base_spec, env, venvs)
                except MethodFailed as e:  # one method's failure does not stop the others
                    failed[m] = str(e)
                    print(json.dumps({"method": m, "name": METHODS[m], "failed": str(e)}),
                          flush=True)
                    continue
                served = proxy.snapshot()
                r["requests"], r["mib_served"] = served.requests, served.bytes_served / MiB
                all_runs[m].append(r)
                print(f"# {m} {METHODS[m]}: {r['seconds']:.2f} s", file=sys.stderr, flush=True)
        results: dict[str, dict[str, Any]] = {}
        for m, runs in all_runs.items():
            if m in failed or not runs:
                continue
            results[m] = {
                "seconds": statistics.median(r["seconds"] for r in runs),
                "runs_seconds": [round(r["seconds"], 3) for r in runs],
                "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
                "rss_above_baseline_mib": max(r["peak_rss_mib"] - r["baseline_rss_mib"]
                                              for r in runs),
                "bitwise_ok": all(r["bitwise_ok"] is not False for r in runs)
                if m != "e" else None,
                **({"metadata_seconds": statistics.median(r["metadata_seconds"] for r in runs)}
                   if "metadata_seconds" in runs[0] else {}),
                "requests": statistics.median(r["requests"] for r in runs),
                "mib_served": statistics.median(r["mib_served"] for r in runs),
            }
        for m, r in results.items():
            line = {"method": m, "name": METHODS[m], **common,
                    "seconds": round(r["seconds"], 3), "runs_seconds": r["runs_seconds"],
                    "mib_s": round(a.size_mib / r["seconds"], 1),
                    "peak_rss_mib": round(r["peak_rss_mib"], 1),
                    "rss_above_baseline_mib": round(r["rss_above_baseline_mib"], 1),
                    "rss_ratio_to_state": round(r["rss_above_baseline_mib"] / a.size_mib, 3),
                    "bitwise_ok": r["bitwise_ok"], "requests": r["requests"],
                    **({"metadata_seconds": round(r["metadata_seconds"], 3)}
                       if "metadata_seconds" in r else {}),
                    "mib_served": round(r["mib_served"], 1)}
            for other, ro in results.items():
                if other != m:
                    line[f"ratio_vs_{other}"] = round(ro["seconds"] / r["seconds"], 2)
            print(json.dumps(line), flush=True)
        s = summary(results)
        if s is not None:
            print(json.dumps(s), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
