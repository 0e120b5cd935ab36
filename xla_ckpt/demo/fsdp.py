"""The demo's sharded leg: one FSDP2 training process (``python -m xla_ckpt.demo.fsdp``).

Launched like :mod:`xla_ckpt.demo.worker` (torchrun-style environment, gloo on loopback), it
trains the same model on the same data, but sharded: ``fully_shard`` on every encoder layer and
on the whole model over ``init_device_mesh("cpu", (world_size,))``, so every parameter and
AdamW moment is a DTensor holding this rank's rows (uneven where the rows do not divide).
FSDP2 averages the gradients itself (reduce-scatter).  The criterion's scale is fixed here
(FSDP2 shards dim 0 and a 0-dim parameter has none).

Checkpoints go through :class:`~xla_ckpt.manager.CheckpointManager`, as in the replicated
leg: the state is ``get_model_state_dict`` / ``get_optimizer_state_dict`` (DTensor leaves) plus
the scheduler, ``num_updates`` and the iterator position; the manager sees DTensors and saves by
owner (each rank writes the chunks it holds, replicated values get one writer, async with
staged copies).  Phases:

* ``reference``: train ``U`` updates without checkpoints.
* ``train``: train with the config's save schedule; on SIGTERM the ranks agree at the next
  update boundary, save, and the same model and optimizer state is also saved with
  ``dcp.save`` into ``--dcp-dir`` (the reference the restores are checked against); exit 0.
  With a local tier (``checkpoint.local_dir``) on several emulated hosts the save goes to
  each host's folder first, then to durable storage, and each host's leader waits for its
  part's replicas (:meth:`CheckpointManager.wait_for_replicas`, ``--replicas-timeout``)
  before the ranks exit: every host then holds its own part and another host's.
* ``resume``: ``restore_or_initialize(into=`` the live DTensors ``)`` of
  ``checkpoint.restore_file``: each rank reads only the byte ranges of its own shards, in place;
  then DCP restores ``--dcp-dir`` into a second model, compared shard by shard; then train on
  to ``U`` updates.
* ``reshard``: the same restore onto however many workers this phase has (the orchestrator
  starts half as many; set ``restore.rank_state_on_resize=drop``: the per-rank RNG stream is
  dropped with a warning); no training.  Restoring ``checkpoint_last`` with the train
  phase's ``checkpoint.local_dir`` it reads from the tiers (``RestoreResult.tier`` in the
  report: which tier, the bytes from each); ``--sync-restores`` holds every rank after the
  manager's restore while the orchestrator counts the bytes storage served.

Each rank writes ``<out>/rank<r>.json``: the global loss of every update (float hex), a digest
of its final local shards, and for a save or a restore the crc32c of every local shard with
its global offsets and sizes, which the orchestrator checks against the saved global tensors.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from xla_ckpt.comm import get_dist
from xla_ckpt.config import load_config
from xla_ckpt.demo import corpus
from xla_ckpt.demo.model import ContrastiveLoss, build
from xla_ckpt.demo.worker import ShardedBatches, _progress, _shut_down, _sync, _write
from xla_ckpt.manager import CheckpointManager

logger = logging.getLogger("xla_ckpt.demo.fsdp")

PHASES = ("reference", "train", "resume", "reshard")
REPLICAS_TIMEOUT_S = 120.0
"""How long a preempted host's leader waits for its part's replicas (``--replicas-timeout``)."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m xla_ckpt.demo.fsdp")
    p.add_argument("--config", required=True, help="YAML config (configs/cpu-emulation.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   help="dotted.key=value override (repeatable)")
    p.add_argument("--phase", choices=PHASES, required=True)
    p.add_argument("--out", required=True, help="folder for rank<r>.json")
    p.add_argument("--dcp-dir", default="",
                   help="train: where the preemption save's DCP copy goes; resume/reshard: the "
                        "DCP checkpoint to compare with")
    p.add_argument("--sync-restores", action="store_true",
                   help="after the manager's restore, every rank waits while the orchestrator "
                        "counts the bytes storage served (before DCP's restore; as "
                        "python -m xla_ckpt.demo.worker --sync-restores)")
    p.add_argument("--replicas-timeout", type=float, default=REPLICAS_TIMEOUT_S, metavar="S",
                   help="train, with a local tier on several hosts: after the preemption save, "
                        "each host's leader waits at most S seconds for its part's replicas "
                        "(checkpoint.local_replicas) before the ranks exit")
    return p.parse_args(argv)


def build_sharded(model_name: str, seed: int, lr: float, weight_decay: float,
                  world: int) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    """(tokenizer, FSDP2 model, AdamW) on a 1-D CPU mesh of ``world`` ranks, deterministic."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415 - after the PG
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415 - after the PG

    tokenizer, model = build(model_name, seed=seed)
    mesh = init_device_mesh("cpu", (world,))
    bert: Any = model.bert  # transformers' BertModel (untyped here)
    # The sentence encoder pools the last hidden states itself; BERT's pooler (all-MiniLM-L6-v2
    # has one) takes no part in the loss.  A parameter that never gets a gradient has no AdamW
    # state after a step, while get_optimizer_state_dict() of a fresh optimizer creates state
    # for every parameter, so the restore targets would name entries the checkpoint cannot
    # have (DCP refuses them the same way).  Drop it.
    bert.pooler = None
    layers = bert.encoder.layer  # a ModuleList of BertLayer
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-6,
                              weight_decay=weight_decay)
    return tokenizer, model, optim


def state_dicts(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` from ``torch.distributed.checkpoint.state_dict``: DTensor
    leaves that alias the live parameters and optimizer state (restore targets, save sources)."""
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415 - after the PG
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}


