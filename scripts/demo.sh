#!/usr/bin/env bash
# Builds wasmrelay and the example plugins, then runs `wasmrelay demo`: an
# embedded development broker, a demo application and the example plugins,
# with messages flowing and a live summary. Extra arguments go to the demo
# (e.g. `--messages 5000`, `--rate 1000`); without `--messages` it stops
# after 2,000 messages.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\n\033[1m==> %s\033[0m\n' "$*" >&2; }

scripts/setup.sh --demo
say "building wasmrelay"
cargo build --locked --bin wasmrelay
say "building the example plugins"
plugins/build.sh >/dev/null

args=("$@")
if [[ " ${args[*]-} " != *" --messages "* ]]; then
  args+=(--messages 2000)
fi
say "wasmrelay demo ${args[*]}"
RUST_LOG="${RUST_LOG:-error}" target/debug/wasmrelay demo --plugins plugins/dist "${args[@]}"
