//! The admin listener over real TCP: the bearer token off loopback, the
//! rule that anything but a read needs the token, and the connection
//! guards (idle and header timeouts, the connection cap, shutdown with
//! connections that never finish a request).
//!
//! Bounds are generous: a test fails when a connection is never closed
//! (or closed for the wrong reason, by the counters), not when it is slow.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use wasmrelay::admin::{self, AdminState};
use wasmrelay::config::AdminConfig;
use wasmrelay::plugin::{PluginLimits, PluginRegistry, PluginRuntime};
use wasmrelay::telemetry::metrics::RelayMetrics;

const TOKEN: &str = "admin-test-token-0123456789abcdef";
/// How long a test waits for something that should happen well before.
const BOUND: Duration = Duration::from_secs(15);
/// A timeout that does not fire during a test.
const NEVER: Duration = Duration::from_secs(600);

/// A running admin server, stopped by `shutdown`.
struct Admin {
    /// Where to connect (loopback, whatever address it listens on).
    addr: SocketAddr,
    /// The address it is bound to.
    bound: SocketAddr,
    metrics: Arc<RelayMetrics>,
    shutdown: CancellationToken,
    serving: JoinHandle<()>,
    _plugins: tempfile::TempDir,
}

impl Admin {
    /// Starts the admin API on `config.listen` (port 0).
    async fn start(config: AdminConfig) -> Admin {
        Admin::start_with_tls(config, None).await
    }

    /// Starts the admin API on `config.listen` (port 0), over TLS if given.
    async fn start_with_tls(
        config: AdminConfig,
        tls: Option<Arc<wasmrelay::tls::ServerTls>>,
    ) -> Admin {
        let plugins = tempfile::tempdir().unwrap();
        let runtime = PluginRuntime::new(PluginLimits::default()).unwrap();
        let metrics = Arc::new(RelayMetrics::new());
        let state = Arc::new(AdminState {
            node_id: "admin-under-test".into(),
            metrics: metrics.clone(),
            plugins: Arc::new(PluginRegistry::new(
                runtime,
                plugins.path(),
                BTreeMap::new(),
            )),
            ready: AtomicBool::new(true),
            links: std::sync::Mutex::new(Vec::new()),
            cluster: std::sync::Mutex::new(None),
        });
        let listener = admin::bind(config.listen).await.unwrap();
        let bound = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let serving = tokio::spawn(admin::serve(listener, state, config, tls, shutdown.clone()));
        Admin {
            addr: SocketAddr::from(([127, 0, 0, 1], bound.port())),
            bound,
            metrics,
            shutdown,
            serving,
            _plugins: plugins,
        }
    }

    /// `method path` with the bearer `token` if given: the status code.
    async fn status(&self, method: &str, path: &str, token: Option<&str>) -> u16 {
        let mut request = reqwest::Client::new().request(
            method.parse().unwrap(),
            format!("http://{}{path}", self.addr),
        );
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        request.send().await.unwrap().status().as_u16()
    }

    /// One sample of the admin's metrics (0 if absent).
    fn metric(&self, sample: &str) -> u64 {
        self.metrics
            .render()
            .lines()
            .find_map(|line| line.strip_prefix(sample)?.trim().parse::<f64>().ok())
            .map_or(0, |v| v as u64)
    }

