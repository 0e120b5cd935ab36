"""Who failed: progress marks and heartbeats on the job's rendezvous store.

When a collective breaks, gloo tells a rank only that *its* operation failed
("Connection closed by peer [127.0.0.1]:41348", "Timed out waiting 3000ms for
recv operation"), not which rank caused it.  DESIGN decision 8 asks every
surviving rank to name the failing rank(s).  Two marks on the c10d store the
rendezvous created (the torchrun agent's store, or rank 0's ``TCPStore``)
make that possible without another collective:

* **progress**: before each collective a rank notes ``(seq, op)`` in memory
  (:meth:`Liveness.entering`: no I/O on the collective's path);
* **heartbeat**: one daemon thread per process, every
  :data:`HEARTBEAT_INTERVAL_S` seconds, writes each group's latest progress
  under ``xla_ckpt/<group>/at/<rank>`` when it changed, then adds 1 to
  ``xla_ckpt/hb/<global rank>``.

When a collective breaks on a rank, :meth:`Liveness.diagnose` watches every
peer's heartbeat for up to :data:`DEAD_AFTER_S`: a count that does not move
means the process died or froze; a count that moved twice means the peer's
progress on the store is current, and a live peer whose last collective
comes before this one never entered it (it hangs or is too slow).  The
collective's error then names those ranks on every surviving rank, at most
``DEAD_AFTER_S`` after the collective gave up (about two beats when every
peer is alive).

Every rank of a group creates its :class:`Liveness` (see
:class:`xla_ckpt.comm.torch_dist.TorchDist`); nothing here is a collective.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Any, Sequence

import torch.distributed as tdist

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
"""Seconds between heartbeats of one process."""

DEAD_AFTER_S = 3.0
"""A peer whose heartbeat did not move for this many seconds counts as dead."""

_PREFIX = "xla_ckpt/"


class _Heartbeat:
    """The daemon thread that beats (and publishes progress) for this process; one per process."""

    def __init__(self, store: Any, global_rank: int, interval_s: float) -> None:
        self._store = tdist.PrefixStore(_PREFIX + "hb/", store)
        self._key = str(global_rank)
        self._interval_s = interval_s
        self._groups: weakref.WeakSet[Liveness] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._store.add(self._key, 1)
        self._thread = threading.Thread(target=self._run, name=f"xla_ckpt-heartbeat-r{global_rank}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop beating and wait (at most ``timeout_s``) for the thread to finish its store call.

        Runs at interpreter exit (``atexit``): a daemon thread still inside a
        store call when Python finalizes is killed as it takes the GIL back,
        and that unwinds through C++ frames into ``std::terminate`` ("terminate
        called without an active exception", exit code -6), seen on rank 0,
        whose process also hosts the store.
        """
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def watch(self, group: "Liveness") -> None:
        with self._lock:
            self._groups.add(group)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                with self._lock:
                    groups = list(self._groups)
                for g in groups:
                    g._publish()
                self._store.add(self._key, 1)
            except Exception as e:  # noqa: BLE001 - the store is gone: the job is over
                logger.debug("heartbeat stopped: %s", e)
                return


_beats: dict[int, _Heartbeat] = {}
_beats_lock = threading.Lock()


def _heartbeat(store: Any, global_rank: int) -> _Heartbeat:
    """This process's heartbeat, started on first use (every group of the process shares it)."""
    with _beats_lock:
        if global_rank not in _beats:
            if not _beats:
                atexit.register(stop_heartbeats)
            _beats[global_rank] = _Heartbeat(store, global_rank, HEARTBEAT_INTERVAL_S)
        return _beats[global_rank]


def stop_heartbeats() -> None:
    """Stop this process's heartbeat threads (registered with ``atexit``; safe to call twice)."""
    with _beats_lock:
        beats = list(_beats.values())
        _beats.clear()
    for b in beats:
        b.stop()


