#!/usr/bin/env bash
# Builds wasmrelay and the example plugins, then shows plugins at work on
# sample messages with `wasmrelay plugin test`.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '\n\033[1m==> %s\033[0m\n' "$*" >&2; }

scripts/setup.sh
say "building wasmrelay"
cargo build --locked --bin wasmrelay
say "building the example plugins"
plugins/build.sh >/dev/null
relay=target/debug/wasmrelay
input=examples/messages.jsonl

say "input messages ($input)"
cat "$input"

say "json-enrich --config field=handled_by --config value=wasmrelay-demo"
"$relay" plugin test plugins/dist/json-enrich.wasm --config field=handled_by --config value=wasmrelay-demo --input "$input"

say "mask-fields --config fields=card_number,password"
"$relay" plugin test plugins/dist/mask-fields.wasm --config fields=card_number,password --input "$input"

say "route-by-field (router): which process each message is for"
"$relay" plugin test plugins/dist/route-by-field.wasm --input "$input"

say "fault-loop: a plugin that never returns is stopped at its deadline"
head -n 1 "$input" | "$relay" plugin test plugins/dist/fault-loop.wasm --deadline-ms 100
