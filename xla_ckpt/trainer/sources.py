"""Where the trainer's state comes from and goes to: injectable restorer and saver.

The trainer never talks to storage itself.  It calls

* a **restorer** ``restorer(uri) -> (state, rank_state | None)`` (or any
  object with ``.state`` and ``.rank_state``, such as the ``Restored`` that
  ``xla_ckpt.restore.restore`` returns), which raises
  :class:`~xla_ckpt.errors.NothingCommittedError` when nothing is committed
  at ``uri`` (what :func:`xla_ckpt.run.resolve.resolve` raises; the trainer
  starts fresh on that class only: any other error, a plain
  ``CheckpointNotFoundError`` included, propagates);
* a **saver** ``saver(state, uri, *, metadata, rank_state) -> Any``.

The defaults here serve a single process: :class:`SingleProcessRestorer`
resolves ``uri`` with the one resolver (:mod:`xla_ckpt.run.resolve`: a
checkpoint folder, a run folder's latest committed checkpoint, a pointer) and
reads with :class:`xla_ckpt.io.CheckpointReader` (CPU tensors, crc32c
checked; with ``targets`` the trainer's live CPU parameters are filled in
place), once more if the checkpoint was replaced while it was read, or,
when ``uri`` names a legacy fairseq/``torch.save`` ``.pt`` file, imports it
through the allow-list of :mod:`xla_ckpt.kinds.legacy` (CASES C4);
:class:`SingleProcessSaver` writes with :func:`xla_ckpt.io.save`, keeping
``rank_state`` in the item ``rank/<rank>``.  A multi-process job passes the
strategies from ``xla_ckpt.restore`` instead, e.g.::

    restorer=lambda uri: restore(uri, dist=dist, strategy="broadcast")
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Optional, Protocol

import torch

from xla_ckpt.api import save
from xla_ckpt.errors import ConfigError
from xla_ckpt.format.manifest import STATE_ITEM, Item, rank_item
from xla_ckpt.kinds.opener import open_reader, read_checkpoint, read_items
from xla_ckpt.run.resolve import Resolved
from xla_ckpt.run.sniff import LEGACY, XLA_CKPT
from xla_ckpt.storage import StorageConfig


class Saver(Protocol):
    def __call__(self, state: Any, uri: str, *, metadata: Any,
                 rank_state: Any | None) -> Any: ...


Restorer = Callable[..., Any]
"""``restorer(uri)``; one that also takes ``targets=`` (:func:`accepts_targets`) may fill live
tensors in place."""

Targets = Callable[[Item], Mapping[str, torch.Tensor]]

#: ``fn(saved: {saved rank: per-rank state}, rank, world_size) -> this rank's per-rank state``.
RankStateRemap = Callable[[dict[int, Any], int, int], Any]
"""The manifest's ``state`` item -> live tensors to read into, by tensor key."""


def accepts_keyword(restorer: Any, name: str) -> bool:
    """Whether ``restorer`` takes the keyword ``name`` (``targets``, ``into``)."""
    try:
        params = inspect.signature(restorer).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
    p = params.get(name)
    return p is not None and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)


def accepts_targets(restorer: Any) -> bool:
    """Whether ``restorer`` takes the keyword ``targets`` (as :class:`SingleProcessRestorer`)."""
    return accepts_keyword(restorer, "targets")


class SingleProcessRestorer:
    """Read the replicated state and this rank's ``rank/<rank>`` item (if any) on one process.

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

    def __call__(self, uri: str, *, targets: Optional[Targets] = None,
                 into: Any = None, rank_state_on_resize: str = "error",
                 rank_state_remap: Optional[RankStateRemap] = None) -> Any:
        """Returns ``(state, rank_state or None)`` with CPU tensors.

        ``into`` (a sharded model's :meth:`~xla_ckpt.trainer.Checkpointer.restore_targets`:
        live DTensors): every rank calls it; :func:`xla_ckpt.restore.restore` with
        ``into=`` over the job's process group (:func:`xla_ckpt.comm.get_dist`) fills
        this rank's shards in place, reading only their byte ranges, and its
        :class:`~xla_ckpt.restore.Restored` is returned (``.state``, ``.rank_state``).
        ``rank_state_on_resize`` (``"error"`` / ``"drop"``) and ``rank_state_remap``
        (``fn(saved, rank, world_size)``) then say what becomes of per-rank items saved by
        another world size (:class:`~xla_ckpt.restore.RestoreConfig`); without ``into``
        only this rank's own ``rank/<rank>`` item is read and they are not used.

        ``targets``: for an xla_ckpt checkpoint, called with the manifest's ``state``
        item before any byte is read; it returns live tensors by tensor key
        (``TensorRecord.key``) that the read fills in place
        (:meth:`~xla_ckpt.io.CheckpointReader.load` ``into=``; the trainer passes
        :func:`~xla_ckpt.trainer.module_load.in_place_targets` of its model and
        criterion).  The state returned then holds views of those tensors.  If the
        checkpoint is replaced while it is read, it is resolved again, ``targets``
        is called again with the new manifest and the read starts over.  A ``targets``
        with a ``read_back(item, state)`` method is told which state was read from the item
        it was given (the trainer then need not check that state's structure again).
        Ignored for other kinds of source (legacy ``.pt``, HF, DCP).

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
        if into is not None:
            from xla_ckpt.comm import get_dist  # noqa: PLC0415 - the sharded path only
            from xla_ckpt.restore import (  # noqa: PLC0415 - restore imports trainer-free io
                RestoreConfig,
                restore,
            )

            return restore(uri, dist=get_dist(), into=into, storage_config=self.config,
                           config=RestoreConfig(rank_state_on_resize=rank_state_on_resize),
                           rank_state_remap=rank_state_remap)
        own = rank_item(self.rank)

        def read(resolved: Resolved) -> tuple[Any, Any | None]:
            if resolved.kind == LEGACY and not self.legacy:
                raise ConfigError(f"{resolved.checkpoint} is a legacy .pt/safetensors file and "
                                  "this restorer was built with legacy=False")
            if targets is None or resolved.kind != XLA_CKPT:
                got = read_items(resolved, STATE_ITEM, optional=(own,), config=self.config)
                return got[STATE_ITEM], got.get(own)
            reader = open_reader(resolved, self.config)
            try:
                item = reader.manifest.item(STATE_ITEM)
                into = targets(item)
                state = reader.load(STATE_ITEM, into=into)
                read_back = getattr(targets, "read_back", None)
                if read_back is not None:
                    read_back(item, state)  # the trainer's checks of item's records hold
                rank_state = reader.load(own) if own in reader.manifest.items else None
                return state, rank_state
            finally:
                reader.storage.close()

        return read_checkpoint(uri, read, config=self.config)


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


def unpack_restored(result: Any) -> tuple[Any, Any | None]:
    """Accept ``(state, rank_state)``, an object with ``.state``/``.rank_state`` or a bare state."""
    if hasattr(result, "state") and hasattr(result, "rank_state"):
        return result.state, result.rank_state
    if isinstance(result, tuple) and len(result) == 2:
        return result[0], result[1]
    return result, None
