"""Import legacy ``torch.save`` / fairseq ``.pt`` files and HF ``safetensors`` files, safely.

Pure: takes ``bytes`` or a seekable binary file object; fetching a ``gs://``
object is :mod:`xla_ckpt.kinds.legacy`'s job.  A legacy file is untrusted input:

1. **Static scan first.**  Every pickle the loader would run is disassembled
   with :mod:`pickletools` (``data.pkl`` of a zip-format file, the five
   leading pickles of a pre-1.6 file).  A global outside :data:`ALLOWED_GLOBALS`
   raises :class:`~xla_ckpt.errors.UnsafePickleError` naming *every* such
   class before anything is unpickled; so do opcodes that can call code
   without a named global (``STACK_GLOBAL``, ``INST``, ``OBJ``, ``EXT*``).
2. **Then** ``torch.load(weights_only=True, map_location="cpu")`` inside
   ``torch.serialization.safe_globals`` with the same allow-list (defence in
   depth: torch's restricted unpickler enforces it again).  Tensors saved
   with a device tag this host lacks (``cuda:3``, ``xla:0``) come back on CPU
   (CASES C1).
3. **Bounded memory.**  Zip archives must not declare more uncompressed bytes
   than the file holds, may not repeat an entry name, and must not be
   TorchScript; after loading, the distinct tensor storages must fit in the
   file and no tensor may be an expanded view much larger than its storage;
   containers are walked with a node budget proportional to the file size
   (a pickle can share one list many times to make a tiny file look huge)
   and a depth bound (:data:`xla_ckpt.format.typed.MAX_DEPTH`).

Where each part lives:

* :mod:`~xla_ckpt.format.legacy.kinds` -- file kinds (:func:`sniff_format`), the zip
  checks, safetensors reading;
* :mod:`~xla_ckpt.format.legacy.unpickle` -- the allow-list (:data:`ALLOWED_GLOBALS`,
  why each global is on it), the static scan, the restricted ``torch.load`` and the
  bounded walk that turns the loaded objects into plain values;
* :mod:`~xla_ckpt.format.legacy.fairseq` -- recognising a fairseq checkpoint by
  fairseq's own fields (:func:`fairseq_vintage`) and the layout upgrade
  (:func:`upgrade_fairseq_state`), which runs only when asked by name or on the
  trainer's restore path (a load returns what was saved, CASES C24);
* :mod:`~xla_ckpt.format.legacy.layouts` -- the import layouts and the entry point,
  :func:`load_legacy`.
"""

from xla_ckpt.format.legacy.fairseq import (
    fairseq_metadata,
    fairseq_vintage,
    looks_like_fairseq,
    upgrade_fairseq_state,
)
from xla_ckpt.format.legacy.kinds import Kind, Source, load_safetensors_file, sniff_format
from xla_ckpt.format.legacy.layouts import Layout, LegacyFile, load_legacy
from xla_ckpt.format.legacy.unpickle import _EXTRA as _EXTRA  # for a benchmark's torch.load peer
from xla_ckpt.format.legacy.unpickle import (
    ALLOWED_GLOBALS,
    MAX_EXPANSION_BYTES,
    REFUSED_DEFAULT_GLOBALS,
    load_torch_file,
    scan_pickle,
)

__all__ = [
    "ALLOWED_GLOBALS", "MAX_EXPANSION_BYTES", "REFUSED_DEFAULT_GLOBALS", "Kind", "Layout",
    "LegacyFile", "Source", "fairseq_metadata", "fairseq_vintage", "load_legacy",
    "load_safetensors_file", "load_torch_file", "looks_like_fairseq", "scan_pickle",
    "sniff_format", "upgrade_fairseq_state",
]
