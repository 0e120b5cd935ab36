"""``restore()``: one entry point, one engine (:mod:`xla_ckpt.restore.engine`), one stats object.

Replaced while reading: when the read fails on some rank(s) with a "file not there /
not as the manifest says" cause (every rank holds the same agreed
:class:`~xla_ckpt.errors.DistributedError`, so every rank takes the same branch),
every rank decides again, collectively (:func:`~xla_ckpt.restore.decide.decide`):
if the checkpoint now has another ``save_id`` (another writer saved over it, or a
run folder's latest moved on) the restore runs once more from the new decision;
if it is unchanged the read's own error is raised.  A second replacement raises
:class:`~xla_ckpt.errors.CheckpointReplacedError` (a ``DistributedError``) on every
rank, naming the race.  The single-process read path applies the same rule
(:func:`xla_ckpt.kinds.opener.read_resolved`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from xla_ckpt.comm.base import Dist
from xla_ckpt.comm.failures import is_broken_collective
from xla_ckpt.comm.select import get_dist
from xla_ckpt.errors import (
    CheckpointReplacedError,
    CollectiveTimeoutError,
    DistributedError,
    NothingCommittedError,
    TargetsOverwrittenError,
)
from xla_ckpt.format import typed
from xla_ckpt.format.gc_pause import gc_paused
from xla_ckpt.format.manifest import STATE_ITEM
from xla_ckpt.format.plan import MapLocation
from xla_ckpt.restore import cost
from xla_ckpt.restore.config import RestoreConfig
from xla_ckpt.restore.decide import Decision, decide
from xla_ckpt.restore.engine import RankStateRemap, run_plan
from xla_ckpt.restore.plan import plan_ranks
from xla_ckpt.restore.result import Restored
from xla_ckpt.restore.select import (
    ALL_RANKS,
    AUTO,
    choose_plan_for_job,
    choose_strategy,
    job_shape,
    sizes_of,
)
from xla_ckpt.restore.targets import agree_on_inputs
from xla_ckpt.storage import StorageConfig

logger = logging.getLogger(__name__)

# Causes (``describe_error`` type names) of a read that may have raced with another writer.
_RACE_CAUSES = frozenset({"CheckpointNotFoundError", "IncompleteCheckpointError",
                          "DataFileMissingError", "CheckpointCorruptError", "IntegrityError"})


def _may_have_raced(e: DistributedError) -> bool:
    """True if ``e`` (an agreed failure, the same on every rank) may come from a replacement."""
    if isinstance(e, CollectiveTimeoutError) or is_broken_collective(e) or not e.failures:
        return False
    return any(c.split(":", 1)[0] in _RACE_CAUSES for c in e.failures.values())


@gc_paused()  # many small objects, no cycles (CASES C26)
def restore(uri: str | Decision, *, dist: Dist | None = None, strategy: str | None = None,
            map_location: MapLocation = None, item: str = STATE_ITEM, rank_item: bool = True,
            zero_sharding: str | None = None,
            load_checkpoint_on_all_dp_ranks: bool | None = None,
            config: RestoreConfig | None = None,
            storage_config: StorageConfig | None = None, into: Any = None,
            rank_state_remap: RankStateRemap | None = None) -> Restored:
    """Restore a checkpoint onto every rank of the job.  Every rank calls it with the same ``uri``.

    Rank 0 decides which checkpoint (``uri`` itself, or the latest committed
    one when ``uri`` is a run folder) and sends the decision and its manifest
    to every rank; then the strategy moves the bytes:

    * ``all_ranks`` — every rank reads from storage in parallel; with
      ``host_shared_memory`` (default) the ranks of one host share one read
      (the ``per_host`` plan: :mod:`xla_ckpt.restore.blobs`);
    * ``per_host`` — each host's leader reads once, the host's ranks map its copy;
    * ``broadcast`` — rank 0 reads, the data plane broadcasts in buckets; ranks
      on one host share one sealed copy in host memory when they can;
    * ``striped`` — every byte fetched once per job, in stripes spread over every
      rank, exchanged through host memory and across hosts
      (:mod:`xla_ckpt.restore.box_striped`);
    * ``auto`` (default) — the plan the cost model predicts fastest for this job
      (:mod:`xla_ckpt.restore.cost`, ``RestoreConfig.cost_model``).

    Every plan gives every rank bitwise the same ``state``.  Log lines and errors
    name the strategy and why it was chosen; ``stats.plan``, ``stats.predicted_s``
    and ``stats.seconds`` say what ran, what the model predicted and what it took.

    **Into live targets, onto any mesh** (``into=``; :mod:`xla_ckpt.restore.sharded`):
    each rank passes its live state tree; every tensor leaf (plain, DTensor from FSDP2 /
    tensor parallel, torch_xla ``XLAShardedTensor``) is filled in place with the bytes of
    its own shards only, read by byte range from the saved chunks that overlap them
    (``all_ranks``) or sent by rank 0 (``broadcast``).  The saved mesh and world size may
    differ from the current ones (4 -> 2, 4 -> 3, 2 -> 4, 2-D dp x tp -> 1-D, uneven and
    empty shards), and a version-1 checkpoint of plain tensors (a DDP job's) restores into
    DTensor targets the same way.  ``strategy="auto"`` picks ``all_ranks`` when any rank
    holds a sharded target (each rank then reads only its own bytes).  A checkpoint with
    chunked (sharded) tensors restored without ``into`` comes back whole on every rank.

    **Per-rank items** (``rank/<r>``: iterator position, RNG) follow one rule
    (:mod:`xla_ckpt.restore.plan`): kept when the world size matches; with another world
    size, ``rank_state_remap(saved, rank, world_size)`` maps ``saved`` (saved rank ->
    state, every saved rank's) onto this rank, or ``RestoreConfig(rank_state_on_resize=
    "drop")`` drops them with a WARNING naming them, or else one
    :class:`~xla_ckpt.errors.WorldSizeMismatchError` names them and both options.

    Args:
        uri: checkpoint folder or run folder (local path or ``gs://``), or a
            :class:`~xla_ckpt.restore.decide.Decision` already made and the same on every
            rank (the manager's): then nothing is listed or decided again.
        dist: the job's :class:`~xla_ckpt.comm.Dist` (default :func:`get_dist`).
        strategy: ``"auto"``, ``"all_ranks"``, ``"per_host"``, ``"broadcast"`` or
            ``"striped"`` (overrides ``config``).
        map_location: where tensors go on *this* rank, as in ``torch.load``:
            None (CPU), a device, ``{"cpu": device}`` or ``fn(key) -> device``.
            Pass ``dist.device`` for this rank's own device (CASES C2: nothing
            lands on another rank's device).
        item: the replicated state item.
        rank_item: also restore this rank's own ``rank/<rank>`` item.
        zero_sharding: ``"os"`` (each rank gets its partition of the sharded
            tensors) or ``"none"`` (overrides ``config``).
        load_checkpoint_on_all_dp_ranks: fairseq's flag; True -> ``all_ranks``.
        config: :class:`RestoreConfig` (bucket size, resharding...).
        storage_config: storage knobs for the ranks that read.
        into: this rank's live state tree whose tensor leaves are the targets, e.g.
            ``{"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, o)}``
            (``torch.distributed.checkpoint.state_dict``; pass the tree back through
            ``set_state_dict`` afterwards).  Leaves are matched to the saved tensors by key
            path (``state['model']['l1.weight']``).  Targets keep their devices
            (``map_location`` places only the leaves ``into`` lacks).
        rank_state_remap: ``fn(saved: dict[int, Any], rank: int, world_size: int) -> Any``,
            called on every rank when the checkpoint's world size differs and it holds
            per-rank items; its value becomes ``Restored.rank_state``.

    Returns:
        :class:`Restored` (state, rank_state, shards, checkpoint, manifest,
        strategy and reason, stats).  With ``into``, ``state`` is the saved tree with each
        target replaced by its live (filled) object; ``stats.bytes_read`` is what this rank
        fetched and ``stats.shard_bytes`` the bytes of its own boxes.

    Raises:
        NothingCommittedError: nothing committed at ``uri`` (the same on every
            rank; :class:`UncommittedCheckpointError`, also an
            IncompleteCheckpointError, when saves began there and none committed).
        CheckpointNotFoundError: a typo'd path (its parent folder is missing too),
            a missing pointer; same on every rank.
        CheckpointReplacedError: another writer replaced the checkpoint during
            the read and again during the read once more (a DistributedError,
            on every rank).
        WorldSizeMismatchError: saved vs current world size cannot be
            reconciled (per-rank items without a remap hook or "drop"; flat
            sharded tensors with ``allow_reshard=False``); same on every rank.
        StateMismatchError: a target of ``into`` is not in the checkpoint or has
            another global shape or dtype (names the rank(s) and keys); every rank,
            before anything is read.
        TargetsOverwrittenError: with ``into``, a read or copy failed on some rank after
            some rank's live targets were (possibly partially) written: on every rank,
            naming the failed rank(s) and cause, the ranks whose targets were written and
            (``keys``) this rank's; restore again into every rank's targets or
            re-initialise them.  A :class:`PartiallyOverwrittenError` (an IntegrityError)
            and a DistributedError.
        DistributedError: a read or rebuild failed on some rank(s);
            ``failures`` names them and the cause, on every rank (with ``into``: no
            rank's target memory was written).
        CollectiveTimeoutError: a rank died or hung (nothing waits forever).
        ConfigError: bad options.
    """
    t0 = time.perf_counter()
    cfg = config or RestoreConfig()
    overrides: dict[str, Any] = {}
    if strategy is not None:
        overrides["strategy"] = strategy
    if zero_sharding is not None:
        overrides["zero_sharding"] = zero_sharding
    if load_checkpoint_on_all_dp_ranks is not None:
        overrides["load_checkpoint_on_all_dp_ranks"] = load_checkpoint_on_all_dp_ranks
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    dist = dist if dist is not None else get_dist()
    name, reason = choose_strategy(dist, cfg)
    # every rank: into / rank_state_remap given on all ranks or none (else the collectives differ)
    sharded_targets = agree_on_inputs(dist, into, rank_state_remap is not None)
    if sharded_targets and cfg.strategy == "auto" and not cfg.load_checkpoint_on_all_dp_ranks \
            and name != ALL_RANKS:
        name, reason = ALL_RANKS, ("auto: restoring into sharded targets, each rank reads only "
                                   "the byte ranges of its own shards")
    context = f"strategy {name}: {reason}"
    if isinstance(uri, Decision):  # decided already (CheckpointManager): not again
        decision, uri = uri, uri.checkpoint
    else:
        decision = decide(uri, dist, config=storage_config, context=context)
    shape = job_shape(dist, cfg)  # every rank: one exchange of host ids and settings
    sizes = sizes_of(decision.manifest, item, cfg, storage_config)
    predictions = {p: e.seconds for p, e in cost.predict(
        shape.topology, sizes, cfg.cost_model, backend_kind=shape.backend_kind).items()}
    if name == AUTO:
        choice = choose_plan_for_job(shape, sizes, cfg)
        name, reason = choice.plan, choice.reason
    for attempt in range(2):
        plans = plan_ranks(decision.manifest, dist.world_size, item=item,
                           restore_rank_items=rank_item, zero_sharding=cfg.zero_sharding,
                           allow_reshard=cfg.allow_reshard, context=context,
                           rank_state_on_resize=cfg.rank_state_on_resize,
                           remap=rank_state_remap is not None)
        what = f"restore of {decision.checkpoint} (strategy {name}: {reason})"
        if dist.rank == 0:
            logger.info("rank 0: restoring %s with strategy %s (%s)", decision.checkpoint, name,
                        reason)
        try:
            loaded = run_plan(decision, dist, plans, name, cfg, into=into, item=item,
                              map_location=map_location, storage_config=storage_config,
                              what=what, remap=rank_state_remap)
            break
        except DistributedError as e:
            if e.args and isinstance(e.args[0], str) and f"strategy {name}" not in e.args[0]:
                e.args = (f"{what}: {e.args[0]}",) + e.args[1:]  # a broken collective: say where
            if not _may_have_raced(e) or decision.source is not None:
                raise  # a tiered source (a host's local copy): its failures are its own
            again = _decide_again(uri, dist, decision, e, storage_config, context)
            if again is None:
                raise  # not replaced: the read's own error
            if attempt == 1:
                raise _replaced(decision, again.manifest.save_id, e) from e
            if dist.rank == 0:
                logger.warning("rank 0: %s was replaced while reading (save id %s -> %s); "
                               "restoring %s once more", decision.checkpoint,
                               decision.manifest.save_id, again.manifest.save_id,
                               again.checkpoint)
            decision = again
    me = plans[dist.rank]
    if me.dropped:
        logger.warning("rank %d: dropped the %s, because restore.rank_state_on_resize is "
                       "'drop'; Restored.rank_state is None (iterators restart the epoch)",
                       dist.rank, me.dropped)
    stats = loaded.stats
    stats.seconds = time.perf_counter() - t0
    stats.plan = stats.plan or name
    stats.predictions = predictions
    stats.predicted_s = predictions.get(stats.plan, 0.0)
    if stats.plan != name:  # e.g. per_host without host shared memory: every rank read
        reason = f"{reason}; ran the {stats.plan} plan ({stats.data_path})"
    md = decision.manifest.metadata
    result = Restored(
        state=loaded.state, rank_state=loaded.rank_state, shards=loaded.shards,
        shard_bounds=dict(me.shards), shard_numel={k: v.numel for k, v in me.layout.items()},
        checkpoint=decision.checkpoint, manifest=decision.manifest,
        metadata=typed.decode(md) if md is not None else None, strategy=name, reason=reason,
        stats=stats)
    if dist.rank == 0:
        logger.info("rank 0: restored %s with strategy %s (plan %s) in %.2f s, predicted "
                    "%.2f s (read %d bytes, %.1f MiB/s)%s",
                    decision.checkpoint, name, stats.plan, stats.seconds, stats.predicted_s,
                    stats.bytes_read, stats.bytes_read / max(stats.seconds, 1e-9) / 2**20,
                    f"; data plane: {stats.data_path}" if stats.data_path else "")
    return result


def _replaced(decision: Decision, now: str, e: DistributedError) -> CheckpointReplacedError:
    before = decision.manifest.save_id
    touched = ("; the live targets passed as into= were (possibly partially) overwritten "
               "on some ranks: restore again into every rank's targets or re-initialise them"
               if isinstance(e, TargetsOverwrittenError) else "")
    return CheckpointReplacedError(
        f"{decision.checkpoint} was replaced while reading (save id {before} -> {now}); retry "
        f"or pause the other writer{touched}", e.failures, uri=decision.checkpoint,
        before=before, after=now)


def _decide_again(uri: str, dist: Dist, decision: Decision, e: DistributedError,
                  storage_config: StorageConfig | None, context: str) -> Decision | None:
    """Every rank, after a read failure that may be a race: the new decision if the checkpoint
    was replaced, None if it is unchanged (the failure is the read's own)."""
    try:
        again = decide(uri, dist, config=storage_config, context=context)
    except NothingCommittedError as gone:  # deleted meanwhile: on every rank alike
        raise _replaced(decision, "none", e) from gone
    if (again.checkpoint, again.manifest.save_id) == (decision.checkpoint,
                                                      decision.manifest.save_id):
        return None
    return again

