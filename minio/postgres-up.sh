#!/usr/bin/env bash
# Start a throwaway PostgreSQL (Debian's package) on loopback for the catalog database.
#
#   eval "$(minio/postgres-up.sh)"     # prints: export SW_PG_URL=postgres://...
#
# Installs the `postgresql` package with apt-get if initdb is missing. Runs the server
# as the `postgres` system user (PostgreSQL refuses root). Settings: SW_PG_DIR (data,
# default /tmp/signalweave-pg), SW_PG_PORT (default 5433). Idempotent. Stop it with
# minio/postgres-down.sh.
set -euo pipefail
DIR=${SW_PG_DIR:-/tmp/signalweave-pg}
PORT=${SW_PG_PORT:-5433}

bindir() {
  ls /usr/lib/postgresql/*/bin/initdb 2>/dev/null | sort -V | tail -n 1 | xargs -r dirname
}
if [ -z "$(bindir)" ]; then
  echo "PostgreSQL not found: installing Debian's postgresql package" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >&2
fi
BIN=$(bindir)
as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

if [ ! -f "$DIR/PG_VERSION" ]; then
  mkdir -p "$DIR"
  [ "$(id -u)" = 0 ] && chown postgres:postgres "$DIR"
  as_pg "$BIN/initdb" -D "$DIR" -U postgres --auth=trust -E UTF8 >/dev/null
fi
if ! as_pg "$BIN/pg_ctl" -D "$DIR" status >/dev/null 2>&1; then
  as_pg "$BIN/pg_ctl" -D "$DIR" -l "$DIR/server.log" -w \
    -o "-p $PORT -k $DIR -c listen_addresses=127.0.0.1 -c fsync=off" start >/dev/null
fi
for _ in $(seq 1 50); do
  if as_pg "$BIN/pg_isready" -h 127.0.0.1 -p "$PORT" >/dev/null 2>&1; then break; fi
  sleep 0.2
done
as_pg "$BIN/psql" -h 127.0.0.1 -p "$PORT" -U postgres -tAc \
  "SELECT 1 FROM pg_database WHERE datname='signalweave'" | grep -q 1 ||
  as_pg "$BIN/psql" -h 127.0.0.1 -p "$PORT" -U postgres -qc "CREATE DATABASE signalweave" >/dev/null
echo "export SW_PG_URL=postgres://postgres@127.0.0.1:$PORT/signalweave"
echo "export SW_PG_DIR=$DIR"
