#!/usr/bin/env bash
# Runs the whole test suite (CPU, real ComfyUI 0.33.0 servers) after setting everything up, on two pytest workers
# (pytest-xdist; FLUXACCEL_TEST_WORKERS, default 2), printing one line per test as it ends and the 25 slowest tests at
# the end. Arguments go to pytest.
#
# ComfyUI 0.38.1's model compiler is tested inside this run (tests/core/upstream/test_comfy_038.py: its real module
# and comfy-aimdo pin in the 0.33.0 tree); no complete 0.38 tree is available to test against.
set -euo pipefail
cd "$(dirname "$0")/.."
WORKERS=${FLUXACCEL_TEST_WORKERS:-2}
# a full disk fails tests far from its cause: said first where less than a run may need is free (the set-up's .venv and
# .cache about 10 GB on a fresh clone, one run's temporary files and inductor's kernels about 3 GB)
for dir in . "${TMPDIR:-/tmp}"; do
  free_kb=$(df -Pk "$dir" 2>/dev/null | awk 'NR==2 {print $4}' || true)
  [ -n "$free_kb" ] || continue
  free_gb=$(( free_kb / 1024 / 1024 ))
  if [ "$free_gb" -lt 13 ]; then
    echo "[test] warning: only $free_gb GB free where $dir is; a run from a fresh clone may need about 13 GB" >&2
  fi
done
bash scripts/setup-browser.sh
PY=$(bash scripts/setup.sh)
# one compute thread per worker: two workers of two threads each on two cores spin against each other
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# and inductor compiles in the process that asks (no pool of compile processes started in every server and worker)
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
# and its CPU kernels in scalar C++ (no vector-ISA variants to generate and build): the compile path under test --
# dynamo, AOT, FluxAccel's wrappers, packages and caches -- is the same; on a GPU inductor writes Triton kernels
export TORCHINDUCTOR_VEC_ISA_OK=${TORCHINDUCTOR_VEC_ISA_OK:-0}
echo "[test] $PY -m pytest -n $WORKERS $*" >&2
exec "$PY" -m pytest -n "$WORKERS" --dist worksteal -v --durations=25 "$@"
