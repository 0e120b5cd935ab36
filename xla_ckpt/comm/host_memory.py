"""Host shared memory: one copy of the checkpoint bytes per host, mapped by every rank on it.

A plan that moves the replicated state to every rank (:mod:`xla_ckpt.restore.blobs`)
need not copy it into every rank of the *same host*: the host holds the bytes once, in a
sealed anonymous memory file, and every rank of it maps that.  This module is the
mechanism; :mod:`xla_ckpt.restore.host_share` negotiates it (and falls back to a copy per
rank when any rank cannot share).

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
* **immutable once filled** — the ranks that fill it write through shared mappings
  (:class:`WritableMapping`), drop them, then the leader seals it (``F_SEAL_WRITE``,
  ``F_SEAL_SHRINK``, ``F_SEAL_GROW``, ``F_SEAL_SEAL``).  From then on no process can change
  its bytes, so what the readers crc32c-checked is what every rank maps.  Readers refuse a
  segment without those seals;
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

Layout of a segment: ``HEADER_BYTES`` of header (magic, nonce, progress),
then the tensors' bytes at offsets aligned to :data:`ALIGN_BYTES`
(:func:`segment_layout`).
"""

from __future__ import annotations

import ctypes
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
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
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
    """Offsets (bytes, from the data's start) of tensors of ``sizes`` bytes, and the data size."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-int(n) // ALIGN_BYTES) * ALIGN_BYTES
    return offsets, end


def _views(base: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    offsets, _ = segment_layout(sizes)
    return [base[o:o + int(n)] for o, n in zip(offsets, sizes, strict=True)]


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
        os.pwrite(self.fd, MAGIC + self.nonce, 0)

    @property
    def sealed(self) -> bool:
        """True once :meth:`seal` has sealed the segment."""
        return self.fd >= 0 and _sealed(self.fd)

    @property
    def handle(self) -> dict:
        """What a reader needs to open the segment: ``{"pid", "fd", "nonce"}`` (JSON-safe)."""
        return {"pid": os.getpid(), "fd": self.fd, "nonce": self.nonce.hex()}

    def size_for(self, sizes: Sequence[int]) -> list[int]:
        """Size the segment for tensors of ``sizes`` bytes; their byte offsets in :attr:`fd`.

        The ranks that fill it then map it with :class:`WritableMapping`.

        Raises:
            HostMemoryError: the segment could not be sized.
        """
        offsets, data = segment_layout(sizes)
        try:
            os.ftruncate(self.fd, HEADER_BYTES + data)
        except OSError as e:
            raise HostMemoryError(f"could not size host shared memory to {HEADER_BYTES + data} "
                                  f"bytes: {e}; set restore.host_shared_memory: false") from None
        return [HEADER_BYTES + o for o in offsets]

    def seal(self) -> None:
        """Seal the segment: its bytes can never change again.

        Every :class:`WritableMapping` of it, on every rank, must be closed first.

        Raises:
            HostMemoryError: sealing failed (``EBUSY``: a writable mapping is still open).
        """
        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
        except OSError as e:
            raise HostMemoryError(f"sealing the host shared-memory segment failed: {e}") from None

    def close(self) -> None:
        """Close the leader's descriptor (pages live on while any rank maps them)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_segment(handle: dict, *, writable: bool = False) -> int:
    """A reader's descriptor of the leader's segment ``handle`` (``O_RDONLY``), its nonce checked.

    ``writable=True`` opens it ``O_RDWR`` instead: a rank of the host that fills part of
    the leader's segment (:class:`WritableMapping`) before the leader seals it (the
    striped plan); it closes that mapping before the seal.

    Raises:
        HostMemoryError: the segment cannot be opened from this process (another
            PID namespace, host or user) or is not the leader's (nonce differs).
    """
    path = f"/proc/{int(handle['pid'])}/fd/{int(handle['fd'])}"
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    except OSError as e:
        raise HostMemoryError(f"cannot open the leader's segment at {path}: {e}") from None
    head = os.pread(fd, len(MAGIC) + 16, 0)
    if head != MAGIC + bytes.fromhex(handle["nonce"]):
        os.close(fd)
        raise HostMemoryError(f"{path} is not the leader's host shared-memory segment "
                              "(header or nonce differs)")
    return fd


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _sealed(fd: int) -> bool:
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS


