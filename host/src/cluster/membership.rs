//! Membership through Kafka: every node publishes a heartbeat to the
//! heartbeat topic at an interval and reads everyone's; a node is live while
//! its heartbeats arrive within the node timeout (measured on the reader's
//! clock, so clock skew between nodes does not matter). When fewer nodes
//! than `min_live_nodes` are live the alarm fires: an error log, the
//! `wasmrelay_cluster_alarm` metric, `/cluster`, and a record on the alarm
//! topic if one is configured.
//!
//! Every heartbeat carries a MAC made with the cluster secret (header
//! [`MAC_HEADER`], see `docs/CLUSTER-RECORDS.md`); one without a good MAC,
//! one that cannot be read, one older than the node timeout plus the
//! allowed clock skew (`stale`) and one not newer than the last from the
//! same instance (`replayed`) are ignored, logged and counted in
//! `wasmrelay_cluster_records_rejected_total`. So only a holder of the
//! secret can make a node look live or move its addresses.
//!
//! Each node instance draws a random instance id at start. Before it
//! serves, [`check_no_live_twin`] watches the heartbeats for a while and
//! refuses to start when another instance with the same node id is
//! beating; while it runs, a heartbeat with its id from another instance
//! fires the alarm (a live twin would hide its routes).
//!
//! The current picture is published as a [`ClusterView`] on a watch
//! channel; the mesh and the route table follow it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use wasmrelay_protocol::mesh_auth::{Key, MAX_CLOCK_SKEW_MS, record_mac, verify_record_mac};

use crate::gateway::Gateway;
use crate::kafka::group_rejoin::PeerLost;
use crate::kafka::tail::TailEvent;
use crate::kafka::{InputRecord, OutputRecord};
use crate::link::KafkaLink;
use crate::telemetry::metrics::ClusterMetrics;

/// The header that carries a cluster record's MAC (32 raw bytes).
pub const MAC_HEADER: &str = "wasmrelay-mac";

/// The record kind in a heartbeat's MAC.
const HEARTBEAT_KIND: &str = "heartbeat";

/// One node's heartbeat, as JSON on the heartbeat topic (key: node id,
/// header [`MAC_HEADER`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// The node.
    pub node_id: String,
    /// This run of the node: random, drawn at start.
    #[serde(default)]
    pub instance_id: String,
    /// Where business processes connect to it.
    pub client_addr: String,
    /// Where other nodes connect to it.
    pub mesh_addr: String,
    /// Its admin API.
    pub admin_addr: String,
    /// Processes connected to it.
    pub connections: u64,
    /// Connections it is meant to hold.
    pub quota: u64,
    /// When it started, ms since the Unix epoch.
    pub started_at_ms: i64,
    /// When this heartbeat was sent (sender's clock).
    pub sent_at_ms: i64,
    /// True in the last heartbeat of a node shutting down.
    #[serde(default)]
    pub leaving: bool,
    /// True while the node is being evacuated (`POST /evacuate`): it is
    /// live and still holds processes, but no node places new ones on it.
    /// Absent in heartbeats of older versions (false).
    #[serde(default)]
    pub evacuating: bool,
}

/// A node as `/cluster` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NodeView {
    /// Its latest heartbeat.
    #[serde(flatten)]
    pub heartbeat: Heartbeat,
    /// Whether its heartbeats arrive in time.
    pub live: bool,
    /// Milliseconds since its last heartbeat arrived here.
    pub last_seen_ms_ago: u64,
}

/// The cluster as this node sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ClusterView {
    /// Every node heard of recently, by id.
    pub nodes: BTreeMap<String, NodeView>,
    /// Live nodes, this one included.
    pub live: usize,
    /// The configured minimum.
    pub min_live_nodes: usize,
    /// True while `live < min_live_nodes`, or while another instance with
    /// this node's id is beating (see `twin_instance`).
    pub alarm: bool,
    /// The instance id of another instance beating with this node's id,
    /// while its heartbeats arrive within the node timeout.
    pub twin_instance: Option<String>,
    /// Times this node's own heartbeats came back from the topic after a
    /// gap of a node timeout or more (a stall, or Kafka out of reach):
    /// other nodes saw it as not live meanwhile, and may have evicted its
    /// routes.
    pub rejoins: u64,
}

