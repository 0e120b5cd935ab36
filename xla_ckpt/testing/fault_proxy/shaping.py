"""The latency and throughput model of the service behind the proxy (:class:`Shaping`).

Three caps apply to every response body, each chunk of it sent no earlier than all three
allow (:class:`_Shaper`): per connection (``stream_mib_s``, one GCS stream), per client
source address (``host_mib_s``, one host's network link: emulated host ``h`` binds its
client sockets to ``127.0.0.(10+h)``, see :mod:`.hosts`), and across every connection
(``total_mib_s``, the service's aggregate).

With ``shape_uploads=True`` the same three caps also pace request bodies (uploads) as the
proxy reads them, on a schedule of their own (a link carries both directions at once).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from xla_ckpt.errors import ConfigError

MiB = 1024 * 1024


@dataclass(kw_only=True)
class Shaping:
    """Latency and throughput of the modelled service (defaults: none).

    Attributes:
        first_byte_latency_s: seconds before the first byte of every response.
        stream_mib_s: body throughput cap per connection, MiB/s (None: uncapped).
        host_mib_s: body throughput cap per client source address (all the
            connections of one emulated host together: its network link), MiB/s
            (None: uncapped).
        total_mib_s: body throughput cap across all connections, MiB/s (None: uncapped).
        shape_uploads: also apply the three caps to request bodies (uploads: multipart,
            resumable and composite-part bodies), each read from the client no faster than
            they allow, on their own schedule (uploads and downloads do not share a cap).
            Default False: request bodies are read at full speed.
    """

    first_byte_latency_s: float = 0.0
    stream_mib_s: float | None = None
    total_mib_s: float | None = None
    host_mib_s: float | None = None
    shape_uploads: bool = False

    def __post_init__(self) -> None:
        if self.first_byte_latency_s < 0:
            raise ConfigError(f"shaping.first_byte_latency_s must be >= 0, got "
                              f"{self.first_byte_latency_s}")
        for name in ("stream_mib_s", "total_mib_s", "host_mib_s"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"shaping.{name} must be > 0 or None, got {v}")
        if not isinstance(self.shape_uploads, bool):
            raise ConfigError(f"shaping.shape_uploads must be a bool, got "
                              f"{self.shape_uploads!r}")


class _Shaper:
    """When each chunk of a body may go out (an upload's: be read), under a :class:`Shaping`.

    Bytes are scheduled back to back at each cap's rate: a chunk starts at the latest of
    now, its connection's pace (``stream start + bytes already sent / stream rate``), its
    source address's next free time and the aggregate's next free time; the address's and
    the aggregate's next free times then move past it.  Thread-safe.

    ``clock`` (seconds, monotonic) is injectable so the schedule can be checked without
    sleeping.  :attr:`scheduled_bytes` counts, per source address, the bytes scheduled
    through that address's link.
    """

    def __init__(self, shaping: Shaping, clock: Callable[[], float] = time.monotonic) -> None:
        self.shaping = shaping
        self._clock = clock
        self._lock = threading.Lock()
        self._total_next = 0.0
        self._host_next: dict[str, float] = {}
        self.scheduled_bytes: Counter[str] = Counter()

    def now(self) -> float:
        return self._clock()

    def wait_s(self, address: str, n: int, *, stream_start: float, stream_sent: int) -> float:
        """Seconds to wait before sending ``n`` more body bytes on a connection from ``address``.

        ``stream_start``: when the connection began sending this body (:meth:`now` then);
        ``stream_sent``: body bytes it has sent since.  Reserves the slot: call once per chunk.
        """
        s = self.shaping
        with self._lock:
            now = self._clock()
            start = now
            if s.stream_mib_s:
                start = max(start, stream_start + stream_sent / (s.stream_mib_s * MiB))
            if s.host_mib_s:
                start = max(start, self._host_next.get(address, 0.0))
            if s.total_mib_s:
                start = max(start, self._total_next)
            # Every link the chunk crosses carries it from the same start.
            if s.host_mib_s:
                self._host_next[address] = start + n / (s.host_mib_s * MiB)
            if s.total_mib_s:
                self._total_next = start + n / (s.total_mib_s * MiB)
            self.scheduled_bytes[address] += n
            return start - now
