//! The admin HTTP API, on its own listener apart from the data path:
//! `/healthz` (the process is up), `/readyz` (links connected, plugins
//! loaded, not shutting down), `/metrics` (Prometheus text), `/plugins`
//! (loaded versions), `/links` (current Kafka connection per link, secrets
//! redacted, and the history of switches); on cluster nodes `/cluster`,
//! `/processes?id=`, `POST /rebalance` (a rebalance round now) and
//! `POST /evacuate[?rate=N]` (move every process off this node and accept
//! no new one).
//!
//! Access: the probes answer anyone; the read-only endpoints need the
//! bearer token when one is configured (and config validation requires one
//! off loopback); any request that is not a `GET` or `HEAD` needs the token
//! always, whatever the address, so a state-changing route added later is
//! guarded without further work ([`auth`]).
//!
//! Owns: routing and rendering. The state it shows belongs to the modules
//! that own it; they hand it over through [`AdminState`]. Connections,
//! timeouts and the connection cap are [`serve`]'s.

pub mod auth;
pub mod serve;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use self::auth::AccessPolicy;
pub use self::serve::ServeOptions;
use crate::config::AdminConfig;
use crate::plugin::PluginRegistry;
use crate::telemetry::metrics::RelayMetrics;

/// What the admin API shows.
#[derive(Debug)]
pub struct AdminState {
    /// The node's id.
    pub node_id: String,
    /// Metrics to render.
    pub metrics: Arc<RelayMetrics>,
    /// The plugins.
    pub plugins: Arc<PluginRegistry>,
    /// True once everything started; false again when shutting down.
    pub ready: AtomicBool,
    /// The Kafka links, for `/links`.
    pub links: std::sync::Mutex<Vec<Arc<crate::link::KafkaLink>>>,
    /// The cluster parts, for `/cluster` and `/processes` (cluster nodes).
    pub cluster: std::sync::Mutex<Option<Arc<crate::cluster::ClusterRuntime>>>,
}

impl AdminState {
    /// Marks the node ready (or not) for `/readyz`.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    /// Hands the cluster over for `/cluster` and `/processes`.
    pub fn set_cluster(&self, cluster: Arc<crate::cluster::ClusterRuntime>) {
        if let Ok(mut current) = self.cluster.lock() {
            *current = Some(cluster);
        }
    }

    fn cluster(&self) -> Option<Arc<crate::cluster::ClusterRuntime>> {
        self.cluster.lock().ok().and_then(|c| c.clone())
    }

    /// Hands the links over for `/links`.
    pub fn set_links(&self, links: Vec<Arc<crate::link::KafkaLink>>) {
        if let Ok(mut current) = self.links.lock() {
            *current = links;
        }
    }
}

/// The routes of the admin API, in three tiers: the probes (`/healthz`,
/// `/readyz`) answer anyone; the read-only endpoints need `Authorization:
/// Bearer <token>` when `policy` has a token; a request with any method but
/// `GET` or `HEAD`, on any path, needs the token always (403 when none is
/// configured).
pub fn router(state: Arc<AdminState>, policy: AccessPolicy) -> Router {
    let reads_policy = policy.clone();
    let reads = Router::new()
        .route("/metrics", get(metrics))
        .route("/plugins", get(plugins))
        .route("/links", get(links))
        .route("/cluster", get(cluster))
        .route("/processes", get(processes))
        .route("/rebalance", post(rebalance))
        .route("/evacuate", post(evacuate))
        .fallback(not_found)
        .layer(axum::middleware::from_fn(move |request, next| {
            auth::require_token_if_set(reads_policy.clone(), request, next)
        }));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .merge(reads)
        .with_state(state)
        // Outermost, over every route and the fallback.
        .layer(axum::middleware::from_fn(move |request, next| {
            auth::require_token_for_changes(policy.clone(), request, next)
        }))
}

/// Binds the admin listener (so that a port in use fails start-up with a clear error).
pub async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("binding the admin listener on {addr}: {e}"))
}