impl ClusterView {
    /// The live nodes other than `self_id`, with their mesh addresses.
    pub fn live_peers(&self, self_id: &str) -> BTreeMap<String, String> {
        self.nodes
            .values()
            .filter(|n| n.live && n.heartbeat.node_id != self_id)
            .map(|n| (n.heartbeat.node_id.clone(), n.heartbeat.mesh_addr.clone()))
            .collect()
    }

    /// Whether `node_id` is live.
    pub fn is_live(&self, node_id: &str) -> bool {
        self.nodes.get(node_id).is_some_and(|n| n.live)
    }

    /// A view with only the nodes `ids`, all live, heard just now, their
    /// heartbeats otherwise empty: what a route table needs to follow in
    /// tests and benchmarks that have no heartbeat topic.
    pub fn of_live_nodes(ids: &[&str]) -> ClusterView {
        let nodes = ids
            .iter()
            .map(|id| {
                let heartbeat = Heartbeat {
                    node_id: id.to_string(),
                    ..Heartbeat::default()
                };
                let view = NodeView {
                    heartbeat,
                    live: true,
                    last_seen_ms_ago: 0,
                };
                (id.to_string(), view)
            })
            .collect();
        ClusterView {
            nodes,
            live: ids.len(),
            ..ClusterView::default()
        }
    }
}

impl ClusterView {
    /// The peers live in `before` whose heartbeats stopped in `self`
    /// (not live, and not because they left), with when each was last
    /// heard (`now` less its age): their consumer-group sessions are
    /// ending, and their partitions must move.
    pub fn lost_since(
        &self,
        before: &ClusterView,
        self_id: &str,
        now: std::time::Instant,
    ) -> Vec<PeerLost> {
        self.nodes
            .values()
            .filter(|n| {
                n.heartbeat.node_id != self_id
                    && !n.live
                    && !n.heartbeat.leaving
                    && before.is_live(&n.heartbeat.node_id)
            })
            .map(|n| PeerLost {
                node_id: n.heartbeat.node_id.clone(),
                last_heard: now
                    .checked_sub(Duration::from_millis(n.last_seen_ms_ago))
                    .unwrap_or(now),
            })
            .collect()
    }
}

/// How membership behaves.
#[derive(Clone, Debug)]
pub struct MembershipOptions {
    /// This node's heartbeat, without the counters (filled at each beat).
    pub identity: Heartbeat,
    /// Heartbeat topic.
    pub topic: String,
    /// Alarm topic, if any.
    pub alarm_topic: Option<String>,
    /// How often to publish.
    pub interval: Duration,
    /// Live while heartbeats arrive within this.
    pub node_timeout: Duration,
    /// Alarm below this many live nodes.
    pub min_live_nodes: usize,
    /// The key of heartbeat MACs (from the cluster secret).
    pub key: Key,
}

/// Forget a node that has been silent this many node timeouts.
const FORGET_AFTER_TIMEOUTS: u32 = 20;

struct NodeEntry {
    heartbeat: Heartbeat,
    last_seen: Instant,
}

/// Why a heartbeat record was ignored (the `reason` label).
#[derive(Debug)]
pub(crate) enum Rejected {
    MissingMac,
    BadMac,
    Malformed(String),
    Stale(i64),
    Replayed,
}

impl Rejected {
    fn reason(&self) -> &'static str {
        match self {
            Rejected::MissingMac => "missing_mac",
            Rejected::BadMac => "bad_mac",
            Rejected::Malformed(_) => "malformed",
            Rejected::Stale(_) => "stale",
            Rejected::Replayed => "replayed",
        }
    }
}

impl std::fmt::Display for Rejected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rejected::MissingMac => f.write_str("it carries no MAC"),
            Rejected::BadMac => f.write_str(
                "its MAC does not verify (forged, altered, or made with another cluster secret)",
            ),
            Rejected::Malformed(why) => write!(f, "it cannot be read: {why}"),
            Rejected::Stale(age) => write!(f, "it was sent {age} ms ago (a replay?)"),
            Rejected::Replayed => {
                f.write_str("it is not newer than the last heartbeat of its instance (a replay?)")
            }
        }
    }
}

