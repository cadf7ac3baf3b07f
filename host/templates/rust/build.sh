#!/usr/bin/env bash
# Builds {{name}}.wasm (a WebAssembly component) from src/lib.rs with
# `cargo build --release --target wasm32-wasip2`; no other tool is needed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
if command -v rustup >/dev/null 2>&1 && ! rustup target list --installed | grep -qx wasm32-wasip2; then
  rustup target add wasm32-wasip2 >&2
fi
cargo build --release --target wasm32-wasip2 >&2
target_dir="${CARGO_TARGET_DIR:-target}"
cp "$target_dir/wasm32-wasip2/release/{{name_snake}}.wasm" {{name}}.wasm
echo "built $(pwd)/{{name}}.wasm" >&2
