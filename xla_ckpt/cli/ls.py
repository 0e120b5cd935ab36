"""``xla-ckpt ls RUN``: committed checkpoints of a run folder, their pointers, and incomplete ones.

Columns: NAME; EPOCH (the saver's ``epoch`` metadata, else the epoch in the manager's folder
name ``checkpoint_<epoch>_<updates>`` / ``checkpoint<epoch>``); STEP (the step
``CheckpointManager.all_steps()`` lists and ``restore(step=...)`` takes: the saver's
``num_updates`` metadata, else its ``step`` metadata, else the updates in the manager's
folder name); ITER (``iterations_in_epoch``: batches done in the epoch, which the
fairseq-style ``Checkpointer`` records and the manager does not know); LOSS (``loss``
metadata, e.g. the manager's ``metrics={"loss": ...}``); SIZE (bytes of data files); SAVED
(UTC); POINTERS (``last``/``best`` when a pointer names it).  ``-``: the checkpoint does not
record it (a plain ``xla_ckpt.save`` without metadata, under a name of its own).  Folders
without a commit marker are listed apart: a restore never uses them.  Folders whose commit
marker is present but cannot be used (a corrupt manifest, a hostile chunk table, a format
version newer than this xla_ckpt reads) are listed apart again, as "committed but
unreadable", each with its reason: they are not incomplete saves (upgrade xla_ckpt, or run
``xla-ckpt verify`` on them); ``gc`` leaves them alone and a restore skips them. Checkpoints
of another kind in the run folder (a PyTorch DCP step folder with its ``.metadata``, an HF
model folder, a fairseq ``checkpoint_last.pt``) are listed apart too, with their kind: they
are not incomplete saves, ``rm``/``gc`` never delete them, ``xla_ckpt.load`` and ``xla-ckpt
convert`` read them.

In-flight objects that interrupted uploads of this library left (upload parts
named ``<file>.tmp-<upload id>-part-<n>``, which no other listing shows) are
listed under "in flight", one line per interrupted upload with its objects,
bytes and age, once the newest of them is older than ``--grace`` (default 1h;
younger ones may be a save still writing and are only counted).
``xla-ckpt gc RUN --in-flight`` deletes them.

``--local-dir DIR`` (on a host of the job) lists this host's local tier of the run too
(:mod:`xla_ckpt.cli.local`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Any

from xla_ckpt.cli.common import (
    EXIT_OK,
    Parents,
    Subparsers,
    human_bytes,
    jsonable,
    plain,
    table,
    utc_time,
)
from xla_ckpt.cli.local import add_local_options, listing, open_tier, print_listing
from xla_ckpt.cli.rm import add_grace_option, describe_upload, exact_bytes, human_age
from xla_ckpt.errors import CheckpointNotFoundError
from xla_ckpt.io.names import name_fields
from xla_ckpt.run.catalog import POINTERS, CheckpointEntry, list_run, read_pointer
from xla_ckpt.run.prune import in_flight_uploads
from xla_ckpt.run.retention import InFlightUpload, check_grace
from xla_ckpt.storage import open_storage, parse_uri


def register(sub: Subparsers, parents: Parents) -> None:
    p = sub.add_parser("ls", parents=parents, help="list checkpoints of a run folder",
                       description=plain(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("uri", metavar="RUN", help="run folder: local path or gs://bucket/prefix")
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    add_grace_option(p)
    add_local_options(p)
    p.set_defaults(func=run)


def _meta(entry: CheckpointEntry, key: str) -> Any:
    md = entry.metadata if isinstance(entry.metadata, dict) else {}
    v = md.get(key)
    return None if isinstance(v, bool) else v


def _num(v: Any) -> str:
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float) and math.isfinite(v):
        return f"{v:.4g}"
    return "-"


def _epoch(entry: CheckpointEntry) -> Any:
    epoch = _meta(entry, "epoch")
    fields = name_fields(entry.name)
    return epoch if epoch is not None or fields is None else fields[0]


def _step(entry: CheckpointEntry) -> Any:
    """The manager's step (its ``all_steps()``): ``num_updates``, else ``step`` metadata, else
    the updates the manager's folder name records."""
    for key in ("num_updates", "step"):
        value = _meta(entry, key)
        if value is not None:
            return value
    fields = name_fields(entry.name)
    return None if fields is None else fields[1]


