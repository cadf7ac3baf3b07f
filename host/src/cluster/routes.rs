//! The route table: which node holds each business process, shared through
//! a compacted Kafka topic keyed by process id.
//!
//! A node writes `{"node": ..., "registered_at_ms": ..., "generation": ...}`
//! when a process registers with it and a tombstone (no value, headers
//! naming the node and the generation of the registration it ends) when the
//! connection ends. Every record carries a MAC made with the cluster secret
//! (header `wasmrelay-mac`; the format is in `docs/CLUSTER-RECORDS.md`): a
//! record or tombstone without a good one is ignored, logged and counted in
//! `wasmrelay_cluster_records_rejected_total`. Every node reads the topic
//! from the beginning at start, then follows it.
//!
//! Routes of one process are ordered by their generation, which the MAC
//! covers, then by offset: the registering node makes it larger than any it
//! knows for the process and than its clock in ms (a hybrid logical clock),
//! so a newer registration has a larger generation, and a record written
//! again later (a replay) cannot replace a newer live session. A tombstone
//! only removes the route it names, node and generation (a process that
//! moved, or registered again on the same node, is not unrouted by a late or
//! replayed goodbye). Tombstones stay null values, so compaction still
//! removes the process ids that left.
//!
//! When a route names another node for a process that is connected here
//! with an older registration, the local connection is replaced: the
//! process registered twice, and the newer one wins, cluster-wide. Routes of
//! nodes that are not live are ignored (a node that misses a few heartbeats
//! under load keeps its routes for when it is back), and dropped once
//! membership forgets the node.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use wasmrelay_protocol::mesh_auth::{Key, record_mac, verify_record_mac};

use super::membership::{ClusterView, MAC_HEADER};
use crate::gateway::{Gateway, RegistrationEvent};
use crate::kafka::tail::TailEvent;
use crate::kafka::{InputRecord, OutputRecord};
use crate::link::KafkaLink;
use crate::telemetry::metrics::ClusterMetrics;

/// The header of a route tombstone naming the node that wrote it.
pub const ROUTE_NODE_HEADER: &str = "wasmrelay-node";
/// The header of a route tombstone naming the generation of the route it
/// ends (decimal).
pub const ROUTE_GENERATION_HEADER: &str = "wasmrelay-generation";

/// The record kind in a route record's MAC.
const ROUTE_KIND: &str = "route";
/// The record kind in a route tombstone's MAC.
const REMOVAL_KIND: &str = "route-removal";

/// The value of a route record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteValue {
    /// The node the process is connected to.
    pub node: String,
    /// When it registered there, ms since the Unix epoch.
    pub registered_at_ms: i64,
    /// Orders the routes of one process: larger is newer.
    #[serde(default)]
    pub generation: u64,
}

/// Orders the records of one key: the generation, then where the record
/// sits in the routes topic.
type Position = (u64, i32, i64);

#[derive(Clone, Debug)]
struct Route {
    node: Arc<str>,
    position: Position,
}

/// Registrations of processes connected here: the connection and, once
/// Kafka acknowledged the route record, its position.
#[derive(Debug, Default)]
struct LocalRoutes {
    by_process: HashMap<String, (u64, Option<Position>)>,
    /// The generation of each local connection's route, by connection id,
    /// for its tombstone.
    generations: HashMap<u64, u64>,
    /// The largest generation this node gave out.
    last_generation: u64,
}

/// Why a route record was ignored (the `reason` label).
fn reject(metrics: &ClusterMetrics, record: &InputRecord, reason: &str, why: &str) {
    let key = String::from_utf8_lossy(record.key.as_deref().unwrap_or_default());
    tracing::warn!(topic = %record.topic, partition = record.partition, offset = record.offset, process = ?key, reason, "ignoring a route record: {why}");
    metrics.record_rejected(&record.topic, reason);
}

