# Detection of km0's build and test prerequisites, each checked the way its consumer uses it.
# Sourced by setup.sh, doctor.sh, test.sh and build-release.sh; tested against fake file
# layouts in host/tests/prereqs.rs. Every function returns 0 when the prerequisite is usable.

# bindgen (through clang-sys) dlopens `libclang.so`, `libclang-<N>.so`, `libclang.so.<N>` or
# `libclang-<N>.so.<M>`, from LIBCLANG_PATH, `llvm-config --libdir` or the usual library
# folders. `libclang-cpp.so.*` (package libclang-cpp14, on the fresh image) is a different
# library that bindgen cannot use: it must not count.
# $1: a root to prepend to every folder (a fake layout in tests; empty for this machine).
km0_find_libclang() {
  local root="${1:-}" dir f name
  local dirs=()
  [ -n "${LIBCLANG_PATH:-}" ] && [ -z "$root" ] && dirs+=("$LIBCLANG_PATH")
  if [ -z "$root" ] && command -v llvm-config >/dev/null 2>&1; then
    dirs+=("$(llvm-config --libdir 2>/dev/null)")
  fi
  for dir in "$root"/usr/lib/llvm-*/lib "$root"/usr/lib/x86_64-linux-gnu "$root"/usr/lib64 \
             "$root"/usr/lib "$root"/usr/local/lib "$root"/lib/x86_64-linux-gnu; do
    dirs+=("$dir")
  done
  for dir in "${dirs[@]}"; do
    [ -d "$dir" ] || continue
    for f in "$dir"/libclang.so "$dir"/libclang.so.* "$dir"/libclang-*.so "$dir"/libclang-*.so.*; do
      [ -e "$f" ] || continue
      name=$(basename "$f")
      case "$name" in
        libclang-cpp*) continue ;;
      esac
      echo "$f"
      return 0
    done
  done
  return 1
}

km0_has_wasm_target() {
  rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2
}

km0_has_componentize_py() {
  command -v componentize-py >/dev/null 2>&1 && componentize-py --version >/dev/null 2>&1
}

# The Prometheus project's Python client: its OpenMetrics parser reads /metrics in the tests.
km0_has_prometheus_client() {
  python3 -c 'import prometheus_client.openmetrics.parser' >/dev/null 2>&1
}

# moto's S3 server (tests/services.rs starts it for the checkpoint-store tests).
km0_has_moto_server() {
  python3 -c 'import moto.server, flask, flask_cors' >/dev/null 2>&1
}

km0_has_node() {
  command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1
}

km0_tansu_bin() {
  echo "${KM0_TOOLS:-$HOME/.cache/km0-tools}/tansu-0.6.0/bin/tansu"
}

km0_has_postgres() {
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1
}

# A browser that runs headless and the WebDriver that drives it (the web UI's test).
km0_has_chromium() {
  command -v "${KM0_CHROMIUM:-chromium}" >/dev/null 2>&1 && command -v "${KM0_CHROMEDRIVER:-chromedriver}" >/dev/null 2>&1
}

# Run apt-get install for the given packages, as root or through sudo.
km0_apt_install() {
  local sudo=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "km0: run as root: apt-get install -y $*" >&2; return 1; }
    sudo=sudo
  fi
  command -v apt-get >/dev/null 2>&1 || { echo "km0: no apt-get here: install $* with this system's package manager" >&2; return 1; }
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}

# llvm-profdata of the active Rust toolchain (rustup's llvm-tools component: its LLVM is
# rustc's, as profile-guided builds need), for scripts/build-release.sh.
km0_llvm_profdata() {
  local sysroot host
  sysroot=$("${RUSTC:-rustc}" --print sysroot 2>/dev/null) || return 1
  host=$("${RUSTC:-rustc}" -vV 2>/dev/null | sed -n 's/^host: //p')
  [ -x "$sysroot/lib/rustlib/$host/bin/llvm-profdata" ] || return 1
  echo "$sysroot/lib/rustlib/$host/bin/llvm-profdata"
}

# The tansu broker, where scripts/bench.py looks for it: KM0_TANSU, the folder
# scripts/install-tansu.sh installs into, or PATH.
km0_has_tansu() {
  { [ -n "${KM0_TANSU:-}" ] && [ -x "$KM0_TANSU" ]; } || [ -x "$(km0_tansu_bin)" ] || command -v tansu >/dev/null 2>&1
}
