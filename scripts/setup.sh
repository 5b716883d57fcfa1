#!/usr/bin/env bash
# Idempotent set-up from nothing, for the ComfyUI 0.33.0 host:
#   .venv                       torch, torchao and the test tools (requirements-dev.txt)
#   .cache/venv-0.33.0          ComfyUI's requirements; it sees .venv's packages through a .pth file
#   .cache/ComfyUI-0.33.0       the ComfyUI tree (tools/host.py: COMFYUI_DIR, a release archive, or a download;
#                               found first, before anything is installed), the plugin linked into its custom_nodes/
# Prints the host's Python on stdout; progress goes to stderr.
# A Python that already has torch + torchvision (e.g. a GPU box) can be used instead: FLUXACCEL_PYTHON=python3.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[setup] $*" >&2; }
# ComfyUI first: a missing archive is said before several GB of packages are installed
say "finding ComfyUI (tools/host.py --source-only)"
COMFY_DIR=$(python3 tools/host.py --source-only)
if [ -n "${FLUXACCEL_PYTHON:-}" ]; then
  PY="$FLUXACCEL_PYTHON"
else
  if [ ! -x .venv/bin/python ]; then say "creating .venv"; python3 -m venv .venv; fi
  if ! .venv/bin/python -c "import torch, torchvision, torchao, pytest, xdist, pytest_randomly, safetensors, tqdm, matplotlib, markdown_it" 2>/dev/null; then
    say "installing torch, torchao and the test tools into .venv (requirements-dev.txt; several minutes on a fresh machine)"
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-compile -r requirements-dev.txt
  fi
  HV=.cache/venv-0.33.0
  if [ ! -x "$HV/bin/python" ]; then
    say "creating $HV (ComfyUI's packages, on top of .venv)"
    mkdir -p .cache && python3 -m venv "$HV"
    base=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    "$HV/bin/python" -c "import sysconfig, sys; open(sysconfig.get_paths()['purelib'] + '/_fluxaccel_base.pth', 'w').write(sys.argv[1] + '\n')" "$base"
  fi
  PY=$HV/bin/python
fi
say "preparing ComfyUI (tools/host.py)"
"$PY" tools/host.py >/dev/null
if [ -z "${FLUXACCEL_PYTHON:-}" ] && [ ! -x .cache/comfy-cli/bin/comfy ]; then
  say "comfy-cli (the registry's own checks, tests/test_registry.py) into .cache/comfy-cli"
  python3 -m venv .cache/comfy-cli && .cache/comfy-cli/bin/python -m pip install -q --disable-pip-version-check --no-compile "comfy-cli==1.23.0" >&2
fi
if [ -z "${FLUXACCEL_PYTHON:-}" ] && [ -f ../shared/hosts/comfyui-0.38.1-files/comfy/model_prefetch.py ]; then
  say "comfy-aimdo 0.5.5 for the ComfyUI 0.38.1 model-compiler test (tools/comfy038.py)"
  "$PY" tools/comfy038.py >/dev/null
fi
# Python byte code for everything the servers, workers and tests import, written here once: packages are installed
# with --no-compile, and where PYTHONDONTWRITEBYTECODE is set (as on many CI images) no process would ever write it,
# so each one would compile torch's and ComfyUI's sources again on import (about 8 s more for each process that
# compiles a model). Done again only when one of these folders changed since (an install adds to its site-packages).
dirs=("$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")" "$COMFY_DIR")
if [ -z "${FLUXACCEL_PYTHON:-}" ]; then
  dirs+=("$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")")
  [ -d .cache/aimdo-0.5.5 ] && dirs+=(.cache/aimdo-0.5.5)
fi
stamp=.cache/bytecode.stamp
if [ ! -f "$stamp" ] || [ -n "$(find "${dirs[@]}" core nodes tools -maxdepth 0 -newer "$stamp")" ]; then
  say "byte-compiling the environments, the ComfyUI tree and the plugin (python -m compileall)"
  # torch's testing/_internal/py312_intrinsics.py is Python 3.12 syntax, imported by nothing here: compileall exits 1
  # for it, so its exit status is not the set-up's; any other file it fails on still compiles on import, as before
  "$PY" -m compileall -q -j 0 -x '/custom_nodes/' "${dirs[@]}" core nodes tools >/dev/null 2>&1 || true
  mkdir -p .cache && touch "$stamp"
fi
echo "$PY"
