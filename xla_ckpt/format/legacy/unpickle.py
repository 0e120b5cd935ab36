"""Unpickling a ``torch.save`` file through the allow-list, and the bounded walk after it.

Allow-list (:data:`ALLOWED_GLOBALS`): torch's own ``weights_only`` defaults
(tensor/storage rebuild functions, ``torch.Size``, dtypes, devices,
``collections.OrderedDict``/``Counter``, ``set``, ``complex``, ``_codecs.encode``)
**minus** ``builtins.bytearray`` (``bytearray(n)`` allocates ``n`` bytes from a
30-byte file), plus what fairseq checkpoints really hold:

* ``argparse.Namespace`` -- fairseq's ``args``;
* numpy scalars (``numpy._core.multiarray.scalar``, also under the numpy 1.x
  name ``numpy.core.multiarray.scalar``) with ``numpy.dtype`` and the numeric,
  bool and string dtype classes (``numpy.dtypes.Float64DType`` ...) --
  ``best_loss``/``val_loss`` and meter values computed with numpy;
* numpy arrays (``numpy._core.multiarray._reconstruct``, ``numpy.ndarray``) --
  torch < 2.6 pickled XLA tensors as ``_rebuild_device_tensor_from_numpy``.

Anything else (``os.system``, ``builtins.eval``, ``collections.defaultdict``,
fairseq or user classes, and omegaconf's ``DictConfig`` -- fairseq 0.10.0/0.10.1
pickled ``cfg`` as one; re-save it with ``OmegaConf.to_container``) is refused
by name.  There is no silent unsafe fallback: ``unsafe_trust_pickle=True``
(CLI ``--unsafe-trust-pickle``) runs plain ``pickle`` and logs a warning.

Values: numpy scalars come back as Python ``int``/``float``/``bool``/``str``
(CASES C4; ``keep_numpy_scalars=True`` keeps them), ``args`` as an
``argparse.Namespace``.  The order of the checks (static scan, restricted
``torch.load``, bounded walk) is the package docstring's.
"""

from __future__ import annotations

import argparse
import importlib
import io
import logging
import pickle
import pickletools
import struct
import threading
import types
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from typing import Any, BinaryIO, Callable

import numpy as np
import torch
from torch import _weights_only_unpickler

from xla_ckpt.errors import CheckpointCorruptError, MetaTensorError, UnsafePickleError
from xla_ckpt.format import typed
from xla_ckpt.format.legacy.kinds import (
    Kind,
    Source,
    _as_file,
    _check_zip,
    _first_line,
    _zip_data_pkl,
    sniff_format,
)

# The package's logger: records keep the name ``xla_ckpt.format.legacy``.
logger = logging.getLogger(__package__)

# A tensor may be an expanded (stride-0/overlapping) view at most this many bytes larger
# than its storage: saving materialises it densely.
MAX_EXPANSION_BYTES = 64 * 1024 * 1024
# Container nodes allowed per byte of input, plus a floor (package docstring, point 3).
_NODE_FLOOR = 100_000


_NUMPY_DTYPE_CLASSES = (
    "BoolDType", "Int8DType", "Int16DType", "Int32DType", "Int64DType", "UInt8DType",
    "UInt16DType", "UInt32DType", "UInt64DType", "Float16DType", "Float32DType", "Float64DType",
    "LongDoubleDType", "Complex64DType", "Complex128DType", "CLongDoubleDType", "BytesDType",
    "StrDType", "ByteDType", "UByteDType", "ShortDType", "UShortDType", "IntDType", "UIntDType",
    "LongDType", "ULongDType", "LongLongDType", "ULongLongDType",
)


def _numpy_core() -> types.ModuleType:
    try:
        return importlib.import_module("numpy._core.multiarray")  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        return importlib.import_module("numpy.core.multiarray")


def _extra_globals() -> dict[str, Any]:
    """Our additions to torch's ``weights_only`` defaults: full pickle name -> object."""
    ma = _numpy_core()
    out: dict[str, Any] = {"argparse.Namespace": argparse.Namespace, "numpy.dtype": np.dtype,
                           "numpy.ndarray": np.ndarray}
    for mod in ("numpy._core.multiarray", "numpy.core.multiarray"):
        out[f"{mod}.scalar"] = ma.scalar
        out[f"{mod}._reconstruct"] = ma._reconstruct
    dtypes = getattr(np, "dtypes", None)
    for name in _NUMPY_DTYPE_CLASSES:
        cls = getattr(dtypes, name, None) if dtypes is not None else None
        if cls is not None:
            out[f"numpy.dtypes.{name}"] = cls
    return out


def _torch_default_globals() -> set[str]:
    return set(_weights_only_unpickler._get_allowed_globals()) - REFUSED_DEFAULT_GLOBALS


REFUSED_DEFAULT_GLOBALS = frozenset({"builtins.bytearray"})

