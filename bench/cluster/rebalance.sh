#!/usr/bin/env bash
# Benchmark 4: a 4th node takes its share of PROCESSES (10,000) business
# processes at the default rebalance settings, while messages flow to all of
# them. See bench/cluster/README.md.
#
#   bench/cluster/rebalance.sh
#
# 1. Three nodes (rebalancing on, defaults: 10% / 10 over the share, 50
#    moves/s, checked every 5 s), PROCESSES SDK processes from CLIENTS (4)
#    client processes (`hold`: receive, ack, follow Rebalance), placed by
#    the nodes. Messages to every process at RATE per second (one producer,
#    process `proc-<seq mod PROCESSES>` in header and key) from BEFORE_S
#    seconds before the join to AFTER_S seconds after the cluster settled.
# 2. node-4 starts. Measured from its being live on every node: the time
#    until no node meets the imbalance condition, the moves and their rate
#    (each node's /cluster, polled every 0.25 s), then, once every message
#    arrived (or DRAIN_TIMEOUT_S), messages produced, received, redelivered
#    (same process and delivery id again) and dead-lettered.
#
# Environment: PROCESSES [10000], CLIENTS [4], RATE [500] messages/s,
# PARTITIONS [12] of the input topic, BEFORE_S [10], AFTER_S [5],
# STABLE_S [12] (settled: no move and no count change for this long),
# SETTLE_TIMEOUT_S [300], DRAIN_TIMEOUT_S [90], SKIP_BUILD=1,
# WASMRELAY_BIN, KEEP_RUN_DIR=1.
source "$(dirname "$0")/lib.sh"

PROCESSES=${PROCESSES:-10000}
CLIENTS=${CLIENTS:-4}
RATE=${RATE:-500}
PARTITIONS=${PARTITIONS:-12}
BEFORE_S=${BEFORE_S:-10}
AFTER_S=${AFTER_S:-5}
STABLE_S=${STABLE_S:-12}
SETTLE_TIMEOUT_S=${SETTLE_TIMEOUT_S:-300}
DRAIN_TIMEOUT_S=${DRAIN_TIMEOUT_S:-90}
PER_CLIENT=$((PROCESSES / CLIENTS))
(( PER_CLIENT * CLIENTS == PROCESSES )) || die "PROCESSES must be a multiple of CLIENTS"
(( PER_CLIENT <= 15000 )) || die "more than 15,000 processes per client process needs more CLIENTS (20,000 open files per process)"
(( PROCESSES / 3 <= 15000 )) || die "more than 15,000 processes per node (20,000 open files per process)"

check_prerequisites
build
# JSON logs: the warnings and errors are counted at the end.
export WASMRELAY_LOG_FORMAT=json
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)

start_tansu
create_cluster_topics "business:$PARTITIONS"

# The defaults of rebalancing (issue 11), written out so the run says
# what it measured; quotas (100,000 by default) far above the counts.
NODE_EXTRA_CLUSTER='rebalance = true
rebalance_threshold_percent = 10
rebalance_min_excess = 10
rebalance_rate = 50
rebalance_interval = "5s"'
REBALANCE_RATE=50

# --- 1. three nodes and the processes --------------------------------------
for n in 1 2 3; do
  start_node "node-$n" business bench-business
  log "node-$n ready: clients $NODE_CLIENT, admin $NODE_ADMIN"
done

# all_live N ID...: every node named sees N live nodes.
all_live() {
  local want=$1 id; shift
  for id in "$@"; do
    [[ "$(cluster_field "$id" live)" == "$want" ]] || return 1
  done
}
TIMEOUT=60 wait_until "3 nodes live everywhere" all_live 3 node-1 node-2 node-3

# Client process k is given the three addresses starting with node k mod 3;
# the nodes place each process (redirecting it where there is most room).
HOLD_PIDS=()
for k in $(seq 0 $((CLIENTS - 1))); do
  addresses=""
  for i in 0 1 2; do
    addresses+="${addresses:+,}${NODE_CLIENTS[node-$(( (k + i) % 3 + 1 ))]}"
  done
  out="$RUN_DIR/hold-$k"
  "$TOOL" hold --connect "$addresses" --count "$PER_CLIENT" --first $((k * PER_CLIENT)) \
    --prefix proc- --ready-file "$out.ready" --status-file "$out.status" \
    --dump "$out.arrivals" >"$out.json" 2>"$out.err" &
  HOLD_PIDS+=("$!")
  STARTED_PIDS+=("$!")
done
for k in $(seq 0 $((CLIENTS - 1))); do
  TIMEOUT=300 wait_until "client process $k connected" test -f "$RUN_DIR/hold-$k.ready"
