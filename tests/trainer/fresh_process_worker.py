"""Runs one side of a fresh-process round trip; the tests start it with subprocess.

    python fresh_process_worker.py restore-tiny <checkpoint> <out>
    python fresh_process_worker.py xla-train    <checkpoint> <out>
    python fresh_process_worker.py xla-restore  <checkpoint> <out>

Results are written with ``xla_ckpt.save`` to ``<out>`` for the test to compare.
"""

from __future__ import annotations

import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trainer_utils import make_checkpointer, train_step, training_part  # noqa: E402 - sys.path set

import xla_ckpt  # noqa: E402 - after the set-up above
from xla_ckpt.trainer import Checkpointer  # noqa: E402 - after the set-up above


def restore_tiny(ckpt_uri: str, out: str) -> None:
    """Restore the tiny transformer's training state into other weights, take one step."""
    ckpt = make_checkpointer(seed=7)
    extra = ckpt.load_checkpoint(ckpt_uri)
    wps = ckpt.metrics.get_meter("train", "wps")
    wps_after_restore = (wps.init, wps.n)
    torch.set_rng_state(extra["rng"])  # dropout continues where the saver stopped
    train_step(ckpt, 3)
    xla_ckpt.save({"raw": xla_ckpt.load(ckpt_uri), "extra": extra, "after": training_part(ckpt),
                   "wps_after_restore": wps_after_restore, "lr": ckpt.get_lr()}, out)


def _adam(params):
    return torch.optim.Adam(params, lr=0.05, betas=(0.8, 0.95))


def _linear_step(model: torch.nn.Linear, optimizer: torch.optim.Optimizer, k: int) -> None:
    g = torch.Generator().manual_seed(k)
    x = torch.randn(3, 2, generator=g).to(model.weight.device)
    optimizer.zero_grad()
    model(x).pow(2).sum().backward()
    optimizer.step()
    import torch_xla

    torch_xla.sync()


def _linear_part(ckpt: Checkpointer) -> dict:
    sd = ckpt.state_dict()
    return {"model": sd["model"], "optimizer": sd["last_optimizer_state"]}


def xla_train(ckpt_uri: str, out: str) -> None:
    """C5 reference run on the XLA CPU device: step, save, step again (uninterrupted)."""
    import torch_xla

    dev = torch_xla.device()
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2).to(dev)
    ckpt = Checkpointer(model=model, build_optimizer=_adam)
    _linear_step(model, ckpt.optimizer, 1)
    ckpt.save_checkpoint(ckpt_uri)
    _linear_step(model, ckpt.optimizer, 2)
    xla_ckpt.save({"expected": _linear_part(ckpt)}, out)


def _placement(ckpt: Checkpointer) -> dict:
    opt = ckpt.optimizer
    held = [p for g in opt.param_groups for p in g["params"]]
    live = list(ckpt.model.parameters())
    moments = {}
    for i, p in enumerate(live):
        for name, v in opt.state[p].items():
            moments[f"{i}.{name}"] = (str(v.device), list(v.shape), str(p.device), list(p.shape))
    holds_live = len(held) == len(live) and all(a is b for a, b in zip(held, live, strict=True))
    return {"holds_live": holds_live, "moments": moments}


def xla_restore(ckpt_uri: str, out: str) -> None:
    """C5/C11: restore into a model moved to the XLA device, and into a meta-device model."""
    import torch_xla

    dev = torch_xla.device()
    torch.manual_seed(5)
    model = torch.nn.Linear(2, 2).to(dev)
    ckpt = Checkpointer(model=model, build_optimizer=_adam)
    ckpt.load_checkpoint(ckpt_uri)
    placement = _placement(ckpt)
    _linear_step(model, ckpt.optimizer, 2)

    with torch.device("meta"):
        meta_model = torch.nn.Linear(2, 2)
    meta_ckpt = Checkpointer(model=meta_model, build_optimizer=_adam, device=dev)
    meta_ckpt.load_checkpoint(ckpt_uri)
    meta_placement = _placement(meta_ckpt)
    _linear_step(meta_model, meta_ckpt.optimizer, 2)
    xla_ckpt.save({"after": _linear_part(ckpt), "placement": placement,
                   "after_meta": _linear_part(meta_ckpt), "meta_placement": meta_placement,
                   "meta_device": str(meta_model.weight.device)}, out)


if __name__ == "__main__":
    mode, ckpt_uri, out = sys.argv[1:4]
    {"restore-tiny": restore_tiny, "xla-train": xla_train, "xla-restore": xla_restore}[mode](
        ckpt_uri, out)
