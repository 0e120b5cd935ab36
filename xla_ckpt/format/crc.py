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
from typing import TYPE_CHECKING, Callable, Union

import google_crc32c
import numpy as np
import torch

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

#: What :func:`crc32c` takes: a bytes-like object or a contiguous CPU tensor.
BufferLike = Union["ReadableBuffer", torch.Tensor]

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
    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous() or buf.device.type != "cpu":
            raise ValueError("crc32c needs a contiguous CPU tensor")
        return buf.data_ptr(), buf.numel() * buf.element_size(), buf
    mv = memoryview(buf)
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
        data = bytes(buf.numpy().tobytes() if isinstance(buf, torch.Tensor) else buf)
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


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)`` in bytes."""
    if len2 <= 0:
        return crc1
    odd = [_CRC32C_POLY_REFLECTED] + [1 << n for n in range(31)]  # one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    while True:
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2
