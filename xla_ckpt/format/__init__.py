"""The checkpoint format: manifest schema, safetensors-layout data files, typed non-tensor state.

Pure: nothing here touches the network, the filesystem or torch.distributed.
"""

from xla_ckpt.format.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    STATE_ITEM,
    BlobRecord,
    Item,
    Manifest,
    TensorRecord,
    rank_item,
)

__all__ = ["FORMAT_VERSION", "MANIFEST_NAME", "STATE_ITEM", "BlobRecord", "Item", "Manifest",
           "TensorRecord", "rank_item"]
