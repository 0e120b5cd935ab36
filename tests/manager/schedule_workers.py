"""Ranks that disagree about the save schedule (issue 25, defect 6): what every rank runs.

:func:`disagree` drives a short ``after_update`` loop on every rank of a real gloo group in
which rank 1 departs from the others in one way (``case``); it returns what this rank
raised and what is committed in the run folder afterwards.
"""

from __future__ import annotations

import logging
import os
import time

import torch

UPDATES = 6


def _committed(run_dir: str) -> list[str]:
    if not os.path.isdir(run_dir):
        return []
    return sorted(n for n in os.listdir(run_dir)
                  if os.path.exists(os.path.join(run_dir, n, "manifest.json")))


def _loop(mgr, rank: int, case: str) -> None:
    w = torch.zeros(4)
    for n in range(1, UPDATES + 1):
        w.fill_(float(n))
        epoch, num_updates, end, metrics = 1, n, False, None
        if case.startswith("plus_one") and rank == 1:
            num_updates = n + 1
        if case.startswith("skip") and rank == 1 and n == 4:
            continue  # rank 1 skips the after_update of the update the schedule saves
        if case == "end_of_epoch" and rank == 1 and n == 3:
            end = True
        if case == "epoch" and rank == 1 and n >= 3:
            epoch = 2
        if case == "metrics" and n == 4:
            metrics = {"loss": torch.tensor(0.25 if rank == 0 else 0.5)}
        if case == "save_vs_wait" and n == 3:
            if rank == 0:
                mgr.save({"w": w}, epoch=1, num_updates=3)
            else:
                mgr.wait()
        mgr.after_update(epoch=epoch, num_updates=num_updates, end_of_epoch=end,
                         state=lambda: {"model": {"w": w}}, rank_state={"rank": rank},
                         metrics=metrics)


def disagree(run_dir: str, case: str, async_save: bool, sync_interval_updates: int) -> dict:
    """Every rank: the loop of ``case`` under ``with CheckpointManager``, then ``close()``."""
    from xla_ckpt.comm import DistConfig, get_dist
    from xla_ckpt.errors import XlaCkptError
    from xla_ckpt.manager import CheckpointConfig, CheckpointManager

    dist = get_dist(DistConfig(backend="gloo", timeout_s=60))
    warnings: list[str] = []
    handler = _Collect(warnings)
    logging.getLogger("xla_ckpt.manager.core").addHandler(handler)
    cfg = CheckpointConfig(save_dir=run_dir, save_interval_updates=2, save_interval_epochs=0,
                           handle_sigterm=False, async_save=async_save,
                           sync_interval_updates=sync_interval_updates)
    out: dict = {"rank": dist.rank, "error": None}
    try:
        with CheckpointManager(cfg, dist=dist) as mgr:
            _loop(mgr, dist.rank, case)
            mgr.close()
    except XlaCkptError as e:
        out.update(error=type(e).__name__, message=str(e),
                   failures={int(k): v for k, v in getattr(e, "failures", {}).items()},
                   positions=dict(getattr(e, "positions", {})))
    except Exception as e:  # noqa: BLE001 - a foreign error: the test fails on it, named
        out.update(error=f"foreign {type(e).__name__}", message=str(e))
    finally:
        logging.getLogger("xla_ckpt.manager.core").removeHandler(handler)
    dist.barrier()  # every rank is done with the run folder
    out["committed"] = _committed(run_dir)
    out["warnings"] = warnings
    if "checkpoint_1_4" in out["committed"]:
        from xla_ckpt.io import CheckpointReader

        reader = CheckpointReader.open(os.path.join(run_dir, "checkpoint_1_4"))
        out["metadata_1_4"] = reader.metadata
    return out


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


def stops_calling(run_dir: str, linger_s: float) -> dict:
    """Rank 1 stops after update 2 (no after_update, no close) and stays alive ``linger_s``;
    rank 0 goes on.  For a pool of its own: the collective that times out breaks the group."""
    from xla_ckpt.comm import DistConfig, get_dist
    from xla_ckpt.errors import XlaCkptError
    from xla_ckpt.manager import CheckpointConfig, CheckpointManager

    dist = get_dist(DistConfig(backend="gloo", timeout_s=4.0))
    cfg = CheckpointConfig(save_dir=run_dir, save_interval_updates=2, save_interval_epochs=0,
                           handle_sigterm=False, async_save=True)
    out: dict = {"rank": dist.rank, "error": None}
    mgr = CheckpointManager(cfg, dist=dist)
    try:
        for n in range(1, UPDATES + 1):
            if dist.rank == 1 and n > 2:
                time.sleep(linger_s)
                break
            mgr.after_update(epoch=1, num_updates=n, state={"w": torch.full((2,), float(n))})
    except XlaCkptError as e:
        out.update(error=type(e).__name__, message=str(e),
                   failures={int(k): v for k, v in getattr(e, "failures", {}).items()})
    if dist.rank == 0:
        try:
            mgr.close()  # the group is broken: its collective fails at once
        except XlaCkptError as e:
            out["close_error"] = type(e).__name__
    return out