def shard_table(tree: Any) -> dict[str, dict[str, Any]]:
    """Every tensor leaf (flattened DCP-style) -> its local shard's ``offsets``, ``sizes`` and
    ``crc32c`` (plain tensors: the whole tensor at offset 0), from DTensor itself."""
    from torch.distributed.checkpoint._nested_dict import (  # noqa: PLC0415 - DCP helper
        flatten_state_dict,
    )
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - after the PG
    from torch.distributed.tensor._utils import (  # noqa: PLC0415 - after the PG
        compute_local_shape_and_global_offset,
    )

    from xla_ckpt.format.crc import crc32c  # noqa: PLC0415 - light
    from xla_ckpt.testing.asserts import tensor_bits  # noqa: PLC0415 - light

    flat, _ = flatten_state_dict(tree)
    out: dict[str, dict[str, Any]] = {}
    for key, v in sorted(flat.items()):
        if not isinstance(v, torch.Tensor):
            continue
        if isinstance(v, DTensor):
            shape, offsets = compute_local_shape_and_global_offset(v.shape, v.device_mesh,
                                                                   v.placements)
            local = v.to_local()
        else:
            shape, offsets, local = tuple(v.shape), (0,) * v.dim(), v
        local = local.detach().contiguous()
        out[key] = {"offsets": list(offsets), "sizes": list(shape),
                    "crc32c": crc32c(tensor_bits(local)) if local.numel() else 0,
                    "nbytes": local.numel() * local.element_size()}
    return out


def shard_digest(table: dict[str, dict[str, Any]]) -> str:
    """sha256 of a :func:`shard_table` (keys, boxes and crc32c of every local shard)."""
    return hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()


