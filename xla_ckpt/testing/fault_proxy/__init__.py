"""A threaded HTTP proxy in front of the GCS emulator that shapes traffic and injects faults.

Real GCS gives one stream roughly 200 MiB/s after a first-byte latency of
tens of milliseconds, and many parallel streams several GiB/s per VM.  The
emulator is one single-threaded Python process, so parallel streams alone do
not make it faster; this proxy models the real service in front of it:

* every client connection is served by its own thread (HTTP/1.1 keep-alive);
* each response body is fetched from the emulator at full speed, then sent to
  the client after ``first_byte_latency_s`` and at most ``stream_mib_s`` per
  connection, ``host_mib_s`` per client source address (one emulated host's
  network link) and ``total_mib_s`` across all of them (the service's aggregate);
  with ``Shaping(shape_uploads=True)`` request bodies (uploads) are read from the
  client under the same caps, on their own schedule;
* emulated hosts each connect from their own loopback address,
  ``127.0.0.(10+h)`` (:func:`host_address`; :func:`bind_session` or
  ``proxy.storage(uri, source_address=...)`` bind a client to it), and the bytes
  served are counted per source address (:meth:`FaultProxy.bytes_served_by_address`);
* faults from a deterministic queue (:meth:`FaultProxy.inject`) or a seeded
  random schedule (:meth:`FaultProxy.random_faults`) replace or damage
  responses: HTTP 503/429 (with ``Retry-After``) or any status, a connection
  reset after ``k`` body bytes (TCP RST or FIN), a short body (Content-Length
  cut, Content-Range kept), flipped bytes, a body that stalls mid-way, a body that
  trickles a few bytes at a time (:meth:`Fault.trickle`), an answer lost after the
  service acted on the request (:meth:`Fault.lost_answer`); a rule can target one
  emulated host (:func:`from_address`);
* counters (:attr:`FaultProxy.stats`) and a request log
  (:meth:`FaultProxy.records`) let tests assert what went over the wire: the
  ``Range`` header of a resumed request, how many requests an error caused,
  how many body bytes were served.

::

    with GCSEmulator() as emu, FaultProxy(emu.host, shaping=Shaping(stream_mib_s=32)) as proxy:
        proxy.inject(Fault.error(503), Fault.error(503), match=downloads("data-"))
        storage = proxy.storage(emu.uri("run/ck"))

Modules: :mod:`.shaping` (the latency/throughput model), :mod:`.faults`
(faults, request matchers, the request log), :mod:`.hosts` (emulated hosts' source
addresses), :mod:`.proxy` (:class:`FaultProxy`),
:mod:`.handler` (the HTTP server that forwards, shapes and damages), and
``python -m xla_ckpt.testing.fault_proxy`` (:mod:`.__main__`) to serve one by hand.
"""

from xla_ckpt.testing.fault_proxy.faults import (
    Fault,
    Matcher,
    ProxyStats,
    RequestInfo,
    RequestRecord,
    any_request,
    downloads,
    from_address,
    requests_to,
    uploads,
)
from xla_ckpt.testing.fault_proxy.hosts import (
    HOST_ADDRESS_BASE,
    SourceAddressAdapter,
    bind_session,
    host_address,
)
from xla_ckpt.testing.fault_proxy.proxy import FaultProxy
from xla_ckpt.testing.fault_proxy.shaping import MiB, Shaping

__all__ = ["HOST_ADDRESS_BASE", "Fault", "FaultProxy", "Matcher", "MiB", "ProxyStats",
           "RequestInfo", "RequestRecord", "Shaping", "SourceAddressAdapter", "any_request",
           "bind_session", "downloads", "from_address", "host_address", "requests_to",
           "uploads"]
