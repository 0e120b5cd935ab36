"""Where a DCP tensor chunk's raw bytes are inside its ``torch.save`` zip, found by byte range.

DCP's ``FileSystemWriter`` writes each tensor chunk with ``torch.save(tensor, stream)`` into a
``.distcp`` file at the ``(offset, length)`` its ``_StorageInfo`` records.  That range is a
zip archive (torch's ``PyTorchStreamWriter``: every member *stored*, uncompressed, data
aligned to 64 bytes) holding ``<prefix>/data.pkl`` (a tiny pickle calling
``torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, ...)``) and the
storage's raw bytes as ``<prefix>/data/<key>``.

:func:`locate_tensor_member` opens the zip through a ranged reader (two small requests in
the usual case: the last 2 KiB for the central directory, the first 2 KiB for ``data.pkl``
and the data member's local header), reads ``data.pkl`` with the allow-list unpickler
(only the rebuild functions, storage types, dtypes and ``OrderedDict``: inert), checks it
against what the ``.metadata`` says (dtype, sizes), checks the member is stored
uncompressed and unencrypted with the size the storage needs, and returns where the
storage's first byte is (:class:`TensorMember`).  A reader can then fetch any sub-box of the
chunk by byte range; the zip's CRC-32 of the member checks a whole-member read.

Pure: the caller's ``read(offset, length)`` does the I/O.
"""

from __future__ import annotations

import collections
import io
import math
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, Callable

import torch

from xla_ckpt.errors import CheckpointCorruptError
from xla_ckpt.format.dcp.unpickle import allow_list_loads
from xla_ckpt.format.dtypes import dtype_name, itemsize

#: ``read(offset, length) -> bytes``: bytes ``[offset, offset + length)`` of one zip (a chunk's
#: byte range), offsets relative to the zip's first byte.
RangeReader = Callable[[int, int], bytes]

#: Bytes fetched per request while walking the zip structure (tail, head).
PREFETCH_BYTES = 2048

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # signature .. extra field length: 30 bytes
_LOCAL_SIG = b"PK\x03\x04"


@dataclass(frozen=True)
class TensorMember:
    """Where one chunk's tensor bytes are in its zip, and how to view them.

    Attributes:
        data_offset: bytes from the zip's first byte to the storage's first byte.
        nbytes: the storage's length in bytes (the member's size).
        crc32: the zip's CRC-32 of the member (checks a whole-member read).
        dtype: the tensor's dtype (equal to the ``.metadata``'s).
        sizes: the tensor's shape (equal to the chunk's sizes).
        stride: its strides, in elements.
        storage_offset: its first element's index in the storage (elements).
    """

    data_offset: int
    nbytes: int
    crc32: int
    dtype: torch.dtype
    sizes: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    @property
    def contiguous(self) -> bool:
        """Row-major contiguous: element ``i`` of the chunk is storage element
        ``storage_offset + i`` (so any box is a few contiguous byte ranges)."""
        expect = 1
        for size, stride in zip(reversed(self.sizes), reversed(self.stride), strict=True):
            if size != 1 and stride != expect:
                return False
            expect *= size
        return True


class _RangedView(io.RawIOBase):
    """A read-only file over ``[0, length)`` of a ranged reader, caching what it fetched."""

    def __init__(self, read: RangeReader, length: int, prefetch: int) -> None:
        super().__init__()
        self._read = read
        self._length = length
        self._prefetch = prefetch
        self._pos = 0
        self._pieces: list[tuple[int, bytes]] = []
        tail = min(length, prefetch)
        self._fetch(length - tail, tail)

    def _fetch(self, start: int, n: int) -> bytes:
        data = bytes(self._read(start, n)) if n else b""
        if len(data) != n:
            raise CheckpointCorruptError(f"short read: {len(data)} of {n} bytes at {start}")
        self._pieces.append((start, data))
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        pos = base + offset
        if pos < 0:
            raise OSError("seek before the start of the chunk")
        self._pos = pos
        return pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = min(len(out), self._length - self._pos)
        if n <= 0:
            return 0
        data = self.get(self._pos, n)
        out[:n] = data
        self._pos += n
        return n

    def get(self, start: int, n: int) -> bytes:
        """Bytes ``[start, start + n)`` (``n`` clipped to the end), from the cache if held."""
        n = max(0, min(n, self._length - start))
        if n == 0 or start < 0:
            return b""
        for s, data in self._pieces:
            if s <= start and start + n <= s + len(data):
                return data[start - s:start - s + n]
        fetch = min(self._length - start, max(n, self._prefetch))
        return self._fetch(start, fetch)[:n]


