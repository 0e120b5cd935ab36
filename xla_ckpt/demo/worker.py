"""One training process of the demo (``python -m xla_ckpt.demo.worker``), launched like torchrun.

Environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``
(the emulated host), ``MASTER_ADDR``, ``MASTER_PORT``, ``PJRT_DEVICE=CPU`` (each worker owns
an XLA CPU device), for the GCS emulator ``STORAGE_EMULATOR_HOST`` (the emulator, or the
shaped proxy in front of it) and, on several emulated hosts, ``XLA_CKPT_GCS_SOURCE_ADDRESS``
(the host's loopback address, which its GCS connections leave from).

The loop is fairseq's ``train.py`` shape: restore (:class:`CheckpointManager` +
:class:`Checkpointer`), then per update: forward on this rank's shard of the batch, backward,
gradient average (gloo all-reduce in CPU emulation; ``xm.all_reduce`` when training on an XLA
device of a real TPU), AdamW + warm-up step, and ``manager.after_update`` (scheduled saves,
SIGTERM preemption).  Per-rank state (the CPU RNG that drives dropout, this rank's data
position) is saved in the rank's own item (CASES C12), the replicated state by rank 0.

Each worker writes ``<out>/rank<r>.json``: the global mean loss of every update it ran (as
float hex, exact), a sha256 digest of the final parameters (and, with ``--digest-every``, of
the parameters at those updates), the restore figures (with ``RestoreResult.tier`` when a local
tier is configured) and a ``timeline`` of wall-clock milestones (process start, dist init,
restore start and end, first update done).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as tdist

from xla_ckpt.comm import get_dist
from xla_ckpt.comm.liveness import stop_heartbeats
from xla_ckpt.config import load_config
from xla_ckpt.demo import corpus
from xla_ckpt.demo.model import ContrastiveLoss, build
from xla_ckpt.manager import CheckpointManager
from xla_ckpt.trainer import Checkpointer, CheckpointerConfig

if TYPE_CHECKING:
    from xla_ckpt.comm.base import Dist

logger = logging.getLogger("xla_ckpt.demo.worker")

PHASES = ("reference", "train", "resume")
"""reference: train without checkpoints; train: restore the latest checkpoint if there is one,
train, checkpoint (the phase a real job runs); resume: train, but a checkpoint must exist
(with ``--also-restore``, the same checkpoint is first restored again with each of those
strategies, no training, each restore's figures and :func:`state_digest` in the report)."""

SYNC_TIMEOUT_S = 300.0
"""How long rank 0 waits for the orchestrator to count a restore's bytes (``--sync-restores``)."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m xla_ckpt.demo.worker")
    p.add_argument("--config", required=True, help="YAML config (configs/cpu-emulation.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   help="dotted.key=value override (repeatable)")
    p.add_argument("--phase", choices=PHASES, required=True)
    p.add_argument("--out", required=True, help="folder for rank<r>.json")
    p.add_argument("--device", choices=("cpu", "xla", "cuda"), default="cpu",
                   help="where the model trains (cpu: fast CPU emulation; xla: this worker's "
                        "XLA device, as on a TPU; cuda: cuda:<LOCAL_RANK>)")
    p.add_argument("--resume-set", dest="resume_overrides", action="append", default=[],
                   metavar="KEY=VALUE",
                   help="override for this phase's own restore and training only, not for "
                        "the --also-restore restores (e.g. restore.host_shared_memory=false)")
    p.add_argument("--also-restore", default="", metavar="STRATEGIES",
                   help="resume phase: after its restore, restore the same checkpoint again "
                        "with each of these comma-separated restore.strategy values (e.g. "
                        "per_host,striped,auto), one after the other, before training on")
    p.add_argument("--sync-restores", action="store_true",
                   help="after each restore, every rank waits while the orchestrator counts "
                        "the bytes storage served (rank 0 writes <out>/restored<k> and waits "
                        "for <out>/counted<k>)")
    p.add_argument("--stop-after-update", type=int, default=0, metavar="N",
                   help="end the run cleanly after update N (its saves committed), as if the "
                        "job were done; the report's digest is the parameters' at N")
    p.add_argument("--no-state-digest", action="store_true",
                   help="skip the restored state's digest (the local leg times the relaunch "
                        "to its first training step; nothing compares that digest there)")
    p.add_argument("--digest-every", type=int, default=0, metavar="N",
                   help="also record the parameters' digest after every N-th update "
                        "(report 'digests')")
    return p.parse_args(argv)


def state_digest(tree: Any) -> str:
    """sha256 over a restored state tree: every key, every tensor's dtype, shape and bytes
    (CPU copies of XLA / CUDA tensors), every other leaf's ``repr``, in tree order.

    Two restores of one checkpoint give the same digest only when they are bitwise equal.
    """
    h = hashlib.sha256()

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            h.update(f"D{len(obj)}".encode())
            for k, v in obj.items():
                h.update(f"K{k!r}".encode())
                walk(v)
        elif isinstance(obj, (list, tuple)):
            h.update(f"{type(obj).__name__}{len(obj)}".encode())
            for v in obj:
                walk(v)
        else:
            h.update(f"V{obj!r}".encode())

    walk(tree)
    return h.hexdigest()


def param_digest(modules: list[torch.nn.Module]) -> str:
    """sha256 over the bytes of every parameter and buffer (CPU copies), in module order."""
    h = hashlib.sha256()
    for m in modules:
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                     if t.numel() else b"")
    return h.hexdigest()


class ShardedBatches:
    """Deterministic per-epoch shuffle of the pair corpus; rank r takes every world-th batch row.

    State (fairseq ``EpochBatchIterator.state_dict`` layout): ``epoch``,
    ``iterations_in_epoch``, ``version`` (2), plus ``shuffle_seed``.
    """

    version = 2

    def __init__(self, n_items: int, *, rank: int, world_size: int, batch_size: int, seed: int):
        self.n_items, self.rank, self.world = n_items, rank, world_size
        self.batch_size, self.seed = batch_size, seed
        self.per_update = batch_size * world_size
        self.updates_per_epoch = n_items // self.per_update

    def batch(self, epoch: int, i: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1000 + epoch)
        perm = torch.randperm(self.n_items, generator=g)
        rows = perm[i * self.per_update:(i + 1) * self.per_update]
        return rows[self.rank::self.world].tolist()


def _grad_average(params: list[torch.nn.Parameter], loss: torch.Tensor, world: int,
                  on_tpu: bool) -> float:
    """Average gradients (and the loss) over ranks; returns the global mean loss."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if on_tpu:  # pragma: no cover - needs a TPU
        import torch_xla.core.xla_model as xm  # noqa: PLC0415 - torch_xla only on a TPU

        xm.all_reduce(xm.REDUCE_SUM, grads + [loss.detach()], scale=1.0 / world)
        return float(loss.item())

    # gloo takes CPU tensors (XLA tensors under CPU emulation go through host); NCCL takes CUDA.
    host = params[0].device.type == "xla"
    flat = torch.cat([g.detach().reshape(-1) for g in grads] + [loss.detach().reshape(1)])
    if host:
        flat = flat.cpu()
    if world > 1:
        tdist.all_reduce(flat)
    flat /= world
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(g).to(p.device)
        offset += n
    return float(flat[-1])


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # Wall-clock seconds (time.time()) of this rank's milestones: the process's start (the
    # kernel's), main() reached (imports done), the process group up, the restore, the
    # first update done.
    timeline = {"process_start": _process_start(), "main": time.time()}
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)

    cfg = load_config(args.config, args.overrides + args.resume_overrides)
    tc = cfg.train
    dist = get_dist(cfg.dist)
    timeline["dist_init"] = time.time()
    world = dist.world_size
    device = torch.device("cpu")
    on_tpu = False
    if args.device == "xla":
        import torch_xla  # noqa: PLC0415 - only with --device xla

        device = torch_xla.device()
        on_tpu = os.environ.get("PJRT_DEVICE", "").upper() == "TPU"
    elif args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)

    tokenizer, model = build(tc.model, seed=tc.seed)
    criterion = ContrastiveLoss()
    model.to(device).train()
    criterion.to(device)
    pairs = corpus.pairs()
    data = ShardedBatches(len(pairs), rank=rank, world_size=world, batch_size=tc.batch_size,
                          seed=tc.seed)
    total = tc.max_updates or tc.max_epoch * data.updates_per_epoch

    def build_optimizer(params: list) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=tc.lr, betas=(0.9, 0.98), eps=1e-6,
                                 weight_decay=tc.weight_decay)

    def build_lr_scheduler(
            opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        warm = max(1, tc.warmup_updates)
        return torch.optim.lr_scheduler.LambdaLR(
            opt, lambda u: min(1.0, (u + 1) / warm) * max(0.0, 1 - u / max(total, 1)))

    ckpt = Checkpointer(model=model, criterion=criterion, build_optimizer=build_optimizer,
                        build_lr_scheduler=build_lr_scheduler, cfg={"train": vars(tc)},
                        rank=rank, device=device,
                        config=CheckpointerConfig(criterion_check=tc.criterion_check,
                                                  fairseq_compat=tc.fairseq_compat))
    torch.manual_seed(tc.seed * 7919 + rank)  # per-rank dropout stream

    ck = cfg.checkpoint
    if args.phase == "reference":
        ck.no_save = True
        ck.handle_sigterm = False
    mgr = CheckpointManager(ck, dist=dist, storage_config=cfg.storage, restore_config=cfg.restore)
    report: dict = {"rank": rank, "phase": args.phase, "losses": {}, "restore": None,
                    "preempted": False, "timeline": timeline, "digests": {}}
    epoch, start_i = 1, 0
    if args.phase != "reference":
        timeline["restore_start"] = time.time()
        res = _restore(mgr, rank, args.device, digest=not args.no_state_digest)
        timeline["restore_end"] = time.time()
        if res is not None and args.sync_restores:
            # The orchestrator's count (not the job's): rank 0's wait is left out of the
            # time to the first training step.
            timeline["count_wait_s"] = _sync(dist, args.out, 0)
        if res is not None and args.also_restore:
            report["restores"] = _also_restore(load_config(args.config, args.overrides), dist,
                                               args)
        if res is None and args.phase == "resume":
            raise SystemExit(f"rank {rank}: nothing to resume from under {ck.save_dir}")
        if res is not None:
            extra = ckpt.load_state(res.result, where=res.result.uri)
            if extra is None:  # load_state gives None only when handed no checkpoint at all
                raise RuntimeError(f"rank {rank}: restored {res.result.uri} but the trainer "
                                   "found no state in it")
            itr = extra["train_iterator"]
            epoch, start_i = int(itr["epoch"]), int(itr["iterations_in_epoch"])
            torch.set_rng_state(extra["rng_state"].cpu())
            report["restore"] = dict(res.figures, num_updates=ckpt.get_num_updates())
    params = ckpt.live_parameters()
    stop = False
    try:
        while ckpt.get_num_updates() < total and not stop:
            for i in range(start_i, data.updates_per_epoch):
                if ckpt.get_num_updates() >= total:
                    break
                rows = data.batch(epoch, i)
                a = tokenizer([pairs[r][0] for r in rows], padding="max_length", truncation=True,
                              max_length=32, return_tensors="pt")
                b = tokenizer([pairs[r][1] for r in rows], padding="max_length", truncation=True,
                              max_length=32, return_tensors="pt")
                ea = model(a["input_ids"].to(device), a["attention_mask"].to(device))
                eb = model(b["input_ids"].to(device), b["attention_mask"].to(device))
                loss = criterion(ea, eb)
                loss.backward()
                mean_loss = _grad_average(params, loss, world, on_tpu)
                ckpt.optimizer.step()
                ckpt.optimizer.zero_grad(set_to_none=True)
                ckpt.lr_scheduler.step()
                ckpt.set_num_updates(ckpt.get_num_updates() + 1)
                if device.type == "xla":
                    import torch_xla.core.xla_model as xm  # noqa: PLC0415 - torch_xla only on a TPU

                    xm.mark_step()
                u = ckpt.get_num_updates()
                timeline.setdefault("first_step", time.time())
                report["losses"][u] = mean_loss.hex()
                if args.digest_every and u % args.digest_every == 0:
                    report["digests"][u] = param_digest([model, criterion])
                _progress(args.out, rank, u)
                last = i == data.updates_per_epoch - 1
                next_pos = {"epoch": epoch + 1 if last else epoch,
                            "iterations_in_epoch": 0 if last else i + 1, "version": 2,
                            "shuffle_seed": tc.seed}
                mgr.after_update(
                    epoch=epoch, num_updates=u, end_of_epoch=last,
                    state=lambda pos=next_pos: ckpt.state_dict({"train_iterator": pos}),
                    rank_state=lambda: {"rng_state": torch.get_rng_state()},
                    metrics={"loss": mean_loss} if last else None)
                if u == args.stop_after_update:
                    stop = True  # this run is done: close() below waits for its saves
                    break
            epoch, start_i = epoch + 1, 0
    except SystemExit as e:
        # The manager ends a preempted run with SystemExit(0) once the preemption save committed.
        report["preempted"] = True
        report["num_updates"] = ckpt.get_num_updates()
        _write(args.out, rank, report)
        _shut_down(dist)
        raise e
    mgr.close()
    report["digest"] = param_digest([model, criterion])
    report["num_updates"] = ckpt.get_num_updates()
    _write(args.out, rank, report)
    _shut_down(dist)
    return 0


def _process_start() -> float:
    """When the kernel started this process (wall clock, 10 ms resolution; Linux
    ``/proc/self/stat``), or now where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def _shut_down(dist: Dist) -> None:
    """Tear the job down in order before the interpreter does it in any order.

    Every rank waits for the others, stops its heartbeat thread (a daemon
    thread still inside a store call at interpreter exit aborts the process)
    and destroys the process group, so rank 0's store outlives every use.
    """


    if dist.world_size > 1:
        dist.barrier()
    stop_heartbeats()
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


@dataclass
class _Restore:
    result: Any
    figures: dict


def _restore(mgr: CheckpointManager, rank: int, device: str, *,
             digest: bool = True) -> "_Restore | None":
    """``restore_or_initialize`` onto this worker's own XLA device (C2), with its figures
    (bytes, plan, predicted and measured seconds, :func:`state_digest` of what came back
    unless not ``digest``: ``""``)."""
    map_location = _map_location(device)
    t0 = time.perf_counter()
    res = mgr.restore_or_initialize(map_location=map_location)
    seconds = time.perf_counter() - t0
    if res is None:
        return None
    r = res.restored
    st = r.stats if r is not None else None
    return _Restore(res, {
        "checkpoint": res.checkpoint, "strategy": r.strategy if r else "",
        "reason": r.reason if r else "", "bytes_read": st.bytes_read if st else 0,
        "bytes_received": st.bytes_received if st else 0,
        "bytes_mapped": st.bytes_mapped if st else 0, "data_path": st.data_path if st else "",
        "seconds": seconds,
        "plan": st.plan if st else "", "predicted_s": st.predicted_s if st else 0.0,
        "predictions": dict(st.predictions) if st else {},
        "restore_seconds": st.seconds if st else seconds,
        "host_shared_memory": mgr.restore_config.host_shared_memory,
        "tier": res.tier,
        "state_digest": state_digest({"state": res.state, "rank_state": res.rank_state})
        if digest else "",
        "state_devices": sorted({str(t.device) for t in _tensors(res.state)}),
    })


def _map_location(device: str) -> Any:
    """Where restored tensors go: this worker's own XLA device (C2) or GPU; None: CPU."""
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())  # this rank's own GPU
    if device == "xla" or os.environ.get("PJRT_DEVICE"):
        try:
            import torch_xla  # noqa: PLC0415 - only with --device xla

            return torch_xla.device()
        except ImportError:  # pragma: no cover - torch_xla is pinned with the demo
            return None
    return None


