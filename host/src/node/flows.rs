//! The node's flows at start: the cluster runtime (started once, for the
//! one flow that delivers to the cluster), and for every flow its chains,
//! its delivery target and the runner of its consumer (not started yet).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cluster::{
    ClusterDelivery, ClusterFlow, ClusterListeners, ClusterRuntime, ClusterTarget, DeliveryPolicy,
    FlowUpstream, ProcessRouter,
};
use crate::config::{ClusterConfig, DeliverConfig, FlowConfig, RelayConfig};
use crate::flow::app::{AppClient, AppConnection, AppTarget};
use crate::flow::chain::PluginChain;
use crate::flow::{DeliveryTarget, FlowHandler, FlowMessageHandler};
use crate::kafka::ConsumerOptions;
use crate::link::KafkaLink;
use crate::link::runner::FlowRunner;
use crate::plugin::PluginRegistry;
use crate::telemetry::metrics::RelayMetrics;

/// How long reading the route table at start may take.
pub(super) const ROUTES_CATCH_UP_TIMEOUT: Duration = Duration::from_secs(300);

/// Starts the cluster runtime for the flow that delivers to the cluster
/// (validation made sure there is exactly one): its processes' upstream
/// sends go through that flow's data-return chain to its output topic.
pub(super) async fn start_cluster(
    config: &RelayConfig,
    cluster: &ClusterConfig,
    listeners: ClusterListeners,
    admin_addr: SocketAddr,
    links: &BTreeMap<String, Arc<KafkaLink>>,
    registry: &Arc<PluginRegistry>,
    metrics: &Arc<RelayMetrics>,
) -> anyhow::Result<Arc<ClusterRuntime>> {
    let flow = config
        .flows
        .iter()
        .find(|f| matches!(f.deliver, Some(DeliverConfig::Cluster(_))))
        .context("`[cluster]` needs a flow with `[flows.deliver.cluster]`")?;
    let upstream = Arc::new(FlowUpstream {
        node: config.node.id.clone(),
        data_return: data_return_chain(flow, registry, metrics),
        link: links[&flow.link].clone(),
        output_topic: flow.output_topic.clone(),
        metrics: metrics.flow(&flow.name),
    });
    let runtime = ClusterRuntime::start(
        &config.node.id,
        admin_addr,
        cluster,
        listeners,
        links[&cluster.link].clone(),
        ClusterFlow {
            upstream,
            router: ProcessRouter::new(cluster_router(flow), registry.clone()),
        },
        metrics,
    )
    .await?;
    Ok(Arc::new(runtime))
}

/// The router plugin of the cluster flow, if it has one.
fn cluster_router(flow: &FlowConfig) -> Option<String> {
    match &flow.deliver {
        Some(DeliverConfig::Cluster(target)) => target.router.clone(),
        _ => None,
    }
}

fn data_return_chain(
    flow: &FlowConfig,
    registry: &Arc<PluginRegistry>,
    metrics: &Arc<RelayMetrics>,
) -> PluginChain {
    PluginChain::new(flow.data_return.clone(), registry.clone(), metrics.clone())
}

/// Records of a partition whose outputs may await Kafka's acknowledgement
/// at once, in a flow whose batches complete together
/// ([`FlowHandler::completes_batches_together`]). Such a record holds only
/// its input's key and place (librdkafka holds the outputs, and hands a
/// refused one back): a thousand (the default, for flows whose completions
/// hold their records) left a lane waiting on the broker's
/// acknowledgements of a single produce batch (`bench/RESULTS.md`,
/// "Kafka's acknowledgements together").
const BATCH_COMPLETING_MAX_PENDING_PER_PARTITION: usize = 5_000;

/// The bound on records awaiting their completion, per partition.
fn max_pending_per_partition(handler: &FlowHandler) -> usize {
    if handler.completes_batches_together() {
        BATCH_COMPLETING_MAX_PENDING_PER_PARTITION
    } else {
        ConsumerOptions::default().max_pending_per_partition
    }
}

