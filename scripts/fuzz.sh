#!/usr/bin/env bash
# Fuzzes the frame decoder for a fixed number of runs; exits non-zero on a
# crash (the reproducer is left in protocol/fuzz/artifacts/TARGET/).
#
#   scripts/fuzz.sh [RUNS]          RUNS defaults to 200000
#   FUZZ_TARGET=decode_then_encode scripts/fuzz.sh 100000
#
# Installs cargo-fuzz if it is missing. cargo fuzz passes nightly-only flags
# (-Zsanitizer=address, ...); RUSTC_BOOTSTRAP=1 makes the stable toolchain
# accept them, so no nightly toolchain is needed. FUZZ_SANITIZER=none builds
# without AddressSanitizer (faster; the target is safe Rust anyway).
#
# Build output goes to protocol/fuzz/target/, the corpus libFuzzer grows to
# protocol/fuzz/corpus/TARGET/ (both git-ignored); the committed seeds in
# protocol/fuzz/seeds/TARGET/ are read as a second, read-only corpus.
set -euo pipefail

runs="${1:-200000}"
target="${FUZZ_TARGET:-decode_frames}"
sanitizer="${FUZZ_SANITIZER:-address}"
case "$runs" in
  '' | *[!0-9]*) echo "usage: $0 [RUNS]  (RUNS: a number of runs, not '$runs')" >&2; exit 2 ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
started=$SECONDS
report() {
  local status=$?
  echo "fuzz.sh: $target, $runs runs: exit $status after $((SECONDS - started)) s in all" >&2
}
trap report EXIT

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz.sh: installing cargo-fuzz" >&2
  cargo install cargo-fuzz --locked
fi

export RUSTC_BOOTSTRAP=1
cd "$root/protocol"
# The same options for build and run, so `run` does not build again.
options=(--sanitizer "$sanitizer" --debug-assertions)
corpus="fuzz/corpus/$target"
mkdir -p "$corpus"

build_started=$SECONDS
cargo fuzz build "${options[@]}" "$target"
echo "fuzz.sh: build took $((SECONDS - build_started)) s" >&2

run_started=$SECONDS
cargo fuzz run "${options[@]}" "$target" "$corpus" "fuzz/seeds/$target" -- \
  -runs="$runs" -max_len=70000
echo "fuzz.sh: $runs runs took $((SECONDS - run_started)) s" >&2
