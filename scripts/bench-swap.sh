#!/usr/bin/env bash
# The pause of a live plugin swap with many open keyed windows (issue 14's benchmark):
# a stock-alert job follows a file of EVENTS updates over PRODUCTS x MARKETS keys, all in
# one 5-minute window (so every key's window stays open), then min-stock 0.1 is deployed
# again (same state schema) and min-stock 0.2 after it (schema 1 -> 2, every accumulator
# migrated). Prints each deploy's record: pause, savepoint and swap time.
#   scripts/bench-swap.sh [EVENTS] [PRODUCTS] [MARKETS] [CHECKPOINTS: no|memory|rocksdb]
# With checkpoints (every 2 s), the swaps come once one has been taken with every window:
# with RocksDB the rollback savepoint then holds only the changes since.
set -euo pipefail
cd "$(dirname "$0")/.."
events=${1:-3000000} products=${2:-1000} markets=${3:-1000} chk=${4:-no}
km0="${CARGO_TARGET_DIR:-$HOME/.cache/km0-target}/release/km0"
work=$(mktemp -d /tmp/km0-bench-swap.XXXXXX)
trap 'kill $pid 2>/dev/null || true; rm -rf "$work"' EXIT
"$km0" generate stock --events "$events" --products "$products" --markets "$markets" --gap-ms 0 \
  --late-fraction 0 --out "$work/in.jsonl"
sed -e "s#data/stock.jsonl#$work/in.jsonl#" -e "s#out/#$work/out/#" \
  -e "s#\.\./\.\./plugins#$PWD/plugins#" examples/stock-alert/pipeline.toml > "$work/p.toml"
if [ "$chk" != no ]; then
  printf '[checkpoints]\ndir = "%s/chk"\ninterval = "2s"\n[state]\nbackend = "%s"\ndir = "%s/rocks"\n' \
    "$work" "$chk" "$work" >> "$work/p.toml"
fi
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
export KM0_TOKEN=bench
"$km0" run --follow --http "127.0.0.1:$port" "$work/p.toml" > "$work/run.out" 2> "$work/run.err" & pid=$!
url="http://127.0.0.1:$port"
until "$km0" status --job "$url" --json 2>/dev/null | python3 -c '
import json,sys; v=json.load(sys.stdin); sys.exit(0 if v["counters"]["read"]=='"$events"' else 1)'; do sleep 0.5; done
if [ "$chk" != no ]; then sleep 6; fi
"$km0" status --job "$url" | grep -E "aggregation|checkpoints"
for plugin in min-stock min-stock-v2; do
  "$km0" deploy "plugins/dist/$plugin.wasm" --job "$url"
done
"$km0" stop --drain --job "$url" > /dev/null
wait $pid
