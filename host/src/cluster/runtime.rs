//! Starting and stopping a node's part of the cluster: the topics it needs,
//! the gateway for processes, membership, the route table and the mesh, and
//! what `/cluster` and `/processes` show of them.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::delivery::{ForwardError, Forwarder};
use super::membership::{
    ClusterView, Heartbeat, MembershipOptions, check_no_live_twin, run_membership,
};
use super::mesh::{Forwarded, LookupFound, Mesh, MeshError, MeshOptions};
use super::rebalance::{RebalanceOptions, Rebalancer};
use super::routes::{MissedRecords, RouteTable, follow_routes, publish_routes, refresh_routes};
use crate::config::ClusterConfig;
use crate::gateway::{Gateway, GatewayOptions, Upstream};
use crate::kafka::admin::{TopicSpec, ensure_topics};
use crate::kafka::group_rejoin::PeerLost;
use crate::kafka::tail::{TailEvent, TailSink, TailStart, TopicTail};
use crate::link::KafkaLink;
use crate::telemetry::metrics::RelayMetrics;
use wasmrelay_protocol::mesh_auth::{Purpose, purpose_key};

/// Misses of the routes reader waiting to be sent to the peers at most.
const MISSED_WAITING: usize = 256;

/// Partitions of the routes topic when the relay creates it.
const ROUTES_PARTITIONS: i32 = 6;
/// How long creating the cluster topics may take.
const TOPIC_TIMEOUT: Duration = Duration::from_secs(30);
/// Records buffered between a topic reader thread and its task.
const TAIL_BUFFER: usize = 4096;

/// The listeners of a cluster node, bound before anything starts (port 0
/// is resolved when they are bound).
#[derive(Debug)]
pub struct ClusterListeners {
    /// Where business processes connect.
    pub client: tokio::net::TcpListener,
    /// Where other nodes connect.
    pub mesh: tokio::net::TcpListener,
}

impl ClusterListeners {
    /// Binds both listeners of `config`, with errors naming the address.
    pub async fn bind(config: &ClusterConfig) -> anyhow::Result<ClusterListeners> {
        let client = crate::gateway::bind(config.client_listen).await?;
        let mesh = tokio::net::TcpListener::bind(config.mesh_listen)
            .await
            .map_err(|e| {
                anyhow::anyhow!("binding the mesh listener on {}: {e}", config.mesh_listen)
            })?;
        Ok(ClusterListeners { client, mesh })
    }
}

/// What the node's cluster flow gives the runtime.
pub struct ClusterFlow {
    /// Where processes' upstream sends go (the flow's data-return chain
    /// and output topic).
    pub upstream: Arc<dyn Upstream>,
    /// The flow's router, whose plugin (if any) has a say in placement.
    pub router: super::router::ProcessRouter,
}

impl std::fmt::Debug for ClusterFlow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterFlow")
            .field("router", &self.router)
            .finish_non_exhaustive()
    }
}

/// The addresses a node tells others (heartbeats, redirects, `/cluster`).
#[derive(Clone, Debug, serde::Serialize)]
pub struct Advertised {
    /// Where processes connect to this node.
    pub client_addr: String,
    /// Where other nodes connect to this node.
    pub mesh_addr: String,
    /// This node's admin API.
    pub admin_addr: String,
}

/// A node's running cluster parts.
#[derive(Debug)]
pub struct ClusterRuntime {
    node_id: String,
    /// This run of the node (in its heartbeats).
    instance_id: String,
    advertised: Advertised,
    gateway: Arc<Gateway>,
    routes: Arc<RouteTable>,
    mesh: Arc<Mesh>,
    rebalancer: Arc<Rebalancer>,
    view: watch::Receiver<ClusterView>,
    /// With `pause_below_min_live`: `true` while enough nodes are live for
    /// the cluster flow to consume.
    consumption_gate: Option<watch::Receiver<bool>>,
    /// The latest peer lost (see [`ClusterRuntime::lost_peers`]).
    lost_peers: watch::Receiver<Option<PeerLost>>,
    stop: CancellationToken,
    /// When the node has heard every live node's heartbeat at least once.
    heard_everyone_at: tokio::time::Instant,
    tasks: TaskTracker,
    /// The readers of the heartbeat and routes topics, on the link's
    /// current cluster.
    tails: Arc<std::sync::Mutex<Vec<TopicTail>>>,
}

