"""Saving a :class:`~xla_ckpt.trainer.Checkpointer`: the training state and its manifest summary.

:meth:`SaveState.state_dict` lays the whole training state out as fairseq
does (:mod:`xla_ckpt.trainer.keys`); :meth:`SaveState.save_checkpoint` hands
it, with a metadata summary, to the injectable saver.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Optional

import torch

from xla_ckpt.trainer import keys as K
from xla_ckpt.trainer.prefixes import unwrap_module
from xla_ckpt.trainer.sharded import is_sharded_module, model_state, optimizer_state
from xla_ckpt.trainer.training_surface import TrainingSurface, has_parameters, logger


def _plain(value: Any) -> Any:
    """Numpy scalars and one-element tensors as Python numbers (for manifest metadata)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return value.item()
    return value


class SaveState(TrainingSurface):
    """:meth:`state_dict` and :meth:`save_checkpoint` (fairseq ``Trainer.save_checkpoint``)."""

    def state_dict(self, extra_state: Optional[Mapping] = None) -> dict:
        """The whole training state (layout in :mod:`xla_ckpt.trainer.keys`).

        ``extra_state`` (``train_iterator``, ``val_loss``, ...) is merged into
        the saved ``extra_state``.  Tensors stay on their devices (the writer
        brings them to host).  Pass ``lambda: ckpt.state_dict(extra)`` as the
        ``state`` of :class:`xla_ckpt.manager.CheckpointManager`.

        A sharded model (any ``DTensor`` parameter: FSDP2, tensor parallel) is saved
        through ``torch.distributed.checkpoint.state_dict``: ``model`` is
        ``get_model_state_dict`` (live DTensors by FQN) and ``last_optimizer_state``
        ``get_optimizer_state_dict`` (:mod:`xla_ckpt.trainer.sharded`); the chunked save
        writes each rank's shards.  Call it on every rank then.

        Raises:
            ConfigError: a sharded model whose optimizer also holds parameters that are not
                the model's (a criterion with parameters).
        """
        criterion = self.criterion
        module = unwrap_module(self.model)
        # A sharded (DTensor: FSDP2 / TP) model: model and optimizer state through DCP's
        # state_dict API (trainer.sharded); any other model exactly as before.
        sharded = is_sharded_module(module)
        state = {
            K.ARGS: self.args,
            K.CFG: self.cfg,
            K.MODEL: model_state(module) if sharded else module.state_dict(),
            K.CRITERION: (unwrap_module(criterion).state_dict()
                          if has_parameters(criterion) else None),
            K.OPTIMIZER_HISTORY: list(self._optim_history) + [{
                K.CRITERION_NAME: type(criterion).__name__ if criterion is not None else None,
                K.OPTIMIZER_NAME: type(self.optimizer).__name__,
                K.LR_SCHEDULER_STATE: (self.lr_scheduler.state_dict()
                                       if self.lr_scheduler is not None else None),
                K.NUM_UPDATES: self.get_num_updates(),
            }],
            K.EXTRA_STATE: {
                K.METRICS: self.metrics.state_dict(),
                K.PREVIOUS_TRAINING_TIME: self.cumulative_training_time(),
            },
        }
        state[K.EXTRA_STATE].update(extra_state or {})
        if not self.config.no_save_optimizer_state:
            state[K.LAST_OPTIMIZER_STATE] = (optimizer_state(module, self.optimizer) if sharded
                                             else self.optimizer.state_dict())
        return state

    def save_checkpoint(self, uri: str, extra_state: Optional[Mapping] = None, *,
                        rank_extra_state: Optional[Mapping] = None,
                        metadata: Optional[Mapping] = None) -> Any:
        """Save the training state to ``uri`` (fairseq ``Trainer.save_checkpoint``).

        Args:
            uri: checkpoint folder (local path or ``gs://``).
            extra_state: merged into ``extra_state`` (``train_iterator``,
                ``val_loss``, ``best``, ...).
            rank_extra_state: this rank's own values (iterator position, RNG
                state) saved in its ``rank/<r>`` item; on restore they are
                merged over ``extra_state`` for this rank only.
            metadata: extra manifest metadata (e.g. ``{"loss": 2.1}``) on top
                of ``num_updates``, ``epoch``, ``iterations_in_epoch`` and
                ``loss`` (from ``extra_state["val_loss"]``).

        Returns:
            What the saver returns (the committed manifest by default).

        Raises:
            MetaTensorError: a model tensor is on the meta device (names the key).
            UnsupportedTypeError: a value the typed encoding cannot hold.
            StorageError: the write failed; nothing was committed.
        """
        t0 = time.perf_counter()
        state = self.state_dict(extra_state)
        md = self._summary(state[K.EXTRA_STATE], metadata)
        result = self.saver(state, uri, metadata=md, rank_state=rank_extra_state)
        if self.rank == 0:
            logger.info("rank %d: saved checkpoint %s (epoch %s @ %d updates) in %.2f s", self.rank,
                        uri, md.get(K.EPOCH), self.get_num_updates(), time.perf_counter() - t0)
        return result

    def _summary(self, extra_state: Mapping, metadata: Optional[Mapping]) -> dict:
        md: dict = {K.NUM_UPDATES: int(self.get_num_updates())}
        itr = extra_state.get(K.TRAIN_ITERATOR)
        if isinstance(itr, Mapping):
            for k in (K.EPOCH, K.ITERATIONS_IN_EPOCH):
                if k in itr:
                    md[k] = _plain(itr[k])
        if extra_state.get(K.VAL_LOSS) is not None:
            md[K.META_LOSS] = _plain(extra_state[K.VAL_LOSS])
        for k, v in (metadata or {}).items():
            md[k] = _plain(v)
        return md
