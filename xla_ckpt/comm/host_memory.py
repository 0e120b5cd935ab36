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

**Following a fill.**  A leader that fills the segment with ``os.pwrite``
publishes how many leading data bytes are written and checked
(:meth:`Segment.publish`); the other ranks map the segment before it is
complete and map in each published range as it grows
(:meth:`PrivateMapping.follow`), so their page-table work overlaps the
leader's fill instead of following it.  Only published bytes are ever mapped;
the segment is sealed before any rank returns a tensor of it.  A leader that
fails publishes :data:`FAILED`; a leader that dies is noticed through its
PID.

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
import struct
import sys
import time
from typing import Sequence

import torch

MAGIC = b"XLA_CKPT-HOSTMEM1"
HEADER_BYTES = mmap.ALLOCATIONGRANULARITY  # the data starts page-aligned (mmap offsets must)
ALIGN_BYTES = 64  # every tensor's first byte: a cache line, enough for every dtype's view
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
PROGRESS_OFFSET = 64  # u64 little-endian in the header: data bytes written and checked
FAILED = (1 << 64) - 1  # progress value of a leader whose fill failed
PAGE_BYTES = mmap.PAGESIZE
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
        self._map: mmap.mmap | None = None
        self._data_bytes = 0
        self._addr = 0
        os.pwrite(self.fd, MAGIC + self.nonce, 0)

    @property
    def sealed(self) -> bool:
        """True once :meth:`seal` has sealed the segment."""
        return self.fd >= 0 and _sealed(self.fd)

    def publish(self, nbytes: int) -> None:
        """Tell followers the first ``nbytes`` data bytes are written and checked.

        ``nbytes`` is :data:`FAILED` when the fill failed.
        """
        os.pwrite(self.fd, struct.pack("<Q", nbytes), PROGRESS_OFFSET)

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
        base = self.writable_data(sizes)
        if base.numel() == 0:
            return [torch.empty(0, dtype=torch.uint8) for _ in sizes]
        return _views(base, sizes)

    def writable_data(self, sizes: Sequence[int]) -> torch.Tensor:
        """Size the segment for tensors of ``sizes`` bytes; its whole data region as one
        writable uint8 tensor (tensor ``i`` at ``segment_layout(sizes)[0][i]``; the alignment
        padding between tensors included).  As :meth:`writable_views`: drop it before
        :meth:`seal`.

        Raises:
            HostMemoryError: the segment could not be sized (names the size).
        """
        self.size_for(sizes)
        data = self._data_bytes
        if data == 0:
            return torch.empty(0, dtype=torch.uint8)
        self._map = mmap.mmap(self.fd, data, flags=mmap.MAP_SHARED,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=HEADER_BYTES)
        base = torch.frombuffer(self._map, dtype=torch.uint8)
        self._addr, self._data_bytes = base.data_ptr(), data
        return base

    def prefault(self) -> bool:
        """Allocate and map every page of the writable mapping now (``MADV_POPULATE_WRITE``,
        Linux >= 5.14), contents unchanged, so bytes received into it later take no page
        fault each.  The GIL is released meanwhile (call it on a helper thread while the
        reads wait on the network).  Returns False where the kernel lacks it (pages then
        fault in on first write, as before).
        """
        if self._map is None or not self._data_bytes:
            return False
        return _libc.madvise(self._addr, self._data_bytes, MADV_POPULATE_WRITE) == 0

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


