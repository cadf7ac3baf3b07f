//! A build that fails at a later step leaves nothing behind: no task on
//! the runtime and no listener (the admin port can be bound again).

#![allow(clippy::unwrap_used)]

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::mocking::MockCluster;

use super::Node;
use crate::config::ValidatedConfig;
use crate::telemetry::metrics::RelayMetrics;

/// A development broker with the flows' topics (the mock cluster does not
/// create topics through the Admin API the way a broker does).
fn mock_kafka() -> MockCluster<'static, rdkafka::producer::DefaultProducerContext> {
    let kafka = MockCluster::new(1).unwrap();
    for topic in ["in", "out", "dlq"] {
        kafka.create_topic(topic, 1, 1).unwrap();
    }
    kafka
}

/// A port nothing listens on now (bound, then released).
fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// A transform flow on `bootstrap` with `extra` TOML after the flow, the
/// admin API on `admin`.
fn config(
    plugins: &std::path::Path,
    admin: SocketAddr,
    link: &str,
    extra: &str,
) -> ValidatedConfig {
    let text = format!(
        r#"shutdown_grace = "5s"
[node]
id = "node-under-test"
[admin]
listen = "{admin}"
[plugins]
dir = "{plugins}"
[links.main]
{link}
[[flows]]
name = "f"
link = "main"
input_topic = "in"
output_topic = "out"
dead_letter_topic = "dlq"
{extra}
"#,
        plugins = plugins.display(),
    );
    crate::config::parse(&text, "test config", &|_| None).unwrap()
}

fn alive_tasks() -> usize {
    tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks()
}