    /// Waits until `sample` reaches `value`.
    async fn wait_metric(&self, sample: &str, value: u64) {
        let deadline = tokio::time::Instant::now() + BOUND;
        while self.metric(sample) != value {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{sample} is {}, expected {value}:\n{}",
                self.metric(sample),
                self.metrics.render()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn config(listen: &str, token: Option<&str>) -> AdminConfig {
    AdminConfig {
        listen: listen.parse().unwrap(),
        token: token.map(|t| t.to_string().into()),
        ..AdminConfig::default()
    }
}

/// Whether the server closed `stream` within `within` (end of stream or a
/// reset); false if it was still open then. Reads and discards any data.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// Opens `n` connections that send nothing.
async fn silent_connections(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut connections = Vec::new();
    for _ in 0..n {
        connections.push(TcpStream::connect(addr).await.unwrap());
    }
    connections
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_every_interface_with_a_token_only_the_probes_answer_without_it() {
    let admin = Admin::start(config("0.0.0.0:0", Some(TOKEN))).await;
    assert!(admin.bound.ip().is_unspecified(), "{}", admin.bound);
    assert_eq!(admin.status("GET", "/healthz", None).await, 200);
    assert_eq!(admin.status("GET", "/readyz", None).await, 200);
    for path in ["/metrics", "/plugins", "/links", "/cluster", "/nowhere"] {
        assert_eq!(admin.status("GET", path, None).await, 401, "{path}");
        assert_eq!(
            admin.status("GET", path, Some("not-the-token")).await,
            401,
            "{path} with a wrong token"
        );
        assert_eq!(
            admin
                .status("GET", path, Some(&TOKEN[..TOKEN.len() - 1]))
                .await,
            401,
            "{path} with a prefix of the token"
        );
    }
    assert_eq!(admin.status("GET", "/metrics", Some(TOKEN)).await, 200);
    assert_eq!(admin.status("GET", "/plugins", Some(TOKEN)).await, 200);
    assert_eq!(admin.status("GET", "/links", Some(TOKEN)).await, 200);
    // The guard lets it through; there is no such route.
    assert_eq!(admin.status("GET", "/nowhere", Some(TOKEN)).await, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_may_change_state_need_the_token_even_on_loopback() {
    // No token on loopback: reads are open, anything else is refused.
    let open = Admin::start(config("127.0.0.1:0", None)).await;
    assert_eq!(open.status("GET", "/metrics", None).await, 200);
    for (method, path) in [
        ("POST", "/rebalance"),
        ("POST", "/evacuate"),
        ("POST", "/metrics"),
        ("DELETE", "/healthz"),
        ("PUT", "/links"),
    ] {
        assert_eq!(
            open.status(method, path, None).await,
            403,
            "{method} {path}"
        );
    }

    // With a token: refused without it, passed on with it (to a 404 or 405,
    // since nothing changes state yet).
    let guarded = Admin::start(config("127.0.0.1:0", Some(TOKEN))).await;
    assert_eq!(guarded.status("POST", "/rebalance", None).await, 401);
    assert_eq!(guarded.status("POST", "/healthz", None).await, 401);
    assert_eq!(
        guarded.status("POST", "/rebalance", Some("wrong")).await,
        401
    );
    assert_eq!(guarded.status("POST", "/rebalance", Some(TOKEN)).await, 404);
    assert_eq!(guarded.status("POST", "/healthz", Some(TOKEN)).await, 405);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_send_nothing_are_closed_after_the_idle_timeout() {
    let admin = Admin::start(AdminConfig {
        idle_timeout: Duration::from_millis(300),
        header_timeout: NEVER,
        ..config("127.0.0.1:0", None)
    })
    .await;
    let mut silent = silent_connections(admin.addr, 5).await;
    for (i, stream) in silent.iter_mut().enumerate() {
        assert!(
            closed_within(stream, BOUND).await,
            "silent connection {i} still open after {BOUND:?}"
        );
    }
    admin
        .wait_metric(
            "wasmrelay_admin_connections_timed_out_total{timeout=\"idle\"}",
            5,
        )
        .await;

    // A keep-alive connection is closed the same way after its request.
    let mut kept = TcpStream::connect(admin.addr).await.unwrap();
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: admin\r\n\r\n")
        .await
        .unwrap();
    let mut answer = vec![0u8; 1024];
    let n = kept.read(&mut answer).await.unwrap();
    assert!(
        String::from_utf8_lossy(&answer[..n]).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer[..n])
    );
    assert!(
        closed_within(&mut kept, BOUND).await,
        "idle keep-alive connection still open"
    );
    admin
        .wait_metric(
            "wasmrelay_admin_connections_timed_out_total{timeout=\"idle\"}",
            6,
        )
        .await;
    admin.wait_metric("wasmrelay_admin_connections ", 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_head_trickled_byte_by_byte_is_closed_after_the_header_timeout() {
    let admin = Admin::start(AdminConfig {
        header_timeout: Duration::from_millis(500),
        idle_timeout: NEVER,
        ..config("127.0.0.1:0", None)
    })
    .await;
    let mut slow = TcpStream::connect(admin.addr).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: admin\r\n")
        .await
        .unwrap();
    // A header byte every 50 ms, never the blank line that ends the head:
    // the connection is never silent, so only the header timeout can end it.
    let deadline = tokio::time::Instant::now() + BOUND;
    let mut buf = [0u8; 64];
    let closed = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a head trickled for {BOUND:?} is still being read"
        );
        if slow.write_all(b"X").await.is_err() {
            break true;
        }
        match tokio::time::timeout(Duration::from_millis(50), slow.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => break true,
            Ok(Ok(n)) => panic!(
                "an answer to a head that never ended: {}",
                String::from_utf8_lossy(&buf[..n])
            ),
            Err(_) => {}
        }
    };
    assert!(closed);
    admin
        .wait_metric(
            "wasmrelay_admin_connections_timed_out_total{timeout=\"header\"}",
            1,
        )
        .await;
    assert_eq!(
        admin.metric("wasmrelay_admin_connections_timed_out_total{timeout=\"idle\"}"),
        0
    );
    // A whole request is answered as usual.
    assert_eq!(admin.status("GET", "/healthz", None).await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_are_closed_at_once_and_counted() {
    let admin = Admin::start(AdminConfig {
        max_connections: 2,
        idle_timeout: NEVER,
        header_timeout: NEVER,
        ..config("127.0.0.1:0", None)
    })
    .await;
    let mut held = silent_connections(admin.addr, 2).await;
    admin.wait_metric("wasmrelay_admin_connections ", 2).await;

    let mut third = TcpStream::connect(admin.addr).await.unwrap();
    assert!(
        closed_within(&mut third, BOUND).await,
        "a connection beyond the cap was kept open"
    );
    admin
        .wait_metric("wasmrelay_admin_connections_refused_total", 1)
        .await;
    for stream in &mut held {
        assert!(
            !closed_within(stream, Duration::from_millis(200)).await,
            "a connection under the cap was closed"
        );
    }

    // A slot freed is a slot for the next client.
    drop(held.pop());
    admin.wait_metric("wasmrelay_admin_connections ", 1).await;
    assert_eq!(admin.status("GET", "/healthz", None).await, 200);
    assert_eq!(admin.metric("wasmrelay_admin_connections_refused_total"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_with_silent_and_half_sent_connections_open() {
    let mut admin = Admin::start(AdminConfig {
        idle_timeout: NEVER,
        header_timeout: NEVER,
        ..config("0.0.0.0:0", Some(TOKEN))
    })
    .await;
    let mut open = silent_connections(admin.addr, 3).await;
    let mut half = TcpStream::connect(admin.addr).await.unwrap();
    half.write_all(b"GET /metrics HTTP/1.1\r\nHost: adm")
        .await
        .unwrap();
    open.push(half);
    admin.wait_metric("wasmrelay_admin_connections ", 4).await;

    admin.shutdown.cancel();
    tokio::time::timeout(BOUND, &mut admin.serving)
        .await
        .expect("the admin server did not stop with connections open")
        .unwrap();
    for (i, stream) in open.iter_mut().enumerate() {
        assert!(
            closed_within(stream, Duration::from_secs(1)).await,
            "connection {i} still open after the server stopped"
        );
    }
    assert_eq!(admin.metric("wasmrelay_admin_connections "), 0);
    std::net::TcpListener::bind(admin.bound).expect("the admin port is still taken");
}

#[tokio::test]
async fn over_tls_the_api_answers_https_and_a_silent_connection_is_closed() {
    let pki = wasmrelay_test_support::pki::TestPki::new("admin-tls");
    let cert = pki.server_cert("admin");
    let tls = wasmrelay::tls::ServerTls::load(&wasmrelay::tls::TlsFiles {
        cert: cert.cert_path.clone(),
        key: cert.key_path.clone(),
        client_ca: None,
    })
    .unwrap();
    let admin = Admin::start_with_tls(
        AdminConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            token: Some(wasmrelay::config::Secret::new(TOKEN)),
            header_timeout: Duration::from_millis(300),
            idle_timeout: NEVER,
            ..AdminConfig::default()
        },
        Some(Arc::new(tls)),
    )
    .await;
    let client = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(pki.ca_pem().as_bytes()).unwrap())
        .build()
        .unwrap();
    let url = |path: &str| format!("https://localhost:{}{path}", admin.addr.port());
    let status = |response: reqwest::Response| response.status().as_u16();
    assert_eq!(
        status(client.get(url("/healthz")).send().await.unwrap()),
        200
    );
    assert_eq!(
        status(client.get(url("/metrics")).send().await.unwrap()),
        401
    );
    assert_eq!(
        status(
            client
                .get(url("/metrics"))
                .bearer_auth(TOKEN)
                .send()
                .await
                .unwrap()
        ),
        200
    );
    // Plain HTTP on the TLS port gets no answer; a client of another CA
    // fails its handshake.
    assert!(
        reqwest::get(format!("http://127.0.0.1:{}/healthz", admin.addr.port()))
            .await
            .is_err()
    );
    let stranger = reqwest::Client::builder()
        .add_root_certificate(
            reqwest::Certificate::from_pem(
                wasmrelay_test_support::pki::TestPki::new("other")
                    .ca_pem()
                    .as_bytes(),
            )
            .unwrap(),
        )
        .build()
        .unwrap();
    assert!(stranger.get(url("/healthz")).send().await.is_err());
    // A connection that never starts its handshake is closed by the header
    // timeout.
    let mut silent = TcpStream::connect(admin.addr).await.unwrap();
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(BOUND, silent.read(&mut buf))
        .await
        .expect("a silent connection was not closed");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    admin.shutdown.cancel();
}
