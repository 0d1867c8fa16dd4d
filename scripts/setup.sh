#!/usr/bin/env bash
# Install what building km0 needs beyond a Rust toolchain: the wasm32-wasip2 target
# (plugins) and libclang (bindgen, for the bundled RocksDB). Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/prereqs.sh
if ! km0_has_wasm_target; then
  echo "== installing the wasm32-wasip2 Rust target"
  rustup target add wasm32-wasip2
fi
if ! km0_find_libclang >/dev/null; then
  echo "== installing libclang-dev (bindgen needs libclang.so to build the bundled RocksDB)"
  km0_apt_install libclang-dev || {
    echo "km0: libclang is missing; fix with: apt-get install -y libclang-dev (then run this again)" >&2
    exit 1
  }
  km0_find_libclang >/dev/null || {
    echo "km0: libclang-dev was installed but no libclang.so was found; set LIBCLANG_PATH to its folder" >&2
    exit 1
  }
fi
