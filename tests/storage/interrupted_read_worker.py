"""A child process for tests/storage/test_gcs_interrupted_read.py: one slow checkpoint load.

``python interrupted_read_worker.py URI`` with ``STORAGE_EMULATOR_HOST`` pointing at the parent's
throttled fault proxy.  It loads the checkpoint with :func:`xla_ckpt.load` (parallel ranged
reads of 4 MiB slices); when the parent's SIGINT surfaces as ``KeyboardInterrupt`` it prints
``INTERRUPTED <time.monotonic()>`` (the machine-wide monotonic clock the parent reads too) and
lets it end the process.
"""

import signal
import sys
import time

import xla_ckpt
from xla_ckpt.storage import StorageConfig

STORAGE = StorageConfig(max_workers=4, slice_size_bytes=4 << 20, initial_backoff_s=0.001,
                        max_backoff_s=0.01, retry_deadline_s=60.0)


def main(uri: str) -> None:
    print("READING", flush=True)
    try:
        xla_ckpt.load(uri, config=STORAGE)
    except KeyboardInterrupt:
        print(f"INTERRUPTED {time.monotonic():.6f}", flush=True)
        raise
    print("FINISHED", flush=True)


if __name__ == "__main__":
    # A job started in the background of a non-interactive shell (as CI may start the suite)
    # inherits SIGINT ignored; the test sends Ctrl-C, so take the default handler back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main(sys.argv[1])
