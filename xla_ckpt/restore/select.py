"""Which restore plan runs, and why (the reason goes into every log line and error).

The plans (:mod:`xla_ckpt.restore.cost`): ``all_ranks``, ``per_host``, ``broadcast`` and
``striped``.  An explicit ``strategy`` wins; ``auto`` asks the cost model, once the
manifest (the checkpoint's size) and the job's shape (hosts x ranks per host, from one
exchange of every rank's host id) are known, for the plan with the lowest predicted
seconds among those this backend may run.  Every rank computes the same answer from the
same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

from xla_ckpt.comm.base import Dist
from xla_ckpt.errors import ConfigError
from xla_ckpt.format.manifest import Manifest
from xla_ckpt.restore import cost
from xla_ckpt.restore.config import RestoreConfig
from xla_ckpt.storage import StorageConfig

ALL_RANKS = cost.ALL_RANKS
PER_HOST = cost.PER_HOST
BROADCAST = cost.BROADCAST
STRIPED = cost.STRIPED
AUTO = "auto"


def choose_strategy(dist: Dist, config: RestoreConfig) -> tuple[str, str]:
    """``(strategy, reason)`` before the checkpoint is known; every rank gets the same answer.

    * fairseq ``load_checkpoint_on_all_dp_ranks=True`` -> ``all_ranks``;
    * an explicit ``strategy`` wins;
    * ``auto`` with one process -> ``all_ranks``;
    * ``auto`` otherwise -> ``("auto", ...)``: :func:`choose_plan_for_job` decides once the
      manifest is known.
    """
    if config.load_checkpoint_on_all_dp_ranks:
        return ALL_RANKS, "load_checkpoint_on_all_dp_ranks=True (fairseq option)"
    if config.strategy != AUTO:
        return config.strategy, f"strategy={config.strategy!r} was requested"
    if dist.world_size == 1:
        return ALL_RANKS, "auto: a single process reads the checkpoint itself"
    return AUTO, "auto: the cost model decides once the checkpoint's size is known"


@dataclass(frozen=True)
class JobShape:
    """The job as the cost model sees it (the same on every rank)."""

    topology: cost.RestoreTopology
    backend_kind: str


#: The restore settings every rank must share (the collectives each plan enters follow them).
#: (``host_shared_memory`` is not among them: false on any rank turns sharing off for every
#: rank, negotiated by :mod:`xla_ckpt.restore.host_share`.)
AGREED_SETTINGS = ("strategy", "load_checkpoint_on_all_dp_ranks", "bucket_size_bytes",
                   "zero_sharding", "allow_xla_data_plane")


def job_shape(dist: Dist, config: RestoreConfig | None = None) -> JobShape:
    """Every rank calls it (one exchange when there are several ranks): hosts are the distinct
    topology ``host_id`` values; with uneven hosts the model sees one host or one rank per
    host, so its hosts x ranks stays the world size.

    Raises:
        ConfigError: on every rank, when ranks passed different :data:`AGREED_SETTINGS`
            (different plans would enter different collectives and hang or crash); names
            the setting and the ranks.
    """
    kind = "single" if dist.world_size == 1 else ("xla" if dist.kind == "xla" else dist.backend)
    if kind not in cost.BACKEND_KINDS:
        kind = "torch"
    if dist.world_size == 1:
        return JobShape(cost.RestoreTopology(hosts=1, ranks_per_host=1), kind)
    mine = [getattr(config, k) for k in AGREED_SETTINGS] if config is not None else []
    every = dist.exchange([dist.topology.host_id, mine])
    for i, k in enumerate(AGREED_SETTINGS if config is not None else ()):
        values = {r: e[1][i] for r, e in enumerate(every)}
        if len(set(values.values())) > 1:
            shown = ", ".join(f"rank {r}: {v!r}" for r, v in values.items())
            raise ConfigError(f"restore.{k} differs between ranks ({shown}); every rank must "
                              "restore with the same restore settings")
    hosts: dict[int, int] = {}
    for h, _ in every:
        hosts[h] = hosts.get(h, 0) + 1
    # uneven hosts (6 ranks as 2 + 4): the model's hosts x ranks must stay the world size
    per = dist.world_size // len(hosts) if dist.world_size % len(hosts) == 0 else 0
    if per:
        return JobShape(cost.RestoreTopology(hosts=len(hosts), ranks_per_host=per), kind)
    return JobShape(cost.RestoreTopology(hosts=1, ranks_per_host=dist.world_size)
                    if max(hosts.values()) * 2 > dist.world_size else
                    cost.RestoreTopology(hosts=dist.world_size, ranks_per_host=1), kind)


def sizes_of(manifest: Manifest, item: str, config: RestoreConfig,
             storage_config: StorageConfig | None) -> cost.RestoreSizes:
    """The cost model's sizes for restoring ``item`` of ``manifest`` whole (a chunked item's
    bytes are those of the saved chunks its global tensors point at)."""
    nbytes = 0
    if item in manifest.items:
        it = manifest.item(item)
        nbytes = sum(b.length for b in it.blobs)
        if it.chunked:
            blobs = {(c.item, manifest.item(c.item).tensors[c.tensor].blob)
                     for gt in manifest.global_tensors for c in gt.chunks}
            nbytes += sum(manifest.item(i).blobs[b].length for i, b in blobs)
    return cost.RestoreSizes(state_bytes=nbytes,
                             request_bytes=(storage_config or StorageConfig()).slice_size_bytes,
                             bucket_bytes=config.bucket_size_bytes)


def choose_plan_for_job(shape: JobShape, sizes: cost.RestoreSizes,
                        config: RestoreConfig) -> cost.PlanChoice:
    """``auto``'s plan for this job (:func:`xla_ckpt.restore.cost.choose_plan`).

    Runnable here: every plan with several ranks (``per_host`` and ``striped`` fall back
    when host memory cannot be shared, with the reason logged); on XLA the plans that need
    a cross-host collective only with ``restore.allow_xla_data_plane``.
    """
    runnable = set(cost.PLANS)
    if not config.host_shared_memory:
        runnable.discard(PER_HOST)  # it would be all_ranks
    if shape.topology.world_size == 1:
        runnable = {ALL_RANKS}
    return cost.choose_plan(shape.topology, sizes, config.cost_model, runnable=runnable,
                            allow_xla_data_plane=config.allow_xla_data_plane,
                            backend_kind=shape.backend_kind)
