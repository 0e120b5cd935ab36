"""``xla-ckpt inspect URI``: the state tree (dtypes, shapes, sizes) and a training-state summary.

URI is a checkpoint folder, or a run folder (its latest committed checkpoint
is shown, as a restore would choose it).  Only the manifest is read: no
tensor bytes move.  A legacy ``.pt``/safetensors file is shown as
``xla-ckpt convert`` would import it (read whole, through the allow-list).

A sharded checkpoint (manifest version 2) shows its global tensors in the state tree with
their global shape, dtype, number of chunks and placement at save
(``float32[10, 6]  240 B  (4 chunks, Shard(0) on mesh (4,))``); the ``chunks/<rank>``
items that hold the chunks' bytes are summed up in one line.

The summary covers the fairseq layout: model and criterion tensors, optimizer
(class from ``optimizer_history``, param groups, learning rates, per-parameter
state), lr scheduler state, ``num_updates``, the train iterator position (also
each rank's own, from ``rank/<r>`` items), ``previous_training_time`` and the
metrics saved.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from xla_ckpt.cli.common import (
    EXIT_OK,
    Parents,
    Subparsers,
    Target,
    UsageError,
    human_bytes,
    jsonable,
    plain,
    resolve_checkpoint,
    short_repr,
    utc_time,
)
from xla_ckpt.errors import CheckpointCorruptError
from xla_ckpt.format import typed
from xla_ckpt.format.chunks import CHUNK_ITEM_PREFIX, GlobalTensor
from xla_ckpt.format.dtypes import check_dtype_name, itemsize_of
from xla_ckpt.format.manifest import STATE_ITEM, Item, Manifest, TensorRecord
from xla_ckpt.io.manifest_file import read_manifest

if TYPE_CHECKING:
    import torch


def register(sub: Subparsers, parents: Parents) -> None:
    p = sub.add_parser("inspect", parents=parents,
                       help="show a checkpoint's state tree and summary",
                       description=plain(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("uri", metavar="URI", help="checkpoint folder or run folder (-> latest)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    p.add_argument("--depth", type=int, default=None, metavar="N",
                   help="show the tree only N levels deep")
    p.add_argument("--layout", choices=("auto", "fairseq", "raw", "model"), default="auto",
                   help="for a legacy .pt/safetensors file: the import layout to show")
    p.set_defaults(func=run)


class TensorInfo:
    """What the manifest says about one tensor (shown in place of its bytes).

    For a global (chunked) tensor, ``chunks`` is its number of saved chunks and
    ``placement`` how it was sharded at save; ``chunks`` is None for a plain record.
    """

    def __init__(self, rec: TensorRecord) -> None:
        self.key = rec.key
        self.dtype = rec.dtype
        self.shape = rec.shape
        self.numel = rec.numel
        self.nbytes = rec.numel * itemsize_of(check_dtype_name(rec.dtype, where=rec.key))
        self.chunks: int | None = None
        self.placement = ""
        self.chunk_items: tuple[str, ...] = ()

    @classmethod
    def of_global(cls, gt: GlobalTensor) -> "TensorInfo":
        """Description of a global tensor of a version-2 manifest (its chunk table)."""
        info = cls(TensorRecord(gt.key, 0, 0, gt.dtype, gt.shape, (1,) * len(gt.shape)))
        info.chunks = len(gt.chunks)
        info.placement = gt.placement
        info.chunk_items = tuple(sorted({c.item for c in gt.chunks}))
        return info

    @classmethod
    def of(cls, t: torch.Tensor, key: str = "") -> "TensorInfo":
        """Description of a loaded tensor (legacy files)."""
        return cls(TensorRecord(key, 0, 0, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                                tuple(t.stride())))

    def describe(self) -> str:
        text = f"{self.dtype}[{', '.join(map(str, self.shape))}]  {human_bytes(self.nbytes)}"
        if self.chunks is None:
            return text
        where = f", {self.placement}" if self.placement else ""
        return f"{text}  ({self.chunks} chunk{'' if self.chunks == 1 else 's'}{where})"

    def to_json(self) -> dict:
        d: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape),
                             "nbytes": self.nbytes}
        if self.chunks is not None:
            d.update(chunks=self.chunks, placement=self.placement,
                     chunk_items=list(self.chunk_items))
        return {"tensor": d}

    def __repr__(self) -> str:
        return f"<{self.dtype}[{', '.join(map(str, self.shape))}]>"


def decode_item(item: Item, manifest: Manifest | None = None) -> Any:
    """The item's typed state with :class:`TensorInfo` where tensors are.

    A chunked item's tensors are ``manifest``'s global tensors (:meth:`TensorInfo.of_global`).
    """
    if item.chunked:
        infos = [TensorInfo.of_global(g) for g in (manifest.global_tensors if manifest else [])]
    else:
        infos = [TensorInfo(r) for r in item.tensors]

    def lookup(i: int) -> TensorInfo:
        if not 0 <= i < len(infos):
            raise CheckpointCorruptError(f"typed state refers to tensor {i} but only "
                                         f"{len(infos)} exist")
        return infos[i]

    return typed.decode(item.state, lookup)


def _describe_tensors(v: Any) -> Any:
    """A loaded state with every tensor replaced by its :class:`TensorInfo`."""
    import torch  # noqa: PLC0415 - legacy files only: inspecting our format needs no torch

    if isinstance(v, torch.Tensor):
        return TensorInfo.of(v)
    if isinstance(v, argparse.Namespace):
        return argparse.Namespace(**{k: _describe_tensors(x) for k, x in vars(v).items()})
    if isinstance(v, dict):
        out = type(v)() if isinstance(v, OrderedDict) else {}
        out.update((k, _describe_tensors(x)) for k, x in v.items())
        return out
    if isinstance(v, (list, tuple)):
        return type(v)(_describe_tensors(x) for x in v) if type(v) in (list, tuple) \
            else [_describe_tensors(x) for x in v]
    return v


def run_legacy(args: argparse.Namespace) -> int:
    """Inspect a legacy .pt/safetensors file as ``convert`` would import it (allow-listed)."""
    from xla_ckpt.kinds.legacy import load_legacy_file  # noqa: PLC0415 - its unpickler needs torch

    legacy = load_legacy_file(args.uri, layout=args.layout)
    tree = _describe_tensors(legacy.state)
    summary = summarize({STATE_ITEM: tree})
    kind = ("fairseq " if legacy.fairseq else "") + legacy.kind
    if args.json:
        print(json.dumps(jsonable({"uri": args.uri, "legacy": kind, "metadata": legacy.metadata,
                                   "tree": tree, "summary": summary}), indent=2))
        return EXIT_OK
    print(f"legacy file {args.uri}  ({kind}; shown as `xla-ckpt convert --layout "
          f"{args.layout}` would import it)")
    for line in render(tree, "state", 1, args.depth):
        print(line)
    print("\nsummary:")
    for line in _summary_lines(summary):
        print("  " + line)
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    try:
        target = resolve_checkpoint(args.uri)
    except UsageError:  # not our format: a legacy file is shown as convert would import it
        from xla_ckpt.run.sniff import is_legacy_file  # noqa: PLC0415 - it imports torch

        if is_legacy_file(args.uri):
            return run_legacy(args)
        raise
    try:
        manifest = read_manifest(target.storage)
    finally:
        target.storage.close()
    trees = {name: decode_item(item, manifest) for name, item in manifest.items.items()}
    # chunk items hold the bytes of the global tensors the state shows: not counted twice
    summary = summarize({n: t for n, t in trees.items() if not _is_chunk_item(n)})
    if args.json:
        doc = {"uri": target.uri, "run": target.run_uri, "save_id": manifest.save_id,
               "version": manifest.version,
               "created_unix_s": manifest.created_unix_s, "world_size": manifest.world_size,
               "nbytes": manifest.nbytes, "files": manifest.files,
               "metadata": typed.decode(manifest.metadata) if manifest.metadata is not None
               else None,
               "global_tensors": [dict(key=g.key, **TensorInfo.of_global(g).to_json()["tensor"])
                                  for g in manifest.global_tensors],
               "items": {name: {"tensors": len(manifest.items[name].tensors),
                                "nbytes": manifest.items[name].nbytes,
                                "chunked": manifest.items[name].chunked, "tree": tree}
                         for name, tree in trees.items()},
               "summary": summary}
        print(json.dumps(jsonable(doc), indent=2, sort_keys=False))
        return EXIT_OK
    print("\n".join(_header(target, manifest)))
    chunk_items = [n for n in trees if _is_chunk_item(n)]
    for name, tree in trees.items():
        item = manifest.items[name]
        if _is_chunk_item(name):
            continue
        if item.chunked:
            print(f"\nitem {name!r}: chunked, {len(_refs(tree))} global tensors")
        else:
            print(f"\nitem {name!r}: {len(item.tensors)} tensors, {human_bytes(item.nbytes)}")
        for line in render(tree, "state", 1, args.depth):
            print(line)
    if chunk_items:
        items = [manifest.items[n] for n in chunk_items]
        span = chunk_items[0] if len(chunk_items) == 1 else \
            f"{chunk_items[0]} .. {chunk_items[-1]}"
        print(f"\nchunk items: {len(chunk_items)} ({span}), "
              f"{sum(len(i.tensors) for i in items)} chunk tensors, "
              f"{human_bytes(sum(i.nbytes for i in items))}")
    print("\nsummary:")
    for line in _summary_lines(summary):
        print("  " + line)
    return EXIT_OK


def _header(target: Target, m: Manifest) -> list[str]:
    lines = [f"checkpoint  {target.uri}" + (f"  (latest in {target.run_uri})"
                                            if target.run_uri else "")]
    lines.append(f"saved       {utc_time(m.created_unix_s)} UTC  save_id {m.save_id}  "
                 f"world_size {m.world_size if m.world_size is not None else '-'}")
    lines.append(f"data        {len(m.files)} files, {human_bytes(m.nbytes)}")
    if m.global_tensors:
        lines.append(f"global      {len(m.global_tensors)} tensors in "
                     f"{sum(len(g.chunks) for g in m.global_tensors)} chunks "
                     f"(manifest version {m.version})")
    if m.metadata is not None:
        lines.append(f"metadata    {short_repr(typed.decode(m.metadata), 100)}")
    return lines


def _is_chunk_item(name: str) -> bool:
    return name.startswith(CHUNK_ITEM_PREFIX)


def _refs(tree: Any) -> list[TensorInfo]:
    """The distinct global tensors under ``tree`` (a tied one once)."""
    return list({id(t): t for t in tensors_in(tree)}.values())


# ---- tree ---------------------------------------------------------------------------------


def _is_leaf(v: Any) -> bool:
    return not isinstance(v, (dict, list, tuple, set, frozenset, argparse.Namespace))


def _children(v: Any) -> list[tuple[str, Any]]:
    if isinstance(v, argparse.Namespace):
        return [(str(k), x) for k, x in vars(v).items()]
    if isinstance(v, dict):
        return [(k if isinstance(k, str) else repr(k), x) for k, x in v.items()]
    if isinstance(v, (set, frozenset)):
        return [(f"[{i}]", x) for i, x in enumerate(v)]
    return [(f"[{i}]", x) for i, x in enumerate(v)]


def _kind(v: Any) -> str:
    if isinstance(v, argparse.Namespace):
        return "Namespace"
    if isinstance(v, OrderedDict):
        return "OrderedDict"
    return type(v).__name__


def tensors_in(v: Any) -> list[TensorInfo]:
    """Every :class:`TensorInfo` under ``v``."""
    if isinstance(v, TensorInfo):
        return [v]
    if _is_leaf(v):
        return []
    out: list[TensorInfo] = []
    for _k, x in _children(v):
        out.extend(tensors_in(x))
    return out


def render(v: Any, name: str, indent: int, depth: int | None) -> list[str]:
    """Text lines of the tree under ``v`` (``depth`` levels; None = all)."""
    pad = "  " * indent
    if isinstance(v, TensorInfo):
        return [f"{pad}{name}  {v.describe()}"]
    if _is_leaf(v):
        return [f"{pad}{name}  {short_repr(v)}"]
    kids = _children(v)
    if kids and all(_is_leaf(x) and not isinstance(x, TensorInfo) for _k, x in kids):
        text = short_repr(v, 100)
        if not text.endswith("..."):
            return [f"{pad}{name}  {text}"]
    ts = tensors_in(v)
    extra = f", {len(ts)} tensors, {human_bytes(sum(t.nbytes for t in ts))}" if ts else ""
    n = len(kids)
    lines = [f"{pad}{name}  ({_kind(v)}, {n} entr{'y' if n == 1 else 'ies'}{extra})"]
    if depth is not None and depth <= 0:
        return lines
    for k, x in kids:
        lines.extend(render(x, k, indent + 1, None if depth is None else depth - 1))
    return lines


# ---- summary ------------------------------------------------------------------------------


def _get(d: Any, *path: Any) -> Any:
    for p in path:
        if isinstance(d, argparse.Namespace):
            d = vars(d)
        if isinstance(d, dict) and p in d:
            d = d[p]
        elif isinstance(d, list) and isinstance(p, int) and -len(d) <= p < len(d):
            d = d[p]
        else:
            return None
    return d


def _tensor_summary(v: Any) -> dict | None:
    ts = tensors_in(v)
    if not ts:
        return None
    return {"tensors": len(ts), "elements": sum(t.numel for t in ts),
            "nbytes": sum(t.nbytes for t in ts), "dtypes": sorted({t.dtype for t in ts})}


def summarize(trees: dict[str, Any]) -> dict:
    """Summary of a decoded checkpoint (fairseq layout where present); JSON-able values."""
    state = trees.get(STATE_ITEM)
    out: dict[str, Any] = {"all_tensors": _tensor_summary(list(trees.values()))}
    if not isinstance(state, dict):
        return out
    for key in ("model", "criterion"):
        if key in state:
            out[key] = _tensor_summary(state[key])
    last = _get(state, "optimizer_history", -1)
    opt = state.get("last_optimizer_state")
    if last is not None or opt is not None:
        groups = _get(opt, "param_groups")
        per_param = _get(opt, "state")
        hyper: dict[str, Any] = {}
        if isinstance(groups, list) and groups and isinstance(groups[0], dict):
            hyper = {k: v for k, v in groups[0].items()
                     if k != "params" and (_is_leaf(v) or isinstance(v, tuple))}
        state_keys: set[str] = set()
        if isinstance(per_param, dict):
            for s in per_param.values():
                if isinstance(s, dict):
                    state_keys.update(str(k) for k in s)
        out["optimizer"] = {
            "name": _get(last, "optimizer_name"),
            "criterion_name": _get(last, "criterion_name"),
            "param_groups": len(groups) if isinstance(groups, list) else None,
            "lr": [_get(g, "lr") for g in groups] if isinstance(groups, list) else None,
            "hyperparameters": hyper,
            "params_with_state": len(per_param) if isinstance(per_param, dict) else None,
            "state_keys": sorted(state_keys),
            "state_tensors": _tensor_summary(per_param),
        }
        out["lr_scheduler"] = _get(last, "lr_scheduler_state")
        out["num_updates"] = _get(last, "num_updates")
    extra = state.get("extra_state")
    if isinstance(extra, dict):
        out["train_iterator"] = extra.get("train_iterator")
        out["previous_training_time_s"] = extra.get("previous_training_time")
        metrics = extra.get("metrics")
        if isinstance(metrics, dict):
            out["metrics"] = [str(k) for k in metrics]
    ranks = {}
    for name, tree in trees.items():
        if name == STATE_ITEM:
            continue
        it = _get(tree, "train_iterator")
        if it is None:
            it = _get(tree, "extra_state", "train_iterator")
        ranks[name] = {"train_iterator": it, "tensors": _tensor_summary(tree)}
    if ranks:
        out["rank_items"] = ranks
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float) and math.isfinite(v):
        return f"{v:.6g}"
    return short_repr(v, 120)


def _tensors_line(s: dict | None) -> str:
    if not s:
        return "no tensors"
    return (f"{s['tensors']} tensors, {s['elements']:,} elements, {human_bytes(s['nbytes'])} "
            f"({', '.join(s['dtypes'])})")


def _summary_lines(s: dict) -> list[str]:
    lines = [f"tensors        {_tensors_line(s.get('all_tensors'))}"]
    if "model" in s:
        lines.append(f"model          {_tensors_line(s['model'])}")
    if "criterion" in s:
        lines.append(f"criterion      {_tensors_line(s['criterion'])}")
    opt = s.get("optimizer")
    if opt:
        lrs = opt["lr"]
        lr = ", ".join(_fmt(x) for x in lrs) if isinstance(lrs, list) else "-"
        lines.append(f"optimizer      {opt['name'] or '-'} "
                     f"(criterion {opt['criterion_name'] or '-'}), "
                     f"{opt['param_groups'] if opt['param_groups'] is not None else '-'} param "
                     f"groups, lr {lr}")
        if opt["hyperparameters"]:
            hp = ", ".join(f"{k}={_fmt(v)}" for k, v in opt["hyperparameters"].items() if k != "lr")
            if hp:
                lines.append(f"               {hp}")
        if opt["params_with_state"] is not None:
            lines.append(f"               state for {opt['params_with_state']} params "
                         f"({', '.join(opt['state_keys']) or 'empty'}); "
                         f"{_tensors_line(opt['state_tensors'])}")
    if "lr_scheduler" in s:
        lines.append(f"lr_scheduler   {_fmt(s['lr_scheduler'])}")
    if "num_updates" in s:
        lines.append(f"num_updates    {_fmt(s['num_updates'])}")
    if "train_iterator" in s:
        lines.append(f"train_iterator {_fmt(s['train_iterator'])}")
    if s.get("previous_training_time_s") is not None:
        lines.append(f"training_time  {_fmt(s['previous_training_time_s'])} s before this save")
    if "metrics" in s:
        lines.append(f"metrics        {', '.join(s['metrics']) or '-'}")
    for name, r in (s.get("rank_items") or {}).items():
        lines.append(f"{name}     iterator {_fmt(r['train_iterator'])}; "
                     f"{_tensors_line(r['tensors'])}")
    return lines