/// The MAC header's value for a heartbeat record.
pub(crate) fn heartbeat_mac(key: &Key, record_key: &[u8], value: &[u8]) -> Vec<u8> {
    record_mac(key, HEARTBEAT_KIND, &[record_key, value]).to_vec()
}

/// Reads a heartbeat record: its MAC must verify over its key and value,
/// the key must be the node id, and it must be recent (by the sender's
/// clock, allowing for skew) so that an old record written again is not
/// taken for a live node.
pub(crate) fn open_heartbeat(
    key: &Key,
    record: &InputRecord,
    node_timeout: Duration,
) -> Result<Heartbeat, Rejected> {
    let Some(value) = record.value.as_deref() else {
        return Err(Rejected::Malformed("it has no value".to_string()));
    };
    let record_key = record.key.as_deref().unwrap_or_default();
    let mac = record
        .headers
        .iter()
        .find(|(name, _)| name == MAC_HEADER)
        .map(|(_, value)| value.as_slice())
        .ok_or(Rejected::MissingMac)?;
    if !verify_record_mac(key, HEARTBEAT_KIND, &[record_key, value], mac) {
        return Err(Rejected::BadMac);
    }
    // JSON is UTF-8 throughout: serde_json skips unknown fields of a slice
    // without checking their strings, so check the whole value first.
    let value = std::str::from_utf8(value)
        .map_err(|e| Rejected::Malformed(format!("it is not UTF-8: {e}")))?;
    let beat: Heartbeat =
        serde_json::from_str(value).map_err(|e| Rejected::Malformed(e.to_string()))?;
    if beat.node_id.as_bytes() != record_key {
        return Err(Rejected::Malformed(
            "its key is not its node id".to_string(),
        ));
    }
    let age = super::now_ms() - beat.sent_at_ms;
    let limit = i64::try_from(node_timeout.as_millis()).unwrap_or(i64::MAX) + MAX_CLOCK_SKEW_MS;
    if age > limit {
        return Err(Rejected::Stale(age));
    }
    Ok(beat)
}

/// Logs and counts a heartbeat record that was ignored.
fn reject(metrics: &ClusterMetrics, topic: &str, record: &InputRecord, why: &Rejected) {
    let key = String::from_utf8_lossy(record.key.as_deref().unwrap_or_default());
    tracing::warn!(%topic, offset = record.offset, key = ?key, reason = why.reason(), "ignoring a heartbeat: {why}");
    metrics.record_rejected(topic, why.reason());
}

/// Why a node may not start.
#[derive(Debug, thiserror::Error)]
pub enum StartRefused {
    /// Another instance with this node id is beating.
    #[error(
        "node id `{node_id}` is already in use by a live node (instance {instance_id}, mesh address {mesh_addr}, started at {started_at_ms} ms since the epoch); give this node another `node.id`, or stop the other one and start this one again"
    )]
    LiveTwin {
        /// The node id.
        node_id: String,
        /// The other instance.
        instance_id: String,
        /// Its mesh address.
        mesh_addr: String,
        /// When it started (its clock).
        started_at_ms: i64,
    },
    /// The heartbeat topic could not be read.
    #[error("the heartbeat topic reader stopped before the node id could be checked")]
    ReaderStopped,
}

