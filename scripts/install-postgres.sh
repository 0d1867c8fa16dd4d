#!/usr/bin/env bash
# Make sure PostgreSQL's server programs (initdb, pg_ctl, postgres, psql) are installed;
# the tests start their own throwaway cluster on 127.0.0.1 (tests/services.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/prereqs.sh
km0_has_postgres && exit 0
echo "== installing PostgreSQL (apt)"
km0_apt_install postgresql || {
  echo "km0: PostgreSQL is not installed; fix with: apt-get install -y postgresql (initdb, pg_ctl, psql)" >&2
  exit 1
}
