#!/usr/bin/env bash
# Installs what building, testing and the demo need, skipping whatever is
# already there, then checks that each piece works:
#
#   - the wasm32-wasip2 Rust target (plugins are built for it);
#   - a C and C++ toolchain: `cc` that compiles and links a C program (Debian
#     gcc, libc6-dev; Rust links through it), `c++` (Debian g++; the rdkafka
#     crate builds librdkafka from source and its configure script fails
#     without a C++ compiler) and make (librdkafka's build runs `make libs`);
#   - the OpenSSL and Cyrus SASL development files and pkg-config (Debian
#     libssl-dev, libsasl2-dev, pkg-config): librdkafka is built with TLS,
#     SASL (PLAIN, SCRAM, GSSAPI) so the relay can reach a secured Kafka;
#   - protoc with the protobuf well-known types (Debian protobuf-compiler and
#     libprotobuf-dev; the etcd client compiles etcd's protobuf files, which
#     import google/protobuf/descriptor.proto);
#
# and, for the tests (not with `--demo`):
#
#   - etcd (Debian etcd-server; the config-center tests start one);
#   - python3 (the sidecar example app) and kill (Debian procps);
#   - cargo-nextest (the test runner) and tansu 0.6.0 with the dynostore and
#     libsql features (the Kafka broker the integration tests start, SQLite
#     storage for its SASL users; a long build the first time);
#   - the toolchains of plugins in other languages: clang, wasm-ld, wasi-libc
#     and the wasm32 compiler-rt (Debian clang, lld, wasi-libc,
#     libclang-rt-14-dev-wasm32) here, then scripts/plugin-toolchains.sh for
#     componentize-js (npm), componentize-py (PyPI), wit-bindgen and
#     wasm-tools (crates.io) and the WASI preview1 adapter, pinned, under
#     $WASMRELAY_TOOLS (default ~/.local/share/wasmrelay/tools).
#
# Debian packages are installed with apt-get (through sudo when not root;
# apt-get update runs once, and only when something is missing). Safe to run
# again and again. With `--demo`, only what the demo needs.
set -euo pipefail

demo_only=false
[[ "${1:-}" == "--demo" ]] && demo_only=true

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
fail() { printf 'error: %s\n' "$*" >&2; exit 1; }

if ! command -v cargo >/dev/null 2>&1; then
  fail "cargo is not installed; install Rust 1.95 or newer with rustup first"
fi

if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2; then
  say "adding the wasm32-wasip2 Rust target (plugins are built for it)"
  rustup target add wasm32-wasip2
fi

scratch="$(mktemp -d "${TMPDIR:-/tmp}/wasmrelay-setup.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT

# --- checks: each one proves a piece works, quietly; the last failure's
# output is kept in $scratch/why for the error message.

c_compiler_works() {
  printf '#include <stdio.h>\nint main(void) { puts("ok"); return 0; }\n' >"$scratch/check.c"
  cc "$scratch/check.c" -o "$scratch/check-c" >"$scratch/why" 2>&1 \
    && "$scratch/check-c" >/dev/null 2>>"$scratch/why"
}

cxx_compiler_works() {
  printf '#include <vector>\nint main() { std::vector<int> v{1}; return v[0] - 1; }\n' >"$scratch/check.cc"
  c++ "$scratch/check.cc" -o "$scratch/check-cc" >"$scratch/why" 2>&1 \
    && "$scratch/check-cc" 2>>"$scratch/why"
}

# librdkafka's configure finds OpenSSL with pkg-config; the sasl2-sys crate
# links the system's libsasl2.
tls_sasl_libraries_work() {
  printf '#include <openssl/ssl.h>\n#include <sasl/sasl.h>\nint main(void) { return OPENSSL_init_ssl(0, NULL) == 1 && sasl_client_init(NULL) == SASL_OK ? 0 : 1; }\n' >"$scratch/check-tls.c"
  { pkg-config --exists openssl libsasl2 || { echo "pkg-config does not find openssl and libsasl2"; false; }; } >"$scratch/why" 2>&1 \
    && cc "$scratch/check-tls.c" -o "$scratch/check-tls" -lssl -lcrypto -lsasl2 >>"$scratch/why" 2>&1 \
    && "$scratch/check-tls" >>"$scratch/why" 2>&1
}

make_works() { command -v make >/dev/null 2>&1 || { echo "make: not found" >"$scratch/why"; return 1; }; }

# prost-build (the etcd client's build script) runs $PROTOC or `protoc` with
# include paths of its own only; protoc finds the well-known types next to
# itself (../include), which Debian's libprotobuf-dev provides.
protoc_works() {
  mkdir -p "$scratch/proto"
  cat >"$scratch/proto/check.proto" <<'EOF'
syntax = "proto3";
package wasmrelay.setup;
import "google/protobuf/descriptor.proto";
message Check { google.protobuf.FileDescriptorProto file = 1; }
EOF
  local protoc="${PROTOC:-protoc}"
  echo "$protoc -I DIR DIR/check.proto (a file importing google/protobuf/descriptor.proto):" >"$scratch/why"
  "$protoc" -I "$scratch/proto" --descriptor_set_out="$scratch/proto/check.pb" \
    "$scratch/proto/check.proto" >>"$scratch/why" 2>&1
}

etcd_works() { etcd --version >"$scratch/why" 2>&1; }