def open_segment(handle: dict, *, writable: bool = False) -> int:
    """A reader's descriptor of the leader's segment ``handle`` (``O_RDONLY``), its nonce checked.

    ``writable=True`` opens it ``O_RDWR`` instead: a rank of the host that fills part of
    the leader's segment with ``os.pwrite`` before the leader seals it (the striped
    restore); it must never map it writable (that would block the seal).

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


def _alive(pid: int) -> bool:
    """False once ``pid`` has exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class PrivateMapping:
    """A rank's copy-on-write mapping of a segment (sealed, or being filled by its leader).

    Attributes:
        views: uint8 tensors of ``sizes`` bytes, views of the mapping (they
            keep it alive; ``fd`` may be closed).  Use them only after
            :meth:`follow` returned ``"sealed"`` or :meth:`check_sealed` passed.
    """

    def __init__(self, fd: int, sizes: Sequence[int]) -> None:
        _, self.data_bytes = segment_layout(sizes)
        self.fd = fd
        self._done = 0  # data bytes mapped in so far
        self._populate_ok = True
        self._check_size()
        if self.data_bytes == 0:
            self.views = [torch.empty(0, dtype=torch.uint8) for _ in sizes]
            self._addr = 0
            return
        m = mmap.mmap(fd, self.data_bytes, flags=mmap.MAP_PRIVATE,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=HEADER_BYTES)
        base = torch.frombuffer(m, dtype=torch.uint8)
        self._addr = base.data_ptr()
        self.views = _views(base, sizes)

    def populate(self, upto: int) -> None:
        """Map in data bytes ``[done, upto)`` now, read-only (copy-on-write intact), in one call.

        Best effort (``MADV_POPULATE_READ``, Linux >= 5.14; elsewhere pages
        map in on first touch).  Whole pages only, unless ``upto`` is the end.
        """
        upto = min(upto, self.data_bytes)
        if upto < self.data_bytes:
            upto -= upto % PAGE_BYTES
        if upto <= self._done or not self._populate_ok:
            return
        # ctypes releases the GIL: the leader's fill threads keep running meanwhile
        if _libc.madvise(self._addr + self._done, upto - self._done, MADV_POPULATE_READ) != 0:
            self._populate_ok = False
        self._done = upto

    def check_sealed(self) -> None:
        """Raise unless the segment is sealed and has the size the manifest says.

        Raises:
            HostMemoryError: not sealed against writes, or another size.
        """
        if not _sealed(self.fd):
            seals = fcntl.fcntl(self.fd, fcntl.F_GET_SEALS)
            raise HostMemoryError(f"host shared-memory segment is not sealed (seals {seals:#x}); "
                                  "refusing to map bytes that could still change")
        self._check_size()

    def _check_size(self) -> None:
        size = os.fstat(self.fd).st_size
        if size != HEADER_BYTES + self.data_bytes:
            raise HostMemoryError(f"host shared-memory segment holds {size} bytes, the manifest "
                                  f"needs {HEADER_BYTES + self.data_bytes}")

    def follow(self, leader_pid: int, timeout_s: float) -> str:
        """Map in the leader's published bytes as they grow, until it seals the segment.

        Returns:
            ``"sealed"`` (complete: every page mapped, seals and size
            checked), ``"failed"`` (the leader published :data:`FAILED`),
            ``"dead"`` (the leader's process exited) or ``"timeout"``
            (nothing sealed after ``timeout_s`` seconds).  Only ``"sealed"``
            makes :attr:`views` usable; on the others the caller goes on to
            the collective step that reports the leader's error.

        Raises:
            HostMemoryError: sealed, but with another size than the manifest's.
        """
        deadline = time.monotonic() + timeout_s
        pause = 0.0005
        while True:
            if _sealed(self.fd):
                self.check_sealed()
                self.populate(self.data_bytes)
                return "sealed"
            (progress,) = struct.unpack("<Q", os.pread(self.fd, 8, PROGRESS_OFFSET))
            if progress == FAILED:
                return "failed"
            if progress > self._done + PAGE_BYTES:
                self.populate(progress)
                pause = 0.0005
                continue
            if not _alive(leader_pid):
                return "dead"
            if time.monotonic() > deadline:
                return "timeout"
            time.sleep(pause)
            pause = min(pause * 2, 0.01)


def map_private(fd: int, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Map a sealed segment copy-on-write: uint8 views of tensors of ``sizes`` bytes.

    Every page is mapped in before returning; the views keep the mapping
    alive, and ``fd`` may be closed afterwards.

    Raises:
        HostMemoryError: the segment is not sealed against writes, or its
            size does not match ``sizes``.
    """
    mapping = PrivateMapping(fd, sizes)
    mapping.check_sealed()
    mapping.populate(mapping.data_bytes)
    return mapping.views
