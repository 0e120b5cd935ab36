"""One way in: what a checkpoint URI names, how it is opened, and when nothing is committed.

Every entry point resolves a URI here and nowhere else: :func:`xla_ckpt.load`
(:mod:`xla_ckpt.api`), the trainer's
:class:`~xla_ckpt.trainer.sources.SingleProcessRestorer`, ``restore()``'s
:func:`~xla_ckpt.restore.decide.decide`, the CLI's
:func:`~xla_ckpt.cli.common.resolve_checkpoint` and
:class:`~xla_ckpt.manager.CheckpointManager`.

Rules of :func:`resolve`, in this order:

1. **A local path that does not exist, in a folder that does not exist either**
   (``/data/rnu7/checkpoint_last``): :class:`CheckpointNotFoundError` saying to check
   the path — a typo, never a fresh start.  (``missing_ok``: the manager's own
   ``save_dir``, which it creates, may be absent on a first start.)
2. **A single object** (a local file, a ``gs://`` object): a legacy
   ``torch.save``/fairseq ``.pt`` or safetensors file gives ``kind="legacy"``, for
   the legacy importer (:mod:`xla_ckpt.kinds.legacy`); a safetensors index
   (``*.safetensors.index.json``) gives ``kind="hf_index"`` (:mod:`xla_ckpt.kinds.hf`);
   a DCP ``.metadata`` file gives ``kind="dcp"`` for its folder; any other file is a
   :class:`CheckpointNotFoundError` naming it, what it starts with and the kinds
   accepted (:data:`ACCEPTED`).
3. **A folder holding** ``manifest.json`` (the commit marker): that checkpoint.
4. **A folder holding data files** (``data-*``) **but no manifest**: a save began
   there and never committed: :class:`UncommittedCheckpointError` (nothing committed).
5. ``<run>/checkpoint_last`` **or** ``<run>/checkpoint_best`` with nothing stored
   under that name: the pointer of the run folder ``<run>`` (the names the
   manager's ``restore_file`` uses), as rule 7 with ``pointer``.
6. **A folder holding a foreign checkpoint at its top**: ``.metadata`` (the commit
   marker of a PyTorch DCP checkpoint, also what torch_xla's ``CheckpointManager``
   writes per step): ``kind="dcp"``; ``model.safetensors.index.json``: ``kind="hf_index"``;
   ``model.safetensors`` (an HF model folder): ``kind="legacy"`` on that file.
7. **Anything else is a run folder**: with ``pointer="last"`` (the default) the
   checkpoint the ``checkpoint_last`` pointer names, unless a newer one is
   committed (the pointer lags after a crash between commit and pointer
   update), else the newest committed one (by lease epoch, then ``num_updates``, then time);
   a pointer ``xla-ckpt convert`` wrote (``converted_from``, no lease epoch) is
   outranked only by a newer checkpoint a manager saved (:func:`~xla_ckpt.run.catalog
   .choose_latest`);
   with ``pointer="best"`` the one ``checkpoint_best`` names, which must be
   committed (else :class:`CheckpointNotFoundError`).  A run folder that holds no
   xla_ckpt checkpoint but checkpoints of another kind (fairseq ``checkpoint_last.pt``,
   DCP step folders, HF model folders) is a :class:`CheckpointNotFoundError` naming
   them and saying how to read or convert them, never "nothing committed": a trainer
   must not start from scratch next to a checkpoint it could not read.

**Cost.**  Rule 3 is one read of ``manifest.json``.  A folder holding committed checkpoint
folders is a run folder (rule 7) as soon as one listing of its sub-folders' commit markers
(:func:`~xla_ckpt.run.catalog.find_latest`) finds one, before rules 4-6 look at its top:
then "latest" is that listing, one read of ``checkpoint_last`` and one read of the chosen
manifest, however many checkpoints the folder keeps.  Only a folder where that finds none
is listed whole (rules 4-7 and the reasons below).

**Nothing committed** — the one answer on which a trainer or the manager starts
from scratch — is :class:`NothingCommittedError` (a :class:`CheckpointNotFoundError`),
raised here only, and only when storage answered that nothing was ever committed
at the URI: the path is absent (its parent folder exists) or the folder/prefix is
empty or holds no checkpoint of any kind (rule 7 finding none; the message then names
what the folder holds), or saves began there and none
committed (:class:`UncommittedCheckpointError`, rule 4 and rule 7 with only
incomplete checkpoint folders; an explicitly named incomplete folder counts as
nothing committed, with that warning, in every entry point).  Not nothing
committed, so errors: a run folder whose only commit markers cannot be read
(:class:`CheckpointCorruptError`), a ``checkpoint_last`` pointer naming a checkpoint
that is gone while none is committed (something was committed and deleted), a
missing bucket, a storage error, and anything that fails while the checkpoint is
read.

Opening and reading what was resolved — and reading again when the checkpoint
is replaced mid-read — is :mod:`xla_ckpt.kinds.opener`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import NoReturn

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    NothingCommittedError,
    UncommittedCheckpointError,
)
from xla_ckpt.format.manifest import MANIFEST_NAME, Manifest, valid_file_name
from xla_ckpt.io.names import DATA_PREFIX, INDEX_NAME, SINGLE_NAME, is_index_name
from xla_ckpt.run.catalog import (
    POINTERS,
    CheckpointEntry,
    Latest,
    choose_latest,
    find_latest,
    list_checkpoints,
    pointer_name,
    read_manifest_bytes,
    read_pointer,
    read_pointer_once,
)
from xla_ckpt.run.fencing import LEASE_NAME
from xla_ckpt.run.sniff import (
    ACCEPTED,
    DCP,
    DCP_METADATA,
    HF_INDEX,
    KINDS,
    LEGACY,
    XLA_CKPT,
    foreign_checkpoints,
    is_legacy_file,
)
from xla_ckpt.storage import Storage, StorageConfig, open_storage
from xla_ckpt.storage.local import LocalStorage
from xla_ckpt.storage.uri import split_uri

logger = logging.getLogger(__name__)

_MAX_NAMED = 5  # objects named in a "found here" message

POINTER_FORMS = {"checkpoint_last": "last", "checkpoint_best": "best"}
"""Last path segments that name a run folder's pointer (rule 5)."""



