"""When a run folder's checkpoint cannot be read: the previous intact one, and how to use it.

A committed checkpoint whose bytes are bad (a data file truncated or missing, a crc32c
mismatch) stays "latest" until it is removed: its commit marker is intact, so every resolver
picks it.  The read's error therefore says what to do (CASES C7):

* :func:`previous_intact` finds the newest committed checkpoint older than the bad one
  whose data files are all there with the sizes its manifest records (one ``stat`` per
  file; ``xla-ckpt verify`` checks every byte);
* :func:`recovery_hint` says it in words, with the option of each entry point that
  restores it (the manager's ``CheckpointConfig.restore_file`` / ``restore(step=...)``,
  the trainer's ``Checkpointer.load_checkpoint(uri)``, ``xla_ckpt.load(uri)``) and the
  command that makes it the latest again (``xla-ckpt rm --force``,
  :func:`xla_ckpt.run.prune.remove_checkpoints` with ``force=True``);
* :func:`add_note` appends such a note to the error being raised (its type and attributes
  stay).

Call from one process (rank 0); these only read.
"""

from __future__ import annotations

import logging

from xla_ckpt.errors import CheckpointCorruptError, CheckpointNotFoundError
from xla_ckpt.run.catalog import CheckpointEntry, list_checkpoints, pointer_name
from xla_ckpt.run.fencing import LEASE_NAME
from xla_ckpt.storage import Storage, StorageConfig, open_storage

logger = logging.getLogger(__name__)

RUN_MARKERS = (pointer_name("last"), LEASE_NAME)
"""Objects that make a checkpoint's parent folder a run folder worth listing for a note."""

MAX_CANDIDATES = 8
"""Older checkpoints looked at (newest first) before :func:`previous_intact` gives up."""


def _subclass_names(cls: type[BaseException]) -> set[str]:
    out = {cls.__name__}
    for sub in cls.__subclasses__():
        out |= _subclass_names(sub)
    return out


def is_corruption(cause: BaseException | str) -> bool:
    """True if ``cause`` (an error, or a failure report's ``"TypeName: message"``) says a
    checkpoint's bytes are bad: :class:`~xla_ckpt.errors.CheckpointCorruptError` or a
    subclass (truncated, crc32c mismatch, a data file missing)."""
    if isinstance(cause, BaseException):
        return isinstance(cause, CheckpointCorruptError)
    return cause.split(":", 1)[0].strip() in _subclass_names(CheckpointCorruptError)


def files_present(run: Storage, entry: CheckpointEntry) -> bool:
    """True if every data file ``entry``'s manifest lists is in ``run`` at its recorded size."""
    if entry.manifest is None:
        return False
    for f, size in entry.manifest.files.items():
        try:
            if run.stat(f"{entry.name}/{f}").size != size:
                return False
        except CheckpointNotFoundError:
            return False
    return True


def previous_intact(run: Storage, bad: str, entries: list[CheckpointEntry] | None = None, *,
                    skip: frozenset[str] | set[str] = frozenset()) -> CheckpointEntry | None:
    """The newest committed checkpoint of ``run`` older than ``bad`` (by the catalog's order:
    lease epoch, ``num_updates``, time) whose data files are all present at their sizes, and
    not in ``skip``; None if there is none.

    ``bad`` not committed (its manifest gone or unreadable): the newest such checkpoint of
    all.  ``entries``: :func:`~xla_ckpt.run.catalog.list_checkpoints` of ``run``, if at hand.
    At most :data:`MAX_CANDIDATES` candidates are looked at.
    """
    entries = list_checkpoints(run) if entries is None else entries
    committed = [e for e in entries if e.committed]
    names = [e.name for e in committed]
    older = committed[:names.index(bad)] if bad in names else committed
    return newest_intact(run, older, skip={*skip, bad})


def newest_intact(run: Storage, entries: list[CheckpointEntry], *,
                  skip: frozenset[str] | set[str] = frozenset()) -> CheckpointEntry | None:
    """The newest committed checkpoint of ``entries`` (oldest first, as listed) not in
    ``skip`` whose data files are all present at their sizes (:func:`files_present`); None
    if none is among the :data:`MAX_CANDIDATES` newest looked at."""
    looked = 0
    for e in reversed(entries):
        if not e.committed or e.name in skip:
            continue
        if files_present(run, e):
            return e
        looked += 1
        if looked >= MAX_CANDIDATES:
            break
    return None


