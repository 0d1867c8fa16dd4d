#!/usr/bin/env bash
# rustc for the workspace's crates during a profile-guided build (scripts/build-release.sh,
# as RUSTC_WORKSPACE_WRAPPER), on the path KM0_PGO_PATH (passed as one argument whatever
# it holds):
#   KM0_PGO_MODE=generate: km0's library and binary get -Cprofile-generate (the binary links the
#     profiling runtime only when it is instrumented itself);
#   KM0_PGO_MODE=use: km0's library alone gets -Cprofile-use. The binary's own code (the CLI,
#     `km0 bench` and its reference loop, the machine's yardstick) stays the same in
#     every build.
# Every other crate compiles as in any build: the dependencies' artifacts are the ones
# `cargo build --release` made. (km0 reads KM0_PGO_MODE with option_env!, so cargo rebuilds it
# when the mode changes.)
rustc="$1"
shift
prev=
name=
kind=
for arg in "$@"; do
  case "$prev" in
    --crate-name) name="$arg" ;;
    --crate-type) kind="$arg" ;;
  esac
  prev="$arg"
done
if [ "$name" = km0 ]; then
  case "${KM0_PGO_MODE:-}" in
    generate) exec "$rustc" "$@" "-Cprofile-generate=${KM0_PGO_PATH:?the path of the profile}" ;;
    use) [ "$kind" = lib ] && exec "$rustc" "$@" "-Cprofile-use=${KM0_PGO_PATH:?the path of the profile}" ;;
    "") ;;
    *)
      echo "rustc-pgo.sh: KM0_PGO_MODE is \"$KM0_PGO_MODE\": generate or use" >&2
      exit 2
      ;;
  esac
fi
exec "$rustc" "$@"
