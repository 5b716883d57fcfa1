#!/usr/bin/env bash
# Runs the project's benchmark command on the lent GPU machine (no package index there).
# The host is ComfyUI 0.33.0. Carry its kit: .gpu033, a copy of ../shared/gpu/kit-0.33 (cp -r ../shared/gpu/kit-0.33
# .gpu033)
# and call:  bash bench/device.sh --case dev-1024-28 [--suite core] [more tools/bench.py args]
#        or:  bash bench/device.sh --reliability   (tools/reliability.py: interrupt, /free, 50 prompts on the GPU)
#        or:  bash bench/device.sh --first-prompts --case klein9b-1024-4   (tools/first_prompts.py)
#        or:  bash bench/device.sh --changes --sequence lora --case dev-1024-28   (tools/changes.py)
# Results land in $OUT/results (the run's JSON only: at most 8 files come back from a call), the ComfyUI log in $OUT;
# the per-node tables and charts stay on the machine in /tmp/fluxaccel-results. Several cases in one call: --cases
# "a b" (each with the same other arguments).
set -euo pipefail
source .gpu033/setup-on-device.sh
export FLUXACCEL_HOST_NO_INSTALL=1
# one compile-cache folder for every run on this machine: a later run's first run is a cached first run
export FLUXACCEL_CACHE_DIR=${FLUXACCEL_CACHE_DIR:-/tmp/fluxaccel-cache}
# clocks, power and load once a second while the benchmark runs (throttling shows here)
nvidia-smi dmon -s pucm -d 1 > "$OUT/dmon-$(date +%s).log" 2>&1 &
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
mkdir -p "$OUT/results"
if [ "${1:-}" = "--reliability" ]; then  # the GPU reliability cases instead of a benchmark
  shift
  exec python3 tools/reliability.py "$@" --out "$OUT/results" --models-dir /tmp/fluxaccel-models
fi
if [ "${1:-}" = "--changes" ]; then  # tools/changes.py: prompts through LoRA or resolution changes
  shift
  exec python3 tools/changes.py "$@" --out "$OUT/results" --models-dir /tmp/fluxaccel-models
fi
if [ "${1:-}" = "--first-prompts" ]; then  # tools/first_prompts.py: each configuration's first and second prompt
  shift
  exec python3 tools/first_prompts.py "$@" --out "$OUT/results" --models-dir /tmp/fluxaccel-models
fi
WORK=/tmp/fluxaccel-results
mkdir -p "$WORK"
run_case() {
  local before
  before=$(date +%s)
  python3 tools/bench.py "$@" --out "$WORK" --models-dir /tmp/fluxaccel-models --log "$OUT/comfyui-$(date +%s).log" || true
  # the latest JSON of this run (not the per-run copies, tables and charts)
  find "$WORK" -maxdepth 1 -name '*.json' -newermt "@$before" ! -name '*-20[0-9][0-9][0-9][0-9][0-9][0-9]-*' \
    -exec cp {} "$OUT/results/" \;
}
if [ "${1:-}" = "--cases" ]; then
  cases=$2; shift 2
  for c in $cases; do run_case --case "$c" "$@"; done
else
  run_case "$@"
fi
