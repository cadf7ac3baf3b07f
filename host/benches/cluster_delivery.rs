//! CPU per cluster delivery inside one process: the relay's delivery path
//! (delivery lines, the process's session, the gateway's connection tasks,
//! and for a routed delivery the mesh link both ways and the far node's
//! gateway) without Kafka, the flow or the lane, against a plain loop that
//! writes the same `Deliver` frames straight to the same process.
//!
//! The routed benchmark (`bench/cluster/routed.sh`) measures the whole
//! path, but shares two cores with tansu and the load generators, and its
//! figure swings by ±20% from run to run. This one has nothing else in
//! the process: its figures move by a few percent, so a change to the
//! delivery path can be judged by it.
//!
//! Three runs of `DELIVERIES` 256 B messages, at most 1,000 unanswered,
//! over 12 partitions (one delivery line each):
//! - `plain`: a task writes `Deliver` frames to a TCP connection and
//!   reads the acks; the floor (framing, loopback TCP, the process).
//! - `local`: `ClusterDelivery::start` to a process connected to this
//!   node's gateway.
//! - `routed`: the same to a process connected to a second node, found in
//!   the route table and forwarded over the mesh (sealed frames).
//!
//! In every run the process is the same task: it acks each delivery as it
//! reads it. CPU is the whole process's (`/proc/self/stat`), so the
//! process and the driver count in every run alike; what a run adds over
//! `plain` is the relay's. Run with
//! `cargo bench -p wasmrelay --bench cluster_delivery`
//! (`BENCH_DELIVERIES`, default 200,000 per run; `BENCH_ROUNDS`, default 5:
//! the three runs are repeated, interleaved, and each path's median is
//! printed with the range). `BENCH_ONLY=routed` (or `local`, `plain`)
//! runs that path alone, e.g. under `perf record`.

// Its tasks (nodes, processes) live as long as the benchmark's process.
#![allow(
    clippy::unwrap_used,
    clippy::print_stdout,
    clippy::disallowed_methods,
    missing_docs
)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt as _, SinkExt as _, StreamExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;
use wasmrelay::cluster::membership::ClusterView;
use wasmrelay::cluster::mesh::{Mesh, MeshOptions};
use wasmrelay::cluster::routes::RouteTable;
use wasmrelay::cluster::{ClusterDelivery, DeliveryPolicy};
use wasmrelay::flow::DeliveryEnd;
use wasmrelay::gateway::{Gateway, GatewayOptions, Upstream, UpstreamError};
use wasmrelay::kafka::{DeliveryOrder, InputRecord, OutputRecord};
use wasmrelay_protocol::v1;
use wasmrelay_protocol::{Frame, FrameCodec, Kind};

const SECRET: &[u8] = b"the cluster secret of the benchmark";
const MAX_FRAME: usize = 64 * 1024;
/// Deliveries unanswered at most (as a partition's pending records).
const WINDOW: usize = 1_000;
const PARTITIONS: i64 = 12;
const VALUE_BYTES: usize = 256;

type Conn = Framed<TcpStream, FrameCodec>;

struct NoUpstream;

impl Upstream for NoUpstream {
    fn send(
        &self,
        _process_id: &str,
        _send: v1::Send,
    ) -> BoxFuture<'static, Result<wasmrelay::gateway::Accepted, UpstreamError>> {
        async { Err(UpstreamError::Refused("no upstream here".to_string())) }.boxed()
    }
}

/// A node: its gateway (and client address) and its mesh (and address).
struct Node {
    gateway: Arc<Gateway>,
    gateway_addr: SocketAddr,
    mesh: Arc<Mesh>,
    mesh_addr: SocketAddr,
}