/// Prepares every flow: its handler and the runner of its consumer, with
/// the id of the link it consumes from. Nothing is consumed yet. The
/// application clients' connection tasks run on `tasks`.
pub(super) fn prepare(
    config: &RelayConfig,
    links: &BTreeMap<String, Arc<KafkaLink>>,
    registry: &Arc<PluginRegistry>,
    cluster: Option<&Arc<ClusterRuntime>>,
    metrics: &Arc<RelayMetrics>,
    consumers_stop: CancellationToken,
    tasks: &TaskTracker,
) -> anyhow::Result<Vec<(String, Arc<FlowRunner>)>> {
    let consumer_options = ConsumerOptions {
        shutdown_grace: config.shutdown_grace,
        ..ConsumerOptions::default()
    };
    let mut runners = Vec::new();
    for flow in &config.flows {
        let handler = FlowHandler {
            name: flow.name.clone(),
            node: config.node.id.clone(),
            service_call: PluginChain::new(
                flow.service_call.clone(),
                registry.clone(),
                metrics.clone(),
            ),
            target: target(flow, registry, cluster, metrics, tasks)
                .with_context(|| format!("flow `{}`", flow.name))?,
            data_return: data_return_chain(flow, registry, metrics),
            link: links[&flow.link].clone(),
            output_topic: flow.output_topic.clone(),
            dead_letter_topic: flow.dead_letter_topic.clone(),
            retry: flow.retry.clone(),
            metrics: metrics.flow(&flow.name),
        };
        let max_pending = max_pending_per_partition(&handler);
        // The cluster flow consumes only while enough nodes are live, when
        // `cluster.pause_below_min_live` asks for it.
        // And rejoins its group when a peer is lost (the broker may never
        // move the dead member's partitions on its own).
        let (gate, lost_peers) = match (&flow.deliver, cluster) {
            (Some(DeliverConfig::Cluster(_)), Some(runtime)) => {
                (runtime.consumption_gate(), Some(runtime.lost_peers()))
            }
            _ => (None, None),
        };
        let runner = FlowRunner::new(
            &flow.name,
            &flow.group_id(),
            &flow.input_topic,
            Arc::new(FlowMessageHandler::new(handler)),
            ConsumerOptions {
                gate,
                lost_peers,
                order: flow.ordering,
                max_in_flight: flow.max_in_flight,
                max_pending_per_partition: max_pending,
                ..consumer_options.clone()
            },
            consumers_stop.clone(),
        );
        runners.push((flow.link.clone(), runner));
    }
    Ok(runners)
}

/// Where the flow's service calls go; `None` for a transform.
fn target(
    flow: &FlowConfig,
    registry: &Arc<PluginRegistry>,
    cluster: Option<&Arc<ClusterRuntime>>,
    metrics: &Arc<RelayMetrics>,
    tasks: &TaskTracker,
) -> anyhow::Result<Option<Arc<dyn DeliveryTarget>>> {
    Ok(match &flow.deliver {
        None => None,
        Some(DeliverConfig::App(app)) => {
            let ca_pem = app
                .ca
                .as_ref()
                .map(|ca| {
                    std::fs::read(ca).with_context(|| {
                        format!(
                            "flow `{}`: reading the application CA {}",
                            flow.name,
                            ca.display()
                        )
                    })
                })
                .transpose()?;
            let connection = AppConnection {
                timeout: app.timeout,
                concurrency: app.concurrency,
                ca_pem: ca_pem.as_deref(),
                http2_only: app.http2_only,
            };
            Some(Arc::new(AppTarget::new(
                AppClient::connect(&flow.name, &app.url, &connection, tasks)?,
                flow.retry.clone(),
                metrics.flow(&flow.name).retried,
            )))
        }
        Some(DeliverConfig::Cluster(target)) => {
            let runtime = cluster.context("a cluster flow needs `[cluster]`")?;
            Some(Arc::new(ClusterTarget::new(
                ProcessRouter::new(target.router.clone(), registry.clone()),
                ClusterDelivery::new(
                    runtime.gateway().clone(),
                    Some(runtime.routes().clone()),
                    runtime.forwarder(),
                    DeliveryPolicy {
                        ttl: target.ttl,
                        initial_backoff: flow.retry.initial_backoff,
                        max_backoff: flow.retry.max_backoff,
                        retried: metrics.flow(&flow.name).retried,
                        lines_recovering: metrics.flow(&flow.name).lines_recovering,
                        order: flow.ordering,
                    },
                ),
            )))
        }
    })
}