/// The topics a cluster node reads and writes besides the flows' own:
/// heartbeats, the (compacted) routes, and alarms if configured. Created
/// at start and on every cluster the link switches to.
pub fn cluster_topics(config: &ClusterConfig) -> Vec<TopicSpec> {
    let mut topics = vec![
        TopicSpec::new(&config.heartbeat_topic, 1),
        TopicSpec {
            configs: vec![("cleanup.policy".to_string(), "compact".to_string())],
            ..TopicSpec::new(&config.routes_topic, ROUTES_PARTITIONS)
        },
    ];
    if let Some(alarm) = &config.alarm_topic {
        topics.push(TopicSpec::new(alarm, 1));
    }
    topics
}

/// What it takes to read the cluster's topics on a cluster: started at
/// start, and again on the new cluster when the link switches.
struct ClusterReaders {
    node_id: String,
    heartbeat_topic: String,
    routes_topic: String,
    heartbeats: mpsc::Sender<TailEvent>,
    routes: Arc<RouteTable>,
    routes_read: Arc<std::sync::atomic::AtomicU64>,
    routes_events: mpsc::Sender<TailEvent>,
}

impl ClusterReaders {
    /// Reads heartbeats written from now on at `info`.
    fn heartbeats_on(&self, info: &crate::kafka::LinkInfo) -> anyhow::Result<TopicTail> {
        TopicTail::start(
            info,
            &self.heartbeat_topic,
            TailStart::End,
            &format!("{}-heartbeats", self.node_id),
            TailSink::Send,
            self.heartbeats.clone(),
        )
        .context("reading the heartbeat topic")
    }

    /// Reads the routes at `info` from the beginning into the table.
    fn routes_on(&self, info: &crate::kafka::LinkInfo) -> anyhow::Result<TopicTail> {
        TopicTail::start(
            info,
            &self.routes_topic,
            TailStart::Beginning,
            &format!("{}-routes", self.node_id),
            super::routes::apply_to_table(self.routes.clone(), self.routes_read.clone()),
            self.routes_events.clone(),
        )
        .context("reading the routes topic")
    }
}

/// Reads the heartbeat and routes topics from the cluster the link writes
/// to: when it switches, the readers start on the new cluster and the old
/// ones stop, and this node's routes are written again there (the other
/// nodes write theirs as they switch). Until `stop`.
async fn follow_link_switches(
    link: Arc<KafkaLink>,
    readers: Arc<ClusterReaders>,
    tails: Arc<std::sync::Mutex<Vec<TopicTail>>>,
    stop: CancellationToken,
) {
    let mut switches = link.switches();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            changed = switches.changed() => if changed.is_err() { return },
        }
        switches.borrow_and_update();
        let info = link.current().info.clone();
        let started = {
            let readers = readers.clone();
            let info = info.clone();
            tokio::task::spawn_blocking(move || {
                let heartbeats = readers.heartbeats_on(&info)?;
                match readers.routes_on(&info) {
                    Ok(routes) => Ok((heartbeats, routes)),
                    Err(error) => {
                        heartbeats.stop();
                        Err(error)
                    }
                }
            })
            .await
        };
        let (heartbeats, routes) = match started {
            Ok(Ok(started)) => started,
            Ok(Err(error)) => {
                // The writes go to the new cluster either way; the old
                // readers are kept (and their reason logged) until the
                // next switch.
                tracing::error!(to = %info.bootstrap_servers, error = %format!("{error:#}"), "the cluster's topics cannot be read on the new cluster; still reading the old one");
                continue;
            }
            Err(_) => return,
        };
        let old = tails
            .lock()
            .map(|mut tails| std::mem::replace(&mut *tails, vec![heartbeats, routes]))
            .unwrap_or_default();
        tokio::task::spawn_blocking(move || old.into_iter().for_each(TopicTail::stop))
            .await
            .ok();
        let processes = readers.routes.write_local_routes_again();
        tracing::info!(to = %info.bootstrap_servers, processes, "the cluster's topics are read on the new cluster; writing this node's routes there");
    }
}

