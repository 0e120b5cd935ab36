"""A run folder: its checkpoints (committed or not) and its pointers.

Layout of a run folder (local path or ``gs://bucket/prefix``)::

    <run>/checkpoint_1_500/manifest.json       committed checkpoint (manifest = commit marker)
    <run>/checkpoint_1_500/data-<id>-state.safetensors
    <run>/checkpoint_2_1000/data-...           no manifest: incomplete, never restored
    <run>/checkpoint_last.json                 pointer {"checkpoint": "checkpoint_1_500", ...}
    <run>/checkpoint_best.json                 pointer

Pointers are written only after the checkpoint they name has committed, as
one atomic object.  "Latest" is decided by one rank (``resolve_latest``) and
broadcast (DESIGN decision 2): listings on different ranks may disagree.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from xla_ckpt.errors import CheckpointCorruptError, CheckpointNotFoundError
from xla_ckpt.format import typed
from xla_ckpt.format.manifest import MANIFEST_NAME, Manifest, valid_file_name
from xla_ckpt.io.reader import read_manifest
from xla_ckpt.storage import Storage

logger = logging.getLogger(__name__)

POINTERS = ("last", "best")
POINTER_SUFFIX = ".json"


def pointer_name(which: str) -> str:
    if which not in POINTERS:
        raise ValueError(f"pointer must be one of {POINTERS}, not {which!r}")
    return f"checkpoint_{which}{POINTER_SUFFIX}"


@dataclass
class CheckpointEntry:
    """One checkpoint folder in a run folder.

    Attributes:
        name: folder name relative to the run folder.
        committed: True when its manifest (commit marker) exists and parses.
        manifest: the parsed manifest (None if not committed).
        metadata: the typed-decoded metadata summary the saver passed.
        nbytes: bytes of its data files (listed size if not committed).
        error: why a folder with a manifest is still not usable (corrupt manifest).
    """

    name: str
    committed: bool
    manifest: Manifest | None = None
    metadata: Any = None
    nbytes: int = 0
    error: str = ""

    @property
    def num_updates(self) -> int:
        md = self.metadata if isinstance(self.metadata, dict) else {}
        v = md.get("num_updates", -1)
        return v if isinstance(v, int) else -1

    @property
    def sort_key(self) -> tuple:
        created = self.manifest.created_unix_s if self.manifest else 0.0
        return (self.num_updates, created, self.name)


def list_checkpoints(run: Storage) -> list[CheckpointEntry]:
    """Every checkpoint folder directly under ``run``, oldest first (by num_updates, then time).

    Folders without a commit marker are returned with ``committed=False``.
    """
    folders: dict[str, int] = {}
    has_manifest: set[str] = set()
    for name in run.list(""):
        if "/" not in name:
            continue
        folder, rest = name.split("/", 1)
        if "/" in rest:
            continue
        if rest == MANIFEST_NAME:
            has_manifest.add(folder)
        folders[folder] = folders.get(folder, 0)
    out = []
    for folder in folders:
        if folder not in has_manifest:
            size = 0
            out.append(CheckpointEntry(folder, committed=False, nbytes=size))
            continue
        try:
            m = read_manifest(run.child(folder))
        except (CheckpointCorruptError, CheckpointNotFoundError) as e:
            out.append(CheckpointEntry(folder, committed=False, error=str(e)))
            continue
        md = typed.decode(m.metadata) if m.metadata is not None else None
        out.append(CheckpointEntry(folder, True, m, md, m.nbytes))
    return sorted(out, key=lambda e: e.sort_key)


def read_pointer(run: Storage, which: str = "last") -> str | None:
    """Checkpoint folder name a pointer names, or None if the pointer is absent/unreadable."""
    try:
        doc = json.loads(run.read_bytes(pointer_name(which)).decode("utf-8"))
    except CheckpointNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError) as e:
        logger.warning("ignoring unreadable pointer %s: %s", run.url(pointer_name(which)), e)
        return None
    name = doc.get("checkpoint") if isinstance(doc, dict) else None
    return name if valid_file_name(name) else None


def write_pointer(run: Storage, which: str, checkpoint: str, **extra: Any) -> None:
    """Point ``checkpoint_<which>`` at a committed checkpoint (one atomic object write).

    Call only after ``checkpoint`` has committed, from one rank.
    """
    if not valid_file_name(checkpoint):
        raise ValueError(f"bad checkpoint folder name {checkpoint!r}")
    doc = {"checkpoint": checkpoint, **extra}
    run.write_atomic(pointer_name(which), [json.dumps(doc, sort_keys=True).encode("utf-8")])


def choose_latest(run: Storage, entries: list[CheckpointEntry]) -> str | None:
    """Which of ``entries`` (:func:`list_checkpoints` of ``run``) to restore, or None if none
    is committed.

    The ``checkpoint_last`` pointer wins if it names a committed checkpoint and
    none newer is committed; otherwise the newest committed checkpoint (the
    pointer lags after a crash between commit and pointer update).
    """
    committed = [e for e in entries if e.committed]
    ptr = read_pointer(run, "last")
    chosen = next((e for e in committed if e.name == ptr), None)
    if chosen is not None:
        newest = committed[-1]
        # The pointer lags (a crash between commit and pointer update): newest committed wins.
        return newest.name if newest.sort_key > chosen.sort_key else chosen.name
    if ptr is not None and committed:
        logger.warning("pointer %s names %r, which is not a committed checkpoint; ignoring it",
                       run.url(pointer_name("last")), ptr)
    return committed[-1].name if committed else None


def resolve_latest(run: Storage) -> str | None:
    """Name of the checkpoint to restore from a run folder, or None if none is committed.

    :func:`choose_latest` over :func:`list_checkpoints`.  Call on one rank and
    send the answer to the others.  Entry points resolve a URI with
    :func:`xla_ckpt.io.resolve.resolve`, which uses this rule and says what
    "none committed" means.
    """
    return choose_latest(run, list_checkpoints(run))


def is_checkpoint(storage: Storage) -> bool:
    """True if ``storage`` is rooted at a committed checkpoint folder (has a manifest)."""
    return storage.exists(MANIFEST_NAME)
