"""How a rank's failure is reported to its peers, and whether a collective broke the group.

:func:`describe_error` is the one-line cause each failing rank sends in
:meth:`~.base.Dist.agree` (and that ``DistributedError.failures`` maps ranks
to); :func:`is_broken_collective` tells a failure that left the group
unusable from one the ranks agreed on.
"""

from __future__ import annotations

MAX_CAUSE_CHARS = 2000


def describe_error(error: BaseException | str) -> str:
    """One line ``"TypeName: message"`` (bounded length) for a failure report."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_CAUSE_CHARS else text[:MAX_CAUSE_CHARS - 3] + "..."


def is_broken_collective(error: BaseException) -> bool:
    """True if ``error`` came from a collective that did not complete (the group is unusable)."""
    return bool(getattr(error, "collective_broken", False))
