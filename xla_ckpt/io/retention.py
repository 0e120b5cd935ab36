"""Retention policy: which checkpoints of a run folder may be deleted.  Pure; no I/O.

fairseq semantics (``checkpoint_utils.save_checkpoint``): keep the newest
``keep_last`` committed checkpoints (``keep_interval_updates``) and the
``keep_best`` best by a metric (``keep_best_checkpoints`` with
``maximize_best_checkpoint_metric``).  Added safety: never delete a checkpoint
named by a pointer, one in ``protect`` (e.g. the one being restored), the
newest committed one, or anything when nothing is committed; incomplete
folders only when asked (one may be a save in flight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from xla_ckpt.errors import ConfigError
from xla_ckpt.io.catalog import CheckpointEntry


@dataclass(kw_only=True)
class RetentionPolicy:
    """How many checkpoints to keep.  ``-1``/None means "keep all" for that rule.

    Attributes:
        keep_last: newest committed checkpoints to keep (fairseq ``keep_interval_updates``).
        keep_best: best committed checkpoints to keep by ``metric`` (``keep_best_checkpoints``).
        metric: metadata key holding the metric value (e.g. ``"loss"``).
        maximize: higher metric is better (``maximize_best_checkpoint_metric``).
    """

    keep_last: int = -1
    keep_best: int = -1
    metric: str = "loss"
    maximize: bool = False

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_best"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < -1:
                raise ConfigError(f"retention.{name} must be an integer >= -1, got {v!r}")


def metric_value(entry: CheckpointEntry, metric: str) -> float | None:
    md = entry.metadata if isinstance(entry.metadata, dict) else {}
    v = md.get(metric)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        return None
    return float(v)


def best_entries(entries: Iterable[CheckpointEntry], metric: str, maximize: bool,
                 n: int) -> list[CheckpointEntry]:
    """The ``n`` best committed entries by ``metric`` (ties: newer first)."""
    sign = -1.0 if maximize else 1.0
    scored: list[tuple[float, int, CheckpointEntry]] = []  # (signed score, -position, entry)
    for i, e in enumerate(entries):
        v = metric_value(e, metric) if e.committed else None
        if v is not None:
            scored.append((sign * v, -i, e))
    scored.sort(key=lambda t: (t[0], t[1]))
    return [e for _, _, e in scored[:n]]


def plan_deletions(entries: list[CheckpointEntry], policy: RetentionPolicy,
                   protect: Iterable[str] = (), *, delete_incomplete: bool = False) -> list[str]:
    """Names of checkpoint folders that ``policy`` allows deleting, oldest first.

    ``entries`` is :func:`xla_ckpt.io.catalog.list_checkpoints` output (oldest first).
    Incomplete folders are only returned with ``delete_incomplete=True`` (one of
    them may be a save in flight; only an operator or the saver knows).
    """
    committed = [e for e in entries if e.committed]
    if not committed:
        return []
    keep = set(protect) | {committed[-1].name}
    if policy.keep_last == -1 and policy.keep_best == -1:
        keep |= {e.name for e in committed}
    else:
        if policy.keep_last == -1:
            keep |= {e.name for e in committed}
        elif policy.keep_last > 0:
            keep |= {e.name for e in committed[-policy.keep_last:]}
        if policy.keep_best == -1:
            keep |= {e.name for e in committed if metric_value(e, policy.metric) is not None}
        elif policy.keep_best > 0:
            keep |= {e.name for e in best_entries(committed, policy.metric, policy.maximize,
                                                   policy.keep_best)}
    return [e.name for e in entries
            if e.name not in keep and (e.committed or delete_incomplete)]
