#!/usr/bin/env bash
# Build km0's release binary with profile-guided optimisation (PGO), as `make release` and
# `make bench` do, and print its path ($CARGO_TARGET_DIR/pgo/km0):
#   1. km0's library (the whole data path) is built instrumented (-Cprofile-generate);
#   2. that binary runs a training set of jobs (`scripts/bench.py --train`): the kinds of
#      job the benchmark times (stock alert over tumbling and sliding windows, the delivery
#      panel's ordered panes and sessions), on other streams than the ones it times
#      (other key counts, sizes and late shares); a checkpoint and a recovery
#      with each state backend; the Kafka path when tansu is installed. What it does not
#      run (PostgreSQL sinks, the control API, followed inputs) is compiled as rarely run;
#   3. the library is built again, optimised with what the training measured
#      (-Cprofile-use): code laid out by heat, hot calls inlined, branches ordered. The
#      binary is copied out of cargo's folder, which the next plain build of km0 overwrites;
#      `km0 --version` says "(profile-guided)".
# Only km0's library is instrumented and optimised so: a rustc wrapper for workspace members
# (scripts/lib/rustc-pgo.sh) gives the flags to it alone. The dependencies are those `cargo
# build --release` built, and the binary's own code (the CLI, `km0 bench` and its reference
# loop, the machine's yardstick) is the same in both builds. The profile is kept in
# $CARGO_TARGET_DIR/pgo/km0.profdata.
# KM0_PGO=0, or no llvm-profdata to be had (rustup's llvm-tools component), builds plain
# and prints $CARGO_TARGET_DIR/release/km0.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/prereqs.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/km0-target}"
mkdir -p "$CARGO_TARGET_DIR/pgo"
CARGO_TARGET_DIR=$(cd "$CARGO_TARGET_DIR" && pwd)
out="$CARGO_TARGET_DIR/pgo"
# One build at a time in this target folder (its km0 changes between the stages).
exec 9>"$out/.lock"
flock 9
# The mode is read here; km0's compilation sees it only through build() below.
mode="${KM0_PGO:-1}"
unset KM0_PGO
plain() {
  cargo build --release --locked -p km0 >&2
  echo "$CARGO_TARGET_DIR/release/km0"
}
if [ "$mode" = 0 ]; then
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
for p in min-stock distance session-gap; do
  [ -f "plugins/dist/$p.wasm" ] || {
    ./scripts/build-plugins.sh >&2
    break
  }
done
work=$(mktemp -d "${TMPDIR:-/tmp}/km0-pgo.XXXXXX")
work=$(cd "$work" && pwd)
done=
cleanup() {
  rm -rf "$work"
  # Halfway: cargo's km0 is the instrumented one; nothing should time it, and the next
  # build must not take it for up to date.
  [ -n "$done" ] || cargo clean --release -p km0 -q || rm -f "$CARGO_TARGET_DIR/release/km0"
}
trap cleanup EXIT
# KM0_PGO (generate, use) selects the flag; km0 reads it, so cargo rebuilds km0 when it
# changes. RUSTC_WRAPPER (a compiler cache) is left out: it would not see the flag.
build() {
  KM0_PGO="$1" KM0_PGO_PATH="$2" RUSTC_WRAPPER= RUSTC_WORKSPACE_WRAPPER="$PWD/scripts/lib/rustc-pgo.sh" \
    cargo build --release --locked -p km0 >&2
}
echo "== km0 PGO 1/3: instrumented build" >&2
build generate "$work/raw"
if ! km0_has_tansu; then
  echo "== km0 PGO: no tansu (scripts/install-tansu.sh): the training leaves out the Kafka path" >&2
fi
echo "== km0 PGO 2/3: training (scripts/bench.py --train)" >&2
# Each process writes its own raw profile here (an LLVM_PROFILE_FILE of the caller's would
# send them elsewhere).
KM0_BIN="$CARGO_TARGET_DIR/release/km0" LLVM_PROFILE_FILE="$work/raw/km0-%p-%m.profraw" \
  python3 scripts/bench.py --train >&2
compgen -G "$work/raw/*.profraw" >/dev/null || {
  echo "km0: the training wrote no profile (in $work/raw)" >&2
  exit 1
}
"$profdata" merge -o "$work/km0.profdata" "$work/raw"
mv "$work/km0.profdata" "$out/km0.profdata"
echo "== km0 PGO 3/3: optimised build" >&2
build use "$out/km0.profdata"
done=1
cp "$CARGO_TARGET_DIR/release/km0" "$out/km0.tmp"
mv "$out/km0.tmp" "$out/km0"
"$out/km0" --version >&2
echo "$out/km0"
