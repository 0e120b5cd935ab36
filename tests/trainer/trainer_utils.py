"""A tiny but complete training set-up shared by the trainer tests and their fresh-process worker.

Everything is deterministic given the seeds: the same calls in two processes
give bitwise the same tensors (one CPU thread).
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from xla_ckpt.trainer import Checkpointer, CheckpointerConfig, Metrics
from xla_ckpt.trainer.restore_checks import NOTHING_RESTORED, ends

D_MODEL = 16
SEQ = 5
BATCH = 4
BETAS = (0.85, 0.97)
LR = 1e-3
WARMUP = 3


class TinyTransformer(torch.nn.Module):
    """Two-layer transformer encoder with dropout and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(D_MODEL, nhead=2, dim_feedforward=32, dropout=0.1,
                                                 batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


class TemperatureMSE(torch.nn.Module):
    """A criterion with a learnable parameter (fairseq criteria may have some)."""

    def __init__(self) -> None:
        super().__init__()
        self.log_temperature = torch.nn.Parameter(torch.zeros(()))

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean() * torch.exp(self.log_temperature)


def inverse_sqrt(step: int) -> float:
    """LambdaLR factor: linear warm-up over WARMUP steps, then 1/sqrt decay."""
    step = max(step, 1)
    return step / WARMUP if step < WARMUP else math.sqrt(WARMUP / step)


def build_adamw(params):
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=0.05, eps=1e-7)


def build_lambda_lr(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt)


def make_args() -> argparse.Namespace:
    return argparse.Namespace(arch="tiny_transformer", lr=[LR], betas=BETAS, seed=np.int64(1),
                              clip_norm=np.float32(0.5), max_epoch=None, fp16=False,
                              layers={"encoder": 2, "decoder": 0})


def batch(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=g)
    y = torch.randn(BATCH, SEQ, D_MODEL, generator=g)
    return x.to(device), y.to(device)


def make_checkpointer(seed: int, **kwargs) -> Checkpointer:
    torch.manual_seed(seed)
    model = TinyTransformer()
    criterion = TemperatureMSE()
    return Checkpointer(model=model, criterion=criterion, build_optimizer=build_adamw,
                        build_lr_scheduler=kwargs.pop("build_lr_scheduler", build_lambda_lr),
                        metrics=kwargs.pop("metrics", Metrics()),
                        args=make_args(), cfg={"task": "denoise", "update_freq": (1,)},
                        config=kwargs.pop("config", CheckpointerConfig()), **kwargs)


def train_step(ckpt: Checkpointer, step: int) -> float:
    """One update: forward, backward, AdamW step, scheduler step, meters, num_updates + 1."""
    model, criterion = ckpt.model, ckpt.criterion
    assert criterion is not None
    model.train()
    x, y = batch(step)
    ckpt.optimizer.zero_grad()
    with ckpt.metrics.aggregate("train"):
        ckpt.metrics.log_start_time("train_wall", priority=800)
        loss = criterion(model(x), y)
        loss.backward()
        ckpt.optimizer.step()
        ckpt.lr_scheduler.step()
        ckpt.metrics.log_scalar("loss", loss.detach(), weight=BATCH)
        ckpt.metrics.log_scalar("bsz", np.float64(BATCH), priority=190)
        ckpt.metrics.log_speed("wps", BATCH * SEQ, priority=90)
        ckpt.metrics.log_stop_time("train_wall")
    ckpt.set_num_updates(ckpt.get_num_updates() + 1)
    return float(loss.detach())


def training_part(ckpt: Checkpointer) -> dict:
    """The parts of a training state that must match bitwise after one more step."""
    sd = ckpt.state_dict()
    return {"model": sd["model"], "criterion": sd["criterion"],
            "last_optimizer_state": sd["last_optimizer_state"],
            "lr_scheduler_state": sd["optimizer_history"][-1]["lr_scheduler_state"],
            "num_updates": sd["optimizer_history"][-1]["num_updates"]}


def refused(message: str) -> str:
    """The text of a restore refused before anything was loaded (issue 25 defect 5)."""
    return ends(message, NOTHING_RESTORED)
