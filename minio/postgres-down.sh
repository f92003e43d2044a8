#!/usr/bin/env bash
# Stop the PostgreSQL started by minio/postgres-up.sh. With --purge, delete its data.
set -euo pipefail
DIR=${SW_PG_DIR:-/tmp/signalweave-pg}
BIN=$(ls /usr/lib/postgresql/*/bin/initdb 2>/dev/null | sort -V | tail -n 1 | xargs -r dirname)
as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}
if [ -n "$BIN" ] && [ -f "$DIR/PG_VERSION" ]; then
  as_pg "$BIN/pg_ctl" -D "$DIR" -m fast stop >/dev/null 2>&1 || true
fi
if [ "${1:-}" = "--purge" ]; then rm -rf "$DIR"; fi