def _also_restore(cfg: Any, dist: Dist, args: argparse.Namespace) -> list[dict]:
    """Restore ``checkpoint.restore_file`` again once per strategy of ``--also-restore`` (a
    fresh manager each, ``no_save``; nothing is loaded into the model), with ``cfg`` (the
    phase's config without ``--resume-set``): each restore's figures and
    :func:`state_digest` (of the state and this rank's item), in order.
    With ``--sync-restores`` restore ``k`` (from 1: the resume's own is 0) is counted.
    """
    import dataclasses  # noqa: PLC0415 - only with --also-restore

    plans = [x.strip() for x in args.also_restore.split(",") if x.strip()]
    ck = dataclasses.replace(cfg.checkpoint, no_save=True, handle_sigterm=False)
    out = []
    for k, plan in enumerate(plans, start=1):
        mgr = CheckpointManager(ck, dist=dist, storage_config=cfg.storage,
                                restore_config=dataclasses.replace(cfg.restore, strategy=plan))
        try:
            res = _restore(mgr, dist.rank, args.device)
            if res is None:
                raise SystemExit(f"rank {dist.rank}: nothing to restore under {ck.save_dir}")
            out.append(dict(res.figures, requested=plan, num_updates=res.result.num_updates))
            del res  # one extra copy of the state at a time
        finally:
            mgr.close()
        if args.sync_restores:
            _sync(dist, args.out, k)
    return out


