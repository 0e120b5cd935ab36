"""Local filesystem backend (a folder on disk, or ``file://`` URIs).

* ``write_atomic``: write to ``<name>.tmp-<upload id>`` (12 hex digits) in the
  same folder, fsync the file, then -- holding the folder lock -- check the
  precondition, ``os.replace`` onto the final name (``os.link`` for create-only),
  fsync the folder.  A crash at any point leaves either the old object or the new
  one, never half of one; what a killed write leaves keeps its temporary name, which
  :meth:`LocalStorage.list_in_flight` reports (``xla-ckpt ls``/``gc --in-flight``).
  The bytes go out in large sequential writes (:data:`WRITE_GROUP_BYTES`; small
  buffers gathered into one, :data:`GATHER_BELOW_BYTES`);
  on Linux the write-back of every :data:`WRITEBACK_WINDOW_BYTES` already written
  is started (``sync_file_range``) by a helper thread while the next window is being
  written, so the closing ``fsync`` only waits for the tail.  That ``fsync`` stays
  the durability point: nothing is renamed before it returned.
* Generations (a file's mtime in ns, later on every replace) and the folder lock
  that makes ``if_generation_match`` hold are :mod:`xla_ckpt.storage.local_lock`'s.
  A read pinned to a generation reads the file that is there (a replaced local file
  stays readable through the descriptor a read opened).
* ``read_range``: ``os.preadv`` straight into the caller's buffer (one copy
  from the page cache); :meth:`Storage.read_ranges` runs slices in parallel
  threads (the GIL is released during the syscall).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import mmap
import os
import re
import threading
import uuid
from collections import deque
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    StorageError,
    StoragePermissionError,
    StorageURIError,
)
from xla_ckpt.storage.base import (
    InFlightObject,
    ObjectInfo,
    Storage,
    StorageConfig,
    check_generation_match,
    join,
    precondition_failed,
)
from xla_ckpt.storage.local_lock import (
    LOCK_NAME,
    file_generation,
    folder_lock,
    live_generation,
    stamp,
)
from xla_ckpt.storage.uri import parse_uri

TMP_MARK = ".tmp-"
"""Temporary files of unfinished writes carry this in their name; :meth:`LocalStorage.list`
hides them."""

IN_FLIGHT_NAME = re.compile(r"(?P<target>.+)\.tmp-(?P<upload_id>[0-9a-f]{12})")
"""The full file name of a temporary file this backend writes: ``<target>.tmp-<upload id>``."""

_NO_LINK = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK})
"""``link`` errors of file systems without hard links: create-only falls back to a rename."""


class LocalStorage(Storage):
    """Storage rooted at a local folder.  See the module docstring.

    Args:
        uri: a local path (relative, absolute, ``~``) or ``file:///abs/path``, as
            :func:`~xla_ckpt.storage.uri.parse_uri` accepts it.

    Raises:
        StorageURIError: ``uri`` is a ``gs://`` URI, another scheme, or a local path that looks
            like a mangled URI (``gs:/b/x``); no folder is created.
    """

    def __init__(self, uri: str, config: StorageConfig | None = None) -> None:
        parsed = parse_uri(uri)
        if not parsed.is_local:
            raise StorageURIError(f"{uri!r}: LocalStorage needs a local path or file:///ABS/PATH; "
                                  "open gs:// URIs with xla_ckpt.storage.open_storage", uri=uri)
        super().__init__(os.path.abspath(os.path.expanduser(parsed.path)), config)
        self.root = self.uri

    lists_in_flight = True
    memory_bound_reads = True

    def _path(self, name: str) -> str:
        name = name.strip("/")
        if not name:
            return self.root
        parts = name.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"object name {name!r} must not contain empty, '.' or '..' segments")
        return os.path.join(self.root, *parts)

    def stat(self, name: str) -> ObjectInfo:
        path = self._path(name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path}: no such file") from None
        except PermissionError as e:
            raise StoragePermissionError(f"{path}: {e.strerror}") from None
        if not os.path.isfile(path):
            raise CheckpointNotFoundError(f"{path}: not a file")
        return ObjectInfo(name=name, size=st.st_size, generation=file_generation(st))

    def read_range(self, name: str, offset: int, out: memoryview,
                   generation: int | None = None) -> None:
        path = self._path(name)
        want = len(out)
        fd = _open_for_reading(path)
        try:
            got = 0
            while got < want:
                n = os.preadv(fd, [out[got:]], offset + got)
                if n == 0:
                    size = os.fstat(fd).st_size
                    raise CheckpointCorruptError(
                        f"{path}: truncated: expected at least {offset + want} bytes, file has "
                        f"{size} bytes")
                got += n
        except OSError as e:
            raise StorageError(f"{path}: read failed at byte {offset + got}: {e}") from e
        finally:
            os.close(fd)

    def map_private(self, name: str, size: int) -> mmap.mmap:
        """A private, writable memory map of the first ``size`` bytes of file ``name``.

        Pages come straight from the page cache; a write into the map copies that
        page into this process and never reaches the file.  Bytes of a page not
        yet written follow the file: another process that writes the file in
        place (this backend never does: it replaces files) changes them, and one
        that truncates it makes touching them raise ``SIGBUS``.

        Raises:
            CheckpointNotFoundError: no such file.
            CheckpointCorruptError: the file is shorter than ``size`` bytes.
            StoragePermissionError / StorageError: it cannot be opened or mapped.
        """
        path = self._path(name)
        fd = _open_for_reading(path)
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise CheckpointCorruptError(f"{path}: truncated: expected at least {size} "
                                             f"bytes, file has {actual} bytes")
            return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise StorageError(f"{path}: cannot map {size} bytes: {e}") from e
        finally:
            os.close(fd)

    def _object_path(self, name: str) -> str:
        path = self._path(name)
        if os.path.basename(path) == LOCK_NAME:
            raise ValueError(f"object name {name!r}: {LOCK_NAME} is reserved for the folder lock")
        return path

    def write_atomic(self, name: str, buffers: Sequence[memoryview | bytes], *,
                     if_generation_match: int | None = None,
                     metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        """Write the concatenation of ``buffers`` as ``name`` (see the module docstring).

        ``if_generation_match`` (see :meth:`Storage.write_atomic`) is checked against the
        live file under the folder lock, after the bytes are written and synced.
        ``metadata`` goes into the extended attribute :data:`METADATA_XATTR` of the file
        before it gets its name (JSON), where the file system keeps user attributes; where
        it does not, the file is written without.

        Raises:
            PreconditionFailedError: it did not hold; the temporary file is removed.
            StoragePermissionError / StorageError: the write failed.
        """
        expected = check_generation_match(if_generation_match)
        path = self._object_path(name)
        folder = os.path.dirname(path)
        try:
            os.makedirs(folder, exist_ok=True)
        except PermissionError as e:
            raise StoragePermissionError(f"{folder}: {e.strerror}") from None
        tmp = f"{path}{TMP_MARK}{uuid.uuid4().hex[:12]}"
        size = 0
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                size = _write_all(fd, buffers)
                if metadata:
                    _set_metadata(fd, metadata)
                os.fsync(fd)  # the durability point: whatever writeback started, wait for all
            finally:
                os.close(fd)
            with folder_lock(folder, required=expected is not None):
                live = live_generation(path)
                if expected is not None and live != (expected or None):
                    raise precondition_failed(self.url(name), name.strip("/"), "written", expected,
                                              live)
                gen = stamp(tmp, live)
                if expected == 0:
                    self._create(tmp, path, name)
                else:
                    os.replace(tmp, path)
            _fsync_dir(folder)
        except BaseException as e:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            if isinstance(e, PermissionError):
                raise StoragePermissionError(f"{path}: {e.strerror}") from None
            if isinstance(e, OSError) and not isinstance(e, StorageError):
                raise StorageError(f"{path}: write failed: {e}") from e
            raise
        return ObjectInfo(name=name, size=size, generation=gen)

    def publish(self, tmp: str, name: str) -> ObjectInfo:
        """Give the finished file ``tmp`` (in ``name``'s folder, written by the caller, e.g.
        through a mapping: :mod:`xla_ckpt.io.mapped_writer`) the name ``name``, as
        :meth:`write_atomic` ends: fsynced, a generation later than a file it replaces,
        renamed, the folder fsynced.

        Raises:
            StorageError: it failed; ``tmp`` is removed.
        """
        path = self._object_path(name)
        folder = os.path.dirname(path)
        try:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            with folder_lock(folder, required=False):
                gen = stamp(tmp, live_generation(path))
                os.replace(tmp, path)
            _fsync_dir(folder)
        except BaseException as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if isinstance(e, OSError) and not isinstance(e, StorageError):
                raise StorageError(f"{path}: publishing {tmp} failed: {e}") from e
            raise
        return ObjectInfo(name=name, size=size, generation=gen)

    def _create(self, tmp: str, path: str, name: str) -> None:
        """Publish ``tmp`` as ``path`` only if no file has that name (under the folder lock)."""
        try:
            os.link(tmp, path)  # fails if ``path`` exists, even made by a writer without the lock
        except FileExistsError:
            raise precondition_failed(self.url(name), name.strip("/"), "written", 0,
                                      live_generation(path)) from None
        except OSError as e:
            if e.errno not in _NO_LINK:
                raise
            os.replace(tmp, path)  # no hard links here: the lock keeps our writers out
            return
        os.unlink(tmp)

    def _files(self, prefix: str) -> Iterator[tuple[str, str]]:
        """(folder relative to the root, file name) of every file under folder ``prefix``."""
        base = self._path(prefix) if prefix.strip("/") else self.root
        for dirpath, _dirs, files in os.walk(base):
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            for f in files:
                yield ("" if rel == "." else rel), f

    def list_in_flight(self, prefix: str = "") -> list[InFlightObject]:
        """Temporary files of unfinished writes under folder ``prefix``, sorted by name.

        Only names of the form :data:`IN_FLIGHT_NAME` are reported (``foo.tmp``, another
        tool's ``.tmp-1`` are not); each with its size and modification time.
        """
        out = []
        for folder, f in self._files(prefix):
            m = IN_FLIGHT_NAME.fullmatch(f)
            if m is None:
                continue
            try:
                st = os.stat(os.path.join(self.root, *folder.split("/"), f))
            except FileNotFoundError:  # the write finished (or was cleaned up) meanwhile
                continue
            out.append(InFlightObject(name=join(folder, f), target=join(folder, m["target"]),
                                      upload_id=m["upload_id"], size=st.st_size,
                                      created_unix_s=st.st_mtime))
        return sorted(out, key=lambda o: o.name)

    def list_in_subfolders(self, prefix: str, name: str) -> list[ObjectInfo]:
        """:meth:`Storage.list_in_subfolders` in one scan of folder ``prefix`` (a ``stat``
        and, where kept, the :data:`METADATA_XATTR` attribute of each file found)."""
        base = self._path(prefix) if prefix.strip("/") else self.root
        try:
            folders = sorted(e.name for e in os.scandir(base) if e.is_dir())
        except (FileNotFoundError, NotADirectoryError):
            return []
        except PermissionError as e:
            raise StoragePermissionError(f"{base}: {e.strerror}") from None
        out = []
        for folder in folders:
            path = os.path.join(base, folder, name)
            try:
                st = os.stat(path)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if not os.path.isfile(path):
                continue
            out.append(ObjectInfo(f"{folder}/{name}", st.st_size, file_generation(st),
                                  _get_metadata(path)))
        return out

    def list(self, prefix: str = "") -> list[str]:
        if prefix.strip("/") and os.path.isfile(self._path(prefix)):
            return [prefix.strip("/")]
        return sorted(join(folder, f) for folder, f in self._files(prefix)
                      if TMP_MARK not in f and f != LOCK_NAME)

    def delete(self, name: str, *, if_generation_match: int | None = None) -> None:
        """Delete ``name`` under the folder lock; a missing object is not an error.

        Raises:
            PreconditionFailedError: ``if_generation_match`` is given and the live file
                is another generation; it is kept.
        """
        expected = check_generation_match(if_generation_match)
        path = self._object_path(name)
        folder = os.path.dirname(path)
        if not os.path.lexists(path):
            return
        try:
            with folder_lock(folder, required=expected is not None):
                if expected is not None:
                    live = live_generation(path)
                    if live is None:
                        return
                    if live != expected:
                        raise precondition_failed(self.url(name), name.strip("/"), "deleted",
                                                  expected, live)
                os.unlink(path)
        except FileNotFoundError:  # deleted (with its folder) by another process meanwhile
            return
        except PermissionError as e:
            raise StoragePermissionError(f"{path}: {e.strerror}") from None
        # Remove folders left empty, up to the root.
        while folder.startswith(self.root) and folder != self.root:
            try:
                os.rmdir(folder)
            except OSError:
                break
            folder = os.path.dirname(folder)


WRITE_GROUP_BYTES = 8 * 1024 * 1024
"""``write_atomic`` hands the kernel up to this many bytes per ``write`` call."""

GATHER_BELOW_BYTES = 64 * 1024
"""Buffers smaller than this are gathered into one ``write`` (see :func:`_write_all`)."""

GATHER_BUFFER_BYTES = 1024 * 1024
"""Size of the bounce buffer that gathers small buffers."""

WRITEBACK_WINDOW_BYTES = 32 * 1024 * 1024
"""Write-back of the file is started in windows of this many bytes while the next is written."""

WRITEBACK_WINDOWS_AHEAD = 2
"""The writer waits until write-back of window ``k`` was started before it writes past window
``k + WRITEBACK_WINDOWS_AHEAD`` (bounds the dirty pages of one write)."""

_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start write-out of dirty pages in the range


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing bytes ``[offset, offset + nbytes)`` of ``fd`` to disk.

    Advisory: errors are ignored (the ``fsync`` that follows is what makes the data durable
    and reports failures).  ctypes releases the GIL for the call.
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class _Writeback:
    """Starts write-back of finished windows of one file on a helper thread.

    :meth:`wrote` (writer thread) reports how many bytes are written so far; each full
    :data:`WRITEBACK_WINDOW_BYTES` window is handed to the helper, which calls
    :func:`_start_writeback` for it.  Before handing over window ``k`` the writer waits
    until the helper has started window ``k - WRITEBACK_WINDOWS_AHEAD``.  The helper
    thread starts with the first full window (small files never start one) and is
    joined by :meth:`close`, before the caller's ``fsync``.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._submitted = 0
        self._cond = threading.Condition()
        self._todo: deque[tuple[int, int] | None] = deque()
        self._started = 0  # windows whose write-back the helper has started
        self._windows = 0  # windows handed over
        self._thread: threading.Thread | None = None

    def wrote(self, upto: int) -> None:
        while upto - self._submitted >= WRITEBACK_WINDOW_BYTES:
            if _sync_file_range is None:
                return
            with self._cond:
                while self._started <= self._windows - WRITEBACK_WINDOWS_AHEAD:
                    self._cond.wait()
                self._todo.append((self._submitted, WRITEBACK_WINDOW_BYTES))
                self._windows += 1
                self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="xla_ckpt-writeback",
                                                daemon=True)
                self._thread.start()
            self._submitted += WRITEBACK_WINDOW_BYTES

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._todo:
                    self._cond.wait()
                job = self._todo.popleft()
            if job is None:
                return
            try:
                _start_writeback(self._fd, *job)
            finally:
                with self._cond:
                    self._started += 1
                    self._cond.notify_all()

    def close(self) -> None:
        if self._thread is None:
            return
        with self._cond:
            self._todo.append(None)
            self._cond.notify_all()
        self._thread.join()
        self._thread = None


