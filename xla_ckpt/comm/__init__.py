"""Distribution layer: topology and collectives behind one small interface (DESIGN "dist").

* :class:`Topology` — rank, world_size, local_rank, local_world_size, host_id.
* :class:`Dist` — ``barrier(timeout_s)``, ``exchange(obj)`` (all-gather of
  small typed objects), ``broadcast_object``, ``broadcast_tensors`` (bucketed,
  into preallocated tensors), ``scatter_tensors`` (each rank its own),
  ``agree`` / ``run_collectively`` (a local failure becomes a
  :class:`~xla_ckpt.errors.DistributedError` on every rank, naming it).
* Backends: :class:`TorchDist` (torch.distributed, gloo/NCCL, ``env://``),
  :class:`XlaDist` (torch_xla runtime; control plane on gloo, ``xla://``),
  :class:`SingleProcess`.  :func:`get_dist` picks one.

This layer knows nothing about checkpoints.
"""

from typing import Any

from xla_ckpt.comm.base import Dist
from xla_ckpt.comm.buckets import DEFAULT_BUCKET_SIZE_BYTES, plan_buckets
from xla_ckpt.comm.config import DIST_BACKENDS, DistConfig
from xla_ckpt.comm.failures import describe_error
from xla_ckpt.comm.objects import decode_object, encode_object
from xla_ckpt.comm.select import get_dist, resolve_backend
from xla_ckpt.comm.single import SingleProcess
from xla_ckpt.comm.topology import Topology
from xla_ckpt.comm.torch_dist import TorchDist


def __getattr__(name: str) -> Any:
    if name == "XlaDist":
        from xla_ckpt.comm.xla_dist import XlaDist  # noqa: PLC0415 - lazily: it needs torch_xla

        return XlaDist
    raise AttributeError(name)


__all__ = ["DEFAULT_BUCKET_SIZE_BYTES", "DIST_BACKENDS", "Dist", "DistConfig", "SingleProcess",
           "Topology", "TorchDist", "XlaDist", "decode_object", "describe_error", "encode_object",
           "get_dist", "plan_buckets", "resolve_backend"]