/// The MAC of a route record.
fn route_mac(key: &Key, process_id: &[u8], value: &[u8]) -> Vec<u8> {
    record_mac(key, ROUTE_KIND, &[process_id, value]).to_vec()
}

/// The MAC of a route tombstone.
fn removal_mac(key: &Key, process_id: &[u8], node: &str, generation: u64) -> Vec<u8> {
    record_mac(
        key,
        REMOVAL_KIND,
        &[
            process_id,
            node.as_bytes(),
            generation.to_string().as_bytes(),
        ],
    )
    .to_vec()
}

/// The shared table and this node's own registrations.
#[derive(Debug)]
pub struct RouteTable {
    self_id: String,
    key: Key,
    routes: Mutex<HashMap<String, Route>>,
    local: Mutex<LocalRoutes>,
    nodes: Mutex<HashMap<String, Arc<str>>>,
    live: arc_swap::ArcSwap<HashSet<String>>,
    known: Mutex<HashSet<String>>,
    gateway: Arc<Gateway>,
    caught_up: watch::Sender<Option<CatchUp>>,
    metrics: ClusterMetrics,
}

/// How reading the table at start went.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CatchUp {
    /// Route records read until the end of the topic.
    pub records: u64,
    /// Routes in the table then.
    pub routes: usize,
    /// How long it took.
    pub seconds: f64,
}

impl RouteTable {
    /// An empty table for node `self_id`, replacing local connections of
    /// `gateway` when their process registered elsewhere; `key` makes and
    /// checks the records' MACs.
    pub fn new(
        self_id: &str,
        key: Key,
        gateway: Arc<Gateway>,
        metrics: ClusterMetrics,
    ) -> Arc<RouteTable> {
        Arc::new(RouteTable {
            self_id: self_id.to_string(),
            key,
            routes: Mutex::new(HashMap::new()),
            local: Mutex::new(LocalRoutes::default()),
            nodes: Mutex::new(HashMap::new()),
            live: arc_swap::ArcSwap::from_pointee(HashSet::new()),
            known: Mutex::new(HashSet::new()),
            gateway,
            caught_up: watch::channel(None).0,
            metrics,
        })
    }

    /// The node holding `process_id`, if a live node does (this node's own
    /// routes are not returned: the gateway knows those).
    pub fn lookup(&self, process_id: &str) -> Option<String> {
        let node = lock(&self.routes).get(process_id)?.node.clone();
        (*node != *self.self_id && self.live.load().contains(&*node)).then(|| node.to_string())
    }

    /// The node the table names for `process_id`, this one included.
    pub fn holder(&self, process_id: &str) -> Option<String> {
        lock(&self.routes)
            .get(process_id)
            .map(|r| r.node.to_string())
    }

    /// Routes in the table.
    pub fn len(&self) -> usize {
        lock(&self.routes).len()
    }

    /// True when the table has no route.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Resolves once the table has been read to the end of the topic.
    pub fn caught_up(&self) -> watch::Receiver<Option<CatchUp>> {
        self.caught_up.subscribe()
    }

