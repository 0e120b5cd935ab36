"""Checkpoints of other kinds, and conversion between kinds.

Reading: legacy ``torch.save``/fairseq ``.pt`` and safetensors files
(:mod:`~xla_ckpt.kinds.legacy`), HF sharded safetensors (:mod:`~xla_ckpt.kinds.hf`), PyTorch
DCP folders (:mod:`~xla_ckpt.kinds.dcp`), only some keys of an xla_ckpt checkpoint
(:mod:`~xla_ckpt.kinds.partial`), a resolved xla_ckpt checkpoint whole
(:mod:`~xla_ckpt.kinds.opener`), any other kind whole (:mod:`~xla_ckpt.kinds.foreign`).
Writing other kinds: :mod:`~xla_ckpt.kinds.export`.
"""

__all__ = ["dcp", "dcp_boxes", "dcp_write", "export", "export_weights", "foreign", "hf", "legacy",
           "opener", "partial"]
