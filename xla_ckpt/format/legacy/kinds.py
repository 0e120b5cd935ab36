"""Legacy file kinds: input handling, :func:`sniff_format`, zip-archive checks, safetensors reading.

A source is ``bytes`` (or another bytes-like buffer, never copied) or a seekable
binary file object.  :func:`sniff_format` tells a zip-format ``torch.save`` file,
a pre-1.6 one and a safetensors file apart from their first bytes; the zip checks
run before anything in the archive is unpickled (package docstring, point 3).
"""

from __future__ import annotations

import io
import json
import os
import struct
import zipfile
from typing import TYPE_CHECKING, BinaryIO, Literal, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import load_file as st_load_file

from xla_ckpt.errors import CheckpointCorruptError
from xla_ckpt.format.safetensors_layout import MAX_HEADER_BYTES

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

Source = Union[bytes, bytearray, memoryview, BinaryIO]
Kind = Literal["torch_zip", "torch_legacy", "safetensors"]

_TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


class _BufferFile(io.RawIOBase):
    """A read-only, seekable file over a bytes-like buffer, without copying it."""

    def __init__(self, buf: bytearray | memoryview) -> None:
        super().__init__()
        self._view = memoryview(buf).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: WriteableBuffer) -> int:
        out = memoryview(b).cast("B")
        n = min(len(out), len(self._view) - self._pos)
        if n <= 0:
            return 0
        out[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


def _as_file(source: Source) -> tuple[BinaryIO, int]:
    """(seekable binary file, size in bytes) for bytes or a file object; never copies a buffer."""
    if isinstance(source, bytes):
        f: BinaryIO = io.BytesIO(source)  # shares the bytes object
    elif isinstance(source, (bytearray, memoryview)):
        f = io.BufferedReader(_BufferFile(source), buffer_size=1 << 20)
    else:
        f = source
    try:
        f.seek(0, io.SEEK_END)
        size = f.tell()
        f.seek(0)
    except (AttributeError, OSError, ValueError) as e:
        raise TypeError(f"legacy source must be bytes or a seekable binary file, not "
                        f"{type(source).__name__} ({e})") from None
    return f, size


def sniff_format(prefix: bytes, *, where: str = "<bytes>", size: int | None = None) -> Kind:
    """Which kind of file starts with ``prefix`` (its first >= 16 bytes).

    Tested in this order: a zip-format ``torch.save`` file (``PK\\x03\\x04``); a
    safetensors file (an 8-byte little-endian header length ``N`` with
    ``0 < N <= MAX_HEADER_BYTES`` and ``8 + N <= size`` when ``size`` (bytes) is given,
    then ``{`` at byte 8); a pre-1.6 ``torch.save`` pickle (``\\x80`` then a protocol
    byte <= 5).  Safetensors comes before the pickle test because a header length of
    128, 384, 640, ... bytes starts with those very two bytes; a pickle never has ``{``
    at byte 8 with a plausible length before it (``torch.save`` writes its magic number
    there).  Anything else with ``{`` at byte 8 is taken for a safetensors file whose
    header length is impossible, which its own check then names.

    Raises:
        CheckpointCorruptError: not a torch.save, fairseq or safetensors file.
    """
    if prefix[:4] == b"PK\x03\x04":
        return "torch_zip"
    if len(prefix) >= 9 and prefix[8:9] == b"{":
        (n,) = struct.unpack("<Q", prefix[:8])
        if 0 < n <= MAX_HEADER_BYTES and (size is None or 8 + n <= size):
            return "safetensors"  # the header itself is checked on load
    if prefix[:1] == b"\x80" and len(prefix) >= 2 and prefix[1] <= 5:
        return "torch_legacy"
    if len(prefix) >= 9 and prefix[8:9] == b"{":
        return "safetensors"  # an impossible header length: the safetensors check names it
    raise CheckpointCorruptError(
        f"{where}: not a torch.save/fairseq .pt file or a safetensors file (starts with "
        f"{bytes(prefix[:8])!r}); pass an xla_ckpt checkpoint folder, a .pt or a .safetensors file")


def _check_zip(f: BinaryIO, size: int, *, where: str) -> None:
    try:
        with zipfile.ZipFile(f) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, struct.error) as e:
        raise CheckpointCorruptError(f"{where}: not a valid zip-format torch file ({e})") from None
    finally:
        f.seek(0)
    names = [i.filename for i in infos]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise CheckpointCorruptError(f"{where}: zip entry {dup!r} appears more than once; "
                                     "refusing an ambiguous archive")
    declared = sum(i.file_size for i in infos)
    if declared > size:
        raise CheckpointCorruptError(
            f"{where}: zip entries declare {declared} uncompressed bytes in a {size}-byte file; "
            "torch.save never compresses, so this archive is malformed or hostile")
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        raise CheckpointCorruptError(f"{where}: this is a TorchScript archive, not a checkpoint; "
                                     "load it with torch.jit.load in a trusted process")


def _zip_data_pkl(f: BinaryIO, *, where: str) -> bytes:
    """The ``data.pkl`` record exactly as torch.load will read it (torch's own zip reader)."""
    try:
        reader = torch._C.PyTorchFileReader(f)
        data = reader.get_record("data.pkl")
    except (RuntimeError, ValueError, OSError) as e:
        raise CheckpointCorruptError(f"{where}: unreadable zip-format torch file "
                                     f"({_first_line(e)})") from None
    finally:
        f.seek(0)
    return bytes(data)


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def load_safetensors_file(source: Source, *, where: str = "<bytes>"
                          ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and ``__metadata__`` of a safetensors file (the safetensors library validates it).

    Raises:
        CheckpointCorruptError: malformed header, offsets or lengths (names ``where``).
    """
    f, size = _as_file(source)
    prefix = f.read(8)
    if len(prefix) < 8:
        raise CheckpointCorruptError(f"{where}: {size}-byte file is too short for safetensors")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise CheckpointCorruptError(f"{where}: safetensors header length {n} is impossible for a "
                                     f"{size}-byte file")
    try:
        header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"{where}: safetensors header is not valid JSON ({e})") \
            from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    f.seek(0)
    path = getattr(f, "name", None)
    try:
        if isinstance(path, str) and os.path.isfile(path):
            tensors = st_load_file(path)  # mmap: no second copy of the file in memory
        else:
            tensors = st_load(f.read())
    except (SafetensorError, ValueError, RuntimeError, TypeError, KeyError) as e:
        raise CheckpointCorruptError(f"{where}: malformed safetensors file ({_first_line(e)})") \
            from None
    meta = {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}
    return tensors, meta
