"""Whether the ranks of each host share one copy of the replicated state, agreed by every rank.

:func:`negotiate` is a collective: every rank enters it, the outcome is the same on every
rank, and whatever goes wrong on any rank (no ``memfd``, a segment that cannot be opened
from a rank) turns into "one copy per rank" with the reason, never into an error or a hang.
The mechanism is :mod:`xla_ckpt.comm.host_memory`; who fills the host's copy is the plan's
choice (:mod:`xla_ckpt.restore.blobs`).

Hosts are the groups of ranks with the same topology ``host_id`` *and* the same
:func:`~xla_ckpt.comm.host_memory.host_identity`; each host's leader is its lowest rank (so
rank 0 leads its host).  With several hosts, the leaders form a subgroup (the plans that
move bytes across hosts exchange over it).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from xla_ckpt.comm.base import Dist, describe_error
from xla_ckpt.comm.host_memory import HostMemoryError, Segment, host_identity, open_segment

logger = logging.getLogger(__name__)

#: Slices a reader keeps in flight into host shared memory (per_host, striped): each is one
#: staging buffer of up to ``StorageConfig.slice_size_bytes``, so this bounds the extra
#: memory a reader holds (8 x 16 MiB by default) while keeping enough streams busy.
STAGING_BUFFERS = 8

@dataclass
class HostShare:
    """This rank's part in a host-shared restore (the same ``hosts`` on every rank).

    Attributes:
        hosts: ranks of each host, each sorted, hosts ordered by their leader.
        leaders: each host's lowest rank (``leaders[0] == 0``).
        leader: this rank's host leader.
        segment: the host's segment, on a leader.
        fd: the leader's segment opened read-only, on a non-leader.
        leaders_dist: the leaders' subgroup (several hosts, on leaders only).
    """

    hosts: list[list[int]]
    leaders: list[int]
    leader: int
    segment: Segment | None = None
    fd: int | None = None
    leaders_dist: Dist | None = None
    plan: str = "broadcast"
    closed: bool = field(default=False, repr=False)

    def own_segment(self) -> Segment:
        """The host's segment; only a leader has one."""
        if self.segment is None:
            raise RuntimeError(f"rank {self.leader}'s host: only the leader holds the segment")
        return self.segment

    def copy_fd(self) -> int:
        """File descriptor of the host's copy: the segment on a leader, else the leader's
        segment opened read-only."""
        fd = self.segment.fd if self.segment is not None else self.fd
        if fd is None:
            raise RuntimeError(f"rank {self.leader}'s host: no segment is open on this rank")
        return fd

    @property
    def describe(self) -> str:
        sizes = sorted({len(h) for h in self.hosts})
        per = "/".join(str(n) for n in sizes)
        if self.plan == "per_host":
            how = "each host's leader reads, the other ranks of the host map its memory"
        elif self.plan == "striped":
            how = ("every rank reads its stripes into its host's memory" +
                   ("" if len(self.hosts) == 1 else
                    ", host leaders all-gather the stripes over the data plane"))
        elif len(self.hosts) == 1:
            how = "rank 0 reads, the other ranks map its memory"
        else:
            how = ("rank 0 reads, host leaders receive over the data plane, the other ranks "
                   "map their leader's memory")
        return (f"host shared memory ({len(self.hosts)} host(s) x {per} rank(s): {how}; "
                "one copy per host)")

    def close(self) -> None:
        """Close this rank's descriptor (mappings made from it stay valid)."""
        if self.segment is not None:
            self.segment.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.closed = True


def negotiate(dist: Dist, enabled: bool, nbytes: int, what: str, *, writable: bool = False,
              leaders_group: bool = True, plan: str = "broadcast") -> tuple[HostShare | None, str]:
    """Every rank calls it; returns this rank's :class:`HostShare` (or None) and why.

    Args:
        enabled: ``restore.host_shared_memory`` on this rank.
        nbytes: bytes of the replicated state to be shared.
        what: the restore, for log lines.
        writable: non-leaders open the leader's segment read-write (they fill their part
            of it before the seal: the striped plan); default read-only.
        leaders_group: with several hosts, make the host leaders' subgroup (the plans that
            move bytes across hosts); False for the per-host plan, which never does.
        plan: the plan sharing the memory (``broadcast``, ``per_host``, ``striped``), for
            :attr:`HostShare.describe`.

    Returns:
        ``(share, reason)``: ``share`` is None on every rank when each rank must hold its
        own copy; ``reason`` says why (same on every rank).
    """
    if dist.world_size == 1:
        return None, "one rank: nothing to share"
    ident = host_identity() if enabled else None
    infos = dist.exchange({"on": bool(enabled), "host": dist.topology.host_id, "id": ident})
    off = [r for r, i in enumerate(infos) if not i["on"]]
    if off:
        return None, f"restore.host_shared_memory is false on rank(s) {_ranks(off)}"
    if nbytes == 0:
        return None, "the state has no tensor bytes"
    missing = [r for r, i in enumerate(infos) if i["id"] is None]
    if missing:
        return None, (f"rank(s) {_ranks(missing)} cannot share host memory "
                      "(no memfd_create, file sealing or /proc)")
    by_host: dict[tuple, list[int]] = {}
    for r, i in enumerate(infos):
        by_host.setdefault((i["host"], i["id"]), []).append(r)
    hosts = sorted(by_host.values(), key=lambda h: h[0])
    if all(len(h) == 1 for h in hosts):
        return None, "one rank per host: nothing to share"
    if len(hosts) > 1 and leaders_group and not dist.supports_subgroups:
        return None, (f"{len(hosts)} hosts, and {type(dist).__name__} cannot make the host "
                      "leaders' subgroup")
    leaders = [h[0] for h in hosts]
    mine = next(h for h in hosts if dist.rank in h)
    share = HostShare(hosts=hosts, leaders=leaders, leader=mine[0], plan=plan)
    try:
        return _open(dist, share, what, writable=writable, leaders_group=leaders_group)
    except BaseException:
        share.close()
        raise


def _open(dist: Dist, share: HostShare, what: str, *, writable: bool,
          leaders_group: bool) -> tuple[HostShare | None, str]:
    report: dict = {"handle": None, "error": None}
    if dist.rank == share.leader:
        try:
            share.segment = Segment(f"xla_ckpt-restore-rank{dist.rank}")
            report["handle"] = share.segment.handle
        except HostMemoryError as e:
            report["error"] = describe_error(e)
    reports = dist.exchange(report)
    failed = {r: rep["error"] for r, rep in enumerate(reports) if rep["error"]}
    error = None
    if not failed and dist.rank != share.leader:
        try:
            share.fd = open_segment(reports[share.leader]["handle"], writable=writable)
        except HostMemoryError as e:
            error = describe_error(e)
    opened = dist.exchange(error)
    failed.update({r: e for r, e in enumerate(opened) if e})
    if failed:
        share.close()
        causes = "; ".join(f"rank {r}: {c}" for r, c in sorted(failed.items()))
        return None, f"host shared memory unavailable ({causes})"
    if len(share.hosts) > 1 and leaders_group:
        share.leaders_dist = dist.subgroup(share.leaders)  # every rank calls it
    if dist.rank == 0:
        logger.info("rank 0: %s: data plane is %s", what, share.describe)
    return share, share.describe


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
