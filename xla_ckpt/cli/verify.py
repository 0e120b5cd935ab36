"""``xla-ckpt verify URI``: recompute every crc32c of a checkpoint, in parallel.

URI is a checkpoint folder, or a run folder (its latest committed checkpoint).
Every blob of every item is read in byte-range slices on a thread pool and
checked against the manifest's chunk and whole-blob crc32c; missing or
resized data files, unreadable safetensors headers and malformed typed
state are reported too.  Every bad tensor is named, not only the first.

Exit codes: 0 intact; 1 corrupt or incomplete (each problem on stdout, one
line per tensor); 2 usage or access error (nothing at URI, no permission);
130 interrupted.

With --json, stdout holds exactly one JSON object whatever happens once the
arguments are parsed: {"uri", "ok", "error", "files", "blobs", "tensors",
"bytes_read", "seconds", "bad_tensors", "problems"} when the checkpoint could
be read (error null), or {"uri", "ok": false, "error": {"type", "message"}}
when the command failed before a report (nothing there, unreadable manifest,
storage or URI error, interrupted).  The exit code is the same as without
--json, and the one-line error message still goes to stderr.

``--local-dir DIR`` (on a host of the job) verifies this host's copy of the newest committed
local step of run URI instead (``--step N``: that step), only the files this host holds
(:mod:`xla_ckpt.cli.local`).
"""

from __future__ import annotations

import argparse
from typing import Any

from xla_ckpt.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    Parents,
    Subparsers,
    Target,
    human_bytes,
    plain,
    print_json,
    progress_bar,
    resolve_checkpoint,
)
from xla_ckpt.cli.local import add_local_options, chosen_step, open_tier, verify_local
from xla_ckpt.io.manifest_file import read_manifest
from xla_ckpt.io.verify import VerifyReport, verify_checkpoint


def register(sub: Subparsers, parents: Parents) -> None:
    p = sub.add_parser("verify", parents=parents, help="recompute every crc32c (exit 0/1/2)",
                       description=plain(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("uri", metavar="URI", help="checkpoint folder or run folder (-> latest)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    add_local_options(p)
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="with --local-dir: the local step of N updates (default: the newest)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # A failure propagates: main() prints the failure document (with --json), the one-line
    # reason on stderr, and picks the exit code.
    if args.local_dir is not None:
        from xla_ckpt.storage import open_storage  # noqa: PLC0415 - torch-free start-up

        with open_storage(args.uri) as st:
            tier = open_tier(args, st.uri)
        step = chosen_step(tier, args.step)
        target = Target(tier.step_storage(step.name), tier.path(step.name))
        args.json_uri = target.uri
        bar = progress_bar(step.nbytes, "verify", enabled=None if not args.no_progress
                           else False)
        try:
            report = verify_local(tier, step, progress=bar.update)
        finally:
            bar.close()
    else:
        target = resolve_checkpoint(args.uri)
        args.json_uri = target.uri  # the failure document names the resolved checkpoint now
        report = _verify(target, progress=not args.no_progress)
    if args.json:
        print_json(report_document(target.uri, report))
        return EXIT_OK if report.ok else EXIT_FAILED
    rate = report.bytes_read / max(report.seconds, 1e-9) / 2**20
    if report.ok:
        print(f"OK {target.uri}: {report.tensors} tensors in {report.files} files, "
              f"{human_bytes(report.bytes_read)} verified in {report.seconds:.2f} s "
              f"({rate:.0f} MiB/s)")
        return EXIT_OK
    for p in report.problems:
        where = f"{p.file}: " if p.file else ""
        prefix = f"{p.item}:" if p.item not in ("", "state") else ""
        if p.keys:
            for k in p.keys:
                print(f"BAD {prefix}{k}: {where}{p.detail}")
        else:
            print(f"BAD {'item ' + repr(p.item) + ': ' if p.item else ''}{where}{p.detail}")
    files = {p.file for p in report.problems if p.file}
    print(f"CORRUPT {target.uri}: {len(report.bad_keys)} bad tensors, {len(report.problems)} "
          f"problems in {len(files)} of {report.files} files")
    return EXIT_FAILED


def _verify(target: Target, *, progress: bool) -> VerifyReport:
    """Read the manifest and verify every byte; closes the target's storage."""
    try:
        manifest = read_manifest(target.storage)
        bar = progress_bar(sum(b.length for i in manifest.items.values() for b in i.blobs),
                           "verify", enabled=None if progress else False)
        try:
            return verify_checkpoint(target.storage, manifest, progress=bar.update)
        finally:
            bar.close()
    finally:
        target.storage.close()


def report_document(uri: str, report: VerifyReport) -> dict[str, Any]:
    """The ``--json`` document of a verification that ran (``ok`` false if problems were found)."""
    return {
        "uri": uri, "ok": report.ok, "error": None, "files": report.files,
        "blobs": report.blobs, "tensors": report.tensors, "bytes_read": report.bytes_read,
        "seconds": report.seconds, "bad_tensors": report.bad_keys,
        "problems": [{"kind": p.kind, "file": p.file, "item": p.item, "keys": list(p.keys),
                      "detail": p.detail} for p in report.problems]}


