#!/usr/bin/env bash
# Start a single-node Garage S3 server on loopback, for tests and for users.
#
# Installs Garage if it is missing (`cargo install garage --locked --version 2.5.0`),
# starts it with one bucket and one key, waits until the S3 API answers, writes a
# SignalWeave lake profile, and prints the environment to use:
#
#   eval "$(minio/garage-up.sh)"
#   signalweave --lake "$SW_LAKE_PROFILE" lake init
#
# Settings (environment): SW_GARAGE_DIR (state, default ./.garage), SW_GARAGE_PORT
# (S3 port, default 3900; RPC and admin use the next two ports), SW_S3_BUCKET
# (default signalweave). Idempotent: if this directory's Garage is running, it only
# prints the environment. Stop it with minio/garage-down.sh.
set -euo pipefail

GARAGE_VERSION=2.5.0
DIR=${SW_GARAGE_DIR:-$PWD/.garage}
PORT=${SW_GARAGE_PORT:-3900}
RPC_PORT=$((PORT + 1))
ADMIN_PORT=$((PORT + 3))
BUCKET=${SW_S3_BUCKET:-signalweave}
# Fixed, local-only credentials in Garage's key format (GK + 24 hex; 64 hex secret).
ACCESS_KEY=GK5157a3e4b1a8c0d2f6e9b7a1
SECRET_KEY=7c1f0e5d2b9a4c8e6f3d1a0b5c7e9f2a4d6b8c0e1f3a5c7e9b2d4f6a8c0e1f35
RPC_SECRET=3e1d5a8c9b0f2e4d6c8a1b3e5f7d9c2b4a6e8f0d1c3b5a7e9f2d4c6b8a0e1f35

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

if ! command -v curl >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq curl) >&2
fi
if ! command -v garage >/dev/null 2>&1; then
  echo "garage not found: installing garage $GARAGE_VERSION with cargo (a few minutes)" >&2
  cargo install garage --locked --version "$GARAGE_VERSION" >&2
fi

cat > "$DIR/garage.toml" <<TOML
metadata_dir = "$DIR/meta"
data_dir = "$DIR/data"
db_engine = "sqlite"
replication_factor = 1
rpc_bind_addr = "127.0.0.1:$RPC_PORT"
rpc_public_addr = "127.0.0.1:$RPC_PORT"
rpc_secret = "$RPC_SECRET"

[s3_api]
s3_region = "garage"
api_bind_addr = "127.0.0.1:$PORT"
root_domain = ".s3.garage.localhost"

[admin]
api_bind_addr = "127.0.0.1:$ADMIN_PORT"
TOML

running() {
  [ -f "$DIR/garage.pid" ] && kill -0 "$(cat "$DIR/garage.pid")" 2>/dev/null
}

answering() {
  # Any HTTP status (403 for an anonymous request) means the S3 API is up.
  curl -s --max-time 2 -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/" 2>/dev/null | grep -q '^[1-5]'
}

if ! running; then
  GARAGE_DEFAULT_ACCESS_KEY=$ACCESS_KEY \
  GARAGE_DEFAULT_SECRET_KEY=$SECRET_KEY \
  GARAGE_DEFAULT_BUCKET=$BUCKET \
  RUST_LOG=${RUST_LOG:-garage=warn} \
    nohup garage -c "$DIR/garage.toml" server --single-node --default-bucket \
      >"$DIR/garage.log" 2>&1 &
  echo $! > "$DIR/garage.pid"
fi

for _ in $(seq 1 150); do
  if answering; then break; fi
  if ! running; then
    echo "garage exited; its log:" >&2
    tail -n 30 "$DIR/garage.log" >&2
    exit 1
  fi
  sleep 0.2
done
if ! answering; then
  echo "garage did not answer on 127.0.0.1:$PORT within 30 s; see $DIR/garage.log" >&2
  exit 1
fi
# The default bucket and key are created just after the API starts: wait for them.
bucket_ready=no
for _ in $(seq 1 150); do
  if garage -c "$DIR/garage.toml" bucket info "$BUCKET" >/dev/null 2>&1; then bucket_ready=yes; break; fi
  sleep 0.2
done
if [ "$bucket_ready" != yes ]; then
  echo "garage is up but bucket $BUCKET did not appear within 30 s; see $DIR/garage.log" >&2
  exit 1
fi

cat > "$DIR/profile.toml" <<TOML
# SignalWeave lake profile: SQLite catalog + Garage S3 warehouse (written by minio/garage-up.sh).
catalog_url = "sqlite://$DIR/catalog.db"

[warehouse]
kind = "s3"
endpoint = "http://127.0.0.1:$PORT"
region = "garage"
bucket = "$BUCKET"
prefix = "warehouse"
access_key_id = "$ACCESS_KEY"
secret_access_key = "$SECRET_KEY"
path_style = true
TOML

cat <<ENV
export SW_S3_ENDPOINT=http://127.0.0.1:$PORT
export SW_S3_REGION=garage
export SW_S3_BUCKET=$BUCKET
export SW_S3_ACCESS_KEY_ID=$ACCESS_KEY
export SW_S3_SECRET_ACCESS_KEY=$SECRET_KEY
export SW_GARAGE_DIR=$DIR
export SW_LAKE_PROFILE=$DIR/profile.toml
ENV
