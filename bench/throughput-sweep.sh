#!/usr/bin/env bash
# Relay throughput against partitions and against message size, each point
# beside the plain rdkafka loop of the same run, with two plots.
#
#   bench/throughput-sweep.sh
#   PARTITIONS="1 3 6 12" SIZES="256 1024 4096 16384" RELAY_BENCH_RECORDS=30000 bench/throughput-sweep.sh
#
# Builds once (the benchmark host/benches/relay_throughput.rs, the release
# `wasmrelay` binary it starts, the example plugins), then runs the
# benchmark once per point, throughput only (RELAY_BENCH_SKIP_LATENCY=1):
# every partition count of PARTITIONS at BASE_SIZE bytes, then every value
# size of SIZES at BASE_PARTITIONS partitions (the point both lists share
# runs once). Each run starts its own tansu and measures the plain loop,
# the relay with `passthrough` and the relay with `json-enrich` on it, so
# every ratio is from one run. Then writes
#   $OUT_DIR/relay-throughput-partitions.png   records/s, relay / plain and CPU per record against partitions
#   $OUT_DIR/relay-throughput-size.png         the same against value size (log axis)
# and prints a markdown table of every run.
#
# Takes about 5 minutes after the build on the 2-core machine (7 runs of
# 30,000 records, each 30-50 s: most of it is filling the input topics, one
# record per batch); the first release build of the benchmark takes 15-30
# minutes more.
#
# Environment: PARTITIONS ["1 3 6 12"], SIZES ["256 1024 4096 16384"] (bytes),
# BASE_SIZE [1024], BASE_PARTITIONS [3], RELAY_BENCH_RECORDS [30000],
# OUT_DIR [bench/plots], RUN_DIR [a new /tmp/wasmrelay-throughput-sweep.XXXXXX;
# always kept: results.jsonl, one log per run], RESULTS_OUT=path.jsonl (a copy
# of the result lines), and what the benchmark itself reads
# (RELAY_BENCH_LINK_OPTIONS, TANSU_BIN).
set -euo pipefail

BENCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$BENCH_DIR/.." && pwd)"

PARTITIONS=${PARTITIONS:-"1 3 6 12"}
SIZES=${SIZES:-"256 1024 4096 16384"}
BASE_SIZE=${BASE_SIZE:-1024}
BASE_PARTITIONS=${BASE_PARTITIONS:-3}
export RELAY_BENCH_RECORDS=${RELAY_BENCH_RECORDS:-30000}
OUT_DIR=${OUT_DIR:-$ROOT/bench/plots}
RUN_DIR=${RUN_DIR:-}

log() { echo "[$(date +%H:%M:%S)] $*" >&2; }
die() { echo "error: $*" >&2; exit 1; }

tansu_bin() {
  if [[ -n "${TANSU_BIN:-}" ]]; then echo "$TANSU_BIN"; return; fi
  if command -v tansu >/dev/null 2>&1; then command -v tansu; return; fi
  echo "${CARGO_HOME:-$HOME/.cargo}/bin/tansu"
}

# --- prerequisites: all checked before anything is built -------------------
command -v cargo >/dev/null 2>&1 || die "cargo is missing: install Rust with rustup"
command -v python3 >/dev/null 2>&1 || die "python3 is missing: apt-get install -y python3"
python3 -c 'import matplotlib' 2>/dev/null \
  || die "matplotlib is missing (for the plots): apt-get install -y python3-matplotlib, or pip install matplotlib"
TANSU="$(tansu_bin)"
[[ -x "$TANSU" ]] || die "the tansu broker is missing: run scripts/setup.sh, or cargo install tansu --version 0.6.0 --features dynostore,libsql --locked"
"$TANSU" --version | grep -qw 0.6.0 || die "$TANSU is not tansu 0.6.0 (scripts/setup.sh installs it)"
for n in $PARTITIONS $SIZES $BASE_SIZE $BASE_PARTITIONS $RELAY_BENCH_RECORDS; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "not a positive whole number: '$n' (PARTITIONS, SIZES, BASE_SIZE, BASE_PARTITIONS, RELAY_BENCH_RECORDS)"
done
[[ -n "$RUN_DIR" ]] || RUN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/wasmrelay-throughput-sweep.XXXXXX")
mkdir -p "$RUN_DIR" "$OUT_DIR"
RESULTS="$RUN_DIR/results.jsonl"
: >"$RESULTS"

# --- build once ------------------------------------------------------------
# The benchmark builds the relay itself (`cargo build --release -p wasmrelay
# --bin wasmrelay`, as the tests' support does) and the plugins
# (plugins/build.sh) when it starts them: built here first, those are
# no-ops in every run, and the benchmark's executable is run directly.
log "building the benchmark, the relay (release) and the plugins"
bench_exe=$(cd "$ROOT" && cargo bench --locked -p wasmrelay --bench relay_throughput --no-run --message-format=json-render-diagnostics \
  | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "relay_throughput" and m.get("executable"):
        print(m["executable"])')
[[ -x "$bench_exe" ]] || die "cargo bench --no-run did not say where the relay_throughput executable is"
(cd "$ROOT" && cargo build --locked --release -p wasmrelay --bin wasmrelay >&2)
bash "$ROOT/plugins/build.sh" >/dev/null

# --- the points ------------------------------------------------------------
points=()
declare -A seen
add_point() {
  local key="$1 $2"
  [[ -z "${seen[$key]:-}" ]] || return 0
  seen[$key]=1
  points+=("$key")
}
for partitions in $PARTITIONS; do add_point "$partitions" "$BASE_SIZE"; done
for size in $SIZES; do add_point "$BASE_PARTITIONS" "$size"; done

started=$SECONDS
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$ROOT" diff --quiet HEAD -- host client protocol plugins 2>/dev/null || echo ' (work tree has uncommitted changes in host/client/protocol/plugins)')"
  echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), load average $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "tansu: $("$TANSU" --version 2>/dev/null | head -1)"
  echo "runs: ${#points[@]} of $RELAY_BENCH_RECORDS records (partitions, value bytes): $(printf '(%s) ' "${points[@]}")"
} | tee "$RUN_DIR/run.txt"
run=0
for point in "${points[@]}"; do
  read -r partitions size <<<"$point"
  run=$((run + 1))
  run_log="$RUN_DIR/run-p$partitions-b$size.log"
  log "run $run of ${#points[@]}: partitions $partitions, values of $size B (log: $run_log)"
  if ! (cd "$ROOT/host" && RELAY_BENCH_PARTITIONS=$partitions RELAY_BENCH_VALUE_BYTES=$size \
        RELAY_BENCH_SKIP_LATENCY=1 RELAY_BENCH_JSON="$RESULTS" "$bench_exe" --bench) >"$run_log" 2>&1; then
    tail -30 "$run_log" >&2
    die "the run at $partitions partitions, $size B failed (log above; results so far in $RESULTS)"
  fi
  grep -E 'records/s|x$|µs per record' "$run_log" >&2 || true
done
log "${#points[@]} runs in $((SECONDS - started)) s"

echo
python3 "$BENCH_DIR/plot_throughput.py" "$RESULTS" --table --out-dir "$OUT_DIR" \
  --base-size "$BASE_SIZE" --base-partitions "$BASE_PARTITIONS"
echo "results and logs: $RUN_DIR"
if [[ -n "${RESULTS_OUT:-}" ]]; then cp "$RESULTS" "$RESULTS_OUT"; fi
