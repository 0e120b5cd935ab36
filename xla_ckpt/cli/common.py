"""Shared pieces of the ``xla-ckpt`` commands: exit codes, target resolution, progress, formatting.

Exit codes (every command): 0 success; 1 the checkpoint is corrupt, incomplete,
unsafe, or the operation was refused; 2 a usage or access error (bad arguments,
nothing at the URI, permission denied, storage unreachable); 141 stdout was closed by its
reader (``| head``), quietly, as ``cat`` would be by SIGPIPE.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import io
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, TextIO, TypeAlias

import numpy as np
from tqdm import tqdm

from xla_ckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
    NothingCommittedError,
    StorageError,
    UncommittedCheckpointError,
    XlaCkptError,
)
from xla_ckpt.storage import Storage, StorageConfig, open_storage

# What each command module's ``register(sub, parents)`` gets: the ``add_subparsers()`` action of
# the top-level parser, and the parent parsers whose options every subcommand accepts too.
# (A string: argparse's action class is not subscriptable at runtime.)
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
Parents: TypeAlias = Sequence[argparse.ArgumentParser]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141
"""stdout's reader went away (``| head``): 128 + SIGPIPE, what a shell reports for ``cat``."""


class UsageError(Exception):
    """Bad command-line use (exit code 2); the message says what to pass instead."""


def exit_code_for(exc: BaseException) -> int:
    """Exit code of a command that raised ``exc`` (see the module docstring)."""
    if isinstance(exc, IncompleteCheckpointError):
        return EXIT_FAILED
    if isinstance(exc, (UsageError, ConfigError, CheckpointNotFoundError, StorageError)):
        return EXIT_USAGE
    if isinstance(exc, XlaCkptError):
        return EXIT_FAILED
    if isinstance(exc, OSError):
        return EXIT_USAGE
    return EXIT_FAILED


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (or its type when it has none)."""
    text = str(exc).strip()
    if isinstance(exc, KeyError) and text.startswith("'"):
        text = f"missing key {text}"
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass
class Target:
    """A resolved checkpoint; ``run_uri`` is set when it was chosen as a run folder's latest."""

    storage: Storage
    uri: str
    run_uri: str | None = None


def resolve_checkpoint(uri: str, config: StorageConfig | None = None) -> Target:
    """What ``uri`` names, by the one resolver (:func:`xla_ckpt.run.resolve.resolve`).

    A checkpoint folder as given, a run folder's latest committed checkpoint, or
    ``<run>/checkpoint_last`` / ``<run>/checkpoint_best``.  A command has no fresh
    start, so "nothing committed" is reported with the CLI's errors: nothing at
    all -> CheckpointNotFoundError (exit 2), incomplete saves only ->
    IncompleteCheckpointError (exit 1).

    Raises:
        UsageError: ``uri`` names a legacy ``.pt``/safetensors file.
        IncompleteCheckpointError: only uncommitted checkpoints are there.
        CheckpointNotFoundError: nothing is there, or a typo'd path (its parent folder
            is missing too).
    """
    # The resolver reads manifests, which needs torch: loaded by the commands that resolve a
    # checkpoint, never by ``xla-ckpt --help`` (which imports this module).
    from xla_ckpt.format.manifest import MANIFEST_NAME  # noqa: PLC0415 - torch-free start-up
    from xla_ckpt.run.resolve import resolve  # noqa: PLC0415 - torch-free start-up
    from xla_ckpt.run.sniff import XLA_CKPT  # noqa: PLC0415 - torch-free start-up

    try:
        resolved = resolve(uri, config)
    except UncommittedCheckpointError as e:
        if e.incomplete:
            raise IncompleteCheckpointError(
                f"{e.uri}: run folder has no committed checkpoint (incomplete: "
                f"{', '.join(e.incomplete[:5])}); their saves did not finish") from e
        raise IncompleteCheckpointError(str(e)) from e
    except NothingCommittedError as e:
        raise CheckpointNotFoundError(f"{e.uri}: no checkpoint here ({MANIFEST_NAME} not "
                                      "found)") from e
    if resolved.kind != XLA_CKPT:
        raise UsageError(f"{uri} is {resolved.what}, not an xla_ckpt checkpoint folder; read it "
                         f"with xla_ckpt.load or import it with `xla-ckpt convert {uri} DST`")
    st = open_storage(resolved.checkpoint, config)
    return Target(st, st.uri, run_uri=resolved.run)


class ProgressBar(Protocol):
    """What :func:`progress_bar` returns: a tqdm bar or a no-op one."""

    def update(self, n: int) -> object: ...

    def refresh(self) -> object: ...

    def close(self) -> None: ...


class _NullBar:
    def update(self, n: int) -> None:
        pass

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


DEFAULT_TERMINAL_SIZE = (80, 24)
"""(columns, rows) assumed when a terminal reports a size of 0 and COLUMNS/LINES are unset."""


def _env_int(name: str) -> int:
    try:
        return int(os.environ.get(name, ""))
    except ValueError:
        return 0


def terminal_size(file: TextIO) -> tuple[int, int]:
    """``(columns, rows)`` of the terminal ``file`` writes to, never 0.

    ``COLUMNS`` / ``LINES`` win when set to a positive number (as
    :func:`shutil.get_terminal_size`); then the terminal's own answer; a terminal that
    reports 0 (a fresh pty, some CI runners, ``stty cols 0``) or no terminal at all gives
    :data:`DEFAULT_TERMINAL_SIZE`.  tqdm asks the terminal directly and, told 0 rows,
    draws nothing at all: this is what :func:`progress_bar` gives it instead.
    """
    cols, rows = _env_int("COLUMNS"), _env_int("LINES")
    if cols <= 0 or rows <= 0:
        try:
            size = os.get_terminal_size(file.fileno())
            tc, tr = size.columns, size.lines
        except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
            tc, tr = 0, 0
        cols = cols if cols > 0 else (tc or DEFAULT_TERMINAL_SIZE[0])
        rows = rows if rows > 0 else (tr or DEFAULT_TERMINAL_SIZE[1])
    return cols, rows


