"""``xla-ckpt convert SRC DST``: bring a checkpoint into the xla_ckpt format, or out as DCP.

SRC is a fairseq or plain ``torch.save`` ``.pt`` file, an HF ``model.safetensors``
file, an HF ``model.safetensors.index.json`` (or the folder holding it), a PyTorch
DCP checkpoint folder (also what torch_xla's ``CheckpointManager`` writes per
step), or a whole fairseq run folder; DST is the checkpoint folder (run folder for
a run folder) to write.  Both may be local paths or ``gs://`` URIs.  The kind is
detected from the names and bytes.  ``--to dcp`` goes the other way: SRC is
anything ``xla_ckpt.load`` reads, DST the DCP folder to write.

A fairseq run folder (``checkpoint1.pt``, ``checkpoint_2_500.pt``,
``checkpoint_last.pt``, ``checkpoint_best.pt``, ...) becomes a run folder: each
distinct file (by size and crc32c) is converted once, into the folder named after
it; ``checkpoint_last.pt`` / ``checkpoint_best.pt``, byte copies of another file
in fairseq, become the ``checkpoint_last`` / ``checkpoint_best`` pointers to it (a
copy of nothing is converted as its own checkpoint), so ``xla_ckpt.load(DST)`` and
the CheckpointManager restore what fairseq would: the checkpoint checkpoint_last.pt
held, even when a checkpoint with more updates is there (the stale branch of a run
restarted from an earlier checkpoint).  A pointer written by convert records no
lease epoch, and only a newer checkpoint saved by a CheckpointManager outranks it.
DST may be SRC itself.  A rerun skips what was already converted from the same
bytes (and finds the pointers already right).  Parts of a sharded fairseq
checkpoint (checkpoint_last-shard0.pt, -model_part-N, -rank-N) are refused: merge
them first.

``.pt`` files are unpickled with ``torch.load(weights_only=True)`` and an
explicit allow-list (argparse.Namespace, numpy scalars/dtypes/arrays, tensors);
any other class stops the conversion with its name.  ``--unsafe-trust-pickle``
lifts the allow-list for a file you trust, and warns: unpickling can run code.

Layouts: ``auto`` (default) and ``raw`` store the object exactly as saved, key for
key and type for type (``auto`` also recognises a fairseq checkpoint by fairseq's
own fields and records its num_updates/epoch/loss in the manifest metadata);
``fairseq`` insists on a fairseq checkpoint and upgrades an old one to the current
fairseq layout (optimizer_history, last_optimizer_state, extra_state with
train_iterator; each change is printed as a WARNING); ``model`` stores it as
``{"model": ...}`` (a bare state_dict or HF weights, ready for the trainer restore; a
training dict holding a ``model`` entry is refused: use auto).  The trainer restore
(:class:`~xla_ckpt.trainer.Checkpointer`) upgrades an old fairseq layout itself, so
``auto`` is right for it too.

DST must not be SRC or inside it (a fairseq run folder may be converted in
place), and a DST that holds a checkpoint of any kind
(manifest.json, DCP .metadata, HF weights, a .pt, a run folder of them) is refused
unless --overwrite; --overwrite replaces only a checkpoint of the kind written
(atomically: the old one stays until the new commits).  Exit code 2 for all of
these.
"""

from __future__ import annotations

import argparse
import sys
import time

from xla_ckpt.api import save
from xla_ckpt.cli.common import (
    EXIT_OK,
    Parents,
    Subparsers,
    UsageError,
    human_bytes,
    plain,
    progress_bar,
)
from xla_ckpt.cli.export import summary
from xla_ckpt.errors import CheckpointNotFoundError
from xla_ckpt.kinds.export import RANK_STATES, check_destination, export
from xla_ckpt.kinds.foreign import read_foreign
from xla_ckpt.kinds.legacy import (
    convert_legacy_run,
    is_single_object,
    legacy_run_files,
    load_legacy_file,
)
from xla_ckpt.run.catalog import is_checkpoint
from xla_ckpt.run.resolve import Resolved, resolve
from xla_ckpt.run.sniff import LEGACY, XLA_CKPT
from xla_ckpt.storage import open_storage