# C plugins: clang compiles for wasm32-wasi against Debian's wasi-libc and
# links with wasm-ld (lld); the compiler-rt builtins come from the wasm32
# compiler-rt package.
wasm_c_works() {
  printf '#include <stdio.h>\n#include <stdlib.h>\nint f(int n) { char b[32]; double *d = malloc(8); *d = n; snprintf(b, 32, "%%g", *d * 1.5); free(d); return b[0]; }\n' >"$scratch/check-wasm.c"
  clang --target=wasm32-wasi -O2 -mexec-model=reactor "$scratch/check-wasm.c" \
    -o "$scratch/check-wasm.wasm" >"$scratch/why" 2>&1
}

# JavaScript and Python plugins: their build tools come from npm and PyPI.
npm_works() { npm --version >"$scratch/why" 2>&1; }
python3_venv_works() { python3 -m venv --help >"$scratch/why" 2>&1; }

python3_works() { python3 -c 'import http.server, json, argparse' >"$scratch/why" 2>&1; }

# The tests run the kill program (not the shell's builtin).
kill_works() { type -P kill >/dev/null 2>&1 || { echo "kill: not found" >"$scratch/why"; return 1; }; }

# Each requirement: "check-function|what it is for|Debian packages".
requirements=(
  "c_compiler_works|a C compiler and linker (cc): Rust links through it|gcc libc6-dev"
  "cxx_compiler_works|a C++ compiler (c++): the rdkafka crate builds librdkafka, whose configure script fails without one|g++"
  "make_works|make: the rdkafka crate builds librdkafka with make|make"
  "tls_sasl_libraries_work|OpenSSL and Cyrus SASL with their headers, found by pkg-config: librdkafka is built with TLS and SASL|libssl-dev libsasl2-dev pkg-config"
  "protoc_works|protoc with the protobuf well-known types (google/protobuf/descriptor.proto, which etcd's protobuf files import): protobuf-compiler alone, installed without recommends, lacks them; libprotobuf-dev provides them|protobuf-compiler libprotobuf-dev"
)
if ! $demo_only; then
  requirements+=(
    "etcd_works|etcd: the config-center tests start one|etcd-server"
    "python3_works|python3 with its standard library: a test runs the sidecar example app|python3"
    "kill_works|the kill program: tests send signals to the relay with it|procps"
    "wasm_c_works|clang for wasm32-wasi with wasi-libc and wasm-ld: C plugins are built with them|clang lld wasi-libc libclang-rt-14-dev-wasm32"
    "npm_works|npm: componentize-js (JavaScript plugins) is installed with it|npm"
    "python3_venv_works|python3 with venv: componentize-py (Python plugins) is installed in a venv|python3-venv"
  )
fi

# --- Debian packages, installed only when missing (apt-get update once).
apt_install() {
  local missing=() package
  for package in "$@"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed' \
      || missing+=("$package")
  done
  ((${#missing[@]} == 0)) && return 0
  if ! command -v apt-get >/dev/null 2>&1; then
    fail "apt-get not found: install the equivalent of the Debian packages ${missing[*]} and run again"
  fi
  local sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    if ! command -v sudo >/dev/null 2>&1; then
      fail "installing ${missing[*]} needs root; run: apt-get update && apt-get install --no-install-recommends ${missing[*]}"
    fi
    sudo=(sudo)
  fi
  say "installing Debian packages: ${missing[*]}"
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

failing=()
packages=()
for requirement in "${requirements[@]}"; do
  IFS='|' read -r check _ debs <<<"$requirement"
  if ! "$check"; then
    failing+=("$requirement")
    read -ra more <<<"$debs"
    packages+=("${more[@]}")
  fi
done
if ((${#packages[@]} > 0)); then
  apt_install "${packages[@]}"
fi
broken=0
for requirement in "${failing[@]}"; do
  IFS='|' read -r check what debs <<<"$requirement"
  if ! "$check"; then
    printf 'error: setup check failed: %s.\n  It needs the Debian packages: %s\n' "$what" "$debs" >&2
    read -ra more <<<"$debs"
    for package in "${more[@]}"; do
      dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed' \
        || printf '  not installed: %s\n' "$package" >&2
    done
    printf '  What failed:\n' >&2
    sed 's/^/    /' "$scratch/why" >&2
    broken=1
  fi
done
((broken == 0)) || exit 1

if $demo_only; then
  exit 0
fi

if ! cargo nextest --version >/dev/null 2>&1; then
  say "installing cargo-nextest (the test runner)"
  cargo install cargo-nextest --locked
fi

# tansu: the Kafka-compatible broker the integration tests start (in memory,
# one per test; SQLite storage, the libsql feature, for brokers with SASL
# users). A long build (15-30 minutes) the first time only; a tansu 0.6.0
# without SQLite support (an older set-up) is rebuilt.
tansu_ok() {
  local binary
  binary="$(command -v tansu 2>/dev/null || echo "${CARGO_HOME:-$HOME/.cargo}/bin/tansu")"
  "$binary" --version 2>/dev/null | grep -qx 'tansu 0\.6\.0' && grep -q libsql_ "$binary"
}
if ! tansu_ok; then
  say "installing tansu 0.6.0 with SQLite storage (the Kafka broker of the integration tests; a long build)"
  cargo install tansu --version 0.6.0 --features dynostore,libsql --locked
fi

# Toolchains of plugins in JavaScript, Python and C (pinned; skips what is there).
"$(dirname "${BASH_SOURCE[0]}")/plugin-toolchains.sh"
