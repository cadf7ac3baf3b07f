//! Many business processes (SDK clients) that receive and acknowledge
//! every delivery while the cluster moves them around: the rebalancing
//! benchmark's processes. Each follows `Rebalance` as the SDK does by
//! itself (a random pause of up to `rebalance_jitter`, then the named
//! node). They count what arrives, per process and per delivery id, so
//! that redeliveries show.

use std::collections::{HashMap, HashSet};
use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use serde_json::json;
use tokio::sync::mpsc;
use wasmrelay_client::{Client, Event, Events};

use crate::relay::{client_config, split};
use crate::{emit, now_ns, read_stamp};

#[derive(Debug, clap::Args)]
pub(crate) struct Hold {
    /// Node client addresses, comma separated, tried in order (placement
    /// may redirect a process to another node).
    #[arg(long)]
    connect: String,
    /// Processes (connections) to hold.
    #[arg(long)]
    count: u64,
    /// Process ids are `<prefix><n>`.
    #[arg(long, default_value = "proc-")]
    prefix: String,
    /// First n.
    #[arg(long, default_value_t = 0)]
    first: u64,
    /// Connections being opened at once.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Written (empty) once every process is registered.
    #[arg(long)]
    ready_file: Option<std::path::PathBuf>,
    /// Rewritten every second with the counts so far (one JSON object).
    #[arg(long)]
    status_file: Option<std::path::PathBuf>,
    /// Every arrival, one line each: `seq process delivery_id node
    /// sent_ns arrived_ns` (written at the end).
    #[arg(long)]
    dump: Option<std::path::PathBuf>,
    /// Connect over TLS, trusting only the CA certificate(s) in this PEM
    /// file.
    #[arg(long)]
    ca: Option<std::path::PathBuf>,
}

/// One arrival, as the processes' tasks report it.
struct Arrival {
    process: u64,
    delivery_id: String,
    node: String,
    seq: Option<u64>,
    sent_ns: u64,
    arrived_ns: u64,
}

/// What the processes' event loops count besides deliveries.
#[derive(Default)]
struct Counters {
    rebalanced: AtomicU64,
    lost: AtomicU64,
    reconnected: AtomicU64,
    ack_failed: AtomicU64,
    other_events: AtomicU64,
}

/// What arrived so far.
#[derive(Default)]
struct Tally {
    received: u64,
    /// (process, delivery id) seen.
    distinct: HashSet<(u64, String)>,
    duplicates: u64,
    /// Sequence numbers seen, with the delivery ids they came with.
    seqs: HashMap<u64, Vec<String>>,
    per_process: HashMap<u64, u64>,
    lines: Vec<String>,
}

impl Tally {
    fn add(&mut self, a: Arrival) {
        self.received += 1;
        *self.per_process.entry(a.process).or_default() += 1;
        if !self.distinct.insert((a.process, a.delivery_id.clone())) {
            self.duplicates += 1;
        }
        if let Some(seq) = a.seq {
            let ids = self.seqs.entry(seq).or_default();
            if !ids.contains(&a.delivery_id) {
                ids.push(a.delivery_id.clone());
            }
        }
        self.lines.push(format!(
            "{} {} {} {} {} {}",
            a.seq.map_or_else(|| "-".to_string(), |s| s.to_string()),
            a.process,
            a.delivery_id,
            a.node,
            a.sent_ns,
            a.arrived_ns
        ));
    }

    fn json(&self, counters: &Counters, clients: &[(u64, Client)]) -> serde_json::Value {
        let mut per_node: HashMap<String, u64> = HashMap::new();
        let mut connected = 0u64;
        for (_, client) in clients {
            if let Some(node) = client.node_id() {
                connected += 1;
                *per_node.entry(node).or_default() += 1;
            }
        }
        let counts: Vec<u64> = clients
            .iter()
            .map(|(n, _)| self.per_process.get(n).copied().unwrap_or(0))
            .collect();
        json!({
            "processes": clients.len(),
            "connected_now": connected,
            "per_node_now": per_node,
            "received": self.received,
            "distinct": self.distinct.len(),
            "duplicates": self.duplicates,
            "distinct_seqs": self.seqs.len(),
            "seqs_with_several_delivery_ids": self.seqs.values().filter(|ids| ids.len() > 1).count(),
            "processes_that_received": counts.iter().filter(|c| **c > 0).count(),
            "per_process_min": counts.iter().min().copied().unwrap_or(0),
            "per_process_max": counts.iter().max().copied().unwrap_or(0),
            "rebalanced": counters.rebalanced.load(Ordering::Relaxed),
            "lost": counters.lost.load(Ordering::Relaxed),
            "reconnected": counters.reconnected.load(Ordering::Relaxed),
            "ack_failed": counters.ack_failed.load(Ordering::Relaxed),
            "other_events": counters.other_events.load(Ordering::Relaxed),
        })
    }
}

