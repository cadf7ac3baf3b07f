"""Prints the result tables of the cluster benchmarks (markdown) from the
JSON lines the scripts collect. Usage: report.py routed|idle|catchup FILE"""

import json
import sys


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def routed(rows):
    by = {(r["variant"], r["measure"], r["size"]): r for r in rows}
    sizes = sorted({r["size"] for r in rows})
    print()
    print("| size | measure | wasmrelay A→mesh→B | wasmrelay A→A (no mesh) | NATS A→route→B | wasmrelay routed / NATS | mesh adds |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for size in sizes:
        t = {v: by.get((v, "throughput", size)) for v in ("wasmrelay-routed", "wasmrelay-local", "nats")}
        if all(t.values()):
            rr, rl, rn = (t[v]["steady_rate_per_s"] for v in ("wasmrelay-routed", "wasmrelay-local", "nats"))
            print(f"| {size} B | throughput, msg/s | {rr:,.0f} | {rl:,.0f} | {rn:,.0f} | {rr / rn:.3f}x | {rr / rl:.2f}x the A→A rate |")
            cr, cl, cn = (t[v]["server_cpu_ms"] * 1000 / t[v]["received"] for v in ("wasmrelay-routed", "wasmrelay-local", "nats"))
            print(f"| {size} B | relay nodes / NATS servers CPU, µs per msg | {cr:.1f} | {cl:.1f} | {cn:.2f} | {cr / cn:.0f}x | {cr - cl:+.1f} µs |")
            kr, kl = (t[v]["broker_cpu_ms"] * 1000 / t[v]["received"] for v in ("wasmrelay-routed", "wasmrelay-local"))
            print(f"| {size} B | broker (tansu) CPU while draining, µs per msg | {kr:.1f} | {kl:.1f} | — | — | — |")
        l = {v: by.get((v, "latency", size)) for v in ("wasmrelay-routed", "wasmrelay-local", "nats")}
        if all(l.values()):
            for p in ("mean", "p50", "p99"):
                key = f"latency_ms_{p}"
                lr, ll, ln = (l[v][key] for v in ("wasmrelay-routed", "wasmrelay-local", "nats"))
                ratio = f"{lr / ln:.0f}x" if ln else "-"
                print(f"| {size} B | latency {p}, ms | {lr:.2f} | {ll:.2f} | {ln:.3f} | {ratio} | {lr - ll:+.2f} ms |")
    if any(r["variant"].endswith("-tls") for r in rows):
        routed_tls(by, sizes)
    print()
    print("Per run (duplicates, disconnects and retries should be 0; latencies of throughput runs are")
    print("left out: there they are the time spent waiting in the backlog):")
    print()
    print("| variant | measure | size | received | duplicates | disconnects | retries | steady msg/s | p50 ms | p90 ms | p99 ms | max ms | server CPU ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['measure']} | {r['size']} | {r['received']} | {r.get('duplicates', 0)} | "
            f"{r.get('disconnects', '-')} | {r.get('retries', '-') if isinstance(r.get('retries'), str) else int(r.get('retries', 0))} | "
            + (
                f"{r['steady_rate_per_s']:,.0f} | — | — | — | — | {r.get('server_cpu_ms', '-')} |"
                if r["measure"] == "throughput"
                else f"{r['steady_rate_per_s']:,.0f} | {r['latency_ms_p50']:.2f} | {r['latency_ms_p90']:.2f} | "
                f"{r['latency_ms_p99']:.2f} | {r['latency_ms_max']:.2f} | {r.get('server_cpu_ms', '-')} |"
            )
        )


def routed_tls(by, sizes):
    """TLS / plaintext, per path: the runs of the TLS cluster (client
    listener TLS, mesh mutual TLS) beside the plaintext ones of the same run."""
    paths = (("wasmrelay-routed", "A→mesh→B"), ("wasmrelay-local", "A→A"))

    def per_msg(r, key):
        return r[key] * 1000 / r["received"]

    measures = [
        ("throughput", "throughput, msg/s", lambda r: r["steady_rate_per_s"], "{:,.0f}"),
        ("throughput", "relay nodes CPU, µs per msg", lambda r: per_msg(r, "server_cpu_ms"), "{:.1f}"),
        ("throughput", "receiving process (SDK) CPU, µs per msg", lambda r: per_msg(r, "client_cpu_ms") if "client_cpu_ms" in r else None, "{:.1f}"),
        ("throughput", "broker (tansu) CPU, µs per msg", lambda r: per_msg(r, "broker_cpu_ms"), "{:.1f}"),
        ("latency", "latency mean, ms", lambda r: r["latency_ms_mean"], "{:.2f}"),
        ("latency", "latency p50, ms", lambda r: r["latency_ms_p50"], "{:.2f}"),
        ("latency", "latency p99, ms", lambda r: r["latency_ms_p99"], "{:.2f}"),
    ]
    print()
    print("TLS (client listener TLS + mesh mutual TLS) against plaintext, same run:")
    print()
    print("| size | measure | " + " | ".join(f"{label} plaintext | {label} TLS | TLS / plaintext" for _, label in paths) + " |")
    print("|---:|---|" + "---:|---:|---:|" * len(paths))
    for size in sizes:
        for measure, label, get, fmt in measures:
            cells = []
            for variant, _ in paths:
                plain = by.get((variant, measure, size))
                tls = by.get((variant + "-tls", measure, size))
                p = get(plain) if plain else None
                t = get(tls) if tls else None
                cells.append(fmt.format(p) if p is not None else "—")
                cells.append(fmt.format(t) if t is not None else "—")
                cells.append(f"{t / p:.2f}x" if p and t is not None else "—")
            print(f"| {size} B | {label} | " + " | ".join(cells) + " |")


def idle(rows):
    print()
    print("| setup | connections | RSS before, MiB | RSS after, MiB | delta, MiB | per connection, KiB | vs NATS |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    # Each row against the nats-server of as many connections as the node
    # holds (a cluster row: as each of its nodes), else the first one.
    nats = {}
    for r in rows:
        if r["variant"] == "nats":
            nats.setdefault(r["connections"], r["delta_kib"] * 1024 / r["connections"])
    first = next(iter(nats.values()), None)
    for r in rows:
        per = r["delta_kib"] * 1024 / r["connections"]
        base_per = nats.get(r.get("per_node_connections", r["connections"]), first)
        ratio = f"{per / base_per:.2f}x" if base_per else "-"
        print(
            f"| {r['label']} | {r['connections']:,} | {r['before_kib'] / 1024:.1f} | {r['after_kib'] / 1024:.1f} | "
            f"{r['delta_kib'] / 1024:.1f} | {per / 1024:.1f} | {ratio} |"
        )
    print()
    labels = [r["label"] for r in rows if "clients_rss_kib" in r]
    for r in rows:
        if "clients_rss_kib" in r:
            # With several counts (COUNTS) a setup is there once per count.
            label = r["label"] if labels.count(r["label"]) == 1 else f"{r['label']}, {r['connections']:,} connections"
            line = (
                f"Client side, {label}: {r['clients_rss_kib'] / 1024:.0f} MiB RSS in the client processes, "
                f"{r['clients_rss_kib'] / r['connections']:.1f} KiB per connection"
            )
            if "clients_rss_before_kib" in r:
                # What the connections cost, as for the node: the processes'
                # growth from before their first connection.
                grown = r["clients_rss_kib"] - r["clients_rss_before_kib"]
                line += (
                    f"; {r['clients_rss_before_kib'] / 1024:.1f} MiB before the first connection, "
                    f"so **{grown / r['connections']:.1f} KiB per connection** over that"
                )
            print(line + ".")


def catchup(rows):
    nodes = [r for r in rows if r.get("kind", "node") == "node"]
    plain = [r for r in rows if r.get("kind") == "plain"]
    empty = next((r for r in nodes if r["variant"] == "empty"), None)
    print()
    print("| routes topic | records | routes | catch-up (node's log), s | plain reader, s | node / plain | ready after start, s | RSS after, MiB | delta vs empty, MiB | per route, B | peak RSS, MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in nodes:
        delta = (r["rss_kib"] - empty["rss_kib"]) if empty else 0
        per = f"{delta * 1024 / r['routes']:.0f}" if r["routes"] else "-"
        reads = [p["seconds"] for p in plain if p["count"] == r.get("count")]
        mean = sum(reads) / len(reads) if reads else None
        plain_s = " / ".join(f"{s:.2f}" for s in reads) if reads else "-"
        ratio = f"{r['seconds'] / mean:.2f}x" if mean else "-"
        print(
            f"| {r['label']} | {r['records']:,} | {r['routes']:,} | {r['seconds']:.2f} | {plain_s} | {ratio} | {r['ready_s']:.2f} | "
            f"{r['rss_kib'] / 1024:.1f} | {delta / 1024:+.1f} | {per} | {r['hwm_kib'] / 1024:.1f} |"
        )
    print()
    print("plain reader: read-all before / after the node; node / plain uses their mean.")
    for r in nodes:
        print(f"{r['label']}: /cluster says routes={r['cluster_routes']}, route_table_caught_up={r['cluster_caught_up']}")


if __name__ == "__main__":
    {"routed": routed, "idle": idle, "catchup": catchup}[sys.argv[1]](load(sys.argv[2]))
