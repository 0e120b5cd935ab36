"""Every error xla_ckpt raises on purpose.

Each class subclasses a builtin where one fits, so callers that already catch
``FileNotFoundError`` or ``ValueError`` keep working.  Messages name the file,
key or rank involved and say what to do next.
"""

from __future__ import annotations

from typing import Mapping


class XlaCkptError(Exception):
    """Base class of every error raised by xla_ckpt on purpose."""


class CheckpointNotFoundError(XlaCkptError, FileNotFoundError):
    """No committed checkpoint (or object) exists at the given URI."""


class IncompleteCheckpointError(CheckpointNotFoundError):
    """The checkpoint folder exists but has no commit marker (manifest).

    A save was interrupted before it committed; readers must not trust it.
    """


class CheckpointCorruptError(XlaCkptError, ValueError):
    """The checkpoint's bytes do not match what its manifest promises.

    Raised for truncated files (expected vs actual size), bad headers and
    manifests, and malformed typed state.
    """


class IntegrityError(CheckpointCorruptError):
    """crc32c of bytes read differs from the manifest after bounded re-reads.

    Attributes:
        path: object or file that was read.
        key: state key (tensor path) whose bytes were wrong, if known.
    """

    def __init__(self, message: str, *, path: str = "", key: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.key = key


class UnsupportedTypeError(XlaCkptError, TypeError):
    """A value in the state has a type the typed encoding cannot represent."""


class MetaTensorError(XlaCkptError, ValueError):
    """A tensor on the ``meta`` device has no data and cannot be saved."""


class UnsafePickleError(XlaCkptError, ValueError):
    """A legacy pickle references a global outside the allow-list."""


class StorageError(XlaCkptError, OSError):
    """A storage backend failed after its retries (or with a non-retryable error)."""


class StoragePermissionError(StorageError, PermissionError):
    """The backend refused access (HTTP 401/403, EACCES); never retried."""


class PreconditionFailedError(StorageError):
    """A conditional write or delete found another generation of the object than it was given.

    Raised by ``Storage.write_atomic`` / ``Storage.delete`` called with ``if_generation_match``:
    ``0`` (create only) and the object exists, or ``N > 0`` and the live object is not
    generation ``N`` (another one, or none).  Nothing was written or deleted; never retried
    (GCS answers HTTP 412).  The message names the URI and both generations.

    Attributes:
        name: the object's name (relative to the storage root).
        expected_generation: the ``if_generation_match`` given (0: the object must not exist).
        actual_generation: the live object's generation when checked; None if absent or unknown.
    """

    def __init__(self, message: str, *, name: str = "", expected_generation: int = 0,
                 actual_generation: int | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.expected_generation = expected_generation
        self.actual_generation = actual_generation


class StateMismatchError(XlaCkptError, RuntimeError):
    """The checkpoint does not fit the live model/optimizer/criterion.

    Raised by the trainer restore (fairseq ``Trainer.load_checkpoint``
    semantics) for strict-load key mismatches and for optimizer/criterion class
    mismatches; the message says which flag (e.g. ``reset_optimizer=True``) to
    pass if the mismatch is intended.
    """


class ConfigError(XlaCkptError, ValueError):
    """A configuration value or YAML key is invalid; the message names the key."""


class StorageURIError(ConfigError):
    """A storage URI is malformed or names a scheme xla_ckpt cannot store to.

    Raised by :func:`xla_ckpt.storage.uri.parse_uri` (so by every entry point:
    ``save``, ``load``, the CLI, the manager) *before* anything is written, for
    unknown schemes (``s3://``), malformed ``gs://`` forms (``gs:/b/x``,
    ``gs//b/x``, a bad bucket name) and local paths that look like a mangled
    URI.  The message names the URI and the form expected.  A
    :class:`ConfigError` (hence a ``ValueError``): the URI is a configuration
    value, and the CLI maps it to exit code 2 like any other.

    Attributes:
        uri: the URI as given.
    """

    def __init__(self, message: str, *, uri: str = "") -> None:
        super().__init__(message)
        self.uri = uri

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only ``uri`` survives pickling
        return (_storage_uri_error, (str(self), self.uri))


def _storage_uri_error(message: str, uri: str) -> StorageURIError:
    return StorageURIError(message, uri=uri)


class WorldSizeMismatchError(XlaCkptError, ValueError):
    """Sharded state was saved with a world size that cannot be resharded to the current one."""


class DistributedError(XlaCkptError, RuntimeError):
    """A collective step failed on one or more ranks.

    Every surviving rank raises this with the same ``failures`` mapping
    (rank -> one-line cause), modelled on PyTorch DCP's ``CheckpointException``.
    """

    def __init__(self, message: str, failures: Mapping[int, str] | None = None) -> None:
        self.failures = dict(failures or {})
        if self.failures:
            detail = "; ".join(f"rank {r}: {c}" for r, c in sorted(self.failures.items()))
            message = f"{message} [{detail}]"
        super().__init__(message)


class CollectiveTimeoutError(DistributedError, TimeoutError):
    """A barrier or collective did not complete within its timeout."""


class CheckpointSaveError(DistributedError):
    """A checkpoint save failed on one or more ranks; nothing was committed.

    Raised on every rank by :class:`xla_ckpt.manager.CheckpointManager` (for an
    async save, at the next update boundary or ``wait()``); ``failures`` maps
    each failing rank to its cause.  The previous committed checkpoint and
    the pointers are untouched.
    """


class FencedError(CheckpointSaveError):
    """A newer incarnation of the job took the run folder's lease: this one stops saving.

    Raised on every rank by :class:`xla_ckpt.manager.CheckpointManager` when its lease
    epoch is older than the run folder's (``<run>/lease.json``, see
    :mod:`xla_ckpt.run.fencing`): before the commit marker, the pointers or rotation, and
    at once (writing nothing) by every later save of that manager.  The message names the
    run folder and both incarnations (epoch and owner).  A :class:`CheckpointSaveError`,
    so code that stops on a failed save stops here too.

    Attributes:
        own_epoch: this incarnation's lease epoch.
        current_epoch: the newer epoch found in the run folder.
        run: the run folder's URI.
    """

    def __init__(self, message: str, failures: Mapping[int, str] | None = None, *,
                 own_epoch: int = 0, current_epoch: int = 0, run: str = "") -> None:
        super().__init__(message, failures)
        self.own_epoch = own_epoch
        self.current_epoch = current_epoch
        self.run = run

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only attributes survive pickling
        return (_fenced_error, (str(self), self.own_epoch, self.current_epoch, self.run))


def _fenced_error(message: str, own_epoch: int, current_epoch: int, run: str) -> FencedError:
    return FencedError(message, own_epoch=own_epoch, current_epoch=current_epoch, run=run)


class DataFileMissingError(CheckpointCorruptError):
    """A data file the committed manifest lists is not there for this process.

    The checkpoint is committed (its manifest is there and lists the file) but
    the storage answers that the file does not exist (HTTP 404, ``ENOENT``),
    before or during the read: the checkpoint is on another host's local
    disk, a filesystem is not mounted here, or it was deleted or replaced
    while it was read.  Its bytes are not known to be bad.  Never a
    :class:`CheckpointNotFoundError` (nor a ``FileNotFoundError``): callers
    take those to mean "nothing committed, start fresh", which would be
    wrong here.  A :class:`CheckpointCorruptError` because that is what this
    case raised before, and callers catch it to refuse (or skip) a checkpoint
    that cannot be read whole.  A file that is there with the wrong size is a
    plain :class:`CheckpointCorruptError` naming expected and actual sizes.

    Attributes:
        path: URI of the missing data file.
        checkpoint: URI of the checkpoint folder.
    """

    def __init__(self, message: str, *, path: str = "", checkpoint: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.checkpoint = checkpoint


class NothingCommittedError(CheckpointNotFoundError):
    """Storage answered that nothing was ever committed at the URI: the one "start fresh" case.

    Raised only by :func:`xla_ckpt.run.resolve.resolve` (so by every entry point: ``load``,
    ``restore``, the trainer, the manager, the CLI) when the path is absent (its parent folder
    exists), or the folder or prefix is empty or holds no committed checkpoint.  A
    :class:`CheckpointNotFoundError`, so ``except CheckpointNotFoundError`` keeps working; the
    trainer and the manager start fresh on this class only, never on another
    CheckpointNotFoundError (a typo'd path whose parent folder is missing too, a missing pointer,
    an object that vanished while it was read).

    Attributes:
        uri: the URI (run folder or checkpoint folder) that holds nothing committed.
        incomplete: checkpoint folders found there without a commit marker.
    """

    def __init__(self, message: str, *, uri: str = "", incomplete: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.uri = uri
        self.incomplete = tuple(incomplete)


class UncommittedCheckpointError(NothingCommittedError, IncompleteCheckpointError):
    """Nothing committed, but saves began there and none finished.

    The URI is a checkpoint folder holding data files without its commit marker
    (``incomplete`` empty), or a run folder whose checkpoint folders all lack one
    (``incomplete`` names them).  Both a :class:`NothingCommittedError` (a trainer starts fresh,
    with a warning naming it) and an :class:`IncompleteCheckpointError`.
    """


class CheckpointReplacedError(DistributedError):
    """A checkpoint was replaced while it was read, and again when it was read once more.

    Another writer saved to (or deleted) the same checkpoint folder during both reads.  The
    message names the URI and the versions (``save id A -> B``); ``failures`` names the ranks
    whose reads failed (``restore()``; empty for a single-process read).  A
    :class:`DistributedError`: ``restore()`` raises it on every rank.

    Attributes:
        uri: the checkpoint folder (or legacy file) that was replaced.
        before / after: save ids (generations for a legacy file) read and found; ``after`` is
            ``"none"`` when it was deleted.
    """

    def __init__(self, message: str, failures: Mapping[int, str] | None = None, *,
                 uri: str = "", before: str = "", after: str = "") -> None:
        super().__init__(message, failures)
        self.uri = uri
        self.before = before
        self.after = after


class StepNotFoundError(CheckpointNotFoundError):
    """No committed checkpoint of the run folder records the asked step (its ``num_updates``).

    Raised on every rank by ``CheckpointManager.restore(step=N)``; the message lists the
    steps there are.  A :class:`CheckpointNotFoundError`, never the fresh-start
    :class:`NothingCommittedError`.

    Attributes:
        step: the step asked for.
        steps: the steps of the committed checkpoints there are (sorted).
        run: the run folder.
    """

    def __init__(self, message: str, *, step: int | None = None, steps: tuple[int, ...] = (),
                 run: str = "") -> None:
        super().__init__(message)
        self.step = step
        self.steps = tuple(steps)
        self.run = run


class UnknownKeyError(XlaCkptError, KeyError):
    """A partial restore named a key the checkpoint does not hold.

    The message names the key and the closest keys the checkpoint does hold.

    Attributes:
        key: the key asked for.
        closest: existing keys closest to it (may be empty).
        checkpoint: the checkpoint read.
    """

    def __init__(self, message: str, *, key: str = "", closest: tuple[str, ...] = (),
                 checkpoint: str = "") -> None:
        super().__init__(message)
        self.key = key
        self.closest = tuple(closest)
        self.checkpoint = checkpoint

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class PartiallyOverwrittenError(IntegrityError):
    """crc32c failed, after the bounded re-reads, in bytes read straight into live tensors.

    Raised by in-place restores (:meth:`xla_ckpt.io.CheckpointReader.load` with ``into``):
    the named tensors now hold bytes that did not pass the check.  Restore another
    checkpoint into them, or re-initialise them, before using them.

    Attributes:
        keys: tensor keys whose live memory holds the unchecked bytes.
    """

    def __init__(self, message: str, *, path: str = "", key: str = "",
                 keys: tuple[str, ...] = ()) -> None:
        super().__init__(message, path=path, key=key)
        self.keys = tuple(keys)


class CheckpointExistsError(XlaCkptError, FileExistsError):
    """A write would replace a committed checkpoint the caller did not ask to replace.

    Raised by :func:`xla_ckpt.kinds.dcp_write.write_dcp` when the target folder already holds a DCP
    ``.metadata`` and ``overwrite=False``; nothing was written.  The message names the URI
    and says to pass ``overwrite=True`` or pick an empty folder.
    """


class OutputExistsError(CheckpointExistsError, ConfigError):
    """``convert`` / ``export`` would write where a checkpoint or an earlier output already is.

    Raised by :func:`xla_ckpt.kinds.export.check_destination` before anything is written: the
    destination holds a checkpoint of any kind (an xla_ckpt manifest, a DCP ``.metadata``,
    HF safetensors weights, a ``.pt`` file, a run folder of them) and ``overwrite`` was not
    passed, or it holds one of another kind than the one being written (never replaced).
    A usage error on the command line (exit code 2); the message names the destination,
    what it holds, and ``--overwrite``.
    """


class ShardedStateError(XlaCkptError, ValueError):
    """A state holding sharded tensors (``DTensor``, torch_xla SPMD) was passed where it cannot
    be saved as it is.

    Raised by :func:`xla_ckpt.save` for a ``DTensor`` when ``torch.distributed`` is not
    initialised (its other shards live on other ranks: every rank saves together, see
    :func:`xla_ckpt.restore.save_distributed`), or with options that only a single writer
    has (``rank_states``, ``storage``).  The message names the key and what to do.
    """


class TargetsOverwrittenError(PartiallyOverwrittenError, DistributedError):
    """A restore into live targets (``restore(uri, into=...)``) failed on some rank after
    the targets of some ranks were (possibly partially) overwritten.

    Raised on EVERY rank alike, whichever rank failed and whichever strategy ran, as soon as
    any rank's live target memory was written (the bytes that landed may be this
    checkpoint's values, or, on the rank whose check failed, bytes that did not pass it): the
    targets across ranks now hold a mix of checkpoint values and their old ones.  Restore
    again into every rank's targets (this checkpoint once fixed, or another one), or
    re-initialise them, before using them.  When no rank's target memory was touched the
    restore raises a plain :class:`DistributedError` instead (targets unchanged).

    It is both a :class:`PartiallyOverwrittenError` (an :class:`IntegrityError`) and a
    :class:`DistributedError`, so either ``except`` catches it.

    Attributes:
        keys: this rank's target keys whose live memory was written (possibly partially).
        overwritten: rank -> number of its targets written (ranks with none are absent).
        failures: rank -> one-line cause, as :class:`DistributedError`.
    """

    def __init__(self, message: str, failures: Mapping[int, str] | None = None, *,
                 keys: tuple[str, ...] = (), overwritten: Mapping[int, int] | None = None
                 ) -> None:
        PartiallyOverwrittenError.__init__(self, message, keys=keys)
        self.failures = dict(failures or {})
        self.overwritten = dict(overwritten or {})


class StorageNotSharedError(StorageError):
    """A data file a writer reported is not visible (or not whole) to the process committing.

    Raised by :func:`xla_ckpt.io.writer.commit` (so by every save: ``xla_ckpt.save``,
    :func:`xla_ckpt.restore.save_distributed`, the manager) before the manifest is written,
    when a data file the parts list is missing for the committing process (rank 0) or has
    another size than its writer reported: the ranks wrote to storage they do not share (a
    node-local path such as ``/tmp/ckpt`` on several hosts), or the file was deleted
    meanwhile.  Nothing was committed.  In a collective save every rank raises a
    :class:`DistributedError` whose ``failures`` carry this message for rank 0.

    Attributes:
        path: URI of the first such data file (as the committing process sees it).
        rank: the rank that wrote it when its item names it (``rank/<r>``, ``chunks/<r>``,
            ``shard/<r>``), else None.
        checkpoint: URI of the checkpoint folder.
    """

    def __init__(self, message: str, *, path: str = "", rank: int | None = None,
                 checkpoint: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.rank = rank
        self.checkpoint = checkpoint

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only attributes survive pickling
        return (_storage_not_shared_error, (str(self), self.path, self.rank, self.checkpoint))


def _storage_not_shared_error(message: str, path: str, rank: int | None,
                              checkpoint: str) -> StorageNotSharedError:
    return StorageNotSharedError(message, path=path, rank=rank, checkpoint=checkpoint)


class BucketNotFoundError(StorageError, FileNotFoundError):
    """The bucket a ``gs://`` URI names does not exist (a mistyped bucket name, most often).

    Raised by the GCS backend (so by every entry point: ``load``, ``save``, the manager, the
    CLI) when the service answers that the bucket itself is missing, confirmed by a request
    for the bucket.  Never a :class:`CheckpointNotFoundError`: a missing bucket is not "nothing
    saved yet", and a trainer or manager must not start fresh on it.  The message names the
    bucket and says what to do (check the name, or create the bucket).

    Attributes:
        bucket: the bucket's name.
        uri: the URI being used when it was found missing.
    """

    def __init__(self, message: str, *, bucket: str = "", uri: str = "") -> None:
        super().__init__(message)
        self.bucket = bucket
        self.uri = uri

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only attributes survive pickling
        return (_bucket_not_found_error, (str(self), self.bucket, self.uri))


def _bucket_not_found_error(message: str, bucket: str, uri: str) -> BucketNotFoundError:
    return BucketNotFoundError(message, bucket=bucket, uri=uri)


class StorageDeadlineError(StorageError, TimeoutError):
    """A storage request did not finish within its total deadline (``request_deadline_s``).

    A ranged read, a whole-object read, a listing, a metadata call or an upload that keeps
    making slow progress (a server that trickles a few bytes per answer, a stalled connection)
    is stopped at its deadline instead of waiting on: the message names the request (object,
    byte range), the bytes that arrived, the deadline and the setting to raise.

    Attributes:
        deadline_s: the deadline in force, seconds.
        received_bytes: bytes of the answer that had arrived (reads), else 0.
    """

    def __init__(self, message: str, *, deadline_s: float = 0.0, received_bytes: int = 0) -> None:
        super().__init__(message)
        self.deadline_s = deadline_s
        self.received_bytes = received_bytes

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only attributes survive pickling
        return (_storage_deadline_error, (str(self), self.deadline_s, self.received_bytes))


def _storage_deadline_error(message: str, deadline_s: float,
                            received_bytes: int) -> StorageDeadlineError:
    return StorageDeadlineError(message, deadline_s=deadline_s, received_bytes=received_bytes)


class ScheduleMismatchError(DistributedError):
    """Ranks reached a :class:`~xla_ckpt.manager.CheckpointManager` collective at different
    points of the save schedule (:mod:`xla_ckpt.manager.lockstep`).

    Every rank raises it from the same exchange: one rank passed another ``epoch``,
    ``num_updates``, ``end_of_epoch`` or ``metrics`` to ``after_update``, skipped a call,
    or is in another manager call (``save``, ``wait``/``close``, a restore) than the
    others.  The message names every rank's position and values; ``failures`` maps each
    rank that differs from the others (the most common position, rank 0's on a tie) to its
    position.  Nothing of the save at that point was written.  Fix the training loop: every
    rank calls ``after_update`` once per update with the same schedule inputs.

    Attributes:
        positions: rank -> its position in words (every rank).
    """

    def __init__(self, message: str, failures: Mapping[int, str] | None = None, *,
                 positions: Mapping[int, str] | None = None) -> None:
        super().__init__(message, failures)
        self.positions = dict(positions or {})

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only attributes survive pickling
        return (_schedule_mismatch_error, (str(self), self.positions))


def _schedule_mismatch_error(message: str, positions: Mapping[int, str]) -> ScheduleMismatchError:
    return ScheduleMismatchError(message, positions=positions)


class RankItemsNotExportedError(ConfigError):
    """An export format has no place for the checkpoint's per-rank items (``rank/<r>``: each
    rank's own iterator position, RNG state, optimizer shard) and the caller did not say what
    to do with them.  The message names the items and the choices:
    ``rank_states="nest"`` (``xla-ckpt export --rank-states nest``: written as
    ``state["rank_states"][rank]``) or ``"drop"`` (left out, and reported).

    Attributes:
        items: the per-rank item names (``["rank/00000", "rank/00001"]``).
    """

    def __init__(self, message: str, items: list[str] | None = None) -> None:
        super().__init__(message)
        self.items = list(items or [])


class UnsupportedTensorError(XlaCkptError, TypeError):
    """A tensor whose layout the format cannot store (``torch.sparse_csr``/``csc``/``bsr``/
    ``bsc``, ``torch._mkldnn``, a nested or other non-strided tensor).  The message names the
    key and the layout and says what to save instead (``t.to_dense()``; for CSR and its kin
    also ``t.to_sparse_coo()``, which round-trips).

    Attributes:
        key: the dotted key of the tensor in the state.
        layout: the tensor's layout in words (``"torch.sparse_csr"``).
    """

    def __init__(self, message: str, *, key: str = "", layout: str = "") -> None:
        super().__init__(message)
        self.key = key
        self.layout = layout
