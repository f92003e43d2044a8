#!/usr/bin/env bash
# The test command (README, and what .ci/run runs): installs and starts everything the
# tests need, then runs the whole suite against every backend.
#
# - Rust toolchain: the machine's rustup toolchain (cargo, rustc).
# - Garage (S3): installed with `cargo install garage --locked --version 2.5.0` if missing,
#   started on 127.0.0.1:3900 by minio/garage-up.sh.
# - PostgreSQL (catalog): Debian's package (installed with apt-get if missing), started on
#   127.0.0.1:5433 by minio/postgres-up.sh.
# - PyIceberg and PyArrow (interop test): pip, from tests/interop/requirements.txt.
# - Chromium (the reconciliation report is rendered headless): Debian's package, installed
#   with apt-get if missing.
#
# SW_REQUIRE_SERVICES=1 makes any test whose service is missing fail rather than skip.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/signalweave/target}
export CARGO_TERM_COLOR=never

if ! command -v curl >/dev/null 2>&1 || ! command -v runuser >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq curl util-linux
fi

if ! command -v chromium >/dev/null 2>&1; then
  echo "== chromium for the report rendering test"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
fi

echo "== python packages for the interop test"
python3 -m pip install -q --disable-pip-version-check -r tests/interop/requirements.txt

echo "== services"
export SW_GARAGE_DIR=${SW_GARAGE_DIR:-$PWD/.garage}
cleanup() {
  minio/garage-down.sh || true
  minio/postgres-down.sh || true
}
trap cleanup EXIT
# Capture first: `eval "$(failing)"` would hide the failure.
garage_env=$(minio/garage-up.sh)
eval "$garage_env"
pg_env=$(minio/postgres-up.sh)
eval "$pg_env"
export SW_REQUIRE_SERVICES=1

echo "== tests"
log=$(mktemp)
set +e
cargo test --workspace --locked 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
# One closing line over every test binary (the last cargo line is often a doc-test run of 0).
awk '/^test result:/ {p += $4; f += $6} END {printf "tests: %d passed, %d failed\n", p, f}' "$log"
rm -f "$log"
exit "$status"
