//! The `etcd` config-center backend against a real etcd: what it publishes
//! on reads, puts and deletes, while etcd is down, and when it comes back.

use std::collections::BTreeMap;
use std::time::Duration;

use support::etcd::Etcd;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use wasmrelay::center::etcd::{EtcdCenterOptions, start};
use wasmrelay::center::{CenterState, Reachability};

use crate::support;

const PREFIX: &str = "/wasmrelay/";

fn options(etcd: &Etcd) -> EtcdCenterOptions {
    EtcdCenterOptions {
        endpoints: vec![etcd.endpoint()],
        prefix: PREFIX.to_string(),
        user: None,
        tls: None,
    }
}

/// Waits until the published state satisfies `done`.
async fn wait_until(
    state: &mut watch::Receiver<CenterState>,
    what: &str,
    done: impl Fn(&CenterState) -> bool,
) -> CenterState {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let current = state.borrow_and_update().clone();
        if done(&current) {
            return current;
        }
        if tokio::time::timeout_at(deadline, state.changed())
            .await
            .is_err()
        {
            panic!("{what}: not seen within 20 s; last state {current:?}");
        }
    }
}

fn values(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[tokio::test]
async fn reads_the_prefix_then_follows_puts_and_deletes() {
    let etcd = Etcd::start();
    etcd.put("/wasmrelay/kafka.main", " one \n").await;
    etcd.put("/other/kafka.main", "not ours").await;
    let shutdown = CancellationToken::new();
    let tasks = TaskTracker::new();
    let center = start(options(&etcd), &tasks, shutdown.clone());
    let mut state = center.subscribe();

    let first = wait_until(&mut state, "the first read", |s| {
        s.reachability == Reachability::Reachable
    })
    .await;
    assert_eq!(first.values, values(&[("kafka.main", "one")]));

    etcd.put("/wasmrelay/kafka.backup", "two").await;
    wait_until(&mut state, "a put", |s| {
        s.values == values(&[("kafka.main", "one"), ("kafka.backup", "two")])
    })
    .await;
    etcd.delete("/wasmrelay/kafka.main").await;
    wait_until(&mut state, "a delete", |s| {
        s.values == values(&[("kafka.backup", "two")])
    })
    .await;
    // Quick flips end on the last value.
    for value in ["a", "b", "c", "d"] {
        etcd.put("/wasmrelay/kafka.backup", value).await;
    }
    wait_until(&mut state, "the last of quick flips", |s| {
        s.kafka_link("backup") == Some("d")
    })
    .await;
    shutdown.cancel();
    drop(center);
    tasks.close();
    tasks.wait().await;
}

#[tokio::test]
async fn etcd_down_keeps_the_last_values_and_a_change_after_it_is_back_is_seen() {
    let mut etcd = Etcd::start();
    etcd.put("/wasmrelay/kafka.main", "one").await;
    let shutdown = CancellationToken::new();
    let tasks = TaskTracker::new();
    let center = start(options(&etcd), &tasks, shutdown.clone());
    let mut state = center.subscribe();
    wait_until(&mut state, "the first read", |s| {
        s.kafka_link("main") == Some("one")
    })
    .await;

    etcd.stop();
    let down = wait_until(&mut state, "etcd reported unreachable", |s| {
        s.reachability != Reachability::Reachable
    })
    .await;
    assert_eq!(down.kafka_link("main"), Some("one"), "last values kept");

    etcd.restart();
    etcd.put("/wasmrelay/kafka.main", "two").await;
    let back = wait_until(&mut state, "the change after etcd is back", |s| {
        s.kafka_link("main") == Some("two")
    })
    .await;
    assert_eq!(back.reachability, Reachability::Reachable);
    shutdown.cancel();
    drop(center);
    tasks.close();
    tasks.wait().await;
}

#[tokio::test]
async fn a_center_started_before_etcd_reads_it_once_it_answers() {
    let mut etcd = Etcd::start();
    etcd.put("/wasmrelay/kafka.main", "one").await;
    etcd.stop();
    let shutdown = CancellationToken::new();
    let tasks = TaskTracker::new();
    let center = start(options(&etcd), &tasks, shutdown.clone());
    let mut state = center.subscribe();
    let initial = state.borrow_and_update().clone();
    assert!(
        matches!(initial.reachability, Reachability::Unreachable { .. }),
        "{initial:?}"
    );
    assert!(initial.values.is_empty());

    etcd.restart();
    wait_until(&mut state, "the read once etcd answers", |s| {
        s.reachability == Reachability::Reachable && s.kafka_link("main") == Some("one")
    })
    .await;
    shutdown.cancel();
    drop(center);
    tasks.close();
    tasks.wait().await;
}
