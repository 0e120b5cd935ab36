"""Legacy files by URI: fetch a ``.pt`` / ``.safetensors`` object and import it safely.

The format work (allow-listed unpickling, fairseq upgrade, hostile-input
bounds) is :mod:`xla_ckpt.format.legacy`; this module only gets the bytes:
a local file is opened and read by ``torch.load`` directly, a ``gs://``
object is fetched with parallel byte-range reads through :mod:`xla_ckpt.storage`.

For the trainer restore::

    if is_legacy_file(uri):
        state = load_legacy_checkpoint(uri)      # fairseq layout, CPU tensors
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import os
import time
from typing import Any, Callable, Iterator

from xla_ckpt.errors import CheckpointCorruptError, CheckpointNotFoundError
from xla_ckpt.format.legacy import Layout, LegacyFile, load_legacy, sniff_format
from xla_ckpt.storage import Storage, StorageConfig, StorageURI, open_storage, parse_uri

logger = logging.getLogger(__name__)

Progress = Callable[[int], object]  # called with a byte count; what it returns is ignored


def split_uri(uri: str) -> tuple[str, str]:
    """``(folder URI, object name)`` of a file URI.

    ``gs://b/run/x.pt`` -> ``("gs://b/run", "x.pt")``; ``/data/x.pt`` -> ``("/data", "x.pt")``.
    """
    target = parse_uri(uri)
    if target.is_gcs:
        if not target.path:
            raise CheckpointNotFoundError(f"{uri}: names a bucket, not an object")
        folder, _, name = target.path.rpartition("/")
        return str(StorageURI("gs", target.bucket, folder)), name
    path = _local_path(uri)
    return os.path.dirname(path) or ".", os.path.basename(path)


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


def is_legacy_file(uri: str, *, config: StorageConfig | None = None) -> bool:
    """True if ``uri`` names one object that is a torch.save/fairseq ``.pt`` or safetensors file.

    An xla_ckpt checkpoint is a folder, so a URI naming one object is never one.
    Reads at most 16 bytes.
    """
    try:
        folder, name = split_uri(uri)
    except CheckpointNotFoundError:
        return False
    if parse_uri(uri).is_local and not os.path.isfile(_local_path(uri)):
        return False
    storage = open_storage(folder, config)
    try:
        info = storage.stat(name)
        prefix = bytearray(min(16, info.size))
        if prefix:
            storage.read_range(name, 0, memoryview(prefix), info.generation)
        sniff_format(bytes(prefix), where=uri)
        return True
    except (CheckpointNotFoundError, CheckpointCorruptError):
        return False
    finally:
        storage.close()


def load_legacy_file(uri: str, *, layout: Layout = "auto", keep_numpy_scalars: bool = False,
                     unsafe_trust_pickle: bool = False, config: StorageConfig | None = None,
                     progress: Progress | None = None) -> LegacyFile:
    """Fetch and import the legacy file at ``uri``; see :func:`xla_ckpt.format.legacy.load_legacy`.

    Raises:
        CheckpointNotFoundError: no such object.
        UnsafePickleError / CheckpointCorruptError / MetaTensorError: as ``load_legacy``.
    """
    with open_legacy_source(uri, config=config, progress=progress) as src:
        return load_legacy(src, where=uri, layout=layout, keep_numpy_scalars=keep_numpy_scalars,
                           unsafe_trust_pickle=unsafe_trust_pickle)


def load_legacy_checkpoint(uri: str, *, config: StorageConfig | None = None) -> Any:
    """The state of the legacy fairseq/``torch.save`` ``.pt`` at ``uri``, for the trainer restore.

    A fairseq file comes back upgraded to the current fairseq layout (``model``,
    ``optimizer_history``, ``last_optimizer_state``, ``extra_state`` with
    ``train_iterator``, ``args``/``cfg``); CPU tensors; numpy scalars as Python
    numbers.  Called by any rank that reads storage (every rank on TPU, rank 0
    on the broadcast path).

    Raises:
        CheckpointNotFoundError: no such object.
        UnsafePickleError: the file names a class outside the allow-list.
        CheckpointCorruptError: malformed, truncated or hostile file.
    """
    return load_legacy_file(uri, config=config).state