done
log "$PROCESSES processes registered ($(for k in $(seq 0 $((CLIENTS - 1))); do tail -1 "$RUN_DIR/hold-$k.err"; done | grep -o 'in [0-9.]* s' | paste -sd' ' -))"

# connections_total ID...: the connections the nodes named hold together.
connections_total() {
  local id sum=0
  for id in "$@"; do sum=$((sum + $(cluster_field "$id" connections))); done
  echo "$sum"
}
counted() { [[ "$(connections_total "$@")" == "$PROCESSES" ]]; }
TIMEOUT=120 wait_until "$PROCESSES connections counted" counted node-1 node-2 node-3
every_route() {
  local id
  for id in node-1 node-2 node-3; do
    [[ "$(cluster_field "$id" routes)" == "$PROCESSES" ]] || return 1
  done
}
if ! (TIMEOUT=120 wait_until "every route on every node" every_route) 2>/dev/null; then
  for id in node-1 node-2 node-3; do
    log "WARNING: $id has $(cluster_field "$id" routes) routes of $PROCESSES"
  done
fi
# Placement spreads them only roughly (each node counts its own redirects
# until the next heartbeats), so the three nodes may rebalance among
# themselves first: the join is measured from a settled cluster.
log "placed: $(for id in node-1 node-2 node-3; do echo -n "$id $(cluster_field "$id" connections)  "; done); waiting until the three are settled"
python3 "$BENCH_DIR/rebalance.py" poll "$RUN_DIR/poll-before.json" "$PROCESSES" "$SETTLE_TIMEOUT_S" \
  "$STABLE_S" "node-1=${NODE_ADMINS[node-1]}" "node-2=${NODE_ADMINS[node-2]}" "node-3=${NODE_ADMINS[node-3]}" \
  2>"$RUN_DIR/poll-before.err" || die "the three nodes did not settle in $SETTLE_TIMEOUT_S s"
log "before the join: $(for id in node-1 node-2 node-3; do echo -n "$id $(cluster_field "$id" connections)  "; done)"

# --- 2. messages, then node-4 joins ------------------------------------------
"$TOOL" produce --bootstrap "$BOOTSTRAP" --topic business --count 1000000000 --size 64 \
  --processes "$PROCESSES" --process-prefix proc- --rate "$RATE" \
  >"$RUN_DIR/produce.json" 2>"$RUN_DIR/produce.err" &
PRODUCER_PID=$!
STARTED_PIDS+=("$PRODUCER_PID")
log "producing $RATE messages/s to the $PROCESSES processes; node-4 joins in $BEFORE_S s"
sleep "$BEFORE_S"
kill -0 "$PRODUCER_PID" 2>/dev/null || { cat "$RUN_DIR/produce.err" >&2; die "the producer stopped"; }

