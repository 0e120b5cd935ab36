"""Emulated hosts on one machine: each has its own loopback source address.

Emulated host ``h`` (the launcher's group rank / host id) binds its client sockets to
``127.0.0.(10+h)`` (:func:`host_address`); the whole 127.0.0.0/8 block is loopback on
Linux, so no set-up is needed.  The proxy then sees one source address per host: it
shapes each host's traffic under ``Shaping.host_mib_s`` (that host's network link) and
counts the bytes served to each (:meth:`FaultProxy.bytes_served_by_address`).

:func:`bind_session` makes a ``requests`` session (the transport of the
google-cloud-storage client and of :class:`~xla_ckpt.storage.gcs.GCSStorage`) connect from
such an address; :meth:`FaultProxy.storage` takes ``source_address=`` for the common case.
A :class:`~xla_ckpt.storage.gcs.GCSStorage` binds itself when
``StorageConfig.source_address`` or the environment variable
``XLA_CKPT_GCS_SOURCE_ADDRESS`` is set (the test launcher sets the latter per emulated
host: ``WorkerPool(world_size, hosts=H)``).  :class:`SourceAddressAdapter` lives in
:mod:`xla_ckpt.storage.gcs.transport` (library code) and is re-exported here.
"""

from __future__ import annotations

import requests

# Re-exported (its home is the GCS transport, which mounts it for StorageConfig.source_address).
from xla_ckpt.storage.gcs.transport import SourceAddressAdapter as SourceAddressAdapter

#: Host ``h`` uses ``127.0.0.(HOST_ADDRESS_BASE + h)``; 127.0.0.1 stays the default address.
HOST_ADDRESS_BASE = 10
MAX_EMULATED_HOSTS = 255 - HOST_ADDRESS_BASE


def host_address(host_id: int) -> str:
    """The loopback source address of emulated host ``host_id``: ``127.0.0.(10+host_id)``.

    Raises:
        ValueError: ``host_id`` is not an integer in ``[0, 245)``.
    """
    if not isinstance(host_id, int) or isinstance(host_id, bool) \
            or not 0 <= host_id < MAX_EMULATED_HOSTS:
        raise ValueError(f"emulated host id must be an integer in [0, {MAX_EMULATED_HOSTS}), "
                         f"got {host_id!r}")
    return f"127.0.0.{HOST_ADDRESS_BASE + host_id}"


def bind_session(session: requests.Session, address: str, *,
                 pool_maxsize: int = 32) -> requests.Session:
    """Mount a :class:`SourceAddressAdapter` for ``http://`` and ``https://`` on ``session``.

    Every later connection of ``session`` leaves from ``address`` (e.g.
    ``host_address(h)``); connections already open are dropped with the old adapters.
    ``max_retries=0`` as in :mod:`xla_ckpt.storage.gcs` (retries are the caller's).
    Returns ``session``.
    """
    adapter = SourceAddressAdapter(address, pool_connections=8, pool_maxsize=pool_maxsize,
                                   max_retries=0)
    for prefix in ("http://", "https://"):
        old = session.adapters.get(prefix)
        session.mount(prefix, adapter)
        if old is not None and old is not adapter:
            old.close()
    return session
