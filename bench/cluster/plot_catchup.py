"""Plots a route table catch-up run (bench/cluster/catchup.sh): catch-up
time of the node and of the plain reader, and the node's memory for the
table, against the number of routes. Usage: plot_catchup.py RESULTS.jsonl OUT.png"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(results, out):
    rows = [json.loads(line) for line in open(results) if line.strip()]
    nodes = [r for r in rows if r.get("kind", "node") == "node" and r["routes"]]
    plain = [r for r in rows if r.get("kind") == "plain"]
    empty = next(r for r in rows if r.get("variant") == "empty")
    nodes.sort(key=lambda r: r["routes"])
    routes = [r["routes"] for r in nodes]
    node_s = [r["seconds"] for r in nodes]
    plain_s = []
    for r in nodes:
        reads = [p["seconds"] for p in plain if p["count"] == r["count"]]
        plain_s.append(sum(reads) / len(reads))
    mib = [(r["rss_kib"] - empty["rss_kib"]) / 1024 for r in nodes]
    per_route = [(r["rss_kib"] - empty["rss_kib"]) * 1024 / r["routes"] for r in nodes]

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(routes, node_s, "o-", label="node catch-up (its log)")
    left.plot(routes, plain_s, "s--", label="plain rdkafka reader (mean of 2)")
    for x, n, p in zip(routes, node_s, plain_s):
        left.annotate(f"{n / p:.2f}x", (x, n), textcoords="offset points", xytext=(4, 6), fontsize=8)
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("routes in the topic")
    left.set_ylabel("seconds to the end of the topic")
    left.set_title("Route table catch-up time")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)

    right.plot(routes, mib, "o-", color="tab:green", label="RSS delta vs an empty-table node, MiB")
    for x, m, b in zip(routes, mib, per_route):
        right.annotate(f"{b:.0f} B/route", (x, m), textcoords="offset points", xytext=(4, -12), fontsize=8)
    right.plot(routes, [r * 100 / 2**20 for r in routes], ":", color="grey", label="100 B per route (the target)")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("routes in the topic")
    right.set_ylabel("MiB")
    right.set_title("Node memory for the route table")
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8)

    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
