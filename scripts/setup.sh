#!/usr/bin/env bash
# Install what building km0 needs beyond a Rust toolchain: the wasm32-wasip2 target
# (plugins) and libclang (bindgen, for the bundled RocksDB). Safe to run repeatedly.
set -euo pipefail
if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2; then
  echo "== installing the wasm32-wasip2 Rust target"
  rustup target add wasm32-wasip2
fi
if ! ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 && ! ldconfig -p 2>/dev/null | grep -q libclang; then
  echo "== installing libclang-dev (needed to build the bundled RocksDB)"
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq libclang-dev
  elif command -v sudo >/dev/null 2>&1; then
    sudo apt-get update -qq && sudo apt-get install -y -qq libclang-dev
  else
    echo "km0: libclang is missing; install libclang-dev (Debian/Ubuntu) and run again" >&2
    exit 1
  fi
fi
