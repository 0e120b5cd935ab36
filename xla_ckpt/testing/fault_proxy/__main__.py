"""``python -m xla_ckpt.testing.fault_proxy --upstream URL [...]``: serve a proxy until Ctrl-C."""

from __future__ import annotations

import argparse
import time
from typing import Sequence

import xla_ckpt.testing.fault_proxy as package
from xla_ckpt.testing.fault_proxy.proxy import FaultProxy
from xla_ckpt.testing.fault_proxy.shaping import Shaping


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m xla_ckpt.testing.fault_proxy --upstream URL [...]``: serve until Ctrl-C."""
    ap = argparse.ArgumentParser(prog="python -m xla_ckpt.testing.fault_proxy",
                                 description=(package.__doc__ or "").partition("\n")[0])
    ap.add_argument("--upstream", required=True, help="emulator URL, e.g. http://127.0.0.1:9023")
    ap.add_argument("--first-byte-latency-ms", type=float, default=0.0)
    ap.add_argument("--stream-mib-s", type=float, default=None)
    ap.add_argument("--total-mib-s", type=float, default=None)
    ap.add_argument("--host-mib-s", type=float, default=None,
                    help="cap per client source address (one emulated host's link)")
    ap.add_argument("--shape-uploads", action="store_true",
                    help="apply the caps to request bodies (uploads) too")
    a = ap.parse_args(argv)
    shaping = Shaping(first_byte_latency_s=a.first_byte_latency_ms / 1000,
                      stream_mib_s=a.stream_mib_s, total_mib_s=a.total_mib_s,
                      host_mib_s=a.host_mib_s, shape_uploads=a.shape_uploads)
    with FaultProxy(a.upstream, shaping=shaping) as proxy:
        print(f"STORAGE_EMULATOR_HOST={proxy.url}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
