"""Where the trainer's state comes from and goes to: one restorer protocol, one saver.

The trainer never talks to storage itself.  It calls

* a **restorer**: any :class:`Restorer`, always the same way, ``restorer(request)`` with one
  :class:`RestoreRequest` (the URI; the live tensors to fill in place, if any; what becomes of
  per-rank items saved by another world size), and it returns one :class:`RestoredState`
  (``state``, ``rank_state``).  It raises :class:`~xla_ckpt.errors.NothingCommittedError`
  when nothing is committed at the URI (what :func:`xla_ckpt.run.resolve.resolve` raises;
  the trainer starts fresh on that class only: any other error, a plain
  ``CheckpointNotFoundError`` included, propagates);
* a **saver** ``saver(state, uri, *, metadata, rank_state) -> Any``.

Restorers here: :class:`SingleProcessRestorer` (the default) resolves ``uri`` with the one
resolver (:mod:`xla_ckpt.run.resolve`: a checkpoint folder, a run folder's latest committed
checkpoint, a pointer) and reads with :class:`xla_ckpt.io.CheckpointReader` (CPU tensors,
crc32c checked; the request's ``targets`` filled in place), once more if the checkpoint was
replaced while it was read, or, when ``uri`` names a legacy fairseq/``torch.save`` ``.pt``
file, imports it through the allow-list of :mod:`xla_ckpt.kinds.legacy` (CASES C4).  In a
job of several ranks (a process group is up) rank 0 decides which checkpoint and sends it
with its manifest to every rank (:func:`xla_ckpt.restore.decide.decide`): the run folder is
listed once per restore, not once per rank.  :func:`make_restorer` restores through
:func:`xla_ckpt.restore.restore` (a strategy, live sharded targets); every rank calls it.
:class:`SingleProcessSaver` writes with :func:`xla_ckpt.api.save`, keeping ``rank_state`` in
the item ``rank/<rank>``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol

import torch
import torch.distributed as tdist

from xla_ckpt.api import save
from xla_ckpt.comm import Dist, get_dist
from xla_ckpt.errors import ConfigError
from xla_ckpt.format.manifest import STATE_ITEM, Item, rank_item
from xla_ckpt.kinds.opener import open_reader, read_checkpoint, read_items, read_resolved
from xla_ckpt.restore import RestoreConfig, restore
from xla_ckpt.restore.decide import decide
from xla_ckpt.run.resolve import Resolved, resolve
from xla_ckpt.run.sniff import LEGACY, XLA_CKPT
from xla_ckpt.storage import StorageConfig


class Saver(Protocol):
    def __call__(self, state: Any, uri: str, *, metadata: Any,
                 rank_state: Any | None) -> Any: ...


#: ``fn(saved: {saved rank: per-rank state}, rank, world_size) -> this rank's per-rank state``.
RankStateRemap = Callable[[dict[int, Any], int, int], Any]


class InPlaceTargets(Protocol):
    """Live tensors a restorer may read into (the trainer's model and criterion).

    ``targets(item)`` is called with the manifest's ``state`` item before any byte is read
    and returns live tensors by tensor key (``TensorRecord.key``); after the read the restorer
    calls ``targets.read_back(item, state)`` with the state read from that item, so the
    trainer need not check its structure again.  A restorer may also not use them (the
    trainer then checks and copies what it returns).
    """

    def __call__(self, item: Item) -> Mapping[str, torch.Tensor]: ...

    def read_back(self, item: Item, state: Any) -> None: ...


@dataclass(frozen=True, kw_only=True)
class RestoreRequest:
    """What the trainer asks its restorer for, on every rank that restores.

    Attributes:
        uri: a checkpoint folder, a run folder (its latest committed checkpoint), a
            ``<run>/checkpoint_last`` / ``checkpoint_best`` pointer, or a legacy ``.pt`` file.
        targets: live CPU tensors to fill in place (an unsharded model), or None.
        into: a sharded model's live state tree
            (:meth:`~xla_ckpt.trainer.Checkpointer.restore_targets`: DTensors) to fill in
            place, each rank reading only its shards; or None.  A restorer that cannot
            returns full tensors, which the trainer shards onto the live placements.
        rank_state_on_resize: ``"error"`` or ``"drop"``: per-rank items saved by another
            world size (:class:`~xla_ckpt.restore.RestoreConfig`); None: the restorer's own
            (``"error"`` unless it was built with another).
        rank_state_remap: ``fn(saved, rank, world_size)`` mapping them onto this rank.
    """

    uri: str
    targets: InPlaceTargets | None = None
    into: Any = None
    rank_state_on_resize: str | None = None
    rank_state_remap: RankStateRemap | None = None


@dataclass(frozen=True)
class RestoredState:
    """What a restorer returns: the replicated state as saved and this rank's private state
    (its ``rank/<rank>`` item; None if the checkpoint has none for it)."""

    state: Any
    rank_state: Any = None


class Restorer(Protocol):
    """The trainer's restorer: ``restorer(request) -> RestoredState`` (module docstring).

    Raises:
        NothingCommittedError: nothing committed at ``request.uri`` (the trainer starts
            fresh); any other error propagates.
    """

    def __call__(self, request: RestoreRequest, /) -> RestoredState: ...


def job_dist() -> Dist | None:
    """The job's :class:`~xla_ckpt.comm.Dist` when a process group of more than one rank is
    up (the ranks then restore together), else None; never starts one."""
    if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
        return get_dist()
    return None


class SingleProcessRestorer:
    """Read the replicated state and this rank's ``rank/<rank>`` item (if any) on each process.

    Args:
        rank: whose private item to read.
        config: storage knobs.
        legacy: accept a URI naming a legacy ``.pt`` file (read through the
            allow-list; never unsafe unpickling).
    """

    def __init__(self, *, rank: int = 0, config: Optional[StorageConfig] = None,
                 legacy: bool = True) -> None:
        self.rank = rank
        self.config = config
        self.legacy = legacy

    def __call__(self, request: RestoreRequest) -> RestoredState:
        """The state at ``request.uri`` with CPU tensors (module docstring).

        ``request.into`` (a sharded model's live DTensors): every rank calls it;
        :func:`xla_ckpt.restore.restore` with ``into=`` over the job's process group fills
        this rank's shards in place, reading only their byte ranges, with the request's
        per-rank item options.  Otherwise only this rank's own ``rank/<rank>`` item is read.

        ``request.targets``: for an xla_ckpt checkpoint, called with the manifest's
        ``state`` item before any byte is read; the read fills the tensors it returns in
        place (:meth:`~xla_ckpt.io.CheckpointReader.load` ``into=``), and
        ``targets.read_back(item, state)`` is told the state read.  If the checkpoint is
        replaced while it is read, it is resolved again, ``targets`` is called again with the
        new manifest and the read starts over.  Ignored for other kinds of source (legacy
        ``.pt``, HF, DCP).

        With a process group of several ranks up, every rank calls it: rank 0 decides which
        checkpoint (listing a run folder once) and sends it with its manifest to every rank,
        and each rank reads it.

        Raises:
            NothingCommittedError: nothing committed at ``uri`` (the trainer starts fresh);
                :class:`UncommittedCheckpointError` when saves began there and none committed.
            CheckpointNotFoundError: a typo'd path (its parent folder is missing too), a
                missing pointer, a file that is not a checkpoint.
            CheckpointReplacedError: replaced while read, twice.
            CheckpointCorruptError / IntegrityError: bad bytes (names path and tensor).
            UnsafePickleError: a legacy file names a class outside the allow-list.
            ConfigError: a legacy file with ``legacy=False``.
        """
        uri, targets = request.uri, request.targets
        if request.into is not None:
            return _restore_collectively(request, dist=get_dist(), storage_config=self.config)
        own = rank_item(self.rank)

        def read(resolved: Resolved) -> RestoredState:
            if resolved.kind == LEGACY and not self.legacy:
                raise ConfigError(f"{resolved.checkpoint} is a legacy .pt/safetensors file and "
                                  "this restorer was built with legacy=False")
            if targets is None or resolved.kind != XLA_CKPT:
                got = read_items(resolved, STATE_ITEM, optional=(own,), config=self.config)
                return RestoredState(got[STATE_ITEM], got.get(own))
            reader = open_reader(resolved, self.config)
            try:
                item = reader.manifest.item(STATE_ITEM)
                state = reader.load(STATE_ITEM, into=targets(item))
                targets.read_back(item, state)  # the trainer's checks of item's records hold
                rank_state = reader.load(own) if own in reader.manifest.items else None
                return RestoredState(state, rank_state)
            finally:
                reader.storage.close()

        decided = self._decided(uri)
        if decided is None:
            return read_checkpoint(uri, read, config=self.config)
        return read_resolved(decided, read, again=lambda: resolve(uri, self.config),
                             config=self.config)

    def _decided(self, uri: str) -> Resolved | None:
        """In a job of several ranks: the checkpoint rank 0 chose, with the manifest it sent
        (every rank calls this); None on one process, or for a source of another kind
        (a legacy ``.pt``, HF, DCP), which each rank then resolves and reads itself."""
        dist = job_dist()
        if dist is None:
            return None
        try:
            d = decide(uri, dist, config=self.config)
        except ConfigError:  # another kind of source, on every rank alike
            return None
        return Resolved(uri=uri, checkpoint=d.checkpoint, manifest=d.manifest)


def _restore_collectively(request: RestoreRequest, *, dist: Dist | None,
                          storage_config: StorageConfig | None = None,
                          **kwargs: Any) -> RestoredState:
    """:func:`xla_ckpt.restore.restore` of ``request`` (every rank calls it)."""
    kw = dict(kwargs)
    if request.into is not None:
        kw["into"] = request.into
    if request.rank_state_remap is not None:
        kw["rank_state_remap"] = request.rank_state_remap
    if request.rank_state_on_resize is not None:
        kw["config"] = dataclasses.replace(kw.get("config") or RestoreConfig(),
                                           rank_state_on_resize=request.rank_state_on_resize)
    if storage_config is not None:
        kw["storage_config"] = storage_config
    r = restore(request.uri, dist=dist, **kw)
    return RestoredState(r.state, r.rank_state)


def make_restorer(*, dist: Dist | None = None, **kwargs: Any) -> Restorer:
    """A :class:`Restorer` that restores through :func:`xla_ckpt.restore.restore` on every
    rank (rank 0 decides and sends the decision; the strategy moves the bytes).

    ``kwargs`` are passed to :func:`~xla_ckpt.restore.restore` (strategy, map_location,
    config, storage_config, rank_state_remap, ...).  Every rank calls the restorer.  The
    request's ``into`` (a sharded model's :meth:`~xla_ckpt.trainer.Checkpointer.
    restore_targets`) is filled in place, each rank reading only its shards' byte ranges;
    its ``rank_state_on_resize`` and ``rank_state_remap``, when set, win over those of
    ``kwargs`` (the first replaces that field of ``kwargs["config"]``).  Its ``targets`` are not
    used (the trainer copies what was read).

    Raises:
        TypeError: (at the call) a ``kwargs`` name :func:`~xla_ckpt.restore.restore` lacks.
    """

    def restorer(request: RestoreRequest) -> RestoredState:
        return _restore_collectively(request, dist=dist, **kwargs)

    return restorer


class SingleProcessSaver:
    """Write the state with :func:`xla_ckpt.save` (atomic commit), this rank's ``rank_state``
    as item ``rank/<rank>``."""

    def __init__(self, *, rank: int = 0, config: Optional[StorageConfig] = None) -> None:
        self.rank = rank
        self.config = config

    def __call__(self, state: Any, uri: str, *, metadata: Any, rank_state: Any | None) -> Any:
        """Write ``state`` (and this rank's ``rank_state``) to ``uri`` with
        :func:`xla_ckpt.api.save`; the committed manifest.

        A state holding sharded tensors (a sharded model's ``DTensor`` state) is saved by
        every rank at once (call it on every rank, ``rank`` being this process's rank in the
        job's process group): ``xla_ckpt.save`` runs :func:`xla_ckpt.restore.save_distributed`
        over the job's process group, each rank writing the shards it owns and its own
        ``rank_state``."""
        rank_states = {self.rank: rank_state} if rank_state is not None else None
        return save(state, uri, metadata=metadata, rank_states=rank_states, config=self.config)
