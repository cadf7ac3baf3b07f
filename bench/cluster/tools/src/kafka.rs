//! Kafka side: topics, the timestamped business messages, the route table fill.

use std::time::{Duration, Instant};

use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::future_producer::OwnedDeliveryResult;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use serde_json::json;

use crate::{emit, now_ns, stamped_value};

#[derive(Debug, clap::Args)]
pub(crate) struct CreateTopics {
    #[arg(long)]
    bootstrap: String,
    /// `name:partitions` or `name:partitions:compact`; repeat.
    #[arg(long = "topic", required = true)]
    topics: Vec<String>,
}

pub(crate) async fn create_topics(args: CreateTopics) -> Result<(), String> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &args.bootstrap)
        .create()
        .map_err(|e| format!("admin client: {e}"))?;
    let mut specs = Vec::new();
    for spec in &args.topics {
        let parts: Vec<&str> = spec.split(':').collect();
        let partitions: i32 = parts
            .get(1)
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| format!("bad topic spec {spec:?} (name:partitions[:compact])"))?;
        specs.push((
            parts[0].to_string(),
            partitions,
            parts.get(2) == Some(&"compact"),
        ));
    }
    let topics: Vec<NewTopic> = specs
        .iter()
        .map(|(name, partitions, compact)| {
            let topic = NewTopic::new(name, *partitions, TopicReplication::Fixed(1));
            if *compact {
                topic.set("cleanup.policy", "compact")
            } else {
                topic
            }
        })
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(20)));
    let results = admin
        .create_topics(topics.iter(), &options)
        .await
        .map_err(|e| format!("creating topics: {e}"))?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => return Err(format!("creating topic {topic}: {code}")),
        }
    }
    Ok(())
}

fn producer(bootstrap: &str, extra: &[(&str, &str)]) -> Result<FutureProducer, String> {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", bootstrap)
        .set("acks", "all")
        .set("queue.buffering.max.messages", "2000000")
        .set("queue.buffering.max.kbytes", "2097151")
        .set("message.timeout.ms", "300000");
    for (key, value) in extra {
        config.set(*key, *value);
    }
    config.create().map_err(|e| format!("producer: {e}"))
}

#[derive(Debug, clap::Args)]
pub(crate) struct Produce {
    #[arg(long)]
    bootstrap: String,
    #[arg(long)]
    topic: String,
    /// Messages to produce.
    #[arg(long)]
    count: u64,
    /// Value size in bytes (at least 16).
    #[arg(long)]
    size: usize,
    /// The process the messages are for (header `process-id`).
    #[arg(long, required_unless_present = "processes")]
    process_id: Option<String>,
    /// Spread the messages over this many processes, `<process-prefix><n>`
    /// for n = seq mod `processes` (header `process-id`, and the record key,
    /// so that the messages of one process stay in one partition).
    #[arg(long, conflicts_with = "process_id")]
    processes: Option<u64>,
    /// The process ids of `--processes`.
    #[arg(long, default_value = "proc-")]
    process_prefix: String,
    /// Messages per second; 0 (default) produces as fast as the broker takes them.
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// Records per producer batch (1: one record per stored batch, which
    /// tansu needs for consumer-group resume correctness).
    #[arg(long, default_value_t = 1)]
    batch: u32,
}

/// Waits for one acknowledgement; counts failures.
fn settle(result: OwnedDeliveryResult, failed: &mut u64) {
    if let Err((error, _)) = result {
        *failed += 1;
        if *failed <= 5 {
            eprintln!("produce failed: {error}");
        }
    }
}

type Acks = FuturesUnordered<DeliveryFuture>;

async fn drain_one(acks: &mut Acks, failed: &mut u64) {
    if let Some(result) = acks.next().await {
        match result {
            Ok(result) => settle(result, failed),
            Err(_) => *failed += 1,
        }
    }
}

