"""Checkpoint folder names that record a position in training (fairseq's naming).

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


def name_fields(name: str) -> tuple[int, int | None] | None:
    """``(epoch, num_updates)`` that a folder name records: ``checkpoint_<epoch>_<updates>``
    -> both, ``checkpoint<epoch>`` -> ``(epoch, None)``; None for any other name."""
    m = UPDATE_NAME.match(name)
    if m:
        return int(m.group(1)), int(m.group(2))
    m = EPOCH_NAME.match(name)
    return (int(m.group(1)), None) if m else None
