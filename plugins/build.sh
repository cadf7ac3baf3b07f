#!/usr/bin/env bash
# Builds every plugin of this workspace as a WebAssembly component
# (wasm32-wasip2, release) and copies each one to dist/<crate-name>.wasm,
# e.g. target/wasm32-wasip2/release/json_enrich.wasm -> dist/json-enrich.wasm.
#
# Honours CARGO_TARGET_DIR (default: plugins/target). Prints the absolute path
# of the dist directory on stdout when done (cargo's output goes to stderr).
#
# Safe to run from several processes at once: cargo locks its own build, each
# copy is atomic (temp file in dist/ + rename) and a file is only replaced
# when its content changed, so a relay watching dist/ sees no churn. When
# flock(1) is available, concurrent runs are also serialised as a whole.
set -euo pipefail

plugins_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dist_dir="$plugins_dir/dist"
target=wasm32-wasip2

# Resolve CARGO_TARGET_DIR before changing directory (it may be relative to
# the caller's working directory).
target_dir="${CARGO_TARGET_DIR:-$plugins_dir/target}"
case "$target_dir" in
    /*) ;;
    *) target_dir="$PWD/$target_dir" ;;
esac
export CARGO_TARGET_DIR="$target_dir"

if command -v rustup >/dev/null 2>&1; then
    installed="$(rustup target list --installed)"
    if ! grep -qx "$target" <<<"$installed"; then
        rustup target add "$target" >&2
    fi
fi

mkdir -p "$target_dir" "$dist_dir"

# Serialise whole runs (build + copies) when flock(1) exists; cargo's lock
# and the atomic copies make this belt and braces.
if command -v flock >/dev/null 2>&1; then
    exec 9>"$target_dir/.wasmrelay-plugins-build.lock"
    flock 9
fi

cd "$plugins_dir"
cargo build --release --target "$target" >&2

out_dir="$target_dir/$target/release"
tmp=""
cleanup() {
    if [[ -n "$tmp" ]]; then rm -f "$tmp"; fi
}
trap cleanup EXIT

count=0
for manifest in "$plugins_dir"/*/Cargo.toml; do
    grep -q 'crate-type *= *\[ *"cdylib" *\]' "$manifest" || continue
    name="$(sed -n 's/^name *= *"\([^"]*\)".*/\1/p' "$manifest" | head -n 1)"
    src="$out_dir/${name//-/_}.wasm"
    dest="$dist_dir/$name.wasm"
    if [[ ! -f "$src" ]]; then
        echo "build.sh: $src was not built" >&2
        exit 1
    fi
    if ! cmp -s "$src" "$dest"; then
        tmp="$(mktemp "$dist_dir/.$name.wasm.XXXXXX")"
        cp "$src" "$tmp"
        chmod 0644 "$tmp"
        mv -f "$tmp" "$dest"
        tmp=""
        echo "build.sh: updated dist/$name.wasm" >&2
    fi
    count=$((count + 1))
done

if [[ "$count" -eq 0 ]]; then
    echo "build.sh: no plugin found" >&2
    exit 1
fi

echo "$dist_dir"
