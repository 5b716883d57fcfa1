#!/usr/bin/env bash
# Runs the whole test suite (CPU, real ComfyUI servers) on both hosts, ComfyUI 0.33.0 then 0.3.75, after setting
# everything up. FLUXACCEL_COMFYUI=0.33.0 (or 0.3.75) runs one host only. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTS=${FLUXACCEL_COMFYUI:-"0.33.0 0.3.75"}
bash scripts/setup-browser.sh
status=0
for h in $HOSTS; do
  PY=$(FLUXACCEL_COMFYUI=$h bash scripts/setup.sh)
  echo "[test] ComfyUI $h: $PY -m pytest $*" >&2
  FLUXACCEL_COMFYUI=$h "$PY" -m pytest --durations=15 "$@" || status=$?
done
exit $status
