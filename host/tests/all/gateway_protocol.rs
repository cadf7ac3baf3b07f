//! The gateway over real TCP, driven by raw frames: registration, delivery
//! and acknowledgement, replacement, keepalive, slow consumers, client
//! tokens (refused Hellos leave the registered session alone; key files
//! rotate), and every kind of bad input a client can send, while another
//! client goes on being served.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{FutureExt as _, SinkExt as _, StreamExt as _};
use tokio::io::AsyncWriteExt as _;
use tokio::net::TcpStream;
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;
use wasmrelay::config::{TokenAlgorithm, TokenKeyConfig};
use wasmrelay::gateway::auth::{TokenRequest, issue_token};
use wasmrelay::gateway::{
    ClientAuth, DeliverError, DeliveryResult, Gateway, GatewayOptions, Upstream, UpstreamError,
};
use wasmrelay::telemetry::metrics::ClientAuthMetrics;
use wasmrelay_protocol::v1::{self, ErrorCode};
use wasmrelay_protocol::{Frame, FrameCodec, Kind};

const STEP: Duration = Duration::from_secs(5);
/// The HS256 key the test nodes trust (in their key file).
const KEY: &str = "gateway-test-key-0123456789abcdef-0123";

/// Upstream that accepts every send whose value is not `fail`; one whose
/// value is `slow:<n>` is acknowledged by "Kafka" after `n` ms.
#[derive(Default)]
struct CountingUpstream {
    sends: AtomicUsize,
}

impl Upstream for CountingUpstream {
    fn send(
        &self,
        _process_id: &str,
        send: v1::Send,
    ) -> BoxFuture<'static, Result<wasmrelay::gateway::Accepted, UpstreamError>> {
        self.sends.fetch_add(1, Ordering::Relaxed);
        let fail = send.value.as_ref() == b"fail";
        let slow_ms = std::str::from_utf8(&send.value)
            .ok()
            .and_then(|v| v.strip_prefix("slow:"))
            .and_then(|ms| ms.parse::<u64>().ok());
        async move {
            if fail {
                return Err(UpstreamError::Refused("refused by the test".to_string()));
            }
            Ok(match slow_ms {
                Some(ms) => async move {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    Ok(())
                }
                .boxed(),
                None => wasmrelay::gateway::already_written(),
            })
        }
        .boxed()
    }
}

struct Node {
    gateway: Arc<Gateway>,
    upstream: Arc<CountingUpstream>,
    addr: std::net::SocketAddr,
    stop: CancellationToken,
    /// The gateway's `serve`: ends once every connection has.
    served: tokio::task::JoinHandle<()>,
    /// Refused Hellos by reason.
    refused: ClientAuthMetrics,
    /// The trusted key's file.
    key_file: std::path::PathBuf,
    _keys: tempfile::TempDir,
}

/// A gateway that trusts [`KEY`], from a key file.
async fn start(options: GatewayOptions) -> Node {
    let keys = tempfile::tempdir().unwrap();
    let key_file = keys.path().join("client-token.key");
    std::fs::write(&key_file, format!("{KEY}\n")).unwrap();
    let refused = ClientAuthMetrics::default();
    let auth = ClientAuth::token(
        &[TokenKeyConfig {
            alg: TokenAlgorithm::Hs256,
            path: Some(key_file.clone()),
            secret: None,
        }],
        None,
    )
    .unwrap()
    .with_metrics(refused.clone());
    let upstream = Arc::new(CountingUpstream::default());
    let gateway = Gateway::new(options, auth, upstream.clone(), None);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let served = tokio::spawn(gateway.clone().serve(listener, stop.clone()));
    Node {
        gateway,
        upstream,
        addr,
        stop,
        served,
        refused,
        key_file,
        _keys: keys,
    }
}

