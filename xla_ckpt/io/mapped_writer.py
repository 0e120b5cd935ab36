"""Stage a data file straight into its own pages: the local tier's one-copy save (issue 24).

An async save into the local tier (:mod:`xla_ckpt.manager.local_save`) lays each data file
out first (:func:`~xla_ckpt.io.writer.plan_file`: the header and every blob's offset are
known before a byte moves), then, on the training thread, copies each blob from the live
tensors (CPU or CUDA; XLA tensors arrive through one batched transfer) into a writable
shared mapping of the file itself (:func:`stage_file`).  That copy is the save's one
device-to-host copy: the file's pages *are* the staging buffers, so no second memcpy
writes them out.  The upload thread then checksums every chunk from those pages and
publishes the file under its final name (:meth:`StagedFile.finish`); until then it has a
temporary name (``<name>.tmp-<id>``), which the tools list as an unfinished write.

Page faults: the first touch of fresh pages costs several times the copy.  The tier hands
a rank the file of the step keep-last-K just evicted (:meth:`~xla_ckpt.run.local_tier.
LocalTier.take_spare`), and :class:`MappedPages` keeps this process's mapping of every file
it staged, so a recycled file is written through a mapping whose pages are already
present: a steady-state local save costs one memcpy into them.  A fresh file's pages are
reserved with ``posix_fallocate`` before the copy, so a full tmpfs is an ``ENOSPC``
(OSError) here and never a SIGBUS in the middle of the copy.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import uuid
from dataclasses import dataclass, replace

import torch

from xla_ckpt.format.crc import crc32c
from xla_ckpt.io.writer import FilePlan, WrittenItem
from xla_ckpt.storage.local import TMP_MARK, LocalStorage


@dataclass
class _Mapping:
    fd: int
    mm: mmap.mmap
    pages: torch.Tensor  # uint8 view of the whole mapping


class MappedPages:
    """One process's writable mappings of the data files it staged, by inode.  Thread-safe.

    A mapping is kept after its file is published (the bytes are not copied anywhere), so
    the file, recycled for a later save, is written again without faults (mapping a 512 MiB
    file again costs about half of the copy itself in page-table faults); a mapping whose
    file has no name left (``st_nlink`` 0: pruned, discarded, replaced as a spare) is closed
    by :meth:`forget_unlinked` or the next :meth:`open`, which frees its pages.
    :meth:`close` drops every mapping.
    """

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], _Mapping] = {}
        self._lock = threading.Lock()

    def open(self, path: str, size: int) -> torch.Tensor:
        """A uint8 tensor over the first ``size`` bytes of file ``path`` (made that long, its
        pages reserved), mapped shared and writable.

        Raises:
            OSError: the file cannot be sized or its pages reserved (``ENOSPC``: no room).
        """
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            if st.st_size != size:
                os.ftruncate(fd, size)
            if st.st_blocks * 512 < size:  # holes: reserve the pages (no SIGBUS mid-copy)
                os.posix_fallocate(fd, 0, size)
            key = (st.st_dev, st.st_ino)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            self._forget_unlinked()
            held = self._maps.get(key)
            if held is not None and len(held.mm) >= size:
                os.close(fd)
                return held.pages[:size]
            if held is not None:
                self._drop(key)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
            pages = torch.frombuffer(mm, dtype=torch.uint8)
            self._maps[key] = _Mapping(fd, mm, pages)
            return pages[:size]

    def forget_unlinked(self) -> None:
        """Unmap the files that have no name left (pruned, discarded, replaced as a spare):
        their pages are freed then, not at the next :meth:`open`.  The manager calls this
        before each save's room check and after each local commit."""
        with self._lock:
            self._forget_unlinked()

    def close(self) -> None:
        """Unmap everything (each mapping once no tensor of it is referenced any more)."""
        with self._lock:
            for key in list(self._maps):
                self._drop(key)

    @property
    def nbytes(self) -> int:
        """Bytes mapped now."""
        with self._lock:
            return sum(len(m.mm) for m in self._maps.values())

    def _forget_unlinked(self) -> None:
        for key, m in list(self._maps.items()):
            try:
                gone = os.fstat(m.fd).st_nlink == 0
            except OSError:
                gone = True
            if gone:
                self._drop(key)

    def _drop(self, key: tuple[int, int]) -> None:
        m = self._maps.pop(key)
        del m.pages
        with contextlib.suppress(BufferError):  # a view still referenced: unmapped with it
            m.mm.close()
        with contextlib.suppress(OSError):
            os.close(m.fd)


@dataclass
class StagedFile:
    """A data file whose bytes are in its pages under a temporary name (:func:`stage_file`).

    ``plan``: the file's plan, its blobs' ``data`` now views of those pages (the snapshot:
    the live tensors may change from here on).
    """

    storage: LocalStorage
    tmp: str
    plan: FilePlan

    def finish(self) -> list[WrittenItem]:
        """Upload thread: crc32c of every chunk (read from the pages), then the file gets
        its name (:meth:`LocalStorage.publish`: fsynced, renamed, folder fsynced).

        Raises:
            StorageError: the publish failed (the temporary file is removed).
        """
        pieces, spans = self.plan.pieces()
        crcs = [0] + [crc32c(p) for p in pieces[1:]]
        info = self.storage.publish(self.tmp, self.plan.fname)
        return self.plan.written(info.size, lambda lo, hi: crcs[lo:hi], spans)

    def discard(self) -> None:
        """Remove the temporary file (a failed or abandoned save)."""
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)


def stage_file(storage: LocalStorage, plan: FilePlan, pages: MappedPages, *,
               spare: str | None = None) -> StagedFile:
    """Training thread: copy ``plan``'s header and blobs into the pages of a new file in
    ``storage``'s folder (``spare``: a file to recycle, renamed in when it is still there).
    Returns the staged file, its plan's blobs pointing at the pages.

    Raises:
        OSError: the file could not be made or its pages reserved (``ENOSPC``); nothing is
            left behind.
    """
    tmp = os.path.join(storage.root, plan.fname) + f"{TMP_MARK}{uuid.uuid4().hex[:12]}"
    recycled = False
    if spare is not None:
        try:
            os.rename(spare, tmp)
            recycled = True
        except OSError:
            pass  # taken or gone: a fresh file
    if not recycled:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    try:
        dst = pages.open(tmp, plan.size)
        n = len(plan.header)
        dst[:n].copy_(torch.frombuffer(bytearray(plan.header), dtype=torch.uint8))
        blobs = []
        for b, off in zip(plan.labelled, plan.offsets, strict=True):
            size = b.data.numel()
            view = dst[off:off + size]
            if size:
                view.copy_(b.data)
            blobs.append(view)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    k = 0
    plans = []
    for p in plan.plans:  # the items' blobs are the labelled ones, in the same order
        plans.append(replace(p, blobs=[replace(b, data=blobs[k + i])
                                       for i, b in enumerate(p.blobs)]))
        k += len(p.blobs)
    labelled = [replace(b, data=v) for b, v in zip(plan.labelled, blobs, strict=True)]
    return StagedFile(storage, tmp, replace(plan, plans=plans, labelled=labelled))
