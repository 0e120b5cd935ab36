"""The orchestrator behind ``xla-ckpt demo``: reference run, preempted run, two resumes, verdicts.

1. Start the GCS emulator on 127.0.0.1 (unless ``--uri`` names real storage or a local path).
2. **Reference**: ``--workers`` processes train ``U`` updates without interruption; record the
   global loss of every update and a digest of the final parameters.
3. **Preempted run**: the same job checkpoints every few updates to ``<uri>``; once it passes the
   middle of an epoch the orchestrator sends SIGTERM to every worker (as GKE / a TPU
   maintenance event would).  Every rank saves at the next update boundary and exits 0.
   The workers of this (replicated, DDP-style) leg run as ``train.hosts`` emulated hosts
   (default 2 x 2 workers): rank ``r`` gets ``GROUP_RANK = r * hosts // workers``, its
   ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` and its host's loopback source address
   (``XLA_CKPT_GCS_SOURCE_ADDRESS = 127.0.0.(10+h)``), so each host has its own link.
4. **Resume**, twice from that same checkpoint, through a
   :class:`~xla_ckpt.testing.fault_proxy.FaultProxy` in front of the emulator that shapes
   every host's link (:data:`~xla_ckpt.demo.link.RESTORE_SHAPING_FIGURES`: 30 ms first byte,
   32 MiB/s per stream, 64 MiB/s per host) and counts the bytes it serves to each host: once
   with every rank reading everything (``all_ranks`` with ``host_shared_memory=false``, the
   old TPU path), once with rank-0-reads-then-broadcasts.  Each resumed run trains to ``U``
   updates.  Before it trains on, the ``all_ranks`` resume restores the same checkpoint
   again with the ``per_host`` and ``striped`` plans and with ``auto``
   (:data:`RESTORE_ONLY`), one after the other (no worker start-up, no training of their own).
5. **Verdict** per strategy: losses of the preempted run up to the checkpoint plus the
   resumed run's losses equal the reference losses bit for bit, and so do the final
   parameters on every worker; every restore's state (digest of every tensor's bytes, the
   rank's own item included) equals the ``all_ranks`` resume's on the same rank.
6. **The sharded leg** (:func:`run_sharded_leg`, workers :mod:`xla_ckpt.demo.fsdp`): the same
   run with FSDP2 -- reference, preempted run on ``train.hosts`` emulated hosts with a local
   tier and peer replicas (every rank saves only its own shards, to its host's folder then
   to GCS; each host's part is replicated to another host; DCP saves the same state
   alongside), a restore on the same number of workers that trains on, a restore resharded
   onto half as many (both of the named checkpoint, from GCS), and ``tier_resharded``:
   ``checkpoint_last`` from the tiers onto half as many workers spread over the same hosts,
   through the shaped proxy.  Verdict per restore: every restored local shard equals its box
   of the saved global tensors and DCP's restore of the same state; the same-size resume also
   reproduces the FSDP2 reference bit for bit; ``tier_resharded`` also restored the preempted
   update from tier ``local`` on every rank with no durable byte and no data-file byte served
   by GCS (:func:`~xla_ckpt.demo.report.tier_resharded_verdict`; bytes by tier per host).
7. **The local-tier leg** (:mod:`xla_ckpt.demo.local_leg`): the replicated run with a local
   tier in host memory (a folder per emulated host), local saves every update and durable
   ones every 4; SIGKILL mid-epoch; the relaunch must restore the newest local step on every
   host with no checkpoint byte from GCS and train on bit for bit; then one byte of one
   host's local copy is flipped and the next relaunch must read that tensor's chunk from GCS
   and the rest locally, again bit for bit (:func:`~xla_ckpt.demo.report.local_verdict`).

Progress goes to the ``xla_ckpt.demo`` loggers at INFO (``xla-ckpt demo`` prints them on
stderr): a start and a done line for every leg, worker phase and long step of the
orchestrator, and a ``still running, N s`` line every
:data:`~xla_ckpt.demo.progress.HEARTBEAT_S` seconds while one runs
(:class:`~xla_ckpt.demo.progress.Heartbeat`); :func:`~xla_ckpt.demo.report.verdict_line` is
the one PASS/FAIL line the CLI ends with.

The pieces: :mod:`xla_ckpt.demo.link` (the emulator, the shaped proxy, bytes served per
host), :mod:`xla_ckpt.demo.phase` (one phase's worker processes),
:mod:`xla_ckpt.demo.report` (verdicts, tables, the last line),
:mod:`xla_ckpt.demo.progress` (progress lines); this module runs the legs in order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

from xla_ckpt.config import load_config
from xla_ckpt.demo import corpus, local_leg
from xla_ckpt.demo.link import ServedCounter, open_demo_storage
from xla_ckpt.demo.phase import DemoError, PhaseResult, run_phase
from xla_ckpt.demo.progress import Heartbeat, step
from xla_ckpt.demo.report import (
    check_states,
    global_losses,
    restore_verdict,
    resume_verdict,
    shard_mismatches,
    sharded_verdict,
    tier_resharded_verdict,
)
from xla_ckpt.run.catalog import resolve_latest
from xla_ckpt.storage import open_storage

logger = logging.getLogger(__name__)

STRATEGIES = ("all_ranks", "broadcast")
"""Restores of the replicated leg that train on (resume phases), in order; ``all_ranks`` runs
with ``restore.host_shared_memory=false`` (every rank reads everything)."""
RESTORE_ONLY = ("per_host", "striped", "auto")
"""Restores of the replicated leg without training of their own (done by the ``all_ranks``
resume's workers before they train on), checked against that resume's restored state."""
LEGS = ("ddp", "fsdp", "local")
"""The legs, in the order they run: ``ddp`` (replicated, SIGTERM, five restore plans),
``fsdp`` (FSDP2-sharded), ``local`` (the local tier: SIGKILL, restore from host memory, a
flipped byte; :mod:`xla_ckpt.demo.local_leg`)."""
REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LOCAL_REPLICAS = 1
"""``checkpoint.local_replicas`` of the fsdp leg's local tier (every host's part on one other
host)."""


def default_config_path() -> str:
    """``configs/cpu-emulation.yaml`` of the source tree (the demo's default)."""
    return str(REPO_CONFIGS / "cpu-emulation.yaml")



def _plan(config: str, overrides: list[str]) -> tuple[Any, int, int, int]:
    """(config, total updates, update after which to preempt, emulated hosts ``train.hosts``;
    the config refuses ``train.workers`` that is not a multiple of it)."""

    cfg = load_config(config, overrides)
    tc = cfg.train
    hosts = tc.hosts
    per_epoch = len(corpus.pairs()) // (tc.batch_size * tc.workers)
    if per_epoch < 2:
        raise DemoError(f"train.batch_size={tc.batch_size} x train.workers={tc.workers} leaves "
                        f"{per_epoch} update(s) per epoch; use smaller batches or fewer workers")
    total = tc.max_updates or tc.max_epoch * per_epoch
    preempt = tc.preempt_at_update or (total - per_epoch // 2 if total > per_epoch else total // 2)
    preempt = max(1, min(preempt, total - 2))
    return cfg, total, preempt, hosts



def run_demo(*, config: str | None = None, overrides: list[str] | None = None,
             uri: str | None = None, workers: int | None = None, model: str | None = None,
             device: str = "cpu", keep: bool = False, legs: Sequence[str] = LEGS,
             hosts: int | None = None) -> dict:
    """Run the whole demo and return the report (what ``--json`` prints).

    ``legs``: ``"ddp"`` (the replicated run: every worker holds the whole model; resumed with
    ``all_ranks`` and ``broadcast``, then restored with ``per_host``, ``striped`` and
    ``auto``) and/or ``"fsdp"`` (the same run sharded with FSDP2; restored on the same
    number of workers and resharded onto half as many, checked against DCP, then resharded
    from the local tier and its peer replicas, ``fsdp_tier_resharded``) and/or
    ``"local"`` (the local tier: a crash restored from host memory, then a flipped byte;
    ``report["local"]``).  ``hosts``: emulated hosts of the legs (``train.hosts``; the demo
    config says 2; the fsdp leg's reference and GCS restores run on one).
    ``report["bitwise_identical"]`` has one entry per restore (``local_crash``,
    ``local_flipped`` and ``fsdp_tier_resharded``: true only when every check of
    :func:`~xla_ckpt.demo.report.local_verdict` /
    :func:`~xla_ckpt.demo.report.tier_resharded_verdict` holds); the CLI exits 0 only when
    all are true.  The local tiers live in
    ``/dev/shm/xla-ckpt-demo-*`` (else the work folder) and are removed at the end
    unless ``keep``.

    Raises:
        DemoError: a phase failed (names the phase and the ranks' log tails).
        ConfigError: a bad config value, e.g. ``train.workers`` not a multiple of
            ``train.hosts``.
        ValueError: an unknown leg.
    """
    bad = sorted(set(legs) - set(LEGS))
    if bad or not legs:
        raise ValueError(f"legs must be a non-empty subset of {LEGS}, got {list(legs)}")
    config = config or default_config_path()
    overrides = list(overrides or [])
    if workers:
        overrides.append(f"train.workers={workers}")
    if model:
        overrides.append(f"train.model={model}")
    if hosts:
        overrides.append(f"train.hosts={hosts}")
    cfg, total, preempt, hosts = _plan(config, overrides)
    n = cfg.train.workers
    report: dict[str, Any] = {"workers": n, "hosts": hosts, "model": cfg.train.model,
                              "updates": total, "legs": list(legs), "restores": [],
                              "bitwise_identical": {}}
    with contextlib.ExitStack() as stack:
        where = open_demo_storage(stack, uri, hosts)
        env, uri, storage_kind = where.env, where.uri, where.kind
        if where.restore_link is not None:
            report["restore_link"] = where.restore_link
        report.update(uri=uri, storage=storage_kind)
        workdir = tempfile.mkdtemp(prefix="xla-ckpt-demo-")
        if not keep:  # a failed demo keeps the worker logs its error points to
            stack.push(lambda exc_type, *_: None if exc_type is not None
                       else shutil.rmtree(workdir, True))
        base = overrides + [f"checkpoint.save_dir={uri}", f"train.max_updates={total}"]
        logger.info("%d workers (%d emulated host(s)), model %s, %d updates, checkpoints "
                    "to %s (%s)", n, hosts, cfg.train.model, total, uri, storage_kind)
        ref: list[PhaseResult] = []  # the ddp leg's reference, for the local leg
        ref_args = ["--digest-every", str(local_leg.DURABLE_EVERY)] if "local" in legs else []
        if "ddp" in legs:
            with _leg("ddp"):
                report.update(_replicated_leg(n, config, base, env, workdir, device, preempt,
                                              uri, hosts=hosts,
                                              restore_env=where.restore_env or env,
                                              counter=where.counter, ref_args=ref_args,
                                              ref_out=ref))
            report["bitwise_identical"].update(
                {r["strategy"]: r["bitwise_identical"] for r in report["restores"]})
        if "fsdp" in legs:
            fsdp_root = local_leg.make_local_root(workdir)
            if not keep:  # host memory: removed whatever the outcome
                stack.callback(local_leg.remove_local_root, fsdp_root)
            with _leg("fsdp"):
                sharded = run_sharded_leg(n, config=config, overrides=base, env=env,
                                          workdir=workdir, preempt=preempt,
                                          save_dir=f"{uri.rstrip('/')}-fsdp", hosts=hosts,
                                          restore_env=where.restore_env or env,
                                          counter=where.counter, local_root=fsdp_root)
            report["sharded"] = sharded
            report["bitwise_identical"].update(
                {f"fsdp_{r['restore']}": r["bitwise_identical"] for r in sharded["restores"]})
        if "local" in legs:
            root = local_leg.make_local_root(workdir)
            if not keep:  # host memory: removed whatever the outcome
                stack.callback(local_leg.remove_local_root, root)
            save_dir = f"{uri.rstrip('/')}-local"
            with _leg("local"):
                loc = local_leg.run_local_leg(
                    n, config=config, overrides=base, env=env,
                    restore_env=where.restore_env or env, counter=where.counter,
                    workdir=workdir, device=device, hosts=hosts, preempt=preempt, total=total,
                    save_dir=save_dir, local_root=root, ref=ref[0] if ref else None,
                    durable_latest=lambda: _latest(save_dir, env))
            report["local"] = loc
            report["bitwise_identical"].update(
                {f"local_{r['restore']}": r["bitwise_identical"] for r in loc["restores"]})
    return report


def _latest(uri: str, env: dict) -> str | None:
    """The newest committed checkpoint of run folder ``uri`` (storage reached through
    ``env``), or None."""
    with _env(env), open_storage(uri) as st:
        return resolve_latest(st)


@contextlib.contextmanager
def _leg(leg: str) -> Iterator[None]:
    """Start and done lines of one leg; a :class:`DemoError` raised in it names the leg."""
    hb = Heartbeat(f"leg {leg}")
    hb.start()
    try:
        yield
    except DemoError as e:
        e.leg = e.leg or leg
        raise
    hb.done()



def _replicated_leg(n: int, config: str, base: list[str], env: dict, workdir: str,
                    device: str, preempt: int, uri: str, *, hosts: int = 1,
                    restore_env: dict | None = None,
                    counter: ServedCounter | None = None, ref_args: Sequence[str] = (),
                    ref_out: list[PhaseResult] | None = None) -> dict:
    """Reference, preempted run, the two resumes and the restore-only plans of the replicated
    (DDP-style) model, on ``hosts`` emulated hosts.

    Saves go to storage through ``env``, restores through ``restore_env`` (the shaped proxy,
    whose bytes per host ``counter`` counts; None: not counted).  ``ref_args``: extra worker
    arguments of the reference run (``--digest-every``); it is appended to ``ref_out``.
    """
    renv = restore_env if restore_env is not None else env
    sync = ["--sync-restores"] if counter is not None else []
    ref = run_phase("reference", workers=n, config=config, overrides=base, env=env,
                    workdir=workdir, device=device, hosts=hosts, args=list(ref_args))
    if ref_out is not None:
        ref_out.append(ref)
    ref_losses = global_losses(ref.reports)
    ref_digest = {r["digest"] for r in ref.reports}
    pre = run_phase("train", workers=n, config=config, overrides=base, env=env,
                    workdir=workdir, device=device, preempt_after_update=preempt, hosts=hosts)
    pre_losses = global_losses(pre.reports)

    with _env(env), open_storage(uri) as run_storage:
        checkpoint = resolve_latest(run_storage)
    if checkpoint is None:
        raise DemoError("the preempted run left no committed checkpoint")
    logger.info("preempted after update %d; latest committed checkpoint %s",
                pre.reports[0]["num_updates"], checkpoint)
    restore_file = f"checkpoint.restore_file={uri.rstrip('/')}/{checkpoint}"
    results = []
    phase_seconds: dict[str, float] = {"reference": round(ref.seconds, 2),
                                       "train": round(pre.seconds, 2)}
    extra: list[dict] = []
    for strategy in STRATEGIES:
        ov = base + [f"restore.strategy={strategy}", restore_file,
                     f"checkpoint.save_dir={uri.rstrip('/')}-resumed-{strategy}"]
        args = list(sync)
        if strategy == "all_ranks":
            # Its own restore: every rank reads everything (the old TPU path).  The other
            # plans restore the same checkpoint in these workers before they train on (no
            # start-up or training of their own), with the config as it is (host shared
            # memory on); each must give every rank this state.
            args += ["--resume-set", "restore.host_shared_memory=false",
                     "--also-restore", ",".join(RESTORE_ONLY)]
        if counter is not None:
            counter.reset()
        res = run_phase("resume", workers=n, config=config, overrides=ov, env=renv,
                        workdir=workdir, device=device, hosts=hosts, args=args,
                        label=f"resume-{strategy}",
                        poll=counter.poll if counter is not None else None)
        phase_seconds[f"resume-{strategy}"] = round(res.seconds, 2)
        served = counter.served(0) if counter is not None else {}
        results.append(resume_verdict(strategy, res, pre_losses, ref_losses, ref_digest, served))
        if strategy == "all_ranks":
            for k, plan in enumerate(RESTORE_ONLY):
                served = counter.served(k + 1) if counter is not None else {}
                extra.append(restore_verdict(
                    plan, [r["restores"][k] for r in res.reports], served))
    results += extra
    check_states(results)
    return {"preempted_at_update": pre.reports[0]["num_updates"], "checkpoint": checkpoint,
            "reference_seconds": round(ref.seconds, 2), "phase_seconds": phase_seconds,
            "restores": results}


# ---- the sharded leg (FSDP2) ---------------------------------------------------------------
def run_sharded_leg(n: int, *, config: str, overrides: list[str], env: dict, workdir: str,
                    preempt: int, save_dir: str, hosts: int = 1,
                    restore_env: dict | None = None, counter: ServedCounter | None = None,
                    local_root: str | None = None) -> dict:
    """The FSDP2 leg (:mod:`xla_ckpt.demo.fsdp`): reference, preempted run, three restores.

    1. ``n`` workers train the sharded model without checkpoints (the reference);
    2. ``n`` workers on ``hosts`` emulated hosts train it with the manager's save schedule into
       ``save_dir``, with a local tier (``local_root``: ``checkpoint.local_dir`` =
       ``<local_root>/fsdp-host-{host}``, ``local_replicas=1``; only the scheduled and the
       preemption saves go through it); SIGTERM after update ``preempt``; every rank saves its
       own shards, locally then durably, each host's leader waits for its part's replicas (so
       every host holds its own part and another host's), DCP saves the same state into the
       work folder, and every rank exits 0;
    3. restore the latest committed checkpoint (named, from ``save_dir``: the durable tier) on
       ``n`` workers and train on (``same_size``), and on ``max(1, n // 2)`` workers
       (``resharded``; per-rank items dropped), each also restored by DCP into a second
       model;
    4. ``tier_resharded``: ``checkpoint_last`` restored from the tiers on ``n // 2`` workers
       spread over the same ``hosts`` hosts (per-rank items dropped), through ``restore_env``
       (the shaped proxy, whose bytes per host ``counter`` counts; None: the library's
       ``durable_bytes`` stand in), also restored by DCP.  Run only when ``n // 2`` is a
       multiple of ``hosts`` (and ``hosts`` > 1, ``local_root`` given); else
       ``tier_resharded_skipped`` says why.

    Verdicts (:func:`sharded_verdict`) check every restored local shard against the saved
    global tensors (read back whole by :func:`xla_ckpt.load`, itself checked against the
    shards every rank saved) and against DCP's restore of the same state; the same-size resume
    must also reproduce the reference's losses and final shards bit for bit;
    ``tier_resharded`` must also have restored the preempted update from tier ``local`` on
    every rank with no durable byte and no data-file byte served by GCS
    (:func:`~xla_ckpt.demo.report.tier_resharded_verdict`; per host: the bytes by tier).
    """
    module = "xla_ckpt.demo.fsdp"
    dcp_dir = os.path.join(workdir, "fsdp-dcp")
    base = overrides + [f"checkpoint.save_dir={save_dir}"]
    tier_workers = n // 2
    skipped = None
    if local_root is None:
        skipped = "no local tier folder"
    elif hosts < 2:
        skipped = "one emulated host: no other host to hold a replica"
    elif tier_workers < hosts or tier_workers % hosts:
        skipped = (f"{tier_workers} workers (half of {n}) do not spread evenly over {hosts} "
                   "hosts; run with train.workers = 2 x a multiple of train.hosts")
    local_dir = os.path.join(local_root, "fsdp-host-{host}") if local_root else None
    tier = [] if local_dir is None else [
        f"checkpoint.local_dir={local_dir}", "checkpoint.local_interval_updates=0",
        f"checkpoint.local_replicas={LOCAL_REPLICAS}", "checkpoint.local_max_bytes=0"]
    ref = run_phase("reference", workers=n, config=config, overrides=base, env=env,
                    workdir=workdir, module=module, label="fsdp-reference")
    pre = run_phase("train", workers=n, config=config, overrides=base + tier, env=env,
                    workdir=workdir, module=module, label="fsdp-train", hosts=hosts,
                    preempt_after_update=preempt, args=["--dcp-dir", dcp_dir])
    with _env(env), open_storage(save_dir) as run_storage:
        name = resolve_latest(run_storage)
    if name is None:
        raise DemoError("the preempted FSDP2 run left no committed checkpoint")
    checkpoint = f"{save_dir.rstrip('/')}/{name}"
    logger.info("FSDP2 run preempted after update %d; restoring %s",
                pre.reports[0]["num_updates"], checkpoint)
    with step("fsdp: reading the saved global tensors"):
        global_tensors = _saved_global_tensors(checkpoint, env)
    saved_bad = shard_mismatches(global_tensors, [r["saved"]["shards"] for r in pre.reports])
    restores = []
    for kind, workers in (("same_size", n), ("resharded", max(1, n // 2))):
        ov = base + [f"checkpoint.restore_file={checkpoint}",
                     f"checkpoint.save_dir={save_dir.rstrip('/')}-resumed-{kind}"]
        if kind == "resharded":
            ov.append("restore.rank_state_on_resize=drop")
        res = run_phase("resume" if kind == "same_size" else "reshard", workers=workers,
                        config=config, overrides=ov, env=env, workdir=workdir, module=module,
                        label=f"fsdp-{kind}", args=["--dcp-dir", dcp_dir])
        restores.append(sharded_verdict(kind, res.reports, global_tensors, saved_bad,
                                        ref=ref.reports if kind == "same_size" else None,
                                        pre=pre.reports))
    preempted_at = pre.reports[0]["num_updates"]
    out: dict[str, Any] = {
        "workers": n, "hosts": hosts, "checkpoint": checkpoint, "checkpoint_name": name,
        "preempted_at_update": preempted_at, "reference_seconds": round(ref.seconds, 2),
        "saved_shards_match": saved_bad == [], "local_dir": local_dir,
        "local_replicas": LOCAL_REPLICAS if local_dir else 0,
        "replication": _replication(pre.reports, name) if local_dir else None,
        "restores": restores}
    if skipped is not None:
        logger.info("fsdp: no restore from the tiers: %s", skipped)
        out["tier_resharded_skipped"] = skipped
        return out
    # From the tiers: checkpoint_last of the same run folder and local tier, resharded onto
    # half the workers, one per host; each host holds its own part and another's replica.
    renv = restore_env if restore_env is not None else env
    ov = base + tier + ["checkpoint.restore_file=checkpoint_last",
                        "restore.rank_state_on_resize=drop"]
    if counter is not None:
        counter.reset()
    res = run_phase("reshard", workers=tier_workers, config=config, overrides=ov, env=renv,
                    workdir=workdir, module=module, label="fsdp-tier_resharded", hosts=hosts,
                    args=["--dcp-dir", dcp_dir]
                    + (["--sync-restores"] if counter is not None else []),
                    poll=counter.poll if counter is not None else None)
    served = counter.served(0) if counter is not None else None
    row = sharded_verdict("tier_resharded", res.reports, global_tensors, saved_bad, ref=None,
                          pre=pre.reports)
    restores.append(tier_resharded_verdict(row, res, hosts=hosts, served=served,
                                           checkpoint_name=name, preempted_at=preempted_at,
                                           saved=[r["saved"]["shards"] for r in pre.reports]))
    return out


def _replication(reports: list[dict], name: str) -> dict[str, Any]:
    """How the preemption save's replicas went, as each host's leader reported it
    (:attr:`CheckpointManager.replication` of ``name`` after ``wait_for_replicas``)."""
    out: dict[str, Any] = {}
    for r in reports:
        status = (r.get("saved") or {}).get("replication")
        if status is not None:
            out[str(r["rank"])] = status.get(name)
    return out


def _saved_global_tensors(checkpoint: str, env: dict) -> dict[str, Any]:
    """The checkpoint's model and optimizer tensors as whole CPU tensors (``xla_ckpt.load``
    assembles them from their chunks), flattened DCP-style (``model.<fqn>``,
    ``optim.state.<fqn>.exp_avg``, ...)."""
    import torch  # noqa: PLC0415 - the orchestrator needs torch only here
    from torch.distributed.checkpoint._nested_dict import (  # noqa: PLC0415 - DCP helper
        flatten_state_dict,
    )

    import xla_ckpt  # noqa: PLC0415 - the top-level API, loaded once here

    with _env(env):
        tree = xla_ckpt.load(checkpoint)
    flat, _ = flatten_state_dict({"model": tree["model"], "optim": tree["optim"]})
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}



@contextlib.contextmanager
def _env(env: dict) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

