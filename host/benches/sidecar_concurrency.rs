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
//! Beside each rate: the CPU the relay, the application (this process) and
//! tansu spent per call while calls flowed, which is steadier than the rate
//! on a machine the three share.
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
use support::cpu::{child_pid, own_cpu_ms, process_cpu_ms};
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

/// CPU time in ms, so far, of the relay, this process (the application)
/// and the broker.
#[derive(Clone, Copy, Default)]
struct Cpu {
    relay: u64,
    app: u64,
    broker: u64,
}

impl Cpu {
    fn now(relay: u32, broker: Option<u32>) -> Cpu {
        Cpu {
            relay: process_cpu_ms(relay),
            app: own_cpu_ms(),
            broker: broker.map_or(0, process_cpu_ms),
        }
    }
}

/// What one ordering's run measured.
struct Run {
    calls_per_second: f64,
    violations: u64,
    lost: u64,
    /// µs of CPU per call while calls flowed: relay, application, broker.
    cpu_per_call: [f64; 3],
}

/// Delivers `count` calls from `input` with `ordering`; measures calls/s
/// from the first call the application saw to the last, and the CPU each
/// part spent over that time (sampled every 20 ms, in 10 ms ticks).
async fn run(kafka: &Tansu, input: &str, ordering: &str, count: u64) -> Run {
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
    let broker = child_pid("tansu");
    let mut cpu_at_first: Option<Cpu> = None;
    let started = Instant::now();
    loop {
        let accepted = check.lock().unwrap().accepted;
        if accepted > 0 && cpu_at_first.is_none() {
            cpu_at_first = Some(Cpu::now(relay.pid(), broker));
        }
        if accepted >= count {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "too slow:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (first, last) = (cpu_at_first.unwrap(), Cpu::now(relay.pid(), broker));
    let per_call = |before: u64, after: u64| (after - before) as f64 * 1000.0 / count as f64;
    let cpu_per_call = [
        per_call(first.relay, last.relay),
        per_call(first.app, last.app),
        per_call(first.broker, last.broker),
    ];
    let dead_letters = relay.metric(r#"wasmrelay_messages_dead_lettered_total{flow="calls"}"#);
    drop(relay);
    let check = check.lock().unwrap();
    let seconds = (check.last_at.unwrap() - check.first_at.unwrap()).as_secs_f64();
    let lost = count - app.distinct_deliveries() as u64;
    Run {
        calls_per_second: count as f64 / seconds,
        violations: check.violations,
        lost: lost + dead_letters,
        cpu_per_call,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let kafka = Tansu::start();
    let keyed = run(&kafka, "calls-key", "key", CALLS).await;
    let partition = run(
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
    println!(
        "| measure | calls/s | / ceiling | order violations | lost or dead-lettered | CPU µs per call: relay | application | broker |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    println!("| ceiling: max_in_flight / latency | {ceiling:.0} | 1.00 | | | | | |");
    for (name, calls, run) in [
        ("key", CALLS, &keyed),
        ("partition", PARTITION_ORDER_CALLS, &partition),
    ] {
        let [relay, app, broker] = run.cpu_per_call;
        println!(
            "| ordering = \"{name}\", {calls} calls | {:.0} | {:.3} | {} | {} | {relay:.1} | {app:.1} | {broker:.1} |",
            run.calls_per_second,
            run.calls_per_second / ceiling,
            run.violations,
            run.lost,
        );
    }
    println!();
    println!(
        "target: at least {target:.0} calls/s (min of 20,000 and 0.8 x ceiling): {}",
        if keyed.calls_per_second >= target {
            "met"
        } else {
            "NOT met"
        }
    );
    assert_eq!(
        keyed.violations + partition.violations,
        0,
        "per-key order broken"
    );
    assert_eq!(
        keyed.lost + partition.lost,
        0,
        "calls lost or dead-lettered"
    );
}
