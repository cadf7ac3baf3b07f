//! Network faults under load, through a fault proxy between the relay and
//! what it talks to ([`support::fault_proxy`]): nothing is lost, and once
//! the fault ends nothing stays stuck (the commit reaches the end).

use std::collections::HashSet;
use std::time::Duration;

use serde_json::json;
use support::app::{Receipt, TestApp};
use support::relay::RelayProcess;
use support::tansu::{Tansu, TestRecord};

use crate::sidecar_flow::{INPUT, OUTPUT, config, header_str};
use wasmrelay_test_support as support;

fn answer(receipt: &Receipt) -> (u16, Vec<u8>, Vec<(String, String)>) {
    let body = json!({"answer_to": receipt.delivery_id});
    (200, body.to_string().into_bytes(), Vec::new())
}

fn numbered(range: std::ops::Range<usize>) -> Vec<TestRecord> {
    range
        .map(|n| TestRecord::keyed(format!("key-{}", n % 31), json!({"n": n}).to_string()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_network_cut_between_relay_and_broker_loses_nothing_and_the_commit_reaches_the_end() {
    const BEFORE: usize = 2_000;
    const AFTER: usize = 500;
    let kafka = Tansu::start_behind_proxy();
    kafka.create_topic(INPUT, 3).await;
    let app = TestApp::start(answer).await;
    let relay = RelayProcess::start(&config(&kafka, &app.url, r#""json-enrich""#, ""), &[]);
    kafka.produce(INPUT, numbered(0..BEFORE)).await;
    relay
        .wait_for("a quarter of the calls", Duration::from_secs(120), || {
            app.count() >= BEFORE / 4
        })
        .await;

    // Longer than the group session (6 s): the broker evicts the relay's
    // consumer meanwhile, and the data-returns in flight wait in the
    // producer.
    kafka.proxy().cut();
    tokio::time::sleep(Duration::from_secs(10)).await;
    kafka.proxy().restore();
    kafka.produce(INPUT, numbered(BEFORE..BEFORE + AFTER)).await;

    let total = BEFORE + AFTER;
    relay
        .wait_for(
            "every call delivered after the cut",
            Duration::from_secs(180),
            || app.distinct_deliveries() >= total,
        )
        .await;
    let returned = kafka
        .consume_all(OUTPUT, total * 2, Duration::from_secs(10))
        .await;
    let returned: HashSet<String> = returned
        .iter()
        .map(|r| header_str(r, "wasmrelay-delivery-id"))
        .collect();
    assert_eq!(returned.len(), total, "relay log:\n{}", relay.log());
    // Nothing stuck: every partition's commit reaches its end.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let committed = kafka.committed_offsets("wasmrelay-orders", INPUT).await;
        if committed.values().sum::<i64>() == i64::try_from(total).unwrap() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the commit stopped short of the end: {committed:?}\nrelay log:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