fn options() -> GatewayOptions {
    GatewayOptions {
        node_id: "node-a".to_string(),
        keepalive: Duration::from_secs(10),
        hello_timeout: Duration::from_secs(2),
        send_queue: 64,
        max_unacked: 16,
        slow_consumer_timeout: Duration::from_millis(300),
        max_frame_bytes: 4096,
        tls: None,
        quota: usize::MAX,
        max_connections: 1000,
    }
}

type Conn = Framed<TcpStream, FrameCodec>;

async fn connect(node: &Node) -> Conn {
    Framed::new(
        TcpStream::connect(node.addr).await.unwrap(),
        FrameCodec::default(),
    )
}

/// A Hello with a valid token for `process_id`.
fn hello(process_id: &str, version: u32) -> Frame {
    hello_with_token(process_id, version, &token(KEY, process_id))
}

fn hello_with_token(process_id: &str, version: u32, token: &str) -> Frame {
    Frame::of(Kind::Hello(v1::Hello {
        protocol_version: version,
        process_id: process_id.to_string(),
        client_name: "test".to_string(),
        accepts_redirect: false,
        token: token.to_string(),
        redirects: 0,
    }))
}

/// A token for `process` signed with the HS256 `key`, valid for a minute.
fn token(key: &str, process: &str) -> String {
    issue_token(&TokenRequest {
        alg: TokenAlgorithm::Hs256,
        key: key.as_bytes().to_vec(),
        process: process.to_string(),
        ttl: Duration::from_secs(60),
        audience: None,
    })
    .unwrap()
}

/// A token with exactly `claims`, signed with the HS256 `key`.
fn token_with_claims(key: &str, claims: serde_json::Value) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(key.as_bytes()),
    )
    .unwrap()
}

fn now() -> u64 {
    jsonwebtoken::get_current_timestamp()
}

async fn next(conn: &mut Conn) -> Option<Frame> {
    tokio::time::timeout(STEP, conn.next())
        .await
        .expect("no frame within 5 s")
        .map(Result::unwrap)
}

async fn register(node: &Node, process_id: &str) -> Conn {
    let mut conn = connect(node).await;
    conn.send(hello(process_id, 1)).await.unwrap();
    match next(&mut conn).await.unwrap().kind {
        Some(Kind::Welcome(welcome)) => assert_eq!(welcome.node_id, "node-a"),
        other => panic!("expected a welcome, got {other:?}"),
    }
    wait_until(|| node.gateway.session(process_id).is_some()).await;
    conn
}