impl ClusterRuntime {
    /// Starts everything; returns once the client listener is bound and the
    /// readers run (the route table may still be catching up: see
    /// [`ClusterRuntime::wait_caught_up`]).
    pub async fn start(
        node_id: &str,
        admin_addr: std::net::SocketAddr,
        config: &ClusterConfig,
        listeners: ClusterListeners,
        link: Arc<KafkaLink>,
        flow: ClusterFlow,
        metrics: &RelayMetrics,
    ) -> anyhow::Result<ClusterRuntime> {
        let ClusterFlow { upstream, router } = flow;
        // Key files are read first: a bad key fails the start before
        // anything is created.
        let client_auth = crate::gateway::ClientAuth::from_config(config, metrics.client_auth())?;
        let client_tls = crate::tls::load_listener(
            "client",
            config.tls.as_ref().map(crate::tls::TlsFiles::from),
        )?;
        let mesh_tls = config
            .mesh_tls
            .as_ref()
            .map(super::mesh::MeshTls::load)
            .transpose()?;
        let info = link.current().info.clone();
        ensure_topics(&info, &cluster_topics(config), TOPIC_TIMEOUT)
            .await
            .context("preparing the cluster topics")?;

        let stop = CancellationToken::new();
        let tasks = TaskTracker::new();
        let registrations = Arc::new(crate::gateway::RegistrationChanges::default());
        let gateway = Gateway::new(
            GatewayOptions {
                tls: client_tls,
                ..gateway_options(node_id, config)
            },
            client_auth,
            upstream,
            Some(registrations.clone()),
        );
        let ClusterListeners {
            client: client_listener,
            mesh: mesh_listener,
        } = listeners;
        let client_addr = client_listener.local_addr()?;
        let mesh_addr = mesh_listener.local_addr()?;
        // Without an advertised address, the bound one (port 0 resolved).
        let advertised = Advertised {
            client_addr: config
                .client_advertise
                .clone()
                .unwrap_or_else(|| client_addr.to_string()),
            mesh_addr: config
                .mesh_advertise
                .clone()
                .unwrap_or_else(|| mesh_addr.to_string()),
            admin_addr: config
                .admin_advertise
                .clone()
                .unwrap_or_else(|| admin_addr.to_string()),
        };

        metrics.register_placement(gateway.stats());
        let cluster_metrics = metrics.cluster();
        let secret = config.secret.expose().as_bytes();
        let routes = RouteTable::new(
            node_id,
            purpose_key(secret, Purpose::RouteRecord),
            config.node_timeout,
            gateway.clone(),
            cluster_metrics.clone(),
        );
        let (view_tx, view) = watch::channel(ClusterView::default());
        gateway.set_placement(Arc::new(
            super::placement::ClusterPlacement::new(
                node_id,
                &advertised.client_addr,
                config.connection_quota,
                view.clone(),
                Some(router),
            )
            .with_evacuating(gateway.evacuating_flag()),
        ));

        let (heartbeats_tx, mut heartbeats_rx) = mpsc::channel::<TailEvent>(TAIL_BUFFER);
        // The reader thread applies the route records itself; the channel
        // only says when it caught up.
        let (routes_tx, routes_rx) = mpsc::channel::<TailEvent>(1);
        let readers = Arc::new(ClusterReaders {
            node_id: node_id.to_string(),
            heartbeat_topic: config.heartbeat_topic.clone(),
            routes_topic: config.routes_topic.clone(),
            heartbeats: heartbeats_tx,
            routes: routes.clone(),
            routes_read: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            routes_events: routes_tx,
        });
        let routes_read = readers.routes_read.clone();
        let heartbeat_tail = readers.heartbeats_on(&info)?;
        // The catch-up is timed from here: the reader fetches while the
        // node checks for a twin, before the table's task starts.
        let routes_started = std::time::Instant::now();
        let routes_tail = match readers.routes_on(&info) {
            Ok(tail) => tail,
            Err(error) => {
                tokio::task::spawn_blocking(move || heartbeat_tail.stop())
                    .await
                    .ok();
                return Err(error);
            }
        };
        // The table reads while the node checks for a twin (that check
        // waits two heartbeat intervals, which the catch-up had waited too,
        // with the reader stopped on a full channel). Nothing it does needs
        // membership yet: with no view it evicts nothing. A refused start
        // stops it with the rest.
        let (missed_tx, missed_rx) = mpsc::channel::<MissedRecords>(MISSED_WAITING);
        tasks.spawn(follow_routes(
            routes.clone(),
            routes_rx,
            missed_tx,
            routes_read,
            view.clone(),
            routes_started,
            stop.clone(),
        ));

        let mut membership = MembershipOptions {
            identity: Heartbeat {
                node_id: node_id.to_string(),
                instance_id: hex::encode(rand::random::<[u8; 8]>()),
                client_addr: advertised.client_addr.clone(),
                mesh_addr: advertised.mesh_addr.clone(),
                admin_addr: advertised.admin_addr.clone(),
                connections: 0,
                quota: config.connection_quota,
                started_at_ms: super::now_ms(),
                sent_at_ms: 0,
                leaving: false,
                evacuating: false,
            },
            topic: config.heartbeat_topic.clone(),
            alarm_topic: config.alarm_topic.clone(),
            interval: config.heartbeat_interval,
            node_timeout: config.node_timeout,
            min_live_nodes: config.min_live_nodes,
            key: purpose_key(secret, Purpose::HeartbeatRecord),
        };
        // One node id, one live instance: a twin would hide this node's
        // routes and take its forwards. A live one beats within an interval.
        let twin_check = check_no_live_twin(
            &mut heartbeats_rx,
            &membership,
            config.heartbeat_interval * 2,
            &cluster_metrics,
        )
        .await;
        if let Err(refused) = twin_check {
            stop.cancel();
            tokio::task::spawn_blocking(move || {
                heartbeat_tail.stop();
                routes_tail.stop();
            })
            .await
            .ok();
            return Err(anyhow::Error::new(refused).context("checking that the node id is free"));
        }
        let instance_id = membership.identity.instance_id.clone();
        // Its first heartbeat goes out now, not when the check began.
        membership.identity.started_at_ms = super::now_ms();

        // Nothing below fails: the tasks start.
        tasks.spawn(gateway.clone().serve(client_listener, stop.clone()));

        let rebalancer = Rebalancer::new(
            node_id,
            config.connection_quota,
            RebalanceOptions {
                automatic: config.rebalance,
                threshold_percent: config.rebalance_threshold_percent,
                min_excess: config.rebalance_min_excess,
                rate: config.rebalance_rate,
                interval: config.rebalance_interval,
            },
            gateway.clone(),
            view.clone(),
            cluster_metrics.clone(),
        );
        tasks.spawn(rebalancer.clone().run(stop.clone()));
        tasks.spawn(run_membership(
            membership,
            link.clone(),
            gateway.clone(),
            heartbeats_rx,
            view_tx,
            cluster_metrics,
            stop.clone(),
        ));
        tasks.spawn(publish_routes(
            routes.clone(),
            link.clone(),
            config.routes_topic.clone(),
            registrations,
            stop.clone(),
        ));
        tasks.spawn(refresh_routes(
            routes.clone(),
            config.route_refresh_interval,
            stop.clone(),
        ));
        let mesh = Mesh::new(
            MeshOptions {
                node_id: node_id.to_string(),
                secret: config.secret.expose().as_bytes().to_vec(),
                max_frame_bytes: config.max_frame_bytes,
                // A link silent for three keepalives is broken: as long as
                // a node may stay silent before it counts as dead.
                keepalive: (config.node_timeout / 3).max(config.heartbeat_interval),
                lookup_timeout: if std::env::var_os(super::mesh::NO_LOOKUPS_ENV).is_some() {
                    Duration::ZERO
                } else {
                    super::mesh::DEFAULT_LOOKUP_TIMEOUT
                },
                tls: mesh_tls,
                ..MeshOptions::default()
            },
            gateway.clone(),
        );
        // Peers asking for a process connected here get its generation,
        // and its route is written again for the nodes that missed it.
        mesh.answer_lookups_with(routes.clone());
        tasks.spawn(ask_peers_to_rewrite(mesh.clone(), missed_rx, stop.clone()));
        tasks.spawn(mesh.clone().serve(mesh_listener, stop.clone()));
        tasks.spawn(follow_peers(
            mesh.clone(),
            node_id.to_string(),
            view.clone(),
            stop.clone(),
        ));
        let consumption_gate = config.pause_below_min_live.then(|| {
            let (gate_tx, gate) = watch::channel(false);
            tasks.spawn(follow_live_count(view.clone(), gate_tx, stop.clone()));
            gate
        });
        let tails = Arc::new(std::sync::Mutex::new(vec![heartbeat_tail, routes_tail]));
        tasks.spawn(follow_link_switches(
            link.clone(),
            readers,
            tails.clone(),
            stop.clone(),
        ));
        let (lost_tx, lost_peers) = watch::channel(None);
        tasks.spawn(follow_lost_peers(
            view.clone(),
            node_id.to_string(),
            lost_tx,
            stop.clone(),
        ));
        // Heartbeats are read from the end: every live node's next one
        // arrives within an interval (plus Kafka's latency).
        let heard_everyone_at = tokio::time::Instant::now() + config.heartbeat_interval * 3 / 2;
        Ok(ClusterRuntime {
            heard_everyone_at,
            instance_id,
            node_id: node_id.to_string(),
            advertised,
            gateway,
            routes,
            mesh,
            rebalancer,
            view,
            consumption_gate,
            lost_peers,
            stop,
            tasks,
            tails,
        })
    }