_EXTRA = _extra_globals()
#: Every pickle global a legacy file may name (the module docstring says why each is there).
ALLOWED_GLOBALS: frozenset[str] = frozenset(_torch_default_globals() | set(_EXTRA))

_CODE_OPCODES = {"STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4"}

# torch.serialization.safe_globals edits one process-wide set; serialise our loads.
_LOAD_LOCK = threading.Lock()


# ---- static pickle scan ----------------------------------------------------------------


def _global_name(arg: str) -> str:
    module, _, name = arg.partition(" ")
    if (module, name) in NAME_MAPPING:
        module, name = NAME_MAPPING[(module, name)]
    elif module in IMPORT_MAPPING:
        module = IMPORT_MAPPING[module]
    return f"{module}.{name}"


def scan_pickle(data: bytes | BinaryIO, *, where: str, count: int = 1) -> set[str]:
    """Globals named by ``count`` consecutive pickles at the start of ``data``.

    Raises:
        UnsafePickleError: an opcode that can call code without a named global.
        CheckpointCorruptError: the bytes are not a well-formed pickle.
    """
    f = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    found: set[str] = set()
    code_ops: set[str] = set()
    try:
        for _ in range(count):
            for op, arg, _pos in pickletools.genops(f):
                if op.name == "GLOBAL":
                    found.add(_global_name(str(arg)))  # "module name", as for INST
                elif op.name in _CODE_OPCODES:
                    code_ops.add(op.name + (f" {_global_name(str(arg))}" if op.name == "INST"
                                            else ""))
    except (ValueError, EOFError, struct.error, UnicodeDecodeError, OverflowError) as e:
        raise CheckpointCorruptError(f"{where}: malformed pickle ({e})") from None
    if code_ops:
        raise UnsafePickleError(
            f"{where}: pickle uses opcodes that can run code ({', '.join(sorted(code_ops))}); "
            "xla_ckpt refuses to load it. Re-save the state with torch.save from a trusted "
            "process, or convert it there with `xla-ckpt convert`")
    return found


def _refuse_unsafe(names: set[str], *, where: str) -> None:
    bad = sorted(names - ALLOWED_GLOBALS)
    if not bad:
        return
    hint = ""
    if any(n.startswith("omegaconf.") for n in bad):
        hint = (" The file's cfg is an omegaconf DictConfig (fairseq 0.10.0/0.10.1 saved it so); "
                "re-save it with cfg = OmegaConf.to_container(cfg) from a trusted process.")
    raise UnsafePickleError(
        f"{where}: refusing to unpickle global{'s' if len(bad) > 1 else ''} "
        f"{', '.join(bad)}: outside the allow-list of xla_ckpt.format.legacy (tensors, "
        f"argparse.Namespace, numpy scalars/dtypes/arrays).{hint} If you trust this file, "
        "convert it with `xla-ckpt convert --unsafe-trust-pickle`")


# ---- load ------------------------------------------------------------------------------


def load_torch_file(source: Source, *, where: str = "<bytes>",
                    unsafe_trust_pickle: bool = False) -> tuple[Any, Kind]:
    """Load a ``torch.save`` file (zip or pre-1.6 format) with the allow-list; CPU tensors.

    Returns:
        (object, kind).

    Raises:
        UnsafePickleError: a global outside :data:`ALLOWED_GLOBALS` (names each one).
        CheckpointCorruptError: truncated, malformed or hostile bytes (names ``where``).
    """
    f, size = _as_file(source)
    kind = sniff_format(f.read(16), where=where, size=size)
    f.seek(0)
    if kind == "safetensors":
        raise CheckpointCorruptError(f"{where}: is a safetensors file, not a torch.save file")
    if kind == "torch_zip":
        _check_zip(f, size, where=where)
        names = scan_pickle(_zip_data_pkl(f, where=where), where=where)
    else:
        names = scan_pickle(f, where=where, count=5)
        f.seek(0)
    if unsafe_trust_pickle:
        logger.warning("%s: --unsafe-trust-pickle: unpickling WITHOUT the allow-list; this runs "
                       "any code the file holds (globals: %s)", where,
                       ", ".join(sorted(names - ALLOWED_GLOBALS)) or "none outside the allow-list")
    else:
        _refuse_unsafe(names, where=where)
    obj = _torch_load(f, where=where, weights_only=not unsafe_trust_pickle)
    return obj, kind


