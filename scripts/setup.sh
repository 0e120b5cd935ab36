#!/usr/bin/env bash
# Idempotent set-up: a project-local virtualenv (.venv) with xla_ckpt and its test/demo extras.
# torch==2.9.0 and torch_xla==2.9.0 are pinned together (binary ABI); on x86_64 that torch is a
# CUDA build from the package index, which runs fine on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.xla_ckpt-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[test,demo,lint]'
  touch "$stamp"
fi