class WritableMapping:
    """A shared, writable mapping of a sized segment's data: how a rank of the host fills it.

    The leader maps its own segment; a rank that fills part of it maps the descriptor
    :func:`open_segment` gave it with ``writable=True``.  Every byte written through any
    rank's mapping is in the one segment.  :meth:`close` every mapping (on every rank)
    before the leader's :meth:`Segment.seal`.

    Attributes:
        data: the whole data region as one uint8 tensor (tensor ``i`` of ``sizes`` at
            ``segment_layout(sizes)[0][i]``, the alignment padding between them included).
        views: one uint8 tensor of each size, views of :attr:`data`.

    Raises:
        HostMemoryError: the segment does not have the size ``sizes`` need.
    """

    def __init__(self, fd: int, sizes: Sequence[int]) -> None:
        _, self.data_bytes = segment_layout(sizes)
        _check_size(fd, self.data_bytes)
        self._map: mmap.mmap | None = None
        if self.data_bytes == 0:
            self.data = torch.empty(0, dtype=torch.uint8)
            self.views = [torch.empty(0, dtype=torch.uint8) for _ in sizes]
            return
        self._map = mmap.mmap(fd, self.data_bytes, flags=mmap.MAP_SHARED,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=HEADER_BYTES)
        self.data = torch.frombuffer(self._map, dtype=torch.uint8)
        self.views = _views(self.data, sizes)

    def prefault(self) -> bool:
        """Allocate and map every page now (``MADV_POPULATE_WRITE``, Linux >= 5.14), contents
        unchanged, so bytes written into it later take no page fault each.  The GIL is
        released meanwhile (call it on a helper thread while the reads wait on the network).
        Returns False where the kernel lacks it (pages then fault in on first write).
        """
        if self._map is None:
            return False
        return _libc.madvise(self.data.data_ptr(), self.data_bytes, MADV_POPULATE_WRITE) == 0

    def close(self, *, strict: bool = True) -> None:
        """Unmap, so the segment can be sealed.  Every tensor taken from :attr:`data` or
        :attr:`views` must be gone first.

        Raises:
            HostMemoryError: such a tensor is still alive (with ``strict``; without, the
                mapping is left to the garbage collector: after a failed restore).
        """
        self.data, self.views = torch.empty(0, dtype=torch.uint8), []
        if self._map is None:
            return
        # torch.frombuffer holds a reference, not a buffer export: closing the map
        # under a live tensor would leave it dangling, so count the references
        if sys.getrefcount(self._map) > 2:
            gc.collect()  # a view kept alive only by a reference cycle
        if sys.getrefcount(self._map) > 2:
            if not strict:
                self._map = None
                return
            raise HostMemoryError("a view of the host shared-memory segment is still alive; "
                                  "cannot seal it")
        self._map.close()
        self._map = None


def _check_size(fd: int, data_bytes: int) -> None:
    size = os.fstat(fd).st_size
    if size != HEADER_BYTES + data_bytes:
        raise HostMemoryError(f"host shared-memory segment holds {size} bytes, the manifest "
                              f"needs {HEADER_BYTES + data_bytes}")


def map_private(fd: int, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Map a sealed segment copy-on-write: uint8 views of tensors of ``sizes`` bytes.

    Every page is mapped in before returning (``MADV_POPULATE_READ``, Linux >= 5.14, best
    effort; elsewhere pages map in on first touch); the views keep the mapping alive, and
    ``fd`` may be closed afterwards.  A rank that later writes a tensor in place gets its
    own copy of those pages.

    Raises:
        HostMemoryError: the segment is not sealed against writes, or its
            size does not match ``sizes``.
    """
    _, data_bytes = segment_layout(sizes)
    if not _sealed(fd):
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        raise HostMemoryError(f"host shared-memory segment is not sealed (seals {seals:#x}); "
                              "refusing to map bytes that could still change")
    _check_size(fd, data_bytes)
    if data_bytes == 0:
        return [torch.empty(0, dtype=torch.uint8) for _ in sizes]
    m = mmap.mmap(fd, data_bytes, flags=mmap.MAP_PRIVATE,
                  prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=HEADER_BYTES)
    base = torch.frombuffer(m, dtype=torch.uint8)
    # ctypes releases the GIL meanwhile
    _libc.madvise(base.data_ptr(), data_bytes, MADV_POPULATE_READ)
    return _views(base, sizes)
