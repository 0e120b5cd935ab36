"""Keys of a trainer checkpoint's state (fairseq ``Trainer.state_dict`` layout).

::

    {
      "args": argparse.Namespace | None,      # legacy fairseq config
      "cfg": dict | None,                     # config
      "model": OrderedDict[str, Tensor],      # unwrapped model.state_dict()
      "criterion": OrderedDict | None,        # only when the criterion has parameters
      "optimizer_history": [                  # one entry per save, oldest first
        {"criterion_name": str, "optimizer_name": str,
         "lr_scheduler_state": dict, "num_updates": int}, ...],
      "extra_state": {
        "metrics": OrderedDict[str, list],    # Metrics.state_dict()
        "previous_training_time": float,      # seconds
        "train_iterator": {"epoch": int, "iterations_in_epoch": int, "version": int},
        ...                                   # whatever the caller passed (val_loss, best, ...)
        # on restore only: "loss_scale": float  # a fairseq FP16 optimizer's loss scale
      },
      "last_optimizer_state": {"state": {int: {...}}, "param_groups": [...]},  # unless not saved
    }

Per-rank state (each rank's iterator/RNG position) is saved in the item
``rank/<r>`` and merged over ``extra_state`` for that rank on restore.
The manifest ``metadata`` (shown by ``xla-ckpt ls``, used by retention) holds
``num_updates``, ``epoch``, ``iterations_in_epoch`` and ``loss`` when known.
"""

ARGS = "args"
CFG = "cfg"
MODEL = "model"
CRITERION = "criterion"
OPTIMIZER_HISTORY = "optimizer_history"
EXTRA_STATE = "extra_state"
LAST_OPTIMIZER_STATE = "last_optimizer_state"

# optimizer_history entries
CRITERION_NAME = "criterion_name"
OPTIMIZER_NAME = "optimizer_name"
LR_SCHEDULER_STATE = "lr_scheduler_state"
NUM_UPDATES = "num_updates"

# extra_state entries
METRICS = "metrics"
PREVIOUS_TRAINING_TIME = "previous_training_time"
TRAIN_ITERATOR = "train_iterator"
EPOCH = "epoch"
ITERATIONS_IN_EPOCH = "iterations_in_epoch"
ITERATOR_VERSION = "version"
VAL_LOSS = "val_loss"
# set by the restore (never saved by it): a fairseq FP16Optimizer / MemoryEfficientFP16Optimizer
# checkpoint's dynamic loss scale (float), taken out of its last_optimizer_state
LOSS_SCALE = "loss_scale"

# manifest metadata entries
META_LOSS = "loss"