/// Serves the admin API on `listener` under `config`'s token, timeouts and
/// connection cap until `shutdown` is cancelled; returns once every
/// connection has closed (within [`serve::SHUTDOWN_DRAIN`] of it).
pub async fn serve(
    listener: TcpListener,
    state: Arc<AdminState>,
    config: AdminConfig,
    tls: Option<Arc<crate::tls::ServerTls>>,
    shutdown: CancellationToken,
) {
    if config.token.is_none() && !config.on_loopback() {
        // Validation lets this through only with the explicit opt-in.
        tracing::warn!(
            listen = %config.listen,
            "the admin API serves metrics, links, plugins and cluster state WITHOUT a token on a \
             non-loopback address (admin.allow_unauthenticated = true): anyone who can reach it \
             can read them; set admin.token"
        );
    }
    let metrics = state.metrics.admin();
    let app = router(
        state,
        AccessPolicy {
            token: config.token.clone(),
        },
    );
    let watching_cert = crate::tls::watch_listener(tls.clone(), "admin", shutdown.clone());
    let serving = serve::run(
        listener,
        app,
        ServeOptions::from(&config),
        tls,
        metrics,
        shutdown,
    );
    tokio::join!(serving, watching_cert);
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(state): State<Arc<AdminState>>) -> Response {
    if state.ready.load(Ordering::SeqCst) {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n").into_response()
    }
}

async fn metrics(State(state): State<Arc<AdminState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

async fn plugins(State(state): State<Arc<AdminState>>) -> Json<serde_json::Value> {
    let plugins: Vec<serde_json::Value> = state
        .plugins
        .plugins()
        .into_iter()
        .map(|p| {
            json!({
                "name": p.name,
                "world": p.world,
                "sha256": p.sha256,
                "file": p.file,
                "loaded_at_ms": p.loaded_at.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0),
                "swaps": p.swaps,
                "calls": p.stats.calls,
                "errors": p.stats.errors,
                "last_failure": p.last_failure.map(|f| json!({"sha256": f.sha256, "error": f.error})),
            })
        })
        .collect();
    Json(json!({"node": state.node_id, "plugins": plugins}))
}

fn not_a_cluster_node() -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(json!({"error": "this node is not a cluster node (no `[cluster]` in its config)"})),
    )
        .into_response()
}

async fn cluster(State(state): State<Arc<AdminState>>) -> Response {
    match state.cluster() {
        Some(cluster) => Json(cluster.cluster_json()).into_response(),
        None => not_a_cluster_node(),
    }
}

/// `POST /rebalance`: a round now, when this node is overloaded.
async fn rebalance(State(state): State<Arc<AdminState>>) -> Response {
    match state.cluster() {
        Some(cluster) => (
            StatusCode::ACCEPTED,
            Json(cluster.rebalancer().start_round()),
        )
            .into_response(),
        None => not_a_cluster_node(),
    }
}

/// `POST /evacuate?rate=<moves per second>`.
#[derive(Debug, serde::Deserialize)]
struct EvacuateQuery {
    rate: Option<u32>,
}

/// `POST /evacuate`: no new process here, every process moved away.
async fn evacuate(
    State(state): State<Arc<AdminState>>,
    query: Result<axum::extract::Query<EvacuateQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Some(cluster) = state.cluster() else {
        return not_a_cluster_node();
    };
    let rate = match query {
        Ok(axum::extract::Query(EvacuateQuery { rate: Some(0) })) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": "rate must be at least 1 (processes per second)"})),
            )
                .into_response();
        }
        Ok(axum::extract::Query(EvacuateQuery { rate })) => rate,
        Err(rejection) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": format!("bad query: {rejection}")})),
            )
                .into_response();
        }
    };
    (
        StatusCode::ACCEPTED,
        Json(cluster.rebalancer().evacuate(rate)),
    )
        .into_response()
}

/// `/processes?id=<process id>`.
#[derive(Debug, serde::Deserialize)]
struct ProcessQuery {
    id: Option<String>,
}

async fn processes(
    State(state): State<Arc<AdminState>>,
    query: Result<axum::extract::Query<ProcessQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Some(cluster) = state.cluster() else {
        return not_a_cluster_node();
    };
    let id = match query {
        Ok(axum::extract::Query(ProcessQuery { id: Some(id) })) if !id.is_empty() => id,
        Ok(_) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": "give the process id: /processes?id=<process id>"})),
            )
                .into_response();
        }
        Err(rejection) => {
            return (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": format!("bad query: {rejection}")})),
            )
                .into_response();
        }
    };
    match cluster.process_json(&id) {
        Some(found) => Json(found).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": format!("no node holds process `{id}`"), "process_id": id})),
        )
            .into_response(),
    }
}

async fn links(State(state): State<Arc<AdminState>>) -> Json<serde_json::Value> {
    let links: Vec<serde_json::Value> = state
        .links
        .lock()
        .map(|links| links.iter().map(|l| l.snapshot()).collect())
        .unwrap_or_default();
    Json(json!({"node": state.node_id, "links": links}))
}

async fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(
            json!({"error": "no such endpoint; try /healthz, /readyz, /metrics, /plugins, /links, /cluster, /processes?id=, POST /rebalance, POST /evacuate"}),
        ),
    )
        .into_response()
}
