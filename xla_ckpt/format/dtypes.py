"""torch dtype <-> safetensors dtype code and item sizes."""

from __future__ import annotations

import torch

from xla_ckpt.errors import CheckpointCorruptError

# safetensors dtype codes (bindings/python/py_src/safetensors/torch.py _TYPES).
_TO_SAFETENSORS: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _TO_SAFETENSORS[getattr(torch, _name)] = _code

_FROM_SAFETENSORS = {v: k for k, v in _TO_SAFETENSORS.items()}

# dtypes a checkpoint may record for a tensor (anything else is refused on load).
_ALLOWED_NAMES = {str(d).removeprefix("torch.") for d in _TO_SAFETENSORS} | {
    "complex64", "complex128", "float8_e4m3fnuz", "float8_e5m2fnuz",
}


def safetensors_code(dtype: torch.dtype) -> str | None:
    """The safetensors dtype code for ``dtype`` or None (then bytes are stored as ``U8``)."""
    return _TO_SAFETENSORS.get(dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: object, *, where: str = "") -> torch.dtype:
    """torch dtype for a manifest dtype name; raises CheckpointCorruptError naming ``where``."""
    if not isinstance(name, str) or name not in _ALLOWED_NAMES or not hasattr(torch, name):
        raise CheckpointCorruptError(f"unknown dtype {name!r}{' for ' + where if where else ''}")
    return getattr(torch, name)


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
