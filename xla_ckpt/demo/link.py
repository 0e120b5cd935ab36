"""Where the demo's checkpoints go, and the shaped link its restores come back through.

Without ``--uri`` the demo starts a GCS emulator on 127.0.0.1 and a
:class:`~xla_ckpt.testing.fault_proxy.FaultProxy` in front of it that shapes every emulated
host's link (:data:`RESTORE_SHAPING_FIGURES`) and counts the bytes it serves to each host
(:class:`ServedCounter`): saves go to the emulator directly, restores through the proxy.  With
``--uri`` (real ``gs://`` or a local path) nothing starts and nothing is counted.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass
from typing import Any

from xla_ckpt.demo.phase import DemoError
from xla_ckpt.demo.progress import step
from xla_ckpt.storage.uri import parse_uri

RESTORE_SHAPING_FIGURES = {"first_byte_latency_s": 0.03, "stream_mib_s": 32.0,
                           "host_mib_s": 64.0}
"""The link every emulated host restores through (``Shaping`` arguments; the demo config's
``restore.cost_model`` carries the same figures, so ``auto`` predicts this emulation)."""


class ServedCounter:
    """Bytes a :class:`~xla_ckpt.testing.fault_proxy.FaultProxy` served to each emulated host,
    per restore of a phase whose workers run with ``--sync-restores``.

    :meth:`poll` (run_phase's ``poll``) sees ``<out>/restored<k>`` (every rank finished
    restore ``k``), records :meth:`FaultProxy.bytes_served_by_address`, zeroes the proxy's
    counters and writes ``<out>/counted<k>`` (the workers go on).  :meth:`reset` before the
    phase starts.
    """

    def __init__(self, proxy: Any, hosts: int) -> None:
        self.proxy = proxy
        self.hosts = hosts
        self.counts: list[dict[str, int]] = []
        self.data_counts: list[dict[str, int]] = []

    def reset(self) -> None:
        self.proxy.reset_log()
        self.counts = []
        self.data_counts = []

    def poll(self, out: str) -> None:
        k = len(self.counts)
        if os.path.exists(os.path.join(out, f"restored{k}")):
            self.counts.append(self.proxy.bytes_served_by_address())
            data: dict[str, int] = {}
            for rec in self.proxy.records():
                if rec.object_name.rsplit("/", 1)[-1].startswith("data-"):
                    data[rec.client_address] = data.get(rec.client_address, 0) + rec.body_bytes
            self.data_counts.append(data)
            self.proxy.reset_log()
            with open(os.path.join(out, f"counted{k}"), "w") as f:
                f.write(str(k))

    def served(self, k: int) -> dict[str, Any]:
        """Restore ``k``: ``served_bytes_per_host`` (host ``h``: bytes sent to its address
        ``127.0.0.(10+h)``; one host: every byte), ``served_bytes_other`` (to any other
        address: a client that did not bind its host's address) and
        ``served_data_bytes_per_host`` (of those, the bodies of checkpoint data files,
        ``data-*``: tensor bytes, not manifests, pointers or listings)."""
        if k >= len(self.counts):
            raise DemoError(f"restore {k} was not counted (the workers did not sync)")
        by, data = self.counts[k], self.data_counts[k]
        total = sum(by.values())
        if self.hosts == 1:
            return {"served_bytes_per_host": [total], "served_bytes_other": 0,
                    "served_data_bytes_per_host": [sum(data.values())]}
        from xla_ckpt.testing.fault_proxy import host_address  # noqa: PLC0415 - light

        per = [by.get(host_address(h), 0) for h in range(self.hosts)]
        return {"served_bytes_per_host": per, "served_bytes_other": total - sum(per),
                "served_data_bytes_per_host": [data.get(host_address(h), 0)
                                               for h in range(self.hosts)]}



@dataclass
class DemoStorage:
    """The run folder of one demo and how its workers reach it.

    ``uri``: the run folder; ``kind``: ``"GCS emulator on <host>"``, ``"gs://"`` or
    ``"local path"`` (the report's ``storage``); ``env``: variables of the workers that save
    (the emulator's endpoint; empty for ``--uri``); ``restore_env``: those of the workers that
    restore (the shaped proxy's endpoint; ``env`` for ``--uri``); ``counter``: the proxy's
    bytes per host (None for ``--uri``); ``restore_link``: the report's ``restore_link`` (the
    proxy's URL and :data:`RESTORE_SHAPING_FIGURES`; None for ``--uri``).
    """

    uri: str
    kind: str
    env: dict[str, str]
    restore_env: dict[str, str]
    counter: ServedCounter | None = None
    restore_link: dict[str, Any] | None = None


def open_demo_storage(stack: contextlib.ExitStack, uri: str | None, hosts: int) -> DemoStorage:
    """The demo's storage: ``uri`` as given, or (None) a fresh run folder
    ``demo-<8 hex>/run`` in bucket ``xla-ckpt-demo`` of a GCS emulator started on 127.0.0.1,
    with the shaped proxy of ``hosts`` emulated hosts in front of it; both stop when ``stack``
    closes.

    Raises:
        xla_ckpt.testing.gcs_emulator.EmulatorError: the emulator did not start (the message
            carries the end of its log).
        OSError: the proxy could not bind a port on 127.0.0.1.
    """
    if uri is not None:
        kind = "gs://" if parse_uri(uri).is_gcs else "local path"
        return DemoStorage(uri=uri, kind=kind, env={}, restore_env={})
    from xla_ckpt.testing.fault_proxy import (  # noqa: PLC0415 - only with the emulator
        FaultProxy,
        Shaping,
    )
    from xla_ckpt.testing.gcs_emulator import GCSEmulator  # noqa: PLC0415 - only the gs:// default starts it

    env: dict[str, str] = {}
    with step("starting the GCS emulator and the shaped proxy"):
        emu = stack.enter_context(GCSEmulator(bucket="xla-ckpt-demo"))
        env.update(emu.env())
        link = RESTORE_SHAPING_FIGURES
        proxy = stack.enter_context(FaultProxy(emu.host, shaping=Shaping(
            first_byte_latency_s=link["first_byte_latency_s"],
            stream_mib_s=link["stream_mib_s"], host_mib_s=link["host_mib_s"])))
    return DemoStorage(
        uri=emu.uri(f"demo-{uuid.uuid4().hex[:8]}/run"), kind="GCS emulator on " + emu.host,
        env=env, restore_env=dict(env, **proxy.env()), counter=ServedCounter(proxy, hosts),
        restore_link={"proxy": proxy.url, **RESTORE_SHAPING_FIGURES,
                      "note": "every emulated host restores through its own shaped link"})
