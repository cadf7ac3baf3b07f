#!/usr/bin/env bash
# Benchmark 1: routed throughput and latency, node A -> mesh -> process on
# node B, against a two-server NATS cluster (publisher on server A,
# subscriber on server B) in the same run. See bench/cluster/README.md.
#
#   bench/cluster/routed.sh
#   TLS=1 bench/cluster/routed.sh   # also every wasmrelay run over TLS
#
# Environment (defaults in brackets): SIZES ["256 4096"], TPUT_COUNT
# [100000] messages per wasmrelay throughput run, NATS_TPUT_COUNT [200000],
# LAT_RATE [1000] messages/s and LAT_SECONDS [10] per latency run,
# LAT_BATCH [1] records per producer batch of a latency run (1: one record
# per request, which tansu serves at only 2-3k messages/s; more lets a
# paced run reach tens of thousands a second, for CPU per message at a
# fixed rate, at the cost of the producer's 20 ms linger in the latency),
# PARTITIONS [12] of each input topic, PROCESSES [1] receiving processes
# of a throughput run (more than 1: the messages are spread over them, each
# process's messages keyed by its id, all on the same receiver), MAX_UNACKED [node default] (sets
# max_unacked and send_queue of both nodes), TLS [0] (1: each wasmrelay
# run is followed by the same run on a second cluster with TLS on the
# client listener and mutual TLS on the mesh, and a table of TLS /
# plaintext is printed), SKIP_BUILD=1, WASMRELAY_BIN, KEEP_RUN_DIR=1,
# PERF_SECONDS [0] (N > 0: `perf record -g` of both nodes for N seconds
# from the start of each throughput run's drain, into
# $RUN_DIR/perf-<variant>-<size>.data; keep the run directory to read them;
# PERF_ARGS [-F 1999 -g] replaces what is recorded, e.g. a uprobe on malloc
# with --call-graph dwarf).
NEED_NATS=1
source "$(dirname "$0")/lib.sh"

SIZES=${SIZES:-"256 4096"}
TPUT_COUNT=${TPUT_COUNT:-100000}
NATS_TPUT_COUNT=${NATS_TPUT_COUNT:-200000}
LAT_RATE=${LAT_RATE:-1000}
LAT_SECONDS=${LAT_SECONDS:-10}
LAT_BATCH=${LAT_BATCH:-1}
PARTITIONS=${PARTITIONS:-12}
PROCESSES=${PROCESSES:-1}
[[ $PROCESSES =~ ^[1-9][0-9]*$ ]] || die "PROCESSES must be a whole number of at least 1, not '$PROCESSES'"
TLS=${TLS:-0}
LAT_COUNT=$((LAT_RATE * LAT_SECONDS))

check_prerequisites
build
RESULTS="$RUN_DIR/results.jsonl"
: >"$RESULTS"

# record VARIANT MEASURE SIZE JSON-LINE: appends a result.
record() {
  python3 -c '
import json, sys
variant, measure, size, line = sys.argv[1:5]
out = json.loads(line)
out.update({"variant": variant, "measure": measure, "size": int(size)})
print(json.dumps(out))' "$1" "$2" "$3" "$4" >>"$RESULTS"
}

start_tansu
create_cluster_topics business.idle:1

# Node B's one cluster flow consumes a topic of its own that stays empty
# (business.idle, its own group): B owns no partition of the benchmark's
# input topics, so every message is consumed by node A, which finds the
# process on B in its route table and forwards it over the mesh. The
# receiving process sits on B, and stays there: rebalancing is off (with
# PROCESSES > 1 it would move half of them to node A, which holds none, as
# the run starts).
NODE_EXTRA_CLUSTER="rebalance = false"
MAX_UNACKED=${MAX_UNACKED:-}
if [[ -n "$MAX_UNACKED" ]]; then
  NODE_EXTRA_CLUSTER+=$'\n'"max_unacked = $MAX_UNACKED"$'\n'"send_queue = $MAX_UNACKED"
fi
start_node node-b business.idle bench-b
log "node-b ready: clients $NODE_CLIENT"

