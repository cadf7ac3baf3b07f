//! A relay node: everything `wasmrelay run` starts, in order, and the
//! shutdown that undoes it.
//!
//! Start: plugins (every plugin a flow names must load), Kafka links and the
//! topics the relay owns, one consumer per flow, the admin API; then ready.
//! Shutdown (first signal): not ready, consumers stop fetching and finish
//! in-flight work within the grace period, commit, producers flush, admin
//! stops last.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::{Context as _, bail};
use tokio_util::sync::CancellationToken;

use crate::admin::{self, AdminState};
use crate::center::{ConfigCenter, Reachability};
use crate::cluster::{
    ClusterDelivery, ClusterRuntime, DeliveryPolicy, FlowUpstream, ProcessRouter,
};
use crate::config::{CenterKind, DeliverConfig, RelayConfig};
use crate::flow::app::AppClient;
use crate::flow::chain::PluginChain;
use crate::flow::handler::Target;
use crate::flow::{FlowHandler, FlowMessageHandler};
use crate::kafka::admin::{TopicSpec, ensure_topics};
use crate::kafka::{ConsumerOptions, LinkInfo};
use crate::link::KafkaLink;
use crate::link::runner::FlowRunner;
use crate::link::switch::{SwitchOptions, follow_center};
use crate::plugin::{PluginRegistry, PluginRuntime, WatchOptions, spawn_plugin_watcher};
use crate::telemetry::metrics::RelayMetrics;

/// Partitions of a topic the relay creates (dead-letter, output).
const CREATED_TOPIC_PARTITIONS: i32 = 3;
/// How long creating topics may take at start-up.
const TOPIC_CREATION_TIMEOUT: Duration = Duration::from_secs(30);
/// How long reading the route table at start may take.
const ROUTES_CATCH_UP_TIMEOUT: Duration = Duration::from_secs(300);
/// How long the producers may take to flush at shutdown.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs a node until `shutdown` is cancelled, then shuts it down in order.
/// Errors at start-up are returned before anything is consumed.
pub async fn run(config: RelayConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    run_with_metrics(config, Arc::new(RelayMetrics::new()), shutdown).await
}

