"""Plots a relay throughput sweep (bench/throughput-sweep.sh) and prints its
table. Reads the JSON lines host/benches/relay_throughput.rs appends to
RELAY_BENCH_JSON, one per run: records/s of the plain rdkafka loop (the
baseline, measured in the same run), of the relay with passthrough and with
json-enrich, and CPU per record.

Writes, with --out-dir DIR:
  DIR/relay-throughput-partitions.png  against partitions, the runs at --base-size bytes
  DIR/relay-throughput-size.png        against value size (log axis), the runs at --base-partitions
each with records/s, relay / plain loop, and CPU per record (the relay
process in the passthrough run, the benchmark process in the plain loop's). A point run more
than once is drawn at the mean of its runs, each run a faint dot.
With --table, prints every run as a markdown table.

Usage: plot_throughput.py RESULTS.jsonl [--table] [--out-dir DIR]
                          [--base-size 1024] [--base-partitions 3]
"""

import argparse
import json
import os
from collections import defaultdict

SERIES = (
    # key, label, style, colour
    ("plain_rate", "plain rdkafka loop (baseline)", "s--", "tab:grey"),
    ("relay_rate", "wasmrelay, passthrough", "o-", "tab:blue"),
    ("enrich_rate", "wasmrelay, json-enrich", "^-", "tab:orange"),
)
RATIOS = (
    # key, label, style, colour, the target of issue 12
    ("relay_ratio", "passthrough / plain loop", "o-", "tab:blue", 0.9),
    ("enrich_ratio", "json-enrich / plain loop", "^-", "tab:orange", 0.8),
)

CPU = (
    # key, label, style, colour
    ("plain_cpu_us_per_record", "plain loop (the benchmark process)", "s--", "tab:grey"),
    ("relay_cpu_us_per_record", "wasmrelay process, passthrough", "o-", "tab:blue"),
)


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def size_label(value_bytes):
    if value_bytes >= 1024 and value_bytes % 1024 == 0:
        return f"{value_bytes // 1024} KiB"
    return f"{value_bytes} B"


