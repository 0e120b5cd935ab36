"""Host shared memory: one copy of the checkpoint bytes per host, mapped by every rank on it.

The broadcast strategy's data plane copies rank 0's bytes into every other
rank over the collective (gloo over TCP on CPU).  Ranks on the *same host*
do not need a copy sent to them: the host's leader (its lowest rank) holds
the bytes in a sealed anonymous memory file and the other ranks of the host
map it.  This module is that mechanism; :mod:`xla_ckpt.restore.broadcast`
decides when to use it (and falls back to the collective when it cannot).

The segment is a Linux ``memfd`` (``memfd_create(2)``):

* **no file system involved** — it lives on the kernel's internal tmpfs
  mount, not in ``/dev/shm``, so the 64 MiB ``/dev/shm`` of a default
  Docker container or GKE pod is no limit, and that mount has no size
  limit of its own (no ``SIGBUS`` on a full file system); its pages count
  against the leader's memory cgroup like any other memory, so running
  out is what it would be for the buffers it replaces;
* **nothing to clean up after a crash** — it has no name on disk; its pages
  are freed when the last process holding its descriptor or a mapping of
  it exits;
* **immutable once filled** — the leader fills it through a shared
  mapping, drops that mapping, then seals it (``F_SEAL_WRITE``,
  ``F_SEAL_SHRINK``, ``F_SEAL_GROW``, ``F_SEAL_SEAL``).  From then on no
  process can change its bytes, so what the leader crc32c-checked is what
  every rank maps.  Readers refuse a segment without those seals;
* **copy-on-write for every rank** — each rank (the leader too) maps it
  ``MAP_PRIVATE``: a rank that later changes a restored tensor in place
  (a training step) gets its own copy of the pages it writes; the other
  ranks keep seeing the checkpoint's bytes.

A rank opens the leader's segment through ``/proc/<leader pid>/fd/<fd>``,
which works only for processes in the same PID namespace on the same
machine with the same user; :func:`host_identity` is the key that says
whether two ranks can share, and the first ``HEADER_BYTES`` of a segment
carry a random nonce each reader checks, so a rank never maps the wrong
segment after a PID was reused.

Layout of a segment: ``HEADER_BYTES`` of header (magic, nonce), then the
tensors' bytes at offsets aligned to :data:`ALIGN_BYTES`
(:func:`segment_layout`).
"""

from __future__ import annotations

import fcntl
import gc
import mmap
import os
import socket
import sys
from typing import Sequence

import torch

MAGIC = b"XLA_CKPT-HOSTMEM1"
HEADER_BYTES = mmap.ALLOCATIONGRANULARITY  # the data starts page-aligned (mmap offsets must)
ALIGN_BYTES = 64  # every tensor's first byte: a cache line, enough for every dtype's view
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
SEALS = (getattr(fcntl, "F_SEAL_WRITE", 0) | getattr(fcntl, "F_SEAL_SHRINK", 0)
         | getattr(fcntl, "F_SEAL_GROW", 0) | getattr(fcntl, "F_SEAL_SEAL", 0))


class HostMemoryError(RuntimeError):
    """A host shared-memory segment could not be created, opened or mapped (message says why)."""


def host_identity() -> str | None:
    """Key equal on two processes iff one can open the other's memfd through ``/proc``.

    ``"<hostname>/<boot id>/<pid namespace inode>/<uid>"``; None where the
    mechanism is missing (not Linux, no ``memfd_create`` or file sealing in
    this Python, no ``/proc``).
    """
    if not hasattr(os, "memfd_create") or not hasattr(fcntl, "F_ADD_SEALS"):
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return f"{socket.gethostname()}/{boot}/{pidns}/{os.getuid()}"


def segment_layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets (bytes, from the start of the data) of tensors of ``sizes`` bytes, and the data size."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-int(n) // ALIGN_BYTES) * ALIGN_BYTES
    return offsets, end