    /// Waits (at most `timeout`) until the route table has read the routes
    /// topic to its end and every live node's heartbeat has been heard once,
    /// so that the first messages find their processes on other nodes.
    pub async fn wait_caught_up(&self, timeout: Duration) -> anyhow::Result<()> {
        let mut caught_up = self.routes.caught_up();
        tokio::time::timeout(timeout, caught_up.wait_for(Option::is_some))
            .await
            .map_err(|_| anyhow::anyhow!("the route table did not catch up within {timeout:?}"))?
            .map_err(|_| anyhow::anyhow!("the route table reader stopped"))?;
        tokio::time::sleep_until(self.heard_everyone_at).await;
        // And linked to them, within a dial's time (a peer that does not
        // answer is retried in the background; deliveries to it retry too).
        let peers = self.view.borrow().live_peers(&self.node_id);
        let peers: Vec<&str> = peers.keys().map(String::as_str).collect();
        let dial = self.mesh.options().connect_timeout;
        if tokio::time::timeout(dial, self.mesh.wait_linked(&peers))
            .await
            .is_err()
        {
            tracing::warn!(?peers, linked = ?self.mesh.linked(), "not linked to every live node yet; starting anyway");
        }
        Ok(())
    }

    /// The addresses this node tells others.
    pub fn advertised(&self) -> &Advertised {
        &self.advertised
    }

