#!/usr/bin/env bash
# The soak: a sidecar and a three-node cluster under steady load for
# MINUTES, a fault every minute in turn (tests/e2e/soak.rs), each relay's
# RSS (anonymous memory and file pages apart), open files, threads, tokio
# tasks, client connections and unfinished records sampled every 10 s.
# Fails on any loss, or if the heap in use (wasmrelay_heap_in_use_bytes:
# what a leak raises; the anonymous memory, which also holds what glibc
# keeps free, and the RSS, mostly the debug binary's pages, are reported
# beside) or the open files (less a node's client connections) of a relay
# that ran throughout
# grew by 5% or more from minute 5 to the end: the least-squares line
# through the samples of the whole five-minute fault cycles after minute 5
# (the second half of the run, if it is shorter than 15 minutes), so the
# ups and downs within a cycle do not count and a trend or a step that
# stays does. The medians of the first and last cycles are shown beside.
#
#   scripts/soak.sh MINUTES [OUT_DIR]
#
# OUT_DIR (default target/soak) gets samples.csv, summary.md (the growth
# table) and soak.svg (the plot). WASMRELAY_SOAK_HEAPTRACK=path runs the
# sidecar with heaptrack's preload library (Debian heaptrack), its raw
# trace written to path (see tests/e2e/soak.rs for reading it). Expects what scripts/test.sh builds
# first (the example plugins, the wasmrelay binary).
set -euo pipefail
cd "$(dirname "$0")/.."

minutes="${1:-}"
case "$minutes" in
  '' | *[!0-9]*) echo "usage: $0 MINUTES [OUT_DIR]  (MINUTES: a whole number, not '$minutes')" >&2; exit 2 ;;
esac
out="${2:-target/soak}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
export WASMRELAY_SOAK_MINUTES="$minutes" WASMRELAY_SOAK_CSV="$out/samples.csv"

# --workspace, as scripts/test.sh builds the tests: with `-p` the
# dependencies get other features and are all built again.
set +e
cargo nextest run --workspace --locked --profile soak --no-capture --run-ignored only \
  -E 'binary(e2e) & test(/^soak::/)' 2>&1 | tee "$out/output.log"
status=${PIPESTATUS[0]}
set -e

python3 scripts/soak-report.py "$out" "$minutes"
if ((status != 0)); then
  echo "soak.sh: the soak failed (exit $status); see $out/output.log" >&2
fi
exit "$status"
