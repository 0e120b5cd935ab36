"""What makes local preconditions hold: the folder lock and the generation of a local file.

**Generation.**  A local object's generation is its file's modification time in
nanoseconds (``st_mtime_ns``; 1 for a file dated at or before 1970, since 0 means
"absent").  :meth:`~xla_ckpt.storage.local.LocalStorage.write_atomic` publishes a
fresh temporary file by ``rename`` (or ``link``), which keeps that file's time, and
:func:`stamp` makes sure, under the folder lock, that the new file's time is later than
the live object's: a replace never gives back a generation the object had before,
even within one tick of the kernel's clock or on a file system that keeps coarse
times (it steps forward until the file system keeps a later time).  Anything else that
modifies a file in place changes its generation too.  Across a delete and a new write the
generation is the new file's own time; a stale one matches again only if the clock went back.

**Folder lock.**  A check of the live generation and the rename that replaces it must
not interleave with another writer of that folder, in this process or another: each
``write_atomic`` and ``delete`` (conditional or not) holds :func:`folder_lock` across
stat + compare + rename/unlink.  The lock is an exclusive ``flock`` on
:data:`LOCK_NAME` in the object's folder, a file that exists only while it is held: its
holder unlinks it before it lets go, and whoever acquires it checks that the name still
points to the file it locked (else it was unlinked meanwhile, and it starts over).  So
no lock file is left in a checkpoint folder after a write (nor holds a deleted folder
up); one left by a killed process is taken over and removed by the next writer there.
:meth:`~xla_ckpt.storage.local.LocalStorage.list` never shows it, and no object may
take its name.  ``flock`` works between processes of one host and, on NFS (where Linux
maps it to a POSIX lock), between hosts; the identity check uses ``stat``, so on a
network file system whose clients cache attributes the lock is as good as that cache.
Where the file system has no locks at all, unconditional writes go on without it and
conditional ones are refused (:func:`folder_lock`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
from typing import Iterator

from xla_ckpt.errors import StorageError

logger = logging.getLogger(__name__)

LOCK_NAME = ".xla_ckpt.lock"
"""The folder lock's file name (see the module docstring); reserved, never an object."""

_STAMP_STEPS_NS = tuple(10 ** k for k in range(11))  # 1 ns ... 10 s: coarser file system times

_NO_LOCKS = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})
"""``flock`` errors of file systems without locks."""

_warned_unlocked = False


def file_generation(st: os.stat_result) -> int:
    """The generation of a local file, from its ``stat``: its mtime in ns, at least 1."""
    return max(st.st_mtime_ns, 1)


def live_generation(path: str) -> int | None:
    """The generation of the file at ``path``; None if there is none (or it is no file)."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return file_generation(st) if os.path.isfile(path) else None


def stamp(tmp: str, after: int | None) -> int:
    """Make ``tmp``'s generation later than ``after`` (the live object's); returns it.

    The file keeps its own time when it is later already; else it gets
    ``max(now, after + step)``, the step growing until the file system keeps a later time.
    Call under the folder lock, right before ``tmp`` is published.
    """
    gen = file_generation(os.stat(tmp))
    if after is None or gen > after:
        return gen
    for step in _STAMP_STEPS_NS:
        want = max(time.time_ns(), after + step)
        os.utime(tmp, ns=(want, want))
        gen = file_generation(os.stat(tmp))
        if gen > after:
            return gen
    raise StorageError(f"{tmp}: the file system keeps no modification time later than "
                       f"{after} ns; its generation cannot change")


@contextlib.contextmanager
def folder_lock(folder: str, *, required: bool) -> Iterator[None]:
    """Hold the exclusive lock of ``folder`` (see the module docstring).

    On a file system without ``flock`` (``ENOLCK``, ``ENOSYS``, ``EOPNOTSUPP``: Lustre
    mounted without ``flock``, NFS without a lock service) a ``required`` lock (a
    precondition depends on it) raises StorageError; otherwise the caller goes on
    without one, as writes did before there was a lock, and a warning says so once.

    Raises:
        FileNotFoundError: the folder does not exist.
        PermissionError / OSError: the lock file cannot be created.
        StorageError: ``required``, and the file system has no locks.
    """
    path = os.path.join(folder, LOCK_NAME)
    fd = _acquire(folder, path, required)
    try:
        yield
    finally:
        if fd is not None:
            try:
                _unlink(path)  # while held: a waiter then finds the name gone and starts over
            finally:
                os.close(fd)


def _acquire(folder: str, path: str, required: bool) -> int | None:
    """The locked descriptor of the lock file ``path`` still has; None: no locks here."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _still_named(fd, path):
                return fd
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_LOCKS:
                raise
            _unlink(path)
            if required:
                raise StorageError(f"{folder}: the file system has no file locks ({e}); "
                                   "if_generation_match cannot be honoured here") from None
            _warn_unlocked(folder, e)
            return None
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # unlinked by its last holder while this one waited: take the new one


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _warn_unlocked(folder: str, e: OSError) -> None:
    global _warned_unlocked
    if not _warned_unlocked:
        _warned_unlocked = True
        logger.warning("%s: the file system has no file locks (%s); local writes go on "
                       "without the folder lock, and conditional ones are refused", folder, e)


def _still_named(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)