def run(args: argparse.Namespace) -> int:
    target = parse_uri(args.uri)  # refuses s3://, gs:/b/x, ... as every command does
    if target.is_local and not os.path.isdir(os.path.expanduser(target.path)):
        raise CheckpointNotFoundError(f"{target.path}: no such folder")
    grace_s = check_grace(args.grace)
    with open_storage(args.uri) as st:
        entries, others = list_run(st)
        pointers = {w: read_pointer(st, w) for w in POINTERS}
        uploads = in_flight_uploads(st)
        now = st.now_unix_s() if uploads else time.time()  # ages by the store's own clock
        uri = st.uri
    tier = open_tier(args, uri)
    local_rows = listing(tier) if tier is not None else None
    stale = [u for u in uploads if u.stale(grace_s, now)]
    young = [u for u in uploads if not u.stale(grace_s, now)]
    named: dict[str, list[str]] = {}
    for which, name in pointers.items():
        if name is not None:
            named.setdefault(name, []).append(which)
    committed = [e for e in entries if e.committed]
    unreadable = [e for e in entries if e.unreadable]
    incomplete = [e for e in entries if not e.committed and not e.kind and not e.unreadable]
    if args.json:
        doc = _as_json(uri, committed, incomplete, pointers, named)
        doc["unreadable"] = [{"name": e.name, "reason": e.reason, "error": e.error}
                             for e in unreadable]
        doc["other_kinds"] = [{"name": n, "kind": kind} for n, kind in others]
        doc["in_flight_grace_s"] = grace_s
        doc["in_flight"] = [_upload_json(u, now, grace_s) for u in uploads]
        if tier is not None:
            doc["local"] = {"host": tier.host, "folder": tier.folder, "checkpoints": local_rows}
        print(json.dumps(jsonable(doc), indent=2, sort_keys=True))
        return EXIT_OK
    n_stale = sum(len(u.objects) for u in stale)
    print(f"{uri}: {len(committed)} committed, {len(incomplete)} incomplete"
          + (f", {len(unreadable)} committed but unreadable" if unreadable else "")
          + (f", {len(others)} of another kind" if others else "")
          + (f", {n_stale} in flight ({exact_bytes(sum(u.nbytes for u in stale))})"
             if stale else ""))
    if committed:
        rows = [[e.name, _num(_epoch(e)), _num(_step(e)), _num(_meta(e, "iterations_in_epoch")),
                 _num(_meta(e, "loss")), human_bytes(e.nbytes),
                 utc_time(e.manifest.created_unix_s if e.manifest else 0.0),
                 ",".join(named.get(e.name, []))] for e in committed]
        print(table(rows, ["NAME", "EPOCH", "STEP", "ITER", "LOSS", "SIZE", "SAVED (UTC)",
                           "POINTERS"]))
    for which, name in pointers.items():
        if name is not None and name not in {e.name for e in committed}:
            print(f"warning: pointer checkpoint_{which} names {name!r}, which is not a committed "
                  "checkpoint (restores ignore it)")
    if unreadable:
        print("committed but unreadable (a manifest is present but cannot be used: corrupt, "
              "or written by a newer xla_ckpt; never restored, gc leaves them; not incomplete "
              "saves: upgrade xla_ckpt or run `xla-ckpt verify`):")
        for e in unreadable:
            print(f"  {e.name}  ({e.reason})")
    if incomplete:
        print("incomplete (no commit marker; never restored):")
        for e in incomplete:
            print(f"  {e.name}" + (f"  ({e.error})" if e.error else ""))
    if others:
        print("of another kind (not written by xla_ckpt; rm/gc never delete them; "
              "xla_ckpt.load and `xla-ckpt convert` read them):")
        for n, kind in others:
            print(f"  {n}  ({kind})")
    if stale:
        print(f"in flight (left by interrupted uploads, older than {human_age(grace_s)}; "
              "`xla-ckpt gc --in-flight` deletes them):")
        for u in stale:
            print(f"  {describe_upload(u, now)}")
    if young:
        print(f"in flight for less than {human_age(grace_s)} (a save may still be writing "
              f"them): {sum(len(u.objects) for u in young)} objects, "
              f"{exact_bytes(sum(u.nbytes for u in young))}")
    if tier is not None and local_rows is not None:
        print_listing(tier, local_rows)
    return EXIT_OK


def _upload_json(u: InFlightUpload, now: float, grace_s: float) -> dict:
    return {"target": u.target, "upload_id": u.upload_id, "objects": [o.name for o in u.objects],
            "nbytes": u.nbytes, "age_s": u.age_s(now), "collectable": u.stale(grace_s, now)}


def _as_json(uri: str, committed: list[CheckpointEntry], incomplete: list[CheckpointEntry],
             pointers: dict[str, str | None], named: dict[str, list[str]]) -> dict:
    def md(e: CheckpointEntry) -> dict:
        m = e.metadata if isinstance(e.metadata, dict) else {}
        return {str(k): v for k, v in m.items()
                if v is None or isinstance(v, (bool, int, float, str))}  # scalars only

    return {
        "uri": uri,
        "pointers": {w: n for w, n in pointers.items()},
        "committed": [{"name": e.name, "epoch": _epoch(e), "step": _step(e),
                       "num_updates": _meta(e, "num_updates"),
                       "iterations_in_epoch": _meta(e, "iterations_in_epoch"),
                       "loss": _meta(e, "loss"),
                       "nbytes": e.nbytes, "save_id": e.manifest.save_id if e.manifest else None,
                       "created_unix_s": e.manifest.created_unix_s if e.manifest else None,
                       "pointers": named.get(e.name, []), "metadata": md(e)}
                      for e in committed],
        "incomplete": [{"name": e.name, "error": e.error} for e in incomplete],
    }
