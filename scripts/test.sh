#!/usr/bin/env bash
# Run every test: build the WASM plugins from plugins/, install the broker (tansu) and
# PostgreSQL that the Kafka tests start and the browser the UI test drives, then the
# workspace's unit and end-to-end tests (release profile, shared target folder), then
# clippy (warnings denied), the import-cycle check and the format check.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/km0-target}"
./scripts/setup.sh
start=$(date +%s)
echo "== module cycles (the host's top-level modules point one way)"
python3 scripts/module-cycles.py host/src
echo "== file cycles (the files of job/, window/, source/ and cli/ point one way)"
python3 scripts/module-cycles.py --files host/src/job host/src/window host/src/source host/src/source/json host/src/cli
./scripts/build-plugins.sh
# The broker the Kafka tests start (on loopback). On a fresh machine it builds from source
# (about 14 minutes on two cores), so it builds in the background while km0 and its tests
# do: where one build waits on a single crate or a link, the other has the second core.
# Its output goes to a log, shown if it fails; later runs find it installed at once.
tansu_log=$(mktemp)
./scripts/install-tansu.sh >"$tansu_log.bin" 2>"$tansu_log" &
tansu_pid=$!
# PostgreSQL, which the PostgreSQL tests start, and the browser the web UI's test drives.
./scripts/install-postgres.sh
./scripts/install-chromium.sh
# The Prometheus project's parser of the metrics text (tests/control_hostile.rs).
. scripts/lib/prereqs.sh
if ! km0_has_prometheus_client; then
  echo "== installing prometheus-client (PyPI)"
  python3 -m pip install --quiet "prometheus-client==0.26.0"
fi
# The S3-compatible server the checkpoint-store tests start (tests/services.rs).
if ! km0_has_moto_server; then
  echo "== installing moto[server] (PyPI)"
  python3 -m pip install --quiet "moto[server]==5.2.1"
fi
echo "== cargo test --no-run (release)"
cargo test --release --locked --workspace --no-run
if ! wait "$tansu_pid"; then
  cat "$tansu_log" >&2
  exit 1
fi
KM0_TANSU=$(cat "$tansu_log.bin")
export KM0_TANSU
rm -f "$tansu_log" "$tansu_log.bin"
echo "== prerequisites"
./scripts/doctor.sh
echo "== cargo test (release)"
# The Kafka tests (tests/kafka.rs, about 55 s, most of it the broker's work and waits) run
# beside the others, whose slowest (plugin authoring with the real toolchains, about 45 s)
# also waits on other processes: about 120 s for both against 150 one after the other (on
# two cores each slows the other: the Kafka tests took 95 s, the authoring ones 74). Each run
# selects targets of the whole workspace (--workspace), so that no dependency resolves
# with other features than the build above and is built again. The others are every test
# target but kafka, as `cargo metadata` lists them, and the unit and doc tests.
names=$(cargo metadata --locked --no-deps --format-version 1 | python3 -c '
import json, sys
for package in json.load(sys.stdin)["packages"]:
    for target in package["targets"]:
        if "test" in target["kind"] and target["name"] != "kafka":
            print(target["name"])')
[ -n "$names" ] || { echo "km0: cargo metadata lists no test targets" >&2; exit 1; }
others=()
for name in $names; do others+=(--test "$name"); done
kafka_log=$(mktemp)
cargo test --release --locked --workspace --test kafka >"$kafka_log" 2>&1 &
kafka_pid=$!
status=0
cargo test --release --locked --workspace --lib --bins "${others[@]}" && cargo test --release --locked --workspace --doc || status=$?
echo "== cargo test --test kafka (release, run beside the others)"
kafka_status=0
wait "$kafka_pid" || kafka_status=$?
cat "$kafka_log"
rm -f "$kafka_log"
[ "$status" = 0 ] || exit "$status"
[ "$kafka_status" = 0 ] || exit "$kafka_status"
# The Kafka and JSON benchmarks (tests/bench_kafka.rs, tests/bench_json.rs) are bench
# targets, which `cargo test` does not build: compiled here so that a change that breaks
# them fails CI (make bench runs them). Built by `cargo test --workspace`, as above, so that
# they reuse the dependencies just built: a `cargo build -p km0-e2e` resolves them without
# the workspace's dev-dependency features, which rebuilt wasmtime, cranelift and km0 (5 min
# on a fresh two-core machine).
echo "== cargo test --benches --no-run (release)"
cargo test --release --locked --workspace --benches --no-run
echo "== cargo clippy (release: the build scripts' outputs above are reused, ~2 min)"
cargo clippy --release --locked --workspace --all-targets -- -D warnings
echo "== cargo fmt --check"
cargo fmt --all -- --check
(cd plugins && cargo fmt --all -- --check)
echo "== all tests passed in $(( $(date +%s) - start )) s"
