"""What the ranks agree on before a :class:`~xla_ckpt.manager.CheckpointManager` save writes.

A save writes one copy of the replicated state (rank 0's, or, for sharded state, each
box once by its owner), so the ranks must hold the same state.  Before anything is
written every rank evaluates its inputs (the ``state`` / ``rank_state`` / ``shards``
callables, on the training thread) and one exchange tells every rank:

* whether any rank's inputs failed (then nothing is written and every rank raises
  the save's error, naming the rank);
* whether any rank holds sharded tensors (``DTensor`` / ``XLAShardedTensor``): then
  every rank takes the chunked path, whose own structure agreement
  (:func:`xla_ckpt.restore.owners.plan_chunked_save`) compares keys, global shapes,
  dtypes and placements;
* otherwise a digest of each rank's tensor layout (key, shape, dtype of every tensor of
  ``state``): when two differ, a second exchange of the layouts names the first rank and
  key that differ from rank 0's (C16: a rank whose model has extra keys was silently not
  written before);
* the layout of the flat ``shards`` pieces (ZeRO), which every rank passes or none;
* the checkpoint folder's URI: every rank must save to the same one (a rank with another
  run folder or checkpoint name would write its files where rank 0's commit does not look:
  refused before anything is written, naming every rank's URI).

Pure decisions over the exchanged messages, so every rank takes the same branch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from xla_ckpt.comm.failures import describe_error
from xla_ckpt.format import typed
from xla_ckpt.format.dtypes import dtype_name
from xla_ckpt.restore.owners import has_sharded

# Keys a message names at most when it lists what differs.
_SHOWN_KEYS = 6

Layout = list[tuple[str, tuple[int, ...], str]]  # (tensor key, shape, dtype) in tree order


@dataclass
class SaveInputs:
    """This rank's evaluated save inputs (the callables called), or the error they raised."""

    state: Any = None
    rank_state: Any = None
    flat: dict[str, torch.Tensor] | None = None  # the ``shards`` pieces, flattened
    error: BaseException | None = None


def evaluate_inputs(state: Any, rank_state: Any, shards: Any) -> SaveInputs:
    """Call the zero-argument callables among the inputs (every rank, training thread).

    An exception is kept (``error``), not raised: the rank still takes part in the
    agreement, which makes every rank raise it.
    """
    out = SaveInputs()
    try:
        out.state = state() if callable(state) else state
        out.rank_state = rank_state() if callable(rank_state) else rank_state
        sh = shards() if callable(shards) else shards
        if sh is not None:
            out.flat = {k: t.detach().reshape(-1) for k, t in sh.items()}
    except Exception as e:  # noqa: BLE001 - agreed on with every rank (SaveAgreement)
        out.error = e
    return out


def tensor_layout(state: Any) -> Layout | None:
    """``(key, shape, dtype)`` of every tensor of ``state`` in tree order; None for no state
    or one the typed encoding refuses (the write then raises, naming the key)."""
    if state is None:
        return None
    out: Layout = []

    def hook(t: torch.Tensor, path: tuple) -> int:
        out.append((typed.format_path(path), tuple(int(s) for s in t.shape), dtype_name(t.dtype)))
        return len(out) - 1

    try:
        typed.encode(state, hook)
    except Exception:  # noqa: BLE001 - the write reports it, naming the key
        return None
    return out


def _digest(layout: Layout | None) -> str | None:
    if layout is None:
        return None
    return hashlib.blake2b(json.dumps(layout).encode("utf-8"), digest_size=16).hexdigest()


def message(inputs: SaveInputs, uri: str = "") -> dict[str, Any]:
    """What this rank sends in the agreement exchange (small: no tensor data); ``uri``: the
    checkpoint folder this rank writes to (normalised, ``Storage.url``)."""
    sharded = inputs.error is None and has_sharded(inputs.state)
    return {
        "uri": uri,
        "error": describe_error(inputs.error) if inputs.error is not None else None,
        "sharded": sharded,
        "digest": None if sharded or inputs.error is not None
        else _digest(tensor_layout(inputs.state)),
        "shards": None if inputs.flat is None
        else {k: [int(t.numel()), dtype_name(t.dtype)] for k, t in inputs.flat.items()},
    }


@dataclass
class SaveAgreement:
    """What every rank concluded from the exchanged messages (the same on every rank).

    Attributes:
        input_errors: rank -> cause, for ranks whose inputs failed (nothing is written).
        sharded: some rank holds sharded tensors: the chunked path.
        layouts_differ: the tensor layout digests differ: exchange the layouts
            (:func:`layout_mismatch`) to name rank and key.
        shard_errors: rank -> what is wrong with its ``shards`` (keys or dtypes differ).
        bounds / numels: this rank's element range of each flat sharded tensor, and
            each tensor's total numel (empty without ``shards``).
        uri_errors: rank -> the URI it saves to, for ranks whose checkpoint URI differs
            from rank 0's (nothing is written).
        rank0_uri: rank 0's checkpoint URI (what every rank's message names).
    """

    input_errors: dict[int, str]
    sharded: bool
    layouts_differ: bool
    shard_errors: dict[int, str]
    bounds: dict[str, tuple[int, int]]
    numels: dict[str, int]
    uri_errors: dict[int, str] = field(default_factory=dict)
    rank0_uri: str = ""