/// Watches the heartbeat topic (a tail from its end) until it is read to
/// the end and then for `watch` more, and refuses when a heartbeat with a
/// good MAC, `node_id` and another instance id than `instance_id` arrives
/// (and is not that instance's leaving heartbeat).
///
/// A live instance beats every heartbeat interval, so watching a little
/// longer than one interval sees it. Only heartbeats sent after the watch
/// began count: a node restarted after a crash is not blocked by its old
/// instance's last heartbeats, only by one that is still beating. The cost
/// is that a start waits `watch`; a twin started at the very same moment
/// as this one can be missed (it is then caught by the running check, which
/// fires the alarm).
pub async fn check_no_live_twin(
    heartbeats: &mut mpsc::Receiver<TailEvent>,
    options: &MembershipOptions,
    watch: Duration,
    metrics: &ClusterMetrics,
) -> Result<(), StartRefused> {
    let self_id = &options.identity.node_id;
    let mut deadline: Option<Instant> = None;
    let mut twin: Option<Heartbeat> = None;
    loop {
        let event = match deadline {
            None => heartbeats.recv().await,
            Some(deadline) => match tokio::time::timeout_at(deadline, heartbeats.recv()).await {
                Ok(event) => event,
                Err(_) => break,
            },
        };
        match event {
            None => return Err(StartRefused::ReaderStopped),
            Some(TailEvent::CaughtUp) => {
                deadline.get_or_insert_with(|| Instant::now() + watch);
            }
            // Heartbeats repeat: the next one makes up for a missed one.
            Some(TailEvent::Missed { .. }) => {}
            Some(TailEvent::Record(record)) => {
                let beat = match open_heartbeat(&options.key, &record, options.node_timeout) {
                    Ok(beat) => beat,
                    Err(why) => {
                        reject(metrics, &options.topic, &record, &why);
                        continue;
                    }
                };
                if beat.node_id != *self_id || beat.instance_id == options.identity.instance_id {
                    continue;
                }
                if beat.leaving {
                    if twin
                        .as_ref()
                        .is_some_and(|t| t.instance_id == beat.instance_id)
                    {
                        twin = None;
                    }
                } else {
                    twin = Some(beat);
                }
            }
        }
    }
    match twin {
        None => Ok(()),
        Some(beat) => Err(StartRefused::LiveTwin {
            node_id: beat.node_id,
            instance_id: beat.instance_id,
            mesh_addr: beat.mesh_addr,
            started_at_ms: beat.started_at_ms,
        }),
    }
}

