#!/usr/bin/env bash
# Install the tansu broker (Apache-Kafka-compatible, Rust, from crates.io) once into a
# cache folder shared by sessions and CI, and print the path of its binary. Building it
# takes 10 to 15 minutes on a fresh two-core machine; later calls return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/prereqs.sh
bin=$(km0_tansu_bin)
root=$(dirname "$(dirname "$bin")")
if [ ! -x "$bin" ]; then
  echo "== building tansu 0.6.0 (SQLite storage) into $root (10-15 min, once)" >&2
  # At opt-level 1: a fresh machine's build (CI's limit: 30 minutes) 3.3 minutes shorter,
  # for 13 s more in the Kafka tests.
  CARGO_TARGET_DIR="${KM0_TOOLS:-$HOME/.cache/km0-tools}/tansu-target" \
  CARGO_PROFILE_RELEASE_OPT_LEVEL=1 \
    cargo install tansu --version 0.6.0 --locked --features dynostore,libsql --root "$root" >&2
fi
[ -x "$bin" ] || { echo "km0: building tansu failed; fix the error above and run scripts/install-tansu.sh again" >&2; exit 1; }
echo "$bin"
