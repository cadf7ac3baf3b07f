#!/usr/bin/env bash
# build-one.sh WORLD SRC_DIR OUT: builds SRC_DIR/<dir name>.js for WORLD of
# wit/plugin.wit into the component OUT with componentize-js. The WASI
# `http` and `fetch-event` features are left out: the relay links no HTTP.
set -euo pipefail
world="$1" src="$2" out="$3"
source "$(dirname "${BASH_SOURCE[0]}")/../toolchain.sh"
need componentize-js
componentize-js "$src/$(basename "$src").js" --wit "$WIT_DIR" --world-name "$world" \
  -d http -d fetch-event -o "$out" >&2