def _views(base: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    offsets, _ = segment_layout(sizes)
    return [base[o:o + int(n)] for o, n in zip(offsets, sizes)]


class Segment:
    """The leader's side: create, fill, seal, then hand out its handle.

    Only the leader of a host constructs one; see the module docstring.

    Raises:
        HostMemoryError: ``memfd_create`` failed (e.g. too many open files).
    """

    def __init__(self, name: str = "xla_ckpt") -> None:
        try:
            self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as e:
            raise HostMemoryError(f"memfd_create failed: {e}") from None
        self.nonce = os.urandom(16)
        self._map: mmap.mmap | None = None
        self._data_bytes = 0
        os.pwrite(self.fd, MAGIC + self.nonce, 0)

    @property
    def handle(self) -> dict:
        """What a reader needs to open the segment: ``{"pid", "fd", "nonce"}`` (JSON-safe)."""
        return {"pid": os.getpid(), "fd": self.fd, "nonce": self.nonce.hex()}

    def size_for(self, sizes: Sequence[int]) -> list[int]:
        """Size the segment for tensors of ``sizes`` bytes; their byte offsets in :attr:`fd`.

        For a caller that fills the segment with ``os.pwrite`` (no mapping:
        the kernel allocates each page as it is written, without zeroing it
        first).

        Raises:
            HostMemoryError: the segment could not be sized.
        """
        offsets, data = segment_layout(sizes)
        self._data_bytes = data
        try:
            os.ftruncate(self.fd, HEADER_BYTES + data)
        except OSError as e:
            raise HostMemoryError(f"could not size host shared memory to {HEADER_BYTES + data} "
                                  f"bytes: {e}; set restore.host_shared_memory: false") from None
        return [HEADER_BYTES + o for o in offsets]

    def writable_views(self, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Size the segment for tensors of ``sizes`` bytes; uint8 views to fill, one per size.

        Pages are allocated as they are first written, as for ``torch.empty``.
        The views must all be dropped before :meth:`seal`.

        Raises:
            HostMemoryError: the segment could not be sized (names the size).
        """
        _, data = segment_layout(sizes)
        self._data_bytes = data
        total = HEADER_BYTES + data
        try:
            os.ftruncate(self.fd, total)
        except OSError as e:
            raise HostMemoryError(f"could not allocate {total} bytes of host shared memory: "
                                  f"{e}; set restore.host_shared_memory: false") from None
        if data == 0:
            return [torch.empty(0, dtype=torch.uint8) for _ in sizes]
        self._map = mmap.mmap(self.fd, data, flags=mmap.MAP_SHARED,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=HEADER_BYTES)
        return _views(torch.frombuffer(self._map, dtype=torch.uint8), sizes)

    def seal(self) -> None:
        """Drop the writable mapping and seal the segment: its bytes can never change again.

        Raises:
            HostMemoryError: a view from :meth:`writable_views` is still alive
                (a bug: the caller must drop them first), or sealing failed.
        """
        if self._map is not None:
            # torch.frombuffer holds a reference, not a buffer export: closing the map
            # under a live tensor would leave it dangling, so count the references
            if sys.getrefcount(self._map) > 2:
                gc.collect()  # a view kept alive only by a reference cycle
            if sys.getrefcount(self._map) > 2:
                raise HostMemoryError("a view of the host shared-memory segment is still alive; "
                                      "cannot seal it")
            self._map.close()
            self._map = None
        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
        except OSError as e:
            raise HostMemoryError(f"sealing the host shared-memory segment failed: {e}") from None

    def close(self) -> None:
        """Close the leader's descriptor (pages live on while any rank maps them)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_segment(handle: dict) -> int:
    """A reader's descriptor of the leader's segment ``handle`` (``O_RDONLY``), its nonce checked.

    Raises:
        HostMemoryError: the segment cannot be opened from this process (another
            PID namespace, host or user) or is not the leader's (nonce differs).
    """
    path = f"/proc/{int(handle['pid'])}/fd/{int(handle['fd'])}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise HostMemoryError(f"cannot open the leader's segment at {path}: {e}") from None
    head = os.pread(fd, len(MAGIC) + 16, 0)
    if head != MAGIC + bytes.fromhex(handle["nonce"]):
        os.close(fd)
        raise HostMemoryError(f"{path} is not the leader's host shared-memory segment "
                              "(header or nonce differs)")
    return fd


def map_private(fd: int, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Map a sealed segment copy-on-write: uint8 views of tensors of ``sizes`` bytes.

    The views keep the mapping alive; ``fd`` may be closed afterwards.

    Raises:
        HostMemoryError: the segment is not sealed against writes, or its
            size does not match ``sizes``.
    """
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & SEALS != SEALS:
        raise HostMemoryError(f"host shared-memory segment is not sealed (seals {seals:#x}); "
                              "refusing to map bytes that could still change")
    _, data = segment_layout(sizes)
    size = os.fstat(fd).st_size
    if size != HEADER_BYTES + data:
        raise HostMemoryError(f"host shared-memory segment holds {size} bytes, the manifest "
                              f"needs {HEADER_BYTES + data}")
    if data == 0:
        return [torch.empty(0, dtype=torch.uint8) for _ in sizes]
    m = mmap.mmap(fd, data, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                  offset=HEADER_BYTES)
    try:  # map every page now, read-only (copy-on-write stays intact), in one call
        m.madvise(MADV_POPULATE_READ)
    except (OSError, ValueError):
        pass  # Linux < 5.14: pages are mapped as they are first touched instead
    return _views(torch.frombuffer(m, dtype=torch.uint8), sizes)
