#!/usr/bin/env bash
# The per-language table of bench/RESULTS.md: json-enrich in Rust, C,
# JavaScript and Python, each measured by `wasmrelay plugin bench` (release
# build) in one run on this machine: component size, compile time at load,
# instantiation time and linear memory of a fresh instance, and time per
# `process` call on a 1 KiB JSON object (what the plugin adds to each
# message). The Rust passthrough plugin is the floor: a call that does
# nothing but copy the message in and out.
#
#   bench/polyglot/run.sh            # prints the markdown table
#   WASMRELAY=path/to/wasmrelay bench/polyglot/run.sh   # with that (release) binary
#
# Needs the toolchains of scripts/setup.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [[ -z "${WASMRELAY:-}" ]]; then
  cargo build --release --locked -p wasmrelay --bin wasmrelay >&2
fi
wasmrelay="${WASMRELAY:-target/release/wasmrelay}"
rust_dist="$(plugins/build.sh)"
polyglot_dist="$(plugins/polyglot/build.sh)"

rows=(
  "Rust (passthrough, the floor)|$rust_dist/passthrough.wasm"
  "Rust|$rust_dist/json-enrich.wasm"
  "C|$polyglot_dist/c-json-enrich.wasm"
  "JavaScript|$polyglot_dist/js-json-enrich.wasm"
  "Python|$polyglot_dist/python-json-enrich.wasm"
)

echo "| language | component size | compile at load | instantiate | memory per instance | per 1 KiB message |"
echo "|---|---|---|---|---|---|"
for row in "${rows[@]}"; do
  IFS='|' read -r lang file <<<"$row"
  line="$("$wasmrelay" plugin bench "$file" --value-bytes 1024)"
  python3 - "$lang" "$line" <<'PY'
import json, sys
lang, m = sys.argv[1], json.loads(sys.argv[2])
def size(b):
    return f"{b / 1024:.0f} KiB" if b < 1 << 20 else f"{b / (1 << 20):.1f} MiB"
def dur_us(us):
    return f"{us:.0f} µs" if us < 1000 else f"{us / 1000:.1f} ms"
def dur_ns(ns):
    return f"{ns:.0f} ns" if ns < 10000 else f"{ns / 1000:.1f} µs"
ms = m["compile_ms"]
compile_ = f"{ms:.0f} ms" if ms < 1000 else f"{ms / 1000:.1f} s"
print(f"| {lang} | {size(m['size_bytes'])} | {compile_} | {dur_us(m['instantiate_us'])} "
      f"| {size(m['memory_bytes'])} | {dur_ns(m['ns_per_call'])} |")
PY
done
