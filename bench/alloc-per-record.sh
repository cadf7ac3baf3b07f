#!/usr/bin/env bash
# Allocations per record of a transform flow, by thread: counts every
# malloc of the passthrough relay of the relay_throughput benchmark while it
# drains, with uprobes (perf probe) on glibc's malloc and on librdkafka's
# rd_kafka_producev (one call per produced record), and prints the counts
# per produced record. Unlike a rate or a CPU figure, the count hardly
# moves from run to run, so it shows a change of the per-record work that
# timing on a shared 2-core machine cannot.
#
#   bench/alloc-per-record.sh
#
# Environment (defaults in brackets): RECORDS [100000] of the benchmark
# run, SECONDS_RECORDED [2] counted from 0.3 s after the relay's first
# plugin call (it drains for longer than that: the probes slow it several
# times over).
# Needs root (uprobes) and perf. The consumer thread reads ahead of what is
# produced, so its count per produced record is an overestimate early in a
# drain; the tokio workers' and the plugin executor's are exact.
set -euo pipefail
cd "$(dirname "$0")/.."

RECORDS=${RECORDS:-100000}
SECONDS_RECORDED=${SECONDS_RECORDED:-2}
LIBC=$(ldconfig -p | awk '/libc\.so\.6 .*x86-64/ {print $NF; exit}')
[[ -n "$LIBC" ]] || { echo "alloc-per-record: glibc's libc.so.6 not found" >&2; exit 1; }
command -v perf >/dev/null || { echo "alloc-per-record: perf is not installed" >&2; exit 1; }

echo "building the benchmark and the relay" >&2
cargo bench --locked -p wasmrelay --bench relay_throughput --no-run 2>&1 | tail -1 >&2
cargo build --release --locked -p wasmrelay 2>&1 | tail -1 >&2
RELAY=$PWD/target/release/wasmrelay

OUT=$(mktemp -d)
remove_probes() {
  perf probe -q -d 'probe_libc:malloc' 2>/dev/null || true
  perf probe -q -d 'probe_wasmrelay:rd_kafka_producev' 2>/dev/null || true
}
trap 'remove_probes; rm -rf "$OUT"' EXIT
remove_probes
perf probe -q -x "$LIBC" --add malloc || { echo "alloc-per-record: cannot add a uprobe on malloc (root needed)" >&2; exit 1; }
perf probe -q -x "$RELAY" --add rd_kafka_producev || { echo "alloc-per-record: cannot add a uprobe on rd_kafka_producev in $RELAY" >&2; exit 1; }

(
  RELAY_BENCH_RECORDS=$RECORDS RELAY_BENCH_SKIP_LATENCY=1 \
    cargo bench --locked -p wasmrelay --bench relay_throughput >"$OUT/bench.log" 2>&1
) &
BENCH=$!
pid=""
for _ in $(seq 1 6000); do
  pid=$(pgrep -f "^$RELAY run --config" | head -1 || true)
  [[ -n "$pid" ]] && break
  kill -0 "$BENCH" 2>/dev/null || break
  sleep 0.1
done
[[ -n "$pid" ]] || { cat "$OUT/bench.log" >&2; echo "alloc-per-record: the relay never started" >&2; exit 1; }
# The plugin executor's threads start with the first plugin call; perf
# follows only the threads there when it attaches, so wait for them.
for _ in $(seq 1 600); do
  grep -qs plugin-exec /proc/"$pid"/task/*/comm && break
  sleep 0.01
done
grep -qs plugin-exec /proc/"$pid"/task/*/comm \
  || { echo "alloc-per-record: the relay made no plugin call within 6 s" >&2; exit 1; }
sleep 0.3
perf record -q -e probe_libc:malloc -e probe_wasmrelay:rd_kafka_producev -p "$pid" \
  -o "$OUT/probes.data" -- sleep "$SECONDS_RECORDED" >/dev/null 2>&1
wait "$BENCH" || { cat "$OUT/bench.log" >&2; echo "alloc-per-record: the benchmark failed" >&2; exit 1; }
perf script -i "$OUT/probes.data" -F comm,event 2>/dev/null >"$OUT/probes.txt"
python3 - "$OUT/probes.txt" <<'EOF_PY'
import collections, re, sys
counts = collections.Counter()
for line in open(sys.argv[1]):
    parts = line.split()
    if len(parts) < 2:
        continue
    event = parts[-1].rstrip(":").split(":")[-1]
    # Thread names without their numbers: one line per kind of thread.
    thread = re.sub(r"[-_]?\d+$", "", " ".join(parts[:-1]))
    counts[(thread, event)] += 1
produced = sum(n for (_, e), n in counts.items() if e == "rd_kafka_producev")
if produced == 0:
    sys.exit("alloc-per-record: no record was produced while recording")
print(f"records produced while recording: {produced}")
print("%-24s %9s %11s" % ("thread", "mallocs", "per record"))
total = 0
for (thread, event), n in sorted(counts.items(), key=lambda kv: -kv[1]):
    if event != "malloc":
        continue
    total += n
    print("%-24s %9d %11.2f" % (thread, n, n / produced))
print("%-24s %9d %11.2f" % ("all threads", total, total / produced))
EOF_PY
grep -E "passthrough plugin" "$OUT/bench.log" | sed "s/^/the benchmark's own line, slowed by the probes while they counted: /" || true