@dataclass(frozen=True)
class Resolved:
    """What a URI names.

    Attributes:
        uri: the URI resolved (as the storage normalised it).
        checkpoint: URI of what to read: the checkpoint folder (xla_ckpt, DCP), the legacy
            file, or the safetensors index.
        kind: :data:`XLA_CKPT`, :data:`LEGACY`, :data:`HF_INDEX` or :data:`DCP`
            (:data:`KINDS` says each in words).
        run: the run folder when the checkpoint was chosen in one (latest or pointer).
        manifest: the checkpoint's manifest, read and validated (None for other kinds).
        manifest_bytes: its bytes, as read (what ``decide`` sends to every rank).
        generation: generation of the manifest / legacy object / index / DCP ``.metadata``.
        storage: the open storage the caller resolved with (rooted at :attr:`uri`; the
            caller owns and closes it), so the read opens no other; None when
            :func:`resolve` was given a URI.
    """

    uri: str
    checkpoint: str
    kind: str = XLA_CKPT
    run: str | None = None
    manifest: Manifest | None = None
    manifest_bytes: bytes = b""
    generation: int | None = None
    storage: Storage | None = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        """Last segment of :attr:`checkpoint` (``checkpoint_1_500``)."""
        return self.checkpoint.rstrip("/").rsplit("/", 1)[-1]

    @property
    def save_id(self) -> str | None:
        return self.manifest.save_id if self.manifest is not None else None

    @property
    def version(self) -> tuple[str, str]:
        """(what identifies this version, its value): ``("save id", id)`` or a generation."""
        if self.kind != XLA_CKPT:
            return "generation", str(self.generation)
        return "save id", str(self.save_id)

    @property
    def what(self) -> str:
        """:attr:`kind` in words (``"a PyTorch DCP checkpoint folder (.metadata)"``)."""
        return KINDS.get(self.kind, self.kind)


# ---- resolve ----------------------------------------------------------------------------------