/// Runs membership until `shutdown`: publishes heartbeats, reads them from
/// `heartbeats` (a tail of the heartbeat topic from its end), keeps `view`
/// current and fires or clears the alarm. Publishes a leaving heartbeat
/// last.
pub async fn run_membership(
    options: MembershipOptions,
    link: Arc<KafkaLink>,
    gateway: Arc<Gateway>,
    mut heartbeats: mpsc::Receiver<TailEvent>,
    view: watch::Sender<ClusterView>,
    metrics: ClusterMetrics,
    shutdown: CancellationToken,
) {
    // Heartbeat acknowledgements are awaited aside (a lost one is replaced
    // by the next); the last is awaited before returning.
    let acks = TaskTracker::new();
    let self_id = options.identity.node_id.clone();
    let mut nodes: BTreeMap<String, NodeEntry> = BTreeMap::new();
    let started = Instant::now();
    let mut alarm = false;
    // Another instance with this node's id: its id and when it last beat.
    let mut twin: Option<(String, Instant)> = None;
    // When this node's own last heartbeat came back from the topic, and
    // how often one came back after a gap of a node timeout.
    let mut own_read: Option<Instant> = None;
    let mut rejoins = 0u64;
    // Readers drop a heartbeat not newer than the last of its instance, so
    // `sent_at_ms` never goes back, even when the clock does.
    let mut last_sent_ms = i64::MIN;
    let mut tick = tokio::time::interval(options.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {
                let beat = current_heartbeat(&options, &gateway, false, &mut last_sent_ms);
                metrics.connections.set(i64::try_from(beat.connections).unwrap_or(i64::MAX));
                publish_heartbeat(&link, &options, &beat, &acks).await;
                // This node knows it is alive without waiting for Kafka.
                nodes.insert(self_id.clone(), NodeEntry { heartbeat: beat, last_seen: Instant::now() });
            }
            event = heartbeats.recv() => {
                let Some(event) = event else { break };
                let TailEvent::Record(record) = event else { continue };
                let beat = match open_heartbeat(&options.key, &record, options.node_timeout) {
                    Ok(beat) => beat,
                    Err(why) => {
                        reject(&metrics, &options.topic, &record, &why);
                        continue;
                    }
                };
                if beat.node_id == self_id {
                    if beat.instance_id == options.identity.instance_id {
                        let now = Instant::now();
                        if own_read.is_some_and(|last| now.duration_since(last) >= options.node_timeout) {
                            rejoins += 1;
                            tracing::warn!(node = %self_id, "this node's heartbeats were not seen for the node timeout or more: other nodes saw it as not live");
                        }
                        own_read = Some(now);
                    } else {
                        // Not inserted: this node's entry stays its own.
                        metrics.twin_heartbeats.inc();
                        if beat.leaving {
                            twin = None;
                        } else {
                            tracing::error!(node = %self_id, instance = %options.identity.instance_id, other_instance = %beat.instance_id, other_mesh = %beat.mesh_addr, "another instance is running with this node's id: their routes hide each other's");
                            twin = Some((beat.instance_id, Instant::now()));
                        }
                    }
                    continue;
                }
                if let Some(known) = nodes.get(&beat.node_id)
                    && known.heartbeat.instance_id == beat.instance_id
                    && known.heartbeat.sent_at_ms >= beat.sent_at_ms
                {
                    reject(&metrics, &options.topic, &record, &Rejected::Replayed);
                    continue;
                }
                let known = nodes.get(&beat.node_id).is_some_and(|n| !n.heartbeat.leaving);
                if !known && !beat.leaving {
                    tracing::info!(node = %beat.node_id, mesh = %beat.mesh_addr, "node joined");
                }
                if beat.leaving {
                    tracing::info!(node = %beat.node_id, "node left");
                }
                nodes.insert(beat.node_id.clone(), NodeEntry { heartbeat: beat, last_seen: Instant::now() });
            }
        }
        let now = Instant::now();
        nodes.retain(|id, n| {
            *id == self_id
                || now.duration_since(n.last_seen) < options.node_timeout * FORGET_AFTER_TIMEOUTS
        });
        if twin
            .as_ref()
            .is_some_and(|(_, seen)| now.duration_since(*seen) >= options.node_timeout)
        {
            twin = None;
        }
        let next = build_view(&nodes, now, &options);
        metrics
            .live_nodes
            .set(i64::try_from(next.live).unwrap_or(i64::MAX));
        // No alarm for too few nodes while a starting node may not have
        // heard the others yet; a twin is certain at once.
        let evaluate = now.duration_since(started) >= options.node_timeout;
        let twin_instance = twin.as_ref().map(|(instance, _)| instance.clone());
        let firing = (evaluate && next.alarm) || twin_instance.is_some();
        if firing != alarm {
            alarm = firing;
            metrics.alarm.set(i64::from(alarm));
            report_alarm(&link, &options, &next, alarm, twin_instance.as_deref()).await;
        }
        let next = ClusterView {
            alarm: firing,
            twin_instance,
            rejoins,
            ..next
        };
        view.send_if_modified(|current| {
            if membership_changed(current, &next) {
                *current = next;
                true
            } else {
                // Counters and ages change every beat: keep them fresh
                // without waking every watcher.
                *current = next;
                false
            }
        });
    }
    let beat = current_heartbeat(&options, &gateway, true, &mut last_sent_ms);
    publish_heartbeat(&link, &options, &beat, &acks).await;
    acks.close();
    acks.wait().await;
}

/// Whether liveness, membership or the alarm changed (what watchers act on).
fn membership_changed(old: &ClusterView, new: &ClusterView) -> bool {
    old.alarm != new.alarm
        || old.twin_instance != new.twin_instance
        || old.rejoins != new.rejoins
        || old.live != new.live
        || old.nodes.len() != new.nodes.len()
        || old
            .nodes
            .iter()
            .zip(new.nodes.iter())
            .any(|((a, x), (b, y))| {
                a != b || x.live != y.live || x.heartbeat.mesh_addr != y.heartbeat.mesh_addr
            })
}

fn build_view(
    nodes: &BTreeMap<String, NodeEntry>,
    now: Instant,
    options: &MembershipOptions,
) -> ClusterView {
    let views: BTreeMap<String, NodeView> = nodes
        .iter()
        .map(|(id, n)| {
            let age = now.duration_since(n.last_seen);
            (
                id.clone(),
                NodeView {
                    heartbeat: n.heartbeat.clone(),
                    live: !n.heartbeat.leaving && age < options.node_timeout,
                    last_seen_ms_ago: u64::try_from(age.as_millis()).unwrap_or(u64::MAX),
                },
            )
        })
        .collect();
    let live = views.values().filter(|n| n.live).count();
    ClusterView {
        nodes: views,
        live,
        min_live_nodes: options.min_live_nodes,
        alarm: live < options.min_live_nodes,
        twin_instance: None,
        rejoins: 0,
    }
}

