#!/usr/bin/env bash
# Builds the example plugins in JavaScript, Python and C into
# dist/<lang>-<name>.wasm (e.g. dist/js-json-enrich.wasm), each only when its
# sources, the WIT contract or a build script are newer than the component.
#
#   plugins/polyglot/build.sh            # all of them
#   plugins/polyglot/build.sh js/fault   # just these
#
# Prints the absolute path of dist/ on stdout when done. The tools come from
# scripts/plugin-toolchains.sh (toolchain.sh says where). Runs are
# serialised with flock(1), and each component is written atomically, so
# tests may call it from several processes at once.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dist="$here/dist"
mkdir -p "$dist"

# Each example: "<lang>/<name> <world>".
examples=(
  "c/json-enrich processor"
  "js/json-enrich processor"
  "js/route-by-field router"
  "js/fault processor"
  "python/json-enrich processor"
)

if command -v flock >/dev/null 2>&1; then
  exec 9>"$dist/.build.lock"
  flock 9
fi

wanted=("$@")
for example in "${examples[@]}"; do
  read -r path world <<<"$example"
  if ((${#wanted[@]} > 0)) && [[ " ${wanted[*]} " != *" $path "* ]]; then
    continue
  fi
  lang="${path%%/*}"
  out="$dist/${path//\//-}.wasm"
  newest="$(find "$here/$path" "$here/$lang/build-one.sh" "$here/toolchain.sh" \
    "$here/../../wit/plugin.wit" -type f -newer "$out" -print -quit 2>/dev/null || true)"
  if [[ -f "$out" && -z "$newest" ]]; then
    continue
  fi
  echo "build.sh: building $path ($world)" >&2
  "$here/$lang/build-one.sh" "$world" "$here/$path" "$out.tmp"
  mv -f "$out.tmp" "$out"
done
echo "$dist"
