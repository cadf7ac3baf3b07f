# Sourced by the build scripts of plugins/polyglot: where the pinned tools are
# (scripts/plugin-toolchains.sh installs them), and a clear error when one is
# missing. Tools are looked up on PATH after $WASMRELAY_TOOLS/bin.

WASMRELAY_TOOLS="${WASMRELAY_TOOLS:-$HOME/.local/share/wasmrelay/tools}"
PATH="$WASMRELAY_TOOLS/bin:$PATH"
WIT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../wit" && pwd)"

# `need TOOL`: fails naming TOOL and how to get it when it is not found.
need() {
  if ! command -v "$1" >/dev/null 2>&1; then
    echo "error: $1 not found in $WASMRELAY_TOOLS/bin or on PATH: run scripts/setup.sh (or scripts/plugin-toolchains.sh)" >&2
    exit 1
  fi
}

# The WASI preview1 reactor adapter: $WASI_ADAPTER, else the installed one.
wasi_adapter() {
  local adapter="${WASI_ADAPTER:-$WASMRELAY_TOOLS/share/wasi_snapshot_preview1.reactor.wasm}"
  if [[ ! -s "$adapter" ]]; then
    echo "error: the WASI preview1 adapter $adapter is missing: run scripts/plugin-toolchains.sh" >&2
    exit 1
  fi
  echo "$adapter"
}
