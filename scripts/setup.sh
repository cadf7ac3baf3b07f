#!/usr/bin/env bash
# Installs what building, testing and the demo need, skipping whatever is
# already there: the wasm32-wasip2 Rust target (plugins are built for it),
# protoc (Debian protobuf-compiler; the etcd client compiles etcd's protobuf
# files), cargo-nextest (the test runner), etcd (Debian etcd-server; the
# config-center tests start one) and tansu (the Kafka broker the integration
# tests start). Safe to run again and again. With `--demo`, only what the
# demo needs (the wasm32-wasip2 target and protoc).
set -euo pipefail

demo_only=false
[[ "${1:-}" == "--demo" ]] && demo_only=true

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

if ! command -v cargo >/dev/null 2>&1; then
  echo "error: cargo is not installed; install Rust 1.95 or newer with rustup first" >&2
  exit 1
fi

if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2; then
  say "adding the wasm32-wasip2 Rust target (plugins are built for it)"
  rustup target add wasm32-wasip2
fi

# Debian packages, installed only when missing (apt-get update once, first).
apt_updated=false
apt_install() {
  local missing=()
  for package in "$@"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed' \
      || missing+=("$package")
  done
  ((${#missing[@]} == 0)) && return 0
  local sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    if ! command -v sudo >/dev/null 2>&1; then
      echo "error: installing ${missing[*]} needs root; run: apt-get install ${missing[*]}" >&2
      exit 1
    fi
    sudo=(sudo)
  fi
  say "installing Debian packages: ${missing[*]}"
  if ! $apt_updated; then
    "${sudo[@]}" apt-get update -qq
    apt_updated=true
  fi
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

if ! command -v protoc >/dev/null 2>&1; then
  apt_install protobuf-compiler
fi

if $demo_only; then
  exit 0
fi

if ! command -v etcd >/dev/null 2>&1; then
  apt_install etcd-server
fi

if ! cargo nextest --version >/dev/null 2>&1; then
  say "installing cargo-nextest (the test runner)"
  cargo install cargo-nextest --locked
fi

# tansu: the Kafka-compatible broker the integration tests start (in memory,
# one per test). A long build (10-30 minutes) the first time only.
if ! tansu --version 2>/dev/null | grep -qx 'tansu 0\.6\.0' \
  && ! "${CARGO_HOME:-$HOME/.cargo}/bin/tansu" --version 2>/dev/null | grep -qx 'tansu 0\.6\.0'; then
  say "installing tansu 0.6.0 (the Kafka broker of the integration tests; a long build)"
  cargo install tansu --version 0.6.0 --features dynostore --locked
fi