async fn start_node(id: &str, stop: &CancellationToken) -> Node {
    let gateway = Gateway::new(
        GatewayOptions {
            node_id: id.to_string(),
            max_frame_bytes: MAX_FRAME,
            ..GatewayOptions::default()
        },
        wasmrelay::gateway::ClientAuth::none(),
        Arc::new(NoUpstream),
        None,
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway_addr = listener.local_addr().unwrap();
    tokio::spawn(gateway.clone().serve(listener, stop.clone()));
    let mesh = Mesh::new(
        MeshOptions {
            node_id: id.to_string(),
            secret: SECRET.to_vec(),
            max_frame_bytes: MAX_FRAME,
            link_queue: 1024,
            connect_timeout: Duration::from_secs(1),
            keepalive: Duration::from_secs(1),
            reconnect_backoff: (Duration::from_millis(20), Duration::from_millis(200)),
            lookup_timeout: Duration::from_secs(1),
            tls: None,
        },
        gateway.clone(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mesh_addr = listener.local_addr().unwrap();
    tokio::spawn(mesh.clone().serve(listener, stop.clone()));
    Node {
        gateway,
        gateway_addr,
        mesh,
        mesh_addr,
    }
}

/// The business process: acks every delivery it reads, flushing when no
/// more frames are ready. Ends when the connection does.
async fn ack_everything(mut conn: Conn) {
    while let Some(Ok(frame)) = conn.next().await {
        let mut frame = Some(frame);
        while let Some(ready) = frame.take() {
            if let Some(Kind::Deliver(deliver)) = ready.kind
                && conn
                    .feed(Frame::of(Kind::Ack(v1::Ack { seq: deliver.seq })))
                    .await
                    .is_err()
            {
                return;
            }
            frame = conn.next().now_or_never().flatten().and_then(Result::ok);
        }
        if conn.flush().await.is_err() {
            return;
        }
    }
}

/// Connects process `process_id` to `node` and starts acking.
async fn connect_process(node: &Node, process_id: &str) {
    let mut conn = Framed::new(
        TcpStream::connect(node.gateway_addr).await.unwrap(),
        FrameCodec::new(MAX_FRAME),
    );
    conn.send(Frame::of(Kind::Hello(v1::Hello {
        protocol_version: 1,
        process_id: process_id.to_string(),
        client_name: "bench".to_string(),
        ..Default::default()
    })))
    .await
    .unwrap();
    let welcome = conn.next().await.unwrap().unwrap();
    assert!(
        matches!(welcome.kind, Some(Kind::Welcome(_))),
        "{welcome:?}"
    );
    tokio::spawn(ack_everything(conn));
    while node.gateway.session(process_id).is_none() {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn input(offset: i64) -> InputRecord {
    InputRecord {
        topic: "bench-input".into(),
        partition: (offset % PARTITIONS) as i32,
        offset,
        key: None,
        value: None,
        headers: Vec::new(),
        timestamp_ms: None,
    }
}

fn message(process_id: &str) -> OutputRecord {
    OutputRecord {
        key: Some(process_id.as_bytes().to_vec()),
        value: Some(vec![b'x'; VALUE_BYTES]),
        headers: vec![("process-id".to_string(), process_id.as_bytes().to_vec())],
    }
}

/// `node`'s route table with every node of `live` live.
fn route_table(id: &str, gateway: &Arc<Gateway>, live: &[&str]) -> Arc<RouteTable> {
    let table = RouteTable::new(
        id,
        wasmrelay_protocol::mesh_auth::purpose_key(
            SECRET,
            wasmrelay_protocol::mesh_auth::Purpose::RouteRecord,
        ),
        Duration::from_secs(10),
        gateway.clone(),
        Default::default(),
    );
    table.follow_view(&ClusterView::of_live_nodes(live));
    table
}

fn policy() -> DeliveryPolicy {
    DeliveryPolicy {
        ttl: Duration::from_secs(30),
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(500),
        retried: Default::default(),
        lines_recovering: Default::default(),
        order: DeliveryOrder::Key,
    }
}

/// CPU seconds the whole process has spent (user and system).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // After the command name (which may hold spaces): fields 3.. of proc(5).
    let fields: Vec<&str> = stat.rsplit_once(") ").unwrap().1.split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // USER_HZ, 100 on Linux.
    ticks as f64 / 100.0
}

/// What one run measured.
#[derive(Clone, Copy)]
struct Measured {
    cpu_us_per_delivery: f64,
    per_second: f64,
}

/// The median of a path's runs (by CPU), with their range.
struct Summary {
    cpu_us_per_delivery: f64,
    per_second: f64,
    lowest_cpu: f64,
    highest_cpu: f64,
}

fn median(mut runs: Vec<Measured>) -> Summary {
    runs.sort_by(|a, b| a.cpu_us_per_delivery.total_cmp(&b.cpu_us_per_delivery));
    let middle = runs[runs.len() / 2];
    Summary {
        cpu_us_per_delivery: middle.cpu_us_per_delivery,
        per_second: middle.per_second,
        lowest_cpu: runs[0].cpu_us_per_delivery,
        highest_cpu: runs[runs.len() - 1].cpu_us_per_delivery,
    }
}

async fn measure<F: Future<Output = ()>>(count: usize, run: F) -> Measured {
    let (cpu, wall) = (cpu_seconds(), Instant::now());
    run.await;
    let (cpu, wall) = (cpu_seconds() - cpu, wall.elapsed().as_secs_f64());
    Measured {
        cpu_us_per_delivery: cpu * 1e6 / count as f64,
        per_second: count as f64 / wall,
    }
}

/// Delivers `count` messages to `process_id` through `delivery`, at most
/// [`WINDOW`] unanswered; each must be delivered.
async fn through_the_relay(delivery: &Arc<ClusterDelivery>, process_id: &str, count: usize) {
    let abort = CancellationToken::new();
    let message = message(process_id);
    let mut ends = FuturesUnordered::new();
    for offset in 0..count as i64 {
        while ends.len() >= WINDOW {
            assert_eq!(ends.next().await, Some(DeliveryEnd::Delivered));
        }
        let end = delivery
            .start(
                process_id.to_string(),
                &input(offset),
                message.clone(),
                abort.clone(),
            )
            .await;
        ends.push(end);
    }
    while let Some(end) = ends.next().await {
        assert_eq!(end, DeliveryEnd::Delivered);
    }
}

/// The floor: the same `Deliver` frames written straight to a process's
/// connection, at most [`WINDOW`] unanswered.
async fn plain_loop(count: usize) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        ack_everything(Framed::new(stream, FrameCodec::new(MAX_FRAME))).await;
    });
    let conn = Framed::new(
        TcpStream::connect(addr).await.unwrap(),
        FrameCodec::new(MAX_FRAME),
    );
    let (mut sink, mut stream) = conn.split();
    let room = Arc::new(Semaphore::new(WINDOW));
    let acks = {
        let room = room.clone();
        tokio::spawn(async move {
            let mut acked = 0;
            while acked < count {
                match stream.next().await.unwrap().unwrap().kind {
                    Some(Kind::Ack(_)) => {
                        acked += 1;
                        room.add_permits(1);
                    }
                    other => panic!("expected an ack, got {other:?}"),
                }
            }
        })
    };
    let process_id = "plain";
    let wire = wasmrelay::cluster::delivery::to_wire(&input(0), message(process_id));
    for offset in 0..count as u64 {
        room.acquire().await.unwrap().forget();
        let frame = Frame::of(Kind::Deliver(v1::Deliver {
            seq: offset,
            delivery_id: format!("bench-input/{}/{offset}", offset as i64 % PARTITIONS),
            message: Some(v1::Message {
                offset: offset as i64,
                ..wire.clone()
            }),
        }));
        sink.feed(frame).await.unwrap();
        if room.available_permits() == 0 || offset + 1 == count as u64 {
            sink.flush().await.unwrap();
        }
    }
    acks.await.unwrap();
}

fn main() {
    let count: usize = std::env::var("BENCH_DELIVERIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let rounds: usize = std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5)
        .max(1);
    let only = std::env::var("BENCH_ONLY").ok();
    let runs_path = move |path: &str| only.as_deref().is_none_or(|only| only == path);
    // As a node runs: two worker threads.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // In a task of the runtime, as a node's lanes are (not on the thread
    // that blocks on the runtime, which would add a thread to every hop).
    let run = runtime.spawn(async move {
        let stop = CancellationToken::new();
        let a = start_node("a", &stop).await;
        let b = start_node("b", &stop).await;
        let peers: BTreeMap<String, String> = [("a", &a), ("b", &b)]
            .into_iter()
            .map(|(id, node)| (id.to_string(), node.mesh_addr.to_string()))
            .collect();
        a.mesh.set_peers(peers.clone());
        b.mesh.set_peers(peers);
        tokio::time::timeout(Duration::from_secs(10), a.mesh.wait_linked(&["b"]))
            .await
            .expect("the two nodes link within 10 s");
        connect_process(&a, "proc-local").await;
        connect_process(&b, "proc-routed").await;
        let routes = route_table("a", &a.gateway, &["a", "b"]);
        assert!(routes.learn("proc-routed", "b", 1));
        let delivery = ClusterDelivery::new(
            a.gateway.clone(),
            Some(routes),
            Some(a.mesh.clone()),
            policy(),
        );

        // A short warm-up of each path, then the runs.
        let warm_up = count / 20;
        plain_loop(warm_up).await;
        through_the_relay(&delivery, "proc-local", warm_up).await;
        through_the_relay(&delivery, "proc-routed", warm_up).await;
        // Rounds of the three, interleaved; each path's median is reported
        // (a run now and then is slowed by the machine).
        let mut runs: [Vec<Measured>; 3] = Default::default();
        for _ in 0..rounds {
            if runs_path("plain") {
                runs[0].push(measure(count, plain_loop(count)).await);
            }
            if runs_path("local") {
                runs[1].push(measure(count, through_the_relay(&delivery, "proc-local", count)).await);
            }
            if runs_path("routed") {
                runs[2].push(measure(count, through_the_relay(&delivery, "proc-routed", count)).await);
            }
        }
        stop.cancel();
        if runs.iter().any(Vec::is_empty) {
            for (name, run) in ["plain", "local", "routed"].iter().zip(&runs) {
                if !run.is_empty() {
                    let run = median(run.clone());
                    println!("{name}: {:.2} µs CPU per delivery ({:.2}-{:.2}), {:.0}/s", run.cpu_us_per_delivery, run.lowest_cpu, run.highest_cpu, run.per_second);
                }
            }
            return;
        }
        let [plain, local, routed] = runs.map(median);

        println!(
            "\n{count} deliveries of {VALUE_BYTES} B, at most {WINDOW} unanswered, {PARTITIONS} partitions, one process (2 worker threads); median of {rounds} rounds (range in brackets)"
        );
        println!("| path | CPU µs per delivery | deliveries/s | CPU / plain | CPU added over plain, µs |");
        println!("|---|---:|---:|---:|---:|");
        for (name, run) in [
            ("plain (frames straight to the process)", &plain),
            ("local (ClusterDelivery to this node's process)", &local),
            ("routed (ClusterDelivery over the mesh)", &routed),
        ] {
            println!(
                "| {name} | {:.2} ({:.2}-{:.2}) | {:.0} | {:.2}x | {:+.2} |",
                run.cpu_us_per_delivery,
                run.lowest_cpu,
                run.highest_cpu,
                run.per_second,
                run.cpu_us_per_delivery / plain.cpu_us_per_delivery,
                run.cpu_us_per_delivery - plain.cpu_us_per_delivery,
            );
        }
        println!(
            "the mesh adds {:.2} µs per delivery (routed less local)",
            routed.cpu_us_per_delivery - local.cpu_us_per_delivery
        );
    });
    runtime.block_on(run).unwrap();
}
