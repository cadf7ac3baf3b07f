"""Glue of bench/cluster/rebalance.sh (a 4th node takes its share).

  rebalance.py poll OUT TOTAL TIMEOUT_S STABLE_S ID=ADMIN_URL...
      Follows /cluster of every node (every 0.25 s) from the moment the
      last node is ready: writes every sample to OUT.timeline.jsonl and the
      result to OUT. Done (exit 0) when every node sees all of them live,
      the counts add up to TOTAL, no node meets the imbalance condition,
      no round runs and no move was made for STABLE_S seconds; exit 1 after
      TIMEOUT_S (the result is written either way).
  rebalance.py report RUN_DIR
      Prints the markdown table from what the run collected.
"""

import glob
import json
import sys
import time
import urllib.request


def cluster(url):
    with urllib.request.urlopen(url + "/cluster", timeout=2) as response:
        return json.load(response)


def overloaded(count, share, threshold_percent, min_excess):
    """The node's own rule (host/src/cluster/rebalance.rs)."""
    excess = max(0, count - share)
    return excess >= max(min_excess, 1) and excess * 100 > share * threshold_percent


def shares(views):
    total = sum(v["connections"] for v in views.values())
    quotas = sum(v["connection_quota"] for v in views.values())
    return {
        node: (total * v["connection_quota"] + quotas // 2) // quotas if quotas else 0
        for node, v in views.items()
    }


def balanced(views):
    share = shares(views)
    return not any(
        overloaded(
            v["connections"],
            share[node],
            v["rebalance"]["threshold_percent"],
            v["rebalance"]["min_excess"],
        )
        for node, v in views.items()
    )


def poll(out, total, timeout_s, stable_s, nodes):
    # `new:ID=URL`: a node that is starting; it may not answer yet, and
    # counts as holding nothing and having moved nothing until it does.
    new = {n[4:].split("=", 1)[0] for n in nodes if n.startswith("new:")}
    nodes = dict(n.removeprefix("new:").split("=", 1) for n in nodes)
    absent = {"live": 0, "connections": 0, "connection_quota": 0,
              "rebalance": {"running": False, "rebalance_moves": 0, "first_move_at_ms": 0,
                            "last_move_at_ms": 0, "rate": 0, "threshold_percent": 10,
                            "min_excess": 10}}
    started = time.time()
    t_live = t_balanced = t_within = None
    unbalanced_after_balanced = 0
    last_change = started
    last_moves = None
    samples = []
    rates = {}
    timeline = open(out + ".timeline.jsonl", "w")
    settled = False
    while time.time() - started < timeout_s:
        t = time.time()
        views = {}
        missing = set()
        for node, url in nodes.items():
            try:
                views[node] = cluster(url)
            except Exception as error:  # not up yet, or slow to answer
                missing.add(node)
                views[node] = absent
                if node not in new:
                    print(f"poll: {node}: {error}", file=sys.stderr)
        if missing - new:
            time.sleep(0.25)
            continue
        for node, v in views.items():
            rates[node] = v["rebalance"]["rate"]
        sample = {
            "t": t,
            "nodes": {
                node: {
                    "live": v["live"],
                    "connections": v["connections"],
                    "running": v["rebalance"]["running"],
                    "moves": v["rebalance"]["rebalance_moves"],
                    "first_move_at_ms": v["rebalance"]["first_move_at_ms"],
                    "last_move_at_ms": v["rebalance"]["last_move_at_ms"],
                }
                for node, v in views.items()
            },
        }
        timeline.write(json.dumps(sample) + "\n")
        timeline.flush()
        samples.append(sample)
        # Live: every node that answers sees them all.
        all_live = all(v["live"] == len(nodes) for n, v in views.items() if n not in missing)
        if t_live is None and all_live:
            t_live = t
        counted = sum(v["connections"] for v in views.values())
        is_balanced = all_live and not missing and counted == total and balanced(views)
        if t_live is not None and is_balanced and t_balanced is None:
            t_balanced = t
        # The same with the processes in flight (told to move, not yet
        # registered anywhere) left out, as the nodes' own counts do.
        if t_live is not None and t_within is None and all_live and not missing and balanced(views):
            t_within = t
        if t_balanced is not None and not is_balanced:
            unbalanced_after_balanced += 1
        state = (
            tuple(s["moves"] for s in sample["nodes"].values()),
            tuple(s["connections"] for s in sample["nodes"].values()),
        )
        sample["missing"] = sorted(missing)
        if state != last_moves:
            last_moves = state
            last_change = t
        running = any(s["running"] for s in sample["nodes"].values())
        if is_balanced and not running and t - last_change >= stable_s:
            settled = True
            break
        time.sleep(max(0.0, 0.25 - (time.time() - t)))
    timeline.close()
    final = samples[-1]["nodes"] if samples else {}
    # Moves counted from the first sample (earlier rounds, e.g. among the
    # nodes before the join, are left out). A node's first move since then:
    # from the first sample that shows more moves, its last move less the
    # paced interval of the others in that sample (no earlier than the
    # sample before). Measured rate per node: its moves over the span from
    # that first move to its last (the node's own clock), and the highest
    # rate over any window of at least a second between two samples.
    per_node = {}
    for node, s in final.items():
        base = samples[0]["nodes"][node]["moves"]
        s = dict(s, moves=s["moves"] - base)
        first_ms = None
        for prev, cur in zip(samples, samples[1:]):
            dm = cur["nodes"][node]["moves"] - prev["nodes"][node]["moves"]
            if cur["nodes"][node]["moves"] > base and dm > 0:
                rate = rates.get(node) or 50
                first_ms = max(prev["t"] * 1000, cur["nodes"][node]["last_move_at_ms"] - (dm - 1) * 1000 / rate)
                break
        s["first_move_at_ms"] = first_ms or 0
        span_s = (s["last_move_at_ms"] - s["first_move_at_ms"]) / 1000 if first_ms else 0
        peak = 0.0
        j = 0
        for i in range(len(samples)):
            while j < i and samples[i]["t"] - samples[j + 1]["t"] >= 1.0:
                j += 1
            dt = samples[i]["t"] - samples[j]["t"]
            if dt >= 1.0:
                dm = samples[i]["nodes"][node]["moves"] - samples[j]["nodes"][node]["moves"]
                peak = max(peak, dm / dt)
        per_node[node] = {
            "moves": s["moves"],
            "moves_before": base,
            "connections_at_live": next(
                (x["nodes"][node]["connections"] for x in samples if x["t"] >= (t_live or 0)), None
            ),
            "connections_end": s["connections"],
            "first_move_at_ms": s["first_move_at_ms"],
            "last_move_at_ms": s["last_move_at_ms"],
            "move_span_s": span_s,
            "rate_per_s": (s["moves"] - 1) / span_s if s["moves"] > 1 and span_s > 0 else None,
            "peak_rate_1s": peak,
        }
    first_moves = [s["first_move_at_ms"] for s in per_node.values() if s["moves"]]
    last_moves_ms = [s["last_move_at_ms"] for s in per_node.values() if s["moves"]]
    result = {
        "settled": settled,
        "polled_from": started,
        "t_live": t_live,
        "t_balanced": t_balanced,
        "t_within": t_within,
        "unbalanced_samples_after_balanced": unbalanced_after_balanced,
        "t_first_move": min(first_moves) / 1000 if first_moves else None,
        "t_last_move": max(last_moves_ms) / 1000 if last_moves_ms else None,
        "t_settled": last_change,
        "samples": len(samples),
        "nodes": per_node,
    }
    with open(out, "w") as f:
        json.dump(result, f)
    sys.exit(0 if settled else 1)


def pct(sorted_values, p):
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), int(-(-len(sorted_values) * p // 1))))
    return sorted_values[rank - 1]


def last_json(path):
    lines = [l for l in open(path).read().split("\n") if l.strip()]
    return json.loads(lines[-1])


def report(run):
    p = json.load(open(f"{run}/poll.json"))
    extra = json.load(open(f"{run}/extra.json"))
    produced = last_json(f"{run}/produce.json")
    holds = [last_json(path) for path in sorted(glob.glob(f"{run}/hold-*.json"))]
    total = extra["processes"]
    rate = extra["rebalance_rate"]
    sent = produced["sent"]

    # Every arrival: seq process delivery_id node sent_ns arrived_ns.
    copies = {}  # (process, delivery id) -> [nodes]
    first_arrival = {}  # seq -> (sent_ns, arrived_ns)
    ids_of_seq = {}
    wrong_process = 0
    arrivals = 0
    for path in glob.glob(f"{run}/hold-*.arrivals"):
        for line in open(path):
            seq, process, delivery_id, node, sent_ns, arrived_ns = line.split()
            arrivals += 1
            copies.setdefault((process, delivery_id), []).append(node)
            if seq == "-":
                continue
            seq = int(seq)
            if seq % total != int(process):
                wrong_process += 1
            ids_of_seq.setdefault(seq, set()).add(delivery_id)
            got = (int(sent_ns), int(arrived_ns))
            if seq not in first_arrival or got[1] < first_arrival[seq][1]:
                first_arrival[seq] = got
    missing = [s for s in range(sent) if s not in first_arrival]
    # Redeliveries by partition: how many, which offsets, when (the later
    # copy, seconds after node-4 was live) and whether the process had moved.
    by_partition = {}
    for (process, delivery_id), nodes_seen in copies.items():
        if len(nodes_seen) > 1:
            topic, partition, offset = delivery_id.rsplit("/", 2)
            by_partition.setdefault(partition, []).append((int(offset), len(nodes_seen) - 1, len(set(nodes_seen)) > 1))
    duplicates = arrivals - len(copies)
    dup_moved = sum(
        len(nodes) - 1 for nodes in copies.values() if len(nodes) > 1 and len(set(nodes)) > 1
    )
    several_ids = sum(1 for ids in ids_of_seq.values() if len(ids) > 1)

    # Latency (first arrival of each message), by when it was sent.
    t_first, t_last = p["t_first_move"], p["t_last_move"]
    windows = {"before the join": [], "while moving": [], "after": []}
    for sent_ns, arrived_ns in first_arrival.values():
        sent_s = sent_ns / 1e9
        key = (
            "before the join" if t_first is None or sent_s < t_first
            else "while moving" if sent_s <= t_last + 1.0
            else "after"
        )
        windows[key].append((arrived_ns - sent_ns) / 1e6)

    def since_live(t):
        return f"{t - p['t_live']:.1f}" if t is not None and p["t_live"] is not None else "never"

    nodes = p["nodes"]
    donors = [n for n in sorted(nodes) if n != extra["new_node"]]
    share = total // len(nodes)
    # The moves the donors must make: to within the condition (10% over the
    # share), and to the end of a round (within min_excess / 2 of it).
    to_condition = [max(0, nodes[n]["connections_at_live"] - int(share * 1.1)) for n in donors]
    to_round_end = [max(0, nodes[n]["connections_at_live"] - share - 5) for n in donors]
    moves_total = sum(v["moves"] for v in nodes.values())
    rebalanced_seen = sum(h["rebalanced"] for h in holds) - extra["rebalanced_before"]

    print()
    print("| measure | value |")
    print("|---|---:|")
    print(f"| processes (SDK clients in {len(holds)} OS processes) | {total:,} |")
    print(f"| counts before the join ({', '.join(donors)}) | {' / '.join(str(nodes[n]['connections_at_live']) for n in donors)} |")
    print(f"| counts at the end ({', '.join(sorted(nodes))}) | {' / '.join(str(nodes[n]['connections_end']) for n in sorted(nodes))} |")
    t_start = extra["t_ready"] - extra["ready_s"]
    print(f"| {extra['new_node']}: started → ready (/readyz), s | {extra['ready_s']:.1f} |")
    print(f"| {extra['new_node']}: started → live on every node (t = 0 below), s | {p['t_live'] - t_start:.1f} |" if p["t_live"] else "| started → live on every node | never |")
    print(f"| live → first move, s | {since_live(p['t_first_move'])} |")
    print(f"| live → no node meets the condition (processes in flight not counted), s | {since_live(p['t_within'])} |")
    print(f"| **live → every node within the condition, all {total:,} counted, s** | **{since_live(p['t_balanced'])}** |")
    print(f"| live → last move, s | {since_live(p['t_last_move'])} |")
    print(f"| live → settled (counts and moves unchanged), s | {since_live(p['t_settled'])} |")
    print(
        f"| ideal at {rate}/s per donor: to the condition / to the end of the rounds, s "
        f"| {max(to_condition) / rate:.1f} / {max(to_round_end) / rate:.1f} (+ up to one rebalance_interval before a donor checks) |"
    )
    print(f"| moves ({', '.join(donors)}) | {' / '.join(str(nodes[n]['moves']) for n in donors)} |")
    print(f"| moves in all (the minimum to the round ends: {sum(to_round_end)}) | {moves_total} |")
    print(f"| moves of {extra['new_node']} (should be 0) | {nodes[extra['new_node']]['moves']} |")
    rates = " / ".join(
        f"{nodes[n]['rate_per_s']:.1f}" if nodes[n]["rate_per_s"] else "-" for n in donors
    )
    print(f"| move rate per donor, first to last move, per s | {rates} |")
    peaks = " / ".join(f"{nodes[n]['peak_rate_1s']:.1f}" for n in donors)
    print(f"| highest move rate per donor over ≥ 1 s (polled), per s | {peaks} |")
    print(f"| moves the processes saw (Rebalance frames) | {rebalanced_seen} |")
    print(f"| connections lost otherwise (should be 0) | {sum(h['lost'] for h in holds)} |")
    print(f"| messages produced ({produced['rate_per_s']:.0f}/s for {produced['seconds']:.0f} s) | {sent:,} |")
    print(f"| messages received (distinct) | {len(first_arrival):,} |")
    print(f"| **never received** | **{len(missing)}** |")
    print(f"| deliveries in all | {arrivals:,} |")
    print(f"| **redelivered (same process and delivery id again)** | **{duplicates}** |")
    print(f"| of them via another node (the process had moved) | {dup_moved} |")
    print(f"| messages that came with several delivery ids | {several_ids} |")
    print(f"| deliveries to another process than addressed (should be 0) | {wrong_process} |")
    print(f"| acks that found the connection gone | {sum(h['ack_failed'] for h in holds)} |")
    print(f"| **dead-lettered (records in business.dlq)** | **{extra['dlq_records']}** |")
    print(f"| records the nodes consumed, beyond those produced (read again after the consumer group's rebalance) | {extra['consumed'] - sent:.0f} |")
    print(f"| cluster delivery retries (nodes' wasmrelay_retries_total) | {extra['retries']:.0f} |")
    for name, values in windows.items():
        values.sort()
        if values:
            print(
                f"| latency sent {name} ({len(values):,}): p50 / p99 / max, ms "
                f"| {pct(values, 0.5):.0f} / {pct(values, 0.99):.0f} / {values[-1]:.0f} |"
            )
    cpu = extra["cpu_ms"]
    window = extra["cpu_window_s"]
    print(
        f"| CPU from {extra['new_node']}'s start to settled ({window:.0f} s), s: nodes / tansu / SDK clients / producer / whole machine (of {2 * window:.0f}) "
        f"| {cpu['nodes'] / 1000:.1f} / {cpu['tansu'] / 1000:.1f} / {cpu['clients'] / 1000:.1f} / {cpu['producer'] / 1000:.1f} / {cpu['machine'] / 1000:.1f} |"
    )
    print(f"| load average at the start / at the end | {extra['load_start']} / {extra['load_end']} |")
    print()
    if by_partition:
        parts = []
        for partition, dups in sorted(by_partition.items(), key=lambda kv: int(kv[0])):
            offsets = sorted(o for o, _, _ in dups)
            moved = sum(1 for _, _, m in dups if m)
            parts.append(
                f"partition {partition}: {sum(n for _, n, _ in dups)} at offsets {offsets[0]}–{offsets[-1]}"
                + (f" ({moved} via another node)" if moved else "")
            )
        print("Redelivered, by input partition: " + "; ".join(parts) + ".")
    if missing:
        print(f"Never received, first ones: {missing[:20]}")
    if not p["settled"]:
        print("WARNING: the cluster did not settle within the timeout (see poll.json.timeline.jsonl)")


if __name__ == "__main__":
    if sys.argv[1] == "poll":
        poll(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), sys.argv[6:])
    else:
        report(sys.argv[2])