# The moves the processes saw so far (the three nodes' own rounds).
rebalanced_before=$(python3 -c '
import json, sys
print(sum(json.load(open(p))["rebalanced"] for p in sys.argv[1:]))' "$RUN_DIR"/hold-*.status)

# /cluster of every node is followed from before node-4 starts (its admin
# port chosen here), so that the moves made before it is ready count too.
NEW_ADMIN_PORT=$(free_port)
python3 "$BENCH_DIR/rebalance.py" poll "$RUN_DIR/poll.json" "$PROCESSES" "$SETTLE_TIMEOUT_S" "$STABLE_S" \
  "node-1=${NODE_ADMINS[node-1]}" "node-2=${NODE_ADMINS[node-2]}" "node-3=${NODE_ADMINS[node-3]}" \
  "new:node-4=http://127.0.0.1:$NEW_ADMIN_PORT" 2>"$RUN_DIR/poll.err" &
POLLER_PID=$!
STARTED_PIDS+=("$POLLER_PID")
sleep 1
# CPU (ms) of the run's processes by kind, and of the whole machine (other
# work included), from node-4's start to settled.
machine_cpu_ms() {
  awk -v tck="$(getconf CLK_TCK)" '/^cpu / {print int(($2 + $3 + $4 + $7 + $8) * 1000 / tck)}' /proc/stat
}
cpu_snapshot() {
  local nodes=0 clients=0 pid id
  for id in "$@"; do nodes=$((nodes + $(cpu_ms "${NODE_PIDS[$id]}"))); done
  for pid in "${HOLD_PIDS[@]}"; do clients=$((clients + $(cpu_ms "$pid"))); done
  echo "$nodes $(cpu_ms "$TANSU_PID") $clients $(cpu_ms "$PRODUCER_PID") $(machine_cpu_ms) $(date +%s.%N)"
}
read -r -a cpu_before <<<"$(cpu_snapshot node-1 node-2 node-3)"
t_start=$(date +%s.%N)
PRESET_ADMIN_PORT=$NEW_ADMIN_PORT start_node node-4 business bench-business
t_ready=$(date +%s.%N)
log "node-4 ready after $(python3 -c "print(f'{$t_ready - $t_start:.1f}')") s; following /cluster of every node"
settled=1
wait "$POLLER_PID" || settled=0
read -r -a cpu_after <<<"$(cpu_snapshot node-1 node-2 node-3 node-4)"
if [[ $settled == 1 ]]; then
  log "settled: $(for id in node-1 node-2 node-3 node-4; do echo -n "$id $(cluster_field "$id" connections)  "; done)"
else
  log "WARNING: not settled after $SETTLE_TIMEOUT_S s: $(for id in node-1 node-2 node-3 node-4; do echo -n "$id $(cluster_field "$id" connections)  "; done)"
fi
sleep "$AFTER_S"

# Stop producing; the producer reports what it sent.
kill -TERM "$PRODUCER_PID"
wait "$PRODUCER_PID" || { cat "$RUN_DIR/produce.err" >&2; die "the producer failed"; }
sent=$(head -1 "$RUN_DIR/produce.json" | json_field sent)
log "produced $sent messages; waiting until the processes have them all (at most $DRAIN_TIMEOUT_S s)"

# distinct_seqs: messages the processes received so far (each message is
# for one process, so the client processes' counts add up).
distinct_seqs() {
  python3 -c '
import json, sys
print(sum(json.load(open(p))["distinct_seqs"] for p in sys.argv[1:]))' "$RUN_DIR"/hold-*.status
}
all_received() { (( $(distinct_seqs) >= sent )); }
if ! (TIMEOUT=$DRAIN_TIMEOUT_S wait_until "every message received" all_received) 2>/dev/null; then
  log "WARNING: $(distinct_seqs) of $sent messages received after $DRAIN_TIMEOUT_S s"
fi
sleep 2  # redeliveries still on their way

for pid in "${HOLD_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
for pid in "${HOLD_PIDS[@]}"; do wait "$pid" || log "WARNING: a client process failed"; done

# Dead letters, and the nodes' retry counters.
dlq=$("$TOOL" tail-count --bootstrap "$BOOTSTRAP" --topic business.dlq --idle-s 3 | json_field records)
# metric_sum NAME: a counter summed over every node (and label set).
metric_sum() {
  local id total=0 value
  for id in node-1 node-2 node-3 node-4; do
    value=$(curl -sf "${NODE_ADMINS[$id]}/metrics" | awk -v m="$1" '$1 ~ "^"m"({|$)" {s += $2} END {print s + 0}')
    total=$(python3 -c "print($total + $value)")
  done
  echo "$total"
}
retries=$(metric_sum wasmrelay_retries_total)
consumed=$(metric_sum wasmrelay_messages_consumed_total)
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)
python3 -c '
import json, sys
keys = ["processes", "rebalance_rate", "new_node", "t_ready", "ready_s", "dlq_records", "retries",
        "consumed", "rebalanced_before", "load_start", "load_end", "cpu_before", "cpu_after"]
vals = sys.argv[1:]
out = dict(zip(keys, vals))
for k in ("processes", "rebalance_rate", "dlq_records", "rebalanced_before"): out[k] = int(out[k])
for k in ("t_ready", "ready_s", "retries", "consumed"): out[k] = float(out[k])
b, a = [float(x) for x in out.pop("cpu_before").split()], [float(x) for x in out.pop("cpu_after").split()]
out["cpu_ms"] = dict(zip(["nodes", "tansu", "clients", "producer", "machine"], [y - x for x, y in zip(b, a)]))
out["cpu_window_s"] = a[5] - b[5]
print(json.dumps(out))' "$PROCESSES" "$REBALANCE_RATE" node-4 "$t_ready" \
  "$(python3 -c "print($t_ready - $t_start)")" "$dlq" "$retries" "$consumed" "$rebalanced_before" "$LOAD_START" "$LOAD_END" \
  "${cpu_before[*]}" "${cpu_after[*]}" >"$RUN_DIR/extra.json"

echo
describe_run
echo "settings: $PROCESSES processes in $CLIENTS client processes, $RATE messages/s ($PARTITIONS partitions, one producer),"
echo "          rebalance defaults (10% and 10 over the share, $REBALANCE_RATE moves/s, checked every 5 s), SDK rebalance_jitter 1 s"
python3 "$BENCH_DIR/rebalance.py" report "$RUN_DIR"
for id in node-1 node-2 node-3 node-4; do
  echo "$id log: $(grep -ci '"level":"warn' "${NODE_LOGS[$id]}") warnings, $(grep -ci '"level":"error' "${NODE_LOGS[$id]}") errors"
done
[[ $settled == 1 ]] || die "the cluster did not settle (logs kept)"