/// Reads one process's events: acks every delivery, reports it, counts
/// moves and losses. The task ends when the client is closed (its events
/// end); [`hold`] keeps the handle and awaits it.
#[allow(clippy::disallowed_methods)]
fn serve(
    n: u64,
    process_id: String,
    mut events: Events,
    tx: mpsc::UnboundedSender<Arrival>,
    counters: Arc<Counters>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(event) = events.next().await {
            match event {
                Event::Delivery(delivery) => {
                    let arrived_ns = now_ns();
                    let stamp = read_stamp(&delivery.message.value);
                    let arrival = Arrival {
                        process: n,
                        delivery_id: delivery.delivery_id.clone(),
                        node: delivery.node_id().to_string(),
                        seq: stamp.map(|(_, seq)| seq),
                        sent_ns: stamp.map_or(0, |(sent, _)| sent),
                        arrived_ns,
                    };
                    if delivery.ack().is_err() {
                        counters.ack_failed.fetch_add(1, Ordering::Relaxed);
                    }
                    let _ = tx.send(arrival);
                }
                Event::Disconnected { reason } => {
                    if reason.starts_with("rebalance") {
                        counters.rebalanced.fetch_add(1, Ordering::Relaxed);
                    } else if counters.lost.fetch_add(1, Ordering::Relaxed) < 5 {
                        eprintln!("{process_id}: disconnected: {reason}");
                    }
                }
                Event::Connected { .. } => {
                    counters.reconnected.fetch_add(1, Ordering::Relaxed);
                }
                other => {
                    if counters.other_events.fetch_add(1, Ordering::Relaxed) < 5 {
                        eprintln!("{process_id}: {other:?}");
                    }
                }
            }
        }
    })
}

/// Connects the processes, receives until SIGTERM or SIGINT, then prints
/// the counts (and writes the dump).
pub(crate) async fn hold(args: Hold) -> Result<(), String> {
    let addresses = split(&args.connect);
    let started = Instant::now();
    let counters = Arc::new(Counters::default());
    let (tx, mut rx) = mpsc::unbounded_channel::<Arrival>();
    let base = client_config(&addresses, String::new(), args.ca.as_deref())?;
    let connect = |n: u64| {
        let mut config = base.clone();
        config.process_id = format!("{}{n}", args.prefix);
        config.connect_timeout = Duration::from_secs(30);
        async move { (n, Client::connect(config).await) }
    };
    let results: Vec<_> = futures::stream::iter(args.first..args.first + args.count)
        .map(connect)
        .buffer_unordered(args.concurrency)
        .collect()
        .await;
    let mut clients: Vec<(u64, Client)> = Vec::new();
    let mut tasks = Vec::new();
    let mut failed = 0u64;
    for (n, result) in results {
        match result {
            Ok((client, events)) => {
                tasks.push(serve(
                    n,
                    format!("{}{n}", args.prefix),
                    events,
                    tx.clone(),
                    counters.clone(),
                ));
                clients.push((n, client));
            }
            Err(error) => {
                failed += 1;
                if failed <= 5 {
                    eprintln!("hold: connecting failed: {error}");
                }
            }
        }
    }
    drop(tx);
    clients.sort_by_key(|(n, _)| *n);
    let connect_seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "hold: {} processes registered in {connect_seconds:.1} s, {failed} failed",
        clients.len()
    );
    if let Some(path) = &args.ready_file {
        std::fs::write(path, b"").map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| e.to_string())?;
    let mut tally = Tally::default();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
            Some(arrival) = rx.recv() => tally.add(arrival),
            _ = tick.tick() => {
                if let Some(path) = &args.status_file {
                    let status = tally.json(&counters, &clients).to_string();
                    let tmp = path.with_extension("tmp");
                    std::fs::write(&tmp, status)
                        .and_then(|()| std::fs::rename(&tmp, path))
                        .map_err(|e| format!("writing {}: {e}", path.display()))?;
                }
            }
        }
    }
    // What already arrived in the channel counts too.
    while let Ok(arrival) = rx.try_recv() {
        tally.add(arrival);
    }
    let mut summary = tally.json(&counters, &clients);
    summary["failed"] = json!(failed);
    summary["connect_seconds"] = json!(connect_seconds);
    summary["held_seconds"] = json!(started.elapsed().as_secs_f64());
    emit(summary);
    if let Some(path) = &args.dump {
        let mut file = std::io::BufWriter::new(
            std::fs::File::create(path).map_err(|e| format!("writing {}: {e}", path.display()))?,
        );
        for line in &tally.lines {
            writeln!(file, "{line}").map_err(|e| format!("writing {}: {e}", path.display()))?;
        }
        file.flush().map_err(|e| e.to_string())?;
    }
    futures::future::join_all(clients.into_iter().map(|(_, client)| client.close())).await;
    // Their event streams end with the clients; do not hang on one that
    // does not.
    let _ = tokio::time::timeout(Duration::from_secs(5), futures::future::join_all(tasks)).await;
    if failed > 0 {
        return Err(format!("{failed} processes could not connect"));
    }
    Ok(())
}
