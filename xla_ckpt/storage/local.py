"""Local filesystem backend (a folder on disk, or ``file://`` URIs).

* ``write_atomic``: write to ``<name>.tmp-<random>`` in the same folder, fsync
  the file, ``os.replace`` onto the final name, fsync the folder.  A crash at
  any point leaves either the old object or the new one, never half of one.
* ``read_range``: ``os.preadv`` straight into the caller's buffer (one copy
  from the page cache); :meth:`Storage.read_ranges` runs slices in parallel
  threads (the GIL is released during the syscall).
"""

from __future__ import annotations

import errno
import os
import uuid
from typing import Sequence

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    StorageError,
    StoragePermissionError,
    StorageURIError,
)
from xla_ckpt.storage.base import ObjectInfo, Storage, StorageConfig
from xla_ckpt.storage.uri import parse_uri

TMP_MARK = ".tmp-"


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
        return ObjectInfo(name=name, size=st.st_size, generation=None)

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

    def write_atomic(self, name: str, buffers: Sequence[memoryview | bytes]) -> ObjectInfo:
        path = self._path(name)
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
        return ObjectInfo(name=name, size=size)

    def list(self, prefix: str = "") -> list[str]:
        base = self._path(prefix) if prefix.strip("/") else self.root
        out: list[str] = []
        if os.path.isfile(base):
            return [prefix.strip("/")]
        for dirpath, _dirs, files in os.walk(base):
            for f in files:
                if TMP_MARK in f:
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), self.root)
                out.append(rel.replace(os.sep, "/"))
        return sorted(out)

    def delete(self, name: str) -> None:
        path = self._path(name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except PermissionError as e:
            raise StoragePermissionError(f"{path}: {e.strerror}") from None
        # Remove folders left empty, up to the root.
        folder = os.path.dirname(path)
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
