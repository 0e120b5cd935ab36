"""Typed, human-readable, pickle-free encoding of non-tensor training state.

The encoding is plain JSON.  JSON natives carry what they carry exactly in
Python (``None``, ``bool``, ``int`` of any size, finite ``float``, ``str``,
``list``, ``dict`` with ``str`` keys); everything else is a one-key tagged
object whose key starts with ``$``:

=====================  ====================================================
Python value           encoding
=====================  ====================================================
``tuple``              ``{"$tuple": [...]}``
non-finite float       ``{"$float": "nan" | "inf" | "-inf"}``
dict, non-str keys     ``{"$dict": [[key, value], ...]}`` (also used when a
                       str key starts with ``$``)
``OrderedDict``        ``{"$odict": [[key, value], ...], "meta": ...}``
                       (``meta`` holds a state_dict's ``_metadata``)
numpy scalar           ``{"$np": "float64", "v": 1.5}``
numpy dtype            ``{"$np_dtype": "float32"}``
``argparse.Namespace`` ``{"$namespace": {...}}``
``torch.dtype``        ``{"$torch_dtype": "bfloat16"}``
``torch.device``       ``{"$torch_device": "cpu"}``
``bytes``              ``{"$bytes": "<base64>"}``
``set``/``frozenset``  ``{"$set": [...]}`` / ``{"$frozenset": [...]}``
``complex``            ``{"$complex": [re, im]}``
tensor                 ``{"$tensor": <index into the manifest's tensors>}``
=====================  ====================================================

Anything else raises :class:`~xla_ckpt.errors.UnsupportedTypeError` naming the
key path, so a checkpoint never holds something it cannot give back.  So does
a tensor (or numpy array) where only values can go: a member of a set or
frozenset, a dict key, an ``OrderedDict``'s ``_metadata``; those are written
inline, with no position to name a tensor by, so the tensor cannot be stored
as a reference to its bytes (the message says to use a list or tuple).
Decoding is bounded: nesting deeper than :data:`MAX_DEPTH` and unknown tags
raise :class:`~xla_ckpt.errors.CheckpointCorruptError`.
"""

from __future__ import annotations

import argparse
import base64
import math
import sys
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence, cast

import numpy as np

from xla_ckpt.errors import CheckpointCorruptError, UnsupportedTypeError

if TYPE_CHECKING:
    import torch

MAX_DEPTH = 128

PathT = Sequence[Any]
#: ``hook(tensor, path)`` -> the index :func:`decode`'s lookup later maps back to the tensor.
TensorHook = Callable[["torch.Tensor", tuple], int]
#: index of a ``{"$tensor": i}`` node -> the restored tensor.
TensorLookup = Callable[[int], Any]


def format_path(path: PathT) -> str:
    """Render a key path as ``state['model']['encoder.weight'][0]``."""
    return "state" + "".join(f"[{k!r}]" for k in path)


class _NoTorch:
    """Stands for torch's classes while torch is not imported: no value is an instance."""


def _torch_types() -> tuple[type[torch.Tensor], type[torch.dtype], type[torch.device]]:
    """``(torch.Tensor, torch.dtype, torch.device)``, or :class:`_NoTorch` three times while
    this process has not imported torch (then no value can be one of them).  Encoding and
    decoding JSON-only values (a manifest's metadata, ``xla-ckpt ls``) thus needs no torch."""
    mod = sys.modules.get("torch")
    if mod is None:
        return cast("tuple[type[torch.Tensor], type[torch.dtype], type[torch.device]]",
                    (_NoTorch, _NoTorch, _NoTorch))
    return mod.Tensor, mod.dtype, mod.device


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype_from_name(name: str) -> torch.dtype:
    """Inverse of the ``"$torch_dtype"`` encoding; raises CheckpointCorruptError."""
    import torch  # noqa: PLC0415 - only a state holding a torch dtype needs torch to decode

    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorruptError(f"unknown torch dtype {name!r} in checkpoint")
    return dtype


def encode(obj: Any, tensor_hook: TensorHook | None = None) -> Any:
    """Encode ``obj`` into JSON-able data.

    Args:
        obj: nested state (dicts, lists, tuples, scalars, tensors, ...).
        tensor_hook: called as ``tensor_hook(tensor, path)`` for every tensor;
            returns the integer the ``{"$tensor": i}`` node stores.  Without a
            hook a tensor raises :class:`UnsupportedTypeError`.

    Raises:
        UnsupportedTypeError: a value of an unsupported type; the message names
            its key path and type.
    """
    return _encode(obj, (), tensor_hook, set(), 0, None)


