"""Host memory for reads: huge-page buffers, arenas laid out like a data file, live targets.

Fresh buffers are views into a few host arenas laid out like the data file
(:func:`host_arenas`), backed by transparent huge pages where the kernel offers
them (:func:`host_buffer`): one page fault per 2 MiB instead of per 4 KiB, which
was most of the cost of reading into fresh memory here; :func:`prefault` faults
a range in with one call.  :func:`in_place_buffers` finds the blobs that can be
read straight into existing CPU tensors (a trainer's live parameters).  One I/O
thread pool per worker count serves every reader of the process
(:func:`shared_pool`).  Nothing here reads storage.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import logging
import mmap
import os
import sys
import threading
from typing import Callable, Iterable, Mapping, Sequence

import torch

from xla_ckpt.format.dtypes import dtype_from_name, dtype_name, itemsize
from xla_ckpt.format.manifest import Item, TensorRecord

logger = logging.getLogger(__name__)

ARENA_MAX_BYTES = 24 * 1024 * 1024
"""Adjacent blobs share one host arena up to this many bytes (a single blob may be larger): the
most memory a tensor the caller keeps can hold alive beyond its own bytes.  Below glibc's largest
mmap threshold (32 MiB), so once a restore's arenas are freed the next restore in the process gets
that memory back from the heap, already faulted in, as ``torch.load``'s buffers do."""

HUGE_PAGE_BYTES = 2 * 1024 * 1024
"""Host buffers of at least this many bytes ask the kernel for transparent huge pages."""


_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)


def _load_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux") or _MADV_HUGEPAGE is None:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()

MADV_POPULATE_WRITE = 23
"""Linux >= 5.14: fault pages in writable in one call, as writing each would (no data
changes).  Older kernels answer EINVAL and the pages fault in one by one as before."""

PAGE_BYTES = mmap.PAGESIZE


