"""What every peer of ``benchmarks/gcs_restore.py`` shares: the spec, the state, RSS, the answer.

A peer runs as a subprocess under its own virtualenv's python (``.venv-orbax``,
``.venv-dataflux``; made by ``scripts/setup_peers.sh``), so this module uses the standard
library, numpy and google-crc32c only (xla_ckpt and torch may be absent there).

The parent (``gcs_restore.py``) writes a JSON spec file and passes its path as ``--spec``:

* ``bucket``, ``prefix``: where the layouts live in the emulator (``gs://<bucket>/<prefix>/...``);
* ``endpoint``: the shaping proxy's URL (``http://127.0.0.1:PORT``), also in
  ``STORAGE_EMULATOR_HOST`` of the peer's environment;
* ``state_path``: a local file holding every tensor's raw little-endian fp32 bytes back to back,
  in ``layout`` order (written by the parent before any peer runs);
* ``layout``: ``[[key, shape, byte_offset], ...]`` of that file;
* ``crcs``: ``{key: crc32c}`` of each tensor's bytes (the parent compares, this module only
  computes).

A timed peer prints one JSON object as its last stdout line: ``seconds`` (the clock around the
restore only), ``baseline_rss_mib`` (RSS before the clock, after imports and set-up),
``peak_rss_mib`` (VmHWM after the clock), ``bytes`` (bytes of tensor data restored) and
``crcs`` (crc32c per tensor of what was restored, computed after the clock).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import google_crc32c
import numpy as np

MiB = 1024 * 1024


def read_spec(path: str) -> dict[str, Any]:
    """The parent's spec (see the module docstring)."""
    with open(path) as f:
        spec: dict[str, Any] = json.load(f)
    return spec


def load_state(spec: dict[str, Any]) -> dict[str, np.ndarray]:
    """``{key: fp32 array}`` of the benchmark state, read from ``spec['state_path']``.

    The arrays are views of one buffer read from the local file; the values are bitwise those
    of the parent's torch tensors (same bytes, same order).
    """
    with open(spec["state_path"], "rb") as f:
        raw = np.frombuffer(f.read(), dtype=np.uint8)
    out: dict[str, np.ndarray] = {}
    for key, shape, offset in spec["layout"]:
        n = 4 * int(np.prod(shape, dtype=np.int64))
        out[key] = raw[offset:offset + n].view("<f4").reshape(shape)
    return out


def array_crcs(state: dict[str, Any]) -> dict[str, int]:
    """crc32c of each array's C-order bytes (numpy arrays, or anything ``np.asarray`` takes)."""
    return {k: google_crc32c.value(np.ascontiguousarray(np.asarray(v)).tobytes())
            for k, v in state.items()}


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in KiB; 0 where there is none."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def answer(seconds: float, baseline_kib: int, state: dict[str, Any],
           extra: dict[str, Any] | None = None) -> None:
    """Print the timed result line (see the module docstring) on stdout, after the clock."""
    peak_kib = status_kib("VmHWM")
    nbytes = sum(int(np.asarray(v).nbytes) for v in state.values())
    out = {"seconds": seconds, "baseline_rss_mib": baseline_kib / 1024,
           "peak_rss_mib": peak_kib / 1024, "bytes": nbytes, "crcs": array_crcs(state),
           **(extra or {})}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
