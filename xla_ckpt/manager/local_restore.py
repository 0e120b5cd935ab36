"""The manager's restore across tiers: one decision from every host's local inventory and the
durable catalog (:func:`xla_ckpt.run.local_tier.choose_local`), then one read through this
host's copy, the other hosts' copies (a replaced host, another mesh: :class:`PeerSources`)
and the durable copy behind them (:mod:`xla_ckpt.storage.tiered`).

Which rank calls what: every host's leader sends its inventory (one exchange, every rank);
rank 0 decides (:func:`decide_local`) and sends the decision with the manager's; with peer
sources, every host leader holding files of the step serves them for the read; every rank
opens its own host's copy with the peers and the durable copy behind it (:func:`tier_source`).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import os
import secrets
import socket
from typing import Any, Callable

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    StorageError,
)
from xla_ckpt.format.manifest import MANIFEST_NAME, STATE_ITEM, Manifest
from xla_ckpt.restore import RestoreConfig
from xla_ckpt.restore.select import ALL_RANKS, PER_HOST
from xla_ckpt.run.catalog import committed_markers
from xla_ckpt.run.fencing import peek_lease
from xla_ckpt.run.local_tier import DurableLatest, LocalStep, LocalTier, choose_local
from xla_ckpt.run.resolve import committed_manifest
from xla_ckpt.storage import Storage, StorageConfig, open_storage
from xla_ckpt.storage.base import SOURCE_ADDRESS_ENV
from xla_ckpt.storage.peer import PeerServer, PeerStorage
from xla_ckpt.storage.tiered import TierCounters, TieredStorage

logger = logging.getLogger(__name__)


def inventory_message(tier: LocalTier | None, leader: bool) -> Any:
    """What this rank sends: its host's committed local steps and the replicas of other
    hosts' parts it holds (the host leader), else None."""
    if tier is None or not leader:
        return None
    return {"own": [s.to_json() for s in tier.inventory()],
            "replicas": [s.to_json() for s in tier.replicas()]}


def host_leaders(every: list[Any]) -> dict[int, int]:
    """``{host: rank of its leader}`` from every rank's ``(host, inventory_message)``."""
    return {h: r for r, (h, inv) in reversed(list(enumerate(every))) if inv is not None}


@dataclasses.dataclass(frozen=True)
class LocalDecision:
    """Rank 0's choice of a local step, sent to every rank.

    Attributes:
        name / save_id: the checkpoint folder and its save.
        durable: the durable tier holds the same save (what a tier lacks or fails comes
            from there).
        reason: why (logged).
        manifest: the manifest's bytes; None when rank 0's host holds none of the step (a
            replaced host, a host new to the job): rank 0 then reads it from a peer
            (:meth:`PeerSources.manifest_bytes`).
        sources: a replaced host or another mesh: ``{data file: hosts whose tier holds
            it}`` (:attr:`~xla_ckpt.run.local_tier.LocalChoice.sources`); None when every
            host reads its own part.
    """

    name: str
    save_id: str
    durable: bool
    reason: str
    manifest: bytes | None
    sources: dict[str, tuple[int, ...]] | None = None
    token: str = ""
    """The secret every peer request of this restore carries (:class:`PeerServer`)."""

    def to_message(self) -> list[Any]:
        """What rank 0 sends (the typed encoding of an exchange holds plain values)."""
        return [self.name, self.save_id, self.durable, self.reason, self.manifest,
                self.sources, self.token]

    @classmethod
    def from_message(cls, msg: list[Any]) -> LocalDecision:
        name, save_id, durable, reason, manifest, sources, token = msg
        return cls(name, save_id, durable, reason, manifest,
                   None if sources is None else {f: tuple(h) for f, h in sources.items()},
                   token)


