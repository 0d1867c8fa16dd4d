#!/usr/bin/env bash
# Build every guest in plugins/ as a WebAssembly component (wasm32-wasip2) and copy them
# to plugins/dist/<name>.wasm, where pipelines and tests find them.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/km0-target}"
. scripts/lib/prereqs.sh
if ! km0_has_wasm_target; then
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

# Plugins in Python: componentize-py (PyPI) turns plugins/python/<name>/aggregate.py, with
# the helper plugins/python/km0_sdk.py, into a component.
if ! km0_has_componentize_py; then
  echo "== installing componentize-py (PyPI)"
  python3 -m pip install --quiet "componentize-py==0.25.1" \
    || { echo "km0: componentize-py could not be installed (fix: python3 -m pip install componentize-py==0.25.1): the Python plugins cannot be built" >&2; exit 1; }
  # pyenv (and similar) put new console scripts on PATH only after a rehash.
  if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
  km0_has_componentize_py || { echo "km0: componentize-py was installed but is not on PATH: add $(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))') to PATH" >&2; exit 1; }
fi
for src in plugins/python/*/aggregate.py; do
  dir=$(dirname "$src")
  name=$(basename "$dir")
  out="plugins/dist/$name-py.wasm"
  # Rebuild only when a source changed (componentizing takes ~10 s).
  if [ ! -f "$out" ] || [ -n "$(find "$dir" plugins/python/km0_sdk.py wit -newer "$out" -print -quit)" ]; then
    componentize-py --wit-path wit --world aggregate-plugin componentize \
      -p "$dir" -p plugins/python aggregate -o "$out" >/dev/null
  fi
  echo "   $out ($(wc -c < "$out") bytes)"
done

# Plugins in JavaScript: componentize-js (npm), through its API (plugins/js/build.mjs).
if [ -n "$(ls plugins/js/*/aggregate.js 2>/dev/null)" ]; then
  if ! km0_has_node; then
    echo "== installing node and npm (apt)"
    km0_apt_install nodejs npm && km0_has_node || {
      echo "km0: node and npm are needed to build the JavaScript plugins (fix: apt-get install -y nodejs npm)" >&2
      exit 1
    }
  fi
  if [ ! -d plugins/js/node_modules/@bytecodealliance/componentize-js ]; then
    echo "== installing componentize-js (npm)"
    (cd plugins/js && npm install --silent --no-audit --no-fund)
  fi
  for src in plugins/js/*/aggregate.js; do
    name=$(basename "$(dirname "$src")")
    out="plugins/dist/$name-js.wasm"
    if [ ! -f "$out" ] || [ -n "$(find "$(dirname "$src")" plugins/js/km0_sdk.js plugins/js/build.mjs wit -newer "$out" -print -quit)" ]; then
      node plugins/js/build.mjs "$src" wit "$out"
    fi
    echo "   $out ($(wc -c < "$out") bytes)"
  done
fi
