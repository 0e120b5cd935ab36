"""``xla-ckpt``: operate checkpoints from a shell (local paths and ``gs://`` URIs).

Each subcommand lives in its own module exposing ``register(subparsers)``,
which adds its parser and sets ``func(args) -> exit code``; :data:`COMMANDS`
lists them (add ``demo``/``bench`` there).  Errors print one line on stderr
(``xla-ckpt <command>: error: <reason>``) and exit non-zero; ``--debug``
adds the traceback and debug logs.  Exit codes are in
:mod:`xla_ckpt.cli.common`.  A command run with ``--json`` prints exactly one
JSON object on stdout whatever happens, usage errors included: its report, or
``{"uri", "ok": false, "error": {"type", "message"}}``
(:func:`~xla_ckpt.cli.common.failure_document`), so ``| jq .ok`` never breaks.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import traceback
from typing import Iterator, Sequence

from xla_ckpt import __version__
from xla_ckpt.cli import convert, demo, export, gc, inspect, ls, rm, train, verify
from xla_ckpt.cli.common import (
    EXIT_USAGE,
    UsageError,
    exit_code_for,
    failure_document,
    one_line,
    print_json,
)
from xla_ckpt.errors import XlaCkptError

COMMANDS = (ls, inspect, verify, convert, rm, gc, export, demo, train)


def common_options() -> argparse.ArgumentParser:
    """Options every subcommand accepts after its name too (``xla-ckpt verify URI --debug``)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="print tracebacks and debug logs")
    p.add_argument("--no-progress", action="store_true", default=argparse.SUPPRESS,
                   help="never draw progress bars (they appear only on a terminal)")
    return p


def build_parser() -> argparse.ArgumentParser:
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
    for module in COMMANDS:
        module.register(sub, parents)
    return parser


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
    """Run one command; returns its exit code (the console script exits with it)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
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
