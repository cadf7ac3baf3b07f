#!/usr/bin/env bash
# Benchmark 2: resident memory per idle connection. See bench/cluster/README.md.
#
#   bench/cluster/idle.sh
#   COUNTS="1000 10000" PLOT=bench/plots/idle-memory-connections.png bench/cluster/idle.sh
#
# For each count of COUNTS (PER_NODE, 10,000):
# 1. One node, that many idle SDK connections from 2 client processes: RSS
#    of the node before and after.
# 2. Baseline, same run: one nats-server, as many idle NATS connections
#    from 2 client processes, each connection with one subscription.
# Then:
# 3. NODES (5) nodes x PER_NODE connections, one client process per node.
# The second command measures memory against connections: 1,000 and 10,000
# on one node (nats-server beside each), 50,000 on 5 nodes of 10,000 (a
# process may hold at most 20,000 open files here, so not on one node), and
# plots it. The first takes 1.5-3 minutes after the build, the second about
# 40 s more (a node and a nats-server for the extra count).
#
# Environment: COUNTS [PER_NODE] (each at most 15000), PER_NODE [10000],
# NODES [5], SETTLE_S [12] seconds to wait after the last connection before
# measuring (at least two keepalive pings of every connection),
# ROUTES_WAIT_S [120], SKIP_BUILD=1, WASMRELAY_BIN, KEEP_RUN_DIR=1,
# PLOT=path.png (node KiB per connection and MiB in all against connections,
# nats-server beside; needs matplotlib), RESULTS_OUT=path.jsonl (keeps the
# result lines: one per measured point).
NEED_NATS=1
source "$(dirname "$0")/lib.sh"

PER_NODE=${PER_NODE:-10000}
NODES=${NODES:-5}
SETTLE_S=${SETTLE_S:-12}
COUNTS=${COUNTS:-$PER_NODE}
(( PER_NODE <= 15000 )) || die "PER_NODE above 15000 needs more client processes (20,000 open files per process)"
for count in $COUNTS; do
  [[ "$count" =~ ^[1-9][0-9]*$ ]] || die "COUNTS: not a positive whole number: '$count'"
  (( count <= 15000 )) || die "COUNTS: $count is above 15000, too many for one node here (20,000 open files per process); part 3 puts NODES x PER_NODE on several"
done
if [[ -n "${PLOT:-}" ]]; then
  python3 -c 'import matplotlib' 2>/dev/null \
    || die "PLOT needs matplotlib: apt-get install -y python3-matplotlib, or pip install matplotlib"
fi

# Measured with the connections where the clients put them: rebalancing
# (on by default) would move processes between the nodes of part 3 while
# their clients connect one node after the other.
export NODE_EXTRA_CLUSTER="${NODE_EXTRA_CLUSTER:-}
rebalance = false"

check_prerequisites
build
RESULTS="$RUN_DIR/results.jsonl"
: >"$RESULTS"

# record LABEL VARIANT CONNECTIONS BEFORE_KIB AFTER_KIB [EXTRA-JSON]
record() {
  python3 -c '
import json, sys
label, variant, conns, before, after, extra = sys.argv[1:7]
r = {"label": label, "variant": variant, "connections": int(conns),
     "before_kib": int(before), "after_kib": int(after), "delta_kib": int(after) - int(before)}
r.update(json.loads(extra or "{}"))
print(json.dumps(r))' "$1" "$2" "$3" "$4" "$5" "${6:-}" >>"$RESULTS"
}

# start_clients KIND TARGET COUNT FIRST PREFIX NAME: an `idle` or
# `nats-idle` client process; waits until all its connections are up.
CLIENT_PIDS=()
start_clients() {
  local kind=$1 target=$2 count=$3 first=$4 prefix=$5 name=$6
  local out="$RUN_DIR/clients-$name"
  rm -f "$out.ready"
  if [[ $kind == relay ]]; then
    "$TOOL" idle --connect "$target" --count "$count" --first "$first" --prefix "$prefix" \
      --ready-file "$out.ready" >"$out.json" 2>"$out.err" &
  else
    "$TOOL" nats-idle --server "$target" --count "$count" --first "$first" --prefix "$prefix" \
      --ready-file "$out.ready" >"$out.json" 2>"$out.err" &
  fi
  local pid=$!
  STARTED_PIDS+=("$pid")
  CLIENT_PIDS+=("$pid")
  echo "$pid" >"$out.pid"
}

