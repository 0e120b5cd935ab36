"""Which checkpoint is "best": the config's metric, or a ``best_fn`` (Orbax ``best_fn``).

Built in (fairseq ``best_checkpoint_metric`` / ``maximize_best_checkpoint_metric``): the
score of a checkpoint is the number its metadata records under
``config.best_checkpoint_metric``; lower is better unless ``maximize``.

With ``best_fn`` (:class:`~xla_ckpt.manager.CheckpointManager` ``best_fn=`` /
``best_mode=``): the score is ``best_fn(metrics)``, where ``metrics`` is the dict of
metrics the checkpoint was saved with (its metadata less the keys the manager writes,
:data:`RESERVED_METADATA`).  A checkpoint saved without metrics has no score (``best_fn``
is not called, as in Orbax); ``best_fn`` returning None or a non-finite number means no
score either.  ``best_mode`` ``"min"`` or ``"max"``; by default the config's
``maximize_best_checkpoint_metric`` decides (False: ``"min"``, as fairseq).

The score picks the ``checkpoint_best`` pointer's target (ties go to the newer checkpoint,
as fairseq) and the ``keep_best_checkpoints`` survivors of rotation; a checkpoint without
a score is never "best".  Pure: no I/O.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, SupportsFloat

from xla_ckpt.errors import ConfigError
from xla_ckpt.manager.config import CheckpointConfig
from xla_ckpt.run.catalog import LEASE_EPOCH_KEY, CheckpointEntry
from xla_ckpt.run.retention import best_entries

logger = logging.getLogger(__name__)

#: Metadata keys the manager writes; metric names must differ from these.
RESERVED_METADATA = ("epoch", "num_updates", "end_of_epoch", "preempted", "world_size",
                     LEASE_EPOCH_KEY)

BestFn = Callable[[dict[str, float]], "SupportsFloat | None"]
"""``best_fn(metrics) -> score``: ``metrics`` maps metric names to floats."""

BestMode = Literal["min", "max"]


def metrics_of(metadata: Any) -> dict[str, float]:
    """The metrics a checkpoint was saved with: its metadata less :data:`RESERVED_METADATA`."""
    if not isinstance(metadata, Mapping):
        return {}
    return {k: v for k, v in metadata.items() if k not in RESERVED_METADATA}


def _number(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v.item() if hasattr(v, "item") else v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


@dataclass(frozen=True)
class BestScore:
    """How checkpoints are ranked (module docstring).

    Attributes:
        metric: ``config.best_checkpoint_metric`` (the built-in score's metadata key).
        maximize: higher scores are better.
        fn: the ``best_fn``, or None for the built-in score.
    """

    metric: str
    maximize: bool
    fn: BestFn | None = None

    @classmethod
    def from_config(cls, cfg: CheckpointConfig, fn: BestFn | None = None,
                    mode: str | None = None) -> BestScore:
        """The ranking by ``fn`` (None: ``cfg.best_checkpoint_metric``) in ``mode`` (None:
        ``"max"`` if ``cfg.maximize_best_checkpoint_metric`` else ``"min"``).

        Raises:
            ConfigError: ``fn`` is not callable, or ``mode`` is not ``"min"``/``"max"``.
        """
        if fn is not None and not callable(fn):
            raise ConfigError(f"best_fn must be a callable metrics -> float, got {fn!r}")
        if mode is not None and mode not in ("min", "max"):
            raise ConfigError(f"best_mode must be 'min' or 'max', got {mode!r}")
        maximize = cfg.maximize_best_checkpoint_metric if mode is None else mode == "max"
        return cls(cfg.best_checkpoint_metric, maximize, fn)

    @property
    def label(self) -> str:
        """What the ``checkpoint_best`` pointer records as its ``metric``."""
        if self.fn is None:
            return self.metric
        return "best_fn:" + str(getattr(self.fn, "__qualname__", type(self.fn).__name__))

    def score(self, metadata: Any) -> float | None:
        """The score of a checkpoint with this metadata, or None when it has none.

        Raises:
            Exception: whatever ``best_fn`` raised (the caller says which checkpoint).
        """
        if self.fn is None:
            md = metadata if isinstance(metadata, Mapping) else {}
            return _number(md.get(self.metric))
        metrics = metrics_of(metadata)
        if not metrics:
            return None
        return _number(self.fn(dict(metrics)))

    def score_entry(self, entry: CheckpointEntry) -> float | None:
        """:meth:`score` of a committed checkpoint of the run folder; ``best_fn`` raising
        counts as no score (logged at WARNING: e.g. saved before that metric existed)."""
        if not entry.committed:
            return None
        try:
            return self.score(entry.metadata)
        except Exception as e:  # noqa: BLE001 - the user's function; said, then unscored
            logger.warning("best_fn raised on the metrics of %s (%s: %s); it has no score",
                           entry.name, type(e).__name__, e)
            return None

    def better(self, value: float, best: float | None) -> bool:
        """``value`` beats (or ties, fairseq: the newer wins) the best so far."""
        if best is None:
            return True
        return value >= best if self.maximize else value <= best

    def best_entries(self, entries: Iterable[CheckpointEntry], n: int) -> list[CheckpointEntry]:
        """The ``n`` best committed entries (ties: newer first), best first."""
        entries = list(entries)
        if self.fn is None:
            return best_entries(entries, self.metric, self.maximize, n)
        sign = -1.0 if self.maximize else 1.0
        scored = []
        for i, e in enumerate(entries):
            v = self.score_entry(e)
            if v is not None:
                scored.append((sign * v, -i, e))
        scored.sort(key=lambda t: (t[0], t[1]))
        return [e for _, _, e in scored[:n]]
