//! The relay against a plain consume-and-produce loop on the same broker.
//!
//! Starts a real broker (tansu) and, in one run:
//! 1. **Throughput**: 50,000 records of 1 KiB (`RELAY_BENCH_RECORDS`, `RELAY_BENCH_VALUE_BYTES`)
//!    in 3 partitions (`RELAY_BENCH_PARTITIONS`) are consumed and produced to
//!    another topic by (a) a plain rdkafka loop in this process (consumer
//!    group, offsets stored after each acknowledgement, acknowledgements
//!    awaited concurrently; the same client settings as the relay's link)
//!    and (b) `wasmrelay run` with a transform flow through the `passthrough`
//!    plugin, (c) another `wasmrelay run` through `json-enrich` (JSON values
//!    of the same size). The plain loop runs again after the relays, on the
//!    same input (a group of its own) to an output of its own, and the
//!    ratios are against the faster of its two runs: what tansu spends per
//!    record swings by a quarter over minutes on this machine, and one
//!    plain run can land on a slow stretch that the relay's runs miss.
//!    Prints records per second of each and the ratios.
//! 2. **Latency**: records produced at a fixed rate carry their send time;
//!    the relay and a plain consume-produce loop (the same two broker trips)
//!    both carry them to an output topic of their own; one consumer reads
//!    each output, one the input topic directly. Prints p50/p99 of each and
//!    what the relay adds over the plain loop.
//!
//! Run: `cargo bench -p wasmrelay --bench relay_throughput` (needs tansu:
//! `scripts/setup.sh`). Results go to bench/RESULTS.md.
//!
//! With `RELAY_BENCH_TLS=1` the whole run is done twice, first on a
//! plaintext broker, then on one reached over TLS (tansu 0.6.0 cannot serve
//! TLS itself, so it sits behind the test support's rustls TLS terminator,
//! which it advertises; every client, the plain loop's and the relay's
//! link included, uses `security.protocol=ssl` with the test CA in
//! `ssl.ca.location`), and a table of both with the ratio TLS / plaintext
//! is printed (markdown). CPU per record is printed too: the relay process,
//! this process while the plain loop runs (its TLS terminator threads
//! left out), the terminator, and tansu.
//!
//! `RELAY_BENCH_RELAY_LOG` is the relays' `RUST_LOG` (default
//! `warn,wasmrelay::node=info`), e.g. `info,wasmrelay::kafka::consumer=debug`
//! to see a lane pause its partition; each relay's log is then kept in
//! `target/relay-bench-<passthrough|json-enrich>.log`.
//!
//! `RELAY_BENCH_LINK_OPTIONS="key=value,key=value"` adds librdkafka
//! properties to every client of both runs (the plain loop's, the relay's
//! link, the latency readers and producer), e.g. `socket.nagle.disable=true`.
//!
//! `RELAY_BENCH_RELAY_ENV="NAME=value NAME=value"` sets environment
//! variables of the relay processes only (not of the plain loop, which runs
//! in this process), e.g. `MALLOC_ARENA_MAX=8` to try another allocator
//! setting on the relay alone.
//!
//! `RELAY_BENCH_TRACE=1` prints, at every look at a relay's metrics while
//! it drains (every 100 ms, then 5 ms), the time since it was ready and its
//! flow's records consumed, in progress, awaiting acknowledgement and
//! returned, and when the plain loop consumed its first record: where a
//! run's time goes (a stall at the start shows as records awaiting
//! acknowledgement while none return). The extra scrapes cost the relay a
//! little CPU.
//!
//! For sweeps (`bench/throughput-sweep.sh` runs this once per point and
//! plots the curves):
//! - `RELAY_BENCH_PARTITIONS` (3): partitions of every topic of the run.
//! - `RELAY_BENCH_VALUE_BYTES` (1024): size of each record's value in the
//!   throughput runs (json-enrich's JSON values are about the same size,
//!   down to a few dozen bytes); the latency records stay at 100 B.
//! - `RELAY_BENCH_SKIP_LATENCY=1`: throughput only (the latency part takes
//!   10 s and more a run).
//! - `RELAY_BENCH_JSON=path`: appends one JSON line per run (per broker,
//!   with `RELAY_BENCH_TLS=1`) to `path`: the settings, the rates and
//!   ratios, CPU per record, latency percentiles (null when skipped) and the
//!   commit.
//!
//! With none of them set, the run and its output are as they always were.

#![allow(clippy::unwrap_used, clippy::print_stdout, missing_docs, dead_code)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use rdkafka::Message as _;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Header, Headers as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use support::cpu::{child_pid, own_cpu_ms, process_cpu_ms, stat_cpu_ms};
use support::pki::TestPki;
use support::relay::RelayProcess;
use support::tansu::{Security, Tansu, TestRecord};
use wasmrelay::kafka::LinkInfo;

