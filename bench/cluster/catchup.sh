#!/usr/bin/env bash
# Benchmark 3: route table catch-up. See bench/cluster/README.md.
#
#   bench/cluster/catchup.sh
#
# Fills a routes topic with ROUTES (1,000,000) process routes, starts a node
# on it and measures how long its route table takes to catch up (the
# node's own "route table caught up" log line, and the time from starting
# the process to /readyz) and its RSS after; the baseline is an identical
# node on an empty routes topic, in the same run.
#
# Environment: ROUTES [1000000], SKIP_BUILD=1, WASMRELAY_BIN, KEEP_RUN_DIR=1.
source "$(dirname "$0")/lib.sh"

ROUTES=${ROUTES:-1000000}

check_prerequisites
build
RESULTS="$RUN_DIR/results.jsonl"
: >"$RESULTS"

start_tansu
create_cluster_topics business:3 wasmrelay.routes-empty:6:compact

log "writing $ROUTES routes to wasmrelay.routes"
fill=$("$TOOL" fill-routes --bootstrap "$BOOTSTRAP" --topic wasmrelay.routes --count "$ROUTES")
log "written: $fill"

# catchup_node LABEL VARIANT ROUTES_TOPIC
catchup_node() {
  local label=$1 variant=$2 topic=$3 id="catchup-$2"
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
label, variant, line, cluster, started, ready, rss, hwm = sys.argv[1:9]
fields = json.loads(line).get("fields", {})
c = json.loads(cluster)
print(json.dumps({
    "label": label, "variant": variant,
    "records": int(fields["records"]), "routes": int(fields["routes"]),
    "seconds": float(fields["seconds"]),
    "ready_s": (int(ready) - int(started)) / 1e9,
    "rss_kib": int(rss), "hwm_kib": int(hwm),
    "cluster_routes": c["routes"], "cluster_caught_up": c["route_table_caught_up"],
}))' "$label" "$variant" "$caught" "$cluster" "$started_ns" "$ready_ns" "$rss" "$hwm" >>"$RESULTS"
  log "$label: $(tail -1 "$RESULTS")"
  stop_node "$id"
}

catchup_node "empty (baseline)" empty wasmrelay.routes-empty
catchup_node "$ROUTES routes" full wasmrelay.routes

echo
describe_run
echo "fill: $fill"
python3 "$BENCH_DIR/report.py" catchup "$RESULTS"
python3 -c '
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print("%s: peak RSS (VmHWM) %.1f MiB; /cluster says routes=%s, route_table_caught_up=%s" % (r["label"], r["hwm_kib"] / 1024, r["cluster_routes"], r["cluster_caught_up"]))' "$RESULTS"
