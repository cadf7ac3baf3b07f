//! Key-ordered delivery to the application (`flows.ordering`, the default
//! `key`): many calls of one partition in flight together, each key's calls
//! strictly in order, through retries and a SIGKILL, with commits only up
//! to the highest contiguous finished offset.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use support::app::{Receipt, TestApp};
use support::relay::RelayProcess;
use support::tansu::{Tansu, TestRecord};

use crate::sidecar_flow::{INPUT, OUTPUT, config, header_str};
use wasmrelay_test_support as support;

const KEYS: u64 = 100;

/// `count` calls over [`KEYS`] keys, each key's calls numbered from 0.
fn keyed_calls(count: u64) -> Vec<TestRecord> {
    (0..count)
        .map(|n| {
            let (key, seq) = (n % KEYS, n / KEYS);
            TestRecord::keyed(
                format!("key-{key}"),
                json!({"key": key, "seq": seq}).to_string(),
            )
        })
        .collect()
}

fn key_and_seq(receipt: &Receipt) -> (u64, u64) {
    let value: Value = serde_json::from_slice(&receipt.body).unwrap();
    (
        value["key"].as_u64().unwrap(),
        value["seq"].as_u64().unwrap(),
    )
}

/// What the application checks on every call it accepts: within one run of
/// the relay, each key's calls come exactly in sequence (the next only
/// after the previous one was answered 200); after a restart, a key may
/// start again at or before the call after its last accepted one (an
/// at-least-once redelivery) but never skip one.
#[derive(Default)]
struct OrderCheck {
    /// Per key: the last accepted sequence number and the relay run it was
    /// accepted in.
    last: HashMap<u64, (u64, u64)>,
    accepted: HashSet<(u64, u64)>,
    violations: Vec<String>,
}

impl OrderCheck {
    fn accept(&mut self, run: u64, key: u64, seq: u64) {
        match self.last.get(&key) {
            None if seq != 0 => self
                .violations
                .push(format!("key {key}: first call was {seq}, not 0")),
            Some(&(last, last_run)) if last_run == run && seq != last + 1 => self
                .violations
                .push(format!("key {key}: {seq} came after {last} in run {run}")),
            Some(&(last, _)) if seq > last + 1 => self.violations.push(format!(
                "key {key}: run {run} began at {seq}, skipping past {last}"
            )),
            _ => {}
        }
        self.last.insert(key, (seq, run));
        self.accepted.insert((key, seq));
    }
}

/// The sidecar flow of these tests with flow-level `settings` added.
fn flow_config(kafka: &Tansu, app_url: &str, settings: &str) -> String {
    config(kafka, app_url, "", "").replace(
        "\n[flows.deliver.app]",
        &format!("\n{settings}\n[flows.deliver.app]"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_key_stays_in_order_through_retries_and_a_sigkill_while_keys_run_together() {
    const COUNT: u64 = 3_000;
    let kafka = Tansu::start();
    // One partition: all concurrency seen is within a partition.
    kafka.create_topic(INPUT, 1).await;
    let run = Arc::new(AtomicU64::new(1));
    let check = Arc::new(Mutex::new(OrderCheck::default()));
    let (app_run, app_check) = (run.clone(), check.clone());
    // 20 ms per call and 16 in flight: about 4 s for all, so that the kill
    // comes while offsets are being committed.
    let app = TestApp::start_with_latency(Duration::from_millis(20), move |receipt| {
        let (key, seq) = key_and_seq(receipt);
        // Every seventh call fails on its first attempt: retried in order.
        if seq % 7 == 3 && receipt.attempt == 1 {
            return (503, b"busy".to_vec(), Vec::new());
        }
        app_check
            .lock()
            .unwrap()
            .accept(app_run.load(Ordering::SeqCst), key, seq);
        (
            200,
            json!({"key": key, "seq": seq}).to_string().into_bytes(),
            Vec::new(),
        )
    })
    .await;
    // The default ordering (`key`).
    let config = flow_config(&kafka, &app.url, "max_in_flight = 16");
    let mut relay = RelayProcess::start(&config, &[]);
    kafka.produce(INPUT, keyed_calls(COUNT)).await;
    relay
        .wait_for("a third of the calls", Duration::from_secs(120), || {
            app.count() as u64 >= COUNT / 3
        })
        .await;
    relay.sigkill();

    // Everything below the committed offset is finished: its data-return is
    // on the output topic.
    let committed = kafka.committed_offsets("wasmrelay-orders", INPUT).await;
    let returned = kafka
        .consume_all(OUTPUT, COUNT as usize, Duration::from_secs(3))
        .await;
    let finished: HashSet<String> = returned
        .iter()
        .map(|r| header_str(r, "wasmrelay-delivery-id"))
        .collect();
    let position = committed.get(&0).copied().unwrap_or(0);
    assert!(
        position > 0,
        "nothing was committed before the kill; relay log:\n{}",
        relay.log()
    );
    for offset in 0..position {
        let id = format!("{INPUT}/0/{offset}");
        assert!(
            finished.contains(&id),
            "offset {id} was committed but its data-return is missing"
        );
    }
    let most_before_kill = app.most_in_progress();

    // Requests of the killed relay are answered by now; the next run starts.
    tokio::time::sleep(Duration::from_secs(7)).await;
    run.store(2, Ordering::SeqCst);
    let relay = RelayProcess::start(&config, &[]);
    relay
        .wait_for(
            "every call accepted after the restart",
            Duration::from_secs(180),
            || check.lock().unwrap().accepted.len() as u64 >= COUNT,
        )
        .await;
    let check = check.lock().unwrap();
    assert!(
        check.violations.is_empty(),
        "per-key order broken: {:?}",
        &check.violations[..check.violations.len().min(10)]
    );
    assert_eq!(check.accepted.len() as u64, COUNT, "every call accepted");
    assert!(
        most_before_kill >= 8,
        "calls of one partition should be in flight together; at most {most_before_kill} were"
    );
    assert!(app.most_in_progress() <= 16, "max_in_flight exceeded");
    // Retries happened: the failed first attempts were tried again.
    let retried = app.receipts().iter().filter(|r| r.attempt > 1).count();
    assert!(retried > 0, "no call was retried");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_ordering_delivers_one_call_of_a_partition_at_a_time() {
    const COUNT: u64 = 300;
    let kafka = Tansu::start();
    kafka.create_topic(INPUT, 1).await;
    let check = Arc::new(Mutex::new(OrderCheck::default()));
    let app_check = check.clone();
    let app = TestApp::start_with_latency(Duration::from_millis(2), move |receipt| {
        let (key, seq) = key_and_seq(receipt);
        app_check.lock().unwrap().accept(1, key, seq);
        (200, b"{}".to_vec(), Vec::new())
    })
    .await;
    let config = flow_config(&kafka, &app.url, "ordering = \"partition\"");
    let relay = RelayProcess::start(&config, &[]);
    kafka.produce(INPUT, keyed_calls(COUNT)).await;
    relay
        .wait_for("every call", Duration::from_secs(120), || {
            check.lock().unwrap().accepted.len() as u64 >= COUNT
        })
        .await;
    assert!(check.lock().unwrap().violations.is_empty());
    assert_eq!(app.most_in_progress(), 1);
    // In offset order overall, not only per key.
    let order: Vec<(u64, u64)> = app.receipts().iter().map(key_and_seq).collect();
    let offsets: Vec<u64> = order.iter().map(|(k, s)| s * KEYS + k).collect();
    assert!(offsets.is_sorted(), "calls out of offset order");
}
