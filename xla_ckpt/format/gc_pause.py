"""Pause Python's cyclic garbage collector around work that makes many small objects.

Planning a save or a restore of a state with tens of thousands of tensors makes millions of
small containers (records, boxes, views, JSON values), none in a reference cycle.  Every
collection their allocations trigger rescans every tracked object of the process, so with the
collector on, about 40 % of an 80,000-tensor ``xla_ckpt.save`` or ``xla_ckpt.load`` went to it
(CASES C26).  Reference counting still frees everything as usual; a cycle made meanwhile is
collected after the pause.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector for the ``with`` block; afterwards it is as it was.

    Nesting and other threads are safe: only the outermost pause that found it enabled turns
    it back on (a thread that finds it paused leaves it to the one that paused it).  Hold it
    around CPU-bound planning, not around long I/O.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
