#!/usr/bin/env bash
# Runs the test suite (CPU; a real ComfyUI host) after setting everything up.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh)
bash scripts/setup-browser.sh
exec "$PY" -m pytest "$@"
