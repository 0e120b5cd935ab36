"""crc32c (Castagnoli) over any buffer, zero-copy, GIL released.

The checksum is google-crc32c's (the library google-cloud-storage uses).  Its
Python entry point only accepts ``bytes``, which would force a copy of every
tensor; so we call the same library's native ``crc32c_extend`` (shipped inside
the google-crc32c wheel) through ctypes on the buffer's address.  ctypes
releases the GIL during the call, so the I/O threads of a restore verify
slices in parallel.  If the native library cannot be located, we fall back to
``google_crc32c.value(bytes(buf))``.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from typing import TYPE_CHECKING, Callable, Sequence, Union, cast

import google_crc32c
import numpy as np

if TYPE_CHECKING:
    import torch
    from _typeshed import ReadableBuffer

#: What :func:`crc32c` takes: a bytes-like object or a contiguous CPU tensor.
BufferLike = Union["ReadableBuffer", "torch.Tensor"]


class _NoTorch:
    """Stands for ``torch.Tensor`` while torch is not imported: no value is an instance."""


def _tensor_type() -> type[torch.Tensor]:
    """``torch.Tensor``, or :class:`_NoTorch` while this process has not imported torch (then
    no buffer can be a tensor: checking bytes needs no torch)."""
    mod = sys.modules.get("torch")
    return cast("type[torch.Tensor]", _NoTorch) if mod is None else mod.Tensor

_extend: Callable[[int, int, int], int] | None = None


def _load_native() -> Callable[[int, int, int], int] | None:
    here = os.path.dirname(google_crc32c.__file__)
    candidates = sorted(glob.glob(os.path.join(here, "..", "google_crc32c.libs", "libcrc32c*.so*")))
    candidates += sorted(glob.glob(os.path.join(here, "libcrc32c*.so*")))
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
            fn = lib.crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_uint32
        return fn
    return None


_extend = _load_native()


def _address(buf: BufferLike) -> tuple[int, int, object]:
    """(address, length, keep-alive) of a C-contiguous byte buffer."""
    if isinstance(buf, _tensor_type()):
        if not buf.is_contiguous() or buf.device.type != "cpu":
            raise ValueError("crc32c needs a contiguous CPU tensor")
        return buf.data_ptr(), buf.numel() * buf.element_size(), buf
    mv = memoryview(cast("ReadableBuffer", buf))
    if not mv.c_contiguous:
        raise ValueError("crc32c needs a C-contiguous buffer")
    n = mv.nbytes
    if n == 0:
        return 0, 0, mv
    flat = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    if mv.readonly:
        # ctypes cannot take the address of a read-only buffer without a copy of its pointer;
        # wrap via numpy which exposes the address of any buffer.
        arr = np.frombuffer(flat, dtype=np.uint8)
        return arr.ctypes.data, n, arr
    c = (ctypes.c_char * n).from_buffer(flat)
    return ctypes.addressof(c), n, c


def crc32c(buf: BufferLike, crc: int = 0) -> int:
    """crc32c of ``buf`` (bytes-like or contiguous CPU tensor), extending ``crc``."""
    if _extend is None:
        data = bytes(buf.numpy().tobytes() if isinstance(buf, _tensor_type()) else buf)
        return google_crc32c.extend(crc, data) if crc else google_crc32c.value(data)
    addr, n, keep = _address(buf)
    if n == 0:
        return crc
    value = int(_extend(crc, addr, n))
    del keep
    return value


def native() -> bool:
    """True when the zero-copy native path is in use."""
    return _extend is not None


# ---- crc32c combine (zlib's crc32_combine, Castagnoli polynomial) -------------------------

_CRC32C_POLY_REFLECTED = 0x82F63B78


def _gf2_times(mat: list[int], vec: int) -> int:
    s = 0
    i = 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


_byte_powers: list[list[int]] = []
"""``_byte_powers[k]``: the GF(2) operator that runs a crc over ``2**k`` zero bytes."""
_powers_lock = threading.Lock()


def _zero_bytes_operator(k: int) -> list[int]:
    """The operator for ``2**k`` zero bytes (built once by squaring, then cached)."""
    if k < len(_byte_powers):
        return _byte_powers[k]
    with _powers_lock:
        if not _byte_powers:
            op = [_CRC32C_POLY_REFLECTED] + [1 << n for n in range(31)]  # one zero bit
            for _ in range(3):  # 2, 4, 8 zero bits: one zero byte
                op = _gf2_square(op)
            _byte_powers.append(op)
        while len(_byte_powers) <= k:
            _byte_powers.append(_gf2_square(_byte_powers[-1]))
        return _byte_powers[k]


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)`` in bytes.

    zlib's ``crc32_combine`` for the Castagnoli polynomial, with the operators for
    ``2**k`` zero bytes cached: one call costs one 32x32 GF(2) product per set bit of
    ``len2`` (a few microseconds for a power of two such as a 4 MiB chunk).
    """
    if len2 <= 0:
        return crc1
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(_zero_bytes_operator(k), crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def crc32c_chunks(buf: BufferLike, chunk_size: int) -> tuple[int, tuple[int, ...]]:
    """``(crc32c of buf, crc32c of each chunk_size-byte chunk)`` in one pass over ``buf``.

    The chunk values are empty when ``buf`` fits in one chunk (the manifest's rule: a blob
    of at most ``chunk_size`` bytes has only its whole crc32c).  Each byte is read once; the
    whole value is combined from the chunk values (:func:`crc32c_combine`).

    Raises:
        ValueError: ``chunk_size`` < 1, or ``buf`` is not contiguous.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 byte, not {chunk_size}")
    if isinstance(buf, _tensor_type()):
        import torch  # noqa: PLC0415 - already imported: buf is a tensor

        if not buf.is_contiguous() or buf.device.type != "cpu":
            raise ValueError("crc32c needs a contiguous CPU tensor")
        flat = buf.reshape(-1).view(torch.uint8) if buf.numel() else buf
        mv = flat.numpy().data.cast("B") if flat.numel() else memoryview(b"")
    else:
        mv = memoryview(cast("ReadableBuffer", buf))
        if not mv.c_contiguous:
            raise ValueError("crc32c needs a C-contiguous buffer")
        mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    n = len(mv)
    if n <= chunk_size:
        return crc32c(mv), ()
    chunks = tuple(crc32c(mv[i:i + chunk_size]) for i in range(0, n, chunk_size))
    return crc32c_concat(chunks, chunk_size, n), chunks


def crc32c_concat(chunk_crcs: Sequence[int], chunk_size: int, total: int) -> int:
    """crc32c of a buffer of ``total`` bytes from the crc32c of its ``chunk_size``-byte chunks
    (the last chunk holds the remainder)."""
    whole = 0
    left = total
    for c in chunk_crcs:
        n = min(chunk_size, left)
        whole = crc32c_combine(whole, c, n)
        left -= n
    return whole
