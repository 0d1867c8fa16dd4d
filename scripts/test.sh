#!/usr/bin/env bash
# Run every test: build the WASM plugins from plugins/, install the broker (tansu) and
# PostgreSQL that the Kafka tests start and the browser the UI test drives, then the
# workspace's unit and end-to-end tests (release profile, shared target folder), then the
# format check.
#
# On a fresh machine the broker is built from source (~13 min of 2 cores) in the
# background while the plugins and the tests build: each of the two builds leaves a core
# idle at times (one large crate or file left to compile), which the other fills.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/km0-target}"
./scripts/setup.sh
start=$(date +%s)
tansu_out=$(mktemp)
tansu_log=$(mktemp)
trap 'rm -f "$tansu_out" "$tansu_log"' EXIT
./scripts/install-tansu.sh >"$tansu_out" 2>"$tansu_log" &
tansu_pid=$!
./scripts/build-plugins.sh
# Services the Kafka and PostgreSQL tests start for themselves (on loopback).
./scripts/install-postgres.sh
# The browser the web UI's test drives.
./scripts/install-chromium.sh
echo "== cargo test --no-run (release)"
cargo test --release --locked --workspace --no-run
if ! wait "$tansu_pid"; then
  cat "$tansu_log" >&2
  exit 1
fi
grep -v '^ *\(Compiling\|Downloaded\|Downloading\)' "$tansu_log" >&2 || true
KM0_TANSU=$(cat "$tansu_out")
export KM0_TANSU
echo "== prerequisites"
./scripts/doctor.sh
echo "== cargo test (release)"
cargo test --release --locked --workspace
echo "== cargo fmt --check"
cargo fmt --all -- --check
(cd plugins && cargo fmt --all -- --check)
echo "== all tests passed in $(( $(date +%s) - start )) s"