def resolve(target: str | Storage, config: StorageConfig | None = None, *,
            pointer: str | None = None, missing_ok: bool = False) -> Resolved:
    """What ``target`` (a URI, or a storage rooted at it) names; the rules are in the module doc.

    Args:
        target: a URI (local path, ``file://``, ``gs://``) or an open storage rooted there
            (kept open; the caller owns it).
        config: storage knobs when ``target`` is a URI.
        pointer: ``"last"`` or ``"best"``: ``target`` is a run folder; follow that pointer
            (rule 7).  Default: rules 1-7.
        missing_ok: an absent local path is nothing committed even if its parent folder is
            absent too (the manager's own ``save_dir``).

    Raises:
        NothingCommittedError: nothing was ever committed there (the one start-fresh answer);
            :class:`UncommittedCheckpointError` when saves began there and none committed.
        CheckpointNotFoundError: not a fresh start: a typo'd path (parent folder absent), a
            bucket that answers 404 but could not be checked, a file that is not a
            checkpoint, a missing or dangling pointer, a run folder holding only checkpoints
            of another kind (named).
        BucketNotFoundError: the ``gs://`` bucket does not exist (a storage error, named).
        CheckpointCorruptError: a commit marker is there but cannot be read.
        StorageError / StoragePermissionError / StorageURIError: from the storage.
    """
    if isinstance(target, Storage):
        return dataclasses.replace(_resolve(target, pointer=pointer, missing_ok=missing_ok),
                                   storage=target)
    with open_storage(target, config) as st:
        return _resolve(st, pointer=pointer, missing_ok=missing_ok)


def _resolve(st: Storage, *, pointer: str | None, missing_ok: bool) -> Resolved:
    if pointer is not None:
        if pointer not in POINTER_FORMS.values():
            raise ValueError(f"pointer must be 'last' or 'best', not {pointer!r}")
        if not missing_ok:
            _check_path(st)
        return _from_run(st, pointer, asked=st.uri)
    if not missing_ok:
        _check_path(st)
    if isinstance(st, LocalStorage) and os.path.isfile(st.root):
        return _single_object(st)
    found = committed_manifest(st)
    if found is not None:
        return _checkpoint(st, *found, asked=st.uri, run=None)
    latest = find_latest(st)  # committed checkpoint folders in it: a run folder (rule 7)
    if latest is not None:
        return _latest(st, latest, asked=st.uri)
    names = _list(st)
    if names == [""]:  # the root is one object (gs://)
        return _single_object(st)
    if any("/" not in n and n.startswith(DATA_PREFIX) for n in names):
        raise UncommittedCheckpointError(
            f"{st.uri}: checkpoint is incomplete (no {MANIFEST_NAME} commit marker); the save "
            "that wrote it did not finish. Restore an earlier checkpoint.", uri=st.uri)
    head, _, last = st.uri.rstrip("/").rpartition("/")
    form = POINTER_FORMS.get(last)
    if not names and form is not None and head and not head.endswith(":/"):
        with open_storage(head, st.config) as run:
            if _list(run):
                return _from_run(run, form, asked=st.uri)
    foreign = _foreign_root(st, names)
    if foreign is not None:
        return foreign
    if not names:
        raise NothingCommittedError(f"{st.uri}: no committed checkpoint here", uri=st.uri)
    return _from_run(st, "last", asked=st.uri, names=names)


def _foreign_root(st: Storage, names: list[str]) -> Resolved | None:
    """Rule 6: a DCP checkpoint or an HF model folder at the root of ``st``; else None."""
    if DCP_METADATA in names:
        return _versioned(st, DCP_METADATA, DCP, st.uri)

    if INDEX_NAME in names:
        return _versioned(st, INDEX_NAME, HF_INDEX, st.url(INDEX_NAME))
    if SINGLE_NAME in names:
        return _versioned(st, SINGLE_NAME, LEGACY, st.url(SINGLE_NAME))
    return None


def _versioned(st: Storage, name: str, kind: str, checkpoint: str) -> Resolved:
    """A :class:`Resolved` of ``kind`` whose version is object ``name``'s generation."""
    try:
        generation = st.stat(name).generation
    except CheckpointNotFoundError:
        generation = None
    return Resolved(uri=st.uri, checkpoint=checkpoint, kind=kind, generation=generation)