class Liveness:
    """Progress marks and heartbeats of one group's ranks (see the module docstring).

    Args:
        store: the c10d store every rank of the job shares (the default store).
        namespace: a name the ranks of this group share and no other group uses
            (the group's name).
        rank: this process's rank in the group.
        global_ranks: global rank of each group rank (index = group rank).
        dead_after_s: how long a heartbeat must stand still to call a rank dead.

    Failures of the store itself never raise: :meth:`diagnose` then says it
    could not tell.
    """

    def __init__(self, store: Any, *, namespace: str, rank: int, global_ranks: Sequence[int],
                 dead_after_s: float = DEAD_AFTER_S) -> None:
        self.rank = rank
        self.global_ranks = list(global_ranks)
        self.dead_after_s = dead_after_s
        self._store = tdist.PrefixStore(f"{_PREFIX}{namespace}/", store)
        self._beats = tdist.PrefixStore(_PREFIX + "hb/", store)
        self._mark = (0, "")  # (seq, op), replaced as one object: read by the heartbeat thread
        self._published = -1
        self._diagnosed = False
        self._ok = True
        try:
            self._publish()
            _heartbeat(store, self.global_ranks[rank]).watch(self)
        except Exception as e:  # noqa: BLE001 - naming failed ranks is best effort
            self._ok = False
            logger.debug("rank %d: no heartbeat (%s); failed ranks will not be named", rank, e)

    def entering(self, op: str) -> None:
        """Note that this rank enters collective ``op`` (before every collective; no I/O)."""
        self._mark = (self._mark[0] + 1, op)

    def _publish(self) -> None:
        """Heartbeat thread: write this rank's progress if it changed since the last beat."""
        seq, op = self._mark
        if seq != self._published:
            self._store.set(f"at/{self.rank}", f"{seq} {op}")
            self._published = seq

    def diagnose(self) -> dict[int, str]:
        """After the current collective broke: ``{peer rank: why it is to blame}``.

        Blamed: every peer whose heartbeat stood still for :attr:`dead_after_s`
        (it died or froze), and of the peers that never entered the current
        collective, those furthest behind (a rank stuck waiting for a hung peer
        is behind too, but less).  Takes up to :attr:`dead_after_s` seconds:
        the wait ends once every peer's heartbeat moved twice (its published
        progress is then current).  Only the first broken collective is
        diagnosed (later ones fail because the group is already broken);
        then, and when the store is unreachable, the answer is empty.
        """
        if self._diagnosed or not self._ok:
            return {}
        self._diagnosed = True
        peers = [r for r in range(len(self.global_ranks)) if r != self.rank]
        try:
            first = {r: self._beat(r) for r in peers}
            waiting = set(peers)
            deadline = time.monotonic() + self.dead_after_s
            while waiting and time.monotonic() < deadline:
                time.sleep(0.05)
                waiting = {r for r in waiting if self._beat(r) < first[r] + 2}
            dead = {r for r in waiting if self._beat(r) == first[r]}
            progress = {r: self._progress(r) for r in peers}
        except Exception as e:  # noqa: BLE001 - the store is gone too
            logger.warning("rank %d: cannot tell which rank failed: the rendezvous store is "
                           "unreachable (%s)", self.rank, e)
            return {}
        my_seq, my_op = self._mark
        behind = {r: progress[r][0] for r in peers if progress[r][0] < my_seq}
        furthest = min(behind.values(), default=None)
        out: dict[int, str] = {}
        for r in peers:
            seq, op = progress[r]
            last = f"its last collective was {op!r}" if seq else "it never entered a collective"
            if r in dead:
                out[r] = (f"died: no heartbeat for {self.dead_after_s:g} s while rank {self.rank} "
                          f"was in {my_op!r} ({last})")
            elif r in behind and behind[r] == furthest:
                out[r] = f"did not enter {my_op!r}: alive but {last}; it hangs or is too slow"
        return out

    def _beat(self, r: int) -> int:
        return self._beats.add(str(self.global_ranks[r]), 0)

    def _progress(self, r: int) -> tuple[int, str]:
        key = f"at/{r}"
        if not self._store.check([key]):
            return 0, ""
        seq, _, op = self._store.get(key).decode("utf-8", "replace").partition(" ")
        return int(seq), op


def for_group(group: Any) -> Liveness | None:
    """A :class:`Liveness` for a process group, or None (one rank, or no default store).

    Every rank of ``group`` calls it after creating the group (nothing waits).
    """
    try:
        ranks = tdist.get_process_group_ranks(group)
        if len(ranks) < 2:
            return None
        store = tdist.distributed_c10d._get_default_store()
        return Liveness(store, namespace=f"group-{group.group_name}", rank=tdist.get_rank(group),
                        global_ranks=ranks)
    except Exception as e:  # noqa: BLE001 - naming failed ranks is best effort
        logger.debug("no liveness tracking for this group: %s", e)
        return None
