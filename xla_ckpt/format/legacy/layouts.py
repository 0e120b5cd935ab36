"""The entry point, :func:`load_legacy`: sniff the kind, load, walk, then apply the layout.

A :data:`Layout` says what the loaded object becomes: ``auto`` (fairseq-looking
dicts are upgraded, anything else kept), ``fairseq``, ``raw`` or ``model``
(wrapped as ``{"model": obj}``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from xla_ckpt.errors import CheckpointCorruptError, ConfigError
from xla_ckpt.format.legacy.fairseq import (
    fairseq_metadata,
    looks_like_fairseq,
    upgrade_fairseq_state,
)
from xla_ckpt.format.legacy.kinds import Kind, Source, _as_file, load_safetensors_file, sniff_format
from xla_ckpt.format.legacy.unpickle import _Walker, load_torch_file

Layout = Literal["auto", "fairseq", "raw", "model"]


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
        ConfigError: ``layout="model"`` on a fairseq checkpoint (pass ``"fairseq"``/``"auto"``).
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
    fairseq = False
    if layout == "fairseq" or (layout == "auto" and looks_like_fairseq(obj)):
        if not isinstance(obj, dict) or "model" not in obj:
            raise CheckpointCorruptError(f"{where}: not a fairseq checkpoint (no 'model' key)")
        obj = upgrade_fairseq_state(obj, where=where)
        md.update(fairseq_metadata(obj))
        fairseq = True
    elif layout == "model":
        if looks_like_fairseq(obj):
            raise ConfigError(f"{where}: is a fairseq checkpoint (model, optimizer_history, "
                              "extra_state, ...), not a bare state_dict: --layout model would "
                              "store the whole fairseq dict under 'model'; pass --layout "
                              "fairseq or auto (layout='fairseq'/'auto')")
        obj = {"model": obj}
    return LegacyFile(state=obj, kind=kind, fairseq=fairseq, metadata=md)