def _check_path(st: Storage) -> None:
    """Rule 1: a local path absent together with its parent folder is a typo, not a first start."""
    if not isinstance(st, LocalStorage) or os.path.exists(st.root):
        return
    parent = os.path.dirname(st.root)
    if parent and not os.path.isdir(parent):
        raise CheckpointNotFoundError(
            f"{st.root}: no such file or folder, and its parent folder {parent} does not exist "
            "either; check the path (a checkpoint URI whose folder is missing is not read as "
            "'no checkpoint yet')")


def _list(st: Storage, prefix: str = "") -> list[str]:
    try:
        return st.list(prefix)
    except CheckpointNotFoundError as e:  # gs://: the bucket itself is missing
        raise CheckpointNotFoundError(f"{st.uri}: cannot be listed ({e}); check the path "
                                      "(does the bucket exist?)") from e


def committed_manifest(st: Storage) -> tuple[Manifest, bytes, int | None] | None:
    """The validated manifest at the root of ``st``, its bytes and generation (None: the
    read does not tell it; a checkpoint's version is its save id); None if absent.

    One read (one GET on GCS), again if it was replaced while read
    (:func:`~xla_ckpt.run.catalog.read_manifest_bytes`).
    """
    found = read_manifest_bytes(st)
    return (found[0], found[1], None) if found is not None else None


def _latest(run: Storage, latest: Latest, *, asked: str) -> Resolved:
    """The :class:`Resolved` of what :func:`~xla_ckpt.run.catalog.find_latest` chose."""
    return Resolved(uri=asked, checkpoint=run.url(latest.name), run=run.uri,
                    manifest=latest.manifest, manifest_bytes=latest.manifest_bytes)


def _checkpoint(st: Storage, manifest: Manifest, data: bytes, generation: int | None, *,
                asked: str, run: str | None) -> Resolved:
    return Resolved(uri=asked, checkpoint=st.uri, run=run, manifest=manifest,
                    manifest_bytes=data, generation=generation)


def _single_object(st: Storage) -> Resolved:
    uri = st.uri
    folder, name = split_uri(uri)

    if name == DCP_METADATA:  # the commit marker named itself: its folder
        with open_storage(folder, st.config) as parent:
            return _versioned(parent, name, DCP, parent.uri)
    if is_index_name(name):
        with open_storage(folder, st.config) as parent:
            return _versioned(parent, name, HF_INDEX, uri)
    # The legacy reader loads torch (its unpickler); resolving anything else needs none.

    if is_legacy_file(uri, config=st.config):
        with open_storage(folder, st.config) as parent:
            return _versioned(parent, name, LEGACY, uri)
    raise CheckpointNotFoundError(
        f"{uri} is a file that is not a checkpoint (it starts with {_prefix(st)!r}); "
        f"xla_ckpt reads {ACCEPTED}")


def _prefix(st: Storage) -> bytes:
    """The first bytes of the single object ``st`` is rooted at (for messages)."""
    folder, name = split_uri(st.uri)
    try:
        with open_storage(folder, st.config) as parent:
            info = parent.stat(name)
            buf = bytearray(min(8, info.size))
            if buf:
                parent.read_range(name, 0, memoryview(buf), info.generation)
            return bytes(buf)
    except Exception:  # noqa: BLE001 - only decorates the message being raised
        return b""


