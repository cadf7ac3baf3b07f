//! The relay against a plain consume-and-produce loop on the same broker.
//!
//! Starts a real broker (tansu) and, in one run:
//! 1. **Throughput**: 20,000 records of 1 KiB are consumed and produced to
//!    another topic by (a) a plain rdkafka loop in this process (consumer
//!    group, offsets stored after each acknowledgement, acknowledgements
//!    awaited concurrently; the same client settings as the relay's link)
//!    and (b) `wasmrelay run` with a transform flow through the `passthrough`
//!    plugin. Prints records per second of each and the ratio.
//! 2. **Latency**: records produced at a fixed rate carry their send time;
//!    one consumer reads the input topic directly, another reads the relay's
//!    output. Prints p50/p99 of both and what the relay adds.
//!
//! Run: `cargo bench -p wasmrelay --bench relay_throughput` (needs tansu:
//! `scripts/setup.sh`). Results go to bench/RESULTS.md.

#![allow(clippy::unwrap_used, clippy::print_stdout, missing_docs, dead_code)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use rdkafka::Message as _;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Header, Headers as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use support::relay::RelayProcess;
use support::tansu::{Tansu, TestRecord};
use wasmrelay::kafka::LinkInfo;

const RECORDS: usize = 20_000;
const VALUE_BYTES: usize = 1024;
const LATENCY_RATE: u64 = 500;
const LATENCY_SECONDS: u64 = 10;
const SENT_HEADER: &str = "bench-sent-ns";
/// Records of the first second are left out of the latency figures: the
/// readers' first fetches and connection set-up are not what is measured.
const WARM_UP_RECORDS: usize = LATENCY_RATE as usize;

