"""``get_dist()``: pick and cache the :class:`Dist` for this process."""

from __future__ import annotations

import logging
import os
import threading

import torch
import torch.distributed as tdist

from xla_ckpt.comm.base import Dist
from xla_ckpt.comm.config import DistConfig
from xla_ckpt.comm.single import SingleProcess
from xla_ckpt.comm.torch_dist import TorchDist

logger = logging.getLogger(__name__)

_cache: dict[tuple, Dist] = {}
_lock = threading.Lock()


def _on_tpu() -> bool:
    return os.environ.get("PJRT_DEVICE", "").upper() == "TPU"


def resolve_backend(config: DistConfig) -> str:
    """The concrete backend ``auto`` means here: ``xla``, ``nccl``, ``gloo`` or ``single``.

    * an initialised process group: its backend (``xla`` on a TPU);
    * a launcher's ``WORLD_SIZE`` > 1: ``xla`` on a TPU (``PJRT_DEVICE=TPU``),
      ``nccl`` when CUDA is available, ``gloo`` otherwise;
    * a TPU without launcher variables: ``xla`` (the runtime knows the pod);
    * else ``single``.
    """
    if config.backend != "auto":
        return config.backend
    if tdist.is_available() and tdist.is_initialized():
        if _on_tpu():
            return "xla"
        return "nccl" if str(tdist.get_backend()).lower() == "nccl" else "gloo"
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        if _on_tpu():
            return "xla"
        return "nccl" if torch.cuda.is_available() else "gloo"
    if _on_tpu():
        return "xla"
    return "single"


def get_dist(config: DistConfig | None = None, *, backend: str | None = None) -> Dist:
    """The :class:`Dist` for this process, created on first use and cached.

    Every rank calls it (creating one initialises the process group and its
    gloo control group, which are collectives).

    Args:
        config: backend / init_method / timeout_s (``DistConfig`` defaults when None).
        backend: shorthand that overrides ``config.backend``.

    Raises:
        ConfigError: a bad backend name or environment.
        CollectiveTimeoutError: the rendezvous did not complete in time.
    """
    cfg = config or DistConfig()
    if backend is not None:
        # ``backend`` is any string (a command line, the environment): DistConfig checks it.
        cfg = DistConfig(backend=backend,  # type: ignore[arg-type]  # a str, checked at run time
                         init_method=cfg.init_method, timeout_s=cfg.timeout_s)
    kind = resolve_backend(cfg)
    key = (kind, cfg.init_method, cfg.timeout_s)
    with _lock:
        d = _cache.get(key)
        if d is not None:
            return d
        if kind == "single":
            d = SingleProcess(timeout_s=cfg.timeout_s)
        elif kind == "xla":
            from xla_ckpt.comm.xla_dist import XlaDist  # noqa: PLC0415 - imports torch_xla

            init = None if cfg.init_method == "env://" else cfg.init_method
            d = XlaDist(init_method=init, timeout_s=cfg.timeout_s)
        else:
            d = TorchDist(backend=kind, init_method=cfg.init_method, timeout_s=cfg.timeout_s)
        logger.info("rank %d: using %r", d.rank, d)
        _cache[key] = d
        return d
