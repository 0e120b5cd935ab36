"""Replicas of each host's local-tier part on other hosts (issue 26), and the transfer that
makes them, over the data plane.

A host's *part* of a checkpoint is what its local tier holds of it
(:class:`~xla_ckpt.run.local_tier.LocalStep`: its data files, listed with their sizes in its
commit marker).  A *replica* of it is the same files in another host's step folder, with a
``replica-<g>.commit.json`` marker written last, only once every byte received was checked
against the manifest's crc32c (:meth:`~xla_ckpt.run.local_tier.LocalTier.commit_replica`).
A host that comes back empty (a preempted TPU VM, a rescheduled GKE node) reads its boxes
from a holder's tier during the restore (:class:`~xla_ckpt.manager.local_restore.PeerSources`),
and every other host reads its own.

Placement (:func:`place_replicas`): a replica never shares a failure domain with its source.
Domains come from the topology (one TPU slice, one GKE node pool) or a user map; by default
each host is its own domain.  Each source takes the least loaded allowed host, nearest in
ring order, so every host holds about ``replicas`` other parts.

Which rank calls what: the sending rank (a host's leader, local rank 0) and the receiving
rank (another host's leader) call :func:`transfer_part` with the same arguments at the same
point of their schedule (point-to-point over :class:`~xla_ckpt.comm.base.Dist`: gloo on CPU,
NCCL on GPU); nothing else is exchanged, so both must know the step and the file list (from
the inventories, or a save's gathered parts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping, Sequence

import torch

from xla_ckpt.comm.base import Dist
from xla_ckpt.format.manifest import MANIFEST_NAME, Manifest
from xla_ckpt.format.plan import tensor_bytes
from xla_ckpt.io.verify import Problem, check_file_bytes
from xla_ckpt.run.local_tier import LocalStep, LocalTier

logger = logging.getLogger(__name__)

_RECV_MARK = ".recv-"
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # page tables filled in one call (Linux)


def place_replicas(hosts: Sequence[int], *, replicas: int = 1,
                   domains: Mapping[int, str] | None = None) -> dict[int, tuple[int, ...]]:
    """Which hosts hold each host's replicas: ``{source host: (holder, ...)}``.

    Args:
        hosts: every host index of the job.
        replicas: replicas per part (R; 0: none).
        domains: each host's failure domain (a TPU slice, a GKE node pool); hosts missing
            from it (or ``None``) are each a domain of their own.

    A holder is never in the source's domain; holders of one source are in different
    domains from each other where there are enough domains; among the hosts allowed, each
    source takes the one holding the fewest parts so far, the nearest in ring order from the
    source on a tie (host ``h`` first asks ``h + 1``).  So every host holds about
    ``replicas`` other parts (exactly that many when the domains are of equal size), never a
    whole domain's parts on one host.  A source with fewer eligible hosts than ``replicas``
    gets what there is (none on a one-domain job): the caller logs it.
    """
    order = sorted(set(hosts))
    dom = {h: (domains or {}).get(h, f"host-{h}") for h in order}
    load = dict.fromkeys(order, 0)
    out: dict[int, tuple[int, ...]] = {}
    for i, src in enumerate(order):
        ring = [order[(i + k) % len(order)] for k in range(1, len(order))]
        eligible = [h for h in ring if dom[h] != dom[src]]
        picked: list[int] = []
        used = {dom[src]}
        while len(picked) < replicas:
            left = [h for h in eligible if h not in picked]
            if not left:
                break
            fresh = [h for h in left if dom[h] not in used]  # a new domain first
            h = min(fresh or left, key=lambda x: (load[x], ring.index(x)))
            picked.append(h)
            used.add(dom[h])
            load[h] += 1
        out[src] = tuple(picked)
    return out


@dataclass
class TransferResult:
    """What :func:`transfer_part` did on this rank.

    Attributes:
        nbytes: bytes sent (sender) or received (receiver).
        problems: the receiver's failed checks (host, file and tensor in each), empty when
            every byte matched its crc32c; the received files are then removed.
        transfer_s / check_s: seconds on the wire and in the receiver's check.
    """

    nbytes: int = 0
    problems: list[Problem] = field(default_factory=list)
    transfer_s: float = 0.0  # the bytes on the wire (the receiver: into its files)
    check_s: float = 0.0  # the receiver's crc32c check of what arrived

    @property
    def ok(self) -> bool:
        return not self.problems


def transfer_part(dist: Dist, tier: LocalTier, step: LocalStep, files: Sequence[str], *,
                  src: int, dst: int) -> TransferResult:
    """Send host ``step.host``'s data files ``files`` of ``step``, and the checkpoint's
    manifest, from rank ``src``'s host tier to rank ``dst``'s, and check them there.

    Both ranks call it (others must not); ``files`` (a subset of ``step.files``) and their
    sizes must be the same on both.  The sender streams the manifest, then each file from its
    step folder (mapped, no copy into the heap); a file that vanished or shrank there is sent
    as zeros beyond what is left, so the transfer stays in step and the receiver's check
    fails.  The receiver writes each file into a ``<file>.recv-<id>`` file of its final size
    in ``step.name``'s folder (reserved, mapped, received in place) and checks every blob of it
    against the manifest's crc32c right there, while its pages are hot
    (:func:`~xla_ckpt.io.verify.check_file_bytes`: nothing is read back); only when every
    file is intact does it rename them to their names (no marker names them yet, so nothing
    counts them) and write the manifest when it has none there; otherwise it removes them
    and returns the problems.  Committing (the replica marker) is the caller's step, after a
    clean check.

    Raises:
        DistributedError: the peer died or the transfer timed out (the receiver's partial
            files are removed).
        ValueError: a file is not in ``step.files``, or this rank is neither end.
    """
    unknown = [f for f in files if f not in step.files]
    if unknown:
        raise ValueError(f"host {step.host}'s part of {step.name} lists no file {unknown}")
    names = sorted(files)
    folder = tier.path(step.name)
    if dist.rank == src:
        try:
            with open(os.path.join(folder, MANIFEST_NAME), "rb") as fh:
                mbytes = fh.read()
        except OSError as e:
            logger.warning("%s: no manifest to send (%s); the receiver rejects the part",
                           folder, e)
            mbytes = b""
        dist.send_tensors([torch.tensor([len(mbytes)], dtype=torch.int64)], dst)
        if mbytes:
            dist.send_tensors([torch.frombuffer(bytearray(mbytes), dtype=torch.uint8)], dst)
        n = 0
        for f in names:  # one file at a time: one mapping at a time
            with _mapped_for_sending(folder, f, step.files[f]) as t:
                n += dist.send_tensors([t], dst)
        return TransferResult(nbytes=n)
    if dist.rank != dst:
        raise ValueError(f"rank {dist.rank} is neither the sender {src} nor the receiver {dst}")
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv_tensors([size], src)
    mbuf = torch.empty(int(size.item()), dtype=torch.uint8)
    if mbuf.numel():
        dist.recv_tensors([mbuf], src)
    tag = uuid.uuid4().hex[:12]
    temps = {f: os.path.join(folder, f"{f}{_RECV_MARK}{tag}") for f in names}
    for leftover in _listdir(folder):  # an earlier transfer of these files killed half way
        if leftover.split(_RECV_MARK)[0] in temps and _RECV_MARK in leftover:
            _remove([os.path.join(folder, leftover)])
    mbytes = mbuf.numpy().tobytes()
    manifest: Manifest | None = None
    problems: list[Problem] = []
    try:
        manifest = Manifest.from_json_bytes(mbytes, where=f"{folder}/{MANIFEST_NAME} "
                                            f"(received)", require_crc=True)
        if manifest.save_id != step.save_id:
            raise ValueError(f"it is of save {manifest.save_id}, not {step.save_id}")
    except ValueError as e:  # CheckpointCorruptError is one; the files are drained all the same
        manifest = None
        problems.append(Problem("header", MANIFEST_NAME, "", (),
                                f"the manifest is unusable: {e}"))
    n = 0
    failed: OSError | None = None  # a temporary file could not be made (a full tmpfs)
    t0 = time.perf_counter()
    check_s = 0.0
    try:
        for f in names:
            try:
                if failed is not None:
                    raise failed
                os.makedirs(folder, exist_ok=True)
                ctx = _mapped_for_receiving(temps[f], step.files[f])
                t = ctx.__enter__()
            except OSError as e:
                # Receive all the same (the sender is sending): the transfer stays in step.
                failed = failed or e
                n += dist.recv_tensors([torch.empty(step.files[f], dtype=torch.uint8)], src)
                continue
            try:
                n += dist.recv_tensors([t], src)
                if manifest is not None:  # checked where it landed, while the pages are hot
                    tc = time.perf_counter()
                    problems += check_file_bytes(manifest, f, tensor_bytes(t) if t.numel()
                                                 else memoryview(b""))
                    check_s += time.perf_counter() - tc
            finally:
                del t
                ctx.__exit__(None, None, None)
        if failed is not None:
            raise failed
        if problems:
            raise _Rejected([dataclasses.replace(
                p, detail=f"host {step.host}'s part as received: {p.detail}") for p in problems])
        for f, tmp in temps.items():  # no marker names them yet: not a committed part
            os.replace(tmp, os.path.join(folder, f))
        temps = {f: os.path.join(folder, f) for f in names}
        if not os.path.exists(os.path.join(folder, MANIFEST_NAME)):
            _write(os.path.join(folder, MANIFEST_NAME), mbytes)
    except _Rejected as e:
        _remove(temps.values())
        return TransferResult(nbytes=n, problems=e.problems,
                              transfer_s=time.perf_counter() - t0 - check_s, check_s=check_s)
    except BaseException:
        _remove(temps.values())
        raise
    total = time.perf_counter() - t0
    logger.debug("received host %d's part of %s: %d bytes in %.3f s (%.3f s of it checking)",
                 step.host, step.name, n, total, check_s)
    return TransferResult(nbytes=n, transfer_s=total - check_s, check_s=check_s)


class _Rejected(Exception):
    def __init__(self, problems: list[Problem]) -> None:
        super().__init__(len(problems))
        self.problems = problems


@contextlib.contextmanager
def _mapped_for_sending(folder: str, name: str, want: int) -> Iterator[torch.Tensor]:
    """File ``name``'s ``want`` bytes as a uint8 tensor (a private mapping, no copy), or as
    much of it as is there followed by zeros (the receiver's check then fails)."""
    mm: mmap.mmap | None = None
    t = torch.zeros(want, dtype=torch.uint8)
    try:
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
    except OSError as e:
        logger.warning("%s: cannot open %s to send it (%s): sending zeros; the receiver's "
                       "check rejects them", folder, name, e)
        yield t
        return
    try:  # any failure to read sends zeros (the transfer stays in step), never raises
        have = os.fstat(fd).st_size
        if have == want and want:
            mm = mmap.mmap(fd, want, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
            t = torch.frombuffer(mm, dtype=torch.uint8)
        elif want:
            got = os.pread(fd, min(have, want), 0)
            if got:
                t[:len(got)] = torch.frombuffer(bytearray(got), dtype=torch.uint8)
            logger.warning("%s: %s holds %d bytes, its marker says %d: sending what is there; "
                           "the receiver's check rejects it", folder, name, have, want)
    except OSError as e:
        logger.warning("%s: cannot read %s to send it (%s): sending zeros; the receiver's "
                       "check rejects them", folder, name, e)
    finally:
        os.close(fd)
    try:
        yield t
    finally:
        del t  # this frame's view of the mapping, before closing it
        _close_mapping(mm)


@contextlib.contextmanager
def _mapped_for_receiving(path: str, n: int) -> Iterator[torch.Tensor]:
    """A new file ``path`` of ``n`` bytes, mapped shared, as a uint8 tensor to receive into.

    Raises:
        OSError: the file could not be made or sized (a full tmpfs; removed then).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    mm: mmap.mmap | None = None
    try:
        if n:
            # Reserve every page now: a full tmpfs fails here (ENOSPC), never as a SIGBUS
            # when a received byte lands on a page it cannot back.
            os.posix_fallocate(fd, 0, n)
            mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED | _POPULATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        os.close(fd)
        _remove([path])
        raise
    os.close(fd)
    t = torch.frombuffer(mm, dtype=torch.uint8) if mm is not None else \
        torch.empty(0, dtype=torch.uint8)
    try:
        yield t
    finally:
        del t  # this frame's view of the mapping, before closing it
        _close_mapping(mm)


def _close_mapping(mm: mmap.mmap | None) -> None:
    """Unmap ``mm`` now; a view of it still alive elsewhere (BufferError) keeps it mapped
    until that view is collected."""
    if mm is not None:
        with contextlib.suppress(BufferError):
            mm.close()


def _write(path: str, data: bytes) -> None:
    tmp = f"{path}{_RECV_MARK}{uuid.uuid4().hex[:12]}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _remove(paths: Iterable[str]) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            os.unlink(p)
