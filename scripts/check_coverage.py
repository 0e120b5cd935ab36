"""Prove the checkers see every Python file: a check that skips a folder looks green and is not.

Compares the repository's Python files (tracked, plus untracked ones git does not ignore) with
the file lists the checkers themselves build from their configuration in ``pyproject.toml``:

* ruff: ``ruff check --show-files`` (the exact files ``ruff check`` lints);
* mypy: the build sources of ``mypy.main.process_options([])`` (what a bare ``mypy`` checks).

Ruff's and Black's default excludes drop any folder named ``dist`` or ``build``; a package that
is called so (``xla_ckpt/dist/`` was) vanishes from lint without a word. Exit status 1, with the
missing files listed, when either checker would skip a file; 0 otherwise.

Run from anywhere: ``.venv/bin/python scripts/check_coverage.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED_FOLDERS = ("xla_ckpt", "tests", "benchmarks", "scripts")


def repository_files() -> set[Path]:
    """Every ``.py`` file under the checked folders that git tracks or would track."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *CHECKED_FOLDERS],
        cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return {(ROOT / line).resolve() for line in out.splitlines()
            if line.endswith(".py") and (ROOT / line).exists()}


def ruff_files() -> set[Path]:
    ruff = Path(sys.executable).with_name("ruff")
    out = subprocess.run([str(ruff), "check", "--show-files", "."], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return {Path(line.strip()).resolve() for line in out.splitlines() if line.strip()}


def mypy_files() -> set[Path]:
    from mypy.main import process_options  # noqa: PLC0415 - only this script needs mypy

    cwd = os.getcwd()
    os.chdir(ROOT)  # mypy reads pyproject.toml and resolves its `files` from the working folder
    try:
        sources, _options = process_options([])
    finally:
        os.chdir(cwd)
    return {(ROOT / s.path).resolve() for s in sources if s.path}


def main() -> int:
    want = repository_files()
    package = {p for p in want if p.is_relative_to(ROOT / "xla_ckpt")}
    failed = False
    for name, seen in (("ruff", ruff_files()), ("mypy", mypy_files())):
        missing = sorted(want - seen)
        if missing:
            failed = True
            print(f"{name} skips {len(missing)} of {len(want)} Python files:", file=sys.stderr)
            for p in missing:
                print(f"  {p.relative_to(ROOT)}", file=sys.stderr)
        else:
            print(f"{name} checks all {len(want)} Python files "
                  f"({len(package)} under xla_ckpt/)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