wait_clients() {
  local name
  for name in "$@"; do
    local out="$RUN_DIR/clients-$name"
    local pid
    pid=$(cat "$out.pid")
    TIMEOUT=300 wait_until "client process $name" test -f "$out.ready"
    local connected
    connected=$(head -1 "$out.json" | json_field connected)
    log "clients $name: $connected connected ($(head -1 "$out.json" | json_field connect_seconds) s)"
  done
}

stop_clients() {
  local pid
  for pid in "${CLIENT_PIDS[@]}"; do stop_pid "$pid"; done
  CLIENT_PIDS=()
}

# clients_rss NAME...: summed RSS of client processes, KiB.
clients_rss() {
  local total=0 name
  for name in "$@"; do total=$((total + $(rss_kb "$(cat "$RUN_DIR/clients-$name.pid")"))); done
  echo "$total"
}

# clients_rss_before NAME...: summed RSS of client processes before their
# first connection (each reports its own), KiB.
clients_rss_before() {
  local total=0 name
  for name in "$@"; do
    local before
    before=$(head -1 "$RUN_DIR/clients-$name.json" \
      | python3 -c "import json,sys; print(json.loads(sys.stdin.readline()).get('rss_before_kib', ''))")
    [[ "$before" =~ ^[0-9]+$ ]] \
      || die "client process $name did not report rss_before_kib: an old benchmark tool? build it again (without SKIP_BUILD=1)"
    total=$((total + before))
  done
  echo "$total"
}

# clients_json NAME...: the client-side fields of a result line.
clients_json() {
  echo "\"clients_rss_kib\": $(clients_rss "$@"), \"clients_rss_before_kib\": $(clients_rss_before "$@")"
}

connections_and_routes() {
  local id=$1 want_conns=$2 want_routes=$3
  [[ "$(cluster_field "$id" connections)" == "$want_conns" && "$(cluster_field "$id" routes)" == "$want_routes" ]]
}

start_tansu
single_routes=()
for count in $COUNTS; do single_routes+=("wasmrelay.routes-single-$count:6:compact"); done
create_cluster_topics business:3 "${single_routes[@]}" wasmrelay.routes-multi:6:compact

for count in $COUNTS; do
  half=$((count / 2))
  # Each count has a node, routes topic and clients of its own.
  id="single-$count"

  # --- 1. one node ---------------------------------------------------------
  log "one node, $count idle connections"
  start_node "$id" business "idle-$id" "wasmrelay.routes-$id"
  before=$(settled_rss_kb "$NODE_PID")
  start_clients relay "$NODE_CLIENT" "$half" 0 single- "$id-1"
  start_clients relay "$NODE_CLIENT" "$((count - half))" "$half" single- "$id-2"
  wait_clients "$id-1" "$id-2"
  TIMEOUT=120 wait_until "$count connections and routes on the node" \
    connections_and_routes "$id" "$count" "$count"
  sleep "$SETTLE_S"
  after=$(settled_rss_kb "$NODE_PID")
  record "wasmrelay, 1 node" relay "$count" "$before" "$after" \
    "{$(clients_json "$id-1" "$id-2"), \"open_files\": $(ls /proc/"$NODE_PID"/fd | wc -l)}"
  log "node RSS $before -> $after KiB; SDK client processes $(clients_rss "$id-1" "$id-2") KiB (before their first connection: $(clients_rss_before "$id-1" "$id-2") KiB)"
  stop_clients
  stop_node "$id"

  # --- 2. nats-server baseline -----------------------------------------------
  log "nats-server, $count idle connections (one subscription each)"
  start_nats "nats-$count"
  nats_pid=$NATS_PID
  before=$(settled_rss_kb "$nats_pid")
  start_clients nats "127.0.0.1:$NATS_PORT" "$half" 0 proc. "nats-$count-1"
  start_clients nats "127.0.0.1:$NATS_PORT" "$((count - half))" "$half" proc. "nats-$count-2"
  wait_clients "nats-$count-1" "nats-$count-2"
  sleep "$SETTLE_S"
  after=$(settled_rss_kb "$nats_pid")
  record "nats-server, 1 server" nats "$count" "$before" "$after" \
    "{$(clients_json "nats-$count-1" "nats-$count-2")}"
  log "nats-server RSS $before -> $after KiB"
  stop_clients
  stop_pid "$nats_pid"