# With TLS=1, a second cluster (its own heartbeat and routes topics, so the
# two never see each other) whose nodes tls-a and tls-b have TLS on the
# client listener and mutual TLS on the mesh; same broker (plaintext Kafka),
# same settings otherwise. Its node B stays up beside the plaintext one.
PKI="$RUN_DIR/pki"
TLS_HEARTBEATS=wasmrelay.heartbeats.tls
TLS_ROUTES=wasmrelay.routes.tls
if [[ $TLS == 1 ]]; then
  "$TOOL" certs --dir "$PKI" --names tls-a,tls-b >/dev/null
  create_topics "$TLS_HEARTBEATS:1" "$TLS_ROUTES:6:compact"
  NODE_TLS_DIR="$PKI" NODE_HEARTBEATS="$TLS_HEARTBEATS" start_node tls-b business.idle bench-b-tls "$TLS_ROUTES"
  log "tls-b ready: clients $NODE_CLIENT (TLS)"
fi

# start_node_sec SEC ID INPUT_TOPIC GROUP: start_node on the plaintext
# cluster (SEC plain) or the TLS one (SEC tls).
start_node_sec() {
  local sec=$1; shift
  if [[ $sec == tls ]]; then
    NODE_TLS_DIR="$PKI" NODE_HEARTBEATS="$TLS_HEARTBEATS" start_node "$@" "$TLS_ROUTES"
  else
    start_node "$@"
  fi
}

# metric NODE NAME: a flow counter of node NODE.
metric() {
  curl -sf "${NODE_ADMINS[$1]}/metrics" | awk -v m="$2" '$1 ~ "^"m"\\{" || $1 == m {print $2; exit}'
}

# path_up PROCESS WHERE A B: node A reaches PROCESS (on node B over a live
# mesh link, or connected to itself).
path_up() {
  local process=$1 where=$2 a=$3 b=$4 body
  body=$(curl -sf "${NODE_ADMINS[$a]}/processes?id=$process") || return 1
  if [[ $where == local ]]; then
    python3 -c 'import json,sys; j=json.loads(sys.argv[1]); sys.exit(0 if j["connected_here"] else 1)' "$body"
  else
    python3 -c 'import json,sys; j=json.loads(sys.argv[1]); sys.exit(0 if j["node"]==sys.argv[2] and j["node_live"] else 1)' "$body" "$b" || return 1
    curl -sf "${NODE_ADMINS[$a]}/cluster" | python3 -c 'import json,sys; sys.exit(0 if sys.argv[1] in json.load(sys.stdin)["mesh"] else 1)' "$b"
  fi
}

