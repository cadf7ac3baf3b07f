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
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, Uri};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use tokio::sync::Semaphore;
use tokio_util::task::TaskTracker;

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

/// An HTTP client for one application endpoint, with bounded concurrency:
/// hyper's pooled client, HTTP/1.1 with keep-alive (HTTP/2 when an
/// `https://` application offers it), redirects not followed (a call is not
/// re-sent somewhere else).
#[derive(Clone, Debug)]
pub struct AppClient {
    uri: Uri,
    http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    timeout: Duration,
    permits: Arc<Semaphore>,
    /// The flow's name, as the `x-wasmrelay-flow` header sends it.
    flow: HeaderValue,
    /// Whether only HTTP/2 is spoken (named in a failed call's reason).
    http2_only: bool,
}

/// `error` and each error it was caused by, `: `-separated: hyper's own
/// text ("client error (Connect)") does not say what went wrong (refused,
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

/// A service call ready to POST: its value taken out as the body, which
/// every attempt shares instead of copying it.
#[derive(Debug)]
pub struct AppCall {
    /// The call without its value (key and headers).
    message: OutputRecord,
    body: Bytes,
    /// The call had no value (a tombstone), not an empty one.
    tombstone: bool,
}

impl AppCall {
    /// Takes `message`'s value as the body.
    pub fn new(mut message: OutputRecord) -> Self {
        let value = message.value.take();
        AppCall {
            tombstone: value.is_none(),
            body: Bytes::from(value.unwrap_or_default()),
            message,
        }
    }

    /// The call as it was given (for a dead letter).
    pub fn into_message(self) -> OutputRecord {
        let AppCall {
            mut message,
            body,
            tombstone,
        } = self;
        message.value = (!tombstone).then(|| Vec::from(body));
        message
    }
}

/// The largest answer read from the application (64 MiB): far above what
/// Kafka takes as a data-return, so only a broken or hostile application
/// reaches it, and it cannot make the relay hold unbounded memory.
pub const MAX_ANSWER_BYTES: usize = 64 << 20;

/// Why one request did not get a whole answer.
enum RequestError {
    Send(hyper_util::client::legacy::Error),
    Body(Box<dyn std::error::Error + Send + Sync>),
}

/// Runs hyper's connection tasks (one per pooled connection) on a
/// [`TaskTracker`], so that whoever owns the tracker (the node) owns them
/// and waits for them when it stops. Each ends once the client that pooled
/// its connection is dropped.
#[derive(Clone, Debug)]
struct TrackedExecutor(TaskTracker);

impl<F> hyper::rt::Executor<F> for TrackedExecutor
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, future: F) {
        self.0.spawn(future);
    }
}

/// How the relay talks to the application, besides its URL.
#[derive(Clone, Copy, Debug)]
pub struct AppConnection<'a> {
    /// Time allowed for one request (and reading its answer).
    pub timeout: Duration,
    /// Most requests in flight at once.
    pub concurrency: usize,
    /// For an `https://` application: CA certificates (PEM) trusted
    /// besides the system's roots.
    pub ca_pem: Option<&'a [u8]>,
    /// The application speaks HTTP/2 only: over `http://` from the first
    /// byte (h2c, prior knowledge), over `https://` h2 is the only protocol
    /// offered by ALPN. Otherwise HTTP/1.1 over `http://`, and HTTP/2 over
    /// `https://` when the application offers it.
    pub http2_only: bool,
}

impl AppClient {
    /// A client for `url` with a per-request `timeout` and at most
    /// `concurrency` requests in flight, its connections' tasks on a
    /// tracker of its own (the node's clients use [`AppClient::connect`]).
    pub fn new(
        flow: &str,
        url: &str,
        timeout: Duration,
        concurrency: usize,
    ) -> anyhow::Result<Self> {
        let connection = AppConnection {
            timeout,
            concurrency,
            ca_pem: None,
            http2_only: false,
        };
        Self::connect(flow, url, &connection, &TaskTracker::new())
    }

