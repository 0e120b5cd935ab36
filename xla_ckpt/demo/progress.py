"""The demo's progress lines: a start, a ``still running, N s`` and a done line per long step.

Every line goes to this module's logger at INFO; ``xla-ckpt demo`` prints the ``xla_ckpt.demo``
loggers on stderr, each line prefixed by the seconds since the demo started.
:class:`Heartbeat` serves a step whose caller polls (a phase's worker loop, a leg);
:func:`step` a step of the orchestrator that blocks (a helper thread beats for it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator

logger = logging.getLogger(__name__)

HEARTBEAT_S = 15.0
"""Seconds between two "still running" lines of a long step (:class:`Heartbeat`)."""


class Heartbeat:
    """Progress lines of one long step: ``<step>: started``, ``<step>: still running, N s``
    about every ``every_s`` seconds (:meth:`beat`, called often), ``<step>: done in N s``.

    ``clock``: seconds, monotonic (tests pass their own).  Lines go to this module's logger
    at INFO, which ``xla-ckpt demo`` prints on stderr.
    """

    def __init__(self, step: str, *, every_s: float = HEARTBEAT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.step = step
        self.every_s = every_s
        self.clock = clock
        self.t0 = clock()
        self.last = self.t0

    def start(self, detail: str = "") -> None:
        logger.info("%s: started%s", self.step, f" ({detail})" if detail else "")

    def beat(self, detail: str = "") -> bool:
        """Log ``still running`` when ``every_s`` passed since the last line; True if it did."""
        now = self.clock()
        if now - self.last < self.every_s:
            return False
        self.last = now
        logger.info("%s: still running, %.0f s%s", self.step, now - self.t0,
                    f" ({detail})" if detail else "")
        return True

    def done(self, detail: str = "") -> float:
        """Log ``done in N s``; returns N."""
        seconds = self.clock() - self.t0
        logger.info("%s: done in %.1f s%s", self.step, seconds, f" ({detail})" if detail else "")
        return seconds


@contextlib.contextmanager
def step(name: str, *, every_s: float = HEARTBEAT_S) -> Iterator[Heartbeat]:
    """A step of the orchestrator itself (no workers): start and done lines, and a
    ``still running`` line every ``every_s`` seconds from a helper thread while the step
    blocks."""
    hb = Heartbeat(name, every_s=every_s)
    hb.start()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(min(1.0, every_s)):
            hb.beat()

    thread = threading.Thread(target=beat, name=f"heartbeat {name}", daemon=True)
    thread.start()
    try:
        yield hb
    finally:
        stop.set()
        thread.join(timeout=5.0)
    hb.done()

