"""Orbax peer of ``benchmarks/gcs_restore.py`` (methods f and g), run by ``.venv-orbax/bin/python``.

  python orbax_peer.py --spec SPEC --save          # untimed set-up: write both layouts
  python orbax_peer.py --spec SPEC --method f      # time one restore, print one JSON line

Orbax (``orbax-checkpoint``) writes and reads arrays through TensorStore's GCS driver, which
reaches the emulator through ``TENSORSTORE_GCS_HTTP_URL`` (here the shaping proxy) with
``GOOGLE_AUTH_TOKEN_FOR_TESTING`` as its bearer token; its path layer (etils ``epath``) opens
``gs://`` through gcsfs, which follows ``STORAGE_EMULATOR_HOST``.

The state is the parent's (``peer_common.load_state``: numpy fp32 arrays, bitwise the torch
tensors of method a). Methods:

* ``f`` Orbax defaults: ``PyTreeCheckpointHandler()`` (OCDBT on, zarr v2, compression on);
* ``g`` Orbax's faster layout: ``PyTreeCheckpointHandler(use_ocdbt=False)`` (one TensorStore
  array per tensor), the other options left at their defaults.

Both save ``jax.Array`` values (the numpy data put on JAX's CPU device) and restore them as
``jax.Array`` on that device (``ArrayRestoreArgs(sharding=SingleDeviceSharding(cpu))``), Orbax's
own target and its fast path: restoring into numpy arrays instead
(``RestoreArgs(restore_type=np.ndarray)``, ``--restore-type numpy``) checks each array's files
one after the other through the path layer and took 3-4x longer here (7-10 s vs 2-3 s for
256 MiB). The clock covers the ``Checkpointer`` restore call and ``jax.block_until_ready``:
metadata reads, every byte, decompression and the arrays' assembly.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.peers.peer_common import answer, load_state, read_spec, status_kib

#: method -> (folder under the prefix, PyTreeCheckpointHandler keyword arguments)
LAYOUTS: dict[str, tuple[str, dict[str, Any]]] = {
    "f": ("orbax_defaults", {}),
    "g": ("orbax_no_ocdbt", {"use_ocdbt": False}),
}


def _environment(spec: dict[str, Any]) -> None:
    """Point TensorStore and gcsfs at the shaping proxy; run JAX on the host CPU."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = spec["endpoint"]
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    os.environ["STORAGE_EMULATOR_HOST"] = spec["endpoint"]
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # else gcsfs waits on gRPC


def _checkpointer(method: str) -> Any:
    import orbax.checkpoint as ocp  # lazy: only this venv has it, after _environment

    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**LAYOUTS[method][1]))


def _path(spec: dict[str, Any], method: str) -> str:
    return f"gs://{spec['bucket']}/{spec['prefix']}/{LAYOUTS[method][0]}"


def save(spec: dict[str, Any]) -> None:
    """Write the state as ``jax.Array`` values in both Orbax layouts (untimed set-up)."""
    import jax
    import orbax.checkpoint as ocp

    state = {k: jax.device_put(v, jax.devices("cpu")[0]) for k, v in load_state(spec).items()}
    for method in LAYOUTS:
        with _checkpointer(method) as ckptr:
            ckptr.save(_path(spec, method), args=ocp.args.PyTreeSave(state), force=True)


def restore(spec: dict[str, Any], method: str, restore_type: str) -> None:
    """Time one restore of ``method``'s layout (``restore_type`` ``"jax"`` or ``"numpy"``)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    keys = [k for k, _shape, _off in spec["layout"]]
    if restore_type == "jax":
        cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        restore_args = {k: ocp.ArrayRestoreArgs(sharding=cpu) for k in keys}
    else:
        restore_args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in keys}
    path = _path(spec, method)
    with _checkpointer(method) as ckptr:
        baseline = status_kib("VmRSS")
        t0 = time.perf_counter()
        state = ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
        jax.block_until_ready(state)
        seconds = time.perf_counter() - t0
    # np.asarray of a CPU jax.Array is a view of its buffer: the crc32c sees the restored bytes.
    answer(seconds, baseline, {k: np.asarray(v) for k, v in state.items()},
           {"restore_type": restore_type})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True, help="the parent's JSON spec file")
    ap.add_argument("--save", action="store_true", help="write both layouts (untimed)")
    ap.add_argument("--method", choices=sorted(LAYOUTS), help="time one restore")
    ap.add_argument("--restore-type", choices=("jax", "numpy"), default="jax",
                    help="restore into jax.Array on the CPU device (default) or numpy arrays")
    a = ap.parse_args(argv)
    spec = read_spec(a.spec)
    _environment(spec)
    if a.save:
        save(spec)
    elif a.method:
        restore(spec, a.method, a.restore_type)
    else:
        ap.error("pass --save or --method")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
