#!/usr/bin/env bash
# Builds {{name}}.wasm (a WebAssembly component) from {{name}}.js with
# componentize-js (npm @bytecodealliance/componentize-js). The WASI `http`
# and `fetch-event` features are left out: the relay links no HTTP.
#
# componentize-js is looked up on PATH, then in $WASMRELAY_TOOLS/bin
# (default ~/.local/share/wasmrelay/tools/bin, where the wasmrelay
# repository's scripts/setup.sh installs it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PATH="$PATH:${WASMRELAY_TOOLS:-$HOME/.local/share/wasmrelay/tools}/bin"
if ! command -v componentize-js >/dev/null 2>&1; then
  echo "build.sh: componentize-js not found; install it with: npm install -g @bytecodealliance/componentize-js@0.23.0" >&2
  exit 1
fi
componentize-js {{name}}.js --wit wit --world-name {{world}} -d http -d fetch-event -o {{name}}.wasm >&2
echo "built $(pwd)/{{name}}.wasm" >&2
