//! Delivering a service call to the application over HTTP, and reading its
//! answer as a data-return.
//!
//! The message value is the request body; the key, the Kafka headers, the
//! input's topic/partition/offset and a delivery id travel as HTTP headers
//! (see [`super::headers`]). A 2xx answer with a body is the data-return;
//! `x-kafka-header-*` response headers become its Kafka headers.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use tokio::sync::Semaphore;

use futures::FutureExt as _;
use futures::future::BoxFuture;
use prometheus_client::metrics::counter::Counter;
use tokio_util::sync::CancellationToken;

use super::dead_letter::Stage;
use super::headers;
use super::retry::{Attempt, Retried, failure_reason, retry};
use super::target::{Delivery, DeliveryTarget};
use crate::config::RetryConfig;
use crate::kafka::{InputRecord, OutputRecord};

/// What the application answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppAnswer {
    /// The data-return, when the answer had a body.
    pub data_return: Option<OutputRecord>,
    /// HTTP status.
    pub status: u16,
}

/// An HTTP client for one application endpoint, with bounded concurrency.
#[derive(Clone, Debug)]
pub struct AppClient {
    url: reqwest::Url,
    http: reqwest::Client,
    permits: Arc<Semaphore>,
    flow: String,
}

/// `error` and each error it was caused by, `: `-separated: reqwest's own
/// text ("error sending request") does not say what went wrong (refused,
/// a certificate that does not verify).
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// How much of an error body is quoted in a dead-letter reason.
const BODY_QUOTE_LIMIT: usize = 200;

impl AppClient {
    /// A client for `url` with a per-request `timeout` and at most
    /// `concurrency` requests in flight.
    pub fn new(
        flow: &str,
        url: &str,
        timeout: Duration,
        concurrency: usize,
    ) -> anyhow::Result<Self> {
        Self::with_ca(flow, url, timeout, concurrency, None)
    }

    /// [`AppClient::new`] that also trusts `ca_pem` (PEM certificates) for
    /// an `https://` application, besides the system's roots.
    pub fn with_ca(
        flow: &str,
        url: &str,
        timeout: Duration,
        concurrency: usize,
        ca_pem: Option<&[u8]>,
    ) -> anyhow::Result<Self> {
        let url = reqwest::Url::parse(url)
            .map_err(|e| anyhow::anyhow!("application URL `{url}`: {e}"))?;
        let mut builder = reqwest::Client::builder()
            .timeout(timeout)
            .pool_max_idle_per_host(concurrency);
        if let Some(pem) = ca_pem {
            for cert in reqwest::Certificate::from_pem_bundle(pem)
                .map_err(|e| anyhow::anyhow!("the application CA: {e}"))?
            {
                builder = builder.add_root_certificate(cert);
            }
        }
        let http = builder
            .build()
            .map_err(|e| anyhow::anyhow!("building the HTTP client: {e}"))?;
        Ok(AppClient {
            url,
            http,
            permits: Arc::new(Semaphore::new(concurrency.max(1))),
            flow: flow.to_string(),
        })
    }

    /// POSTs `message` (produced from `input` by the service-call chain) and
    /// classifies the answer: 2xx is success, 4xx (but 408 and 429) is final,
    /// anything else, timeouts and connection errors are worth a retry.
    pub async fn deliver(&self, input: &InputRecord, message: &OutputRecord) -> Attempt<AppAnswer> {
        let Ok(_permit) = self.permits.acquire().await else {
            return Attempt::Retry("application client closed".into());
        };
        let request = self
            .http
            .post(self.url.clone())
            .headers(self.request_headers(input, message))
            .body(message.value.clone().unwrap_or_default());
        let response = match request.send().await {
            Ok(response) => response,
            Err(error) if error.is_timeout() => {
                return Attempt::Retry(format!("app did not answer in time: {error}"));
            }
            Err(error) => {
                return Attempt::Retry(format!("app unreachable: {}", with_causes(&error)));
            }
        };
        let status = response.status();
        let response_headers = response.headers().clone();
        let body = match response.bytes().await {
            Ok(body) => body,
            Err(error) => return Attempt::Retry(format!("reading the app's answer: {error}")),
        };
        if status.is_success() {
            let data_return = (!body.is_empty()).then(|| OutputRecord {
                key: message.key.clone(),
                value: Some(body.to_vec()),
                headers: data_return_headers(message, &response_headers),
            });
            return Attempt::Success(AppAnswer {
                data_return,
                status: status.as_u16(),
            });
        }
        let quoted = String::from_utf8_lossy(&body[..body.len().min(BODY_QUOTE_LIMIT)]).to_string();
        let reason = format!("app answered {status}: {quoted}");
        if status.is_client_error() && status.as_u16() != 408 && status.as_u16() != 429 {
            Attempt::GiveUp(reason)
        } else {
            Attempt::Retry(reason)
        }
    }

