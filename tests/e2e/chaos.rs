//! Chaos scenarios (issue 14): a steady load while a fault is injected
//! again and again, then a drain; each prints one row (produced,
//! delivered, duplicated, dead-lettered, lost, longest stall) that
//! `scripts/chaos.sh` collects into a table, and fails on any loss or on a
//! flow that stays stuck once the fault has ended (the commit must reach
//! the end). `WASMRELAY_CHAOS_SECONDS` sets how long each runs (20 s by
//! default, the short mode CI runs).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use serde_json::json;
use support::app::{Receipt, TestApp};
use support::chaos::{ChaosRun, Load, Outcome};
use support::fault_proxy::FaultProxy;
use support::processes::{ProcessPool, node_config};
use support::relay::RelayProcess;
use support::tansu::{ConsumedRecord, Tansu, TestRecord};

use crate::sidecar_flow::{INPUT, OUTPUT, config};
use wasmrelay_test_support as support;

const SIDECAR_DLQ: &str = "service-calls.dlq";
const SIDECAR_GROUP: &str = "wasmrelay-orders";
const BUSINESS: &str = "business";
const CLUSTER_DLQ: &str = "business.dlq";
const CLUSTER_GROUP: &str = "wasmrelay-cluster";
/// Records a second of every scenario's load.
const RATE: usize = 200;
const TICK: Duration = Duration::from_millis(100);

/// The longest single fault of a scenario: 20 s, or half the run in the
/// short mode.
fn fault_length(run: &ChaosRun) -> Duration {
    (run.duration() / 2).min(Duration::from_secs(20))
}

fn answer(receipt: &Receipt) -> (u16, Vec<u8>, Vec<(String, String)>) {
    let body = json!({"answer_to": receipt.delivery_id});
    (200, body.to_string().into_bytes(), Vec::new())
}

fn service_call(n: usize) -> TestRecord {
    TestRecord::keyed(format!("key-{}", n % 31), json!({"n": n}).to_string())
}

fn header(record: &ConsumedRecord, name: &str) -> Option<String> {
    record
        .header(name)
        .map(|value| String::from_utf8_lossy(value).into_owned())
}

/// Every record in `topic`, read to its end.
async fn whole_topic(kafka: &Tansu, topic: &str) -> Vec<ConsumedRecord> {
    let end: i64 = kafka.high_watermarks(topic).await.values().sum();
    let expected = usize::try_from(end).unwrap_or(0);
    if expected == 0 {
        return Vec::new();
    }
    let records = kafka
        .consume_all(topic, expected, Duration::from_secs(60))
        .await;
    assert_eq!(
        records.len(),
        expected,
        "{topic} could not be read to its end"
    );
    records
}

/// The distinct values of `header` in the whole of `topic`.
async fn distinct_in(kafka: &Tansu, topic: &str, header_name: &str) -> HashSet<String> {
    whole_topic(kafka, topic)
        .await
        .iter()
        .filter_map(|r| header(r, header_name))
        .collect()
}

