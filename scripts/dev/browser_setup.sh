#!/usr/bin/env bash
# Make the dashboard's browser tests runnable: Debian's Chromium plus Playwright for Python.
# Idempotent: does nothing that is already done. Never downloads a browser through Playwright
# (no `playwright install`); the tests drive /usr/bin/chromium.
set -euo pipefail

cd "$(dirname "$0")/../.."
VENV="${VENV:-.venv}"

if [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update
    $SUDO apt-get install -y --no-install-recommends chromium fonts-dejavu-core
fi

if ! "$VENV/bin/python" -c "import playwright" 2>/dev/null; then
    "$VENV/bin/pip" install --quiet "playwright>=1.45"
fi

/usr/bin/chromium --version 2>/dev/null | head -n 1
"$VENV/bin/pip" show playwright | grep -i '^version' | sed 's/^/playwright /' 