/// Builds `config`, expects an error containing `expected`, then checks
/// that every task is gone and the admin address is free again.
async fn assert_build_fails_cleanly(config: ValidatedConfig, admin: SocketAddr, expected: &str) {
    let before = alive_tasks();
    let error = Node::build(config, Arc::new(RelayMetrics::new()))
        .await
        .expect_err("the build must fail");
    let text = format!("{error:#}");
    assert!(text.contains(expected), "expected `{expected}` in: {text}");
    eprintln!("the build failed as expected: {text}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while alive_tasks() > before {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} tasks still alive after the failed build (before: {before})",
            alive_tasks()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    TcpListener::bind(admin)
        .unwrap_or_else(|e| panic!("the admin address {admin} is still taken: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_center_fails_the_build_and_leaves_nothing_running() {
    let plugins = tempfile::tempdir().unwrap();
    let admin = free_addr();
    let etcd = free_addr();
    let config = config(
        plugins.path(),
        admin,
        "from_center = true",
        &format!(
            "[center]\nkind = \"etcd\"\nendpoints = [\"http://{etcd}\"]\nwait_for_key = \"300ms\"\n"
        ),
    );
    assert_build_fails_cleanly(config, admin, "cannot be reached").await;
}

/// The topic step fails when Kafka does not answer (librdkafka's mock
/// cluster cannot stand in for a broker that refuses creation: it does not
/// implement CreateTopics at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_kafka_fails_the_topic_step_and_leaves_nothing_running() {
    let plugins = tempfile::tempdir().unwrap();
    let admin = free_addr();
    let kafka = free_addr();
    let config = config(
        plugins.path(),
        admin,
        &format!("bootstrap_servers = \"{kafka}\""),
        "",
    );
    assert_build_fails_cleanly(config, admin, "preparing the topics the relay writes to").await;
}

/// Topic creation that the broker does not complete: librdkafka's mock
/// cluster has the flows' input but not their output topics, and answers no
/// CreateTopics request, so creation fails after the relay's timeout (30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_topic_creation_fails_the_build_and_leaves_nothing_running() {
    let plugins = tempfile::tempdir().unwrap();
    let kafka = MockCluster::new(1).unwrap();
    kafka.create_topic("in", 1, 1).unwrap();
    let admin = free_addr();
    let config = config(
        plugins.path(),
        admin,
        &format!("bootstrap_servers = \"{}\"", kafka.bootstrap_servers()),
        "",
    );
    assert_build_fails_cleanly(config, admin, "creating topics on").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_cluster_address_fails_the_build_and_leaves_nothing_running() {
    let plugins = tempfile::tempdir().unwrap();
    let kafka = MockCluster::new(1).unwrap();
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let admin = free_addr();
    // The bind is under test, not client authentication: `client_auth = "none"`.
    let text = format!(
        "[flows.deliver.cluster]\n[cluster]\nlink = \"main\"\nclient_listen = \"{}\"\nmesh_listen = \"127.0.0.1:0\"\nsecret = \"0123456789abcdef0123456789abcdef\"\nclient_auth = \"none\"\n",
        taken.local_addr().unwrap()
    );
    let config = config(
        plugins.path(),
        admin,
        &format!("bootstrap_servers = \"{}\"", kafka.bootstrap_servers()),
        &text,
    );
    assert_build_fails_cleanly(config, admin, "binding the client listener").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listeners_on_port_zero_report_their_bound_addresses() {
    let plugins = tempfile::tempdir().unwrap();
    let kafka = mock_kafka();
    let config = config(
        plugins.path(),
        "127.0.0.1:0".parse().unwrap(),
        &format!("bootstrap_servers = \"{}\"", kafka.bootstrap_servers()),
        "",
    );
    let node = Node::build(config, Arc::new(RelayMetrics::new()))
        .await
        .unwrap();
    let addrs = node.addrs();
    assert_ne!(addrs.admin.port(), 0);
    // The admin API answers there before the node runs: not ready yet.
    let status = reqwest::get(format!("http://{}/readyz", addrs.admin))
        .await
        .unwrap()
        .status();
    assert_eq!(status, 503);
    let shutdown = tokio_util::sync::CancellationToken::new();
    #[allow(clippy::disallowed_methods)]
    let running = tokio::spawn(node.run(shutdown.clone()));
    let ready = format!("http://{}/readyz", addrs.admin);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while reqwest::get(&ready).await.map(|r| r.status()).ok() != Some(reqwest::StatusCode::OK) {
        assert!(tokio::time::Instant::now() < deadline, "never ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    running.await.unwrap().unwrap();
    TcpListener::bind(addrs.admin).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_admin_token_only_the_probes_answer_without_it() {
    let plugins = tempfile::tempdir().unwrap();
    let kafka = mock_kafka();
    let text = format!(
        r#"[admin]
listen = "127.0.0.1:0"
token = "admin-secret-token"
[plugins]
dir = "{}"
[links.main]
bootstrap_servers = "{}"
[[flows]]
name = "f"
link = "main"
input_topic = "in"
output_topic = "out"
dead_letter_topic = "dlq"
"#,
        plugins.path().display(),
        kafka.bootstrap_servers()
    );
    let config = crate::config::parse(&text, "test config", &|_| None).unwrap();
    let node = Node::build(config, Arc::new(RelayMetrics::new()))
        .await
        .unwrap();
    let base = format!("http://{}", node.addrs().admin);
    let http = reqwest::Client::new();
    let status = |path: &'static str, token: Option<&'static str>| {
        let mut request = http.get(format!("{base}{path}"));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        async move { request.send().await.unwrap().status().as_u16() }
    };
    assert_eq!(status("/healthz", None).await, 200);
    assert_eq!(status("/readyz", None).await, 503);
    assert_eq!(status("/metrics", None).await, 401);
    assert_eq!(status("/links", Some("wrong-token")).await, 401);
    assert_eq!(status("/nowhere", None).await, 401);
    assert_eq!(status("/metrics", Some("admin-secret-token")).await, 200);
    assert_eq!(status("/links", Some("admin-secret-token")).await, 200);
    drop(node);
}

/// Runs a sidecar node on the mock cluster whose flow delivers to an
/// application here (`[flows.deliver.app]` plus `app_toml`), sends it one
/// message, waits until the application has it, then stops the node.
/// Returns the HTTP versions the application saw and how long the stop took.
async fn call_the_application_once_and_stop(
    app_toml: &str,
) -> (Vec<axum::http::Version>, Duration) {
    use rdkafka::producer::{FutureProducer, FutureRecord};

    let plugins = tempfile::tempdir().unwrap();
    let kafka = mock_kafka();
    let versions = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = versions.clone();
    let app = axum::Router::new().route(
        "/calls",
        axum::routing::post(move |request: axum::extract::Request| {
            seen.lock().unwrap().push(request.version());
            async { axum::http::StatusCode::OK }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app_addr = listener.local_addr().unwrap();
    // Aborted at the end.
    #[allow(clippy::disallowed_methods)]
    let server = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let config = config(
        plugins.path(),
        "127.0.0.1:0".parse().unwrap(),
        &format!("bootstrap_servers = \"{}\"", kafka.bootstrap_servers()),
        &format!("[flows.deliver.app]\nurl = \"http://{app_addr}/calls\"\n{app_toml}"),
    );
    let node = Node::build(config, Arc::new(RelayMetrics::new()))
        .await
        .unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    #[allow(clippy::disallowed_methods)]
    let running = tokio::spawn(node.run(shutdown.clone()));

    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", kafka.bootstrap_servers())
        .create()
        .unwrap();
    producer
        .send(
            FutureRecord::<str, str>::to("in").key("k").payload("call"),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while versions.lock().unwrap().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the application was never called"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let stopping = tokio::time::Instant::now();
    shutdown.cancel();
    running.await.unwrap().unwrap();
    let took = stopping.elapsed();
    server.abort();
    let versions = versions.lock().unwrap().clone();
    (versions, took)
}

/// A sidecar node that has called its application (over a kept-alive
/// connection, whose task runs on the node's tracker) stops within its
/// grace period, not at its end: the flows' clients are let go before the
/// node waits for its tasks. With `http2_only` the application is spoken
/// to in HTTP/2 (h2c) over plain `http://`: the option reaches the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_that_called_its_application_stops_well_within_its_grace_period() {
    let cases = [
        ("", axum::http::Version::HTTP_11),
        ("http2_only = true\n", axum::http::Version::HTTP_2),
    ];
    for (app_toml, version) in cases {
        let (versions, took) = call_the_application_once_and_stop(app_toml).await;
        assert_eq!(versions, vec![version], "with `{app_toml}`");
        // The grace period is 5 s; waiting for a connection task that
        // nothing ends would take all of it and 2 s more.
        assert!(
            took < Duration::from_secs(3),
            "with `{app_toml}` the node took {took:?} to stop"
        );
    }
}
