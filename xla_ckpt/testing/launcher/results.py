"""What a rank sends back for one call (:class:`RankResult`), and how its exception travels.

A worker packs the exception it raised into plain picklable parts
(:func:`_pack_exception`); the parent re-creates it with its type, ``args``
and attributes (:func:`_unpack_exception`), or a :class:`RemoteError` that
stands in for it when its class cannot be re-created there.
"""

from __future__ import annotations

import importlib
import pickle
import traceback
from dataclasses import dataclass
from typing import Any


class RemoteError(Exception):
    """Stands in for a worker exception whose class could not be re-created in the parent."""


@dataclass
class RankResult:
    """What one rank produced for one call.

    Attributes:
        rank: global rank of the worker.
        value: what the function returned (None if it raised or died).
        error: the exception it raised, re-created in the parent (same type,
            ``args`` and attributes), a :class:`TimeoutError` if it was killed
            by the hard timeout, or a :class:`RemoteError` if it died.
        traceback: formatted traceback from the worker (chained causes included).
        exitcode: process exit code if the process ended (negative = signal).
        timed_out: True when the hard timeout killed it.
        seconds: wall time of the call on that rank (0 if it never answered).
    """

    rank: int
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""
    exitcode: int | None = None
    timed_out: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> Any:
        """The value, or raise the rank's error (with its worker traceback in the message)."""
        if self.error is not None:
            raise RuntimeError(f"rank {self.rank} failed:\n{self.traceback}") from self.error
        return self.value


def _pack_exception(e: BaseException) -> dict[str, Any]:
    attrs = {}
    for k, v in vars(e).items():
        try:
            pickle.dumps(v)
        except Exception:  # noqa: BLE001 - any pickling failure: drop what cannot travel
            continue
        attrs[k] = v
    try:
        pickle.dumps(e.args)
        args = e.args
    except Exception:  # noqa: BLE001 - any pickling failure: send the args as text instead
        args = tuple(str(a) for a in e.args)
    pickled: bytes | None
    try:
        pickled = pickle.dumps(e)  # BaseException pickles as (cls, args, __dict__)
        pickle.loads(pickled)
    except Exception:  # noqa: BLE001 - rebuilt from the parts below instead
        pickled = None
    return {"module": type(e).__module__, "qualname": type(e).__qualname__, "args": args,
            "attrs": attrs, "text": f"{type(e).__name__}: {e}", "pickled": pickled,
            "traceback": "".join(traceback.format_exception(e))}


def _unpack_exception(d: dict[str, Any]) -> BaseException:
    if d.get("pickled") is not None:
        try:
            return pickle.loads(d["pickled"])
        except Exception:  # noqa: BLE001 - e.g. the class is not importable here
            pass
    try:
        cls: Any = importlib.import_module(d["module"])
        for part in d["qualname"].split("."):
            cls = getattr(cls, part)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            raise TypeError(d["qualname"])
        e = None
        for base in cls.__mro__:  # the builtin whose layout the class extends
            if base.__module__ == "builtins" and issubclass(base, BaseException):
                try:
                    e = base.__new__(cls)
                    break
                except TypeError:
                    continue
        if e is None:
            raise TypeError(d["qualname"])
        e.args = d["args"]
        e.__dict__.update(d["attrs"])
        return e
    except Exception:  # noqa: BLE001 - fall back to a readable stand-in
        return RemoteError(d["text"])