def _write_fully(fd: int, mv: memoryview) -> None:
    """``os.write`` every byte of ``mv`` (retrying short writes)."""
    while len(mv):
        n = os.write(fd, mv)
        mv = mv[n:]


def _write_all(fd: int, buffers: Iterable[memoryview | bytes]) -> int:
    """Write the concatenation of ``buffers`` to ``fd`` at its position; returns bytes written.

    Large buffers go to the kernel as they are, in ``write`` calls of
    :data:`WRITE_GROUP_BYTES`; buffers under :data:`GATHER_BELOW_BYTES` (biases, norms,
    scalars: thousands in a model's state) are gathered into one bounce buffer of
    :data:`GATHER_BUFFER_BYTES` first, so they cost one ``write``, not one each.
    ``buffers`` is taken one at a time, in order (a lazy sequence may compute each just
    before it is needed); write-back of finished windows starts while the next ones are
    written (:class:`_Writeback`).
    """
    wb = _Writeback(fd)
    size = 0
    bounce: bytearray | None = None
    held = 0  # bytes gathered in ``bounce``

    def flush() -> None:
        nonlocal held, size
        if held:
            assert bounce is not None  # held > 0 only after gathering into it
            _write_fully(fd, memoryview(bounce)[:held])
            size += held
            held = 0
            wb.wrote(size)

    try:
        for buf in buffers:
            mv = memoryview(buf).cast("B")
            n = len(mv)
            if not n:
                continue
            if n < GATHER_BELOW_BYTES:
                if held + n > GATHER_BUFFER_BYTES:
                    flush()
                if bounce is None:
                    bounce = bytearray(GATHER_BUFFER_BYTES)
                bounce[held:held + n] = mv
                held += n
                continue
            flush()
            for i in range(0, n, WRITE_GROUP_BYTES):
                piece = mv[i:i + WRITE_GROUP_BYTES]
                _write_fully(fd, piece)
                size += len(piece)
                wb.wrote(size)
        flush()
    finally:
        wb.close()
    return size


