//! wasmrelay side: business processes on the SDK that receive and measure,
//! and many idle ones.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use serde_json::json;
use tokio::sync::mpsc;
use wasmrelay_client::{Client, ClientConfig, ClientTls, Event, Events};

use crate::stats::Observations;
use crate::{emit, now_ns, read_stamp};

/// The client configuration of one process: over TLS, trusting only the CA
/// in `ca` (PEM), when it is given.
pub(crate) fn client_config(
    addresses: &[String],
    process_id: String,
    ca: Option<&std::path::Path>,
) -> Result<ClientConfig, String> {
    let config = ClientConfig::new(addresses.to_vec(), process_id);
    Ok(match ca {
        None => config,
        Some(path) => config.with_tls(ClientTls::with_ca_file(path).map_err(|e| e.to_string())?),
    })
}

/// CPU time (user + system) this process has used so far, in ms
/// (`/proc/self/stat`; Linux reports it in USER_HZ = 100 ticks a second).
fn own_cpu_ms() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| {
            // The fields after the command name, which is in parentheses.
            let rest = &stat[stat.rfind(')')? + 2..];
            let fields: Vec<&str> = rest.split_whitespace().collect();
            // utime and stime are fields 14 and 15 of the whole line.
            let utime: u64 = fields.get(11)?.parse().ok()?;
            let stime: u64 = fields.get(12)?.parse().ok()?;
            Some((utime + stime) * 10)
        })
        .unwrap_or(0)
}

