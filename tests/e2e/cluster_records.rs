//! The cluster's Kafka records and node ids end to end: real `wasmrelay`
//! nodes on a real tansu broker, and records written straight to the
//! cluster topics with a plain Kafka producer. A record without a good MAC
//! changes nothing and is counted; a second node with a live node's id
//! exits naming the id; a node restarted after a crash is not blocked; a
//! live twin's heartbeat fires the alarm. The MACs made here follow
//! `docs/CLUSTER-RECORDS.md` by hand, so they also check that the format
//! documented is the one the nodes use.

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};
use support::processes::{ProcessPool, node_config};
use support::relay::{RelayProcess, http_get};
use support::tansu::{Tansu, TestRecord};

use wasmrelay_test_support as support;

const BUSINESS: &str = "business";
const HEARTBEATS: &str = "wasmrelay.heartbeats";
const ROUTES: &str = "wasmrelay.routes";
/// The secret of [`node_config`].
const SECRET: &[u8] = b"test-cluster-secret-0123456789abcdef";

fn cluster_of(node: &RelayProcess) -> Value {
    let (_, body) = http_get(&format!("{}/cluster", node.admin)).expect("no /cluster");
    serde_json::from_str(&body).unwrap()
}

fn holder_of(node: &RelayProcess, process: &str) -> Value {
    let (_, body) =
        http_get(&format!("{}/processes?id={process}", node.admin)).expect("no /processes");
    serde_json::from_str(&body).unwrap()
}

