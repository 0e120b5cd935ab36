"""The restore cost model: predicted seconds of each read plan, and the plan ``auto`` picks.

Pure arithmetic, no I/O: every rank evaluates it on the same inputs and gets the same answer.

**Plans** (the points of one mechanism; DESIGN "Each byte once"):

* ``all_ranks`` — every rank fetches every byte it needs from storage itself;
* ``per_host`` — one leader per host fetches the bytes its host needs, once; the
  other ranks of the host map the leader's sealed copy (host shared memory);
* ``broadcast`` — the first holder of each chunk (rank 0 when the state is
  replicated) fetches it; the data plane sends it to the other hosts that need it,
  and ranks on a host share their leader's copy;
* ``striped`` — the bytes of each chunk are split into stripes, one per rank that
  needs the chunk; every stripe is fetched once per job and exchanged: an
  all-gather across the hosts that hold the chunk, host shared memory within a host.

**Model** (each phase's seconds add; the phases are not assumed to overlap):

* Every restore first pays ``restore_fixed_s``, whatever its size: resolving and
  broadcasting the decision (pointer and manifest reads), the control-plane agreements
  that bracket each step, opening the storage clients, and for the plans that share host
  memory negotiating, sealing and handing over the segment (the part that does not grow
  with the bytes).  It is the same for every plan, so it never changes which plan ``auto``
  picks; it makes the predicted seconds comparable with measured ones, which matters most
  for small or fast restores (``benchmarks/striped_restore.py`` measured 0.34 s of it on
  emulated hosts, a sixth of a striped restore of 256 MiB there).
* A reader fetches its bytes in ranged requests of ``request_bytes``, on
  ``streams_per_reader`` parallel streams.  Each wave of requests waits
  ``first_byte_latency_s``; its bytes flow at ``storage_stream_bytes_per_s`` per
  stream, capped at ``storage_host_bytes_per_s`` for all the readers of one host
  (the host's network link): ``read = waves x latency + host bytes / min(host cap,
  readers x streams x stream rate)``.
* Every byte fetched by the whole job also slows every reader down:
  ``+ job bytes / storage_total_bytes_per_s``.  This aggregate term adds to the
  per-host one (two bottlenecks in series) rather than taking their ``max``: Orbax's
  every-replica reads of Llama 3.1 70B grow smoothly with the number of replicas
  (27.9 / 51.8 / 156.0 / 231.1 s for n = 2 / 4 / 16 / 32), which a ``max`` cannot
  reproduce (``benchmarks/scale_model.py`` calibrates on those rows).  So
  ``storage_total_bytes_per_s`` is the job's *marginal* rate: each extra byte the job
  fetches adds ``1 / storage_total_bytes_per_s`` seconds to the read, which is how it is
  measured (``benchmarks/striped_restore.py``'s storage probe times every host reading at
  once against one host reading alone, both through their shaped links).  It is not the
  rate an unshaped probe saturates: a service that serves the hosts' links with capacity
  to spare slows them little, and taking its capacity as the series term over-predicted
  the every-rank plans there by 30 %.
* Across hosts (``data_plane_cross_host_bytes_per_s`` per host link), a
  broadcast of ``M`` bytes to ``P`` hosts costs ``f(P) x M / bw`` with
  ``f = 2(P-1)/P`` on XLA (``xm.collective_broadcast`` is an all-reduce),
  ``ceil(log2 P)`` on gloo (binomial tree of whole buckets) and 1 on NCCL
  (pipelined ring); an all-gather in which every host ends with ``M`` bytes costs
  ``(P-1)/P x M / bw`` (ring) on every backend (``Dist.all_gather_tensors``: rounds of
  ``torch.distributed.all_gather`` on gloo and NCCL, ``xm.all_gather`` on the XLA plane).
  Each bucket (``bucket_bytes``) of such a collective also costs one
  ``data_plane_latency_s`` round.
* Within a host, a rank that gets its bytes from its leader's copy instead of
  its own fetch pays ``rank bytes / data_plane_intra_host_bytes_per_s`` plus one
  ``data_plane_latency_s`` round (the handover of the sealed copy).

**Topology**: ``hosts`` x ``ranks_per_host`` ranks; each chunk of the state is
needed by ``replicas`` ranks (all of them for a replicated state; 1 for a fully
sharded one) spread over ``replica_hosts`` hosts.  Each rank then needs
``state_bytes x replicas / world_size`` bytes and each host
``state_bytes x replica_hosts / hosts`` distinct bytes.

Defaults (:class:`Bandwidths`) describe a Cloud TPU / GPU VM reading GCS; a config
overrides any of them (``restore.cost_model`` in YAML, see
:class:`~xla_ckpt.restore.config.RestoreConfig`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

from xla_ckpt.comm.buckets import DEFAULT_BUCKET_SIZE_BYTES
from xla_ckpt.errors import ConfigError

__all__ = ["ALL_RANKS", "BACKEND_KINDS", "BROADCAST", "Bandwidths", "PER_HOST", "PLANS",
           "PlanChoice", "PlanEstimate", "RestoreSizes", "RestoreTopology", "STRIPED",
           "choose_plan", "estimate", "needs_data_plane", "predict"]

MiB = 1024 * 1024
GiB = 1024 * MiB

ALL_RANKS = "all_ranks"
PER_HOST = "per_host"
BROADCAST = "broadcast"
STRIPED = "striped"
#: Every plan, in the order ties are broken (the simpler plan first).
PLANS = (ALL_RANKS, PER_HOST, BROADCAST, STRIPED)
#: ``backend_kind`` values: the data-plane library (``Dist.kind`` "torch" means NCCL/gloo by
#: its backend; "single" is one process).
BACKEND_KINDS = ("xla", "nccl", "gloo", "torch", "single")

_TIE_RELATIVE = 1e-9  # predictions this close count as equal; the earlier plan in PLANS wins


def _positive_int(where: str, name: str, v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"{where}.{name} must be an integer >= 1, got {v!r}")
    return v


@dataclass(frozen=True, kw_only=True)
class RestoreTopology:
    """The job's shape as the cost model sees it.

    Attributes:
        hosts: number of hosts (machines), >= 1.
        ranks_per_host: processes per host (one per chip on TPU), >= 1.
        replicas: ranks that need each chunk, ``1 <= replicas <= world_size``;
            None means every rank (a replicated state).  A state of ``d``
            data-parallel replicas of a model sharded over ``world_size / d`` ranks
            has ``replicas = d``.
        replica_hosts: distinct hosts among which a chunk's ``replicas`` ranks sit;
            None derives it as data-parallel-outermost meshes place them
            (``hosts`` for a replicated state, else ``min(replicas, hosts)``).

    Both None fields are resolved at construction (so ``dataclasses.replace`` keeps the
    resolved values: build a new one to change ``hosts`` or ``ranks_per_host``).

    Raises:
        ConfigError: a value out of range or inconsistent (names the field).
    """

    hosts: int
    ranks_per_host: int
    replicas: int | None = None
    replica_hosts: int | None = None

    def __post_init__(self) -> None:
        _positive_int("topology", "hosts", self.hosts)
        _positive_int("topology", "ranks_per_host", self.ranks_per_host)
        world = self.hosts * self.ranks_per_host
        if self.replicas is None:
            object.__setattr__(self, "replicas", world)
        r = _positive_int("topology", "replicas", self.replicas)
        if r > world:
            raise ConfigError(f"topology.replicas ({r}) cannot exceed the world size "
                              f"({self.hosts} hosts x {self.ranks_per_host} ranks = {world})")
        if self.replica_hosts is None:
            object.__setattr__(self, "replica_hosts", self.hosts if r == world
                               else min(r, self.hosts))
        p = _positive_int("topology", "replica_hosts", self.replica_hosts)
        if p > min(self.hosts, r) or r > p * self.ranks_per_host:
            raise ConfigError(f"topology.replica_hosts ({p}) must be between "
                              f"ceil(replicas / ranks_per_host) = "
                              f"{math.ceil(r / self.ranks_per_host)} and "
                              f"min(hosts, replicas) = {min(self.hosts, r)}")

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def holders(self) -> int:
        """Ranks that need each chunk (``replicas``, resolved)."""
        return self.replicas if self.replicas is not None else self.world_size

    @property
    def holder_hosts(self) -> int:
        """Hosts that need each chunk (``replica_hosts``, resolved)."""
        return self.replica_hosts if self.replica_hosts is not None else self.hosts

    @property
    def sharing_ranks_per_host(self) -> int:
        """Ranks of one host that need the same chunk (they can share one fetched copy)."""
        return min(self.ranks_per_host, math.ceil(self.holders / self.holder_hosts))

    def rank_bytes(self, sizes: RestoreSizes) -> float:
        """Bytes each rank needs: ``state_bytes x replicas / world_size``."""
        return sizes.state_bytes * self.holders / self.world_size

    def host_bytes(self, sizes: RestoreSizes) -> float:
        """Distinct bytes each host needs: ``state_bytes x replica_hosts / hosts``."""
        return sizes.state_bytes * self.holder_hosts / self.hosts


@dataclass(frozen=True, kw_only=True)
class RestoreSizes:
    """How much a restore moves.

    Attributes:
        state_bytes: distinct tensor bytes the restore needs, each chunk counted once
            (the manifest's data bytes for a whole-state restore), >= 0.
        request_bytes: bytes per ranged read request (``StorageConfig.slice_size_bytes``,
            a multiple of the crc32c chunk size), >= 1.
        bucket_bytes: largest single data-plane collective
            (``RestoreConfig.bucket_size_bytes``), >= 1.

    Raises:
        ConfigError: a value out of range (names the field).
    """

    state_bytes: int
    request_bytes: int = 16 * MiB
    bucket_bytes: int = DEFAULT_BUCKET_SIZE_BYTES

    def __post_init__(self) -> None:
        b = self.state_bytes
        if not isinstance(b, int) or isinstance(b, bool) or b < 0:
            raise ConfigError(f"sizes.state_bytes must be an integer >= 0, got {b!r}")
        _positive_int("sizes", "request_bytes", self.request_bytes)
        _positive_int("sizes", "bucket_bytes", self.bucket_bytes)


@dataclass(kw_only=True)
class Bandwidths:
    """Throughputs and latencies of storage and the data plane (the model's parameters).

    Attributes:
        storage_stream_bytes_per_s: one request stream's throughput, bytes/s
            (a single GCS stream gives ~200 MiB/s).
        storage_host_bytes_per_s: one host's storage throughput over all its
            streams, bytes/s (its network link; "several GiB/s per VM" on GCS).
        storage_total_bytes_per_s: the job's aggregate storage rate in series with the
            host links, bytes/s: each byte the whole job fetches adds ``1 / this``
            seconds to the read (the module docstring; GCS's default egress bandwidth
            quota, 200 Gbit/s = 25e9 B/s per project and region, as the default).
        first_byte_latency_s: seconds before the first byte of each request (GCS:
            tens of milliseconds).
        data_plane_intra_host_bytes_per_s: a rank's copy out of its host's shared
            copy, bytes/s, with every rank of the host doing the same at once (mapping
            the sealed segment's pages: host memory bandwidth and page-table work; the
            default is a VM with a core per rank).
        data_plane_cross_host_bytes_per_s: one host's data-plane link for
            collectives across hosts, bytes/s (DCN / Ethernet / InfiniBand).
        data_plane_latency_s: seconds of one collective round: a bucket of a
            broadcast or all-gather, or the handover of a host's shared copy.
        streams_per_reader: parallel requests one reader keeps in flight
            (``StorageConfig.max_workers``).
        restore_fixed_s: seconds every restore pays whatever its size (the module
            docstring): deciding what to restore, control-plane agreements, opening
            storage clients, negotiating and sealing host shared memory.  The default,
            0.5 s, is a job of tens of hosts on a cloud control plane reading GCS (a
            pointer and a manifest read at tens of milliseconds each, a dozen gloo
            agreements across hosts); 4 emulated hosts x 2 ranks on one machine measured 0.34 s
            (``benchmarks/striped_restore.py``'s fixed-cost probe).

    Raises:
        ConfigError: a value <= 0 or of the wrong type (names the field).
    """

    storage_stream_bytes_per_s: float = float(200 * MiB)
    storage_host_bytes_per_s: float = float(4 * GiB)
    storage_total_bytes_per_s: float = 25e9
    first_byte_latency_s: float = 0.03
    data_plane_intra_host_bytes_per_s: float = float(8 * GiB)
    data_plane_cross_host_bytes_per_s: float = float(10 * GiB)
    data_plane_latency_s: float = 0.002
    streams_per_reader: int = 16
    restore_fixed_s: float = 0.5

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "streams_per_reader":
                _positive_int("restore.cost_model", f.name, v)
            elif f.name in ("first_byte_latency_s", "data_plane_latency_s", "restore_fixed_s"):
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0 \
                        or math.isinf(v):
                    raise ConfigError(f"restore.cost_model.{f.name} must be a finite number "
                                      f">= 0 (seconds), got {v!r}")
            elif (not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0
                  or math.isinf(v)):
                raise ConfigError(f"restore.cost_model.{f.name} must be a finite number > 0 "
                                  f"(bytes/s), got {v!r}")


@dataclass(frozen=True)
class PlanEstimate:
    """One plan's predicted cost and where it comes from.

    Attributes:
        plan: one of :data:`PLANS`.
        seconds: predicted restore seconds, ``fixed_s + read_s + exchange_s``.
        read_s: fetching from storage (latency waves + bytes over the caps).
        latency_s: the first-byte-latency part of ``read_s``.
        exchange_s: moving fetched bytes to the ranks that need them (data plane
            across hosts plus host shared memory within a host).
        storage_bytes: bytes the whole job fetches from storage.
        storage_bytes_per_host: bytes the busiest host fetches.
        fixed_s: the part every restore pays whatever its size
            (``Bandwidths.restore_fixed_s``).
    """

    plan: str
    seconds: float
    read_s: float
    latency_s: float
    exchange_s: float
    storage_bytes: float
    storage_bytes_per_host: float
    fixed_s: float = 0.0


class PlanChoice(NamedTuple):
    """What :func:`choose_plan` returns: ``(plan, predicted_s, reason)``.

    ``predicted_s`` holds every plan's predicted seconds (plans the job cannot run
    included, for the log); ``reason`` says why ``plan`` won and why others were excluded.
    """

    plan: str
    predicted_s: dict[str, float]
    reason: str


def _check_backend(backend_kind: str) -> None:
    if backend_kind not in BACKEND_KINDS:
        raise ConfigError(f"backend_kind must be one of {', '.join(BACKEND_KINDS)}; "
                          f"got {backend_kind!r}")


def _check_plan(plan: str) -> None:
    if plan not in PLANS:
        raise ConfigError(f"unknown restore plan {plan!r}; plans: {', '.join(PLANS)}")


def _broadcast_factor(backend_kind: str, peers: int) -> float:
    """``f(P)``: seconds of a broadcast to ``P`` hosts, in units of ``bytes / link bandwidth``."""
    if peers <= 1:
        return 0.0
    if backend_kind == "xla":
        return 2.0 * (peers - 1) / peers
    if backend_kind == "gloo":
        return float(math.ceil(math.log2(peers)))
    return 1.0


def _read(bw: Bandwidths, sizes: RestoreSizes, *, reader_bytes: float, readers_per_host: int,
          job_bytes: float) -> tuple[float, float]:
    """``(read seconds, latency seconds)`` when every reading host runs ``readers_per_host``
    readers of ``reader_bytes`` each and the job fetches ``job_bytes`` in all."""
    if reader_bytes <= 0:
        return 0.0, 0.0
    requests = math.ceil(reader_bytes / sizes.request_bytes)
    streams = min(bw.streams_per_reader, requests)
    latency = math.ceil(requests / bw.streams_per_reader) * bw.first_byte_latency_s
    host_rate = min(bw.storage_host_bytes_per_s,
                    readers_per_host * streams * bw.storage_stream_bytes_per_s)
    seconds = (latency + reader_bytes * readers_per_host / host_rate
               + job_bytes / bw.storage_total_bytes_per_s)
    return seconds, latency


def estimate(plan: str, topology: RestoreTopology, sizes: RestoreSizes, bandwidths: Bandwidths,
             *, backend_kind: str) -> PlanEstimate:
    """Predicted cost of one plan (see the module docstring for the model).

    Args:
        plan: one of :data:`PLANS`.
        topology, sizes, bandwidths: the inputs.
        backend_kind: the data plane, one of :data:`BACKEND_KINDS` (decides the
            cost of a broadcast across hosts).

    Raises:
        ConfigError: unknown plan or backend kind.
    """
    _check_plan(plan)
    _check_backend(backend_kind)
    t, bw = topology, bandwidths
    rank_b, host_b = t.rank_bytes(sizes), t.host_bytes(sizes)
    share = t.sharing_ranks_per_host
    intra = rank_b / bw.data_plane_intra_host_bytes_per_s + bw.data_plane_latency_s
    cross = bw.data_plane_cross_host_bytes_per_s

    def rounds(moved_bytes: float) -> float:
        return math.ceil(moved_bytes / sizes.bucket_bytes) * bw.data_plane_latency_s
    exchange = 0.0
    if plan == ALL_RANKS:
        reader_b, readers, reading_hosts = rank_b, t.ranks_per_host, t.hosts
    elif plan == PER_HOST:
        reader_b, readers, reading_hosts = host_b, 1, t.hosts
        if t.ranks_per_host > 1:  # the others take their bytes from the leader's copy
            exchange = intra
    elif plan == BROADCAST:
        # The first holder of each chunk reads it: hosts / replica_hosts hosts read, each
        # a whole host's worth; the data plane fans it out to the other holder hosts.
        reader_b, readers = host_b, 1
        reading_hosts = max(1, t.hosts // t.holder_hosts)
        if t.holder_hosts > 1:
            exchange = (_broadcast_factor(backend_kind, t.holder_hosts) * host_b / cross
                        + rounds(host_b))
        if t.ranks_per_host > 1:
            exchange += intra
    else:  # STRIPED: each rank reads 1/replicas of what it needs, then the holders exchange
        reader_b, readers, reading_hosts = rank_b / t.holders, t.ranks_per_host, t.hosts
        p = t.holder_hosts
        if p > 1:
            exchange = (p - 1) / p * host_b / cross + rounds(host_b)
        if share > 1:
            exchange += intra
    job = reader_b * readers * reading_hosts
    read_s, latency_s = _read(bw, sizes, reader_bytes=reader_b, readers_per_host=readers,
                              job_bytes=job)
    fixed = bw.restore_fixed_s
    return PlanEstimate(plan=plan, seconds=fixed + read_s + exchange, read_s=read_s,
                        latency_s=latency_s, exchange_s=exchange, storage_bytes=job,
                        storage_bytes_per_host=reader_b * readers, fixed_s=fixed)


def predict(topology: RestoreTopology, sizes: RestoreSizes, bandwidths: Bandwidths, *,
            backend_kind: str) -> dict[str, PlanEstimate]:
    """:func:`estimate` of every plan in :data:`PLANS`, keyed by plan."""
    return {p: estimate(p, topology, sizes, bandwidths, backend_kind=backend_kind)
            for p in PLANS}


def needs_data_plane(plan: str, topology: RestoreTopology) -> bool:
    """True if ``plan`` moves tensor bytes over a data-plane collective on ``topology``.

    ``broadcast`` does whenever there is more than one rank; ``striped`` when a
    chunk's holders span more than one host (within a host, stripes go through
    host shared memory); ``all_ranks`` and ``per_host`` never do.  On XLA such a
    collective is ``xm.all_gather`` / ``xm.collective_broadcast``, which only runs
    when ``restore.allow_xla_data_plane`` is true.
    """
    _check_plan(plan)
    if plan == BROADCAST:
        return topology.world_size > 1
    if plan == STRIPED:
        return topology.holder_hosts > 1
    return False


def choose_plan(topology: RestoreTopology, sizes: RestoreSizes, bandwidths: Bandwidths, *,
                runnable: set[str] | frozenset[str], allow_xla_data_plane: bool,
                backend_kind: str) -> PlanChoice:
    """The plan ``strategy="auto"`` runs: the lowest prediction among the plans allowed.

    Every rank calls it with the same arguments and gets the same answer (pure
    arithmetic).  A plan is allowed when it is in ``runnable`` (what the backend and
    the host can run: e.g. no ``per_host`` / ``striped`` without host shared memory)
    and, on XLA (``backend_kind="xla"``), when it needs no XLA collective
    (:func:`needs_data_plane`) unless ``allow_xla_data_plane``.  Ties go to the plan
    earlier in :data:`PLANS`.

    Returns:
        :class:`PlanChoice` ``(plan, predicted_s, reason)``: ``predicted_s`` has
        every plan's predicted seconds; ``reason`` names the winner, its prediction,
        the others' and why any plan was excluded.

    Raises:
        ConfigError: ``runnable`` names an unknown plan, or leaves no plan allowed;
            an unknown ``backend_kind``.
    """
    _check_backend(backend_kind)
    unknown = sorted(set(runnable) - set(PLANS))
    if unknown:
        raise ConfigError(f"runnable names unknown restore plan(s) {', '.join(unknown)}; "
                          f"plans: {', '.join(PLANS)}")
    est = predict(topology, sizes, bandwidths, backend_kind=backend_kind)
    predicted = {p: e.seconds for p, e in est.items()}
    excluded: dict[str, str] = {}
    for p in PLANS:
        if p not in runnable:
            excluded[p] = "not runnable here"
        elif backend_kind == "xla" and not allow_xla_data_plane and needs_data_plane(p, topology):
            excluded[p] = "needs an XLA collective (restore.allow_xla_data_plane is false)"
    allowed = [p for p in PLANS if p not in excluded]
    if not allowed:
        why = "; ".join(f"{p}: {r}" for p, r in excluded.items())
        raise ConfigError(f"no restore plan is allowed ({why}); add all_ranks to the runnable "
                          "plans or set restore.allow_xla_data_plane: true")
    low = min(predicted[p] for p in allowed)
    plan = next(p for p in allowed if predicted[p] <= low * (1 + _TIE_RELATIVE))
    others = ", ".join(f"{p} {predicted[p]:.3g} s" for p in PLANS if p != plan)
    reason = (f"auto: {plan} has the lowest predicted time, {predicted[plan]:.3g} s ({others}; "
              f"{topology.hosts} host(s) x {topology.ranks_per_host} rank(s), "
              f"{topology.holders} replica(s) of each chunk, {sizes.state_bytes} bytes, "
              f"{backend_kind})")
    if excluded:
        reason += "; excluded: " + "; ".join(f"{p} ({r})" for p, r in excluded.items())
    return PlanChoice(plan, predicted, reason)
