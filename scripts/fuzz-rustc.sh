#!/usr/bin/env bash
# The RUSTC_WORKSPACE_WRAPPER of scripts/fuzz.sh for the host's fuzz
# targets: runs rustc as cargo asks, adding libFuzzer's coverage
# instrumentation (the flags cargo fuzz passes, without a sanitizer). Cargo
# runs it for the workspace's own crates only (host/fuzz, the host library,
# the protocol crate), and keeps their wrapped builds apart from the
# ordinary ones; the dependencies (wasmtime, librdkafka, ...) are those of
# `cargo build -p wasmrelay`, built once for both.
set -euo pipefail
rustc="$1"
shift

# Build scripts are not instrumented: they do not link libFuzzer.
if [[ " $* " == *" --crate-name build_script_"* ]]; then
  exec "$rustc" "$@"
fi
exec "$rustc" "$@" \
  -Cpasses=sancov-module \
  -Cllvm-args=-sanitizer-coverage-level=4 \
  -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
  -Cllvm-args=-sanitizer-coverage-pc-table \
  -Cllvm-args=-sanitizer-coverage-trace-compares
