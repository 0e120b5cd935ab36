"""The one-process backend: rank 0 of a world of 1; every collective is local."""

from __future__ import annotations

import torch

from xla_ckpt.comm.base import Dist
from xla_ckpt.comm.topology import Topology


class SingleProcess(Dist):
    """:class:`Dist` for a job of one process (no process group needed).

    Args:
        device: this process's compute device (``cpu`` by default; pass
            ``torch_xla.device()`` or ``cuda:0`` to restore onto it).
        timeout_s: kept for interface parity; nothing here waits.
    """

    kind = "single"

    def __init__(self, *, device: torch.device | str | None = None, timeout_s: float = 0.0) -> None:
        super().__init__(Topology(), timeout_s=timeout_s)
        self._device = torch.device(device) if device is not None else torch.device("cpu")

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def data_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def backend(self) -> str:
        return "none"

    def barrier(self, timeout_s: float | None = None) -> None:
        return None

    def _allgather_bytes(self, data: bytes, op: str) -> list[bytes]:
        return [bytes(data)]

    def _broadcast_bytes(self, data: bytes | None, src: int, op: str) -> bytes:
        if src != 0:
            raise ValueError(f"{op}: src {src} does not exist in a world of 1")
        return bytes(data or b"")

    def _data_broadcast(self, t: torch.Tensor, src: int) -> None:
        return None

    def _data_send(self, t: torch.Tensor, dst: int) -> None:
        raise ValueError(f"cannot send to rank {dst} in a world of 1")

    def _data_recv(self, t: torch.Tensor, src: int) -> None:
        raise ValueError(f"cannot receive from rank {src} in a world of 1")