fn current_heartbeat(
    options: &MembershipOptions,
    gateway: &Gateway,
    leaving: bool,
    last_sent_ms: &mut i64,
) -> Heartbeat {
    *last_sent_ms = super::now_ms().max(last_sent_ms.saturating_add(1));
    Heartbeat {
        connections: gateway.connection_count() as u64,
        sent_at_ms: *last_sent_ms,
        leaving,
        evacuating: gateway.evacuating(),
        ..options.identity.clone()
    }
}

async fn publish_heartbeat(
    link: &KafkaLink,
    options: &MembershipOptions,
    beat: &Heartbeat,
    acks: &TaskTracker,
) {
    let topic = &options.topic;
    let Ok(value) = serde_json::to_vec(beat) else {
        return;
    };
    let key = beat.node_id.as_bytes().to_vec();
    let mac = heartbeat_mac(&options.key, &key, &value);
    let record = OutputRecord {
        key: Some(key),
        value: Some(value),
        headers: vec![(MAC_HEADER.to_string(), mac)],
    };
    // A lost heartbeat is replaced by the next one: do not wait for it.
    match link.producer().enqueue(topic, &record).await {
        Ok(ack) => {
            let topic = topic.to_string();
            acks.spawn(async move {
                if let Err(error) = ack.await {
                    tracing::warn!(%topic, %error, "a heartbeat was not written");
                }
            });
        }
        Err(error) => tracing::warn!(%topic, %error, "a heartbeat was not written"),
    }
}

