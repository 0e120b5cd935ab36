r"""Sharded restore benchmark: xla_ckpt against PyTorch DCP for FSDP2 state on gloo ranks.

``--ranks`` (default 4) gloo ranks (real processes from :mod:`xla_ckpt.testing.launcher`,
loopback only) train an FSDP2 model (``fully_shard`` per layer on ``init_device_mesh("cpu",
(ranks,))``) of ``Linear(2050, 2050)`` layers -- 2050 rows do not divide by 4, so the shards are
uneven (513, 513, 513, 511) -- for one AdamW step.  The model plus its AdamW moments make about
``--size-mib`` MiB (default 512).  That state (``get_model_state_dict`` +
``get_optimizer_state_dict``: DTensors) is saved once with xla_ckpt (``save_distributed``,
every rank writes its own chunks) and once with ``dcp.save``, to local disk and to the GCS
emulator behind the shaping proxy (30 ms first byte, 32 MiB/s per connection, as in
``benchmarks/gcs_restore.py``; one proxy per rank, so each rank's bytes are counted apart).
Then every method restores it into the same live DTensors (zeroed before each run), methods
interleaved, ``--repeat`` runs each (median):

  xla_ckpt_local   restore(<folder>, into=<the DTensors>): each rank reads only the byte ranges of
                   its own shards, crc32c-checked, straight into the local tensors
  dcp_local        dcp.load(<the DTensors>, storage_reader=FileSystemReader(<folder>))
  xla_ckpt_gcs     restore(gs://..., into=...) through this rank's shaping proxy
  dcp_gcs          dcp.load(..., storage_reader=FsspecReader(gs://..., endpoint_url=<proxy>))
                   (gcsfs: the ``bench`` extra; without it one skip line and the rest run)
  xla_ckpt_local_broadcast
                   (not in the default set) the same with strategy="broadcast"

One JSON line per method: ``seconds`` (slowest rank, from a barrier until the restore returned;
median of the runs) and ``runs_seconds``; per rank: ``shard_mib_per_rank`` (the bytes of the
rank's own local shards plus the replicated scalars), ``mib_read_per_rank`` (xla_ckpt: its
``RestoreStats`` bytes read + received + mapped; DCP local: the byte length of every saved item
its reader opened, plus ``.metadata``; GCS methods: the bytes this rank's proxy served) and its
ratio to the shard bytes, ``peak_rss_over_baseline_mib_per_rank`` (VmHWM reset just before the
run, minus the RSS then) and its ratio to the shard bytes; ``bitwise_ok`` (every local shard's
crc32c equals the one saved; checked after the clock stops); ``ratio_vs_<peer>`` (peer seconds /
this method's seconds, > 1: this one is faster).

Part ``save``: the same ranks save a *replicated* state of ``--size-mib`` MiB (plain fp32
tensors, equal on every rank) to local disk, interleaved:

  save_balanced    save_distributed(state, uri, balance_replicated=True): each replicated tensor
                   gets one writer, chosen to balance bytes over the ranks
  save_rank0       save_distributed(state, uri): rank 0 writes the whole replicated state

Part ``save_gcs``: the same two saves to the GCS emulator, each rank through its own shaping
proxy that also shapes uploads (``Shaping(shape_uploads=True)``): 30 ms first byte, 32 MiB/s
per connection (``--stream-mib-s``) and ``--upload-host-mib-s`` (64) MiB/s for all of the
rank's connections together (its VM's link: one proxy per rank, so the cap is per rank).
xla_ckpt uploads each large file as parallel 32 MiB parts, so the per-stream cap alone would
let rank 0 go ``max_workers`` times faster; GCS also limits one VM's upload rate, which is what
spreading the replicated writes over the ranks is for.  Lines ``save_balanced_gcs`` /
``save_rank0_gcs``; ``mib_written_per_rank`` is the request-body bytes each rank's proxy read.
Not in ``--quick``'s default parts.

Part ``manifest``: a version-2 manifest of ``--manifest-tensors`` (1000) global tensors x
``--manifest-chunks`` (256) chunks each (a 16 x 16 grid of boxes, one chunk item per rank), its
size in bytes and the median seconds of ``Manifest.from_json_bytes`` (every validation included)
on one process.

The last line is ``{"summary": ...}``: each target (issue 12) with the measured figure and
whether it was met.

  .venv/bin/python benchmarks/sharded_restore.py                       # 512 MiB, everything
  .venv/bin/python benchmarks/sharded_restore.py --repeat 5 --parts restore
  .venv/bin/python benchmarks/sharded_restore.py --parts save,save_gcs   # the replicated save
  .venv/bin/python benchmarks/sharded_restore.py --quick               # seconds-long smoke run
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

MiB = 1024 * 1024
RESTORE_METHODS = ("xla_ckpt_local", "dcp_local", "xla_ckpt_gcs", "dcp_gcs",
                   "xla_ckpt_local_broadcast")
DEFAULT_RESTORE = "xla_ckpt_local,dcp_local,xla_ckpt_gcs,dcp_gcs"
SAVE_METHODS = ("save_balanced", "save_rank0")
PARTS = ("restore", "save", "save_gcs", "manifest")
QUICK_PARTS = ("restore", "save", "manifest")
#: method -> the peer its ``ratio_vs_peer`` and the targets compare it with
PEER = {"xla_ckpt_local": "dcp_local", "xla_ckpt_gcs": "dcp_gcs",
        "xla_ckpt_local_broadcast": "dcp_local", "save_balanced": "save_rank0",
        "save_balanced_gcs": "save_rank0_gcs"}
INSTALL_GCSFS = ".venv/bin/pip install -e '.[bench]'"


def model_dims(size_mib: int) -> tuple[int, int]:
    """(width, layers) of the Linear(width, width) stack whose weights, biases and two AdamW
    moments make about ``size_mib`` MiB (fp32).  Width 2050 from 64 MiB up, 258 below."""
    width = 2050 if size_mib >= 64 else 258
    per_layer = 3 * 4 * (width * width + width)
    return width, max(1, round(size_mib * MiB / per_layer))


def replicated_layout(size_mib: int) -> list[tuple[str, tuple[int, ...]]]:
    """(key, shape) of the replicated fp32 state of the save part: 16 MiB matrices (1 MiB below
    64 MiB) and a remainder, ``size_mib`` MiB in all."""
    rows = 4096 if size_mib >= 64 else 256
    per = rows * 1024
    n_full, rest = divmod(size_mib * MiB // 4, per)
    out: list[tuple[str, tuple[int, ...]]] = [(f"layers.{i}.weight", (rows, 1024))
                                              for i in range(n_full)]
    if rest:
        out.append(("embed.weight", (rest // 1024, 1024)))
    return out


# ---- on every rank -----------------------------------------------------------------------
#: what a rank keeps between calls of the pool: the live targets and what they must hold
_HELD: dict[str, Any] = {}


def _join() -> Any:
    """This rank's Dist (gloo).  The rank's stdout goes to stderr first: gloo prints its
    connection lines to stdout, which is the parent's stream of JSON lines."""
    from xla_ckpt.comm import DistConfig, get_dist

    if not _HELD.get("stdout_to_stderr"):
        sys.stdout.flush()
        os.dup2(2, 1)
    _HELD["stdout_to_stderr"] = True
    return get_dist(DistConfig(backend="gloo", timeout_s=1800))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(key + r":\s+(\d+)", f.read())
    assert m is not None, key
    return int(m.group(1)) * 1024


