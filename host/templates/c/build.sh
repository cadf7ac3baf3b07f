#!/usr/bin/env bash
# Builds {{name}}.wasm (a WebAssembly component) from {{name_snake}}.c:
#   1. wit-bindgen writes the C bindings of the {{world}} world into gen/;
#   2. clang compiles for wasm32-wasi against wasi-libc, as a reactor (no
#      main), and links with wasm-ld;
#   3. wasm-tools wraps the core module into a component, with the WASI
#      preview1 adapter turning wasi-libc's preview1 imports into WASI 0.2.
#
# Tools are looked up on PATH, then in $WASMRELAY_TOOLS/bin (default
# ~/.local/share/wasmrelay/tools/bin, where the wasmrelay repository's
# scripts/setup.sh installs them); the adapter is $WASI_ADAPTER or
# $WASMRELAY_TOOLS/share/wasi_snapshot_preview1.reactor.wasm.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
tools="${WASMRELAY_TOOLS:-$HOME/.local/share/wasmrelay/tools}"
PATH="$PATH:$tools/bin"
for tool in clang wasm-ld wit-bindgen wasm-tools; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "build.sh: $tool not found; it needs Debian clang, lld and wasi-libc, and" \
      "cargo install --locked wit-bindgen-cli@0.61.1 wasm-tools@1.263.0" >&2
    exit 1
  fi
done
adapter="${WASI_ADAPTER:-$tools/share/wasi_snapshot_preview1.reactor.wasm}"
if [[ ! -s "$adapter" ]]; then
  echo "build.sh: the WASI preview1 reactor adapter $adapter is missing (set WASI_ADAPTER;" \
    "it is in the wasi-preview1-component-adapter-provider crate)" >&2
  exit 1
fi
rm -rf gen
mkdir -p gen
wit-bindgen c wit --world {{world}} --out-dir gen >/dev/null
clang --target=wasm32-wasi -O2 -mexec-model=reactor -Wall -Wextra -Wno-unused-parameter \
  -I gen {{name_snake}}.c gen/{{world}}.c gen/{{world}}_component_type.o -o gen/core.wasm
wasm-tools component new gen/core.wasm --adapt "wasi_snapshot_preview1=$adapter" -o {{name}}.wasm
echo "built $(pwd)/{{name}}.wasm" >&2
