"""The entry point, :func:`load_legacy`: sniff the kind, load, walk, then apply the layout.

A :data:`Layout` says what the loaded object becomes:

* ``auto`` (the default of ``xla_ckpt.load``, ``xla-ckpt inspect`` and ``convert``)
  and ``raw``: the object exactly as saved, key for key and type for type.  ``auto``
  (not ``raw``) also recognises a fairseq checkpoint
  (:func:`~xla_ckpt.format.legacy.fairseq.fairseq_vintage`: by fairseq's own fields and
  their shapes) to report it and its ``num_updates`` / ``epoch`` / ``loss`` metadata,
  without changing it;
* ``fairseq``: a fairseq checkpoint brought to the current fairseq layout
  (:func:`~xla_ckpt.format.legacy.fairseq.upgrade_fairseq_state`; each change logged at
  WARNING); anything else is refused;
* ``model``: the object wrapped as ``{"model": obj}`` (a bare state_dict or HF weights).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from xla_ckpt.errors import ConfigError
from xla_ckpt.format.legacy.fairseq import (
    fairseq_metadata,
    fairseq_vintage,
    upgrade_fairseq_state,
)
from xla_ckpt.format.legacy.kinds import Kind, Source, _as_file, load_safetensors_file, sniff_format
from xla_ckpt.format.legacy.unpickle import _Walker, load_torch_file

logger = logging.getLogger(__name__)

Layout = Literal["auto", "fairseq", "raw", "model"]


@dataclass
class LegacyFile:
    """What :func:`load_legacy` returns.

    Attributes:
        state: the loaded state (upgraded only with ``layout="fairseq"``); CPU tensors.
        kind: ``"torch_zip"``, ``"torch_legacy"`` or ``"safetensors"``.
        fairseq: True when the file is a fairseq checkpoint (recognised by fairseq's own
            fields, :func:`~xla_ckpt.format.legacy.fairseq.fairseq_vintage`).
        upgraded: the changes the fairseq upgrade made (``layout="fairseq"`` on an old
            layout), one line each; empty when nothing was changed.
        metadata: manifest metadata for a converted checkpoint (``num_updates``,
            ``epoch``, ``iterations_in_epoch``, ``loss`` of a fairseq file when known,
            ``source_format``, and a safetensors file's own ``__metadata__``).
    """

    state: Any
    kind: Kind
    fairseq: bool = False
    upgraded: list[str] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)


def _keys(obj: Any) -> str:
    if not isinstance(obj, Mapping):
        return f"a {type(obj).__name__}"
    names = sorted(map(str, obj))
    return "keys " + ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")


def load_legacy(source: Source, *, where: str = "<bytes>", layout: Layout = "auto",
                keep_numpy_scalars: bool = False, unsafe_trust_pickle: bool = False) -> LegacyFile:
    """Load a legacy ``.pt`` (fairseq or plain ``torch.save``) or a safetensors file.

    Args:
        source: the file's bytes or a seekable binary file object.
        where: name for messages (a path or URI).
        layout: ``"auto"`` and ``"raw"`` return the object as saved (``"auto"`` also
            fills ``fairseq`` and the fairseq metadata); ``"fairseq"`` requires a fairseq
            checkpoint and upgrades an old layout (logged at WARNING); ``"model"`` wraps
            the object as ``{"model": obj}``.  See the module docstring.
        keep_numpy_scalars: keep numpy scalars instead of Python numbers.
        unsafe_trust_pickle: unpickle without the allow-list (logs a warning).

    Raises:
        UnsafePickleError: a pickle global outside
            :data:`~xla_ckpt.format.legacy.unpickle.ALLOWED_GLOBALS`.
        CheckpointCorruptError: malformed, truncated or hostile input.
        MetaTensorError: a meta tensor (names its key).
        ConfigError: ``layout="fairseq"`` on a file that is not fairseq's (names the keys
            found); ``layout="model"`` on a training dict (fairseq's, or any dict holding a
            ``model`` mapping): pass ``auto``/``raw`` (or ``fairseq``).
    """
    if layout not in ("auto", "fairseq", "raw", "model"):
        raise ValueError(f"layout must be auto, fairseq, raw or model, not {layout!r}")
    f, size = _as_file(source)
    kind = sniff_format(f.read(16), where=where, size=size)
    f.seek(0)
    md: dict = {"source_format": kind}
    if kind == "safetensors":
        obj, st_meta = load_safetensors_file(f, where=where)
        if st_meta:
            md["safetensors_metadata"] = st_meta
    else:
        obj, kind = load_torch_file(f, where=where, unsafe_trust_pickle=unsafe_trust_pickle)
    obj = _Walker(where=where, file_size=size, keep_numpy_scalars=keep_numpy_scalars).run(obj)
    vintage = fairseq_vintage(obj) if layout != "raw" else None
    upgraded: list[str] = []
    if layout == "fairseq":
        if vintage is None:
            raise ConfigError(
                f"{where}: --layout fairseq (layout='fairseq'): not a fairseq checkpoint "
                f"({_keys(obj)}); fairseq writes optimizer_history entries with "
                "criterion_name/optimizer_name/lr_scheduler_state/num_updates. Pass --layout "
                "auto or raw to import it as saved")
        obj, upgraded = upgrade_fairseq_state(obj, where=where)
        for change in upgraded:
            logger.warning("%s: fairseq upgrade (layout='fairseq'): %s", where, change)
    elif layout == "model":
        if vintage is not None or (isinstance(obj, Mapping) and
                                   isinstance(obj.get("model"), Mapping)):
            what = "a fairseq checkpoint" if vintage is not None else "a training checkpoint"
            ways = "fairseq or auto" if vintage is not None else "auto or raw"
            raise ConfigError(
                f"{where}: is {what} ({_keys(obj)}), not a bare state_dict: --layout model "
                f"would store the whole dict under 'model'; pass --layout {ways} "
                f"(layout='{ways.split()[0]}'/'{ways.split()[-1]}')")
        obj = {"model": obj}
    if vintage is not None:
        md.update(fairseq_metadata(obj))
    return LegacyFile(state=obj, kind=kind, fairseq=vintage is not None, upgraded=upgraded,
                      metadata=md)
