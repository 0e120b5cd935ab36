"""A DCP checkpoint's ``.metadata``: read through the allow-list, checked, as plain dataclasses.

``torch.distributed.checkpoint`` (torch 2.9, ``filesystem.py``) commits a checkpoint by
writing ``.metadata`` last: ``pickle.dump`` of a ``Metadata`` whose

* ``state_dict_metadata`` maps each flattened key (``"model.layer.weight"``,
  ``"optim.state.layer.weight.exp_avg"``, ``"optim.param_groups.0.lr"``) to a
  ``TensorStorageMetadata`` (``TensorProperties`` with the dtype, the global ``size``, and
  ``ChunkStorageMetadata`` chunks with ``offsets``/``sizes`` in the global index space) or a
  ``BytesStorageMetadata`` (a non-tensor value, ``torch.save`` bytes);
* ``storage_data`` maps a ``MetadataIndex(fqn, offset)`` per chunk / bytes item to a
  ``_StorageInfo(relative_path, offset, length)``: the byte range of that item in a
  ``.distcp`` file of the checkpoint folder;
* ``planner_data`` (default planner) maps each flattened key to its path in the nested
  state (``("optim", "param_groups", 0, "lr")``).

:func:`load_dcp_metadata` unpickles it with the allow-list of
:mod:`xla_ckpt.format.dcp.unpickle` (exactly the classes above plus ``StorageMeta``,
``torch.Size``, torch dtypes and layouts, the memory-format enum and ``pathlib`` paths,
all as inert stand-ins), then checks what the readers rely on and returns
:class:`DcpMetadata`.  It refuses, naming the file and the key: a global outside the list
(:class:`~xla_ckpt.errors.UnsafePickleError`, nothing runs), unknown dtypes or non-strided
layouts, chunks outside the tensor's bounds or overlapping each other or not covering it,
a chunk's byte length too small for its sizes, a chunk or bytes item without a storage
entry, relative paths that leave the folder (``..``, absolute), and stream transforms
(DCP's compression extensions; the bytes could not be read by range).

Pure: no file, network or torch.distributed access; the caller gives the bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

import torch

from xla_ckpt.errors import CheckpointCorruptError
from xla_ckpt.format.dcp.unpickle import Pickled, allow_list_loads, stand_in
from xla_ckpt.format.dtypes import dtype_from_name, dtype_name, itemsize

#: The commit marker of a DCP checkpoint folder (``filesystem._metadata_fn``).
METADATA_NAME = ".metadata"

_MD = "torch.distributed.checkpoint.metadata."
_FS = "torch.distributed.checkpoint.filesystem."
#: The DCP classes a ``.metadata`` may name (module path as torch 2.9 pickles them).
DCP_CLASSES: tuple[str, ...] = (
    _MD + "Metadata", _MD + "TensorStorageMetadata", _MD + "BytesStorageMetadata",
    _MD + "ChunkStorageMetadata", _MD + "TensorProperties", _MD + "MetadataIndex",
    _MD + "StorageMeta", _FS + "_StorageInfo",
)
_MEM_FORMAT_ENUM = _MD + "_MEM_FORMAT_ENCODING"
_PATH_CLASSES = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                 "PureWindowsPath")
_LAYOUTS = {"torch.strided": torch.strided, "torch.sparse_coo": torch.sparse_coo,
            "torch.sparse_csr": torch.sparse_csr, "torch.sparse_csc": torch.sparse_csc,
            "torch.sparse_bsr": torch.sparse_bsr, "torch.sparse_bsc": torch.sparse_bsc}


def _size(values: Any = ()) -> tuple[int, ...]:
    """Stand-in for ``torch.Size(values)``: a tuple of ints (checked later)."""
    if not isinstance(values, (tuple, list)):
        raise TypeError(f"torch.Size of {type(values).__name__}")
    return tuple(values)


def _mem_format(value: Any) -> int:
    """Stand-in for ``_MEM_FORMAT_ENCODING(value)``: 0 contiguous, 1 channels_last, 2 preserve."""
    if type(value) is not int or value not in (0, 1, 2):
        raise ValueError(f"_MEM_FORMAT_ENCODING({value!r})")
    return value


def _layout(name: Any) -> torch.layout:
    """Stand-in for ``torch.serialization._get_layout(name)``, over a fixed table."""
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise ValueError(f"unknown layout {name!r}")
    return _LAYOUTS[name]


def _path(*parts: Any) -> str:
    """Stand-in for a ``pathlib`` path: its string (no filesystem access)."""
    if not all(isinstance(p, str) for p in parts):
        raise TypeError("pathlib path parts must be str")
    return "/".join(parts)


def _allowed_globals() -> dict[str, Any]:
    allowed: dict[str, Any] = {name: stand_in(name) for name in DCP_CLASSES}
    allowed[_MEM_FORMAT_ENUM] = _mem_format
    allowed["torch.Size"] = _size
    allowed["torch.serialization._get_layout"] = _layout
    allowed.update(_LAYOUTS)
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            allowed[f"torch.{name}"] = value
    for module in ("pathlib", "pathlib._local"):
        for cls in _PATH_CLASSES:
            allowed[f"{module}.{cls}"] = _path
    return allowed


#: ``"module.name"`` -> what the ``.metadata`` unpickler gives for it (see the module docstring).
METADATA_GLOBALS: Mapping[str, Any] = _allowed_globals()


# ---- the result ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DcpChunk:
    """One saved chunk of a tensor: a box of the global tensor and where its bytes are.

    Attributes:
        offsets: the box's first index in each dimension (global index space).
        sizes: the box's extent in each dimension (elements).
        file: the ``.distcp`` file holding it, relative to the checkpoint folder.
        offset: where the chunk's ``torch.save`` zip starts in ``file`` (bytes).
        length: the zip's length (bytes); the tensor's raw bytes are one uncompressed
            member inside it (:mod:`xla_ckpt.format.dcp.zip_member`).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class DcpTensorEntry:
    """A tensor key: dtype, global shape and the chunks that tile it exactly.

    Attributes:
        key: the flattened key as DCP names it (``"model.layer.weight"``).
        dtype: the saved dtype (kept exactly; CASES C23).
        shape: the global shape.
        chunks: every saved chunk; disjoint, inside ``shape``, together covering it.
    """

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole global tensor (``numel * element_size``)."""
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True)
class DcpBytesEntry:
    """A non-tensor key: ``torch.save`` bytes at ``[offset, offset + length)`` of ``file``.

    Read them with :func:`xla_ckpt.format.dcp.items.load_bytes_item` (``weights_only``).
    """

    key: str
    file: str
    offset: int
    length: int


DcpEntry = Union[DcpTensorEntry, DcpBytesEntry]


@dataclass(frozen=True)
class DcpMetadata:
    """What xla_ckpt needs of a DCP ``.metadata``.

    Attributes:
        source: the ``.metadata`` URI (for messages).
        entries: flattened key -> :class:`DcpTensorEntry` or :class:`DcpBytesEntry`, in
            DCP's order.
        mapping: flattened key -> path in the nested state (DCP's default planner's
            ``planner_data``; empty when the saver's planner recorded none).
        version: DCP's format version string (``"1.0.0"`` in torch 2.9), or None.
    """

    source: str
    entries: Mapping[str, DcpEntry]
    mapping: Mapping[str, tuple[str | int, ...]] = field(default_factory=dict)
    version: str | None = None

    @property
    def files(self) -> tuple[str, ...]:
        """Every data file the entries name (relative to the folder), sorted."""
        names: set[str] = set()
        for e in self.entries.values():
            if isinstance(e, DcpTensorEntry):
                names.update(c.file for c in e.chunks)
            else:
                names.add(e.file)
        return tuple(sorted(names))

    def tensors(self) -> dict[str, DcpTensorEntry]:
        return {k: e for k, e in self.entries.items() if isinstance(e, DcpTensorEntry)}


# ---- reading ---------------------------------------------------------------------------------


def load_dcp_metadata(data: bytes, *, source: str) -> DcpMetadata:
    """Parse and check the bytes of a DCP ``.metadata`` file (torch 2.x ``FileSystemWriter``).

    Args:
        data: the whole ``.metadata`` object.
        source: its URI, named in every error.

    Returns:
        :class:`DcpMetadata`: per key a tensor entry (dtype, global shape, chunks with their
        file, byte offset and length) or a bytes entry (file, offset, length).

    Raises:
        UnsafePickleError: the pickle names a global outside :data:`METADATA_GLOBALS`
            (the message names it); nothing it names was imported or run.
        CheckpointCorruptError: malformed pickle, or an entry fails a check of the module
            docstring (the message names the key).
    """
    obj = allow_list_loads(bytes(data), allowed=METADATA_GLOBALS, where=source,
                           what="DCP .metadata")
    return _Converter(source).metadata(obj)


class _Converter:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, what: str, key: str | None = None) -> CheckpointCorruptError:
        where = f"{self.source}: key {key!r}: " if key is not None else f"{self.source}: "
        return CheckpointCorruptError(f"{where}{what}; the DCP checkpoint is malformed or "
                                      "hostile (re-save it with torch.distributed.checkpoint)")

    def fields(self, obj: Any, cls: str, key: str | None = None) -> dict[str, Any]:
        if not isinstance(obj, Pickled) or obj.pickled_name != cls:
            raise self.fail(f"expected a {cls.rpartition('.')[2]}, found "
                            f"{getattr(obj, 'pickled_name', type(obj).__name__)}", key)
        state = obj.state if obj.state is not None else {}
        if obj.args or not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise self.fail(f"unexpected pickled form of {cls.rpartition('.')[2]}", key)
        return state

    def count(self, v: Any, what: str, key: str | None) -> int:
        if type(v) is not int or v < 0:
            raise self.fail(f"{what} must be an integer >= 0, not {v!r}", key)
        return v

    def index(self, v: Any, what: str, key: str | None) -> tuple[int, ...]:
        if not isinstance(v, (tuple, list)):
            raise self.fail(f"{what} must be a torch.Size, not {type(v).__name__}", key)
        return tuple(self.count(x, what, key) for x in v)

    def metadata(self, obj: Any) -> DcpMetadata:
        md = self.fields(obj, _MD + "Metadata")
        sdm = md.get("state_dict_metadata")
        if not isinstance(sdm, dict):
            raise self.fail("state_dict_metadata is not a dict")
        storage = self.storage(md.get("storage_data"))
        entries: dict[str, DcpEntry] = {}
        for key, meta in sdm.items():
            if not isinstance(key, str):
                raise self.fail(f"state_dict_metadata key {key!r} is not a string")
            name = getattr(meta, "pickled_name", None)
            if name == _MD + "BytesStorageMetadata":
                self.fields(meta, name, key)
                file, off, length = self.lookup(storage, key, None)
                entries[key] = DcpBytesEntry(key, file, off, length)
            elif name == _MD + "TensorStorageMetadata":
                entries[key] = self.tensor(key, meta, storage)
            else:
                raise self.fail(f"entry is a {name or type(meta).__name__}, not tensor or bytes "
                                "storage metadata", key)
        version = md.get("version")
        return DcpMetadata(source=self.source, entries=entries,
                           mapping=self.mapping(md.get("planner_data"), entries),
                           version=version if isinstance(version, str) else None)

    def storage(self, sd: Any) -> dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]]:
        if not isinstance(sd, dict):
            raise self.fail("storage_data is not a dict (not written by DCP's FileSystemWriter)")
        out: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
        for idx, info in sd.items():
            f = self.fields(idx, _MD + "MetadataIndex")
            fqn = f.get("fqn")
            if not isinstance(fqn, str):
                raise self.fail(f"MetadataIndex fqn {fqn!r} is not a string")
            off = f.get("offset")
            offsets = None if off is None else self.index(off, "MetadataIndex offset", fqn)
            s = self.fields(info, _FS + "_StorageInfo", fqn)
            transforms = s.get("transform_descriptors")
            if transforms:
                raise CheckpointCorruptError(
                    f"{self.source}: key {fqn!r}: saved through DCP stream transforms "
                    f"{list(transforms) if isinstance(transforms, (list, tuple)) else transforms!r}"
                    " (compression); xla_ckpt reads plain DCP checkpoints by byte range only. "
                    "Load it with torch.distributed.checkpoint.load and re-save it without "
                    "_extensions")
            path = self.relative_path(s.get("relative_path"), fqn)
            entry = (path, self.count(s.get("offset"), "storage offset", fqn),
                     self.count(s.get("length"), "storage length", fqn))
            if (fqn, offsets) in out:
                raise self.fail(f"two storage entries for the chunk at offsets {offsets}", fqn)
            out[(fqn, offsets)] = entry
        return out

    def relative_path(self, p: Any, key: str) -> str:
        if not isinstance(p, str) or not p or "\\" in p or "\x00" in p or p.startswith("/") \
                or re.match(r"^[A-Za-z]:", p) \
                or any(part in ("", ".", "..") for part in p.split("/")):
            raise self.fail(f"data file name {p!r} is not a plain name inside the checkpoint "
                            "folder", key)
        return p

    def lookup(self, storage: Mapping[tuple[str, tuple[int, ...] | None], tuple[str, int, int]],
               key: str, offsets: tuple[int, ...] | None) -> tuple[str, int, int]:
        try:
            return storage[(key, offsets)]
        except KeyError:
            what = "the bytes item" if offsets is None else f"the chunk at offsets {offsets}"
            raise self.fail(f"no storage entry (file, offset, length) for {what}", key) from None

    def tensor(self, key: str, meta: Any, storage: Mapping[tuple[str, tuple[int, ...] | None],
                                                           tuple[str, int, int]]) \
            -> DcpTensorEntry:
        f = self.fields(meta, _MD + "TensorStorageMetadata", key)
        dtype, layout = self.properties(f.get("properties"), key)
        if layout != torch.strided:
            raise self.fail(f"layout {layout} is not supported (strided tensors only)", key)
        shape = self.index(f.get("size"), "size", key)
        raw_chunks = f.get("chunks")
        if not isinstance(raw_chunks, (list, tuple)):
            raise self.fail("chunks is not a list", key)
        item = itemsize(dtype)
        chunks: list[DcpChunk] = []
        for c in raw_chunks:
            cf = self.fields(c, _MD + "ChunkStorageMetadata", key)
            offsets = self.index(cf.get("offsets"), "chunk offsets", key)
            sizes = self.index(cf.get("sizes"), "chunk sizes", key)
            if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                    o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)):
                raise self.fail(f"chunk at offsets {offsets} with sizes {sizes} is out of the "
                                f"bounds of the tensor's shape {shape}", key)
            file, off, length = self.lookup(storage, key, offsets)
            need = math.prod(sizes) * item
            if length < need:
                raise self.fail(f"chunk at offsets {offsets} has {length} bytes in {file}, fewer "
                                f"than its sizes {sizes} of {dtype_name(dtype)} need ({need})",
                                key)
            chunks.append(DcpChunk(offsets, sizes, file, off, length))
        self.check_tiling(key, shape, chunks)
        return DcpTensorEntry(key, dtype, shape, tuple(chunks))

    def properties(self, p: Any, key: str) -> tuple[torch.dtype, torch.layout]:
        name = _MD + "TensorProperties"
        if not isinstance(p, Pickled) or p.pickled_name != name or p.args:
            raise self.fail("tensor properties missing or of the wrong class", key)
        st = p.state
        if isinstance(st, tuple) and len(st) == 5:  # TensorProperties.__getstate__ (torch >= 2.0)
            dtype, layout = st[0], st[1]
        elif isinstance(st, dict):  # older DCP: the dataclass __dict__
            dtype, layout = st.get("dtype"), st.get("layout", torch.strided)
        else:
            raise self.fail("tensor properties in an unknown pickled form", key)
        if not isinstance(dtype, torch.dtype):
            raise self.fail(f"dtype {dtype!r} is not a torch dtype", key)
        try:
            dtype = dtype_from_name(dtype_name(dtype), where=f"{self.source}: key {key!r}")
        except CheckpointCorruptError:
            raise self.fail(f"dtype {dtype} cannot be restored (quantized or unknown)", key) \
                from None
        if not isinstance(layout, torch.layout):
            raise self.fail(f"layout {layout!r} is not a torch layout", key)
        return dtype, layout

    def check_tiling(self, key: str, shape: tuple[int, ...], chunks: list[DcpChunk]) -> None:
        numel = math.prod(shape)
        boxes = sorted((c for c in chunks if c.numel), key=lambda c: c.offsets)
        total = sum(c.numel for c in boxes)
        for i, a in enumerate(boxes):
            a_end0 = a.offsets[0] + a.sizes[0] if shape else 1
            for b in boxes[i + 1:]:
                if shape and b.offsets[0] >= a_end0:
                    break
                if all(bo < ao + asz and ao < bo + bsz for ao, asz, bo, bsz
                       in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)):
                    raise self.fail(f"chunks at offsets {a.offsets} and {b.offsets} overlap",
                                    key)
        if total != numel:
            raise self.fail(f"chunks cover {total} of the tensor's {numel} elements (shape "
                            f"{shape})", key)

    def mapping(self, planner_data: Any, entries: Mapping[str, DcpEntry]
                ) -> dict[str, tuple[str | int, ...]]:
        """The default planner's key -> nested path; {} if the planner recorded something else."""
        if not isinstance(planner_data, dict):
            return {}
        out: dict[str, tuple[str | int, ...]] = {}
        for k, path in planner_data.items():
            if not isinstance(k, str) or not isinstance(path, (tuple, list)) or not path or \
                    not all(type(p) in (str, int) for p in path):
                return {}
            out[k] = tuple(path)
        return out
