# Shared by the cluster benchmark scripts (sourced, not run): building,
# free ports, starting and stopping tansu, relay nodes and nats-server, RSS,
# waiting. Every process a script starts is recorded and killed on exit, by
# its own pid; the run directory (configs, logs) is removed unless
# KEEP_RUN_DIR=1 or the script failed.

set -euo pipefail

BENCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$BENCH_DIR/../.." && pwd)"
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
TOOL="$TARGET_DIR/release/wasmrelay-cluster-bench"
WASMRELAY="${WASMRELAY_BIN:-$TARGET_DIR/release/wasmrelay}"

RUN_DIR="$(mktemp -d "${TMPDIR:-/tmp}/wasmrelay-cluster-bench.XXXXXX")"
STARTED_PIDS=()

log() { echo "[$(date +%H:%M:%S)] $*" >&2; }
die() { echo "error: $*" >&2; exit 1; }

cleanup() {
  local status=$?
  for pid in "${STARTED_PIDS[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  # Give them a moment, then make sure.
  for pid in "${STARTED_PIDS[@]}"; do
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
  wait 2>/dev/null || true
  if [[ $status -ne 0 || "${KEEP_RUN_DIR:-0}" == 1 ]]; then
    echo "logs and configs kept in $RUN_DIR" >&2
  else
    rm -rf "$RUN_DIR"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Stops one process this script started (SIGTERM, then SIGKILL after 5 s).
stop_pid() {
  local pid=$1
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

need() {
  local what=$1 hint=$2
  command -v "$what" >/dev/null 2>&1 || [[ -x "$what" ]] || die "$what is missing: $hint"
}

tansu_bin() {
  if [[ -n "${TANSU_BIN:-}" ]]; then echo "$TANSU_BIN"; return; fi
  if command -v tansu >/dev/null 2>&1; then command -v tansu; return; fi
  echo "${CARGO_HOME:-$HOME/.cargo}/bin/tansu"
}

check_prerequisites() {
  need python3 "install Debian python3 (used to find free ports)"
  need curl "install Debian curl"
  need cargo "install Rust with rustup"
  local tansu
  tansu="$(tansu_bin)"
  [[ -x "$tansu" ]] || die "the tansu broker is missing: run scripts/setup.sh, or cargo install tansu --version 0.6.0 --features dynostore --locked"
  "$tansu" --version | grep -qw 0.6.0 || die "$tansu is not tansu 0.6.0"
  if [[ "${NEED_NATS:-0}" == 1 ]]; then
    need nats-server "install Debian nats-server: apt-get install -y nats-server"
  fi
}

# Builds the relay (release) and the benchmark tool unless told not to.
build() {
  if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
    if [[ -z "${WASMRELAY_BIN:-}" ]]; then
      log "building wasmrelay (release)"
      (cd "$ROOT" && cargo build --release -p wasmrelay --bin wasmrelay >&2)
    fi
    log "building the benchmark tool (release)"
    cargo build --release --manifest-path "$BENCH_DIR/tools/Cargo.toml" --target-dir "$TARGET_DIR" >&2
  fi
  [[ -x "$WASMRELAY" ]] || die "no wasmrelay binary at $WASMRELAY"
  [[ -x "$TOOL" ]] || die "no benchmark tool at $TOOL"
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# Waits until `$@` succeeds, checking every 0.1 s, at most $TIMEOUT seconds
# (default 60); fails with WHAT.
wait_until() {
  local what=$1; shift
  local deadline=$((SECONDS + ${TIMEOUT:-60}))
  until "$@" >/dev/null 2>&1; do
    (( SECONDS < deadline )) || die "timed out waiting for $what"
    sleep 0.1
  done
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

rss_kb() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }

# RSS of a process after it settles: the last of 3 samples a second apart.
settled_rss_kb() {
  local pid=$1 rss=0
  for _ in 1 2 3; do sleep 1; rss=$(rss_kb "$pid"); done
  echo "$rss"
}

# --- tansu -------------------------------------------------------------

start_tansu() {
  local port dir
  port=$(free_port)
  dir="$RUN_DIR/tansu"
  mkdir -p "$dir"
  (cd "$dir" && RUST_LOG=warn NO_COLOR=1 exec "$(tansu_bin)" broker \
      --cluster-id "wasmrelay-bench-$$" \
      --listener-url "tcp://127.0.0.1:$port" \
      --advertised-listener-url "tcp://127.0.0.1:$port" \
      --storage-engine memory://tansu/ >"$dir/tansu.log" 2>&1) &
  TANSU_PID=$!
  STARTED_PIDS+=("$TANSU_PID")
  BOOTSTRAP="127.0.0.1:$port"
  TIMEOUT=30 wait_until "tansu on $BOOTSTRAP" port_open "$port"
  log "tansu on $BOOTSTRAP (pid $TANSU_PID)"
}

# create_topics name:partitions[:compact] ...
create_topics() {
  local args=()
  for spec in "$@"; do args+=(--topic "$spec"); done
  local attempt
  for attempt in 1 2 3 4 5; do
    if "$TOOL" create-topics --bootstrap "$BOOTSTRAP" "${args[@]}" 2>"$RUN_DIR/create-topics.err"; then
      return 0
    fi
    sleep 1
  done
  cat "$RUN_DIR/create-topics.err" >&2
  die "could not create topics $*"
}

# The topics every node of the cluster shares.
create_cluster_topics() {
  create_topics wasmrelay.heartbeats:1 wasmrelay.routes:6:compact wasmrelay.alarms:1 \
    business.replies:1 business.dlq:1 "$@"
}

# --- relay nodes ---------------------------------------------------------

# start_node ID INPUT_TOPIC GROUP [ROUTES_TOPIC]: starts a node of the
# cluster on $BOOTSTRAP and waits until it is ready (its route table caught
# up). Sets NODE_PID, NODE_CLIENT, NODE_ADMIN; also NODE_PIDS[ID] etc.
# PRESET_CLIENT_PORT fixes the client port, PRESET_ADMIN_PORT the admin
# port; NODE_EXTRA_CLUSTER is appended to [cluster], NODE_EXTRA_LINK to
# [links.main.options]; NODE_HEARTBEATS
# names the heartbeat topic (default wasmrelay.heartbeats: nodes with
# other heartbeat and routes topics are another cluster). NODE_TLS_DIR (a
# directory written by `wasmrelay-cluster-bench certs`, with ca.pem and
# ID.pem / ID.key) turns on TLS on the client listener ([cluster.tls]) and
# mutual TLS on the mesh ([cluster.mesh_tls]) with the node's certificate.
declare -A NODE_PIDS NODE_CLIENTS NODE_ADMINS NODE_LOGS

# node_tls_tables ID: the [cluster.tls] and [cluster.mesh_tls] tables of
# node ID when NODE_TLS_DIR is set (nothing otherwise). The certificate
# names 127.0.0.1, the host of the node's client and mesh addresses.
node_tls_tables() {
  local id=$1 dir=${NODE_TLS_DIR:-}
  [[ -n "$dir" ]] || return 0
  cat <<EOF
[cluster.tls]
cert = "$dir/$id.pem"
key = "$dir/$id.key"
[cluster.mesh_tls]
cert = "$dir/$id.pem"
key = "$dir/$id.key"
ca = "$dir/ca.pem"
EOF
}
start_node() {
  local id=$1 input=$2 group=$3 routes=${4:-wasmrelay.routes}
  local admin client mesh dir
  admin=${PRESET_ADMIN_PORT:-$(free_port)}; client=${PRESET_CLIENT_PORT:-$(free_port)}; mesh=$(free_port)
  dir="$RUN_DIR/node-$id"
  mkdir -p "$dir/plugins"
  cat >"$dir/node.toml" <<EOF
# A cluster node as in examples/cluster/node.toml, with the settings tansu
# needs (small fetch.wait.max.ms) and faster heartbeats.
[node]
id = "$id"
[admin]
listen = "127.0.0.1:$admin"
[plugins]
dir = "$dir/plugins"
[links.main]
bootstrap_servers = "$BOOTSTRAP"
[links.main.options]
"fetch.wait.max.ms" = "10"
"session.timeout.ms" = "6000"
"heartbeat.interval.ms" = "500"
${NODE_EXTRA_LINK:-}
[cluster]
link = "main"
client_listen = "127.0.0.1:$client"
mesh_listen = "127.0.0.1:$mesh"
secret = "cluster-bench-secret-0123456789abcdef"
heartbeat_topic = "${NODE_HEARTBEATS:-wasmrelay.heartbeats}"
routes_topic = "$routes"
alarm_topic = "wasmrelay.alarms"
heartbeat_interval = "500ms"
node_timeout = "3s"
min_live_nodes = 1
keepalive = "10s"
# The benchmarks measure delivery, not client authentication (its cost is a
# token check per Hello): processes connect without tokens.
client_auth = "none"
${NODE_EXTRA_CLUSTER:-}
$(node_tls_tables "$id")
[[flows]]
name = "business"
link = "main"
input_topic = "$input"
group = "$group"
output_topic = "business.replies"
dead_letter_topic = "business.dlq"
retry = { initial_backoff = "20ms", max_backoff = "200ms", budget = "60s" }
[flows.deliver.cluster]
ttl = "60s"
EOF
  # Appended: a node started again for the next run keeps the last run's log.
  RUST_LOG="${NODE_LOG:-info}" "$WASMRELAY" run --config "$dir/node.toml" >>"$dir/node.log" 2>&1 &
  NODE_PID=$!
  STARTED_PIDS+=("$NODE_PID")
  NODE_CLIENT="127.0.0.1:$client"
  NODE_ADMIN="http://127.0.0.1:$admin"
  NODE_PIDS[$id]=$NODE_PID
  NODE_CLIENTS[$id]=$NODE_CLIENT
  NODE_ADMINS[$id]=$NODE_ADMIN
  NODE_LOGS[$id]="$dir/node.log"
  local deadline=$((SECONDS + ${NODE_READY_TIMEOUT:-120}))
  until curl -sf "$NODE_ADMIN/readyz" >/dev/null 2>&1; do
    if ! kill -0 "$NODE_PID" 2>/dev/null; then
      tail -20 "$dir/node.log" >&2
      die "node $id exited before it was ready (log above)"
    fi
    (( SECONDS < deadline )) || { tail -20 "$dir/node.log" >&2; die "node $id not ready in time"; }
    sleep 0.05
  done
}

stop_node() {
  local id=$1
  stop_pid "${NODE_PIDS[$id]}"
}

# cluster_field ID JQ-LESS-FIELD: a top-level field of /cluster (python3).
cluster_field() {
  curl -sf "${NODE_ADMINS[$1]}/cluster" | python3 -c "import json,sys; print(json.load(sys.stdin)[sys.argv[1]])" "$2"
}

# json_field FIELD: a field of the JSON object on stdin.
json_field() {
  python3 -c "import json,sys; v=json.loads(sys.stdin.readline())[sys.argv[1]]; print(v)" "$1"
}

# --- nats-server -----------------------------------------------------------

# start_nats NAME [ROUTE_PORT_OF_PEER]: a nats-server on free ports; sets
# NATS_PORT, NATS_CLUSTER_PORT, NATS_PID.
start_nats() {
  local name=$1 peer=${2:-}
  local port cport dir
  port=$(free_port); cport=$(free_port)
  dir="$RUN_DIR/nats-$name"
  mkdir -p "$dir"
  {
    echo "server_name: $name"
    echo "listen: 127.0.0.1:$port"
    echo "max_connections: 100000"
    echo "cluster {"
    echo "  name: bench"
    echo "  listen: 127.0.0.1:$cport"
    if [[ -n "$peer" ]]; then echo "  routes: [nats-route://127.0.0.1:$peer]"; fi
    echo "}"
  } >"$dir/nats.conf"
  nats-server -c "$dir/nats.conf" >"$dir/nats.log" 2>&1 &
  NATS_PID=$!
  STARTED_PIDS+=("$NATS_PID")
  NATS_PORT=$port
  NATS_CLUSTER_PORT=$cport
  TIMEOUT=20 wait_until "nats-server $name" port_open "$port"
}

# Machine and build facts for the results.
describe_run() {
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- host client protocol 2>/dev/null || echo ' (work tree has uncommitted changes in host/client/protocol)')"
  echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), load average $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "tansu: $("$(tansu_bin)" --version 2>/dev/null | head -1)"
  if command -v nats-server >/dev/null 2>&1; then echo "nats-server: $(nats-server --version)"; fi
}

# CPU time (user + system) a process has used so far, in ms.
cpu_ms() {
  awk -v tck="$(getconf CLK_TCK)" '{print int(($14 + $15) * 1000 / tck)}' "/proc/$1/stat"
}
