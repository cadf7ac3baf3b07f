#!/usr/bin/env bash
# build-one.sh WORLD SRC_DIR OUT: builds SRC_DIR/<dir name>.c for WORLD of
# wit/plugin.wit into the component OUT: wit-bindgen writes the C bindings,
# clang compiles for wasm32-wasi against wasi-libc (a reactor: no main) and
# links with wasm-ld, and wasm-tools wraps the core module into a component
# with the WASI preview1 adapter, which turns wasi-libc's preview1 imports
# into WASI 0.2 ones.
set -euo pipefail
world="$1" src="$2" out="$3"
source "$(dirname "${BASH_SOURCE[0]}")/../toolchain.sh"
need clang
need wit-bindgen
need wasm-tools
adapter="$(wasi_adapter)"
gen="$(mktemp -d)"
trap 'rm -rf "$gen"' EXIT
wit-bindgen c "$WIT_DIR" --world "$world" --out-dir "$gen" >/dev/null
clang --target=wasm32-wasi -O2 -mexec-model=reactor -Wall -Wextra -Werror -Wno-unused-parameter \
  -I "$gen" "$src/$(basename "$src").c" "$gen/$world.c" "$gen/${world}_component_type.o" \
  -o "$gen/core.wasm"
wasm-tools component new "$gen/core.wasm" --adapt "wasi_snapshot_preview1=$adapter" -o "$out"
