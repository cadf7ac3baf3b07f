"""The soak's report (scripts/soak.sh): from OUT_DIR/samples.csv and the
rows and growth lines in OUT_DIR/output.log, writes OUT_DIR/summary.md (a
table in Markdown) and OUT_DIR/soak.svg (heap in use, anonymous memory,
RSS, and open files less client connections over time, one line a
process), with nothing but the standard library."""

import csv
import json
import sys
from collections import defaultdict

out, minutes = sys.argv[1], sys.argv[2]
samples = defaultdict(list)
with open(f"{out}/samples.csv") as f:
    for row in csv.DictReader(f):
        samples[row["process"]].append({k: (v if k == "process" else int(v)) for k, v in row.items()})

rows, growth = [], []
for line in open(f"{out}/output.log", errors="replace"):
    if line.startswith("chaos-row "):
        rows.append(json.loads(line.split(" ", 1)[1]))
    elif line.startswith("soak-growth "):
        growth.append(json.loads(line.split(" ", 1)[1]))

lines = [f"Soak of {minutes} minutes (`scripts/soak.sh {minutes}`).", ""]
lines += ["| flow | produced | delivered | duplicated | lost | longest stall (ms) |", "|---|---|---|---|---|---|"]
lines += [f"| {r['scenario']} | {r['produced']} | {r['delivered']} | {r['duplicated']} | {r['lost']} | {r['max_stall_ms']} |" for r in rows]
lines += ["", "| process | measure | trend after warm-up | trend at the end | growth | judged | first cycle (median) | last cycle (median) |",
          "|---|---|---|---|---|---|---|---|"]
lines += [f"| {g['process']} | {g['what']} | {g['after_warm_up']} | {g['at_the_end']} | {g['growth'] * 100:+.1f}% | {'yes' if g.get('judged', True) else 'no'} "
          f"| {g.get('first_cycle_median', '')} | {g.get('last_cycle_median', '')} |" for g in growth]
lines += ["", "| process | samples | tasks | threads | client connections | open files | records in progress (most) | awaiting ack (most) |",
          "|---|---|---|---|---|---|---|---|"]
span = lambda points, key: f"{min(p[key] for p in points)}-{max(p[key] for p in points)}"
for process, points in samples.items():
    lines.append(f"| {process} | {len(points)} | {span(points, 'tasks')} | {span(points, 'threads')} | {span(points, 'connections')} "
                 f"| {span(points, 'open_files')} | {max(p['in_progress'] for p in points)} | {max(p['awaiting_ack'] for p in points)} |")
lines += ["", "The trend is the least-squares line through the samples of the whole fault cycles after minute 5; growth is its rise over its value after the warm-up. Ranges are min-max over the samples. Open files less client connections is what must stay flat for a node: its clients move between nodes by design. heap_in_use_kib is glibc's heap allocated and not freed (wasmrelay_heap_in_use_bytes), what a leak raises; anon_kib is the RSS's anonymous memory (RssAnon: heap pages, free ones the allocator keeps included, stacks); the rest of the RSS is mostly the debug binary's pages (RssFile), shown and not judged."]
open(f"{out}/summary.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))

# The plot: four panels, heap in use, anonymous memory and RSS (MiB), and open files
# less client connections, against minutes.
for points in samples.values():
    for p in points:
        p["files_less_clients"] = p["open_files"] - p["connections"]
colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
width, panel, margin = 760, 240, 50
panels = [("heap_in_use_kib", "heap in use, wasmrelay_heap_in_use_bytes (MiB)", 1 / 1024),
          ("anon_kib", "anonymous memory, RssAnon (MiB)", 1 / 1024), ("rss_kib", "RSS, VmRSS (MiB)", 1 / 1024),
          ("files_less_clients", "open files less client connections", 1)]
panels = [p for p in panels if all(p[0] in q for pts in samples.values() for q in pts)]
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{len(panels) * panel + (len(panels) + 1) * margin}" font-family="sans-serif" font-size="12">',
       '<rect width="100%" height="100%" fill="white"/>']
end = max((p["seconds"] for pts in samples.values() for p in pts), default=1) or 1
for index, (measure, label, scale) in enumerate(panels):
    top = margin + index * (panel + margin)
    peak = max((p[measure] * scale for pts in samples.values() for p in pts), default=1) * 1.1 or 1
    svg.append(f'<text x="{margin}" y="{top - 8}">{label} against minutes; peak axis {peak:.0f}</text>')
    svg.append(f'<rect x="{margin}" y="{top}" width="{width - 2 * margin}" height="{panel}" fill="none" stroke="#999"/>')
    for tick in range(0, int(end // 60) + 1, max(1, int(end // 60) // 10)):
        x = margin + (tick * 60 / end) * (width - 2 * margin)
        svg.append(f'<text x="{x:.0f}" y="{top + panel + 14}" text-anchor="middle">{tick}</text>')
    for color, (process, points) in zip(colors, samples.items()):
        path = " ".join(f"{margin + p['seconds'] / end * (width - 2 * margin):.1f},{top + panel - p[measure] * scale / peak * panel:.1f}" for p in points)
        svg.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{path}"/>')
        if index == 0:
            y = top + 14 + 14 * list(samples).index(process)
            svg.append(f'<text x="{width - margin - 150}" y="{y}" fill="{color}">{process}</text>')
svg.append("</svg>")
open(f"{out}/soak.svg", "w").write("\n".join(svg) + "\n")
print(f"soak-report: wrote {out}/summary.md and {out}/soak.svg")
