"""Retention policy: which checkpoints of a run folder may be deleted.  Pure; no I/O.

fairseq semantics (``checkpoint_utils.save_checkpoint``): keep the newest
``keep_last`` committed checkpoints (``keep_interval_updates``) and the
``keep_best`` best by a metric (``keep_best_checkpoints`` with
``maximize_best_checkpoint_metric``).  Added safety: never delete a checkpoint
named by a pointer, one in ``protect`` (e.g. the one being restored), the
newest committed one, or anything when nothing is committed; incomplete
folders only when asked (one may be a save in flight).

What this library provably wrote (:func:`library_object`, :func:`owned_in_flight`) and
the grace-period rule for in-flight objects (:class:`InFlightUpload`) live here too:
cleanup deletes nothing else.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable

from xla_ckpt.errors import ConfigError
from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.io.names import DATA_PREFIX
from xla_ckpt.run.catalog import POINTERS, CheckpointEntry, pointer_name
from xla_ckpt.storage.base import InFlightObject

DEFAULT_IN_FLIGHT_GRACE_S = 3600.0
"""Seconds: an interrupted write's in-flight objects are listed as left over and collected
only once the newest of them is at least this old (a live save keeps adding parts)."""

_DATA_FILE = re.compile(re.escape(DATA_PREFIX) + r"[0-9a-f]{12}-[^/]+\.safetensors")
_POINTER_FILES = frozenset(pointer_name(w) for w in POINTERS)


def library_object(name: str) -> bool:
    """True for a name this library's saves write in a run folder (relative to it).

    A pointer (``checkpoint_last.json``/``checkpoint_best.json``) at the top, or a
    manifest or data file (``data-<save id>-<item>.safetensors``) directly inside a
    checkpoint folder.  Anything else (a ``.pt``, a DCP folder, a nested folder copied
    in from another run) is not ours, and cleanup leaves it alone.
    """
    parts = name.strip("/").split("/")
    if len(parts) == 1:
        return parts[0] in _POINTER_FILES
    return len(parts) == 2 and (parts[1] == MANIFEST_NAME or bool(_DATA_FILE.fullmatch(parts[1])))


def owned_in_flight(obj: InFlightObject) -> bool:
    """An in-flight object of this library's own save in this run folder: the backend found
    its in-flight mark (``.tmp-<upload id>-part-<n>``) and the write's target is one of
    :func:`library_object`'s names."""
    return library_object(obj.target)


@dataclass(frozen=True)
class InFlightUpload:
    """The in-flight objects one unfinished write left (one target, one upload id).

    The grace-period rule is per write: it may be collected only when its *newest*
    object is at least ``grace_s`` old (by the store's creation times against the store's
    own current time, :meth:`Storage.now_unix_s <xla_ckpt.storage.base.Storage.now_unix_s>`:
    a skewed host clock neither deletes early nor never), so no part of a write still
    producing parts is ever deleted; an object without a creation time is never collected.
    """

    target: str
    upload_id: str
    objects: tuple[InFlightObject, ...]

    @property
    def nbytes(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def folder(self) -> str:
        """The checkpoint folder it was written into ("" at the top of the run folder)."""
        return self.target.split("/", 1)[0] if "/" in self.target else ""

    def age_s(self, now: float) -> float | None:
        """Seconds since its newest object was created; None when a creation time is unknown."""
        times = [o.created_unix_s for o in self.objects]
        if not times or any(t is None for t in times):
            return None
        return now - max(t for t in times if t is not None)

    def stale(self, grace_s: float, now: float) -> bool:
        age = self.age_s(now)
        return age is not None and age >= grace_s


def check_grace(grace_s: float) -> float:
    """``grace_s`` as a float; ConfigError unless a finite number >= 0."""
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) \
            or not math.isfinite(grace_s) or grace_s < 0:
        raise ConfigError(f"the in-flight grace period must be a number of seconds >= 0, got "
                          f"{grace_s!r}")
    return float(grace_s)


def group_in_flight(objects: Iterable[InFlightObject]
                    ) -> tuple[list[InFlightUpload], list[InFlightObject]]:
    """Owned in-flight objects grouped by write (sorted by target), and the others (not ours)."""
    groups: dict[tuple[str, str], list[InFlightObject]] = {}
    foreign: list[InFlightObject] = []
    for o in objects:
        if owned_in_flight(o):
            groups.setdefault((o.target, o.upload_id), []).append(o)
        else:
            foreign.append(o)
    uploads = [InFlightUpload(t, u, tuple(sorted(objs, key=lambda o: o.name)))
               for (t, u), objs in sorted(groups.items())]
    return uploads, foreign


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

    ``entries`` is :func:`xla_ckpt.run.catalog.list_checkpoints` output (oldest first).
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
