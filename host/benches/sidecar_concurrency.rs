//! A sidecar delivering to a slow application with key-ordered concurrency
//! (issue 12: `ordering = "key"`, `max_in_flight`).
//!
//! One tansu broker; service calls over [`KEYS`] keys in a 3-partition
//! topic, each key's calls numbered; a real HTTP application in this process
//! that answers each call after [`APP_LATENCY`] and checks, for every call,
//! that each key's calls arrive in sequence. `wasmrelay run` (release build)
//! delivers them with `max_in_flight = 256` (and the application client's
//! `concurrency = 256`). Printed beside it, from the same run: the ceiling
//! `max_in_flight / latency`, and the same relay with `ordering =
//! "partition"` (one call per partition at a time: what the relay did
//! before). Every call must arrive, in order per key, nothing dead-lettered.
//!
//! Run: `cargo bench -p wasmrelay --bench sidecar_concurrency` (needs tansu:
//! `scripts/setup.sh`). Results go to bench/RESULTS.md.

#![allow(clippy::unwrap_used, clippy::print_stdout, missing_docs)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::app::TestApp;
use support::relay::RelayProcess;
use support::tansu::{Tansu, TestRecord};

const CALLS: u64 = 60_000;
const PARTITION_ORDER_CALLS: u64 = 1_800;
const KEYS: u64 = 1_000;
const PARTITIONS: i32 = 3;
const APP_LATENCY: Duration = Duration::from_millis(5);
const MAX_IN_FLIGHT: usize = 256;

/// Per key, the next sequence number expected; and what broke the order.
#[derive(Default)]
struct OrderCheck {
    next: HashMap<u64, u64>,
    accepted: u64,
    violations: u64,
    first_at: Option<Instant>,
    last_at: Option<Instant>,
}

fn calls(topic_run: &str, count: u64) -> Vec<TestRecord> {
    (0..count)
        .map(|n| {
            let (key, seq) = (n % KEYS, n / KEYS);
            TestRecord::keyed(
                format!("key-{key}"),
                format!("{{\"run\":\"{topic_run}\",\"key\":{key},\"seq\":{seq}}}"),
            )
        })
        .collect()
}

fn relay_config(kafka: &Tansu, app_url: &str, input: &str, ordering: &str) -> String {
    format!(
        r#"
[admin]
listen = "127.0.0.1:0"
[plugins]
dir = "{plugins}"
watch = false
[links.main]
bootstrap_servers = "{bootstrap}"
[links.main.options]
"fetch.wait.max.ms" = "10"
"session.timeout.ms" = "6000"
"heartbeat.interval.ms" = "500"
[[flows]]
name = "calls"
link = "main"
input_topic = "{input}"
output_topic = "{input}.returns"
dead_letter_topic = "{input}.dlq"
ordering = "{ordering}"
max_in_flight = {MAX_IN_FLIGHT}
[flows.deliver.app]
url = "{app_url}"
timeout = "10s"
concurrency = {MAX_IN_FLIGHT}
"#,
        plugins = support::plugins_dist().display(),
        bootstrap = kafka.bootstrap(),
    )
}

/// Delivers `count` calls from `input` with `ordering`; returns calls/s from
/// the first call the application saw to the last, and the order check.
async fn run(kafka: &Tansu, input: &str, ordering: &str, count: u64) -> (f64, u64, u64) {
    kafka.create_topic(input, PARTITIONS).await;
    kafka.produce(input, calls(input, count)).await;
    let check = Arc::new(Mutex::new(OrderCheck::default()));
    let app_check = check.clone();
    let app = TestApp::start_with_latency(APP_LATENCY, move |receipt| {
        let value: serde_json::Value = serde_json::from_slice(&receipt.body).unwrap();
        let (key, seq) = (
            value["key"].as_u64().unwrap(),
            value["seq"].as_u64().unwrap(),
        );
        let mut guard = app_check.lock().unwrap();
        let check = &mut *guard;
        let now = Instant::now();
        check.first_at.get_or_insert(now);
        check.last_at = Some(now);
        let next = check.next.entry(key).or_insert(0);
        if seq != *next {
            check.violations += 1;
        }
        *next = seq + 1;
        check.accepted += 1;
        (200, Vec::new(), Vec::new())
    })
    .await;
    let relay = RelayProcess::start(
        &relay_config(kafka, &app.url, input, ordering),
        &[("RUST_LOG", "warn,wasmrelay::node=info")],
    );
    let started = Instant::now();
    while check.lock().unwrap().accepted < count {
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "too slow:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let dead_letters = relay.metric(r#"wasmrelay_messages_dead_lettered_total{flow="calls"}"#);
    drop(relay);
    let check = check.lock().unwrap();
    let seconds = (check.last_at.unwrap() - check.first_at.unwrap()).as_secs_f64();
    let lost = count - app.distinct_deliveries() as u64;
    (
        count as f64 / seconds,
        check.violations,
        lost + dead_letters,
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let kafka = Tansu::start();
    let (keyed, keyed_violations, keyed_missing) = run(&kafka, "calls-key", "key", CALLS).await;
    let (partition, partition_violations, partition_missing) = run(
        &kafka,
        "calls-partition",
        "partition",
        PARTITION_ORDER_CALLS,
    )
    .await;
    let ceiling = MAX_IN_FLIGHT as f64 / APP_LATENCY.as_secs_f64();
    let target = 20_000f64.min(0.8 * ceiling);
    println!();
    println!(
        "sidecar to an application answering in {} ms: {PARTITIONS} partitions, {KEYS} keys, max_in_flight {MAX_IN_FLIGHT}",
        APP_LATENCY.as_millis()
    );
    println!("| measure | calls/s | / ceiling | order violations | lost or dead-lettered |");
    println!("|---|---:|---:|---:|---:|");
    println!("| ceiling: max_in_flight / latency | {ceiling:.0} | 1.00 | | |");
    println!(
        "| ordering = \"key\", {CALLS} calls | {keyed:.0} | {:.2} | {keyed_violations} | {keyed_missing} |",
        keyed / ceiling
    );
    println!(
        "| ordering = \"partition\", {PARTITION_ORDER_CALLS} calls | {partition:.0} | {:.3} | {partition_violations} | {partition_missing} |",
        partition / ceiling
    );
    println!();
    println!(
        "target: at least {target:.0} calls/s (min of 20,000 and 0.8 x ceiling): {}",
        if keyed >= target { "met" } else { "NOT met" }
    );
    assert_eq!(
        keyed_violations + partition_violations,
        0,
        "per-key order broken"
    );
    assert_eq!(
        keyed_missing + partition_missing,
        0,
        "calls lost or dead-lettered"
    );
}