    fn request_headers(&self, input: &InputRecord, message: &OutputRecord) -> HeaderMap {
        let mut map = HeaderMap::new();
        let mut put = |name: &str, value: &[u8]| {
            if let (Ok(name), Ok(value)) =
                (HeaderName::try_from(name), HeaderValue::from_bytes(value))
            {
                map.append(name, value);
            }
        };
        put(headers::HTTP_DELIVERY_ID, input.delivery_id().as_bytes());
        put(headers::HTTP_FLOW, self.flow.as_bytes());
        put(headers::HTTP_TOPIC, input.topic.as_bytes());
        put(
            headers::HTTP_PARTITION,
            input.partition.to_string().as_bytes(),
        );
        put(headers::HTTP_OFFSET, input.offset.to_string().as_bytes());
        if let Some(key) = &message.key {
            match std::str::from_utf8(key)
                .ok()
                .filter(|k| HeaderValue::from_str(k).is_ok())
            {
                Some(text) => put(headers::HTTP_KEY, text.as_bytes()),
                None => put(headers::HTTP_KEY_B64, BASE64.encode(key).as_bytes()),
            }
        }
        for (name, value) in &message.headers {
            if headers::TRACE_HEADERS.contains(&name.as_str()) {
                put(name, value);
            } else {
                put(
                    &format!(
                        "{}{}",
                        headers::HTTP_KAFKA_HEADER_PREFIX,
                        name.to_ascii_lowercase()
                    ),
                    value,
                );
            }
        }
        map
    }
}

/// The application as a flow's [`DeliveryTarget`]: each call is POSTed and
/// retried within the flow's retry budget; the answer's body is the
/// data-return.
#[derive(Debug)]
pub struct AppTarget {
    client: AppClient,
    retry: RetryConfig,
    retried: Counter,
}

impl AppTarget {
    /// Delivers through `client`, retrying by `retry`; `retried` counts
    /// each retry (the flow's `wasmrelay_retries_total`).
    pub fn new(client: AppClient, retry: RetryConfig, retried: Counter) -> Self {
        AppTarget {
            client,
            retry,
            retried,
        }
    }
}

impl DeliveryTarget for AppTarget {
    fn deliver<'a>(
        &'a self,
        input: &'a InputRecord,
        call: OutputRecord,
        abort: &'a CancellationToken,
    ) -> BoxFuture<'a, Delivery> {
        async move {
            let retried = retry(
                &self.retry,
                abort,
                |_| {
                    self.retried.inc();
                },
                || self.client.deliver(input, &call),
            )
            .await;
            match retried {
                Retried::Success(answer) => {
                    Delivery::Answered(answer.data_return.into_iter().collect())
                }
                Retried::Failed {
                    error,
                    attempts,
                    budget_spent,
                } => Delivery::Failed {
                    stage: Stage::App,
                    reason: failure_reason(&error, attempts, budget_spent),
                },
                Retried::Aborted => Delivery::Aborted,
            }
        }
        .boxed()
    }
}

/// Headers of the data-return: the trace context of the service call, then
/// what the application set with `x-kafka-header-*` (its own `traceparent`
/// wins when it sets one).
fn data_return_headers(message: &OutputRecord, response: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = message
        .headers
        .iter()
        .filter(|(name, _)| headers::TRACE_HEADERS.contains(&name.as_str()))
        .cloned()
        .collect();
    for (name, value) in response {
        let name = name.as_str();
        let kafka_name = if headers::TRACE_HEADERS.contains(&name) {
            name
        } else if let Some(stripped) = name.strip_prefix(headers::HTTP_KAFKA_HEADER_PREFIX) {
            stripped
        } else {
            continue;
        };
        out.retain(|(n, _)| n != kafka_name);
        out.push((kafka_name.to_string(), value.as_bytes().to_vec()));
    }
    out
}
