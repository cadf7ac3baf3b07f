//! Membership through Kafka: every node publishes a heartbeat to the
//! heartbeat topic at an interval and reads everyone's; a node is live while
//! its heartbeats arrive within the node timeout (measured on the reader's
//! clock, so clock skew between nodes does not matter). When fewer nodes
//! than `min_live_nodes` are live the alarm fires: an error log, the
//! `wasmrelay_cluster_alarm` metric, `/cluster`, and a record on the alarm
//! topic if one is configured.
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

use crate::gateway::Gateway;
use crate::kafka::OutputRecord;
use crate::kafka::tail::TailEvent;
use crate::link::KafkaLink;
use crate::telemetry::metrics::ClusterMetrics;

/// One node's heartbeat, as JSON on the heartbeat topic (key: node id).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// The node.
    pub node_id: String,
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
    /// True while `live < min_live_nodes`.
    pub alarm: bool,
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
}

/// Forget a node that has been silent this many node timeouts.
const FORGET_AFTER_TIMEOUTS: u32 = 20;

struct NodeEntry {
    heartbeat: Heartbeat,
    last_seen: Instant,
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
    let mut tick = tokio::time::interval(options.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {
                let beat = current_heartbeat(&options, &gateway, false);
                metrics.connections.set(i64::try_from(beat.connections).unwrap_or(i64::MAX));
                publish_heartbeat(&link, &options.topic, &beat, &acks).await;
                // This node knows it is alive without waiting for Kafka.
                nodes.insert(self_id.clone(), NodeEntry { heartbeat: beat, last_seen: Instant::now() });
            }
            event = heartbeats.recv() => {
                let Some(event) = event else { break };
                let TailEvent::Record(record) = event else { continue };
                match record.value.as_deref().map(serde_json::from_slice::<Heartbeat>) {
                    Some(Ok(beat)) => {
                        let known = nodes.get(&beat.node_id).is_some_and(|n| !n.heartbeat.leaving);
                        if !known && !beat.leaving && beat.node_id != self_id {
                            tracing::info!(node = %beat.node_id, mesh = %beat.mesh_addr, "node joined");
                        }
                        if beat.leaving {
                            tracing::info!(node = %beat.node_id, "node left");
                        }
                        nodes.insert(beat.node_id.clone(), NodeEntry { heartbeat: beat, last_seen: Instant::now() });
                    }
                    Some(Err(error)) => {
                        tracing::warn!(topic = %options.topic, offset = record.offset, %error, "ignoring a heartbeat that is not valid JSON");
                        continue;
                    }
                    None => continue,
                }
            }
        }
        let now = Instant::now();
        nodes.retain(|id, n| {
            *id == self_id
                || now.duration_since(n.last_seen) < options.node_timeout * FORGET_AFTER_TIMEOUTS
        });
        let next = build_view(&nodes, now, &options);
        metrics
            .live_nodes
            .set(i64::try_from(next.live).unwrap_or(i64::MAX));
        // No alarm while a starting node may not have heard the others yet.
        let evaluate = now.duration_since(started) >= options.node_timeout;
        let firing = evaluate && next.alarm;
        if firing != alarm {
            alarm = firing;
            metrics.alarm.set(i64::from(alarm));
            report_alarm(&link, &options, &next, alarm).await;
        }
        let next = ClusterView {
            alarm: firing,
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
    let beat = current_heartbeat(&options, &gateway, true);
    publish_heartbeat(&link, &options.topic, &beat, &acks).await;
    acks.close();
    acks.wait().await;
}

/// Whether liveness, membership or the alarm changed (what watchers act on).
fn membership_changed(old: &ClusterView, new: &ClusterView) -> bool {
    old.alarm != new.alarm
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
    }
}

fn current_heartbeat(options: &MembershipOptions, gateway: &Gateway, leaving: bool) -> Heartbeat {
    Heartbeat {
        connections: gateway.connection_count() as u64,
        sent_at_ms: super::now_ms(),
        leaving,
        ..options.identity.clone()
    }
}

async fn publish_heartbeat(link: &KafkaLink, topic: &str, beat: &Heartbeat, acks: &TaskTracker) {
    let record = OutputRecord {
        key: Some(beat.node_id.as_bytes().to_vec()),
        value: serde_json::to_vec(beat).ok(),
        headers: Vec::new(),
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
) {
    let live: Vec<&str> = view
        .nodes
        .values()
        .filter(|n| n.live)
        .map(|n| n.heartbeat.node_id.as_str())
        .collect();
    if firing {
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
    let body = serde_json::json!({
        "alarm": "live_nodes_below_minimum",
        "firing": firing,
        "live": view.live,
        "min_live_nodes": options.min_live_nodes,
        "live_nodes": live,
        "reported_by": options.identity.node_id,
        "time_ms": super::now_ms(),
    });
    let record = OutputRecord {
        key: Some(b"live_nodes_below_minimum".to_vec()),
        value: Some(body.to_string().into_bytes()),
        headers: Vec::new(),
    };
    if let Err(error) = link.producer().send(topic, &record).await {
        tracing::error!(%topic, %error, "writing the alarm to the alarm topic failed");
    }
}
