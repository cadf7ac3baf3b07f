#!/usr/bin/env bash
# Fuzzes the parsers of input from outside for a fixed number of runs each;
# exits non-zero on a crash (the reproducer is left in
# PROJECT/fuzz/artifacts/TARGET/).
#
#   scripts/fuzz.sh [RUNS] [TARGET...]   RUNS defaults to 200000; all targets
#   scripts/fuzz.sh 100000 config_text center_value
#
# The targets, by project:
#   protocol/fuzz: decode_frames, decode_then_encode (the frame codec)
#   host/fuzz:     config_text (the config loader: TOML, interpolation,
#                  validation), center_value (`kafka.<id>` values),
#                  heartbeat_record and route_records (records read from
#                  the cluster's topics, signed or not), message_line (the
#                  `plugin test` input lines); their checks are in
#                  host/src/fuzzing.rs.
#
# Installs cargo-fuzz if it is missing. cargo fuzz passes nightly-only flags
# (-Zsanitizer=address, ...); RUSTC_BOOTSTRAP=1 makes the stable toolchain
# accept them, so no nightly toolchain is needed. FUZZ_SANITIZER=none builds
# without AddressSanitizer (faster; the targets are safe Rust anyway). The
# host targets are built without optimisations (`--dev`): the host's
# dependencies (wasmtime, librdkafka) take several times as long to build
# optimised, and these parsers are fast either way.
#
# Build output goes to PROJECT/fuzz/target/, the corpus libFuzzer grows to
# PROJECT/fuzz/corpus/TARGET/ (both git-ignored); the committed seeds in
# PROJECT/fuzz/seeds/TARGET/ are read as a second, read-only corpus.
set -euo pipefail

runs="${1:-200000}"
(($#)) && shift
case "$runs" in
  '' | *[!0-9]*) echo "usage: $0 [RUNS] [TARGET...]  (RUNS: a number of runs, not '$runs')" >&2; exit 2 ;;
esac
sanitizer="${FUZZ_SANITIZER:-address}"

protocol_targets=(decode_frames decode_then_encode)
host_targets=(config_text center_value heartbeat_record route_records message_line)
targets=("$@")
# FUZZ_TARGET names one target, as before the host targets existed.
[[ ${#targets[@]} -eq 0 && -n "${FUZZ_TARGET:-}" ]] && targets=("$FUZZ_TARGET")
[[ ${#targets[@]} -eq 0 ]] && targets=("${protocol_targets[@]}" "${host_targets[@]}")

project_of() {
  local t
  for t in "${protocol_targets[@]}"; do [[ "$t" == "$1" ]] && { echo protocol; return; }; done
  for t in "${host_targets[@]}"; do [[ "$t" == "$1" ]] && { echo host; return; }; done
  echo "fuzz.sh: no target '$1'; the targets: ${protocol_targets[*]} ${host_targets[*]}" >&2
  exit 2
}
for target in "${targets[@]}"; do project_of "$target" >/dev/null; done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
started=$SECONDS
report() {
  local status=$?
  echo "fuzz.sh: ${targets[*]}, $runs runs each: exit $status after $((SECONDS - started)) s in all" >&2
}
trap report EXIT

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz.sh: installing cargo-fuzz" >&2
  cargo install cargo-fuzz --locked
fi
export RUSTC_BOOTSTRAP=1

# The same options for build and run, so that `run` does not build again.
options_of() {
  case "$1" in
    protocol) echo "--sanitizer $sanitizer --debug-assertions" ;;
    host) echo "--sanitizer $sanitizer --dev" ;;
  esac
}

built=""
for target in "${targets[@]}"; do
  project="$(project_of "$target")"
  read -r -a options <<<"$(options_of "$project")"
  cd "$root/$project"
  if [[ " $built " != *" $project "* ]]; then
    build_started=$SECONDS
    cargo fuzz build "${options[@]}"
    echo "fuzz.sh: building $project/fuzz took $((SECONDS - build_started)) s" >&2
    built="$built $project"
  fi
  corpus="fuzz/corpus/$target"
  mkdir -p "$corpus"
  run_started=$SECONDS
  cargo fuzz run "${options[@]}" "$target" "$corpus" "fuzz/seeds/$target" -- \
    -runs="$runs" -max_len=70000
  echo "fuzz.sh: $target, $runs runs took $((SECONDS - run_started)) s" >&2
done
