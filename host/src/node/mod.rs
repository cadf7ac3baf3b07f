//! A relay node, put together in two phases: [`Node::build`], then
//! [`Node::run`].
//!
//! `build` does everything that can fail: it binds every listener (admin,
//! and for a cluster node the client and mesh listeners; port 0 is resolved
//! and reported in [`BoundAddrs`]), loads the plugins, starts the config
//! center, opens the Kafka links and creates the topics the relay owns,
//! starts the cluster runtime once and waits for its route table, and
//! prepares every flow. Nothing is consumed yet. When a step fails, what
//! the earlier steps started is stopped again before the error is returned:
//! no task and no listener outlives a failed build.
//!
//! `run` starts the consumers, turns ready, and on `shutdown` stops
//! everything in a fixed order under one grace deadline: not ready; link
//! followers stop (no new consumer starts); consumers stop fetching, finish
//! in-flight work and commit; the cluster tells its processes it is going
//! away; the center and the plugin watcher stop; producers flush; the admin
//! API stops last. Every task the node starts runs on its [`TaskTracker`]:
//! none is detached.
//!
//! Submodules: [`plugins`] (loading and checking plugins), [`links`] (the
//! center and the Kafka links), [`flows`] (each flow's handler and target).

mod flows;
mod links;
mod memory;
mod plugins;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::Context as _;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::{self, AdminState};
use crate::center::ConfigCenter;
use crate::cluster::{ClusterListeners, ClusterRuntime};
use crate::config::ValidatedConfig;
use crate::link::KafkaLink;
use crate::link::runner::FlowRunner;
use crate::link::switch::{SwitchOptions, follow_center};
use crate::plugin::{PluginRegistry, WatchOptions, spawn_plugin_watcher};
use crate::telemetry::metrics::RelayMetrics;

/// How long the producers may take to flush at shutdown, at most (less
/// when the grace deadline is nearer).
const FLUSH_TIMEOUT: Duration = Duration::from_secs(10);
/// How long tasks that did not stop by the grace deadline get after they
/// are cancelled outright.
const CANCEL_WAIT: Duration = Duration::from_secs(2);

/// Where the node's listeners are bound (port 0 resolved).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct BoundAddrs {
    /// The admin API.
    pub admin: SocketAddr,
    /// Where business processes connect (cluster nodes).
    pub client: Option<SocketAddr>,
    /// Where other nodes connect (cluster nodes).
    pub mesh: Option<SocketAddr>,
}

/// A built node: everything prepared, nothing consumed yet.
#[derive(Debug)]
pub struct Node {
    node_id: String,
    shutdown_grace: Duration,
    addrs: BoundAddrs,
    parts: Parts,
    /// Consumers to start, with their link's id.
    runners: Vec<(String, Arc<FlowRunner>)>,
    /// Links that follow the center: what their followers need.
    followers: Vec<(Arc<KafkaLink>, SwitchOptions)>,
}

/// What a node has started so far, and the order to stop it in. A failed
/// build stops the parts it got to; a running node stops all of them.
#[derive(Debug)]
struct Parts {
    /// Every task of the node.
    tasks: TaskTracker,
    /// Cancels every task outright (after the grace deadline).
    root: CancellationToken,
    /// Stops the admin API (last).
    admin_stop: CancellationToken,
    /// Stops the center, the plugin watcher.
    background_stop: CancellationToken,
    /// Stops the link followers (first).
    followers_stop: CancellationToken,
    /// Stops the consumers (each consumer also has its own child token).
    consumers_stop: CancellationToken,
    admin: Option<Arc<AdminState>>,
    center: Option<ConfigCenter>,
    links: BTreeMap<String, Arc<KafkaLink>>,
    cluster: Option<Arc<ClusterRuntime>>,
    /// Consumers started (their runners).
    started: Vec<Arc<FlowRunner>>,
}

impl Node {
    /// Builds a node from a validated config: binds, loads, connects and
    /// prepares everything, or fails leaving nothing running. `metrics`
    /// are the caller's (the demo prints them live).
    pub async fn build(
        config: ValidatedConfig,
        metrics: Arc<RelayMetrics>,
    ) -> anyhow::Result<Node> {
        let mut parts = Parts::new();
        match Self::build_parts(&config, metrics, &mut parts).await {
            Ok((addrs, runners, followers)) => Ok(Node {
                node_id: config.node.id.clone(),
                shutdown_grace: config.shutdown_grace,
                addrs,
                parts,
                runners,
                followers,
            }),
            Err(error) => {
                tracing::error!(error = %format!("{error:#}"), "start-up failed; stopping what was started");
                parts
                    .stop_in_order(Instant::now() + config.shutdown_grace)
                    .await;
                Err(error)
            }
        }
    }

