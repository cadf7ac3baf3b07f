#!/usr/bin/env bash
# Checks the README's "Set up" on a fresh machine: builds a bare Debian root
# (debootstrap --variant=minbase), gives it the Rust toolchain of this machine
# (read-only) and a clean clone of this repository's committed HEAD, and runs
# the README's two commands in it with chroot, as root:
#
#   scripts/demo.sh    then    scripts/test.sh
#
# timing each step. Ends with a summary (passed/failed and how long each step
# took) and exits non-zero if anything failed. For developers and releases,
# not CI: it is long (tansu, wasmrelay and the suite all build from scratch).
# Run it at a low priority beside other work: `nice -n 10 scripts/fresh-check.sh`.
#
# Usage: scripts/fresh-check.sh [options]   (as root)
#   --workdir DIR    where the root and the logs go
#                    (default /var/tmp/wasmrelay-fresh-check)
#   --ref REF        the commit, branch or tag to check (default HEAD)
#   --keep           keep the root afterwards (for a re-run with --reuse)
#   --reuse          re-use the root left by --keep: skip debootstrap and keep
#                    what was installed and built in it (not a fresh check!)
#   --fail-fast      skip test.sh when demo.sh failed
#   --mirror URL     the Debian mirror (default: the first one in this
#                    machine's apt sources that serves the suite)
#   --suite NAME     the Debian suite (default bookworm)
#   --env NAME[=VALUE]  pass a variable into the root (repeatable); FUZZ_RUNS,
#                    FUZZ_SANITIZER, FUZZ_TARGET, CARGO_BUILD_JOBS,
#                    NEXTEST_TEST_THREADS and the proxy variables pass
#                    through when set
#
# What the root gets from this machine: the CA bundle and any local CA
# certificates (so cargo and apt trust the same CAs), /etc/resolv.conf, an
# /etc/hosts naming localhost (as an installed Debian has; debootstrap writes none),
# /proc, /dev, /dev/pts, /sys, RUSTUP_HOME (through an overlay: what rustup
# adds in the root stays in the work directory) and the rustup proxies
# (cargo, rustc, ...). It has its own CARGO_HOME (/root/.cargo, first on
# PATH), so cargo-nextest, tansu and cargo-fuzz are installed inside it, as on
# a fresh machine. Mounts are undone on exit, even on failure.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit "${1:-2}"; }
say() { printf '\n\033[1m==> fresh-check: %s\033[0m\n' "$*" >&2; }
fail() { printf 'fresh-check: error: %s\n' "$*" >&2; exit 1; }

workdir=/var/tmp/wasmrelay-fresh-check
ref=HEAD
keep=false
reuse=false
fail_fast=false
mirror=""
suite=bookworm
pass_env=()
while (($# > 0)); do
  case "$1" in
    --workdir) workdir="${2:?--workdir needs a directory}"; shift 2 ;;
    --ref) ref="${2:?--ref needs a commit}"; shift 2 ;;
    --keep) keep=true; shift ;;
    --reuse) reuse=true; shift ;;
    --fail-fast) fail_fast=true; shift ;;
    --mirror) mirror="${2:?--mirror needs a URL}"; shift 2 ;;
    --suite) suite="${2:?--suite needs a name}"; shift 2 ;;
    --env)
      [[ -n "${2:-}" ]] || fail "--env needs NAME or NAME=VALUE"
      if [[ "$2" == *=* ]]; then pass_env+=("$2"); else pass_env+=("$2=${!2-}"); fi
      shift 2 ;;
    -h | --help) usage 0 ;;
    *) echo "fresh-check: unknown option: $1" >&2; usage ;;
  esac
done
for name in FUZZ_RUNS FUZZ_SANITIZER FUZZ_TARGET CARGO_BUILD_JOBS NEXTEST_TEST_THREADS \
  http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
  if [[ -n "${!name:-}" ]]; then pass_env+=("$name=${!name}"); fi
done

[[ $(id -u) -eq 0 ]] || fail "run as root (debootstrap, mount and chroot need it): sudo $0 $*"

repo="$(git -C "$(dirname "${BASH_SOURCE[0]}")" rev-parse --show-toplevel)"
sha="$(git -C "$repo" rev-parse --verify "$ref^{commit}")" || fail "no such commit: $ref"
mkdir -p "$workdir"
workdir="$(cd "$workdir" && pwd)"
root="$workdir/root"
logs="$workdir/logs"
mkdir -p "$logs"

# --- the summary, printed on every exit.
steps=()
overall=0
record() { # record STEP STATUS SECONDS [NOTE]
  steps+=("$(printf '  %-12s %-7s %6d s  (%dm%02ds)  %s' "$1" "$2" "$3" $(($3 / 60)) $(($3 % 60)) "${4:-}")")
  [[ "$2" == passed || "$2" == skipped ]] || overall=1
}

