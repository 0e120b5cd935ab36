"""Functions the multi-rank manager tests run on every rank (xla_ckpt.testing.launcher workers),
and the stale incarnation of the fencing tests (also run as a script: ``python
manager_workers.py --run RUN --events-dir DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

FLAT = torch.arange(10, dtype=torch.float32) * 1.5 + 0.25
PIECES = [(0, 1), (1, 5), (5, 5), (5, 10)]  # rank r owns FLAT[lo:hi] (uneven, one empty)


def save_zero_shards(run_dir: str) -> str:
    """Every rank saves its piece of FLAT (async) plus private state; returns the checkpoint."""
    from xla_ckpt.comm import DistConfig, get_dist
    from xla_ckpt.manager import CheckpointConfig, CheckpointManager

    dist = get_dist(DistConfig(backend="gloo", timeout_s=60))
    lo, hi = PIECES[dist.rank]
    piece = FLAT[lo:hi].clone()
    cfg = CheckpointConfig(save_dir=run_dir, save_interval_updates=2, async_save=True,
                           handle_sigterm=False)
    with CheckpointManager(cfg, dist=dist) as mgr:
        for n in (1, 2):
            res = mgr.after_update(epoch=1, num_updates=n, state={"step": n},
                                   rank_state={"rank": dist.rank},
                                   shards=lambda: {"exp_avg": piece})
        piece.fill_(-1.0)  # changed after staging: the checkpoint keeps the staged values
    assert res.saved is not None
    return res.saved


def restore_zero_shards(run_dir: str, zero_sharding: str) -> dict:
    """Restore through the manager with the given ZeRO mode; returns what this rank got."""
    from xla_ckpt.comm import DistConfig, get_dist
    from xla_ckpt.manager import CheckpointConfig, CheckpointManager
    from xla_ckpt.restore import RestoreConfig

    dist = get_dist(DistConfig(backend="gloo", timeout_s=60))
    cfg = CheckpointConfig(save_dir=run_dir, handle_sigterm=False)
    with CheckpointManager(cfg, dist=dist,
                           restore_config=RestoreConfig(zero_sharding=zero_sharding)) as mgr:
        r = mgr.restore_or_initialize()
    assert r is not None and r.restored is not None
    return {"checkpoint": r.checkpoint, "state": r.state, "rank_state": r.rank_state,
            "exp_avg": r.restored.shards["exp_avg"].tolist(),
            "bounds": list(r.restored.shard_bounds["exp_avg"])}


# ---- the stale incarnation of the fencing tests (test_fencing.py) -------------------------------
#
# :func:`predecessor` restores (taking lease epoch 1 in a fresh run folder), saves
# ``checkpoint_1_10``, then -- once ``<events>/go-save`` exists -- starts an async save of
# ``checkpoint_1_15`` whose upload stops until ``<events>/go-upload`` exists (writing
# ``<events>/uploading-<rank>`` there: the job is mid-save).  In one process it stops after
# the replicated state file, before its own rank file; on a multi-rank job (whose ranks write
# no per-rank state, so that a one-process successor can restore it) rank 0 stops before the
# state file and the other ranks wait for it.  Then it waits for that save (``wait()``),
# tries one more save (``checkpoint_1_16``) and reports both outcomes in
# ``<events>/outcome-<rank>.json``.

KEEP_LAST = 1


def state_at(n: int) -> dict:
    g = torch.Generator().manual_seed(n)
    return {"model": {"w": torch.randn(64, 16, generator=g)}, "num_updates": n}


def _wait_for(path: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.01)


def _touch(path: str, text: str = "") -> None:
    with open(path, "w") as f:
        f.write(text)


def holding(st, folder: str, events_dir: str, rank: int, *, held_state: bool = False):
    """``st`` (any backend), whose data-file writes holding a ``rank/<r>`` item (every data
    file with ``held_state``) into checkpoint folder ``folder`` wait for
    ``<events>/go-upload``; its child storages too.  A writer's items share one data file
    (:func:`xla_ckpt.io.writer.write_items`): rank 0's rank item is in its ``-state`` file."""
    base = type(st)

    class Held(base):  # type: ignore[misc, valid-type]  # a subclass of the backend's class
        def write_atomic(self, name, buffers, **kw):
            if self.uri.rstrip("/").endswith("/" + folder) and name.startswith("data-") \
                    and ("-rank-" in name or held_state or (rank == 0 and "-state" in name)):
                _touch(os.path.join(events_dir, f"uploading-{rank}"), str(os.getpid()))
                _wait_for(os.path.join(events_dir, "go-upload"))
            return super().write_atomic(name, buffers, **kw)

        def child(self, prefix):
            c = super().child(prefix)
            c.__class__ = Held
            return c

    st.__class__ = Held
    return st


def _outcome(fn) -> dict:
    from xla_ckpt.errors import FencedError

    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
        out = {"ok": False, "error": type(e).__name__, "message": str(e)}
        if isinstance(e, FencedError):
            out.update(own_epoch=e.own_epoch, current_epoch=e.current_epoch, run=e.run)
        return out
    return {"ok": True}


def _objects(run) -> list[str]:
    return sorted(run.list(""))


def predecessor(run_uri: str, events_dir: str, dist=None) -> dict:
    """The stale incarnation (see the module docstring); returns this rank's outcome too."""
    from xla_ckpt.manager import CheckpointConfig, CheckpointManager
    from xla_ckpt.storage import open_storage

    rank = dist.rank if dist is not None else 0
    # Per-rank state only in one process: the successor (one process) restores it then.
    mine = {"rank": rank} if dist is None or dist.world_size == 1 else None
    cfg = CheckpointConfig(save_dir=run_uri, save_interval_epochs=0, async_save=True,
                           keep_interval_updates=KEEP_LAST, handle_sigterm=False)
    run = holding(open_storage(run_uri), "checkpoint_1_15", events_dir, rank,
                  held_state=mine is None)
    out: dict = {"rank": rank}
    with CheckpointManager(cfg, dist=dist, storage=run) as mgr:
        assert mgr.restore_or_initialize() is None
        mgr.save(state_at(10), epoch=1, num_updates=10, rank_state=mine, block=True)
        _touch(os.path.join(events_dir, f"ready-{rank}"))
        _wait_for(os.path.join(events_dir, "go-save"))
        mgr.save(state_at(15), epoch=1, num_updates=15, rank_state=mine, block=False)
        out["saved_15"] = _outcome(mgr.wait)
        before = _objects(run)
        out["saved_16"] = _outcome(lambda: mgr.save(state_at(16), epoch=1, num_updates=16,
                                                    rank_state=mine, block=True))
        out["written_by_16"] = sorted(set(_objects(run)) ^ set(before))
    run.close()
    with open(os.path.join(events_dir, f"outcome-{rank}.json"), "w") as f:
        json.dump(out, f)
    return out


def predecessor_rank(run_uri: str, events_dir: str) -> dict:
    """Entry point for a launcher worker: one rank of the stale job."""
    from xla_ckpt.comm import DistConfig, get_dist

    return predecessor(run_uri, events_dir, get_dist(DistConfig(backend="gloo", timeout_s=60)))


def main() -> None:
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--events-dir", required=True)
    a = ap.parse_args()
    predecessor(a.run, a.events_dir)


if __name__ == "__main__":
    main()
