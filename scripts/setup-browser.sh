#!/usr/bin/env bash
# What the browser test (tests/e2e/test_browser.py) needs besides Python: Debian's headless Chromium and
# playwright-core from npm (pinned in tests/browser/package-lock.json). Checks only when both are there.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x "${CHROMIUM:-/usr/bin/chromium}" ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core >&2
  else
    echo "setup-browser: install Debian's chromium (sudo apt-get install chromium) for the browser test" >&2
  fi
fi
if [ ! -d tests/browser/node_modules/playwright-core ]; then
  (cd tests/browser && npm ci --no-audit --no-fund >&2)
fi