    /// The gateway of this node.
    pub fn gateway(&self) -> &Arc<Gateway> {
        &self.gateway
    }

    /// What forwards deliveries to other nodes: the mesh.
    pub fn forwarder(&self) -> Option<Arc<dyn Forwarder>> {
        Some(self.mesh.clone())
    }

    /// The mesh.
    pub fn mesh(&self) -> &Arc<Mesh> {
        &self.mesh
    }

    /// Rebalancing and evacuation (`POST /rebalance`, `POST /evacuate`).
    pub fn rebalancer(&self) -> &Arc<Rebalancer> {
        &self.rebalancer
    }

    /// The route table.
    pub fn routes(&self) -> &Arc<RouteTable> {
        &self.routes
    }

    /// The cluster as this node sees it.
    pub fn view(&self) -> watch::Receiver<ClusterView> {
        self.view.clone()
    }

    /// With `cluster.pause_below_min_live`: whether the cluster flow may
    /// consume now (enough nodes live), for its consumer's gate.
    pub fn consumption_gate(&self) -> Option<watch::Receiver<bool>> {
        self.consumption_gate.clone()
    }

    /// What `/cluster` shows.
    /// The peer lost last (its heartbeats stopped without a leave), the
    /// one heard last of those when several were: what the cluster flow's
    /// consumer rejoins its group for.
    pub fn lost_peers(&self) -> watch::Receiver<Option<PeerLost>> {
        self.lost_peers.clone()
    }

