"""Partial restore: read only some keys of a checkpoint, and only the bytes they live in.

A **key** names a node of the saved state by its path, in one of two forms:

* dotted: the path's parts joined with ``.`` (dict keys, list/tuple indices, Namespace
  attributes), matched at part boundaries.  ``"optimizer"`` selects the whole optimizer
  state; ``"model.encoder.layer.0"`` selects ``state["model"]["encoder.layer.0.weight"]``
  and ``...bias`` (a model state_dict's own keys hold dots too) but not
  ``encoder.layer.01.weight``; an exact state_dict key such as
  ``"model.encoder.layer.0.weight"`` selects that one tensor.  A dotted key splits at
  container boundaries first: where a container holds a node the key names exactly or
  lies under (``state["model"]`` for ``"model"``), the key does not also select a
  sibling whose own dict key merely starts with it (``state["model.extra"]``); it matches
  inside a dict key only where no container boundary fits;
* bracketed, as error messages print keys: ``"state['model']['encoder.weight']"``
  (useful when a dict key itself holds a dot ambiguously).

Every key selects the subtree below the node(s) it names.  The result keeps the saved
structure, pruned to the selected nodes: dicts keep only the selected keys (in saved
order, ``OrderedDict`` ``_metadata`` kept), a Namespace only the selected attributes,
and a list or tuple only partly selected comes back as a dict ``{index: value}`` (so an
index keeps its meaning).  A key under another selected key (``["model",
"model.layer.2"]``) is selected with it and counts as found if it names something there.
An empty key list raises ``ValueError`` (pass None for everything).  A key that selects
nothing raises
:class:`~xla_ckpt.errors.UnknownKeyError` naming it and the closest keys there are.

Reading: the selection is made on the manifest's typed state (no tensor bytes), then
only the blobs the selected tensors live in are read through
:meth:`CheckpointReader.allocate` / :meth:`CheckpointReader.read_into` (crc32c checked
as always); a blob shared by a selected and an unselected tensor (tied weights, views of
one storage) is read whole.  In a sharded checkpoint (a chunked item, manifest version 2)
the selected global tensors are assembled whole from their chunks
(:func:`xla_ckpt.io.chunked.read_boxes`); only their chunks' bytes are read.  Other
checkpoint kinds (a legacy ``.pt``, HF safetensors, DCP) are read whole by the opener and
pruned the same way.

No ranks here: :meth:`xla_ckpt.manager.CheckpointManager.restore` with ``keys=`` runs
this on every rank after rank 0 decided which checkpoint.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from xla_ckpt.errors import UnknownKeyError
from xla_ckpt.format import typed
from xla_ckpt.format.manifest import STATE_ITEM, Item, Manifest
from xla_ckpt.format.plan import MapLocation, materialize_item
from xla_ckpt.io.chunked import nbytes_of, plan_whole_reads
from xla_ckpt.io.reader import CheckpointReader
from xla_ckpt.kinds.opener import open_reader, read_checkpoint, read_items
from xla_ckpt.run.resolve import Resolved
from xla_ckpt.run.sniff import XLA_CKPT
from xla_ckpt.storage import StorageConfig

logger = logging.getLogger(__name__)

Progress = Callable[[int], None]
"""Called with the byte count of each finished read (``progress(nbytes)``)."""

Keys = str | Sequence[str] | None

PROGRESS_STEP_BYTES = 64 * 2**20
"""With a ``progress`` hook, blobs are read in groups of about this many bytes, one call each."""

_MISSING = object()
_MAX_CLOSEST = 3


class _Ref:
    """Stands for tensor ``index`` of the item while the selection is made (no bytes read)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


@dataclass(frozen=True)
class _Key:
    text: str
    bracketed: bool

    def covers(self, path: tuple) -> bool:
        """The node at ``path`` is this key's node or below it."""
        if self.bracketed:
            name = typed.format_path(path)
            return name == self.text or name.startswith(self.text + "[")
        name = dotted_name(path)
        return bool(path) and (name == self.text or name.startswith(self.text + "."))

    def below(self, path: tuple) -> bool:
        """This key names a node below ``path`` (look inside it)."""
        if self.bracketed:
            return self.text.startswith(typed.format_path(path) + "[")
        return not path or self.text.startswith(dotted_name(path) + ".")

    def on_boundary(self, path: tuple) -> bool:
        """The node at ``path`` is this key's node or one of its containers: the key splits
        at ``path``'s container boundaries (not inside one of its dict keys)."""
        if self.bracketed:
            return True
        name = dotted_name(path)
        return name == self.text or self.text.startswith(name + ".")


