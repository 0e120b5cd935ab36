"""Meters with fairseq's state_dict layout (``fairseq/logging/meters.py``).

A checkpoint written by fairseq's ``metrics.state_dict()`` and one written
here hold the same values in the same shape, so meters restore across the two:

* :class:`AverageMeter` -> ``{"val", "sum", "count", "round"}``
* :class:`SumMeter` -> ``{"sum", "round"}``
* :class:`TimeMeter` -> ``{"init": elapsed seconds, "n", "round"}``; loading
  restarts its clock (``reset(init, n)``)
* :class:`StopwatchMeter` -> ``{"sum": seconds, "n", "round"}``; loading stops it
* :class:`MetersDict` -> ``[(priority, key, class name, meter state), ...]``,
  derived meters left out (they hold a function)

Loading a :class:`MetersDict` looks the class name up in a registry of meter
classes (:func:`register_meter`) instead of fairseq's ``globals()``; an unknown
name raises :class:`~xla_ckpt.errors.CheckpointCorruptError` naming it.
Values may be Python numbers, numpy scalars or tensors; they round-trip
through the typed encoding with their types.
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

from xla_ckpt.errors import CheckpointCorruptError


def _type_as(a: Any, b: Any) -> Any:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.to(b)
    return a


def safe_round(number: Any, ndigits: int) -> Any:
    """``round`` for Python numbers, one-element tensors and numpy scalars."""
    if hasattr(number, "__round__"):
        return round(number, ndigits)
    if torch.is_tensor(number) and number.numel() == 1:
        return safe_round(number.item(), ndigits)
    if hasattr(number, "item") and getattr(number, "ndim", None) == 0:
        return safe_round(number.item(), ndigits)
    return number


class Meter:
    """Base class of meters: ``state_dict``/``load_state_dict``/``reset``/``smoothed_value``."""

    round: Optional[int]  # digits :meth:`_rounded` keeps (set by the meters that round)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass

    def reset(self) -> None:
        raise NotImplementedError

    @property
    def smoothed_value(self) -> Any:
        raise NotImplementedError

    def _rounded(self, val: Any) -> Any:
        if self.round is not None and val is not None:
            return safe_round(val, self.round)
        return val


class AverageMeter(Meter):
    """Weighted average of logged values (``update(val, n)``); fairseq semantics."""

    def __init__(self, round: Optional[int] = None) -> None:  # noqa: A002 - fairseq meters API
        self.round = round
        self.reset()

    def reset(self) -> None:
        self.val = None
        self.sum: Any = 0
        self.count: Any = 0

    def update(self, val: Any, n: Any = 1) -> None:
        if val is not None:
            self.val = val
            if n > 0:
                self.sum = _type_as(self.sum, val) + (val * n)
                self.count = _type_as(self.count, n) + n

    def state_dict(self) -> dict:
        return {"val": self.val, "sum": self.sum, "count": self.count, "round": self.round}

    def load_state_dict(self, state_dict: dict) -> None:
        self.val = state_dict["val"]
        self.sum = state_dict["sum"]
        self.count = state_dict["count"]
        self.round = state_dict.get("round", None)

    @property
    def avg(self) -> Any:
        return self.sum / self.count if self.count > 0 else self.val

    @property
    def smoothed_value(self) -> Any:
        return self._rounded(self.avg)


class SumMeter(Meter):
    """Sum of logged values; fairseq semantics."""

    def __init__(self, round: Optional[int] = None) -> None:  # noqa: A002 - fairseq meters API
        self.round = round
        self.reset()

    def reset(self) -> None:
        self.sum: Any = 0

    def update(self, val: Any) -> None:
        if val is not None:
            self.sum = _type_as(self.sum, val) + val

    def state_dict(self) -> dict:
        return {"sum": self.sum, "round": self.round}

    def load_state_dict(self, state_dict: dict) -> None:
        self.sum = state_dict["sum"]
        self.round = state_dict.get("round", None)

    @property
    def smoothed_value(self) -> Any:
        return self._rounded(self.sum)


class TimeMeter(Meter):
    """Rate of an event per second (``n / elapsed seconds``); fairseq semantics.

    ``state_dict()["init"]`` is the elapsed time in seconds at save;
    loading restarts the clock from it.  The trainer restore resets every
    TimeMeter after loading (their start times mean nothing in a new process).
    """

    def __init__(self, init: float = 0, n: Any = 0,
                 round: Optional[int] = None,  # noqa: A002 - fairseq meters API
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.round = round
        self._clock = clock
        self.reset(init, n)

    def reset(self, init: float = 0, n: Any = 0) -> None:
        self.init = init
        self.start = self._clock()
        self.n = n
        self.i = 0

    def update(self, val: Any = 1) -> None:
        self.n = _type_as(self.n, val) + val
        self.i += 1

    def state_dict(self) -> dict:
        return {"init": self.elapsed_time, "n": self.n, "round": self.round}

    def load_state_dict(self, state_dict: dict) -> None:
        if "start" in state_dict:  # fairseq's oldest layout
            self.reset(init=state_dict["init"])
        else:
            self.reset(init=state_dict["init"], n=state_dict["n"])
            self.round = state_dict.get("round", None)

    @property
    def avg(self) -> Any:
        return self.n / self.elapsed_time

    @property
    def elapsed_time(self) -> float:
        return self.init + (self._clock() - self.start)

    @property
    def smoothed_value(self) -> Any:
        return self._rounded(self.avg)


class StopwatchMeter(Meter):
    """Sum and average duration in seconds of start/stop intervals; fairseq semantics."""

    def __init__(self, round: Optional[int] = None,  # noqa: A002 - fairseq meters API
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.round = round
        self._clock = clock
        self.sum: Any = 0
        self.n: Any = 0
        self.start_time: Optional[float] = None

    def start(self) -> None:
        self.start_time = self._clock()

    def stop(self, n: Any = 1, prehook: Optional[Callable[[], None]] = None) -> None:
        if self.start_time is not None:
            if prehook is not None:
                prehook()
            delta = self._clock() - self.start_time
            self.sum = self.sum + delta
            self.n = _type_as(self.n, n) + n

    def reset(self) -> None:
        self.sum = 0
        self.n = 0
        self.start()

    def state_dict(self) -> dict:
        return {"sum": self.sum, "n": self.n, "round": self.round}

    def load_state_dict(self, state_dict: dict) -> None:
        self.sum = state_dict["sum"]
        self.n = state_dict["n"]
        self.start_time = None
        self.round = state_dict.get("round", None)

    @property
    def avg(self) -> Any:
        return self.sum / self.n if self.n > 0 else self.sum

    @property
    def elapsed_time(self) -> float:
        if self.start_time is None:
            return 0.0
        return self._clock() - self.start_time

    @property
    def smoothed_value(self) -> Any:
        return self._rounded(self.avg if self.sum > 0 else self.elapsed_time)


class DerivedMeter(Meter):
    """A value computed from other meters by ``fn(meters_dict)``; never saved."""

    def __init__(self, fn: Callable[["MetersDict"], Any]) -> None:
        self.fn = fn

    def reset(self) -> None:
        pass


_METER_CLASSES: dict[str, type] = {}


def register_meter(cls: type) -> type:
    """Make ``cls`` restorable by its class name (usable as a decorator).

    Raises:
        ValueError: another class is already registered under the same name.
    """
    other = _METER_CLASSES.get(cls.__name__)
    if other is not None and other is not cls:
        raise ValueError(f"a meter class named {cls.__name__!r} is already registered "
                         f"({other.__module__}.{other.__qualname__})")
    _METER_CLASSES[cls.__name__] = cls
    return cls


for _cls in (AverageMeter, SumMeter, TimeMeter, StopwatchMeter):
    register_meter(_cls)


class MetersDict(OrderedDict):
    """Meters ordered by the priority given when each was added; fairseq semantics."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.priorities: list[tuple[int, int, str]] = []

    def __setitem__(self, key: str, value: tuple[int, Meter]) -> None:
        if key in self:
            raise KeyError(f"meter {key!r} already exists; MetersDict does not support "
                           "reassignment")
        priority, meter = value
        bisect.insort(self.priorities, (priority, len(self.priorities), key))
        super().__setitem__(key, meter)
        for _, _, k in self.priorities:  # reorder to match priorities
            self.move_to_end(k)

    def add_meter(self, key: str, meter: Meter, priority: int) -> None:
        self.__setitem__(key, (priority, meter))

    def state_dict(self) -> list[tuple[int, str, str, dict]]:
        """``[(priority, key, class name, meter state), ...]`` without derived meters."""
        return [(pri, key, self[key].__class__.__name__, self[key].state_dict())
                for pri, _, key in self.priorities if not isinstance(self[key], DerivedMeter)]

    def load_state_dict(self, state_dict: list) -> None:
        """Replace every meter with those in ``state_dict``.

        Raises:
            CheckpointCorruptError: a meter class name is not registered
                (see :func:`register_meter`), or an entry is malformed.
        """
        self.clear()
        self.priorities.clear()
        for entry in state_dict:
            try:
                pri, key, meter_cls, meter_state = entry
            except (TypeError, ValueError):
                raise CheckpointCorruptError(
                    f"malformed meter entry {entry!r}: expected (priority, key, class, state)"
                ) from None
            cls = _METER_CLASSES.get(meter_cls)
            if cls is None:
                raise CheckpointCorruptError(
                    f"meter {key!r} has class {meter_cls!r}, which is not registered; call "
                    "xla_ckpt.trainer.register_meter(<class>) before restoring, or pass "
                    "reset_meters=True")
            meter = cls()
            meter.load_state_dict(meter_state)
            self.add_meter(key, meter, pri)

    def get_smoothed_value(self, key: str) -> Any:
        meter = self[key]
        if isinstance(meter, DerivedMeter):
            return meter.fn(self)
        return meter.smoothed_value

    def get_smoothed_values(self) -> "OrderedDict[str, Any]":
        return OrderedDict((k, self.get_smoothed_value(k)) for k in self.keys()
                           if not k.startswith("_"))

    def reset(self) -> None:
        """Reset every meter (derived meters have nothing to reset)."""
        for meter in self.values():
            meter.reset()
