#!/usr/bin/env bash
# Fuzzes the parsers of input from outside for a fixed number of runs each;
# exits non-zero on a crash (the reproducer is left in
# PROJECT/fuzz/artifacts/TARGET/).
#
#   scripts/fuzz.sh [RUNS] [TARGET...]   RUNS defaults to 200000; all targets
#   scripts/fuzz.sh 100000 config_text center_value
#
# The targets, by project:
#   protocol/fuzz: decode_frames, decode_then_encode (the frame codec),
#                  check_message (a forwarded message passed on undecoded)
#   host/fuzz:     config_text (the config loader: TOML, interpolation,
#                  validation), center_value (`kafka.<id>` values),
#                  heartbeat_record and route_records (records read from
#                  the cluster's topics, signed or not), message_line (the
#                  `plugin test` input lines); their checks are in
#                  host/src/fuzzing.rs.
#
# The frame decoder's targets are built by cargo fuzz (installed if
# missing), which passes nightly-only flags (-Zsanitizer=address, ...);
# RUSTC_BOOTSTRAP=1 makes the stable toolchain accept them, so no nightly
# toolchain is needed. FUZZ_SANITIZER=none builds them without
# AddressSanitizer.
#
# The host's targets (host/fuzz, a member of the root workspace) are built
# by cargo itself into the root target directory, with
# scripts/fuzz-rustc.sh as RUSTC_WORKSPACE_WRAPPER: only the workspace's own
# crates get libFuzzer's coverage instrumentation, the dependencies are
# those `cargo build -p wasmrelay` builds (wasmtime and librdkafka are not
# built again for fuzzing), and there is no sanitizer (the host forbids
# unsafe code). Not through RUSTC_BOOTSTRAP: it would make proc-macro2 and
# everything after it build again.
#
# Corpus: libFuzzer grows PROJECT/fuzz/corpus/TARGET/ (git-ignored); the
# committed seeds in PROJECT/fuzz/seeds/TARGET/ are read as a second,
# read-only corpus; a crash's reproducer goes to
# PROJECT/fuzz/artifacts/TARGET/.
set -euo pipefail

runs="${1:-200000}"
(($#)) && shift
case "$runs" in
  '' | *[!0-9]*) echo "usage: $0 [RUNS] [TARGET...]  (RUNS: a number of runs, not '$runs')" >&2; exit 2 ;;
esac
sanitizer="${FUZZ_SANITIZER:-address}"

protocol_targets=(decode_frames decode_then_encode check_message)
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

needs_cargo_fuzz=false
for target in "${targets[@]}"; do
  [[ "$(project_of "$target")" == protocol ]] && needs_cargo_fuzz=true
done
if $needs_cargo_fuzz && ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz.sh: installing cargo-fuzz" >&2
  cargo install cargo-fuzz --locked
fi

# Builds a project's targets once; prints nothing.
built=""
build() {
  [[ " $built " == *" $1 "* ]] && return
  local build_started=$SECONDS
  case "$1" in
    protocol)
      (cd "$root/protocol" && RUSTC_BOOTSTRAP=1 cargo fuzz build --sanitizer "$sanitizer" --debug-assertions)
      # Its tests: the committed seeds are what they say they are.
      (cd "$root/protocol/fuzz" && cargo test --locked --quiet) ;;
    host)
      (cd "$root" && RUSTC_WORKSPACE_WRAPPER="$root/scripts/fuzz-rustc.sh" \
        cargo build --locked -p wasmrelay-host-fuzz --bins) ;;
  esac
  echo "fuzz.sh: building $1/fuzz took $((SECONDS - build_started)) s" >&2
  built="$built $1"
}

target_dir="$(cd "$root" && cargo metadata --format-version 1 --no-deps --locked |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"

for target in "${targets[@]}"; do
  project="$(project_of "$target")"
  build "$project"
  fuzz_dir="$root/$project/fuzz"
  corpus="$fuzz_dir/corpus/$target"
  artifacts="$fuzz_dir/artifacts/$target"
  mkdir -p "$corpus" "$artifacts"
  run_started=$SECONDS
  libfuzzer_options=(-runs="$runs" -max_len=70000 -artifact_prefix="$artifacts/")
  case "$project" in
    protocol)
      (cd "$root/protocol" && RUSTC_BOOTSTRAP=1 cargo fuzz run --sanitizer "$sanitizer" --debug-assertions \
        "$target" "$corpus" "$fuzz_dir/seeds/$target" -- "${libfuzzer_options[@]}") ;;
    host)
      "$target_dir/debug/$target" "${libfuzzer_options[@]}" "$corpus" "$fuzz_dir/seeds/$target" ;;
  esac
  echo "fuzz.sh: $target, $runs runs took $((SECONDS - run_started)) s" >&2
done
