#!/usr/bin/env bash
# Runs the whole test suite (CPU, real ComfyUI servers) on both hosts, ComfyUI 0.33.0 and 0.3.75, after setting
# everything up. FLUXACCEL_COMFYUI=0.33.0 (or 0.3.75) runs one host only. Arguments go to pytest.
#
# The two hosts' suites run at the same time, each in its own process tree (own servers, ports, temp folders and
# compile caches); their lines are printed as they come, prefixed with the host, and each suite's whole output
# (.cache/test-<host>.log) again when it ends. Much of a CPU test's
# time is single-threaded (Python imports, dynamo tracing, inductor's lowering), so two suites overlap well on a
# 2-core machine. FLUXACCEL_TEST_SERIAL=1 runs them one after the other, printing as they go.
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTS=${FLUXACCEL_COMFYUI:-"0.33.0 0.3.75"}
bash scripts/setup-browser.sh
declare -A PYS
for h in $HOSTS; do  # set-up in order: both hosts share .venv
  PYS[$h]=$(FLUXACCEL_COMFYUI=$h bash scripts/setup.sh)
done
run() {  # host, pytest args...
  local h=$1; shift
  echo "[test] ComfyUI $h: ${PYS[$h]} -m pytest $*" >&2
  FLUXACCEL_COMFYUI=$h "${PYS[$h]}" -m pytest --durations=15 "$@"
}
status=0
if [ -n "${FLUXACCEL_TEST_SERIAL:-}" ] || [ "$(wc -w <<<"$HOSTS")" -eq 1 ]; then
  for h in $HOSTS; do run "$h" "$@" || status=$?; done
  exit $status
fi
declare -A PIDS
# one compute thread per suite: two suites of two threads each on two cores spin against each other
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
for h in $HOSTS; do
  # each suite's lines appear as they come, prefixed with its host (one line per test: -v), and go to its log
  ( set -o pipefail; run "$h" -v "$@" 2>&1 | tee ".cache/test-$h.log" | sed -u "s/^/[$h] /" ) &
  PIDS[$h]=$!
done
for h in $HOSTS; do
  rc=0
  wait "${PIDS[$h]}" || rc=$?
  echo "===== ComfyUI $h: pytest exit $rc (.cache/test-$h.log, printed whole) ====="
  cat ".cache/test-$h.log"
  [ "$rc" -eq 0 ] || status=$rc
done
exit $status
