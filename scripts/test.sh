#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run calls this): installs what it
# needs, checks formatting and lints, builds the example plugins, runs every
# test with nextest, runs the chaos scenarios in their short mode
# (scripts/chaos.sh), then fuzzes every target of scripts/fuzz.sh (the
# frame decoder, the config loader, center values, cluster records, plugin
# test lines) for FUZZ_RUNS runs each (50,000 by default).
# Extra arguments go to `cargo nextest run`.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step says how long the one before it took, and the end prints them all,
# so a slow CI run shows where its time went.
step_name=""
step_start=$SECONDS
suite_start=$SECONDS
step_times=()
end_step() {
  if [[ -n "$step_name" ]]; then
    step_times+=("$(printf '%5d s  %s' $((SECONDS - step_start)) "$step_name")")
  fi
}
say() {
  end_step
  step_name="$*"
  step_start=$SECONDS
  printf '\033[1m==> %s\033[0m\n' "$*" >&2
}
print_step_times() {
  local status=$?
  end_step
  step_name=""
  printf '\n\033[1m==> time per step (%d s in all, exit %d)\033[0m\n' $((SECONDS - suite_start)) "$status" >&2
  printf '%s\n' "${step_times[@]}" >&2
}
trap print_step_times EXIT

# A full build of the workspace and its tests takes about 15 GiB; say so up
# front rather than failing an hour in with "No space left on device".
free_kib="$(df -Pk . | awk 'NR == 2 { print $4 }')"
if [[ -n "$free_kib" ]] && ((free_kib < 20 * 1024 * 1024)); then
  printf 'warning: only %d GiB free on %s; building and testing needs about 20 GiB\n' \
    $((free_kib / 1024 / 1024)) "$(pwd)" >&2
fi

say "set-up (scripts/setup.sh)"
scripts/setup.sh

say "cargo fmt --check (host and plugins)"
cargo fmt --all -- --check
(cd plugins && cargo fmt --all -- --check)

say "building the example plugins (wasm32-wasip2)"
plugins/build.sh >/dev/null

say "building the example plugins in C, JavaScript and Python (plugins/polyglot)"
plugins/polyglot/build.sh >/dev/null

say "cargo clippy -D warnings (host and plugins)"
cargo clippy --workspace --all-targets --locked -- -D warnings
(cd plugins && cargo clippy --workspace --target wasm32-wasip2 --locked -- -D warnings)

# The end-to-end tests (tests/) build these themselves when they are out of
# date, but then within a test's time limit: build them first, with the same
# commands (tests/support/lib.rs), so that the tests find them current.
say "building the binaries the end-to-end tests run"
cargo build --locked -p wasmrelay --bin wasmrelay
cargo build --locked -p wasmrelay-client --example relay-client

say "running the tests (the chaos scenarios apart, next)"
cargo nextest run --workspace --locked --no-fail-fast -E 'not test(/^chaos::/)' "$@"

say "the chaos scenarios, short mode (scripts/chaos.sh)"
scripts/chaos.sh

say "fuzzing the parsers of outside input (${FUZZ_RUNS:-50000} runs a target)"
scripts/fuzz.sh "${FUZZ_RUNS:-50000}"