def _sync(dist: Dist, out: str, k: int) -> float:
    """Every rank: hold here until the orchestrator has counted restore ``k``'s bytes.

    All ranks finish the restore (barrier); rank 0 writes ``<out>/restored<k>`` and waits
    for ``<out>/counted<k>`` (the orchestrator read and reset the proxy's counters);
    another barrier releases the others.  Returns rank 0's wait for the count in seconds
    (0.0 on the other ranks).
    """
    if dist.world_size > 1:
        dist.barrier()
    waited = 0.0
    if dist.rank == 0:
        t0 = time.perf_counter()
        with open(os.path.join(out, f"restored{k}"), "w") as f:
            f.write(str(k))
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        while not os.path.exists(os.path.join(out, f"counted{k}")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0: the orchestrator did not count restore {k} "
                                   f"within {SYNC_TIMEOUT_S:.0f} s (no {out}/counted{k})")
            time.sleep(0.02)
        waited = time.perf_counter() - t0
    if dist.world_size > 1:
        dist.barrier()
    return waited


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _progress(out: str, rank: int, num_updates: int) -> None:
    with open(os.path.join(out, f"progress{rank}"), "w") as f:
        f.write(str(num_updates))


def _write(out: str, rank: int, report: dict) -> None:
    path = os.path.join(out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
