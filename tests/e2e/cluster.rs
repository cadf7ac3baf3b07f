//! The relay cluster end to end: real `wasmrelay` nodes (separate
//! processes), a real tansu broker, business processes on the SDK over real
//! TCP.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use rand::Rng as _;
use serde_json::Value;
use support::processes::{ProcessPool, node_config};
use support::relay::{RelayProcess, http_get};
use support::tansu::{Tansu, TestRecord};

use wasmrelay_test_support as support;

const BUSINESS: &str = "business";

/// The client listener address a cluster node logged.
fn client_addr(node: &RelayProcess) -> String {
    node.client_addr()
        .unwrap_or_else(|| panic!("the node logged no client listener:\n{}", node.log()))
}

fn get_json(url: &str) -> (u16, Value) {
    let (status, body) = http_get(url).unwrap_or_else(|| panic!("no answer from {url}"));
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

/// Each process received the messages of each partition in offset order.
fn check_in_order_per_process(received: &[support::processes::Received]) -> Result<(), String> {
    let mut last: BTreeMap<(String, i32), i64> = BTreeMap::new();
    for r in received {
        let previous = last.insert((r.process_id.clone(), r.partition), r.offset);
        if previous.is_some_and(|p| p >= r.offset) {
            return Err(format!(
                "{} got partition {} offset {} after {previous:?}",
                r.process_id, r.partition, r.offset
            ));
        }
    }
    Ok(())
}

/// Messages numbered in their value, each addressed (header `process-id`)
/// to a random process, and which process each value is for.
struct Addressed {
    records: Vec<TestRecord>,
    process_of: HashMap<String, String>,
}

/// `count` messages addressed to random ones of `processes`.
fn addressed(count: usize, processes: &[String]) -> Addressed {
    let mut rng = rand::rng();
    let mut process_of = HashMap::new();
    let records = (0..count)
        .map(|n| {
            let process = processes[rng.random_range(0..processes.len())].clone();
            process_of.insert(n.to_string(), process.clone());
            TestRecord::keyed(process.clone(), n.to_string()).header("process-id", process)
        })
        .collect();
    Addressed {
        records,
        process_of,
    }
}

impl Addressed {
    /// Every message reached exactly its process, exactly once, in order
    /// per process and partition.
    fn assert_each_delivered_once(&self, received: &[support::processes::Received]) {
        if let Err(wrong) = self.check_each_delivered_once(received) {
            panic!("{wrong}");
        }
    }

    /// [`Self::assert_each_delivered_once`], saying what is wrong.
    fn check_each_delivered_once(
        &self,
        received: &[support::processes::Received],
    ) -> Result<(), String> {
        if received.len() != self.records.len() {
            let mut times: HashMap<&str, Vec<(&str, &str)>> = HashMap::new();
            for r in received {
                times
                    .entry(r.delivery_id.as_str())
                    .or_default()
                    .push((r.process_id.as_str(), r.node_id.as_str()));
            }
            let twice: Vec<_> = times
                .iter()
                .filter(|(_, got)| got.len() > 1)
                .take(10)
                .collect();
            return Err(format!(
                "{} messages received for {} sent in a run without faults; received more than \
                 once (delivery id: process, node): {twice:?}",
                received.len(),
                self.records.len()
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for r in received {
            let value = String::from_utf8(r.value.clone()).unwrap();
            if self.process_of[&value] != r.process_id {
                return Err(format!(
                    "message {value} went to {}, not {}",
                    r.process_id, self.process_of[&value]
                ));
            }
            if !seen.insert(value.clone()) {
                return Err(format!("message {value} received twice"));
            }
        }
        check_in_order_per_process(received)
    }

    /// Every reply came from the process the message was for.
    fn assert_replies(&self, replies: &[support::tansu::ConsumedRecord]) {
        assert_eq!(replies.len(), self.records.len());
        for reply in replies {
            let process =
                std::str::from_utf8(reply.header("wasmrelay-origin-process").unwrap()).unwrap();
            let value = String::from_utf8(reply.value.clone().unwrap()).unwrap();
            assert_eq!(self.process_of[&value], process);
            assert!(reply.header("wasmrelay-delivery-id").is_some());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_node_delivers_each_message_to_its_process_once_and_takes_replies() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 3).await;
    let node = RelayProcess::start(&node_config("node-a", &kafka.bootstrap(), ""), &[]);
    let processes: Vec<String> = (0..20).map(|n| format!("proc-{n:02}")).collect();
    let mut pool = ProcessPool::default();
    for id in &processes {
        pool.connect(&[client_addr(&node)], id, true).await;
    }
    node.wait_for("all processes registered", Duration::from_secs(10), || {
        get_json(&format!("{}/cluster", node.admin)).1["connections"] == 20
    })
    .await;

    let messages = addressed(2000, &processes);
    kafka.produce(BUSINESS, messages.records.clone()).await;
    node.wait_for("every message delivered", Duration::from_secs(90), || {
        pool.count() >= 2000
    })
    .await;
    // A duplicate would come after the last first delivery: wait for quiet.
    node.wait_quiet(
        "no more deliveries",
        Duration::from_millis(500),
        Duration::from_secs(30),
        || pool.count(),
    )
    .await;
    let received = pool.received();
    messages.assert_each_delivered_once(&received);
    assert!(received.iter().all(|r| r.node_id == "node-a"));
    let replies = kafka
        .consume_all("business.replies", 2000, Duration::from_secs(60))
        .await;
    messages.assert_replies(&replies);

    let (status, found) = get_json(&format!("{}/processes?id=proc-07", node.admin));
    assert_eq!(status, 200, "{found}");
    assert_eq!(found["node"], "node-a");
    assert_eq!(found["connected_here"], true);
    let (status, _) = get_json(&format!("{}/processes?id=nobody", node.admin));
    assert_eq!(status, 404);
    let (status, _) = get_json(&format!("{}/processes", node.admin));
    assert_eq!(status, 400);
    let (_, cluster) = get_json(&format!("{}/cluster", node.admin));
    assert_eq!(cluster["live"], 1, "{cluster}");
    assert_eq!(cluster["alarm"], false);
    // The node advertises the addresses its port-0 listeners got.
    let me = &cluster["nodes"][0];
    assert_eq!(me["node_id"], "node-a", "{cluster}");
    assert_eq!(me["client_addr"], client_addr(&node), "{cluster}");
    assert_eq!(me["mesh_addr"], node.mesh_addr().unwrap(), "{cluster}");
    assert_eq!(
        me["admin_addr"],
        node.admin.strip_prefix("http://").unwrap(),
        "{cluster}"
    );
}

/// A cluster of nodes on one broker, started one by one.
struct Cluster {
    /// Each node's id, client address (kept after a kill: its processes
    /// still try it) and process while it runs.
    nodes: Vec<(String, String, Option<RelayProcess>)>,
}

impl Cluster {
    /// Nodes `ids`, started one after the other, each with `extra` in its
    /// `[cluster]`.
    fn start(kafka: &Tansu, ids: &[&str], extra: &str) -> Cluster {
        let mut cluster = Cluster { nodes: Vec::new() };
        for id in ids {
            cluster.start_node(kafka, id, extra);
        }
        cluster
    }

    /// `count` processes `<prefix>-<n>`, spread over the nodes (each with
    /// every node's address, its own first).
    async fn connect_processes(
        &self,
        count: usize,
        prefix: &str,
        reply: bool,
    ) -> (Vec<String>, ProcessPool) {
        let processes: Vec<String> = (0..count).map(|n| format!("{prefix}-{n:04}")).collect();
        let mut pool = ProcessPool::default();
        for (i, id) in processes.iter().enumerate() {
            pool.connect(&self.addresses_from(i % self.nodes.len()), id, reply)
                .await;
        }
        (processes, pool)
    }

    fn start_node(&mut self, kafka: &Tansu, id: &str, extra: &str) {
        let node = RelayProcess::start(&node_config(id, &kafka.bootstrap(), extra), &[]);
        self.nodes
            .push((id.to_string(), client_addr(&node), Some(node)));
    }

    fn node(&self, index: usize) -> &RelayProcess {
        self.nodes[index].2.as_ref().unwrap()
    }

    fn cluster_json(&self, index: usize) -> Value {
        get_json(&format!("{}/cluster", self.node(index).admin)).1
    }

    /// Waits until `done()` holds, checking every 50 ms; after `timeout`
    /// the test fails with `what`, what each running node's `/cluster`
    /// says (routes, connections, live nodes, stats) and the end of each
    /// node's log: a cluster test that times out shows every node, not
    /// only the first.
    async fn wait_for(&self, what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
        let started = std::time::Instant::now();
        while !done() {
            if started.elapsed() >= timeout {
                panic!(
                    "timed out after {timeout:?} waiting for {what}\n{}",
                    self.describe()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Each running node's view and the last lines of its log.
    fn describe(&self) -> String {
        let mut out = String::new();
        for (id, _, node) in &self.nodes {
            let Some(node) = node else {
                out.push_str(&format!("--- {id}: not running\n"));
                continue;
            };
            let view = http_get(&format!("{}/cluster", node.admin))
                .and_then(|(_, body)| serde_json::from_str::<Value>(&body).ok())
                .unwrap_or(Value::Null);
            let log = node.log();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(60)..].join("\n");
            out.push_str(&format!(
                "--- {id}: routes {} connections {} live {} stats {}\n{tail}\n",
                view["routes"], view["connections"], view["live"], view["stats"]
            ));
        }
        out.push_str(&format!(
            "--- consumer group events\n{}",
            self.group_events()
        ));
        out
    }

    /// Each running node's consumer group events (partitions assigned,
    /// revoked, abandoned, commits refused), from its log.
    fn group_events(&self) -> String {
        let mut out = String::new();
        for (id, _, node) in &self.nodes {
            let Some(node) = node else { continue };
            for line in node.log().lines().filter(|l| {
                l.contains("partitions assigned")
                    || l.contains("partitions revoked")
                    || l.contains("abandoned")
                    || l.contains("committing offsets")
            }) {
                out.push_str(&format!("{id}: {line}\n"));
            }
        }
        out
    }

    /// Waits until the business topic's consumer group has settled: each
    /// node's last group event is an assignment, and together they hold
    /// each of the topic's `partitions` once. A test about routing starts
    /// its traffic then: messages consumed while the group still moves
    /// partitions may come twice (at least once), which is not routing's
    /// doing.
    async fn wait_group_settled(&self, partitions: i32) {
        self.wait_for(
            "the consumer group settled",
            Duration::from_secs(60),
            || {
                let mut held: Vec<i32> = Vec::new();
                for (_, _, node) in &self.nodes {
                    let Some(node) = node else { continue };
                    let log = node.log();
                    let last = log.lines().rfind(|l| {
                        l.contains("partitions assigned") || l.contains("partitions revoked")
                    });
                    let Some(assigned) = last.and_then(|l| l.split_once("partitions assigned"))
                    else {
                        return false;
                    };
                    let Some((_, list)) = assigned.1.split_once("partitions=[") else {
                        return false;
                    };
                    let list = list.split(']').next().unwrap_or_default();
                    held.extend(list.split(',').filter_map(|p| p.trim().parse::<i32>().ok()));
                }
                held.sort_unstable();
                held == (0..partitions).collect::<Vec<_>>()
            },
        )
        .await;
    }

    /// Client addresses, starting with node `first`'s.
    fn addresses_from(&self, first: usize) -> Vec<String> {
        let n = self.nodes.len();
        (0..n)
            .map(|i| self.nodes[(first + i) % n].1.clone())
            .collect()
    }

    /// Whether every running node sees exactly `ids` live and linked.
    fn all_agree(&self, ids: &[&str]) -> bool {
        self.nodes
            .iter()
            .enumerate()
            .all(|(i, (self_id, _, node))| {
                if node.is_none() {
                    return true;
                }
                let view = self.cluster_json(i);
                let Some(nodes) = view["nodes"].as_array() else {
                    return false;
                };
                let live: Vec<&str> = nodes
                    .iter()
                    .filter(|n| n["live"] == true)
                    .filter_map(|n| n["node_id"].as_str())
                    .collect();
                let mesh: Vec<&str> = view["mesh"]
                    .as_array()
                    .map(|m| m.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                let mut expected_mesh: Vec<&str> =
                    ids.iter().copied().filter(|id| id != self_id).collect();
                expected_mesh.sort_unstable();
                let mut live_sorted = live.clone();
                live_sorted.sort_unstable();
                let mut ids_sorted = ids.to_vec();
                ids_sorted.sort_unstable();
                live_sorted == ids_sorted && mesh == expected_mesh
            })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_started_one_by_one_join_every_mesh_within_three_heartbeats() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 3).await;
    let mut cluster = Cluster { nodes: Vec::new() };
    let interval = Duration::from_millis(500);
    let mut ids: Vec<&str> = Vec::new();
    for (index, id) in ["node-a", "node-b", "node-c"].into_iter().enumerate() {
        cluster.start_node(&kafka, id, "");
        ids.push(id);
        // From the node's first heartbeat (its membership start, on this
        // machine's clock) until every node has it live and linked.
        let started_ms = cluster.cluster_json(index)["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["node_id"] == id)
            .unwrap()["started_at_ms"]
            .as_i64()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !cluster.all_agree(&ids) {
            assert!(
                std::time::Instant::now() < deadline,
                "the nodes never agreed on {ids:?}: {:#?}",
                (0..cluster.nodes.len())
                    .map(|i| cluster.cluster_json(i))
                    .collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64;
        let took = Duration::from_millis(u64::try_from(now_ms - started_ms).unwrap());
        eprintln!("{id}: in every node's mesh {took:?} after its first heartbeat");
        assert!(
            took <= interval * 3,
            "{id} joined every mesh only {took:?} after its first heartbeat (3 heartbeat \
             intervals: {:?})",
            interval * 3
        );
    }
    // Every node's /cluster agrees: same live nodes, same addresses.
    let views: Vec<Value> = (0..3).map(|i| cluster.cluster_json(i)).collect();
    for view in &views {
        assert_eq!(view["live"], 3, "{view}");
        assert_eq!(view["alarm"], false);
        let addrs: Vec<&Value> = view["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| &n["mesh_addr"])
            .collect();
        let first: Vec<&Value> = views[0]["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| &n["mesh_addr"])
            .collect();
        assert_eq!(addrs, first);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_route_every_message_to_its_process_exactly_once() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 6).await;
    let cluster = Cluster::start(&kafka, &["node-a", "node-b", "node-c"], "");
    let (processes, pool) = cluster.connect_processes(1000, "p", true).await;
    cluster
        .wait_for(
            "every route known on every node",
            Duration::from_secs(30),
            || (0..3).all(|i| cluster.cluster_json(i)["routes"] == 1000),
        )
        .await;
    // Placement spreads them (each process dials its own node first and
    // may be redirected to a less loaded one): about a third each. Three
    // nodes place at once, each seeing the others' counts as of their last
    // heartbeat, so not exactly (one placer is exact to 10%: see
    // `placement::processes_given_one_address_spread_over_the_nodes_by_quota`).
    let counts: Vec<u64> = (0..3)
        .map(|i| cluster.cluster_json(i)["connections"].as_u64().unwrap())
        .collect();
    for connections in &counts {
        assert!(
            connections.abs_diff(333) <= 66,
            "the nodes hold {counts:?} of 1000 processes: not about a third each"
        );
    }

    cluster.wait_group_settled(6).await;

    let total = 50_000;
    let messages = addressed(total, &processes);
    // In chunks: tansu takes single-record batches slowly while three
    // nodes consume, and librdkafka times out records queued too long.
    for chunk in messages.records.chunks(2_000) {
        kafka.produce(BUSINESS, chunk.to_vec()).await;
    }
    cluster
        .wait_for("every message delivered", Duration::from_secs(240), || {
            pool.count() >= total
        })
        .await;
    cluster
        .node(0)
        .wait_quiet(
            "no more deliveries",
            Duration::from_secs(1),
            Duration::from_secs(60),
            || pool.count(),
        )
        .await;
    if let Err(wrong) = messages.check_each_delivered_once(&pool.received()) {
        panic!("{wrong}\n{}", cluster.describe());
    }
    let replies = kafka
        .consume_all("business.replies", total, Duration::from_secs(120))
        .await;
    messages.assert_replies(&replies);
    // Messages crossed the mesh: processes sit on all three nodes, and every
    // node consumed some of the partitions.
    for i in 0..3 {
        let stats = &cluster.cluster_json(i)["stats"];
        assert!(stats["forwards_delivered"].as_u64().unwrap() > 0, "{stats}");
        assert!(stats["forwards_received"].as_u64().unwrap() > 0, "{stats}");
        assert_eq!(stats["forwards_lost"], 0, "{stats}");
    }
    let (_, metrics) = http_get(&format!("{}/metrics", cluster.node(1).admin)).unwrap();
    assert!(
        metrics.contains("wasmrelay_cluster_live_nodes 3"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_loses_nothing_its_processes_move_and_the_alarm_fires() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 6).await;
    let mut cluster = Cluster::start(
        &kafka,
        &["node-a", "node-b", "node-c"],
        "min_live_nodes = 3",
    );
    let (processes, pool) = cluster.connect_processes(300, "p", false).await;
    cluster
        .wait_for("every route known", Duration::from_secs(30), || {
            (0..3).all(|i| cluster.cluster_json(i)["routes"] == 300)
        })
        .await;

    let total = 10_000;
    let messages = addressed(total, &processes);
    let (first, rest) = messages.records.split_at(6_000);
    for chunk in first.chunks(2_000) {
        kafka.produce(BUSINESS, chunk.to_vec()).await;
    }
    // Killed in the middle of the stream, with work in flight.
    cluster
        .wait_for("traffic before the kill", Duration::from_secs(60), || {
            pool.count() >= 2_000
        })
        .await;
    cluster.nodes[2].2.as_mut().unwrap().sigkill();
    cluster.nodes[2].2 = None;
    for chunk in rest.chunks(2_000) {
        kafka.produce(BUSINESS, chunk.to_vec()).await;
    }

    // The killed node's processes move to the others.
    cluster
        .wait_for(
            "processes reconnected elsewhere",
            Duration::from_secs(30),
            || {
                pool.nodes()
                    .values()
                    .all(|n| n.as_deref().is_some_and(|n| n != "node-c"))
            },
        )
        .await;
    // The live count dropped below the minimum: the alarm fires.
    cluster
        .wait_for(
            "the alarm in every survivor's /cluster",
            Duration::from_secs(30),
            || {
                (0..2).all(|i| {
                    let view = cluster.cluster_json(i);
                    view["live"] == 2 && view["alarm"] == true
                })
            },
        )
        .await;
    let (_, metrics) = http_get(&format!("{}/metrics", cluster.node(0).admin)).unwrap();
    assert!(metrics.contains("wasmrelay_cluster_alarm 1"), "{metrics}");
    // (Nodes starting one by one may have reported the alarm and its end
    // before: look for the report of the loss.)
    let alarms = kafka
        .consume_all("wasmrelay.alarms", 100, Duration::from_secs(5))
        .await;
    let alarms: Vec<Value> = alarms
        .iter()
        .map(|a| serde_json::from_slice(a.value.as_deref().unwrap()).unwrap())
        .collect();
    assert!(
        alarms
            .iter()
            .any(|a| a["firing"] == true && a["live"] == 2 && a["min_live_nodes"] == 3),
        "no alarm for 2 of 3 live nodes on the alarm topic: {alarms:#?}"
    );

    // A replacement node joins, as an orchestrator would start one (the
    // survivors rejoin the group for the dead node on their own too: see
    // the next test); the killed node's partitions are consumed again from
    // their commits.
    cluster.start_node(&kafka, "node-d", "min_live_nodes = 3");

    // Every message arrives at least once; duplicates carry the same id.
    cluster
        .wait_for(
            "every message at least once",
            Duration::from_secs(120),
            || {
                let values: std::collections::HashSet<Vec<u8>> =
                    pool.received().into_iter().map(|r| r.value).collect();
                values.len() == total
            },
        )
        .await;
    let mut ids: HashMap<Vec<u8>, std::collections::HashSet<String>> = HashMap::new();
    for r in pool.received() {
        ids.entry(r.value).or_default().insert(r.delivery_id);
    }
    assert!(
        ids.values().all(|d| d.len() == 1),
        "a duplicate with another delivery id"
    );
    assert!(pool.received().len() >= total);
    eprintln!(
        "delivered {} times for {total} messages",
        pool.received().len()
    );
    cluster
        .wait_for(
            "the alarm cleared with three live nodes",
            Duration::from_secs(30),
            || {
                let view = cluster.cluster_json(0);
                view["live"] == 3 && view["alarm"] == false
            },
        )
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_nodes_partitions_move_to_the_survivors_with_no_replacement_started() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 6).await;
    let mut cluster = Cluster::start(&kafka, &["node-a", "node-b", "node-c"], "");
    let (processes, pool) = cluster.connect_processes(60, "p", false).await;
    cluster
        .wait_for("every route known", Duration::from_secs(30), || {
            (0..3).all(|i| cluster.cluster_json(i)["routes"] == 60)
        })
        .await;
    let total = 3_000;
    let messages = addressed(total, &processes);
    let (first, rest) = messages.records.split_at(1_000);
    kafka.produce(BUSINESS, first.to_vec()).await;
    cluster
        .wait_for("traffic before the kill", Duration::from_secs(60), || {
            pool.count() >= 500
        })
        .await;
    cluster.nodes[2].2.as_mut().unwrap().sigkill();
    cluster.nodes[2].2 = None;
    kafka.produce(BUSINESS, rest.to_vec()).await;

    // No node-d: the survivors themselves make the group reassign the dead
    // node's partitions once its session has ended (tansu never would).
    cluster
        .wait_for(
            "every message at least once, on the two survivors",
            Duration::from_secs(90),
            || {
                let values: std::collections::HashSet<Vec<u8>> =
                    pool.received().into_iter().map(|r| r.value).collect();
                values.len() == total
            },
        )
        .await;
    let rejoined = (0..2).any(|i| {
        cluster
            .node(i)
            .log()
            .contains("rejoining the consumer group")
    });
    assert!(
        rejoined,
        "no survivor said it rejoined:\n{}",
        cluster.node(0).log()
    );
}

/// A node of a cluster whose link follows a `dir` config center at `center`.
fn node_config_from_center(id: &str, center: &std::path::Path) -> String {
    let config = node_config(id, "from-the-center", "");
    let config = config.replace(
        "[links.main]\nbootstrap_servers = \"from-the-center\"",
        "[links.main]\nfrom_center = true",
    );
    assert!(config.contains("from_center = true"), "{config}");
    format!(
        "[center]\nkind = \"dir\"\ndir = \"{}\"\ndrain_timeout = \"10s\"\n{config}",
        center.display()
    )
}

/// Points the center's `kafka.main` at `kafka` (an atomic replace).
fn point_center_at(center: &std::path::Path, kafka: &Tansu) {
    let tmp = center.join(".tmp");
    std::fs::write(
        &tmp,
        serde_json::json!({"bootstrap.servers": kafka.bootstrap()}).to_string(),
    )
    .unwrap();
    std::fs::rename(&tmp, center.join("kafka.main")).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_following_the_center_beats_and_routes_on_the_new_kafka_after_a_switch() {
    let (kafka1, kafka2) = (Tansu::start(), Tansu::start());
    for kafka in [&kafka1, &kafka2] {
        kafka.create_topic(BUSINESS, 3).await;
    }
    let center = tempfile::tempdir().unwrap();
    point_center_at(center.path(), &kafka1);
    let mut cluster = Cluster { nodes: Vec::new() };
    for id in ["node-a", "node-b"] {
        let node = RelayProcess::start(&node_config_from_center(id, center.path()), &[]);
        cluster
            .nodes
            .push((id.to_string(), client_addr(&node), Some(node)));
    }
    cluster
        .wait_for(
            "both nodes live and linked",
            Duration::from_secs(30),
            || cluster.all_agree(&["node-a", "node-b"]),
        )
        .await;
    let (processes, pool) = cluster.connect_processes(20, "p", false).await;

    point_center_at(center.path(), &kafka2);
    for i in 0..2 {
        cluster
            .node(i)
            .wait_for("the link on the new cluster", Duration::from_secs(30), || {
                get_json(&format!("{}/links", cluster.node(i).admin)).1["links"][0]["current"]
                    ["bootstrap_servers"]
                    == kafka2.bootstrap()
            })
            .await;
    }
    // Three node timeouts (3 s each) on the new cluster: heartbeats read
    // where they are written keep every peer live.
    let until = std::time::Instant::now() + Duration::from_secs(9);
    while std::time::Instant::now() < until {
        for i in 0..2 {
            let view = cluster.cluster_json(i);
            assert!(
                view["live"] == 2 && view["alarm"] == false,
                "node {i} lost its peer after the switch: {view}"
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // Every process's route is on the new cluster (not only after the
    // next anti-entropy period).
    let routes = kafka2
        .consume_all("wasmrelay.routes", 10_000, Duration::from_secs(8))
        .await;
    let routed: std::collections::HashSet<String> = routes
        .iter()
        .filter(|r| r.value.is_some())
        .map(|r| String::from_utf8(r.key.clone().unwrap()).unwrap())
        .collect();
    assert_eq!(routed.len(), 20, "routes on the new cluster: {routed:?}");

    // And messages on the new cluster reach their processes.
    let messages = addressed(300, &processes);
    kafka2.produce(BUSINESS, messages.records.clone()).await;
    cluster
        .wait_for("every message delivered", Duration::from_secs(60), || {
            let values: std::collections::HashSet<Vec<u8>> =
                pool.received().into_iter().map(|r| r.value).collect();
            values.len() == 300
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_registered_twice_on_two_nodes_replaces_the_older_connection() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 2).await;
    let cluster = Cluster::start(&kafka, &["node-a", "node-b"], "");
    let mut older = ProcessPool::default();
    older
        .connect(&[cluster.nodes[0].1.clone()], "twice", false)
        .await;
    cluster
        .node(1)
        .wait_for(
            "node-b knows the route to node-a",
            Duration::from_secs(10),
            || {
                get_json(&format!("{}/processes?id=twice", cluster.node(1).admin)).1["node"]
                    == "node-a"
            },
        )
        .await;
    let mut newer = ProcessPool::default();
    newer
        .connect(&[cluster.nodes[1].1.clone()], "twice", false)
        .await;
    cluster
        .wait_for(
            "the older connection told it was replaced",
            Duration::from_secs(10),
            || {
                older
                    .events()
                    .iter()
                    .any(|(_, e)| e.contains("Replaced") && e.contains("node-b"))
            },
        )
        .await;
    cluster
        .wait_for(
            "both nodes route to node-b",
            Duration::from_secs(10),
            || {
                (0..2).all(|i| {
                    get_json(&format!("{}/processes?id=twice", cluster.node(i).admin)).1["node"]
                        == "node-b"
                })
            },
        )
        .await;
    cluster
        .wait_for(
            "node-a closed the older connection",
            Duration::from_secs(10),
            || cluster.cluster_json(0)["connections"] == 0,
        )
        .await;
    // Messages now reach the newer connection only.
    kafka
        .produce(
            BUSINESS,
            (0..20).map(|n| TestRecord::keyed("twice", format!("{n}"))),
        )
        .await;
    cluster
        .wait_for(
            "deliveries to the newer connection",
            Duration::from_secs(30),
            || newer.count() == 20,
        )
        .await;
    assert_eq!(older.count(), 0);
    // Compaction keeps the last record of each key: it must be node-b's
    // route, not node-a's goodbye (a node started on the compacted topic
    // would not know the process).
    let routes = kafka
        .consume_all("wasmrelay.routes", 1_000, Duration::from_secs(3))
        .await;
    let last = routes
        .iter()
        .rfind(|r| r.key.as_deref() == Some(b"twice".as_slice()))
        .expect("a route record for the process");
    let value: Value = serde_json::from_slice(last.value.as_deref().unwrap_or_else(|| {
        panic!(
            "the last record for the process is a tombstone: {:?}",
            last.headers
        )
    }))
    .unwrap();
    assert_eq!(value["node"], "node-b", "{routes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_missed_a_route_record_delivers_after_anti_entropy_well_before_the_ttl() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 2).await;
    let refresh = "route_refresh_interval = \"3s\"";
    // node-a's reader drops the route record of `missed` once: a broker
    // that lost it. Its mesh lookups are off, or they would heal it first
    // (a_node_that_missed_a_route_record_delivers_at_once_through_a_mesh_lookup).
    let node_a = RelayProcess::start(
        &node_config("node-a", &kafka.bootstrap(), refresh),
        &[
            ("WASMRELAY_TEST_DROP_ROUTE_RECORD", "missed"),
            ("WASMRELAY_TEST_NO_MESH_LOOKUPS", "1"),
        ],
    );
    let mut cluster = Cluster { nodes: Vec::new() };
    cluster
        .nodes
        .push(("node-a".to_string(), client_addr(&node_a), Some(node_a)));
    cluster.start_node(&kafka, "node-b", refresh);
    let mut pool = ProcessPool::default();
    pool.connect(&[cluster.nodes[1].1.clone()], "missed", false)
        .await;
    cluster
        .wait_for("node-a dropped the route", Duration::from_secs(10), || {
            cluster.node(0).log().contains("dropping a route record")
        })
        .await;
    // Messages for it on both partitions, from the moment it is missed:
    // node-a's share waits for the route (well within the 30 s ttl).
    kafka
        .produce(
            BUSINESS,
            (0..20).map(|n| TestRecord::keyed("missed", format!("{n}")).in_partition(n % 2)),
        )
        .await;
    let started = std::time::Instant::now();
    cluster
        .wait_for("node-a routes to node-b", Duration::from_secs(10), || {
            get_json(&format!("{}/processes?id=missed", cluster.node(0).admin)).1["node"]
                == "node-b"
        })
        .await;
    cluster
        .wait_for("every message delivered", Duration::from_secs(15), || {
            pool.count() == 20
        })
        .await;
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "well before the ttl"
    );
    assert!(cluster.cluster_json(1)["stats"]["routes_republished"].as_u64() > Some(0));
    assert_eq!(cluster.cluster_json(0)["stats"]["lookups_sent"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_record_the_broker_never_delivered_to_a_node_is_written_again_by_its_writer() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 2).await;
    // Neither anti-entropy nor a lookup can be what heals it here.
    let refresh = "route_refresh_interval = \"1h\"";
    // node-a's reader skips the route record of `missed` as tansu does with
    // a batch stored out of offset order: never delivered, the offsets
    // after it are.
    let node_a = RelayProcess::start(
        &node_config("node-a", &kafka.bootstrap(), refresh),
        &[
            ("WASMRELAY_TEST_TAIL_SKIP_ONCE", "wasmrelay.routes/missed"),
            ("WASMRELAY_TEST_NO_MESH_LOOKUPS", "1"),
        ],
    );
    let mut cluster = Cluster { nodes: Vec::new() };
    cluster
        .nodes
        .push(("node-a".to_string(), client_addr(&node_a), Some(node_a)));
    cluster.start_node(&kafka, "node-b", refresh);
    cluster
        .wait_for("both nodes linked", Duration::from_secs(20), || {
            cluster.all_agree(&["node-a", "node-b"])
        })
        .await;
    let mut pool = ProcessPool::default();
    let node_b = [cluster.nodes[1].1.clone()];
    pool.connect(&node_b, "missed", false).await;
    cluster
        .wait_for("node-a skipped the route", Duration::from_secs(10), || {
            cluster.node(0).log().contains("skipping a record")
        })
        .await;
    // Later records of its partition show node-a the offset it never got
    // (six partitions: some of 60 routes land in that one).
    for n in 0..60 {
        pool.connect(&node_b, &format!("after-{n:02}"), false).await;
    }
    cluster
        .wait_for("node-a knows every route", Duration::from_secs(15), || {
            cluster.cluster_json(0)["routes"] == 61
        })
        .await;
    let (status, found) = get_json(&format!("{}/processes?id=missed", cluster.node(0).admin));
    assert_eq!(
        (status, &found["node"]),
        (200, &Value::from("node-b")),
        "{found}"
    );
    let a = cluster.cluster_json(0)["stats"].clone();
    let b = cluster.cluster_json(1)["stats"].clone();
    assert!(a["route_records_missed"].as_u64() >= Some(1), "{a}");
    assert!(a["route_rewrites_asked"].as_u64() >= Some(1), "{a}");
    assert!(
        b["route_rewrites_asked_by_peers"].as_u64() >= Some(1),
        "{b}"
    );
    assert!(b["routes_rewritten_for_missed"].as_u64() >= Some(1), "{b}");
    assert_eq!(a["lookups_sent"], 0, "{a}");
    let (_, metrics) = http_get(&format!("{}/metrics", cluster.node(0).admin)).unwrap();
    let missed = metrics
        .lines()
        .find_map(|line| line.strip_prefix("wasmrelay_cluster_route_records_missed_total "))
        .and_then(|n| n.trim().parse::<u64>().ok());
    assert!(missed >= Some(1), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_missed_a_route_record_delivers_at_once_through_a_mesh_lookup() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 2).await;
    // Anti-entropy cannot be what heals it within this test.
    let refresh = "route_refresh_interval = \"1h\"";
    // node-a's reader drops the route record of `missed` once: a broker
    // that lost it.
    let node_a = RelayProcess::start(
        &node_config("node-a", &kafka.bootstrap(), refresh),
        &[("WASMRELAY_TEST_DROP_ROUTE_RECORD", "missed")],
    );
    let mut cluster = Cluster { nodes: Vec::new() };
    cluster
        .nodes
        .push(("node-a".to_string(), client_addr(&node_a), Some(node_a)));
    cluster.start_node(&kafka, "node-b", refresh);
    let mut pool = ProcessPool::default();
    pool.connect(&[cluster.nodes[1].1.clone()], "missed", false)
        .await;
    cluster
        .wait_for("node-a dropped the route", Duration::from_secs(10), || {
            cluster.node(0).log().contains("dropping a route record")
        })
        .await;
    assert_eq!(
        get_json(&format!("{}/processes?id=missed", cluster.node(0).admin)).0,
        404,
        "node-a knows no route for the process"
    );
    // Messages for it on both partitions: node-a's share finds the process
    // by asking node-b over the mesh, on the first attempt.
    kafka
        .produce(
            BUSINESS,
            (0..20).map(|n| TestRecord::keyed("missed", format!("{n}")).in_partition(n % 2)),
        )
        .await;
    let started = std::time::Instant::now();
    cluster
        .wait_for("every message delivered", Duration::from_secs(15), || {
            pool.count() == 20
        })
        .await;
    let took = started.elapsed();
    let consumed_by_a = cluster
        .node(0)
        .metric(r#"wasmrelay_messages_consumed_total{flow="business"}"#);
    assert!(
        consumed_by_a > 0,
        "node-a consumed none of the messages (no partition?): nothing shown"
    );
    let stats_a = &cluster.cluster_json(0)["stats"];
    assert!(stats_a["lookups_found"].as_u64() >= Some(1), "{stats_a}");
    assert_eq!(
        cluster
            .node(0)
            .metric(r#"wasmrelay_retries_total{flow="business"}"#),
        0,
        "node-a delivered its share on the first attempts ({took:?}): {stats_a}"
    );
    // The holder wrote its route again (anti-entropy would not have for an
    // hour), and node-a read it: it routes to node-b.
    let stats_b = &cluster.cluster_json(1)["stats"];
    assert!(stats_b["lookups_received"].as_u64() >= Some(1), "{stats_b}");
    assert!(
        stats_b["routes_republished"].as_u64() >= Some(1),
        "{stats_b}"
    );
    let routes = kafka
        .consume_all("wasmrelay.routes", 1_000, Duration::from_secs(3))
        .await;
    let written: Vec<Value> = routes
        .iter()
        .filter(|r| r.key.as_deref() == Some(b"missed".as_slice()))
        .filter_map(|r| serde_json::from_slice(r.value.as_deref()?).ok())
        .collect();
    assert!(
        written.len() >= 2,
        "the route was not written again: {written:?}"
    );
    assert!(
        written
            .iter()
            .all(|w| w["node"] == "node-b" && w["generation"] == written[0]["generation"]),
        "{written:?}"
    );
    let (status, process) = get_json(&format!("{}/processes?id=missed", cluster.node(0).admin));
    assert_eq!((status, &process["node"]), (200, &Value::from("node-b")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_client_prints_deliveries_as_json_lines_and_replies() {
    let binary = support::relay_client_example();
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 1).await;
    let node = RelayProcess::start(&node_config("node-a", &kafka.bootstrap(), ""), &[]);
    let child = tokio::process::Command::new(binary)
        .args([
            "--connect",
            &client_addr(&node),
            "--process-id",
            "cli-1",
            "--token",
            &support::client_tokens::token("cli-1"),
            "--reply",
            "--count",
            "3",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("starting relay-client");
    node.wait_for(
        "the example client registered",
        Duration::from_secs(20),
        || get_json(&format!("{}/processes?id=cli-1", node.admin)).0 == 200,
    )
    .await;
    kafka
        .produce(
            BUSINESS,
            (0..3).map(|n| {
                TestRecord::keyed("cli-1", format!("{{\"n\":{n}}}")).header("trace", "abc")
            }),
        )
        .await;
    let output = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("relay-client did not exit after 3 deliveries")
        .unwrap();
    assert!(
        output.status.success(),
        "relay-client failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let lines: Vec<Value> = String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    for (n, line) in lines.iter().enumerate() {
        assert_eq!(line["value"], format!("{{\"n\":{n}}}"), "{line}");
        assert_eq!(line["key"], "cli-1");
        assert_eq!(line["headers"]["trace"], "abc");
        assert_eq!(line["delivery_id"], format!("business/0/{n}"));
        assert_eq!(line["node"], "node-a");
    }
    let replies = kafka
        .consume_all("business.replies", 3, Duration::from_secs(30))
        .await;
    assert_eq!(replies.len(), 3);
    assert_eq!(
        replies[0].header("wasmrelay-origin-process"),
        Some(&b"cli-1"[..])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_with_a_header_of_the_relays_own_is_refused_naming_it_and_never_written() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 1).await;
    let node = RelayProcess::start(&node_config("node-a", &kafka.bootstrap(), ""), &[]);
    let config = wasmrelay_client::ClientConfig::new(vec![client_addr(&node)], "forger")
        .with_token(support::client_tokens::token("forger"));
    let (client, _events) = wasmrelay_client::Client::connect(config).await.unwrap();
    for name in [
        "wasmrelay-delivery-id",
        "WasmRelay-Origin-Process",
        "wasmrelay-mac",
    ] {
        let mut forged = wasmrelay_client::OutgoingMessage::new("forged");
        forged.headers.push((name.to_string(), "x".into()));
        match client.send(forged).await {
            Err(wasmrelay_client::SendError::Rejected(error)) => {
                assert!(
                    error.contains(&format!("header `{name}` is reserved")),
                    "{error}"
                );
            }
            other => panic!("a send with header {name} was not refused: {other:?}"),
        }
    }
    // The connection is fine, and a send without one goes through.
    let mut honest = wasmrelay_client::OutgoingMessage::new("honest");
    honest.headers.push(("trace".to_string(), "abc".into()));
    client.send(honest).await.expect("an honest send");
    let replies = kafka
        .consume_all("business.replies", 1, Duration::from_secs(30))
        .await;
    assert_eq!(replies.len(), 1);
    // Nothing else is there (a forged record would come before the honest one).
    let again = kafka
        .consume_all("business.replies", 2, Duration::from_secs(3))
        .await;
    assert_eq!(again.len(), 1, "{again:?}");
    assert_eq!(again[0].value.as_deref(), Some(&b"honest"[..]));
    assert_eq!(
        again[0].header("wasmrelay-origin-process"),
        Some(&b"forger"[..])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_pipelined_on_one_connection_reach_kafka_and_are_acknowledged_in_the_order_sent() {
    use futures::{SinkExt as _, StreamExt as _};
    use wasmrelay_protocol::{Frame, FrameCodec, Kind, v1};
    const SENDS: u64 = 300;
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 1).await;
    let node = RelayProcess::start(&node_config("node-a", &kafka.bootstrap(), ""), &[]);
    // The frames themselves, all written at once: nothing but the node
    // decides the order they are taken in.
    let stream = tokio::net::TcpStream::connect(client_addr(&node))
        .await
        .unwrap();
    let mut conn = tokio_util::codec::Framed::new(stream, FrameCodec::default());
    conn.send(Frame::of(Kind::Hello(v1::Hello {
        protocol_version: wasmrelay_protocol::PROTOCOL_VERSION,
        process_id: "pipeliner".to_string(),
        client_name: "test".to_string(),
        token: support::client_tokens::token("pipeliner"),
        ..v1::Hello::default()
    })))
    .await
    .unwrap();
    let welcome = conn.next().await.unwrap().unwrap();
    assert!(
        matches!(welcome.kind, Some(Kind::Welcome(_))),
        "{welcome:?}"
    );
    for seq in 1..=SENDS {
        conn.feed(Frame::of(Kind::Send(v1::Send {
            seq,
            key: Some("one-key".into()),
            value: seq.to_string().into(),
            ..v1::Send::default()
        })))
        .await
        .unwrap();
    }
    conn.flush().await.unwrap();
    let mut acked = Vec::new();
    while acked.len() < SENDS as usize {
        let frame = tokio::time::timeout(Duration::from_secs(30), conn.next())
            .await
            .expect("no SendAck within 30 s")
            .unwrap()
            .unwrap();
        match frame.kind {
            Some(Kind::SendAck(ack)) => {
                assert!(ack.ok, "send {} refused: {}", ack.seq, ack.error);
                acked.push(ack.seq);
            }
            Some(Kind::Ping(_) | Kind::Pong(_)) => {}
            other => panic!("expected a SendAck, got {other:?}"),
        }
    }
    assert_eq!(
        acked,
        (1..=SENDS).collect::<Vec<_>>(),
        "acknowledged out of order"
    );
    let written = kafka
        .consume_all("business.replies", SENDS as usize, Duration::from_secs(30))
        .await;
    let values: Vec<u64> = written
        .iter()
        .map(|r| {
            std::str::from_utf8(r.value.as_deref().unwrap())
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(
        values,
        (1..=SENDS).collect::<Vec<_>>(),
        "written out of order"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_too_large_for_a_frame_is_dead_lettered_at_once_and_the_session_is_untouched() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 1).await;
    // Frames of at most 4 KiB to processes (and peers); the ttl is 30 s.
    let config = node_config("node-a", &kafka.bootstrap(), "max_frame_bytes = 4096");
    let node = RelayProcess::start(&config, &[]);
    let mut pool = ProcessPool::default();
    pool.connect(&[client_addr(&node)], "big", false).await;
    let started = std::time::Instant::now();
    kafka
        .produce(
            BUSINESS,
            [
                TestRecord::keyed("big", "x".repeat(10_000)),
                TestRecord::keyed("big", "small, after it"),
            ],
        )
        .await;
    let dead = kafka
        .consume_all("business.dlq", 1, Duration::from_secs(30))
        .await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "dead-lettered only after {:?} (the ttl is 30 s)",
        started.elapsed()
    );
    let reason =
        String::from_utf8(dead[0].header("wasmrelay-dlq-reason").unwrap().to_vec()).unwrap();
    assert!(reason.contains("can never be delivered"), "{reason}");
    assert!(reason.contains("4096"), "{reason}");
    node.wait_for(
        "the small message delivered",
        Duration::from_secs(30),
        || pool.count() == 1,
    )
    .await;
    assert_eq!(pool.received()[0].value, b"small, after it");
    // The session saw nothing of the large one: connected once, no error,
    // no reconnect.
    let events = pool.events();
    assert_eq!(events.len(), 1, "{events:?}");
    assert!(events[0].1.starts_with("Connected"), "{events:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_for_no_process_are_retried_until_the_ttl_then_dead_lettered() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 1).await;
    let config =
        node_config("node-a", &kafka.bootstrap(), "").replace("ttl = \"30s\"", "ttl = \"2s\"");
    let node = RelayProcess::start(&config, &[]);
    let mut pool = ProcessPool::default();
    let started = std::time::Instant::now();
    kafka
        .produce(
            BUSINESS,
            [
                TestRecord::keyed("nobody", "for a process that never connects"),
                TestRecord {
                    value: Some(b"no process id at all".to_vec()),
                    ..TestRecord::default()
                },
                TestRecord::keyed("late", "for a process that connects within the ttl"),
            ],
        )
        .await;
    // Both lines (keys `nobody` and `late`) go one at a time while their
    // deliveries fail, and operators can see it.
    let recovering = r#"wasmrelay_delivery_lines_recovering{flow="business"}"#;
    node.wait_for("two lines recovering", Duration::from_secs(10), || {
        node.metric(recovering) == 2
    })
    .await;
    pool.connect(&[client_addr(&node)], "late", false).await;
    let dead = kafka
        .consume_all("business.dlq", 2, Duration::from_secs(30))
        .await;
    assert_eq!(dead.len(), 2, "{dead:?}");
    let header = |r: &support::tansu::ConsumedRecord, name: &str| {
        String::from_utf8(r.header(name).unwrap_or_default().to_vec()).unwrap()
    };
    let no_id = dead
        .iter()
        .find(|r| r.value.as_deref() == Some(&b"no process id at all"[..]))
        .unwrap();
    assert_eq!(header(no_id, "wasmrelay-dlq-stage"), "router:built-in");
    assert!(header(no_id, "wasmrelay-dlq-reason").contains("no process id"));
    let nobody = dead
        .iter()
        .find(|r| r.key.as_deref() == Some(&b"nobody"[..]))
        .unwrap();
    assert_eq!(header(nobody, "wasmrelay-dlq-stage"), "deliver");
    assert_eq!(
        nobody.value.as_deref(),
        Some(&b"for a process that never connects"[..]),
        "the dead letter carries the message"
    );
    let reason = header(nobody, "wasmrelay-dlq-reason");
    assert!(
        reason.contains("nobody") && reason.contains("time to live"),
        "{reason}"
    );
    assert_eq!(header(nobody, "wasmrelay-delivery-id"), "business/0/0");
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "dead-lettered before the ttl"
    );
    assert!(node.metric(r#"wasmrelay_retries_total{flow="business"}"#) > 0);
    assert_eq!(
        node.metric(r#"wasmrelay_messages_dead_lettered_total{flow="business"}"#),
        2
    );
    // The process that connected in time got its message.
    node.wait_for(
        "the late process's delivery",
        Duration::from_secs(10),
        || pool.count() == 1,
    )
    .await;
    node.wait_for("no line recovering", Duration::from_secs(10), || {
        node.metric(recovering) == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_plugin_names_the_process() {
    let kafka = Tansu::start();
    kafka.create_topic(BUSINESS, 1).await;
    // route-by-field: the `process-id` header, else the JSON field `process_id`.
    let config = node_config("node-a", &kafka.bootstrap(), "").replace(
        "[flows.deliver.cluster]",
        "[flows.deliver.cluster]\nrouter = \"route-by-field\"",
    );
    let node = RelayProcess::start(&config, &[]);
    let mut pool = ProcessPool::default();
    pool.connect(&[client_addr(&node)], "by-field", false).await;
    kafka
        .produce(
            BUSINESS,
            [
                // The key names another process: the plugin, not the key, decides.
                TestRecord::keyed("someone-else", r#"{"process_id":"by-field","n":1}"#),
                TestRecord::keyed("someone-else", r#"{"n":2}"#),
            ],
        )
        .await;
    node.wait_for("the routed delivery", Duration::from_secs(20), || {
        pool.count() == 1
    })
    .await;
    assert_eq!(pool.received()[0].process_id, "by-field");
    let dead = kafka
        .consume_all("business.dlq", 1, Duration::from_secs(20))
        .await;
    assert_eq!(dead.len(), 1);
    let stage = String::from_utf8(dead[0].header("wasmrelay-dlq-stage").unwrap().to_vec()).unwrap();
    assert!(stage.starts_with("router:route-by-field@"), "{stage}");
}