def _dcp_shards(model_name: str, seed: int, lr: float, weight_decay: float, world: int,
                path: str) -> dict[str, dict[str, Any]]:
    """DCP's own restore of ``path`` into a second, freshly built FSDP2 model: its shard table."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 - the reference only

    _, model2, optim2 = build_sharded(model_name, seed + 1, lr, weight_decay, world)
    target = state_dicts(model2, optim2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=path)
    table = shard_table(target)
    del model2, optim2, target
    return table


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    cfg = load_config(args.config, args.overrides)
    tc = cfg.train
    dist = get_dist(cfg.dist)
    world = dist.world_size
    pairs = corpus.pairs()
    tokenizer, model, optim = build_sharded(tc.model, tc.seed, tc.lr, tc.weight_decay, world)
    criterion = ContrastiveLoss()
    criterion.log_scale.requires_grad_(False)
    data = ShardedBatches(len(pairs), rank=rank, world_size=world, batch_size=tc.batch_size,
                          seed=tc.seed)
    total = tc.max_updates or tc.max_epoch * data.updates_per_epoch
    warm = max(1, tc.warmup_updates)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda u: min(1.0, (u + 1) / warm) * max(0.0, 1 - u / max(total, 1)))
    torch.manual_seed(tc.seed * 7919 + rank)  # per-rank dropout stream

    ck = cfg.checkpoint
    if args.phase == "reference":
        ck.no_save = True
        ck.handle_sigterm = False
    ck.exit_on_preemption = False  # this process saves DCP's copy after the preemption save
    mgr = CheckpointManager(ck, dist=dist, storage_config=cfg.storage, restore_config=cfg.restore)
    report: dict[str, Any] = {"rank": rank, "world_size": world, "phase": args.phase,
                              "losses": {}, "restore": None, "preempted": False}
    num_updates, epoch, start_i = 0, 1, 0
    if args.phase in ("resume", "reshard"):
        num_updates, epoch, start_i = _restore(args, mgr, model, optim, sched, report, world,
                                               dist)
        if args.phase == "reshard":
            mgr.close()
            _write(args.out, rank, report)
            _shut_down(dist)
            return 0

    while num_updates < total:
        for i in range(start_i, data.updates_per_epoch):
            if num_updates >= total:
                break
            rows = data.batch(epoch, i)
            a = tokenizer([pairs[r][0] for r in rows], padding="max_length", truncation=True,
                          max_length=32, return_tensors="pt")
            b = tokenizer([pairs[r][1] for r in rows], padding="max_length", truncation=True,
                          max_length=32, return_tensors="pt")
            # Anchors and positives in one forward: FSDP2 all-gathers each layer once for it.
            emb = model(torch.cat([a["input_ids"], b["input_ids"]]),
                        torch.cat([a["attention_mask"], b["attention_mask"]]))
            loss = criterion(emb[:len(rows)], emb[len(rows):])
            loss.backward()  # FSDP2 reduce-scatters the averaged gradients
            mean = loss.detach().clone().reshape(1)
            if world > 1:
                tdist.all_reduce(mean)
            mean_loss = float(mean / world)
            optim.step()
            optim.zero_grad(set_to_none=True)
            sched.step()
            num_updates += 1
            report["losses"][num_updates] = mean_loss.hex()
            _progress(args.out, rank, num_updates)
            last = i == data.updates_per_epoch - 1
            pos = {"epoch": epoch + 1 if last else epoch,
                   "iterations_in_epoch": 0 if last else i + 1, "version": 2,
                   "shuffle_seed": tc.seed}
            step = mgr.after_update(
                epoch=epoch, num_updates=num_updates, end_of_epoch=last,
                state=lambda pos=pos, u=num_updates: {
                    **state_dicts(model, optim), "lr_scheduler": sched.state_dict(),
                    "num_updates": u, "train_iterator": pos},
                rank_state=lambda: {"rng_state": torch.get_rng_state()},
                metrics={"loss": mean_loss} if last else None)
            if step.preempted:
                # Every rank saved its shards of this update's state; DCP saves the same
                # model and optimizer state next to it (the restores are checked against it).
                # With a local tier on several hosts, each host's leader first waits for its
                # part's replicas (every host then holds its own part and another host's).
                replication = mgr.wait_for_replicas(args.replicas_timeout) \
                    if ck.local_dir else None
                mgr.close()
                sd = state_dicts(model, optim)
                report["saved"] = {"num_updates": num_updates, "shards": shard_table(sd),
                                   "replication": replication}
                if args.dcp_dir:
                    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 - the reference only

                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        dcp.save(sd, checkpoint_id=args.dcp_dir)
                report["preempted"] = True
                report["num_updates"] = num_updates
                _write(args.out, rank, report)
                _shut_down(dist)
                return 0
        epoch, start_i = epoch + 1, 0
    mgr.close()
    report["num_updates"] = num_updates
    report["digest"] = shard_digest(shard_table(state_dicts(model, optim)))
    _write(args.out, rank, report)
    _shut_down(dist)
    return 0


def _restore(args: argparse.Namespace, mgr: CheckpointManager, model: nn.Module,
             optim: torch.optim.Optimizer, sched: Any, report: dict,
             world: int, dist: Any) -> tuple[int, int, int]:
    """``restore_or_initialize(into=`` the live DTensors ``)`` of ``checkpoint.restore_file``;
    then DCP's restore of the same state into a second model, for comparison.  With
    ``--sync-restores`` every rank waits between the two while the orchestrator counts the
    bytes storage served to the manager's restore.  With a local tier the report carries
    ``RestoreResult.tier`` (``tier``, ``host``, ``local_bytes``, ``peer_bytes``,
    ``durable_bytes``, ``fallbacks``, times).

    Returns (num_updates, epoch, iterations_in_epoch) to continue from.
    """
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415 - after the PG
        set_optimizer_state_dict,
    )

    cfg = load_config(args.config, args.overrides)
    tc = cfg.train
    into = state_dicts(model, optim)
    t0 = time.perf_counter()
    res = mgr.restore_or_initialize(into=into)
    seconds = time.perf_counter() - t0
    count_wait = _sync(dist, args.out, 0) if args.sync_restores and res is not None else 0.0
    if res is None or res.restored is None:
        raise SystemExit(f"rank {report['rank']}: nothing to restore under "
                         f"{cfg.checkpoint.save_dir} ({cfg.checkpoint.restore_file})")
    st = res.state
    # The DTensors were filled in place; the optimizer's param_groups (lr, betas...) and the
    # scheduler come from the checkpoint's tree.
    set_optimizer_state_dict(model, optim, optim_state_dict=st["optim"])
    sched.load_state_dict(st["lr_scheduler"])
    table = shard_table(into)
    r = res.restored
    report["restore"] = {
        "checkpoint": res.uri, "checkpoint_name": res.checkpoint, "strategy": r.strategy,
        "reason": r.reason, "world_size": world,
        "saved_world_size": r.manifest.world_size, "seconds": round(seconds, 3),
        "bytes_read": r.stats.bytes_read, "bytes_received": r.stats.bytes_received,
        "bytes_mapped": r.stats.bytes_mapped,
        "shard_bytes": sum(e["nbytes"] for e in table.values()),
        "rank_state_kept": res.rank_state is not None, "num_updates": int(st["num_updates"]),
        "tier": res.tier, "count_wait_s": round(count_wait, 3), "shards": table}
    if args.dcp_dir:
        report["restore"]["dcp_shards"] = _dcp_shards(tc.model, tc.seed, tc.lr, tc.weight_decay,
                                                      world, args.dcp_dir)
    if res.rank_state is not None:  # last: building DCP's model above draws from the RNG
        torch.set_rng_state(res.rank_state["rng_state"].cpu())
    pos = st["train_iterator"]
    return int(st["num_updates"]), int(pos["epoch"]), int(pos["iterations_in_epoch"])


if __name__ == "__main__":
    sys.exit(main())
