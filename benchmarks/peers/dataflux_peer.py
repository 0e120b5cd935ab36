"""GCS Connector for PyTorch peer of ``benchmarks/gcs_restore.py`` (methods h and i).

  .venv-dataflux/bin/python dataflux_peer.py --spec SPEC --method h

Runs under ``.venv-dataflux`` (``scripts/setup_peers.sh dataflux``): ``gcs-torch-dataflux``
needs ``google-cloud-storage<3``, which cannot share our environment. Its client reaches the
emulator (here the shaping proxy) through ``STORAGE_EMULATOR_HOST``.

The connector's writers upload through XML multipart, which the emulator does not implement, so
the parent writes both layouts plainly (the same objects the connector's writers produce) and
this peer times only the connector's reads:

* ``h`` ``DatafluxCheckpoint.reader(<prefix>/fairseq/checkpoint.pt)`` then
  ``torch.load(stream, weights_only=True)``: the connector's checkpoint reader for ``torch.save``
  files;
* ``i`` ``torch.distributed.checkpoint.load`` with the connector's DCP storage reader
  ``dataflux_pytorch.lightning.GCSDistributedReader`` over ``<prefix>/dcp`` into tensors
  preallocated before the clock (one process, no process group).

The storage client exists before the clock starts (as in methods a-d); the clock covers every
request and the tensors' assembly.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.peers.peer_common import answer, read_spec, status_kib

METHODS = ("h", "i")


def restore(spec: dict[str, Any], method: str) -> None:
    """Time one restore with the connector's reader; print the result line."""
    import torch
    from google.cloud import storage  # google-cloud-storage 2.x of this venv

    torch.set_num_threads(1)
    project = os.environ.get("GOOGLE_CLOUD_PROJECT", "test-project")
    client = storage.Client(project=project)
    bucket, prefix = spec["bucket"], spec["prefix"]
    if method == "h":
        from dataflux_pytorch.dataflux_checkpoint import DatafluxCheckpoint

        ckpt = DatafluxCheckpoint(project_name=project, bucket_name=bucket, storage_client=client)

        def load() -> dict[str, Any]:
            stream = ckpt.reader(f"{prefix}/fairseq/checkpoint.pt")
            out: dict[str, Any] = torch.load(stream, weights_only=True)
            return out
    else:
        import torch.distributed.checkpoint as dcp
        from dataflux_pytorch.lightning import GCSDistributedReader

        dest = {k: torch.empty(shape) for k, shape, _off in spec["layout"]}

        def load() -> dict[str, Any]:
            reader = GCSDistributedReader(f"gs://{bucket}/{prefix}/dcp", project_name=project,
                                          storage_client=client)
            dcp.load(dest, storage_reader=reader)
            return dest

    baseline = status_kib("VmRSS")
    t0 = time.perf_counter()
    state = load()
    seconds = time.perf_counter() - t0
    answer(seconds, baseline, {k: v.numpy() for k, v in state.items()})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True, help="the parent's JSON spec file")
    ap.add_argument("--method", required=True, choices=METHODS, help="time one restore")
    a = ap.parse_args(argv)
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    restore(read_spec(a.spec), a.method)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
