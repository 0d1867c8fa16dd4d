#!/usr/bin/env bash
# Check each prerequisite of the build, the demo and the tests the way its consumer uses it,
# one line each, with the command that fixes what is missing. Exit 1 if any is missing.
# `scripts/test.sh` runs it after installing, so a missing step fails early and says why.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/prereqs.sh
missing=0
line() { # ok|MISSING what detail
  printf '%-8s %-18s %s\n' "$1" "$2" "$3"
  [ "$1" = ok ] || missing=1
}
if lib=$(km0_find_libclang); then line ok libclang "$lib (bindgen, RocksDB)"
else line MISSING libclang "bindgen needs libclang.so: apt-get install -y libclang-dev (scripts/setup.sh)"; fi
if km0_has_wasm_target; then line ok wasm32-wasip2 "rust target (plugins)"
else line MISSING wasm32-wasip2 "rustup target add wasm32-wasip2 (scripts/setup.sh)"; fi
if km0_has_componentize_py; then line ok componentize-py "$(componentize-py --version 2>/dev/null | head -n1) (Python plugins)"
else line MISSING componentize-py "python3 -m pip install componentize-py==0.25.1 (scripts/build-plugins.sh)"; fi
if km0_has_node; then line ok node/npm "node $(node --version) (JavaScript plugins)"
else line MISSING node/npm "apt-get install -y nodejs npm (scripts/build-plugins.sh)"; fi
if [ "${1:-}" != --build ]; then
  t=$(km0_tansu_bin)
  if [ -x "$t" ]; then line ok tansu "$t (Kafka tests)"
  else line MISSING tansu "scripts/install-tansu.sh"; fi
  if km0_has_chromium; then line ok chromium "$(command -v "${KM0_CHROMEDRIVER:-chromedriver}") (web UI test)"
  else line MISSING chromium "apt-get install -y chromium chromium-driver (scripts/install-chromium.sh)"; fi
  if km0_has_prometheus_client; then line ok prometheus-client "python3 (the metrics tests' parser)"
  else line MISSING prometheus-client "python3 -m pip install prometheus-client==0.26.0 (scripts/test.sh)"; fi
  if km0_has_moto_server; then line ok moto-server "python3 -m moto.server (the S3-compatible store the checkpoint tests start)"
  else line MISSING moto-server "python3 -m pip install 'moto[server]==5.2.1' (scripts/test.sh)"; fi
  if km0_has_postgres; then line ok postgresql "$(ls -d /usr/lib/postgresql/*/bin | head -n1) (PostgreSQL tests)"
  else line MISSING postgresql "apt-get install -y postgresql (scripts/install-postgres.sh)"; fi
fi
exit $missing
