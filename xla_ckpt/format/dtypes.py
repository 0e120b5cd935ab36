"""torch dtype <-> safetensors dtype code and item sizes.

The tables are by dtype *name* (``"bfloat16"``), so a manifest is parsed and checked without
torch (``xla-ckpt ls`` / ``verify`` start fast); :func:`dtype_from_name` imports torch for the
``torch.dtype`` itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xla_ckpt.errors import CheckpointCorruptError

if TYPE_CHECKING:
    import torch

# safetensors dtype codes (bindings/python/py_src/safetensors/torch.py _TYPES), by torch name.
_TO_SAFETENSORS: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
    "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "uint16": "U16", "uint32": "U32", "uint64": "U64",
}

# Bytes per element of every dtype a checkpoint may record for a tensor (anything else is
# refused on load).
_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "complex64": 8, "complex128": 16, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}
_ALLOWED_NAMES = frozenset(_ITEMSIZE)


def safetensors_code(dtype: torch.dtype) -> str | None:
    """The safetensors dtype code for ``dtype`` or None (then bytes are stored as ``U8``)."""
    return _TO_SAFETENSORS.get(dtype_name(dtype))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_dtype_name(name: object, *, where: str = "") -> str:
    """``name`` if a checkpoint may record it as a tensor's dtype (no torch needed); raises
    CheckpointCorruptError naming ``where``."""
    if not isinstance(name, str) or name not in _ALLOWED_NAMES:
        raise CheckpointCorruptError(f"unknown dtype {name!r}{' for ' + where if where else ''}")
    return name


def dtype_from_name(name: object, *, where: str = "") -> torch.dtype:
    """torch dtype for a manifest dtype name; raises CheckpointCorruptError naming ``where``."""
    import torch  # noqa: PLC0415 - the name tables above serve the torch-free callers

    if not isinstance(name, str) or name not in _ALLOWED_NAMES or not hasattr(torch, name):
        raise CheckpointCorruptError(f"unknown dtype {name!r}{' for ' + where if where else ''}")
    return getattr(torch, name)


def itemsize_of(name: str) -> int:
    """Bytes per element of the dtype named ``name`` (one :func:`check_dtype_name` accepts)."""
    return _ITEMSIZE[name]


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    size = _ITEMSIZE.get(dtype_name(dtype))
    return size if size is not None else dtype.itemsize
