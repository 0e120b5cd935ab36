"""``xla-ckpt verify`` and legacy import (``convert``) against their peers (local, warm page cache).

State: ``--size-mib`` MiB of fp32 tensors (8 MiB each) plus a fairseq-style
optimizer history, iterator state, Namespace ``args`` and numpy scalars.
Methods (same process, same bytes, median of ``--repeat``):

  verify           xla_ckpt.io.verify.verify_checkpoint: every blob in parallel slices, chunk and
                   whole-blob crc32c, every problem collected
  peer_crc_seq     naive verify: read each data file whole, one google_crc32c.value per blob
  peer_load        xla_ckpt.load: the restore read path (parallel, crc32c per chunk, stops at the
                   first bad byte)
  import_legacy    xla_ckpt.format.legacy.load_legacy of the same state saved with torch.save:
                   static pickle scan + torch.load(weights_only, allow-list) + bounded walk +
                   fairseq upgrade
  peer_torch_load  torch.load(weights_only=True) with the same safe globals, nothing else
  convert          load_legacy + xla_ckpt.save (what `xla-ckpt convert` does)
  peer_torch_copy  torch.load(weights_only=True) + torch.save to a new file

The same tensors as a PyTorch DCP checkpoint (``dcp.save``, no Namespace: DCP items must load
with weights_only), read by xla_ckpt's DCP reader (byte ranges, no template state needed):

  convert_dcp             `xla-ckpt convert DCP DST`: read_dcp + unflatten + xla_ckpt.save
  peer_dcp_load_save      dcp.load into a preallocated template (no_dist) + the same
                          xla_ckpt.save
  export_dcp_pt           `xla-ckpt export DCP out.pt --format pt`: read_dcp + torch.save
  peer_dcp_load_torch_save dcp.load into a preallocated template + torch.save

Each line is JSON with ``seconds``, ``mib_s`` and ``ratio_vs_<peer>`` (peer seconds / these
seconds: > 1 means the xla_ckpt method is faster).

  .venv/bin/python benchmarks/cli_verify_convert.py [--size-mib 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import google_crc32c  # noqa: E402 - after the sys.path insert above
import numpy as np  # noqa: E402 - after the sys.path insert above
import torch  # noqa: E402 - after the sys.path insert above
import torch.distributed.checkpoint as dcp  # noqa: E402 - after the sys.path insert above

import xla_ckpt  # noqa: E402 - after the sys.path insert above
from xla_ckpt.format import legacy  # noqa: E402 - after the sys.path insert above
from xla_ckpt.io import read_manifest  # noqa: E402 - after the sys.path insert above
from xla_ckpt.io.verify import verify_checkpoint  # noqa: E402 - after the sys.path insert above
from xla_ckpt.kinds.export import export  # noqa: E402 - after the sys.path insert above
from xla_ckpt.kinds.foreign import read_foreign  # noqa: E402 - after the sys.path insert above
from xla_ckpt.run.resolve import resolve  # noqa: E402 - after the sys.path insert above
from xla_ckpt.storage import open_storage  # noqa: E402 - after the sys.path insert above

MiB = 1024 * 1024


def make_state(size_mib: int) -> dict:
    g = torch.Generator().manual_seed(0)
    n = max(1, size_mib // 8)
    model = {f"layers.{i}.weight": torch.randn(2 * MiB, generator=g) for i in range(n)}
    return {
        "args": argparse.Namespace(lr=1e-3, arch="bench", seed=np.int64(1)),
        "model": model,
        "optimizer_history": [{"criterion_name": "CrossEntropyCriterion",
                               "optimizer_name": "AdamW", "lr_scheduler_state": {"best": 1.0},
                               "num_updates": np.int64(100)}],
        "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 5, "version": 2},
                        "val_loss": np.float64(1.5)},
    }


def timed(fn, repeat: int) -> float:
    fn()  # warm-up: page cache, thread pools, imports
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    state = make_state(args.size_mib)
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    with tempfile.TemporaryDirectory() as tmp:
        ck = os.path.join(tmp, "ck")
        xla_ckpt.save(state, ck)
        pt = os.path.join(tmp, "legacy.pt")
        torch.save(state, pt)
        st = open_storage(ck)
        m = read_manifest(st)

        def verify():
            assert verify_checkpoint(st, m).ok

        def crc_seq():
            for item in m.items.values():
                data = {}
                for b in item.blobs:
                    if b.file not in data:
                        with open(os.path.join(ck, b.file), "rb") as f:
                            data[b.file] = f.read()
                    view = memoryview(data[b.file])[b.offset:b.offset + b.length]
                    assert google_crc32c.value(bytes(view)) == b.crc32c

        def load():
            xla_ckpt.load(ck)

        def import_legacy():
            with open(pt, "rb") as f:
                legacy.load_legacy(f, where=pt)

        extra: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
            (obj, name) for name, obj in legacy._EXTRA.items()]

        def torch_load():
            with torch.serialization.safe_globals(extra):
                torch.load(pt, map_location="cpu", weights_only=True)

        def convert():
            with open(pt, "rb") as f:
                got = legacy.load_legacy(f, where=pt)
            xla_ckpt.save(got.state, os.path.join(tmp, "converted"), metadata=got.metadata)

        def torch_copy():
            with torch.serialization.safe_globals(extra):
                obj = torch.load(pt, map_location="cpu", weights_only=True)
            torch.save(obj, os.path.join(tmp, "copy.pt"))

        dcp_state = {"model": state["model"],
                     "optim": {"step": torch.tensor(100.0), "lr": 1e-3, "betas": [0.9, 0.98]}}
        dcp_dir = os.path.join(tmp, "dcp")
        dcp.save(dcp_state, storage_writer=dcp.FileSystemWriter(dcp_dir), no_dist=True)

        def template() -> dict:
            return {"model": {k: torch.empty_like(v) for k, v in dcp_state["model"].items()},
                    "optim": {"step": torch.empty(()), "lr": 0.0, "betas": [0.0, 0.0]}}

        def convert_dcp():
            got = read_foreign(resolve(dcp_dir))
            xla_ckpt.save(got, os.path.join(tmp, "from_dcp"),
                          metadata={"source_format": "dcp"})

        def dcp_load_save():
            target = template()
            dcp.load(target, storage_reader=dcp.FileSystemReader(dcp_dir), no_dist=True)
            xla_ckpt.save(target, os.path.join(tmp, "from_dcp_peer"),
                          metadata={"source_format": "dcp"})

        def export_dcp_pt():
            export(dcp_dir, os.path.join(tmp, "dcp.pt"), fmt="pt", overwrite=True)

        def dcp_load_torch_save():
            target = template()
            dcp.load(target, storage_reader=dcp.FileSystemReader(dcp_dir), no_dist=True)
            torch.save(target, os.path.join(tmp, "dcp_peer.pt"))

        results = {name: timed(fn, args.repeat) for name, fn in [
            ("verify", verify), ("peer_crc_seq", crc_seq), ("peer_load", load),
            ("import_legacy", import_legacy), ("peer_torch_load", torch_load),
            ("convert", convert), ("peer_torch_copy", torch_copy),
            ("convert_dcp", convert_dcp), ("peer_dcp_load_save", dcp_load_save),
            ("export_dcp_pt", export_dcp_pt), ("peer_dcp_load_torch_save", dcp_load_torch_save)]}
        st.close()
    peers = {"verify": ["peer_crc_seq", "peer_load"], "import_legacy": ["peer_torch_load"],
             "convert": ["peer_torch_copy"], "convert_dcp": ["peer_dcp_load_save"],
             "export_dcp_pt": ["peer_dcp_load_torch_save"]}
    for name, secs in results.items():
        line = {"method": name, "size_mib": round(nbytes / MiB), "seconds": round(secs, 4),
                "mib_s": round(nbytes / MiB / secs, 1)}
        for peer in peers.get(name, []):
            line[f"ratio_vs_{peer}"] = round(results[peer] / secs, 3)
        print(json.dumps(line))


if __name__ == "__main__":
    main()
