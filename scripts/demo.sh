#!/usr/bin/env bash
# The README's first command: build signalweave, generate a day of commerce events,
# load them into the embedded lake (./lake: SQLite catalog + local warehouse), query it,
# then run the HTTP gateway on the same lake, send it live events with `signalweave
# produce`, and query those.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/signalweave/target}
cargo build -p signalweave
SW="$CARGO_TARGET_DIR/debug/signalweave"
mkdir -p lake
"$SW" fixtures generate --out lake/demo.ndjson --expected lake/demo.expected.json \
  --events 200000 --events-per-sec 5 --dup-fraction 0.01 --late-fraction 0.01 --invalid-fraction 0.005
"$SW" lake init
"$SW" load lake/demo.ndjson
"$SW" sql "SELECT market_id, event_type, count(*) AS events, sum(amount_minor) AS amount_minor
           FROM signalweave.events
           WHERE event_time >= TIMESTAMP '2026-01-01T00:00:00Z' AND event_time < TIMESTAMP '2026-01-02T00:00:00Z'
           GROUP BY market_id, event_type ORDER BY events DESC LIMIT 10"
"$SW" sql "SELECT reason_code, count(*) AS rejected FROM signalweave.rejections GROUP BY reason_code"
"$SW" lake tables
echo "expected figures (from the generator): $(tr -d '\n ' < lake/demo.expected.json)"

echo "== the gateway: live events over HTTP into the same lake"
"$SW" gateway --listen 127.0.0.1:8088 2> lake/gateway.log &
gw=$!
trap 'kill -TERM $gw 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
  curl -sf http://127.0.0.1:8088/readyz >/dev/null 2>&1 && break
  sleep 0.2
done
"$SW" produce --url http://127.0.0.1:8088 --token sw-dev-tenant-0 --tenant tenant-0 \
  --producer-id demo-producer --rate 2000 --duration 5s --dup-fraction 0.01 --late-fraction 0.01 || true
"$SW" sql "SELECT producer_id, count(*) AS events, max(ingest_time) AS last_ingest
           FROM signalweave.events WHERE producer_id = 'demo-producer' GROUP BY producer_id"
kill -TERM $gw && wait $gw
trap - EXIT
tail -n 1 lake/gateway.log