/// Waits until the group's commit on every partition of `topic` is at the
/// partition's end (its high watermark). The end, not the count of records
/// the load produced: a producer retry in a cut can store a record twice
/// (seen in scenario c: 4,011 records for 4,010 produced).
async fn wait_commit_at_end(kafka: &Tansu, group: &str, topic: &str, log: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let end = kafka.high_watermarks(topic).await;
        let committed = kafka.committed_offsets(group, topic).await;
        if !end.is_empty()
            && end
                .iter()
                .all(|(partition, end)| committed.get(partition).is_some_and(|c| c >= end))
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the commit stopped short of the end {end:?}: {committed:?}\n{}",
            log()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// What breaks in a sidecar scenario.
enum SidecarFault {
    /// The application goes away for a second every three (connections
    /// reset, new ones refused), as an application killed and restarted.
    AppRestarts(FaultProxy),
    /// The broker is frozen (SIGSTOP) once, for [`fault_length`].
    BrokerFrozen,
    /// The network between relay and broker is cut once, for
    /// [`fault_length`].
    BrokerCut,
}

impl SidecarFault {
    /// Puts the fault on or off for this moment of the run.
    fn apply(&self, kafka: &Tansu, run: &ChaosRun, on: &mut bool) {
        let elapsed = run.elapsed();
        let want = match self {
            SidecarFault::AppRestarts(_) => {
                elapsed.as_millis() % 3_000 < 1_000 && elapsed > Duration::from_secs(1)
            }
            SidecarFault::BrokerFrozen | SidecarFault::BrokerCut => {
                let from = run.duration() / 4;
                elapsed >= from && elapsed < from + fault_length(run)
            }
        };
        if want == *on {
            return;
        }
        *on = want;
        match (self, want) {
            (SidecarFault::AppRestarts(proxy), true) => proxy.cut(),
            (SidecarFault::AppRestarts(proxy), false) => proxy.restore(),
            (SidecarFault::BrokerFrozen, true) => kafka.freeze(),
            (SidecarFault::BrokerFrozen, false) => kafka.thaw(),
            (SidecarFault::BrokerCut, true) => kafka.proxy().cut(),
            (SidecarFault::BrokerCut, false) => kafka.proxy().restore(),
        }
    }
}

/// The topics of a sidecar scenario, and its application (answers at
/// once).
async fn sidecar_parts(kafka: &Tansu) -> TestApp {
    kafka.create_topic(INPUT, 3).await;
    kafka.create_topic(SIDECAR_DLQ, 1).await;
    TestApp::start(answer).await
}

/// A sidecar flow (json-enrich) to `app` at `app_url` under [`RATE`]
/// records a second while `fault` strikes.
async fn run_sidecar(
    name: &'static str,
    kafka: Tansu,
    app: TestApp,
    app_url: String,
    fault: SidecarFault,
) {
    let mut text = config(&kafka, &app_url, r#""json-enrich""#, "");
    if matches!(fault, SidecarFault::BrokerFrozen) {
        // librdkafka's default session (45 s), longer than the freeze: a
        // frozen tansu 0.6.0 that outlives a member's session keeps the
        // dead member as the group's leader, and the group never forms
        // again (docs/RELIABILITY.md).
        text = text
            .replace(
                "\"session.timeout.ms\" = \"6000\"",
                "\"session.timeout.ms\" = \"45000\"",
            )
            .replace(
                "\"max.poll.interval.ms\" = \"10000\"",
                "\"max.poll.interval.ms\" = \"60000\"",
            );
    }
    let relay = RelayProcess::start(&text, &[]);
    let mut run = ChaosRun::start(name);
    let load = Load::start(kafka.producer_config(), INPUT, RATE, service_call);
    let mut on = false;
    while run.running() {
        fault.apply(&kafka, &run, &mut on);
        run.observe(load.acknowledged(), app.distinct_deliveries());
        tokio::time::sleep(TICK).await;
    }
    if on {
        // Ends the fault (the phase ended inside it).
        match &fault {
            SidecarFault::AppRestarts(proxy) => proxy.restore(),
            SidecarFault::BrokerFrozen => kafka.thaw(),
            SidecarFault::BrokerCut => kafka.proxy().restore(),
        }
    }
    let total = load.stop().await;
    run.drain(
        total,
        Duration::from_secs(180),
        || app.distinct_deliveries(),
        || relay.log(),
    )
    .await;
    wait_commit_at_end(&kafka, SIDECAR_GROUP, INPUT, || relay.log()).await;
    let returned = distinct_in(&kafka, OUTPUT, "wasmrelay-delivery-id").await;
    let dead: HashSet<String> = distinct_in(&kafka, SIDECAR_DLQ, "wasmrelay-delivery-id")
        .await
        .difference(&returned)
        .cloned()
        .collect();
    wait_commit_at_end(&kafka, SIDECAR_GROUP, INPUT, || relay.log()).await;
    run.finish(Outcome {
        delivered: returned.len(),
        duplicated: app.count() - app.distinct_deliveries(),
        dead_lettered: dead.len(),
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_a_sidecar_with_the_application_killed_and_restarted() {
    let kafka = Tansu::start();
    let app = sidecar_parts(&kafka).await;
    let upstream = app
        .url
        .trim_start_matches("http://")
        .trim_end_matches("/calls")
        .parse()
        .expect("the app's address");
    let proxy = FaultProxy::to(upstream);
    let app_url = format!("http://{}/calls", proxy.addr());
    run_sidecar(
        "a: sidecar, application killed and restarted every 3 s",
        kafka,
        app,
        app_url,
        SidecarFault::AppRestarts(proxy),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_b_sidecar_with_the_broker_frozen_under_load() {
    let kafka = Tansu::start();
    let app = sidecar_parts(&kafka).await;
    let app_url = app.url.clone();
    run_sidecar(
        "b: sidecar, broker frozen (SIGSTOP) then resumed",
        kafka,
        app,
        app_url,
        SidecarFault::BrokerFrozen,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_c_sidecar_with_the_network_to_the_broker_cut() {
    let kafka = Tansu::start_behind_proxy();
    let app = sidecar_parts(&kafka).await;
    let app_url = app.url.clone();
    run_sidecar(
        "c: sidecar, network to the broker cut then restored",
        kafka,
        app,
        app_url,
        SidecarFault::BrokerCut,
    )
    .await;
}

/// `count` processes `p-<n>`.
fn process_ids(count: usize) -> Vec<String> {
    (0..count).map(|n| format!("p-{n:03}")).collect()
}

/// Message `n`, for process `n % len`, its value the number.
fn addressed(processes: &[String]) -> impl Fn(usize) -> TestRecord + Send + 'static {
    let processes = processes.to_vec();
    move |n| {
        let process = &processes[n % processes.len()];
        TestRecord::keyed(process.clone(), n.to_string()).header("process-id", process.clone())
    }
}

fn distinct_values(pool: &ProcessPool) -> usize {
    pool.received()
        .into_iter()
        .map(|r| r.value)
        .collect::<HashSet<_>>()
        .len()
}

/// The drain and the row of a cluster scenario.
async fn finish_cluster(
    mut run: ChaosRun,
    kafka: &Tansu,
    load: Load,
    pool: &ProcessPool,
    log: impl Fn() -> String,
) {
    let total = load.stop().await;
    run.drain(
        total,
        Duration::from_secs(180),
        || distinct_values(pool),
        &log,
    )
    .await;
    let received = pool.received();
    let delivered: HashSet<Vec<u8>> = received.iter().map(|r| r.value.clone()).collect();
    wait_commit_at_end(kafka, CLUSTER_GROUP, BUSINESS, &log).await;
    let dead = whole_topic(kafka, CLUSTER_DLQ)
        .await
        .into_iter()
        .filter(|r| r.value.as_ref().is_some_and(|v| !delivered.contains(v)))
        .count();
    run.finish(Outcome {
        delivered: delivered.len(),
        duplicated: received.len() - delivered.len(),
        dead_lettered: dead,
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_d_three_nodes_with_one_killed_and_restarted_again_and_again() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 6).await;
    kafka.create_topic(CLUSTER_DLQ, 1).await;
    let ids = ["node-a", "node-b", "node-c"];
    let mut nodes: Vec<Option<RelayProcess>> = ids
        .iter()
        .map(|id| {
            Some(RelayProcess::start(
                &node_config(id, &kafka.bootstrap(), ""),
                &[],
            ))
        })
        .collect();
    let addresses: Vec<String> = nodes
        .iter()
        .map(|node| node.as_ref().unwrap().client_addr().unwrap())
        .collect();
    let processes = process_ids(60);
    let mut pool = ProcessPool::default();
    for (i, id) in processes.iter().enumerate() {
        // Each with every node's address, a different one first.
        let mut mine = addresses.clone();
        mine.rotate_left(i % addresses.len());
        pool.connect(&mine, id, false).await;
    }
    let mut run = ChaosRun::start("d: three nodes, one SIGKILLed and restarted in turn");
    let period = (run.duration() / 2).min(Duration::from_secs(15));
    let load = Load::start(
        kafka.producer_config(),
        BUSINESS,
        RATE,
        addressed(&processes),
    );
    let mut kills = 0u32;
    let mut down_since: Option<Instant> = None;
    while run.running() {
        let elapsed = run.elapsed();
        // Node-b and node-c take turns; node-a stays up to be asked.
        let victim = 1 + (kills as usize % 2);
        if down_since.is_none() && elapsed >= period * (kills + 1) - period / 2 {
            nodes[victim].as_mut().unwrap().sigkill();
            nodes[victim] = None;
            down_since = Some(Instant::now());
        } else if down_since.is_some_and(|since| since.elapsed() >= Duration::from_secs(2)) {
            nodes[victim] = Some(RelayProcess::start(
                &node_config(ids[victim], &kafka.bootstrap(), ""),
                &[],
            ));
            down_since = None;
            kills += 1;
        }
        run.observe(load.acknowledged(), distinct_values(&pool));
        tokio::time::sleep(TICK).await;
    }
    if down_since.is_some() {
        let victim = 1 + (kills as usize % 2);
        nodes[victim] = Some(RelayProcess::start(
            &node_config(ids[victim], &kafka.bootstrap(), ""),
            &[],
        ));
    }
    let log = || {
        nodes
            .iter()
            .flatten()
            .map(RelayProcess::log)
            .collect::<Vec<_>>()
            .join("\n--- next node ---\n")
    };
    finish_cluster(run, &kafka, load, &pool, log).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_f_two_hundred_clients_reconnecting_in_a_storm() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 3).await;
    kafka.create_topic(CLUSTER_DLQ, 1).await;
    let node = RelayProcess::start(&node_config("node-a", &kafka.bootstrap(), ""), &[]);
    let proxy = FaultProxy::to(node.client_addr().unwrap().parse().unwrap());
    let processes = process_ids(200);
    let mut pool = ProcessPool::default();
    for id in &processes {
        pool.connect(&[proxy.addr().to_string()], id, false).await;
    }
    let mut run = ChaosRun::start("f: 200 clients reconnecting at once every 3 s");
    let load = Load::start(
        kafka.producer_config(),
        BUSINESS,
        RATE,
        addressed(&processes),
    );
    let mut storms = 0u128;
    while run.running() {
        if run.elapsed().as_millis() / 3_000 > storms {
            storms += 1;
            proxy.reset();
        }
        run.observe(load.acknowledged(), distinct_values(&pool));
        tokio::time::sleep(TICK).await;
    }
    finish_cluster(run, &kafka, load, &pool, || node.log()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_e_mesh_links_cut_and_restored_while_forwarding() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 4).await;
    kafka.create_topic(CLUSTER_DLQ, 1).await;
    // Each node advertises a proxy in front of its mesh listener: every
    // link between them goes through one of the two proxies.
    let mut proxies = Vec::new();
    let mut nodes = Vec::new();
    for id in ["node-a", "node-b"] {
        let mesh_port = support::relay::free_port();
        let proxy = FaultProxy::to(([127, 0, 0, 1], mesh_port).into());
        let config = node_config(
            id,
            &kafka.bootstrap(),
            &format!("mesh_advertise = \"{}\"", proxy.addr()),
        )
        .replace(
            "mesh_listen = \"127.0.0.1:0\"",
            &format!("mesh_listen = \"127.0.0.1:{mesh_port}\""),
        );
        nodes.push(RelayProcess::start(&config, &[]));
        proxies.push(proxy);
    }
    RelayProcess::wait_all_live(&nodes, 2, Duration::from_secs(30)).await;
    let processes = process_ids(40);
    let mut pool = ProcessPool::default();
    for (i, id) in processes.iter().enumerate() {
        pool.connect(&[nodes[i % 2].client_addr().unwrap()], id, false)
            .await;
    }
    let mut run = ChaosRun::start("e: mesh links cut for 1.5 s every 4 s while forwarding");
    let load = Load::start(
        kafka.producer_config(),
        BUSINESS,
        RATE,
        addressed(&processes),
    );
    let mut cut = false;
    while run.running() {
        let phase = run.elapsed().as_millis() % 4_000;
        let want = phase >= 2_500;
        if want != cut {
            cut = want;
            for proxy in &proxies {
                if cut { proxy.cut() } else { proxy.restore() }
            }
        }
        run.observe(load.acknowledged(), distinct_values(&pool));
        tokio::time::sleep(TICK).await;
    }
    for proxy in &proxies {
        proxy.restore();
    }
    let stat = |name: &str| -> u64 {
        nodes
            .iter()
            .map(|node| node.cluster_json()["stats"][name].as_u64().unwrap_or(0))
            .sum()
    };
    let (forwarded, broken) = (stat("forwards_sent"), stat("mesh_links_broken"));
    // The fault hit what it was meant to: forwards crossed the mesh, and
    // links broke under them.
    assert!(
        forwarded > 0 && broken > 0,
        "forwards {forwarded}, links broken {broken}"
    );
    let log = || {
        nodes
            .iter()
            .map(RelayProcess::log)
            .collect::<Vec<_>>()
            .join("\n--- next node ---\n")
    };
    finish_cluster(run, &kafka, load, &pool, log).await;
}

/// A center value for `kafka` (connection properties only).
fn center_value(kafka: &Tansu) -> String {
    json!({"bootstrap.servers": kafka.bootstrap(), "socket.timeout.ms": 10000}).to_string()
}

/// Points the `dir` center's `kafka.main` at `kafka` (written, then
/// renamed over the old value).
fn point_center_at(dir: &std::path::Path, kafka: &Tansu) {
    support::write_then_rename(dir, "kafka.main", center_value(kafka).as_bytes());
}

/// `(cluster, n)` of every service call the application received.
fn calls_received(app: &TestApp) -> HashSet<(String, u64)> {
    app.receipts()
        .iter()
        .filter_map(|r| {
            let body: serde_json::Value = serde_json::from_slice(&r.body).ok()?;
            Some((body["c"].as_str()?.to_string(), body["n"].as_u64()?))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_g_center_flips_and_plugin_reloads_together_under_load() {
    let clusters = [Tansu::start(), Tansu::start()];
    for kafka in &clusters {
        kafka.create_topic(INPUT, 3).await;
        kafka.create_topic(SIDECAR_DLQ, 1).await;
    }
    let center = tempfile::tempdir().unwrap();
    point_center_at(center.path(), &clusters[0]);
    let plugins = tempfile::tempdir().unwrap();
    support::write_then_rename(
        plugins.path(),
        "version-tag.wasm",
        &support::version_tag_bytes(0),
    );
    let app = TestApp::start(answer).await;
    let config = crate::link_switch::center_sidecar_config(
        &crate::link_switch::dir_center(center.path()),
        plugins.path(),
        "version-tag",
        &app.url,
    );
    let relay = RelayProcess::start(&config, &[]);
    let mut run = ChaosRun::start("g: center flips every 2 s, plugin reloads every 1 s");
    let loads: Vec<Load> = ["a", "b"]
        .into_iter()
        .zip(&clusters)
        .map(|(name, kafka)| {
            Load::start(kafka.producer_config(), INPUT, RATE / 2, move |n| {
                TestRecord::keyed(
                    format!("key-{}", n % 31),
                    json!({"c": name, "n": n}).to_string(),
                )
            })
        })
        .collect();
    let (mut flips, mut reloads) = (0u128, 0u32);
    let clock = Instant::now();
    let flip = |flips: &mut u128| {
        if clock.elapsed().as_millis() / 2_000 > *flips {
            *flips += 1;
            point_center_at(center.path(), &clusters[(*flips % 2) as usize]);
        }
    };
    while run.running() {
        flip(&mut flips);
        if run.elapsed().as_secs() > u64::from(reloads) {
            reloads += 1;
            support::write_then_rename(
                plugins.path(),
                "version-tag.wasm",
                &support::version_tag_bytes(reloads),
            );
        }
        let produced: usize = loads.iter().map(Load::acknowledged).sum();
        run.observe(produced, calls_received(&app).len());
        tokio::time::sleep(TICK).await;
    }
    let mut per_cluster = Vec::new();
    for load in loads {
        per_cluster.push(load.stop().await);
    }
    let produced = per_cluster.iter().sum();
    // Records written to a cluster while the link pointed at the other
    // wait there: the flips go on until both are drained.
    run.drain(
        produced,
        Duration::from_secs(180),
        || {
            flip(&mut flips);
            calls_received(&app).len()
        },
        || relay.log(),
    )
    .await;
    for kafka in &clusters {
        wait_commit_at_end(kafka, SIDECAR_GROUP, INPUT, || relay.log()).await;
    }
    let versions: HashSet<String> = app
        .receipts()
        .iter()
        .filter_map(|r| r.headers.get("x-kafka-header-x-version").cloned())
        .collect();
    assert!(
        versions.len() >= 2,
        "the plugin reloads never showed: versions seen {versions:?}"
    );
    let switches = relay.metric(r#"wasmrelay_link_switches_total{link="main"}"#);
    assert!(switches >= 2, "{switches} switches in the run");
    let received = calls_received(&app);
    run.finish(Outcome {
        delivered: received.len(),
        duplicated: app.count() - received.len(),
        dead_lettered: 0,
    });
}

/// A process that registers and then reads nothing, ever: a small receive
/// window, a Hello, and the socket held. Every `reconnect` it registers
/// again on a new connection (a stuck process restarted, stuck again).
struct DeafProcess {
    task: tokio::task::JoinHandle<()>,
}

impl DeafProcess {
    fn start(addr: String, process_id: String, reconnect: Duration) -> DeafProcess {
        use tokio::io::AsyncWriteExt as _;
        use wasmrelay_protocol::{Frame, FrameCodec, Kind, v1};
        let hello = FrameCodec::default()
            .encode_to_vec(&Frame::of(Kind::Hello(v1::Hello {
                protocol_version: 1,
                process_id: process_id.clone(),
                client_name: "chaos-deaf".to_string(),
                accepts_redirect: false,
                token: support::client_tokens::token(&process_id),
                redirects: 0,
            })))
            .expect("encoding a Hello");
        let addr: std::net::SocketAddr = addr.parse().expect("the node's client address");
        // Aborted by `Drop`.
        #[allow(clippy::disallowed_methods)]
        let task = tokio::spawn(async move {
            loop {
                let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
                socket.set_recv_buffer_size(4096).expect("a small window");
                if let Ok(mut stream) = socket.connect(addr).await {
                    let _ = stream.write_all(&hello).await;
                    tokio::time::sleep(reconnect).await;
                    drop(stream);
                } else {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        });
        DeafProcess { task }
    }
}

impl Drop for DeafProcess {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_h_slow_and_non_reading_clients_mixed_with_fast_ones() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 3).await;
    kafka.create_topic(CLUSTER_DLQ, 1).await;
    let node = RelayProcess::start(
        &node_config(
            "node-a",
            &kafka.bootstrap(),
            "max_unacked = 8\nslow_consumer_timeout = \"2s\"",
        ),
        &[],
    );
    let addr = node.client_addr().unwrap();
    // 80 fast processes, 10 slow ones (200 ms over each delivery, with 2
    // a second addressed to each), 10 that never read.
    let processes = process_ids(100);
    let is_deaf = |n: usize| n % 10 == 9;
    let is_slow = |n: usize| n % 10 == 8;
    let mut pool = ProcessPool::default();
    let mut deaf = Vec::new();
    for (n, id) in processes.iter().enumerate() {
        if is_deaf(n) {
            deaf.push(DeafProcess::start(
                addr.clone(),
                id.clone(),
                Duration::from_secs(5),
            ));
            continue;
        }
        let config = wasmrelay_client::ClientConfig::new(vec![addr.clone()], id.as_str())
            .with_token(support::client_tokens::token(id));
        let delay = if is_slow(n) {
            Duration::from_millis(200)
        } else {
            Duration::ZERO
        };
        pool.connect_slow(config, false, delay).await;
    }
    let mut run = ChaosRun::start("h: slow and non-reading clients among fast ones");
    let load = Load::start(
        kafka.producer_config(),
        BUSINESS,
        RATE,
        addressed(&processes),
    );
    // Stall and loss are counted over every message; the fast and slow
    // processes' messages must all be delivered, the deaf ones' all
    // dead-lettered once their time to live is over.
    let dead_letters = || async {
        whole_topic(&kafka, CLUSTER_DLQ)
            .await
            .into_iter()
            .filter_map(|r| {
                let value = r.value?;
                std::str::from_utf8(&value).ok()?.parse::<usize>().ok()
            })
            .collect::<HashSet<usize>>()
    };
    let mut dead_seen = 0;
    let mut last_look = Instant::now();
    while run.running() {
        if last_look.elapsed() >= Duration::from_secs(5) {
            dead_seen = dead_letters().await.len();
            last_look = Instant::now();
        }
        run.observe(load.acknowledged(), distinct_values(&pool) + dead_seen);
        tokio::time::sleep(TICK).await;
    }
    let total = load.stop().await;
    let deaf_total = (0..total).filter(|n| is_deaf(n % processes.len())).count();
    run.drain(
        total - deaf_total,
        Duration::from_secs(120),
        || distinct_values(&pool),
        || node.log(),
    )
    .await;
    // The deaf processes' messages wait out their time to live (30 s).
    let deadline = Instant::now() + Duration::from_secs(120);
    let dead = loop {
        let dead = dead_letters().await;
        if dead.len() >= deaf_total || Instant::now() >= deadline {
            break dead;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let received = pool.received();
    let delivered: HashSet<usize> = received
        .iter()
        .filter_map(|r| std::str::from_utf8(&r.value).ok()?.parse().ok())
        .collect();
    let wrongly_dead: Vec<&usize> = dead
        .iter()
        .filter(|n| !is_deaf(*n % processes.len()))
        .collect();
    assert!(
        wrongly_dead.is_empty(),
        "messages of processes that read were dead-lettered: {wrongly_dead:?}\n{}",
        node.log()
    );
    wait_commit_at_end(&kafka, CLUSTER_GROUP, BUSINESS, || node.log()).await;
    drop(deaf);
    run.drain(
        total,
        Duration::from_secs(1),
        || delivered.len() + dead.len(),
        || node.log(),
    )
    .await;
    run.finish(Outcome {
        delivered: delivered.len(),
        duplicated: received.len() - delivered.len(),
        dead_lettered: dead.len(),
    });
}
