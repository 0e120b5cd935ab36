"""A child process for tests/storage/test_local.py: a large local save, written slowly.

``python local_write_worker.py RUN_DIR`` saves a 32 MiB tensor with :func:`xla_ckpt.save` to
``RUN_DIR/checkpoint_1_1``.  The local backend's ``os.write`` is slowed (1 MiB per call, a
pause after each, ~2 s for the data file) so that the parent can SIGKILL the save mid-write.
"""

import os
import sys
import time
import types
from typing import Any

import torch

import xla_ckpt
import xla_ckpt.storage.local as local

BLOCK = 1 << 20
PAUSE_S = 0.05


class _SlowOs(types.SimpleNamespace):
    """Stands in for the ``os`` module inside :mod:`xla_ckpt.storage.local`: slow writes."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def write(self, fd, data):
        n = os.write(fd, memoryview(data).cast("B")[:BLOCK])
        time.sleep(PAUSE_S)
        return n


def main(run_dir: str) -> None:
    local.os = _SlowOs()  # type: ignore[assignment]  # a slow stand-in for os, on purpose
    state = {"w": torch.arange(8 << 20, dtype=torch.float32)}  # 32 MiB
    xla_ckpt.save(state, os.path.join(run_dir, "checkpoint_1_1"))
    print("saved", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
