"""The steps of a save from every rank, written once: :func:`~xla_ckpt.restore.save_distributed`
and the :class:`~xla_ckpt.manager.CheckpointManager` both take them, in this order.

1. **Inputs** (every rank, :func:`evaluate_inputs`): the ``state`` / ``rank_state`` /
   ``shards`` callables are called; an exception is kept, not raised, so the rank still
   takes part in the agreement, which makes every rank raise it.
2. **Agreement, with the save id** (:func:`agree_on_save`, ONE exchange): every rank sends
   :func:`message` -- the checkpoint folder's URI, whether its inputs failed, whether it
   holds sharded tensors (or asks for the chunked path), a digest of its tensor layout (key,
   shape, dtype of every tensor), the layout of its flat ``shards`` pieces (ZeRO) -- and
   rank 0 adds the head: the save id (data file names carry it) and what its caller needs
   every rank to know before anything is written (a newer lease; the manager's score).
   :func:`agree` draws the same conclusions on every rank; :func:`refuse` raises on every
   rank, before anything is written, naming the ranks: different URIs (the commit would
   miss the others' files), different ``shards`` keys or dtypes, different tensor layouts
   (C16: a second exchange names the first rank and key that differ).  A chunked save then
   agrees on keys, global shapes, dtypes and placements and plans who writes which box
   (:func:`plan`, :func:`xla_ckpt.restore.owners.plan_chunked_save`).
3. **Write** (every rank): :func:`payload` is what this rank writes (rank 0's state on the
   plain path, this rank's boxes on the chunked one, its ``rank/<r>`` and ``shard/<r>``
   items); :func:`write_payload` puts it in one data file.
4. **Gather**: every rank's :class:`~xla_ckpt.io.writer.WrittenItem` records travel to rank
   0 as :func:`parts_json` and come back validated by :func:`parts_from_json`
   (:meth:`WrittenItem.from_json`).
5. **Commit** (rank 0, :func:`commit_save`): with a :class:`SaveFence` (the manager's lease,
   or the one given to ``save_distributed``) the lease is checked right before the commit
   marker and the marker is created only if absent, or on the generation of an older
   epoch's manifest (:mod:`xla_ckpt.run.fencing`); then the manifest, with the chunked
   state's global tensors.

Which rank calls what: every function here is called by every rank in the same order,
except :func:`commit_save` and :meth:`SaveFence.newer` (rank 0 only); the exchanges are the
caller's (``exchange(obj) -> [every rank's obj]``: ``Dist.exchange`` or the manager's
lockstep-checked one), so both callers run the same steps under their own schedule checks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Mapping, Sequence

import torch

from xla_ckpt.comm.base import Dist
from xla_ckpt.comm.failures import describe_error, is_broken_collective
from xla_ckpt.errors import (
    CheckpointCorruptError,
    CollectiveTimeoutError,
    DistributedError,
    PreconditionFailedError,
)
from xla_ckpt.format import typed
from xla_ckpt.format.dtypes import dtype_name
from xla_ckpt.format.manifest import STATE_ITEM, Manifest, rank_item
from xla_ckpt.io.writer import WrittenItem, commit, new_save_id, write_items
from xla_ckpt.restore.owners import ChunkedSavePlan, has_sharded, plan_chunked_save
from xla_ckpt.restore.sharding import shard_item, shard_state
from xla_ckpt.run.fencing import Lease, check_lease, manifest_precondition, read_lease
from xla_ckpt.storage import Storage

logger = logging.getLogger(__name__)

#: Keys a message names at most when it lists what differs.
SHOWN_KEYS = 6

Layout = list[tuple[str, tuple[int, ...], str]]  # (tensor key, shape, dtype) in tree order
Exchange = Callable[[Any], list[Any]]  # every rank's obj, in rank order (collective)

URI_HINT = ("every rank must save to the same checkpoint folder, on storage every rank shares "
            "(a shared filesystem or gs://, not a node-local path): pass every rank the same "
            "uri (a CheckpointManager: the same save_dir)")

LAYOUT_HINT = ("only one copy of the replicated state is written, so every rank must hold the "
               "same tensors; pass per-rank values as rank_state, and shard a model across "
               "ranks with DTensor (FSDP2 / tensor parallel) so each rank's part is saved")


# ---- 1. inputs -------------------------------------------------------------------------------


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
    except Exception as e:  # noqa: BLE001 - agreed on with every rank (agree / refuse)
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


# ---- 2. agreement ----------------------------------------------------------------------------


def message(inputs: SaveInputs, uri: str, *, chunked: bool = False) -> dict[str, Any]:
    """What this rank sends in the agreement exchange (small: no tensor data).

    ``uri``: the checkpoint folder this rank writes to, normalised (``Storage.uri``);
    ``chunked``: take the chunked path even without sharded tensors (``balance_replicated``).
    """
    failed = inputs.error is not None
    sharded = not failed and (chunked or has_sharded(inputs.state))
    return {
        "uri": uri,
        "error": describe_error(inputs.error) if inputs.error is not None else None,
        "chunked": sharded,
        "digest": None if sharded or failed else _digest(tensor_layout(inputs.state)),
        "shards": None if inputs.flat is None
        else {k: [int(t.numel()), dtype_name(t.dtype)] for k, t in inputs.flat.items()},
    }


@dataclass
class SaveAgreement:
    """What every rank concluded from the exchanged messages (the same on every rank).

    Attributes:
        input_errors: rank -> cause, for ranks whose inputs failed (nothing is written).
        chunked: some rank holds sharded tensors or asked for it: the chunked path.
        layouts_differ: the tensor layout digests differ: :func:`refuse` exchanges the
            layouts (:func:`layout_mismatch`) to name rank and key.
        shard_errors: rank -> what is wrong with its ``shards`` (keys or dtypes differ).
        bounds / numels: this rank's element range of each flat sharded tensor, and
            each tensor's total numel (empty without ``shards``).
        uri_errors: rank -> the URI it saves to, for ranks whose checkpoint URI differs
            from rank 0's (nothing is written).
        rank0_uri: rank 0's checkpoint URI (what every rank's message names).
    """

    input_errors: dict[int, str]
    chunked: bool
    layouts_differ: bool
    shard_errors: dict[int, str]
    bounds: dict[str, tuple[int, int]]
    numels: dict[str, int]
    uri_errors: dict[int, str]
    rank0_uri: str


def agree(msgs: Sequence[Mapping[str, Any]], rank: int) -> SaveAgreement:
    """Every rank: the conclusions of the exchanged :func:`message` of every rank."""
    errors = {r: m["error"] for r, m in enumerate(msgs) if m["error"] is not None}
    chunked = any(m["chunked"] for m in msgs)
    digests = {m["digest"] for m in msgs if m["digest"] is not None}
    shard_errors, bounds, numels = _shard_layout([m["shards"] for m in msgs], rank)
    uris = [str(m["uri"]) for m in msgs]
    uri_errors = {r: f"saves to {u!r}, rank 0 to {uris[0]!r}" for r, u in enumerate(uris)
                  if u != uris[0] and r not in errors}
    return SaveAgreement(input_errors=errors, chunked=chunked,
                         layouts_differ=not chunked and len(digests) > 1,
                         shard_errors=shard_errors, bounds=bounds, numels=numels,
                         uri_errors=uri_errors, rank0_uri=uris[0])


def _shard_layout(every: Sequence[Mapping[str, list] | None], rank: int
                  ) -> tuple[dict[int, str], dict[str, tuple[int, int]], dict[str, int]]:
    """``shards`` of every rank (None: passed none, as ``{}``): errors (rank -> why, against
    rank 0's), this rank's bounds, total numels.

    Rank ``r``'s piece is the ``r``-th contiguous range of the flat tensor, so pieces may have
    any (uneven, even empty) lengths.
    """
    maps = [dict(m or {}) for m in every]
    ref = maps[0]
    bad: dict[int, str] = {}
    for r, m in enumerate(maps):
        if set(m) != set(ref):
            bad[r] = f"passes shards for keys {sorted(m)}, rank 0 for {sorted(ref)}"
            continue
        for k in sorted(m):
            if m[k][1] != ref[k][1]:
                bad[r] = f"sharded tensor {k!r} has dtype {m[k][1]}, rank 0's {ref[k][1]}"
                break
    if bad:
        return bad, {}, {}
    bounds, numels = {}, {}
    for k in ref:
        sizes = [int(m[k][0]) for m in maps]
        lo = sum(sizes[:rank])
        bounds[k] = (lo, lo + sizes[rank])
        numels[k] = sum(sizes)
    return {}, bounds, numels


def agree_on_save(exchange: Exchange, rank: int, inputs: SaveInputs, uri: str, *,
                  chunked: bool = False, head: Callable[[], Mapping[str, Any]] | None = None
                  ) -> tuple[dict[str, Any], SaveAgreement]:
    """The save's one agreement exchange (collective): rank 0's head and every rank's
    :func:`message`.

    Rank 0's head is ``{"save_id": a new save id, **head()}`` (``head``: what the caller
    needs every rank to know before anything is written, from rank 0; it must not raise).

    Returns:
        ``(rank 0's head, the agreement)``, the same on every rank.
    """
    mine = {"save_id": new_save_id(), **(head() if head is not None else {})} \
        if rank == 0 else None
    msgs = exchange((mine, message(inputs, uri, chunked=chunked)))
    return msgs[0][0], agree([m[1] for m in msgs], rank)


def refuse(agreed: SaveAgreement, inputs: SaveInputs, *, exchange: Exchange, what: str,
           error: type[DistributedError] = DistributedError,
           defer_input_errors: bool = False) -> None:
    """Raise on every rank, before anything is written, when the ranks' save differs.

    ``what``: the save, for messages, with ``{uri}`` for rank 0's checkpoint URI (the
    message is the same on every rank).  Collective only when the tensor layouts differ (a
    second exchange names rank and key).  ``defer_input_errors``: a failed input is the
    caller's to report (the manager reports it as the save's failure, at its next update
    boundary); the other checks then pass.

    Raises:
        error: (``DistributedError`` or the caller's subclass) some rank's inputs failed
            (its folder could not be opened, a state callable raised); ranks save to
            different checkpoint URIs (``failures`` names each one's); ranks passed
            ``shards`` with different keys or dtypes; their plain states hold different
            tensors (names the first key of each differing rank).
    """
    head = what.format(uri=agreed.rank0_uri)
    if agreed.input_errors and not defer_input_errors:
        ranks = ", ".join(str(r) for r in sorted(agreed.input_errors))
        raise error(f"{head} failed on rank(s) {ranks} before anything was written (its "
                    "checkpoint folder could not be opened or its inputs raised); nothing was "
                    "written", agreed.input_errors)
    if agreed.uri_errors:
        raise error(f"{head} refused: ranks passed different checkpoint URIs, so the ranks "
                    f"save to different checkpoint folders ({URI_HINT}); nothing was written",
                    agreed.uri_errors)
    if agreed.input_errors:
        return
    if agreed.shard_errors:
        raise error(f"{head} refused: ranks passed different flat sharded tensors (shards=: "
                    "pass the same keys and dtypes on every rank, or none anywhere); nothing "
                    "was written", agreed.shard_errors)
    if agreed.layouts_differ:
        differ = layout_mismatch(exchange(tensor_layout(inputs.state)))
        if differ:
            raise error(f"{head} refused: ranks hold different tensors; nothing was written "
                        f"({LAYOUT_HINT})", differ)


def layout_mismatch(layouts: Sequence[Layout | None]) -> dict[int, str]:
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
    shown = ", ".join(keys[:SHOWN_KEYS])
    return shown + (f" (+{len(keys) - SHOWN_KEYS} more)" if len(keys) > SHOWN_KEYS else "")


def strip_failures(e: DistributedError) -> str:
    """``e``'s message without the ``[rank r: cause; ...]`` detail its failures add."""
    text = str(e)
    if e.failures:
        detail = "; ".join(f"rank {r}: {c}" for r, c in sorted(e.failures.items()))
        text = text.removesuffix(f" [{detail}]")
    return text


def plan(dist: Dist, agreed: SaveAgreement, inputs: SaveInputs, *, what: str,
         error: type[DistributedError] = DistributedError,
         owned_devices: Sequence[int] | None = None,
         check_replicas: bool = False) -> ChunkedSavePlan | None:
    """Every rank (collective when chunked): the owners' plan of a chunked save, or None
    (the plain path, or a rank's inputs failed).  ``what`` as in :func:`refuse`.

    Raises:
        error: the ranks' structures differ (keys, global shapes, dtypes, placements, ties;
            names rank and key, on every rank; nothing was written), a rank could not
            describe its state, copies of a replicated box differ (``check_replicas``).
        CollectiveTimeoutError: a rank died or hung (as it is, whatever ``error``).
    """
    if not agreed.chunked or agreed.input_errors:
        return None
    try:
        return plan_chunked_save(dist, inputs.state, owned_devices=owned_devices,
                                 check_replicas=check_replicas,
                                 what=f"{what.format(uri=agreed.rank0_uri)} refused")
    except DistributedError as e:
        if isinstance(e, (error, CollectiveTimeoutError)) or is_broken_collective(e):
            raise
        raise error(strip_failures(e), e.failures) from e


# ---- 3. write --------------------------------------------------------------------------------


@dataclass
class SavePayload:
    """What one rank writes (each None for none), in one data file.

    Attributes:
        state: the replicated state (rank 0, plain path).
        rank_state: this rank's private state (item ``rank/<r>``).
        shards: this rank's flat sharded pieces with their ranges (item ``shard/<r>``).
        chunk_name / chunks: this rank's boxes of a chunked save (item ``chunks/<r>``), C-
            contiguous tensors in the plan's order.
    """

    state: Any = None
    rank_state: Any = None
    shards: Any = None
    chunk_name: str | None = None
    chunks: list[torch.Tensor] | None = None

    def items(self, rank: int) -> list[tuple[str, Any]]:
        """``(item name, state)`` to write, in file order."""
        items: list[tuple[str, Any]] = []
        if self.chunk_name is not None and self.chunks is not None:
            items.append((self.chunk_name, [t if t.is_contiguous() else t.contiguous()
                                            for t in self.chunks]))
        if self.state is not None:
            items.append((STATE_ITEM, self.state))
        if self.rank_state is not None:
            items.append((rank_item(rank), self.rank_state))
        if self.shards is not None:
            items.append((shard_item(rank), self.shards))
        return items


def payload(inputs: SaveInputs, agreed: SaveAgreement, plan: ChunkedSavePlan | None,
            rank: int) -> SavePayload:
    """What this rank writes: rank 0's state (plain path) or this rank's boxes (chunked),
    its ``rank_state``, its ``shards`` piece with its range."""
    shards = (shard_state(inputs.flat, agreed.bounds, agreed.numels)
              if inputs.flat else None)
    chunk = plan.chunk_item() if plan is not None else None
    return SavePayload(state=inputs.state if plan is None and rank == 0 else None,
                       rank_state=inputs.rank_state, shards=shards,
                       chunk_name=chunk[0] if chunk is not None else None,
                       chunks=list(chunk[1]) if chunk is not None else None)


def write_payload(storage: Storage, save_id: str, what: SavePayload, rank: int, *,
                  chunk_size_bytes: int | None = None,
                  progress: Callable[[int], object] | None = None) -> list[WrittenItem]:
    """Write ``what`` as this rank's one data file (one object, one fsync:
    :func:`~xla_ckpt.io.writer.write_items`); what was written (nothing for nothing)."""
    items = what.items(rank)
    if not items:
        return []
    kw: dict[str, Any] = {"progress": progress}
    if chunk_size_bytes is not None:
        kw["chunk_size_bytes"] = chunk_size_bytes
    return write_items(storage, save_id, items, **kw)


# ---- 4. gather -------------------------------------------------------------------------------


def parts_json(parts: Iterable[WrittenItem]) -> bytes:
    """This rank's written items as JSON bytes (what travels to rank 0)."""
    return json.dumps([p.to_json() for p in parts], separators=(",", ":")).encode("utf-8")


def parts_from_json(every: Sequence[bytes], save_id: str) -> list[WrittenItem]:
    """Every rank's :func:`parts_json`, in rank order, rebuilt and validated
    (:meth:`WrittenItem.from_json`).

    Raises:
        CheckpointCorruptError: a rank's document is not a list of written items (names the
            rank, the item and the field).
    """
    out: list[WrittenItem] = []
    for r, blob in enumerate(every):
        try:
            docs = json.loads(bytes(blob).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise CheckpointCorruptError(f"the items written by rank {r} are not JSON ({e})"
                                         ) from None
        if not isinstance(docs, list):
            raise CheckpointCorruptError(f"the items written by rank {r} must be a list, got "
                                         f"{type(docs).__name__}")
        out.extend(WrittenItem.from_json(d, rank=r, save_id=save_id) for d in docs)
    return out


# ---- 5. commit -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveFence:
    """The lease a save commits under: ``lease`` of run folder ``run`` (:mod:`xla_ckpt.run.
    fencing`); the manager's own, or the one given to ``save_distributed``."""

    run: Storage
    lease: Lease

    def newer(self) -> tuple[int, dict] | None:
        """Rank 0, before any rank writes: ``(epoch, owner)`` of the run folder's lease if
        newer than this one (the save is then refused on every rank, writing nothing).  A
        lease that cannot be read is logged and passed: the commit checks again."""
        try:
            current = read_lease(self.run)
        except Exception as e:  # noqa: BLE001 - the commit checks again, and fails then
            logger.warning("could not read the lease of %s before saving: %s", self.run.uri, e)
            return None
        if current is not None and current.epoch > self.lease.epoch:
            return current.epoch, dict(current.owner)
        return None

    def check(self, what: str) -> None:
        """Raise :class:`~xla_ckpt.errors.FencedError` if a newer incarnation holds the lease
        (``what``: the step refused, ``"to commit checkpoint_1_15"``)."""
        check_lease(self.run, self.lease, what=what)


def commit_save(storage: Storage, save_id: str, parts: Sequence[WrittenItem], *, name: str,
                plan: ChunkedSavePlan | None = None, metadata: Any = None,
                world_size: int | None = None, fence: SaveFence | None = None,
                cleanup: bool = True, check_files: bool = True,
                guard: Callable[[], ContextManager[Any]] | None = None) -> Manifest:
    """Rank 0: write the commit marker of a save from every rank.

    With ``fence``: the lease is checked right before the marker; the marker is created only
    if the folder holds none, or on the generation of a manifest an older epoch committed
    there (whose data files must all still be here); a marker created meanwhile is checked
    again, so a newer incarnation's is named as such.  Without, an existing checkpoint at
    ``storage`` is replaced.  A chunked save (``plan``) commits the state tree as a chunked
    item with the global tensors' chunk tables.  ``guard``: a context manager the marker is
    written inside (the manager's gate against an abandoned save).  ``cleanup``: remove the
    data files of earlier saves in this folder once committed (:func:`xla_ckpt.io.commit`).

    Raises:
        FencedError: a newer incarnation took the lease, or committed in this folder.
        PreconditionFailedError: a manifest of this epoch is there already (fenced), or
            another save committed meanwhile; nothing was committed.
        StorageNotSharedError / ValueError / StorageError: as :func:`xla_ckpt.io.commit`.
    """
    expected: int | None = None
    if fence is not None:
        fence.check(what=f"to commit {name}")
        expected = manifest_precondition(storage, fence.lease, run=fence.run)
        if expected:
            # Replacing an older incarnation's checkpoint of this name: its data files must
            # all still be here (a stale writer's commit clean-up may have run meanwhile).
            for f in sorted({f for p in parts for f in p.files}):
                storage.stat(f)
    extra: dict[str, Any] = {}
    if plan is not None:
        # The state item is rank 0's tree; each box lives in its owner's chunks/<r> item
        # (global_tensors also names the chunk records by their box).
        extra["global_tensors"] = plan.global_tensors(parts)
        parts = [*parts, WrittenItem(STATE_ITEM, plan.state_item(), {})]
    with guard() if guard is not None else contextlib.nullcontext():
        try:
            return commit(storage, save_id, parts, metadata=metadata, world_size=world_size,
                          cleanup=cleanup, if_generation_match=expected,
                          check_files=check_files, **extra)
        except PreconditionFailedError:
            if fence is not None:  # created meanwhile: by a newer incarnation (say so), or ours
                fence.check(what=f"to commit {name}")
                manifest_precondition(storage, fence.lease, run=fence.run)
            raise
