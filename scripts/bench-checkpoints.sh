#!/usr/bin/env bash
# Checkpoint benchmark: ~1M open keyed windows (1000 products x 1000 markets in one
# 5-minute window), one checkpoint near the end of the input, for the memory and the
# RocksDB backends: processing pause, background write time, then recovery time; and
# stock-alert throughput with a checkpoint every 100k records.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/km0-target}"
km0="$CARGO_TARGET_DIR/release/km0"
# Each run's output is filtered down to its timing lines, so a missing input fails here, said.
for f in "$km0" plugins/dist/min-stock.wasm; do
  [ -e "$f" ] || { echo "km0: $f is missing: make bench builds it (or scripts/build-plugins.sh, cargo build --release)" >&2; exit 1; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$km0" generate stock --events 2000000 --products 1000 --markets 1000 --gap-ms 0 --late-fraction 0 --out "$work/keys.jsonl"
"$km0" generate stock --events 1000000 --out "$work/stock.jsonl"
for backend in memory rocksdb; do
  for case in keys stock; do
    every=$([ "$case" = keys ] && echo 1990000 || echo 100000)
    sed -e "s#path = \"data/stock.jsonl\"#path = \"$work/$case.jsonl\"#" \
        -e "s#../../plugins/dist/#$PWD/plugins/dist/#" \
        -e "s#dir = \"out/savepoints\"#dir = \"$work/sp-$backend-$case\"\n[checkpoints]\ndir = \"$work/chk-$backend-$case\"\ninterval = \"1h\"\nevery_records = $every\nretain = 2\n[state]\nbackend = \"$backend\"\ndir = \"$work/state-$backend\"#" \
        examples/stock-alert/pipeline.toml > "$work/$backend-$case.toml"
    sed -i "s#path = \"out/#path = \"$work/out-$backend-$case/#" "$work/$backend-$case.toml"
    echo "== $backend backend, $case"
    KM0_LOG=km0=debug "$km0" run "$work/$backend-$case.toml" --stop-with-savepoint-after 1999999 2>&1 \
      | grep -E "checkpoints, processing|checkpoint complete|this run" | sed -e 's/\x1b\[[0-9;]*m//g' -e 's/^.*DEBUG //'
    if [ "$case" = keys ]; then
      echo "   recovery:"
      "$km0" run "$work/$backend-$case.toml" 2>&1 | grep -E "recovered"
    fi
  done
done
