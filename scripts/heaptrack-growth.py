"""What a relay's heap grew by between two moments, by call site, from a
heaptrack trace (the soak writes one with WASMRELAY_SOAK_HEAPTRACK=raw;
interpret it first: /usr/lib/heaptrack/libexec/heaptrack_interpret < raw |
zstd > trace.zst).

    python3 scripts/heaptrack-growth.py trace.zst FROM_S [TO_S]

For every allocation site (size and call stack), the bytes allocated less
the bytes freed between FROM_S and TO_S seconds after the relay started:
the sites that hold more at the end than at the start. Grouped by the first
frame of the relay (wasmrelay::...) or librdkafka (rd_kafka_...) on the
stack, then the largest stacks in full. heaptrack_print has no time window;
this reads heaptrack's interpreted format (v, s, i, t, a, +, -, c lines;
numbers in hex) with nothing but the standard library and zstd."""

import collections
import os
import shutil
import subprocess
import sys

if len(sys.argv) not in (3, 4):
    sys.exit("usage: heaptrack-growth.py TRACE.zst FROM_S [TO_S]  (seconds after the relay started)")
if not shutil.which("zstd"):
    sys.exit("heaptrack-growth.py: zstd is missing (apt-get install -y zstd)")
if not os.path.isfile(sys.argv[1]):
    sys.exit(f"heaptrack-growth.py: no trace at {sys.argv[1]!r}")
try:
    path, t0 = sys.argv[1], int(float(sys.argv[2]) * 1000)
    t1 = int(float(sys.argv[3]) * 1000) if len(sys.argv) > 3 else 1 << 62
except ValueError:
    sys.exit(f"heaptrack-growth.py: FROM_S and TO_S are seconds, not {sys.argv[2:]!r}")
if t1 <= t0:
    sys.exit("heaptrack-growth.py: TO_S must be after FROM_S")
reader = subprocess.Popen(["zstd", "-dc", path], stdout=subprocess.PIPE, text=True, errors="replace")
strings, ips, traces, allocations = [""], [0], [(0, 0)], []
now, net, count = 0, collections.Counter(), collections.Counter()
for line in reader.stdout:
    kind = line[0]
    if kind in "+-":
        if t0 <= now < t1:
            size, trace = allocations[int(line[2:], 16)]
            sign = 1 if kind == "+" else -1
            net[trace] += sign * size
            count[trace] += sign
    elif kind == "c":
        now = int(line[2:], 16)
    elif kind == "a":
        _, size, trace = line.split()
        allocations.append((int(size, 16), int(trace, 16)))
    elif kind == "t":
        _, ip, parent = line.split()
        traces.append((int(ip, 16), int(parent, 16)))
    elif kind == "i":
        parts = line.split()
        ips.append(int(parts[3], 16) if len(parts) > 3 else 0)
    elif kind == "s":
        strings.append(line[2:].rstrip("\n").split(" ", 1)[1] if " " in line[2:] else "")
if reader.wait() != 0:
    sys.exit(f"heaptrack-growth.py: zstd could not read {path!r} (an interpreted heaptrack trace, .zst)")
if not allocations:
    sys.exit(f"heaptrack-growth.py: {path!r} holds no allocations: is it heaptrack_interpret's output?")


def frames(trace):
    out = []
    while trace and len(out) < 80:
        ip, parent = traces[trace]
        out.append(strings[ips[ip]] if ips[ip] < len(strings) else "?")
        trace = parent
    return out


print(f"window {t0 / 1000:.0f}-{min(t1, now) / 1000:.0f} s of {now / 1000:.0f} s; net bytes {sum(net.values())}")
by_site, by_site_count = collections.Counter(), collections.Counter()
for trace, size in net.items():
    site = next((f for f in frames(trace) if "wasmrelay" in f or f.startswith("rd_kafka_")), "(elsewhere)")
    by_site[site[:140]] += size
    by_site_count[site[:140]] += count[trace]
print(f"{'bytes':>10} {'blocks':>7}  first relay or librdkafka frame")
for site, size in by_site.most_common(15):
    print(f"{size:10d} {by_site_count[site]:7d}  {site}")
print("\nlargest stacks:")
for trace, size in net.most_common(5):
    print(f"{size} bytes in {count[trace]} blocks")
    for f in [f for f in frames(trace) if not f.startswith(("_RN", "core::", "alloc::", "std::", "__rust"))][:12]:
        print(f"      {f[:130]}")