# --- mounts, undone on exit (in reverse order).
mounts=()
mount_into() { # mount_into TARGET MOUNT-ARGS...
  local target="$1"; shift
  mount "$@" "$target"
  mounts+=("$target")
}
bind_ro() { # bind_ro SOURCE TARGET
  mount_into "$2" --bind "$1"
  mount -o remount,bind,ro "$2"
}
mounted_under() { awk -v r="$root" '$5 == r || index($5, r "/") == 1 { print $5 }' /proc/self/mountinfo; }
stop_root_processes() { # what the steps left running in the root (brokers, etcd)
  local signal pid found
  for signal in TERM KILL; do
    found=false
    for pid in /proc/[0-9]*; do
      if [[ "$(readlink "$pid/root" 2>/dev/null)" == "$root" ]]; then
        kill "-$signal" "${pid#/proc/}" 2>/dev/null || true
        found=true
      fi
    done
    $found || return 0
    sleep 2
  done
}
cleanup() {
  local status=$? i
  trap - EXIT INT TERM
  if ((${#mounts[@]} > 0)); then
    stop_root_processes
    for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
      umount "${mounts[i]}" 2>/dev/null || umount -l "${mounts[i]}" || true
    done
  fi
  local left
  left="$(mounted_under || true)"
  if [[ -n "$left" ]]; then
    printf 'fresh-check: still mounted under %s (not removing it):\n%s\n' "$root" "$left" >&2
  elif ! $keep && [[ -d "$root" ]]; then
    rm -rf "$root"
  fi
  if ((${#steps[@]} > 0)); then
    printf '\nfresh-check summary: %s (%s), %s, open files limit %s\n' \
      "${sha:0:12}" "$ref" "$suite" "${fd_limit:-?}"
    printf '%s\n' "${steps[@]}"
    printf '  %-12s %-7s %6d s  (%dm%02ds)\n' "in all" "" "$SECONDS" $((SECONDS / 60)) $((SECONDS % 60))
    if ((overall == 0 && status == 0)); then echo "fresh-check: PASSED"; else echo "fresh-check: FAILED"; fi
    echo "logs: $logs$($keep && echo "; root kept: $root")"
  fi
  ((status == 0)) && status=$overall
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- host tools.
if ! command -v debootstrap >/dev/null 2>&1; then
  say "installing debootstrap on this machine"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap
fi

# The mirror: from this machine's apt sources (one-line and deb822 formats).
find_mirror() {
  local file
  for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -f "$file" ]] || continue
    awk -v s="$suite" '$1 == "deb" {
        i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
        if ($(i + 1) == s) { print $i; exit }
      }' "$file"
  done
  for file in /etc/apt/sources.list.d/*.sources; do
    [[ -f "$file" ]] || continue
    awk -v s="$suite" '
      function flush() { if (deb && hit && uris != "") { split(uris, u, " "); print u[1] } deb = hit = 0; uris = "" }
      /^[ \t]*$/ { flush(); next }
      /^#/ { next }
      tolower($1) == "types:" { for (i = 2; i <= NF; i++) if ($i == "deb") deb = 1 }
      tolower($1) == "suites:" { for (i = 2; i <= NF; i++) if ($i == s) hit = 1 }
      tolower($1) == "uris:" { uris = ""; for (i = 2; i <= NF; i++) uris = uris " " $i }
      tolower($1) == "enabled:" && tolower($2) == "no" { deb = 0; hit = -1000 }
      END { flush() }' "$file"
  done
}
if [[ -z "$mirror" ]]; then
  mirror="$(find_mirror | head -n 1)"
  [[ -n "$mirror" ]] || fail "no '$suite' mirror in /etc/apt/sources.list{,.d/}; give one with --mirror URL"
fi

rustup_home="${RUSTUP_HOME:-$HOME/.rustup}"
cargo_bin="${CARGO_HOME:-$HOME/.cargo}/bin"
[[ -x "$cargo_bin/rustup" ]] || fail "no rustup in $cargo_bin (install Rust with rustup first)"
[[ -d "$rustup_home/toolchains" ]] || fail "no rustup toolchains in $rustup_home"

# --- step 1: the bare root.
if [[ -n "$(mounted_under)" ]]; then
  fail "something is mounted under $root (an earlier run still going?): $(mounted_under | tr '\n' ' ')"
fi
if $reuse && [[ -f "$root/.fresh-check-debootstrapped" ]]; then
  say "re-using the root in $root (not a fresh machine: what earlier runs installed is still there)"
  record debootstrap skipped 0 "re-used $root"
else
  rm -rf "$root"
  say "debootstrap --variant=minbase $suite from $mirror into $root"
  started=$SECONDS
  if debootstrap --variant=minbase "$suite" "$root" "$mirror" >"$logs/debootstrap.log" 2>&1; then
    touch "$root/.fresh-check-debootstrapped"
    record debootstrap passed $((SECONDS - started))
  else
    record debootstrap FAILED $((SECONDS - started)) "see $logs/debootstrap.log"
    tail -n 20 "$logs/debootstrap.log" >&2
    exit 1
  fi
fi

# --- step 2: what the root takes from this machine.
mkdir -p "$root/etc/ssl/certs" "$root/usr/local/share/ca-certificates"
cp -L /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
if compgen -G '/usr/local/share/ca-certificates/*' >/dev/null; then
  cp -rL /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/"
fi
rm -f "$root/etc/resolv.conf"
cp -L /etc/resolv.conf "$root/etc/resolv.conf"
# debootstrap writes no /etc/hosts, which every installed Debian has (the
# installer writes it): without it `localhost` does not resolve, and tests
# that connect to https://localhost fail for a reason no user would meet.
if [[ ! -s "$root/etc/hosts" ]]; then
  printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
fi

mount_into "$root/proc" -t proc proc
mount_into "$root/dev" --bind /dev
mount_into "$root/dev/pts" --bind /dev/pts
if mountpoint -q /dev/shm; then mount_into "$root/dev/shm" -t tmpfs shm; fi
bind_ro /sys "$root/sys"
mkdir -p "$root/opt/rustup" "$root/opt/rust/bin"
# RUSTUP_HOME through an overlay: the root sees this machine's toolchain and
# may add to it (setup.sh adds the wasm32-wasip2 target, as on a fresh
# machine), but what it adds lands in the work directory, not here. Without
# overlayfs, read-only (then the target must already be installed here).
rm -rf "$workdir/rustup-upper" "$workdir/rustup-work"
mkdir -p "$workdir/rustup-upper" "$workdir/rustup-work"
if ! mount_into "$root/opt/rustup" -t overlay overlay \
  -o "lowerdir=$rustup_home,upperdir=$workdir/rustup-upper,workdir=$workdir/rustup-work" 2>/dev/null; then
  say "no overlayfs: RUSTUP_HOME is read-only in the root (rustup cannot add targets there)"
  bind_ro "$rustup_home" "$root/opt/rustup"
fi
touch "$root/opt/rust/bin/rustup"
bind_ro "$cargo_bin/rustup" "$root/opt/rust/bin/rustup"
# The proxies: every link to rustup in ~/.cargo/bin (not what cargo
# installed there, such as tansu).
for proxy in "$cargo_bin"/*; do
  name="${proxy##*/}"
  [[ "$name" != rustup && -L "$proxy" && "$(readlink -f "$proxy")" == "$(readlink -f "$cargo_bin/rustup")" ]] || continue
  ln -sfn rustup "$root/opt/rust/bin/$name"
done
mkdir -p "$root/root/.cargo/bin"

# --- step 3: a clean clone of the commit.
src=/root/wasmrelay
if $reuse && [[ -d "$root$src/.git" ]]; then
  say "updating the clone in the root to ${sha:0:12} (keeping its build directories)"
  git -C "$root$src" fetch --quiet "$repo" "$sha"
  git -C "$root$src" checkout --quiet --force --detach "$sha"
  git -C "$root$src" clean -ffdxq -e /target/ -e /plugins/target/ -e /protocol/fuzz/target/
else
  rm -rf "${root:?}$src"
  say "cloning ${sha:0:12} ($ref) into the root"
  git clone --quiet --no-hardlinks "$repo" "$root$src"
  git -C "$root$src" cat-file -e "$sha^{commit}" 2>/dev/null || git -C "$root$src" fetch --quiet "$repo" "$sha"
  git -C "$root$src" checkout --quiet --detach "$sha"
fi

# --- steps 4 and 5: the README's commands, in the root, as root.
fd_limit="$(ulimit -Hn)"
[[ "$fd_limit" == unlimited ]] && fd_limit=1048576
((fd_limit > 1048576)) && fd_limit=1048576
ulimit -n "$fd_limit"
in_root() { # in_root COMMAND: runs a bash command line in the root, clean environment
  env -i HOME=/root USER=root LOGNAME=root LANG=C.UTF-8 TERM="${TERM:-dumb}" \
    PATH=/root/.cargo/bin:/opt/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    RUSTUP_HOME=/opt/rustup CARGO_HOME=/root/.cargo \
    "${pass_env[@]}" \
    chroot "$root" /bin/bash -c "$1"
}
# shellcheck disable=SC2016 # expanded in the root
limits="$(in_root 'echo "$(ulimit -Sn) $(ulimit -Hn)"')"
say "open files limit in the root: ${limits% *} (hard ${limits#* })"
if ((${limits% *} < 8192)); then
  echo "fresh-check: warning: only ${limits% *} open files per process in the root; the cluster tests open thousands of connections" >&2
fi
in_root 'rustc --version && cargo --version' || fail "the Rust toolchain does not run in the root"

run_step() { # run_step NAME COMMAND
  local name="$1" started=$SECONDS status=0
  say "$name: $2 (log: $logs/$name.log)"
  in_root "cd $src && $2" > >(tee "$logs/$name.log") 2>&1 || status=$?
  wait $! 2>/dev/null || true
  if ((status == 0)); then
    record "$name" passed $((SECONDS - started))
  else
    record "$name" FAILED $((SECONDS - started)) "exit $status; see $logs/$name.log"
  fi
  return "$status"
}
demo_ok=true
run_step demo.sh scripts/demo.sh || demo_ok=false
if ! $demo_ok && $fail_fast; then
  record test.sh skipped 0 "demo.sh failed (--fail-fast)"
  overall=1
else
  run_step test.sh scripts/test.sh || true
fi
