//! Asking a Kafka cluster whether it answers, and when it does not, saying
//! why in librdkafka's own words: a metadata request alone fails with "timed
//! out" or "all brokers down", while the reason (a TLS certificate that does
//! not verify, a SASL login refused, a connection refused) only reaches the
//! client's error callback.

use std::sync::Mutex;
use std::time::Duration;

use anyhow::Context as _;
use rdkafka::ClientContext;
use rdkafka::error::KafkaError;
use rdkafka::producer::{BaseProducer, NoCustomPartitioner, Producer as _, ProducerContext};

use super::link::LinkInfo;

/// The most reasons a probe keeps (the distinct last ones).
const MAX_REASONS: usize = 3;

/// Collects the error events of a probe's client.
#[derive(Default)]
struct ProbeContext {
    reasons: Mutex<Vec<String>>,
}

impl ClientContext for ProbeContext {
    fn error(&self, error: KafkaError, reason: &str) {
        let text = if reason.is_empty() {
            error.to_string()
        } else {
            reason.to_owned()
        };
        if let Ok(mut reasons) = self.reasons.lock()
            && !reasons.contains(&text)
        {
            reasons.push(text);
            if reasons.len() > MAX_REASONS {
                reasons.remove(0);
            }
        }
    }
}

impl ProducerContext<NoCustomPartitioner> for ProbeContext {
    type DeliveryOpaque = ();
    fn delivery(&self, _: &rdkafka::message::DeliveryResult<'_>, _: ()) {}
}

/// Asks the cluster of `info` for its metadata within `timeout`. The error
/// names what librdkafka reported on the way (TLS, SASL, connection), with
/// the link's secret values scrubbed.
pub async fn probe_cluster(info: &LinkInfo, timeout: Duration) -> anyhow::Result<()> {
    let producer: BaseProducer<ProbeContext> = info
        .create_with_context(&info.admin_config(), ProbeContext::default())
        .context("creating a client")?;
    let outcome = tokio::task::spawn_blocking(move || {
        match producer.client().fetch_metadata(None, timeout) {
            Ok(_) => Ok(()),
            Err(error) => {
                // Serve the error events queued during the request.
                producer.poll(Duration::from_millis(100));
                let reasons = producer
                    .context()
                    .reasons
                    .lock()
                    .map(|r| r.clone())
                    .unwrap_or_default();
                Err((error, reasons))
            }
        }
    })
    .await
    .context("probe task")?;
    outcome.map_err(|(error, reasons)| {
        let text = if reasons.is_empty() {
            format!("metadata request: {error}")
        } else {
            format!(
                "metadata request: {error}; librdkafka reports: {}",
                reasons.join("; ")
            )
        };
        anyhow::anyhow!("{}", info.redact(&text))
    })
}