def recovery_hint(run: Storage, bad: str, entries: list[CheckpointEntry] | None = None) -> str:
    """A note (starting with a space) naming the checkpoint to restore instead of ``bad``
    and how: each entry point's option, and ``xla-ckpt rm --force`` to make it the latest.

    Example: `` The previous intact committed checkpoint of /r is checkpoint_1_10 (step 10,
    lease epoch 1): restore it with CheckpointConfig.restore_file='checkpoint_1_10'
    (CheckpointManager.restore_or_initialize) or CheckpointManager.restore(step=10),
    Checkpointer.load_checkpoint('/r/checkpoint_1_10') or xla_ckpt.load('/r/checkpoint_1_10');
    or make it the latest again with `xla-ckpt rm --force /r checkpoint_1_12` ...``
    """
    entries = list_checkpoints(run) if entries is None else entries
    prev = previous_intact(run, bad, entries)
    if prev is None:
        return (f" No intact committed checkpoint older than {bad} is in {run.uri}: nothing to "
                f"fall back to (`xla-ckpt ls {run.uri}` lists what is there).")
    uri = run.url(prev.name)
    step = f"step {prev.num_updates}, " if prev.num_updates >= 0 else ""
    same_step = [e for e in entries if e.committed and e.num_updates == prev.num_updates]
    by_step = (f" or CheckpointManager.restore(step={prev.num_updates})"
               if prev.num_updates >= 0 and same_step and same_step[-1].name == prev.name
               else "")
    committed = [e for e in entries if e.committed]
    if committed and committed[-1].name == bad:  # "latest": remove it and what is skipped
        doomed = [e.name for e in committed if e.sort_key > prev.sort_key]
        them = "them" if len(doomed) > 1 else bad
        remove = (f"make it the latest again with `xla-ckpt rm --force {run.uri} "
                  f"{' '.join(doomed)}`, which removes {them} and moves checkpoint_last back "
                  f"to {prev.name}")
    else:
        remove = f"remove the bad one with `xla-ckpt rm {run.uri} {bad}`"
    return (f" The previous intact committed checkpoint of {run.uri} is {prev.name} ({step}lease "
            f"epoch {prev.lease_epoch}): restore it with "
            f"CheckpointConfig.restore_file={prev.name!r} "
            f"(CheckpointManager.restore_or_initialize){by_step}, "
            f"Checkpointer.load_checkpoint({uri!r}) or xla_ckpt.load({uri!r}); or {remove}.")


def add_note(err: BaseException, note: str) -> BaseException:
    """Append ``note`` to ``err``'s message in place (type, attributes and traceback stay);
    returns ``err``.  A no-op for an empty note."""
    if note and err.args and isinstance(err.args[0], str):
        err.args = (err.args[0] + note, *err.args[1:])
    elif note:
        err.args = (f"{err}{note}",)
    return err


def note_for_read(err: BaseException, checkpoint: str, run: str | None,
                  config: StorageConfig | None = None) -> BaseException:
    """Add :func:`recovery_hint` to ``err``, a failed read of ``checkpoint`` (a URI), when it
    says the bytes are bad (:func:`is_corruption`); returns ``err``.

    ``run``: the run folder ``checkpoint`` was chosen in (latest or a pointer); None for a
    checkpoint named directly, whose parent folder is then looked at if it is a run folder
    (it holds ``checkpoint_last.json`` or ``lease.json``), and noted only if it holds an
    intact committed checkpoint older than this one.  Never raises: a failure to
    look leaves ``err`` as it is.
    """
    if not is_corruption(err):
        return err
    parent, _, name = checkpoint.rstrip("/").rpartition("/")
    folder = run if run is not None else parent
    if not folder or not name:
        return err
    try:
        with open_storage(folder, config) as st:
            if run is None and not any(st.exists(n) for n in RUN_MARKERS):
                return err  # not a run folder: never list a bucket's root on an error path
            entries = list_checkpoints(st)
            if run is None and previous_intact(st, name, entries) is None:
                return err
            return add_note(err, recovery_hint(st, name, entries))
    except Exception as e:  # noqa: BLE001 - only decorates the error being raised
        logger.debug("could not look for an intact checkpoint before %s: %s", checkpoint, e)
        return err