def dotted_name(path: Sequence[Any]) -> str:
    """A key path joined with dots: ``("model", "enc.weight")`` -> ``model.enc.weight``."""
    return ".".join(str(p) for p in path)


def check_keys(keys: Keys) -> None:
    """Refuse malformed ``keys`` before any I/O or collective (ValueError, as
    :func:`select_state`): an empty sequence, an empty or non-string key."""
    _parse_keys(keys)


def _parse_keys(keys: Keys) -> list[_Key] | None:
    if keys is None:
        return None
    if isinstance(keys, str):
        keys = [keys]
    keys = list(keys)
    if not keys:
        raise ValueError("keys is empty; pass None to load everything")
    out = []
    for k in keys:
        if not isinstance(k, str) or not k.strip() or k in (".", "state"):
            raise ValueError(f"a key must be a non-empty dotted path ('model.encoder') or a "
                             f"bracketed one (\"state['model']\"), got {k!r}")
        out.append(_Key(k, k.startswith("state[")))
    return out


def _children(node: Any) -> Iterator[tuple[Any, Any]] | None:
    if isinstance(node, dict):
        return iter(node.items())
    if isinstance(node, (list, tuple)):
        return iter(enumerate(node))
    if isinstance(node, argparse.Namespace):
        return iter(vars(node).items())
    return None


def _rebuild(node: Any, kept: list[tuple[Any, Any]]) -> Any:
    if isinstance(node, OrderedDict):
        out: Any = OrderedDict(kept)
        meta = getattr(node, "_metadata", None)
        if meta is not None:
            out._metadata = meta
        return out
    if isinstance(node, dict):
        return dict(kept)
    if isinstance(node, argparse.Namespace):
        return argparse.Namespace(**dict(kept))
    if len(kept) == len(node):
        return type(node)(v for _, v in kept)
    return dict(kept)  # a partly selected list or tuple: {index: value}


def _prune(node: Any, path: tuple, keys: list[_Key], matched: set[str]) -> Any:
    taken = [k for k in keys if k.covers(path)]
    if taken:
        matched.update(k.text for k in taken)
        # A key below this node is selected with it: it counts as matched if it names
        # something here (["model", "model.layer.2"]); one naming nothing still fails.
        inner = [k for k in keys if k not in taken and k.below(path)]
        if inner:
            _prune(node, path, inner, matched)
        return node
    if not any(k.below(path) for k in keys):
        return _MISSING
    children = _children(node)
    if children is None:
        return _MISSING
    items = list(children)
    # A key that splits at a container boundary here ("model" and state["model"]) does not
    # also select a sibling whose own dict key merely starts with it (state["model.extra"]).
    split = {k for k in keys if not k.bracketed
             and any(k.on_boundary(path + (part,)) for part, _ in items)}
    kept = []
    for part, child in items:
        p = path + (part,)
        got = _prune(child, p, [k for k in keys if k not in split or k.on_boundary(p)], matched)
        if got is not _MISSING:
            kept.append((part, got))
    return _rebuild(node, kept) if kept else _MISSING


def _names(node: Any, path: tuple = ()) -> Iterator[str]:
    """Dotted names of every node below the root (what a key could have named)."""
    children = _children(node)
    if children is None:
        return
    for part, child in children:
        p = path + (part,)
        yield dotted_name(p)
        yield from _names(child, p)


def _refs(node: Any) -> Iterator[_Ref]:
    if isinstance(node, _Ref):
        yield node
        return
    children = _children(node)
    if children is not None:
        for _, child in children:
            yield from _refs(child)


def select_state(state: Any, keys: Keys, *, where: str = "the checkpoint") -> Any:
    """``state`` pruned to ``keys`` (module docstring); the whole state when ``keys`` is None.

    Pure: no I/O.  ``where`` names the checkpoint in errors.

    Raises:
        UnknownKeyError: a key selects nothing (names it and the closest keys there are).
        ValueError: an empty or malformed key.
    """
    parsed = _parse_keys(keys)
    if parsed is None:
        return state
    matched: set[str] = set()
    out = _prune(state, (), parsed, matched)
    missing = [k.text for k in parsed if k.text not in matched]
    if missing:
        raise _unknown(missing[0], state, where)
    return out