pub(crate) async fn produce(args: Produce) -> Result<(), String> {
    let batch = args.batch.to_string();
    let linger = if args.batch > 1 { "20" } else { "0" };
    let producer = producer(
        &args.bootstrap,
        &[("batch.num.messages", &batch), ("linger.ms", linger)],
    )?;
    // The process of message `seq`.
    let process_of = |seq: u64| match (args.processes, &args.process_id) {
        (Some(n), _) => format!("{}{}", args.process_prefix, seq % n.max(1)),
        (None, Some(id)) => id.clone(),
        (None, None) => String::new(),
    };
    // SIGTERM ends the run early: what was sent is waited for and reported
    // (so `--count` can be large and the script stops it when it is done).
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let started_tokio = tokio::time::Instant::now();
    let mut acks: Acks = FuturesUnordered::new();
    let mut failed = 0u64;
    let mut sent = 0u64;
    let mut stopped = false;
    'produce: for seq in 0..args.count {
        if args.rate > 0.0 {
            let due = started_tokio + Duration::from_secs_f64(seq as f64 / args.rate);
            loop {
                tokio::select! {
                    () = tokio::time::sleep_until(due) => break,
                    _ = term.recv() => { stopped = true; break 'produce; }
                    Some(result) = acks.next() => match result {
                        Ok(result) => settle(result, &mut failed),
                        Err(_) => failed += 1,
                    },
                }
            }
        }
        let process = process_of(seq);
        let headers = OwnedHeaders::new().insert(Header {
            key: "process-id",
            value: Some(process.as_bytes()),
        });
        loop {
            let value = stamped_value(args.size, seq, now_ns());
            let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&args.topic)
                .payload(value.as_slice())
                .headers(headers.clone());
            if args.processes.is_some() {
                record = record.key(process.as_bytes());
            }
            match producer.send_result(record) {
                Ok(ack) => {
                    acks.push(ack);
                    sent += 1;
                    break;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    drain_one(&mut acks, &mut failed).await;
                }
                Err((error, _)) => return Err(format!("producing: {error}")),
            }
        }
    }
    let enqueued = started.elapsed().as_secs_f64();
    while !acks.is_empty() {
        drain_one(&mut acks, &mut failed).await;
    }
    let took = started.elapsed().as_secs_f64();
    // Sequence numbers 0..sent were sent; `failed` of them not acknowledged.
    emit(json!({
        "produced": sent - failed,
        "sent": sent,
        "failed": failed,
        "stopped_by_signal": stopped,
        "enqueue_s": enqueued,
        "seconds": took,
        "rate_per_s": sent as f64 / took,
    }));
    if failed > 0 {
        return Err(format!("{failed} records were not produced"));
    }
    Ok(())
}

#[derive(Debug, clap::Args)]
pub(crate) struct FillRoutes {
    #[arg(long)]
    bootstrap: String,
    #[arg(long, default_value = "wasmrelay.routes")]
    topic: String,
    /// Routes to write (distinct process ids).
    #[arg(long)]
    count: u64,
    /// Process ids are `<prefix><n>`, n zero-padded to 7 digits.
    #[arg(long, default_value = "proc-")]
    prefix: String,
    /// The node the routes name.
    #[arg(long, default_value = "node-x")]
    node: String,
    /// The cluster secret the nodes reading the routes use (the records
    /// carry its MAC, as a node's do; the default is bench/cluster/lib.sh's).
    #[arg(long, default_value = "cluster-bench-secret-0123456789abcdef")]
    secret: String,
}

pub(crate) async fn fill_routes(args: FillRoutes) -> Result<(), String> {
    let producer = producer(
        &args.bootstrap,
        &[
            ("linger.ms", "50"),
            ("batch.num.messages", "10000"),
            ("batch.size", "1000000"),
        ],
    )?;
    use wasmrelay_protocol::mesh_auth::{Purpose, purpose_key, record_mac};
    // The exact record a node writes (host/src/cluster/routes.rs,
    // RouteValue and route_mac).
    let value = format!(
        r#"{{"node":{},"registered_at_ms":0,"generation":1}}"#,
        serde_json::Value::from(args.node.as_str())
    )
    .into_bytes();
    let key_of_routes = purpose_key(args.secret.as_bytes(), Purpose::RouteRecord);
    let started = Instant::now();
    let mut acks: Acks = FuturesUnordered::new();
    let mut failed = 0u64;
    for n in 0..args.count {
        let key = format!("{}{n:07}", args.prefix);
        let mac = record_mac(&key_of_routes, "route", &[key.as_bytes(), &value]);
        loop {
            let record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&args.topic)
                .key(key.as_bytes())
                .payload(&value[..])
                .headers(OwnedHeaders::new().insert(Header {
                    key: "wasmrelay-mac",
                    value: Some(&mac[..]),
                }));
            match producer.send_result(record) {
                Ok(ack) => {
                    acks.push(ack);
                    break;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    drain_one(&mut acks, &mut failed).await;
                }
                Err((error, _)) => return Err(format!("producing a route: {error}")),
            }
        }
        // Keep the number of futures in check.
        while acks.len() > 200_000 {
            drain_one(&mut acks, &mut failed).await;
        }
    }
    while !acks.is_empty() {
        drain_one(&mut acks, &mut failed).await;
    }
    let took = started.elapsed().as_secs_f64();
    emit(json!({
        "routes_written": args.count - failed,
        "failed": failed,
        "seconds": took,
        "rate_per_s": args.count as f64 / took,
        "value_bytes": value.len(),
    }));
    if failed > 0 {
        return Err(format!("{failed} routes were not written"));
    }
    Ok(())
}

#[derive(Debug, clap::Args)]
pub(crate) struct TailCount {
    #[arg(long)]
    bootstrap: String,
    #[arg(long)]
    topic: String,
    /// Stop after nothing arrived for this many seconds.
    #[arg(long, default_value_t = 5.0)]
    idle_s: f64,
    /// `fetch.wait.max.ms` of the reader.
    #[arg(long, default_value = "10")]
    fetch_wait_ms: String,
}

