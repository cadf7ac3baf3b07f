//! The route table: which node holds each business process, shared through
//! a compacted Kafka topic keyed by process id.
//!
//! A node writes `{"node": ..., "registered_at_ms": ..., "generation": ...}`
//! when a process registers with it and a tombstone (no value, headers
//! naming the node and the generation of the registration it ends) when the
//! connection ends without a successor elsewhere. Every record carries a
//! MAC made with the cluster secret (header `wasmrelay-mac`; the format is
//! in `docs/CLUSTER-RECORDS.md`): a record or tombstone without a good one
//! is ignored, logged and counted in
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
//! Compaction keeps only the last record of a key, so the last record must
//! be the holder's route. A session replaced by a newer registration on
//! another node writes no tombstone, and the node holding a process writes
//! its route again whenever it reads, after its own, a record for that
//! process that is not its latest route (a goodbye or an older route that
//! lost a race): whatever the interleaving, the holder has the last word.
//! The same write runs as anti-entropy ([`refresh_routes`]): every node
//! writes the routes of its sessions again on a slow period, paced, and at
//! once when it rejoins (its own heartbeats came back after a gap of a node
//! timeout: others may have evicted its routes), so a node that missed a
//! record (a broker that lost it) learns it within a period.
//!
//! A record the broker never delivered to this node's reader, though it
//! stored it (tansu 0.6 stores concurrent producers' batches out of offset
//! order, and a follower that has passed the higher batch never gets the
//! lower one), shows as offsets skipped once the reader is at the end
//! ([`crate::kafka::tail::TailEvent::Missed`]). The node then asks every
//! peer over the mesh to write again what it wrote at those offsets
//! ([`RouteTable::rewrite_missed`], from a ring of each node's recent writes),
//! and does so itself for its own: the records come back at new offsets,
//! within a second instead of a refresh period.
//!
//! When a route names another node for a process that is connected here
//! with an older registration, the local connection is replaced: the
//! process registered twice, and the newer one wins, cluster-wide. Routes of
//! nodes that are not live are ignored, and evicted once their node has not
//! been live for a node timeout (a node that misses a few heartbeats under
//! load keeps its routes; one that comes back later writes them again). The
//! node names are interned and pruned with their last route, so memory
//! follows the processes of live nodes.
//!
//! The table itself is compact and sharded ([`super::route_map`]): a route
//! is a node id (the names interned), its generation and place in the topic
//! packed, and a short process id stored inline; lookups take one shard's
//! read lock, never a lock of the whole table.
//!
//! A node that has a message for a process it has no route for asks its
//! mesh peers ([`crate::cluster::mesh::Mesh::lookup`]): the holder answers
//! with its registration's generation and writes the route again (at most
//! once per process every [`LOOKUP_REWRITE_EVERY`]), and the asker learns
//! the route ([`RouteTable::learn`]) until the record arrives; a learned
//! route never replaces a route read from the topic of the same or a newer
//! generation, and any record of that generation or newer replaces it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, mpsc, watch};
use tokio_util::sync::CancellationToken;
use wasmrelay_protocol::mesh_auth::{Key, record_mac, verify_record_mac};

mod publisher;
mod recent_writes;

pub use publisher::{AckWait, RouteSink, publish_routes};
use recent_writes::{RecentWrites, Written};

use super::membership::{ClusterView, MAC_HEADER};
use super::route_map::{Change, NodeId, NodeTable, Route, RouteMap, place};
use crate::gateway::Gateway;
use crate::kafka::tail::{TailEvent, TailSink};
use crate::kafka::{InputRecord, OutputRecord, RecordView};
use crate::telemetry::metrics::ClusterMetrics;
use crate::work_set::WorkSet;

/// The header of a route tombstone naming the node that wrote it.
pub const ROUTE_NODE_HEADER: &str = "wasmrelay-node";
/// The header of a route tombstone naming the generation of the route it
/// ends (decimal).
pub const ROUTE_GENERATION_HEADER: &str = "wasmrelay-generation";

/// The record kind in a route record's MAC.
const ROUTE_KIND: &str = "route";
/// The record kind in a route tombstone's MAC.
const REMOVAL_KIND: &str = "route-removal";

/// Routes written again per refresh step.
const REFRESH_BATCH: usize = 50;
/// The fastest a refresh writes routes again, records per second: 100,000
/// sessions take 50 s when a node rejoins, and never come as one burst.
const MAX_REFRESH_RATE: u32 = 2000;
/// Republish requests written per turn of the publisher, so registrations
/// are not held up behind a long refresh.
const REPUBLISH_TURN: usize = 64;

/// The least time between two rewrites of one process's route asked for
/// by the peers' lookups: a flood of lookups writes at most one record per
/// process held here per this.
pub const LOOKUP_REWRITE_EVERY: Duration = Duration::from_secs(5);

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

/// A [`RouteValue`] as read: the node name borrowed from the record when
/// it has no escapes (one allocation fewer per record read).
#[derive(Deserialize)]
struct ReadRoute<'a> {
    #[serde(borrow)]
    node: std::borrow::Cow<'a, str>,
    /// Required, as in a [`RouteValue`]; not used when reading.
    #[serde(rename = "registered_at_ms")]
    _registered_at_ms: i64,
    #[serde(default)]
    generation: u64,
}

/// Orders the records of one key: the generation, then where the record
/// sits in the routes topic.
type Position = (u64, i32, i64);

/// A registration of a process connected here.
#[derive(Clone, Copy, Debug)]
struct LocalRoute {
    connection: u64,
    generation: u64,
    registered_at_ms: i64,
    /// Where Kafka put its latest route record, once acknowledged.
    position: Option<Position>,
}

/// Registrations of processes connected here.
#[derive(Debug, Default)]
struct LocalRoutes {
    by_process: HashMap<String, LocalRoute>,
    /// The generation of each local connection's route, by connection id,
    /// for its tombstone.
    generations: HashMap<u64, u64>,
    /// The largest generation this node gave out.
    last_generation: u64,
}

/// Processes in the order their route was written again for a lookup
/// (with when), and the same as a set.
type RecentRewrites = (VecDeque<(Instant, String)>, HashSet<String>);

/// A record of the routes topic as far as the holder of its process cares.
struct Seen<'a> {
    node: &'a str,
    generation: u64,
    partition: i32,
    offset: i64,
    tombstone: bool,
}

/// A record of the routes topic checked and about to be applied.
struct Checked<'r> {
    process_id: &'r str,
    partition: i32,
    offset: i64,
    what: CheckedKind<'r>,
}

/// A route or a tombstone, as [`Checked`] holds it.
enum CheckedKind<'r> {
    /// A route of `node`, interned in `new`.
    Route {
        node: std::borrow::Cow<'r, str>,
        new: Route,
    },
    /// A tombstone of `writer`'s registration `generation`.
    Tombstone { writer: &'r str, generation: u64 },
}

/// What applying a [`Checked`] record found and did to its process's route.
#[derive(Clone, Copy, Default)]
struct Outcome {
    /// The route before.
    old: Option<Route>,
    /// A route stored, or the route a tombstone ends removed.
    done: bool,
}

/// Why a route record was ignored (the `reason` label).
fn reject(metrics: &ClusterMetrics, record: &RecordView<'_>, reason: &str, why: &str) {
    let key = String::from_utf8_lossy(record.key.unwrap_or_default());
    tracing::warn!(topic = %record.topic, partition = record.partition, offset = record.offset, process = ?key, reason, "ignoring a route record: {why}");
    metrics.record_rejected(record.topic, reason);
}

/// The MAC of a route record.
pub(crate) fn route_mac(key: &Key, process_id: &[u8], value: &[u8]) -> Vec<u8> {
    record_mac(key, ROUTE_KIND, &[process_id, value]).to_vec()
}

