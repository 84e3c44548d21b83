#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with FlexShard installed (editable) and its
# test tools. On a machine without an NVIDIA GPU it pins the CPU build of torch first, so that no
# CUDA wheels are pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${PIP[@]}" "torch>=2.4"
  else
    "${PIP[@]}" "torch==2.13.0"
  fi
fi
"${PIP[@]}" -e ".[dev,plots]"
