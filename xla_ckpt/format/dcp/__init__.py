"""PyTorch DCP (``torch.distributed.checkpoint``) checkpoints, read without unrestricted pickle.

* :mod:`.metadata` -- the ``.metadata`` commit marker through an allow-list unpickler, checked,
  as plain dataclasses (:func:`load_dcp_metadata`, :class:`DcpMetadata`);
* :mod:`.zip_member` -- where a tensor chunk's raw bytes sit inside its ``torch.save`` zip,
  found by byte range (:func:`locate_tensor_member`);
* :mod:`.items` -- non-tensor items, ``torch.load(weights_only=True)`` only;
* :mod:`.unpickle` -- the allow-list unpickler both pickles go through.

Pure (no I/O): :mod:`xla_ckpt.kinds.dcp` reads and writes DCP folders on top of this.
"""

from xla_ckpt.format.dcp.items import load_bytes_item
from xla_ckpt.format.dcp.metadata import (
    METADATA_NAME,
    DcpBytesEntry,
    DcpChunk,
    DcpMetadata,
    DcpTensorEntry,
    load_dcp_metadata,
)
from xla_ckpt.format.dcp.zip_member import TensorMember, locate_tensor_member

__all__ = ["METADATA_NAME", "DcpBytesEntry", "DcpChunk", "DcpMetadata", "DcpTensorEntry",
           "TensorMember", "load_bytes_item", "load_dcp_metadata", "locate_tensor_member"]
