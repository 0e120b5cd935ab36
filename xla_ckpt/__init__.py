"""xla_ckpt: restore and save the complete training state of PyTorch jobs on TPU, GKE and CUDA.

Quick use::

    import xla_ckpt
    xla_ckpt.save(state, "gs://bucket/run/checkpoint_100")   # atomic, pickle-free
    state = xla_ckpt.load("gs://bucket/run/checkpoint_100")  # parallel ranged reads, crc32c
"""

from xla_ckpt.io import load, save

__version__ = "0.1.0"
__all__ = ["load", "save", "__version__"]
