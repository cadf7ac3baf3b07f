#!/usr/bin/env bash
# Runs the chaos scenarios (tests/e2e/chaos.rs) one after the other and
# prints their table: scenario, messages produced, delivered, duplicated
# (the same delivery again), dead-lettered, lost, and the longest stall
# (delivery standing still while messages waited). Exits non-zero if any
# scenario lost a message or stayed stuck once its fault ended.
#
#   scripts/chaos.sh            the short mode CI runs: 20 s a scenario
#   scripts/chaos.sh --full     180 s a scenario (the table in
#                               docs/RELIABILITY.md)
#   scripts/chaos.sh --seconds N [FILTER]
#                               N seconds a scenario; FILTER (a substring
#                               of the test names, e.g. chaos_b) picks some
#
# The scenarios run one at a time (--no-capture), so that one's faults do
# not slow another's delivery. Expects what scripts/test.sh builds first
# (the example plugins, the wasmrelay binary).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=20
filter=""
while (($#)); do
  case "$1" in
    --full) seconds=180 ;;
    --seconds) seconds="${2:?--seconds needs a number}"; shift ;;
    -*) echo "usage: $0 [--full | --seconds N] [FILTER]" >&2; exit 2 ;;
    *) filter="$1" ;;
  esac
  shift
done
case "$seconds" in
  '' | *[!0-9]*) echo "chaos.sh: --seconds wants a number of seconds, not '$seconds'" >&2; exit 2 ;;
esac
export WASMRELAY_CHAOS_SECONDS="$seconds"

output="$(mktemp "${TMPDIR:-/tmp}/wasmrelay-chaos.XXXXXX")"
trap 'rm -f "$output"' EXIT

expression="binary(e2e) & test(/^chaos::/)"
[[ -n "$filter" ]] && expression="$expression and test($filter)"
# --workspace, as scripts/test.sh builds the tests: with `-p` the
# dependencies get other features and are all built again.
set +e
cargo nextest run --workspace --locked --no-capture --no-fail-fast \
  -E "$expression" 2>&1 | tee "$output"
status=${PIPESTATUS[0]}
set -e

echo
echo "chaos scenarios, $seconds s each:"
python3 - "$output" <<'PY'
import json, sys
rows = [json.loads(line.split("chaos-row ", 1)[1])
        for line in open(sys.argv[1], errors="replace") if line.startswith("chaos-row ")]
columns = ["scenario", "produced", "delivered", "duplicated", "dead_lettered", "lost", "max_stall_ms"]
print("| " + " | ".join(columns) + " |")
print("|" + "---|" * len(columns))
for row in rows:
    print("| " + " | ".join(str(row[c]) for c in columns) + " |")
if not rows:
    print("(no scenario reported a row)")
PY
if ((status != 0)); then
  echo "chaos.sh: a scenario failed (exit $status); its output is above" >&2
fi
exit "$status"
