"""``xla-ckpt``: operate checkpoints from a shell (local paths and ``gs://`` URIs).

Each subcommand lives in its own module ``xla_ckpt.cli.<name>`` exposing
``register(subparsers, parents)``, which adds its parser and sets ``func(args) -> exit code``;
:data:`COMMANDS` lists them with their one-line summaries (add new ones there).  Only the
command being run is imported: ``xla-ckpt --help`` lists the summaries without importing any
command, and neither it nor ``ls``, ``inspect``, ``rm``, ``gc`` and ``verify`` (which read
manifests and bytes only) import torch, so they start in a fraction of a second.  Errors
print one line on stderr (``xla-ckpt <command>: error: <reason>``) and exit non-zero;
``--debug`` adds the traceback and debug logs.  Exit codes are in
:mod:`xla_ckpt.cli.common`.  A command run with ``--json`` prints exactly one
JSON object on stdout whatever happens, usage errors included: its report, or
``{"uri", "ok": false, "error": {"type", "message"}}``
(:func:`~xla_ckpt.cli.common.failure_document`), so ``| jq .ok`` never breaks.

A reader that goes away (``xla-ckpt inspect RUN | head -1``) ends the command quietly: no
message, the rest of stdout is discarded, and the exit code is 141 (:data:`EXIT_BROKEN_PIPE`,
128 + SIGPIPE), what a shell reports for ``cat``, ``ls`` or ``git log`` in the same pipe, so
``set -o pipefail`` scripts see the same status they see for those tools.  (``--help`` and
``--version``, which argparse prints itself, ignore a closed stdout and exit 0, as quietly.)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
import traceback
from typing import Collection, Iterator, Sequence

from xla_ckpt import __version__
from xla_ckpt.cli.common import (
    EXIT_BROKEN_PIPE,
    EXIT_USAGE,
    UsageError,
    exit_code_for,
    failure_document,
    one_line,
    print_json,
)
from xla_ckpt.errors import XlaCkptError

COMMANDS: dict[str, str] = {
    "ls": "list checkpoints of a run folder",
    "inspect": "show a checkpoint's state tree and summary",
    "verify": "recompute every crc32c (exit 0/1/2)",
    "convert": "import a .pt, safetensors, HF index, DCP checkpoint or fairseq run folder "
               "(or write DCP with --to dcp)",
    "rm": "delete named checkpoints (never protected ones)",
    "gc": "apply a retention policy (keep-last/keep-best), collect interrupted uploads",
    "export": "write a checkpoint as a torch.save .pt, HF safetensors or DCP",
    "demo": "preempt and resume a real training run",
    "train": "run one rank of a checkpointed training job",
}
"""Every command, in ``--help`` order: name (its module is ``xla_ckpt.cli.<name>``) -> the
one-line summary ``xla-ckpt --help`` shows (the same text as the module's own ``help=``)."""


def common_options() -> argparse.ArgumentParser:
    """Options every subcommand accepts after its name too (``xla-ckpt verify URI --debug``)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="print tracebacks and debug logs")
    p.add_argument("--no-progress", action="store_true", default=argparse.SUPPRESS,
                   help="never draw progress bars (they appear only on a terminal)")
    return p


def build_parser(load: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``xla-ckpt`` parser.

    ``load``: the commands whose modules are imported and whose full parsers are registered
    (default: every command); the others get a summary-only entry, enough for the top-level
    ``--help`` and for "invalid choice" errors.
    """
    names = COMMANDS if load is None else load
    parser = argparse.ArgumentParser(
        prog="xla-ckpt",
        description="List, inspect, verify, convert, export and prune xla_ckpt checkpoints "
                    "(local paths or gs:// URIs).")
    parser.add_argument("--version", action="version", version=f"xla-ckpt {__version__}")
    parser.add_argument("--debug", action="store_true", help="print tracebacks and debug logs")
    parser.add_argument("--no-progress", action="store_true",
                        help="never draw progress bars (they appear only on a terminal)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parents = [common_options()]
    for name, summary in COMMANDS.items():
        if name in names:
            importlib.import_module(f"xla_ckpt.cli.{name}").register(sub, parents)
        else:
            sub.add_parser(name, help=summary, add_help=False)
    return parser


def _command_in(argv: Sequence[str]) -> list[str]:
    """The command ``argv`` runs (its first word that names one), as ``build_parser``'s
    ``load``; none for ``--help``, ``--version`` or a usage error."""
    return next(([a] for a in argv if a in COMMANDS), [])


def _stdout_closed() -> int:
    """stdout's reader went away: discard whatever is still to be written (the interpreter's
    last flush included) and return :data:`EXIT_BROKEN_PIPE`."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is no file (a test's capture)
        pass
    return EXIT_BROKEN_PIPE


@contextlib.contextmanager
def _cli_logging(debug: bool) -> Iterator[None]:
    """Library log lines to stderr while a command runs (WARNING+, DEBUG with --debug).

    Attached to the ``xla_ckpt`` logger and removed afterwards, so calling
    :func:`main` in-process (tests, notebooks) leaves logging as it found it.
    """
    log = logging.getLogger("xla_ckpt")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("xla-ckpt: %(levelname)s %(name)s: %(message)s" if debug
                                           else "xla-ckpt: %(levelname)s: %(message)s"))
    handler.setLevel(logging.DEBUG if debug else logging.WARNING)
    old_level = log.level
    log.addHandler(handler)
    if debug:
        log.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)


def _json_requested(argv: Sequence[str]) -> bool:
    return "--json" in argv


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit code (the console script exits with it).

    A closed stdout (``| head``) ends it quietly with :data:`EXIT_BROKEN_PIPE` (141).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _run(argv)
        sys.stdout.flush()  # a reader that left after the last line fails here, not at exit
    except BrokenPipeError:
        return _stdout_closed()
    return code


def _run(argv: list[str]) -> int:
    parser = build_parser(_command_in(argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help/--version exit 0, usage errors exit 2
        code = int(e.code) if isinstance(e.code, int) else EXIT_USAGE
        if code != 0 and _json_requested(argv):  # argparse already said why on stderr
            print_json(failure_document(None, UsageError(
                f"bad arguments {' '.join(argv)!r}; see `xla-ckpt --help`")))
        return code
    try:
        with _cli_logging(args.debug):
            return int(args.func(args) or 0)
    except BrokenPipeError:
        raise  # main(): stdout's reader went away, nothing to report
    except KeyboardInterrupt as e:
        if getattr(args, "json", False):
            print_json(failure_document(_json_uri(args), e))
        print(f"xla-ckpt {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI boundary: one line unless --debug
        if getattr(args, "json", False):
            print_json(failure_document(_json_uri(args), e))
        if args.debug:
            traceback.print_exc()
        code = exit_code_for(e)
        if isinstance(e, (XlaCkptError, UsageError, OSError)):
            reason = one_line(e)
        else:
            reason = f"internal error ({type(e).__name__}: {one_line(e)}); rerun with --debug"
        print(f"xla-ckpt {args.command}: error: {reason}", file=sys.stderr)
        return code


def _json_uri(args: argparse.Namespace) -> str | None:
    """What a failure document names: the resolved checkpoint once a command has one."""
    return getattr(args, "json_uri", None) or getattr(args, "uri", None)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
