#!/usr/bin/env bash
# rustc for the workspace's crates during a profile-guided build (scripts/build-release.sh,
# as RUSTC_WORKSPACE_WRAPPER): the flags in KM0_PGO_FLAGS go to the km0 crate alone (its
# library and binary); every other crate compiles as in any build, so its artifacts are
# the ones `cargo build --release` made.
rustc="$1"
shift
prev=
for arg in "$@"; do
  if [ "$prev" = "--crate-name" ] && [ "$arg" = "km0" ]; then
    # shellcheck disable=SC2086 # KM0_PGO_FLAGS is a list of flags
    exec "$rustc" "$@" ${KM0_PGO_FLAGS:-}
  fi
  prev="$arg"
done
exec "$rustc" "$@"
