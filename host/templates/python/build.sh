#!/usr/bin/env bash
# Builds {{name}}.wasm (a WebAssembly component) from app.py with
# componentize-py (PyPI componentize-py).
#
# componentize-py is looked up on PATH, then in $WASMRELAY_TOOLS/bin
# (default ~/.local/share/wasmrelay/tools/bin, where the wasmrelay
# repository's scripts/setup.sh installs it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PATH="$PATH:${WASMRELAY_TOOLS:-$HOME/.local/share/wasmrelay/tools}/bin"
if ! command -v componentize-py >/dev/null 2>&1; then
  echo "build.sh: componentize-py not found; install it with: pip install componentize-py==0.25.1" >&2
  exit 1
fi
componentize-py -d wit -w {{world}} componentize app -o {{name}}.wasm >&2
echo "built $(pwd)/{{name}}.wasm" >&2
