"""Local filesystem backend (a folder on disk, or ``file://`` URIs).

* ``write_atomic``: write to ``<name>.tmp-<upload id>`` (12 hex digits) in the
  same folder, fsync the file, then -- holding the folder lock -- check the
  precondition, ``os.replace`` onto the final name (``os.link`` for create-only),
  fsync the folder.  A crash at any point leaves either the old object or the new
  one, never half of one; what a killed write leaves keeps its temporary name, which
  :meth:`LocalStorage.list_in_flight` reports (``xla-ckpt ls``/``gc --in-flight``).
* Generations (a file's mtime in ns, later on every replace) and the folder lock
  that makes ``if_generation_match`` hold are :mod:`xla_ckpt.storage.local_lock`'s.
  A read pinned to a generation reads the file that is there (a replaced local file
  stays readable through the descriptor a read opened).
* ``read_range``: ``os.preadv`` straight into the caller's buffer (one copy
  from the page cache); :meth:`Storage.read_ranges` runs slices in parallel
  threads (the GIL is released during the syscall).
"""

from __future__ import annotations

import errno
import os
import re
import uuid
from typing import Iterator, Sequence

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
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path}: no such file") from None
        except PermissionError as e:
            raise StoragePermissionError(f"{path}: {e.strerror}") from None
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

    def _object_path(self, name: str) -> str:
        path = self._path(name)
        if os.path.basename(path) == LOCK_NAME:
            raise ValueError(f"object name {name!r}: {LOCK_NAME} is reserved for the folder lock")
        return path

    def write_atomic(self, name: str, buffers: Sequence[memoryview | bytes], *,
                     if_generation_match: int | None = None) -> ObjectInfo:
        """Write the concatenation of ``buffers`` as ``name`` (see the module docstring).

        ``if_generation_match`` (see :meth:`Storage.write_atomic`) is checked against the
        live file under the folder lock, after the bytes are written and synced.

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
                for buf in buffers:
                    mv = memoryview(buf).cast("B")
                    while len(mv):
                        n = os.write(fd, mv)
                        size += n
                        mv = mv[n:]
                os.fsync(fd)
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
