"""The manager's restore across tiers: one decision from every host's local inventory and the
durable catalog (:func:`xla_ckpt.run.local_tier.choose_local`), then one read through this
host's copy with the durable copy behind it (:mod:`xla_ckpt.storage.tiered`).

Which rank calls what: every host's leader sends its inventory (one exchange, every rank);
rank 0 decides (:func:`decide_local`) and sends the decision with the manager's; every rank
opens its own host's copy (:func:`tier_source`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from xla_ckpt.errors import CheckpointCorruptError
from xla_ckpt.format import typed
from xla_ckpt.format.manifest import STATE_ITEM, Manifest
from xla_ckpt.restore import RestoreConfig
from xla_ckpt.restore.select import ALL_RANKS, PER_HOST
from xla_ckpt.run.catalog import LEASE_EPOCH_KEY
from xla_ckpt.run.fencing import read_lease
from xla_ckpt.run.local_tier import DurableLatest, LocalStep, LocalTier, choose_local
from xla_ckpt.run.resolve import committed_manifest
from xla_ckpt.storage import Storage, StorageConfig, open_storage
from xla_ckpt.storage.tiered import TierCounters, TieredStorage

logger = logging.getLogger(__name__)


def inventory_message(tier: LocalTier | None, leader: bool) -> Any:
    """What this rank sends: its host's committed local steps (the host leader), else None."""
    if tier is None or not leader:
        return None
    return [s.to_json() for s in tier.inventory()]


def _md_int(manifest: Manifest | None, key: str) -> int:
    md = typed.decode(manifest.metadata) if manifest is not None and \
        manifest.metadata is not None else None
    v = md.get(key) if isinstance(md, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def decide_local(run: Storage, tier: LocalTier, every: list[Any], *, world_size: int,
                 durable_name: str | None, durable_manifest: Manifest | None
                 ) -> tuple[str, str, bool, str, bytes] | None:
    """Rank 0: ``(name, save id, durable holds it, reason, manifest bytes)`` of the local step
    to restore, or None (the durable choice stands; the reason is logged).

    ``every``: each rank's ``(host, inventory_message)``; ``durable_name`` /
    ``durable_manifest``: the durable tier's choice (None: nothing committed there).
    """
    invs: dict[int, list[LocalStep]] = {}
    for host, inv in every:
        if inv is not None:
            invs[host] = [LocalStep.from_json(d, where=f"host {host}'s inventory") for d in inv]
    hosts = {h for h, _ in every}
    for h in hosts - set(invs):
        invs[h] = []
    try:
        lease = read_lease(run)
    except CheckpointCorruptError as e:  # a restore only reads: the durable choice stands
        logger.warning("rank 0: restoring from the durable tier: the run folder's lease is "
                       "unreadable, so no local step's lineage can be checked (%s)", e)
        return None
    latest = None
    if durable_name is not None and durable_manifest is not None:
        latest = DurableLatest(durable_name, durable_manifest.save_id,
                               _md_int(durable_manifest, LEASE_EPOCH_KEY),
                               _md_int(durable_manifest, "num_updates"))

    def durable_save_id(name: str) -> str | None:
        if latest is not None and name == latest.name:
            return latest.save_id
        with run.child(name) as st:
            found = committed_manifest(st)
        return found[0].save_id if found is not None else None

    while True:
        choice, why = choose_local(invs, world_size=world_size,
                                   lease_epoch=lease.epoch if lease is not None else 0,
                                   durable=latest, durable_save_id=durable_save_id)
        if choice is None:
            logger.info("rank 0: restoring from the durable tier: %s", why)
            return None
        # Every rank parses these bytes: a damaged manifest is this step's failure (never
        # trusted again, decide once more), not the restore's.
        try:
            mbytes = tier.manifest_bytes(choice.name)
            parsed = Manifest.from_json_bytes(mbytes, where=f"{tier.path(choice.name)}/"
                                              "manifest.json", require_crc=True)
            if parsed.save_id != choice.save_id:
                raise ValueError(f"its manifest is of save {parsed.save_id}, the host commit "
                                 f"markers of save {choice.save_id}")
        except (OSError, ValueError) as e:
            tier.untrust(choice.name, choice.save_id, f"unusable manifest: {e}")
            invs = {h: [s for s in inv if s.name != choice.name] for h, inv in invs.items()}
            continue
        return choice.name, choice.save_id, choice.durable, choice.reason, mbytes


def tensors_in_range(manifest: Manifest) -> Callable[[str, int, int], list[str]]:
    """``(file, offset, n) -> keys`` of every tensor whose bytes overlap that byte range of
    that data file (item-qualified for per-rank and sharded items: ``rank/00001:rng``)."""
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for iname, item in manifest.items.items():
        for t in item.tensors:
            if not 0 <= t.blob < len(item.blobs):
                continue
            blob = item.blobs[t.blob]
            start = blob.offset + t.byte_offset
            key = t.key if iname == STATE_ITEM else f"{iname}:{t.key}"
            spans.setdefault(blob.file, []).append((start, start + t.span_bytes(), key))

    def at(file: str, offset: int, n: int) -> list[str]:
        return [k for a, b, k in spans.get(file, ()) if a < offset + n and offset < b]
    return at


def tier_source(tier: LocalTier, run: Storage, *, name: str, save_id: str, durable: bool,
                manifest: Manifest, counters: TierCounters
                ) -> Callable[[StorageConfig | None], Storage]:
    """This rank's opener for the chosen local step: its host's copy first, the durable
    folder behind it when it holds the same save; a failed check marks the host's copy
    untrusted (:meth:`LocalTier.untrust`)."""
    url = run.url(name)
    files = dict(manifest.files)
    tensors_at = tensors_in_range(manifest)

    def open_(config: StorageConfig | None) -> Storage:
        def durable_storage() -> Storage:
            return open_storage(url, config or run.config)
        return TieredStorage(tier.step_storage(name), durable_storage if durable else None,
                             files=files, host=tier.host, counters=counters,
                             tensors_at=tensors_at,
                             on_failure=lambda why: tier.untrust(name, save_id, why),
                             config=config)
    return open_


def own_host_config(config: RestoreConfig) -> RestoreConfig:
    """The restore config of a read from the local tier: each rank reads from its own host's
    copy (``all_ranks``; with host shared memory, the host's leader reads the replicated
    state once for its host), never another host's bytes over the network."""
    if config.strategy in (ALL_RANKS, PER_HOST):
        return config
    return dataclasses.replace(config, strategy=ALL_RANKS)
