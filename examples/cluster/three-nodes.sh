#!/usr/bin/env bash
# Starts three wasmrelay cluster nodes on this machine against one Kafka,
# each with its own ports, and stops them all on Ctrl-C.
#
#   KAFKA_BOOTSTRAP=127.0.0.1:9092 examples/cluster/three-nodes.sh
#
# The input topic `business` must exist (the relay creates only the topics it
# writes to: replies, dead letters, heartbeats, routes, alarms); until it
# does, the nodes warn that it is unknown every few seconds.
#
# Then connect processes (any of the client ports) with a token for their id
# (the key file is printed at start), for example:
#   target/debug/wasmrelay token issue --key "$CLIENT_TOKEN_KEY_FILE" --process p-1 > p-1.token
#   cargo run -p wasmrelay-client --example relay-client -- \
#     --connect 127.0.0.1:7401,127.0.0.1:7402,127.0.0.1:7403 --process-id p-1 \
#     --token-file p-1.token --reply
# and look at the cluster:  curl -s 127.0.0.1:9401/cluster
set -euo pipefail
cd "$(dirname "$0")/../.."

: "${KAFKA_BOOTSTRAP:?set KAFKA_BOOTSTRAP to the Kafka the nodes share (host:port)}"
export KAFKA_BOOTSTRAP
export PLUGINS_DIR="${PLUGINS_DIR:-$PWD/plugins/dist}"
# The nodes' shared secret: yours, or a fresh random one for this run.
CLUSTER_SECRET="${CLUSTER_SECRET:-$(openssl rand -hex 32 2>/dev/null || od -An -tx1 -N32 /dev/urandom | tr -d ' \n')}"
export CLUSTER_SECRET
# The key client tokens are signed with: yours, or a fresh one for this run.
if [[ -z "${CLIENT_TOKEN_KEY_FILE:-}" ]]; then
  CLIENT_TOKEN_KEY_FILE="$(mktemp -t wasmrelay-client-token.XXXXXX)"
  (openssl rand -hex 32 2>/dev/null || od -An -tx1 -N32 /dev/urandom | tr -d ' \n') >"$CLIENT_TOKEN_KEY_FILE"
fi
export CLIENT_TOKEN_KEY_FILE
echo "client token key: $CLIENT_TOKEN_KEY_FILE (wasmrelay token issue --key $CLIENT_TOKEN_KEY_FILE --process ID)" >&2
binary="${WASMRELAY_BIN:-target/debug/wasmrelay}"
if [[ ! -x "$binary" ]]; then
  cargo build --locked --bin wasmrelay
fi
mkdir -p "$PLUGINS_DIR"

pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT INT TERM
for n in 1 2 3; do
  NODE_ID="node-$n" \
  CLIENT_ADDR="127.0.0.1:740$n" \
  MESH_ADDR="127.0.0.1:750$n" \
  ADMIN_ADDR="127.0.0.1:940$n" \
    "$binary" run --config examples/cluster/node.toml &
  pids+=($!)
  echo "node-$n: clients 127.0.0.1:740$n, mesh 127.0.0.1:750$n, admin http://127.0.0.1:940$n/cluster" >&2
done
wait
