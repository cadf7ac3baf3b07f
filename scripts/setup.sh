#!/usr/bin/env bash
# Installs what building, testing and the demo need, skipping whatever is
# already there: the wasm32-wasip2 Rust target (plugins are built for it) and
# cargo-nextest (the test runner). Safe to run again and again.
set -euo pipefail

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

if ! command -v cargo >/dev/null 2>&1; then
  echo "error: cargo is not installed; install Rust 1.95 or newer with rustup first" >&2
  exit 1
fi

if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2; then
  say "adding the wasm32-wasip2 Rust target (plugins are built for it)"
  rustup target add wasm32-wasip2
fi

if ! cargo nextest --version >/dev/null 2>&1; then
  say "installing cargo-nextest (the test runner)"
  cargo install cargo-nextest --locked
fi
