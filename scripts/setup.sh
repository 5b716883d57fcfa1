#!/usr/bin/env bash
# Idempotent set-up from nothing: .venv with torch/torchao/test tools, then the ComfyUI host (tools/host.py).
# A Python that already has torch + torchvision (e.g. a GPU box) can be used instead: FLUXACCEL_PYTHON=python3.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${FLUXACCEL_PYTHON:-}" ]; then
  PY="$FLUXACCEL_PYTHON"
else
  [ -x .venv/bin/python ] || python3 -m venv .venv
  PY=.venv/bin/python
  if ! "$PY" -c "import torch, torchvision, torchao, pytest, safetensors, tqdm" 2>/dev/null; then
    "$PY" -m pip install -q --disable-pip-version-check -r requirements-dev.txt
  fi
fi
"$PY" tools/host.py >/dev/null
echo "$PY"
