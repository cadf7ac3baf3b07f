//! Sidecar flows end to end: the real `wasmrelay` binary, a real Kafka
//! broker (tansu), a real HTTP application, the real example plugins.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::app::{Receipt, TestApp};
use support::relay::{RelayProcess, free_port};
use support::tansu::{ConsumedRecord, Tansu, TestRecord};

use wasmrelay_test_support as support;

pub(crate) const INPUT: &str = "service-calls";
pub(crate) const OUTPUT: &str = "data-returns";
const DLQ: &str = "service-calls.dlq";

/// A relay config with one flow `orders`; `extra_flows` are appended as is.
pub(crate) fn config(kafka: &Tansu, app_url: &str, service_call: &str, extra: &str) -> String {
    let plugins = support::plugins_dist().display().to_string();
    format!(
        r#"
shutdown_grace = "20s"
[node]
id = "test-node"
[admin]
listen = "127.0.0.1:0"
[plugins]
dir = "{plugins}"
call_deadline = "100ms"
[plugins.config.json-enrich]
field = "handled_by"
value = "wasmrelay-test"
[plugins.config.mask-fields]
fields = "card_number"
[links.main]
bootstrap_servers = "{bootstrap}"
[links.main.options]
# tansu answers every fetch after about fetch.wait.max.ms; resuming inside a
# multi-record batch skips records there, so write one record per batch.
"fetch.wait.max.ms" = "10"
"batch.num.messages" = "1"
"session.timeout.ms" = "6000"
"heartbeat.interval.ms" = "500"
"max.poll.interval.ms" = "10000"

[[flows]]
name = "orders"
link = "main"
input_topic = "{INPUT}"
service_call = [{service_call}]
data_return = ["mask-fields"]
output_topic = "{OUTPUT}"
dead_letter_topic = "{DLQ}"
retry = {{ initial_backoff = "10ms", max_backoff = "100ms", budget = "20s" }}
[flows.deliver.app]
url = "{app_url}"
timeout = "5s"
{extra}
"#,
        bootstrap = kafka.bootstrap(),
    )
}

fn value_json(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes)
        .unwrap_or_else(|e| panic!("not JSON: {e}: {}", String::from_utf8_lossy(bytes)))
}

pub(crate) fn header_str(record: &ConsumedRecord, name: &str) -> String {
    String::from_utf8(
        record
            .header(name)
            .unwrap_or_else(|| panic!("no header {name}"))
            .to_vec(),
    )
    .unwrap()
}

/// The application of these tests answers with a data-return that carries
/// a card number (for mask-fields) and the delivery it answers.
fn answer_ok(receipt: &Receipt) -> (u16, Vec<u8>, Vec<(String, String)>) {
    let body = json!({"answer_to": receipt.delivery_id, "card_number": "4111111111111111"});
    (
        200,
        body.to_string().into_bytes(),
        vec![("x-kafka-header-app".into(), "test-app".into())],
    )
}

fn inputs(count: usize) -> Vec<TestRecord> {
    (0..count)
        .map(|n| {
            TestRecord::keyed(format!("key-{}", n % 97), json!({"n": n}).to_string())
                .header("traceparent", format!("00-{n:032x}-{:016x}-01", n))
        })
        .collect()
}

/// The full sha256 of a built example plugin: the version a dead letter names.
fn plugin_sha(name: &str) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(support::plugin_bytes(name)))
}