# relay_run MEASURE WHERE SIZE [SEC]: one wasmrelay run (fresh input topic,
# fresh node A). MEASURE throughput: the topic is filled first, then node A
# drains it. MEASURE latency: LAT_RATE messages/s produced while the path is
# up. SEC tls: on the TLS cluster (nodes tls-a and tls-b; the receiving
# process connects over TLS); plain (the default): nodes node-a and node-b.
relay_run() {
  local measure=$1 where=$2 size=$3 sec=${4:-plain}
  local a=node-a b=node-b suffix="" ca_args=()
  if [[ $sec == tls ]]; then
    a=tls-a; b=tls-b; suffix=-tls; ca_args=(--ca "$PKI/ca.pem")
  fi
  local topic="in-$measure-$where-$size$suffix" process="proc-$where-$size-$measure$suffix"
  local count out="$RUN_DIR/recv-$measure-$where-$size$suffix"
  # The processes that receive (their ids, comma-separated).
  local processes=$process
  create_topics "$topic:$PARTITIONS"
  if [[ $measure == throughput ]]; then
    count=$TPUT_COUNT
    log "$where $size B: filling $topic with $count messages for $PROCESSES process(es) (one record per batch)"
    if ((PROCESSES > 1)); then
      processes=$(seq -s, -f "$process-%g" 0 $((PROCESSES - 1)))
      "$TOOL" produce --bootstrap "$BOOTSTRAP" --topic "$topic" --count "$count" --size "$size" \
        --processes "$PROCESSES" --process-prefix "$process-" >"$out.produce"
    else
      "$TOOL" produce --bootstrap "$BOOTSTRAP" --topic "$topic" --count "$count" --size "$size" \
        --process-id "$process" >"$out.produce"
    fi
  else
    count=$LAT_COUNT
  fi
  rm -f "$out.ready"
  if [[ $where == routed ]]; then
    # Registered on node B before node A starts.
    "$TOOL" receive --connect "${NODE_CLIENTS[$b]}" --process-ids "$processes" "${ca_args[@]}" \
      --expect "$count" --warmup "$([[ $measure == latency ]] && echo "$LAT_RATE" || echo 0)" \
      --ready-file "$out.ready" --timeout-s 300 --dump "$out.arrivals" >"$out.json" 2>"$out.err" &
    local receiver=$!
    STARTED_PIDS+=("$receiver")
    wait_until "the receiver on $b" test -f "$out.ready"
    start_node_sec "$sec" "$a" "$topic" "bench-a-$topic"
  else
    # Node A's client listener is up before its flow consumes: the receiver
    # keeps trying until it registers there.
    start_node_with_receiver "$sec" "$a" "$topic" "$processes" "$count" "$measure" "$out" "${ca_args[@]}"
    local receiver=$RECEIVER_PID
  fi
  local cpu_a cpu_b cpu_k
  cpu_a=$(cpu_ms "${NODE_PIDS[$a]}"); cpu_b=$(cpu_ms "${NODE_PIDS[$b]}"); cpu_k=$(cpu_ms "$TANSU_PID")
  if [[ $measure == throughput && ${PERF_SECONDS:-0} -gt 0 ]]; then
    # shellcheck disable=SC2086 # PERF_ARGS is a list of words
    perf record -q ${PERF_ARGS:--F 1999 -g} -p "${NODE_PIDS[$a]},${NODE_PIDS[$b]}" \
      -o "$RUN_DIR/perf-$where$suffix-$size.data" -- sleep "$PERF_SECONDS" \
      >"$RUN_DIR/perf-$where$suffix-$size.log" 2>&1 &
  fi
  if [[ $measure == latency ]]; then
    TIMEOUT=30 wait_until "node A reaching $process" path_up "$process" "$where" "$a" "$b"
    log "$where $size B: $LAT_RATE messages/s for $LAT_SECONDS s"
    "$TOOL" produce --bootstrap "$BOOTSTRAP" --topic "$topic" --count "$count" --size "$size" \
      --process-id "$process" --rate "$LAT_RATE" --batch "$LAT_BATCH" >"$out.produce"
  fi
  if ! wait "$receiver"; then
    tail -5 "$out.err" >&2
    die "the $measure run $where $size $sec failed (logs in $RUN_DIR)"
  fi
  cpu_a=$(( $(cpu_ms "${NODE_PIDS[$a]}") - cpu_a ))
  cpu_b=$(( $(cpu_ms "${NODE_PIDS[$b]}") - cpu_b ))
  cpu_k=$(( $(cpu_ms "$TANSU_PID") - cpu_k ))
  local line
  line=$(python3 -c '
import json, sys
r = json.loads(open(sys.argv[1]).readline())
r["retries"] = float(sys.argv[2] or 0)
r["consumed"] = float(sys.argv[3] or 0)
r["server_cpu_ms"] = int(sys.argv[4]) + int(sys.argv[5])
r["broker_cpu_ms"] = int(sys.argv[6])
print(json.dumps(r))' "$out.json" "$(metric "$a" wasmrelay_retries_total)" "$(metric "$a" wasmrelay_messages_consumed_total)" "$cpu_a" "$cpu_b" "$cpu_k")
  record "wasmrelay-$where$suffix" "$measure" "$size" "$line"
  log "$where $size B $measure $sec: $(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print("steady %.0f msg/s, p50 %.2f ms, p99 %.2f ms, duplicates %d, disconnects %d, retries %d" % (r["steady_rate_per_s"], r["latency_ms_p50"], r["latency_ms_p99"], r["duplicates"], r["disconnects"], r["retries"]))' "$line")"
  stop_node "$a"
}

# start_node_with_receiver SEC A TOPIC PROCESS COUNT MEASURE OUT [RECEIVE-ARGS...]:
# for the local variant: node A is started in the background, its client
# port known in advance, and the receiver keeps trying to register there.
start_node_with_receiver() {
  local sec=$1 a=$2 topic=$3 process=$4 count=$5 measure=$6 out=$7
  shift 7
  PRESET_CLIENT_PORT=$(free_port)
  "$TOOL" receive --connect "127.0.0.1:$PRESET_CLIENT_PORT" --process-ids "$process" "$@" \
    --expect "$count" --warmup "$([[ $measure == latency ]] && echo "$LAT_RATE" || echo 0)" \
    --connect-wait-s 120 --ready-file "$out.ready" --timeout-s 300 --dump "$out.arrivals" >"$out.json" 2>"$out.err" &
  RECEIVER_PID=$!
  STARTED_PIDS+=("$RECEIVER_PID")
  start_node_sec "$sec" "$a" "$topic" "bench-a-$topic"
  unset PRESET_CLIENT_PORT
}

nats_run() {
  local measure=$1 size=$2
  local out="$RUN_DIR/nats-$measure-$size.json"
  local cpu_a cpu_b
  cpu_a=$(cpu_ms "$NATS_A_PID"); cpu_b=$(cpu_ms "$NATS_B_PID")
  if [[ $measure == throughput ]]; then
    "$TOOL" nats-pub-sub --publish-to "127.0.0.1:$NATS_A" --subscribe-to "127.0.0.1:$NATS_B" \
      --count "$NATS_TPUT_COUNT" --size "$size" >"$out" 2>"$out.err"
  else
    "$TOOL" nats-pub-sub --publish-to "127.0.0.1:$NATS_A" --subscribe-to "127.0.0.1:$NATS_B" \
      --count "$LAT_COUNT" --size "$size" --rate "$LAT_RATE" --warmup "$LAT_RATE" >"$out" 2>"$out.err"
  fi
  cpu_a=$(( $(cpu_ms "$NATS_A_PID") - cpu_a ))
  cpu_b=$(( $(cpu_ms "$NATS_B_PID") - cpu_b ))
  record nats "$measure" "$size" "$(python3 -c '
import json, sys
r = json.loads(open(sys.argv[1]).readline())
r["server_cpu_ms"] = int(sys.argv[2])
print(json.dumps(r))' "$out" "$((cpu_a + cpu_b))")"
}

start_nats a
NATS_A=$NATS_PORT; NATS_A_PID=$NATS_PID
start_nats b "$NATS_CLUSTER_PORT"
NATS_B=$NATS_PORT; NATS_B_PID=$NATS_PID
log "nats-server cluster: a on $NATS_A, b on $NATS_B (route between them)"

# With TLS=1 each wasmrelay run is followed at once by the same run on the
# TLS cluster, so the two see the same machine load as far as possible.
for size in $SIZES; do
  for where in routed local; do
    relay_run throughput "$where" "$size"
    if [[ $TLS == 1 ]]; then relay_run throughput "$where" "$size" tls; fi
  done
  nats_run throughput "$size"
  for where in routed local; do
    relay_run latency "$where" "$size"
    if [[ $TLS == 1 ]]; then relay_run latency "$where" "$size" tls; fi
  done
  nats_run latency "$size"
done

echo
describe_run
echo "settings: max_unacked = send_queue = ${MAX_UNACKED:-default}; throughput $TPUT_COUNT messages (wasmrelay, topic filled first, $PARTITIONS partitions) / $NATS_TPUT_COUNT (NATS, window 10000);"
echo "          latency $LAT_RATE messages/s for $LAT_SECONDS s, first second left out; wasmrelay producer batches of $LAT_BATCH"
if [[ $TLS == 1 ]]; then
  echo "          TLS: client listener TLS and mesh mutual TLS (rustls, ECDSA P-256 certificates); Kafka plaintext"
fi
python3 "$BENCH_DIR/report.py" routed "$RESULTS"