    async fn build_parts(
        config: &ValidatedConfig,
        metrics: Arc<RelayMetrics>,
        parts: &mut Parts,
    ) -> anyhow::Result<(
        BoundAddrs,
        Vec<(String, Arc<FlowRunner>)>,
        Vec<(Arc<KafkaLink>, SwitchOptions)>,
    )> {
        // Listeners first: an address in use fails before anything starts.
        let admin_tls = crate::tls::load_listener(
            "admin",
            config.admin.tls.as_ref().map(crate::tls::TlsFiles::from),
        )?;
        let admin_listener = admin::bind(config.admin.listen).await?;
        let cluster_listeners = match &config.cluster {
            Some(cluster) => Some(ClusterListeners::bind(cluster).await?),
            None => None,
        };
        let addrs = BoundAddrs {
            admin: admin_listener.local_addr()?,
            client: cluster_listeners
                .as_ref()
                .map(|l| l.client.local_addr())
                .transpose()?,
            mesh: cluster_listeners
                .as_ref()
                .map(|l| l.mesh.local_addr())
                .transpose()?,
        };
        for (listener, addr) in [
            ("admin", Some(addrs.admin)),
            ("client", addrs.client),
            ("mesh", addrs.mesh),
        ] {
            if let Some(addr) = addr {
                tracing::info!(listener, %addr, "listening");
            }
        }

        let registry: Arc<PluginRegistry> = plugins::load(config).await?;
        let admin_state = Arc::new(AdminState {
            node_id: config.node.id.clone(),
            metrics: metrics.clone(),
            plugins: registry.clone(),
            ready: AtomicBool::new(false),
            links: std::sync::Mutex::new(Vec::new()),
            cluster: std::sync::Mutex::new(None),
        });
        parts.tasks.spawn(admin::serve(
            admin_listener,
            admin_state.clone(),
            config.admin.clone(),
            admin_tls,
            parts.admin_stop.clone(),
        ));
        parts.admin = Some(admin_state.clone());
        parts.tasks.spawn(memory::release_free_memory_now_and_then(
            parts.background_stop.clone(),
        ));

        if config.plugins.watch {
            spawn_plugin_watcher(
                registry.clone(),
                WatchOptions::default(),
                &parts.tasks,
                parts.background_stop.clone(),
            )?;
        }
        if let Some(center) = &config.center {
            parts.center = Some(
                links::start_center(center, &parts.tasks, parts.background_stop.clone()).await?,
            );
        }
        parts.links = links::open(config, parts.center.as_ref()).await?;

        if let (Some(cluster_config), Some(listeners)) = (&config.cluster, cluster_listeners) {
            let runtime = flows::start_cluster(
                config,
                cluster_config,
                listeners,
                addrs.admin,
                &parts.links,
                &registry,
                &metrics,
            )
            .await?;
            parts.cluster = Some(runtime.clone());
            // `/cluster` answers while the route table catches up.
            admin_state.set_cluster(runtime.clone());
            runtime
                .wait_caught_up(flows::ROUTES_CATCH_UP_TIMEOUT)
                .await
                .context("reading the route table")?;
        }

        let runners = flows::prepare(
            config,
            &parts.links,
            &registry,
            parts.cluster.as_ref(),
            &metrics,
            parts.consumers_stop.clone(),
            &parts.tasks,
        )?;
        let mut followers = Vec::new();
        if let Some(center_config) = &config.center {
            for (id, link) in &parts.links {
                if !config.links[id].from_center {
                    continue;
                }
                followers.push((
                    link.clone(),
                    SwitchOptions {
                        probe_timeout: center_config.probe_timeout(),
                        drain_timeout: center_config.drain_timeout(),
                        owned_topics: links::owned_topics(config, id),
                        base_options: config.links[id].options.clone(),
                        policy: links::center_policy(center_config),
                        metrics: metrics.clone(),
                        tasks: parts.tasks.clone(),
                    },
                ));
            }
        }
        admin_state.set_links(parts.links.values().cloned().collect());
        Ok((addrs, runners, followers))
    }

    /// Where the listeners are bound.
    pub fn addrs(&self) -> BoundAddrs {
        self.addrs
    }

