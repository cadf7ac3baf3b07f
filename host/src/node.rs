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
use crate::config::RelayConfig;
use crate::flow::app::AppClient;
use crate::flow::chain::PluginChain;
use crate::flow::{FlowHandler, FlowMessageHandler};
use crate::kafka::admin::{TopicSpec, ensure_topics};
use crate::kafka::{ConsumerOptions, LinkInfo, PartitionedConsumer, RelayProducer};
use crate::plugin::{PluginRegistry, PluginRuntime, WatchOptions, spawn_plugin_watcher};
use crate::telemetry::metrics::RelayMetrics;

/// Partitions of a topic the relay creates (dead-letter, output).
const CREATED_TOPIC_PARTITIONS: i32 = 3;
/// How long creating topics may take at start-up.
const TOPIC_CREATION_TIMEOUT: Duration = Duration::from_secs(30);
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
    });
    let admin_listener = admin::bind(config.admin.listen).await?;
    tracing::info!(addr = %config.admin.listen, "admin API listening");
    let admin_stop = CancellationToken::new();
    let admin_task = tokio::spawn(admin::serve(
        admin_listener,
        admin_state.clone(),
        admin_stop.clone(),
    ));

    let mut producers: BTreeMap<String, RelayProducer> = BTreeMap::new();
    for (id, link) in &config.links {
        let info = LinkInfo {
            bootstrap_servers: link.bootstrap_servers.clone(),
            options: link.options.clone(),
        };
        let owned_topics: Vec<TopicSpec> = config
            .flows
            .iter()
            .filter(|f| &f.link == id)
            .flat_map(|f| [f.output_topic.clone(), f.dead_letter_topic.clone()])
            .map(|t| TopicSpec::new(t, CREATED_TOPIC_PARTITIONS))
            .collect();
        ensure_topics(&info, &owned_topics, TOPIC_CREATION_TIMEOUT)
            .await
            .with_context(|| format!("link `{id}`: preparing the topics the relay writes to"))?;
        producers.insert(
            id.clone(),
            RelayProducer::new(&info).with_context(|| format!("link `{id}`"))?,
        );
    }

    let consumer_options = ConsumerOptions {
        shutdown_grace: config.shutdown_grace,
        ..ConsumerOptions::default()
    };
    let mut consumers = Vec::new();
    for flow in &config.flows {
        let link = &config.links[&flow.link];
        let info = LinkInfo {
            bootstrap_servers: link.bootstrap_servers.clone(),
            options: link.options.clone(),
        };
        let app = match &flow.deliver {
            Some(crate::config::DeliverConfig::App(app)) => Some(
                AppClient::new(&flow.name, &app.url, app.timeout, app.concurrency)
                    .with_context(|| format!("flow `{}`", flow.name))?,
            ),
            None => None,
        };
        let handler = FlowHandler {
            name: flow.name.clone(),
            node: config.node.id.clone(),
            service_call: PluginChain::new(
                flow.service_call.clone(),
                registry.clone(),
                metrics.clone(),
            ),
            app,
            data_return: PluginChain::new(
                flow.data_return.clone(),
                registry.clone(),
                metrics.clone(),
            ),
            producer: producers[&flow.link].clone(),
            output_topic: flow.output_topic.clone(),
            dead_letter_topic: flow.dead_letter_topic.clone(),
            retry: flow.retry.clone(),
            metrics: metrics.flow(&flow.name),
        };
        let consumer = PartitionedConsumer::start(
            &info,
            &flow.group_id(),
            &flow.input_topic,
            Arc::new(FlowMessageHandler::new(handler)),
            consumer_options.clone(),
            shutdown.clone(),
        )
        .with_context(|| format!("flow `{}`: starting its consumer", flow.name))?;
        tracing::info!(flow = %flow.name, topic = %flow.input_topic, group = %flow.group_id(), "flow started");
        consumers.push((flow.name.clone(), consumer));
    }

    admin_state.set_ready(true);
    tracing::info!(node = %config.node.id, flows = consumers.len(), "relay ready");
    shutdown.cancelled().await;

    tracing::info!("shutting down: finishing in-flight messages");
    admin_state.set_ready(false);
    for (flow, consumer) in consumers {
        let report = consumer.join().await;
        tracing::info!(%flow, consumed = report.consumed, abandoned = report.abandoned_at_shutdown, "flow stopped");
    }
    plugin_watch.cancel();
    for (id, producer) in producers {
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
    if !problems.is_empty() {
        bail!("{}", problems.join("\n"));
    }
    Ok(registry)
}