/// [`run`] with metrics the caller keeps (the demo prints them live).
pub async fn run_with_metrics(
    config: RelayConfig,
    metrics: Arc<RelayMetrics>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let registry = start_plugins(&config).await?;

    let plugin_watch = CancellationToken::new();
    if config.plugins.watch {
        spawn_plugin_watcher(
            registry.clone(),
            WatchOptions::default(),
            plugin_watch.clone(),
        )?;
    }

    let admin_state = Arc::new(AdminState {
        node_id: config.node.id.clone(),
        metrics: metrics.clone(),
        plugins: registry.clone(),
        ready: AtomicBool::new(false),
        links: std::sync::Mutex::new(Vec::new()),
        cluster: std::sync::Mutex::new(None),
    });
    let admin_listener = admin::bind(config.admin.listen).await?;
    tracing::info!(addr = %config.admin.listen, "admin API listening");
    let admin_stop = CancellationToken::new();
    let admin_task = tokio::spawn(admin::serve(
        admin_listener,
        admin_state.clone(),
        admin_stop.clone(),
    ));

    let center = start_center(&config, shutdown.clone()).await?;
    let mut links: BTreeMap<String, Arc<KafkaLink>> = BTreeMap::new();
    for (id, link_config) in &config.links {
        let owned_topics = owned_topics(&config, id);
        let (info, source) = match (&center, link_config.from_center) {
            (Some(center), true) => {
                let wait = config
                    .center
                    .as_ref()
                    .map(|c| c.wait_for_key)
                    .unwrap_or_default();
                (
                    link_info_from_center(center, id, link_config, wait).await?,
                    "center",
                )
            }
            _ => (
                LinkInfo {
                    bootstrap_servers: link_config.bootstrap_servers.clone(),
                    options: link_config.options.clone(),
                },
                "config",
            ),
        };
        ensure_topics(&info, &owned_topics, TOPIC_CREATION_TIMEOUT)
            .await
            .with_context(|| format!("link `{id}`: preparing the topics the relay writes to"))?;
        links.insert(
            id.clone(),
            KafkaLink::new(id, info, source).with_context(|| format!("link `{id}`"))?,
        );
    }

    let consumer_options = ConsumerOptions {
        shutdown_grace: config.shutdown_grace,
        ..ConsumerOptions::default()
    };
    let mut runners: Vec<(String, Arc<FlowRunner>)> = Vec::new();
    let mut cluster_runtime: Option<Arc<ClusterRuntime>> = None;
    for flow in &config.flows {
        let link = links[&flow.link].clone();
        let data_return =
            PluginChain::new(flow.data_return.clone(), registry.clone(), metrics.clone());
        let target = match &flow.deliver {
            Some(DeliverConfig::App(app)) => Target::App(
                AppClient::new(&flow.name, &app.url, app.timeout, app.concurrency)
                    .with_context(|| format!("flow `{}`", flow.name))?,
            ),
            Some(DeliverConfig::Cluster(target)) => {
                let cluster_config = config
                    .cluster
                    .as_ref()
                    .context("a cluster flow needs `[cluster]`")?;
                let upstream = Arc::new(FlowUpstream {
                    node: config.node.id.clone(),
                    data_return: data_return.clone(),
                    link: link.clone(),
                    output_topic: flow.output_topic.clone(),
                    metrics: metrics.flow(&flow.name),
                });
                let runtime = Arc::new(
                    ClusterRuntime::start(
                        &config.node.id,
                        config.admin.listen.to_string(),
                        cluster_config,
                        links[&cluster_config.link].clone(),
                        upstream,
                        &metrics,
                    )
                    .await?,
                );
                runtime
                    .wait_caught_up(ROUTES_CATCH_UP_TIMEOUT)
                    .await
                    .context("reading the route table")?;
                admin_state.set_cluster(runtime.clone());
                cluster_runtime = Some(runtime.clone());
                Target::Cluster {
                    router: ProcessRouter::new(target.router.clone(), registry.clone()),
                    delivery: ClusterDelivery::new(
                        runtime.gateway().clone(),
                        Some(runtime.routes().clone()),
                        runtime.forwarder(),
                        DeliveryPolicy {
                            ttl: target.ttl,
                            initial_backoff: flow.retry.initial_backoff,
                            max_backoff: flow.retry.max_backoff,
                            retried: metrics.flow(&flow.name).retried,
                        },
                    ),
                }
            }
            None => Target::Transform,
        };
        let handler = FlowHandler {
            name: flow.name.clone(),
            node: config.node.id.clone(),
            service_call: PluginChain::new(
                flow.service_call.clone(),
                registry.clone(),
                metrics.clone(),
            ),
            target,
            data_return,
            link: link.clone(),
            output_topic: flow.output_topic.clone(),
            dead_letter_topic: flow.dead_letter_topic.clone(),
            retry: flow.retry.clone(),
            metrics: metrics.flow(&flow.name),
        };
        let runner = FlowRunner::new(
            &flow.name,
            &flow.group_id(),
            &flow.input_topic,
            Arc::new(FlowMessageHandler::new(handler)),
            consumer_options.clone(),
            shutdown.clone(),
        );
        runner
            .start_on(&link.current().info)
            .with_context(|| format!("flow `{}`: starting its consumer", flow.name))?;
        tracing::info!(flow = %flow.name, topic = %flow.input_topic, group = %flow.group_id(), link = %flow.link, "flow started");
        runners.push((flow.link.clone(), runner));
    }

    // Links that follow the center switch when their key changes.
    if let (Some(center), Some(center_config)) = (&center, &config.center) {
        for (id, link) in &links {
            if !config.links[id].from_center {
                continue;
            }
            let link_runners: Vec<Arc<FlowRunner>> = runners
                .iter()
                .filter(|(l, _)| l == id)
                .map(|(_, r)| r.clone())
                .collect();
            let options = SwitchOptions {
                probe_timeout: center_config.probe_timeout,
                drain_timeout: center_config.drain_timeout,
                owned_topics: owned_topics(&config, id),
                base_options: config.links[id].options.clone(),
                metrics: metrics.clone(),
            };
            tokio::spawn(follow_center(
                link.clone(),
                link_runners,
                center.subscribe(),
                options,
                shutdown.clone(),
            ));
        }
    }
    admin_state.set_links(links.values().cloned().collect());

    admin_state.set_ready(true);
    tracing::info!(node = %config.node.id, flows = runners.len(), "relay ready");
    shutdown.cancelled().await;

    tracing::info!("shutting down: finishing in-flight messages");
    admin_state.set_ready(false);
    for (_, runner) in &runners {
        if let Some(consumer) = runner.take() {
            let report = consumer.stop_and_join().await;
            tracing::info!(flow = %runner.name, consumed = report.consumed, abandoned = report.abandoned_at_shutdown, "flow stopped");
        }
    }
    // Processes are told the node is going away once nothing more is
    // delivered to them; what they had not acked is consumed again.
    if let Some(runtime) = &cluster_runtime {
        runtime.stop().await;
    }
    plugin_watch.cancel();
    for (id, link) in links {
        let producer = link.producer();
        let flushed = tokio::task::spawn_blocking(move || producer.flush(FLUSH_TIMEOUT)).await;
        if !matches!(flushed, Ok(Ok(()))) {
            tracing::warn!(link = %id, "producer did not flush everything in time");
        }
    }
    admin_stop.cancel();
    let _ = admin_task.await;
    tracing::info!("relay stopped");
    Ok(())
}

