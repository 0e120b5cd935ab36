"""Rank 0's storage reads on a thread, so the broadcast can send what is already read.

Used by :mod:`xla_ckpt.restore.broadcast`: the data plane waits, blob by blob,
for just the bytes its next bucket needs (:meth:`BackgroundRead.wait_for`).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from xla_ckpt.io import CheckpointReader


class BackgroundRead:
    """Rank 0's reads, in blob order, on a thread; the broadcast waits for what it needs.

    Blobs are read in groups of about a quarter bucket, so the first bucket
    can travel while later blobs are still being read and crc32c-checked.
    """

    def __init__(self, open_reader: Callable[[], CheckpointReader], item: str,
                 bufs: dict[int, torch.Tensor], group_bytes: int,
                 fill: Callable[[CheckpointReader], int] | None = None,
                 abort: Callable[[], None] | None = None) -> None:
        self.error: BaseException | None = None
        self.bytes_read = 0
        self._ready = -1
        self._cond = threading.Condition()
        self._args = (open_reader, item, group_bytes)
        self._bufs = bufs
        self._fill = fill
        self._abort = abort
        self._thread = threading.Thread(target=self._run, name="xla_ckpt-rank0-read", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        open_reader, item, group_bytes = self._args
        bufs = self._bufs
        reader = None
        try:
            reader = open_reader()
            if self._fill is not None:  # no buffers: checked bytes go into host memory
                self.bytes_read += self._fill(reader)
            group: dict[int, torch.Tensor] = {}
            size = 0
            for i in sorted(bufs):
                group[i] = bufs[i]
                size += bufs[i].numel()
                if size >= group_bytes:
                    self._read(reader, item, group)
                    group, size = {}, 0
            if group:
                self._read(reader, item, group)
        except BaseException as e:  # noqa: BLE001 - reported through the agreement step
            self.error = e
            if self._abort is not None:
                self._abort()
        finally:
            if reader is not None:
                reader.storage.close()
            with self._cond:
                self._ready = 1 << 62
                self._cond.notify_all()

    def _read(self, reader: CheckpointReader, item: str, group: dict[int, torch.Tensor]) -> None:
        reader.read_into(item, group)
        self.bytes_read += sum(b.numel() for b in group.values())
        with self._cond:
            self._ready = max(group)
            self._cond.notify_all()

    def wait_for(self, index: int) -> None:
        """Block until blobs ``0..index`` are read (or the read failed: then return at once)."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready >= index)

    def join(self) -> None:
        self._thread.join()

    def release(self) -> None:
        """Drop the references to the destination buffers (after :meth:`join`)."""
        self._bufs = {}