def register(sub: Subparsers, parents: Parents) -> None:
    p = sub.add_parser("convert", parents=parents,
                       help="import a .pt, safetensors, HF index, DCP checkpoint or fairseq run "
                            "folder (or write DCP with --to dcp)",
                       description=plain(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="what to convert (local or gs://)")
    p.add_argument("dst", metavar="DST", help="checkpoint (or run) folder to write")
    p.add_argument("--to", choices=("xla_ckpt", "dcp"), default="xla_ckpt",
                   help="what to write (default: xla_ckpt)")
    p.add_argument("--layout", choices=("auto", "fairseq", "raw", "model"), default="auto",
                   help="how to store the loaded object: auto/raw as saved, fairseq "
                        "upgrades an old fairseq layout, model wraps a bare state_dict "
                        "(default: auto)")
    p.add_argument("--keep-numpy-scalars", action="store_true",
                   help="keep numpy scalars instead of converting them to Python numbers")
    p.add_argument("--unsafe-trust-pickle", action="store_true",
                   help="unpickle without the allow-list (runs any code in the file!)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a committed checkpoint at DST")
    p.add_argument("--rank-states", choices=RANK_STATES, default="error",
                   help="--to dcp: per-rank items rank/<r>: error (default: refuse, naming "
                        "them), nest (as state['rank_states'][r]) or drop (left out, noted)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.to == "dcp":
        return _to_dcp(args)
    if args.unsafe_trust_pickle:
        print("xla-ckpt convert: WARNING: --unsafe-trust-pickle: unpickling without the "
              "allow-list runs any code the file holds; use it only on files you trust",
              file=sys.stderr)
    with open_storage(args.src) as src:
        is_run = bool(legacy_run_files(src)) and not is_checkpoint(src)
    if is_run:
        return _run_folder(args)
    check_destination(args.src, args.dst, writes="xla_ckpt", overwrite=args.overwrite)
    with open_storage(args.dst) as dst:
        resolved = _resolve_src(args.src)
        if resolved.kind == XLA_CKPT:
            raise UsageError(f"{resolved.checkpoint} is already an xla_ckpt checkpoint; write "
                             f"it as DCP with `xla-ckpt convert {args.src} DST --to dcp`, or "
                             "as .pt/safetensors with `xla-ckpt export`")
        t0 = time.perf_counter()
        bar = progress_bar(None, "read", enabled=False if args.no_progress else None)
        try:
            if resolved.kind == LEGACY:
                legacy = load_legacy_file(resolved.checkpoint, layout=args.layout,
                                          keep_numpy_scalars=args.keep_numpy_scalars,
                                          unsafe_trust_pickle=args.unsafe_trust_pickle,
                                          progress=bar.update)
                state, metadata = legacy.state, dict(legacy.metadata)
                kind = ("fairseq " if legacy.fairseq else "") + legacy.kind + \
                    (f", upgraded: {len(legacy.upgraded)} change(s)" if legacy.upgraded else "")
            else:
                if args.layout == "fairseq":
                    raise UsageError(f"{resolved.checkpoint} is {resolved.what}, not a fairseq "
                                     ".pt; pass --layout auto, raw or model")
                state = read_foreign(resolved, progress=bar.update)
                if args.layout == "model":
                    state = {"model": state}
                metadata = {"source_format": resolved.kind}
                kind = resolved.kind
        finally:
            bar.close()
        t1 = time.perf_counter()
        metadata["converted_from"] = resolved.checkpoint
        wbar = progress_bar(None, "write", enabled=False if args.no_progress else None)
        try:
            manifest = save(state, dst.uri, metadata=metadata, storage=dst, progress=wbar.update)
        finally:
            wbar.close()
        t2 = time.perf_counter()
    tensors = sum(len(i.tensors) for i in manifest.items.values())
    print(f"converted {args.src} ({kind}) -> {dst.uri}: {tensors} tensors, "
          f"{human_bytes(manifest.nbytes)}; read {t1 - t0:.2f} s, write {t2 - t1:.2f} s "
          f"({manifest.nbytes / max(t2 - t1, 1e-9) / 2**20:.0f} MiB/s)")
    return EXIT_OK


def _resolve_src(src: str) -> Resolved:
    """What SRC names; a single object no kind claims is read as a legacy file (whose
    importer then says exactly what is wrong with it: exit 1, a corrupt source)."""
    try:
        return resolve(src)
    except CheckpointNotFoundError:
        if not is_single_object(src):
            raise
        return Resolved(uri=src, checkpoint=src, kind=LEGACY)


def _run_folder(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    bar = progress_bar(None, "read", enabled=False if args.no_progress else None)
    try:
        report = convert_legacy_run(args.src, args.dst, layout=args.layout,
                                    keep_numpy_scalars=args.keep_numpy_scalars,
                                    unsafe_trust_pickle=args.unsafe_trust_pickle,
                                    overwrite=args.overwrite, progress=bar.update)
    finally:
        bar.close()
    dt = time.perf_counter() - t0
    done = [f for f in report.files if f.copy_of is None and not f.skipped]
    print(f"converted run folder {report.src} -> {report.dst}: {len(done)} checkpoints "
          f"({human_bytes(report.nbytes)}) in {dt:.2f} s; xla_ckpt.load({report.dst}) -> "
          f"{report.latest}")
    for f in report.files:
        if f.copy_of is not None:
            what = f"same bytes as {f.copy_of}"
        elif f.skipped:
            what = "already converted"
        else:
            what = "converted"
        pointer = next((f" (checkpoint_{w})" for w, n in report.pointers.items()
                        if n == f.checkpoint and f.source == f"checkpoint_{w}.pt"), "")
        print(f"  {f.source} -> {f.checkpoint}{pointer}: {what}, updates {f.num_updates}")
    return EXIT_OK


def _to_dcp(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    report = export(args.src, args.dst, fmt="dcp", overwrite=args.overwrite,
                    rank_states=args.rank_states)
    print(summary(args.src, report, time.perf_counter() - t0))
    return EXIT_OK
