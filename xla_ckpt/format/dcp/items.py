"""A DCP checkpoint's non-tensor items: ``torch.save`` bytes, loaded with ``weights_only`` only.

DCP saves every non-tensor value of the state (``param_groups`` entries such as ``lr``,
ints, strings, lists) with ``torch.save`` into a ``BytesIO`` and writes those bytes as one
storage item (``BytesStorageMetadata``).  DCP's own loader reads them back with
``torch.load(weights_only=False)``; xla_ckpt never does: :func:`load_bytes_item` uses
``torch.load(weights_only=True)`` and nothing else, so a value outside torch's
``weights_only`` allow-list is refused by name, never run.  The zip's CRC-32 of every member
is checked first (``torch.load`` does not), so a flipped bit is an error, not another value.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from typing import Any

import torch

from xla_ckpt.errors import CheckpointCorruptError, IntegrityError, UnsafePickleError


def load_bytes_item(data: bytes | bytearray | memoryview, *, where: str) -> Any:
    """The value of one DCP bytes item (tensors in it on CPU).

    Args:
        data: the item's bytes (its ``_StorageInfo`` range of the ``.distcp`` file).
        where: file and key, named in errors.

    Raises:
        UnsafePickleError: the value needs a global outside torch's ``weights_only``
            allow-list (the message names it).
        IntegrityError: a zip member's CRC-32 does not match its bytes.
        CheckpointCorruptError: the bytes are not a ``torch.save`` payload.
    """
    raw = bytes(data)
    _check_crc(raw, where=where)
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        reason = next((ln.split("WeightsUnpickler error:", 1)[-1].strip() for ln in lines
                       if "WeightsUnpickler error:" in ln or "GLOBAL" in ln
                       or ln.startswith(("Unsupported", "Trying"))), None)
        if reason is not None:
            raise UnsafePickleError(f"{where}: torch.load(weights_only=True) refused the item: "
                                    f"{reason[:300]} xla_ckpt never unpickles DCP items without "
                                    "weights_only; load it with torch.distributed.checkpoint in "
                                    "a trusted process") from None
        raise CheckpointCorruptError(f"{where}: malformed torch.save item "
                                     f"({(lines[-1] if lines else 'unpickling failed')[:300]})") \
            from None
    except MemoryError:
        raise CheckpointCorruptError(f"{where}: the item declares more memory than this host "
                                     "has; it is malformed or hostile") from None
    except Exception as e:  # noqa: BLE001 - torch.load raises many types on bad bytes
        first = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointCorruptError(f"{where}: malformed or truncated torch.save item "
                                     f"({type(e).__name__}: {first})") from None


def _check_crc(raw: bytes, *, where: str) -> None:
    """CRC-32 of every member of a zip-format ``torch.save`` payload (older formats: none)."""
    if not raw.startswith(b"PK\x03\x04"):
        return
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            if sum(i.file_size for i in z.infolist()) > len(raw):
                raise CheckpointCorruptError(f"{where}: zip members declare more bytes than the "
                                             f"{len(raw)}-byte item holds")
            bad = z.testzip()
    except CheckpointCorruptError:
        raise
    except Exception as e:  # noqa: BLE001 - zipfile raises many types on hostile bytes
        raise CheckpointCorruptError(f"{where}: the item is not a readable torch.save zip "
                                     f"({type(e).__name__}: {e})") from None
    if bad is not None:
        raise IntegrityError(f"{where}: CRC-32 of zip member {bad} does not match its bytes; the "
                             "item is corrupt", path=where, key="")