def prefault(addr: int, nbytes: int) -> None:
    """Fault in the pages of ``[addr, addr + nbytes)`` before a read fills them.

    One ``madvise(MADV_POPULATE_WRITE)`` call instead of one page fault per 4 KiB page
    as the read's copy first touches each: the kernel still allocates and zeroes the
    pages, but without a trap per page (benchmarks/README.md, "Local restore").  Pages
    already present are left as they are; the range is widened to whole pages, which
    changes no byte.  Best effort: any failure (old kernel, not Linux) leaves the
    ordinary faults to the read.
    """
    if _madvise is None or nbytes <= 0 or not addr:
        return
    start = addr - addr % PAGE_BYTES
    end = -(-(addr + nbytes) // PAGE_BYTES) * PAGE_BYTES
    _madvise(start, end - start, MADV_POPULATE_WRITE)

HUGE_PAGES: bool | None = None
"""Whether :func:`host_buffer` asks for transparent huge pages: ``True`` always, ``False``
never, ``None`` (default) when the kernel gives them without stalling the fault (see
:func:`huge_pages_stall_free`)."""


def _sysfs_choice(path: str) -> str:
    """The ``[selected]`` word of a sysfs multiple-choice file; ``""`` if unreadable."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def huge_pages_stall_free() -> bool:
    """True when ``MADV_HUGEPAGE`` cannot make a page fault wait for compaction or reclaim.

    With ``transparent_hugepage/defrag`` set to ``madvise``, ``defer+madvise`` or
    ``always`` (the usual defaults), a fault in a region marked ``MADV_HUGEPAGE``
    compacts or reclaims memory until a huge page is free: measured here on a
    busy host with fragmented memory, a 260 MiB restore then took 0.4-0.9 s
    instead of 0.1 s.  Only ``defer`` and ``never`` leave that to the
    background (the fault takes small pages instead).
    """
    base = "/sys/kernel/mm/transparent_hugepage/"
    return (_sysfs_choice(base + "enabled") in ("always", "madvise")
            and _sysfs_choice(base + "defrag") in ("defer", "never"))


_HUGE_STALL_FREE = huge_pages_stall_free()


def host_buffer(nbytes: int) -> torch.Tensor:
    """A fresh uint8 CPU tensor of ``nbytes`` bytes, backed by huge pages where that is safe.

    When :data:`HUGE_PAGES` allows it (by default: the kernel's THP settings
    cannot stall a fault, :func:`huge_pages_stall_free`), buffers of at least
    :data:`HUGE_PAGE_BYTES` start on a 2 MiB boundary (2 MiB more address
    space is reserved, never touched) and are marked ``MADV_HUGEPAGE`` before
    their first touch: filling them takes one page fault per 2 MiB instead of
    per 4 KiB, which is most of the cost of reading into fresh memory on the
    project's VMs (benchmarks/README.md, "Local restore").  Otherwise, and off
    Linux, the buffer is an ordinary one.
    """
    huge = HUGE_PAGES if HUGE_PAGES is not None else _HUGE_STALL_FREE
    if nbytes < HUGE_PAGE_BYTES or not huge or _madvise is None or _MADV_HUGEPAGE is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    lead = -raw.data_ptr() % HUGE_PAGE_BYTES
    buf = raw[lead:lead + nbytes]
    if _madvise(buf.data_ptr(), nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    return buf


def _top_key(key: str) -> str:
    """``state['model']`` of ``state['model']['fc.weight']``: arenas never span two of these."""
    cut = key.find("][")
    return key if cut < 0 else key[:cut + 1]


def host_arenas(item: Item, blob_ids: Iterable[int]) -> dict[int, torch.Tensor]:
    """Fresh uint8 buffers for ``blob_ids``, as views into arenas laid out like the data file.

    Blobs that follow each other in one data file (no gap), belong to the same
    top-level entry of the state (``state['model']``, ``state['optimizer']``)
    and keep their tensors' alignment share one :func:`host_buffer` of at most
    :data:`ARENA_MAX_BYTES`, at the same distances as in the file, so
    :func:`~xla_ckpt.io.planning.plan_spans` reads them with one request per slice.  The tensors
    rebuilt from a blob keep its arena alive (memory is freed per arena, not
    per tensor); a model state the caller drops is never in an arena with
    optimizer state it keeps.
    """
    align: dict[int, int] = {}
    group: dict[int, str] = {}
    for t in item.tensors:
        align[t.blob] = max(align.get(t.blob, 1), itemsize(dtype_from_name(t.dtype, where=t.key)))
        group.setdefault(t.blob, _top_key(t.key))
    ids = sorted(set(blob_ids), key=lambda i: (item.blobs[i].file, item.blobs[i].offset))
    out: dict[int, torch.Tensor] = {}
    runs: list[list[int]] = []
    for i in ids:
        rec = item.blobs[i]
        if rec.length == 0:
            out[i] = torch.empty(0, dtype=torch.uint8)
            continue
        if runs:
            first, last = item.blobs[runs[-1][0]], item.blobs[runs[-1][-1]]
            if (rec.file == first.file and rec.offset == last.offset + last.length
                    and group.get(i) == group.get(runs[-1][0])
                    and (rec.offset - first.offset) % align.get(i, 1) == 0
                    and rec.offset + rec.length - first.offset <= ARENA_MAX_BYTES):
                runs[-1].append(i)
                continue
        runs.append([i])
    for run in runs:
        first, last = item.blobs[run[0]], item.blobs[run[-1]]
        arena = host_buffer(last.offset + last.length - first.offset)
        for i in run:
            rec = item.blobs[i]
            out[i] = arena[rec.offset - first.offset:rec.offset - first.offset + rec.length]
    return out



def bump_versions(tensors: Iterable[torch.Tensor]) -> None:
    """Tell autograd that tensors written behind its back changed (as ``copy_`` would)."""
    seen: set[int] = set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            try:
                torch.autograd.graph.increment_version(t)
            except RuntimeError:  # inference tensors have no version counter
                pass


def _fits_in_place(t: torch.Tensor, rec: TensorRecord) -> bool:
    """Whether live tensor ``t`` can take the saved bytes of ``rec`` as they are."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"
            and t.layout == torch.strided and not t.is_quantized and not t.is_conj()
            and not t.is_neg() and t.numel() > 0 and dtype_name(t.dtype) == rec.dtype
            and tuple(t.shape) == rec.shape and tuple(t.stride()) == rec.stride
            and _dense_layout(t))