def _unit(total: float | None, n: float) -> tuple[str, int]:
    """MiB, or KiB for work under 1 MiB (``0.0/0.0 MiB`` would say nothing)."""
    size = total if total else n
    return ("KiB", 2**10) if size < 2**20 else ("MiB", 2**20)


_WITH_TOTAL = ("{desc}: {percentage:3.0f}%|{bar}| {n_units}/{total_units} {size_unit} "
               "[{elapsed}<{remaining}, {rate_mib}]")
_NO_TOTAL = "{desc}: {n_units} {size_unit} [{elapsed}, {rate_mib}]"


class _MiBBar(tqdm):
    """A tqdm byte counter that shows MiB (KiB below 1 MiB; binary, one decimal, as
    ``human_bytes``) and MiB/s, and sizes itself by :func:`terminal_size`."""

    @property
    def format_dict(self) -> dict[str, Any]:
        d = dict(super().format_dict)
        rate, total, n = d.get("rate"), d.get("total"), d.get("n") or 0
        unit, div = _unit(total, n)
        d["n_units"] = f"{n / div:.1f}"
        d["total_units"] = f"{total / div:.1f}" if total else "?"
        d["size_unit"] = unit
        d["rate_mib"] = f"{rate / 2**20:.1f} MiB/s" if rate else "? MiB/s"
        d["bar_format"] = _WITH_TOTAL if total else _NO_TOTAL
        return d


def _shape(file: TextIO) -> tuple[int, int]:
    cols, rows = terminal_size(file)
    return max(cols - 1, 1), max(rows - 1, 1)  # tqdm's own margin: never the last column


def progress_bar(total_bytes: int | None, desc: str, *,
                 enabled: bool | None = None, file: TextIO | None = None) -> ProgressBar:
    """A byte counter on stderr in MiB (KiB below 1 MiB) and MiB/s when stderr is a terminal,
    else a no-op.

    Args:
        total_bytes: bytes the work will count (None: unknown; no bar, a running count).
        desc: the label (``"verify"``, ``"read"``).
        enabled: True draws even when ``file`` is not a terminal; False never draws;
            None (default) draws only on a terminal (``xla-ckpt --no-progress`` passes False).
        file: where to draw (default ``sys.stderr``).

    Returns:
        A bar whose ``update(nbytes)`` counts bytes done and ``close()`` removes it
        (``leave=False``).  The width follows the terminal, read by :func:`terminal_size`,
        so a terminal that reports no width still gets a bar.
    """
    out = file if file is not None else sys.stderr
    if enabled is None:
        try:
            enabled = out.isatty()
        except (AttributeError, ValueError):
            enabled = False
    if not enabled:
        return _NullBar()
    cols, rows = _shape(out)
    bar = _MiBBar(total=total_bytes, desc=desc, unit="B", file=out, leave=False, ncols=cols,
                  nrows=rows, dynamic_ncols=False, mininterval=0.1)
    # Follow resizes through the same fallbacks: tqdm calls ``dynamic_ncols(file)`` on every
    # refresh when it is a callable (what its own dynamic_ncols=True installs).
    bar.dynamic_ncols = _shape  # type: ignore[assignment]  # tqdm stubs type it as the bool argument
    return bar


def human_bytes(n: int | float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def utc_time(unix_s: float) -> str:
    if not unix_s or not math.isfinite(unix_s):
        return "-"
    try:
        return _dt.datetime.fromtimestamp(unix_s, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return "-"


def short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned text columns separated by two spaces."""
    cols = [header] + rows
    widths = [max(len(r[i]) for r in cols) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cols]
    return "\n".join(lines)


def failure_document(uri: str | None, error: BaseException) -> dict[str, Any]:
    """The ``--json`` document of a command that failed: ``{"uri", "ok": false, "error":
    {"type", "message"}}`` (every command with ``--json`` prints exactly one JSON object)."""
    message = "interrupted" if isinstance(error, KeyboardInterrupt) else str(error).strip()
    return {"uri": uri, "ok": False,
            "error": {"type": type(error).__name__, "message": message or type(error).__name__}}


def print_json(doc: Any) -> None:
    """One JSON document on stdout (decoded state values made plain with :func:`jsonable`)."""
    print(json.dumps(jsonable(doc), indent=2), flush=True)


def jsonable(value: Any) -> Any:
    """Plain-JSON form of a decoded state value, for ``--json`` output.

    Tuples become lists, ``argparse.Namespace`` a dict, numpy scalars Python
    numbers, non-finite floats the strings ``"nan"``/``"inf"``/``"-inf"``,
    dict keys strings, bytes ``{"bytes": n}``; objects with a ``to_json()``
    method (tensor descriptions) use it.
    """


    if hasattr(value, "to_json") and callable(value.to_json):
        return value.to_json()
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, argparse.Namespace):
        return {str(k): jsonable(v) for k, v in vars(value).items()}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": len(value)}
    if isinstance(value, complex):
        return [jsonable(value.real), jsonable(value.imag)]
    return str(value)


def plain(doc: str | None) -> str:
    """A module docstring as ``--help`` text (reST double backquotes removed)."""
    return (doc or "").replace("``", "")