/// The link settings both the relay and the plain loop use.
fn link(kafka: &Tansu) -> LinkInfo {
    LinkInfo {
        bootstrap_servers: kafka.bootstrap(),
        options: BTreeMap::from([
            ("fetch.wait.max.ms".to_string(), "10".to_string()),
            ("session.timeout.ms".to_string(), "6000".to_string()),
            ("heartbeat.interval.ms".to_string(), "500".to_string()),
        ]),
    }
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// The plain loop: consume, produce, store the offset when acknowledged.
async fn plain_loop(kafka: &Tansu, input: &str, output: &str, expected: usize) -> Duration {
    let info = link(kafka);
    let started = Instant::now();
    let consumer: StreamConsumer = info
        .consumer_config("bench-plain-loop", Duration::from_millis(500))
        .create()
        .unwrap();
    consumer.subscribe(&[input]).unwrap();
    let producer: FutureProducer = info.producer_config().create().unwrap();
    let mut acks = FuturesUnordered::new();
    let (mut consumed, mut acked) = (0usize, 0usize);
    while acked < expected {
        tokio::select! {
            message = consumer.recv(), if consumed < expected => {
                let message = message.unwrap();
                let mut record = FutureRecord::to(output);
                if let Some(key) = message.key() { record = record.key(key); }
                if let Some(value) = message.payload() { record = record.payload(value); }
                if let Some(headers) = message.headers() { record = record.headers(headers.detach()); }
                let ack = producer.send_result(record).map_err(|(e, _)| e).unwrap();
                let (partition, offset) = (message.partition(), message.offset());
                acks.push(async move { (ack.await, partition, offset) });
                consumed += 1;
            }
            Some((result, partition, offset)) = acks.next(), if !acks.is_empty() => {
                result.unwrap().unwrap();
                consumer.store_offset(input, partition, offset).unwrap();
                acked += 1;
            }
        }
    }
    started.elapsed()
}

fn relay_config(kafka: &Tansu) -> String {
    let plugins = support::plugins_dist().display();
    let bootstrap = kafka.bootstrap();
    let flow = |name: &str, input: &str, output: &str| {
        format!(
            "[[flows]]\nname = \"{name}\"\nlink = \"main\"\ninput_topic = \"{input}\"\nservice_call = [\"passthrough\"]\noutput_topic = \"{output}\"\ndead_letter_topic = \"{input}.dlq\"\n"
        )
    };
    format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n[plugins]\ndir = \"{plugins}\"\nwatch = false\n\
         [links.main]\nbootstrap_servers = \"{bootstrap}\"\n[links.main.options]\n\"fetch.wait.max.ms\" = \"10\"\n\
         \"session.timeout.ms\" = \"6000\"\n\"heartbeat.interval.ms\" = \"500\"\n{}{}",
        flow("throughput", "relay-in", "relay-out"),
        flow("latency", "lat-in", "lat-out"),
    )
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Reads `topic` from the beginning and records now - sent for each record.
fn latency_reader(
    kafka: &Tansu,
    topic: &str,
    expected: usize,
) -> tokio::task::JoinHandle<Vec<f64>> {
    let consumer: StreamConsumer = link(kafka)
        .admin_config()
        .set("group.id", "bench-latency")
        .create()
        .unwrap();
    let mut partitions = rdkafka::TopicPartitionList::new();
    for partition in 0..3 {
        partitions
            .add_partition_offset(topic, partition, rdkafka::Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&partitions).unwrap();
    // The handle is returned and awaited by `main`.
    #[allow(clippy::disallowed_methods)]
    tokio::spawn(async move {
        let mut latencies = Vec::with_capacity(expected);
        let mut read = 0;
        while read < expected {
            let message = consumer.recv().await.unwrap();
            read += 1;
            let n: usize = message
                .key()
                .and_then(|k| std::str::from_utf8(k).ok()?.strip_prefix('k')?.parse().ok())
                .expect("record without its number");
            if n < WARM_UP_RECORDS {
                continue;
            }
            let sent = message
                .headers()
                .and_then(|h| {
                    h.iter()
                        .find(|h| h.key == SENT_HEADER)
                        .and_then(|h| h.value.map(<[u8]>::to_vec))
                })
                .and_then(|v| String::from_utf8(v).ok()?.parse::<u128>().ok())
                .expect("record without its send time");
            latencies.push((now_ns() - sent) as f64 / 1e6);
        }
        latencies.sort_by(f64::total_cmp);
        latencies
    })
}

#[tokio::main]
async fn main() {
    let kafka = Tansu::start();
    for topic in ["plain-in", "relay-in", "lat-in"] {
        kafka.create_topic(topic, 3).await;
    }
    kafka.create_topic("plain-out", 3).await;
    let value = vec![b'x'; VALUE_BYTES];
    let records: Vec<TestRecord> = (0..RECORDS)
        .map(|n| TestRecord::keyed(format!("k{}", n % 100), value.clone()))
        .collect();
    // One record per stored batch: tansu skips the rest of a batch when a
    // fetch starts inside it, which librdkafka does after a partial batch.
    kafka.produce("plain-in", records.clone()).await;
    kafka.produce("relay-in", records).await;

    // Throughput: the plain loop, then the relay, on the same broker.
    let plain = plain_loop(&kafka, "plain-in", "plain-out", RECORDS).await;
    // Quiet, but for the line that says where the admin listener is.
    let relay = RelayProcess::start(
        &relay_config(&kafka),
        &[("RUST_LOG", "warn,wasmrelay::node=info")],
    );
    let started = Instant::now();
    while relay.metric(r#"wasmrelay_messages_returned_total{flow="throughput"}"#) < RECORDS as u64 {
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "relay too slow:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let through_relay = started.elapsed();
    let plain_rate = RECORDS as f64 / plain.as_secs_f64();
    let relay_rate = RECORDS as f64 / through_relay.as_secs_f64();

    // Latency at a fixed rate.
    let count = (LATENCY_RATE * LATENCY_SECONDS) as usize;
    let direct = latency_reader(&kafka, "lat-in", count);
    let relayed = latency_reader(&kafka, "lat-out", count);
    let producer: FutureProducer = link(&kafka)
        .producer_config()
        .set("linger.ms", "0")
        .create()
        .unwrap();
    let mut ticker = tokio::time::interval(Duration::from_nanos(1_000_000_000 / LATENCY_RATE));
    let mut pending = FuturesUnordered::new();
    for n in 0..count {
        ticker.tick().await;
        let key = format!("k{n}");
        let sent = now_ns().to_string();
        let headers = OwnedHeaders::new().insert(Header {
            key: SENT_HEADER,
            value: Some(sent.as_str()),
        });
        let ack = producer
            .send_result(
                FutureRecord::to("lat-in")
                    .key(&key)
                    .payload(&value[..100])
                    .headers(headers),
            )
            .map_err(|(e, _)| e)
            .unwrap();
        pending.push(ack);
        while let Some(Some(_)) = futures::FutureExt::now_or_never(pending.next()) {}
    }
    while pending.next().await.is_some() {}
    let direct = direct.await.unwrap();
    let relayed = relayed.await.unwrap();
    drop(relay);

    println!();
    println!(
        "relay throughput: {RECORDS} records of {VALUE_BYTES} B, 3 partitions, tansu on loopback"
    );
    println!(
        "{:<44} {:>10.0} records/s ({:.2} s)",
        "plain rdkafka consume-produce loop",
        plain_rate,
        plain.as_secs_f64()
    );
    println!(
        "{:<44} {:>10.0} records/s ({:.2} s)",
        "wasmrelay transform flow, passthrough plugin",
        relay_rate,
        through_relay.as_secs_f64()
    );
    println!(
        "{:<44} {:>10.2}x",
        "relay / plain loop",
        relay_rate / plain_rate
    );
    println!();
    println!(
        "latency at {LATENCY_RATE} records/s for {LATENCY_SECONDS} s (100 B), ms from produce to read"
    );
    let (d50, d99) = (percentile(&direct, 0.5), percentile(&direct, 0.99));
    let (r50, r99) = (percentile(&relayed, 0.5), percentile(&relayed, 0.99));
    println!(
        "{:<44} p50 {d50:>7.1}  p99 {d99:>7.1}",
        "direct consumption of the input topic"
    );
    println!(
        "{:<44} p50 {r50:>7.1}  p99 {r99:>7.1}",
        "through the relay (output topic)"
    );
    println!(
        "{:<44} p50 {:>7.1}  p99 {:>7.1}",
        "added by the relay",
        r50 - d50,
        r99 - d99
    );
}