/// The MAC of a route tombstone.
pub(crate) fn removal_mac(key: &Key, process_id: &[u8], node: &str, generation: u64) -> Vec<u8> {
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
    /// How long a node may stay not live before its routes are evicted.
    node_timeout: Duration,
    /// The routes by process id (a route learned from a lookup is at
    /// `place(None)`: below any record, so a record of the same generation
    /// replaces it).
    routes: RouteMap,
    local: Mutex<LocalRoutes>,
    /// The node names routes use, interned, with since when each has not
    /// been live; pruned with their last route.
    nodes: NodeTable,
    live: arc_swap::ArcSwap<HashSet<String>>,
    /// Processes whose route this node is to write again, each once.
    republish: WorkSet,
    /// Tombstones Kafka refused, by process: the generation each ends.
    /// Written again in order with the rest, while still due.
    goodbyes_again: Mutex<HashMap<String, u64>>,
    /// Times this node rejoined (from the cluster view) taken so far.
    rejoins: AtomicU64,
    /// Woken when this node rejoined: its routes are written again.
    rejoined: Notify,
    /// Routes written again since start (holder's last word, refreshes).
    republished: AtomicU64,
    /// Where this node's recent route records landed, to write again those
    /// a reader missed.
    recent_writes: RecentWrites,
    /// Offsets of the routes topic this node's reader never got.
    records_missed: AtomicU64,
    /// Records written again because a reader (a peer's or this node's)
    /// missed them.
    rewritten_for_missed: AtomicU64,
    /// The processes whose route a peer's lookup had written again, oldest
    /// first, within the last [`LOOKUP_REWRITE_EVERY`].
    rewritten_for_lookups: Mutex<RecentRewrites>,
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
    /// checks the records' MACs; routes of a node not live for
    /// `node_timeout` are evicted.
    pub fn new(
        self_id: &str,
        key: Key,
        node_timeout: Duration,
        gateway: Arc<Gateway>,
        metrics: ClusterMetrics,
    ) -> Arc<RouteTable> {
        Arc::new(RouteTable {
            self_id: self_id.to_string(),
            key,
            node_timeout,
            routes: RouteMap::default(),
            local: Mutex::new(LocalRoutes::default()),
            nodes: NodeTable::default(),
            live: arc_swap::ArcSwap::from_pointee(HashSet::new()),
            republish: WorkSet::default(),
            goodbyes_again: Mutex::default(),
            rejoins: AtomicU64::new(0),
            rejoined: Notify::new(),
            republished: AtomicU64::new(0),
            recent_writes: RecentWrites::default(),
            records_missed: AtomicU64::new(0),
            rewritten_for_missed: AtomicU64::new(0),
            rewritten_for_lookups: Mutex::default(),
            gateway,
            caught_up: watch::channel(None).0,
            metrics,
        })
    }

    /// The node holding `process_id`, if a live node does (this node's own
    /// routes are not returned: the gateway knows those). The name is the
    /// table's own, shared: a lookup allocates nothing.
    pub fn lookup(&self, process_id: &str) -> Option<Arc<str>> {
        let (_, node) = self.route_of(process_id)?;
        (*node != *self.self_id && self.live.load().contains(&*node)).then_some(node)
    }

    /// The route of `process_id`, and the name of its node.
    fn route_of(&self, process_id: &str) -> Option<(Route, Arc<str>)> {
        let route = self.routes.get(process_id)?;
        Some((route, self.nodes.name(route.node)?))
    }

    /// Makes room for about `routes` routes (the records of the routes
    /// topic when the node starts reading it).
    pub fn reserve(&self, routes: u64) {
        self.routes
            .reserve(usize::try_from(routes).unwrap_or(usize::MAX));
    }

    /// Learns from a peer's answer to a lookup that `process_id` is
    /// connected to `node` with registration `generation`, when the table
    /// has no route for it of that generation or newer (a route read from
    /// the topic always wins, and the next record of this generation or
    /// newer replaces the learned one). Ignored for a generation of 0 (the
    /// peer's route record is about to be written), this node, and a
    /// process registered here. True when it was learned.
    pub fn learn(&self, process_id: &str, node: &str, generation: u64) -> bool {
        if generation == 0 || node == self.self_id {
            return false;
        }
        if lock(&self.local).by_process.contains_key(process_id) {
            return false;
        }
        let node = self.intern(node);
        let learned = Route {
            node,
            generation,
            at: place(None),
        };
        let (old, learned) = self.routes.modify(process_id, |old| {
            if old.is_none_or(|r| r.generation < generation) {
                (Change::Put(learned), true)
            } else {
                (Change::Keep, false)
            }
        });
        self.settle(node, learned, old);
        if learned {
            tracing::debug!(process = %process_id, generation, "learned a route from a mesh lookup");
            self.metrics
                .routes
                .set(i64::try_from(self.len()).unwrap_or(i64::MAX));
        }
        learned
    }

    /// Forgets the route of `process_id` if it was learned from a lookup
    /// and names `node` (which just said the process is not connected
    /// there); a route read from the topic stays. True when forgotten.
    pub fn forget_learned(&self, process_id: &str, node: &str) -> bool {
        let (_, forgotten) = self.routes.modify(process_id, |old| match old {
            Some(r) if r.learned() && self.names(r.node, node) => (Change::Remove, Some(r.node)),
            _ => (Change::Keep, None),
        });
        if let Some(node) = forgotten {
            self.nodes.release([(node, 1)]);
            self.metrics
                .routes
                .set(i64::try_from(self.len()).unwrap_or(i64::MAX));
        }
        forgotten.is_some()
    }

    /// The node the table names for `process_id`, this one included.
    pub fn holder(&self, process_id: &str) -> Option<String> {
        self.route_of(process_id).map(|(_, node)| node.to_string())
    }

    /// Routes in the table.
    pub fn len(&self) -> usize {
        self.routes.len()
    }

    /// True when the table has no route.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Node names the table holds (those its routes name).
    pub fn node_names(&self) -> usize {
        self.nodes.len()
    }

    /// Routes this node wrote again since start: as the holder's last word
    /// after a goodbye or an older route, and as anti-entropy.
    pub fn republished(&self) -> u64 {
        self.republished.load(Ordering::Relaxed)
    }

    /// Offsets of the routes topic this node's reader never got (see
    /// [`RouteTable::reader_missed`]).
    pub fn offsets_missed(&self) -> u64 {
        self.records_missed.load(Ordering::Relaxed)
    }

    /// Records this node wrote again because a reader missed them.
    pub fn rewritten_for_missed(&self) -> u64 {
        self.rewritten_for_missed.load(Ordering::Relaxed)
    }

    /// Notes that this node's route record or tombstone (ending
    /// `ends`) of `process_id` landed at `offset` of `partition`.
    fn wrote(&self, process_id: &str, partition: i32, offset: i64, ends: Option<u64>) {
        self.recent_writes.note(
            partition,
            offset,
            Written {
                process_id: process_id.into(),
                ends,
            },
        );
    }

    /// A reader missed offsets `from..to` of `partition`: has what this node
    /// wrote there written again as it stands now (the route of a process
    /// still connected here, the tombstone of one still gone), in order
    /// with the rest. Returns how many records that is.
    pub fn rewrite_missed(&self, partition: i32, from: i64, to: i64) -> usize {
        let written = self.recent_writes.between(partition, from, to);
        for Written { process_id, ends } in &written {
            match ends {
                Some(generation) => self.request_goodbye_again(process_id, *generation),
                None => self.request_republish(std::iter::once(&**process_id)),
            }
        }
        if !written.is_empty() {
            tracing::debug!(
                partition,
                from,
                to,
                records = written.len(),
                "writing route records a reader missed again"
            );
            self.rewritten_for_missed
                .fetch_add(written.len() as u64, Ordering::Relaxed);
        }
        written.len()
    }

    /// This node's reader never got offsets `from..to` of `partition`:
    /// counts and logs it, and writes again what this node wrote there
    /// (the peers are asked for theirs by the caller).
    pub fn reader_missed(&self, partition: i32, from: i64, to: i64) {
        let count = u64::try_from(to - from).unwrap_or_default();
        self.records_missed.fetch_add(count, Ordering::Relaxed);
        self.metrics.route_records_missed.inc_by(count);
        tracing::warn!(
            partition,
            from,
            to,
            "the broker never delivered these offsets of the routes topic to this node (stored out of offset order?); asking the nodes that wrote them to write them again"
        );
        self.rewrite_missed(partition, from, to);
    }

    /// Resolves once the table has been read to the end of the topic.
    pub fn caught_up(&self) -> watch::Receiver<Option<CatchUp>> {
        self.caught_up.subscribe()
    }

    /// Applies one record of the routes topic.
    pub fn apply(&self, record: &InputRecord) {
        self.apply_view(&record.view());
    }

    /// Applies one record of the routes topic, read in place.
    pub fn apply_view(&self, record: &RecordView<'_>) {
        self.apply_views(std::slice::from_ref(record));
    }

    /// Applies records of the routes topic, read in place, as if one after
    /// the other in their order. Each is checked first (its MAC, its value);
    /// then the routes change shard by shard ([`RouteMap::modify_many`]:
    /// reading a large topic is mostly cache misses into the map, which
    /// overlap when no lock is taken between two records); then what
    /// follows from each (node counts, the local registrations) is done in
    /// order.
    pub fn apply_views(&self, records: &[RecordView<'_>]) {
        let checked: Vec<Checked<'_>> = records
            .iter()
            .filter_map(|record| self.check(record))
            .collect();
        let mut outcomes = vec![Outcome::default(); checked.len()];
        self.routes.modify_many(
            checked.len(),
            |i| checked[i].process_id,
            |i, old| {
                let (change, done) = match &checked[i].what {
                    // Only the route it ends: same node, same generation.
                    CheckedKind::Tombstone { writer, generation } => match old {
                        Some(r) if r.generation == *generation && self.names(r.node, writer) => {
                            (Change::Remove, true)
                        }
                        _ => (Change::Keep, false),
                    },
                    CheckedKind::Route { new, .. } => {
                        if old.is_none_or(|r| r.order() < new.order()) {
                            (Change::Put(*new), true)
                        } else {
                            (Change::Keep, false)
                        }
                    }
                };
                outcomes[i] = Outcome { old, done };
                change
            },
        );
        // One look at the local registrations for the batch while nothing
        // is connected here (a node's catch-up at start).
        let any_local = !lock(&self.local).by_process.is_empty();
        for (record, outcome) in checked.iter().zip(outcomes) {
            let process_id = record.process_id;
            let local = if any_local {
                self.local_route(process_id)
            } else {
                None
            };
            match &record.what {
                CheckedKind::Tombstone { writer, generation } => {
                    if let (true, Some(old)) = (outcome.done, outcome.old) {
                        self.nodes.release([(old.node, 1)]);
                    }
                    self.reassert_if_held(
                        process_id,
                        local,
                        &Seen {
                            node: writer,
                            generation: *generation,
                            partition: record.partition,
                            offset: record.offset,
                            tombstone: true,
                        },
                    );
                }
                CheckedKind::Route { node, new } => {
                    let newer = outcome.done;
                    self.settle(new.node, newer, outcome.old);
                    if !newer {
                        // A registration older than the route known (a
                        // record written again, or one that lost a race):
                        // not news.
                        tracing::debug!(process = %process_id, generation = new.generation, offset = record.offset, "ignoring a route older than the one known");
                    }
                    if newer && *node != self.self_id {
                        let position = (new.generation, record.partition, record.offset);
                        self.replace_if_older(process_id, local, node, position);
                    }
                    self.reassert_if_held(
                        process_id,
                        local,
                        &Seen {
                            node,
                            generation: new.generation,
                            partition: record.partition,
                            offset: record.offset,
                            tombstone: false,
                        },
                    );
                }
            }
        }
        self.metrics
            .routes
            .set(i64::try_from(self.len()).unwrap_or(i64::MAX));
    }

    /// A record checked (UTF-8 key, MAC, value) and ready to apply; `None`
    /// (logged and counted) when it is to be ignored. A route's node is
    /// interned here, counted as one of its routes until
    /// [`RouteTable::settle`].
    fn check<'r>(&self, record: &RecordView<'r>) -> Option<Checked<'r>> {
        let Some(process_id) = record.key.and_then(|k| std::str::from_utf8(k).ok()) else {
            tracing::warn!(
                offset = record.offset,
                partition = record.partition,
                "ignoring a route record without a UTF-8 key"
            );
            return None;
        };
        let Some(mac) = record.header(MAC_HEADER) else {
            reject(&self.metrics, record, "missing_mac", "it carries no MAC");
            return None;
        };
        let bad_mac =
            "its MAC does not verify (forged, altered, or made with another cluster secret)";
        let what = match record.value {
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
                    return None;
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
                    return None;
                }
                CheckedKind::Tombstone { writer, generation }
            }
            Some(value) => {
                if !verify_record_mac(&self.key, ROUTE_KIND, &[process_id.as_bytes(), value], mac) {
                    reject(&self.metrics, record, "bad_mac", bad_mac);
                    return None;
                }
                // JSON is UTF-8 throughout: serde_json skips unknown fields
                // of a slice without checking their strings.
                let parsed = std::str::from_utf8(value)
                    .map_err(|e| format!("it is not UTF-8: {e}"))
                    .and_then(|text| {
                        serde_json::from_str::<ReadRoute<'_>>(text).map_err(|e| e.to_string())
                    });
                let route: ReadRoute<'_> = match parsed {
                    Ok(route) => route,
                    Err(error) => {
                        reject(
                            &self.metrics,
                            record,
                            "malformed",
                            &format!("it is not valid JSON: {error}"),
                        );
                        return None;
                    }
                };
                let new = Route {
                    node: self.intern(&route.node),
                    generation: route.generation,
                    at: place(Some((record.partition, record.offset))),
                };
                CheckedKind::Route {
                    node: route.node,
                    new,
                }
            }
        };
        Some(Checked {
            process_id,
            partition: record.partition,
            offset: record.offset,
            what,
        })
    }

    /// The registration of `process_id` here, if it is connected here (one
    /// lock, and none at all while nothing is connected here: a node's
    /// catch-up at start).
    fn local_route(&self, process_id: &str) -> Option<LocalRoute> {
        let local = lock(&self.local);
        if local.by_process.is_empty() {
            return None;
        }
        local.by_process.get(process_id).copied()
    }

    /// After reading `seen` for `process_id`: if the process is connected
    /// here and `seen` is neither this node's latest route for it nor a
    /// newer registration elsewhere, and it sits after this node's route in
    /// the topic, the route is written again, so that compaction (which
    /// keeps a key's last record) keeps the holder's route.
    fn reassert_if_held(&self, process_id: &str, local: Option<LocalRoute>, seen: &Seen<'_>) {
        let Some(local) = local else {
            return;
        };
        let own = seen.node == self.self_id;
        let stale = match (own, seen.tombstone) {
            // A goodbye of this or an older registration here: a replay.
            (true, true) => seen.generation <= local.generation,
            // An older route of this node's.
            (true, false) => seen.generation < local.generation,
            // Another node's goodbye or route older than the session here
            // (an equal generation is ordered by offset, settled when
            // Kafka acknowledges the local route; a newer one replaces the
            // session here).
            (false, _) => seen.generation < local.generation,
        };
        if !stale {
            return;
        }
        match local.position {
            // The route here already comes after it.
            Some((_, partition, offset)) if partition == seen.partition && offset > seen.offset => {
                return;
            }
            // This node's own earlier record: the route in flight follows
            // it on the same partition.
            None if own => return,
            _ => {}
        }
        tracing::debug!(process = %process_id, node = %seen.node, generation = seen.generation, offset = seen.offset, tombstone = seen.tombstone, "a record after this node's route for a process connected here; writing the route again");
        self.request_republish(std::iter::once(process_id));
    }

    /// Asks the publisher to write the routes of `processes` again (those
    /// still connected here when it gets to them).
    fn request_republish<'a>(&self, processes: impl IntoIterator<Item = &'a str>) {
        self.republish.add_keys(processes);
    }

    /// Up to `max` processes whose routes are to be written again.
    fn take_republish(&self, max: usize) -> (Vec<String>, bool) {
        let (taken, more) = self.republish.take(max);
        (
            taken.into_iter().map(|(process, ())| process).collect(),
            more,
        )
    }

    /// Asks the publisher to write the tombstone of `process_id`'s route
    /// of `generation` again (Kafka refused it), in order with the rest:
    /// only if no route of the process was written since.
    fn request_goodbye_again(&self, process_id: &str, generation: u64) {
        lock(&self.goodbyes_again).insert(process_id.to_string(), generation);
        self.request_republish(std::iter::once(process_id));
    }

    /// The tombstone of `process_id` to write again, if one was refused
    /// and is still due: the process is not connected here again and no
    /// newer route elsewhere replaced the one it ends.
    fn goodbye_again(&self, process_id: &str) -> Option<OutputRecord> {
        let generation = lock(&self.goodbyes_again).remove(process_id)?;
        if lock(&self.local).by_process.contains_key(process_id) {
            return None;
        }
        self.tombstone_unless_succeeded(process_id, generation)
    }

    /// Has the routes of every process connected here written again (to
    /// the cluster the link writes to now, after a switch); how many.
    pub fn write_local_routes_again(&self) -> usize {
        let processes = self.local_processes();
        self.request_republish(processes.iter().map(String::as_str));
        processes.len()
    }

    /// The processes connected here, as this node published them.
    fn local_processes(&self) -> Vec<String> {
        lock(&self.local).by_process.keys().cloned().collect()
    }

    /// The route record of `process_id` connected here written again, and
    /// its connection and generation; `None` when it is not connected here
    /// any more or a newer route elsewhere is replacing it.
    fn route_again(&self, process_id: &str) -> Option<(OutputRecord, (u64, u64))> {
        let local = lock(&self.local).by_process.get(process_id).copied()?;
        let replaced = self
            .route_of(process_id)
            .is_some_and(|(r, node)| *node != *self.self_id && r.generation > local.generation);
        if replaced {
            return None;
        }
        self.republished.fetch_add(1, Ordering::Relaxed);
        Some((
            self.route_record(process_id, local.registered_at_ms, local.generation),
            (local.connection, local.generation),
        ))
    }

    /// The record of this node's route for `process_id`.
    fn route_record(
        &self,
        process_id: &str,
        registered_at_ms: i64,
        generation: u64,
    ) -> OutputRecord {
        let value = RouteValue {
            node: self.self_id.clone(),
            registered_at_ms,
            generation,
        };
        let value = serde_json::to_vec(&value).unwrap_or_default();
        let mac = route_mac(&self.key, process_id.as_bytes(), &value);
        OutputRecord {
            key: Some(process_id.as_bytes().to_vec()),
            value: Some(value),
            headers: vec![(MAC_HEADER.to_string(), mac)],
        }
    }

    /// Follows membership (see [`RouteTable::follow_view_at`]), now.
    pub fn follow_view(&self, view: &ClusterView) {
        self.follow_view_at(view, Instant::now());
    }

    /// Follows membership at `now`: routes to nodes not live in `view` are
    /// ignored from now on, and the clock of their eviction starts; when
    /// this node rejoined, its routes are written again.
    pub fn follow_view_at(&self, view: &ClusterView, now: Instant) {
        let live: HashSet<String> = view
            .nodes
            .values()
            .filter(|n| n.live)
            .map(|n| n.heartbeat.node_id.clone())
            .collect();
        self.nodes.follow_live(&live, now);
        self.live.store(Arc::new(live));
        if view.rejoins > self.rejoins.swap(view.rejoins, Ordering::Relaxed) {
            tracing::info!(
                processes = lock(&self.local).by_process.len(),
                "this node rejoined the cluster; writing the routes of its processes again"
            );
            self.rejoined.notify_one();
        }
    }

    /// Evicts the routes of nodes that have not been live for the node
    /// timeout at `now` (never this node's), and forgets node names no
    /// route uses any more.
    pub fn evict_dead(&self, now: Instant) {
        let dead = self.nodes.dead(&self.self_id, now, self.node_timeout);
        if !dead.is_empty() {
            let removed = self.routes.evict(|r| dead.contains_key(&r.node));
            let evicted: u64 = removed.values().sum();
            self.nodes.release(removed);
            if evicted > 0 {
                let nodes: Vec<&str> = dead.values().map(|name| &**name).collect();
                tracing::info!(
                    evicted,
                    ?nodes,
                    "evicted the routes of nodes not live for the node timeout"
                );
                self.metrics
                    .routes
                    .set(i64::try_from(self.len()).unwrap_or(i64::MAX));
            }
        }
        self.nodes.prune();
    }

    /// Notes a local registration (connection `connection_id`) whose route
    /// record Kafka acknowledged at `position`; if a newer route already
    /// names another node, the local connection is replaced.
    fn local_registered(&self, process_id: &str, connection_id: u64, position: Position) {
        {
            let mut local = lock(&self.local);
            match local.by_process.get_mut(process_id) {
                Some(route) if route.connection == connection_id => {
                    route.position = Some(position);
                }
                _ => return,
            }
        }
        let at = (position.0, place(Some((position.1, position.2))));
        let newer_elsewhere = self
            .route_of(process_id)
            .filter(|(r, node)| **node != *self.self_id && r.order() > at)
            .map(|(_, node)| node.to_string());
        if let Some(node) = newer_elsewhere {
            self.gateway.replace_local(
                process_id,
                format!("process `{process_id}` registered again on node {node}"),
            );
        }
    }

    fn replace_if_older(
        &self,
        process_id: &str,
        local: Option<LocalRoute>,
        node: &str,
        position: Position,
    ) {
        if let Some(LocalRoute {
            position: Some(local_position),
            ..
        }) = local
            && local_position < position
        {
            self.gateway.replace_local(
                process_id,
                format!("process `{process_id}` registered again on node {node}"),
            );
        }
    }

    /// Notes a local registration of `process_id` (connection
    /// `connection_id`, at `now_ms`) and gives its route a generation
    /// larger than the route known for the process, than any this node
    /// gave out, and than `now_ms`.
    fn next_generation(&self, process_id: &str, now_ms: i64, connection_id: u64) -> u64 {
        let known = self
            .routes
            .get(process_id)
            .map_or(0, |route| route.generation);
        let mut local = lock(&self.local);
        let generation = u64::try_from(now_ms)
            .unwrap_or_default()
            .max(known + 1)
            .max(local.last_generation + 1);
        local.last_generation = generation;
        let older = local.by_process.insert(
            process_id.to_string(),
            LocalRoute {
                connection: connection_id,
                generation,
                registered_at_ms: now_ms,
                position: None,
            },
        );
        // A connection replaced by a newer one here ends without a goodbye
        // of its own.
        if let Some(older) = older
            && older.connection != connection_id
        {
            local.generations.remove(&older.connection);
        }
        local.generations.insert(connection_id, generation);
        generation
    }

    /// The connection this node published a route of `process_id` for.
    fn local_connection(&self, process_id: &str) -> Option<u64> {
        lock(&self.local)
            .by_process
            .get(process_id)
            .map(|route| route.connection)
    }

    /// Notes that connection `connection_id` of `process_id` ended, and
    /// returns the tombstone of its route; `None` when it has no route to
    /// end (never registered here) or was replaced by a newer registration
    /// elsewhere (that route is the process's, and a goodbye after it would
    /// be the key's last record once compacted).
    fn goodbye(&self, process_id: &str, connection_id: u64) -> Option<OutputRecord> {
        let generation = {
            let mut local = lock(&self.local);
            if local
                .by_process
                .get(process_id)
                .is_some_and(|route| route.connection == connection_id)
            {
                local.by_process.remove(process_id);
            }
            local.generations.remove(&connection_id)
        }?;
        self.tombstone_unless_succeeded(process_id, generation)
    }

    /// The tombstone of this node's route of `process_id` of `generation`;
    /// `None` when a route of that generation or newer on another node
    /// succeeded it.
    fn tombstone_unless_succeeded(
        &self,
        process_id: &str,
        generation: u64,
    ) -> Option<OutputRecord> {
        let successor = self
            .route_of(process_id)
            .filter(|(r, node)| **node != *self.self_id && r.generation >= generation)
            .map(|(_, node)| node);
        if let Some(node) = successor {
            tracing::debug!(process = %process_id, %node, "no route tombstone: the process registered again on another node");
            return None;
        }
        let mac = removal_mac(&self.key, process_id.as_bytes(), &self.self_id, generation);
        Some(OutputRecord {
            key: Some(process_id.as_bytes().to_vec()),
            value: None,
            headers: vec![
                (
                    ROUTE_NODE_HEADER.to_string(),
                    self.self_id.as_bytes().to_vec(),
                ),
                (
                    ROUTE_GENERATION_HEADER.to_string(),
                    generation.to_string().into_bytes(),
                ),
                (MAC_HEADER.to_string(), mac),
            ],
        })
    }

    /// The id of `node` for a route about to be stored, counted as one of
    /// its routes (see [`RouteTable::settle`]); a node not live starts its
    /// eviction clock, and a route just written by one restarts it.
    fn intern(&self, node: &str) -> NodeId {
        self.nodes.acquire(node, Instant::now())
    }

    /// After storing (`stored`) or not a route of `node` over `old`: the
    /// route not stored, or the one it replaced, no longer counts for its
    /// node.
    fn settle(&self, node: NodeId, stored: bool, old: Option<Route>) {
        match (stored, old) {
            (false, _) => self.nodes.release([(node, 1)]),
            (true, Some(old)) => self.nodes.release([(old.node, 1)]),
            (true, None) => {}
        }
    }

    /// True when node `id` is `name`.
    fn names(&self, id: NodeId, name: &str) -> bool {
        self.nodes.name(id).is_some_and(|n| *n == *name)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl super::mesh::LookupAnswerer for RouteTable {
    /// The generation of the registration of `process_id` here (0 when its
    /// route is not written yet: it is about to be), and its route written
    /// again unless a lookup had it written within
    /// [`LOOKUP_REWRITE_EVERY`].
    fn asked_for(&self, process_id: &str) -> u64 {
        let Some(generation) = lock(&self.local)
            .by_process
            .get(process_id)
            .map(|local| local.generation)
        else {
            return 0;
        };
        let now = Instant::now();
        let rewrite = {
            let mut rewritten = lock(&self.rewritten_for_lookups);
            let (order, recent) = &mut *rewritten;
            while let Some((at, _)) = order.front()
                && now.saturating_duration_since(*at) >= LOOKUP_REWRITE_EVERY
            {
                if let Some((_, process)) = order.pop_front() {
                    recent.remove(&process);
                }
            }
            let first = recent.insert(process_id.to_string());
            if first {
                order.push_back((now, process_id.to_string()));
            }
            first
        };
        if rewrite {
            tracing::debug!(process = %process_id, "a peer looked up a process connected here; writing its route again");
            self.request_republish(std::iter::once(process_id));
        }
        generation
    }

    fn records_missed(&self, partition: i32, from: i64, to: i64) {
        self.rewrite_missed(partition, from, to);
    }
}

/// Names a process whose next route record (not a tombstone) this node's
/// reader drops, once: fault injection for the tests, standing for a
/// broker that lost a record. It can only make a node miss a route, never
/// take one that was not written with the cluster secret.
pub const DROP_ROUTE_ONCE_ENV: &str = "WASMRELAY_TEST_DROP_ROUTE_RECORD";

/// What the routes topic's reader does, on its thread: makes room in
/// `table` for the records the topic holds (before the first is read, so
/// the maps never grow and copy themselves on the way), then applies each
/// record (unless it is the one [`DROP_ROUTE_ONCE_ENV`] names: then it
/// forgets the name), counting them in `read`.
pub fn apply_to_table(table: Arc<RouteTable>, read: Arc<AtomicU64>) -> TailSink {
    let mut drop_once = std::env::var(DROP_ROUTE_ONCE_ENV).ok();
    TailSink::ApplyWhenSized(Box::new(move |records_at_start| {
        table.reserve(records_at_start.unwrap_or_default());
        Box::new(move |records: &[RecordView<'_>]| {
            read.fetch_add(records.len() as u64, Ordering::Relaxed);
            let dropped = drop_once.as_deref().and_then(|process| {
                records.iter().position(|record| {
                    record.value.is_some() && record.key == Some(process.as_bytes())
                })
            });
            match dropped {
                None => table.apply_views(records),
                Some(at) => {
                    drop_once = None;
                    let record = &records[at];
                    tracing::warn!(process = ?String::from_utf8_lossy(record.key.unwrap_or_default()), offset = record.offset, "dropping a route record ({DROP_ROUTE_ONCE_ENV})");
                    table.apply_views(&records[..at]);
                    table.apply_views(&records[at + 1..]);
                }
            }
        })
    }))
}

/// Offsets `from..to` of `partition` of the routes topic that this node's
/// reader never got: the peers are asked to write again what they wrote
/// there ([`crate::cluster::mesh::Mesh::ask_to_rewrite`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MissedRecords {
    /// The partition.
    pub partition: i32,
    /// The first offset missed.
    pub from: i64,
    /// One past the last offset missed.
    pub to: i64,
}

