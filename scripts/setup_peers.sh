#!/usr/bin/env bash
# Idempotent set-up of the optional peer environments of benchmarks/gcs_restore.py.
#
#   bash scripts/setup_peers.sh            # both
#   bash scripts/setup_peers.sh orbax      # .venv-orbax: methods f, g (Orbax over tensorstore)
#   bash scripts/setup_peers.sh dataflux   # .venv-dataflux: methods h, i (GCS Connector for PyTorch)
#
# Each peer runs in a virtualenv of its own because it cannot share ours:
#   .venv-orbax     orbax-checkpoint + jax[cpu] + tensorstore (the TensorStore GCS driver), gcsfs
#                   (Orbax's path layer opens gs:// through etils.epath -> gcsfs), numpy,
#                   google-crc32c (per-tensor crc32c for the parent's bitwise check).
#   .venv-dataflux  gcs-torch-dataflux, which needs google-cloud-storage<3 (ours is 3.x) and pulls
#                   lightning; torch for torch.load and DCP. Any torch >= 2.6 reads the
#                   checkpoint, so a CPU build is enough: the newest torch-*+cpu wheel found in
#                   pip's find-links folders is used when there is one (a local file, no
#                   download), else torch==$(torch version of .venv). Set PEER_TORCH to override
#                   (a requirement such as "torch==2.9.0" or a wheel path).
# A stamp file per venv records a finished install; delete the venv to rebuild it.
# Versions: the ones that install from this machine's package index and work with the emulator
# (checked 2026-12-01: orbax-checkpoint 0.12.4, jax/jaxlib 0.10.2, tensorstore 0.1.85,
# gcs-torch-dataflux 1.4.0 with google-cloud-storage 2.19, torch 2.13.0+cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(orbax dataflux)

make_venv() {  # make_venv DIR: create DIR with an up-to-date pip unless it exists
  if [ ! -x "$1/bin/python" ]; then
    "$PY" -m venv "$1"
    "$1/bin/python" -m pip install -q --upgrade pip
  fi
}

find_cpu_torch() {  # newest torch-*+cpu wheel in pip's find-links folders, or nothing
  local links d
  links="${PIP_FIND_LINKS:-} $("$PY" -m pip config get global.find-links 2>/dev/null || true)"
  for d in $links; do
    d=${d#file://}
    [ -d "$d" ] && ls "$d"/torch-*+cpu-*.whl 2>/dev/null
  done | sort -V | tail -n 1
}

setup_orbax() {
  local venv=.venv-orbax stamp=.venv-orbax/.peer-installed
  [ -f "$stamp" ] && { echo "$venv: ready"; return; }
  make_venv "$venv"
  "$venv/bin/python" -m pip install -q \
    "orbax-checkpoint>=0.11" "jax[cpu]>=0.5" "tensorstore>=0.1.70" "gcsfs>=2024.2" \
    "numpy>=1.24" "google-crc32c>=1.5"
  "$venv/bin/python" -c "import orbax.checkpoint, jax, tensorstore, gcsfs, google_crc32c"
  touch "$stamp"
  echo "$venv: installed"
}

setup_dataflux() {
  local venv=.venv-dataflux stamp=.venv-dataflux/.peer-installed torch_req
  [ -f "$stamp" ] && { echo "$venv: ready"; return; }
  make_venv "$venv"
  torch_req=${PEER_TORCH:-$(find_cpu_torch)}
  if [ -z "$torch_req" ]; then
    torch_req="torch==$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])' \
                        2>/dev/null || echo 2.9.0)"
  fi
  echo "$venv: torch from $torch_req"
  "$venv/bin/python" -m pip install -q "$torch_req"
  "$venv/bin/python" -m pip install -q "gcs-torch-dataflux>=1.4" "google-cloud-storage>=2.14,<3" \
    "numpy>=1.24" "google-crc32c>=1.5"
  "$venv/bin/python" -c "import dataflux_pytorch.dataflux_checkpoint, dataflux_pytorch.lightning, google_crc32c"
  touch "$stamp"
  echo "$venv: installed"
}

for t in "${targets[@]}"; do
  case "$t" in
    orbax) setup_orbax ;;
    dataflux) setup_dataflux ;;
    *) echo "unknown peer '$t' (expected: orbax, dataflux)" >&2; exit 2 ;;
  esac
done
