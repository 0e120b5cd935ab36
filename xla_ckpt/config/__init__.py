"""Config dataclasses and their YAML loading (``configs/*.yaml``), with CLI overrides.

One ``@dataclass(kw_only=True)`` per component, units in field names, validation
in ``__post_init__`` raising :class:`~xla_ckpt.errors.ConfigError` that names the
dotted key.  A YAML file fills the top-level :class:`Config`::

    checkpoint:                      # xla_ckpt.manager.CheckpointConfig
      save_dir: gs://${XLA_CKPT_BUCKET}/runs/minilm
      save_interval_updates: 50
      keep_interval_updates: 3
    restore:                         # xla_ckpt.restore.RestoreConfig
      strategy: all_ranks
    storage:                         # xla_ckpt.storage.StorageConfig
      max_workers: 16
    dist:                            # xla_ckpt.comm.DistConfig
      backend: xla
    train:                           # TrainConfig (the demo's training loop)
      model: minilm

Where each part lives:

* each component's section beside it: :class:`xla_ckpt.manager.CheckpointConfig`,
  :class:`xla_ckpt.restore.RestoreConfig`, :class:`xla_ckpt.storage.StorageConfig`,
  :class:`xla_ckpt.comm.DistConfig`, :class:`xla_ckpt.trainer.CheckpointerConfig`;
* :mod:`~xla_ckpt.config.sections` -- the top-level :class:`Config` composing them, and the
  demo's :class:`TrainConfig`;
* :mod:`~xla_ckpt.config.loading` -- YAML loading, ``key=value`` overrides, ``${VAR}``
  expansion and the strict type conversion (:func:`load_config`, :func:`apply_overrides`,
  :func:`config_from_dict`, :func:`config_to_dict`, :func:`dump_config`).
"""

from xla_ckpt.config.loading import (
    apply_overrides,
    config_from_dict,
    config_to_dict,
    dump_config,
    load_config,
)
from xla_ckpt.config.sections import Config, TrainConfig

__all__ = [
    "Config", "TrainConfig",
    "apply_overrides", "config_from_dict", "config_to_dict", "dump_config", "load_config",
]