/// Follows the reading of the routes topic into `table` (records applied
/// by [`apply_to_table`], counted in `read`) until `shutdown`: reports the
/// catch-up, timed from `started` (when the reader started); counts the
/// offsets the reader missed, writes again this node's records among them
/// and sends them to `missed` for the peers; follows
/// membership, and, from its first view on, evicts the routes of nodes not
/// live for the node timeout.
pub async fn follow_routes(
    table: Arc<RouteTable>,
    mut events: mpsc::Receiver<TailEvent>,
    missed: mpsc::Sender<MissedRecords>,
    read: Arc<AtomicU64>,
    mut view: watch::Receiver<ClusterView>,
    started: Instant,
    shutdown: CancellationToken,
) {
    let mut viewed = false;
    let mut sweep = tokio::time::interval((table.node_timeout / 4).max(Duration::from_millis(100)));
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            // Before membership's first view no node is known live (the
            // task starts while the node checks for a twin): no eviction.
            _ = sweep.tick(), if viewed => table.evict_dead(Instant::now()),
            changed = view.changed() => {
                if changed.is_err() { return; }
                viewed = true;
                let current = view.borrow_and_update().clone();
                table.follow_view(&current);
            }
            event = events.recv() => match event {
                None => return,
                // An applying tail sends no records.
                Some(TailEvent::Record(_)) => {}
                Some(TailEvent::Missed { partition, from, to }) => {
                    table.reader_missed(partition, from, to);
                    if missed.try_send(MissedRecords { partition, from, to }).is_err() {
                        tracing::warn!(partition, from, to, "too many misses waiting to be sent to the peers; this one is left to anti-entropy");
                    }
                }
                Some(TailEvent::CaughtUp) => {
                    let catch_up = CatchUp {
                        records: read.load(Ordering::Relaxed),
                        routes: table.len(),
                        seconds: started.elapsed().as_secs_f64(),
                    };
                    tracing::info!(records = catch_up.records, routes = catch_up.routes, seconds = catch_up.seconds, "route table caught up");
                    table.routes.shrink();
                    table.caught_up.send_replace(Some(catch_up));
                    // What the reader's fetches and the map's growth freed
                    // stays with glibc until given back: now, rather than
                    // at the next periodic release.
                    let released = tokio::task::spawn_blocking(wasmrelay_malloc::release_free_memory).await;
                    tracing::debug!(released = released.unwrap_or(false), "free heap memory given back after the catch-up");
                }
            }
        }
    }
}

