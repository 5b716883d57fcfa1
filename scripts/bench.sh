#!/usr/bin/env bash
# The main job: a headless benchmark through a real ComfyUI server (tiny FLUX on CPU, FLUX.1-dev shape on a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh)
exec "$PY" tools/bench.py "$@"