    pub fn cluster_json(&self) -> serde_json::Value {
        let view = self.view.borrow().clone();
        let linked = self.mesh.linked();
        let nodes: Vec<serde_json::Value> = view
            .nodes
            .values()
            .map(|n| {
                let mut node = serde_json::to_value(n).unwrap_or_default();
                node["in_mesh"] = json!(
                    n.heartbeat.node_id == self.node_id || linked.contains(&n.heartbeat.node_id)
                );
                node
            })
            .collect();
        json!({
            "node": self.node_id,
            "instance_id": self.instance_id,
            "twin_instance": view.twin_instance,
            "client_addr": self.advertised.client_addr,
            "mesh_addr": self.advertised.mesh_addr,
            "admin_addr": self.advertised.admin_addr,
            "live": view.live,
            "min_live_nodes": view.min_live_nodes,
            "alarm": view.alarm,
            "consumption_paused": self.consumption_gate.as_ref().is_some_and(|gate| !*gate.borrow()),
            "connections": self.gateway.connection_count(),
            "connection_quota": self.gateway.options().quota,
            "evacuating": self.gateway.evacuating(),
            "rebalance": self.rebalancer.json(),
            "routes": self.routes.len(),
            "route_table_caught_up": self.routes.caught_up().borrow().is_some(),
            "mesh": linked,
            "nodes": nodes,
            "stats": self.stats_json(),
        })
    }

    /// Counters of the gateway and the mesh since start.
    fn stats_json(&self) -> serde_json::Value {
        let gateway = self.gateway.stats();
        let mesh = self.mesh.stats();
        json!({
            "clients_accepted": gateway.accepted(),
            "client_protocol_errors": gateway.protocol_errors(),
            "clients_replaced": gateway.replaced(),
            "client_tls_failures": gateway.tls_failures(),
            "clients_redirected": gateway.redirected(),
            "clients_refused_full": gateway.refused_full(),
            "forwards_sent": mesh.forwards_sent(),
            "forwards_delivered": mesh.forwards_delivered(),
            "forwards_not_here": mesh.forwards_not_here(),
            "forwards_failed": mesh.forwards_failed(),
            "forwards_lost": mesh.forwards_lost(),
            "forwards_received": mesh.forwards_received(),
            "mesh_links_established": mesh.links_established(),
            "mesh_links_broken": mesh.links_broken(),
            "mesh_unauthorized": mesh.unauthorized(),
            "lookups_sent": mesh.lookups_sent(),
            "lookups_found": mesh.lookups_found(),
            "lookups_not_found": mesh.lookups_not_found(),
            "lookups_received": mesh.lookups_received(),
            "routes_republished": self.routes.republished(),
            "route_records_missed": self.routes.offsets_missed(),
            "route_rewrites_asked": mesh.rewrites_asked(),
            "route_rewrites_asked_by_peers": mesh.rewrites_asked_by_peers(),
            "routes_rewritten_for_missed": self.routes.rewritten_for_missed(),
            "rebalance_moves": self.rebalancer.json()["rebalance_moves"],
            "evacuation_moves": self.rebalancer.json()["evacuation_moves"],
        })
    }

    /// What `/processes?id=` shows; `None` when no node holds the process.
    pub fn process_json(&self, process_id: &str) -> Option<serde_json::Value> {
        let local = self.gateway.session(process_id);
        let node = match &local {
            Some(_) => Some(self.node_id.clone()),
            None => self.routes.lookup(process_id).map(|node| node.to_string()),
        }?;
        let view = self.view.borrow();
        let holder = view.nodes.get(&node);
        Some(json!({
            "process_id": process_id,
            "node": node,
            "connected_here": local.is_some(),
            "node_live": holder.is_some_and(|n| n.live),
            "client_addr": holder.map(|n| n.heartbeat.client_addr.clone()),
            "admin_addr": holder.map(|n| n.heartbeat.admin_addr.clone()),
        }))
    }

    /// Stops everything: processes are told the node is going away, the
    /// last heartbeat says it is leaving.
    pub async fn stop(&self) {
        self.stop.cancel();
        self.mesh.close();
        self.tasks.close();
        self.tasks.wait().await;
        let tails = std::mem::take(&mut *self.tails.lock().unwrap_or_else(|e| e.into_inner()));
        for tail in tails {
            tokio::task::spawn_blocking(move || tail.stop()).await.ok();
        }
    }
}

/// Sends each miss of the routes reader to the linked peers, until `stop`:
/// they write again what they wrote at those offsets.
async fn ask_peers_to_rewrite(
    mesh: Arc<Mesh>,
    mut missed: mpsc::Receiver<MissedRecords>,
    stop: CancellationToken,
) {
    loop {
        let next = tokio::select! {
            _ = stop.cancelled() => return,
            next = missed.recv() => next,
        };
        let Some(MissedRecords {
            partition,
            from,
            to,
        }) = next
        else {
            return;
        };
        let asked = mesh.ask_to_rewrite(partition, from, to);
        tracing::debug!(
            partition,
            from,
            to,
            peers = asked,
            "asked the peers to write missed route records again"
        );
    }
}

