"""The run folder: what a URI names and which checkpoint of a run folder counts.

:mod:`~xla_ckpt.run.catalog` (checkpoints, pointers, "latest"), :mod:`~xla_ckpt.run.resolve`
(the one resolver every entry point uses, and the one rule for "nothing committed"),
:mod:`~xla_ckpt.run.fencing` (the lease between job incarnations),
:mod:`~xla_ckpt.run.retention` and :mod:`~xla_ckpt.run.prune` (keep-N, garbage),
:mod:`~xla_ckpt.run.recovery` (the previous intact checkpoint).  Torch-free.
"""

__all__ = ["catalog", "fencing", "prune", "recovery", "resolve", "retention", "sniff"]
