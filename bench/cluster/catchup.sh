#!/usr/bin/env bash
# Benchmark 3: route table catch-up. See bench/cluster/README.md.
#
#   bench/cluster/catchup.sh
#   ROUTES="10000 100000 1000000" bench/cluster/catchup.sh
#
# For each count in ROUTES (1000000), fills a routes topic of its own with
# that many process routes (MAC'd as nodes write them), then, in turn:
# reads it with a plain rdkafka reader with a node's reader settings (the
# baseline: `read-all`), starts a node on it and measures how long its
# route table takes to catch up (the node's own "route table caught up"
# log line, timed from starting its reader; and the time from starting the
# process to /readyz) and its RSS after, and reads it with the plain reader
# again. The ratio is the node's catch-up over the mean of the two plain
# reads. The memory baseline is an identical node on an empty routes topic,
# in the same run.
#
# Environment: ROUTES ["1000000"], SKIP_BUILD=1, WASMRELAY_BIN, KEEP_RUN_DIR=1,
# PLOT=path.png (plots catch-up time and memory against routes; needs
# matplotlib), RESULTS_OUT=path.jsonl (keeps the result lines).
source "$(dirname "$0")/lib.sh"

ROUTES=${ROUTES:-1000000}

check_prerequisites
build
RESULTS="$RUN_DIR/results.jsonl"
: >"$RESULTS"

start_tansu
topics=(business:3 wasmrelay.routes-empty:6:compact)
for count in $ROUTES; do topics+=("wasmrelay.routes-$count:6:compact"); done
create_cluster_topics "${topics[@]}"

FILLS="$RUN_DIR/fills.jsonl"
: >"$FILLS"
for count in $ROUTES; do
  log "writing $count routes to wasmrelay.routes-$count"
  # The routes name the node that reads them: a node never evicts its own
  # routes, where those of a node not live go a node timeout after they
  # were read (before the RSS is taken).
  "$TOOL" fill-routes --bootstrap "$BOOTSTRAP" --topic "wasmrelay.routes-$count" --count "$count" \
    --node "catchup-n$count" | tee -a "$FILLS" >&2
done

# plain_read LABEL ROUTES TOPIC: the baseline reader, one result line.
plain_read() {
  local label=$1 count=$2 topic=$3 out
  out=$("$TOOL" read-all --bootstrap "$BOOTSTRAP" --topic "$topic")
  python3 -c '
import json, sys
label, count, out = sys.argv[1:4]
r = json.loads(out)
print(json.dumps({"kind": "plain", "label": label, "count": int(count), **r}))' "$label" "$count" "$out" >>"$RESULTS"
  log "$label: $(tail -1 "$RESULTS")"
}

# catchup_node LABEL VARIANT ROUTES_TOPIC COUNT
catchup_node() {
  local label=$1 variant=$2 topic=$3 count=$4 id="catchup-$2"
  local started_ns ready_ns
  started_ns=$(date +%s%N)
  WASMRELAY_LOG_FORMAT=json NODE_READY_TIMEOUT=900 start_node "$id" business "catchup-$variant" "$topic"
  ready_ns=$(date +%s%N)
  local rss hwm
  rss=$(settled_rss_kb "$NODE_PID")
  hwm=$(awk '/^VmHWM:/ {print $2}' "/proc/$NODE_PID/status")
  local caught
  caught=$(grep -m1 '"route table caught up"' "${NODE_LOGS[$id]}") \
    || die "node $id never logged \"route table caught up\" (log: ${NODE_LOGS[$id]})"
  local cluster
  cluster=$(curl -sf "$NODE_ADMIN/cluster")
  python3 -c '
import json, sys
label, variant, count, line, cluster, started, ready, rss, hwm = sys.argv[1:10]
fields = json.loads(line).get("fields", {})
c = json.loads(cluster)
print(json.dumps({
    "kind": "node", "label": label, "variant": variant, "count": int(count),
    "records": int(fields["records"]), "routes": int(fields["routes"]),
    "seconds": float(fields["seconds"]),
    "ready_s": (int(ready) - int(started)) / 1e9,
    "rss_kib": int(rss), "hwm_kib": int(hwm),
    "cluster_routes": c["routes"], "cluster_caught_up": c["route_table_caught_up"],
}))' "$label" "$variant" "$count" "$caught" "$cluster" "$started_ns" "$ready_ns" "$rss" "$hwm" >>"$RESULTS"
  log "$label: $(tail -1 "$RESULTS")"
  stop_node "$id"
}

catchup_node "empty (baseline)" empty wasmrelay.routes-empty 0
for count in $ROUTES; do
  topic="wasmrelay.routes-$count"
  plain_read "plain reader, $count routes (before)" "$count" "$topic"
  catchup_node "$count routes" "n$count" "$topic" "$count"
  plain_read "plain reader, $count routes (after)" "$count" "$topic"
done

echo
describe_run
echo "fills:"; cat "$FILLS"
python3 "$BENCH_DIR/report.py" catchup "$RESULTS"
if [[ -n "${PLOT:-}" ]]; then
  python3 "$BENCH_DIR/plot_catchup.py" "$RESULTS" "$PLOT"
  echo "plot: $PLOT"
fi
if [[ -n "${RESULTS_OUT:-}" ]]; then cp "$RESULTS" "$RESULTS_OUT"; fi
