#!/usr/bin/env bash
# Build km0's release binary with profile-guided optimisation (PGO), as `make release` and
# `make bench` do, and print its path:
#   1. the km0 crate is built instrumented (-Cprofile-generate);
#   2. that binary runs a training set of jobs (`scripts/bench.py --train`): the cases the
#      benchmark times, on other streams (other key counts, sizes and late shares), so that
#      the profile learns which paths of the code are hot rather than the measured inputs;
#      checkpoints and recovery with both state backends; the Kafka path when tansu is
#      installed;
#   3. the km0 crate is built again, optimised with what the training measured
#      (-Cprofile-use): code laid out by heat, hot calls inlined, branches ordered.
# Only the km0 crate (library and binary) is instrumented and rebuilt: a rustc wrapper for
# workspace members (scripts/lib/rustc-pgo.sh) gives the flags to it alone, so the
# dependencies are those `cargo build --release` built. A later plain `cargo build` builds
# km0 plain again.
# The profile is kept in $CARGO_TARGET_DIR/pgo/km0.profdata.
# KM0_PGO=0, or no llvm-profdata to be had (rustup's llvm-tools component), builds plain.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/prereqs.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/km0-target}"
bin="$CARGO_TARGET_DIR/release/km0"
# What the binary is, for `make bench`'s table (stale once cargo builds km0 again: newer).
built() {
  echo "$1" >"$bin.build"
  echo "$bin"
}
plain() {
  cargo build --release --locked -p km0 >&2
  built plain
}
if [ "${KM0_PGO:-1}" = 0 ]; then
  echo "== km0: plain release build (KM0_PGO=0)" >&2
  plain
  exit 0
fi
if ! profdata=$(km0_llvm_profdata); then
  echo "== installing rustup's llvm-tools (llvm-profdata, for the profile-guided build)" >&2
  rustup component add llvm-tools >&2 || true
  if ! profdata=$(km0_llvm_profdata); then
    echo "km0: no llvm-profdata (rustup component add llvm-tools): a plain release build, without PGO" >&2
    plain
    exit 0
  fi
fi
# The training needs the plugins it runs.
for p in min-stock distance session-gap; do [ -f "plugins/dist/$p.wasm" ] || { ./scripts/build-plugins.sh >&2; break; }; done
work=$(mktemp -d "${TMPDIR:-/tmp}/km0-pgo.XXXXXX")
trap 'rm -rf "$work"' EXIT
build() {
  # A changed flag is not a changed fingerprint: km0's artifacts go first.
  cargo clean --release -p km0 -q
  KM0_PGO_FLAGS="$1" RUSTC_WORKSPACE_WRAPPER="$PWD/scripts/lib/rustc-pgo.sh" \
    cargo build --release --locked -p km0 >&2
}
echo "== km0 PGO 1/3: instrumented build" >&2
build "-Cprofile-generate=$work/raw"
echo "== km0 PGO 2/3: training (scripts/bench.py --train)" >&2
python3 scripts/bench.py --train >&2
# Kept: the test suite can run on the same optimised code (see the README).
mkdir -p "$CARGO_TARGET_DIR/pgo"
"$profdata" merge -o "$CARGO_TARGET_DIR/pgo/km0.profdata" "$work/raw"
echo "== km0 PGO 3/3: optimised build" >&2
build "-Cprofile-use=$CARGO_TARGET_DIR/pgo/km0.profdata"
built pgo
