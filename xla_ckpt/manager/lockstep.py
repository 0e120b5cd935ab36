"""Where each rank is when the ranks of a :class:`~xla_ckpt.manager.CheckpointManager` exchange.

Every exchange of the manager (``ManagerBase._exchange``) carries this rank's *position*:
the collective call it is in, with the schedule inputs it was given:

* ``after_update``: how many times this rank called it (this call included), ``epoch``,
  ``num_updates``, ``end_of_epoch``, and ``metrics`` as numbers;
* ``save``: the same inputs, and the checkpoint name;
* ``wait`` (also :meth:`~xla_ckpt.manager.CheckpointManager.close`);
* none of those (a restore, a step query): ``None``.

Before anything is read from the exchanged messages, every rank compares the positions
(:func:`unwrap`); when they differ, every rank raises the same
:class:`~xla_ckpt.errors.ScheduleMismatchError` naming each rank's position and values.  So a
rank that passes ``num_updates + 1``, skips one ``after_update``, or saves while another
waits fails at once and alike on every rank, instead of reading another call's message (a
``TypeError`` deep in the save path) or finishing while nothing was committed.  A rank that
never reaches the exchange is named by the collective timeout
(:class:`~xla_ckpt.errors.CollectiveTimeoutError`, :mod:`xla_ckpt.comm.liveness`).

``metrics`` are not part of the schedule: only rank 0's are recorded (``checkpoint_best``,
``keep_best_checkpoints``), so ranks that pass different ones (or pass some while rank 0
passes none) are reported by the manager in a WARNING on rank 0 naming every rank's values,
once per call, and the save goes on.  Pure functions over the exchanged messages: every rank
takes the same branch.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Mapping

from xla_ckpt.errors import ScheduleMismatchError

ENVELOPE = "xla_ckpt.manager.position/1"

Position = dict[str, Any] | None

HINT = ("every rank must call after_update once per update with the same epoch, num_updates "
        "and end_of_epoch, and call save, wait and close at the same points; nothing of the "
        "save at this point was written")

METRICS_HINT = ("only rank 0's metrics are recorded (checkpoint_best, keep_best_checkpoints): "
                "all-reduce the validation metrics so that every rank passes the same, or pass "
                "them on rank 0 only")


def metric_values(metrics: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``metrics`` as ``{name: float}`` (numbers, numpy scalars, one-element tensors); a value
    that is not a number is kept as its ``repr`` (the save then refuses it, naming it)."""
    if metrics is None:
        return None
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        try:
            out[str(k)] = float(v.item() if hasattr(v, "item") else v)
        except (TypeError, ValueError, RuntimeError):
            out[str(k)] = repr(v)
    return out


def position(call: str, **values: Any) -> dict[str, Any]:
    """This rank's position: ``call`` and its schedule inputs (``metrics`` given raw)."""
    pos: dict[str, Any] = {"call": call}
    for k, v in values.items():
        pos[k] = metric_values(v) if k == "metrics" else v
    return pos


def wrap(pos: Position, obj: Any) -> list[Any]:
    """The message this rank sends: its position around the exchange's own object."""
    return [ENVELOPE, pos, obj]


def describe(pos: Any) -> str:
    """A position in words, as the error names it."""
    if pos is _FOREIGN:
        return "a collective outside the CheckpointManager's calls"
    if pos is None:
        return "a restore or step query (restore_or_initialize, restore, all_steps, ...)"
    call = pos.get("call", "?")
    args = [f"{k}={pos[k]!r}" for k in ("name", "epoch", "num_updates", "end_of_epoch", "metrics")
            if k in pos and (k != "metrics" or pos[k] is not None)]
    nth = f" #{pos['calls']}" if "calls" in pos else ""
    return f"{call}{nth}({', '.join(args)})"


_FOREIGN = object()  # a message that is not a manager envelope


def _same_metrics(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if set(a) != set(b):
        return False
    for k, x in a.items():
        y = b[k]
        both_nan = isinstance(x, float) and isinstance(y, float) and math.isnan(x) \
            and math.isnan(y)
        if x != y and not both_nan:
            return False
    return True


def _key(p: Any) -> Any:
    """What must be equal on every rank: the position without its metrics."""
    if p is _FOREIGN:
        return "foreign"
    if p is None:
        return None
    return tuple(sorted((k, repr(v)) for k, v in p.items() if k != "metrics"))


def _metrics_differ(positions: list[Any]) -> dict[int, str]:
    """Rank -> its position in words, for ranks whose metrics differ from rank 0's (or that
    pass metrics while rank 0, whose metrics are recorded, passes none)."""
    ref = positions[0].get("metrics") if isinstance(positions[0], dict) else None
    out = {}
    for r, p in enumerate(positions):
        mine = p.get("metrics") if isinstance(p, dict) else None
        if r == 0 or mine is None:
            continue
        if ref is None or not _same_metrics(ref, mine):
            out[r] = describe(p)
    return out


def unwrap(msgs: list[Any]) -> tuple[list[Any], dict[int, str]]:
    """Every rank: the exchanged objects, once every rank's position agrees; and rank -> its
    position in words for the ranks whose ``metrics`` differ from rank 0's (rank 0 included
    then; empty when they agree).  Metrics are not the schedule: only rank 0's are recorded,
    so a difference is the caller's to report, not an error.

    Raises:
        ScheduleMismatchError: the positions differ (every rank, the same message).
    """
    positions: list[Any] = []
    payloads: list[Any] = []
    for m in msgs:
        if isinstance(m, (list, tuple)) and len(m) == 3 and m[0] == ENVELOPE:
            positions.append(m[1])
            payloads.append(m[2])
        else:
            positions.append(_FOREIGN)
            payloads.append(None)
    keys = [_key(p) for p in positions]
    if len(set(keys)) == 1:
        differ = _metrics_differ(positions)
        if differ:
            differ[0] = describe(positions[0])
        return payloads, differ
    # Name the ranks that differ from the most common position (rank 0's on a tie).
    counts = Counter(keys)
    top = max(counts.values())
    usual = keys[0] if counts[keys[0]] == top else next(k for k in keys if counts[k] == top)
    failures = {r: describe(positions[r]) for r, k in enumerate(keys) if k != usual}
    raise ScheduleMismatchError(f"ranks disagree about the save schedule ({grouped(positions)}); "
                                f"{HINT}", failures,
                                positions={r: describe(p) for r, p in enumerate(positions)})


def grouped(positions: list[Any]) -> str:
    """Every rank's position in words, ranks at the same one together."""
    groups: dict[str, list[int]] = {}
    for r, p in enumerate(positions):
        groups.setdefault(describe(p), []).append(r)
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {w}"
                     for w, rs in groups.items())


def positions_of(msgs: list[Any]) -> list[Any]:
    """The positions carried by exchanged messages (for :func:`grouped`)."""
    return [m[1] if isinstance(m, (list, tuple)) and len(m) == 3 and m[0] == ENVELOPE
            else _FOREIGN for m in msgs]
