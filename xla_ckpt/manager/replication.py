"""The manager's replication of each host's local-tier part to other hosts (issue 26).

After a local save commits on every host (``SavePath._local_written``, a collective point),
each host's leader hands its committed :class:`~xla_ckpt.run.local_tier.LocalStep` to its
:class:`Replicator`.  A background thread on each leader then runs one *round* per save,
over a process group of the host leaders that nothing else uses
(:meth:`~xla_ckpt.comm.base.Dist.own_subgroup`), so the training thread never waits for it:

1. the leaders exchange what they committed (each host's marker), whether a newer save is
   already queued behind this one, and the room left in their tiers (``local_max_bytes``);
   a round every leader would skip for a newer one is skipped;
2. :func:`~xla_ckpt.run.replicas.place_replicas` names each part's holders (never in the
   source's failure domain); each source's leader sends its files (those the holder does not
   hold itself, e.g. its own copy of the replicated state) and the manifest to each holder
   (:func:`~xla_ckpt.run.replicas.transfer_part`, one pair at a time in one order on every
   leader); the holder checks every crc32c, then writes ``replica-<g>.commit.json`` last;
3. the leaders exchange the outcomes: :attr:`Replicator.status` records, per checkpoint,
   which replicas committed, and a step counts as replicated only when all of them did.

A restore reads the replica markers from every host's inventory
(:func:`~xla_ckpt.manager.local_restore.decide_local`): a replaced host's ranks read their
boxes from a holder's tier.  A failure of the group (a leader died, a timeout) stops
replication for this manager with one WARNING; training and the local and durable saves go on.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from typing import Any, Mapping

from xla_ckpt.comm.base import Dist
from xla_ckpt.errors import DistributedError
from xla_ckpt.run.local_tier import ROOM_SLACK_BYTES, LocalStep, LocalTier
from xla_ckpt.run.replicas import place_replicas, transfer_part

logger = logging.getLogger(__name__)

STATUS_KEPT = 32
"""Checkpoints :attr:`Replicator.status` remembers (the newest)."""


class Replicator:
    """One host leader's background replication (see the module docstring).

    Args:
        group: the host leaders' own process group (this leader's :class:`Dist` in it).
        tier: this host's local tier.
        host: this host's index.
        replicas: holders per part (``CheckpointConfig.local_replicas``).
        domains: failure domain of each host (``CheckpointConfig.local_replica_domains``).

    Attributes:
        status: per checkpoint name, ``{"state": "queued" | "running" | "replicated" |
            "partial" | "skipped" | "failed", "holders": {source host: [holders that
            committed]}, "bytes_sent": int, "bytes_received": int, "problems": [str]}``.
    """

    def __init__(self, group: Dist, tier: LocalTier, *, host: int, replicas: int,
                 domains: Mapping[int, str] | None) -> None:
        self._group = group
        self._tier = tier
        self._host = host
        self._replicas = replicas
        self._domains = dict(domains or {})
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="xla_ckpt-replicate")
        self._lock = threading.Lock()
        self._queued: list[str] = []
        self._broken: str | None = None
        self.status: dict[str, dict[str, Any]] = {}

    def submit(self, name: str, own: LocalStep | None) -> cf.Future:
        """Queue the round of checkpoint ``name`` (``own``: this host's committed part, None
        when its local commit failed).  Every leader submits the same names in the same
        order."""
        with self._lock:
            self._queued.append(name)
            self.status[name] = {"state": "queued", "holders": {}, "bytes_sent": 0,
                                 "bytes_received": 0, "problems": []}
            for old in list(self.status)[:-STATUS_KEPT]:  # a long run: the newest only
                if old not in self._queued:
                    del self.status[old]
        self._tier.protected.add(name)
        return self._pool.submit(self._round, name, own)

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait until every queued round has ended (at most ``timeout_s`` seconds)."""
        done = threading.Event()
        self._pool.submit(done.set)
        done.wait(timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Let the queued rounds finish (at most ``timeout_s`` seconds), then stop."""
        self.wait(timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _round(self, name: str, own: LocalStep | None) -> None:
        st = self.status[name]
        with self._lock:
            self._queued.remove(name)
            newer = bool(self._queued)
        try:
            if self._broken is not None:
                st["state"] = "skipped"
                return
            st["state"] = "running"
            self._run(name, own, newer, st)
        except DistributedError as e:
            self._broken = str(e)
            st["state"] = "failed"
            st["problems"].append(str(e))
            logger.warning("host %d: replication of the local tier stops for this job: %s; "
                           "training and the local and durable saves go on", self._host, e)
        except Exception as e:  # noqa: BLE001 - a replica is a copy: logged, training goes on
            st["state"] = "failed"
            st["problems"].append(f"{type(e).__name__}: {e}")
            logger.warning("host %d: replicating %s failed: %s: %s", self._host, name,
                           type(e).__name__, e)
        finally:
            self._tier.protected.discard(name)

    def _run(self, name: str, own: LocalStep | None, newer: bool, st: dict[str, Any]) -> None:
        tier = self._tier
        room = tier.max_bytes - tier.used_bytes() if tier.max_bytes > 0 else -1
        msgs = self._group.exchange((self._host, own.to_json() if own is not None else None,
                                     newer, room))
        if all(m[2] for m in msgs):
            st["state"] = "skipped"  # every leader has a newer save queued: replicate that
            return
        rank_of = {h: i for i, (h, *_rest) in enumerate(msgs)}
        rooms = {h: r for h, _d, _n, r in msgs}
        parts = {h: LocalStep.from_json(d, where=f"host {h}'s local commit of {name}")
                 for h, d, _n, _r in msgs if d is not None}
        placement = place_replicas(list(rank_of), replicas=self._replicas,
                                   domains=self._domains)
        outcome: dict[int, str] = {}  # source host -> "ok" or why not (this host as holder)
        for g in sorted(parts):
            if not placement.get(g) and self._host == g:
                logger.warning("host %d: no host outside its failure domain holds a replica "
                               "of its part of %s", g, name)
            for h in placement.get(g, ()):
                files = [f for f in parts[g].files
                         if h not in parts or parts[h].files.get(f) != parts[g].files[f]]
                need = sum(parts[g].files[f] for f in files)
                if rooms[h] >= 0 and need + ROOM_SLACK_BYTES > rooms[h]:
                    if self._host == h:
                        outcome[g] = (f"no room: {need} bytes, {rooms[h]} left under "
                                      f"local_max_bytes {tier.max_bytes}")
                    continue
                if self._host not in (g, h):
                    continue
                try:
                    res = transfer_part(self._group, tier, parts[g], files, src=rank_of[g],
                                        dst=rank_of[h])
                    if self._host == h and res.ok:
                        tier.commit_replica(parts[g])
                except (OSError, ValueError) as e:  # this host's tier (full): the round goes on
                    outcome[g] = f"{type(e).__name__}: {e}"
                    continue
                if self._host == g:
                    st["bytes_sent"] += res.nbytes
                    continue
                st["bytes_received"] += res.nbytes
                if res.ok:
                    outcome[g] = "ok"
                else:
                    outcome[g] = "; ".join(f"{p.file} {list(p.keys)[:3]}: {p.detail}"
                                           for p in res.problems[:5])
        results = self._group.exchange(outcome)
        holders: dict[int, list[int]] = {g: [] for g in parts}
        for (h, *_rest), out in zip(msgs, results, strict=True):
            for g, why in out.items():
                if why == "ok":
                    holders[g].append(h)
                else:
                    st["problems"].append(f"host {g} -> host {h}: {why}")
        st["holders"] = holders
        want = {g: len(placement.get(g, ())) for g in parts}
        full = len(parts) == len(msgs) and all(len(holders[g]) == want[g] and want[g] > 0
                                               for g in parts)
        st["state"] = "replicated" if full else "partial"
        if self._group.rank == 0:
            if full:
                logger.info("replicated %s: %s", name, "; ".join(
                    f"host {g} on host(s) {holders[g]}" for g in sorted(holders)))
            else:
                logger.warning("%s is not replicated on every host: %s", name,
                               "; ".join(st["problems"]) or "a host did not commit it")
