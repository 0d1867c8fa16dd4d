#!/usr/bin/env bash
# Set up and run the jobs on the embedded default (files, no broker): install the wasm
# target if needed, build the plugins and km0, run the Kilómetro Cero low-stock alert and
# the delivery panel over their bundled data, and print results.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/km0-target}"
./scripts/setup.sh
./scripts/build-plugins.sh
echo "== building km0 (release)"
cargo build --release --locked -p km0
km0="$CARGO_TARGET_DIR/release/km0"
ex=examples/stock-alert
echo "== km0 run $ex/pipeline.toml"
"$km0" run "$ex/pipeline.toml"
echo "== first alerts in $ex/out/alertas.jsonl ($(wc -l < "$ex/out/alertas.jsonl") in all)"
head -n 8 "$ex/out/alertas.jsonl"
echo "== the lesson's golden trace (10:00-10:15, delay 2 min)"
"$km0" run "$ex/pipeline.toml" --input "$ex/data/golden-trace.jsonl" --output "$ex/out/golden-alertas.jsonl"
cat "$ex/out/golden-alertas.jsonl"
ex=examples/delivery-panel
echo "== km0 run $ex/pipeline.toml (distance over sliding windows + sessions without signal)"
"$km0" run "$ex/pipeline.toml"
echo "== some of $ex/out/panel.jsonl ($(wc -l < "$ex/out/panel.jsonl") results)"
grep -m 3 '"distancia|' "$ex/out/panel.jsonl"
grep -m 3 '"sin_senal|' "$ex/out/panel.jsonl"