/// Keeps the mesh's peers equal to the live nodes until `stop`.
async fn follow_peers(
    mesh: Arc<Mesh>,
    node_id: String,
    mut view: watch::Receiver<ClusterView>,
    stop: CancellationToken,
) {
    loop {
        let peers = view.borrow_and_update().live_peers(&node_id);
        mesh.set_peers(peers);
        tokio::select! {
            _ = stop.cancelled() => return,
            changed = view.changed() => if changed.is_err() { return },
        }
    }
}

impl Forwarder for Mesh {
    fn try_forward(
        &self,
        node: &str,
        parcel: &Arc<wasmrelay_protocol::Parcel>,
    ) -> Option<Result<Forwarded, ForwardError>> {
        match self.try_forward_parcel(node, parcel) {
            Err(MeshError::WindowFull { .. }) => None,
            forwarded => Some(forwarded.map_err(forward_error)),
        }
    }

    fn forward<'a>(
        &'a self,
        node: &'a str,
        parcel: Arc<wasmrelay_protocol::Parcel>,
    ) -> futures::future::BoxFuture<'a, Result<Forwarded, ForwardError>> {
        Box::pin(async move {
            Mesh::forward(self, node, parcel)
                .await
                .map_err(forward_error)
        })
    }

    fn lookup(&self, process_id: &str) -> futures::future::BoxFuture<'static, Option<LookupFound>> {
        Mesh::lookup(self, process_id)
    }
}

/// Why a forward was not queued, as the delivery sees it.
fn forward_error(error: MeshError) -> ForwardError {
    match error {
        MeshError::TooLarge { .. } => ForwardError::TooLarge(error.to_string()),
        _ => ForwardError::NotQueued(error.to_string()),
    }
}

/// Tells `lost` of each peer whose heartbeats stop in `view` (the one heard
/// last when several stop at once), until `stop`.
async fn follow_lost_peers(
    mut view: watch::Receiver<ClusterView>,
    node_id: String,
    lost: watch::Sender<Option<PeerLost>>,
    stop: CancellationToken,
) {
    let mut before = view.borrow_and_update().clone();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            changed = view.changed() => if changed.is_err() { return },
        }
        let now = view.borrow_and_update().clone();
        let latest = now
            .lost_since(&before, &node_id, std::time::Instant::now())
            .into_iter()
            .max_by_key(|peer| peer.last_heard);
        if let Some(peer) = latest {
            tracing::warn!(node = %peer.node_id, "a peer's heartbeats stopped: its partitions of the cluster flow move once its consumer-group session ends");
            lost.send_replace(Some(peer));
        }
        before = now;
    }
}

/// Holds `gate` at whether at least `min_live_nodes` nodes are live in
/// `view`, until `stop`.
async fn follow_live_count(
    mut view: watch::Receiver<ClusterView>,
    gate: watch::Sender<bool>,
    stop: CancellationToken,
) {
    loop {
        let open = {
            let view = view.borrow_and_update();
            view.live >= view.min_live_nodes
        };
        gate.send_if_modified(|current| std::mem::replace(current, open) != open);
        tokio::select! {
            _ = stop.cancelled() => return,
            changed = view.changed() => if changed.is_err() { return },
        }
    }
}

/// How this node's gateway treats process connections.
fn gateway_options(node_id: &str, cluster: &ClusterConfig) -> GatewayOptions {
    GatewayOptions {
        node_id: node_id.to_string(),
        keepalive: cluster.keepalive,
        hello_timeout: cluster.hello_timeout,
        send_queue: cluster.send_queue,
        max_unacked: cluster.max_unacked,
        slow_consumer_timeout: cluster.slow_consumer_timeout,
        max_frame_bytes: cluster.max_frame_bytes,
        tls: None,
        quota: usize::try_from(cluster.connection_quota).unwrap_or(usize::MAX),
        max_connections: cluster
            .max_connections
            .unwrap_or_else(crate::net::default_connection_cap),
    }
}