    /// Starts consuming, turns ready, and runs until `shutdown` is
    /// cancelled; then stops everything in order within the grace period.
    /// A consumer that cannot start stops the node and is returned.
    pub async fn run(mut self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let started = self.start_consumers();
        if let Err(error) = started {
            tracing::error!(error = %format!("{error:#}"), "start-up failed; stopping what was started");
            // The flows' application clients go first (see below).
            self.runners.clear();
            self.parts
                .stop_in_order(Instant::now() + self.shutdown_grace)
                .await;
            return Err(error);
        }
        // Followers exist only for links that follow a configured center.
        let center = self.parts.center.as_ref().map(ConfigCenter::subscribe);
        for (link, options) in std::mem::take(&mut self.followers) {
            let Some(center) = center.clone() else {
                break;
            };
            let link_runners: Vec<Arc<FlowRunner>> = self
                .runners
                .iter()
                .filter(|(id, _)| id == link.id())
                .map(|(_, runner)| runner.clone())
                .collect();
            self.parts.tasks.spawn(follow_center(
                link,
                link_runners,
                center,
                options,
                self.parts.followers_stop.clone(),
            ));
        }
        if let Some(admin) = &self.parts.admin {
            admin.set_ready(true);
        }
        tracing::info!(
            node = %self.node_id,
            flows = self.runners.len(),
            admin = %self.addrs.admin,
            client = ?self.addrs.client,
            mesh = ?self.addrs.mesh,
            "relay ready"
        );
        shutdown.cancelled().await;
        tracing::info!("shutting down: finishing in-flight messages");
        // The node holds its flows only to start them. Let go of them now,
        // so that each flow's application client is dropped once its
        // consumer stops: the tasks of its pooled connections (on the
        // node's tracker) end then, and the node does not wait for them
        // until its grace period runs out.
        self.runners.clear();
        self.parts
            .stop_in_order(Instant::now() + self.shutdown_grace)
            .await;
        tracing::info!("relay stopped");
        Ok(())
    }

    fn start_consumers(&mut self) -> anyhow::Result<()> {
        for (link_id, runner) in &self.runners {
            let link = &self.parts.links[link_id];
            runner
                .start_on(&link.current().info)
                .with_context(|| format!("flow `{}`: starting its consumer", runner.name))?;
            tracing::info!(flow = %runner.name, topic = %runner.topic(), group = %runner.group(), link = %link_id, "flow started");
            self.parts.started.push(runner.clone());
        }
        Ok(())
    }
}

impl Drop for Parts {
    /// A node dropped without running (or a build abandoned mid-way) still
    /// stops its tasks.
    fn drop(&mut self) {
        self.root.cancel();
    }
}

impl Parts {
    fn new() -> Parts {
        let root = CancellationToken::new();
        Parts {
            tasks: TaskTracker::new(),
            admin_stop: root.child_token(),
            background_stop: root.child_token(),
            followers_stop: root.child_token(),
            consumers_stop: root.child_token(),
            root,
            admin: None,
            center: None,
            links: BTreeMap::new(),
            cluster: None,
            started: Vec::new(),
        }
    }

    /// Stops whatever was started, in order, by `deadline`; what has not
    /// stopped by then is cancelled outright.
    async fn stop_in_order(&mut self, deadline: Instant) {
        if let Some(admin) = &self.admin {
            admin.set_ready(false);
        }
        self.followers_stop.cancel();
        for runner in self.started.drain(..) {
            if let Some(consumer) = runner.take() {
                match tokio::time::timeout_at(deadline, consumer.stop_and_join()).await {
                    Ok(report) => {
                        tracing::info!(flow = %runner.name, consumed = report.consumed, abandoned = report.abandoned_at_shutdown, lane_pauses = report.lane_pauses, "flow stopped")
                    }
                    Err(_) => {
                        tracing::warn!(flow = %runner.name, "the flow did not stop within the grace period")
                    }
                }
            }
        }
        self.consumers_stop.cancel();
        // Processes are told the node is going away once nothing more is
        // delivered to them; what they had not acked is consumed again.
        if let Some(cluster) = self.cluster.take()
            && tokio::time::timeout_at(deadline, cluster.stop())
                .await
                .is_err()
        {
            tracing::warn!("the cluster parts did not stop within the grace period");
        }
        self.background_stop.cancel();
        self.center = None;
        let flush = FLUSH_TIMEOUT.min(deadline.saturating_duration_since(Instant::now()));
        for (id, link) in std::mem::take(&mut self.links) {
            let producer = link.producer();
            let flushed = tokio::task::spawn_blocking(move || producer.flush(flush)).await;
            if !matches!(flushed, Ok(Ok(()))) {
                tracing::warn!(link = %id, "producer did not flush everything in time");
            }
        }
        self.admin_stop.cancel();
        self.tasks.close();
        if tokio::time::timeout_at(deadline, self.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                tasks = self.tasks.len(),
                "tasks still running at the end of the grace period; cancelling them"
            );
            self.root.cancel();
            if tokio::time::timeout(CANCEL_WAIT, self.tasks.wait())
                .await
                .is_err()
            {
                tracing::error!(
                    tasks = self.tasks.len(),
                    "tasks did not stop after cancellation"
                );
            }
        }
        self.admin = None;
    }
}

#[cfg(test)]
mod tests;