def fits_box(t: torch.Tensor, dtype: str, shape: Sequence[int]) -> bool:
    """Whether live tensor ``t`` can be filled in place with a ``dtype``/``shape`` global tensor."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"
            and t.layout == torch.strided and not t.is_quantized and not t.is_conj()
            and not t.is_neg() and dtype_name(t.dtype) == dtype
            and tuple(t.shape) == tuple(shape) and _dense_layout(t))


def _dense_layout(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span exactly once (contiguous or permuted).

    A transposed tensor qualifies; a tensor sliced with a step (gaps between its elements,
    which may belong to other live tensors) or expanded (a zero stride) does not.
    """
    expected = 1
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz > 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def in_place_buffers(item: Item, into: Mapping[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Blob index -> uint8 view of live memory, for the blobs that can be read into ``into``.

    ``into`` maps tensor keys (``TensorRecord.key``) to existing tensors.  A
    blob qualifies when every tensor record of it has a target that
    :func:`_fits_in_place` (CPU, plain tensor or Parameter, saved dtype,
    shape and strides, elements filling their span: contiguous or permuted),
    the targets sit in one storage at the saved distances (tied weights: the
    same tensor for several keys), they
    cover every byte of the blob (nothing else in that storage is
    overwritten), and no other blob's targets overlap that memory.  Every
    other blob is left out (the caller reads it into fresh memory).
    """
    records: dict[int, list[TensorRecord]] = {}
    for t in item.tensors:
        records.setdefault(t.blob, []).append(t)
    claims: list[tuple[int, int, int]] = []  # (first address, end address, blob)
    views: dict[int, torch.Tensor] = {}
    for b, recs in records.items():
        rec = item.blobs[b]
        targets = [into.get(r.key) for r in recs]
        if rec.length == 0 or not all(t is not None and _fits_in_place(t, r)
                                      for t, r in zip(targets, recs, strict=True)):
            continue
        live = [t for t in targets if t is not None]
        st = live[0].untyped_storage()
        base = live[0].data_ptr() - recs[0].byte_offset
        if any(t.untyped_storage().data_ptr() != st.data_ptr() or t.data_ptr() - base
               != r.byte_offset for t, r in zip(live, recs, strict=True)):
            continue
        if base < st.data_ptr() or base + rec.length > st.data_ptr() + st.nbytes():
            continue
        covered = 0
        for lo, hi in sorted((r.byte_offset, r.byte_offset + r.span_bytes()) for r in recs):
            if lo > covered:
                break
            covered = max(covered, hi)
        if covered < rec.length:
            continue
        claims.append((base, base + rec.length, b))
        views[b] = torch.empty(0, dtype=torch.uint8).set_(st, base - st.data_ptr(),
                                                           (rec.length,), (1,))
    claims.sort()
    clash: set[int] = set()
    for (_, end, b), (lo, _, c) in zip(claims, claims[1:], strict=False):
        if lo < end:
            clash.update((b, c))
    return {b: v for b, v in views.items() if b not in clash}


_POOLS: dict[int, cf.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _forget_pools_in_child() -> None:
    """A forked child has none of the parent's threads: it starts pools of its own."""
    global _POOLS_LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_in_child)


def shared_pool(max_workers: int) -> cf.ThreadPoolExecutor:
    """One I/O thread pool per worker count for every reader of the process.

    Readers come and go with each restore (every ``xla_ckpt.load`` opens its
    own storage); starting the threads of a fresh pool each time cost more
    than the reads of a small checkpoint on a busy host.  Tasks in this pool
    never wait on other tasks of it, so sharing it cannot deadlock.
    """
    with _POOLS_LOCK:
        pool = _POOLS.get(max_workers)
        if pool is None:
            pool = _POOLS[max_workers] = cf.ThreadPoolExecutor(
                max_workers, thread_name_prefix="xla_ckpt-read")
            # Start every thread now, while no read competes for the GIL and the cores: a
            # thread started mid-read waits for both (0.6 s for 11 threads on a busy 2-core VM).
            ready = threading.Barrier(max_workers + 1)
            for _ in range(max_workers):
                pool.submit(ready.wait)
            ready.wait()
        return pool

