"""Read checkpoints: :class:`CheckpointReader` assembles an item's state from its blobs or chunks.

:class:`CheckpointReader` is what every restore strategy uses on the rank(s)
that touch storage: a :class:`~xla_ckpt.io.blob_reader.BlobReader` (byte-range
reads planned across blobs by :mod:`xla_ckpt.io.planning`, crc32c on every byte,
into buffers of :mod:`xla_ckpt.io.buffers`) plus item assembly:
:meth:`~CheckpointReader.load` rebuilds one item's state, reading blobs into fresh
arenas, straight into existing CPU tensors (``into``, :func:`in_place_buffers`)
or as checked views of private maps of local data files (``mmap``); a chunked
item (manifest version 2) is assembled from its chunks by
:func:`xla_ckpt.io.chunked.read_boxes`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Sequence

import torch

from xla_ckpt.errors import (
    ConfigError,
    IntegrityError,
    PartiallyOverwrittenError,
    StateMismatchError,
)
from xla_ckpt.format import typed
from xla_ckpt.format.crc import crc32c
from xla_ckpt.format.dtypes import dtype_name
from xla_ckpt.format.gc_pause import gc_paused
from xla_ckpt.format.manifest import STATE_ITEM, Item
from xla_ckpt.format.plan import MapLocation, materialize_item, resolve_device
from xla_ckpt.io.blob_reader import BlobReader
from xla_ckpt.io.buffers import bump_versions, fits_box, host_arenas, in_place_buffers
from xla_ckpt.io.chunked import BoxRequest, read_boxes, whole_tensor_request
from xla_ckpt.io.planning import Span, plan_spans
from xla_ckpt.storage import StorageConfig, open_storage
from xla_ckpt.storage.local import LocalStorage

logger = logging.getLogger(__name__)


class CheckpointReader(BlobReader):
    """Reads one committed checkpoint folder.  Any rank may use one.

    Args:
        storage: storage rooted at the checkpoint folder.
        manifest: an already-read manifest (e.g. received from rank 0); read
            from storage when None.
        crc_retries: re-reads of a slice whose crc32c mismatches before
            :class:`IntegrityError`.
    """

    @classmethod
    def open(cls, uri: str, config: StorageConfig | None = None) -> "CheckpointReader":
        return cls(open_storage(uri, config))

    @property
    def metadata(self) -> Any:
        """The typed-decoded ``metadata`` summary the saver passed."""
        m = self.manifest.metadata
        return typed.decode(m) if m is not None else None

    @gc_paused()  # many small objects, no cycles (CASES C26)
    def load(self, item_name: str = STATE_ITEM, map_location: MapLocation = None, *,
             into: Mapping[str, torch.Tensor] | None = None, mmap: bool = False) -> Any:
        """Read and rebuild one item's state (CPU tensors unless ``map_location``).

        ``mmap`` (local storage only; ignored elsewhere): the CPU tensors are
        views of private memory maps of the data files instead of fresh copies
        (as ``torch.load(mmap=True)``), every byte crc32c-checked before this
        returns; writing a tensor copies its pages and never touches the file.
        No copy and no fresh memory is made, but the bytes stay tied to the
        files: a process that writes a data file in place changes the tensors,
        and one that truncates it makes touching them raise ``SIGBUS``
        (xla_ckpt never writes a data file in place; it writes a new one and
        renames).  A blob that fails its check is read again the ordinary way
        (re-reads, then :class:`IntegrityError`).

        ``into``: tensors that already exist, by tensor key (the manifest's
        ``TensorRecord.key``, e.g. ``state['model']['fc.weight']``; see
        :func:`in_place_buffers`).  A blob whose tensors all have a target of
        the saved dtype, shape and strides on CPU, covering the blob exactly, is
        read straight into the targets' memory (no fresh buffer, no copy); the
        returned state then holds views of that memory.  Every other tensor
        (other devices, another dtype, tensor subclasses, targets sharing memory
        with another blob's targets) is read into fresh buffers as without
        ``into`` (and all of them when ``map_location`` is given).  The caller
        checks keys, shapes and dtypes before calling
        (:func:`xla_ckpt.trainer.module_load.in_place_targets` does for a
        module); the autograd version counter of every target filled is bumped.

        A chunked item (manifest version 2: sharded state saved by its owners) comes back
        with every global tensor assembled whole on CPU from its chunks
        (:func:`xla_ckpt.io.chunked.read_boxes`: crc32c-checked in staging buffers, then
        copied), then placed as ``map_location`` says; ``into`` is then keyed by global
        tensor key (the same tree path) and every target is filled in place and returned
        as the leaf: a plain CPU tensor of the saved dtype and shape whose elements fill
        their memory once (any order of strides) directly, any other plain tensor of the
        saved dtype and shape (stepped slices, other devices) through a checked staging
        copy; a target the item lacks, or of another dtype or shape, or a tensor subclass,
        raises instead (never a stale target); ``mmap`` does not apply.  What DCP's
        ``dcp_to_torch_save`` gives, without a second copy.

        Raises:
            StateMismatchError: chunked item: an ``into`` key that is not one of its
                tensors, or a target of another dtype or shape, or a tensor subclass
                (names the key); before anything is read.
            ConfigError: chunked item: ``into`` together with ``map_location``.
            PartiallyOverwrittenError: a crc32c failure after the re-reads in the bytes
                of a target (its key is named; the target holds unchecked bytes).
            IntegrityError / CheckpointCorruptError: as :meth:`read_into`.
        """
        item = self.manifest.item(item_name)
        if item.chunked:
            return self._load_chunked(item, map_location, into)
        live = in_place_buffers(item, into) if into and map_location is None else {}
        self.check_files({b.file for b in item.blobs})
        rest = [i for i in range(len(item.blobs)) if i not in live]
        bufs: dict[int, torch.Tensor] = {}
        if mmap and isinstance(self.storage, LocalStorage):
            bufs.update(self._mapped(item, rest))
            rest = [i for i in rest if i not in bufs]
        bufs.update(host_arenas(item, rest))
        bufs.update(live)
        unread = set(rest) | set(live)
        self.read_into(item_name, {i: b for i, b in bufs.items() if i in unread}, live=live)
        if live and into:
            bump_versions([into[t.key] for t in item.tensors if t.blob in live])
        return materialize_item(item, bufs, map_location)

    def read_boxes(self, requests: Sequence[BoxRequest]) -> int:
        """Fill boxes of global (chunked) tensors; returns the bytes fetched (``self.stats``).

        :func:`xla_ckpt.io.chunked.read_boxes` with this reader: each request's ``out``
        (a CPU tensor of the box's shape and the global dtype) gets the saved elements of
        its box, fetched by byte range (row sub-ranges of saved chunks), every byte
        crc32c-checked in a staging buffer before it lands in ``out``.

        Raises:
            ValueError / CheckpointCorruptError / IntegrityError: as
                :func:`~xla_ckpt.io.chunked.read_boxes`.
        """
        return read_boxes(self, requests)

    def _load_chunked(self, item: Item, map_location: MapLocation,
                      into: Mapping[str, torch.Tensor] | None) -> Any:
        """:meth:`load` of a chunked item: every global tensor it refers to, assembled whole.

        ``into`` is keyed by global tensor key; every target is filled in place (a plain
        CPU tensor of the saved dtype and shape whose elements fill their memory once
        directly, any other plain tensor of that dtype and shape through a checked staging
        copy) and returned as its leaf; the other tensors get fresh ones.

        Raises:
            StateMismatchError: an ``into`` key the item lacks, another dtype or shape, or
                a tensor subclass (names the key); before anything is read.
            ConfigError: ``into`` together with ``map_location``.
        """
        refs: set[int] = set()
        typed.decode(item.state, refs.add)
        placed = self.assemble(sorted(refs), map_location, into=into)
        return typed.decode(item.state, placed.__getitem__)

    def assemble(self, tensors: Sequence[int], map_location: MapLocation = None, *,
                 into: Mapping[str, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
        """Global tensors ``tensors`` (indices into ``manifest.global_tensors``), each whole.

        Every one is one whole-tensor request of :func:`~xla_ckpt.io.chunked.read_boxes`
        (only its chunks' bytes are read, crc32c-checked), then placed as ``map_location``
        says; ``into`` (by global tensor key) as for :meth:`load` of a chunked item.
        ``self.stats`` then says what the read did (``bytes_read``: bytes fetched).

        Returns:
            Global tensor index -> its tensor (the ``into`` target where one was given).

        Raises:
            StateMismatchError / ConfigError / IntegrityError / PartiallyOverwrittenError:
                as :meth:`load` of a chunked item.
        """
        gts = self.manifest.global_tensors
        if into and map_location is not None:
            raise ConfigError("CheckpointReader.load: into= targets keep their own devices; "
                              "pass into= or map_location=, not both")
        _check_chunked_targets(into or {}, {gts[g].key: gts[g] for g in tensors})
        requests = []
        live: list[torch.Tensor] = []
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target, checked staging)
        for g in tensors:
            gt = gts[g]
            target = into.get(gt.key) if into else None
            if target is not None and fits_box(target, gt.dtype, gt.shape):
                live.append(target)
                requests.append(whole_tensor_request(self.manifest, g, target))
            else:
                requests.append(whole_tensor_request(self.manifest, g))
                if target is not None:
                    staged.append((target, requests[-1].out))
        try:
            read_boxes(self, requests)
        except PartiallyOverwrittenError:
            raise  # names the into= targets holding unchecked bytes
        except IntegrityError as e:
            if not live:
                raise
            raise IntegrityError(
                f"{e} (targets given in into= may already hold some of the checkpoint's "
                "values, checked ones only: restore again or re-initialise them)",
                path=e.path, key=e.key) from e
        with torch.no_grad():
            for target, checked in staged:
                target.copy_(checked)
        staged_out = {id(checked): target for target, checked in staged}
        bump_versions(live)
        placed: dict[int, torch.Tensor] = {}
        for req in requests:
            if id(req.out) in staged_out:
                placed[req.tensor] = staged_out[id(req.out)]
                continue
            dev = resolve_device(map_location, gts[req.tensor].key)
            placed[req.tensor] = req.out if dev is None or dev.type == "cpu" else req.out.to(dev)
        return placed

    def _mapped(self, item: Item, blob_ids: Sequence[int]) -> dict[int, torch.Tensor]:
        """Blobs as checked views of private maps of their data files; failed ones left out."""
        storage = self.storage
        assert isinstance(storage, LocalStorage)
        t0 = time.perf_counter()
        bufs: dict[int, torch.Tensor] = {}
        for name in sorted({item.blobs[i].file for i in blob_ids if item.blobs[i].length}):
            base = torch.frombuffer(storage.map_private(name, self.manifest.files[name]),
                                    dtype=torch.uint8)
            for i in blob_ids:
                rec = item.blobs[i]
                if rec.file == name and rec.length:
                    bufs[i] = base[rec.offset:rec.offset + rec.length]
        bad: set[int] = set()
        step = self.storage.config.slice_size_bytes

        def check(span: Span) -> None:
            assert span.out is not None  # spans of one map are always in place
            for p in span.pieces:
                at = p.file_offset - span.offset
                if crc32c(span.out[at:at + p.length]) != p.crc32c:
                    bad.add(p.blob_id)

        self._run([(sp,) for sp in plan_spans(item, bufs, step)], fn=check)
        if bad:
            logger.warning("crc32c mismatch in the mapped bytes of %d blob(s) of %s; reading "
                           "them again", len(bad), self.storage.uri)
        self.stats.seconds += time.perf_counter() - t0
        return {i: b for i, b in bufs.items() if i not in bad}


def _check_chunked_targets(into: Mapping[str, Any], saved: Mapping[str, Any]) -> None:
    """Every ``into`` target of a chunked load names one of the item's global tensors
    (``saved``: key -> GlobalTensor) and has its dtype and shape, as a plain tensor.

    Raises:
        StateMismatchError: the first few that do not (names the keys, what to do).
    """
    bad = []
    for key, t in into.items():
        gt = saved.get(key)
        if gt is None:
            bad.append(f"{key} is not a tensor of this item (keys look like "
                       f"{next(iter(saved), 'state[...]')})")
        elif not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor,
                                                                 torch.nn.Parameter):
            bad.append(f"{key} is a {type(t).__name__}, not a plain tensor (restore sharded "
                       "targets with xla_ckpt.restore.restore(uri, into=...))")
        elif dtype_name(t.dtype) != gt.dtype or tuple(t.shape) != tuple(gt.shape):
            bad.append(f"{key} is {gt.dtype}{list(gt.shape)} in the checkpoint but "
                       f"{dtype_name(t.dtype)}{list(t.shape)} in the target")
    if bad:
        more = f"; ... ({len(bad) - 8} more)" if len(bad) > 8 else ""
        raise StateMismatchError(
            f"CheckpointReader.load(into=...): {'; '.join(bad[:8])}{more}. Pass targets of the "
            "saved keys, dtypes and shapes (or leave a tensor out of into= to get a fresh "
            "one); nothing was read")


