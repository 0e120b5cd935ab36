"""An evaluator polling a run folder while a trainer saves there (CASES C25), as a real process.

``python evaluator_worker.py --run RUN --kind manager|checkpointer``: reads one command a line
from stdin and answers one JSON line on stdout:

* ``round <prev step>``: restore what the run holds, the ways an evaluator does, and report
  what each got: ``manager``: one long-lived ``CheckpointManager`` with a default config
  (``latest_step``, ``all_steps``, ``restore()``, ``restore(step=<prev step>)``,
  ``restore(keys=["model"])``) and a fresh one each round (``restore_or_initialize()``);
  ``checkpointer``: the trainer's ``Checkpointer.load_checkpoint(RUN)``, and
  ``xla_ckpt.load`` of the run folder and of ``checkpoint_last``;
* ``quit``: close and exit 0.

Nothing here saves: the test checks that the trainer was never fenced and that the run
folder's lease is still the trainer's.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import xla_ckpt
from xla_ckpt.manager import CheckpointConfig, CheckpointManager
from xla_ckpt.trainer import Checkpointer


def weight(state: dict) -> list[float]:
    """The model weight of a Checkpointer state (``model.weight``), flat."""
    return [float(x) for x in state["model"]["weight"].flatten()]


def manager_round(mgr: CheckpointManager, run: str, prev: int) -> dict:
    latest = mgr.latest_step()
    r_latest = mgr.restore()
    r_step = mgr.restore(step=prev)
    r_keys = mgr.restore(keys=["model"])
    with CheckpointManager(CheckpointConfig(save_dir=run)) as fresh:  # a default config
        r_init = fresh.restore_or_initialize()
    assert r_init is not None
    return {"latest_step": latest, "all_steps": mgr.all_steps(),
            "latest": [r_latest.num_updates, weight(r_latest.state)],
            "step": [r_step.num_updates, weight(r_step.state)],
            "keys": [r_keys.num_updates, sorted(r_keys.state), weight(r_keys.state)],
            "init": [r_init.num_updates, weight(r_init.state)]}


def checkpointer_round(run: str) -> dict:
    model = torch.nn.Linear(2, 2)
    ckpt = Checkpointer(model=model, build_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    extra = ckpt.load_checkpoint(run)
    assert extra is not None
    return {"checkpointer": [ckpt.get_num_updates(),
                             [float(x) for x in model.weight.detach().flatten()]],
            "load": weight(xla_ckpt.load(run)),
            "load_last": weight(xla_ckpt.load(f"{run}/checkpoint_last"))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run", required=True)
    p.add_argument("--kind", choices=("manager", "checkpointer"), required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    mgr = CheckpointManager(CheckpointConfig(save_dir=a.run)) if a.kind == "manager" else None
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        try:
            if mgr is not None:
                out = manager_round(mgr, a.run, int(cmd[1]))
            else:
                out = checkpointer_round(a.run)
        except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)
    if mgr is not None:
        mgr.close()


if __name__ == "__main__":
    main()