/// Anti-entropy until `shutdown`: every `interval`, and at once when this
/// node rejoins, the routes of the processes connected here are written
/// again, spread over half the interval (at once on a rejoin) and never
/// faster than [`MAX_REFRESH_RATE`] records a second.
pub async fn refresh_routes(
    table: Arc<RouteTable>,
    interval: Duration,
    shutdown: CancellationToken,
) {
    loop {
        let rejoin = tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => false,
            _ = table.rejoined.notified() => true,
        };
        let processes = table.local_processes();
        if processes.is_empty() {
            continue;
        }
        let span = if rejoin { Duration::ZERO } else { interval / 2 };
        let steps = u32::try_from(processes.len().div_ceil(REFRESH_BATCH)).unwrap_or(u32::MAX);
        let pause =
            (span / steps).max(Duration::from_secs(1) * REFRESH_BATCH as u32 / MAX_REFRESH_RATE);
        tracing::debug!(
            processes = processes.len(),
            rejoin,
            ?pause,
            "writing the routes of the processes connected here again"
        );
        for batch in processes.chunks(REFRESH_BATCH) {
            table.request_republish(batch.iter().map(String::as_str));
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(pause) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(5);

    pub(super) fn table() -> Arc<RouteTable> {
        let gateway = Gateway::new(
            Default::default(),
            crate::gateway::ClientAuth::none(),
            Arc::new(crate::gateway::RefusingUpstream),
            None,
        );
        RouteTable::new("a", key(), TIMEOUT, gateway, ClusterMetrics::default())
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

    /// A route record of `value` as written, MAC'd.
    fn route_valued(process: &str, value: &[u8], offset: i64) -> InputRecord {
        InputRecord {
            headers: vec![(
                MAC_HEADER.to_string(),
                route_mac(&key(), process.as_bytes(), value),
            )],
            value: Some(value.to_vec()),
            ..route(process, "x", offset)
        }
    }

    #[test]
    fn a_route_value_is_read_as_written_escapes_included_and_one_without_its_time_is_malformed() {
        let table = table();
        table.follow_view(&view(&[("a", true), ("b\"c", true)]));
        table.apply(&route_valued(
            "p",
            br#"{"node":"b\"c","registered_at_ms":0,"generation":1}"#,
            1,
        ));
        assert_eq!(table.lookup("p").as_deref(), Some("b\"c"));
        table.apply(&route_valued("q", br#"{"node":"b\"c","generation":1}"#, 2));
        assert_eq!(table.lookup("q"), None);
        assert_eq!(rejected(&table, "malformed"), 1);
        // Bytes that are not UTF-8, even in a field the reader skips (found
        // by the route_records fuzz target).
        table.apply(&route_valued(
            "r",
            b"{\"node\":\"b\\\"c\",\"registered_at_ms\":0,\"other\":\"\x9c\x94\"}",
            3,
        ));
        assert_eq!(table.lookup("r"), None);
        assert_eq!(rejected(&table, "malformed"), 2);
    }

    #[test]
    fn records_applied_in_one_batch_end_as_if_applied_one_at_a_time() {
        // Many processes (all shards), some with several records in the
        // batch: routes replacing routes, an older one after a newer one,
        // tombstones that end the route and one that does not, a forgery.
        let mut records = Vec::new();
        for n in 0..300i64 {
            let process = format!("p-{n}");
            records.push(route(&process, "b", 3 * n + 1));
            match n % 5 {
                0 => records.push(route(&process, "c", 3 * n + 2)),
                1 => records.push(tombstone(&process, "b", (3 * n + 1) as u64, 3 * n + 2)),
                2 => records.push(tombstone(&process, "c", (3 * n + 1) as u64, 3 * n + 2)),
                3 => records.push(route_of_generation(&process, "c", 0, 3 * n + 2)),
                _ => {
                    let mut forged = route(&process, "c", 3 * n + 2);
                    forged.headers[0].1[0] ^= 1;
                    records.push(forged);
                }
            }
        }
        let live = view(&[("a", true), ("b", true), ("c", true)]);
        let one_by_one = table();
        one_by_one.follow_view(&live);
        for record in &records {
            one_by_one.apply(record);
        }
        let batched = table();
        batched.follow_view(&live);
        let views: Vec<RecordView<'_>> = records.iter().map(InputRecord::view).collect();
        batched.apply_views(&views);
        for n in 0..300 {
            let process = format!("p-{n}");
            assert_eq!(
                batched.lookup(&process),
                one_by_one.lookup(&process),
                "{process}"
            );
        }
        assert_eq!(batched.len(), one_by_one.len());
        assert_eq!(
            batched.len(),
            240,
            "the 60 ended by their tombstone are gone"
        );
        assert_eq!(batched.lookup("p-0").as_deref(), Some("c"));
        assert_eq!(
            batched.lookup("p-3").as_deref(),
            Some("b"),
            "older after newer"
        );
        assert_eq!(rejected(&batched, "bad_mac"), 60);
        // Each node counts the routes that name it, as one by one.
        assert_eq!(batched.nodes.len(), one_by_one.nodes.len());
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
                        ..Heartbeat::default()
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

    /// `table` registers `process` on connection `connection` and Kafka
    /// acknowledges its route at `offset`; the route record is returned.
    fn register_here(
        table: &RouteTable,
        process: &str,
        connection: u64,
        offset: i64,
    ) -> InputRecord {
        let generation = table.next_generation(process, offset, connection);
        table.local_registered(process, connection, (generation, 0, offset));
        let record = table.route_record(process, offset, generation);
        InputRecord {
            topic: "routes".into(),
            partition: 0,
            offset,
            key: record.key,
            value: record.value,
            headers: record.headers,
            timestamp_ms: None,
        }
    }

    /// An output record as read back at `offset`.
    fn read_back(record: OutputRecord, offset: i64) -> InputRecord {
        InputRecord {
            topic: "routes".into(),
            partition: 0,
            offset,
            key: record.key,
            value: record.value,
            headers: record.headers,
            timestamp_ms: None,
        }
    }

    /// What a node that reads only the last record of each key (a compacted
    /// topic) makes of `records`.
    fn compacted(records: &[InputRecord]) -> Vec<InputRecord> {
        let mut last: HashMap<Vec<u8>, InputRecord> = HashMap::new();
        for record in records {
            last.insert(record.key.clone().unwrap(), record.clone());
        }
        let mut records: Vec<InputRecord> = last.into_values().collect();
        records.sort_by_key(|r| r.offset);
        records
    }

    fn table_of(node: &str) -> Arc<RouteTable> {
        let gateway = Gateway::new(
            Default::default(),
            crate::gateway::ClientAuth::none(),
            Arc::new(crate::gateway::RefusingUpstream),
            None,
        );
        RouteTable::new(node, key(), TIMEOUT, gateway, ClusterMetrics::default())
    }

    #[test]
    fn a_session_replaced_on_another_node_leaves_no_tombstone() {
        let b = table_of("b");
        let on_b = register_here(&b, "p", 1, 1);
        b.apply(&on_b);
        // p registers on c: b reads c's route, its session is replaced and
        // ends.
        b.apply(&route_of_generation("p", "c", u64::MAX / 2, 2));
        assert!(
            b.goodbye("p", 1).is_none(),
            "a successor elsewhere: no goodbye"
        );
        // A session that ends without a successor says goodbye.
        let on_b = register_here(&b, "q", 2, 3);
        b.apply(&on_b);
        let goodbye = b.goodbye("q", 2).expect("a tombstone");
        assert_eq!(goodbye.value, None);
        assert!(b.goodbye("q", 2).is_none(), "once");
    }

    #[test]
    fn a_moved_process_routes_to_its_new_node_after_compaction_whatever_the_order() {
        // p moves from b to c; b's goodbye is written after c's route (b
        // lost the client before it read c's route).
        let b = table_of("b");
        let c = table_of("c");
        let mut topic = vec![register_here(&b, "p", 1, 1)];
        for record in &topic {
            c.apply(record);
        }
        topic.push(register_here(&c, "p", 7, 2));
        let goodbye = b.goodbye("p", 1).expect("b had not read c's route");
        topic.push(read_back(goodbye, 3));
        // c reads the goodbye after its own route: it writes the route
        // again, the key's last word.
        for record in &topic[1..] {
            c.apply(record);
        }
        let (again, _) = c.take_republish(10);
        assert_eq!(again, vec!["p".to_string()]);
        let (record, (connection, generation)) = c.route_again("p").expect("p is connected to c");
        topic.push(read_back(record, 4));
        c.local_registered("p", connection, (generation, 0, 4));
        // c reads its own record again: no loop.
        c.apply(&topic[3]);
        assert!(c.take_republish(10).0.is_empty());
        // A node started later on the compacted topic routes p to c.
        let later = table();
        later.follow_view(&view(&[("a", true), ("b", true), ("c", true)]));
        for record in compacted(&topic) {
            later.apply(&record);
        }
        assert_eq!(later.lookup("p").as_deref(), Some("c"));
        // Without the holder's last word, the goodbye would be all.
        let before = table();
        for record in compacted(&topic[..3]) {
            before.apply(&record);
        }
        assert_eq!(before.holder("p"), None);
    }

    #[test]
    fn the_holder_writes_its_route_again_only_after_a_record_that_is_not_its_latest() {
        let c = table_of("c");
        let own = register_here(&c, "p", 1, 10);
        let generation: u64 = 10;
        // Its own route: nothing.
        c.apply(&own);
        // Records before its route in the topic: nothing.
        c.apply(&route_of_generation("p", "b", generation - 1, 9));
        c.apply(&tombstone("p", "b", generation - 1, 8));
        assert!(c.take_republish(10).0.is_empty());
        // A newer registration elsewhere: replaced, not reasserted.
        c.apply(&route_of_generation("p", "d", generation + 1, 11));
        assert!(c.take_republish(10).0.is_empty());
        // After it: an older route, a goodbye of an older one, a replayed
        // goodbye of its own.
        let c = table_of("c");
        register_here(&c, "p", 1, 10);
        for record in [
            route_of_generation("p", "b", generation - 1, 11),
            tombstone("p", "b", generation - 1, 12),
            tombstone("p", "c", generation, 13),
        ] {
            c.apply(&record);
            assert_eq!(c.take_republish(10).0, vec!["p".to_string()], "{record:?}");
        }
        // Not connected here: nothing.
        c.apply(&tombstone("q", "b", 1, 14));
        assert!(c.take_republish(10).0.is_empty());
    }

    #[test]
    fn a_route_is_not_written_again_once_the_process_left_or_moved() {
        let c = table_of("c");
        register_here(&c, "p", 1, 10);
        register_here(&c, "q", 2, 11);
        c.request_republish(["p", "q", "p"]);
        assert_eq!(
            c.take_republish(10).0,
            vec!["p".to_string(), "q".to_string()],
            "each once"
        );
        assert!(c.goodbye("p", 1).is_some());
        assert!(
            c.route_again("p").is_none(),
            "gone: no route after its goodbye"
        );
        c.apply(&route_of_generation("q", "d", u64::MAX / 2, 12));
        assert!(c.route_again("q").is_none(), "moved: no stale route");
        assert_eq!(c.republished(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn anti_entropy_writes_every_local_route_again_each_period_and_at_once_on_a_rejoin() {
        let c = table_of("c");
        for i in 0..120 {
            register_here(&c, &format!("p{i}"), i, i as i64 + 1);
        }
        let shutdown = CancellationToken::new();
        let period = Duration::from_secs(60);
        let tasks = tokio_util::task::TaskTracker::new();
        tasks.spawn(refresh_routes(c.clone(), period, shutdown.clone()));
        let taken = |c: &RouteTable| c.take_republish(usize::MAX).0.len();
        tokio::time::sleep(period - Duration::from_secs(1)).await;
        assert_eq!(taken(&c), 0, "nothing before the period");
        // Paced over half the period: a batch at a time.
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(taken(&c), REFRESH_BATCH);
        tokio::time::sleep(period / 2).await;
        assert_eq!(taken(&c), 120 - REFRESH_BATCH);
        // Rejoining: everything again, at the fastest rate, now.
        let mut rejoined = view(&[("c", true)]);
        rejoined.rejoins = 1;
        c.follow_view(&rejoined);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(taken(&c), 120);
        // The same view again is no new rejoin.
        c.follow_view(&rejoined);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(taken(&c), 0);
        shutdown.cancel();
        tasks.close();
        tasks.wait().await;
    }

    #[test]
    fn routes_of_nodes_not_live_for_the_node_timeout_are_evicted_and_their_names_forgotten() {
        let table = table();
        let t0 = Instant::now();
        table.follow_view_at(&view(&[("a", true), ("b", true)]), t0);
        table.apply(&route("p", "b", 1));
        table.apply(&route("q", "a", 2));
        // Never heard of: evicted a node timeout after it was read.
        table.apply(&route("r", "x", 3));
        assert_eq!(table.node_names(), 3);
        table.evict_dead(Instant::now() + TIMEOUT / 2);
        assert_eq!(table.holder("r").as_deref(), Some("x"));
        // b misses heartbeats for less than the timeout: kept.
        table.follow_view_at(&view(&[("a", true), ("b", false)]), t0);
        assert_eq!(table.lookup("p"), None, "ignored while not live");
        table.evict_dead(t0 + TIMEOUT / 2);
        table.follow_view_at(&view(&[("a", true), ("b", true)]), t0 + TIMEOUT / 2);
        table.evict_dead(t0 + TIMEOUT * 2);
        assert_eq!(
            table.lookup("p").as_deref(),
            Some("b"),
            "b's routes survive a hiccup"
        );
        // b silent for the node timeout: evicted, its name forgotten.
        let t1 = t0 + TIMEOUT * 3;
        table.follow_view_at(&view(&[("a", true), ("b", false)]), t1);
        table.evict_dead(t1 + TIMEOUT);
        assert_eq!(table.holder("p"), None);
        assert_eq!(table.holder("r"), None);
        assert_eq!(table.holder("q").as_deref(), Some("a"), "never this node's");
        assert_eq!(table.node_names(), 1);
        assert_eq!(table.len(), 1);
    }

    #[test]
    fn a_route_written_by_a_node_not_live_restarts_its_eviction_clock() {
        let table = table();
        let t0 = Instant::now();
        table.follow_view_at(&view(&[("a", true), ("b", false)]), t0);
        table.apply(&route("p", "b", 1));
        std::thread::sleep(Duration::from_millis(20));
        // b rejoined and wrote its routes again before its heartbeat came.
        let written = Instant::now();
        table.apply(&route("q", "b", 2));
        let after = Instant::now();
        table.evict_dead(written + TIMEOUT - Duration::from_millis(10));
        assert_eq!(table.len(), 2);
        table.evict_dead(after + TIMEOUT);
        assert_eq!(table.len(), 0);
    }

    #[test]
    fn a_learned_route_never_replaces_a_newer_record_and_any_record_of_its_generation_replaces_it()
    {
        let table = table();
        table.follow_view_at(
            &view(&[("a", true), ("b", true), ("c", true)]),
            Instant::now(),
        );
        // Nothing known: learned.
        assert!(table.learn("p", "b", 10));
        assert_eq!(table.lookup("p").as_deref(), Some("b"));
        // Not over a route of the same or a newer generation.
        assert!(!table.learn("p", "c", 10));
        table.apply(&route_of_generation("q", "c", 20, 1));
        assert!(!table.learn("q", "b", 19));
        assert!(!table.learn("q", "b", 20));
        assert_eq!(table.lookup("q").as_deref(), Some("c"));
        // Over an older one, yes.
        assert!(table.learn("q", "b", 21));
        assert_eq!(table.lookup("q").as_deref(), Some("b"));
        // Never generation 0, this node, or a process registered here.
        assert!(!table.learn("r", "b", 0));
        assert!(!table.learn("r", "a", 5));
        register_here(&table, "s", 1, 3);
        assert!(!table.learn("s", "b", u64::MAX));
        // The record of the learned generation replaces it, even written
        // at a low offset; so does its tombstone.
        table.apply(&route_of_generation("p", "b", 10, 0));
        assert!(!table.forget_learned("p", "b"), "read from the topic now");
        assert_eq!(table.lookup("p").as_deref(), Some("b"));
        table.apply(&tombstone("q", "b", 21, 2));
        assert_eq!(table.holder("q"), None);
        // A learned route that went stale is forgotten; only for its node.
        assert!(table.learn("t", "b", 7));
        assert!(!table.forget_learned("t", "c"));
        assert!(table.forget_learned("t", "b"));
        assert_eq!(table.holder("t"), None);
    }

    #[test]
    fn lookups_have_a_held_route_written_again_at_most_once_per_process_per_period() {
        use super::super::mesh::LookupAnswerer as _;
        let table = table();
        let record = register_here(&table, "p", 1, 5);
        let generation: RouteValue =
            serde_json::from_slice(record.value.as_deref().unwrap()).unwrap();
        // Not held here: generation 0, nothing written.
        assert_eq!(table.asked_for("nobody"), 0);
        assert_eq!(table.take_republish(10).0, Vec::<String>::new());
        for _ in 0..100 {
            assert_eq!(table.asked_for("p"), generation.generation);
        }
        assert_eq!(table.take_republish(10).0, vec!["p".to_string()]);
        assert_eq!(table.asked_for("p"), generation.generation);
        assert!(table.take_republish(10).0.is_empty(), "once per period");
        // After the period, again.
        lock(&table.rewritten_for_lookups).0.front_mut().unwrap().0 -= LOOKUP_REWRITE_EVERY;
        table.asked_for("p");
        assert_eq!(table.take_republish(10).0, vec!["p".to_string()]);
        assert_eq!(lock(&table.rewritten_for_lookups).1.len(), 1, "bounded");
    }

    #[test]
    fn what_this_node_wrote_at_offsets_a_reader_missed_is_written_again_as_it_stands() {
        use super::super::mesh::LookupAnswerer as _;
        let table = table();
        table.wrote("p", 0, 10, None);
        table.wrote("gone", 0, 11, Some(9));
        table.wrote("other-partition", 1, 10, None);
        table.wrote("later", 0, 12, None);
        // A peer missed offsets 10 and 11 of partition 0.
        table.records_missed(0, 10, 12);
        let mut again = table.take_republish(10).0;
        again.sort();
        assert_eq!(again, vec!["gone".to_string(), "p".to_string()]);
        assert_eq!(
            lock(&table.goodbyes_again).get("gone"),
            Some(&9),
            "a tombstone is written again only while still due"
        );
        assert_eq!(table.rewritten_for_missed(), 2);
        assert_eq!(table.rewrite_missed(0, 13, 20), 0, "nothing written there");
        // This node's own reader missed one: counted, and its own record
        // written again.
        table.reader_missed(0, 12, 13);
        assert_eq!(table.offsets_missed(), 1);
        assert_eq!(table.metrics.route_records_missed.get(), 1);
        assert_eq!(table.take_republish(10).0, vec!["later".to_string()]);
    }

    #[test]
    fn a_route_moving_between_nodes_counts_for_its_new_node_and_the_old_name_goes() {
        let table = table();
        table.follow_view(&view(&[("a", true), ("b", true), ("c", true)]));
        table.apply(&route("p", "b", 1));
        table.apply(&route("q", "b", 2));
        // p moves to c.
        table.apply(&route("p", "c", 3));
        assert_eq!(table.lookup("p").as_deref(), Some("c"));
        table.evict_dead(Instant::now());
        assert_eq!(table.node_names(), 2, "b still holds q");
        // q moves too: b names no route and is forgotten.
        table.apply(&route("q", "c", 4));
        table.evict_dead(Instant::now());
        assert_eq!(table.node_names(), 1);
        // A replayed older route of b's changes nothing and keeps no name.
        table.apply(&route("p", "b", 2));
        table.evict_dead(Instant::now());
        assert_eq!(table.node_names(), 1);
        assert_eq!(table.lookup("p").as_deref(), Some("c"));
        // b comes back with a newer route: a name of its own again.
        table.apply(&route("p", "b", 5));
        assert_eq!(table.lookup("p").as_deref(), Some("b"));
        assert_eq!(table.holder("q").as_deref(), Some("c"));
        // c's goodbye for q, and a route learned and forgotten, leave b
        // alone.
        table.apply(&tombstone("q", "c", 4, 6));
        assert!(table.learn("r", "d", 9));
        assert_eq!(table.node_names(), 3);
        assert!(table.forget_learned("r", "d"));
        table.evict_dead(Instant::now());
        assert_eq!(table.node_names(), 1);
        assert_eq!(table.len(), 1);
        assert_eq!(table.holder("p").as_deref(), Some("b"));
    }

    #[test]
    fn lookups_on_many_threads_see_routes_applied_meanwhile() {
        let table = table();
        table.follow_view(&view(&[("a", true), ("b", true), ("c", true)]));
        let processes: Vec<String> = (0..2000).map(|i| format!("proc-{i:07}")).collect();
        for (i, process) in processes.iter().enumerate() {
            table.apply(&route(process, "b", i as i64));
        }
        std::thread::scope(|threads| {
            for _ in 0..4 {
                threads.spawn(|| {
                    for _ in 0..10 {
                        for process in &processes {
                            let node = table.lookup(process);
                            assert!(
                                matches!(node.as_deref(), Some("b" | "c")),
                                "{process}: {node:?}"
                            );
                        }
                    }
                });
            }
            threads.spawn(|| {
                for (i, process) in processes.iter().enumerate() {
                    table.apply(&route(process, "c", 2000 + i as i64));
                }
            });
        });
        assert!(
            processes
                .iter()
                .all(|p| table.lookup(p).as_deref() == Some("c"))
        );
        assert_eq!(table.len(), 2000);
        table.evict_dead(Instant::now());
        assert_eq!(table.node_names(), 1, "b named no route any more");
    }
}
