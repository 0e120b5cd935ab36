"""A small real training loop driven by CheckpointManager (used in-process and as a subprocess).

Linear(4, 3) + Adam, deterministic batches per (epoch, step, rank), gradients
averaged over the gloo group of :func:`xla_ckpt.dist.get_dist` when ``WORLD_SIZE`` > 1.  The state is the model,
the optimizer and the loop position; each rank also saves a private
``rank_state``.  Run as a script it prints one JSON line per event on stdout:

    {"event": "update", "n": 3, "rank": 0, "w": "<hex of weight bytes>"}
    {"event": "resumed", "n": 7, "checkpoint": "checkpoint_1_7"}
    {"event": "done", "n": 12, "params": {...hex...}, "losses": [...]}

With ``--pause-at N`` it prints update N, then reads one line from stdin
before reaching the update boundary (the test sends SIGTERM in between).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

torch.set_num_threads(1)

UPDATES_PER_EPOCH = 6
MAX_EPOCH = 2


def hexof(t: torch.Tensor) -> str:
    return t.detach().contiguous().numpy().tobytes().hex()


def batch(epoch: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(epoch * 10_000 + step * 100 + rank)
    return torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)


def train(cfg, *, dist=None, emit=lambda ev: None, pause_at: int = 0,
          fail_rank_state: bool = False) -> dict:
    """Train MAX_EPOCH epochs of UPDATES_PER_EPOCH updates, resuming from cfg.save_dir if possible."""
    from xla_ckpt.manager import CheckpointManager

    rank = dist.rank if dist is not None else 0
    world = dist.world_size if dist is not None else 1
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    mgr = CheckpointManager(cfg, dist=dist)
    epoch, step, num_updates, losses = 1, 0, 0, []
    resumed = mgr.restore_or_initialize()
    if resumed is not None:
        model.load_state_dict(resumed.state["model"])
        opt.load_state_dict(resumed.state["optimizer"])
        epoch, step = resumed.state["epoch"], resumed.state["step"]
        num_updates, losses = resumed.state["num_updates"], list(resumed.state["losses"])
        assert resumed.rank_state == {"rank": rank, "num_updates": num_updates}
        if step == UPDATES_PER_EPOCH:
            epoch, step = epoch + 1, 0
        emit({"event": "resumed", "n": num_updates, "checkpoint": resumed.checkpoint})

    def state():
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                "step": step, "num_updates": num_updates, "losses": list(losses)}

    def rank_state():
        if fail_rank_state:
            return {"bad": object()}
        return {"rank": rank, "num_updates": num_updates}

    while epoch <= MAX_EPOCH:
        while step < UPDATES_PER_EPOCH:
            x, y = batch(epoch, step, rank)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if world > 1:
                for p in model.parameters():
                    torch.distributed.all_reduce(p.grad)
                    p.grad /= world
            opt.step()
            step += 1
            num_updates += 1
            losses.append(loss.item())
            emit({"event": "update", "n": num_updates, "rank": rank, "w": hexof(model.weight),
                  "b": hexof(model.bias)})
            if num_updates == pause_at:
                sys.stdin.readline()
            end = step == UPDATES_PER_EPOCH
            mgr.after_update(epoch=epoch, num_updates=num_updates, end_of_epoch=end, state=state,
                             rank_state=rank_state, metrics={"loss": losses[-1]} if end else None)
        epoch, step = epoch + 1, 0
    mgr.close()
    return {"event": "done", "n": num_updates, "losses": losses,
            "w": hexof(model.weight), "b": hexof(model.bias)}


def reference(world_size: int = 1) -> dict:
    """The uninterrupted run, in one process, simulating ``world_size`` ranks (no manager).

    Returns ``{"updates": {n: (weight_hex, bias_hex)}, "losses": {rank: [...]}}``: bitwise what
    :func:`train` computes on every rank (gloo's sum of two tensors is ``a + b``).
    """
    assert world_size in (1, 2)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    updates, losses, n = {}, {r: [] for r in range(world_size)}, 0
    for epoch in range(1, MAX_EPOCH + 1):
        for step in range(UPDATES_PER_EPOCH):
            grads = []
            for r in range(world_size):
                x, y = batch(epoch, step, r)
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                grads.append([p.grad.clone() for p in model.parameters()])
                losses[r].append(loss.item())
            if world_size > 1:
                for i, p in enumerate(model.parameters()):
                    p.grad = grads[0][i] + grads[1][i]
                    p.grad /= world_size
            opt.step()
            n += 1
            updates[n] = (hexof(model.weight), hexof(model.bias))
    return {"updates": updates, "losses": losses}


def main() -> None:
    from xla_ckpt.config import CheckpointConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--save-dir", required=True)
    ap.add_argument("--pause-at", type=int, default=0)
    ap.add_argument("--async-save", type=int, default=1)
    ap.add_argument("--fail-rank-state", type=int, default=-1)
    a = ap.parse_args()
    dist = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from xla_ckpt.config import DistConfig
        from xla_ckpt.dist import get_dist

        dist = get_dist(DistConfig(backend="gloo", timeout_s=60))
    cfg = CheckpointConfig(save_dir=a.save_dir, save_interval_updates=4, keep_interval_updates=1,
                           keep_last_epochs=1, keep_best_checkpoints=1,
                           async_save=bool(a.async_save), barrier_timeout_s=60)

    def emit(ev):
        print(json.dumps(ev), flush=True)

    rank = dist.rank if dist else 0
    try:
        emit(train(cfg, dist=dist, emit=emit, pause_at=a.pause_at,
                   fail_rank_state=(a.fail_rank_state == rank)))
    finally:
        if dist is not None:
            dist.close()
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