/// The topics the relay writes to through link `id` (created when missing).
fn owned_topics(config: &RelayConfig, id: &str) -> Vec<TopicSpec> {
    config
        .flows
        .iter()
        .filter(|f| f.link == id)
        .flat_map(|f| [f.output_topic.clone(), f.dead_letter_topic.clone()])
        .map(|t| TopicSpec::new(t, CREATED_TOPIC_PARTITIONS))
        .collect()
}

/// Starts the config center, if one is configured.
async fn start_center(
    config: &RelayConfig,
    shutdown: CancellationToken,
) -> anyhow::Result<Option<ConfigCenter>> {
    let Some(center) = &config.center else {
        return Ok(None);
    };
    let started = match center.kind {
        CenterKind::Dir => {
            let dir = center.dir.clone().context("center.dir is not set")?;
            crate::center::dir::start(&dir, shutdown).await?
        }
        CenterKind::Etcd => crate::center::etcd::start(
            crate::center::etcd::EtcdCenterOptions {
                endpoints: center.endpoints.clone(),
                prefix: center.prefix.clone(),
                user: center.user.clone().zip(center.password.clone()),
            },
            shutdown,
        ),
    };
    tracing::info!(center = started.description(), "config center");
    Ok(Some(started))
}

/// Waits (up to `wait`) for `kafka.<id>` in the center and parses it; the
/// config file's options are used under the center's.
async fn link_info_from_center(
    center: &ConfigCenter,
    id: &str,
    link: &crate::config::LinkConfig,
    wait: Duration,
) -> anyhow::Result<LinkInfo> {
    let key = format!("{}{id}", crate::center::KAFKA_KEY_PREFIX);
    let mut state = center.subscribe();
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let value = state.borrow_and_update().kafka_link(id).map(str::to_string);
        if let Some(value) = value {
            let mut info = LinkInfo::from_center_value(&value).map_err(|problem| {
                anyhow::anyhow!("link `{id}`: bad value at center key `{key}`: {problem}")
            })?;
            for (k, v) in &link.options {
                info.options.entry(k.clone()).or_insert_with(|| v.clone());
            }
            return Ok(info);
        }
        tracing::info!(link = %id, %key, "waiting for the link's key in the config center");
        if tokio::time::timeout_at(deadline, state.changed())
            .await
            .is_err()
        {
            let reachability = match &state.borrow().reachability {
                Reachability::Reachable => String::new(),
                Reachability::Unreachable { error, .. } => {
                    format!("; the center cannot be reached: {error}")
                }
            };
            anyhow::bail!(
                "link `{id}`: the config center ({}) has no key `{key}` (waited {wait:?}){reachability}",
                center.description()
            );
        }
    }
}

/// Loads every plugin in the plugins directory and checks that each plugin a
/// flow names is loaded and is a processor.
async fn start_plugins(config: &RelayConfig) -> anyhow::Result<Arc<PluginRegistry>> {
    let runtime = PluginRuntime::new(config.plugins.limits())?;
    let registry = Arc::new(PluginRegistry::new(
        runtime,
        config.plugins.dir.clone(),
        config.plugins.config.clone(),
    ));
    let report = registry.scan().await;
    let mut problems = Vec::new();
    for flow in &config.flows {
        for (chain, plugins) in [
            ("service_call", &flow.service_call),
            ("data_return", &flow.data_return),
        ] {
            for name in plugins {
                match registry.get(name) {
                    Some(slot) if slot.world() == crate::plugin::World::Processor => {}
                    Some(slot) => problems.push(format!(
                        "flow `{}` {chain}: plugin `{name}` is a {} plugin, not a processor",
                        flow.name,
                        slot.world()
                    )),
                    None => {
                        let cause = report
                            .failed
                            .iter()
                            .find(|e| e.to_string().contains(&format!("{name}.wasm")))
                            .map(|e| e.to_string())
                            .unwrap_or_else(|| "no such file in the plugins directory".to_string());
                        problems.push(format!(
                            "flow `{}` {chain}: plugin `{name}` is not loaded: {cause}",
                            flow.name
                        ));
                    }
                }
            }
        }
    }
    for flow in &config.flows {
        if let Some(DeliverConfig::Cluster(target)) = &flow.deliver
            && let Some(name) = &target.router
        {
            match registry.get(name) {
                Some(slot) if slot.world() == crate::plugin::World::Router => {}
                Some(slot) => problems.push(format!(
                    "flow `{}` deliver.cluster.router: plugin `{name}` is a {} plugin, not a router",
                    flow.name,
                    slot.world()
                )),
                None => problems.push(format!(
                    "flow `{}` deliver.cluster.router: plugin `{name}` is not loaded",
                    flow.name
                )),
            }
        }
    }
    if !problems.is_empty() {
        bail!("{}", problems.join("\n"));
    }
    Ok(registry)
}
