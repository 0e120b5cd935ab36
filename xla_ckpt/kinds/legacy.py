"""Legacy files by URI: fetch a ``.pt`` / ``.safetensors`` object and import it safely.

The format work (allow-listed unpickling, fairseq upgrade, hostile-input
bounds) is :mod:`xla_ckpt.format.legacy`; this module only gets the bytes:
a local file is opened and read by ``torch.load`` directly, a ``gs://``
object is fetched with parallel byte-range reads through :mod:`xla_ckpt.storage`.
:func:`convert_legacy_run` converts a whole fairseq run folder (its
``checkpoint_last.pt`` / ``checkpoint_best.pt`` copies become pointers).

For the trainer restore::

    if is_legacy_file(uri):
        state = load_legacy_checkpoint(uri)      # a fairseq file in its current layout
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from xla_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConfigError,
    OutputExistsError,
)
from xla_ckpt.format import typed
from xla_ckpt.format.crc import crc32c
from xla_ckpt.format.legacy import (
    Layout,
    LegacyFile,
    load_legacy,
    upgrade_fairseq_state,
)
from xla_ckpt.format.manifest import MANIFEST_NAME
from xla_ckpt.io.manifest_file import read_manifest
from xla_ckpt.io.writer import write_checkpoint
from xla_ckpt.run.catalog import pointer_name, read_pointer, write_pointer
from xla_ckpt.run.resolve import resolve
from xla_ckpt.run.sniff import destination_holds
from xla_ckpt.storage import Storage, StorageConfig, open_storage, parse_uri
from xla_ckpt.storage.base import ObjectInfo
from xla_ckpt.storage.local import LocalStorage
from xla_ckpt.storage.uri import split_uri

logger = logging.getLogger(__name__)

Progress = Callable[[int], object]  # called with a byte count; what it returns is ignored


def _local_path(uri: str) -> str:
    return os.path.abspath(os.path.expanduser(parse_uri(uri).path))


def read_object(uri: str, *, config: StorageConfig | None = None,
                progress: Progress | None = None) -> bytearray:
    """The whole object at ``uri`` (local or ``gs://``), read in parallel byte ranges.

    The slices land straight in one preallocated buffer (no second copy).

    Args:
        progress: called with the number of bytes of each finished slice.

    Raises:
        CheckpointNotFoundError: no such object.
        StorageError: the backend failed after its retries.
    """
    folder, name = split_uri(uri)
    storage = open_storage(folder, config)
    try:
        return _read_all(storage, name, progress)
    finally:
        storage.close()


def _read_all(storage: Storage, name: str, progress: Progress | None) -> bytearray:
    info = storage.stat(name)
    buf = bytearray(info.size)
    view = memoryview(buf)
    step = storage.config.slice_size_bytes
    slices = [(start, view[start:start + step]) for start in range(0, info.size, step)]

    def one(start: int, out: memoryview) -> int:
        storage.read_range(name, start, out, info.generation)
        return len(out)

    t0 = time.perf_counter()
    if len(slices) <= 1:
        for s in slices:
            n = one(*s)
            if progress:
                progress(n)
    else:
        pool = storage._executor()
        futures = [pool.submit(one, *s) for s in slices]
        try:
            for f in cf.as_completed(futures):
                n = f.result()
                if progress:
                    progress(n)
        except BaseException:
            for f in futures:
                f.cancel()
            cf.wait(futures)
            raise
    dt = time.perf_counter() - t0
    logger.debug("read %s (%d bytes) in %.3f s (%.1f MiB/s)", storage.url(name), info.size, dt,
                 info.size / max(dt, 1e-9) / 2**20)
    return buf


@contextlib.contextmanager
def open_legacy_source(uri: str, *, config: StorageConfig | None = None,
                       progress: Progress | None = None) -> Iterator[Any]:
    """A binary file object (local) or the bytes (``gs://``) of the object at ``uri``."""
    if parse_uri(uri).is_gcs:
        yield read_object(uri, config=config, progress=progress)
        return
    path = _local_path(uri)
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"{path}: no such file")
    with open(path, "rb") as f:
        if progress:
            progress(os.fstat(f.fileno()).st_size)
        yield f


def is_single_object(uri: str, *, config: StorageConfig | None = None) -> bool:
    """True if ``uri`` names one existing object (a local file, a ``gs://`` object)."""
    if parse_uri(uri).is_local:
        return os.path.isfile(_local_path(uri))
    try:
        folder, name = split_uri(uri)
    except CheckpointNotFoundError:
        return False
    with open_storage(folder, config) as st:
        return st.exists(name)


_FAIRSEQ_PART = re.compile(r"-(?:shard\d+|model_part-\d+|rank-\d+)(?=-|\.pt$)")


def fairseq_part_files(names: list[str]) -> list[str]:
    """The names that are one rank's part of a fairseq checkpoint, not a whole checkpoint.

    fairseq writes FSDP (``--ddp-backend fully_sharded`` without
    ``--use-sharded-state`` consolidation) and model-parallel checkpoints as one file per
    rank: ``checkpoint_last-shard0.pt``, ``checkpoint5-model_part-1.pt``,
    ``checkpoint_2_500-rank-3.pt`` (``checkpoint_suffix`` in fairseq's
    ``checkpoint_utils``); each holds only its rank's slice of the model and optimizer.
    """
    return sorted(n for n in names
                  if n.endswith(".pt") and _FAIRSEQ_PART.search(os.path.basename(n)))


def _refuse_parts(parts: list[str], where: str) -> None:
    if parts:
        shown = ", ".join(parts[:5]) + (", ..." if len(parts) > 5 else "")
        raise ConfigError(
            f"{where}: {shown} {'are' if len(parts) > 1 else 'is'} one rank's part of a "
            "sharded fairseq checkpoint (FSDP -shardN / model-parallel -model_part-N / "
            "-rank-N), not a whole checkpoint; merge the parts first (for FSDP, fairseq's "
            "consolidate_fsdp_shards in fairseq/distributed/fully_sharded_data_parallel.py) "
            "and convert the merged .pt")


def load_legacy_file(uri: str, *, layout: Layout = "auto", keep_numpy_scalars: bool = False,
                     unsafe_trust_pickle: bool = False, config: StorageConfig | None = None,
                     progress: Progress | None = None) -> LegacyFile:
    """Fetch and import the legacy file at ``uri``; see :func:`xla_ckpt.format.legacy.load_legacy`.

    Raises:
        CheckpointNotFoundError: no such object.
        ConfigError: the file is one rank's part of a sharded fairseq checkpoint
            (:func:`fairseq_part_files`).
        UnsafePickleError / CheckpointCorruptError / MetaTensorError: as ``load_legacy``.
    """
    _refuse_parts(fairseq_part_files([uri.rstrip("/").rsplit("/", 1)[-1]]), uri)
    with open_legacy_source(uri, config=config, progress=progress) as src:
        return load_legacy(src, where=uri, layout=layout, keep_numpy_scalars=keep_numpy_scalars,
                           unsafe_trust_pickle=unsafe_trust_pickle)


def load_legacy_checkpoint(uri: str, *, config: StorageConfig | None = None) -> Any:
    """The state of the legacy fairseq/``torch.save`` ``.pt`` at ``uri``, for the trainer restore.

    A fairseq file (recognised by fairseq's own fields,
    :func:`~xla_ckpt.format.legacy.fairseq_vintage`) comes back in the current fairseq
    layout (``model``, ``optimizer_history``, ``last_optimizer_state``, ``extra_state``
    with ``train_iterator``; an old one upgraded, each change logged at WARNING); any
    other file exactly as saved.  CPU tensors; numpy scalars as Python numbers.  Called by
    any rank that reads storage (every rank on TPU, rank 0 on the broadcast path).

    Raises:
        CheckpointNotFoundError: no such object.
        UnsafePickleError: the file names a class outside the allow-list.
        CheckpointCorruptError: malformed, truncated or hostile file.
    """
    legacy = load_legacy_file(uri, config=config)
    if not legacy.fairseq:
        return legacy.state
    state, changes = upgrade_fairseq_state(legacy.state, where=uri)
    for change in changes:
        logger.warning("%s: fairseq upgrade for the trainer restore: %s", uri, change)
    return state


# ---- a whole fairseq run folder ---------------------------------------------------------------

FAIRSEQ_POINTERS = {"checkpoint_last.pt": "last", "checkpoint_best.pt": "best"}
"""The fairseq files that are (byte-)copies of another checkpoint, and the pointer each becomes."""


@dataclass
class ConvertedFile:
    """One ``.pt`` of a converted run folder.

    Attributes:
        source: its name in the source run folder (``checkpoint_2_500.pt``).
        size: its size in bytes.
        crc32c: crc32c of its bytes.
        checkpoint: the checkpoint folder holding its state in the destination run folder.
        copy_of: the source file with the same bytes that was converted instead (None: this
            one was converted).
        skipped: already converted there earlier (same source name, size and crc32c).
        num_updates / epoch: from its fairseq state (None when not fairseq).
    """

    source: str
    size: int
    crc32c: int = 0
    checkpoint: str = ""
    copy_of: str | None = None
    skipped: bool = False
    num_updates: int | None = None
    epoch: int | None = None


@dataclass
class RunConversion:
    """What :func:`convert_legacy_run` did.

    Attributes:
        src / dst: the run folders.
        files: every ``.pt`` of ``src``, in the order converted.
        pointers: ``{"last" | "best": checkpoint folder}`` written in ``dst``.
        latest: the checkpoint ``xla_ckpt.load(dst)`` now resolves to.
        nbytes: tensor bytes written.
    """

    src: str
    dst: str
    files: list[ConvertedFile] = field(default_factory=list)
    pointers: dict[str, str] = field(default_factory=dict)
    latest: str = ""
    nbytes: int = 0


def legacy_run_files(src: Storage) -> list[str]:
    """Names of the ``.pt`` files at the top of the folder ``src`` ([] for a single object)."""
    if isinstance(src, LocalStorage) and not os.path.isdir(src.root):
        return []
    return [n for n in src.list("") if "/" not in n and n.endswith(".pt")]


def object_crc32c(storage: Storage, name: str, info: ObjectInfo | None = None) -> int:
    """crc32c of object ``name``, read in ``slice_size_bytes`` slices of one generation."""
    info = info or storage.stat(name)
    step = storage.config.slice_size_bytes
    buf = bytearray(min(step, info.size))
    crc = 0
    for start in range(0, info.size, step):
        view = memoryview(buf)[:min(step, info.size - start)]
        storage.read_range(name, start, view, info.generation)
        crc = crc32c(view, crc)
    return crc


def _folder_name(name: str) -> str:
    return name[:-len(".pt")] if name.endswith(".pt") else name


def convert_legacy_run(src: str, dst: str, *, layout: Layout = "auto",
                       keep_numpy_scalars: bool = False, unsafe_trust_pickle: bool = False,
                       overwrite: bool = False, config: StorageConfig | None = None,
                       progress: Progress | None = None) -> RunConversion:
    """Convert a fairseq run folder (``checkpoint1.pt``, ``checkpoint_2_500.pt``,
    ``checkpoint_last.pt``, ``checkpoint_best.pt``, ...) into an xla_ckpt run folder.

    Each distinct ``.pt`` (by size and crc32c) is converted once, into the folder named
    after it (``checkpoint_2_500.pt`` -> ``checkpoint_2_500``).  fairseq writes
    ``checkpoint_last.pt`` / ``checkpoint_best.pt`` as byte copies of the checkpoint just
    saved: a copy becomes the ``checkpoint_last`` / ``checkpoint_best`` pointer to that
    checkpoint (:func:`xla_ckpt.run.catalog.write_pointer`, the manager's format); one that
    is a copy of nothing (``--no-epoch-checkpoints`` runs, rotated epochs) is converted as
    its own checkpoint ``checkpoint_<epoch>_<num_updates>`` (``checkpoint_last_pt`` when
    that is taken or unknown) and pointed at.  Pointers are written after every
    checkpoint has committed, so ``xla_ckpt.load(dst)`` and
    ``CheckpointManager.restore_or_initialize`` pick what fairseq would (``checkpoint_last``):
    the pointers record ``converted_from`` and no lease epoch, and the resolver follows such
    a ``checkpoint_last`` even where a converted checkpoint records more updates (the stale
    branch of a run restarted from an earlier checkpoint;
    :func:`xla_ckpt.run.catalog.choose_latest`).  Parts of a sharded fairseq
    checkpoint (:func:`fairseq_part_files`) are refused before anything is read.
    ``dst`` may be ``src`` itself (the ``.pt`` files are left alone).  Running it again
    skips checkpoints already converted from the same bytes (resumable).

    Raises:
        CheckpointNotFoundError: ``src`` holds no ``.pt`` files.
        ConfigError: ``src`` holds parts of a sharded fairseq checkpoint
            (:func:`fairseq_part_files`; named).
        OutputExistsError: a destination checkpoint folder (or a pointer naming another
            checkpoint) exists from something else and not ``overwrite``; ``dst`` holds a
            checkpoint at its top (an xla_ckpt manifest, DCP ``.metadata``, HF weights).
        UnsafePickleError / CheckpointCorruptError: as :func:`load_legacy_file` (names the file).
    """

    report = RunConversion(src=src, dst=dst)
    with open_storage(src, config) as src_st, open_storage(dst, config) as dst_st:
        names = legacy_run_files(src_st)
        if not names:
            raise CheckpointNotFoundError(f"{src_st.uri}: no .pt files at the top of this "
                                          "folder; nothing to convert")
        _refuse_parts(fairseq_part_files(names), src_st.uri)
        held = destination_holds(dst_st.uri, config)
        if held is not None and held[0] != "run":
            raise OutputExistsError(
                f"{dst_st.uri} holds {held[1]} at its top, and a run folder conversion writes "
                "checkpoint folders and pointers beside it (it would be shadowed); choose "
                "another DST")
        infos = {n: src_st.stat(n) for n in names}
        files = {n: ConvertedFile(n, infos[n].size, object_crc32c(src_st, n, infos[n]))
                 for n in names}
        # Representatives: a regular checkpoint first, then checkpoint_last, then _best.
        rank = {"checkpoint_last.pt": 1, "checkpoint_best.pt": 2}
        ordered = sorted(names, key=lambda n: (rank.get(n, 0), _natural(n)))
        first: dict[tuple[int, int], str] = {}
        for n in ordered:
            key = (files[n].size, files[n].crc32c)
            if key in first:
                files[n].copy_of = first[key]
            else:
                first[key] = n
        used = {_folder_name(n) for n in ordered if n not in FAIRSEQ_POINTERS}
        pointers = [n for n in FAIRSEQ_POINTERS if n in files]
        for n in ordered:
            f = files[n]
            if f.copy_of is not None:
                continue
            uri = src_st.url(n)
            target = _folder_name(n) if n not in FAIRSEQ_POINTERS else ""
            done = _converted_before(dst_st, target, f, uri) if target else None
            if done is not None:
                f.checkpoint, f.skipped = target, True
                f.num_updates, f.epoch = done.get("num_updates"), done.get("epoch")
                continue
            legacy = load_legacy_file(uri, layout=layout, keep_numpy_scalars=keep_numpy_scalars,
                                      unsafe_trust_pickle=unsafe_trust_pickle, config=config,
                                      progress=progress)
            md = dict(legacy.metadata)
            f.num_updates, f.epoch = md.get("num_updates"), md.get("epoch")
            if not target:
                target = f"checkpoint_{f.epoch}_{f.num_updates}" \
                    if f.epoch is not None and f.num_updates is not None else ""
                if not target or target in used:
                    target = _folder_name(n) + "_pt"
                done = _converted_before(dst_st, target, f, uri)
                if done is not None:
                    f.checkpoint, f.skipped = target, True
                    continue
            used.add(target)
            with dst_st.child(target) as ck:
                if ck.exists(MANIFEST_NAME) and not overwrite:
                    raise OutputExistsError(f"{ck.uri} already holds a committed checkpoint "
                                            f"(not converted from {uri}); pass --overwrite to "
                                            "replace it")
            md.update(converted_from=uri, source_size_bytes=f.size, source_crc32c=f.crc32c)
            with dst_st.child(target) as ck:
                manifest = write_checkpoint(legacy.state, ck.uri, metadata=md, storage=ck)
            report.nbytes += manifest.nbytes
            f.checkpoint = target
            del legacy
        for n in ordered:
            copy_of = files[n].copy_of
            if copy_of is not None:
                orig = files[copy_of]
                files[n].checkpoint = orig.checkpoint
                files[n].num_updates, files[n].epoch = orig.num_updates, orig.epoch
        if not overwrite:  # a pointer naming what it would name anyway is fine (a rerun)
            for n in pointers:
                w = FAIRSEQ_POINTERS[n]
                there = read_pointer(dst_st, w)
                if dst_st.exists(pointer_name(w)) and there != files[n].checkpoint:
                    raise OutputExistsError(
                        f"{dst_st.url(pointer_name(w))} already exists and names {there!r}, "
                        f"not {files[n].checkpoint!r} (what {n} holds); pass --overwrite to "
                        "move it")
        for n in pointers:
            f = files[n]
            which = FAIRSEQ_POINTERS[n]
            extra: dict[str, Any] = {"converted_from": src_st.url(n)}
            if f.epoch is not None:
                extra["epoch"] = f.epoch
            if which == "best":
                with dst_st.child(f.checkpoint) as ck:
                    md = typed.decode(read_manifest(ck).metadata or {"$d": []}) \
                        if ck.exists(MANIFEST_NAME) else {}
                loss = md.get("loss") if isinstance(md, dict) else None
                if isinstance(loss, float):
                    extra.update(metric="loss", value=loss)
            write_pointer(dst_st, which, f.checkpoint, num_updates=f.num_updates, **extra)
            report.pointers[which] = f.checkpoint
        report.files = [files[n] for n in ordered]
        report.latest = resolve(dst_st).name
    if "last" in report.pointers and report.latest != report.pointers["last"]:
        logger.warning("%s: xla_ckpt.load picks %s, not %s (what checkpoint_last.pt held): it "
                       "records more updates", dst, report.latest, report.pointers["last"])
    return report


def _converted_before(dst: Storage, name: str, f: ConvertedFile, uri: str) -> dict | None:
    """The metadata of ``dst/name`` if it was converted from these very bytes; else None."""

    with dst.child(name) as ck:
        if not ck.exists(MANIFEST_NAME):
            return None
        try:
            m = read_manifest(ck)
        except (CheckpointCorruptError, CheckpointNotFoundError):
            return None
    md = typed.decode(m.metadata) if m.metadata is not None else None
    if isinstance(md, dict) and md.get("source_crc32c") == f.crc32c and \
            md.get("source_size_bytes") == f.size and \
            str(md.get("converted_from", "")).rsplit("/", 1)[-1] == f.source:
        return md
    return None


def _natural(name: str) -> list:
    """Sort key putting ``checkpoint2`` before ``checkpoint10``."""

    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