    /// Applies one record of the routes topic.
    pub fn apply(&self, record: &InputRecord) {
        let Some(process_id) = record
            .key
            .as_deref()
            .and_then(|k| std::str::from_utf8(k).ok())
        else {
            tracing::warn!(
                offset = record.offset,
                partition = record.partition,
                "ignoring a route record without a UTF-8 key"
            );
            return;
        };
        let mac = record.header(MAC_HEADER);
        let Some(mac) = mac else {
            reject(&self.metrics, record, "missing_mac", "it carries no MAC");
            return;
        };
        let bad_mac =
            "its MAC does not verify (forged, altered, or made with another cluster secret)";
        match &record.value {
            None => {
                let writer = record
                    .header(ROUTE_NODE_HEADER)
                    .and_then(|h| std::str::from_utf8(h).ok());
                let generation = record
                    .header(ROUTE_GENERATION_HEADER)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| h.parse::<u64>().ok());
                let (Some(writer), Some(generation)) = (writer, generation) else {
                    reject(
                        &self.metrics,
                        record,
                        "malformed",
                        "a tombstone must name its node and generation",
                    );
                    return;
                };
                if !verify_record_mac(
                    &self.key,
                    REMOVAL_KIND,
                    &[
                        process_id.as_bytes(),
                        writer.as_bytes(),
                        generation.to_string().as_bytes(),
                    ],
                    mac,
                ) {
                    reject(&self.metrics, record, "bad_mac", bad_mac);
                    return;
                }
                let mut routes = lock(&self.routes);
                // Only the route it ends: same node, same generation.
                if routes
                    .get(process_id)
                    .is_some_and(|route| *route.node == *writer && route.position.0 == generation)
                {
                    routes.remove(process_id);
                }
            }
            Some(value) => {
                if !verify_record_mac(&self.key, ROUTE_KIND, &[process_id.as_bytes(), value], mac) {
                    reject(&self.metrics, record, "bad_mac", bad_mac);
                    return;
                }
                let route: RouteValue = match serde_json::from_slice(value) {
                    Ok(route) => route,
                    Err(error) => {
                        reject(
                            &self.metrics,
                            record,
                            "malformed",
                            &format!("it is not valid JSON: {error}"),
                        );
                        return;
                    }
                };
                let position = (route.generation, record.partition, record.offset);
                let node = self.intern(&route.node);
                let newer = {
                    let mut routes = lock(&self.routes);
                    let newer = routes.get(process_id).is_none_or(|r| r.position < position);
                    if newer {
                        routes.insert(
                            process_id.to_string(),
                            Route {
                                node: node.clone(),
                                position,
                            },
                        );
                    }
                    newer
                };
                if !newer {
                    // A registration older than the route known (a record
                    // written again, or one that lost a race): not news.
                    tracing::debug!(process = %process_id, generation = route.generation, offset = record.offset, "ignoring a route older than the one known");
                }
                if newer && *node != *self.self_id {
                    self.replace_if_older(process_id, &node, position);
                }
            }
        }
        self.metrics
            .routes
            .set(i64::try_from(self.len()).unwrap_or(i64::MAX));
    }

    /// Follows membership: routes to nodes not live in `view` are ignored
    /// from now on, and those of nodes membership forgot (listed before,
    /// gone from `view` after a long silence) are dropped. Routes of nodes
    /// not heard of yet (read before their first heartbeat) are kept.
    pub fn follow_view(&self, view: &ClusterView) {
        let live: HashSet<String> = view
            .nodes
            .values()
            .filter(|n| n.live)
            .map(|n| n.heartbeat.node_id.clone())
            .collect();
        self.live.store(Arc::new(live));
        let listed: HashSet<String> = view.nodes.keys().cloned().collect();
        let forgotten: HashSet<String> = {
            let mut known = lock(&self.known);
            let forgotten = known.difference(&listed).cloned().collect();
            *known = listed;
            forgotten
        };
        if forgotten.is_empty() {
            return;
        }
        let mut routes = lock(&self.routes);
        let before = routes.len();
        routes.retain(|_, r| !forgotten.contains(&*r.node));
        let dropped = before - routes.len();
        drop(routes);
        if dropped > 0 {
            tracing::info!(dropped, "dropped the routes of nodes gone for good");
            self.metrics
                .routes
                .set(i64::try_from(self.len()).unwrap_or(i64::MAX));
        }
    }

    /// Notes a local registration (connection `connection_id`) whose route
    /// record Kafka acknowledged at `position`; if a newer route already
    /// names another node, the local connection is replaced.
    fn local_registered(&self, process_id: &str, connection_id: u64, position: Position) {
        {
            let mut local = lock(&self.local);
            match local.by_process.get_mut(process_id) {
                Some((connection, slot)) if *connection == connection_id => *slot = Some(position),
                _ => return,
            }
        }
        let newer_elsewhere = lock(&self.routes)
            .get(process_id)
            .filter(|r| *r.node != *self.self_id && r.position > position)
            .map(|r| r.node.to_string());
        if let Some(node) = newer_elsewhere {
            self.gateway.replace_local(
                process_id,
                format!("process `{process_id}` registered again on node {node}"),
            );
        }
    }

    fn replace_if_older(&self, process_id: &str, node: &str, position: Position) {
        let local = lock(&self.local).by_process.get(process_id).copied();
        if let Some((_, Some(local_position))) = local
            && local_position < position
        {
            self.gateway.replace_local(
                process_id,
                format!("process `{process_id}` registered again on node {node}"),
            );
        }
    }

    /// Notes a local registration of `process_id` (connection
    /// `connection_id`) and gives its route a generation larger than the
    /// route known for the process, than any this node gave out, and than
    /// `now_ms`.
    fn next_generation(&self, process_id: &str, now_ms: i64, connection_id: u64) -> u64 {
        let known = lock(&self.routes)
            .get(process_id)
            .map_or(0, |route| route.position.0);
        let mut local = lock(&self.local);
        let generation = u64::try_from(now_ms)
            .unwrap_or_default()
            .max(known + 1)
            .max(local.last_generation + 1);
        local.last_generation = generation;
        local
            .by_process
            .insert(process_id.to_string(), (connection_id, None));
        local.generations.insert(connection_id, generation);
        generation
    }

    fn intern(&self, node: &str) -> Arc<str> {
        lock(&self.nodes)
            .entry(node.to_string())
            .or_insert_with(|| Arc::from(node))
            .clone()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Reads the routes topic into `table` until `shutdown`: from the beginning
/// (reporting the catch-up), then following it; drops the routes of nodes
/// that stop being live.
pub async fn follow_routes(
    table: Arc<RouteTable>,
    mut records: mpsc::Receiver<TailEvent>,
    mut view: watch::Receiver<ClusterView>,
    shutdown: CancellationToken,
) {
    let started = Instant::now();
    let mut read = 0u64;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            changed = view.changed() => {
                if changed.is_err() { return; }
                let current = view.borrow_and_update().clone();
                table.follow_view(&current);
            }
            event = records.recv() => match event {
                None => return,
                Some(TailEvent::Record(record)) => {
                    read += 1;
                    table.apply(&record);
                }
                Some(TailEvent::CaughtUp) => {
                    let catch_up = CatchUp {
                        records: read,
                        routes: table.len(),
                        seconds: started.elapsed().as_secs_f64(),
                    };
                    tracing::info!(records = catch_up.records, routes = catch_up.routes, seconds = catch_up.seconds, "route table caught up");
                    table.caught_up.send_replace(Some(catch_up));
                }
            }
        }
    }
}