class _Inline(NamedTuple):
    """Where values are encoded inline, without the tensor hook: what holds them, at which path."""

    where: str  # "in the set", "in a key of the dict", ...
    path: tuple
    why: str
    fix: str


_WHY_SET = ("a set is saved as a value, its members written inline (sorted; unordered in "
            "Python) with no index or key to refer to one by")
_FIX_SET = ("store the tensors in a list or tuple instead (keep a set of their names beside it if "
            "membership is what matters)")
_WHY_KEY = ("dict keys are saved as values, written inline (and a tensor hashes by identity, so a "
            "restored key would never match a live one)")
_FIX_KEY = ("key the dict by a name or an index and keep the tensor as the value, or store a list "
            "of (key, value) tuples")
_WHY_META = "a state_dict's _metadata is saved as a value, written inline"
_FIX_META = "keep tensors out of it (it holds per-module version numbers)"


def _inline(where: str, path: tuple, why: str, fix: str, hook: TensorHook | None,
            inline: _Inline | None) -> _Inline | None:
    """The context of values encoded without the hook from here on (None: there was none)."""
    if hook is None and inline is None:
        return None  # the caller gave no hook at all: the plain "needs a tensor hook" error
    return _Inline(where, path, why, fix)


def _describe_array(obj: torch.Tensor | np.ndarray) -> str:
    kind = type(obj)
    dtype = str(obj.dtype).removeprefix("torch.")
    return f"{kind.__module__}.{kind.__qualname__} of dtype {dtype} and shape {list(obj.shape)}"


def _no_hook(obj: torch.Tensor | np.ndarray, path: tuple,
             inline: _Inline | None) -> UnsupportedTypeError:
    """The refusal of a tensor (or numeric numpy array) met where the hook does not reach."""
    what = "tensor" if isinstance(obj, _torch_types()[0]) else "numpy array"
    if inline is None:
        if what == "tensor":
            return UnsupportedTypeError(
                f"tensor at {format_path(path)} needs a tensor hook: a {_describe_array(obj)} "
                "cannot be stored in typed JSON alone (checkpoint metadata, control-plane "
                "messages hold no tensor bytes); pass a Python number or list instead "
                "(t.item(), t.tolist()), or save it in the state")
        return UnsupportedTypeError(
            f"numpy array of dtype {obj.dtype} at {format_path(path)} cannot be stored in typed "
            "JSON alone (checkpoint metadata, control-plane messages hold no array bytes); pass "
            "a list instead (a.tolist()), or save it in the state")
    return UnsupportedTypeError(
        f"cannot save a {what} ({_describe_array(obj)}) {inline.where} at "
        f"{format_path(inline.path)}: {inline.why}, so a {what} there cannot be stored as a "
        f"reference to its bytes; {inline.fix}")


def _too_deep(path: tuple) -> UnsupportedTypeError:
    return UnsupportedTypeError(
        f"state nested deeper than {MAX_DEPTH} levels at {format_path(path[:8])}...: a load "
        "would refuse it; flatten the structure before saving")


