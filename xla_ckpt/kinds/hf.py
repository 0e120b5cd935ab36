"""Sharded Hugging Face safetensors checkpoints: ``model.safetensors.index.json`` and its shards.

``save_pretrained`` writes a model larger than ``max_shard_size`` as
``model-00001-of-0000N.safetensors`` files plus an index
``{"metadata": {"total_size": ...}, "weight_map": {tensor name: shard file}}``.
:func:`read_hf_index` reads and checks the index (shard names must be plain file
names next to it: no ``/``, no ``..``); :func:`load_hf_index` reads every shard
through the legacy importer (:func:`xla_ckpt.kinds.legacy.load_legacy_file`, which
validates each safetensors header) and checks that each tensor is in the shard
the index names, once.  Local paths and ``gs://`` alike.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import torch

from xla_ckpt.errors import CheckpointCorruptError, CheckpointNotFoundError
from xla_ckpt.format.manifest import valid_file_name
from xla_ckpt.kinds.legacy import Progress, load_legacy_file, split_uri
from xla_ckpt.storage import StorageConfig, open_storage

logger = logging.getLogger(__name__)

MAX_INDEX_BYTES = 64 * 1024 * 1024
"""Largest index accepted (bytes); real ones are well under 1 MiB per 10k tensors."""


@dataclass(frozen=True)
class HFIndex:
    """A parsed safetensors index.

    Attributes:
        uri: the index file's URI.
        folder: the folder URI its shards are in.
        weight_map: tensor name -> shard file name, in the index's order.
        metadata: the index's ``metadata`` object (``total_size`` in bytes, as written).
    """

    uri: str
    folder: str
    weight_map: dict[str, str]
    metadata: dict[str, Any]

    @property
    def shards(self) -> list[str]:
        """Shard file names, in order of first appearance in the weight map."""
        return list(dict.fromkeys(self.weight_map.values()))


def read_hf_index(uri: str, *, config: StorageConfig | None = None) -> HFIndex:
    """Read and check the safetensors index at ``uri`` (local or ``gs://``).

    Raises:
        CheckpointNotFoundError: no such object.
        CheckpointCorruptError: not JSON, no ``weight_map`` object, a tensor name or shard
            file name that is not a plain string, a shard name with ``/`` or ``..``, or
            larger than :data:`MAX_INDEX_BYTES`.
    """
    folder, name = split_uri(uri)
    with open_storage(folder, config) as st:
        info = st.stat(name)
        if info.size > MAX_INDEX_BYTES:
            raise CheckpointCorruptError(f"{uri}: {info.size}-byte safetensors index is larger "
                                         f"than the {MAX_INDEX_BYTES} bytes accepted")
        data = st.read_bytes(name)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"{uri}: safetensors index is not valid JSON ({e})") \
            from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointCorruptError(f"{uri}: not a safetensors index (no non-empty "
                                     "'weight_map' object)")
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or not valid_file_name(shard):
            raise CheckpointCorruptError(
                f"{uri}: weight_map[{key!r}] = {shard!r} is not a file name next to the index "
                "(no '/', no '..')")
    metadata = doc.get("metadata")
    return HFIndex(uri=uri, folder=folder, weight_map=dict(weight_map),
                   metadata=metadata if isinstance(metadata, dict) else {})


def load_hf_index(uri: str, *, config: StorageConfig | None = None,
                  progress: Progress | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the sharded safetensors checkpoint whose index is at ``uri``.

    Shards are read one at a time (peak memory: the tensors plus one shard), each
    validated by the safetensors library; tensors come back on CPU with their saved
    dtype and shape, in weight-map order.

    Args:
        progress: called with byte counts as shards are read.

    Raises:
        CheckpointNotFoundError: the index or a shard it names is missing (names it).
        CheckpointCorruptError: a malformed index or shard; a tensor the index names is
            not in its shard, or a shard holds a tensor the index does not give it (names
            the tensor and both files).
    """
    index = read_hf_index(uri, config=config)
    got: dict[str, torch.Tensor] = {}
    for shard in index.shards:
        shard_uri = f"{index.folder.rstrip('/')}/{shard}"
        try:
            tensors = load_legacy_file(shard_uri, layout="raw", config=config,
                                       progress=progress).state
        except CheckpointNotFoundError as e:
            raise CheckpointNotFoundError(f"{uri} names shard {shard}, which is missing "
                                          f"({e})") from e
        if not isinstance(tensors, dict):  # a .pt renamed to .safetensors
            raise CheckpointCorruptError(f"{shard_uri}: not a safetensors shard")
        for key, t in tensors.items():
            owner = index.weight_map.get(key)
            if owner != shard:
                raise CheckpointCorruptError(
                    f"{shard_uri} holds tensor {key!r}, which the index {uri} "
                    + (f"puts in {owner}" if owner else "does not list"))
            got[key] = t
    missing = [k for k in index.weight_map if k not in got]
    if missing:
        k = missing[0]
        raise CheckpointCorruptError(
            f"{uri}: tensor {k!r} is not in {index.weight_map[k]}, the shard the index names "
            f"({len(missing)} missing)")
    return {k: got[k] for k in index.weight_map}