/// Records of the throughput runs, unless `RELAY_BENCH_RECORDS` says otherwise.
const DEFAULT_RECORDS: usize = 50_000;

/// Records of each throughput run: `RELAY_BENCH_RECORDS`, or
/// [`DEFAULT_RECORDS`].
fn record_count() -> usize {
    std::env::var("RELAY_BENCH_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_RECORDS)
}

/// Partitions of every topic of a run, unless `RELAY_BENCH_PARTITIONS` says
/// otherwise.
const DEFAULT_PARTITIONS: i32 = 3;

/// Partitions of every topic of a run: `RELAY_BENCH_PARTITIONS`, or
/// [`DEFAULT_PARTITIONS`].
fn partition_count() -> i32 {
    std::env::var("RELAY_BENCH_PARTITIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&partitions| partitions > 0)
        .unwrap_or(DEFAULT_PARTITIONS)
}

/// Size of each record's value in the throughput runs, unless
/// `RELAY_BENCH_VALUE_BYTES` says otherwise.
const DEFAULT_VALUE_BYTES: usize = 1024;

/// Size of each record's value in the throughput runs:
/// `RELAY_BENCH_VALUE_BYTES`, or [`DEFAULT_VALUE_BYTES`].
fn value_bytes() -> usize {
    std::env::var("RELAY_BENCH_VALUE_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_VALUE_BYTES)
}

/// Whether the latency part is left out (`RELAY_BENCH_SKIP_LATENCY=1`).
fn skip_latency() -> bool {
    std::env::var("RELAY_BENCH_SKIP_LATENCY").is_ok_and(|v| v == "1")
}

/// What a json-enrich value's padding is short of the value size (as it
/// always was): the rest of the JSON, `{"n":12345,"pad":""}`, is 16 to 20
/// bytes, so those values are 10 to 14 bytes shorter than the plain ones;
/// below this size the padding is empty.
const JSON_OVERHEAD_BYTES: usize = 30;

/// Size of the latency records' values, whatever the throughput runs use.
const LATENCY_VALUE_BYTES: usize = 100;
const LATENCY_RATE: u64 = 500;
const LATENCY_SECONDS: u64 = 10;
const SENT_HEADER: &str = "bench-sent-ns";
/// Records of the first second are left out of the latency figures: the
/// readers' first fetches and connection set-up are not what is measured.
const WARM_UP_RECORDS: usize = LATENCY_RATE as usize;

/// The broker of one run: plaintext, or over TLS through the terminator.
struct Broker {
    kafka: Tansu,
    /// The librdkafka properties of a TLS client (empty for plaintext).
    tls_options: Vec<(String, String)>,
    /// Holds the CA file for as long as the broker is used.
    _pki: Option<TestPki>,
}

impl Broker {
    fn plaintext() -> Broker {
        Broker {
            kafka: Tansu::start(),
            tls_options: Vec::new(),
            _pki: None,
        }
    }

    /// tansu behind the TLS terminator, with a certificate of a CA of its
    /// own for 127.0.0.1 (librdkafka checks the name: its default
    /// `ssl.endpoint.identification.algorithm` is `https`).
    fn tls() -> Broker {
        let pki = TestPki::new("relay-bench");
        let cert = pki.server_cert("broker");
        let kafka = Tansu::start_secured(Security {
            tls: Some(cert),
            trust_ca_pem: Some(pki.ca_pem().to_owned()),
            scram_user: None,
        });
        Broker {
            kafka,
            tls_options: vec![
                ("security.protocol".to_string(), "ssl".to_string()),
                (
                    "ssl.ca.location".to_string(),
                    pki.ca_path().display().to_string(),
                ),
            ],
            _pki: Some(pki),
        }
    }

    fn is_tls(&self) -> bool {
        !self.tls_options.is_empty()
    }
}

/// The link settings both the relay and the plain loop use.
fn link(broker: &Broker) -> LinkInfo {
    let mut options = BTreeMap::from([
        ("fetch.wait.max.ms".to_string(), "10".to_string()),
        ("session.timeout.ms".to_string(), "6000".to_string()),
        ("heartbeat.interval.ms".to_string(), "500".to_string()),
    ]);
    options.extend(broker.tls_options.iter().cloned());
    options.extend(extra_link_options());
    LinkInfo {
        bootstrap_servers: broker.kafka.bootstrap(),
        options,
    }
}

/// `RELAY_BENCH_TRACE` is set: print where a run's time goes.
fn trace() -> bool {
    std::env::var_os("RELAY_BENCH_TRACE").is_some()
}

/// The relays' `RUST_LOG`: `RELAY_BENCH_RELAY_LOG`, or quiet but for the
/// line that says where the admin listener is. Each relay's log is printed
/// when it is too slow, and kept in its directory while it runs.
fn relay_log() -> String {
    std::env::var("RELAY_BENCH_RELAY_LOG").unwrap_or_else(|_| "warn,wasmrelay::node=info".into())
}

/// The relays' environment: `RUST_LOG` ([`relay_log`]) and what
/// `RELAY_BENCH_RELAY_ENV` sets (`NAME=value`, separated by spaces).
fn relay_env() -> Vec<(String, String)> {
    let mut env = vec![("RUST_LOG".to_string(), relay_log())];
    for pair in std::env::var("RELAY_BENCH_RELAY_ENV")
        .unwrap_or_default()
        .split_whitespace()
    {
        let (name, value) = pair
            .split_once('=')
            .unwrap_or_else(|| panic!("RELAY_BENCH_RELAY_ENV: {pair:?} is not NAME=value"));
        env.push((name.to_string(), value.to_string()));
    }
    env
}

/// [`relay_env`] as [`RelayProcess::start`] takes it.
fn env_refs(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect()
}

/// With `RELAY_BENCH_RELAY_LOG` set, copies a relay's log to
/// `target/relay-bench-<name>.log` (its own directory goes with it).
fn keep_log(relay: &RelayProcess, name: &str) {
    if std::env::var_os("RELAY_BENCH_RELAY_LOG").is_some() {
        let path = support::repo_root().join(format!("target/relay-bench-{name}.log"));
        std::fs::write(&path, relay.log()).unwrap();
        println!("relay log ({name}): {}", path.display());
    }
}

/// The properties of `RELAY_BENCH_LINK_OPTIONS` (`key=value,...`).
fn extra_link_options() -> Vec<(String, String)> {
    std::env::var("RELAY_BENCH_LINK_OPTIONS")
        .unwrap_or_default()
        .split(',')
        .filter_map(|pair| {
            let (key, value) = pair.split_once('=')?;
            Some((key.trim().to_string(), value.trim().to_string()))
        })
        .collect()
}

/// CPU used so far, in ms, by the parts of a run.
#[derive(Clone, Copy, Debug, Default)]
struct Cpu {
    /// This process, without its TLS terminator threads.
    bench: u64,
    /// The TLS terminator's threads (in this process).
    terminator: u64,
    relay: u64,
    broker: u64,
}

impl Cpu {
    fn now(relay: Option<u32>, broker: Option<u32>) -> Cpu {
        let mut terminator = 0;
        if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
            for task in tasks.flatten() {
                let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
                if comm.trim() == "tls-terminator" {
                    terminator += stat_cpu_ms(&task.path().join("stat"));
                }
            }
        }
        let proc_stat = |pid: Option<u32>| pid.map_or(0, process_cpu_ms);
        Cpu {
            bench: own_cpu_ms().saturating_sub(terminator),
            terminator,
            relay: proc_stat(relay),
            broker: proc_stat(broker),
        }
    }

    fn since(self, before: Cpu) -> Cpu {
        Cpu {
            bench: self.bench.saturating_sub(before.bench),
            terminator: self.terminator.saturating_sub(before.terminator),
            relay: self.relay.saturating_sub(before.relay),
            broker: self.broker.saturating_sub(before.broker),
        }
    }
}

/// CPU (ms) of each group of threads of process `pid`: librdkafka's
/// (`rdk:broker`, `rdk:main`...), tokio's workers, the rest by name without
/// the trailing number.
fn thread_cpu_ms(pid: u32) -> BTreeMap<String, u64> {
    let mut groups = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return groups;
    };
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let comm = comm.trim();
        let group = if comm.starts_with("rdk:broker") {
            "rdk:broker".to_string()
        } else {
            comm.trim_end_matches(|c: char| c.is_ascii_digit() || c == '-')
                .to_string()
        };
        *groups.entry(group).or_insert(0) += stat_cpu_ms(&task.path().join("stat"));
    }
    groups
}

