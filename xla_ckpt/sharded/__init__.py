"""Live sharded values: what one rank holds of a tensor sharded over a mesh.

:class:`~xla_ckpt.sharded.value.LocalShard` / :class:`~xla_ckpt.sharded.value.ShardedValue`
describe it; :mod:`~xla_ckpt.sharded.views` reads them off DTensors (FSDP2, tensor parallel)
and :mod:`~xla_ckpt.sharded.spmd` off torch_xla SPMD tensors.  Below :mod:`xla_ckpt.restore`,
which saves and restores them; knows nothing about checkpoints.
"""

__all__ = ["spmd", "value", "views"]