METADATA_XATTR = "user.xla_ckpt.metadata"
"""Extended attribute holding an object's custom metadata (JSON), where the file system
keeps user attributes (ext4, xfs, btrfs, tmpfs since Linux 6.6)."""


def _set_metadata(fd: int, metadata: Mapping[str, str]) -> None:
    """Store ``metadata`` on the open file ``fd``; a file system without user attributes
    (or a platform without ``os.setxattr``) keeps none, which readers allow for."""
    setxattr = getattr(os, "setxattr", None)
    if setxattr is None:
        return
    try:
        setxattr(fd, METADATA_XATTR, json.dumps(dict(metadata), sort_keys=True).encode())
    except OSError as e:
        if e.errno not in _NO_XATTR:
            raise


def _get_metadata(path: str) -> dict[str, str] | None:
    """The metadata :func:`_set_metadata` stored on ``path``; None if none (or unreadable)."""
    getxattr = getattr(os, "getxattr", None)
    if getxattr is None:
        return None
    try:
        doc = json.loads(getxattr(path, METADATA_XATTR))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    return {str(k): str(v) for k, v in doc.items()}


_NO_XATTR = frozenset({errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EPERM,
                       errno.E2BIG, errno.ENOSPC})
"""``setxattr`` errors of file systems that keep no (or no more) user attributes."""


def _open_for_reading(path: str) -> int:
    """``os.open(path, O_RDONLY)`` with the backend's errors (not found, permission)."""
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such file") from None
    except PermissionError as e:
        raise StoragePermissionError(f"{path}: {e.strerror}") from None


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems refuse fsync on folders
        if e.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)