/// HMAC-SHA256 (RFC 2104), written out so the test depends on nothing of
/// the relay's.
fn hmac_sha256(key: &[u8], message: &[u8]) -> Vec<u8> {
    let mut block = [0u8; 64];
    if key.len() > 64 {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let pad = |byte: u8| block.iter().map(|k| k ^ byte).collect::<Vec<u8>>();
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(message)
        .finalize();
    Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize()
        .to_vec()
}

/// The record MAC of `docs/CLUSTER-RECORDS.md`.
fn record_mac(secret: &[u8], purpose: &str, kind: &str, parts: &[&[u8]]) -> Vec<u8> {
    let key = hmac_sha256(secret, format!("wasmrelay-key\n{purpose}").as_bytes());
    let mut input = Vec::new();
    let label: &[u8] = b"wasmrelay-record";
    for part in [label, kind.as_bytes()].iter().chain(parts) {
        input.extend((part.len() as u32).to_be_bytes());
        input.extend(*part);
    }
    hmac_sha256(&key, &input)
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// A heartbeat of `node_id` (instance `instance`) with mesh address `mesh`.
fn heartbeat(node_id: &str, instance: &str, mesh: &str) -> Vec<u8> {
    json!({
        "node_id": node_id, "instance_id": instance,
        "client_addr": mesh, "mesh_addr": mesh, "admin_addr": mesh,
        "connections": 0, "quota": 1000,
        "started_at_ms": now_ms(), "sent_at_ms": now_ms(), "leaving": false,
    })
    .to_string()
    .into_bytes()
}

fn heartbeat_signed(secret: &[u8], node_id: &str, instance: &str, mesh: &str) -> TestRecord {
    let value = heartbeat(node_id, instance, mesh);
    let mac = record_mac(
        secret,
        "heartbeat-record",
        "heartbeat",
        &[node_id.as_bytes(), &value],
    );
    TestRecord::keyed(node_id, value).header("wasmrelay-mac", mac)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_heartbeats_and_routes_change_nothing_and_are_counted() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 3).await;
    let a = RelayProcess::start(&node_config("node-a", &kafka.bootstrap(), ""), &[]);
    let b = RelayProcess::start(&node_config("node-b", &kafka.bootstrap(), ""), &[]);
    let mut pool = ProcessPool::default();
    pool.connect(&[b.client_addr().unwrap()], "p-1", false)
        .await;
    a.wait_for("a knows p-1 is on b", Duration::from_secs(20), || {
        holder_of(&a, "p-1")["node"] == "node-b"
    })
    .await;
    let b_mesh = b.mesh_addr().unwrap();

    // Where a forged heartbeat would send the nodes: a listener that
    // counts the connections it gets.
    let trap = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let trap_addr = trap.local_addr().unwrap().to_string();
    let dialled = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = dialled.clone();
    #[allow(clippy::disallowed_methods)]
    let trap_task = tokio::spawn(async move {
        while trap.accept().await.is_ok() {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });

    // Heartbeats: a new node and node-b moved to the trap, without a MAC,
    // with a MAC of another secret, and node-b's with its value altered.
    let mut altered = heartbeat_signed(SECRET, "node-b", "0000000000000000", &b_mesh);
    altered.value = Some(heartbeat("node-b", "0000000000000000", &trap_addr));
    kafka
        .produce(
            HEARTBEATS,
            [
                TestRecord::keyed("node-x", heartbeat("node-x", "1", &trap_addr)),
                TestRecord::keyed("node-b", heartbeat("node-b", "2", &trap_addr)),
                heartbeat_signed(b"a guess at the secret", "node-x", "3", &trap_addr),
                altered,
            ],
        )
        .await;
    // Routes: p-1 moved to node-a (which would replace the live session on
    // b), without a MAC and with a wrong one, and its tombstone for b.
    let route = json!({"node": "node-a", "registered_at_ms": now_ms(), "generation": u64::MAX / 2})
        .to_string();
    let wrong = record_mac(
        b"a guess at the secret",
        "route-record",
        "route",
        &[b"p-1", route.as_bytes()],
    );
    kafka
        .produce(
            ROUTES,
            [
                TestRecord::keyed("p-1", route.clone()),
                TestRecord::keyed("p-1", route.clone()).header("wasmrelay-mac", wrong),
                TestRecord {
                    key: Some(b"p-1".to_vec()),
                    value: None,
                    ..TestRecord::default()
                }
                .header("wasmrelay-node", "node-b")
                .header("wasmrelay-generation", "1"),
            ],
        )
        .await;

    let rejected = |node: &RelayProcess, topic: &str, reason: &str| {
        node.metric(&format!(
            "wasmrelay_cluster_records_rejected_total{{topic=\"{topic}\",reason=\"{reason}\"}}"
        ))
    };
    for node in [&a, &b] {
        node.wait_for(
            "the forged records counted",
            Duration::from_secs(20),
            || {
                rejected(node, HEARTBEATS, "missing_mac") == 2
                    && rejected(node, HEARTBEATS, "bad_mac") == 2
                    && rejected(node, ROUTES, "missing_mac") == 2
                    && rejected(node, ROUTES, "bad_mac") == 1
            },
        )
        .await;
    }
    // Give a forged record the time it would need to have an effect.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        dialled.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "a node dialled the address of a forged heartbeat"
    );
    let view = cluster_of(&a);
    let nodes: Vec<&str> = view["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["node_id"].as_str().unwrap())
        .collect();
    assert_eq!(nodes, ["node-a", "node-b"], "{view}");
    assert_eq!(view["nodes"][1]["mesh_addr"], b_mesh, "{view}");
    assert_eq!(view["mesh"], json!(["node-b"]), "{view}");
    // The live session stays where it is, everywhere.
    assert_eq!(holder_of(&a, "p-1")["node"], "node-b");
    let on_b = holder_of(&b, "p-1");
    assert_eq!(on_b["connected_here"], true, "{on_b}");
    // Connected once, to b, and never replaced.
    let events = pool.events();
    assert!(
        events.len() == 1 && events[0].1.starts_with("Connected"),
        "{events:?}"
    );
    for node in [&a, &b] {
        let log = node.log();
        assert!(
            !log.contains(std::str::from_utf8(SECRET).unwrap()),
            "the secret is in a log"
        );
        assert!(log.contains("ignoring a heartbeat"), "{log}");
        assert!(log.contains("ignoring a route record"), "{log}");
    }
    trap_task.abort();
}

/// Runs `wasmrelay run` on `config` until it exits (at most `timeout`);
/// returns its exit code and everything it wrote.
fn run_to_exit(config: &str, timeout: Duration) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("relay.toml");
    std::fs::write(&path, config).unwrap();
    let log_path = dir.path().join("relay.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut child = Command::new(support::wasmrelay_binary())
        .args(["run", "--config"])
        .arg(&path)
        .env("RUST_LOG", "info")
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "wasmrelay did not exit within {timeout:?}:\n{}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (
        status.code(),
        std::fs::read_to_string(&log_path).unwrap_or_default(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_live_instance_per_node_id() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 3).await;
    let a = RelayProcess::start(&node_config("node-a", &kafka.bootstrap(), ""), &[]);
    let instance = cluster_of(&a)["instance_id"].as_str().unwrap().to_string();
    assert_eq!(instance.len(), 16, "{instance}");

    // A second node with a's id: refused before it serves, naming the id.
    let (code, output) = run_to_exit(
        &node_config("node-a", &kafka.bootstrap(), ""),
        Duration::from_secs(60),
    );
    assert!(code.is_some_and(|c| c != 0), "exit {code:?}:\n{output}");
    assert!(
        output.contains("node id `node-a` is already in use by a live node")
            && output.contains(&instance),
        "{output}"
    );
    assert!(!output.contains("mesh link up"), "it served:\n{output}");
    // a goes on as before, alone and without an alarm.
    let view = cluster_of(&a);
    assert_eq!(view["live"], 1, "{view}");
    assert_eq!(view["alarm"], false, "{view}");
    assert_eq!(view["instance_id"], instance.as_str(), "{view}");

    // A node killed and started again at once is not blocked: its old
    // instance no longer beats.
    let mut b = RelayProcess::start(&node_config("node-b", &kafka.bootstrap(), ""), &[]);
    b.sigkill();
    let b = RelayProcess::start(&node_config("node-b", &kafka.bootstrap(), ""), &[]);
    assert_ne!(cluster_of(&b)["instance_id"], Value::Null);
    drop(b);

    // A twin that slipped through (started at the same moment): its
    // heartbeats fire the alarm while they come.
    let twin = heartbeat_signed(SECRET, "node-a", "7777777777777777", "127.0.0.1:9");
    kafka.produce(HEARTBEATS, [twin]).await;
    a.wait_for("the twin alarm", Duration::from_secs(10), || {
        let view = cluster_of(&a);
        view["alarm"] == true && view["twin_instance"] == "7777777777777777"
    })
    .await;
    assert!(a.metric("wasmrelay_cluster_twin_heartbeats_total") >= 1);
    assert!(a.metrics().contains("wasmrelay_cluster_alarm 1"));
    assert!(
        a.log()
            .contains("another instance is running with this node's id"),
        "{}",
        a.log()
    );
    // Once the twin is silent for node_timeout (3 s), the alarm clears.
    a.wait_for("the alarm cleared", Duration::from_secs(15), || {
        cluster_of(&a)["alarm"] == false
    })
    .await;
}
