"""A child process for tests/storage/test_gcs_interrupted_upload.py: one slow multi-part save.

``python interrupted_upload_worker.py MODE URI`` with the emulator's variables in the
environment.  The part bodies are sent slowly (a pause before each 16 KiB block), so the
parent can interrupt the save while parts are being uploaded.  MODE:

* ``save``: :func:`xla_ckpt.save` of an 8 MiB tensor (64 parts of 128 KiB, 4 upload
  threads) on the main thread;
* ``manager``: an async :class:`~xla_ckpt.manager.CheckpointManager` save inside its
  ``with`` block, the main thread "training" (sleeping) meanwhile; ``exit_grace_s=0``, so
  Ctrl-C abandons the save (named in an ERROR line) instead of letting it commit;
* ``manager-no-close``: the same without ``with`` or ``close()``: the interrupt ends
  the process with the upload thread still running.
"""

import signal
import sys
import time

import torch

import xla_ckpt
from xla_ckpt.manager import CheckpointConfig, CheckpointManager
from xla_ckpt.storage import StorageConfig
from xla_ckpt.storage.gcs import writes

BLOCK_PAUSE_S = 0.03
STORAGE = StorageConfig(max_workers=4, parallel_upload_threshold_bytes=1 << 20,
                        upload_part_size_bytes=128 << 10, initial_backoff_s=0.001,
                        max_backoff_s=0.01, retry_deadline_s=20.0)


def _slow_sending() -> None:
    read = writes._BodyReader.read

    def slow_read(self, n=-1):
        time.sleep(BLOCK_PAUSE_S)
        return read(self, n)

    setattr(writes._BodyReader, "read", slow_read)  # noqa: B010 - a method, patched
    writes.SEND_BLOCK_BYTES = 16 << 10


def main(mode: str, uri: str) -> None:
    _slow_sending()
    state = {"w": torch.zeros(2 << 20, dtype=torch.float32)}  # 8 MiB
    if mode == "save":
        xla_ckpt.save(state, f"{uri}/checkpoint_1_1", config=STORAGE)
        return
    # exit_grace_s=0: Ctrl-C abandons the save in flight at once (named in an ERROR line) and
    # deletes its parts; the default grace would let it commit first (C27, tests/manager/
    # test_exit_with_save_in_flight.py).
    cfg = CheckpointConfig(save_dir=uri, async_save=True, handle_sigterm=False,
                           save_interval_epochs=0, exit_grace_s=0)
    if mode == "manager":
        with CheckpointManager(cfg, storage_config=STORAGE) as mgr:
            mgr.save(state, epoch=1, num_updates=1, block=False)
            while True:
                time.sleep(0.05)
    if mode == "manager-no-close":
        mgr = CheckpointManager(cfg, storage_config=STORAGE)
        mgr.save(state, epoch=1, num_updates=1, block=False)
        while True:
            time.sleep(0.05)
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    # A job started in the background of a non-interactive shell (as CI may start the suite)
    # inherits SIGINT ignored; the tests send Ctrl-C, so take the default handler back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main(sys.argv[1], sys.argv[2])