def _io(key: str) -> int:
    with open("/proc/self/io") as f:
        m = re.search(r"^" + key + r":\s+(\d+)", f.read(), re.M)
    assert m is not None, key
    return int(m.group(1))


def _reset_peak() -> int:
    """Free what can be freed, reset the peak-RSS mark; the RSS now (bytes)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _leaves(tree: Any) -> dict[str, Any]:
    """Flat FQN -> tensor leaf (DTensor or plain) of a state-dict tree (DCP's own flattening)."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(tree)
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def _crcs(leaves: dict[str, Any]) -> dict[str, int]:
    from xla_ckpt.format.crc import crc32c
    from xla_ckpt.testing.asserts import tensor_bits

    return {k: crc32c(tensor_bits(_local(v).detach().contiguous())) for k, v in leaves.items()}


def _counting_reader(kind: str, path: str, **kwargs: Any) -> Any:
    """A DCP reader (``FileSystemReader`` or ``FsspecReader``) that adds up the bytes of every
    saved item it opens (what its ``read_data`` reads: each ReadItem reads the whole saved
    chunk it points at) plus the ``.metadata`` file, in ``.bytes_read``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    base = FileSystemReader if kind == "local" else FsspecReader

    class Counting(base):  # type: ignore[misc, valid-type]  # chosen at run time
        bytes_read = 0

        def read_metadata(self) -> Any:
            md = super().read_metadata()
            meta = self.fs.concat_path(self.path, ".metadata")
            with self.fs.create_stream(meta, "rb") as f:
                f.seek(0, os.SEEK_END)
                self.bytes_read += f.tell()
            return md

        def read_data(self, plan: Any, planner: Any) -> Any:
            self.bytes_read += sum(self.storage_data[ri.storage_index].length
                                   for ri in plan.items)
            return super().read_data(plan, planner)

    return Counting(path, **kwargs)


def setup_sharded(spec: dict) -> dict:
    """Build the FSDP2 model, take one AdamW step, save it four ways; keep the live state.

    Every rank: xla_ckpt ``save_distributed`` to ``<workdir>/xla`` (and to GCS through its own
    proxy), ``dcp.save`` to ``<workdir>/dcp``; rank 0 uploads the DCP folder object by object
    (unshaped uploads).  Returns this rank's shard bytes and the state's global bytes.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from xla_ckpt.restore import save_distributed

    torch.set_num_threads(1)
    d = _join()
    if spec.get("proxies"):
        os.environ["STORAGE_EMULATOR_HOST"] = spec["proxies"][d.rank]
    mesh = init_device_mesh("cpu", (d.world_size,))
    width, layers = spec["width"], spec["layers"]
    torch.manual_seed(0)  # the same full model on every rank; fully_shard keeps each rank's rows
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(100 + d.rank)
    model(torch.randn(2, width)).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    into = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    leaves = _leaves(into)
    _HELD.clear()
    _HELD.update(model=model, optim=optim, into=into, leaves=leaves, crcs=_crcs(leaves))
    shard_bytes = sum(_local(v).numel() * v.element_size() for v in leaves.values())
    global_bytes = sum(v.numel() * v.element_size() for v in leaves.values())
    work = spec["workdir"]
    xla_error = ""
    try:  # a failed xla_ckpt save fails the xla_ckpt methods only; DCP's still run
        save_distributed(into, os.path.join(work, "xla"), dist=d)
        if spec.get("gcs_prefix"):
            save_distributed(into, spec["gcs_prefix"] + "/xla", dist=d)
    except Exception as e:  # noqa: BLE001 - reported on the methods' lines
        xla_error = f"xla_ckpt save failed: {type(e).__name__}: {e}"[:800]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(into, storage_writer=dcp.FileSystemWriter(os.path.join(work, "dcp")))
    d.barrier()
    if spec.get("gcs_prefix"):
        if d.rank == 0 and spec.get("dcp_gcs"):
            from xla_ckpt.storage import open_storage

            st = open_storage(spec["gcs_prefix"] + "/dcp")
            try:
                local = os.path.join(work, "dcp")
                for name in sorted(os.listdir(local)):
                    with open(os.path.join(local, name), "rb") as f:
                        st.write_atomic(name, [f.read()])
            finally:
                st.close()
        d.barrier()
    if spec.get("dcp_gcs"):
        import gcsfs  # noqa: F401 - imported before any clock (the first import costs ~1 s)
    return {"shard_bytes": shard_bytes, "global_bytes": global_bytes, "xla_error": xla_error}


def run_restore(method: str, spec: dict) -> dict:
    """One timed restore of ``method`` into the held DTensors (zeroed first), on every rank."""
    import torch
    import torch.distributed.checkpoint as dcp

    from xla_ckpt.restore import restore

    d = _join()
    leaves = _HELD["leaves"]
    with torch.no_grad():
        for v in leaves.values():
            _local(v).zero_()
    work = spec["workdir"]
    base = _reset_peak()
    d.barrier()
    t0 = time.perf_counter()
    extra: dict[str, Any] = {}
    if method.startswith("xla_ckpt"):
        uri = spec["gcs_prefix"] + "/xla" if method == "xla_ckpt_gcs" else os.path.join(work, "xla")
        strategy = "broadcast" if method.endswith("_broadcast") else "all_ranks"
        restore_into: Any = restore  # into= is issue 12's (H3); typed loosely while it lands
        res = restore_into(uri, dist=d, into=_HELD["into"], strategy=strategy)
        st = res.stats
        fetched = st.bytes_read + st.bytes_received + st.bytes_mapped
        extra = {"bytes_reported": [st.bytes_read, st.bytes_received, st.bytes_mapped],
                 "read_seconds": st.read_seconds}
        del res
    elif method == "dcp_local":
        reader = _counting_reader("local", os.path.join(work, "dcp"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(_HELD["into"], storage_reader=reader)
        fetched = reader.bytes_read
    elif method == "dcp_gcs":
        bucket_path = "gs://" + spec["gcs_prefix"][len("gs://"):] + "/dcp"
        reader = _counting_reader("fsspec", bucket_path, token="anon",
                                  endpoint_url=spec["proxies"][d.rank])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(_HELD["into"], storage_reader=reader)
        fetched = reader.bytes_read
    else:
        raise ValueError(f"unknown restore method {method!r}")
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    ok = _crcs(leaves) == _HELD["crcs"]
    d.barrier()
    return {"seconds": seconds, "fetched": fetched, "peak_over_base": peak - base, "ok": ok,
            **extra}


def setup_replicated(spec: dict) -> dict:
    """The save part's replicated state, the same on every rank (fixed seed); kept held."""
    import torch

    from xla_ckpt.format.crc import crc32c
    from xla_ckpt.testing.asserts import tensor_bits

    torch.set_num_threads(1)
    _join()
    _HELD.clear()
    g = torch.Generator().manual_seed(7)
    state: dict[str, Any] = {"model": {k: torch.empty(s).uniform_(generator=g)
                       for k, s in replicated_layout(spec["size_mib"])}, "num_updates": 1000}
    _HELD["rep"] = state
    _HELD["rep_crc"] = {k: crc32c(tensor_bits(v)) for k, v in state["model"].items()}
    return {"bytes": sum(v.numel() * 4 for v in state["model"].values())}


def run_save(method: str, spec: dict, run: int) -> dict:
    """One timed ``save_distributed`` of the replicated state on every rank, to a fresh folder
    (``<workdir>/<method>-<run>``, or ``<gcs_prefix>/<method>-<run>`` through this rank's proxy
    when ``spec["proxies"]`` is set)."""
    from xla_ckpt.restore import save_distributed

    d = _join()
    gcs = bool(spec.get("proxies"))
    if gcs:
        os.environ["STORAGE_EMULATOR_HOST"] = spec["proxies"][d.rank]
        uri = f"{spec['gcs_prefix']}/{method}-{run}"
    else:
        uri = os.path.join(spec["workdir"], f"{method}-{run}")
    balanced = method.startswith("save_balanced")
    kwargs: dict[str, Any] = {"balance_replicated": True} if balanced else {}
    base = _reset_peak()
    w0 = _io("wchar")
    d.barrier()
    t0 = time.perf_counter()
    save: Any = save_distributed  # balance_replicated= is issue 12's (H2)
    save(_HELD["rep"], uri, dist=d, **kwargs)
    seconds = time.perf_counter() - t0
    written = _io("wchar") - w0
    peak = _status("VmHWM")
    d.barrier()
    ok = None
    if d.rank == 0:
        if run == 0:  # the first save of each method is read back and checked bitwise
            import xla_ckpt
            from xla_ckpt.format.crc import crc32c
            from xla_ckpt.testing.asserts import tensor_bits

            got = xla_ckpt.load(uri)["model"]
            ok = {k: crc32c(tensor_bits(v)) for k, v in got.items()} == _HELD["rep_crc"]
            del got
        if not gcs:  # the parent deletes the GCS objects
            shutil.rmtree(uri, ignore_errors=True)
    d.barrier()
    return {"seconds": seconds, "written": written, "peak_over_base": peak - base, "ok": ok}


def drop_held() -> None:
    _HELD.clear()
    gc.collect()


# ---- manifest part (one process) ---------------------------------------------------------
def manifest_figures(n_tensors: int, n_chunks: int, repeat: int) -> dict:
    """Size and parse seconds of a version-2 manifest of ``n_tensors`` x ``n_chunks`` chunks.

    Each global tensor is (64 * g, 64 * g) fp32 with g = ceil(sqrt(n_chunks)) rows/cols of 64 x
    64 boxes (the first ``n_chunks`` boxes of the grid tile a ``(64 * rows_used, 64 * g)``
    tensor); chunk ``c`` of every tensor lives in item ``chunks/<c>`` (one per "rank"), whose one
    blob holds its tensors back to back with 4 MiB crc32c chunks.
    """
    import math

    from xla_ckpt.format.chunks import ChunkRecord, GlobalTensor, chunk_item
    from xla_ckpt.format.manifest import BlobRecord, Item, Manifest, TensorRecord

    g = math.isqrt(n_chunks)
    if g * g != n_chunks:
        raise ValueError(f"--manifest-chunks must be a square (a g x g grid), got {n_chunks}")
    side = 64
    shape = (side * g, side * g)
    per = side * side * 4
    blob_len = per * n_tensors
    n_crc = -(-blob_len // (4 * MiB))
    items: dict[str, Item] = {}
    files: dict[str, int] = {}
    for c in range(n_chunks):
        r, q = divmod(c, g)
        name = chunk_item(c)
        file = f"data-{c:05d}.safetensors"
        files[file] = blob_len + 4096
        tensors = [TensorRecord(key=f"state['model']['t{t}'][{r * side}:{(r + 1) * side},"
                                    f"{q * side}:{(q + 1) * side}]",
                                blob=0, byte_offset=t * per, dtype="float32",
                                shape=(side, side), stride=(side, 1)) for t in range(n_tensors)]
        items[name] = Item(state=[{"$tensor": t} for t in range(n_tensors)], tensors=tensors,
                           blobs=[BlobRecord(file=file, offset=4096, length=blob_len,
                                             crc32c=0x1234567, chunk_size=4 * MiB,
                                             chunk_crc32c=tuple(range(n_crc)))])
    gts = []
    for t in range(n_tensors):
        chunks = tuple(ChunkRecord(item=chunk_item(c), tensor=t,
                                   offsets=(side * (c // g), side * (c % g)), sizes=(side, side))
                       for c in range(n_chunks))
        gts.append(GlobalTensor(key=f"state['model']['t{t}']", dtype="float32", shape=shape,
                                chunks=chunks, placement=f"Shard(0), Shard(1) on mesh ({g}, {g})"))
    items["state"] = Item(state={"model": {f"t{t}": {"$tensor": t} for t in range(n_tensors)}},
                          chunked=True)
    manifest = Manifest(save_id="0" * 16, items=items, files=files, world_size=n_chunks,
                        global_tensors=gts)
    data = manifest.to_json_bytes()
    del manifest, items, gts
    times = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        parsed = Manifest.from_json_bytes(data, where="bench manifest", require_crc=True)
        times.append(time.perf_counter() - t0)
        assert len(parsed.global_tensors) == n_tensors
        del parsed
    return {"part": "manifest", "tensors": n_tensors, "chunks_per_tensor": n_chunks,
            "tensor_records": n_tensors * n_chunks, "bytes": len(data),
            "mib": round(len(data) / MiB, 1), "parse_seconds": round(statistics.median(times), 3),
            "parse_runs_seconds": [round(t, 3) for t in times]}


# ---- parent ------------------------------------------------------------------------------
def gcsfs_missing() -> str | None:
    """None if gcsfs imports here (dcp_gcs), else the reason (one line)."""
    try:
        import gcsfs  # noqa: F401 - the import is the check
    except Exception as e:  # noqa: BLE001 - a broken install raises anything; dcp_gcs is optional
        return f"gcsfs does not import: {type(e).__name__}: {e}".splitlines()[0]
    return None


def _per_rank(runs: list[list[dict]], key: str) -> list[float]:
    """Per rank: the worst (max) of ``key`` over the runs."""
    return [max(run[r][key] for run in runs) for r in range(len(runs[0]))]


def summarise(method: str, part: str, runs: list[list[dict]], shard: list[int] | None,
              common: dict) -> dict:
    secs = [max(v["seconds"] for v in run) for run in runs]
    med = runs[secs.index(statistics.median_low(secs))]
    line: dict[str, Any] = {"method": method, "part": part, **common,
                            "seconds": round(statistics.median(secs), 3),
                            "runs_seconds": [round(s, 3) for s in secs],
                            "seconds_per_rank": [round(v["seconds"], 3) for v in med]}
    rss = _per_rank(runs, "peak_over_base")
    if part == "restore":
        assert shard is not None
        fetched = _per_rank(runs, "fetched")
        line["shard_mib_per_rank"] = [round(b / MiB, 1) for b in shard]
        line["mib_read_per_rank"] = [round(b / MiB, 1) for b in fetched]
        line["read_over_shard_per_rank"] = [round(f / s, 3) for f, s in zip(fetched, shard,
                                                                           strict=True)]
        if "served" in runs[0][0]:
            line["mib_served_by_proxy_per_rank"] = [round(b / MiB, 1)
                                                   for b in _per_rank(runs, "served")]
        if "bytes_reported" in runs[0][0]:
            line["stats_read_received_mapped_mib_rank0"] = [
                round(b / MiB, 1) for b in med[0]["bytes_reported"]]
            line["stats_read_seconds_per_rank"] = [round(v["read_seconds"], 3) for v in med]
        line["peak_rss_over_baseline_mib_per_rank"] = [round(b / MiB, 1) for b in rss]
        line["rss_over_shard_per_rank"] = [round(b / s, 3) for b, s in zip(rss, shard,
                                                                          strict=True)]
    else:
        line["mib_written_per_rank"] = [round(v["written"] / MiB, 1) for v in med]
        line["peak_rss_over_baseline_mib_per_rank"] = [round(b / MiB, 1) for b in rss]
    oks = [v["ok"] for run in runs for v in run if v["ok"] is not None]
    line["bitwise_ok"] = bool(oks) and all(oks)
    return line


def summary(lines: dict[str, dict], manifest: dict | None, size_mib: int) -> dict:
    """Issue 12's targets against the measured figures (absent methods left out)."""
    out: dict[str, Any] = {"summary": "targets (issue 12)"}

    def ratio(m: str, target: float, name: str) -> None:
        if m in lines and PEER[m] in lines:
            r = lines[m][f"ratio_vs_{PEER[m]}"]
            out[name] = {"ratio": r, "target": target, "met": r >= target}

    ratio("xla_ckpt_gcs", 3.0, "restore_vs_dcp_emulator")
    ratio("xla_ckpt_local", 1.5, "restore_vs_dcp_local_disk")
    for m in ("xla_ckpt_local", "xla_ckpt_gcs"):
        if m in lines:
            worst = max(lines[m]["read_over_shard_per_rank"])
            out[f"{m}_bytes_read_over_shard_max"] = {"ratio": worst, "target": 1.05,
                                                    "met": worst <= 1.05}
            worst = max(lines[m]["rss_over_shard_per_rank"])
            out[f"{m}_peak_rss_over_shard_max"] = {"ratio": worst, "target": 1.2,
                                                  "met": worst <= 1.2}
    ratio("save_balanced", 2.0, f"save_balanced_vs_rank0_{size_mib}mib_replicated")
    ratio("save_balanced_gcs", 2.0,
          f"save_balanced_vs_rank0_{size_mib}mib_replicated_shaped_emulator")
    if manifest is not None and "parse_seconds" in manifest:
        out["manifest_parse_seconds"] = {"seconds": manifest["parse_seconds"],
                                         "bytes": manifest["bytes"], "target": "well under 1 s",
                                         "met": manifest["parse_seconds"] < 1.0}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=None,
                    help="state size (default 512; 8 with --quick)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=None, help="runs per method (default 3; "
                                                              "1 with --quick)")
    ap.add_argument("--parts", default=None,
                    help=f"of {', '.join(PARTS)} (default all; --quick: "
                         f"{','.join(QUICK_PARTS)})")
    ap.add_argument("--methods", default=DEFAULT_RESTORE,
                    help=f"restore methods, in run order (of {', '.join(RESTORE_METHODS)})")
    ap.add_argument("--save-methods", default=",".join(SAVE_METHODS))
    ap.add_argument("--manifest-tensors", type=int, default=None, help="default 1000 (--quick 50)")
    ap.add_argument("--manifest-chunks", type=int, default=None, help="default 256 (--quick 16)")
    ap.add_argument("--first-byte-latency-ms", type=float, default=30.0)
    ap.add_argument("--stream-mib-s", type=float, default=32.0)
    ap.add_argument("--upload-host-mib-s", type=float, default=64.0,
                    help="save_gcs: upload cap of each rank's proxy (the rank's VM), MiB/s")
    ap.add_argument("--quick", action="store_true",
                    help="small sizes for a smoke run: 8 MiB, 1 repeat, a 50 x 16 manifest")
    a = ap.parse_args(argv)
    size = a.size_mib or (8 if a.quick else 512)
    repeat = a.repeat or (1 if a.quick else 3)
    n_tensors = a.manifest_tensors or (50 if a.quick else 1000)
    n_chunks = a.manifest_chunks or (16 if a.quick else 256)
    parts = [p for p in (a.parts or ",".join(QUICK_PARTS if a.quick else PARTS)).split(",")
             if p]
    methods = [m for m in a.methods.split(",") if m]
    save_methods = [m for m in a.save_methods.split(",") if m]
    for p in parts:
        if p not in PARTS:
            ap.error(f"unknown part {p!r}; choose from {', '.join(PARTS)}")
    for m in methods:
        if m not in RESTORE_METHODS:
            ap.error(f"unknown method {m!r}; choose from {', '.join(RESTORE_METHODS)}")
    for m in save_methods:
        if m not in SAVE_METHODS:
            ap.error(f"unknown save method {m!r}; choose from {', '.join(SAVE_METHODS)}")

    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # else gcsfs waits on gRPC
    if "restore" in parts and "dcp_gcs" in methods:
        why = gcsfs_missing()
        if why is not None:
            print(json.dumps({"method": "dcp_gcs", "skipped": f"install with: {INSTALL_GCSFS}",
                              "extra": "bench", "reason": why}), flush=True)
            methods.remove("dcp_gcs")

    lines: dict[str, dict] = {}
    manifest_line: dict | None = None
    if "manifest" in parts:
        try:
            manifest_line = manifest_figures(n_tensors, n_chunks, max(3, repeat))
        except Exception as e:  # noqa: BLE001 - report it, run the other parts
            manifest_line = {"part": "manifest", "failed": f"{type(e).__name__}: {e}"[:500]}
        print(json.dumps(manifest_line), flush=True)

    import contextlib

    from xla_ckpt.testing.launcher import WorkerPool

    common = {"ranks": a.ranks, "size_mib": size}
    with contextlib.ExitStack() as stack:
        work = stack.enter_context(tempfile.TemporaryDirectory(prefix="xla_ckpt_sharded_"))
        need_gcs = "restore" in parts and any(m.endswith("_gcs") for m in methods)
        save_gcs = "save_gcs" in parts and bool(save_methods)
        proxies: list[Any] = []
        up_proxies: list[Any] = []
        env = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024),
               "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
        gcs_prefix = ""
        emu: Any = None
        if need_gcs or save_gcs:
            from xla_ckpt.testing.fault_proxy import FaultProxy, Shaping
            from xla_ckpt.testing.gcs_emulator import GCSEmulator

            emu = stack.enter_context(GCSEmulator())
            env.update(emu.env())
            gcs_prefix = emu.unique_uri("sharded")
        if need_gcs:
            shaping = Shaping(first_byte_latency_s=a.first_byte_latency_ms / 1000,
                              stream_mib_s=a.stream_mib_s)
            proxies = [stack.enter_context(FaultProxy(emu.host, shaping=shaping))
                       for _ in range(a.ranks)]
        if save_gcs:
            up_shaping = Shaping(first_byte_latency_s=a.first_byte_latency_ms / 1000,
                                 stream_mib_s=a.stream_mib_s, host_mib_s=a.upload_host_mib_s,
                                 shape_uploads=True)
            up_proxies = [stack.enter_context(FaultProxy(emu.host, shaping=up_shaping))
                          for _ in range(a.ranks)]
        pool = WorkerPool(a.ranks, xla=False, env=env)
        stack.callback(pool.close)

        if "restore" in parts and methods:
            width, layers = model_dims(size)
            spec: dict[str, Any] = {
                "workdir": os.path.join(work, "restore"), "width": width, "layers": layers,
                "proxies": [p.url for p in proxies], "gcs_prefix": gcs_prefix,
                "dcp_gcs": "dcp_gcs" in methods}
            os.makedirs(spec["workdir"])
            t0 = time.perf_counter()
            info = [r.unwrap() for r in pool.run(setup_sharded, spec, timeout_s=3600)]
            shard = [i["shard_bytes"] for i in info]
            state_mib = info[0]["global_bytes"] / MiB
            print(f"# FSDP2 state {state_mib:.1f} MiB ({layers} x Linear({width}, {width}) + "
                  f"AdamW), saved 4 ways in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                  flush=True)
            runs: dict[str, list[list[dict]]] = {m: [] for m in methods}
            failed: dict[str, str] = {}
            why = next((i["xla_error"] for i in info if i["xla_error"]), "")
            for m in methods:
                if why and m.startswith("xla_ckpt"):
                    failed[m] = why
                    print(json.dumps({"method": m, "part": "restore", "failed": why}), flush=True)
            for _ in range(repeat):
                for m in methods:
                    if m in failed:
                        continue
                    for p in proxies:
                        p.reset_log()
                    res = pool.run(run_restore, m, spec, timeout_s=3600)
                    bad = [r for r in res if not r.ok]
                    if bad:
                        failed[m] = f"rank {bad[0].rank}: {bad[0].error!r}"[:800]
                        print(json.dumps({"method": m, "part": "restore", "failed": failed[m]}),
                              flush=True)
                        if pool.broken:
                            pool = WorkerPool(a.ranks, xla=False, env=env)
                            stack.callback(pool.close)
                            [r.unwrap() for r in pool.run(setup_sharded, spec, timeout_s=3600)]
                        continue
                    per_rank = [r.unwrap() for r in res]
                    if m.endswith("_gcs"):
                        for r, p in zip(per_rank, proxies, strict=True):
                            r["served"] = p.snapshot().bytes_served
                            r["fetched"] = r["served"]
                    runs[m].append(per_rank)
                    print(f"# {m}: {max(v['seconds'] for v in per_rank):.2f} s", file=sys.stderr,
                          flush=True)
            for m in methods:
                if runs[m] and m not in failed:
                    lines[m] = summarise(m, "restore", runs[m], shard,
                                         {**common, "state_mib": round(state_mib, 1)})
            pool.run(drop_held, timeout_s=600)

        held_replicated: dict | None = None
        for part in ("save", "save_gcs"):
            if part not in parts or not save_methods:
                continue
            gcs = part == "save_gcs"
            spec = {"workdir": os.path.join(work, part), "size_mib": size,
                    "proxies": [p.url for p in up_proxies] if gcs else [],
                    "gcs_prefix": f"{gcs_prefix}/save" if gcs else ""}
            os.makedirs(spec["workdir"])
            if held_replicated is None:
                held_replicated = [r.unwrap() for r in pool.run(setup_replicated, spec,
                                                                timeout_s=3600)][0]
            names = {m: f"{m}_gcs" if gcs else m for m in save_methods}
            sruns: dict[str, list[list[dict]]] = {m: [] for m in save_methods}
            sfailed: dict[str, str] = {}
            for i in range(repeat):
                for m in save_methods:
                    if m in sfailed:
                        continue
                    for p in up_proxies:
                        p.reset_log()
                    res = pool.run(run_save, names[m], spec, i, timeout_s=3600)
                    bad = [r for r in res if not r.ok]
                    if bad:
                        sfailed[m] = f"rank {bad[0].rank}: {bad[0].error!r}"[:800]
                        print(json.dumps({"method": names[m], "part": part,
                                          "failed": sfailed[m]}), flush=True)
                        if pool.broken:
                            break
                        continue
                    per_rank = [r.unwrap() for r in res]
                    if gcs:
                        for r, p in zip(per_rank, up_proxies, strict=True):
                            r["written"] = p.snapshot().bytes_received
                        bucket_prefix = f"{spec['gcs_prefix']}/{names[m]}-{i}/"
                        emu.delete_prefix(bucket_prefix[len(f"gs://{emu.bucket}/"):])
                    sruns[m].append(per_rank)
                    print(f"# {names[m]}: {max(v['seconds'] for v in per_rank):.2f} s",
                          file=sys.stderr, flush=True)
                if pool.broken:
                    break
            extra: dict[str, Any] = {"storage": "local"}
            if gcs:
                extra = {"storage": "gcs_emulator", "shaping": {
                    "first_byte_latency_ms": a.first_byte_latency_ms,
                    "stream_mib_s": a.stream_mib_s, "upload_host_mib_s": a.upload_host_mib_s,
                    "proxy": "one per rank, uploads shaped"}}
            for m in save_methods:
                if sruns[m] and m not in sfailed:
                    lines[names[m]] = summarise(
                        names[m], "save", sruns[m], None,
                        {**common, "state_mib": round(held_replicated["bytes"] / MiB, 1),
                         **extra})
    for m, line in lines.items():
        peer = PEER.get(m)
        if peer in lines:
            line[f"ratio_vs_{peer}"] = round(lines[peer]["seconds"] / line["seconds"], 2)
        for other, o in lines.items():  # the peer's view of us
            if PEER.get(other) == m:
                line[f"ratio_vs_{other}"] = round(o["seconds"] / line["seconds"], 2)
        print(json.dumps(line), flush=True)
    print(json.dumps(summary(lines, manifest_line, size)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
