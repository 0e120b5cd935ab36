"""The latency and throughput model of the service behind the proxy (:class:`Shaping`)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from xla_ckpt.errors import ConfigError

MiB = 1024 * 1024


@dataclass(kw_only=True)
class Shaping:
    """Latency and throughput of the modelled service (defaults: none).

    Attributes:
        first_byte_latency_s: seconds before the first byte of every response.
        stream_mib_s: body throughput cap per connection, MiB/s (None: uncapped).
        total_mib_s: body throughput cap across all connections, MiB/s (None: uncapped).
    """

    first_byte_latency_s: float = 0.0
    stream_mib_s: float | None = None
    total_mib_s: float | None = None

    def __post_init__(self) -> None:
        if self.first_byte_latency_s < 0:
            raise ConfigError(f"shaping.first_byte_latency_s must be >= 0, got "
                              f"{self.first_byte_latency_s}")
        for name in ("stream_mib_s", "total_mib_s"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"shaping.{name} must be > 0 or None, got {v}")


class _TokenBucket:
    """Shared throughput cap: bytes are scheduled back to back at ``rate`` bytes/s."""

    def __init__(self, rate_bytes_s: float) -> None:
        self.rate = rate_bytes_s
        self._next = 0.0
        self._lock = threading.Lock()

    def reserve(self, n: int) -> float:
        """Seconds to wait before sending ``n`` more bytes."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
            return start - now
