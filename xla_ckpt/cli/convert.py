"""``xla-ckpt convert SRC DST``: import a legacy file into the xla_ckpt format.

SRC is a fairseq or plain ``torch.save`` ``.pt`` file, or an HF
``model.safetensors`` file; DST is the checkpoint folder to write.  Both may
be local paths or ``gs://`` URIs.  The kind is detected from the bytes.

``.pt`` files are unpickled with ``torch.load(weights_only=True)`` and an
explicit allow-list (argparse.Namespace, numpy scalars/dtypes/arrays, tensors);
any other class stops the conversion with its name.  ``--unsafe-trust-pickle``
lifts the allow-list for a file you trust, and warns: unpickling can run code.

Layouts: ``auto`` (default) upgrades fairseq checkpoints to the current fairseq
layout (optimizer_history, train_iterator, ...) and keeps anything else as it
is; ``fairseq`` insists on a fairseq checkpoint; ``raw`` keeps the object as it
is; ``model`` stores it as ``{"model": ...}`` (a bare state_dict or HF weights,
ready for the trainer restore).  A committed checkpoint at DST is replaced
only with ``--overwrite`` (atomically: the old one stays until the new commits).
"""

from __future__ import annotations

import argparse
import sys
import time

from xla_ckpt.cli.common import (
    EXIT_OK,
    Parents,
    Subparsers,
    UsageError,
    human_bytes,
    plain,
    progress_bar,
)
from xla_ckpt.io import save
from xla_ckpt.io.catalog import is_checkpoint
from xla_ckpt.io.legacy import load_legacy_file
from xla_ckpt.storage import open_storage


def register(sub: Subparsers, parents: Parents) -> None:
    p = sub.add_parser("convert", parents=parents,
                       help="import a fairseq/torch.save .pt or safetensors file",
                       description=plain(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help=".pt or .safetensors file (local or gs://)")
    p.add_argument("dst", metavar="DST", help="checkpoint folder to write (local or gs://)")
    p.add_argument("--layout", choices=("auto", "fairseq", "raw", "model"), default="auto",
                   help="how to store the loaded object (default: auto)")
    p.add_argument("--keep-numpy-scalars", action="store_true",
                   help="keep numpy scalars instead of converting them to Python numbers")
    p.add_argument("--unsafe-trust-pickle", action="store_true",
                   help="unpickle without the allow-list (runs any code in the file!)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a committed checkpoint at DST")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with open_storage(args.dst) as dst:
        if is_checkpoint(dst) and not args.overwrite:
            raise UsageError(f"{dst.uri} already holds a committed checkpoint; pass --overwrite "
                             "to replace it")
        if args.unsafe_trust_pickle:
            print("xla-ckpt convert: WARNING: --unsafe-trust-pickle: unpickling without the "
                  "allow-list runs any code the file holds; use it only on files you trust",
                  file=sys.stderr)
        t0 = time.perf_counter()
        bar = progress_bar(None, "read", enabled=False if args.no_progress else None)
        try:
            legacy = load_legacy_file(args.src, layout=args.layout,
                                      keep_numpy_scalars=args.keep_numpy_scalars,
                                      unsafe_trust_pickle=args.unsafe_trust_pickle,
                                      progress=bar.update)
        finally:
            bar.close()
        t1 = time.perf_counter()
        metadata = dict(legacy.metadata)
        metadata["converted_from"] = args.src
        manifest = save(legacy.state, dst.uri, metadata=metadata, storage=dst)
        t2 = time.perf_counter()
    tensors = sum(len(i.tensors) for i in manifest.items.values())
    kind = ("fairseq " if legacy.fairseq else "") + legacy.kind
    print(f"converted {args.src} ({kind}) -> {dst.uri}: {tensors} tensors, "
          f"{human_bytes(manifest.nbytes)}; read {t1 - t0:.2f} s, write {t2 - t1:.2f} s "
          f"({manifest.nbytes / max(t2 - t1, 1e-9) / 2**20:.0f} MiB/s)")
    return EXIT_OK
