"""Export a checkpoint for other tools: a ``torch.save`` ``.pt``, HF safetensors, or PyTorch DCP.

What ``xla-ckpt export URI DST --format pt|safetensors|dcp`` runs.  The source is
anything :func:`xla_ckpt.load` reads (an xla_ckpt checkpoint or run folder, a legacy
``.pt``, HF safetensors, a DCP folder); tensors are exported from CPU with their
dtype, shape and values exactly (int64, bool, bf16 included; sizes are
``numel * element_size``).

* **pt** (:func:`export_pt`): one ``torch.save`` object at ``DST`` holding the whole
  state, aliasing kept (tied weights stay one storage).  A fairseq-layout state keeps
  its layout (``model``, ``args``/``cfg``, ``optimizer_history``, ``extra_state``,
  ``last_optimizer_state``); a ``cfg`` that is only the flat copy of ``args`` made at
  import (:mod:`xla_ckpt.format.legacy.fairseq`) goes back to ``None``, as fairseq
  wrote it (fairseq rebuilds ``cfg`` from ``args`` when it loads).  ``torch.load(DST,
  weights_only=True)`` reads it; a state holding ``argparse.Namespace`` (fairseq
  ``args``) or numpy values needs those classes allowed, as for any fairseq file:
  :attr:`ExportReport.safe_globals` names them (``with
  torch.serialization.safe_globals([argparse.Namespace]): torch.load(...)``).
* **safetensors** (:func:`export_safetensors`): the model weights (``state["model"]``,
  or a state that is all tensors; :func:`select_weights`) as an HF model folder:
  ``model.safetensors``, or with ``max_shard_size_bytes`` ``model-0000i-of-0000n.safetensors``
  plus ``model.safetensors.index.json``, each with ``{"format": "pt"}`` metadata, so
  ``transformers`` ``from_pretrained(DST)`` reads it (given a ``config.json``: pass
  ``hf_config``).  safetensors holds no shared storage: a tensor that is the very same
  view as an earlier one (a tied embedding/output weight) is dropped after
  ``torch.equal`` confirms it, and recorded in the file metadata as
  ``{dropped name: kept name}`` (``safetensors.torch.save_model`` semantics;
  ``from_pretrained`` re-ties it); a tensor overlapping another in any other way is
  written as its own copy.  Both are in :attr:`ExportReport.ties`.
* **dcp** (:func:`export_dcp`): the whole state through :func:`xla_ckpt.kinds.dcp_write.write_dcp`
  (``torch.distributed.checkpoint.load`` reads it back).

**Per-rank items.** A checkpoint saved with ``rank_states`` (the manager's ``rank_state``,
the Checkpointer's ``rank_extra_state``) holds each rank's own state in items ``rank/<r>``
(iterator position, RNG state), apart from the state :func:`xla_ckpt.load` returns.  None of
the formats has a place for them of its own, so they are never left out silently:
``rank_states="error"`` (the default) refuses with :class:`RankItemsNotExportedError` naming
them; ``"nest"`` (pt, dcp) writes them inside the exported state as
``state["rank_states"][r]`` (``torch.load(DST)["rank_states"][1]`` is rank 1's own state;
the state must be a dict without a ``rank_states`` key); ``"drop"`` leaves them out and says
so in :attr:`ExportReport.notes`.  **safetensors** holds the model weights only: per-rank
items, like the optimizer and every other entry outside the weights, are never written, and
:attr:`ExportReport.notes` names what was left out.

Local paths and ``gs://`` alike; each object is written atomically.  A destination
holding a checkpoint of any kind is refused unless ``overwrite=True`` replaces one of the
kind being written; the source itself (or a folder inside it) is never a destination
(:func:`check_destination`).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import save as st_save

from xla_ckpt.errors import (
    CheckpointCorruptError,
    ConfigError,
    OutputExistsError,
    RankItemsNotExportedError,
)
from xla_ckpt.format.legacy import looks_like_fairseq
from xla_ckpt.format.manifest import STATE_ITEM
from xla_ckpt.io.names import INDEX_NAME, SINGLE_NAME
from xla_ckpt.kinds.export_weights import Tie, find_ties, left_out, select_weights, walk_state
from xla_ckpt.kinds.legacy import is_single_object, split_uri
from xla_ckpt.kinds.opener import read_checkpoint, read_items
from xla_ckpt.run.sniff import OUTPUT_KINDS, destination_holds
from xla_ckpt.storage import StorageConfig, open_storage, parse_uri

logger = logging.getLogger(__name__)

FORMATS = ("pt", "safetensors", "dcp")
"""What :func:`export` writes."""
RANK_STATES = ("error", "nest", "drop")
"""What :func:`export` does with per-rank items ``rank/<r>`` (see the module docstring)."""
RANK_STATES_KEY = "rank_states"
"""The entry of the exported state that ``rank_states="nest"`` adds: ``{rank: its state}``."""

Progress = Callable[[int], object]  # called with a byte count



@dataclass
class ExportReport:
    """What an export wrote.

    Attributes:
        dst: the destination URI.
        format: ``"pt"``, ``"safetensors"`` or ``"dcp"``.
        files: URIs of the objects written (shards, index, config), in write order.
        tensors: tensors written (a tie kept as one storage counts once).
        nbytes: tensor bytes written (``numel * element_size`` each, a kept tie once).
        dtypes: ``{dtype name: tensors of it}``.
        ties: overlapping tensors found and what was done (:class:`Tie`).
        safe_globals: for ``pt``: classes beyond torch's defaults that
            ``torch.load(weights_only=True)`` must be allowed to read the file
            (``"argparse.Namespace"``); empty when plain ``weights_only=True`` reads it.
        notes: other changes made, in words (a synthesised fairseq ``cfg`` reset).
    """

    dst: str
    format: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    nbytes: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)
    ties: list[Tie] = field(default_factory=list)
    safe_globals: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def count(self, t: torch.Tensor) -> None:
        self.tensors += 1
        self.nbytes += t.numel() * t.element_size()
        name = str(t.dtype).removeprefix("torch.")
        self.dtypes[name] = self.dtypes.get(name, 0) + 1



# ---- writing ----------------------------------------------------------------------------------

_HF_WEIGHTS = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")


def _is_hf_weight_file(name: str) -> bool:
    """``model.safetensors``, ``model-00001-of-00003.safetensors`` or the index."""
    return name == INDEX_NAME or bool(_HF_WEIGHTS.match(name))


def _canonical(uri: str) -> str:
    target = parse_uri(uri)
    if target.is_local:
        return os.path.realpath(os.path.expanduser(target.path)).rstrip("/") or "/"
    return str(target).rstrip("/")


def check_destination(src: str | None, dst: str, *, writes: str, overwrite: bool,
                      config: StorageConfig | None = None, same_ok: bool = False) -> None:
    """Refuse a ``convert`` / ``export`` destination before anything is read or written.

    Rules, in order:

    1. ``dst`` is ``src`` or inside it (``src`` a checkpoint, run folder or file): refused,
       with or without ``overwrite`` (``same_ok``: a fairseq run folder converted in
       place, whose ``.pt`` files are left alone).
    2. ``dst`` already holds a checkpoint of any kind (:func:`destination_holds`): refused
       unless ``overwrite``; with ``overwrite`` only one of the kind being written
       (``writes``: a key of :data:`OUTPUT_KINDS`) is replaced; another kind is refused
       (it would be shadowed or mixed: an xla_ckpt manifest next to a DCP ``.metadata``
       hides it), so remove it first or choose another ``dst``.

    Raises:
        ConfigError: rule 1.
        OutputExistsError: rule 2 (a ConfigError: exit code 2 on the command line).
    """
    if src is not None and not same_ok:
        s, d = _canonical(src), _canonical(dst)
        if d == s or d.startswith(s.rstrip("/") + "/"):
            raise ConfigError(f"{dst} is the source {src} or inside it; write to another "
                              "folder (the source is never written)")
    held = destination_holds(dst, config)
    if held is None:
        return
    kind, what = held
    if not overwrite:
        raise OutputExistsError(f"{dst} already holds {what}; pass --overwrite "
                                "(overwrite=True) to replace it, or choose an empty DST")
    if kind != writes:
        raise OutputExistsError(
            f"{dst} holds {what}, and this writes {OUTPUT_KINDS[writes]}: --overwrite replaces "
            "only output of the same kind (the two would shadow each other); remove it first "
            "or choose another DST")


def _check_absent(st: Any, names: list[str], overwrite: bool) -> None:
    if overwrite:
        return
    there = [n for n in names if st.exists(n)]
    if there:
        raise OutputExistsError(f"{st.url(there[0])} already exists; pass --overwrite "
                                "(overwrite=True) to replace it")


def _plain_fairseq(state: Any, report: ExportReport) -> Any:
    """Undo what import added to a fairseq state and fairseq itself does not write."""
    if not (looks_like_fairseq(state) and isinstance(state.get("args"), argparse.Namespace)):
        return state
    cfg = state.get("cfg")
    if isinstance(cfg, dict) and cfg == dict(vars(state["args"])):
        state = dict(state)
        state["cfg"] = None
        report.notes.append("cfg: None (it was the flat copy of args made at import; fairseq "
                            "rebuilds cfg from args on load)")
    return state


def _safe_globals(leaves: list[tuple[str, Any]], data: bytes | memoryview) -> list[str]:
    """The globals ``torch.load(weights_only=True)`` must be allowed to read ``data``.

    What the pickle names (``torch.serialization.get_unsafe_globals_in_checkpoint``:
    ``argparse.Namespace``, ``numpy._core.multiarray.scalar`` on numpy 2, ...) plus the
    dtype class of every numpy value (``numpy.dtypes.Float32DType``): on numpy 2 the
    unpickler builds it while it rebuilds a ``numpy.dtype`` and refuses it unless allowed.
    """
    names = set(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
    for _, v in leaves:
        dtype = v if isinstance(v, np.dtype) else getattr(v, "dtype", None) \
            if isinstance(v, (np.generic, np.ndarray)) else None
        if isinstance(dtype, np.dtype) and type(dtype).__module__ == "numpy.dtypes":
            names.add(f"numpy.dtypes.{type(dtype).__name__}")
    return sorted(names)


def _separate_dtypes(state: Any, tensors: dict[str, torch.Tensor]
                     ) -> tuple[Any, set[str]]:
    """``state`` with its own memory for tensors whose storage other dtypes view too.

    ``torch.save`` refuses one storage viewed as several dtypes (a reader may pack small
    tensors into one buffer).  Those tensors are copied, one copy per distinct view, so a
    tie (the very same view under two names) stays one tensor.  Returns the new state and
    the paths copied.
    """
    dtypes: dict[int, set[torch.dtype]] = {}
    for t in tensors.values():
        dtypes.setdefault(t.untyped_storage().data_ptr(), set()).add(t.dtype)
    mixed = {p for p, d in dtypes.items() if len(d) > 1}
    if not mixed:
        return state, set()
    copies: dict[tuple, torch.Tensor] = {}
    cloned: set[str] = set()

    def own(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in mixed:
            return t
        sig = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if sig not in copies:
            copies[sig] = t.clone()
        return copies[sig]

    cloned = {p for p, t in tensors.items() if t.untyped_storage().data_ptr() in mixed}
    return _map_tensors(state, own), cloned


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` rebuilt with ``fn(t)`` for every tensor (dicts keep their type and order)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = _map_tensors(v, fn)
        return out
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_map_tensors(v, fn) for v in obj)
    if isinstance(obj, argparse.Namespace):
        return argparse.Namespace(**{k: _map_tensors(v, fn) for k, v in vars(obj).items()})
    return obj


def _check_pt_destination(dst: str, *, overwrite: bool, config: StorageConfig | None) -> None:
    """``dst`` must name a file: an existing folder (or ``gs://`` prefix) is refused."""
    target = parse_uri(dst)
    if target.is_local:
        folder = os.path.isdir(os.path.abspath(os.path.expanduser(target.path)))
    else:
        with open_storage(dst, config) as st:
            names = st.list("")
        folder = bool(names) and names != [""]
    if folder:
        raise ConfigError(f"{dst} is a folder; --format pt writes one file: name a file "
                          f"such as {dst.rstrip('/')}/checkpoint.pt")
    check_destination(None, dst, writes="file", overwrite=overwrite, config=config)


def export_pt(state: Any, dst: str, *, overwrite: bool = False,
              config: StorageConfig | None = None,
              progress: Progress | None = None) -> ExportReport:
    """Write ``state`` as one ``torch.save`` file at ``dst`` (local path or ``gs://`` object).

    The file is built in memory (one copy of the state) and written atomically.
    See the module docstring for the fairseq layout and ``safe_globals``.

    Raises:
        OutputExistsError: ``dst`` exists and not ``overwrite`` (a ConfigError).
        ConfigError: ``dst`` is a folder; a meta tensor (names it).
    """
    _check_pt_destination(dst, overwrite=overwrite, config=config)
    report = ExportReport(dst=dst, format="pt")
    state = _plain_fairseq(state, report)
    leaves: list[tuple[str, Any]] = []
    walk_state(state, "", leaves)
    tensors = {p: t for p, t in leaves if isinstance(t, torch.Tensor)}
    for p, t in tensors.items():
        if t.device.type == "meta":
            raise ConfigError(f"{p}: a meta tensor has no values to export")
    state, cloned = _separate_dtypes(state, tensors)
    ties = find_ties(tensors)
    report.ties = [Tie(n, k, "copied" if not same and (n in cloned or k in cloned) else "kept")
                   for n, k, same in ties]
    once = {n for n, _, same in ties if same}  # written once, under the earlier name
    for p, t in tensors.items():
        if p not in once:
            report.count(t)
    folder, name = split_uri(dst)
    buf = io.BytesIO()
    torch.save(state, buf)
    report.safe_globals = _safe_globals(leaves, buf.getbuffer())
    with open_storage(folder, config) as st:
        _check_absent(st, [name], overwrite)
        st.write_atomic(name, [buf.getbuffer()])
    if progress:
        progress(buf.tell())
    report.files.append(dst)
    return report


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"10MiB"`` -> 10_485_760, ``"4096"`` -> 4096 (bytes).

    HF's ``max_shard_size`` convention (decimal ``KB``/``MB``/``GB``, binary ``KiB``...).

    Raises:
        ConfigError: not a size, or not positive.
    """
    m = _SIZE.match(text)
    unit = (m.group(2) or "").upper() if m else ""
    if unit and not unit.endswith("B"):
        unit += "B"
    if not m or unit not in _UNITS:
        raise ConfigError(f"{text!r} is not a size in bytes (e.g. 5GB, 500MB, 10MiB, 4096)")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ConfigError(f"size {text!r} must be positive")
    return n


def plan_shards(weights: Mapping[str, torch.Tensor],
                max_shard_size_bytes: int | None) -> list[list[str]]:
    """Names per shard, in order: fill a shard until the next tensor would pass the limit.

    HF ``save_pretrained``'s rule: a tensor larger than the limit gets a shard of its own.
    Sizes are ``numel * element_size`` (not the storage's size, which a view may exceed).
    """
    if not max_shard_size_bytes:
        return [list(weights)]
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in weights.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_size_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _own_memory(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and alone on its storage (what safetensors needs), copying only if not."""
    if t.is_contiguous() and t.storage_offset() == 0 and \
            t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.contiguous().clone()


def export_safetensors(state: Any, dst: str, *, key: str = "auto",
                       max_shard_size_bytes: int | None = None, hf_config: str | None = None,
                       overwrite: bool = False, config: StorageConfig | None = None,
                       progress: Progress | None = None) -> ExportReport:
    """Write the model weights of ``state`` as HF safetensors (see the module docstring).

    Args:
        dst: an HF model folder (``model.safetensors``, or shards and an index, go in it),
            or a file name ending in ``.safetensors`` (one file; no sharding).
        key: which weights (:func:`select_weights`).
        max_shard_size_bytes: shard above this many bytes of tensors per file (None: one
            file).
        hf_config: a ``config.json`` (or a folder holding one) copied into ``dst``, so
            ``from_pretrained(dst)`` works; without it the caller supplies one.

    With ``overwrite`` an earlier export in the folder is replaced whole: its
    ``model.safetensors`` and ``model.safetensors.index.json`` are removed first (an
    interrupted export then leaves a folder ``from_pretrained`` refuses, never a mix of
    old and new weights), and its shards that the new export did not rewrite after the
    new files are written.  Without ``overwrite`` a folder holding HF weights (or any
    other checkpoint, :func:`check_destination`) is refused.

    Raises:
        OutputExistsError: a checkpoint or earlier output at ``dst`` without ``overwrite``,
            or one of another kind (:func:`check_destination`).
        ConfigError: no weights (:func:`select_weights`), sharding asked for a single-file
            ``dst``, a meta tensor.
        CheckpointNotFoundError: ``hf_config`` is missing.
    """
    single = dst.rstrip("/").endswith(".safetensors")
    check_destination(None, dst, writes="file" if single else "hf", overwrite=overwrite,
                      config=config)
    report = ExportReport(dst=dst, format="safetensors")
    weights = dict(select_weights(state, key))
    others = left_out(state, key)
    if others:
        report.notes.append(f"not exported (safetensors holds the model weights only): "
                            f"{', '.join(others)}")
    for name, t in weights.items():
        if t.device.type == "meta":
            raise ConfigError(f"{name}: a meta tensor has no values to export")
    dropped: dict[str, str] = {}
    for name, first, same in find_ties(weights):
        if same and torch.equal(weights[name], weights[first]):
            dropped[name] = first
            report.ties.append(Tie(name, first, "dropped"))
        else:
            report.ties.append(Tie(name, first, "copied"))
    for name in dropped:
        del weights[name]
    if single and max_shard_size_bytes:
        raise ConfigError(f"{dst}: a single .safetensors file cannot be sharded; pass a folder "
                          "as DST to write shards and an index")
    shards = plan_shards(weights, max_shard_size_bytes)
    if single:
        folder, only = split_uri(dst)
        names = [only]
    else:
        folder = dst
        n = len(shards)
        names = [SINGLE_NAME] if n == 1 else \
            [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    config_doc = _read_hf_config(hf_config, config) if hf_config else None
    with open_storage(folder, config) as st:
        out = names + ([INDEX_NAME] if len(names) > 1 else []) + \
            (["config.json"] if config_doc is not None else [])
        _check_absent(st, out, overwrite)
        stale = [] if single else [n for n in st.list("") if _is_hf_weight_file(n)]
        # The entry points of an earlier export go first, so an interrupted export leaves
        # a folder that from_pretrained refuses, never old and new weights mixed.
        for old in (SINGLE_NAME, INDEX_NAME):
            if old in stale:
                st.delete(old)
                report.notes.append(f"removed {old} of the earlier export")
        weight_map: dict[str, str] = {}
        for shard, file in zip(shards, names, strict=True):
            part = {k: _own_memory(weights[k]) for k in shard}
            meta = {"format": "pt"}
            meta.update({d: k for d, k in dropped.items() if k in part})
            data = st_save(part, metadata=meta)
            st.write_atomic(file, [data])
            for k, t in part.items():
                report.count(t)
                weight_map[k] = file
            report.files.append(st.url(file))
            if progress:
                progress(len(data))
            del part, data
        if len(names) > 1:
            index = {"metadata": {"total_size": report.nbytes},
                     "weight_map": dict(sorted(weight_map.items()))}
            st.write_atomic(INDEX_NAME, [(json.dumps(index, indent=2) + "\n").encode("utf-8")])
            report.files.append(st.url(INDEX_NAME))
        for old in stale:
            if old not in names and old not in (SINGLE_NAME, INDEX_NAME):
                st.delete(old)
                report.notes.append(f"removed {old} of the earlier export")
        if config_doc is not None:
            st.write_atomic("config.json", [config_doc])
            report.files.append(st.url("config.json"))
    return report


def _read_hf_config(path: str, config: StorageConfig | None) -> bytes:
    """The bytes of ``path`` (a ``config.json``, or a folder holding one), checked to be JSON."""
    if is_single_object(path, config=config):
        folder, name = split_uri(path)
        where = path
    else:
        folder, name = path, "config.json"
        where = f"{path.rstrip('/')}/config.json"
    with open_storage(folder, config) as st:
        data = st.read_bytes(name)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointCorruptError(f"{where}: not a JSON config ({e})") from None
    if not isinstance(doc, dict):
        raise CheckpointCorruptError(f"{where}: not a JSON object")
    return data


def _namespaces_as_dicts(obj: Any) -> Any:
    """``obj`` with every ``argparse.Namespace`` replaced by the dict of its attributes."""
    if isinstance(obj, argparse.Namespace):
        return {k: _namespaces_as_dicts(v) for k, v in vars(obj).items()}
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = _namespaces_as_dicts(v)
        return out
    if isinstance(obj, list):
        return [_namespaces_as_dicts(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_namespaces_as_dicts(v) for v in obj)
    return obj


def export_dcp(state: Any, dst: str, *, overwrite: bool = False,
               config: StorageConfig | None = None) -> ExportReport:
    """Write ``state`` as a PyTorch DCP checkpoint folder (:func:`.dcp_write.write_dcp`).

    DCP has no aliasing: a tied tensor is written under each of its names (reported as
    ``"copied"``), and ``dcp.load`` into a model with the tie fills the one storage.  An
    ``argparse.Namespace`` (fairseq ``args``) is written as the dict of its attributes (a
    DCP item must load with ``torch.load(weights_only=True)``; reported in ``notes``).

    Raises:
        OutputExistsError: ``dst`` already holds a checkpoint and not ``overwrite``, or
            one of another kind (:func:`check_destination`).
        UnsupportedTypeError: a value ``torch.load(weights_only=True)`` cannot read back
            (numpy values, other classes), names the key.
    """
    from xla_ckpt.kinds.dcp_write import write_dcp  # noqa: PLC0415 - DCP support loads torch.distributed

    check_destination(None, dst, writes="dcp", overwrite=overwrite, config=config)
    report = ExportReport(dst=dst, format="dcp")
    leaves: list[tuple[str, Any]] = []
    walk_state(state, "", leaves)
    tensors = {p: t for p, t in leaves if isinstance(t, torch.Tensor)}
    for t in tensors.values():
        report.count(t)
    report.ties = [Tie(n, k, "copied") for n, k, _ in find_ties(tensors)]
    spaces = [p for p, v in leaves if isinstance(v, argparse.Namespace)]
    if spaces:
        state = _namespaces_as_dicts(state)
        report.notes.append(f"{', '.join(spaces)}: argparse.Namespace written as a dict (a DCP "
                            "item must load with torch.load(weights_only=True))")
    write_dcp(state, dst, config=config, overwrite=overwrite)
    with open_storage(dst, config) as st:
        report.files = [st.url(n) for n in st.list("")]
    return report


def export(uri: str, dst: str, *, fmt: str, key: str = "auto",
           max_shard_size_bytes: int | None = None, hf_config: str | None = None,
           overwrite: bool = False, config: StorageConfig | None = None,
           progress: Progress | None = None, rank_states: str = "error") -> ExportReport:
    """Load ``uri`` (anything :func:`xla_ckpt.load` reads) and export it as ``fmt``.

    Args:
        fmt: ``"pt"`` (:func:`export_pt`), ``"safetensors"`` (:func:`export_safetensors`;
            ``key``, ``max_shard_size_bytes``, ``hf_config`` apply to it only) or ``"dcp"``
            (:func:`export_dcp`).
        rank_states: what to do with the checkpoint's per-rank items ``rank/<r>``
            (:data:`RANK_STATES`; the module docstring): ``"error"`` refuses a pt or dcp
            export of a checkpoint that has them, ``"nest"`` writes them as
            ``state["rank_states"][r]``, ``"drop"`` leaves them out (noted).  safetensors
            never writes them (noted).

    Raises:
        ConfigError: an unknown ``fmt`` or ``rank_states``; ``dst`` is ``uri`` or inside it;
            or what the exporter raises.
        RankItemsNotExportedError: per-rank items and ``rank_states="error"`` (names them),
            or ``"nest"`` into a state that is not a dict or has a ``rank_states`` key.
        OutputExistsError: ``dst`` holds a checkpoint (:func:`check_destination`).
        and what :func:`xla_ckpt.load` raises.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if rank_states not in RANK_STATES:
        raise ConfigError(f"rank_states must be one of {', '.join(RANK_STATES)}, not "
                          f"{rank_states!r}")
    if fmt == "safetensors" and rank_states == "nest":
        raise ConfigError("--rank-states nest applies to --format pt and dcp: safetensors "
                          "holds the model weights only")
    if fmt != "safetensors" and (max_shard_size_bytes or hf_config or key != "auto"):
        raise ConfigError("--max-shard-size, --hf-config and --key apply to --format "
                          "safetensors only")
    writes = {"pt": "file", "dcp": "dcp"}.get(fmt) or \
        ("file" if dst.rstrip("/").endswith(".safetensors") else "hf")
    check_destination(uri, dst, writes=writes, overwrite=overwrite, config=config)
    state, ranks, names = _read_with_ranks(uri, config, nest=rank_states == "nest")
    notes: list[str] = []
    if names:
        listed = ", ".join(names)
        if fmt == "safetensors" or rank_states == "drop":
            notes.append(f"not exported: the per-rank items {listed} (each rank's own state)")
        elif rank_states == "error":
            raise RankItemsNotExportedError(
                f"{uri} holds per-rank items ({listed}: each rank's own state, e.g. its "
                f"iterator position and RNG state) that a --format {fmt} export has no place "
                f"of its own for; pass --rank-states nest (rank_states='nest') to write them "
                f"as state['{RANK_STATES_KEY}'][rank], or --rank-states drop to leave them out",
                names)
        else:
            state = _nest_ranks(uri, state, ranks, names)
            notes.append(f"the per-rank items {listed} are written as "
                         f"state['{RANK_STATES_KEY}'][rank] (ranks {sorted(ranks)})")
    report = _export_state(state, dst, fmt=fmt, key=key,
                           max_shard_size_bytes=max_shard_size_bytes, hf_config=hf_config,
                           overwrite=overwrite, config=config, progress=progress)
    report.notes += notes
    return report


def _read_with_ranks(uri: str, config: StorageConfig | None, *, nest: bool
                     ) -> tuple[Any, dict[int, Any], list[str]]:
    """``(state, {rank: its item} (read only when ``nest``), per-rank item names)`` of
    ``uri``, from one resolution (foreign sources have no per-rank items)."""

    def read(resolved: Any) -> tuple[Any, dict[int, Any], list[str]]:
        manifest = resolved.manifest
        names = sorted(n for n in (manifest.items if manifest is not None else ())
                       if _RANK_ITEM.match(n))
        items = read_items(resolved, STATE_ITEM, optional=tuple(names) if nest else (),
                           config=config)
        ranks = {int(n.split("/", 1)[1]): items[n] for n in names if n in items}
        return items[STATE_ITEM], ranks, names

    return read_checkpoint(uri, read, config=config)


_RANK_ITEM = re.compile(r"^rank/\d+$")


def _nest_ranks(uri: str, state: Any, ranks: dict[int, Any], names: list[str]) -> dict:
    if not isinstance(state, Mapping) or RANK_STATES_KEY in state:
        why = (f"its state is a {type(state).__name__}, not a dict" if not isinstance(
            state, Mapping) else f"its state already has a {RANK_STATES_KEY!r} entry")
        raise RankItemsNotExportedError(
            f"{uri}: cannot nest the per-rank items {', '.join(names)}: {why}; pass "
            "--rank-states drop (rank_states='drop') to leave them out", names)
    return {**state, RANK_STATES_KEY: dict(sorted(ranks.items()))}


def _export_state(state: Any, dst: str, *, fmt: str, key: str,
                  max_shard_size_bytes: int | None, hf_config: str | None, overwrite: bool,
                  config: StorageConfig | None, progress: Progress | None) -> ExportReport:
    if fmt == "pt":
        return export_pt(state, dst, overwrite=overwrite, config=config, progress=progress)
    if fmt == "safetensors":
        return export_safetensors(state, dst, key=key, max_shard_size_bytes=max_shard_size_bytes,
                                  hf_config=hf_config, overwrite=overwrite, config=config,
                                  progress=progress)
    return export_dcp(state, dst, overwrite=overwrite, config=config)