def decide_local(run: Storage, tier: LocalTier, every: list[Any], *, world_size: int
                 ) -> LocalDecision | None:
    """Rank 0: the local step to restore (:class:`LocalDecision`), or None (the caller then
    decides from the durable tier alone; the reason is logged).

    ``every``: each rank's ``(host, inventory_message)``.  What the durable tier must say
    comes from two requests made at once, whatever the number of checkpoints: one read of
    the run folder's lease (the lineage) and one listing of its commit markers, whose
    metadata carries each committed checkpoint's lease epoch, ``num_updates`` and save id
    (:func:`~xla_ckpt.run.catalog.committed_markers`).  Only a candidate the durable tier
    committed without its save id in that metadata (an earlier xla_ckpt) costs one more
    read, of its manifest.  On the emulator with 30 ms of first-byte latency this decision
    takes one round trip, not the seven of resolving ``checkpoint_last`` first
    (``benchmarks/time_to_resume.py``).

    Raises:
        StorageError and its kinds: the listing failed (the durable decision would too).
    """
    invs: dict[int, list[LocalStep]] = {}
    held: dict[int, list[LocalStep]] = {}
    for host, inv in every:
        if inv is not None:
            where = f"host {host}'s inventory"
            invs[host] = [LocalStep.from_json(d, where=where) for d in inv["own"]]
            held[host] = [LocalStep.from_json(d, where=where) for d in inv["replicas"]]
    hosts = {h for h, _ in every}
    for h in hosts - set(invs):
        invs[h] = []
    if not any(invs.values()) and not any(held.values()):
        logger.info("rank 0: restoring from the durable tier: no host holds a committed "
                    "local step")
        return None
    with cf.ThreadPoolExecutor(1, thread_name_prefix="xla_ckpt-lease") as pool:
        leased = pool.submit(peek_lease, run)
        markers = committed_markers(run)
        try:
            lease = leased.result()
        except CheckpointCorruptError as e:  # a restore only reads: the durable choice stands
            logger.warning("rank 0: restoring from the durable tier: the run folder's lease "
                           "is unreadable, so no local step's lineage can be checked (%s)", e)
            return None
    latest = None
    if markers:
        name, m = max(markers.items(), key=lambda kv: (*kv[1].order, kv[0]))
        latest = DurableLatest(name, m.save_id or "", m.order[0], m.order[1])

    def durable_save_id(name: str) -> str | None:
        m = markers.get(name)
        if m is None:
            return None  # not committed in the durable tier (as of the listing)
        if m.save_id is not None:
            return m.save_id
        if m.read is not None:
            return m.read[0].save_id
        with run.child(name) as st:
            found = committed_manifest(st)
        return found[0].save_id if found is not None else None

    while True:
        choice, why = choose_local(invs, world_size=world_size,
                                   lease_epoch=lease.epoch if lease is not None else 0,
                                   durable=latest, durable_save_id=durable_save_id,
                                   replicas=held)
        if choice is None:
            logger.info("rank 0: restoring from the durable tier: %s", why)
            return None
        sources = dict(choice.sources) if choice.sources is not None else None
        token = secrets.token_hex(16) if sources is not None else ""
        if sources is not None and not os.path.exists(os.path.join(tier.path(choice.name),
                                                                   MANIFEST_NAME)):
            # This host was replaced, or is new to the job: rank 0 reads the manifest from
            # a peer (PeerSources) and sends it to every rank.
            return LocalDecision(choice.name, choice.save_id, choice.durable, choice.reason,
                                 None, sources, token)
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
            held = {h: [s for s in inv if s.name != choice.name] for h, inv in held.items()}
            continue
        return LocalDecision(choice.name, choice.save_id, choice.durable, choice.reason,
                             mbytes, sources, token)


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
                manifest: Manifest, counters: TierCounters, peers: PeerSources | None = None
                ) -> Callable[[StorageConfig | None], Storage]:
    """This rank's opener for the chosen local step: its host's copy first, then (another
    mesh, ``peers``) the tiers of the other hosts that hold a file, the durable folder
    behind them when it holds the same save; a failed check marks the host's copy (or the
    replica the file belongs to) untrusted (:meth:`LocalTier.untrust`,
    :meth:`LocalTier.untrust_replica`)."""
    url = run.url(name)
    files = dict(manifest.files)
    tensors_at = tensors_in_range(manifest)
    local_files = peers.local_files(tier.host) if peers is not None else None
    owner = file_owners(tier, name, save_id) if peers is not None else {}

    def file_failed(file: str, why: str) -> None:
        source = owner.get(file, tier.host)
        if source == tier.host:
            tier.untrust(name, save_id, why)
        else:
            tier.untrust_replica(name, source, save_id, why)

    def open_(config: StorageConfig | None) -> Storage:
        def durable_storage() -> Storage:
            return open_storage(url, config or run.config)
        return TieredStorage(tier.step_storage(name), durable_storage if durable else None,
                             files=files, host=tier.host, counters=counters,
                             tensors_at=tensors_at,
                             on_failure=lambda why: tier.untrust(name, save_id, why),
                             config=config, local_files=local_files,
                             peers=peers.storages(tier.host) if peers is not None else None,
                             on_file_failure=file_failed if peers is not None else None)
    return open_


def file_owners(tier: LocalTier, name: str, save_id: str) -> dict[str, int]:
    """``{file: the host whose part it is}`` for the files of ``name`` this host's tier holds
    as replicas of other hosts' parts (its own files are absent)."""
    return {f: s.host for s in tier.replicas() if s.name == name and s.save_id == save_id
            for f in s.files}


#: Environment variable: the address this host's leader serves its tier on for peers (a
#: restore onto another mesh); default :func:`peer_address`.
PEER_ADDRESS_ENV = "XLA_CKPT_PEER_ADDRESS"


