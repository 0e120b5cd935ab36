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

**Order.**  A checkpoint written by the :class:`~xla_ckpt.manager.CheckpointManager`
records the lease epoch of the job incarnation that wrote it (metadata key
``lease_epoch``, see :mod:`xla_ckpt.run.fencing`); one written without a lease has
epoch 0.  "Newer" means a higher ``(lease_epoch, num_updates)``, then a later
creation time: a newer incarnation always wins, within one incarnation the higher
update count does.  :attr:`CheckpointEntry.sort_key`, "latest" and rotation all use it.

**Pointers move by compare-and-swap** (:func:`write_pointer`): the pointer is read
with its generation and written with ``if_generation_match`` on it (0 when absent);
when another writer changed it meanwhile the write is refused by the store and
retried on what is there now (bounded).  A pointer document written with a
``lease_epoch`` carries it and ``num_updates``, and such a write moves the pointer
only if its ``(lease_epoch, num_updates)`` is at least the current one's, so the
pointer never goes backwards, whatever the interleaving of writers.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
from dataclasses import dataclass
from typing import Any

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    PreconditionFailedError,
)
from xla_ckpt.format import typed
from xla_ckpt.format.manifest import MANIFEST_NAME, Manifest, valid_file_name
from xla_ckpt.io.manifest_file import (
    LEASE_EPOCH_KEY,
    Order,
    order_from_metadata,
    order_of,
    read_manifest,
    save_id_from_metadata,
)
from xla_ckpt.run.sniff import foreign_checkpoints
from xla_ckpt.storage import RangeRead, Storage

logger = logging.getLogger(__name__)

POINTERS = ("last", "best")
POINTER_SUFFIX = ".json"


CAS_ATTEMPTS = 16
"""Compare-and-swap attempts of one pointer move before giving up (each re-reads it)."""

