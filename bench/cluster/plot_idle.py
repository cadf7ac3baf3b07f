"""Plots memory against idle connections (bench/cluster/idle.sh with
COUNTS): the node's RSS growth per connection, and in all, against the
connections it holds, with nats-server at the same counts beside it.
wasmrelay's points are one node at each count of COUNTS, and the NODES
nodes of part 3 together (their summed growth over all their connections;
the range of the nodes' own figures drawn as a bar). Usage:
plot_idle.py RESULTS.jsonl OUT.png"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402


def per_connection_kib(r):
    return r["delta_kib"] / r["connections"]


def main(results, out):
    rows = [json.loads(line) for line in open(results) if line.strip()]
    single = sorted((r for r in rows if r["variant"] == "relay"), key=lambda r: r["connections"])
    nats = sorted((r for r in rows if r["variant"] == "nats"), key=lambda r: r["connections"])
    cluster = [r for r in rows if r["variant"] == "relay-cluster"]
    cluster_nodes = [r for r in rows if r["variant"] == "relay-node"]

    fig, (left, right) = plt.subplots(1, 2, figsize=(11.5, 4.6))
    for axes, value, ylabel, title, fmt in (
        (left, per_connection_kib, "RSS growth per connection, KiB", "Memory per idle connection", "{:.1f} KiB"),
        (right, lambda r: r["delta_kib"] / 1024, "RSS growth, MiB", "Memory for all connections", "{:.1f} MiB"),
    ):
        for series, label, style, colour in (
            (single, "wasmrelay, 1 node", "o-", "tab:blue"),
            (nats, "nats-server, 1 server (baseline)", "s--", "tab:grey"),
        ):
            if not series:
                continue
            xs = [r["connections"] for r in series]
            ys = [value(r) for r in series]
            axes.plot(xs, ys, style, color=colour, label=label)
            for x, y in zip(xs, ys):
                axes.annotate(fmt.format(y), (x, y), textcoords="offset points", xytext=(5, 5),
                              fontsize=8, color=colour)
        for r in cluster:
            nodes = r.get("nodes", len(cluster_nodes))
            x, y = r["connections"], value(r)
            label = f"wasmrelay, {nodes} nodes together ({r.get('per_node_connections', r['connections'] // max(nodes, 1)):,} each)"
            if axes is left and cluster_nodes:
                # The nodes' own per-connection figures, lowest to highest.
                own = [per_connection_kib(n) for n in cluster_nodes]
                axes.errorbar([x], [y], yerr=[[y - min(own)], [max(own) - y]], fmt="D", color="tab:green",
                              capsize=4, label=label + ", bar: each node")
            else:
                axes.plot([x], [y], "D", color="tab:green", label=label)
            axes.annotate(fmt.format(y), (x, y), textcoords="offset points", xytext=(6, 5),
                          fontsize=8, color="tab:green")
        axes.set_xscale("log")
        xs = sorted({r["connections"] for r in single + nats + cluster})
        axes.set_xticks(xs)
        axes.set_xticklabels([f"{x:,}" for x in xs])
        axes.minorticks_off()
        axes.set_xlabel("idle connections (registered SDK processes / NATS clients)")
        axes.set_ylabel(ylabel)
        axes.set_title(title)
        axes.grid(True, which="both", alpha=0.3)
        axes.margins(x=0.15)
    left.set_ylim(0, max(per_connection_kib(r) for r in rows) * 1.2)
    right.set_yscale("log")
    # Plain numbers (60, 200), not 6 x 10^1, on the log axis.
    right.yaxis.set_major_formatter(matplotlib.ticker.LogFormatter(labelOnlyBase=False))
    right.yaxis.set_minor_formatter(matplotlib.ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    right.set_ylim(top=max(r["delta_kib"] / 1024 for r in rows) * 2)
    left.legend(fontsize=7, loc="center left")
    if cluster:
        fig.text(0.01, 0.01, "The cluster's point is its nodes together: a process may hold at most 20,000 "
                 "open files here. nats-server is measured on one server only.", fontsize=7, color="dimgrey")
    fig.suptitle("Resident memory of the server against idle connections (VmRSS after - before)", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
