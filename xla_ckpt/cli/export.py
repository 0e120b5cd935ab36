"""``xla-ckpt export URI DST --format pt|safetensors|dcp``: write a checkpoint for other tools.

URI is anything ``xla_ckpt.load`` reads: an xla_ckpt checkpoint or run folder
(its latest), a legacy .pt, HF safetensors, a PyTorch DCP folder.  Local paths
and gs:// URIs both ways.

  pt           one torch.save file at DST, the whole state (fairseq layout kept;
               tied weights stay tied).  torch.load(DST, weights_only=True) reads
               it; a state holding argparse.Namespace (fairseq args) or numpy
               values needs them allowed (printed), as any fairseq file does.
  safetensors  the model weights (state["model"], or a state of tensors only;
               --key NAME picks another entry) as an HF model folder DST:
               model.safetensors, or shards + model.safetensors.index.json with
               --max-shard-size; every dtype kept.  A tied weight (the very same
               tensor under two names) is dropped after an equality check and
               recorded in the file metadata, as safetensors' save_model does;
               from_pretrained re-ties it.  --hf-config PATH copies config.json
               into DST so AutoModel.from_pretrained(DST) works; else supply it.
  dcp          the whole state as a torch.distributed.checkpoint folder.

Per-rank items (rank/<r>: each rank's own iterator position and RNG state, saved with
rank_states / rank_extra_state) are not part of the state xla_ckpt.load returns, and are
never left out silently: pt and dcp refuse a checkpoint holding them (naming them, exit 2)
unless --rank-states says what to do: nest writes them inside the state, as
torch.load(DST)["rank_states"][r]; drop leaves them out (printed as a note).
safetensors writes the model weights only; what it leaves out (optimizer, per-rank
items, other entries) is printed as a note.

DST must not be URI or inside it.  A DST that holds a checkpoint of any kind
(manifest.json, DCP .metadata, HF weights, a file) is refused unless --overwrite,
which replaces only output of the kind written: a .pt file, a DCP folder, or an
earlier HF export, whose model.safetensors, index and shards are all removed (the
entry points first, so an interrupted export is never a mix of old and new
weights).  Exit code 2 for all of these.  Every tie found and what was done with
it is printed.
"""

from __future__ import annotations

import argparse
import time

from xla_ckpt.cli.common import EXIT_OK, Parents, Subparsers, human_bytes, plain, progress_bar
from xla_ckpt.kinds.export import FORMATS, RANK_STATES, ExportReport, export, parse_size


def register(sub: Subparsers, parents: Parents) -> None:
    p = sub.add_parser("export", parents=parents,
                       help="write a checkpoint as a torch.save .pt, HF safetensors or DCP",
                       description=plain(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("uri", metavar="URI", help="what to export (local or gs://)")
    p.add_argument("dst", metavar="DST", help="file (pt) or folder (safetensors, dcp) to write")
    p.add_argument("--format", required=True, choices=FORMATS, help="what to write")
    p.add_argument("--key", default="auto",
                   help="safetensors: the state entry holding the weights (default: auto)")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="safetensors: shard above SIZE bytes per file (e.g. 5GB, 500MB, 10MiB)")
    p.add_argument("--hf-config", default=None, metavar="PATH",
                   help="safetensors: a config.json (or a folder holding one) to copy into DST")
    p.add_argument("--rank-states", default="error", choices=RANK_STATES,
                   help="per-rank items rank/<r> (pt, dcp): error (default: refuse, naming "
                        "them), nest (as state['rank_states'][r]) or drop (left out, noted)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    shard = parse_size(args.max_shard_size) if args.max_shard_size else None
    t0 = time.perf_counter()
    bar = progress_bar(None, "export", enabled=False if args.no_progress else None)
    try:
        report = export(args.uri, args.dst, fmt=args.format, key=args.key,
                        max_shard_size_bytes=shard, hf_config=args.hf_config,
                        overwrite=args.overwrite, progress=bar.update,
                        rank_states=args.rank_states)
    finally:
        bar.close()
    print(summary(args.uri, report, time.perf_counter() - t0))
    return EXIT_OK


def summary(uri: str, report: ExportReport, seconds: float) -> str:
    """The lines ``export`` (and ``convert --to dcp``) print about what was written."""
    dtypes = ", ".join(f"{k} {v}" for k, v in sorted(report.dtypes.items()))
    lines = [(f"exported {uri} -> {report.dst} ({report.format}): {report.tensors} tensors "
              f"({dtypes}), {human_bytes(report.nbytes)}, {len(report.files)} "
              f"file{'s' if len(report.files) != 1 else ''}; {seconds:.2f} s "
              f"({report.nbytes / max(seconds, 1e-9) / 2**20:.0f} MiB/s)")]
    lines += [f"  tie: {t.describe()}" for t in report.ties]
    lines += [f"  note: {n}" for n in report.notes]
    if report.safe_globals:
        lines.append("  read it with: with torch.serialization.safe_globals(["
                     f"{', '.join(report.safe_globals)}]): torch.load(PATH, weights_only=True)")
    return "\n".join(lines)