def _torch_load(f: BinaryIO, *, where: str, weights_only: bool) -> Any:
    extra: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
        (obj, name) for name, obj in _EXTRA.items()]
    try:
        with _LOAD_LOCK, torch.serialization.safe_globals(extra):
            return torch.load(f, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as e:
        msg = str(e)
        if "Unsupported global" in msg or "unrecognized function" in msg:
            raise UnsafePickleError(f"{where}: torch's restricted unpickler refused the file: "
                                    f"{_weights_only_reason(msg)}") from None
        raise CheckpointCorruptError(f"{where}: malformed torch.save file "
                                     f"({_weights_only_reason(msg)})") from None
    except MemoryError:
        raise CheckpointCorruptError(f"{where}: the file declares more memory than this host "
                                     "has; it is malformed or hostile") from None
    except (RuntimeError, ValueError, EOFError, struct.error, TypeError, KeyError, IndexError,
            AttributeError, OverflowError, UnicodeDecodeError, AssertionError) as e:
        raise CheckpointCorruptError(f"{where}: malformed or truncated torch.save file "
                                     f"({type(e).__name__}: {_first_line(e)})") from None


def _weights_only_reason(msg: str) -> str:
    for line in msg.splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip() or line.strip()
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith(("Unsupported", "Trying", "Can only", "Unsupported operand")):
            return ln
    return lines[-1] if lines else "unpickling failed"


# ---- post-load walk --------------------------------------------------------------------


class _Walker:
    """Bounded walk: numpy scalars -> Python, depth/node budget, meta tensors, storage sizes."""

    def __init__(self, *, where: str, file_size: int, keep_numpy_scalars: bool) -> None:
        self.where = where
        self.file_size = file_size
        self.keep = keep_numpy_scalars
        self.budget = file_size + _NODE_FLOOR
        self.storages: dict[int, int] = {}
        self.active: set[int] = set()

    def run(self, obj: Any) -> Any:
        out = self._walk(obj, (), 0)
        total = sum(self.storages.values())
        if total > self.file_size:
            raise CheckpointCorruptError(
                f"{self.where}: tensors claim {total} bytes of storage but the file holds only "
                f"{self.file_size} bytes; the file is malformed or hostile")
        return out

    def _spend(self, path: tuple) -> None:
        self.budget -= 1
        if self.budget < 0:
            raise CheckpointCorruptError(
                f"{self.where}: the unpickled state has more container entries than a "
                f"{self.file_size}-byte file can hold without sharing (at "
                f"{typed.format_path(path)}); refusing a pickle that expands on load")

    def _walk(self, obj: Any, path: tuple, depth: int) -> Any:
        if depth > typed.MAX_DEPTH:
            raise CheckpointCorruptError(f"{self.where}: nesting deeper than {typed.MAX_DEPTH} "
                                         f"levels at {typed.format_path(path[:8])}...")
        self._spend(path)
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path)
        if isinstance(obj, np.generic):
            return obj if self.keep else obj.item()
        if obj is None or isinstance(obj, (bool, int, float, str, bytes, complex)):
            return obj
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in "biufc":
                raise CheckpointCorruptError(f"{self.where}: numpy array of dtype {obj.dtype} at "
                                             f"{typed.format_path(path)} is not supported")
            self.storages[id(obj)] = obj.nbytes
            return obj
        oid = id(obj)
        if oid in self.active:
            raise CheckpointCorruptError(f"{self.where}: reference cycle at "
                                         f"{typed.format_path(path)}")
        self.active.add(oid)
        try:
            if isinstance(obj, argparse.Namespace):
                for k, v in list(vars(obj).items()):
                    setattr(obj, k, self._walk(v, path + (k,), depth + 2))
                return obj
            if isinstance(obj, dict):
                items = [(self._walk(k, path, depth + 1), self._walk(v, path + (k,), depth + 1))
                         for k, v in obj.items()]
                obj.clear()
                obj.update(items)
                return obj
            if isinstance(obj, list):
                obj[:] = [self._walk(v, path + (i,), depth + 1) for i, v in enumerate(obj)]
                return obj
            if isinstance(obj, tuple):
                vals = [self._walk(v, path + (i,), depth + 1) for i, v in enumerate(obj)]
                return tuple(vals) if type(obj) in (tuple, torch.Size) else type(obj)(vals)
            if isinstance(obj, (set, frozenset)):
                vals = [self._walk(v, path, depth + 1) for v in obj]
                return type(obj)(vals)
        finally:
            self.active.discard(oid)
        return obj

    def _tensor(self, t: torch.Tensor, path: tuple) -> torch.Tensor:
        key = typed.format_path(path)
        if t.device.type == "meta":
            raise MetaTensorError(f"{self.where}: tensor at {key} is on the meta device and holds "
                                  "no data; the file cannot be restored")
        if t.layout != torch.strided:
            return t
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        self.storages[storage.data_ptr() or id(storage)] = nbytes
        dense = t.numel() * t.element_size()
        if dense > nbytes + MAX_EXPANSION_BYTES:
            raise CheckpointCorruptError(
                f"{self.where}: tensor at {key} is a view of {dense} bytes over a {nbytes}-byte "
                "storage (expanded/overlapping strides); refusing to materialise it")
        return t

