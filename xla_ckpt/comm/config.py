"""The control plane's config section: how processes find each other (``dist:`` in YAML)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from xla_ckpt.checks import check_choice, check_number
from xla_ckpt.errors import ConfigError

DIST_BACKENDS = ("auto", "single", "gloo", "nccl", "xla")


@dataclass(kw_only=True)
class DistConfig:
    """How processes find each other (the control plane; DESIGN decision 1).

    Attributes:
        backend: ``auto`` (xla on TPU, nccl with CUDA, gloo otherwise, single when
            ``WORLD_SIZE`` is unset), or one of ``single``, ``gloo``, ``nccl``, ``xla``.
        init_method: ``env://`` (torchrun / the demo launcher), ``xla://`` (TPU runtime),
            ``tcp://host:port`` or ``file:///shared/path``.
        timeout_s: process-group timeout, seconds; every barrier and collective
            gives up after it.

    Raises:
        ConfigError: an unknown backend, an ``init_method`` of another scheme, or a
            ``timeout_s`` that is not a number > 0 (names ``dist.<field>`` and the value).
    """

    backend: Literal["auto", "single", "gloo", "nccl", "xla"] = "auto"
    init_method: str = "env://"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        check_choice("dist", "backend", self.backend, DIST_BACKENDS)
        if not isinstance(self.init_method, str) or not re.match(r"^(env|xla|tcp|file)://",
                                                                  self.init_method):
            raise ConfigError("dist.init_method must start with env://, xla://, tcp:// or "
                              f"file://, got {self.init_method!r}")
        check_number("dist", "timeout_s", self.timeout_s)