def _encode(obj: Any, path: tuple, hook: TensorHook | None, active: set, depth: int,
            inline: _Inline | None) -> Any:
    # ``depth`` counts levels exactly as _decode does, so whatever encodes also decodes.
    # ``inline``: set while encoding the inside of a set, a dict key or _metadata, where ``hook``
    # is None on purpose (what holds the value, for the refusal of a tensor there).
    if depth > MAX_DEPTH:
        raise _too_deep(path)
    if isinstance(obj, np.generic):  # before str: np.str_ is a str subclass
        if depth + 1 > MAX_DEPTH:  # its value sits one level down
            raise _too_deep(path)
        if obj.dtype.kind not in "biufcSU":  # what decode accepts
            raise UnsupportedTypeError(f"numpy scalar of dtype {obj.dtype} at {format_path(path)} "
                                       "cannot be restored; convert it to a Python value")
        value = obj.item()
        if isinstance(value, float) and not math.isfinite(value):
            value = {"$float": repr(value)}
        elif isinstance(value, complex):
            value = {"$complex": [value.real, value.imag]}
        elif isinstance(value, bytes):
            value = {"$bytes": base64.b64encode(value).decode("ascii")}
        return {"$np": obj.dtype.str if obj.dtype.kind in "SUV" else obj.dtype.name, "v": value}
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    tensor_t, dtype_t, device_t = _torch_types()
    if isinstance(obj, tensor_t):
        if hook is None:
            raise _no_hook(obj, path, inline)
        return {"$tensor": hook(obj, path)}
    if isinstance(obj, np.ndarray):
        return _np_array(obj, path, hook, inline)
    if isinstance(obj, int):  # bool was handled above
        return int(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return float(obj)
        return {"$float": repr(float(obj))}
    if isinstance(obj, complex):
        return {"$complex": [obj.real, obj.imag]}
    if isinstance(obj, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, dtype_t):
        return {"$torch_dtype": _torch_dtype_name(obj)}
    if isinstance(obj, device_t):
        return {"$torch_device": str(obj)}
    if isinstance(obj, np.dtype):
        if obj.kind == "O":  # what decode refuses
            raise UnsupportedTypeError(f"object numpy dtype at {format_path(path)} cannot be "
                                       "restored")
        return {"$np_dtype": obj.str if obj.kind in "SUVO" else obj.name}

    oid = id(obj)
    if oid in active:
        raise UnsupportedTypeError(f"reference cycle at {format_path(path)}")
    active.add(oid)
    try:
        if isinstance(obj, argparse.Namespace):
            return {"$namespace": _encode(vars(obj), path, hook, active, depth + 1, inline)}
        if isinstance(obj, dict):
            # Keys are encoded inline: a tensor key has no reference (and hashes by identity).
            in_key = _inline(f"in a key of the {type(obj).__name__}", path, _WHY_KEY, _FIX_KEY,
                             hook, inline)
            plain_keys = not isinstance(obj, OrderedDict) and all(
                isinstance(k, str) and not k.startswith("$") for k in obj)
            if plain_keys:
                return {k: _encode(v, path + (k,), hook, active, depth + 1, inline)
                        for k, v in obj.items()}
            items = [[_encode(k, path, None, active, depth + 1, in_key),
                      _encode(v, path + (k,), hook, active, depth + 1, inline)]
                     for k, v in obj.items()]
            if not isinstance(obj, OrderedDict):
                return {"$dict": items}
            node: dict = {"$odict": items}
            meta = getattr(obj, "_metadata", None)
            if meta is not None:
                in_meta = _inline("in the _metadata of the OrderedDict", path, _WHY_META,
                                  _FIX_META, hook, inline)
                node["meta"] = _encode(meta, path + ("_metadata",), None, active, depth + 1,
                                       in_meta)
            return node
        if isinstance(obj, list):
            return [_encode(v, path + (i,), hook, active, depth + 1, inline)
                    for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            if hasattr(obj, "_fields"):
                raise UnsupportedTypeError(
                    f"namedtuple {type(obj).__qualname__} at {format_path(path)}: convert it to a "
                    "dict or plain tuple before saving")
            return {"$tuple": [_encode(v, path + (i,), hook, active, depth + 1, inline)
                               for i, v in enumerate(obj)]}
        if isinstance(obj, (set, frozenset)):
            tag = "$frozenset" if isinstance(obj, frozenset) else "$set"
            try:
                members = sorted(obj)
            except Exception:  # noqa: BLE001 - members' own comparisons (a tensor's is ambiguous)
                members = list(obj)  # no total order: iteration order, still restored exactly
            in_set = _inline(f"in the {type(obj).__name__}", path, _WHY_SET, _FIX_SET, hook,
                             inline)
            return {tag: [_encode(v, path, None, active, depth + 1, in_set) for v in members]}
    finally:
        active.discard(oid)
    raise UnsupportedTypeError(
        f"cannot save value of type {type(obj).__module__}.{type(obj).__qualname__} at "
        f"{format_path(path)}: the typed encoding holds None/bool/int/float/str, tuples, lists, "
        "dicts, numpy scalars, argparse.Namespace, torch dtypes/devices and tensors; convert it "
        "(e.g. to a dict) before saving")


def _np_array(arr: np.ndarray, path: tuple, hook: TensorHook | None,
              inline: _Inline | None) -> Any:
    if hook is None and arr.dtype.kind in "biufc":
        raise _no_hook(arr, path, inline)
    if hook is None or arr.dtype.kind not in "biufc":
        raise UnsupportedTypeError(
            f"numpy array of dtype {arr.dtype} at {format_path(path)}: convert it to a tensor")
    import torch  # noqa: PLC0415 - a numpy array goes into the state as a tensor's bytes

    return {"$ndarray": hook(torch.from_numpy(np.ascontiguousarray(arr)), path)}


def decode(node: Any, tensor_lookup: TensorLookup | None = None) -> Any:
    """Decode what :func:`encode` produced.

    Args:
        node: JSON-parsed data.
        tensor_lookup: maps the index of a ``{"$tensor": i}`` node to the
            restored tensor.

    Raises:
        CheckpointCorruptError: unknown tag, malformed node, or nesting deeper
            than :data:`MAX_DEPTH`.
    """
    return _decode(node, tensor_lookup, 0)


_FLOAT_WORDS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _bad(msg: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"malformed typed state: {msg}")


def _np_dtype(value: Any) -> np.dtype:
    """A numpy dtype from its name; only plain names (what encode writes) are accepted."""
    if not isinstance(value, str) or len(value) > 32:
        raise _bad(f"numpy dtype must be a dtype name, got {value!r}"[:120])
    try:
        return np.dtype(value)
    except (TypeError, ValueError, OverflowError, MemoryError):
        raise _bad(f"unknown numpy dtype {value!r}") from None


def _pairs(value: Any, lookup: TensorLookup | None, depth: int) -> list:
    if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
        raise _bad("dict items must be a list of [key, value] pairs")
    out = []
    for k, v in value:
        key = _decode(k, None, depth + 1)
        try:
            hash(key)
        except TypeError:
            raise _bad(f"unhashable dict key {key!r}") from None
        out.append((key, _decode(v, lookup, depth + 1)))
    return out


def _decode(node: Any, lookup: TensorLookup | None, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise _bad(f"nesting deeper than {MAX_DEPTH}")
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_decode(v, lookup, depth + 1) for v in node]
    if not isinstance(node, dict):
        raise _bad(f"unexpected JSON value of type {type(node).__name__}")
    tag = next(iter(node), None)
    if not (isinstance(tag, str) and tag.startswith("$")):
        return {k: _decode(v, lookup, depth + 1) for k, v in node.items()}
    value = node[tag]
    if tag == "$tensor":  # the most common tag by far: tested first
        if not isinstance(value, int) or isinstance(value, bool) or lookup is None:
            raise _bad(f"{tag} needs an integer index")
        return lookup(value)
    if tag == "$tuple":
        if not isinstance(value, list):
            raise _bad("$tuple needs a list")
        return tuple(_decode(v, lookup, depth + 1) for v in value)
    if tag == "$float":
        if not isinstance(value, str) or value not in _FLOAT_WORDS:
            raise _bad(f"$float {value!r}")
        return _FLOAT_WORDS[value]
    if tag == "$dict":
        return dict(_pairs(value, lookup, depth))
    if tag == "$odict":
        od = OrderedDict(_pairs(value, lookup, depth))
        if "meta" in node:
            od._metadata = _decode(node["meta"], None, depth + 1)  # type: ignore[attr-defined]  # torch's state-dict metadata attribute
        return od
    if tag == "$np":
        dtype = _np_dtype(value)
        if dtype.kind not in "biufcSU":
            raise _bad(f"numpy dtype {value!r} not allowed")
        v = _decode(node.get("v"), None, depth + 1)
        try:
            return dtype.type(v)
        except (TypeError, ValueError, OverflowError) as e:
            raise _bad(f"numpy scalar {value}({v!r}): {e}") from None
    if tag == "$np_dtype":
        dtype = _np_dtype(value)
        if dtype.kind == "O":
            raise _bad("object numpy dtype not allowed")
        return dtype
    if tag == "$namespace":
        d = _decode(value, lookup, depth + 1)
        if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
            raise _bad("$namespace needs a dict with str keys")
        return argparse.Namespace(**d)
    if tag == "$torch_dtype":
        try:
            return torch_dtype_from_name(value)
        except CheckpointCorruptError as e:
            raise _bad(str(e)) from None
    if tag == "$torch_device":
        if not isinstance(value, str):
            raise _bad(f"bad device {value!r}")
        try:
            import torch  # noqa: PLC0415 - only a state holding a torch device needs torch

            return torch.device(value)
        except (RuntimeError, TypeError, ValueError):
            raise _bad(f"bad device {value!r}") from None
    if tag == "$bytes":
        try:
            return base64.b64decode(value, validate=True)
        except (ValueError, TypeError):
            raise _bad("bad base64 in $bytes") from None
    if tag in ("$set", "$frozenset"):
        if not isinstance(value, list):
            raise _bad(f"{tag} needs a list")
        members = [_decode(v, None, depth + 1) for v in value]
        try:
            return set(members) if tag == "$set" else frozenset(members)
        except TypeError:
            raise _bad(f"unhashable member in {tag}") from None
    if tag == "$complex":
        if not (isinstance(value, list) and len(value) == 2
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)):
            raise _bad("$complex needs [re, im]")
        try:
            return complex(value[0], value[1])
        except OverflowError:
            raise _bad("$complex part out of range") from None
    if tag in ("$tensor", "$ndarray"):
        if not isinstance(value, int) or isinstance(value, bool) or lookup is None:
            raise _bad(f"{tag} needs an integer index")
        t = lookup(value)
        if tag == "$ndarray" and isinstance(t, _torch_types()[0]):
            return t.cpu().numpy()
        return t
    raise _bad(f"unknown tag {tag!r}")
