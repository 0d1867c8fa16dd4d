#!/usr/bin/env bash
# Build km0's release binary with profile-guided optimisation (PGO), as `make release` and
# `make bench` do, and print its path ($CARGO_TARGET_DIR/pgo/km0):
#   1. km0 is built instrumented (-Cprofile-generate: its library, the whole data path, and
#      its binary, which must link the profiling runtime);
#   2. that binary runs a training set of jobs (`scripts/bench.py --train`): the kinds of
#      job the benchmark times (stock alert over tumbling and sliding windows, the delivery
#      panel's ordered panes and sessions), on other streams than the ones it times
#      (other key counts, sizes and late shares); a checkpoint and a recovery
#      with each state backend; the Kafka path when tansu is installed. What it does not
#      run (PostgreSQL sinks, the control API, followed inputs, the host side of Python and
#      JavaScript plugins) is compiled as rarely run;
#   3. km0's library alone is built again, optimised with what the training measured
#      (-Cprofile-use): code laid out by heat, hot calls inlined, branches ordered. The
#      binary is copied out of cargo's folder, which the next plain build of km0 overwrites;
#      `km0 --version` says "(profile-guided)".
# A rustc wrapper for workspace members (scripts/lib/rustc-pgo.sh) gives the flags to km0
# alone. The dependencies are those `cargo build --release` built, and the binary's own code
# (the CLI, `km0 bench` and its reference loop, the machine's yardstick) is compiled as in a
# plain build. The profile is kept in $CARGO_TARGET_DIR/pgo/km0.profdata.
# KM0_PGO=0 (or no, false, off), or no llvm-profdata to be had (rustup's llvm-tools
# component), builds plain and prints $CARGO_TARGET_DIR/release/km0. One build runs at a time
# per target folder: another waits for it.
set -euo pipefail
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/km0-target}"
mkdir -p "$CARGO_TARGET_DIR/pgo"
CARGO_TARGET_DIR=$(cd "$CARGO_TARGET_DIR" && pwd)
out="$CARGO_TARGET_DIR/pgo"
# One build at a time in this target folder (its km0 changes between the stages): the
# script runs again under flock, which holds the lock and keeps it from the processes the
# build starts (-o), so that none of them outlives the build holding it.
if [ -z "${KM0_RELEASE_LOCKED:-}" ]; then
  flock -n "$out/.lock" true || echo "== km0: another release build is running in $CARGO_TARGET_DIR: waiting for it" >&2
  self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
  KM0_RELEASE_LOCKED=1 exec flock -o "$out/.lock" "$self" "$@"
fi
unset KM0_RELEASE_LOCKED
cd "$(dirname "$0")/.."
. scripts/lib/prereqs.sh
# The user's switch. The compiled mode is KM0_PGO_MODE, set by build() below for km0's
# compilation alone; a stray one must not reach the plain build.
case "${KM0_PGO:-1}" in
  0 | no | false | off) mode=plain ;;
  1 | yes | true | on) mode=pgo ;;
  *)
    echo "km0: KM0_PGO is \"$KM0_PGO\": 1 (profile-guided, the default) or 0 (a plain build)" >&2
    exit 2
    ;;
esac
unset KM0_PGO KM0_PGO_MODE KM0_PGO_PATH
plain() {
  cargo build --release --locked -p km0 >&2
  echo "$CARGO_TARGET_DIR/release/km0"
}
if [ "$mode" = plain ]; then
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
  # Halfway, cargo's km0 may be the instrumented one: nothing should time it. Cargo builds
  # a missing binary again (and rebuilds km0 anyway, its KM0_PGO_MODE having changed).
  [ -n "$done" ] || rm -f "$CARGO_TARGET_DIR/release/km0"
}
trap cleanup EXIT
# KM0_PGO_MODE (generate, use) selects the flag; km0 reads it, so cargo rebuilds km0 when
# it changes. RUSTC_WRAPPER (a compiler cache) is left out: it would not see the flag.
build() {
  KM0_PGO_MODE="$1" KM0_PGO_PATH="$2" RUSTC_WRAPPER= RUSTC_WORKSPACE_WRAPPER="$PWD/scripts/lib/rustc-pgo.sh" \
    cargo build --release --locked -p km0 >&2
}
# The binary at $1 says it is the $2 build (km0 --version), or the script stops.
expect_build() {
  local said
  said=$(LLVM_PROFILE_FILE="$work/version-%p.profraw" "$1" --version)
  case "$said" in
    *"($2"*) echo "   $said" >&2 ;;
    *)
      echo "km0: $1 says \"$said\", not the $2 build" >&2
      exit 1
      ;;
  esac
}
echo "== km0 PGO 1/3: instrumented build" >&2
build generate "$work/raw"
cp "$CARGO_TARGET_DIR/release/km0" "$work/km0"
expect_build "$work/km0" instrumented
if ! km0_has_tansu; then
  echo "== km0 PGO: no tansu (scripts/install-tansu.sh): the training leaves out the Kafka path" >&2
fi
echo "== km0 PGO 2/3: training (scripts/bench.py --train)" >&2
# Each process writes its own raw profile here (an LLVM_PROFILE_FILE of the caller's would
# send them elsewhere).
KM0_BIN="$work/km0" LLVM_PROFILE_FILE="$work/raw/km0-%p-%m.profraw" python3 scripts/bench.py --train >&2
shopt -s nullglob
raw=("$work"/raw/*.profraw)
shopt -u nullglob
if [ "${#raw[@]}" = 0 ]; then
  echo "km0: the training wrote no profile (in $work/raw)" >&2
  exit 1
fi
"$profdata" merge -o "$out/km0.profdata.tmp" "${raw[@]}"
mv "$out/km0.profdata.tmp" "$out/km0.profdata"
echo "== km0 PGO 3/3: optimised build" >&2
build use "$out/km0.profdata"
done=1
cp "$CARGO_TARGET_DIR/release/km0" "$out/km0.tmp"
expect_build "$out/km0.tmp" profile-guided
mv "$out/km0.tmp" "$out/km0"
echo "$out/km0"
