"""How small objects travel on the control plane: typed JSON, never pickles.

:func:`encode_object` / :func:`decode_object` turn a small object (decisions,
manifests, failure reports; no tensors) into the bytes a :class:`~.base.Dist`
exchanges and back, through :mod:`xla_ckpt.format.typed`: a peer can send
data, not code.
"""

from __future__ import annotations

import json
from typing import Any

from xla_ckpt.errors import CheckpointCorruptError
from xla_ckpt.format import typed


def encode_object(obj: Any) -> bytes:
    """Typed JSON bytes of a small object (no tensors).

    Raises:
        UnsupportedTypeError: ``obj`` holds something the typed encoding cannot carry.
    """
    return json.dumps(typed.encode(obj), ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode("utf-8")


def decode_object(data: bytes) -> Any:
    """Inverse of :func:`encode_object`.

    Raises:
        CheckpointCorruptError: the bytes are not a typed JSON document.
    """
    try:
        return typed.decode(json.loads(data.decode("utf-8")))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointCorruptError(f"control-plane message is not typed JSON ({e})") from None
