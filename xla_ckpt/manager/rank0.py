"""Rank 0's error in a step it does alone, raised on every rank as one type.

The manager's restore path decides on rank 0 (resolve ``checkpoint_last``, list the steps)
and sends every rank the decision or rank 0's error.  Every rank must then raise the same
type (DESIGN decision 8; issue 25: rank 0 raised ``PreconditionFailedError`` while rank 1
raised ``DistributedError`` naming rank 0):

* a library error (a class of :mod:`xla_ckpt.errors`) is rebuilt on every rank as that exact
  class, with its message and its plain attributes (``step``, ``steps``, ``bucket``,
  ``failures``, ``expected_generation`` ...), and notes; rank 0 raises its own exception
  object, which is of that class; a note on every rank names rank 0 and the step;
* anything else (an ``OSError``, a bug's ``TypeError``) becomes, on every rank (rank 0
  included, its exception as the ``__cause__``), a :class:`~xla_ckpt.errors.DistributedError`
  whose ``failures`` names rank 0 and the cause.

With one process there is nobody to agree with: rank 0's exception is raised as it is.
"""

from __future__ import annotations

from typing import Any, NoReturn

import xla_ckpt.errors as errors_module
from xla_ckpt.comm.failures import describe_error
from xla_ckpt.errors import DistributedError, XlaCkptError

_PLAIN = (str, int, float, bool, type(None))


def _plain(v: Any, depth: int = 0) -> bool:
    """``v`` travels in an exchange as it is (small plain data only)."""
    if isinstance(v, _PLAIN):
        return True
    if depth > 3:
        return False
    if isinstance(v, (list, tuple)):
        return len(v) <= 1000 and all(_plain(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return len(v) <= 1000 and all(isinstance(k, (str, int)) and _plain(x, depth + 1)
                                      for k, x in v.items())
    return False


def error_message(e: BaseException) -> tuple[str, str, str, dict[str, Any]]:
    """What rank 0 sends for its error ``e``: ``("error", class name, message, attributes)``."""
    attrs = {k: v for k, v in vars(e).items() if _plain(v)}
    return "error", type(e).__name__, str(e), attrs


def _rebuild(name: str, text: str, attrs: dict[str, Any]) -> BaseException | None:
    """The library error ``name`` rebuilt from its message and attributes, or None."""
    cls = getattr(errors_module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, XlaCkptError)):
        return None
    attrs = dict(attrs)
    notes = attrs.pop("__notes__", None)
    try:
        err: BaseException = cls(text, **attrs)
    except TypeError:  # a constructor that takes other keywords: set the attributes instead
        err = cls.__new__(cls)
        Exception.__init__(err, text)
        err.__dict__.update(attrs)
    if str(err) != text:  # a constructor that reformats the message (DistributedError)
        err.args = (text,)
    for note in notes or []:
        err.add_note(str(note))
    return err


def raise_error(msg: tuple, own: BaseException | None, *, world_size: int,
                what: str) -> NoReturn:
    """Raise rank 0's error ``msg`` (:func:`error_message`) on this rank; ``own``: rank 0's
    exception on rank 0, None elsewhere; ``what``: the step, for the message ("resolve the
    checkpoint to restore").

    Raises:
        The library error rank 0 hit (the same class on every rank), or
        :class:`~xla_ckpt.errors.DistributedError` naming rank 0 and the cause.
    """
    _, name, text, attrs = msg
    if own is not None and world_size == 1:
        raise own
    rebuilt = _rebuild(name, text, attrs)
    if rebuilt is not None:
        err = own if own is not None else rebuilt
        err.add_note(f"rank 0 hit this error while it decided for all {world_size} ranks (to "
                     f"{what}); every rank raises it")
        raise err
    err = DistributedError(f"rank 0 could not {what}", {0: describe_error(f"{name}: {text}")})
    raise err from own