/// Publishes this node's registrations and unregistrations (from the
/// gateway's events) to the routes topic until `shutdown`. A route record is
/// retried until Kafka takes it.
pub async fn publish_routes(
    table: Arc<RouteTable>,
    link: Arc<KafkaLink>,
    topic: String,
    events: mpsc::UnboundedReceiver<RegistrationEvent>,
    shutdown: CancellationToken,
) {
    // Acknowledgements are awaited aside, each in a task of its own.
    let acks = TaskTracker::new();
    publish_in_order(&table, &link, &topic, events, &acks, &shutdown).await;
    acks.close();
    acks.wait().await;
}

/// Writes each registration event's record in event order until `shutdown`;
/// acknowledgements (and rewrites of a refused record) run on `acks`.
async fn publish_in_order(
    table: &Arc<RouteTable>,
    link: &Arc<KafkaLink>,
    topic: &str,
    mut events: mpsc::UnboundedReceiver<RegistrationEvent>,
    acks: &TaskTracker,
    shutdown: &CancellationToken,
) {
    loop {
        let event = tokio::select! {
            _ = shutdown.cancelled() => return,
            event = events.recv() => match event { Some(event) => event, None => return },
        };
        let (process_id, record, connection) = match event {
            RegistrationEvent::Registered {
                process_id,
                connection_id,
            } => {
                let registered_at_ms = super::now_ms();
                let generation =
                    table.next_generation(&process_id, registered_at_ms, connection_id);
                let value = RouteValue {
                    node: table.self_id.clone(),
                    registered_at_ms,
                    generation,
                };
                let value = serde_json::to_vec(&value).unwrap_or_default();
                let mac = route_mac(&table.key, process_id.as_bytes(), &value);
                let record = OutputRecord {
                    key: Some(process_id.as_bytes().to_vec()),
                    value: Some(value),
                    headers: vec![(MAC_HEADER.to_string(), mac)],
                };
                (process_id, record, Some((connection_id, generation)))
            }
            RegistrationEvent::Unregistered {
                process_id,
                connection_id,
            } => {
                let generation = {
                    let mut local = lock(&table.local);
                    if local
                        .by_process
                        .get(&process_id)
                        .is_some_and(|(c, _)| *c == connection_id)
                    {
                        local.by_process.remove(&process_id);
                    }
                    local.generations.remove(&connection_id)
                };
                // A connection never registered here has no route to end.
                let Some(generation) = generation else {
                    continue;
                };
                let mac = removal_mac(
                    &table.key,
                    process_id.as_bytes(),
                    &table.self_id,
                    generation,
                );
                let record = OutputRecord {
                    key: Some(process_id.as_bytes().to_vec()),
                    value: None,
                    headers: vec![
                        (
                            ROUTE_NODE_HEADER.to_string(),
                            table.self_id.as_bytes().to_vec(),
                        ),
                        (
                            ROUTE_GENERATION_HEADER.to_string(),
                            generation.to_string().into_bytes(),
                        ),
                        (MAC_HEADER.to_string(), mac),
                    ],
                };
                (process_id, record, None)
            }
        };
        // Enqueue in event order; wait for the acknowledgement aside.
        let ack = loop {
            match link.producer().enqueue(topic, &record).await {
                Ok(ack) => break ack,
                Err(error) => {
                    tracing::warn!(%topic, process = %process_id, %error, "writing a route failed; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(std::time::Duration::from_millis(200)) => {}
                    }
                }
            }
        };
        let table = table.clone();
        let link = link.clone();
        let topic = topic.to_string();
        let shutdown = shutdown.clone();
        acks.spawn(async move {
            let delivered = match ack.await {
                Ok(delivered) => delivered,
                Err(error) => {
                    tracing::warn!(%topic, process = %process_id, %error, "a route was not written; writing it again");
                    loop {
                        match link.producer().send(&topic, &record).await {
                            Ok(delivered) => break delivered,
                            Err(_) => tokio::select! {
                                // The route is written again when the process registers anew.
                                _ = shutdown.cancelled() => return,
                                _ = tokio::time::sleep(std::time::Duration::from_millis(200)) => {}
                            },
                        }
                    }
                }
            };
            if let Some((connection_id, generation)) = connection {
                table.local_registered(
                    &process_id,
                    connection_id,
                    (generation, delivered.partition, delivered.offset),
                );
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct NoUpstream;
    impl crate::gateway::Upstream for NoUpstream {
        fn send(
            &self,
            _: &str,
            _: wasmrelay_protocol::v1::Send,
        ) -> futures::future::BoxFuture<'static, Result<(), crate::gateway::UpstreamError>>
        {
            Box::pin(async { Err(crate::gateway::UpstreamError::Refused("none".to_string())) })
        }
    }

    fn table() -> Arc<RouteTable> {
        let gateway = Gateway::new(
            Default::default(),
            crate::gateway::ClientAuth::none(),
            Arc::new(NoUpstream),
            None,
        );
        RouteTable::new("a", key(), gateway, ClusterMetrics::default())
    }

    fn key() -> Key {
        wasmrelay_protocol::mesh_auth::purpose_key(
            b"secret",
            wasmrelay_protocol::mesh_auth::Purpose::RouteRecord,
        )
    }

    /// A route record of generation `offset`, at `offset`.
    fn route(process: &str, node: &str, offset: i64) -> InputRecord {
        route_of_generation(process, node, offset as u64, offset)
    }

    fn route_of_generation(process: &str, node: &str, generation: u64, offset: i64) -> InputRecord {
        let value = serde_json::to_vec(&RouteValue {
            node: node.into(),
            registered_at_ms: 0,
            generation,
        })
        .unwrap();
        InputRecord {
            topic: "routes".into(),
            partition: 0,
            offset,
            key: Some(process.as_bytes().to_vec()),
            headers: vec![(
                MAC_HEADER.to_string(),
                route_mac(&key(), process.as_bytes(), &value),
            )],
            value: Some(value),
            timestamp_ms: None,
        }
    }

    /// The tombstone of `node`'s route of `generation`, at `offset`.
    fn tombstone(process: &str, node: &str, generation: u64, offset: i64) -> InputRecord {
        InputRecord {
            value: None,
            headers: vec![
                (ROUTE_NODE_HEADER.to_string(), node.as_bytes().to_vec()),
                (
                    ROUTE_GENERATION_HEADER.to_string(),
                    generation.to_string().into_bytes(),
                ),
                (
                    MAC_HEADER.to_string(),
                    removal_mac(&key(), process.as_bytes(), node, generation),
                ),
            ],
            ..route(process, node, offset)
        }
    }

    fn rejected(table: &RouteTable, reason: &str) -> u64 {
        table
            .metrics
            .records_rejected
            .get_or_create(&crate::telemetry::metrics::RecordRejectedLabels {
                topic: "routes".to_string(),
                reason: reason.to_string(),
            })
            .get()
    }

    #[test]
    fn the_latest_route_wins_and_an_old_nodes_tombstone_does_not_unroute() {
        let table = table();
        table.follow_view(&view(&[("a", true), ("b", true), ("c", true)]));
        table.apply(&route("p", "b", 1));
        assert_eq!(table.lookup("p").as_deref(), Some("b"));
        table.apply(&route("p", "c", 2));
        table.apply(&tombstone("p", "b", 1, 3));
        assert_eq!(
            table.lookup("p").as_deref(),
            Some("c"),
            "b's late goodbye must not unroute c"
        );
        table.apply(&tombstone("p", "c", 2, 4));
        assert_eq!(table.lookup("p"), None);
    }

    #[test]
    fn records_without_a_good_mac_change_nothing_and_are_counted() {
        let table = table();
        table.follow_view(&view(&[("a", true), ("b", true), ("x", true)]));
        table.apply(&route("p", "b", 1));
        // No MAC.
        let mut forged = route("p", "x", 2);
        forged.headers.clear();
        table.apply(&forged);
        // A MAC made with another secret.
        let mut forged = route("p", "x", 3);
        let other = wasmrelay_protocol::mesh_auth::purpose_key(
            b"a guess",
            wasmrelay_protocol::mesh_auth::Purpose::RouteRecord,
        );
        forged.headers = vec![(
            MAC_HEADER.to_string(),
            route_mac(&other, b"p", forged.value.as_deref().unwrap()),
        )];
        table.apply(&forged);
        // A good MAC over another value (the value altered).
        let mut altered = route("p", "b", 4);
        altered.value = route("p", "x", 4).value;
        table.apply(&altered);
        // A tombstone without a MAC, and one naming another generation.
        let mut tomb = tombstone("p", "b", 1, 5);
        tomb.headers.retain(|(name, _)| name != MAC_HEADER);
        table.apply(&tomb);
        assert_eq!(table.lookup("p").as_deref(), Some("b"));
        assert_eq!(rejected(&table, "missing_mac"), 2);
        assert_eq!(rejected(&table, "bad_mac"), 2);
    }

    #[test]
    fn a_replayed_route_or_tombstone_does_not_replace_a_newer_session() {
        let table = table();
        table.follow_view(&view(&[("a", true), ("b", true), ("c", true)]));
        let old = route_of_generation("p", "b", 100, 1);
        table.apply(&old);
        table.apply(&route_of_generation("p", "c", 200, 2));
        // b's old record and tombstone written again, later in the topic.
        table.apply(&InputRecord { offset: 3, ..old });
        table.apply(&tombstone("p", "c", 150, 4));
        assert_eq!(table.lookup("p").as_deref(), Some("c"));
        // The generation outranks the offset; the same generation is
        // ordered by offset.
        table.apply(&route_of_generation("p", "b", 200, 5));
        assert_eq!(table.lookup("p").as_deref(), Some("b"));
    }

    #[test]
    fn a_local_registration_gets_a_generation_above_every_known_one() {
        let table = table();
        table.apply(&route_of_generation("p", "b", u64::MAX / 2, 1));
        let first = table.next_generation("p", 1000, 1);
        assert_eq!(first, u64::MAX / 2 + 1);
        let second = table.next_generation("q", 1000, 2);
        assert!(second > first, "unique on this node");
        // With nothing known, the clock.
        assert_eq!(super::tests::table().next_generation("r", 5000, 3), 5000);
    }

    #[test]
    fn own_routes_are_not_returned_by_lookup() {
        let table = table();
        table.apply(&route("p", "a", 1));
        assert_eq!(table.lookup("p"), None);
        assert_eq!(table.holder("p").as_deref(), Some("a"));
    }

    fn view(nodes: &[(&str, bool)]) -> ClusterView {
        use super::super::membership::{Heartbeat, NodeView};
        ClusterView {
            nodes: nodes
                .iter()
                .map(|(id, live)| {
                    let heartbeat = Heartbeat {
                        node_id: id.to_string(),
                        instance_id: String::new(),
                        client_addr: String::new(),
                        mesh_addr: String::new(),
                        admin_addr: String::new(),
                        connections: 0,
                        quota: 0,
                        started_at_ms: 0,
                        sent_at_ms: 0,
                        leaving: false,
                    };
                    (
                        id.to_string(),
                        NodeView {
                            heartbeat,
                            live: *live,
                            last_seen_ms_ago: 0,
                        },
                    )
                })
                .collect(),
            ..ClusterView::default()
        }
    }

    #[test]
    fn routes_of_dead_nodes_are_ignored_then_dropped_when_forgotten() {
        let table = table();
        // Read before b's first heartbeat: kept.
        table.follow_view(&view(&[("a", true)]));
        table.apply(&route("p", "b", 1));
        table.follow_view(&view(&[("a", true)]));
        assert_eq!(table.holder("p").as_deref(), Some("b"));
        table.apply(&route("q", "a", 2));
        table.follow_view(&view(&[("a", true), ("b", true)]));
        assert_eq!(table.lookup("p").as_deref(), Some("b"));
        // b misses heartbeats: ignored, kept.
        table.follow_view(&view(&[("a", true), ("b", false)]));
        assert_eq!(table.lookup("p"), None);
        table.follow_view(&view(&[("a", true), ("b", true)]));
        assert_eq!(
            table.lookup("p").as_deref(),
            Some("b"),
            "b's routes survive a hiccup"
        );
        // b forgotten: dropped.
        table.follow_view(&view(&[("a", true)]));
        assert_eq!(table.holder("p"), None);
        assert_eq!(table.holder("q").as_deref(), Some("a"));
    }
}
