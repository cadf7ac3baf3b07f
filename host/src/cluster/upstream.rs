//! Upstream sends of business processes (data-returns): through the cluster
//! flow's data-return chain to its output topic, acknowledged to the process
//! only once Kafka has them.
//!
//! The record keeps the process's key, value and headers, and gains
//! `wasmrelay-origin-process`, `wasmrelay-origin-node`, and, when the send
//! answers a delivery, `wasmrelay-delivery-id`. A send carrying a header of
//! the relay's own (`wasmrelay-*`, [`headers::is_reserved`]) is refused,
//! naming it: a process cannot forge an origin, a delivery id or a MAC.

use std::sync::Arc;

use futures::FutureExt as _;
use futures::future::BoxFuture;
use wasmrelay_protocol::v1;

use crate::flow::chain::PluginChain;
use crate::flow::headers;
use crate::flow::retry::Attempt;
use crate::gateway::{Accepted, Upstream, UpstreamError};
use crate::kafka::{InputRecord, OutputRecord};
use crate::link::KafkaLink;
use crate::telemetry::metrics::FlowMetrics;

/// Where a cluster flow's upstream sends go.
#[derive(Debug)]
pub struct FlowUpstream {
    /// This node's id.
    pub node: String,
    /// The flow's data-return chain.
    pub data_return: PluginChain,
    /// The flow's link (its current cluster).
    pub link: Arc<KafkaLink>,
    /// The flow's output topic.
    pub output_topic: String,
    /// The flow's counters.
    pub metrics: FlowMetrics,
}

impl Upstream for FlowUpstream {
    fn send(
        &self,
        process_id: &str,
        send: v1::Send,
    ) -> BoxFuture<'static, Result<Accepted, UpstreamError>> {
        if let Some(header) = send.headers.iter().find(|h| headers::is_reserved(&h.name)) {
            let refused = UpstreamError::Refused(format!(
                "header `{}` is reserved: names starting with `{}` are set by the relay, not by a process",
                header.name,
                headers::RESERVED_PREFIX
            ));
            return futures::future::ready(Err(refused)).boxed();
        }
        let mut record = OutputRecord {
            key: send.key.map(|k| k.to_vec()),
            value: Some(send.value.to_vec()),
            headers: send
                .headers
                .into_iter()
                .map(|h| (h.name, h.value.to_vec()))
                .collect(),
        };
        record.set_header(headers::ORIGIN_PROCESS, process_id.as_bytes());
        record.set_header(headers::ORIGIN_NODE, self.node.as_bytes());
        if !send.in_reply_to.is_empty() {
            record.set_header(headers::DELIVERY_ID, send.in_reply_to.as_bytes());
        }
        // What the data-return plugins see as the message's origin.
        let origin = InputRecord {
            topic: "".into(),
            partition: -1,
            offset: -1,
            key: record.key.clone(),
            value: record.value.clone(),
            headers: record.headers.clone(),
            timestamp_ms: None,
        };
        let chain = self.data_return.clone();
        let link = self.link.clone();
        let topic = self.output_topic.clone();
        let metrics = self.metrics.clone();
        async move {
            let records = match chain.apply(&origin, record).await {
                Attempt::Success(records) => records,
                Attempt::Retry(failure) => {
                    return Err(UpstreamError::PluginFailed {
                        plugin: failure.plugin,
                        reason: failure.reason,
                    });
                }
                Attempt::GiveUp(failure) => {
                    return Err(UpstreamError::PluginRefused {
                        plugin: failure.plugin,
                        reason: failure.reason,
                    });
                }
            };
            // Enqueued in order; acknowledged whenever Kafka gets to them.
            let mut acks = Vec::with_capacity(records.len());
            for record in records {
                let ack = link
                    .producer()
                    .enqueue(&topic, &record)
                    .await
                    .map_err(|source| UpstreamError::Produce {
                        topic: topic.clone(),
                        source,
                    })?;
                acks.push(ack);
            }
            let accepted: Accepted = async move {
                for ack in acks {
                    ack.await.map_err(|source| UpstreamError::Produce {
                        topic: topic.clone(),
                        source,
                    })?;
                    metrics.returned.inc();
                }
                Ok(())
            }
            .boxed();
            Ok(accepted)
        }
        .boxed()
    }
}
