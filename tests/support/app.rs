//! A test application for sidecar flows: a real HTTP server on a free port
//! that records every request it receives and answers as the test decides.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// One request the application received.
#[derive(Clone, Debug)]
pub struct Receipt {
    /// `x-wasmrelay-delivery-id`.
    pub delivery_id: String,
    /// `x-wasmrelay-key`, if any.
    pub key: Option<String>,
    /// The body.
    pub body: Vec<u8>,
    /// All request headers (lower-case names).
    pub headers: HashMap<String, String>,
    /// How many times this delivery id was received, this one included.
    pub attempt: usize,
}

/// What the application answers: status, body, extra response headers.
pub type Answer = (u16, Vec<u8>, Vec<(String, String)>);

type Behaviour = dyn Fn(&Receipt) -> Answer + Send + Sync;

struct AppState {
    receipts: Mutex<Vec<Receipt>>,
    attempts: Mutex<HashMap<String, usize>>,
    behaviour: Box<Behaviour>,
    /// How long each answer takes (after `behaviour` has decided it).
    latency: Duration,
    /// Requests being answered now, and the most at once.
    in_progress: AtomicUsize,
    most_in_progress: AtomicUsize,
}

/// A running test application.
pub struct TestApp {
    /// `http://127.0.0.1:PORT/calls`.
    pub url: String,
    state: Arc<AppState>,
    stop: CancellationToken,
}

impl TestApp {
    /// Starts the application on a free port; `behaviour` decides each answer.
    pub async fn start(behaviour: impl Fn(&Receipt) -> Answer + Send + Sync + 'static) -> TestApp {
        Self::start_with_latency(Duration::ZERO, behaviour).await
    }

    /// [`TestApp::start`] for an application that takes `latency` to answer
    /// each request (`behaviour` decides the answer when the request
    /// arrives).
    pub async fn start_with_latency(
        latency: Duration,
        behaviour: impl Fn(&Receipt) -> Answer + Send + Sync + 'static,
    ) -> TestApp {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding the test app");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(AppState {
            receipts: Mutex::new(Vec::new()),
            attempts: Mutex::new(HashMap::new()),
            behaviour: Box::new(behaviour),
            latency,
            in_progress: AtomicUsize::new(0),
            most_in_progress: AtomicUsize::new(0),
        });
        let router = Router::new()
            .route("/calls", axum::routing::post(handle))
            .with_state(state.clone());
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        // Lives until the test's runtime ends; dropping the app stops it.
        #[allow(clippy::disallowed_methods)]
        tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async move { stopped.cancelled().await })
                .await
                .unwrap();
        });
        TestApp {
            url: format!("http://{addr}/calls"),
            state,
            stop,
        }
    }

    /// Every request received so far, in arrival order.
    pub fn receipts(&self) -> Vec<Receipt> {
        self.state.receipts.lock().unwrap().clone()
    }

    /// How many different delivery ids were received (redeliveries count once).
    pub fn distinct_deliveries(&self) -> usize {
        self.state
            .receipts
            .lock()
            .unwrap()
            .iter()
            .map(|r| r.delivery_id.as_str())
            .collect::<std::collections::HashSet<_>>()
            .len()
    }

    /// How many requests were received.
    pub fn count(&self) -> usize {
        self.state.receipts.lock().unwrap().len()
    }

    /// The most requests the application was answering at once.
    pub fn most_in_progress(&self) -> usize {
        self.state.most_in_progress.load(Ordering::Relaxed)
    }
}

impl std::fmt::Debug for TestApp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestApp")
            .field("url", &self.url)
            .field("requests", &self.count())
            .finish_non_exhaustive()
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn handle(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let header_map: HashMap<String, String> = headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).to_string(),
            )
        })
        .collect();
    let delivery_id = header_map
        .get("x-wasmrelay-delivery-id")
        .cloned()
        .unwrap_or_default();
    let attempt = {
        let mut attempts = state.attempts.lock().unwrap();
        let n = attempts.entry(delivery_id.clone()).or_insert(0);
        *n += 1;
        *n
    };
    let receipt = Receipt {
        key: header_map.get("x-wasmrelay-key").cloned(),
        delivery_id,
        body: body.to_vec(),
        headers: header_map,
        attempt,
    };
    let _in_progress = InProgress::enter(&state);
    let (status, body, extra) = (state.behaviour)(&receipt);
    state.receipts.lock().unwrap().push(receipt);
    if !state.latency.is_zero() {
        tokio::time::sleep(state.latency).await;
    }
    let mut response = (StatusCode::from_u16(status).unwrap(), body).into_response();
    for (name, value) in extra {
        response.headers_mut().insert(
            axum::http::HeaderName::try_from(name).unwrap(),
            axum::http::HeaderValue::try_from(value).unwrap(),
        );
    }
    response
}

/// Counts a request as being answered until dropped (also when the server
/// drops the handler because the client went away).
struct InProgress<'a>(&'a AppState);

impl<'a> InProgress<'a> {
    fn enter(state: &'a AppState) -> Self {
        let now = state.in_progress.fetch_add(1, Ordering::Relaxed) + 1;
        state.most_in_progress.fetch_max(now, Ordering::Relaxed);
        InProgress(state)
    }
}

impl Drop for InProgress<'_> {
    fn drop(&mut self) {
        self.0.in_progress.fetch_sub(1, Ordering::Relaxed);
    }
}
