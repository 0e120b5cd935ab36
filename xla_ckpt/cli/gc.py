"""``xla-ckpt gc RUN``: apply a retention policy to a run folder, collect interrupted writes.

fairseq semantics: keep the newest ``--keep-last`` committed checkpoints
(``keep_interval_updates``) and the ``--keep-best`` best by ``--metric`` from
their metadata (``keep_best_checkpoints``, lower is better unless
``--maximize``); a checkpoint either rule keeps stays, and a rule not given
keeps nothing by itself.  Whatever the policy says, checkpoints named by a pointer
and the newest committed one are kept.  Incomplete folders are deleted only
with ``--incomplete`` (one may be a save still in flight).

``--in-flight`` (implied by ``--incomplete``) deletes the in-flight objects
interrupted uploads left (the ``.tmp-<upload id>-part-<n>`` parts ``xla-ckpt ls``
shows as "in flight") once the newest part of the upload is older than ``--grace``
(default 1h); their bytes count in "freed".

Only what xla_ckpt wrote is deleted: pointers, manifests, ``data-<save id>-*``
files and the in-flight objects of those, directly in this run folder and its
checkpoint folders.  An incomplete folder holding anything else (a ``.pt``, a DCP
checkpoint, a folder copied from another run) is left alone, and so is such an
object inside a checkpoint folder.  On a local disk a checkpoint folder that gc
emptied is removed too; a folder still holding anything stays.  ``--dry-run`` only
prints what would happen.

``--local-dir DIR`` (on a host of the job) applies ``--keep-last`` to this host's local tier
of the run too, and ``--incomplete`` removes its uncommitted folders (:mod:`xla_ckpt.cli.local`).
"""

from __future__ import annotations

import argparse

from xla_ckpt.cli.common import EXIT_OK, Parents, Subparsers, UsageError, plain
from xla_ckpt.cli.local import add_local_options, collect_local, open_tier
from xla_ckpt.cli.rm import add_grace_option, print_result
from xla_ckpt.run.prune import collect_garbage
from xla_ckpt.run.retention import RetentionPolicy
from xla_ckpt.storage import open_storage


def register(sub: Subparsers, parents: Parents) -> None:
    p = sub.add_parser("gc", parents=parents,
                       help="apply a retention policy (keep-last/keep-best), collect "
                            "interrupted uploads",
                       description=plain(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("uri", metavar="RUN", help="run folder: local path or gs://bucket/prefix")
    p.add_argument("--keep-last", type=int, default=None, metavar="N",
                   help="newest committed checkpoints to keep (-1: all)")
    p.add_argument("--keep-best", type=int, default=None, metavar="N",
                   help="best committed checkpoints to keep by --metric (-1: all that have it)")
    p.add_argument("--metric", default="loss", help="metadata key ranking checkpoints (loss)")
    p.add_argument("--maximize", action="store_true", help="higher --metric is better")
    p.add_argument("--incomplete", action="store_true",
                   help="also delete incomplete folders (no commit marker) and in-flight objects")
    p.add_argument("--in-flight", action="store_true",
                   help="delete in-flight objects of interrupted uploads older than --grace")
    add_grace_option(p)
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted")
    add_local_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.keep_last is None and args.keep_best is None:
        if not (args.incomplete or args.in_flight):
            raise UsageError("nothing to do: pass --keep-last N, --keep-best N, --incomplete "
                             "and/or --in-flight")
        keep_last, keep_best = -1, -1  # only incomplete folders / in-flight objects go
    else:  # a rule not given keeps nothing by itself: the given rule decides
        keep_last = 0 if args.keep_last is None else args.keep_last
        keep_best = 0 if args.keep_best is None else args.keep_best
    policy = RetentionPolicy(keep_last=keep_last, keep_best=keep_best, metric=args.metric,
                             maximize=args.maximize)
    with open_storage(args.uri) as st:
        now = st.now_unix_s()  # in-flight ages by the store's own clock, not this host's
        result = collect_garbage(st, policy, delete_incomplete=args.incomplete,
                                 delete_in_flight=args.incomplete or args.in_flight,
                                 grace_s=args.grace, dry_run=args.dry_run, now=now)
        uri = st.uri
    print_result(result, now)
    tier = open_tier(args, uri)
    if tier is not None:
        gone = collect_local(tier, keep_last=keep_last if keep_last >= 0 else 1 << 30,
                             incomplete=args.incomplete, dry_run=args.dry_run)
        spare = tier.spare_bytes()  # files kept for the next save to recycle: no checkpoint
        if spare and not args.dry_run:
            tier.drop_spares()
        print(f"local tier of host {tier.host} ({tier.folder}): "
              f"{'would delete' if args.dry_run else 'deleted'} {len(gone)} folder(s)"
              + (f": {', '.join(gone)}" if gone else "")
              + (f"; and {spare} bytes of spare files" if spare else ""))
    return EXIT_OK
