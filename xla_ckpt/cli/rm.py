"""``xla-ckpt rm``: delete named checkpoints of a run folder, safely.

Forms: ``xla-ckpt rm RUN NAME [NAME ...]`` or ``xla-ckpt rm RUN/NAME``.
A checkpoint named by the ``checkpoint_last``/``checkpoint_best`` pointer, and
the newest committed checkpoint, are not deleted (they are reported as kept, with
the newest intact committed checkpoint that would stay and how to restore it, and
the exit code is 1) unless ``--force`` is given: for a corrupt newest checkpoint,
``--force`` removes it and moves ``checkpoint_last`` back, by compare-and-swap, to
the newest committed checkpoint that stays whose data files are all there at their
sizes; a ``checkpoint_best`` naming it is removed (the next scored save sets it
again).  ``--force`` takes no lease, so it never fences a live job: a save that moved
a pointer meanwhile wins, and a live job's next save moves ``checkpoint_last``
forward as usual.  It refuses when no intact committed checkpoint would stay.
The manifest (commit marker) goes first, so
an interrupted ``rm`` leaves an incomplete folder, never a broken committed
one.  In-flight objects of an interrupted upload in a named folder (what
``xla-ckpt ls`` shows as "in flight") go too once they are older than
``--grace`` (default 1h), as ``xla-ckpt gc --in-flight`` would delete them; a
folder holding only younger ones is kept, saying so.  On a local disk a folder
rm emptied is removed too.  ``--dry-run`` only prints what would happen.
"""

from __future__ import annotations

import argparse
import math
import re
import time

from xla_ckpt.cli.common import EXIT_FAILED, EXIT_OK, Parents, Subparsers, human_bytes, plain
from xla_ckpt.run.prune import RemovalResult, remove_checkpoints
from xla_ckpt.run.retention import DEFAULT_IN_FLIGHT_GRACE_S, InFlightUpload
from xla_ckpt.storage import open_storage
from xla_ckpt.storage.uri import split_uri

_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|sec|m|min|h|d)?\s*", re.IGNORECASE)
_UNIT_S = {"": 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def duration_s(text: str) -> float:
    """``"90"``/``"90s"`` -> 90.0, ``"30m"`` -> 1800.0, ``"1h"``, ``"2d"`` (argparse type)."""
    m = _DURATION.fullmatch(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (seconds, or with s/m/h/d: "
                                         "0, 90s, 30m, 1h, 2d)")
    return float(m.group(1)) * _UNIT_S[(m.group(2) or "").lower()]


def add_grace_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grace", type=duration_s, default=DEFAULT_IN_FLIGHT_GRACE_S,
                   metavar="DURATION",
                   help="in-flight objects of an interrupted upload count as left over once "
                        "the newest of its parts is this old (default 1h; 0, 90s, 30m, 2d)")


def human_age(seconds: float | None) -> str:
    """``42`` -> ``"42 s"``, ``5400`` -> ``"1.5 h"``; ``None`` -> ``"age unknown"``."""
    if seconds is None or not math.isfinite(seconds):
        return "age unknown"
    s = max(0.0, seconds)
    if s < 120:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def exact_bytes(n: int) -> str:
    """``512`` -> ``"512 B"``, ``1536`` -> ``"1.5 KiB = 1536 B"``."""
    return human_bytes(n) if n < 1024 else f"{human_bytes(n)} = {n} B"


def describe_upload(up: InFlightUpload, now: float) -> str:
    """``ck/data-...: 26 objects, 832.0 MiB = 872415232 B, 2.1 h old (upload 0123456789ab)``."""
    n = len(up.objects)
    return (f"{up.target}: {n} object{'s' if n != 1 else ''}, {exact_bytes(up.nbytes)}, "
            f"{human_age(up.age_s(now))} old (upload {up.upload_id})")


def register(sub: Subparsers, parents: Parents) -> None:
    p = sub.add_parser("rm", parents=parents,
                       help="delete named checkpoints (never protected ones)",
                       description=plain(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("uri", metavar="URI", help="run folder (with NAMEs) or one checkpoint folder")
    p.add_argument("names", metavar="NAME", nargs="*", help="checkpoint folder names in the run")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted")
    p.add_argument("--force", action="store_true",
                   help="also remove a checkpoint a pointer names or the newest committed one "
                        "(a corrupt newest checkpoint): checkpoint_last moves back to the "
                        "newest intact committed checkpoint that stays")
    add_grace_option(p)
    p.set_defaults(func=run)


def print_result(result: RemovalResult, now: float | None = None) -> None:
    now = time.time() if now is None else now
    verb = "would delete" if result.dry_run else "deleted"
    for name in result.deleted:
        print(f"{verb} {name}")
    for line in result.repointed:
        print(line)
    for up in result.in_flight:
        print(f"{verb} in-flight {describe_upload(up, now)}")
    for name, why in result.refused.items():
        print(f"kept {name}: {why}")
    for name, objs in result.left.items():
        print(f"left {len(objs)} object(s) xla_ckpt did not write in {name} (e.g. {objs[0]})")
    young = result.in_flight_young
    if young:
        print(f"kept {sum(len(u.objects) for u in young)} in-flight object(s) "
              f"({exact_bytes(sum(u.nbytes for u in young))}) younger than the grace period "
              f"({human_age(result.grace_s)}): a save may still be writing them")
    extra = f", {result.in_flight_objects} in-flight objects" if result.in_flight else ""
    print(f"{'would free' if result.dry_run else 'freed'} {exact_bytes(result.bytes_freed)} "
          f"({len(result.deleted)} checkpoints{extra}{', dry run' if result.dry_run else ''})")


def run(args: argparse.Namespace) -> int:
    if args.names:
        run_uri, names = args.uri, list(args.names)
    else:
        run_uri, name = split_uri(args.uri)
        names = [name]
    with open_storage(run_uri) as st:
        now = st.now_unix_s()  # in-flight ages by the store's own clock, not this host's
        result = remove_checkpoints(st, names, dry_run=args.dry_run, grace_s=args.grace, now=now,
                                    force=args.force)
    print_result(result, now)
    return EXIT_FAILED if result.refused else EXIT_OK