def peer_address() -> str:
    """The address other hosts reach this host's peer server on: ``$XLA_CKPT_PEER_ADDRESS``,
    else the address this host's GCS connections leave from (``$XLA_CKPT_GCS_SOURCE_ADDRESS``,
    :attr:`~xla_ckpt.storage.StorageConfig.source_address`), else 127.0.0.1 when the job's
    rendezvous (``MASTER_ADDR``) is on this machine's loopback (one machine: emulated
    hosts), else this machine's name resolved (a TPU VM's or a pod's own address)."""
    env = os.environ.get(PEER_ADDRESS_ENV) or os.environ.get(SOURCE_ADDRESS_ENV)
    if env:
        return env
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if master in ("localhost", "::1") or master.startswith("127."):
        return "127.0.0.1"
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclasses.dataclass
class PeerSources:
    """A restore onto another mesh (issue 26, resharding from the tiers): which hosts' tiers
    hold each data file, and where each host serves its own.

    Which rank calls what: every host's leader whose tier holds a file of the step calls
    :meth:`serve` (before the read); every rank exchanges the servers' addresses
    (:attr:`urls`); each rank's :class:`~xla_ckpt.storage.tiered.TieredStorage` reads a
    file it needs from its own host's tier when it holds it, else from the listed peers'
    servers (:meth:`storages`), checked by the reader's crc32c, else from the durable tier.
    The servers stop after the read (:meth:`close`).
    """

    name: str
    save_id: str
    sources: dict[str, tuple[int, ...]]
    token: str
    urls: dict[int, str] = dataclasses.field(default_factory=dict)
    server: Any = None
    timeout_s: float = 60.0

    def local_files(self, host: int) -> set[str]:
        return {f for f, hs in self.sources.items() if host in hs}

    def serve(self, tier: LocalTier) -> str | None:
        """This host's leader: start serving the files of the step its tier holds (and the
        manifest); returns the server's URL, or None when it holds none."""
        folder = tier.path(self.name)
        files = {f: os.path.join(folder, f) for f in self.local_files(tier.host)}
        if not files:
            return None
        if os.path.exists(os.path.join(folder, MANIFEST_NAME)):
            files[MANIFEST_NAME] = os.path.join(folder, MANIFEST_NAME)
        self.server = PeerServer(files, address=peer_address(), token=self.token)
        return str(self.server.url)

    def storages(self, host: int) -> dict[str, list[tuple[int, Storage]]]:
        """``{file: [(peer host, its storage), ...]}``: the other hosts holding each file (for
        a file ``host`` holds too, the ones it falls back to when its own copy fails a
        check); one storage per peer, closed with the caller's TieredStorage."""
        per: dict[int, Storage] = {}
        out: dict[str, list[tuple[int, Storage]]] = {}
        for f, hs in self.sources.items():
            for h in hs:
                if h != host and h in self.urls:
                    if h not in per:
                        per[h] = PeerStorage(self.urls[h], host=h, token=self.token,
                                             timeout_s=self.timeout_s)
                    out.setdefault(f, []).append((h, per[h]))
        return out

    def manifest_bytes(self) -> bytes:
        """Rank 0, when its host holds none of the step: the manifest from the first peer
        that serves it.

        Raises:
            CheckpointCorruptError: no peer's server returned it.
        """
        errors = []
        for h, url in sorted(self.urls.items()):
            st = PeerStorage(url, host=h, token=self.token, timeout_s=self.timeout_s)
            try:
                return st.read_bytes(MANIFEST_NAME)
            except (StorageError, CheckpointNotFoundError) as e:
                errors.append(f"host {h}: {e}")
            finally:
                st.close()
        raise CheckpointCorruptError(f"no peer served the manifest of {self.name}: "
                                     + "; ".join(errors))

    def end(self, exchange: Callable[[Any], list[Any]], tier: LocalTier,
            counters: TierCounters, *, leader: bool) -> bool:
        """Every rank, after a read from peers (or its failure): one exchange (no server
        stops while a rank still reads) of the peer copies that failed; each holder's leader
        marks a failed copy untrusted, so no later restore reads it again.  Returns whether
        any rank fell back from a copy (then a failed read decides again)."""
        every = exchange([bool(counters.fallbacks),
                          [[h, f, why] for h, f, why in counters.peer_failures]])
        fell_back = any(part[0] for part in every)
        if not leader:
            return fell_back
        owner = file_owners(tier, self.name, self.save_id)
        for f, why in [(f, why) for part in every for h, f, why in part[1] if h == tier.host]:
            why = why if f in why else f"{f}: {why}"
            source = owner.get(f, tier.host)
            if source == tier.host:
                tier.untrust(self.name, self.save_id, why)
            else:
                tier.untrust_replica(self.name, source, self.save_id, why)
        return fell_back

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def own_host_config(config: RestoreConfig) -> RestoreConfig:
    """The restore config of a read from the local tier: each rank reads its own boxes
    (``all_ranks``; with host shared memory, the host's leader reads the replicated state
    once for its host) through its tiers, no plan's exchange over the data plane."""
    if config.strategy in (ALL_RANKS, PER_HOST):
        return config
    return dataclasses.replace(config, strategy=ALL_RANKS)