/// `after` - `before`, per group.
fn thread_cpu_since(
    after: BTreeMap<String, u64>,
    before: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    after
        .into_iter()
        .map(|(group, ms)| {
            let spent = ms.saturating_sub(before.get(&group).copied().unwrap_or(0));
            (group, spent)
        })
        .collect()
}

/// What one run measured.
#[derive(Debug)]
struct Figures {
    /// The plain loop, before the relays.
    plain: Duration,
    /// The plain loop again, after them.
    plain_after: Duration,
    through_relay: Duration,
    /// The same through `json-enrich` (JSON values of the same size).
    through_enrich: Duration,
    /// CPU while the plain loop ran, and while the relay drained its topic.
    plain_cpu: Cpu,
    relay_cpu: Cpu,
    /// The relay's CPU (ms) while it drained its topic, per thread group.
    relay_threads: BTreeMap<String, u64>,
    /// None when the latency part was skipped (`RELAY_BENCH_SKIP_LATENCY`).
    latency: Option<Latencies>,
}

/// Sorted latencies (ms) of the latency part: read directly, through the
/// relay, and through the plain loop.
#[derive(Debug)]
struct Latencies {
    direct: Vec<f64>,
    relayed: Vec<f64>,
    looped: Vec<f64>,
}

impl Figures {
    /// The plain loop's rate in the faster of its two runs: the baseline of
    /// the ratios.
    fn plain_rate(&self) -> f64 {
        record_count() as f64 / self.plain_best().as_secs_f64()
    }

