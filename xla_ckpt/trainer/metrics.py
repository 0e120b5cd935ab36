"""Named aggregators of meters, as an object (``fairseq/logging/metrics.py`` semantics).

fairseq keeps its aggregators in module globals; here they live in a
:class:`Metrics` instance so a process can hold more than one and tests stay
independent.  :meth:`Metrics.state_dict` has fairseq's layout::

    OrderedDict([("default", [(priority, key, class name, meter state), ...]),
                 ("train", [...]), ...])

Usage::

    metrics = Metrics()
    with metrics.aggregate("train"):
        metrics.log_scalar("loss", 2.5, weight=32)
    metrics.get_smoothed_values("train")["loss"]
"""

from __future__ import annotations

import contextlib
import uuid
from collections import OrderedDict, defaultdict
from typing import Any, Callable, Iterator, Optional

from xla_ckpt.trainer.meters import (
    AverageMeter,
    DerivedMeter,
    Meter,
    MetersDict,
    StopwatchMeter,
    SumMeter,
    TimeMeter,
)

DEFAULT = "default"


class Metrics:
    """Aggregators of meters keyed by name; ``"default"`` observes everything logged."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Drop every aggregator; start again with an empty ``"default"`` one."""
        self._aggregators: "OrderedDict[str, MetersDict]" = OrderedDict()
        self._active: "OrderedDict[str, MetersDict]" = OrderedDict()
        self._active_cnt: defaultdict[str, int] = defaultdict(int)
        self._aggregators[DEFAULT] = MetersDict()
        self._active[DEFAULT] = self._aggregators[DEFAULT]
        self._active_cnt[DEFAULT] = 1

    @contextlib.contextmanager
    def aggregate(self, name: Optional[str] = None, new_root: bool = False) -> Iterator[MetersDict]:
        """Record values logged inside the block under ``name`` (and every enclosing aggregator).

        ``new_root=True`` hides the enclosing aggregators, ``"default"``
        included, for the duration of the block.  A ``name`` of None makes a
        temporary aggregator.
        """
        if name is None:
            name = str(uuid.uuid4())
            agg = MetersDict()
        else:
            if name == DEFAULT:
                raise ValueError("'default' is always active; aggregate under another name")
            agg = self._aggregators.setdefault(name, MetersDict())
        if new_root:
            backup, backup_cnt = self._active.copy(), self._active_cnt.copy()
            self._active.clear()
            self._active_cnt.clear()
        self._active[name] = agg
        self._active_cnt[name] += 1
        try:
            yield agg
        finally:
            self._active_cnt[name] -= 1
            if self._active_cnt[name] == 0 and name in self._active:
                del self._active[name]
            if new_root:
                self._active.clear()
                self._active.update(backup)
                self._active_cnt.clear()
                self._active_cnt.update(backup_cnt)

    def _each(self) -> list[MetersDict]:
        return list(self._active.values())

    def log_scalar(self, key: str, value: Any, weight: float = 1, priority: int = 10,
                   round: Optional[int] = None) -> None:  # noqa: A002 - fairseq meters API
        """Average of ``value`` weighted by ``weight`` (0: keep the latest value)."""
        for agg in self._each():
            if key not in agg:
                agg.add_meter(key, AverageMeter(round=round), priority)
            agg[key].update(value, weight)

    def log_scalar_sum(self, key: str, value: Any, priority: int = 10,
                       round: Optional[int] = None) -> None:  # noqa: A002 - fairseq meters API
        """Sum of ``value``."""
        for agg in self._each():
            if key not in agg:
                agg.add_meter(key, SumMeter(round=round), priority)
            agg[key].update(value)

    def log_derived(self, key: str, fn: Callable[[MetersDict], Any], priority: int = 20) -> None:
        """A value computed from other meters when read (never saved)."""
        for agg in self._each():
            if key not in agg:
                agg.add_meter(key, DerivedMeter(fn), priority)

    def log_speed(self, key: str, value: Any, priority: int = 30,
                  round: Optional[int] = None) -> None:  # noqa: A002 - fairseq meters API
        """Rate of ``value`` per second (a :class:`TimeMeter`)."""
        for agg in self._each():
            if key not in agg:
                agg.add_meter(key, TimeMeter(round=round), priority)
                agg[key].reset()
            else:
                agg[key].update(value)

    def log_start_time(self, key: str, priority: int = 40,
                       round: Optional[int] = None) -> None:  # noqa: A002 - fairseq meters API
        """Start the :class:`StopwatchMeter` ``key``."""
        for agg in self._each():
            if key not in agg:
                agg.add_meter(key, StopwatchMeter(round=round), priority)
            agg[key].start()

    def log_stop_time(self, key: str, weight: float = 0.0,
                      prehook: Optional[Callable[[], None]] = None) -> None:
        """Stop the stopwatch ``key``; ``weight`` > 0 reports the average instead of the sum."""
        for agg in self._each():
            if key in agg:
                agg[key].stop(weight, prehook)

    def get_meter(self, name: str, key: str) -> Optional[Meter]:
        if name not in self._aggregators:
            return None
        return self._aggregators[name].get(key, None)

    def get_meters(self, name: str) -> Optional[MetersDict]:
        return self._aggregators.get(name, None)

    def aggregator_names(self) -> list[str]:
        return list(self._aggregators)

    def get_smoothed_values(self, name: str) -> "OrderedDict[str, Any]":
        """Raises KeyError if nothing was logged under ``name``."""
        return self._aggregators[name].get_smoothed_values()

    def reset_meter(self, name: str, key: str) -> None:
        meter = self.get_meter(name, key)
        if meter is not None:
            meter.reset()

    def reset_meters(self, name: str) -> None:
        meters = self.get_meters(name)
        if meters is not None:
            meters.reset()

    def reset_time_meters(self) -> int:
        """Reset every :class:`TimeMeter` in every aggregator; returns how many were reset.

        Called by the trainer restore after loading meters: a TimeMeter's start
        time means nothing in a new process.
        """
        count = 0
        for agg in self._aggregators.values():
            for meter in agg.values():
                if isinstance(meter, TimeMeter):
                    meter.reset()
                    count += 1
        return count

    def state_dict(self) -> "OrderedDict[str, list]":
        return OrderedDict((name, agg.state_dict()) for name, agg in self._aggregators.items())

    def load_state_dict(self, state_dict: Any) -> None:
        """Replace the aggregators named in ``state_dict`` (others stay as they are).

        An aggregator that is active (inside :meth:`aggregate`) keeps
        receiving values after the load.

        Raises:
            CheckpointCorruptError: an unknown meter class or a malformed entry.
        """
        for name, agg_state in state_dict.items():
            agg = self._aggregators.get(name)
            if agg is None:
                agg = self._aggregators[name] = MetersDict()
            agg.load_state_dict(agg_state)
