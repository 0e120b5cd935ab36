"""A small real training loop driven by CheckpointManager (run as a script, in a worker pool,
or in-process).

Linear(4, 3) + Adam, deterministic batches per (epoch, step, rank), gradients
averaged over the gloo group of :func:`xla_ckpt.comm.get_dist` when the world
has more than one rank.  The replicated state is the model, the optimizer and
the loop position; each rank also saves its own ``rank_state`` (its losses).

Events go to ``<events_dir>/events-<rank>.jsonl``, one JSON object a line::

    {"event": "resumed", "n": 7, "checkpoint": "checkpoint_1_7"}
    {"event": "update", "n": 8, "w": "<hex of weight bytes>", "b": "<hex>", "loss": 0.5}
    {"event": "done", "n": 12, "w": ..., "b": ...}

With ``pause_at=N`` every rank writes ``<events_dir>/paused-<rank>`` (holding its
pid) after update N and waits for ``<events_dir>/go`` before reaching the update
boundary; the test sends SIGTERM in between.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

torch.set_num_threads(1)

UPDATES_PER_EPOCH = 6
MAX_EPOCH = 2
TOTAL = UPDATES_PER_EPOCH * MAX_EPOCH


def hexof(t: torch.Tensor) -> str:
    return t.detach().contiguous().numpy().tobytes().hex()


def batch(epoch: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(epoch * 10_000 + step * 100 + rank)
    return torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)


def make_cfg(save_dir: str, *, async_save: bool = True):
    from xla_ckpt.manager import CheckpointConfig

    return CheckpointConfig(save_dir=save_dir, save_interval_updates=4, keep_interval_updates=1,
                            keep_last_epochs=1, keep_best_checkpoints=1,
                            async_save=async_save)


def _wait_for(path: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.01)


def train(cfg, events_dir: str, *, dist=None, pause_at: int = 0,
          fail_rank_state_on: int = -1) -> None:
    """Train MAX_EPOCH epochs of UPDATES_PER_EPOCH updates; resume from cfg.save_dir if possible."""
    from xla_ckpt.manager import CheckpointManager

    rank = dist.rank if dist is not None else 0
    world = dist.world_size if dist is not None else 1
    out = open(os.path.join(events_dir, f"events-{rank}.jsonl"), "a")

    def emit(ev: dict) -> None:
        out.write(json.dumps(ev) + "\n")
        out.flush()

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    epoch, step, num_updates, losses = 1, 0, 0, []
    with out, CheckpointManager(cfg, dist=dist) as mgr:
        resumed = mgr.restore_or_initialize()
        if resumed is not None:
            model.load_state_dict(resumed.state["model"])
            opt.load_state_dict(resumed.state["optimizer"])
            epoch, step = resumed.state["epoch"], resumed.state["step"]
            num_updates = resumed.state["num_updates"]
            assert resumed.rank_state["rank"] == rank
            assert resumed.rank_state["num_updates"] == num_updates
            losses = list(resumed.rank_state["losses"])
            if step == UPDATES_PER_EPOCH:
                epoch, step = epoch + 1, 0
            emit({"event": "resumed", "n": num_updates, "checkpoint": resumed.checkpoint})

        def state():
            return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                    "step": step, "num_updates": num_updates}

        def rank_state():
            if rank == fail_rank_state_on:
                return {"bad": object()}
            return {"rank": rank, "num_updates": num_updates, "losses": list(losses)}

        while epoch <= MAX_EPOCH:
            while step < UPDATES_PER_EPOCH:
                x, y = batch(epoch, step, rank)
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                if world > 1:
                    for p in model.parameters():
                        assert p.grad is not None  # backward() filled it
                        torch.distributed.all_reduce(p.grad)
                        p.grad /= world
                opt.step()
                step += 1
                num_updates += 1
                losses.append(loss.item())
                emit({"event": "update", "n": num_updates, "w": hexof(model.weight),
                      "b": hexof(model.bias), "loss": losses[-1]})
                if num_updates == pause_at:
                    with open(os.path.join(events_dir, f"paused-{rank}"), "w") as f:
                        f.write(str(os.getpid()))
                    _wait_for(os.path.join(events_dir, "go"))
                end = step == UPDATES_PER_EPOCH
                mgr.after_update(epoch=epoch, num_updates=num_updates, end_of_epoch=end,
                                 state=state, rank_state=rank_state,
                                 metrics={"loss": losses[-1]} if end else None)
            epoch, step = epoch + 1, 0
        emit({"event": "done", "n": num_updates, "w": hexof(model.weight),
              "b": hexof(model.bias)})


def run_rank(save_dir: str, events_dir: str, pause_at: int = 0,
             fail_rank_state_on: int = -1) -> None:
    """Entry point for a launcher worker (xla_ckpt.testing.launcher): one rank of the job."""
    from xla_ckpt.comm import DistConfig, get_dist

    dist = get_dist(DistConfig(backend="gloo", timeout_s=60))
    train(make_cfg(save_dir), events_dir, dist=dist, pause_at=pause_at,
          fail_rank_state_on=fail_rank_state_on)


def reference() -> dict:
    """The uninterrupted single-process run, in this process, without a manager.

    Returns ``{"updates": {n: (weight_hex, bias_hex)}, "losses": [...]}``: bitwise what
    :func:`train` computes in one process.
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    updates, losses = {}, []
    for epoch in range(1, MAX_EPOCH + 1):
        for step in range(UPDATES_PER_EPOCH):
            x, y = batch(epoch, step, 0)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            updates[len(losses)] = (hexof(model.weight), hexof(model.bias))
    return {"updates": updates, "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save-dir", required=True)
    ap.add_argument("--events-dir", required=True)
    ap.add_argument("--pause-at", type=int, default=0)
    a = ap.parse_args()
    train(make_cfg(a.save_dir), a.events_dir, pause_at=a.pause_at)


if __name__ == "__main__":
    main()
