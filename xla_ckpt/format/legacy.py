"""Import legacy ``torch.save`` / fairseq ``.pt`` files and HF ``safetensors`` files, safely.

Pure: takes ``bytes`` or a seekable binary file object; fetching a ``gs://``
object is :mod:`xla_ckpt.io.legacy`'s job.  A legacy file is untrusted input:

1. **Static scan first.**  Every pickle the loader would run is disassembled
   with :mod:`pickletools` (``data.pkl`` of a zip-format file, the five
   leading pickles of a pre-1.6 file).  A global outside :data:`ALLOWED_GLOBALS`
   raises :class:`~xla_ckpt.errors.UnsafePickleError` naming *every* such
   class before anything is unpickled; so do opcodes that can call code
   without a named global (``STACK_GLOBAL``, ``INST``, ``OBJ``, ``EXT*``).
2. **Then** ``torch.load(weights_only=True, map_location="cpu")`` inside
   ``torch.serialization.safe_globals`` with the same allow-list (defence in
   depth: torch's restricted unpickler enforces it again).  Tensors saved
   with a device tag this host lacks (``cuda:3``, ``xla:0``) come back on CPU
   (CASES C1).
3. **Bounded memory.**  Zip archives must not declare more uncompressed bytes
   than the file holds, may not repeat an entry name, and must not be
   TorchScript; after loading, the distinct tensor storages must fit in the
   file and no tensor may be an expanded view much larger than its storage;
   containers are walked with a node budget proportional to the file size
   (a pickle can share one list many times to make a tiny file look huge)
   and a depth bound (:data:`xla_ckpt.format.typed.MAX_DEPTH`).

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
``argparse.Namespace``.

fairseq upgrade (:func:`upgrade_fairseq_state`, after fairseq's
``checkpoint_utils._upgrade_state_dict``): ``optimizer_history`` and
``last_optimizer_state`` are synthesised for the oldest layouts, top-level
``epoch``/``batch_offset``/``val_loss`` move into ``extra_state``,
``optimizer_name``/``lr_scheduler_state``/``num_updates`` are filled,
``extra_state["train_iterator"]`` is synthesised (``version`` 1, fairseq's
default when absent) and ``previous_training_time`` defaults to 0.0; the
Namespace-level renames fairseq applies (``max_positions``,
``remove_bpe``->``post_process``, ``min_lr``->``stop_min_lr``, float ``lr`` ->
``[lr]``, ...) are applied to ``args``.  **args -> cfg decision:** ``args``
stays an ``argparse.Namespace``; when the file has no ``cfg``, ``cfg`` becomes
a *flat* ``dict`` copy of ``vars(args)`` (fairseq groups it with its dataclass
registry, which needs fairseq itself); a ``cfg`` dict in newer files is kept
as it is.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import os
import pickle
import pickletools
import struct
import threading
import zipfile
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Literal, Union

import numpy as np
import torch

from xla_ckpt.errors import CheckpointCorruptError, MetaTensorError, UnsafePickleError
from xla_ckpt.format import typed
from xla_ckpt.format.safetensors_layout import MAX_HEADER_BYTES

logger = logging.getLogger(__name__)

Source = Union[bytes, bytearray, memoryview, BinaryIO]
Kind = Literal["torch_zip", "torch_legacy", "safetensors"]
Layout = Literal["auto", "fairseq", "raw", "model"]

# A tensor may be an expanded (stride-0/overlapping) view at most this many bytes larger
# than its storage: saving materialises it densely.
MAX_EXPANSION_BYTES = 64 * 1024 * 1024
# Container nodes allowed per byte of input, plus a floor (see module docstring, point 3).
_NODE_FLOOR = 100_000

_TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C

_NUMPY_DTYPE_CLASSES = (
    "BoolDType", "Int8DType", "Int16DType", "Int32DType", "Int64DType", "UInt8DType",
    "UInt16DType", "UInt32DType", "UInt64DType", "Float16DType", "Float32DType", "Float64DType",
    "LongDoubleDType", "Complex64DType", "Complex128DType", "CLongDoubleDType", "BytesDType",
    "StrDType", "ByteDType", "UByteDType", "ShortDType", "UShortDType", "IntDType", "UIntDType",
    "LongDType", "ULongDType", "LongLongDType", "ULongLongDType",
)


def _numpy_core():
    try:
        from numpy._core import multiarray  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core import multiarray
    return multiarray


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
    from torch import _weights_only_unpickler as wou

    return set(wou._get_allowed_globals()) - REFUSED_DEFAULT_GLOBALS


REFUSED_DEFAULT_GLOBALS = frozenset({"builtins.bytearray"})

_EXTRA = _extra_globals()
#: Every pickle global a legacy file may name (see the module docstring for why each is there).
ALLOWED_GLOBALS: frozenset[str] = frozenset(_torch_default_globals() | set(_EXTRA))

_CODE_OPCODES = {"STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4"}

# torch.serialization.safe_globals edits one process-wide set; serialise our loads.
_LOAD_LOCK = threading.Lock()


@dataclass
class LegacyFile:
    """What :func:`load_legacy` returns.

    Attributes:
        state: the loaded (and, for fairseq files, upgraded) state; CPU tensors.
        kind: ``"torch_zip"``, ``"torch_legacy"`` or ``"safetensors"``.
        fairseq: True when the fairseq upgrade was applied.
        metadata: manifest metadata for a converted checkpoint (``num_updates``,
            ``epoch``, ``iterations_in_epoch``, ``loss`` when known, ``source_format``,
            and a safetensors file's own ``__metadata__``).
    """

    state: Any
    kind: Kind
    fairseq: bool = False
    metadata: dict = field(default_factory=dict)


# ---- input handling -------------------------------------------------------------------


class _BufferFile(io.RawIOBase):
    """A read-only, seekable file over a bytes-like buffer, without copying it."""

    def __init__(self, buf) -> None:
        super().__init__()
        self._view = memoryview(buf).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), len(self._view) - self._pos)
        if n <= 0:
            return 0
        memoryview(b).cast("B")[:n] = self._view[self._pos:self._pos + n]
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


def sniff_format(prefix: bytes, *, where: str = "<bytes>") -> Kind:
    """Which kind of file starts with ``prefix`` (its first >= 16 bytes).

    Raises:
        CheckpointCorruptError: not a torch.save, fairseq or safetensors file.
    """
    if prefix[:4] == b"PK\x03\x04":
        return "torch_zip"
    if prefix[:1] == b"\x80" and len(prefix) >= 2 and prefix[1] <= 5:
        return "torch_legacy"
    if len(prefix) >= 9:
        (n,) = struct.unpack("<Q", prefix[:8])
        if prefix[8:9] == b"{" and n > 0:  # the header length itself is checked on load
            return "safetensors"
    raise CheckpointCorruptError(
        f"{where}: not a torch.save/fairseq .pt file or a safetensors file (starts with "
        f"{bytes(prefix[:8])!r}); pass an xla_ckpt checkpoint folder, a .pt or a .safetensors file")


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
                    found.add(_global_name(arg))
                elif op.name in _CODE_OPCODES:
                    code_ops.add(op.name + (f" {_global_name(arg)}" if op.name == "INST" else ""))
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
    kind = sniff_format(f.read(16), where=where)
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
    extra = [(obj, name) for name, obj in _EXTRA.items()]
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


def load_safetensors_file(source: Source, *, where: str = "<bytes>"
                          ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and ``__metadata__`` of a safetensors file (the safetensors library validates it).

    Raises:
        CheckpointCorruptError: malformed header, offsets or lengths (names ``where``).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load as st_load
    from safetensors.torch import load_file as st_load_file

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


# ---- fairseq ---------------------------------------------------------------------------


def looks_like_fairseq(obj: Any) -> bool:
    """True for a fairseq ``Trainer``/``checkpoint_utils.save_state`` dict (any vintage)."""
    if not isinstance(obj, dict) or "model" not in obj:
        return False
    return any(k in obj for k in ("optimizer_history", "args", "cfg", "extra_state",
                                  "last_optimizer_state", "best_loss"))


def upgrade_fairseq_state(state: dict, *, where: str = "<state>") -> dict:
    """Bring a fairseq checkpoint dict to the current layout, in place (fairseq
    ``checkpoint_utils._upgrade_state_dict`` semantics; see the module docstring).

    Raises:
        CheckpointCorruptError: a key the upgrade needs has the wrong type (names it).
    """
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise CheckpointCorruptError(f"{where}: fairseq checkpoint field {what} is malformed")

    if "optimizer_history" not in state:
        state["optimizer_history"] = [{"criterion_name": "CrossEntropyCriterion",
                                       "best_loss": state.pop("best_loss", None)}]
        if "optimizer" in state:
            state["last_optimizer_state"] = state.pop("optimizer")
    if "epoch" in state and "extra_state" not in state:
        state["extra_state"] = {k: state.pop(k, None)
                                for k in ("epoch", "batch_offset", "val_loss")}
    hist = state["optimizer_history"]
    need(isinstance(hist, list) and bool(hist) and all(isinstance(h, dict) for h in hist),
         "optimizer_history (a non-empty list of dicts)")
    last = hist[-1]
    if "optimizer" in last:
        state["last_optimizer_state"] = last["optimizer"]
        for h in hist:
            h.pop("optimizer", None)
    last.setdefault("optimizer_name", "FairseqNAG")
    if "lr_scheduler_state" not in last:
        last["lr_scheduler_state"] = {"best": last.pop("best_loss", None)}
    last.setdefault("num_updates", 0)

    extra = state.setdefault("extra_state", {})
    if extra is None:
        extra = state["extra_state"] = {}
    need(isinstance(extra, dict), "extra_state (a dict)")
    if "train_iterator" not in extra:
        extra["train_iterator"] = {"epoch": extra.get("epoch", 0),
                                   "iterations_in_epoch": extra.get("batch_offset", 0)}
    it = extra["train_iterator"]
    if it is not None:
        need(isinstance(it, dict), "extra_state['train_iterator'] (a dict)")
        it.setdefault("version", 1)
    extra.setdefault("previous_training_time", 0.0)

    args = state.get("args")
    if args is not None:
        need(isinstance(args, argparse.Namespace), "args (an argparse.Namespace)")
        _upgrade_args(args)
        if it is not None:
            epoch = it.get("epoch", 1)
            it["epoch"] = max(epoch if isinstance(epoch, int) else 1, 1)
        if state.get("cfg") is None:
            state["cfg"] = dict(vars(args))
    return state


def _upgrade_args(args: argparse.Namespace) -> None:
    """The Namespace renames of fairseq ``_upgrade_state_dict`` that need no fairseq registry."""
    if hasattr(args, "max_positions") and not hasattr(args, "max_source_positions"):
        args.max_source_positions = args.max_positions
        args.max_target_positions = args.max_positions
    if not hasattr(args, "task"):
        args.task = "translation"
    if getattr(args, "raw_text", False):
        args.dataset_impl = "raw"
    elif getattr(args, "lazy_load", False):
        args.dataset_impl = "lazy"
    if hasattr(args, "remove_bpe"):
        args.post_process = args.remove_bpe
    if hasattr(args, "min_lr"):
        args.stop_min_lr = args.min_lr
        del args.min_lr
    if getattr(args, "criterion", None) in ("binary_cross_entropy", "kd_binary_cross_entropy"):
        args.criterion = "wav2vec"
    if hasattr(args, "log_keys") and args.log_keys is None:
        del args.log_keys
    if getattr(args, "task", None) == "speech_pretraining":
        args.task = "audio_pretraining"
    if getattr(args, "arch", None) == "audio_cpc":
        args.arch = "wav2vec"
    if isinstance(getattr(args, "lr", None), float):
        args.lr = [args.lr]
    data = getattr(args, "data", None)
    if isinstance(data, list) and data:
        args.data = data[0]


def fairseq_metadata(state: dict) -> dict:
    """``num_updates``/``epoch``/``iterations_in_epoch``/``loss`` of an upgraded fairseq state."""
    md: dict = {}
    hist = state.get("optimizer_history")
    if isinstance(hist, list) and hist and isinstance(hist[-1], dict):
        n = hist[-1].get("num_updates")
        if isinstance(n, int) and not isinstance(n, bool):
            md["num_updates"] = n
    extra = state.get("extra_state")
    if isinstance(extra, dict):
        it = extra.get("train_iterator")
        if isinstance(it, dict):
            for k in ("epoch", "iterations_in_epoch"):
                if isinstance(it.get(k), int) and not isinstance(it.get(k), bool):
                    md[k] = it[k]
        loss = extra.get("val_loss")
        if isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss):
            md["loss"] = float(loss)
    return md


# ---- entry point -----------------------------------------------------------------------


def load_legacy(source: Source, *, where: str = "<bytes>", layout: Layout = "auto",
                keep_numpy_scalars: bool = False, unsafe_trust_pickle: bool = False) -> LegacyFile:
    """Load a legacy ``.pt`` (fairseq or plain ``torch.save``) or a safetensors file.

    Args:
        source: the file's bytes or a seekable binary file object.
        where: name for messages (a path or URI).
        layout: ``"auto"`` upgrades fairseq-looking dicts (:func:`looks_like_fairseq`)
            and keeps anything else as it is; ``"fairseq"`` requires a fairseq dict;
            ``"raw"`` keeps the object as it is; ``"model"`` wraps it as
            ``{"model": obj}`` (a bare state_dict or HF weights for the trainer restore).
        keep_numpy_scalars: keep numpy scalars instead of Python numbers.
        unsafe_trust_pickle: unpickle without the allow-list (logs a warning).

    Raises:
        UnsafePickleError: a pickle global outside :data:`ALLOWED_GLOBALS`.
        CheckpointCorruptError: malformed, truncated or hostile input.
        MetaTensorError: a meta tensor (names its key).
    """
    if layout not in ("auto", "fairseq", "raw", "model"):
        raise ValueError(f"layout must be auto, fairseq, raw or model, not {layout!r}")
    f, size = _as_file(source)
    kind = sniff_format(f.read(16), where=where)
    f.seek(0)
    md: dict = {"source_format": kind}
    if kind == "safetensors":
        obj, st_meta = load_safetensors_file(f, where=where)
        if st_meta:
            md["safetensors_metadata"] = st_meta
    else:
        obj, kind = load_torch_file(f, where=where, unsafe_trust_pickle=unsafe_trust_pickle)
    obj = _Walker(where=where, file_size=size, keep_numpy_scalars=keep_numpy_scalars).run(obj)
    fairseq = False
    if layout == "fairseq" or (layout == "auto" and looks_like_fairseq(obj)):
        if not isinstance(obj, dict) or "model" not in obj:
            raise CheckpointCorruptError(f"{where}: not a fairseq checkpoint (no 'model' key)")
        obj = upgrade_fairseq_state(obj, where=where)
        md.update(fairseq_metadata(obj))
        fairseq = True
    elif layout == "model":
        obj = {"model": obj}
    return LegacyFile(state=obj, kind=kind, fairseq=fairseq, metadata=md)
