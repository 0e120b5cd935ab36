#!/usr/bin/env bash
# Lint and type checks over every Python file (xla_ckpt/, tests/, benchmarks/, scripts/), as
# .ci/run runs them before the tests. Rules and levels: pyproject.toml ([tool.ruff], [tool.mypy]).
# Needs the virtualenv of scripts/setup.sh (the `lint` extra).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python scripts/check_coverage.py      # no folder is skipped by either checker
.venv/bin/python scripts/check_suppressions.py  # every noqa / type: ignore says why
.venv/bin/ruff check .
.venv/bin/mypy
