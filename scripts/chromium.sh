#!/usr/bin/env bash
# Chromium for the browser test of the dashboard (tests/test_localnet.py), from Debian's own packages
# (Debian 12, run as root). Idempotent: installs only when /usr/bin/chromium is missing. The tests
# drive this binary with Playwright's Python package (`executable_path="/usr/bin/chromium"`); nothing
# ever downloads a browser of its own.
set -euo pipefail

CHROMIUM=/usr/bin/chromium

step() { printf '\033[1m==> %s\033[0m\n' "$*"; }

if [ -x "$CHROMIUM" ]; then
  step "chromium present: $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "scripts/chromium.sh must run as root to install chromium (apt-get), or install it yourself" >&2
  exit 1
fi
step "installing chromium"
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends chromium fonts-dejavu-core
step "chromium ready: $("$CHROMIUM" --version)"