pub(crate) fn split(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

#[derive(Debug, clap::Args)]
pub(crate) struct Receive {
    /// Node client addresses, comma separated, tried in order.
    #[arg(long)]
    connect: String,
    /// Process ids to register, comma separated (one connection each).
    #[arg(long)]
    process_ids: String,
    /// Stop after this many distinct messages.
    #[arg(long)]
    expect: u64,
    /// Messages with a sequence number below this are left out of the
    /// latency figures.
    #[arg(long, default_value_t = 0)]
    warmup: u64,
    /// Throughput is measured from the arrival of this fraction of the
    /// messages to the last one.
    #[arg(long, default_value_t = 0.1)]
    steady_from: f64,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
    /// Written (empty) once every process is registered.
    #[arg(long)]
    ready_file: Option<std::path::PathBuf>,
    /// Keep trying to connect for this many seconds (the node may not be
    /// listening yet).
    #[arg(long, default_value_t = 0)]
    connect_wait_s: u64,
    /// Writes every arrival (`seq sent_ns arrived_ns`) to this file.
    #[arg(long)]
    dump: Option<std::path::PathBuf>,
    /// Connect over TLS, trusting only the CA certificate(s) in this PEM
    /// file (the node's certificate must name the host dialed).
    #[arg(long)]
    ca: Option<std::path::PathBuf>,
}

/// Connects, retrying every 20 ms for up to `wait` while nothing answers.
async fn connect_retrying(
    config: ClientConfig,
    wait: Duration,
) -> Result<(Client, Events), wasmrelay_client::ClientError> {
    let deadline = Instant::now() + wait;
    loop {
        match Client::connect(config.clone()).await {
            Ok(connected) => return Ok(connected),
            Err(wasmrelay_client::ClientError::Unreachable { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(error) => return Err(error),
        }
    }
}

pub(crate) async fn receive(args: Receive) -> Result<(), String> {
    let addresses = split(&args.connect);
    let (tx, mut rx) = mpsc::unbounded_channel::<(u64, u64, u64)>();
    let disconnects = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    for process_id in split(&args.process_ids) {
        let mut config = client_config(&addresses, process_id.clone(), args.ca.as_deref())?;
        config.initial_backoff = Duration::from_millis(50);
        config.max_backoff = Duration::from_millis(500);
        let (client, mut events) =
            connect_retrying(config, Duration::from_secs(args.connect_wait_s))
                .await
                .map_err(|e| format!("process {process_id}: {e}"))?;
        let tx = tx.clone();
        let disconnects = disconnects.clone();
        tokio::spawn(async move {
            while let Some(event) = events.next().await {
                match event {
                    Event::Delivery(delivery) => {
                        let arrived = now_ns();
                        let stamp = read_stamp(&delivery.message.value);
                        let _ = delivery.ack();
                        if let Some((sent, seq)) = stamp {
                            let _ = tx.send((seq, sent, arrived));
                        }
                    }
                    Event::Disconnected { reason } => {
                        disconnects.fetch_add(1, Ordering::Relaxed);
                        eprintln!("{process_id}: disconnected: {reason}");
                    }
                    Event::Connected { node_id } => {
                        eprintln!("{process_id}: connected to {node_id}");
                    }
                    other => eprintln!("{process_id}: {other:?}"),
                }
            }
        });
        clients.push(client);
    }
    drop(tx);
    if let Some(path) = &args.ready_file {
        std::fs::write(path, b"").map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    eprintln!("receive: {} processes registered", clients.len());
    let cpu_at_ready = own_cpu_ms();
    let mut seen = HashSet::new();
    let mut observations = Observations::default();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.timeout_s);
    let mut timed_out = false;
    while (seen.len() as u64) < args.expect {
        tokio::select! {
            () = tokio::time::sleep_until(deadline) => { timed_out = true; break; }
            got = rx.recv() => match got {
                None => break,
                Some((seq, sent, arrived)) => {
                    if seen.insert(seq) {
                        observations.arrivals.push((seq, sent, arrived));
                    } else {
                        observations.duplicates += 1;
                    }
                }
            }
        }
    }
    // Before writing the dump: the CPU of receiving, decrypting when over
    // TLS, acknowledging and recording.
    let client_cpu_ms = own_cpu_ms().saturating_sub(cpu_at_ready);
    if let Some(path) = &args.dump {
        let text: String = observations
            .arrivals
            .iter()
            .map(|(seq, sent, arrived)| format!("{seq} {sent} {arrived}\n"))
            .collect();
        std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    let mut summary = observations.summary(args.steady_from, args.warmup);
    summary["client_cpu_ms"] = json!(client_cpu_ms);
    summary["expected"] = json!(args.expect);
    summary["timed_out"] = json!(timed_out);
    summary["disconnects"] = json!(disconnects.load(Ordering::Relaxed));
    emit(summary);
    for client in clients {
        client.close().await;
    }
    if timed_out {
        return Err(format!(
            "timed out after {} s with {} of {} messages",
            args.timeout_s,
            seen.len(),
            args.expect
        ));
    }
    Ok(())
}

#[derive(Debug, clap::Args)]
pub(crate) struct Idle {
    /// Node client addresses, comma separated, tried in order.
    #[arg(long)]
    connect: String,
    /// Connections (processes) to open.
    #[arg(long)]
    count: u64,
    /// Process ids are `<prefix><n>`.
    #[arg(long, default_value = "idle-")]
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
    /// Connect over TLS, trusting only the CA certificate(s) in this PEM
    /// file.
    #[arg(long)]
    ca: Option<std::path::PathBuf>,
}

/// Opens the connections, reports, then holds them until SIGTERM or SIGINT.
pub(crate) async fn idle(args: Idle) -> Result<(), String> {
    let rss_before_kib = crate::own_rss_kib();
    let addresses = split(&args.connect);
    let started = Instant::now();
    let disconnects = Arc::new(AtomicU64::new(0));
    // Read once: every connection shares the parsed CA.
    let base = client_config(&addresses, String::new(), args.ca.as_deref())?;
    let connect = |n: u64| {
        let mut config = base.clone();
        config.process_id = format!("{}{n}", args.prefix);
        config.connect_timeout = Duration::from_secs(30);
        async move { Client::connect(config).await }
    };
    let results: Vec<Result<(Client, Events), wasmrelay_client::ClientError>> =
        futures::stream::iter(args.first..args.first + args.count)
            .map(connect)
            .buffer_unordered(args.concurrency)
            .collect()
            .await;
    let mut clients = Vec::new();
    let mut failed = 0u64;
    for result in results {
        match result {
            Ok((client, mut events)) => {
                let disconnects = disconnects.clone();
                tokio::spawn(async move {
                    while let Some(event) = events.next().await {
                        if let Event::Disconnected { reason } = event
                            && disconnects.fetch_add(1, Ordering::Relaxed) < 5
                        {
                            eprintln!("idle: disconnected: {reason}");
                        }
                    }
                });
                clients.push(client);
            }
            Err(error) => {
                failed += 1;
                if failed <= 5 {
                    eprintln!("idle: connecting failed: {error}");
                }
            }
        }
    }
    emit(json!({
        "connected": clients.len(),
        "failed": failed,
        "connect_seconds": started.elapsed().as_secs_f64(),
        "rss_before_kib": rss_before_kib,
    }));
    if let Some(path) = &args.ready_file {
        std::fs::write(path, b"").map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| e.to_string())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    let connected_now = clients.iter().filter(|c| c.node_id().is_some()).count();
    emit(json!({
        "held_seconds": started.elapsed().as_secs_f64(),
        "disconnects": disconnects.load(Ordering::Relaxed),
        "connected_at_end": connected_now,
    }));
    if failed > 0 {
        return Err(format!("{failed} connections failed"));
    }
    Ok(())
}