@dataclass(frozen=True)
class _StorageRef:
    dtype: torch.dtype
    key: str
    numel: int  # elements of ``dtype``


@dataclass(frozen=True)
class _TensorRecord:
    storage: _StorageRef
    dtype: torch.dtype
    storage_offset: int
    sizes: tuple[int, ...]
    stride: tuple[int, ...]


class _StorageType:
    """Stand-in for a ``torch.<X>Storage`` class named in a persistent id."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)) or not all(type(x) is int and x >= 0 for x in v):
        raise ValueError(f"expected a tuple of integers >= 0, got {v!r}")
    return tuple(v)


def _check_extras(requires_grad: Any, hooks: Any, metadata: Any) -> None:
    if not isinstance(requires_grad, bool) or not isinstance(hooks, dict) or hooks or \
            metadata not in (None, {}):
        raise ValueError("tensor with backward hooks or metadata (DCP saves plain tensors)")


def _rebuild_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                hooks: Any, metadata: Any = None) -> _TensorRecord:
    if not isinstance(storage, _StorageRef) or type(storage_offset) is not int:
        raise ValueError("_rebuild_tensor_v2 without a storage")
    _check_extras(requires_grad, hooks, metadata)
    return _TensorRecord(storage, storage.dtype, storage_offset, _ints(size), _ints(stride))


def _rebuild_v3(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                hooks: Any, dtype: Any, metadata: Any = None) -> _TensorRecord:
    if not isinstance(storage, _StorageRef) or type(storage_offset) is not int or \
            not isinstance(dtype, torch.dtype):
        raise ValueError("_rebuild_tensor_v3 without a storage or dtype")
    _check_extras(requires_grad, hooks, metadata)
    return _TensorRecord(storage, dtype, storage_offset, _ints(size), _ints(stride))


def _data_pkl_globals() -> dict[str, Any]:
    allowed: dict[str, Any] = {
        "torch._utils._rebuild_tensor_v2": _rebuild_v2,
        "torch._utils._rebuild_tensor_v3": _rebuild_v3,
        "collections.OrderedDict": collections.OrderedDict,
        "torch.storage.UntypedStorage": _StorageType(torch.uint8),
        "torch.UntypedStorage": _StorageType(torch.uint8),
    }
    for dtype, name in torch.storage._dtype_to_storage_type_map().items():
        if dtype_name(dtype).startswith("q"):
            continue  # quantized storages: never a DCP chunk
        allowed[f"torch.{name}"] = _StorageType(dtype)
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            allowed[f"torch.{name}"] = value
    return allowed


_DATA_PKL_GLOBALS = _data_pkl_globals()


def _persistent_load(pid: Any) -> _StorageRef:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")
            and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)
            and isinstance(pid[3], str) and type(pid[4]) is int and pid[4] >= 0):
        raise ValueError(f"unexpected persistent id {pid!r}")
    return _StorageRef(pid[1].dtype, pid[2], pid[4])


def locate_tensor_member(read: RangeReader, length: int, *, where: str, dtype: torch.dtype,
                         sizes: tuple[int, ...], prefetch_bytes: int = PREFETCH_BYTES
                         ) -> TensorMember:
    """Find the raw storage bytes of the one tensor a ``torch.save`` zip of ``length`` bytes holds.

    Args:
        read: ranged reader over the zip (offsets relative to its first byte).
        length: the zip's length in bytes (the chunk's ``_StorageInfo.length``).
        where: file and key, named in every error.
        dtype / sizes: what the ``.metadata`` promises for this chunk; checked.
        prefetch_bytes: bytes per structure request (the tail, then the head).

    Returns:
        :class:`TensorMember` (offsets relative to the zip's first byte).

    Raises:
        UnsafePickleError: ``data.pkl`` names a global outside its allow-list.
        CheckpointCorruptError: not a zip, no/ambiguous ``data.pkl``, a member compressed or
            encrypted or out of the range, dtype/sizes differing from the ``.metadata``, or a
            storage too small for its sizes and strides (each names ``where``).
    """
    def fail(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{where}: {what}")

    view = _RangedView(read, length, prefetch_bytes)
    try:
        zf = zipfile.ZipFile(view)
        infos = {}
        for info in zf.infolist():
            if info.filename in infos:
                raise fail(f"zip member {info.filename!r} appears twice; refusing an ambiguous "
                           "archive")
            infos[info.filename] = info
        pkls = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise fail(f"the chunk's byte range is not one torch.save archive ({len(pkls)} "
                       "data.pkl records)")
        prefix = pkls[0][:-len("data.pkl")]
        pkl_info = infos[pkls[0]]
        _check_stored(pkl_info, fail)
        if pkl_info.file_size > 1 << 20:
            raise fail(f"data.pkl of {pkl_info.file_size} bytes is too large for one tensor")
        pkl = zf.read(pkl_info)  # checks its CRC-32
        cd_start = zf.start_dir
    except CheckpointCorruptError as e:
        if str(e).startswith(where):
            raise
        raise fail(str(e)) from None
    except Exception as e:  # noqa: BLE001 - zipfile raises many types on hostile bytes
        raise fail(f"the chunk's byte range is not a readable torch.save zip "
                   f"({type(e).__name__}: {e})") from None

    rec = allow_list_loads(pkl, allowed=_DATA_PKL_GLOBALS, where=f"{where} (data.pkl)",
                           what="torch.save tensor record", persistent_load=_persistent_load)
    if not isinstance(rec, _TensorRecord):
        raise fail(f"the chunk holds a {type(rec).__name__}, not one tensor")
    if rec.dtype != dtype:
        raise fail(f"the chunk's tensor is {dtype_name(rec.dtype)} but the .metadata says "
                   f"{dtype_name(dtype)}")
    if rec.sizes != tuple(sizes):
        raise fail(f"the chunk's tensor has shape {rec.sizes} but the .metadata says sizes "
                   f"{tuple(sizes)}")
    if len(rec.stride) != len(rec.sizes):
        raise fail(f"stride {rec.stride} does not match shape {rec.sizes}")
    member = infos.get(f"{prefix}data/{rec.storage.key}")
    if member is None:
        raise fail(f"the zip has no member data/{rec.storage.key} for the tensor's storage")
    _check_stored(member, fail)
    storage_bytes = rec.storage.numel * itemsize(rec.storage.dtype)
    if member.file_size != storage_bytes:
        raise fail(f"member {member.filename} holds {member.file_size} bytes but the storage "
                   f"needs {storage_bytes}")
    item = itemsize(dtype)
    if storage_bytes % item:
        raise fail(f"a {storage_bytes}-byte storage is not a whole number of {dtype_name(dtype)}")
    if math.prod(rec.sizes):
        reach = sum((s - 1) * st for s, st in zip(rec.sizes, rec.stride, strict=True))
        extent = rec.storage_offset + reach + 1
        if extent * item > storage_bytes:
            raise fail(f"shape {rec.sizes}, stride {rec.stride} and storage offset "
                       f"{rec.storage_offset} reach element {extent - 1} of a storage of "
                       f"{storage_bytes // item}")
    header = view.get(member.header_offset, _LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size:
        raise fail(f"member {member.filename}'s local header is cut off")
    sig, _ver, flags, method, _t, _d, _crc, _csize, _usize, nlen, xlen = _LOCAL_HEADER.unpack(
        header)
    name = view.get(member.header_offset + _LOCAL_HEADER.size, nlen)
    if sig != _LOCAL_SIG or method != zipfile.ZIP_STORED or flags & 0x1 or \
            name != member.filename.encode():
        raise fail(f"member {member.filename}'s local header does not match the central "
                   "directory (compressed, encrypted or not the same member)")
    data_offset = member.header_offset + _LOCAL_HEADER.size + nlen + xlen
    if data_offset + member.file_size > min(cd_start, length):
        raise fail(f"member {member.filename} ({member.file_size} bytes at {data_offset}) runs "
                   f"past the end of the chunk's zip ({length} bytes)")
    return TensorMember(data_offset, member.file_size, member.CRC, dtype, rec.sizes,
                        rec.stride, rec.storage_offset)


def _check_stored(info: zipfile.ZipInfo, fail: Callable[[str], CheckpointCorruptError]) -> None:
    if info.compress_type != zipfile.ZIP_STORED:
        raise fail(f"zip member {info.filename} is compressed (method {info.compress_type}); "
                   "torch.save stores members uncompressed, so its bytes cannot be read by "
                   "range. Re-save the checkpoint with torch.distributed.checkpoint")
    if info.flag_bits & 0x1:
        raise fail(f"zip member {info.filename} is encrypted")
    if info.compress_size != info.file_size:
        raise fail(f"zip member {info.filename} declares {info.compress_size} stored bytes for "
                   f"{info.file_size} bytes")