/// Follows a topic like a node's route-table reader (partitions assigned
/// from the beginning, no group) and counts offsets it never saw.
pub(crate) async fn tail_count(args: TailCount) -> Result<(), String> {
    use rdkafka::Message as _;
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &args.bootstrap)
            .set("group.id", "bench-tail-count")
            .set("enable.auto.commit", "false")
            .set("fetch.wait.max.ms", &args.fetch_wait_ms)
            .create()
            .map_err(|e| format!("consumer: {e}"))?;
        let metadata = consumer
            .fetch_metadata(Some(&args.topic), Duration::from_secs(10))
            .map_err(|e| format!("metadata: {e}"))?;
        let partitions: Vec<i32> = metadata
            .topics()
            .iter()
            .flat_map(|t| t.partitions().iter().map(|p| p.id()))
            .collect();
        let mut assignment = rdkafka::TopicPartitionList::new();
        for p in &partitions {
            assignment
                .add_partition_offset(&args.topic, *p, rdkafka::Offset::Beginning)
                .map_err(|e| e.to_string())?;
        }
        consumer.assign(&assignment).map_err(|e| e.to_string())?;
        let mut next: std::collections::HashMap<i32, i64> = partitions.iter().map(|p| (*p, 0)).collect();
        let (mut records, mut skipped, mut backwards) = (0u64, 0i64, 0u64);
        let mut gaps: Vec<(i32, i64, i64)> = Vec::new();
        let mut last = Instant::now();
        while last.elapsed().as_secs_f64() < args.idle_s {
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(message)) => {
                    last = Instant::now();
                    records += 1;
                    let expected = next.get(&message.partition()).copied().unwrap_or(0);
                    let offset = message.offset();
                    if offset > expected {
                        skipped += offset - expected;
                        gaps.push((message.partition(), expected, offset));
                    } else if offset < expected {
                        backwards += 1;
                    }
                    next.insert(message.partition(), offset + 1);
                }
                Some(Err(error)) => eprintln!("tail-count: {error}"),
                None => {}
            }
        }
        emit(json!({
            "records": records,
            "skipped": skipped,
            "backwards": backwards,
            "gaps": gaps.iter().take(20).map(|(p, from, to)| json!({"partition": p, "from": from, "to": to})).collect::<Vec<_>>(),
        }));
        Ok(())
    })
    .await
    .map_err(|e| e.to_string())?
}

#[derive(Debug, clap::Args)]
pub(crate) struct ReadAll {
    #[arg(long)]
    bootstrap: String,
    #[arg(long)]
    topic: String,
    /// `fetch.wait.max.ms` of the reader (the bench nodes' link setting).
    #[arg(long, default_value = "10")]
    fetch_wait_ms: String,
}

/// The baseline of the route table catch-up: a plain rdkafka reader with a
/// node's route-reader settings (partitions assigned from the beginning,
/// no group, `enable.partition.eof`, a `BaseConsumer` polled on one
/// thread) that reads every partition to its end and only counts what it
/// reads; timed from creating the consumer, as a node times its catch-up
/// from starting its reader.
pub(crate) async fn read_all(args: ReadAll) -> Result<(), String> {
    use rdkafka::Message as _;
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &args.bootstrap)
            .set("fetch.wait.max.ms", &args.fetch_wait_ms)
            .set("group.id", "bench-read-all")
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "true")
            .create()
            .map_err(|e| format!("consumer: {e}"))?;
        let metadata = consumer
            .fetch_metadata(Some(&args.topic), Duration::from_secs(10))
            .map_err(|e| format!("metadata: {e}"))?;
        let partitions: Vec<i32> = metadata
            .topics()
            .iter()
            .filter(|t| t.name() == args.topic)
            .flat_map(|t| t.partitions().iter().map(|p| p.id()))
            .collect();
        let mut assignment = rdkafka::TopicPartitionList::new();
        for p in &partitions {
            assignment
                .add_partition_offset(&args.topic, *p, rdkafka::Offset::Beginning)
                .map_err(|e| e.to_string())?;
        }
        consumer.assign(&assignment).map_err(|e| e.to_string())?;
        let mut not_at_end: std::collections::HashSet<i32> = partitions.into_iter().collect();
        let (mut records, mut bytes) = (0u64, 0u64);
        while !not_at_end.is_empty() {
            if started.elapsed() > Duration::from_secs(900) {
                return Err("not at the end after 900 s".to_string());
            }
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(message)) => {
                    records += 1;
                    bytes += (message.key().map_or(0, <[u8]>::len)
                        + message.payload().map_or(0, <[u8]>::len))
                        as u64;
                }
                Some(Err(KafkaError::PartitionEOF(partition))) => {
                    not_at_end.remove(&partition);
                }
                Some(Err(error)) => eprintln!("read-all: {error}"),
                None => {}
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        emit(json!({
            "records": records,
            "bytes": bytes,
            "seconds": seconds,
            "records_per_s": records as f64 / seconds,
        }));
        Ok(())
    })
    .await
    .map_err(|e| e.to_string())?
}