done

# --- 3. NODES nodes ------------------------------------------------------------
total=$((NODES * PER_NODE))
log "$NODES nodes, $PER_NODE idle connections each ($total)"
ids=()
for n in $(seq 1 "$NODES"); do
  start_node "node-$n" business idle-multi wasmrelay.routes-multi
  ids+=("node-$n")
done
# Let the nodes find each other (mesh) before measuring.
all_meshed() {
  local id
  for id in "${ids[@]}"; do
    [[ "$(cluster_field "$id" live)" == "$NODES" ]] || return 1
  done
}
TIMEOUT=60 wait_until "$NODES nodes live everywhere" all_meshed
declare -A BEFORE
for id in "${ids[@]}"; do BEFORE[$id]=$(rss_kb "${NODE_PIDS[$id]}"); done
sleep 2
for id in "${ids[@]}"; do BEFORE[$id]=$(rss_kb "${NODE_PIDS[$id]}"); done
first=0
for id in "${ids[@]}"; do
  start_clients relay "${NODE_CLIENTS[$id]}" "$PER_NODE" "$first" multi- "$id"
  first=$((first + PER_NODE))
done
wait_clients "${ids[@]}"
# Every node should hold every route, and the nodes all connections between
# them (placement sends a new process to the least-loaded node, so a node
# may hold more or fewer than the PER_NODE its client process dialed); a
# node that still misses some after ROUTES_WAIT_S is reported (it happened,
# see bench/RESULTS.md) and the measurement goes on.
all_routes() {
  local id held=0
  for id in "${ids[@]}"; do
    [[ "$(cluster_field "$id" routes)" == "$total" ]] || return 1
    held=$((held + $(cluster_field "$id" connections)))
  done
  (( held == total ))
}
if ! (TIMEOUT=${ROUTES_WAIT_S:-120} wait_until "every route on every node" all_routes) 2>/dev/null; then
  for id in "${ids[@]}"; do
    log "WARNING: $id has $(cluster_field "$id" routes) routes of $total and $(cluster_field "$id" connections) connections of $PER_NODE after ${ROUTES_WAIT_S:-120} s"
  done
  ROUTES_SHORT=1
fi
sleep "$SETTLE_S"
sum_before=0; sum_after=0
for id in "${ids[@]}"; do
  after=$(settled_rss_kb "${NODE_PIDS[$id]}")
  record "wasmrelay, $id of $NODES" relay-node "$(cluster_field "$id" connections)" "${BEFORE[$id]}" "$after"
  sum_before=$((sum_before + BEFORE[$id])); sum_after=$((sum_after + after))
done
routes_seen=$(for id in "${ids[@]}"; do cluster_field "$id" routes; done | paste -sd, -)
record "wasmrelay, $NODES nodes together" relay-cluster "$total" "$sum_before" "$sum_after" \
  "{$(clients_json "${ids[@]}"), \"routes_per_node\": [$routes_seen], \"nodes\": $NODES, \"per_node_connections\": $PER_NODE}"
stop_clients

echo
describe_run
if [[ "$COUNTS" == "$PER_NODE" ]]; then
  echo "settings: $PER_NODE connections per node or server, measured $SETTLE_S s after the last one connected"
else
  echo "settings: one node and one nats-server at $COUNTS connections, $NODES nodes x $PER_NODE; measured $SETTLE_S s after the last one connected"
fi
python3 "$BENCH_DIR/report.py" idle "$RESULTS"
echo "Routes in each node's table at the end (each should be $total): $routes_seen."
python3 -c '
import glob, json, sys
drops = 0
for path in glob.glob(sys.argv[1] + "/clients-*.json"):
    lines = open(path).read().split("\n")
    end = json.loads([l for l in lines if l.strip()][-1])
    drops += end.get("disconnects", 0) + end.get("closed_by_server", 0)
print(f"Connections lost while held (should be 0): {drops}.")' "$RUN_DIR"
if [[ -n "${PLOT:-}" ]]; then
  python3 "$BENCH_DIR/plot_idle.py" "$RESULTS" "$PLOT"
  echo "plot: $PLOT"
fi
if [[ -n "${RESULTS_OUT:-}" ]]; then cp "$RESULTS" "$RESULTS_OUT"; fi
