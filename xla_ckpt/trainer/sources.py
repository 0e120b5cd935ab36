"""Where the trainer's state comes from and goes to: injectable restorer and saver.

The trainer never talks to storage itself.  It calls

* a **restorer** ``restorer(uri) -> (state, rank_state | None)`` (or any
  object with ``.state`` and ``.rank_state``, such as the ``Restored`` that
  ``xla_ckpt.restore.restore`` returns), which raises
  :class:`~xla_ckpt.errors.CheckpointNotFoundError` when nothing is committed
  at ``uri``;
* a **saver** ``saver(state, uri, *, metadata, rank_state) -> Any``.

The defaults here serve a single process: :class:`SingleProcessRestorer`
reads with :class:`xla_ckpt.io.CheckpointReader` (CPU tensors, crc32c
checked), or, when ``uri`` names a legacy fairseq/``torch.save`` ``.pt``
file, imports it through the allow-list of :mod:`xla_ckpt.io.legacy` (CASES
C4); :class:`SingleProcessSaver` writes with :func:`xla_ckpt.io.save`,
keeping ``rank_state`` in the item ``rank/<rank>``.  A multi-process job
passes the strategies from ``xla_ckpt.restore`` instead, e.g.::

    restorer=lambda uri: restore(uri, dist=dist, strategy="broadcast")
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from xla_ckpt.format.manifest import STATE_ITEM, rank_item
from xla_ckpt.io import CheckpointReader, save
from xla_ckpt.io.legacy import is_legacy_file, load_legacy_checkpoint
from xla_ckpt.storage import StorageConfig


class Saver(Protocol):
    def __call__(self, state: Any, uri: str, *, metadata: Any,
                 rank_state: Any | None) -> Any: ...


Restorer = Callable[[str], Any]


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

    def __call__(self, uri: str) -> tuple[Any, Any | None]:
        """Returns ``(state, rank_state or None)`` with CPU tensors.

        Raises:
            CheckpointNotFoundError / IncompleteCheckpointError: nothing committed at ``uri``.
            CheckpointCorruptError / IntegrityError: bad bytes (names path and tensor).
            UnsafePickleError: a legacy file names a class outside the allow-list.
        """
        if self.legacy and is_legacy_file(uri, config=self.config):
            return load_legacy_checkpoint(uri, config=self.config), None
        reader = CheckpointReader.open(uri, self.config)
        try:
            state = reader.load(STATE_ITEM)
            own = rank_item(self.rank)
            rank_state = reader.load(own) if own in reader.manifest.items else None
            return state, rank_state
        finally:
            reader.storage.close()


class SingleProcessSaver:
    """Write the whole state from one process with :func:`xla_ckpt.io.save` (atomic commit)."""

    def __init__(self, *, rank: int = 0, config: Optional[StorageConfig] = None) -> None:
        self.rank = rank
        self.config = config

    def __call__(self, state: Any, uri: str, *, metadata: Any, rank_state: Any | None) -> Any:
        rank_states = {self.rank: rank_state} if rank_state is not None else None
        return save(state, uri, metadata=metadata, rank_states=rank_states, config=self.config)


def unpack_restored(result: Any) -> tuple[Any, Any | None]:
    """Accept ``(state, rank_state)``, an object with ``.state``/``.rank_state`` or a bare state."""
    if hasattr(result, "state") and hasattr(result, "rank_state"):
        return result.state, result.rank_state
    if isinstance(result, tuple) and len(result) == 2:
        return result[0], result[1]
    return result, None