    fn plain_best(&self) -> Duration {
        self.plain.min(self.plain_after)
    }

    fn relay_rate(&self) -> f64 {
        record_count() as f64 / self.through_relay.as_secs_f64()
    }

    fn enrich_rate(&self) -> f64 {
        record_count() as f64 / self.through_enrich.as_secs_f64()
    }
}

/// µs per record of `ms` CPU over the throughput run.
fn per_record(ms: u64) -> f64 {
    ms as f64 * 1000.0 / record_count() as f64
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// The plain loop: consume, produce, store the offset when acknowledged.
async fn plain_loop(
    broker: &Broker,
    group: &str,
    input: &str,
    output: &str,
    expected: usize,
) -> Duration {
    let info = link(broker);
    let started = Instant::now();
    let consumer: StreamConsumer = info
        .consumer_config(group, Duration::from_millis(500))
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
                if consumed == 0 && trace() {
                    eprintln!("trace: plain loop {group}: first record consumed after {} ms", started.elapsed().as_millis());
                }
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

/// A relay with one transform flow per `(name, input, output, plugin)`.
fn relay_config_with(broker: &Broker, flows: &[(&str, &str, &str, &str)]) -> String {
    let plugins = support::plugins_dist().display();
    let bootstrap = broker.kafka.bootstrap();
    let extra: String = broker
        .tls_options
        .iter()
        .cloned()
        .chain(extra_link_options())
        .map(|(key, value)| format!("\"{key}\" = \"{value}\"\n"))
        .collect();
    let flows: String = flows
        .iter()
        .map(|(name, input, output, plugin)| {
            format!(
                "[[flows]]\nname = \"{name}\"\nlink = \"main\"\ninput_topic = \"{input}\"\nservice_call = [\"{plugin}\"]\noutput_topic = \"{output}\"\ndead_letter_topic = \"{input}.dlq\"\n"
            )
        })
        .collect();
    format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n[plugins]\ndir = \"{plugins}\"\nwatch = false\n\
         [plugins.config.json-enrich]\nfield = \"enriched_by\"\nvalue = \"wasmrelay-bench\"\n\
         [links.main]\nbootstrap_servers = \"{bootstrap}\"\n[links.main.options]\n\"fetch.wait.max.ms\" = \"10\"\n\
         \"session.timeout.ms\" = \"6000\"\n\"heartbeat.interval.ms\" = \"500\"\n{extra}{flows}"
    )
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Reads `topic` from the beginning and records now - sent for each record.
fn latency_reader(
    broker: &Broker,
    topic: &str,
    expected: usize,
) -> tokio::task::JoinHandle<Vec<f64>> {
    let consumer: StreamConsumer = link(broker)
        .admin_config()
        .set("group.id", "bench-latency")
        .create()
        .unwrap();
    let mut partitions = rdkafka::TopicPartitionList::new();
    for partition in 0..partition_count() {
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

/// The latency part, with a relay up whose `latency` flow carries `lat-in`
/// to `lat-out` (through `passthrough`): records at a fixed rate,
/// read directly, through the relay and through a plain loop.
async fn measure_latency(broker: &Broker) -> Latencies {
    let count = (LATENCY_RATE * LATENCY_SECONDS) as usize;
    let value = [b'x'; LATENCY_VALUE_BYTES];
    let direct = latency_reader(broker, "lat-in", count);
    let relayed = latency_reader(broker, "lat-out", count);
    let looped = latency_reader(broker, "lat-plain-out", count);
    let producer: FutureProducer = link(broker)
        .producer_config()
        .set("linger.ms", "0")
        .create()
        .unwrap();
    let produce = async {
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
                        .payload(&value[..])
                        .headers(headers),
                )
                .map_err(|(e, _)| e)
                .unwrap();
            pending.push(ack);
            while let Some(Some(_)) = futures::FutureExt::now_or_never(pending.next()) {}
        }
        while pending.next().await.is_some() {}
    };
    // The baseline: a plain loop doing the relay's two broker trips, on the
    // same input at the same time.
    tokio::join!(
        produce,
        plain_loop(
            broker,
            "bench-plain-latency",
            "lat-in",
            "lat-plain-out",
            count
        )
    );
    let direct = direct.await.unwrap();
    let relayed = relayed.await.unwrap();
    let looped = looped.await.unwrap();
    Latencies {
        direct,
        relayed,
        looped,
    }
}

/// One whole run on `broker`: throughput of the plain loop and of the
/// relay, then latency at a fixed rate (unless skipped).
async fn run(broker: &Broker) -> Figures {
    let kafka = &broker.kafka;
    let tansu = child_pid("tansu");
    let partitions = partition_count();
    for topic in ["plain-in", "relay-in", "lat-in", "enrich-in"] {
        kafka.create_topic(topic, partitions).await;
    }
    kafka.create_topic("plain-out", partitions).await;
    kafka.create_topic("plain-out-after", partitions).await;
    kafka.create_topic("lat-plain-out", partitions).await;
    let value = vec![b'x'; value_bytes()];
    let records: Vec<TestRecord> = (0..record_count())
        .map(|n| TestRecord::keyed(format!("k{}", n % 100), value.clone()))
        .collect();
    // One record per stored batch: tansu skips the rest of a batch when a
    // fetch starts inside it, which librdkafka does after a partial batch.
    kafka.produce("plain-in", records.clone()).await;
    kafka.produce("relay-in", records).await;
    // json-enrich needs JSON: the same size, as a JSON object.
    let padding = "x".repeat(value_bytes().saturating_sub(JSON_OVERHEAD_BYTES));
    let json_records: Vec<TestRecord> = (0..record_count())
        .map(|n| {
            TestRecord::keyed(
                format!("k{}", n % 100),
                format!("{{\"n\":{n},\"pad\":\"{padding}\"}}"),
            )
        })
        .collect();
    kafka.produce("enrich-in", json_records).await;

    // Throughput: the plain loop, then the relay, on the same broker.
    let before = Cpu::now(None, tansu);
    let plain = plain_loop(
        broker,
        "bench-plain-loop",
        "plain-in",
        "plain-out",
        record_count(),
    )
    .await;
    let plain_cpu = Cpu::now(None, tansu).since(before);
    // One flow, as the plain loop is one loop: an idle second flow would
    // add its consumer's group and empty fetches to the broker's work.
    let relay = RelayProcess::start(
        &relay_config_with(
            broker,
            &[("throughput", "relay-in", "relay-out", "passthrough")],
        ),
        &env_refs(&relay_env()),
    );
    let relay_pid = Some(relay.pid());
    let before = Cpu::now(relay_pid, tansu);
    let threads_before = thread_cpu_ms(relay.pid());
    let started = Instant::now();
    wait_until_returned(&relay, "throughput", started).await;
    let through_relay = started.elapsed();
    let relay_cpu = Cpu::now(relay_pid, tansu).since(before);
    let calls = relay.metric(r#"wasmrelay_plugin_call_seconds_count{plugin="passthrough"}"#);
    println!(
        "passthrough: {calls} plugin calls for {} records ({:.1} a call)",
        record_count(),
        record_count() as f64 / calls.max(1) as f64
    );
    let relay_threads = thread_cpu_since(thread_cpu_ms(relay.pid()), &threads_before);
    keep_log(&relay, "passthrough");
    drop(relay);

    let latency = if skip_latency() {
        None
    } else {
        let relay = RelayProcess::start(
            &relay_config_with(broker, &[("latency", "lat-in", "lat-out", "passthrough")]),
            &env_refs(&relay_env()),
        );
        let latencies = measure_latency(broker).await;
        drop(relay);
        Some(latencies)
    };

    // Throughput through json-enrich: a relay of its own, started now.
    let relay = RelayProcess::start(
        &relay_config_with(
            broker,
            &[("enrich", "enrich-in", "enrich-out", "json-enrich")],
        ),
        &env_refs(&relay_env()),
    );
    let started = Instant::now();
    wait_until_returned(&relay, "enrich", started).await;
    let through_enrich = started.elapsed();
    keep_log(&relay, "json-enrich");
    drop(relay);
    // The plain loop again, on the broker as the relays left it.
    let plain_after = plain_loop(
        broker,
        "bench-plain-loop-after",
        "plain-in",
        "plain-out-after",
        record_count(),
    )
    .await;
    Figures {
        plain,
        plain_after,
        through_relay,
        through_enrich,
        plain_cpu,
        relay_cpu,
        relay_threads,
        latency,
    }
}

/// Waits until `relay`'s flow `flow` has returned every record of the run
/// (started at `started`). `/metrics` is read every 100 ms, and every 5 ms
/// once 95% are done: a scrape costs the relay CPU that the plain loop does
/// not pay (a connection, the rendering, glibc's heap statistics), so it is
/// read rarely, and closely at the end, so that the time is exact to a few
/// milliseconds.
async fn wait_until_returned(relay: &RelayProcess, flow: &str, started: Instant) {
    let metric = format!(r#"wasmrelay_messages_returned_total{{flow="{flow}"}}"#);
    let expected = record_count() as u64;
    loop {
        let returned = relay.metric(&metric);
        if trace() {
            let gauge = |name: &str| relay.metric(&format!(r#"wasmrelay_{name}{{flow="{flow}"}}"#));
            eprintln!(
                "trace: {flow} {:>5} ms: consumed {}, in progress {}, awaiting ack {}, returned {returned}",
                started.elapsed().as_millis(),
                gauge("messages_consumed_total"),
                gauge("messages_in_progress"),
                gauge("messages_awaiting_ack"),
            );
        }
        if returned >= expected {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "relay too slow:\n{}",
            relay.log()
        );
        let pause = if returned * 100 >= expected * 95 {
            5
        } else {
            100
        };
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
}

/// The figures of one run, as the benchmark has always printed them, plus
/// CPU per record.
fn print_run(broker: &Broker, figures: &Figures) {
    let over = if broker.is_tls() {
        "TLS (terminator in front of tansu)"
    } else {
        "loopback"
    };
    let partitions = partition_count();
    let partitions = if partitions == 1 {
        "1 partition".to_string()
    } else {
        format!("{partitions} partitions")
    };
    println!();
    println!(
        "relay throughput: {} records of {} B, {partitions}, tansu on {over}",
        record_count(),
        value_bytes()
    );
    println!(
        "{:<44} {:>10.0} records/s (the faster of {:.2} s before the relays, {:.2} s after)",
        "plain rdkafka consume-produce loop",
        figures.plain_rate(),
        figures.plain.as_secs_f64(),
        figures.plain_after.as_secs_f64()
    );
    println!(
        "{:<44} {:>10.0} records/s ({:.2} s)",
        "wasmrelay transform flow, passthrough plugin",
        figures.relay_rate(),
        figures.through_relay.as_secs_f64()
    );
    println!(
        "{:<44} {:>10.2}x",
        "relay / plain loop",
        figures.relay_rate() / figures.plain_rate()
    );
    println!(
        "{:<44} {:>10.0} records/s ({:.2} s)",
        "wasmrelay transform flow, json-enrich plugin",
        figures.enrich_rate(),
        figures.through_enrich.as_secs_f64()
    );
    println!(
        "{:<44} {:>10.2}x",
        "relay (json-enrich) / plain loop",
        figures.enrich_rate() / figures.plain_rate()
    );
    println!(
        "{:<44} plain loop {:>6.1}  relay {:>6.1}",
        "CPU, µs per record: loop / relay process",
        per_record(figures.plain_cpu.bench),
        per_record(figures.relay_cpu.relay)
    );
    println!(
        "{:<44} plain loop {:>6.1}  relay {:>6.1}",
        "CPU, µs per record: tansu",
        per_record(figures.plain_cpu.broker),
        per_record(figures.relay_cpu.broker)
    );
    let threads: Vec<String> = figures
        .relay_threads
        .iter()
        .filter(|(_, ms)| **ms > 0)
        .map(|(group, ms)| format!("{group} {:.1}", per_record(*ms)))
        .collect();
    println!(
        "{:<44} {}",
        "relay CPU by thread, µs per record",
        threads.join(", ")
    );
    if broker.is_tls() {
        println!(
            "{:<44} plain loop {:>6.1}  relay {:>6.1}",
            "CPU, µs per record: TLS terminator",
            per_record(figures.plain_cpu.terminator),
            per_record(figures.relay_cpu.terminator)
        );
    }
    println!();
    let Some(latency) = &figures.latency else {
        println!("latency: skipped (RELAY_BENCH_SKIP_LATENCY=1)");
        return;
    };
    println!(
        "latency at {LATENCY_RATE} records/s for {LATENCY_SECONDS} s ({LATENCY_VALUE_BYTES} B), ms from produce to read"
    );
    let (direct, relayed) = (&latency.direct, &latency.relayed);
    let (d50, d99) = (percentile(direct, 0.5), percentile(direct, 0.99));
    let (r50, r99) = (percentile(relayed, 0.5), percentile(relayed, 0.99));
    println!(
        "{:<44} p50 {d50:>7.1}  p99 {d99:>7.1}",
        "direct consumption of the input topic"
    );
    println!(
        "{:<44} p50 {r50:>7.1}  p99 {r99:>7.1}",
        "through the relay (output topic)"
    );
    let looped = &latency.looped;
    let (l50, l99) = (percentile(looped, 0.5), percentile(looped, 0.99));
    println!(
        "{:<44} p50 {l50:>7.1}  p99 {l99:>7.1}",
        "through a plain consume-produce loop"
    );
    println!(
        "{:<44} p50 {:>7.1}  p99 {:>7.1}",
        "added by the relay over the plain loop",
        r50 - l50,
        r99 - l99
    );
}

/// Plaintext and TLS side by side (markdown), with TLS / plaintext.
fn print_comparison(plain: &Figures, tls: &Figures) {
    println!();
    println!("plaintext and TLS, same run (markdown):");
    println!();
    println!("| measure | plaintext | TLS | TLS / plaintext |");
    println!("|---|---:|---:|---:|");
    let row = |label: &str, get: &dyn Fn(&Figures) -> f64, decimals: usize| {
        let (p, t) = (get(plain), get(tls));
        let ratio = if p > 0.0 {
            format!("{:.2}x", t / p)
        } else {
            "—".to_string()
        };
        println!(
            "| {label} | {} | {} | {ratio} |",
            format_figure(p, decimals),
            format_figure(t, decimals)
        );
    };
    row("plain loop throughput, records/s", &Figures::plain_rate, 0);
    row("wasmrelay throughput, records/s", &Figures::relay_rate, 0);
    row(
        "wasmrelay / plain loop",
        &|f| f.relay_rate() / f.plain_rate(),
        2,
    );
    row(
        "plain loop CPU (bench process), µs/record",
        &|f| per_record(f.plain_cpu.bench),
        1,
    );
    row(
        "wasmrelay process CPU, µs/record",
        &|f| per_record(f.relay_cpu.relay),
        1,
    );
    row(
        "TLS terminator CPU, plain loop run, µs/record",
        &|f| per_record(f.plain_cpu.terminator),
        1,
    );
    row(
        "TLS terminator CPU, relay run, µs/record",
        &|f| per_record(f.relay_cpu.terminator),
        1,
    );
    row(
        "tansu CPU, plain loop run, µs/record",
        &|f| per_record(f.plain_cpu.broker),
        1,
    );
    row(
        "tansu CPU, relay run, µs/record",
        &|f| per_record(f.relay_cpu.broker),
        1,
    );
    if plain.latency.is_none() || tls.latency.is_none() {
        return;
    }
    /// The latencies of a run that has them (both have: checked above).
    fn latency(figures: &Figures) -> &Latencies {
        figures.latency.as_ref().unwrap()
    }
    row(
        "latency p50 direct, ms",
        &|f| percentile(&latency(f).direct, 0.5),
        1,
    );
    row(
        "latency p99 direct, ms",
        &|f| percentile(&latency(f).direct, 0.99),
        1,
    );
    row(
        "latency p50 through the relay, ms",
        &|f| percentile(&latency(f).relayed, 0.5),
        1,
    );
    row(
        "latency p99 through the relay, ms",
        &|f| percentile(&latency(f).relayed, 0.99),
        1,
    );
    row(
        "latency p50 added by the relay over a plain loop, ms",
        &|f| percentile(&latency(f).relayed, 0.5) - percentile(&latency(f).looped, 0.5),
        1,
    );
    row(
        "latency p99 added by the relay over a plain loop, ms",
        &|f| percentile(&latency(f).relayed, 0.99) - percentile(&latency(f).looped, 0.99),
        1,
    );
}

/// Appends the figures of one run as a JSON line to the file
/// `RELAY_BENCH_JSON` names, if it is set (what `bench/throughput-sweep.sh`
/// collects and plots). Rates are records/s, CPU is µs per record,
/// latencies are ms (null when the latency part was skipped).
fn append_json_line(broker: &Broker, figures: &Figures) {
    let Ok(path) = std::env::var("RELAY_BENCH_JSON") else {
        return;
    };
    let latency_ms = |series: fn(&Latencies) -> &[f64], p: f64| {
        figures
            .latency
            .as_ref()
            .map(|latency| percentile(series(latency), p))
    };
    let threads: serde_json::Map<String, serde_json::Value> = figures
        .relay_threads
        .iter()
        .filter(|(_, ms)| **ms > 0)
        .map(|(group, ms)| (group.clone(), per_record(*ms).into()))
        .collect();
    let line = serde_json::json!({
        "bench": "relay_throughput",
        "commit": commit(),
        "uncommitted_changes": uncommitted_changes(),
        "unix_time": SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs(),
        "load_average_1m": load_average(),
        "over": if broker.is_tls() { "tls" } else { "loopback" },
        "link_options": std::env::var("RELAY_BENCH_LINK_OPTIONS").ok(),
        "partitions": partition_count(),
        "value_bytes": value_bytes(),
        "records": record_count(),
        "plain_rate": figures.plain_rate(),
        "relay_rate": figures.relay_rate(),
        "enrich_rate": figures.enrich_rate(),
        "relay_ratio": figures.relay_rate() / figures.plain_rate(),
        "enrich_ratio": figures.enrich_rate() / figures.plain_rate(),
        "plain_seconds": figures.plain_best().as_secs_f64(),
        "plain_before_seconds": figures.plain.as_secs_f64(),
        "plain_after_seconds": figures.plain_after.as_secs_f64(),
        "relay_seconds": figures.through_relay.as_secs_f64(),
        "enrich_seconds": figures.through_enrich.as_secs_f64(),
        "plain_cpu_us_per_record": per_record(figures.plain_cpu.bench),
        "relay_cpu_us_per_record": per_record(figures.relay_cpu.relay),
        "tansu_cpu_us_per_record_plain": per_record(figures.plain_cpu.broker),
        "tansu_cpu_us_per_record_relay": per_record(figures.relay_cpu.broker),
        "relay_threads_us_per_record": threads,
        "latency_direct_p50_ms": latency_ms(|l| &l.direct, 0.5),
        "latency_direct_p99_ms": latency_ms(|l| &l.direct, 0.99),
        "latency_relayed_p50_ms": latency_ms(|l| &l.relayed, 0.5),
        "latency_relayed_p99_ms": latency_ms(|l| &l.relayed, 0.99),
        "latency_looped_p50_ms": latency_ms(|l| &l.looped, 0.5),
        "latency_looped_p99_ms": latency_ms(|l| &l.looped, 0.99),
    });
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("opening {path} (RELAY_BENCH_JSON): {e}"));
    writeln!(file, "{line}").unwrap_or_else(|e| panic!("writing to {path}: {e}"));
}

/// `git ARGS` in the repository root: its exit code and trimmed output, or
/// None if git could not be run.
fn git(args: &[&str]) -> Option<(Option<i32>, String)> {
    let output = std::process::Command::new("git")
        .args(args)
        .current_dir(support::repo_root())
        .output()
        .ok()?;
    let stdout = String::from_utf8_lossy(&output.stdout).trim().to_string();
    Some((output.status.code(), stdout))
}

/// The commit of this checkout (`git rev-parse --short HEAD`), or
/// `unknown`.
fn commit() -> String {
    match git(&["rev-parse", "--short", "HEAD"]) {
        Some((Some(0), hash)) if !hash.is_empty() => hash,
        _ => "unknown".to_string(),
    }
}

/// Whether the sources of what runs (host, client, protocol, plugins) have
/// changes not committed; None if git cannot tell.
fn uncommitted_changes() -> Option<bool> {
    let args = [
        "diff", "--quiet", "HEAD", "--", "host", "client", "protocol", "plugins",
    ];
    match git(&args)?.0? {
        0 => Some(false),
        1 => Some(true),
        _ => None,
    }
}

/// The 1-minute load average at the end of the run, if Linux says.
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `value` with `decimals` decimals, thousands separated when whole.
fn format_figure(value: f64, decimals: usize) -> String {
    if decimals > 0 {
        return format!("{value:.decimals$}");
    }
    let whole = format!("{:.0}", value.abs());
    let mut grouped = String::new();
    for (i, digit) in whole.chars().enumerate() {
        if i > 0 && (whole.len() - i) % 3 == 0 {
            grouped.push(',');
        }
        grouped.push(digit);
    }
    if value < 0.0 {
        format!("-{grouped}")
    } else {
        grouped
    }
}

#[tokio::main]
async fn main() {
    let tls = std::env::var("RELAY_BENCH_TLS").is_ok_and(|v| v == "1");
    let plain = {
        let broker = Broker::plaintext();
        let figures = run(&broker).await;
        print_run(&broker, &figures);
        append_json_line(&broker, &figures);
        figures
    };
    if tls {
        // The plaintext broker is gone; the same run over TLS.
        let broker = Broker::tls();
        let figures = run(&broker).await;
        print_run(&broker, &figures);
        append_json_line(&broker, &figures);
        print_comparison(&plain, &figures);
    }
}