def _unknown(key: str, state: Any, where: str) -> UnknownKeyError:
    names = list(dict.fromkeys(_names(state)))

    def nearness(name: str) -> tuple[int, float]:  # the longest shared start, then similarity
        return (len(os.path.commonprefix([key, name])),
                difflib.SequenceMatcher(None, key, name).ratio())

    closest = tuple(sorted(names, key=nearness, reverse=True)[:_MAX_CLOSEST])
    hint = ", ".join(repr(c) for c in closest) if closest else "none (the state is empty)"
    return UnknownKeyError(
        f"{where}: no key {key!r} in the saved state; closest keys there: {hint}. A key is a "
        "dotted path ('optimizer', 'model.encoder.layer.0') or a bracketed one "
        "(\"state['model']['w']\")", key=key, closest=closest, checkpoint=where)


@dataclass(frozen=True)
class Selection:
    """Which tensors and blobs of one item a set of keys needs.  Made by :func:`select_item`.

    Attributes:
        keys: the keys asked (None: all of the item).
        tensors: indices into ``item.tensors`` of the selected tensors (for a chunked
            item: into the manifest's ``global_tensors``).
        blob_ids: indices into ``item.blobs`` to read (sorted; no blob for empty tensors;
            none for a chunked item).
        nbytes: bytes of those blobs (what a read of them fetches; for a chunked item the
            byte ranges of the selected tensors' chunks).
    """

    keys: tuple[str, ...] | None
    tensors: frozenset[int]
    blob_ids: tuple[int, ...]
    nbytes: int


def select_item(item: Item, keys: Keys, *, where: str = "the checkpoint",
                manifest: Manifest | None = None) -> Selection:
    """The tensors and blobs of ``item`` that ``keys`` select.  Pure: reads no tensor bytes.

    For a chunked item (manifest version 2) ``tensors`` are indices into
    ``manifest.global_tensors``, ``blob_ids`` is empty and ``nbytes`` the bytes of the
    ranges a read of those whole tensors fetches (0 without ``manifest``).

    Raises:
        UnknownKeyError: a key selects nothing.
        ValueError: an empty or malformed key.
    """
    refs = typed.decode(item.state, _Ref)
    chosen = select_state(refs, keys, where=where)
    if item.chunked:
        picked = frozenset(r.index for r in _refs(chosen))
        nbytes = (sum(r.length for r in plan_whole_reads(manifest, sorted(picked)))
                  if manifest is not None else 0)
        return Selection(keys=None if keys is None else tuple([keys] if isinstance(keys, str)
                                                              else keys),
                         tensors=picked, blob_ids=(), nbytes=nbytes)
    if keys is None:
        tensors = frozenset(range(len(item.tensors)))
    else:
        tensors = frozenset(r.index for r in _refs(chosen))
    blob_ids = tuple(sorted({item.tensors[i].blob for i in tensors
                             if 0 <= i < len(item.tensors) and item.tensors[i].numel}))
    return Selection(keys=None if keys is None else tuple([keys] if isinstance(keys, str)
                                                          else keys),
                     tensors=tensors, blob_ids=blob_ids,
                     nbytes=sum(item.blobs[i].length for i in blob_ids))


@dataclass
class PartialResult:
    """What :func:`read_partial` returns.

    Attributes:
        state: the selected part of the item's state (module docstring); tensors on CPU
            unless ``map_location``.
        selection: the :class:`Selection` read.
        bytes_read: bytes fetched from storage (the selected blobs, each once).
        seconds: wall time of the read and rebuild.
    """

    state: Any
    selection: Selection
    bytes_read: int
    seconds: float


def _groups_of(ids: Sequence[int], size: Callable[[int], int],
               step_bytes: int | None) -> Iterable[list[int]]:
    """``ids`` in runs of about ``step_bytes`` bytes (``size(i)`` each); all in one run when
    ``step_bytes`` is None."""
    if step_bytes is None:
        if ids:
            yield list(ids)
        return
    group: list[int] = []
    total = 0
    for i in ids:
        group.append(i)
        total += size(i)
        if total >= step_bytes:
            yield group
            group, total = [], 0
    if group:
        yield group


