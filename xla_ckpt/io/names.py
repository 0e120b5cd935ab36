"""Names inside a run folder: checkpoint folders that record a position in training
(fairseq's naming), the data files of a checkpoint, and the files of an HF model folder.

* ``checkpoint<epoch>``: an end-of-epoch checkpoint;
* ``checkpoint_<epoch>_<updates>``: an update-interval or preemption checkpoint.

The manager names its checkpoints so (:mod:`xla_ckpt.manager.naming`, which also decides when);
readers of a run folder (``xla-ckpt ls``) read the epoch and step back from a name when the
metadata lacks them.  Pure: no I/O.
"""

from __future__ import annotations

import re

EPOCH_NAME = re.compile(r"^checkpoint(\d+)$")
"""``checkpoint<epoch>``."""
UPDATE_NAME = re.compile(r"^checkpoint_(\d+)_(\d+)$")
"""``checkpoint_<epoch>_<num_updates>``."""
DATA_PREFIX = "data-"
"""Data files of a checkpoint are ``data-<save id>-<item slug>.safetensors``
(:func:`xla_ckpt.io.writer.data_file_name`)."""


def name_fields(name: str) -> tuple[int, int | None] | None:
    """``(epoch, num_updates)`` that a folder name records: ``checkpoint_<epoch>_<updates>``
    -> both, ``checkpoint<epoch>`` -> ``(epoch, None)``; None for any other name."""
    m = UPDATE_NAME.match(name)
    if m:
        return int(m.group(1)), int(m.group(2))
    m = EPOCH_NAME.match(name)
    return (int(m.group(1)), None) if m else None


INDEX_NAME = "model.safetensors.index.json"
"""The index ``save_pretrained`` writes next to sharded safetensors weights."""
INDEX_SUFFIX = ".safetensors.index.json"
"""How the name of any safetensors index ends (``model.safetensors.index.json``)."""
SINGLE_NAME = "model.safetensors"
"""The one weights file of an unsharded HF model folder."""


def is_index_name(name: str) -> bool:
    """True if ``name`` (a file name) is a safetensors index name."""
    return name.endswith(INDEX_SUFFIX)
