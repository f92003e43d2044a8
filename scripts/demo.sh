#!/usr/bin/env bash
# The README's first command: build signalweave, generate a day of commerce events,
# load them into the embedded lake (./lake: SQLite catalog + local warehouse), query it,
# then run `signalweave demo`: the gateway, the live market_aggregates job and the serving
# API on the same lake, fed by a producer with late and duplicate events, ending with a
# reconciliation of the outputs against an SQL recount of the landing table.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/signalweave/target}
cargo build -p signalweave
SW="$CARGO_TARGET_DIR/debug/signalweave"
mkdir -p lake
"$SW" fixtures generate --out lake/demo.ndjson --expected lake/demo.expected.json \
  --events 200000 --events-per-sec 5 --dup-fraction 0.01 --late-fraction 0.01 --invalid-fraction 0.005
"$SW" lake init
# In commits of 5,000 records: the live job reads them in that order, so events sent late
# (minutes to 3 h behind) arrive after later ones, as they would live.
"$SW" load lake/demo.ndjson --chunk-records 5000
"$SW" sql "SELECT market_id, event_type, count(*) AS events, sum(amount_minor) AS amount_minor
           FROM signalweave.events
           WHERE event_time >= TIMESTAMP '2026-01-01T00:00:00Z' AND event_time < TIMESTAMP '2026-01-02T00:00:00Z'
           GROUP BY market_id, event_type ORDER BY events DESC LIMIT 10"
"$SW" sql "SELECT reason_code, count(*) AS rejected FROM signalweave.rejections GROUP BY reason_code"
"$SW" lake tables
echo "expected figures (from the generator): $(tr -d '\n ' < lake/demo.expected.json)"

echo "== live: gateway + live job + serving on the same lake, a producer with late and duplicate events"
# Ends with a reconciliation of the job's outputs against an SQL recount (exit 1 if they differ).
"$SW" demo --duration "${SW_DEMO_DURATION:-60s}" --rate "${SW_DEMO_RATE:-2000}"
"$SW" sql "SELECT key, window_start, output_version, completeness, placed_count, placed_amount_minor
           FROM signalweave.market_aggregates_current ORDER BY window_start DESC, key LIMIT 10"

echo "== backfill: job version 2 (4 h of allowed lateness instead of 2 h) over the loaded day,"
echo "   into a namespace of its own; then what it would change in the live outputs"
NS="demo_v2_$(date +%s)"
"$SW" backfill start --job market_aggregates --job-version 2 --namespace "$NS" \
  --from 2026-01-01T00:00:00Z --to 2026-01-02T00:00:00Z
"$SW" backfill status --job market_aggregates --namespace "$NS"
"$SW" backfill compare --job market_aggregates --namespace "$NS" --limit 5
echo "(promote it with: $SW backfill promote --job market_aggregates --namespace $NS)"
echo "== audit: every window of the loaded day recomputed by an independent SQL oracle, every"
echo "   event accounted for (counted, duplicate, late, rejected); report in lake/report-live/"
"$SW" reconcile --job market_aggregates --from 2026-01-01T00:00:00Z --to 2026-01-02T00:00:00Z \
  --out lake/report-live
echo "   and the version-2 backfill's namespace, before any promotion: lake/report-$NS/"
"$SW" reconcile --job market_aggregates --namespace "$NS" \
  --from 2026-01-01T00:00:00Z --to 2026-01-02T00:00:00Z --out "lake/report-$NS"
echo "== capacity: the reference design's model (fixtures/slo-sheet.toml)"
"$SW" plan --sheet fixtures/slo-sheet.toml
