#!/usr/bin/env bash
# Build every guest in plugins/ as a WebAssembly component (wasm32-wasip2) and copy them
# to plugins/dist/<name>.wasm, where pipelines and tests find them.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/km0-target}"
if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2; then
  echo "== installing the wasm32-wasip2 Rust target"
  rustup target add wasm32-wasip2
fi
echo "== building plugins (wasm32-wasip2, release)"
(cd plugins && cargo build --release --target wasm32-wasip2 --locked)
mkdir -p plugins/dist
for wasm in "$CARGO_TARGET_DIR"/wasm32-wasip2/release/*.wasm; do
  name=$(basename "$wasm" .wasm | tr '_' '-')
  cp "$wasm" "plugins/dist/$name.wasm"
  echo "   plugins/dist/$name.wasm ($(wc -c < "$wasm") bytes)"
done