async fn wait_until(done: impl Fn() -> bool) {
    tokio::time::timeout(STEP, async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("condition not reached within 5 s");
}

/// The connection's next frame is an error with `code`, then it closes.
async fn expect_error_and_close(conn: &mut Conn, code: ErrorCode) -> String {
    let frame = next(conn).await.expect("closed without an error frame");
    let Some(Kind::Error(error)) = frame.kind else {
        panic!("expected an error, got {frame:?}");
    };
    assert_eq!(error.code, code as i32, "{}", error.message);
    assert!(next(conn).await.is_none(), "not closed after the error");
    error.message
}

fn message(value: &str) -> v1::Message {
    v1::Message {
        value: Bytes::from(value.to_string()),
        ..v1::Message::default()
    }
}

/// Another client is still served: a delivery reaches it and its ack
/// arrives.
async fn still_served(node: &Node, other: &mut Conn, process_id: &str) {
    let answer = node
        .gateway
        .deliver(process_id, "t/0/1".to_string(), message("still here"))
        .await
        .unwrap();
    let Some(Kind::Deliver(deliver)) = next(other).await.unwrap().kind else {
        panic!("expected a delivery");
    };
    other
        .send(Frame::of(Kind::Ack(v1::Ack { seq: deliver.seq })))
        .await
        .unwrap();
    assert_eq!(
        tokio::time::timeout(STEP, answer).await.unwrap().unwrap(),
        DeliveryResult::Acked
    );
}

#[tokio::test]
async fn deliveries_are_acked_and_nacked_in_order_and_sends_are_acknowledged() {
    let node = start(options()).await;
    let mut conn = register(&node, "p-1").await;
    let mut answers = Vec::new();
    for n in 0..5 {
        answers.push(
            node.gateway
                .deliver("p-1", format!("t/0/{n}"), message(&format!("m{n}")))
                .await
                .unwrap(),
        );
    }
    for n in 0..5 {
        let Some(Kind::Deliver(deliver)) = next(&mut conn).await.unwrap().kind else {
            panic!("expected a delivery");
        };
        assert_eq!(deliver.delivery_id, format!("t/0/{n}"));
        assert_eq!(deliver.message.unwrap().value, format!("m{n}"));
        let answer = if n == 3 {
            Kind::Nack(v1::Nack {
                seq: deliver.seq,
                reason: "busy".to_string(),
            })
        } else {
            Kind::Ack(v1::Ack { seq: deliver.seq })
        };
        conn.send(Frame::of(answer)).await.unwrap();
    }
    let mut results = Vec::new();
    for answer in answers {
        results.push(tokio::time::timeout(STEP, answer).await.unwrap().unwrap());
    }
    assert_eq!(results[3], DeliveryResult::Nacked("busy".to_string()));
    assert!(
        results
            .iter()
            .enumerate()
            .all(|(n, r)| n == 3 || *r == DeliveryResult::Acked)
    );

    for (seq, value, ok) in [(1, "hello", true), (2, "fail", false)] {
        conn.send(Frame::of(Kind::Send(v1::Send {
            seq,
            value: Bytes::from(value),
            ..v1::Send::default()
        })))
        .await
        .unwrap();
        let Some(Kind::SendAck(ack)) = next(&mut conn).await.unwrap().kind else {
            panic!("expected a send ack");
        };
        assert_eq!((ack.seq, ack.ok), (seq, ok), "{}", ack.error);
    }
    assert_eq!(node.upstream.sends.load(Ordering::Relaxed), 2);

    conn.send(Frame::of(Kind::Ping(v1::Ping { nonce: 42 })))
        .await
        .unwrap();
    assert!(matches!(
        next(&mut conn).await.unwrap().kind,
        Some(Kind::Pong(v1::Pong { nonce: 42 }))
    ));
    node.stop.cancel();
}

#[tokio::test]
async fn pipelined_sends_are_acknowledged_in_the_order_sent_whenever_kafka_has_them() {
    let node = start(options()).await;
    let mut conn = register(&node, "p-1").await;
    // As many as may be in flight (max_unacked = 16), the first ones
    // acknowledged by Kafka last.
    let sends: Vec<u64> = (1..=16).collect();
    for seq in &sends {
        conn.feed(Frame::of(Kind::Send(v1::Send {
            seq: *seq,
            value: Bytes::from(format!("slow:{}", 5 * (17 - seq))),
            ..v1::Send::default()
        })))
        .await
        .unwrap();
    }
    conn.flush().await.unwrap();
    let mut acked = Vec::new();
    while acked.len() < sends.len() {
        match next(&mut conn).await.unwrap().kind {
            Some(Kind::SendAck(ack)) => {
                assert!(ack.ok, "{}", ack.error);
                acked.push(ack.seq);
            }
            other => panic!("expected a send ack, got {other:?}"),
        }
    }
    assert_eq!(acked, sends);
    node.stop.cancel();
}

#[tokio::test]
async fn a_delivery_too_large_for_a_frame_is_refused_and_the_session_is_untouched() {
    let node = start(options()).await;
    let mut conn = register(&node, "p-1").await;
    // max_frame_bytes = 4096.
    let refused = node
        .gateway
        .deliver("p-1", "t/0/7".to_string(), message(&"x".repeat(5000)))
        .await
        .unwrap_err();
    assert!(
        matches!(refused, DeliverError::TooLarge { max: 4096, bytes } if bytes > 5000),
        "{refused:?}"
    );
    assert!(
        refused.to_string().contains("can never be delivered"),
        "{refused}"
    );
    // The connection saw nothing of it and still serves.
    still_served(&node, &mut conn, "p-1").await;
    assert_eq!(
        node.gateway.stats().accepted(),
        1,
        "the client did not reconnect"
    );
    node.stop.cancel();
}

#[tokio::test]
async fn a_client_that_never_reads_is_cut_off_and_does_not_hold_up_the_shutdown() {
    let mut options = options();
    options.slow_consumer_timeout = Duration::from_millis(500);
    // Room for every Pong: only the socket can be full, not the queue.
    options.send_queue = 25_000_000;
    let node = start(options).await;
    // A small receive window: the node's side fills after a few KiB.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut conn = Framed::new(
        socket.connect(node.addr).await.unwrap(),
        FrameCodec::default(),
    );
    conn.send(hello("deaf", 1)).await.unwrap();
    assert!(matches!(
        next(&mut conn).await.unwrap().kind,
        Some(Kind::Welcome(_))
    ));
    let mut stream = conn.into_inner();
    // Pings, never reading the Pongs: the node's socket buffer fills, and
    // its writer cannot finish a write.
    let ping = FrameCodec::default()
        .encode_to_vec(&Frame::of(Kind::Ping(v1::Ping { nonce: 1 })))
        .unwrap();
    let burst: Vec<u8> = ping
        .iter()
        .copied()
        .cycle()
        .take(ping.len() * 100_000)
        .collect();
    let writing = tokio::spawn(async move {
        for _ in 0..200 {
            if stream.write_all(&burst).await.is_err() {
                break;
            }
        }
        stream
    });
    tokio::time::timeout(Duration::from_secs(30), async {
        while node.gateway.session("deaf").is_some() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("a client that does not read was not cut off");
    node.stop.cancel();
    tokio::time::timeout(STEP, node.served)
        .await
        .expect("the shutdown waited for a client that does not read")
        .unwrap();
    writing.abort();
}

#[tokio::test]
async fn an_id_registered_again_replaces_the_older_connection_which_is_told_why() {
    let node = start(options()).await;
    let mut older = register(&node, "p-1").await;
    let pending = node
        .gateway
        .deliver("p-1", "t/0/7".to_string(), message("unacked"))
        .await
        .unwrap();
    assert!(matches!(
        next(&mut older).await.unwrap().kind,
        Some(Kind::Deliver(_))
    ));
    let mut newer = connect(&node).await;
    newer.send(hello("p-1", 1)).await.unwrap();
    assert!(matches!(
        next(&mut newer).await.unwrap().kind,
        Some(Kind::Welcome(_))
    ));
    let Some(Kind::Replaced(replaced)) = next(&mut older).await.unwrap().kind else {
        panic!("expected Replaced");
    };
    assert!(
        replaced.reason.contains("registered again"),
        "{}",
        replaced.reason
    );
    assert!(
        next(&mut older).await.is_none(),
        "the older connection stays open"
    );
    // Its unacked delivery is handed back for redelivery, not lost.
    assert!(matches!(
        tokio::time::timeout(STEP, pending).await.unwrap().unwrap(),
        DeliveryResult::Lost(_)
    ));
    assert_eq!(node.gateway.connection_count(), 1);
    still_served(&node, &mut newer, "p-1").await;
    assert_eq!(node.gateway.stats().replaced(), 1);
}

#[tokio::test]
async fn bad_input_gets_an_error_frame_and_a_disconnect_while_others_are_served() {
    let node = start(options()).await;
    let mut other = register(&node, "other").await;

    // Garbage: a length that fits, bytes that are not a Frame.
    let mut raw = TcpStream::connect(node.addr).await.unwrap();
    raw.write_all(&[0, 0, 0, 4, 0xff, 0xff, 0xff, 0xff])
        .await
        .unwrap();
    let mut conn = Framed::new(raw, FrameCodec::default());
    let why = expect_error_and_close(&mut conn, ErrorCode::BadFrame).await;
    assert!(why.contains("not a valid Frame"), "{why}");

    // Oversized: a length over the node's maximum (4096 here).
    let mut raw = TcpStream::connect(node.addr).await.unwrap();
    raw.write_all(&100_000u32.to_be_bytes()).await.unwrap();
    let mut conn = Framed::new(raw, FrameCodec::default());
    let why = expect_error_and_close(&mut conn, ErrorCode::FrameTooLarge).await;
    assert!(why.contains("100000") && why.contains("4096"), "{why}");

    // Oversized after registering.
    let mut big = register(&node, "big").await;
    let mut raw_big = big.into_inner();
    raw_big.write_all(&5000u32.to_be_bytes()).await.unwrap();
    big = Framed::new(raw_big, FrameCodec::default());
    expect_error_and_close(&mut big, ErrorCode::FrameTooLarge).await;
    wait_until(|| node.gateway.session("big").is_none()).await;

    // Wrong version.
    let mut conn = connect(&node).await;
    conn.send(hello("p-2", 99)).await.unwrap();
    let why = expect_error_and_close(&mut conn, ErrorCode::UnsupportedVersion).await;
    assert!(why.contains("99"), "{why}");

    // Something other than Hello first; a bad process id.
    let mut conn = connect(&node).await;
    conn.send(Frame::of(Kind::Ack(v1::Ack { seq: 1 })))
        .await
        .unwrap();
    expect_error_and_close(&mut conn, ErrorCode::ProtocolViolation).await;
    let mut conn = connect(&node).await;
    conn.send(hello("", 1)).await.unwrap();
    expect_error_and_close(&mut conn, ErrorCode::BadProcessId).await;

    // An ack for a delivery that was never sent; a node-only frame.
    let mut conn = register(&node, "p-3").await;
    conn.send(Frame::of(Kind::Ack(v1::Ack { seq: 77 })))
        .await
        .unwrap();
    let why = expect_error_and_close(&mut conn, ErrorCode::ProtocolViolation).await;
    assert!(why.contains("77"), "{why}");
    let mut conn = register(&node, "p-4").await;
    conn.send(Frame::of(Kind::Welcome(v1::Welcome::default())))
        .await
        .unwrap();
    expect_error_and_close(&mut conn, ErrorCode::ProtocolViolation).await;

    // Truncated: the connection ends inside a frame; the session goes away.
    let conn = register(&node, "p-5").await;
    let mut raw = conn.into_inner();
    raw.write_all(&[0, 0, 0, 50, 1, 2, 3]).await.unwrap();
    raw.shutdown().await.unwrap();
    drop(raw);
    wait_until(|| node.gateway.session("p-5").is_none()).await;

    still_served(&node, &mut other, "other").await;
    assert!(node.gateway.stats().protocol_errors() >= 8);
}

#[tokio::test]
async fn a_silent_client_is_closed_after_the_idle_timeout() {
    let node = start(GatewayOptions {
        keepalive: Duration::from_millis(100),
        ..options()
    })
    .await;
    let mut conn = register(&node, "quiet").await;
    let why = expect_error_and_close(&mut conn, ErrorCode::IdleTimeout).await;
    assert!(why.contains("Ping"), "{why}");
    wait_until(|| node.gateway.session("quiet").is_none()).await;

    // A client that pings stays.
    let mut chatty = register(&node, "chatty").await;
    for nonce in 0..10 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        chatty
            .send(Frame::of(Kind::Ping(v1::Ping { nonce })))
            .await
            .unwrap();
        assert!(matches!(
            next(&mut chatty).await.unwrap().kind,
            Some(Kind::Pong(_))
        ));
    }
    assert!(node.gateway.session("chatty").is_some());
}

#[tokio::test]
async fn a_busy_process_holds_deliveries_back_and_one_that_never_acks_is_cut_off() {
    let node = start(options()).await;
    // max_unacked is 16: a process that acks as it goes receives 100
    // deliveries in order, the later ones waiting for capacity.
    let mut busy = register(&node, "busy").await;
    let gateway = node.gateway.clone();
    let sender = tokio::spawn(async move {
        let mut answers = Vec::new();
        for n in 0..100 {
            answers.push(
                gateway
                    .deliver("busy", format!("t/0/{n}"), message(&format!("{n}")))
                    .await
                    .unwrap(),
            );
        }
        answers
    });
    for n in 0..100 {
        let Some(Kind::Deliver(deliver)) = next(&mut busy).await.unwrap().kind else {
            panic!("expected delivery {n}");
        };
        assert_eq!(deliver.message.unwrap().value, n.to_string());
        assert!(node.gateway.session("busy").unwrap().unacked() <= 16);
        busy.send(Frame::of(Kind::Ack(v1::Ack { seq: deliver.seq })))
            .await
            .unwrap();
    }
    for answer in sender.await.unwrap() {
        assert_eq!(
            tokio::time::timeout(STEP, answer).await.unwrap().unwrap(),
            DeliveryResult::Acked
        );
    }

    // A process that acks nothing: the 17th delivery waits 300 ms
    // (slow_consumer_timeout), then the process is cut off and everything
    // pending is handed back.
    let mut slow = register(&node, "slow").await;
    let mut answers = Vec::new();
    for n in 0..17 {
        answers.push(
            node.gateway
                .deliver("slow", format!("t/0/{n}"), message("x"))
                .await
                .unwrap(),
        );
    }
    for answer in answers {
        assert!(matches!(
            tokio::time::timeout(STEP, answer).await.unwrap().unwrap(),
            DeliveryResult::Lost(_)
        ));
    }
    // The client is told why, after the deliveries already on their way.
    loop {
        match next(&mut slow).await.expect("closed without a reason").kind {
            Some(Kind::Deliver(_)) => continue,
            Some(Kind::Error(error)) => {
                assert_eq!(error.code, ErrorCode::SlowConsumer as i32);
                assert!(
                    error.message.contains("unacknowledged"),
                    "{}",
                    error.message
                );
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    wait_until(|| node.gateway.session("slow").is_none()).await;
}

/// Log lines written while the guard lives, on this thread (the test's
/// current-thread runtime runs the gateway's tasks here too).
fn capture_logs() -> (
    Arc<std::sync::Mutex<Vec<u8>>>,
    tracing::subscriber::DefaultGuard,
) {
    #[derive(Clone)]
    struct Sink(Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Sink {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buffer = Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = Sink(buffer.clone());
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || sink.clone())
        .finish();
    (buffer, tracing::subscriber::set_default(subscriber))
}

#[tokio::test]
async fn a_hello_without_a_valid_token_is_refused_and_leaves_the_registered_process_alone() {
    let (logs, _guard) = capture_logs();
    let node = start(options()).await;
    let mut registered = register(&node, "p-1").await;
    let p2_token = token(KEY, "p-2");
    let expired = token_with_claims(KEY, serde_json::json!({"sub": "p-1", "exp": now() - 60}));
    let not_yet = token_with_claims(
        KEY,
        serde_json::json!({"sub": "p-1", "exp": now() + 600, "nbf": now() + 300}),
    );
    let unknown_key = token("another-key-that-this-node-does-not-trust", "p-1");
    let attempts = [
        ("", "missing", "a token is required"),
        ("garbage", "malformed", "malformed"),
        (expired.as_str(), "expired", "expired"),
        (not_yet.as_str(), "not_yet_valid", "not valid yet"),
        (
            unknown_key.as_str(),
            "unknown_key",
            "not valid for any HS256 key",
        ),
        (
            p2_token.as_str(),
            "wrong_process",
            "for process `p-2`, not `p-1`",
        ),
    ];
    for (token, reason, says) in attempts {
        let mut intruder = connect(&node).await;
        intruder
            .send(hello_with_token("p-1", 1, token))
            .await
            .unwrap();
        let why = expect_error_and_close(&mut intruder, ErrorCode::Unauthorized).await;
        assert!(why.contains(says), "{reason}: {why}");
        assert_eq!(node.refused.refused_count(reason), 1, "{reason}");
    }
    // A token for p-1 does not register p-2 either.
    let mut conn = connect(&node).await;
    conn.send(hello_with_token("p-2", 1, &token(KEY, "p-1")))
        .await
        .unwrap();
    expect_error_and_close(&mut conn, ErrorCode::Unauthorized).await;
    assert!(node.gateway.session("p-2").is_none());

    // The registered process was neither replaced nor disturbed.
    assert_eq!(node.gateway.stats().replaced(), 0);
    assert_eq!(node.gateway.connection_count(), 1);
    still_served(&node, &mut registered, "p-1").await;

    let logs = String::from_utf8(logs.lock().unwrap().clone()).unwrap();
    assert!(logs.contains("refusing a client"), "{logs}");
    for (token, _, _) in attempts.iter().filter(|(t, _, _)| t.len() > 10) {
        assert!(!logs.contains(token), "a token was logged:\n{logs}");
    }
    node.stop.cancel();
}

#[tokio::test]
async fn a_rotated_key_file_is_picked_up() {
    let node = start(options()).await;
    let new_key = "the-next-gateway-key-0123456789abcdef";
    let old_token = token(KEY, "p-1");
    let new_token = token(new_key, "p-1");
    // A file that does not load (too short) keeps the key in use.
    std::fs::write(&node.key_file, "short").unwrap();
    tokio::time::sleep(wasmrelay::gateway::auth::KEY_POLL * 2).await;
    let mut conn = connect(&node).await;
    conn.send(hello_with_token("p-1", 1, &old_token))
        .await
        .unwrap();
    assert!(matches!(
        next(&mut conn).await.unwrap().kind,
        Some(Kind::Welcome(_))
    ));
    drop(conn);

    std::fs::write(&node.key_file, new_key).unwrap();
    let accepted = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let mut conn = connect(&node).await;
            conn.send(hello_with_token("p-1", 1, &new_token))
                .await
                .unwrap();
            if let Some(Kind::Welcome(_)) = next(&mut conn).await.unwrap().kind {
                return conn;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("a token of the new key was not accepted within 10 s");
    drop(accepted);
    let mut conn = connect(&node).await;
    conn.send(hello_with_token("p-1", 1, &old_token))
        .await
        .unwrap();
    expect_error_and_close(&mut conn, ErrorCode::Unauthorized).await;
    node.stop.cancel();
}

#[tokio::test]
async fn no_hello_in_time_is_refused() {
    let node = start(options()).await;
    let mut conn = connect(&node).await;
    let why = expect_error_and_close(&mut conn, ErrorCode::IdleTimeout).await;
    assert!(why.contains("Hello"), "{why}");
}

/// Sends `process_id` elsewhere when it starts with `away-`.
struct AwayPlacement;

impl wasmrelay::gateway::PlacementPolicy for AwayPlacement {
    fn place(
        &self,
        process_id: &str,
        _local_connections: usize,
    ) -> BoxFuture<'static, wasmrelay::gateway::Placement> {
        let placement = if process_id.starts_with("away-") {
            wasmrelay::gateway::Placement::Elsewhere {
                node_id: "node-b".to_string(),
                address: "10.0.0.2:7400".to_string(),
            }
        } else {
            wasmrelay::gateway::Placement::Here
        };
        futures::future::ready(placement).boxed()
    }
}

/// A Hello for `process_id` that says whether it follows redirects and
/// how many it followed.
fn placed_hello(process_id: &str, accepts_redirect: bool, redirects: u32) -> Frame {
    Frame::of(Kind::Hello(v1::Hello {
        protocol_version: 1,
        process_id: process_id.to_string(),
        client_name: "test".to_string(),
        accepts_redirect,
        token: token(KEY, process_id),
        redirects,
    }))
}

#[tokio::test]
async fn connections_over_the_cap_are_closed_at_once_and_a_freed_slot_is_taken_again() {
    let node = start(GatewayOptions {
        max_connections: 2,
        ..options()
    })
    .await;
    let p1 = register(&node, "p-1").await;
    // Counted from accept: one that has not said Hello holds a slot too.
    let silent = connect(&node).await;
    let mut over = connect(&node).await;
    assert!(
        next(&mut over).await.is_none(),
        "a third connection was served"
    );
    drop(p1);
    wait_until(|| node.gateway.session("p-1").is_none()).await;
    // The freed slot serves the next one (the closing may take a moment).
    let mut served = false;
    for _ in 0..50 {
        let mut conn = connect(&node).await;
        conn.send(hello("p-2", 1)).await.unwrap();
        if let Some(Ok(frame)) = tokio::time::timeout(STEP, conn.next()).await.unwrap()
            && matches!(frame.kind, Some(Kind::Welcome(_)))
        {
            served = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(served, "no slot came free");
    drop(silent);
    node.stop.cancel();
}

#[tokio::test]
async fn a_node_at_its_quota_refuses_new_processes_but_takes_back_its_own() {
    let node = start(GatewayOptions {
        quota: 2,
        ..options()
    })
    .await;
    let _p1 = register(&node, "p-1").await;
    let _p2 = register(&node, "p-2").await;
    let mut p3 = connect(&node).await;
    p3.send(hello("p-3", 1)).await.unwrap();
    let reason = expect_error_and_close(&mut p3, ErrorCode::NodeFull).await;
    assert!(reason.contains("quota of 2"), "{reason}");
    assert!(node.gateway.session("p-3").is_none());
    assert_eq!(node.gateway.stats().refused_full(), 1);
    // p-1 again (a reconnect or a takeover) is no new process.
    let _again = register(&node, "p-1").await;
    assert_eq!(node.gateway.connection_count(), 2);
}

#[tokio::test]
async fn a_client_that_follows_redirects_is_placed_once_and_a_redirected_hello_is_taken() {
    let node = start(options()).await;
    node.gateway.set_placement(Arc::new(AwayPlacement));

    let mut away = connect(&node).await;
    away.send(placed_hello("away-1", true, 0)).await.unwrap();
    let Some(Kind::Redirect(redirect)) = next(&mut away).await.unwrap().kind else {
        panic!("expected a redirect");
    };
    assert_eq!(redirect.addresses, vec!["10.0.0.2:7400".to_string()]);
    assert!(redirect.reason.contains("node-b"), "{}", redirect.reason);
    assert!(
        next(&mut away).await.is_none(),
        "not closed after the redirect"
    );
    assert!(node.gateway.session("away-1").is_none());
    assert_eq!(node.gateway.stats().redirected(), 1);

    // Redirected here already, or not following redirects: taken here,
    // whatever the policy says (no loops).
    for (id, accepts, redirects) in [("away-2", true, 1), ("away-3", false, 0)] {
        let mut conn = connect(&node).await;
        conn.send(placed_hello(id, accepts, redirects))
            .await
            .unwrap();
        assert!(
            matches!(next(&mut conn).await.unwrap().kind, Some(Kind::Welcome(_))),
            "{id} was not welcomed"
        );
    }
    let mut here = connect(&node).await;
    here.send(placed_hello("p-1", true, 0)).await.unwrap();
    assert!(matches!(
        next(&mut here).await.unwrap().kind,
        Some(Kind::Welcome(_))
    ));
    assert_eq!(node.gateway.stats().redirected(), 1);
}