def table(rows):
    print("| commit | partitions | value | plain loop, rec/s | passthrough, rec/s | ratio | json-enrich, rec/s | ratio | relay CPU µs/rec (plain loop) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        commit = r.get("commit", "unknown") + ("+" if r.get("uncommitted_changes") else "")
        print(
            f"| `{commit}` | {r['partitions']} | {size_label(r['value_bytes'])} | {r['plain_rate']:,.0f} | "
            f"{r['relay_rate']:,.0f} | {r['relay_ratio']:.2f}x | {r['enrich_rate']:,.0f} | {r['enrich_ratio']:.2f}x | "
            f"{r['relay_cpu_us_per_record']:.1f} ({r['plain_cpu_us_per_record']:.1f}) |"
        )
    if any(r.get("uncommitted_changes") for r in rows):
        print()
        print("`+`: the work tree had changes to host, client, protocol or plugins not committed.")
    loads = [r["load_average_1m"] for r in rows if r.get("load_average_1m") is not None]
    if loads:
        print()
        print(f"Load average (1 min) at the end of each run: {min(loads):.1f} to {max(loads):.1f}.")


def by_x(rows, x_key):
    """{x: [rows]} in increasing x."""
    groups = defaultdict(list)
    for r in rows:
        groups[r[x_key]].append(r)
    return dict(sorted(groups.items()))


def mean(values):
    return sum(values) / len(values)


def plot(rows, x_key, xlabel, title, out, log_x):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = by_x(rows, x_key)
    xs = list(groups)
    fig, (top, middle, bottom) = plt.subplots(
        3, 1, figsize=(8, 9.5), sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.6]}
    )
    for key, label, style, colour in SERIES:
        top.plot(xs, [mean([r[key] for r in groups[x]]) for x in xs], style, color=colour, label=label)
        if any(len(g) > 1 for g in groups.values()):
            top.plot([x for x in xs for _ in groups[x]], [r[key] for x in xs for r in groups[x]],
                     ".", color=colour, alpha=0.35)
    top.set_ylabel("records/s")
    top.set_ylim(bottom=0)
    top.set_title(title, fontsize=10)
    top.grid(True, which="both", alpha=0.3)
    top.legend(fontsize=8)

    # Passthrough's labels above its points, json-enrich's below.
    for (key, label, style, colour, target), dy in zip(RATIOS, (6, -12)):
        ratios = [mean([r[key] for r in groups[x]]) for x in xs]
        middle.plot(xs, ratios, style, color=colour, label=label)
        for x, ratio in zip(xs, ratios):
            middle.annotate(f"{ratio:.2f}x", (x, ratio), textcoords="offset points", xytext=(4, dy),
                            fontsize=7, color=colour)
        middle.axhline(target, linestyle=":", color=colour, alpha=0.7, label=f"target {target}x (issue 12)")
    all_ratios = [r[key] for r in rows for key, *_ in RATIOS]
    middle.set_ylim(min(0.5, int(min(all_ratios) * 10) / 10 - 0.1), max(1.05, max(all_ratios) + 0.1))
    middle.set_ylabel("relay / plain loop\n(same run)")
    middle.grid(True, which="both", alpha=0.3)
    middle.legend(fontsize=7, ncol=2)

    for key, label, style, colour in CPU:
        bottom.plot(xs, [mean([r[key] for r in groups[x]]) for x in xs], style, color=colour, label=label)
    bottom.set_ylabel("CPU, µs per record")
    bottom.set_ylim(bottom=0)
    bottom.set_xlabel(xlabel)
    bottom.grid(True, which="both", alpha=0.3)
    bottom.legend(fontsize=7)

    for axes in (top, middle, bottom):
        axes.margins(x=0.08)
    if log_x:
        bottom.set_xscale("log", base=2)
        bottom.set_xticks(xs)
        bottom.set_xticklabels([size_label(x) for x in xs])
        bottom.minorticks_off()
    else:
        bottom.set_xticks(xs)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def describe(rows):
    commits = sorted({r.get("commit", "unknown") for r in rows})
    records = sorted({r["records"] for r in rows})
    over = sorted({r.get("over", "loopback") for r in rows})
    return (
        f"{'/'.join(f'{n:,}' for n in records)} records a run, tansu on {'/'.join(over)}, "
        f"commit {', '.join(commits)}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="JSON lines of RELAY_BENCH_JSON")
    parser.add_argument("--table", action="store_true", help="print a markdown table of every run")
    parser.add_argument("--out-dir", help="write the two plots there")
    parser.add_argument("--base-size", type=int, default=1024, help="value size of the partitions plot")
    parser.add_argument("--base-partitions", type=int, default=3, help="partitions of the size plot")
    args = parser.parse_args()

    rows = load(args.results)
    if not rows:
        raise SystemExit(f"no results in {args.results}")
    if args.table:
        table(rows)
    if not args.out_dir:
        return
    written = []
    at_size = [r for r in rows if r["value_bytes"] == args.base_size]
    if len({r["partitions"] for r in at_size}) > 1:
        out = os.path.join(args.out_dir, "relay-throughput-partitions.png")
        plot(at_size, "partitions", "partitions of every topic",
             f"Relay throughput against partitions, {size_label(args.base_size)} values\n{describe(at_size)}",
             out, log_x=False)
        written.append(out)
    at_partitions = [r for r in rows if r["partitions"] == args.base_partitions]
    if len({r["value_bytes"] for r in at_partitions}) > 1:
        out = os.path.join(args.out_dir, "relay-throughput-size.png")
        plot(at_partitions, "value_bytes", "record value size",
             f"Relay throughput against value size, {args.base_partitions} partitions\n{describe(at_partitions)}",
             out, log_x=True)
        written.append(out)
    if not written:
        raise SystemExit("nothing to plot: fewer than two partition counts or value sizes at the base point")
    for out in written:
        print(f"plot: {out}")


if __name__ == "__main__":
    main()
