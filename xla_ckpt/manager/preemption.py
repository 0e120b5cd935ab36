"""Preemption notice: a SIGTERM handler that only sets a flag.

Cloud TPU spot/preemptible VMs and GKE (kubelet, before SIGKILL after the
pod's ``terminationGracePeriodSeconds``) send SIGTERM.  The handler does no
I/O: it records the request, and the :class:`~xla_ckpt.manager.CheckpointManager`
acts on it at the next update boundary, after the ranks agree on it.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

logger = logging.getLogger(__name__)


class PreemptionNotice:
    """A flag set by SIGTERM (or by :meth:`request`), checked at update boundaries.

    Call :meth:`install` on the main thread (Python delivers signals there);
    :meth:`uninstall` puts the previous handler back.
    """

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum
        self._event = threading.Event()
        self._previous: Any = None
        self._installed = False

    @property
    def requested(self) -> bool:
        """True once the signal arrived (or :meth:`request` was called)."""
        return self._event.is_set()

    def request(self) -> None:
        """Ask for a preemption save as if the signal had arrived."""
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def install(self) -> bool:
        """Install the handler; returns False (and logs) when not on the main thread."""
        if self._installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            logger.warning("not on the main thread: no %s handler installed; preemption saves "
                           "need PreemptionNotice.request()", signal.Signals(self.signum).name)
            return False
        self._previous = signal.signal(self.signum, self._handle)
        self._installed = True
        return True

    def uninstall(self) -> None:
        """Put back the handler that was there before :meth:`install`."""
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(self.signum, self._previous if self._previous is not None
                          else signal.SIG_DFL)
            self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        self._event.set()