_READ_ATTEMPTS = 8  # an object replaced between its stat and its pinned read is read again


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
        error: why a folder with a manifest is still not usable (a corrupt or hostile
            manifest, a format version newer than this library reads); such a folder is
            committed-but-unreadable (:attr:`unreadable`), not an incomplete save.
        kind: ``""`` for a folder of this library; otherwise, in words, the checkpoint of
            another kind the folder holds without an xla_ckpt manifest (``"a PyTorch DCP
            checkpoint"``, ``"an HF model folder"``; :func:`xla_ckpt.run.resolve.
            foreign_checkpoints`).  Such a folder is not committed, but it is not an
            incomplete save either: ``ls`` lists it apart and ``rm``/``gc`` never delete it.
    """

    name: str
    committed: bool
    manifest: Manifest | None = None
    metadata: Any = None
    nbytes: int = 0
    error: str = ""
    kind: str = ""

    @property
    def unreadable(self) -> bool:
        """A manifest (commit marker) is present but cannot be used: corrupt, a hostile
        chunk table, or written by a newer xla_ckpt.  Never restored; ``gc`` leaves it
        alone; ``ls`` lists it apart from incomplete saves, with :attr:`reason`."""
        return not self.committed and bool(self.error)

    @property
    def reason(self) -> str:
        """One line on why an :attr:`unreadable` checkpoint cannot be used (``""`` if it can),
        e.g. ``"unreadable: manifest version 3 is newer than this xla_ckpt reads (versions
        1, 2); upgrade xla_ckpt"``."""
        if not self.unreadable:
            return ""
        text = self.error
        head = f"{MANIFEST_NAME}: "
        if head in text:  # drop the "<folder>/manifest.json: " prefix: the row names it
            text = text.split(head, 1)[1]
        m = _UNSUPPORTED_VERSION.search(text)
        known = [int(v) for v in re.findall(r"\d+", m.group(2))] if m else []
        if m and known and int(m.group(1)) > max(known):
            text = (f"manifest version {m.group(1)} is newer than this xla_ckpt reads "
                    f"(versions {m.group(2)}); upgrade xla_ckpt")
        return f"unreadable: {text}"

    @property
    def num_updates(self) -> int:
        md = self.metadata if isinstance(self.metadata, dict) else {}
        v = md.get("num_updates", -1)
        return v if isinstance(v, int) else -1

    @property
    def lease_epoch(self) -> int:
        """Lease epoch of the incarnation that wrote it (0: written without a lease)."""
        return epoch_of(self.metadata)

    @property
    def sort_key(self) -> tuple:
        """Oldest first: ``(lease_epoch, num_updates, created, name)`` (module docstring)."""
        created = self.manifest.created_unix_s if self.manifest else 0.0
        return (self.lease_epoch, self.num_updates, created, self.name)


_UNSUPPORTED_VERSION = re.compile(
    r"manifest version (\d+) is not supported by this xla_ckpt \(reads versions ([^)]*)\)")


def epoch_of(doc: Any) -> int:
    """The ``lease_epoch`` a metadata summary or pointer document records (0 if none)."""
    v = doc.get(LEASE_EPOCH_KEY, 0) if isinstance(doc, dict) else 0
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def list_checkpoints(run: Storage) -> list[CheckpointEntry]:
    """Every checkpoint folder directly under ``run``, oldest first.

    Order: :attr:`CheckpointEntry.sort_key` (lease epoch, num_updates, then time).

    Folders without a commit marker are returned with ``committed=False``; those holding a
    checkpoint of another kind (a DCP ``.metadata``, an HF model) have ``kind`` set.
    """
    return list_run(run)[0]


def list_run(run: Storage) -> tuple[list[CheckpointEntry], list[tuple[str, str]]]:
    """One listing of ``run``: :func:`list_checkpoints`'s entries, and ``(name, kind in
    words)`` of every checkpoint of another kind in it (folders, as in the entries'
    ``kind``, and top-level files such as a fairseq ``checkpoint_last.pt``), sorted by name.
    """
    names = run.list("")
    foreign = foreign_checkpoints(names)
    foreign_kind = dict(foreign)
    folders: dict[str, int] = {}
    has_manifest: set[str] = set()
    for name in names:
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
            out.append(CheckpointEntry(folder, committed=False,
                                       kind=foreign_kind.get(folder, "")))
            continue
        try:
            m = read_manifest(run.child(folder))
        except (CheckpointCorruptError, CheckpointNotFoundError) as e:
            out.append(CheckpointEntry(folder, committed=False, error=str(e)))
            continue
        md = typed.decode(m.metadata) if m.metadata is not None else None
        out.append(CheckpointEntry(folder, True, m, md, m.nbytes))
    committed = {e.name for e in out if e.committed}
    return (sorted(out, key=lambda e: e.sort_key),
            [(n, kind) for n, kind in foreign if n not in committed])


def read_versioned(storage: Storage, name: str) -> tuple[bytes, int | None] | None:
    """``(bytes, generation)`` of object ``name``, the bytes read pinned to that generation;
    None if there is no such object.

    A conditional write or delete that passes the generation acts only if the object is
    still what was read.  On GCS the read is pinned to it; a local read opens whatever file
    has the name by then, so the generation is looked at again after the read and a
    replace in between (a newer file, maybe of another size) is read again.

    Raises:
        PreconditionFailedError: it was replaced during each of a few reads (busy writers:
            what a compare-and-swap loop retries, like a refused write).
    """
    last: tuple[int | None, int | None] = (None, None)
    for attempt in range(_READ_ATTEMPTS):
        if attempt:
            time.sleep(random.uniform(0, 0.002 * 2 ** attempt))
        try:
            info = storage.stat(name)
            buf = bytearray(info.size)
            if info.size:
                storage.read_ranges([RangeRead(name, 0, memoryview(buf), info.generation)])
            now = storage.stat(name).generation
            if now != info.generation:
                last = (info.generation, now)
                continue  # replaced while it was read
        except CheckpointNotFoundError:
            if not storage.exists(name):
                return None
            continue  # replaced between the stat and the pinned read: read the new one
        except CheckpointCorruptError:
            continue  # shortened by a replace between the stat and the read
        return bytes(buf), info.generation
    raise PreconditionFailedError(
        f"{storage.url(name)}: replaced during each of {_READ_ATTEMPTS} reads", name=name,
        expected_generation=last[0] or 0, actual_generation=last[1])


def read_pointer_doc(run: Storage, which: str) -> tuple[dict | None, int | None]:
    """``(document, generation)`` of pointer ``which``: ``(None, 0)`` when absent, ``(None,
    generation)`` when unreadable (it may be replaced on that generation)."""
    got = read_versioned(run, pointer_name(which))
    if got is None:
        return None, 0
    data, generation = got
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        logger.warning("ignoring unreadable pointer %s: %s", run.url(pointer_name(which)), e)
        return None, generation
    return (doc if isinstance(doc, dict) else None), generation


def pointer_order(doc: dict | None) -> tuple[int, int]:
    """``(lease_epoch, num_updates)`` of a pointer document ((0, -1) for what lacks them)."""
    if not isinstance(doc, dict):
        return (0, -1)
    n = doc.get("num_updates", -1)
    return (epoch_of(doc), n if isinstance(n, int) and not isinstance(n, bool) else -1)


def read_pointer(run: Storage, which: str = "last") -> str | None:
    """Checkpoint folder name a pointer names, or None if the pointer is absent/unreadable.

    Read as :func:`read_pointer_doc` does, so a pointer replaced while it is read is read
    again, never taken for an unreadable one.
    """
    doc, _ = read_pointer_doc(run, which)
    name = doc.get("checkpoint") if doc is not None else None
    return name if valid_file_name(name) else None


def write_pointer(run: Storage, which: str, checkpoint: str, *, lease_epoch: int | None = None,
                  num_updates: int | None = None, attempts: int = CAS_ATTEMPTS,
                  **extra: Any) -> bool:
    """Point ``checkpoint_<which>`` at a committed checkpoint by compare-and-swap.

    Reads the pointer with its generation and writes the new document with
    ``if_generation_match`` on it (0: create only, when absent); when another writer
    changed it in between, the store refuses and this reads again and retries, up to
    ``attempts`` times.

    With ``lease_epoch`` (the manager's writes) the document records it and
    ``num_updates``, and the pointer moves only if ``(lease_epoch, num_updates)`` is at
    least what the current document records (a newer incarnation always wins; within
    one, the higher update count): it never goes backwards.  Without it (a tool's or an
    operator's write) it moves whatever is there.  Call only after ``checkpoint`` has
    committed, from one rank.

    Returns:
        True if the pointer now names ``checkpoint``; False if it was left alone because
        it names a newer one (read it with :func:`read_pointer_doc`).

    Raises:
        PreconditionFailedError: the pointer changed under every one of ``attempts`` tries.
    """
    if not valid_file_name(checkpoint):
        raise ValueError(f"bad checkpoint folder name {checkpoint!r}")
    doc: dict[str, Any] = {"checkpoint": checkpoint, **extra}
    if num_updates is not None:
        doc["num_updates"] = num_updates
    if lease_epoch is not None:
        doc[LEASE_EPOCH_KEY] = lease_epoch
    body = json.dumps(doc, sort_keys=True).encode("utf-8")
    ours = pointer_order(doc)
    name = pointer_name(which)
    last: PreconditionFailedError | None = None
    for attempt in range(attempts):
        try:
            current, generation = read_pointer_doc(run, which)
            if lease_epoch is not None and current is not None and \
                    pointer_order(current) > ours:
                logger.info("%s names %r at (lease epoch, update) %s, newer than %s for %r: "
                            "left alone", run.url(name), current.get("checkpoint"),
                            pointer_order(current), ours, checkpoint)
                return False
            run.write_atomic(name, [body], if_generation_match=generation)
            return True
        except PreconditionFailedError as e:  # another writer moved it: look again
            last = e
            time.sleep(random.uniform(0, min(0.2, 0.005 * 2 ** attempt)))
    raise PreconditionFailedError(
        f"{run.url(name)}: not moved to {checkpoint!r}: it changed under each of {attempts} "
        "compare-and-swap attempts (many concurrent writers?)", name=name,
        expected_generation=last.expected_generation if last else 0,
        actual_generation=last.actual_generation if last else None) from last


MOVED = "moved"
REMOVED = "removed"
LEFT = "left"


def repoint(run: Storage, which: str, away_from: str, to: CheckpointEntry | None, *,
            attempts: int = CAS_ATTEMPTS) -> str:
    """Move pointer ``which`` off checkpoint ``away_from`` by compare-and-swap, only while it
    still names it: to the committed checkpoint ``to`` (recording its lease epoch and
    ``num_updates``, so a manager's later save moves it forward as usual), or, with ``to``
    None, remove it.  An operator's act (``xla-ckpt rm --force``): it takes no lease and may
    move the pointer backwards, but only from the checkpoint being removed; a save that
    moved the pointer meanwhile wins.  Call from one process.

    Returns:
        :data:`MOVED`, :data:`REMOVED`, or :data:`LEFT` (absent, or it names another
        checkpoint now).

    Raises:
        PreconditionFailedError: the pointer changed under every one of ``attempts`` tries.
    """
    name = pointer_name(which)
    body = b""
    if to is not None:
        md = to.metadata if isinstance(to.metadata, dict) else {}
        doc: dict[str, Any] = {"checkpoint": to.name, "num_updates": to.num_updates,
                               LEASE_EPOCH_KEY: to.lease_epoch, "moved_back_from": away_from}
        if isinstance(md.get("epoch"), int) and not isinstance(md.get("epoch"), bool):
            doc["epoch"] = md["epoch"]
        body = json.dumps(doc, sort_keys=True).encode("utf-8")
    last: PreconditionFailedError | None = None
    for attempt in range(attempts):
        current, generation = read_pointer_doc(run, which)
        if current is None or current.get("checkpoint") != away_from:
            return LEFT
        try:
            if to is None:
                run.delete(name, if_generation_match=generation)
                logger.info("%s named %r: removed", run.url(name), away_from)
                return REMOVED
            run.write_atomic(name, [body], if_generation_match=generation)
            logger.info("%s moved from %r back to %r", run.url(name), away_from, to.name)
            return MOVED
        except PreconditionFailedError as e:  # a save moved it meanwhile: look again
            last = e
            time.sleep(random.uniform(0, min(0.2, 0.005 * 2 ** attempt)))
    raise PreconditionFailedError(
        f"{run.url(name)}: not moved off {away_from!r}: it changed under each of {attempts} "
        "compare-and-swap attempts (many concurrent writers?)", name=name,
        expected_generation=last.expected_generation if last else 0,
        actual_generation=last.actual_generation if last else None) from last


def _choose(doc: dict | None, committed: list[tuple[str, tuple]], where: str) -> str | None:
    """The rule of :func:`choose_latest` over ``committed`` (``(name, sort key)``, oldest
    first) and the ``checkpoint_last`` document ``doc`` (None: absent or unreadable)."""
    ptr = doc.get("checkpoint") if doc is not None else None
    ptr = ptr if valid_file_name(ptr) else None
    keys = dict(committed)
    if ptr in keys and doc is not None and epoch_of(doc) == 0 and "converted_from" in doc:
        managed = [n for n, k in committed if k[0] > 0 and k > keys[ptr]]
        return managed[-1] if managed else ptr
    if ptr in keys:
        newest, key = committed[-1]
        # The pointer lags (a crash between commit and pointer update): newest committed wins.
        return newest if key > keys[ptr] else ptr
    if ptr is not None and committed:
        logger.warning("pointer %s names %r, which is not a committed checkpoint; ignoring it",
                       where, ptr)
    return committed[-1][0] if committed else None


def read_pointer_once(run: Storage, which: str) -> dict | None:
    """The document of pointer ``which`` in one read (one GET on GCS): None when absent or
    unreadable (logged).  For deciding what to restore; a compare-and-swap reads it with its
    generation instead (:func:`read_pointer_doc`)."""
    name = pointer_name(which)
    for attempt in range(_READ_ATTEMPTS):  # a local pointer replaced while read: read again
        try:
            doc = json.loads(run.read_bytes(name).decode("utf-8"))
        except CheckpointNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError, CheckpointCorruptError) as e:
            if attempt + 1 < _READ_ATTEMPTS:
                continue
            logger.warning("ignoring unreadable pointer %s: %s", run.url(name), e)
            return None
        return doc if isinstance(doc, dict) else None
    return None  # pragma: no cover - the loop returns


@dataclass(frozen=True)
class Latest:
    """What :func:`find_latest` chose: checkpoint folder ``name`` of the run folder, its
    manifest parsed and validated, and the manifest's bytes as read."""

    name: str
    manifest: Manifest
    manifest_bytes: bytes


def _order_key(order: Order, name: str) -> tuple:
    return (*order, name)


@dataclass(frozen=True)
class Marker:
    """One committed checkpoint folder as one listing tells it: its :data:`Order`, its save
    id (None: committed without it in the marker's metadata), and its manifest with bytes
    when the listing did not tell the order and the manifest had to be read."""

    order: Order
    save_id: str | None
    read: tuple[Manifest, bytes] | None = None


def committed_markers(run: Storage) -> dict[str, Marker]:
    """Every committed checkpoint folder of ``run`` by name, from one listing of the commit
    markers with their custom metadata (:meth:`Storage.list_in_subfolders`; one request per
    1,000 checkpoints on GCS).  A marker committed without the order in its metadata (an
    earlier xla_ckpt, a local file system without user attributes) is read to learn it; one
    that cannot be read is left out with a WARNING.

    Raises:
        StorageError and its kinds: from the storage.
    """
    out: dict[str, Marker] = {}
    for m in run.list_in_subfolders("", MANIFEST_NAME):
        folder = m.name.split("/", 1)[0]
        order = order_from_metadata(m.metadata)
        if order is not None:
            out[folder] = Marker(order, save_id_from_metadata(m.metadata))
            continue
        got = _read_marker(run, folder)  # committed without the order in its metadata
        if got is not None:
            out[folder] = Marker(order_of(got[0]), got[0].save_id, got)
    return out


def find_latest(run: Storage) -> Latest | None:
    """The checkpoint :func:`choose_latest` picks in ``run``, in a number of requests that
    does not grow with the number of checkpoints kept; None when none is committed.

    One listing of the sub-folders' commit markers with their custom metadata
    (:meth:`Storage.list_in_subfolders`: the order the commit stored with each manifest,
    :func:`~xla_ckpt.io.manifest_file.order_metadata`; no data file is listed), one read of
    the ``checkpoint_last`` pointer, and one download of the chosen manifest.  Only a
    manifest committed without that metadata (by an earlier xla_ckpt, or on a local file
    system without user attributes) is downloaded to learn its order, and a chosen manifest
    that cannot be read is skipped with a WARNING (as :func:`choose_latest` skips it) and the
    next one chosen.  None sends the caller to :func:`list_checkpoints`, which says why
    nothing is committed (an unreadable commit marker, a dangling pointer, checkpoints of
    another kind).  Call on one rank and send the answer to the others.

    Raises:
        StorageError and its kinds: from the storage.
    """
    found = committed_markers(run)
    if not found:
        return None
    keys = {name: _order_key(m.order, name) for name, m in found.items()}
    read = {name: m.read for name, m in found.items() if m.read is not None}
    doc = read_pointer_once(run, "last")
    while keys:
        committed = sorted(keys.items(), key=lambda kv: kv[1])
        chosen = _choose(doc, committed, run.url(pointer_name("last")))
        assert chosen is not None  # committed is not empty
        got = read.get(chosen) or _read_marker(run, chosen)
        if got is not None:
            return Latest(chosen, *got)
        del keys[chosen]  # unreadable or gone since the listing: the next one
    return None


def _read_marker(run: Storage, folder: str) -> tuple[Manifest, bytes] | None:
    """Folder ``folder``'s manifest and its bytes (:func:`read_manifest_bytes`); None, with a
    WARNING when it is there but cannot be used, when it is gone or unreadable."""
    try:
        return read_manifest_bytes(run, f"{folder}/{MANIFEST_NAME}")
    except CheckpointCorruptError as e:
        logger.warning("%s: skipping %s: its commit marker cannot be read (%s)", run.uri,
                       folder, e)
        return None


def read_manifest_bytes(storage: Storage, name: str = MANIFEST_NAME
                        ) -> tuple[Manifest, bytes] | None:
    """The manifest ``name`` of ``storage``, parsed and validated, and its bytes; None if there
    is none.  One read (one GET on GCS); a read that does not parse is made again, up to
    :data:`_READ_ATTEMPTS` times in all, since a manifest replaced while it was read (locally:
    another size between the stat and the read) reads as corrupt once.

    Raises:
        CheckpointCorruptError: it does not parse, every time.
    """
    where = storage.url(name)
    for attempt in range(_READ_ATTEMPTS):
        try:
            data = storage.read_bytes(name)
        except CheckpointNotFoundError:
            return None
        except CheckpointCorruptError:
            if attempt + 1 < _READ_ATTEMPTS:
                continue  # shortened by a replace between the stat and the read
            raise
        try:
            return Manifest.from_json_bytes(data, where=where, require_crc=True), data
        except CheckpointCorruptError:
            if attempt + 1 < _READ_ATTEMPTS:
                continue
            raise
    return None  # pragma: no cover - the loop returns or raises


def choose_latest(run: Storage, entries: list[CheckpointEntry]) -> str | None:
    """Which of ``entries`` (:func:`list_checkpoints` of ``run``) to restore, or None if none
    is committed.

    The ``checkpoint_last`` pointer wins if it names a committed checkpoint and
    none newer (by :attr:`CheckpointEntry.sort_key`: lease epoch, then num_updates) is
    committed; otherwise the newest committed checkpoint (the pointer lags after a
    crash between commit and pointer update).

    One exception: a pointer written by ``xla-ckpt convert`` of a fairseq run folder
    (it records ``converted_from`` and no lease epoch) is what fairseq would restore
    (``checkpoint_last.pt``).  It is followed while it names a committed checkpoint,
    and only a newer checkpoint saved by a manager incarnation (lease epoch >= 1,
    necessarily saved after the conversion) outranks it; converted checkpoints (no
    lease epoch) never do, however many updates they record (the stale branch of a
    run restarted from an earlier checkpoint).
    """
    committed = [(e.name, e.sort_key) for e in entries if e.committed]
    doc, _ = read_pointer_doc(run, "last")
    return _choose(doc, committed, run.url(pointer_name("last")))


def resolve_latest(run: Storage) -> str | None:
    """Name of the checkpoint to restore from a run folder, or None if none is committed.

    :func:`choose_latest` over :func:`list_checkpoints`.  Call on one rank and
    send the answer to the others.  Entry points resolve a URI with
    :func:`xla_ckpt.run.resolve.resolve`, which uses this rule and says what
    "none committed" means.
    """
    return choose_latest(run, list_checkpoints(run))


def is_checkpoint(storage: Storage) -> bool:
    """True if ``storage`` is rooted at a committed checkpoint folder (has a manifest)."""
    return storage.exists(MANIFEST_NAME)
