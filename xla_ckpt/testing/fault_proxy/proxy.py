""":class:`FaultProxy`: start and stop the proxy, queue faults, read its log and counters."""

from __future__ import annotations

import random
import socket
import threading
from collections import Counter
from typing import TYPE_CHECKING, Sequence
from urllib.parse import urlsplit

from xla_ckpt.testing.fault_proxy.faults import (
    Fault,
    Matcher,
    ProxyStats,
    RequestInfo,
    RequestRecord,
    _RandomRule,
    _Rule,
    any_request,
    downloads,
)
from xla_ckpt.testing.fault_proxy.handler import _Handler, _Server
from xla_ckpt.testing.fault_proxy.hosts import bind_session
from xla_ckpt.testing.fault_proxy.shaping import Shaping, _Shaper

if TYPE_CHECKING:
    from xla_ckpt.storage.base import StorageConfig
    from xla_ckpt.storage.gcs import GCSStorage

_ANY_DOWNLOAD = downloads()  # default body-fault matcher of random_faults


class FaultProxy:
    """HTTP proxy on 127.0.0.1 (free port) in front of ``upstream`` (see the package docstring).

    Args:
        upstream: ``http://host:port`` of the emulator.
        shaping: latency/throughput model; None for none.  May be replaced later
            (``proxy.shaping = Shaping(...)``), e.g. on the ``fault_proxy`` fixture.
        seed: seed of the random fault schedule and of random fault positions.
        host: address to bind (loopback).  Clients may connect from any loopback
            source address; emulated host ``h`` uses ``127.0.0.(10+h)``
            (:func:`~xla_ckpt.testing.fault_proxy.host_address`), and ``host_mib_s``
            shaping and :meth:`bytes_served_by_address` are per source address.

    Thread-safe: rules may be added while requests are served.
    """

    def __init__(self, upstream: str, *, shaping: Shaping | None = None, seed: int = 0,
                 host: str = "127.0.0.1") -> None:
        u = urlsplit(upstream if "://" in upstream else f"http://{upstream}")
        self.upstream_host = u.hostname or "127.0.0.1"
        self.upstream_port = u.port or 80
        self._shaper = _Shaper(shaping or Shaping())
        self._up_shaper = _Shaper(self._shaper.shaping)  # request bodies (shape_uploads)
        self._stopping = threading.Event()
        self.stats = ProxyStats()
        self._bind = host
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._random: _RandomRule | None = None
        self._records: list[RequestRecord] = []
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()

    @property
    def shaping(self) -> Shaping:
        """The latency/throughput model in force."""
        return self._shaper.shaping

    @shaping.setter
    def shaping(self, shaping: Shaping) -> None:
        """Replace the model; the caps' schedules and per-address counts start afresh."""
        self._shaper = _Shaper(shaping)
        self._up_shaper = _Shaper(shaping)

    # ---- lifecycle ---------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the proxy is not running; call start() or use `with`")
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``: the endpoint (or ``STORAGE_EMULATOR_HOST``) to use."""
        return f"http://{self._bind}:{self.port}"

    def start(self) -> "FaultProxy":
        if self._server is not None:
            return self
        self._stopping.clear()
        self._server = _Server((self._bind, 0), _Handler, self)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.1},
                                        name=f"fault-proxy-{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and drop every open client connection."""
        if self._server is None:
            return
        self._stopping.set()  # ends injected stalls
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._server = None
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def env(self) -> dict[str, str]:
        """Environment for a (child) process whose GCS traffic should go through this proxy."""
        return {"STORAGE_EMULATOR_HOST": self.url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def storage(self, uri: str, config: "StorageConfig | None" = None, *,
                source_address: str | None = None) -> "GCSStorage":
        """A :class:`~xla_ckpt.storage.gcs.GCSStorage` for ``uri`` that goes through this proxy.

        ``source_address``: bind its client sockets to this loopback address (an emulated
        host's, :func:`~xla_ckpt.testing.fault_proxy.host_address`), so the proxy counts and
        shapes its traffic as that host's.
        """
        # Lazy: the GCS client stack (google-auth, google-cloud-storage) is not needed by the
        # proxy or its CLI.
        from xla_ckpt.storage.gcs import GCSStorage  # noqa: PLC0415 - heavy, needed here only

        storage = GCSStorage(uri, config, endpoint=self.url)
        if source_address is not None:
            bind_session(storage._conn.session, source_address,
                         pool_maxsize=max(32, 2 * storage.config.max_workers))
        return storage

    # ---- faults --------------------------------------------------------------------------
    def inject(self, *faults: Fault, match: Matcher = any_request, times: int = 1) -> None:
        """Queue faults: each applies to the next ``times`` requests ``match`` accepts, in order."""
        with self._lock:
            for f in faults:
                self._rules.append(_Rule(f, match, times))

    def random_faults(self, probability: float, faults: Sequence[Fault], *,
                      match: Matcher = _ANY_DOWNLOAD, status_match: Matcher | None = any_request,
                      limit: int | None = None) -> None:
        """Seeded random schedule: each matching request gets a random fault with ``probability``.

        Body faults (reset/short/flip) apply to requests ``match`` accepts
        (media downloads by default); status faults to those ``status_match``
        accepts (every request by default).  At most ``limit`` faults in all.
        """
        with self._lock:
            self._random = _RandomRule(probability, tuple(faults), match, limit, status_match)

    def clear_faults(self) -> None:
        with self._lock:
            self._rules.clear()
            self._random = None

    def pending_faults(self) -> int:
        """Queued deterministic faults not yet used."""
        with self._lock:
            return sum(r.times for r in self._rules)

    def records(self, match: Matcher | None = None) -> list[RequestRecord]:
        """Logged requests (in arrival order), optionally filtered."""
        with self._lock:
            recs = list(self._records)
        if match is None:
            return recs
        return [r for r in recs if match(r.info)]

    def snapshot(self) -> ProxyStats:
        """A copy of the counters."""
        with self._lock:
            st = self.stats
            return ProxyStats(st.requests, st.connections, st.bytes_served, Counter(st.faults),
                              Counter(st.bytes_by_address), Counter(st.connections_by_address),
                              st.bytes_received, Counter(st.bytes_received_by_address))

    def bytes_served_by_address(self) -> dict[str, int]:
        """Response body bytes sent so far, per client source address (``{"127.0.0.10": n}``).

        With emulated hosts bound to ``127.0.0.(10+h)`` this is the bytes each host fetched
        from storage; the values sum to ``snapshot().bytes_served``.
        """
        with self._lock:
            return dict(self.stats.bytes_by_address)

    def bytes_received_by_address(self) -> dict[str, int]:
        """Request body bytes read so far (uploads, JSON bodies), per client source address."""
        with self._lock:
            return dict(self.stats.bytes_received_by_address)

    def reset_log(self) -> None:
        """Forget logged requests and zero the counters."""
        with self._lock:
            self._records.clear()
            self.stats = ProxyStats()

    def _choose(self, info: RequestInfo) -> Fault | None:
        with self._lock:
            for i, rule in enumerate(self._rules):
                if rule.match(info):
                    rule.times -= 1
                    if rule.times <= 0:
                        del self._rules[i]
                    return rule.fault
            rr = self._random
            if rr is None or (rr.limit is not None and sum(self.stats.faults.values()) >= rr.limit):
                return None
            body_ok = rr.match(info)
            status_ok = rr.status_match is not None and rr.status_match(info)
            if not (body_ok or status_ok) or self._rng.random() >= rr.probability:
                return None
            choices = [f for f in rr.faults
                       if (body_ok if f.needs_body else (status_ok or body_ok))]
            return self._rng.choice(choices) if choices else None

    def _randint(self, lo: int, hi: int) -> int:
        with self._lock:
            return self._rng.randint(lo, hi)
