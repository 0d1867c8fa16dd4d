#!/usr/bin/env bash
# Make sure a headless browser and its WebDriver are installed: the web UI's test drives
# Debian's chromium through chromedriver (host/tests/ui.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/prereqs.sh
km0_has_chromium && exit 0
echo "== installing chromium and chromedriver (apt)"
km0_apt_install chromium chromium-driver || {
  echo "km0: chromium is not installed; fix with: apt-get install -y chromium chromium-driver (the web UI's test)" >&2
  exit 1
}
