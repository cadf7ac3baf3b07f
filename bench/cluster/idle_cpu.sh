#!/usr/bin/env bash
# CPU of an idle cluster node: one node with one flow on an empty topic,
# nothing connected, on tansu; its CPU over MEASURE_S seconds, in total and
# per thread group, after SETTLE_S seconds of start-up. With BASELINE_BIN
# set, a node of that build is measured the same way in the same run,
# alternating with WASMRELAY_BIN ROUNDS times, and the ratio is printed.
#
#   bench/cluster/idle_cpu.sh
#   BASELINE_BIN=/path/to/older/wasmrelay SKIP_BUILD=1 bench/cluster/idle_cpu.sh
#
# Environment: MEASURE_S [20], SETTLE_S [8], ROUNDS [2], WASMRELAY_BIN,
# BASELINE_BIN, SKIP_BUILD=1, KEEP_RUN_DIR=1.
source "$(dirname "$0")/lib.sh"

MEASURE_S=${MEASURE_S:-20}
SETTLE_S=${SETTLE_S:-8}
ROUNDS=${ROUNDS:-2}
BASELINE_BIN=${BASELINE_BIN:-}

check_prerequisites
build
[[ -z "$BASELINE_BIN" || -x "$BASELINE_BIN" ]] || die "BASELINE_BIN: no executable at $BASELINE_BIN"
start_tansu
create_cluster_topics business.idle:3

# thread_ms PID: "group ms" per thread group (rdkafka's broker threads as
# one group, trailing numbers dropped), CPU used so far.
thread_ms() {
  local tck
  tck=$(getconf CLK_TCK)
  for task in /proc/"$1"/task/*; do
    local comm stat
    comm=$(cat "$task/comm" 2>/dev/null) || continue
    stat=$(cat "$task/stat" 2>/dev/null) || continue
    # utime and stime are fields 14 and 15, counted after the ')' of comm.
    echo "$comm|${stat##*) }"
  done | awk -F'|' -v tck="$tck" '{
    split($2, f, " "); g = $1
    if (g ~ /^rdk:broker/) g = "rdk:broker"; else sub(/[-0-9]+$/, "", g)
    ms[g] += (f[12] + f[13]) * 1000 / tck
  } END { for (g in ms) printf "%s|%d\n", g, ms[g] }'
}

# measure LABEL BIN: one idle node of BIN; prints "LABEL total-ms/s" and the
# groups, and appends to $RUN_DIR/results.
measure() {
  local label=$1 bin=$2 pid before after
  WASMRELAY=$bin start_node "idle-$label" business.idle "bench-idle-$label-$RANDOM"
  pid=$NODE_PID
  sleep "$SETTLE_S"
  before=$(thread_ms "$pid")
  sleep "$MEASURE_S"
  after=$(thread_ms "$pid")
  stop_node "idle-$label"
  python3 - "$label" "$MEASURE_S" "$before" "$after" <<'EOF' | tee -a "$RUN_DIR/results"
import sys
label, seconds, before, after = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
parse = lambda text: {g: int(ms) for g, ms in (line.split("|") for line in text.splitlines() if "|" in line)}
b, a = parse(before), parse(after)
spent = {g: a[g] - b.get(g, 0) for g in a}
total = sum(spent.values())
groups = ", ".join(f"{g} {ms / seconds:.1f}" for g, ms in sorted(spent.items(), key=lambda kv: -kv[1]) if ms > 0)
print(f"{label}|{total / seconds:.1f}|{groups}")
EOF
}

describe_run
echo "idle node: one flow on an empty 3-partition topic, nothing connected; CPU ms per second over $MEASURE_S s after $SETTLE_S s"
for round in $(seq 1 "$ROUNDS"); do
  measure "build-$round" "$WASMRELAY" >/dev/null
  if [[ -n "$BASELINE_BIN" ]]; then
    measure "baseline-$round" "$BASELINE_BIN" >/dev/null
  fi
done
echo
echo "| run | node CPU, ms per s | by thread group, ms per s |"
echo "|---|---:|---|"
awk -F'|' '{printf "| %s | %s | %s |\n", $1, $2, $3}' "$RUN_DIR/results"
if [[ -n "$BASELINE_BIN" ]]; then
  awk -F'|' '$1 ~ /^build/ {b += $2; nb++} $1 ~ /^baseline/ {s += $2; ns++}
    END { if (nb && ns && s > 0) printf "\nbuild / baseline: %.2fx (means %.1f / %.1f ms per s)\n", (b/nb)/(s/ns), b/nb, s/ns }' "$RUN_DIR/results"
fi
