#!/usr/bin/env bash
# Make sure PostgreSQL's server programs (initdb, pg_ctl, postgres, psql) are installed;
# the tests start their own throwaway cluster on 127.0.0.1 (tests/services.rs).
set -euo pipefail
if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "km0: PostgreSQL is not installed: install the 'postgresql' package (initdb, pg_ctl, psql)" >&2
  exit 1
fi
echo "== installing PostgreSQL (apt)"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
