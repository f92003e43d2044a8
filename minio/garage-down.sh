#!/usr/bin/env bash
# Stop the Garage server started by minio/garage-up.sh (same SW_GARAGE_DIR).
# With --purge, also delete its data.
set -euo pipefail
DIR=${SW_GARAGE_DIR:-$PWD/.garage}
if [ -f "$DIR/garage.pid" ]; then
  pid=$(cat "$DIR/garage.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$DIR/garage.pid"
fi
if [ "${1:-}" = "--purge" ]; then rm -rf "$DIR"; fi