def read_partial(reader: CheckpointReader, keys: Keys, *, item: str = STATE_ITEM,
                 map_location: MapLocation = None,
                 progress: Progress | None = None) -> PartialResult:
    """Read only what ``keys`` select of item ``item`` through ``reader``.  Any rank.

    Args:
        reader: an open reader of the checkpoint (its manifest already read).
        keys: dotted or bracketed keys (module docstring); a single string is one key;
            None reads the whole item.
        map_location: where tensors go, as :func:`xla_ckpt.load`.
        progress: called with the byte count of each finished group of blobs (about
            :data:`PROGRESS_STEP_BYTES` each), e.g. a CLI progress bar's ``update``.

    Raises:
        UnknownKeyError: a key selects nothing in this checkpoint.
        CheckpointCorruptError / IntegrityError / DataFileMissingError: as
            :meth:`CheckpointReader.read_into` (bytes checked by crc32c as always).
    """
    t0 = time.perf_counter()
    it = reader.manifest.item(item)
    sel = select_item(it, keys, where=reader.storage.uri, manifest=reader.manifest)
    if it.chunked:
        return _read_chunked(reader, it, sel, keys, map_location, progress, t0)
    buffers: dict[int, torch.Tensor] = {}
    read = 0
    for group in _groups_of(sel.blob_ids, lambda i: it.blobs[i].length,
                            PROGRESS_STEP_BYTES if progress is not None else None):
        bufs = reader.allocate(item, group)
        reader.read_into(item, bufs)
        n = sum(b.numel() for b in bufs.values())
        read += n
        buffers.update(bufs)
        if progress is not None:
            progress(n)
    wanted = {id(it.tensors[i]) for i in sel.tensors}
    full = materialize_item(it, buffers, map_location,
                            tensor_filter=None if keys is None else (lambda r: id(r) in wanted))
    state = select_state(full, keys, where=reader.storage.uri)
    dt = time.perf_counter() - t0
    logger.debug("read %d of %d blobs (%d bytes) of %s for keys %s in %.3f s", len(sel.blob_ids),
                 len(it.blobs), read, reader.storage.uri, sel.keys, dt)
    return PartialResult(state=state, selection=sel, bytes_read=read, seconds=dt)


def _read_chunked(reader: CheckpointReader, it: Item, sel: Selection, keys: Keys,
                  map_location: MapLocation, progress: Progress | None,
                  t0: float) -> PartialResult:
    """:func:`read_partial` of a chunked item: the selected global tensors, each whole
    (:meth:`CheckpointReader.assemble`), in groups of about :data:`PROGRESS_STEP_BYTES` when
    ``progress`` is given."""
    gts = reader.manifest.global_tensors
    placed: dict[int, torch.Tensor] = {}
    read = 0
    for group in _groups_of(sorted(sel.tensors), lambda g: nbytes_of(gts[g]),
                            PROGRESS_STEP_BYTES if progress is not None else None):
        placed.update(reader.assemble(group, map_location))
        read += reader.stats.bytes_read
        if progress is not None:
            progress(reader.stats.bytes_read)
    full = typed.decode(it.state, placed.get)
    state = select_state(full, keys, where=reader.storage.uri)
    dt = time.perf_counter() - t0
    logger.debug("read %d of %d global tensors (%d bytes) of %s for keys %s in %.3f s",
                 len(placed), len(gts), read, reader.storage.uri, sel.keys, dt)
    return PartialResult(state=state, selection=sel, bytes_read=read, seconds=dt)


def load_partial(uri: str, keys: Keys, *, map_location: MapLocation = None,
                 config: StorageConfig | None = None, item: str = STATE_ITEM,
                 progress: Progress | None = None) -> Any:
    """Load only ``keys`` of the state saved at ``uri`` (``xla_ckpt.load(uri, keys=...)``).

    ``uri`` is anything :func:`xla_ckpt.load` opens (resolved by the one resolver, read
    again once if replaced meanwhile).  For an xla_ckpt checkpoint only the blobs the
    selected tensors live in are read; other kinds are read whole and then pruned.

    Args:
        keys: dotted (``"model.encoder.layer.0"``, ``"optimizer"``) or bracketed
            (``"state['model']['w']"``) keys; see the module docstring.  None: everything.
        map_location: as :func:`xla_ckpt.load`.
        progress: called with the byte count of each finished group of reads (xla_ckpt
            checkpoints only).

    Returns:
        The selected part of the state, structure kept (module docstring).

    Raises:
        UnknownKeyError: a key selects nothing (names it and the closest keys).
        Whatever :func:`xla_ckpt.load` raises (nothing committed, corrupt, replaced twice).
    """
    _parse_keys(keys)  # a malformed key fails before any I/O

    def read(resolved: Resolved) -> Any:
        if resolved.kind != XLA_CKPT or resolved.manifest is None:
            state = read_items(resolved, item, map_location=map_location, config=config)[item]
            return select_state(state, keys, where=resolved.checkpoint)
        reader = open_reader(resolved, config)
        try:
            return read_partial(reader, keys, item=item, map_location=map_location,
                                progress=progress).state
        finally:
            reader.storage.close()

    return read_checkpoint(uri, read, config=config)