def agree(msgs: list[dict[str, Any]], rank: int) -> SaveAgreement:
    """Every rank: the conclusions of the exchanged :func:`message` of every rank."""
    errors = {r: m["error"] for r, m in enumerate(msgs) if m["error"] is not None}
    sharded = any(m["sharded"] for m in msgs)
    digests = {m["digest"] for m in msgs if m["digest"] is not None}
    shard_errors, bounds, numels = _shard_layout([m["shards"] for m in msgs], rank)
    uris = [str(m.get("uri", "")) for m in msgs]
    uri_errors = {r: f"saves to {u!r}, rank 0 to {uris[0]!r}" for r, u in enumerate(uris)
                  if u != uris[0]}
    return SaveAgreement(input_errors=errors, sharded=sharded,
                         layouts_differ=not sharded and len(digests) > 1,
                         shard_errors=shard_errors, bounds=bounds, numels=numels,
                         uri_errors=uri_errors, rank0_uri=uris[0])


def _shard_layout(every: list[Mapping[str, list] | None], rank: int
                  ) -> tuple[dict[int, str], dict[str, tuple[int, int]], dict[str, int]]:
    """``shards`` of every rank: errors (rank -> why), this rank's bounds, total numels.

    Rank ``r``'s piece is the ``r``-th contiguous range of the flat tensor (the layout
    :func:`xla_ckpt.restore.save_distributed` writes).
    """
    passed = [r for r, m in enumerate(every) if m is not None]
    if not passed:
        return {}, {}, {}
    if len(passed) != len(every):
        missing = [r for r, m in enumerate(every) if m is None]
        return ({r: f"passed no shards while rank(s) {passed[:_SHOWN_KEYS]} passed shards "
                    f"{sorted(every[passed[0]] or {})[:_SHOWN_KEYS]}; pass shards on every "
                    "rank or on none" for r in missing}, {}, {})
    ref = every[0] or {}
    keys = set(ref)
    bad: dict[int, str] = {}
    for r, m in enumerate(every):
        m = m or {}
        if set(m) != keys:
            extra, lack = sorted(set(m) - keys), sorted(keys - set(m))
            bad[r] = (f"sharded keys differ from rank 0's: {'extra ' + str(extra) if extra else ''}"
                      f"{'; ' if extra and lack else ''}{'missing ' + str(lack) if lack else ''}")
            continue
        for k in sorted(keys):
            if m[k][1] != ref[k][1]:
                bad[r] = f"sharded tensor {k!r} has dtype {m[k][1]}, rank 0's {ref[k][1]}"
                break
    if bad:
        return bad, {}, {}
    bounds, numels = {}, {}
    for k in keys:
        sizes = [int((m or {})[k][0]) for m in every]
        lo = sum(sizes[:rank])
        bounds[k] = (lo, lo + sizes[rank])
        numels[k] = sum(sizes)
    return {}, bounds, numels


def layout_mismatch(layouts: list[Layout | None]) -> dict[int, str]:
    """Rank -> the first way its tensor layout differs from rank 0's (ranks passing no state
    are not compared).  Names the keys only one side has, or a shape/dtype that differs."""
    ref_rank = next((r for r, lay in enumerate(layouts) if lay is not None), None)
    if ref_rank is None:
        return {}
    ref = {k: (tuple(s), d) for k, s, d in layouts[ref_rank] or []}
    out: dict[int, str] = {}
    for r, lay in enumerate(layouts):
        if lay is None or r == ref_rank:
            continue
        mine = {k: (tuple(s), d) for k, s, d in lay}
        extra = [k for k in mine if k not in ref]
        lack = [k for k in ref if k not in mine]
        if extra:
            out[r] = (f"holds {len(extra)} tensor(s) rank {ref_rank} does not: "
                      f"{_keys(extra)}")
        elif lack:
            out[r] = f"lacks {len(lack)} tensor(s) rank {ref_rank} holds: {_keys(lack)}"
        else:
            for k, (shape, dt) in mine.items():
                if ref[k] != (shape, dt):
                    out[r] = (f"tensor {k} has shape {list(shape)} dtype {dt}, rank {ref_rank}'s "
                              f"shape {list(ref[k][0])} dtype {ref[k][1]}")
                    break
    return out


def _keys(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN_KEYS])
    return shown + (f" (+{len(keys) - _SHOWN_KEYS} more)" if len(keys) > _SHOWN_KEYS else "")


URI_HINT = ("every rank must save to the same checkpoint folder, on storage every rank shares "
            "(a shared filesystem or gs://, not a node-local path): give every rank's manager "
            "the same save_dir")

LAYOUT_HINT = ("only one copy of the replicated state is written, so every rank must hold the "
               "same tensors; pass per-rank values as rank_state, and shard a model across "
               "ranks with DTensor (FSDP2 / tensor parallel) so each rank's part is saved")