    /// A client of flow `flow` for the application at `url`, talking to it
    /// as `connection` says, its connections' tasks on `tasks`.
    pub fn connect(
        flow: &str,
        url: &str,
        connection: &AppConnection<'_>,
        tasks: &TaskTracker,
    ) -> anyhow::Result<Self> {
        let AppConnection {
            timeout,
            concurrency,
            ca_pem,
            http2_only,
        } = *connection;
        let parsed =
            url::Url::parse(url).map_err(|e| anyhow::anyhow!("application URL `{url}`: {e}"))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            anyhow::bail!("application URL `{url}`: the scheme must be http or https");
        }
        // The URL as url normalised it (an IDN host in ASCII, a path of at
        // least `/`), once, instead of for every request.
        let uri: Uri = parsed
            .as_str()
            .parse()
            .map_err(|e| anyhow::anyhow!("application URL `{url}`: {e}"))?;
        let tls = crate::tls::web_client_config(ca_pem)?;
        let mut tcp = HttpConnector::new();
        tcp.enforce_http(false);
        tcp.set_nodelay(true);
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http();
        let connector = if http2_only {
            https.enable_http2().wrap_connector(tcp)
        } else {
            https.enable_all_versions().wrap_connector(tcp)
        };
        let http = Client::builder(TrackedExecutor(tasks.clone()))
            .pool_max_idle_per_host(concurrency)
            .http2_only(http2_only)
            .build(connector);
        Ok(AppClient {
            uri,
            http,
            timeout,
            permits: Arc::new(Semaphore::new(concurrency.max(1))),
            flow: HeaderValue::from_str(flow)
                .map_err(|e| anyhow::anyhow!("flow name `{flow}` as an HTTP header: {e}"))?,
            http2_only,
        })
    }

    /// POSTs `call` (produced from `input` by the service-call chain) and
    /// classifies the answer: 2xx is success, 4xx (but 408 and 429) is final,
    /// anything else, timeouts and connection errors are worth a retry.
    pub async fn deliver(&self, input: &InputRecord, call: &AppCall) -> Attempt<AppAnswer> {
        let Ok(_permit) = self.permits.acquire().await else {
            return Attempt::Retry("application client closed".into());
        };
        let message = &call.message;
        let mut request = Request::new(Full::new(call.body.clone()));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = self.uri.clone();
        *request.headers_mut() = self.request_headers(input, message);
        let exchange = async {
            let response = self
                .http
                .request(request)
                .await
                .map_err(RequestError::Send)?;
            let (parts, body) = response.into_parts();
            let body = http_body_util::Limited::new(body, MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(RequestError::Body)?;
            Ok::<_, RequestError>((parts, body.to_bytes()))
        };
        let (parts, body) = match tokio::time::timeout(self.timeout, exchange).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(RequestError::Send(error))) => {
                let hint = if self.http2_only {
                    " (the flow has `http2_only = true`: does the application speak HTTP/2?)"
                } else {
                    ""
                };
                return Attempt::Retry(format!("app unreachable: {}{hint}", with_causes(&error)));
            }
            Ok(Err(RequestError::Body(error)))
                if error.is::<http_body_util::LengthLimitError>() =>
            {
                // Asking again gets the same answer.
                return Attempt::GiveUp(format!(
                    "the app's answer is larger than {MAX_ANSWER_BYTES} bytes"
                ));
            }
            Ok(Err(RequestError::Body(error))) => {
                return Attempt::Retry(format!(
                    "reading the app's answer: {}",
                    with_causes(&*error)
                ));
            }
            Err(_) => {
                return Attempt::Retry(format!(
                    "app did not answer in time (timeout {:?})",
                    self.timeout
                ));
            }
        };
        let status = parts.status;
        if status.is_success() {
            let data_return = (!body.is_empty()).then(|| OutputRecord {
                key: message.key.clone(),
                value: Some(body.to_vec()),
                headers: data_return_headers(message, &parts.headers),
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
        let mut map = HeaderMap::with_capacity(8 + message.headers.len());
        if let Ok(id) = HeaderValue::try_from(input.delivery_id()) {
            map.append(HeaderName::from_static(headers::HTTP_DELIVERY_ID), id);
        }
        map.append(
            HeaderName::from_static(headers::HTTP_FLOW),
            self.flow.clone(),
        );
        if let Ok(topic) = HeaderValue::from_str(&input.topic) {
            map.append(HeaderName::from_static(headers::HTTP_TOPIC), topic);
        }
        map.append(
            HeaderName::from_static(headers::HTTP_PARTITION),
            HeaderValue::from(input.partition),
        );
        map.append(
            HeaderName::from_static(headers::HTTP_OFFSET),
            HeaderValue::from(input.offset),
        );
        if let Some(key) = &message.key {
            match HeaderValue::from_bytes(key)
                .ok()
                .filter(|_| std::str::from_utf8(key).is_ok())
            {
                Some(text) => {
                    map.append(HeaderName::from_static(headers::HTTP_KEY), text);
                }
                None => {
                    if let Ok(encoded) = HeaderValue::try_from(BASE64.encode(key)) {
                        map.append(HeaderName::from_static(headers::HTTP_KEY_B64), encoded);
                    }
                }
            }
        }
        for (name, value) in &message.headers {
            let name = if headers::TRACE_HEADERS.contains(&name.as_str()) {
                HeaderName::try_from(name.as_str())
            } else {
                HeaderName::try_from(format!(
                    "{}{}",
                    headers::HTTP_KAFKA_HEADER_PREFIX,
                    name.to_ascii_lowercase()
                ))
            };
            if let (Ok(name), Ok(value)) = (name, HeaderValue::from_bytes(value)) {
                map.append(name, value);
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
            let call = AppCall::new(call);
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
                    call: call.into_message(),
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

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use axum::Router;
    use axum::body::Bytes as Body;
    use axum::http::{HeaderMap as AxumHeaders, StatusCode};
    use axum::routing::post;

    use super::*;

    /// What the test application received: each request's headers and body,
    /// and whether the redirect's target was ever called.
    #[derive(Default)]
    struct Seen {
        requests: Mutex<Vec<(AxumHeaders, Vec<u8>)>>,
        redirected_to: Mutex<u32>,
    }

    /// An application on a free port: `/calls` answers 200 with
    /// `answer:<body>` and an `x-kafka-header-reply` header, `/moved`
    /// redirects to `/elsewhere` (307), `/slow` answers after 2 s.
    async fn application(seen: Arc<Seen>) -> (String, tokio::task::JoinHandle<()>) {
        let calls = seen.clone();
        let elsewhere = seen.clone();
        let router = Router::new()
            .route(
                "/calls",
                post(move |headers: AxumHeaders, body: Body| async move {
                    calls
                        .requests
                        .lock()
                        .unwrap()
                        .push((headers, body.to_vec()));
                    let mut answer = b"answer:".to_vec();
                    answer.extend_from_slice(&body);
                    (StatusCode::OK, [("x-kafka-header-reply", "yes")], answer)
                }),
            )
            .route(
                "/moved",
                post(|| async { (StatusCode::TEMPORARY_REDIRECT, [("location", "/elsewhere")]) }),
            )
            .route(
                "/elsewhere",
                post(move || async move {
                    *elsewhere.redirected_to.lock().unwrap() += 1;
                    StatusCode::OK
                }),
            )
            .route("/huge", post(|| async { vec![b'x'; MAX_ANSWER_BYTES + 1] }))
            .route(
                "/slow",
                post(|| async {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    StatusCode::OK
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // Aborted by the test that started it.
        #[allow(clippy::disallowed_methods)]
        let server = tokio::spawn(async move {
            axum::serve(listener, router).await.unwrap();
        });
        (format!("http://{addr}"), server)
    }

    /// 5 s a request, 4 at a time, HTTP/1.1 over http.
    fn connection() -> AppConnection<'static> {
        AppConnection {
            timeout: Duration::from_secs(5),
            concurrency: 4,
            ca_pem: None,
            http2_only: false,
        }
    }

    /// A client of flow `orders` for `url`, talking as `connection` says.
    fn client_with(url: &str, connection: AppConnection<'_>) -> AppClient {
        AppClient::connect("orders", url, &connection, &TaskTracker::new()).unwrap()
    }

    /// A client of flow `orders` for `url`, 4 requests at a time.
    fn client(url: String, timeout: Duration) -> AppClient {
        AppClient::new("orders", &url, timeout, 4).unwrap()
    }

    /// One attempt at delivering the call of key `key`.
    async fn deliver(client: &AppClient, key: &[u8]) -> Attempt<AppAnswer> {
        client.deliver(&input(key), &AppCall::new(call(key))).await
    }

    fn input(key: &[u8]) -> InputRecord {
        InputRecord {
            topic: "calls".into(),
            partition: 2,
            offset: 41,
            key: Some(key.to_vec()),
            value: Some(b"hello".to_vec()),
            headers: vec![],
            timestamp_ms: None,
        }
    }

    fn call(key: &[u8]) -> OutputRecord {
        OutputRecord {
            key: Some(key.to_vec()),
            value: Some(b"hello".to_vec()),
            headers: vec![
                ("traceparent".into(), b"00-abc-def-01".to_vec()),
                ("Tenant".into(), b"t-1".to_vec()),
            ],
        }
    }

    #[tokio::test]
    async fn a_call_carries_its_place_key_and_headers_and_the_answer_is_the_data_return() {
        let seen = Arc::new(Seen::default());
        let (base, server) = application(seen.clone()).await;
        let client = client(format!("{base}/calls"), Duration::from_secs(5));

        let Attempt::Success(answer) = deliver(&client, b"k-1").await else {
            panic!("the call did not succeed");
        };
        assert_eq!(answer.status, 200);
        let data_return = answer.data_return.unwrap();
        assert_eq!(data_return.key.as_deref(), Some(&b"k-1"[..]));
        assert_eq!(data_return.value.as_deref(), Some(&b"answer:hello"[..]));
        assert_eq!(
            data_return.headers,
            vec![
                ("traceparent".to_string(), b"00-abc-def-01".to_vec()),
                ("reply".to_string(), b"yes".to_vec()),
            ]
        );

        // A key that is not text travels base64-encoded.
        let binary = [0xff, 0x00, 0x10];
        assert!(matches!(
            deliver(&client, &binary).await,
            Attempt::Success(_)
        ));

        let requests = seen.requests.lock().unwrap();
        let (headers, body) = &requests[0];
        let header = |name: &str| headers.get(name).map(|v| v.to_str().unwrap().to_string());
        assert_eq!(body, b"hello");
        assert_eq!(
            header(headers::HTTP_DELIVERY_ID).as_deref(),
            Some("calls/2/41")
        );
        assert_eq!(header(headers::HTTP_FLOW).as_deref(), Some("orders"));
        assert_eq!(header(headers::HTTP_TOPIC).as_deref(), Some("calls"));
        assert_eq!(header(headers::HTTP_PARTITION).as_deref(), Some("2"));
        assert_eq!(header(headers::HTTP_OFFSET).as_deref(), Some("41"));
        assert_eq!(header(headers::HTTP_KEY).as_deref(), Some("k-1"));
        assert_eq!(header("traceparent").as_deref(), Some("00-abc-def-01"));
        assert_eq!(header("x-kafka-header-tenant").as_deref(), Some("t-1"));
        assert_eq!(header("content-length").as_deref(), Some("5"));
        let (binary_headers, _) = &requests[1];
        assert_eq!(binary_headers.get(headers::HTTP_KEY), None);
        assert_eq!(
            binary_headers.get(headers::HTTP_KEY_B64).unwrap(),
            BASE64.encode(binary).as_str()
        );
        server.abort();
    }

    #[tokio::test]
    async fn a_redirect_is_not_followed_and_is_worth_a_retry() {
        let seen = Arc::new(Seen::default());
        let (base, server) = application(seen.clone()).await;
        let client = client(format!("{base}/moved"), Duration::from_secs(5));
        let Attempt::Retry(reason) = deliver(&client, b"k").await else {
            panic!("a redirect was not a retry");
        };
        assert!(reason.starts_with("app answered 307"), "{reason}");
        assert_eq!(
            *seen.redirected_to.lock().unwrap(),
            0,
            "the redirect was followed"
        );
        server.abort();
    }

    #[tokio::test]
    async fn an_answer_over_the_limit_is_final_and_says_so() {
        let (base, server) = application(Arc::new(Seen::default())).await;
        let client = client(format!("{base}/huge"), Duration::from_secs(30));
        let Attempt::GiveUp(reason) = deliver(&client, b"k").await else {
            panic!("an answer over the limit was not final");
        };
        assert!(reason.contains("larger than 67108864 bytes"), "{reason}");
        server.abort();
    }

    #[tokio::test]
    async fn a_slow_or_unreachable_application_is_worth_a_retry_and_says_why() {
        let seen = Arc::new(Seen::default());
        let (base, server) = application(seen).await;
        let slow = client(format!("{base}/slow"), Duration::from_millis(200));
        let Attempt::Retry(reason) = deliver(&slow, b"k").await else {
            panic!("a timeout was not a retry");
        };
        assert!(reason.contains("did not answer in time"), "{reason}");
        server.abort();

        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let gone = client(
            format!("http://127.0.0.1:{port}/calls"),
            Duration::from_secs(5),
        );
        let Attempt::Retry(reason) = deliver(&gone, b"k").await else {
            panic!("a refused connection was not a retry");
        };
        assert!(reason.starts_with("app unreachable: "), "{reason}");
        assert!(reason.contains("refused"), "the cause is named: {reason}");
    }

    /// An `https://` application on a free port that answers one
    /// connection, over HTTP/2 when the client picks it by ALPN; `alpn`
    /// is what the server offers. Returns its port, and each request's
    /// HTTP version.
    async fn https_application(
        pki: &wasmrelay_test_support::pki::TestPki,
        alpn: &[&[u8]],
    ) -> (
        u16,
        Arc<Mutex<Vec<hyper::Version>>>,
        tokio::task::JoinHandle<()>,
    ) {
        use wasmrelay_test_support::pki::TestPki;
        let mut config = (*TestPki::server_config(&pki.server_cert("app"))).clone();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let versions = Arc::new(Mutex::new(Vec::new()));
        let seen = versions.clone();
        // Aborted by the test that started it.
        #[allow(clippy::disallowed_methods)]
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let tls = acceptor.accept(tcp).await.unwrap();
            let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
            let service = hyper::service::service_fn(move |request: Request<_>| {
                seen.lock().unwrap().push(request.version());
                async {
                    Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(
                        Bytes::from_static(b"ok"),
                    )))
                }
            });
            let io = hyper_util::rt::TokioIo::new(tls);
            if h2 {
                hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(io, service)
                    .await
                    .unwrap();
            } else {
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, service)
                    .await
                    .unwrap();
            }
        });
        (port, versions, server)
    }

    #[tokio::test]
    async fn an_https_application_that_offers_http2_gets_it_and_one_that_does_not_gets_http1() {
        let pki = wasmrelay_test_support::pki::TestPki::new("app-versions");
        let cases: [(&[&[u8]], hyper::Version); 3] = [
            (&[b"h2", b"http/1.1"], hyper::Version::HTTP_2),
            (&[b"http/1.1"], hyper::Version::HTTP_11),
            (&[], hyper::Version::HTTP_11),
        ];
        for (alpn, expected) in cases {
            let (port, versions, server) = https_application(&pki, alpn).await;
            let client = client_with(
                &format!("https://localhost:{port}/calls"),
                AppConnection {
                    ca_pem: Some(pki.ca_pem().as_bytes()),
                    ..connection()
                },
            );
            let Attempt::Success(answer) = deliver(&client, b"k").await else {
                panic!("the call over https did not succeed");
            };
            assert_eq!(
                answer.data_return.unwrap().value.as_deref(),
                Some(&b"ok"[..])
            );
            assert_eq!(
                *versions.lock().unwrap(),
                vec![expected],
                "offered {alpn:?}"
            );
            server.abort();
        }
    }

    #[tokio::test]
    async fn a_pooled_connections_task_runs_on_the_given_tracker_and_ends_with_the_client() {
        let seen = Arc::new(Seen::default());
        let (base, server) = application(seen.clone()).await;
        let tasks = TaskTracker::new();
        let client =
            AppClient::connect("orders", &format!("{base}/calls"), &connection(), &tasks).unwrap();
        assert!(matches!(deliver(&client, b"k").await, Attempt::Success(_)));
        assert!(matches!(deliver(&client, b"k").await, Attempt::Success(_)));
        assert_eq!(
            tasks.len(),
            1,
            "one kept-alive connection, its task on the tracker"
        );
        drop(client);
        tasks.close();
        tokio::time::timeout(Duration::from_secs(5), tasks.wait())
            .await
            .expect("the connection's task ends once its client is dropped");
        server.abort();
    }

    /// An application on plain TCP that speaks only HTTP/2 (h2c) or only
    /// HTTP/1.1: the versions of the requests it got and how many
    /// connections it took.
    async fn plain_application(
        http2: bool,
    ) -> (
        String,
        Arc<Mutex<Vec<hyper::Version>>>,
        Arc<Mutex<u32>>,
        tokio::task::JoinHandle<()>,
    ) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let versions = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::new(Mutex::new(0));
        let (seen, accepted) = (versions.clone(), connections.clone());
        // Aborted by the test that started it.
        #[allow(clippy::disallowed_methods)]
        let server = tokio::spawn(async move {
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                *accepted.lock().unwrap() += 1;
                let seen = seen.clone();
                let service = hyper::service::service_fn(move |request: Request<_>| {
                    seen.lock().unwrap().push(request.version());
                    async {
                        Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(
                            Bytes::from_static(b"ok"),
                        )))
                    }
                });
                // Each connection on its own: one in the other version fails alone.
                let io = hyper_util::rt::TokioIo::new(tcp);
                if http2 {
                    let h2 = hyper::server::conn::http2::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    );
                    #[allow(clippy::disallowed_methods)]
                    tokio::spawn(async move { h2.serve_connection(io, service).await });
                } else {
                    let h1 = hyper::server::conn::http1::Builder::new();
                    #[allow(clippy::disallowed_methods)]
                    tokio::spawn(async move { h1.serve_connection(io, service).await });
                }
            }
        });
        (format!("http://{addr}"), versions, connections, server)
    }

    #[tokio::test]
    async fn with_http2_only_a_plain_http_application_gets_h2c_with_calls_sharing_one_connection() {
        let (base, versions, connections, server) = plain_application(true).await;
        let h2c = client_with(
            &format!("{base}/calls"),
            AppConnection {
                http2_only: true,
                ..connection()
            },
        );
        let attempts = futures::future::join_all((0..4).map(|_| deliver(&h2c, b"k"))).await;
        for attempt in attempts {
            let Attempt::Success(answer) = attempt else {
                panic!("an h2c call did not succeed");
            };
            assert_eq!(answer.status, 200);
        }
        assert_eq!(*versions.lock().unwrap(), vec![hyper::Version::HTTP_2; 4]);
        assert_eq!(
            *connections.lock().unwrap(),
            1,
            "four calls, one connection"
        );

        // Without the option the relay speaks HTTP/1.1, which this
        // application does not take: a retry, not a hang.
        let http1 = client(format!("{base}/calls"), Duration::from_secs(5));
        let Attempt::Retry(reason) = deliver(&http1, b"k").await else {
            panic!("an HTTP/1.1 call to an h2c-only application was not a retry");
        };
        assert!(reason.starts_with("app unreachable"), "{reason}");
        assert_eq!(versions.lock().unwrap().len(), 4);
        server.abort();

        // With the option, an application that speaks only HTTP/1.1: a
        // retry whose reason names the option.
        let (base, versions, _, server) = plain_application(false).await;
        let h2c = client_with(
            &format!("{base}/calls"),
            AppConnection {
                http2_only: true,
                ..connection()
            },
        );
        let Attempt::Retry(reason) = deliver(&h2c, b"k").await else {
            panic!("an h2c call to an HTTP/1.1-only application was not a retry");
        };
        assert!(reason.contains("`http2_only = true`"), "{reason}");
        assert!(versions.lock().unwrap().is_empty());
        server.abort();
    }

    #[test]
    fn a_call_given_back_for_its_dead_letter_is_as_it_was() {
        for value in [Some(b"v".to_vec()), Some(Vec::new()), None] {
            let message = OutputRecord {
                value,
                ..call(b"k")
            };
            assert_eq!(AppCall::new(message.clone()).into_message(), message);
        }
    }

    #[test]
    fn a_url_that_is_not_http_or_a_ca_without_certificates_is_refused() {
        let error = AppClient::new("f", "ftp://app/calls", Duration::from_secs(1), 1).unwrap_err();
        assert!(error.to_string().contains("http or https"), "{error}");
        let connection = AppConnection {
            ca_pem: Some(b"not a certificate"),
            ..connection()
        };
        let error = AppClient::connect("f", "https://app/calls", &connection, &TaskTracker::new())
            .unwrap_err();
        assert!(error.to_string().contains("no PEM certificate"), "{error}");
    }
}
