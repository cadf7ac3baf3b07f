#!/usr/bin/env bash
# build-one.sh WORLD SRC_DIR OUT: builds SRC_DIR/app.py for WORLD of
# wit/plugin.wit into the component OUT with componentize-py.
set -euo pipefail
world="$1" src="$2" out="$3"
source "$(dirname "${BASH_SOURCE[0]}")/../toolchain.sh"
need componentize-py
# componentize-py writes __pycache__ next to the sources: keep the tree clean.
PYTHONDONTWRITEBYTECODE=1 componentize-py -d "$WIT_DIR" -w "$world" componentize \
  -p "$src" app -o "$out" >&2