async fn report_alarm(
    link: &KafkaLink,
    options: &MembershipOptions,
    view: &ClusterView,
    firing: bool,
    twin_instance: Option<&str>,
) {
    let live: Vec<&str> = view
        .nodes
        .values()
        .filter(|n| n.live)
        .map(|n| n.heartbeat.node_id.as_str())
        .collect();
    if firing && let Some(other) = twin_instance {
        tracing::error!(node = %options.identity.node_id, other_instance = %other, "ALARM: another instance is running with this node's id");
    } else if firing {
        tracing::error!(live = view.live, min_live_nodes = options.min_live_nodes, nodes = ?live, "ALARM: fewer live relay nodes than the minimum");
    } else {
        tracing::info!(
            live = view.live,
            min_live_nodes = options.min_live_nodes,
            "alarm cleared: enough live relay nodes again"
        );
    }
    let Some(topic) = &options.alarm_topic else {
        return;
    };
    let alarm = if twin_instance.is_some() {
        "node_id_in_use_twice"
    } else {
        "live_nodes_below_minimum"
    };
    let body = serde_json::json!({
        "alarm": alarm,
        "twin_instance": twin_instance,
        "firing": firing,
        "live": view.live,
        "min_live_nodes": options.min_live_nodes,
        "live_nodes": live,
        "reported_by": options.identity.node_id,
        "time_ms": super::now_ms(),
    });
    let record = OutputRecord {
        key: Some(alarm.as_bytes().to_vec()),
        value: Some(body.to_string().into_bytes()),
        headers: Vec::new(),
    };
    if let Err(error) = link.producer().send(topic, &record).await {
        tracing::error!(%topic, %error, "writing the alarm to the alarm topic failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasmrelay_protocol::mesh_auth::{Purpose, purpose_key};

    fn key() -> Key {
        purpose_key(b"secret", Purpose::HeartbeatRecord)
    }

    fn beat(node_id: &str, instance_id: &str, leaving: bool) -> Heartbeat {
        Heartbeat {
            node_id: node_id.to_string(),
            instance_id: instance_id.to_string(),
            client_addr: "127.0.0.1:1".to_string(),
            mesh_addr: "127.0.0.1:2".to_string(),
            admin_addr: "127.0.0.1:3".to_string(),
            connections: 0,
            quota: 10,
            started_at_ms: super::super::now_ms(),
            sent_at_ms: super::super::now_ms(),
            leaving,
            evacuating: false,
        }
    }

    fn record(beat: &Heartbeat, key: &Key) -> InputRecord {
        let value = serde_json::to_vec(beat).unwrap();
        let mac = heartbeat_mac(key, beat.node_id.as_bytes(), &value);
        InputRecord {
            topic: "heartbeats".into(),
            partition: 0,
            offset: 0,
            key: Some(beat.node_id.as_bytes().to_vec()),
            value: Some(value),
            headers: vec![(MAC_HEADER.to_string(), mac)],
            timestamp_ms: None,
        }
    }

    fn reason(record: &InputRecord) -> &'static str {
        open_heartbeat(&key(), record, Duration::from_secs(3))
            .unwrap_err()
            .reason()
    }

    #[test]
    fn only_a_fresh_heartbeat_with_a_good_mac_over_key_and_value_is_taken() {
        let sent = beat("a", "i1", false);
        let good = record(&sent, &key());
        assert_eq!(
            open_heartbeat(&key(), &good, Duration::from_secs(3)).unwrap(),
            sent
        );
        let mut unsigned = good.clone();
        unsigned.headers.clear();
        assert_eq!(reason(&unsigned), "missing_mac");
        let other = record(
            &beat("a", "i1", false),
            &purpose_key(b"a guess", Purpose::HeartbeatRecord),
        );
        assert_eq!(reason(&other), "bad_mac");
        let mut moved = good.clone();
        moved.value = Some(serde_json::to_vec(&beat("a", "i1", true)).unwrap());
        assert_eq!(reason(&moved), "bad_mac");
        let mut rekeyed = good.clone();
        rekeyed.key = Some(b"b".to_vec());
        assert_eq!(reason(&rekeyed), "bad_mac");
        let route_key = purpose_key(b"secret", Purpose::RouteRecord);
        assert_eq!(
            reason(&record(&beat("a", "i1", false), &route_key)),
            "bad_mac"
        );
        let mut old = beat("a", "i1", false);
        old.sent_at_ms -= 3_000 + MAX_CLOCK_SKEW_MS + 1_000;
        assert_eq!(reason(&record(&old, &key())), "stale");
        // Bytes that are not UTF-8 in a field the reader would skip, MAC
        // and all good.
        let mut value = serde_json::to_vec(&sent).unwrap();
        value.pop();
        value.extend_from_slice(b",\"other\":\"\x9c\x94\"}");
        let not_utf8 = InputRecord {
            headers: vec![(MAC_HEADER.to_string(), heartbeat_mac(&key(), b"a", &value))],
            value: Some(value),
            ..good.clone()
        };
        assert_eq!(reason(&not_utf8), "malformed");
    }

    fn options() -> MembershipOptions {
        MembershipOptions {
            identity: beat("a", "mine", false),
            topic: "heartbeats".to_string(),
            alarm_topic: None,
            interval: Duration::from_millis(100),
            node_timeout: Duration::from_secs(3),
            min_live_nodes: 1,
            key: key(),
        }
    }

    async fn check(events: Vec<TailEvent>) -> Result<(), StartRefused> {
        let (tx, mut rx) = mpsc::channel(16);
        for event in events {
            tx.send(event).await.unwrap();
        }
        check_no_live_twin(
            &mut rx,
            &options(),
            Duration::from_millis(200),
            &ClusterMetrics::default(),
        )
        .await
    }

    #[tokio::test(start_paused = true)]
    async fn a_start_is_refused_only_while_another_instance_with_the_id_beats() {
        let twin = beat("a", "other", false);
        let error = check(vec![
            TailEvent::CaughtUp,
            TailEvent::Record(record(&twin, &key())),
        ])
        .await
        .unwrap_err();
        let text = error.to_string();
        assert!(
            text.contains("node id `a` is already in use") && text.contains("other"),
            "{text}"
        );
        // Its own heartbeats, other nodes, a twin that is leaving, a forged
        // twin: no refusal.
        let forged = record(&twin, &purpose_key(b"a guess", Purpose::HeartbeatRecord));
        check(vec![
            TailEvent::CaughtUp,
            TailEvent::Record(record(&beat("a", "mine", false), &key())),
            TailEvent::Record(record(&beat("b", "x", false), &key())),
            TailEvent::Record(record(&twin, &key())),
            TailEvent::Record(record(&beat("a", "other", true), &key())),
            TailEvent::Record(forged),
        ])
        .await
        .unwrap();
    }
}
