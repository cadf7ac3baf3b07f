//! `wasmrelay-cluster-bench`: the load generators and measuring clients of
//! the cluster benchmarks (`bench/cluster/*.sh`). The scripts start the
//! broker, the relay nodes and nats-server; this binary only produces,
//! receives, connects and measures, and prints one JSON object per result
//! on stdout (progress goes to stderr).
//!
//! Messages of the throughput and latency runs carry, in the first 16 bytes
//! of their value, the time they were sent (ns since the Unix epoch, big
//! endian) and their sequence number; the receiving process, on the same
//! machine and clock, computes the latency from it.

#![allow(clippy::print_stdout)]

mod certs;
mod hold;
mod kafka;
mod nats;
mod relay;
mod stats;

use std::time::{SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "wasmrelay-cluster-bench",
    about = "Load and measurements for bench/cluster"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Creates topics (existing ones are left as they are).
    CreateTopics(kafka::CreateTopics),
    /// Produces timestamped messages addressed to a process (header
    /// `process-id`), as fast as possible or at a fixed rate.
    Produce(kafka::Produce),
    /// Fills a routes topic with process routes (batched).
    FillRoutes(kafka::FillRoutes),
    /// Reads every partition of a topic from the beginning (no group) and
    /// reports records and offset gaps (skipped records).
    TailCount(kafka::TailCount),
    /// Reads every partition of a topic to its end with a node's reader
    /// settings and reports how long it took (the catch-up baseline).
    ReadAll(kafka::ReadAll),
    /// Connects business processes (SDK) and measures what they receive.
    Receive(relay::Receive),
    /// Holds many idle SDK connections (registered processes that ping).
    Idle(relay::Idle),
    /// Holds many SDK processes that receive and ack, follow `Rebalance`,
    /// and count deliveries and redeliveries (until SIGTERM).
    Hold(hold::Hold),
    /// NATS publisher on one server and subscriber on another: throughput or latency.
    NatsPubSub(nats::PubSub),
    /// Holds many idle NATS client connections, each with one subscription.
    NatsIdle(nats::Idle),
    /// Writes a throw-away CA and node certificates (PEM) for the TLS runs.
    Certs(certs::Certs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("building the tokio runtime");
    let result = runtime.block_on(async move {
        match cli.command {
            Command::CreateTopics(args) => kafka::create_topics(args).await,
            Command::Produce(args) => kafka::produce(args).await,
            Command::FillRoutes(args) => kafka::fill_routes(args).await,
            Command::TailCount(args) => kafka::tail_count(args).await,
            Command::ReadAll(args) => kafka::read_all(args).await,
            Command::Receive(args) => relay::receive(args).await,
            Command::Idle(args) => relay::idle(args).await,
            Command::Hold(args) => hold::hold(args).await,
            Command::NatsPubSub(args) => nats::pub_sub(args).await,
            Command::NatsIdle(args) => nats::idle(args).await,
            Command::Certs(args) => certs::certs(args).await,
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("wasmrelay-cluster-bench: {message}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Nanoseconds since the Unix epoch.
pub(crate) fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// A message value of `size` bytes (at least 16): send time, sequence
/// number, then filler.
pub(crate) fn stamped_value(size: usize, seq: u64, sent_ns: u64) -> Vec<u8> {
    let mut value = vec![b'x'; size.max(16)];
    value[..8].copy_from_slice(&sent_ns.to_be_bytes());
    value[8..16].copy_from_slice(&seq.to_be_bytes());
    value
}

/// (sent ns, seq) of a stamped value.
pub(crate) fn read_stamp(value: &[u8]) -> Option<(u64, u64)> {
    if value.len() < 16 {
        return None;
    }
    let sent = u64::from_be_bytes(value[..8].try_into().ok()?);
    let seq = u64::from_be_bytes(value[8..16].try_into().ok()?);
    Some((sent, seq))
}

/// This process's resident size (`VmRSS`), KiB; 0 if it cannot be read.
/// The idle commands report it from before their first connection, so that
/// what the connections cost is told apart from what the process costs
/// anyway (its runtime, its code).
pub(crate) fn own_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse().ok()
        })
        .unwrap_or(0)
}

/// Prints one result line.
pub(crate) fn emit(result: serde_json::Value) {
    println!("{result}");
}