fn n_of(receipt: &Receipt) -> u64 {
    value_json(&receipt.body)["n"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_calls_reach_the_app_once_and_return_with_correlation() {
    const COUNT: usize = 10_000;
    let kafka = Tansu::start();
    kafka.create_topic(INPUT, 3).await;
    let app = TestApp::start(answer_ok).await;
    let relay = RelayProcess::start(&config(&kafka, &app.url, r#""json-enrich""#, ""), &[]);
    let produced = kafka.produce(INPUT, inputs(COUNT)).await;
    assert_eq!(produced.len(), COUNT);

    let returns = kafka
        .consume_all(OUTPUT, COUNT, Duration::from_secs(180))
        .await;
    assert_eq!(
        returns.len(),
        COUNT,
        "data-returns missing; relay log:\n{}",
        relay.log()
    );

    // Every input reached the application exactly once, enriched by json-enrich.
    let receipts = app.receipts();
    assert_eq!(
        receipts.len(),
        COUNT,
        "the app got duplicates or missed calls"
    );
    let ids: HashSet<&str> = receipts.iter().map(|r| r.delivery_id.as_str()).collect();
    assert_eq!(ids.len(), COUNT);
    let ns: HashSet<u64> = receipts.iter().map(n_of).collect();
    assert_eq!(ns.len(), COUNT);
    for receipt in &receipts {
        let body = value_json(&receipt.body);
        assert_eq!(
            body["handled_by"], "wasmrelay-test",
            "json-enrich not applied: {body}"
        );
        assert_eq!(
            receipt
                .headers
                .get("x-kafka-header-x-enriched-by")
                .map(String::as_str),
            Some("wasmrelay-test")
        );
        assert!(
            receipt
                .headers
                .get("traceparent")
                .is_some_and(|t| t.starts_with("00-")),
            "traceparent not carried"
        );
        assert!(
            receipt
                .key
                .as_deref()
                .is_some_and(|k| k.starts_with("key-"))
        );
    }

    // Every data-return carries its correlation headers, masked by mask-fields.
    let by_id: HashMap<&str, &Receipt> = receipts
        .iter()
        .map(|r| (r.delivery_id.as_str(), r))
        .collect();
    for record in &returns {
        let id = header_str(record, "wasmrelay-delivery-id");
        let receipt = by_id
            .get(id.as_str())
            .unwrap_or_else(|| panic!("data-return for unknown delivery {id}"));
        let (topic, partition, offset) = (
            header_str(record, "wasmrelay-origin-topic"),
            header_str(record, "wasmrelay-origin-partition"),
            header_str(record, "wasmrelay-origin-offset"),
        );
        assert_eq!(format!("{topic}/{partition}/{offset}"), id);
        assert_eq!(
            record.header("wasmrelay-origin-key").map(<[u8]>::to_vec),
            receipt.key.clone().map(String::into_bytes)
        );
        assert_eq!(
            record.key.as_deref(),
            receipt.key.as_deref().map(str::as_bytes)
        );
        let value = value_json(record.value.as_deref().unwrap());
        assert_eq!(value["answer_to"], json!(id));
        assert_eq!(
            value["card_number"], "***",
            "mask-fields not applied: {value}"
        );
        assert_eq!(header_str(record, "app"), "test-app");
        assert_eq!(
            header_str(record, "traceparent"),
            receipt.headers["traceparent"]
        );
    }

    assert!(
        kafka
            .consume_all(DLQ, 1, Duration::from_millis(500))
            .await
            .is_empty()
    );
    let committed_ok = || async {
        kafka.committed_offsets("wasmrelay-orders", INPUT).await
            == kafka.high_watermarks(INPUT).await
    };
    let started = Instant::now();
    while !committed_ok().await {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "offsets not committed to the end"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        relay.metric(r#"wasmrelay_messages_delivered_total{flow="orders"}"#),
        COUNT as u64
    );
    assert_eq!(
        relay.metric(r#"wasmrelay_messages_returned_total{flow="orders"}"#),
        COUNT as u64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn app_errors_are_retried_or_dead_lettered_and_nothing_is_missing() {
    const COUNT: usize = 600;
    let kafka = Tansu::start();
    kafka.create_topic(INPUT, 3).await;
    // n % 10 == 0: 500 twice, then fine. n % 10 == 5: 400 always.
    let app = TestApp::start(|receipt| {
        let n = n_of(receipt);
        if n.is_multiple_of(10) && receipt.attempt <= 2 {
            (500, b"try again".to_vec(), vec![])
        } else if n % 10 == 5 {
            (400, format!("bad order {n}").into_bytes(), vec![])
        } else {
            answer_ok(receipt)
        }
    })
    .await;
    let relay = RelayProcess::start(&config(&kafka, &app.url, r#""json-enrich""#, ""), &[]);
    kafka.produce(INPUT, inputs(COUNT)).await;

    let rejected = COUNT / 10;
    let returns = kafka
        .consume_all(OUTPUT, COUNT - rejected, Duration::from_secs(120))
        .await;
    let dead = kafka
        .consume_all(DLQ, rejected, Duration::from_secs(60))
        .await;
    assert_eq!(
        returns.len(),
        COUNT - rejected,
        "relay log:\n{}",
        relay.log()
    );
    assert_eq!(dead.len(), rejected);

    // Retried ones were delivered on their third attempt.
    let receipts = app.receipts();
    let retried: Vec<&Receipt> = receipts
        .iter()
        .filter(|r| n_of(r).is_multiple_of(10))
        .collect();
    assert_eq!(
        retried.iter().filter(|r| r.attempt == 3).count(),
        COUNT / 10
    );
    assert!(retried.iter().all(|r| r.attempt <= 3));
    // Rejected ones were tried once and dead-lettered with the reason.
    let mut dead_ns = HashSet::new();
    for record in &dead {
        assert_eq!(header_str(record, "wasmrelay-dlq-stage"), "app");
        let reason = header_str(record, "wasmrelay-dlq-reason");
        assert!(
            reason.contains("400") && reason.contains("bad order"),
            "{reason}"
        );
        assert_eq!(header_str(record, "wasmrelay-dlq-flow"), "orders");
        assert!(
            header_str(record, "wasmrelay-dlq-time-ms")
                .parse::<u64>()
                .is_ok()
        );
        assert!(record.header("wasmrelay-origin-offset").is_some());
        let n = value_json(record.value.as_deref().unwrap())["n"]
            .as_u64()
            .unwrap();
        assert_eq!(n % 10, 5);
        dead_ns.insert(n);
    }
    assert_eq!(dead_ns.len(), rejected);
    // Nothing else is missing: every input is a data-return or a dead letter.
    let returned_ids: HashSet<String> = returns
        .iter()
        .map(|r| header_str(r, "wasmrelay-delivery-id"))
        .collect();
    let dead_ids: HashSet<String> = dead
        .iter()
        .map(|r| header_str(r, "wasmrelay-delivery-id"))
        .collect();
    assert_eq!(returned_ids.len() + dead_ids.len(), COUNT);
    assert!(returned_ids.is_disjoint(&dead_ids));
    assert!(relay.metric(r#"wasmrelay_retries_total{flow="orders"}"#) >= 2 * (COUNT / 10) as u64);
    assert_eq!(
        relay.metric(r#"wasmrelay_messages_dead_lettered_total{flow="orders"}"#),
        rejected as u64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_too_large_for_kafka_is_dead_lettered_without_it_and_the_partition_goes_on() {
    const COUNT: usize = 20;
    let kafka = Tansu::start();
    kafka.create_topic(INPUT, 1).await;
    // n == 3: a 2 MB answer, over librdkafka's message.max.bytes (1 MB),
    // for the data-return and for a dead letter carrying it.
    let app = TestApp::start(|receipt| {
        if n_of(receipt) == 3 {
            let body = json!({"n": 3, "pad": "x".repeat(2_000_000)});
            (200, body.to_string().into_bytes(), vec![])
        } else {
            answer_ok(receipt)
        }
    })
    .await;
    // mask-fields reads the 2 MB answer on the data-return chain: on a
    // loaded machine that takes longer than the tests' 100 ms deadline (seen
    // in a full run: dead-lettered at stage `plugin:mask-fields`), which is
    // not what this test is about.
    let config = config(&kafka, &app.url, r#""json-enrich""#, "")
        .replace(r#"call_deadline = "100ms""#, r#"call_deadline = "5s""#);
    let relay = RelayProcess::start(&config, &[]);
    kafka.produce(INPUT, inputs(COUNT)).await;
    let returns = kafka
        .consume_all(OUTPUT, COUNT - 1, Duration::from_secs(60))
        .await;
    let dead = kafka.consume_all(DLQ, 1, Duration::from_secs(60)).await;
    assert_eq!(returns.len(), COUNT - 1, "relay log:\n{}", relay.log());
    assert_eq!(dead.len(), 1, "relay log:\n{}", relay.log());
    let dead = &dead[0];
    assert_eq!(header_str(dead, "wasmrelay-dlq-stage"), "produce");
    assert!(
        header_str(dead, "wasmrelay-dlq-reason").contains("too large"),
        "{}",
        header_str(dead, "wasmrelay-dlq-reason")
    );
    let dropped = header_str(dead, "wasmrelay-dlq-dropped");
    assert!(
        dropped.contains("too large for the dead-letter topic"),
        "{dropped}"
    );
    assert_eq!(dead.value.as_deref(), Some(&[][..]));
    assert_eq!(header_str(dead, "wasmrelay-origin-offset"), "3");
    // The partition went on: every input committed.
    let started = Instant::now();
    while kafka.committed_offsets("wasmrelay-orders", INPUT).await
        != BTreeMap::from([(0, COUNT as i64)])
    {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the commit stopped at {:?}",
            kafka.committed_offsets("wasmrelay-orders", INPUT).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_trap_and_timeout_dead_letter_the_message_and_the_flow_goes_on() {
    let kafka = Tansu::start();
    kafka.create_topic(INPUT, 1).await;
    kafka.create_topic("loop-in", 1).await;
    let app = TestApp::start(answer_ok).await;
    let looping_flow = r#"
[[flows]]
name = "looping"
link = "main"
input_topic = "loop-in"
service_call = ["fault-loop"]
output_topic = "loop-out"
dead_letter_topic = "loop-in.dlq"
"#;
    let relay = RelayProcess::start(
        &config(
            &kafka,
            &app.url,
            r#""json-enrich", "fault-panic""#,
            looping_flow,
        ),
        &[],
    );
    kafka.produce(INPUT, inputs(20)).await;
    kafka.produce("loop-in", inputs(5)).await;

    let trapped = kafka.consume_all(DLQ, 20, Duration::from_secs(60)).await;
    assert_eq!(trapped.len(), 20, "relay log:\n{}", relay.log());
    for record in &trapped {
        assert_eq!(
            header_str(record, "wasmrelay-dlq-stage"),
            format!("plugin:fault-panic@{}", plugin_sha("fault-panic"))
        );
        assert!(header_str(record, "wasmrelay-dlq-reason").contains("deliberate panic"));
        // The dead letter is the input as consumed, ready to be replayed.
        let value = value_json(record.value.as_deref().unwrap());
        assert!(
            value["n"].is_u64() && value.get("handled_by").is_none(),
            "{value}"
        );
    }
    let timed_out = kafka
        .consume_all("loop-in.dlq", 5, Duration::from_secs(60))
        .await;
    assert_eq!(timed_out.len(), 5);
    for record in &timed_out {
        assert_eq!(
            header_str(record, "wasmrelay-dlq-stage"),
            format!("plugin:fault-loop@{}", plugin_sha("fault-loop"))
        );
        assert!(
            header_str(record, "wasmrelay-dlq-reason").contains("deadline"),
            "{}",
            header_str(record, "wasmrelay-dlq-reason")
        );
    }
    assert_eq!(
        app.count(),
        0,
        "nothing should reach the app past a trapping plugin"
    );
    // The flows went on to the end of their input.
    let started = Instant::now();
    while kafka.committed_offsets("wasmrelay-orders", INPUT).await != BTreeMap::from([(0, 20)])
        || kafka
            .committed_offsets("wasmrelay-looping", "loop-in")
            .await
            != BTreeMap::from([(0, 5)])
    {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "flows did not commit to the end"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_stream_loses_nothing_and_never_commits_past_unfinished_work() {
    const COUNT: usize = 3_000;
    let kafka = Tansu::start();
    kafka.create_topic(INPUT, 3).await;
    let app = TestApp::start(answer_ok).await;
    let config = config(&kafka, &app.url, r#""json-enrich""#, "");
    let mut relay = RelayProcess::start(&config, &[]);
    kafka.produce(INPUT, inputs(COUNT)).await;
    relay
        .wait_for("a third of the calls", Duration::from_secs(120), || {
            app.count() >= COUNT / 3
        })
        .await;
    relay.sigkill();

    // What was committed at the kill: everything below must be finished,
    // i.e. have its data-return on the output topic.
    let committed = kafka.committed_offsets("wasmrelay-orders", INPUT).await;
    let returned_before = kafka
        .consume_all(OUTPUT, COUNT, Duration::from_secs(3))
        .await;
    let finished: HashSet<String> = returned_before
        .iter()
        .map(|r| header_str(r, "wasmrelay-delivery-id"))
        .collect();
    for (partition, position) in &committed {
        for offset in 0..*position {
            let id = format!("{INPUT}/{partition}/{offset}");
            assert!(
                finished.contains(&id),
                "offset {id} was committed but its data-return is missing"
            );
        }
    }

    // A killed member leaves no LeaveGroup behind: the broker hands its
    // partitions out again only once its session (6 s here) has expired.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let relay = RelayProcess::start(&config, &[]);
    relay
        .wait_for(
            "every call delivered after the restart",
            Duration::from_secs(180),
            || app.distinct_deliveries() >= COUNT,
        )
        .await;
    let receipts = app.receipts();
    // At least once: every input delivered; a duplicate is the same message
    // under the same delivery id.
    let mut by_id: HashMap<String, u64> = HashMap::new();
    for receipt in &receipts {
        let n = n_of(receipt);
        if let Some(previous) = by_id.insert(receipt.delivery_id.clone(), n) {
            assert_eq!(
                previous, n,
                "delivery id {} carried two different messages",
                receipt.delivery_id
            );
        }
    }
    assert_eq!(by_id.len(), COUNT);
    assert_eq!(by_id.values().collect::<HashSet<_>>().len(), COUNT);
    // Every input has a data-return; some have two (delivered again after
    // the kill), so read until every delivery id is there.
    let started = Instant::now();
    let returned = loop {
        // At most one return per receipt; a call killed before its return
        // was produced has none, so do not wait long for the last few.
        let returns = kafka
            .consume_all(OUTPUT, receipts.len(), Duration::from_secs(3))
            .await;
        let returned: HashSet<String> = returns
            .iter()
            .map(|r| header_str(r, "wasmrelay-delivery-id"))
            .collect();
        if returned.len() == COUNT || started.elapsed() > Duration::from_secs(60) {
            break returned;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(returned.len(), COUNT, "relay log:\n{}", relay.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_finishes_in_flight_work_and_exits_0() {
    const COUNT: usize = 2_000;
    let kafka = Tansu::start();
    kafka.create_topic(INPUT, 3).await;
    let app = TestApp::start(|receipt| {
        std::thread::sleep(Duration::from_millis(2));
        answer_ok(receipt)
    })
    .await;
    let config = config(&kafka, &app.url, r#""json-enrich""#, "");
    let mut relay = RelayProcess::start(&config, &[]);
    kafka.produce(INPUT, inputs(COUNT)).await;
    relay
        .wait_for("some calls", Duration::from_secs(120), || {
            app.count() >= 300
        })
        .await;
    relay.sigterm();
    let status = relay.wait(Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "relay log:\n{}", relay.log());
    assert!(relay.log().contains("relay stopped"));

    // Everything the app answered before the exit has its data-return.
    let delivered: HashSet<String> = app
        .receipts()
        .iter()
        .map(|r| r.delivery_id.clone())
        .collect();
    let returns = kafka
        .consume_all(OUTPUT, delivered.len(), Duration::from_secs(10))
        .await;
    let returned: HashSet<String> = returns
        .iter()
        .map(|r| header_str(r, "wasmrelay-delivery-id"))
        .collect();
    let lost: Vec<&String> = delivered.difference(&returned).collect();
    assert!(lost.is_empty(), "delivered but not returned: {lost:?}");
    // Nothing is committed past unfinished work: every offset below a
    // partition's commit has its data-return. (With key ordering, calls of
    // other keys may have finished beyond the first unfinished one; those
    // are delivered again under the same delivery id.)
    let committed = kafka.committed_offsets("wasmrelay-orders", INPUT).await;
    for (partition, position) in &committed {
        let missing: Vec<i64> = (0..*position)
            .filter(|offset| !returned.contains(&format!("{INPUT}/{partition}/{offset}")))
            .collect();
        assert!(
            missing.is_empty(),
            "partition {partition} committed to {position} past unfinished offsets {missing:?}\nrelay log:\n{}",
            relay.log()
        );
    }
    let committed_total: i64 = committed.values().sum();
    assert!(
        committed_total as usize <= returned.len() && committed_total > 0,
        "committed {committed_total} of {} finished",
        returned.len()
    );
    let relay = RelayProcess::start(&config, &[]);
    relay
        .wait_for(
            "the rest after the restart",
            Duration::from_secs(120),
            || app.distinct_deliveries() >= COUNT,
        )
        .await;
}

/// A relay with one transform flow from `raw` to `cooked` (dead letters to
/// `raw.dlq`); `flow` adds the flow's name, chains and settings, and may
/// end with more tables. json-enrich adds `"stage": "transformed"`.
fn transform_config(kafka: &Tansu, flow: &str) -> String {
    let plugins = support::plugins_dist().display().to_string();
    format!(
        r#"
[admin]
listen = "127.0.0.1:0"
[plugins]
dir = "{plugins}"
call_deadline = "5s"
[plugins.config.json-enrich]
field = "stage"
value = "transformed"
[links.main]
bootstrap_servers = "{}"
[links.main.options]
"fetch.wait.max.ms" = "10"
[[flows]]
link = "main"
input_topic = "raw"
output_topic = "cooked"
dead_letter_topic = "raw.dlq"
{flow}"#,
        kafka.bootstrap()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transform_flow_processes_into_the_output_topic_without_an_app() {
    let kafka = Tansu::start();
    kafka.create_topic("raw", 2).await;
    let config = transform_config(
        &kafka,
        r#"
name = "transform"
service_call = ["json-enrich"]
data_return = ["mask-fields"]
[plugins.config.mask-fields]
fields = "secret"
"#,
    );
    let relay = RelayProcess::start(&config, &[]);
    let records: Vec<TestRecord> = (0..100)
        .map(|n| {
            TestRecord::keyed(
                format!("k{n}"),
                json!({"n": n, "secret": "s3cret"}).to_string(),
            )
        })
        .collect();
    kafka.produce("raw", records).await;
    let cooked = kafka
        .consume_all("cooked", 100, Duration::from_secs(60))
        .await;
    assert_eq!(cooked.len(), 100, "relay log:\n{}", relay.log());
    let mut ns = HashSet::new();
    for record in &cooked {
        let value = value_json(record.value.as_deref().unwrap());
        assert_eq!(value["stage"], "transformed");
        assert_eq!(value["secret"], "***");
        assert!(record.header("wasmrelay-delivery-id").is_some());
        ns.insert(value["n"].as_u64().unwrap());
    }
    assert_eq!(ns.len(), 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_signal_exits_at_once() {
    let kafka = Tansu::start();
    kafka.create_topic(INPUT, 1).await;
    // An app that never answers in time: the first SIGTERM waits for the
    // grace period (20 s); the second must not.
    let app = TestApp::start(|receipt| {
        std::thread::sleep(Duration::from_secs(3));
        answer_ok(receipt)
    })
    .await;
    let mut relay = RelayProcess::start(&config(&kafka, &app.url, r#""json-enrich""#, ""), &[]);
    kafka.produce(INPUT, inputs(5)).await;
    relay
        .wait_for("a call in flight", Duration::from_secs(30), || {
            app.count() >= 1
        })
        .await;
    relay.sigterm();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    relay.sigterm();
    let status = relay.wait(Duration::from_secs(10));
    assert_eq!(status.code(), Some(130), "relay log:\n{}", relay.log());
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_example_runs_as_is_with_the_example_app() {
    let kafka = Tansu::start();
    kafka.create_topic(INPUT, 3).await;
    let app_port = free_port();
    let mut app = std::process::Command::new("python3")
        .arg(support::repo_root().join("examples/sidecar/app.py"))
        .args(["--port", &app_port.to_string()])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("python3 runs the example app");
    let example =
        std::fs::read_to_string(support::repo_root().join("examples/sidecar/relay.toml")).unwrap();
    let bootstrap = kafka.bootstrap();
    let app_url = format!("http://127.0.0.1:{app_port}/calls");
    let plugins = support::plugins_dist().display().to_string();
    let relay = RelayProcess::start(
        &example,
        &[
            ("KAFKA_BOOTSTRAP", bootstrap.as_str()),
            ("APP_URL", app_url.as_str()),
            ("ADMIN_ADDR", "127.0.0.1:0"),
            ("PLUGINS_DIR", plugins.as_str()),
        ],
    );
    let orders: Vec<TestRecord> = (0..30)
        .map(|n| {
            TestRecord::keyed(
                format!("c{n}"),
                json!({"order": n, "quantity": n % 10}).to_string(),
            )
        })
        .collect();
    kafka.produce(INPUT, orders).await;
    let returns = kafka.consume_all(OUTPUT, 27, Duration::from_secs(60)).await;
    let dead = kafka.consume_all(DLQ, 3, Duration::from_secs(30)).await;
    let _ = app.kill();
    let _ = app.wait();
    assert_eq!(
        (returns.len(), dead.len()),
        (27, 3),
        "relay log:\n{}",
        relay.log()
    );
    for record in &returns {
        let value = value_json(record.value.as_deref().unwrap());
        assert_eq!(value["status"], "accepted");
        assert_eq!(value["card_number"], "***");
        assert_eq!(header_str(record, "handled-by"), "example-app");
    }
}

/// The flow's gauges say where unfinished records are, for an operator
/// asking why a relay is behind: held at an unreachable application
/// (`wasmrelay_messages_in_progress`), or answered and waiting for a frozen
/// broker to acknowledge their data-returns (`wasmrelay_messages_awaiting_ack`);
/// both are back at zero once everything is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_flow_gauges_show_records_held_at_the_app_and_awaiting_kafka() {
    const COUNT: usize = 100;
    let kafka = Tansu::start();
    kafka.create_topic(INPUT, 3).await;
    let app = TestApp::start(answer_ok).await;
    let app_proxy = support::fault_proxy::FaultProxy::to(
        app.url
            .trim_start_matches("http://")
            .trim_end_matches("/calls")
            .parse()
            .unwrap(),
    );
    let app_url = format!("http://{}/calls", app_proxy.addr());
    let relay = RelayProcess::start(&config(&kafka, &app_url, r#""json-enrich""#, ""), &[]);
    let in_progress = || relay.metric(r#"wasmrelay_messages_in_progress{flow="orders"}"#);
    let awaiting_ack = || relay.metric(r#"wasmrelay_messages_awaiting_ack{flow="orders"}"#);

    app_proxy.cut();
    kafka.produce(INPUT, inputs(COUNT)).await;
    relay
        .wait_for(
            "records held at the unreachable app",
            Duration::from_secs(30),
            || in_progress() > 0,
        )
        .await;
    assert_eq!(awaiting_ack(), 0, "nothing was answered yet");

    kafka.freeze();
    app_proxy.restore();
    let answered_while_frozen = Instant::now();
    while awaiting_ack() == 0 && answered_while_frozen.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seen_awaiting = awaiting_ack();
    let seen_in_progress = in_progress();
    kafka.thaw();
    assert!(
        seen_awaiting > 0 && seen_in_progress >= seen_awaiting,
        "answers waiting for the frozen broker: awaiting_ack {seen_awaiting}, in_progress {seen_in_progress}\n{}",
        relay.log()
    );

    relay
        .wait_for("every call answered", Duration::from_secs(60), || {
            app.distinct_deliveries() >= COUNT
        })
        .await;
    relay
        .wait_for("both gauges back at zero", Duration::from_secs(30), || {
            in_progress() == 0 && awaiting_ack() == 0
        })
        .await;
}

/// A transform flow takes the ready records of a partition in batches (one
/// plugin call for many records): each key's records still come out in the
/// order they went in, a record the plugin refuses is dead-lettered alone
/// with its reason while the records batched with it go on, nothing is
/// lost or written twice, and the commit reaches the end of every partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transform_flow_in_batches_keeps_each_key_in_order_and_dead_letters_only_the_bad_records()
{
    const COUNT: u64 = 3_000;
    const KEYS: u64 = 50;
    let kafka = Tansu::start();
    kafka.create_topic("raw", 3).await;
    let config = transform_config(
        &kafka,
        r#"
name = "batches"
group = "transform-batches"
max_in_flight = 256
service_call = ["passthrough", "json-enrich"]
"#,
    );
    // Every 10th record is not JSON: json-enrich dead-letters it.
    let records: Vec<TestRecord> = (0..COUNT)
        .map(|n| {
            let key = format!("k{}", n % KEYS);
            let seq = n / KEYS;
            if n % 10 == 9 {
                TestRecord::keyed(key, format!("not json {n}"))
            } else {
                TestRecord::keyed(key, json!({"n": n, "seq": seq}).to_string())
            }
        })
        .collect();
    // Produced before the relay starts, so that its first fetches find
    // whole partitions ready and the batches are large.
    kafka.produce("raw", records).await;
    let relay = RelayProcess::start(&config, &[]);
    let (cooked, dead) = cooked_and_dead(&kafka, COUNT, &relay).await;

    // Each key's records in order: the output of a key is in one partition.
    let mut cooked = cooked;
    cooked.sort_by_key(|r| (r.partition, r.offset));
    let mut last_seq: HashMap<String, u64> = HashMap::new();
    let mut seen = HashSet::new();
    for record in &cooked {
        let value = value_json(record.value.as_deref().unwrap());
        assert_eq!(value["stage"], "transformed");
        let key = String::from_utf8(record.key.clone().unwrap()).unwrap();
        let seq = value["seq"].as_u64().unwrap();
        if let Some(previous) = last_seq.insert(key.clone(), seq) {
            assert!(seq > previous, "key {key}: seq {seq} after {previous}");
        }
        assert!(
            seen.insert(value["n"].as_u64().unwrap()),
            "written twice: {value}"
        );
    }
    for record in &dead {
        let value = String::from_utf8(record.value.clone().unwrap()).unwrap();
        assert!(value.starts_with("not json "), "{value}");
        let stage =
            String::from_utf8(record.header("wasmrelay-dlq-stage").unwrap().to_vec()).unwrap();
        assert!(stage.starts_with("plugin:json-enrich@"), "{stage}");
        let reason =
            String::from_utf8(record.header("wasmrelay-dlq-reason").unwrap().to_vec()).unwrap();
        assert!(reason.contains("not a JSON object"), "{reason}");
    }

    // The batches were real: far fewer plugin calls than records.
    let calls = relay.metric(r#"wasmrelay_plugin_call_seconds_count{plugin="json-enrich"}"#);
    assert!(
        calls < COUNT / 4,
        "{calls} json-enrich calls for {COUNT} records: not batched"
    );

    commit_reaches(&kafka, "transform-batches", "raw", COUNT, &relay).await;
}

/// A transform flow's batch is enqueued as one group: an output Kafka
/// refuses (here larger than the link's `message.max.bytes`) is
/// dead-lettered alone at stage `produce` (without its message, which is
/// too large for the dead-letter topic too), the records enqueued with it
/// are written, and the commit reaches the end of every partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transform_output_kafka_refuses_is_dead_lettered_alone_and_its_batch_goes_on() {
    const COUNT: u64 = 300;
    let kafka = Tansu::start();
    kafka.create_topic("raw", 3).await;
    let config = transform_config(
        &kafka,
        r#"
name = "refusals"
group = "transform-refusals"
service_call = ["json-enrich"]
"#,
    )
    .replace(
        r#""fetch.wait.max.ms" = "10""#,
        r#""fetch.wait.max.ms" = "10"
"message.max.bytes" = "2000""#,
    );
    // Every 10th record is larger than the relay may produce.
    let records: Vec<TestRecord> = (0..COUNT)
        .map(|n| {
            let pad = if n % 10 == 7 { 3_000 } else { 10 };
            TestRecord::keyed(
                format!("k{}", n % 30),
                json!({"n": n, "pad": "x".repeat(pad)}).to_string(),
            )
        })
        .collect();
    // Produced before the relay starts: its batches are large.
    kafka.produce("raw", records).await;
    let relay = RelayProcess::start(&config, &[]);
    let (cooked, dead) = cooked_and_dead(&kafka, COUNT, &relay).await;
    let mut seen = HashSet::new();
    for record in &cooked {
        let value = value_json(record.value.as_deref().unwrap());
        assert_eq!(value["stage"], "transformed");
        let n = value["n"].as_u64().unwrap();
        assert_ne!(n % 10, 7, "a record over the limit was written: {n}");
        assert!(seen.insert(n), "written twice: {n}");
    }
    let mut dead_offsets = HashSet::new();
    for record in &dead {
        assert_eq!(header_str(record, "wasmrelay-dlq-stage"), "produce");
        let reason = header_str(record, "wasmrelay-dlq-reason");
        assert!(reason.contains("too large"), "{reason}");
        assert!(
            header_str(record, "wasmrelay-dlq-dropped").contains("too large"),
            "the message is dropped from the dead letter"
        );
        assert!(dead_offsets.insert(header_str(record, "wasmrelay-delivery-id")));
    }
    assert_eq!(
        relay.metric(r#"wasmrelay_messages_dead_lettered_total{flow="refusals"}"#),
        COUNT / 10
    );
    commit_reaches(&kafka, "transform-refusals", "raw", COUNT, &relay).await;
}

/// Waits (up to a minute) until `group`'s commits on `topic` add up to
/// `count` records (the end of every partition of a topic filled with
/// `count`).
async fn commit_reaches(kafka: &Tansu, group: &str, topic: &str, count: u64, relay: &RelayProcess) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let committed = kafka.committed_offsets(group, topic).await;
        if committed.values().sum::<i64>() == count as i64 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the commit stopped short of the end: {committed:?}\nrelay log:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Reads what a transform flow over `count` records wrote, one in ten of
/// them dead-lettered: the outputs (`cooked`) and the dead letters
/// (`raw.dlq`), each checked complete.
async fn cooked_and_dead(
    kafka: &Tansu,
    count: u64,
    relay: &RelayProcess,
) -> (Vec<ConsumedRecord>, Vec<ConsumedRecord>) {
    let cooked = kafka
        .consume_all(
            "cooked",
            (count - count / 10) as usize,
            Duration::from_secs(120),
        )
        .await;
    let dead = kafka
        .consume_all("raw.dlq", (count / 10) as usize, Duration::from_secs(60))
        .await;
    assert_eq!(
        cooked.len() as u64,
        count - count / 10,
        "relay log:\n{}",
        relay.log()
    );
    assert_eq!(dead.len() as u64, count / 10, "relay log:\n{}", relay.log());
    (cooked, dead)
}
