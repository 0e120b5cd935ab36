"""``xla-ckpt rm``: delete named checkpoints of a run folder, safely.

Forms: ``xla-ckpt rm RUN NAME [NAME ...]`` or ``xla-ckpt rm RUN/NAME``.
A checkpoint named by the ``checkpoint_last``/``checkpoint_best`` pointer, and
the newest committed checkpoint, are never deleted (they are reported as
kept, and the exit code is 1).  The manifest (commit marker) goes first, so
an interrupted ``rm`` leaves an incomplete folder, never a broken committed
one.  ``--dry-run`` only prints what would happen.
"""

from __future__ import annotations

import argparse

from xla_ckpt.cli.common import EXIT_FAILED, EXIT_OK, Parents, Subparsers, human_bytes, plain
from xla_ckpt.io.legacy import split_uri
from xla_ckpt.io.prune import RemovalResult, remove_checkpoints
from xla_ckpt.storage import open_storage


def register(sub: Subparsers, parents: Parents) -> None:
    p = sub.add_parser("rm", parents=parents,
                       help="delete named checkpoints (never protected ones)",
                       description=plain(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("uri", metavar="URI", help="run folder (with NAMEs) or one checkpoint folder")
    p.add_argument("names", metavar="NAME", nargs="*", help="checkpoint folder names in the run")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted")
    p.set_defaults(func=run)


def print_result(result: RemovalResult) -> None:
    verb = "would delete" if result.dry_run else "deleted"
    for name in result.deleted:
        print(f"{verb} {name}")
    for name, why in result.refused.items():
        print(f"kept {name}: {why}")
    print(f"{'would free' if result.dry_run else 'freed'} {human_bytes(result.bytes_freed)} "
          f"({len(result.deleted)} checkpoints{', dry run' if result.dry_run else ''})")


def run(args: argparse.Namespace) -> int:
    if args.names:
        run_uri, names = args.uri, list(args.names)
    else:
        run_uri, name = split_uri(args.uri)
        names = [name]
    with open_storage(run_uri) as st:
        result = remove_checkpoints(st, names, dry_run=args.dry_run)
    print_result(result)
    return EXIT_FAILED if result.refused else EXIT_OK
