//! Delivering a message to its business process wherever it is connected,
//! with retries until a time to live, then a verdict for the dead-letter
//! topic.
//!
//! The first attempt is handed over in the caller's order (so deliveries to
//! one process keep their partition order when nothing fails), waiting while
//! a local process has as many deliveries unanswered as it may: that is the
//! back-pressure on the partition. Waiting for the acknowledgement, and any
//! retry, happen in the returned future.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt as _;
use futures::future::BoxFuture;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use wasmrelay_protocol::v1;

use super::routes::RouteTable;
use crate::gateway::{DeliveryResult, Gateway};
use crate::kafka::{InputRecord, OutputRecord};

/// How a delivery ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeliveryEnd {
    /// The process acknowledged it.
    Delivered,
    /// Every attempt failed until the time to live ran out; the last reason.
    GaveUp(String),
    /// The work was aborted (shutdown, partition revoked): it will be
    /// consumed again.
    Aborted,
}

/// Retry pacing of cluster deliveries.
#[derive(Clone, Debug)]
pub struct DeliveryPolicy {
    /// How long a message is retried before it is dead-lettered.
    pub ttl: Duration,
    /// First wait after a failed attempt.
    pub initial_backoff: Duration,
    /// Longest wait between attempts.
    pub max_backoff: Duration,
    /// Counts each retry (the flow's `wasmrelay_retries_total`).
    pub retried: prometheus_client::metrics::counter::Counter,
}

/// Hands a message to a process on another node (the mesh).
pub trait Forwarder: Send + Sync + std::fmt::Debug + 'static {
    /// Queues the message on the link to `node` (in call order) and returns
    /// the future of the process's answer there; `Err` when there is no
    /// usable link to `node` now.
    fn forward(
        &self,
        node: &str,
        process_id: &str,
        delivery_id: String,
        message: v1::Message,
    ) -> Result<BoxFuture<'static, Result<(), String>>, String>;
}

/// Delivers messages to processes in the cluster.
#[derive(Debug)]
pub struct ClusterDelivery {
    gateway: Arc<Gateway>,
    routes: Option<Arc<RouteTable>>,
    forwarder: Option<Arc<dyn Forwarder>>,
    policy: DeliveryPolicy,
}

type Attempt = BoxFuture<'static, Result<(), String>>;

impl ClusterDelivery {
    /// Delivers to processes connected to `gateway` and, through
    /// `forwarder`, to those `routes` places on other nodes.
    pub fn new(
        gateway: Arc<Gateway>,
        routes: Option<Arc<RouteTable>>,
        forwarder: Option<Arc<dyn Forwarder>>,
        policy: DeliveryPolicy,
    ) -> Arc<ClusterDelivery> {
        Arc::new(ClusterDelivery {
            gateway,
            routes,
            forwarder,
            policy,
        })
    }

    /// Makes the first attempt (waiting for the process's capacity) and
    /// returns the future of the final outcome.
    pub async fn start(
        self: &Arc<Self>,
        process_id: String,
        input: &InputRecord,
        message: OutputRecord,
        abort: CancellationToken,
    ) -> BoxFuture<'static, DeliveryEnd> {
        let delivery_id = input.delivery_id();
        let message = to_wire(input, message);
        let first = self.attempt(&process_id, &delivery_id, &message).await;
        let this = self.clone();
        async move {
            let deadline = Instant::now() + this.policy.ttl;
            let mut backoff = this.policy.initial_backoff;
            let mut attempt = first;
            let mut attempts = 1u32;
            loop {
                let result = tokio::select! {
                    _ = abort.cancelled() => return DeliveryEnd::Aborted,
                    result = &mut attempt => result,
                };
                let reason = match result {
                    Ok(()) => return DeliveryEnd::Delivered,
                    Err(reason) => reason,
                };
                if Instant::now() + backoff > deadline {
                    return DeliveryEnd::GaveUp(format!(
                        "{reason} (time to live {:?} spent after {attempts} attempts)",
                        this.policy.ttl
                    ));
                }
                tracing::debug!(process = %process_id, %delivery_id, %reason, retry_in = ?backoff, "delivery failed; retrying");
                tokio::select! {
                    _ = abort.cancelled() => return DeliveryEnd::Aborted,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(this.policy.max_backoff);
                attempts += 1;
                this.policy.retried.inc();
                attempt = tokio::select! {
                    _ = abort.cancelled() => return DeliveryEnd::Aborted,
                    attempt = this.attempt(&process_id, &delivery_id, &message) => attempt,
                };
            }
        }
        .boxed()
    }

    /// One attempt: hand the message to the process's connection (or the
    /// mesh link to its node); the returned future waits for its answer.
    async fn attempt(&self, process_id: &str, delivery_id: &str, message: &v1::Message) -> Attempt {
        match self
            .gateway
            .deliver(process_id, delivery_id.to_string(), message.clone())
            .await
        {
            Ok(answer) => async move {
                match answer.await {
                    Ok(DeliveryResult::Acked) => Ok(()),
                    Ok(DeliveryResult::Nacked(reason)) => {
                        Err(format!("the process refused it: {reason}"))
                    }
                    Ok(DeliveryResult::Lost(reason)) => Err(format!(
                        "the process's connection ended before it acked: {reason}"
                    )),
                    Err(_) => Err("the process's connection ended".to_string()),
                }
            }
            .boxed(),
            Err(not_here) => {
                let elsewhere = self.routes.as_ref().and_then(|r| r.lookup(process_id));
                let result = match (elsewhere, &self.forwarder) {
                    (Some(node), Some(forwarder)) => forwarder
                        .forward(&node, process_id, delivery_id.to_string(), message.clone())
                        .map_err(|e| format!("process `{process_id}` is on node {node}: {e}")),
                    (Some(node), None) => Err(format!(
                        "process `{process_id}` is on node {node}, and this node has no mesh"
                    )),
                    (None, _) => Err(format!("{not_here} (nor known elsewhere in the cluster)")),
                };
                match result {
                    Ok(answer) => answer,
                    Err(reason) => async move { Err(reason) }.boxed(),
                }
            }
        }
    }
}

/// The wire form of a message (its origin from `input`).
pub fn to_wire(input: &InputRecord, message: OutputRecord) -> v1::Message {
    v1::Message {
        key: message.key.map(Bytes::from),
        value: message.value.map(Bytes::from).unwrap_or_default(),
        headers: message
            .headers
            .into_iter()
            .map(|(name, value)| v1::Header {
                name,
                value: Bytes::from(value),
            })
            .collect(),
        topic: input.topic.clone(),
        partition: input.partition,
        offset: input.offset,
        timestamp_ms: input.timestamp_ms.unwrap_or(-1),
    }
}