def _from_run(run: Storage, which: str, *, asked: str, names: list[str] | None = None,
              attempts: int = 2) -> Resolved:
    """Rule 6 in the run folder ``run``."""
    if which == "best":
        doc = read_pointer_once(run, "best")
        name = doc.get("checkpoint") if doc is not None else None
        name = name if valid_file_name(name) else None
        where = run.url(pointer_name("best"))
        if name is None:
            raise CheckpointNotFoundError(f"{where}: no checkpoint_best pointer; restore "
                                          "checkpoint_last or name a checkpoint folder")
        with run.child(name) as child:
            found = committed_manifest(child)
            if found is None:
                raise CheckpointNotFoundError(
                    f"{where}: names {name!r}, which is not a committed checkpoint of {run.uri}")
            return _checkpoint(child, *found, asked=asked, run=run.uri)
    for _ in range(attempts):
        latest = find_latest(run)  # a constant number of requests
        if latest is not None:
            return _latest(run, latest, asked=asked)
        entries = list_checkpoints(run)  # none committed and readable: say why
        chosen = choose_latest(run, entries)
        if chosen is None:
            _nothing_committed(run, entries, names if names is not None else _list(run))
        for e in entries:
            if e.error:
                logger.warning("%s: skipping %s: its commit marker cannot be read (%s)",
                               run.uri, e.name, e.error)
        with run.child(chosen) as child:
            found = committed_manifest(child)
            if found is not None:
                return _checkpoint(child, *found, asked=asked, run=run.uri)
        # Deleted between the listing and the read (rotation): look again.
        logger.info("%s: %s went away while the run folder was read; looking again", run.uri,
                    chosen)
        names = None
    raise CheckpointNotFoundError(f"{run.uri}: the latest committed checkpoint was deleted "
                                  f"while it was resolved, {attempts} times; is another job "
                                  "rotating this run folder?")


def _nothing_committed(run: Storage, entries: list[CheckpointEntry], names: list[str]) -> NoReturn:
    """Rule 6 found no committed checkpoint: raise what that means."""
    broken = [e for e in entries if e.error]
    if broken:
        e = broken[-1]
        raise CheckpointCorruptError(
            f"{run.uri}: no readable committed checkpoint: {e.name} has a commit marker that "
            f"cannot be read ({e.error})")
    dangling = read_pointer(run, "last")
    if dangling is not None:
        raise CheckpointNotFoundError(
            f"{run.url(pointer_name('last'))} names {dangling!r}, but no checkpoint is committed "
            f"in {run.uri}: it was committed and then deleted. Restore another checkpoint, or "
            "remove the pointer to start from scratch")
    others = foreign_checkpoints(names)
    if others:
        shown = ", ".join(f"{n} ({what})" for n, what in others[:_MAX_NAMED])
        more = f" and {len(others) - _MAX_NAMED} more" if len(others) > _MAX_NAMED else ""
        first = others[0][0]
        files = [n for n, what in others if what == KINDS[LEGACY] and n.endswith(".pt")]
        folders = [n for n, what in others if "/" not in n and n not in files]
        steps = []
        if files:  # fairseq .pt files: the run folder converts as a whole
            steps.append(f"convert the run folder with `xla-ckpt convert {run.uri} DST_RUN`")
        if folders or not files:  # DCP / HF folders (and lone safetensors): one by one
            one = folders[0] if folders else first
            out = one if one.startswith("checkpoint") else f"checkpoint_{one}"
            steps.append(f"convert each one into a run folder, e.g. `xla-ckpt convert "
                         f"{run.url(one)} DST_RUN/{out}`")
        raise CheckpointNotFoundError(
            f"{run.uri} holds no xla_ckpt checkpoint, but checkpoints of another kind: "
            f"{shown}{more}. Name one ({run.url(first)}; xla_ckpt.load reads it), or "
            f"{', or '.join(steps)}; this is not read as 'no checkpoint yet'")
    incomplete = sorted({n.split("/", 1)[0] for n in names
                         if n.count("/") == 1 and n.split("/", 1)[1].startswith(DATA_PREFIX)})
    if incomplete:
        raise UncommittedCheckpointError(
            f"{run.uri}: no committed checkpoint here (skipped incomplete: "
            f"{', '.join(incomplete[:5])})", uri=run.uri, incomplete=tuple(incomplete))
    own = {LEASE_NAME, *(pointer_name(w) for w in POINTERS)}
    other = [n for n in names if n not in own]
    if other:
        shown = ", ".join(other[:_MAX_NAMED]) + (", ..." if len(other) > _MAX_NAMED else "")
        raise NothingCommittedError(
            f"{run.uri}: no committed checkpoint here (it holds {len(other)} other "
            f"object{'s' if len(other) != 1 else ''}: {shown}; xla_ckpt reads {ACCEPTED})",
            uri=run.uri)
    raise NothingCommittedError(f"{run.uri}: no committed checkpoint here", uri=run.uri)


# ---- read, once more if replaced --------------------------------------------------------------
