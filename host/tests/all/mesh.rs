//! The mesh between relay nodes over real TCP: nodes (a mesh and a gateway
//! each) in one test process, business processes as raw frame clients of
//! the gateways, and raw mesh connections for what a misbehaving peer
//! sends: forwarding and its outcomes, order, authentication, broken and
//! silent peers, bad input while the other links go on working, a man
//! in the middle (a TCP proxy between two nodes) that relays, alters or
//! answers frames, and lookups of a process no route names (alone, and as
//! the miss path of a cluster delivery).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{FutureExt as _, SinkExt as _, StreamExt as _};
use tokio::io::AsyncWriteExt as _;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_util::codec::{Decoder, Framed};
use tokio_util::sync::CancellationToken;
use wasmrelay::cluster::mesh::{
    FORWARDS_WAITING_PER_PROCESS, ForwardOutcome, Forwarded, LookupAnswerer, LookupFound, Mesh,
    MeshError, MeshOptions,
};
use wasmrelay::gateway::{Gateway, GatewayOptions, Upstream, UpstreamError};
use wasmrelay_protocol::mesh_auth::{
    MeshCodec, SessionKeys, hello_mac, seal, verify_welcome, welcome_mac,
};
use wasmrelay_protocol::v1::{self, ErrorCode};
use wasmrelay_protocol::{Frame, FrameCodec, Kind, Parcel};

const STEP: Duration = Duration::from_secs(5);
const SECRET: &[u8] = b"the cluster secret";
const KEEPALIVE: Duration = Duration::from_millis(200);
const MAX_FRAME: usize = 64 * 1024;
/// Long, so that a lookup that ends sooner shows every peer answered.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(3);

struct NoUpstream;

impl Upstream for NoUpstream {
    fn send(
        &self,
        _process_id: &str,
        _send: v1::Send,
    ) -> BoxFuture<'static, Result<wasmrelay::gateway::Accepted, UpstreamError>> {
        async {
            Err(UpstreamError::Refused(
                "no upstream in this test".to_string(),
            ))
        }
        .boxed()
    }
}

/// A relay node as far as the mesh is concerned: its gateway and its mesh.
struct Node {
    id: String,
    gateway: Arc<Gateway>,
    gateway_addr: SocketAddr,
    mesh: Arc<Mesh>,
    mesh_addr: SocketAddr,
    stop: CancellationToken,
    serving: JoinHandle<()>,
}

fn mesh_options(id: &str, secret: &[u8]) -> MeshOptions {
    MeshOptions {
        node_id: id.to_string(),
        secret: secret.to_vec(),
        max_frame_bytes: MAX_FRAME,
        link_queue: 1024,
        connect_timeout: Duration::from_secs(1),
        keepalive: KEEPALIVE,
        reconnect_backoff: (Duration::from_millis(20), Duration::from_millis(200)),
        lookup_timeout: LOOKUP_TIMEOUT,
        tls: None,
    }
}

async fn start(id: &str, secret: &[u8]) -> Node {
    start_on(mesh_options(id, secret), "127.0.0.1:0".parse().unwrap()).await
}

async fn start_on(options: MeshOptions, mesh_addr: SocketAddr) -> Node {
    let id = options.node_id.clone();
    let gateway = Gateway::new(
        GatewayOptions {
            node_id: id.clone(),
            keepalive: Duration::from_secs(10),
            hello_timeout: Duration::from_secs(2),
            send_queue: 256,
            max_unacked: 256,
            slow_consumer_timeout: Duration::from_secs(5),
            max_frame_bytes: MAX_FRAME,
            tls: None,
            quota: usize::MAX,
            max_connections: 1000,
        },
        // The mesh is under test here, not client authentication.
        wasmrelay::gateway::ClientAuth::none(),
        Arc::new(NoUpstream),
        None,
    );
    let stop = CancellationToken::new();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gateway_addr = listener.local_addr().unwrap();
    tokio::spawn(gateway.clone().serve(listener, stop.clone()));
    let mesh = Mesh::new(options, gateway.clone());
    let listener = TcpListener::bind(mesh_addr).await.unwrap();
    let mesh_addr = listener.local_addr().unwrap();
    let serving = tokio::spawn(mesh.clone().serve(listener, stop.clone()));
    Node {
        id,
        gateway,
        gateway_addr,
        mesh,
        mesh_addr,
        stop,
        serving,
    }
}

impl Node {
    /// Stops the node (mesh listener, links, gateway) and waits until its
    /// mesh listener is closed.
    async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(STEP, self.serving)
            .await
            .expect("the mesh did not stop within 5 s")
            .unwrap();
    }
}

/// Tells every node about every other.
fn link_all(nodes: &[&Node]) {
    for node in nodes {
        node.mesh.set_peers(
            nodes
                .iter()
                .map(|peer| (peer.id.clone(), peer.mesh_addr.to_string()))
                .collect(),
        );
    }
}

fn peers(nodes: &[&Node]) -> BTreeMap<String, String> {
    nodes
        .iter()
        .map(|node| (node.id.clone(), node.mesh_addr.to_string()))
        .collect()
}

async fn wait_linked(node: &Node, peers: &[&str]) {
    tokio::time::timeout(STEP, node.mesh.wait_linked(peers))
        .await
        .unwrap_or_else(|_| {
            panic!(
                "node {} not linked to {peers:?} within 5 s (linked: {:?})",
                node.id,
                node.mesh.linked()
            )
        });
}

async fn wait_until(what: &str, done: impl Fn() -> bool) {
    tokio::time::timeout(STEP, async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what}: not within 5 s"));
}

async fn outcome(answer: Forwarded) -> ForwardOutcome {
    tokio::time::timeout(STEP, answer)
        .await
        .expect("no outcome within 5 s")
        .expect("the outcome was dropped")
}

fn message(value: &str) -> v1::Message {
    v1::Message {
        value: Bytes::from(value.to_string()),
        ..v1::Message::default()
    }
}

/// A business process's connection.
type Conn = Framed<TcpStream, FrameCodec>;
/// A raw mesh connection: plain until sealed after the handshake.
type MeshConn = Framed<TcpStream, MeshCodec>;

async fn next<C>(conn: &mut Framed<TcpStream, C>) -> Option<Frame>
where
    C: Decoder<Item = Frame>,
    C::Error: std::fmt::Debug,
{
    tokio::time::timeout(STEP, conn.next())
        .await
        .expect("no frame within 5 s")
        .map(Result::unwrap)
}

/// A business process registered on `node`'s gateway.
async fn register(node: &Node, process_id: &str) -> Conn {
    let mut conn = Framed::new(
        TcpStream::connect(node.gateway_addr).await.unwrap(),
        FrameCodec::new(MAX_FRAME),
    );
    conn.send(Frame::of(Kind::Hello(v1::Hello {
        protocol_version: 1,
        process_id: process_id.to_string(),
        client_name: "test".to_string(),
        accepts_redirect: false,
        ..Default::default()
    })))
    .await
    .unwrap();
    assert!(matches!(
        next(&mut conn).await.unwrap().kind,
        Some(Kind::Welcome(_))
    ));
    wait_until("the process registered", || {
        node.gateway.session(process_id).is_some()
    })
    .await;
    conn
}

/// Takes the next delivery on `conn` and acks it.
async fn ack_next(conn: &mut Conn) -> v1::Deliver {
    let deliver = next_delivery(conn).await;
    conn.send(Frame::of(Kind::Ack(v1::Ack { seq: deliver.seq })))
        .await
        .unwrap();
    deliver
}

async fn next_delivery(conn: &mut Conn) -> v1::Deliver {
    match next(conn).await.expect("closed").kind {
        Some(Kind::Deliver(deliver)) => deliver,
        other => panic!("expected a delivery, got {other:?}"),
    }
}

/// The connection's next frame is an error with `code`, then it closes.
async fn expect_error_and_close<C>(conn: &mut Framed<TcpStream, C>, code: ErrorCode) -> String
where
    C: Decoder<Item = Frame>,
    C::Error: std::fmt::Debug,
{
    let frame = next(conn).await.expect("closed without an error frame");
    let Some(Kind::Error(error)) = frame.kind else {
        panic!("expected an error, got {frame:?}");
    };
    assert_eq!(error.code, code as i32, "{}", error.message);
    assert!(next(conn).await.is_none(), "not closed after the error");
    error.message
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// A `MeshHello` from a dialer that takes no sealed batches (as a node of
/// an earlier version).
fn mesh_hello(from: &str, to: &str, secret: &[u8], nonce: [u8; 16], time_ms: i64) -> Frame {
    Frame::of(Kind::MeshHello(v1::MeshHello {
        protocol_version: 1,
        node_id: from.to_string(),
        to_node_id: to.to_string(),
        nonce: Bytes::copy_from_slice(&nonce),
        time_ms,
        mac: hello_mac(secret, from, to, &nonce, time_ms).into(),
        takes_sealed_batches: false,
    }))
}

async fn raw_mesh(node: &Node) -> MeshConn {
    Framed::new(
        TcpStream::connect(node.mesh_addr).await.unwrap(),
        MeshCodec::new(MAX_FRAME),
    )
}

/// A raw connection to `node`'s mesh port, authenticated as node `x`,
/// sealing and opening frames from then on.
async fn raw_linked(node: &Node, nonce: [u8; 16]) -> MeshConn {
    raw_linked_taking_batches(node, nonce, false).await
}

/// [`raw_linked`], saying whether it takes sealed batches.
async fn raw_linked_taking_batches(node: &Node, nonce: [u8; 16], takes: bool) -> MeshConn {
    let mut conn = raw_mesh(node).await;
    let mut hello = mesh_hello("x", &node.id, SECRET, nonce, now_ms());
    if let Some(Kind::MeshHello(hello)) = &mut hello.kind {
        hello.takes_sealed_batches = takes;
    }
    conn.send(hello).await.unwrap();
    match next(&mut conn).await.expect("closed").kind {
        Some(Kind::MeshWelcome(welcome)) => {
            assert_eq!(welcome.node_id, node.id);
            assert!(welcome.takes_sealed_batches, "a node takes sealed batches");
            verify_welcome(SECRET, &welcome, "x", &nonce).unwrap();
            let keys = SessionKeys::derive(SECRET, "x", &node.id, &nonce, &welcome.nonce);
            conn.codec_mut().seal_with(keys.for_dialer());
        }
        other => panic!("expected a MeshWelcome, got {other:?}"),
    }
    conn
}

#[tokio::test]
async fn forwards_reach_a_process_on_another_node_in_order_and_their_acks_come_back() {
    let a = start("a", SECRET).await;
    let b = start("b", SECRET).await;
    link_all(&[&a, &b]);
    wait_linked(&a, &["b"]).await;
    wait_linked(&b, &["a"]).await;
    assert_eq!(a.mesh.linked(), vec!["b".to_string()]);
    assert_eq!(b.mesh.linked(), vec!["a".to_string()]);

    let mut process = register(&b, "p-1").await;
    let answers: Vec<_> = (0..100)
        .map(|n| {
            let mut message = message(&format!("m{n}"));
            message.key = Some(Bytes::from(format!("k{n}")));
            message.headers = vec![v1::Header {
                name: "h".to_string(),
                value: Bytes::from_static(b"v"),
            }];
            message.offset = n;
            a.mesh
                .try_forward("b", "p-1", format!("t/0/{n}"), message)
                .unwrap()
        })
        .collect();
    let mut seqs = Vec::new();
    for n in 0..100 {
        let deliver = next_delivery(&mut process).await;
        assert_eq!(deliver.delivery_id, format!("t/0/{n}"), "out of order");
        let message = deliver.message.unwrap();
        assert_eq!(message.value, format!("m{n}"));
        assert_eq!(message.key.unwrap(), format!("k{n}"));
        assert_eq!(message.headers[0].name, "h");
        assert_eq!(message.offset, n);
        seqs.push(deliver.seq);
    }
    // Acks go back in whatever order the process answers.
    for seq in seqs.into_iter().rev() {
        process
            .send(Frame::of(Kind::Ack(v1::Ack { seq })))
            .await
            .unwrap();
    }
    for answer in answers {
        assert_eq!(outcome(answer).await, ForwardOutcome::Delivered);
    }
    assert_eq!(a.mesh.stats().forwards_sent(), 100);
    assert_eq!(a.mesh.stats().forwards_delivered(), 100);
    assert_eq!(b.mesh.stats().forwards_received(), 100);

    // The other way round, on B's own link to A.
    let mut other = register(&a, "p-2").await;
    let answer = b
        .mesh
        .try_forward("a", "p-2", "t/1/0".to_string(), message("back"))
        .unwrap();
    ack_next(&mut other).await;
    assert_eq!(outcome(answer).await, ForwardOutcome::Delivered);
    assert_eq!(b.mesh.stats().forwards_delivered(), 1);
}

#[tokio::test]
async fn a_process_that_does_not_keep_up_holds_back_only_its_own_forwards() {
    let a = start("a", SECRET).await;
    let b = start("b", SECRET).await;
    link_all(&[&a, &b]);
    wait_linked(&a, &["b"]).await;
    // `slow` never acks: past its 256 unacknowledged deliveries, forwards
    // to it wait on B (until the slow-consumer timeout, 5 s).
    let _slow = register(&b, "slow").await;
    let mut fast = register(&b, "fast").await;
    let waiting: Vec<_> = (0..300)
        .map(|n| {
            a.mesh
                .try_forward("b", "slow", format!("t/0/{n}"), message("for slow"))
                .unwrap()
        })
        .collect();
    let started = std::time::Instant::now();
    let answers: Vec<_> = (0..20)
        .map(|n| {
            a.mesh
                .try_forward("b", "fast", format!("t/1/{n}"), message("for fast"))
                .unwrap()
        })
        .collect();
    for n in 0..20 {
        let deliver = next_delivery(&mut fast).await;
        assert_eq!(deliver.delivery_id, format!("t/1/{n}"), "out of order");
        fast.send(Frame::of(Kind::Ack(v1::Ack { seq: deliver.seq })))
            .await
            .unwrap();
    }
    for answer in answers {
        assert_eq!(outcome(answer).await, ForwardOutcome::Delivered);
    }
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the fast process waited {:?} behind the slow one",
        started.elapsed()
    );
    assert_eq!(a.mesh.linked(), vec!["b".to_string()], "the link broke");
    drop(waiting);
}

#[tokio::test]
async fn a_sender_keeps_no_more_forwards_to_a_process_unanswered_than_its_peer_holds() {
    let a = start("a", SECRET).await;
    let b = start("b", SECRET).await;
    link_all(&[&a, &b]);
    wait_linked(&a, &["b"]).await;
    let mut process = register(&b, "p-1").await;
    // More than B holds for one process: 256 with the process (its
    // `max_unacked`) and 1,024 waiting; without a window at A, B would
    // refuse the rest and A would have to retry them.
    let total = FORWARDS_WAITING_PER_PROCESS + 400;
    let sender = {
        let mesh = a.mesh.clone();
        tokio::spawn(async move {
            let mut answers = Vec::new();
            for n in 0..total {
                let parcel = Arc::new(Parcel {
                    process_id: "p-1".to_string(),
                    delivery_id: format!("t/0/{n}"),
                    message: message("x").into(),
                });
                let answer = mesh.forward("b", parcel).await.unwrap();
                answers.push(answer);
            }
            answers
        })
    };
    wait_until("A sends a full window", || {
        a.mesh.stats().forwards_sent() == FORWARDS_WAITING_PER_PROCESS as u64
    })
    .await;
    // The process has not answered: the next forward waits at A.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        a.mesh.stats().forwards_sent(),
        FORWARDS_WAITING_PER_PROCESS as u64,
        "A sent past the window while nothing was answered"
    );
    assert!(!sender.is_finished());
    match a
        .mesh
        .try_forward("b", "p-1", "t/1/0".to_string(), message("x"))
    {
        Err(MeshError::WindowFull {
            node_id,
            process_id,
            window,
        }) => {
            assert_eq!((node_id.as_str(), process_id.as_str()), ("b", "p-1"));
            assert_eq!(window, FORWARDS_WAITING_PER_PROCESS);
        }
        other => panic!("expected WindowFull, got {other:?}"),
    }
    // Another process has a window of its own.
    let mut other = register(&b, "p-2").await;
    let answer = a
        .mesh
        .try_forward("b", "p-2", "t/2/0".to_string(), message("y"))
        .unwrap();
    ack_next(&mut other).await;
    assert_eq!(outcome(answer).await, ForwardOutcome::Delivered);

    // As the process answers, the rest go, in order, and none is refused.
    for n in 0..total {
        let deliver = next_delivery(&mut process).await;
        assert_eq!(deliver.delivery_id, format!("t/0/{n}"), "out of order");
        process
            .send(Frame::of(Kind::Ack(v1::Ack { seq: deliver.seq })))
            .await
            .unwrap();
    }
    let answers = tokio::time::timeout(STEP, sender).await.unwrap().unwrap();
    for answer in answers {
        assert_eq!(outcome(answer).await, ForwardOutcome::Delivered);
    }
    assert_eq!(a.mesh.stats().forwards_failed(), 0, "B refused forwards");
    assert_eq!(a.mesh.stats().forwards_delivered(), total as u64 + 1);
}

#[tokio::test]
async fn an_unknown_process_is_not_here_and_a_nack_or_a_lost_connection_fails() {
    let a = start("a", SECRET).await;
    let b = start("b", SECRET).await;
    link_all(&[&a, &b]);
    wait_linked(&a, &["b"]).await;

    let answer = a
        .mesh
        .try_forward("b", "nobody", "t/0/0".to_string(), message("x"))
        .unwrap();
    match outcome(answer).await {
        ForwardOutcome::NotHere(reason) => assert!(reason.contains("nobody"), "{reason}"),
        other => panic!("expected NotHere, got {other:?}"),
    }

    let mut process = register(&b, "p-1").await;
    let answer = a
        .mesh
        .try_forward("b", "p-1", "t/0/1".to_string(), message("x"))
        .unwrap();
    let deliver = next_delivery(&mut process).await;
    process
        .send(Frame::of(Kind::Nack(v1::Nack {
            seq: deliver.seq,
            reason: "too busy".to_string(),
        })))
        .await
        .unwrap();
    match outcome(answer).await {
        ForwardOutcome::Failed(reason) => assert!(reason.contains("too busy"), "{reason}"),
        other => panic!("expected Failed, got {other:?}"),
    }

    // The process goes away before it answers.
    let answer = a
        .mesh
        .try_forward("b", "p-1", "t/0/2".to_string(), message("x"))
        .unwrap();
    next_delivery(&mut process).await;
    drop(process);
    match outcome(answer).await {
        ForwardOutcome::Failed(reason) => assert!(reason.contains("connection ended"), "{reason}"),
        other => panic!("expected Failed, got {other:?}"),
    }
    assert_eq!(a.mesh.stats().forwards_not_here(), 1);
    assert_eq!(a.mesh.stats().forwards_failed(), 2);

    // Refused before anything is sent: an unknown node, a frame too large.
    assert_eq!(
        a.mesh
            .try_forward("zzz", "p-1", "t/0/3".to_string(), message("x"))
            .unwrap_err(),
        MeshError::UnknownNode("zzz".to_string())
    );
    let huge = message(&"x".repeat(MAX_FRAME));
    assert!(matches!(
        a.mesh.try_forward("b", "p-1", "t/0/4".to_string(), huge),
        Err(MeshError::TooLarge { max: MAX_FRAME, .. })
    ));
    // Neither hurt the link.
    let answer = a
        .mesh
        .try_forward("b", "nobody", "t/0/5".to_string(), message("x"))
        .unwrap();
    assert!(matches!(outcome(answer).await, ForwardOutcome::NotHere(_)));
    assert_eq!(a.mesh.stats().links_established(), 1);
}

#[tokio::test]
async fn nodes_with_a_different_secret_never_link_and_the_right_secret_does() {
    let a = start("a", SECRET).await;
    let b = start("b", b"not the cluster secret").await;
    link_all(&[&a, &b]);
    // Each refuses the other's hello, again and again.
    wait_until("both sides refused a hello", || {
        a.mesh.stats().unauthorized() >= 2 && b.mesh.stats().unauthorized() >= 2
    })
    .await;
    assert!(
        tokio::time::timeout(Duration::from_secs(2), a.mesh.wait_linked(&["b"]))
            .await
            .is_err(),
        "a linked to b without the secret"
    );
    assert!(a.mesh.linked().is_empty());
    assert!(b.mesh.linked().is_empty());
    assert_eq!(a.mesh.stats().links_accepted(), 0);
    assert_eq!(b.mesh.stats().links_accepted(), 0);
    assert!(a.mesh.stats().dial_failures() >= 2);
    assert_eq!(
        a.mesh
            .try_forward("b", "p", "t/0/0".to_string(), message("x"))
            .unwrap_err(),
        MeshError::NotLinked("b".to_string())
    );

    // A node with the right secret links with a (and b still does not).
    let c = start("c", SECRET).await;
    a.mesh.set_peers(peers(&[&b, &c]));
    c.mesh.set_peers(peers(&[&a]));
    wait_linked(&a, &["c"]).await;
    wait_linked(&c, &["a"]).await;
    assert_eq!(a.mesh.linked(), vec!["c".to_string()]);
}

#[tokio::test]
async fn the_acceptor_checks_every_part_of_the_hello() {
    let b = start("b", SECRET).await;

    // A good hello is welcomed with a MAC over its nonce; pings answered.
    let nonce = [7u8; 16];
    let time_ms = now_ms();
    let mut conn = raw_mesh(&b).await;
    conn.send(mesh_hello("x", "b", SECRET, nonce, time_ms))
        .await
        .unwrap();
    let Some(Kind::MeshWelcome(welcome)) = next(&mut conn).await.unwrap().kind else {
        panic!("expected a MeshWelcome");
    };
    assert_eq!(welcome.node_id, "b");
    assert_eq!(welcome.nonce.len(), 16);
    assert_eq!(
        welcome.mac,
        welcome_mac(SECRET, "b", "x", &nonce, &welcome.nonce)
    );
    let keys = SessionKeys::derive(SECRET, "x", "b", &nonce, &welcome.nonce);
    conn.codec_mut().seal_with(keys.for_dialer());
    conn.send(Frame::of(Kind::Ping(v1::Ping { nonce: 9 })))
        .await
        .unwrap();
    assert!(matches!(
        next(&mut conn).await.unwrap().kind,
        Some(Kind::Pong(v1::Pong { nonce: 9 }))
    ));
    // A dialer may not answer forwards.
    conn.send(Frame::of(Kind::ForwardAck(v1::ForwardAck::default())))
        .await
        .unwrap();
    expect_error_and_close(&mut conn, ErrorCode::ProtocolViolation).await;

    // After the handshake, an unsealed frame is refused.
    let mut conn = raw_linked(&b, [8; 16]).await;
    let plain = FrameCodec::new(MAX_FRAME)
        .encode_to_vec(&Frame::of(Kind::Ping(v1::Ping { nonce: 1 })))
        .unwrap();
    conn.get_mut().write_all(&plain).await.unwrap();
    let why = expect_error_and_close(&mut conn, ErrorCode::Unauthorized).await;
    assert!(why.contains("unsealed"), "{why}");

    // The same hello again is a replay.
    let mut conn = raw_mesh(&b).await;
    conn.send(mesh_hello("x", "b", SECRET, nonce, time_ms))
        .await
        .unwrap();
    let why = expect_error_and_close(&mut conn, ErrorCode::Unauthorized).await;
    assert!(why.contains("used before"), "{why}");

    // Meant for another node.
    let mut conn = raw_mesh(&b).await;
    conn.send(mesh_hello("x", "c", SECRET, [1; 16], now_ms()))
        .await
        .unwrap();
    let why = expect_error_and_close(&mut conn, ErrorCode::Unauthorized).await;
    assert!(why.contains("`c`"), "{why}");

    // The wrong secret.
    let mut conn = raw_mesh(&b).await;
    conn.send(mesh_hello("x", "b", b"guess", [2; 16], now_ms()))
        .await
        .unwrap();
    let why = expect_error_and_close(&mut conn, ErrorCode::Unauthorized).await;
    assert!(why.contains("secret"), "{why}");

    // Ten minutes old.
    let mut conn = raw_mesh(&b).await;
    conn.send(mesh_hello("x", "b", SECRET, [3; 16], now_ms() - 600_000))
        .await
        .unwrap();
    let why = expect_error_and_close(&mut conn, ErrorCode::Unauthorized).await;
    assert!(why.contains("clocks"), "{why}");

    // Another version; something other than a hello first.
    let mut conn = raw_mesh(&b).await;
    let Some(Kind::MeshHello(mut hello)) = mesh_hello("x", "b", SECRET, [4; 16], now_ms()).kind
    else {
        unreachable!()
    };
    hello.protocol_version = 2;
    conn.send(Frame::of(Kind::MeshHello(hello))).await.unwrap();
    expect_error_and_close(&mut conn, ErrorCode::UnsupportedVersion).await;
    let mut conn = raw_mesh(&b).await;
    conn.send(Frame::of(Kind::Forward(v1::Forward::default())))
        .await
        .unwrap();
    expect_error_and_close(&mut conn, ErrorCode::ProtocolViolation).await;

    assert_eq!(b.mesh.stats().unauthorized(), 5);
    assert_eq!(b.mesh.stats().links_accepted(), 2);
}

#[tokio::test]
async fn a_stopped_peer_loses_the_pending_forwards_and_is_linked_again_when_back() {
    let a = start("a", SECRET).await;
    let b = start("b", SECRET).await;
    link_all(&[&a, &b]);
    wait_linked(&a, &["b"]).await;
    wait_linked(&b, &["a"]).await;

    let mut process = register(&b, "p-1").await;
    let answers: Vec<_> = (0..3)
        .map(|n| {
            a.mesh
                .try_forward("b", "p-1", format!("t/0/{n}"), message("x"))
                .unwrap()
        })
        .collect();
    for _ in 0..3 {
        next_delivery(&mut process).await; // and never answered
    }

    let b_mesh = b.mesh.clone();
    let b_addr = b.mesh_addr;
    b.stop().await;
    for answer in answers {
        match outcome(answer).await {
            ForwardOutcome::Lost(reason) => assert!(reason.contains("`b`"), "{reason}"),
            other => panic!("expected Lost, got {other:?}"),
        }
    }
    assert_eq!(a.mesh.stats().forwards_lost(), 3);
    wait_until("a's link to b is down", || a.mesh.linked().is_empty()).await;
    assert_eq!(
        a.mesh
            .try_forward("b", "p-1", "t/0/9".to_string(), message("x"))
            .unwrap_err(),
        MeshError::NotLinked("b".to_string())
    );
    // The stopped node's own links are closed too.
    assert!(b_mesh.linked().is_empty());
    assert_eq!(
        b_mesh
            .try_forward("a", "p-1", "t/0/9".to_string(), message("x"))
            .unwrap_err(),
        MeshError::Closed
    );

    // B comes back on the same address; A links again by itself.
    let b = start_on(mesh_options("b", SECRET), b_addr).await;
    wait_linked(&a, &["b"]).await;
    assert!(a.mesh.stats().links_established() >= 2);
    let mut process = register(&b, "p-1").await;
    let answer = a
        .mesh
        .try_forward("b", "p-1", "t/0/0".to_string(), message("again"))
        .unwrap();
    let deliver = next_delivery(&mut process).await;
    assert_eq!(deliver.delivery_id, "t/0/0");
    process
        .send(Frame::of(Kind::Ack(v1::Ack { seq: deliver.seq })))
        .await
        .unwrap();
    assert_eq!(outcome(answer).await, ForwardOutcome::Delivered);
}

#[tokio::test]
async fn a_dropped_peer_loses_the_pending_forwards_and_is_no_longer_dialled() {
    let a = start("a", SECRET).await;
    let b = start("b", SECRET).await;
    a.mesh.set_peers(peers(&[&a, &b]));
    wait_linked(&a, &["b"]).await;
    let mut process = register(&b, "p-1").await;
    let answer = a
        .mesh
        .try_forward("b", "p-1", "t/0/0".to_string(), message("x"))
        .unwrap();
    next_delivery(&mut process).await;

    // Idempotent: the same set again changes nothing.
    a.mesh.set_peers(peers(&[&a, &b]));
    assert_eq!(a.mesh.linked(), vec!["b".to_string()]);

    a.mesh.set_peers(BTreeMap::new());
    assert!(matches!(outcome(answer).await, ForwardOutcome::Lost(_)));
    assert!(a.mesh.linked().is_empty());
    assert_eq!(
        a.mesh
            .try_forward("b", "p-1", "t/0/1".to_string(), message("x"))
            .unwrap_err(),
        MeshError::UnknownNode("b".to_string())
    );
    wait_until("the link counted as closed", || {
        a.mesh.stats().links_broken() == 1
    })
    .await;

    a.mesh.set_peers(peers(&[&b]));
    wait_linked(&a, &["b"]).await;
    assert_eq!(b.mesh.stats().links_accepted(), 2);
}

#[tokio::test]
async fn bad_input_on_the_mesh_port_gets_an_error_frame_while_links_keep_working() {
    let a = start("a", SECRET).await;
    let b = start("b", SECRET).await;
    link_all(&[&a, &b]);
    wait_linked(&a, &["b"]).await;
    let mut process = register(&b, "p-1").await;

    // Garbage: a length that fits, bytes that are not a Frame.
    let mut raw = TcpStream::connect(b.mesh_addr).await.unwrap();
    raw.write_all(&[0, 0, 0, 4, 0xff, 0xff, 0xff, 0xff])
        .await
        .unwrap();
    let mut conn = Framed::new(raw, FrameCodec::new(MAX_FRAME));
    let why = expect_error_and_close(&mut conn, ErrorCode::BadFrame).await;
    assert!(why.contains("not a valid Frame"), "{why}");

    // A length over the maximum.
    let mut raw = TcpStream::connect(b.mesh_addr).await.unwrap();
    raw.write_all(&10_000_000u32.to_be_bytes()).await.unwrap();
    let mut conn = Framed::new(raw, FrameCodec::new(MAX_FRAME));
    expect_error_and_close(&mut conn, ErrorCode::FrameTooLarge).await;

    // Garbage after authenticating; a Forward without a message.
    let mut conn = raw_linked(&b, [5; 16]).await;
    conn.get_mut()
        .write_all(&[0, 0, 0, 2, 0xff, 0xff])
        .await
        .unwrap();
    expect_error_and_close(&mut conn, ErrorCode::BadFrame).await;
    let mut conn = raw_linked(&b, [6; 16]).await;
    conn.send(Frame::of(Kind::Forward(v1::Forward {
        seq: 1,
        process_id: "p-1".to_string(),
        delivery_id: "t/0/0".to_string(),
        message: None,
    })))
    .await
    .unwrap();
    expect_error_and_close(&mut conn, ErrorCode::ProtocolViolation).await;
    // A Forward whose message is not a valid `Message` (its topic is not
    // UTF-8): the node passes messages on undecoded, so it checks them.
    let mut conn = raw_linked(&b, [7; 16]).await;
    conn.send(Frame::of(Kind::Forward(v1::Forward {
        seq: 1,
        process_id: "p-1".to_string(),
        delivery_id: "t/0/0".to_string(),
        message: Some(Bytes::from_static(&[0x22, 0x02, 0xff, 0xfe])),
    })))
    .await
    .unwrap();
    expect_error_and_close(&mut conn, ErrorCode::BadFrame).await;
    assert!(b.mesh.stats().protocol_errors() >= 5);

    // Idle for several keepalive intervals: pings keep the link up.
    tokio::time::sleep(KEEPALIVE * 5).await;
    assert_eq!(a.mesh.linked(), vec!["b".to_string()]);
    assert_eq!(a.mesh.stats().links_established(), 1);
    assert_eq!(a.mesh.stats().links_broken(), 0);

    // The link between the nodes is untouched.
    let answer = a
        .mesh
        .try_forward("b", "p-1", "t/0/1".to_string(), message("fine"))
        .unwrap();
    ack_next(&mut process).await;
    assert_eq!(outcome(answer).await, ForwardOutcome::Delivered);
}

#[tokio::test]
async fn a_peer_that_stops_answering_is_dropped_after_three_keepalives_and_dialled_again() {
    let a = start("a", SECRET).await;
    // A peer that welcomes, then reads and never writes again.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mute_addr = listener.local_addr().unwrap();
    let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let mut conn = Framed::new(stream, MeshCodec::new(MAX_FRAME));
            let Some(Ok(frame)) = conn.next().await else {
                continue;
            };
            let Some(Kind::MeshHello(hello)) = frame.kind else {
                panic!("expected a MeshHello, got {frame:?}");
            };
            let nonce = [9u8; 16];
            conn.send(Frame::of(Kind::MeshWelcome(v1::MeshWelcome {
                node_id: "mute".to_string(),
                mac: welcome_mac(SECRET, "mute", &hello.node_id, &hello.nonce, &nonce).into(),
                nonce: Bytes::copy_from_slice(&nonce),
                takes_sealed_batches: false,
            })))
            .await
            .unwrap();
            let keys = SessionKeys::derive(SECRET, &hello.node_id, "mute", &hello.nonce, &nonce);
            conn.codec_mut().seal_with(keys.for_acceptor());
            let seen_tx = seen_tx.clone();
            tokio::spawn(async move {
                while let Some(Ok(frame)) = conn.next().await {
                    let _ = seen_tx.send(frame.kind_name());
                }
                let _ = seen_tx.send("closed");
            });
        }
    });

    a.mesh.set_peers(BTreeMap::from([(
        "mute".to_string(),
        mute_addr.to_string(),
    )]));
    wait_linked(&a, &["mute"]).await;
    let started = tokio::time::Instant::now();
    let answer = a
        .mesh
        .try_forward("mute", "p-1", "t/0/0".to_string(), message("x"))
        .unwrap();
    let mut kinds = Vec::new();
    while !kinds.contains(&"closed") {
        kinds.push(
            tokio::time::timeout(STEP, seen.recv())
                .await
                .expect("the mute peer's link was not closed within 5 s")
                .unwrap(),
        );
    }
    assert_eq!(kinds[0], "forward");
    assert!(kinds.contains(&"ping"), "{kinds:?}");
    match outcome(answer).await {
        ForwardOutcome::Lost(reason) => assert!(reason.contains("nothing received"), "{reason}"),
        other => panic!("expected Lost, got {other:?}"),
    }
    let silent = started.elapsed();
    assert!(
        silent >= KEEPALIVE * 3 - Duration::from_millis(50) && silent < KEEPALIVE * 10,
        "broken after {silent:?}"
    );
    // Told why before the close, then dialled again.
    assert!(kinds.contains(&"error"), "{kinds:?}");
    assert!(a.mesh.stats().links_broken() >= 1);
    wait_until("the mute peer was dialled again", || {
        a.mesh.stats().links_established() >= 2
    })
    .await;
}

#[tokio::test]
async fn an_accepted_link_that_sends_nothing_is_closed_after_three_keepalives() {
    let b = start("b", SECRET).await;
    // A dialer that pings every keepalive stays linked well past the
    // timeout (the acceptor's timer moves with what it receives)...
    let mut chatty = raw_linked(&b, [11; 16]).await;
    for nonce in 0..8 {
        tokio::time::sleep(KEEPALIVE).await;
        chatty
            .send(Frame::of(Kind::Ping(v1::Ping { nonce })))
            .await
            .unwrap();
        match next(&mut chatty).await.expect("closed").kind {
            Some(Kind::Pong(pong)) => assert_eq!(pong.nonce, nonce),
            other => panic!("expected a Pong, got {other:?}"),
        }
    }
    // ...and one that goes silent is told why and closed.
    let started = tokio::time::Instant::now();
    let why = expect_error_and_close(&mut chatty, ErrorCode::IdleTimeout).await;
    assert!(why.contains("nothing received"), "{why}");
    let silent = started.elapsed();
    assert!(
        silent >= KEEPALIVE * 3 - Duration::from_millis(50) && silent < KEEPALIVE * 10,
        "closed after {silent:?} of silence"
    );
}

#[tokio::test]
async fn frames_are_sealed_in_batches_only_for_a_peer_that_takes_them() {
    let b = start("b", SECRET).await;
    for (takes, nonce) in [(false, [12; 16]), (true, [13; 16])] {
        let mut conn = raw_linked_taking_batches(&b, nonce, takes).await;
        for nonce in 0..200 {
            conn.feed(Frame::of(Kind::Ping(v1::Ping { nonce })))
                .await
                .unwrap();
        }
        futures::SinkExt::<Frame>::flush(&mut conn).await.unwrap();
        // Read what comes back without opening it: 200 pongs, in order.
        let parts = conn.into_parts();
        let mut raw_parts =
            tokio_util::codec::FramedParts::new(parts.io, FrameCodec::new(MAX_FRAME));
        raw_parts.read_buf = parts.read_buf;
        let mut raw = Framed::from_parts(raw_parts);
        let (mut pongs, mut batches) = (Vec::new(), 0);
        while pongs.len() < 200 {
            let frame = next(&mut raw).await.expect("closed before 200 pongs");
            let Some(Kind::MeshSealed(sealed)) = frame.kind else {
                panic!("expected a MeshSealed, got {frame:?}");
            };
            let carried = if sealed.frames.is_empty() {
                vec![sealed.frame]
            } else {
                batches += 1;
                sealed.frames
            };
            for bytes in carried {
                match <Frame as prost::Message>::decode(bytes).unwrap().kind {
                    Some(Kind::Pong(pong)) => pongs.push(pong.nonce),
                    other => panic!("expected a Pong, got {other:?}"),
                }
            }
        }
        assert_eq!(pongs, (0..200).collect::<Vec<_>>());
        if !takes {
            assert_eq!(batches, 0, "a batch went to a peer that does not take them");
        }
    }
}

/// Which way a frame crosses the man in the middle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    /// From the dialing node to the accepting one.
    ToAcceptor,
    /// Back.
    ToDialer,
}

/// What the man in the middle does with one frame (its body, without the
/// length prefix).
enum Act {
    /// Passes these bytes on.
    Pass(Vec<u8>),
    /// Keeps the frame and sends these bytes back to where it came from.
    Answer(Vec<u8>),
}

type Tamper = Arc<dyn Fn(Way, Frame, Vec<u8>) -> Act + Send + Sync>;

/// A TCP proxy in front of `target` that relays every frame of every
/// connection through `tamper`; returns its address.
async fn man_in_the_middle(target: SocketAddr, tamper: Tamper) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (client, _) = listener.accept().await.unwrap();
            let Ok(server) = TcpStream::connect(target).await else {
                continue;
            };
            let (client_read, client_write) = client.into_split();
            let (server_read, server_write) = server.into_split();
            let client_write = Arc::new(tokio::sync::Mutex::new(client_write));
            let server_write = Arc::new(tokio::sync::Mutex::new(server_write));
            tokio::spawn(relay(
                client_read,
                server_write.clone(),
                client_write.clone(),
                Way::ToAcceptor,
                tamper.clone(),
            ));
            tokio::spawn(relay(
                server_read,
                client_write,
                server_write,
                Way::ToDialer,
                tamper.clone(),
            ));
        }
    });
    addr
}

type Writer = Arc<tokio::sync::Mutex<tokio::net::tcp::OwnedWriteHalf>>;

/// Reads length-prefixed frames from `from` and writes what `tamper` says
/// to `to` (or back on `back`), until either side closes.
async fn relay(
    mut from: tokio::net::tcp::OwnedReadHalf,
    to: Writer,
    back: Writer,
    way: Way,
    tamper: Tamper,
) {
    use prost::Message as _;
    use tokio::io::AsyncReadExt as _;
    loop {
        let mut prefix = [0u8; 4];
        if from.read_exact(&mut prefix).await.is_err() {
            break;
        }
        let mut body = vec![0u8; u32::from_be_bytes(prefix) as usize];
        if from.read_exact(&mut body).await.is_err() {
            break;
        }
        let frame = Frame::decode(body.as_slice()).unwrap_or_default();
        let (bytes, writer) = match tamper(way, frame, body) {
            Act::Pass(bytes) => (bytes, &to),
            Act::Answer(bytes) => (bytes, &back),
        };
        let mut framed = (bytes.len() as u32).to_be_bytes().to_vec();
        framed.extend(bytes);
        if writer.lock().await.write_all(&framed).await.is_err() {
            break;
        }
    }
    let _ = to.lock().await.shutdown().await;
}

/// The frame a `MeshSealed` carries, if `frame` is one.
fn opened(frame: &Frame) -> Option<Frame> {
    use prost::Message as _;
    match &frame.kind {
        Some(Kind::MeshSealed(sealed)) => Frame::decode(sealed.frame.clone()).ok(),
        _ => None,
    }
}

/// `frame` (a `MeshSealed`) with one byte of the frame it carries changed.
fn altered(frame: Frame) -> Vec<u8> {
    use prost::Message as _;
    let Some(Kind::MeshSealed(mut sealed)) = frame.kind else {
        panic!("not a sealed frame");
    };
    let mut inner = sealed.frame.to_vec();
    let last = inner.len() - 1;
    inner[last] ^= 0x01;
    sealed.frame = inner.into();
    Frame::of(Kind::MeshSealed(sealed)).encode_to_vec()
}

/// A (whose link to B goes through `proxy`) and B, linked both ways, with
/// process `p-1` registered on B.
async fn nodes_behind(
    proxy: impl FnOnce(SocketAddr) -> BoxFuture<'static, SocketAddr>,
) -> (Node, Node, Conn) {
    let a = start("a", SECRET).await;
    let b = start("b", SECRET).await;
    let via = proxy(b.mesh_addr).await;
    a.mesh
        .set_peers(BTreeMap::from([("b".to_string(), via.to_string())]));
    b.mesh.set_peers(peers(&[&a]));
    wait_linked(&a, &["b"]).await;
    wait_linked(&b, &["a"]).await;
    let process = register(&b, "p-1").await;
    (a, b, process)
}

#[tokio::test]
async fn a_proxy_that_relays_the_bytes_unchanged_is_only_a_transport() {
    let (a, b, mut process) = nodes_behind(|target| {
        man_in_the_middle(target, Arc::new(|_, _, bytes| Act::Pass(bytes))).boxed()
    })
    .await;
    for n in 0..20 {
        let answer = a
            .mesh
            .try_forward("b", "p-1", format!("t/0/{n}"), message("through"))
            .unwrap();
        let deliver = next_delivery(&mut process).await;
        assert_eq!(deliver.delivery_id, format!("t/0/{n}"));
        process
            .send(Frame::of(Kind::Ack(v1::Ack { seq: deliver.seq })))
            .await
            .unwrap();
        assert_eq!(outcome(answer).await, ForwardOutcome::Delivered);
    }
    assert_eq!(a.mesh.stats().unauthorized(), 0);
    assert_eq!(b.mesh.stats().unauthorized(), 0);
    assert_eq!(a.mesh.stats().links_established(), 1);
}

#[tokio::test]
async fn a_proxy_that_alters_a_forward_breaks_the_link_and_nothing_is_delivered() {
    let (a, b, mut process) = nodes_behind(|target| {
        man_in_the_middle(
            target,
            Arc::new(|way, frame, bytes| {
                let is_forward = opened(&frame)
                    .is_some_and(|inner| matches!(inner.kind, Some(Kind::Forward(_))));
                if way == Way::ToAcceptor && is_forward {
                    Act::Pass(altered(frame))
                } else {
                    Act::Pass(bytes)
                }
            }),
        )
        .boxed()
    })
    .await;
    let answer = a
        .mesh
        .try_forward("b", "p-1", "t/0/0".to_string(), message("original"))
        .unwrap();
    match outcome(answer).await {
        ForwardOutcome::Lost(reason) => assert!(reason.contains("`b`"), "{reason}"),
        other => panic!("an altered forward must not be answered, got {other:?}"),
    }
    wait_until("b refused the altered frame", || {
        b.mesh.stats().unauthorized() >= 1
    })
    .await;
    assert_eq!(b.mesh.stats().forwards_received(), 0);
    assert_eq!(a.mesh.stats().forwards_delivered(), 0);
    // The process never saw it.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), process.next())
            .await
            .is_err(),
        "the altered forward reached the process"
    );
}

#[tokio::test]
async fn a_proxy_that_alters_a_forward_ack_gets_nothing_acknowledged() {
    let (a, _b, mut process) = nodes_behind(|target| {
        man_in_the_middle(
            target,
            Arc::new(|way, frame, bytes| {
                let is_ack = opened(&frame)
                    .is_some_and(|inner| matches!(inner.kind, Some(Kind::ForwardAck(_))));
                if way == Way::ToDialer && is_ack {
                    Act::Pass(altered(frame))
                } else {
                    Act::Pass(bytes)
                }
            }),
        )
        .boxed()
    })
    .await;
    let answer = a
        .mesh
        .try_forward("b", "p-1", "t/0/0".to_string(), message("x"))
        .unwrap();
    ack_next(&mut process).await;
    assert!(
        matches!(outcome(answer).await, ForwardOutcome::Lost(_)),
        "an altered ForwardAck must not count"
    );
    assert_eq!(a.mesh.stats().forwards_delivered(), 0);
    assert!(a.mesh.stats().unauthorized() >= 1);
}

#[tokio::test]
async fn a_proxy_that_answers_a_forward_itself_gets_nothing_acknowledged() {
    // Two forgeries of ForwardAck{DELIVERED} for the proxy's own answer: in
    // the clear, and sealed with a key made without the cluster secret.
    for sealed in [false, true] {
        let (a, b, mut process) = nodes_behind(move |target| {
            man_in_the_middle(
                target,
                Arc::new(move |way, frame, bytes| {
                    let Some(Kind::Forward(forward)) = opened(&frame).and_then(|f| f.kind) else {
                        return Act::Pass(bytes);
                    };
                    assert_eq!(way, Way::ToAcceptor);
                    let ack = Frame::of(Kind::ForwardAck(v1::ForwardAck {
                        seq: forward.seq,
                        result: v1::ForwardResult::Delivered as i32,
                        reason: String::new(),
                    }));
                    let answer = if sealed {
                        let guess = SessionKeys::derive(b"a guess", "a", "b", &[0; 16], &[0; 16]);
                        seal(&guess.acceptor_to_dialer, 1, &ack)
                    } else {
                        ack
                    };
                    use prost::Message as _;
                    Act::Answer(answer.encode_to_vec())
                }),
            )
            .boxed()
        })
        .await;
        let answer = a
            .mesh
            .try_forward("b", "p-1", "t/0/0".to_string(), message("x"))
            .unwrap();
        assert!(
            matches!(outcome(answer).await, ForwardOutcome::Lost(_)),
            "a forged ForwardAck (sealed: {sealed}) must not count"
        );
        assert_eq!(a.mesh.stats().forwards_delivered(), 0);
        assert!(a.mesh.stats().unauthorized() >= 1);
        assert_eq!(b.mesh.stats().forwards_received(), 0);
        assert!(
            tokio::time::timeout(Duration::from_millis(200), process.next())
                .await
                .is_err(),
            "the intercepted forward reached the process"
        );
    }
}

/// Answers lookups with a fixed generation and records what it was asked.
#[derive(Debug, Default)]
struct FixedGeneration {
    generation: u64,
    asked: std::sync::Mutex<Vec<String>>,
    missed: std::sync::Mutex<Vec<(i32, i64, i64)>>,
}

impl LookupAnswerer for FixedGeneration {
    fn asked_for(&self, process_id: &str) -> u64 {
        self.asked.lock().unwrap().push(process_id.to_string());
        self.generation
    }

    fn records_missed(&self, partition: i32, from: i64, to: i64) {
        self.missed.lock().unwrap().push((partition, from, to));
    }
}

#[tokio::test]
async fn records_a_reader_missed_reach_every_linked_peer_s_route_table() {
    let a = start("a", SECRET).await;
    let b = start("b", SECRET).await;
    let c = start("c", SECRET).await;
    // Nobody linked: nobody asked.
    assert_eq!(a.mesh.ask_to_rewrite(3, 10, 12), 0);
    link_all(&[&a, &b, &c]);
    wait_linked(&a, &["b", "c"]).await;
    let on_b = Arc::new(FixedGeneration::default());
    let on_c = Arc::new(FixedGeneration::default());
    b.mesh.answer_lookups_with(on_b.clone());
    c.mesh.answer_lookups_with(on_c.clone());
    assert_eq!(a.mesh.ask_to_rewrite(3, 10, 12), 2);
    wait_until("both peers told", || {
        !on_b.missed.lock().unwrap().is_empty() && !on_c.missed.lock().unwrap().is_empty()
    })
    .await;
    assert_eq!(*on_b.missed.lock().unwrap(), vec![(3, 10, 12)]);
    assert_eq!(*on_c.missed.lock().unwrap(), vec![(3, 10, 12)]);
    assert_eq!(a.mesh.stats().rewrites_asked(), 2);
    assert_eq!(b.mesh.stats().rewrites_asked_by_peers(), 1);
    // Not answered, and the links stay up.
    let (found, _) = lookup(&a, "nobody").await;
    assert_eq!(found, None);
    assert_eq!(a.mesh.linked(), vec!["b".to_string(), "c".to_string()]);
    assert_eq!(a.mesh.stats().links_broken(), 0);
}

async fn lookup(node: &Node, process_id: &str) -> (Option<LookupFound>, Duration) {
    let started = std::time::Instant::now();
    let found = tokio::time::timeout(STEP, node.mesh.lookup(process_id))
        .await
        .expect("a lookup outlived its timeout");
    (found, started.elapsed())
}

#[tokio::test]
async fn a_lookup_finds_the_peer_holding_a_process_and_an_unknown_one_is_nowhere_at_once() {
    let a = start("a", SECRET).await;
    let b = start("b", SECRET).await;
    let c = start("c", SECRET).await;
    // Without peers: nowhere, at once, and nothing sent.
    let (found, took) = lookup(&a, "p").await;
    assert_eq!(found, None);
    assert!(took < Duration::from_millis(100), "{took:?}");
    assert_eq!(a.mesh.stats().lookups_sent(), 0);
    link_all(&[&a, &b, &c]);
    wait_linked(&a, &["b", "c"]).await;
    wait_linked(&b, &["a", "c"]).await;
    wait_linked(&c, &["a", "b"]).await;
    let answerer = Arc::new(FixedGeneration {
        generation: 77,
        ..FixedGeneration::default()
    });
    c.mesh.answer_lookups_with(answerer.clone());
    let _process = register(&c, "p").await;
    let _on_b = register(&b, "q").await;

    let (found, _) = lookup(&a, "p").await;
    assert_eq!(
        found,
        Some(LookupFound {
            node: "c".to_string(),
            generation: 77
        })
    );
    // The holder's route table was asked (it writes the route again).
    assert_eq!(*answerer.asked.lock().unwrap(), vec!["p".to_string()]);
    // A node without a route table answers from its gateway: generation 0.
    let (found, _) = lookup(&a, "q").await;
    assert_eq!(
        found,
        Some(LookupFound {
            node: "b".to_string(),
            generation: 0
        })
    );
    // Every peer says no: nowhere, long before the timeout.
    let (found, took) = lookup(&a, "nobody").await;
    assert_eq!(found, None);
    assert!(took < LOOKUP_TIMEOUT / 3, "{took:?}");
    // The other way round too, and only processes connected count.
    let (found, _) = lookup(&b, "p").await;
    assert_eq!(found.map(|f| f.node).as_deref(), Some("c"));
    assert_eq!(*answerer.asked.lock().unwrap(), vec!["p", "p"]);

    let stats = a.mesh.stats();
    assert_eq!(stats.lookups_sent(), 6, "each of 3 lookups to both peers");
    assert_eq!(stats.lookups_found(), 2);
    assert_eq!(stats.lookups_not_found(), 2, "no peers once, nobody once");
    assert_eq!(b.mesh.stats().lookups_received(), 3);
    assert_eq!(c.mesh.stats().lookups_received(), 4);
    // Lookups never broke a link.
    assert_eq!(stats.links_established(), 2);
    assert_eq!(stats.protocol_errors(), 0);
    assert_eq!(c.mesh.stats().protocol_errors(), 0);
}

#[tokio::test]
async fn a_peer_that_never_answers_a_lookup_costs_the_timeout_and_nothing_stays_pending() {
    let options = MeshOptions {
        lookup_timeout: Duration::from_millis(300),
        ..mesh_options("a", SECRET)
    };
    let a = start_on(options, "127.0.0.1:0".parse().unwrap()).await;
    let b = start("b", SECRET).await;
    // "x" authenticates as an acceptor and then reads, never answering
    // (but pongs, so the link stays up).
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let lookups_seen = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let seen = lookups_seen.clone();
    tokio::spawn(async move {
        let (stream, _) = silent.accept().await.unwrap();
        let mut conn = Framed::new(stream, MeshCodec::new(MAX_FRAME));
        let Some(Ok(Frame {
            kind: Some(Kind::MeshHello(hello)),
        })) = conn.next().await
        else {
            panic!("no MeshHello");
        };
        let nonce = [9u8; 16];
        conn.send(Frame::of(Kind::MeshWelcome(v1::MeshWelcome {
            node_id: "x".to_string(),
            mac: welcome_mac(SECRET, "x", &hello.node_id, &hello.nonce, &nonce).into(),
            nonce: Bytes::copy_from_slice(&nonce),
            takes_sealed_batches: false,
        })))
        .await
        .unwrap();
        let keys = SessionKeys::derive(SECRET, &hello.node_id, "x", &hello.nonce, &nonce);
        conn.codec_mut().seal_with(keys.for_acceptor());
        while let Some(Ok(frame)) = conn.next().await {
            match frame.kind {
                Some(Kind::MeshLookup(_)) => {
                    seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                Some(Kind::Ping(ping)) => {
                    let pong = Frame::of(Kind::Pong(v1::Pong { nonce: ping.nonce }));
                    if conn.send(pong).await.is_err() {
                        return;
                    }
                }
                _ => {}
            }
        }
    });
    let mut peers = peers(&[&a, &b]);
    peers.insert("x".to_string(), silent_addr.to_string());
    a.mesh.set_peers(peers);
    wait_linked(&a, &["b", "x"]).await;
    let _process = register(&b, "p").await;

    // b answers at once: found without waiting for x.
    let (found, took) = lookup(&a, "p").await;
    assert_eq!(found.map(|f| f.node).as_deref(), Some("b"));
    assert!(took < Duration::from_millis(300), "{took:?}");
    // b says no and x says nothing: the timeout.
    for _ in 0..3 {
        let (found, took) = lookup(&a, "nobody").await;
        assert_eq!(found, None);
        assert!(took >= Duration::from_millis(300), "{took:?}");
    }
    // Given up on, and dropped unfinished: nothing waits on x's link.
    drop(a.mesh.lookup("nobody"));
    wait_until("x saw every lookup", || {
        lookups_seen.load(std::sync::atomic::Ordering::Relaxed) == 5
    })
    .await;
    assert_eq!(a.mesh.stats().lookups_not_found(), 3);
    assert_eq!(a.mesh.stats().lookups_found(), 1);
    assert_eq!(a.mesh.pending_lookups("x"), Some(0));
    assert_eq!(a.mesh.pending_lookups("b"), Some(0));
    assert_eq!(a.mesh.linked(), vec!["b".to_string(), "x".to_string()]);
}

fn delivery_policy() -> wasmrelay::cluster::DeliveryPolicy {
    wasmrelay::cluster::DeliveryPolicy {
        ttl: Duration::from_secs(2),
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(200),
        retried: Default::default(),
        lines_recovering: Default::default(),
        order: wasmrelay::kafka::DeliveryOrder::Key,
    }
}

fn input(offset: i64) -> wasmrelay::kafka::InputRecord {
    wasmrelay::kafka::InputRecord {
        topic: "business".into(),
        partition: 0,
        offset,
        key: None,
        value: Some(b"x".to_vec()),
        headers: Vec::new(),
        timestamp_ms: None,
    }
}

fn output(value: &str) -> wasmrelay::kafka::OutputRecord {
    wasmrelay::kafka::OutputRecord {
        key: None,
        value: Some(value.as_bytes().to_vec()),
        headers: Vec::new(),
    }
}

/// A route table of node `node` that sees `live` live.
fn route_table(node: &Node, live: &[&str]) -> Arc<wasmrelay::cluster::routes::RouteTable> {
    use wasmrelay::cluster::membership::ClusterView;
    let table = wasmrelay::cluster::routes::RouteTable::new(
        &node.id,
        wasmrelay_protocol::mesh_auth::purpose_key(
            SECRET,
            wasmrelay_protocol::mesh_auth::Purpose::RouteRecord,
        ),
        Duration::from_secs(10),
        node.gateway.clone(),
        Default::default(),
    );
    table.follow_view(&ClusterView::of_live_nodes(live));
    table
}

#[tokio::test]
async fn a_delivery_with_no_route_reaches_its_process_through_a_lookup_on_the_first_attempt() {
    use wasmrelay::cluster::ClusterDelivery;
    use wasmrelay::flow::DeliveryEnd;
    let a = start("a", SECRET).await;
    let b = start("b", SECRET).await;
    link_all(&[&a, &b]);
    wait_linked(&a, &["b"]).await;
    b.mesh.answer_lookups_with(Arc::new(FixedGeneration {
        generation: 500,
        ..FixedGeneration::default()
    }));
    let mut process = register(&b, "p").await;
    // a's route table is empty: it missed p's route.
    let routes = route_table(&a, &["a", "b"]);
    assert!(routes.is_empty());
    let policy = delivery_policy();
    let retried = policy.retried.clone();
    let delivery = ClusterDelivery::new(
        a.gateway.clone(),
        Some(routes.clone()),
        Some(a.mesh.clone()),
        policy,
    );
    let abort = CancellationToken::new();
    let first = delivery
        .start("p".to_string(), &input(0), output("first"), abort.clone())
        .await;
    let deliver = next_delivery(&mut process).await;
    assert_eq!(deliver.message.unwrap().value, "first");
    process
        .send(Frame::of(Kind::Ack(v1::Ack { seq: deliver.seq })))
        .await
        .unwrap();
    assert_eq!(
        tokio::time::timeout(STEP, first).await.unwrap(),
        DeliveryEnd::Delivered
    );
    assert_eq!(retried.get(), 0, "delivered on the first attempt");
    assert_eq!(a.mesh.stats().lookups_found(), 1);
    assert_eq!(a.mesh.stats().forwards_delivered(), 1);
    // a learned the route from the answer: the next message needs no
    // lookup.
    assert_eq!(routes.lookup("p").as_deref(), Some("b"));
    let second = delivery
        .start("p".to_string(), &input(1), output("second"), abort.clone())
        .await;
    ack_next(&mut process).await;
    assert_eq!(
        tokio::time::timeout(STEP, second).await.unwrap(),
        DeliveryEnd::Delivered
    );
    assert_eq!(a.mesh.stats().lookups_sent(), 1);

    // The process leaves b: the learned route is stale, and forgotten at
    // the first "not here"; an unknown process is looked up on every
    // attempt and dead-lettered at the ttl, as before.
    drop(process);
    wait_until("p left b", || b.gateway.session("p").is_none()).await;
    let gone = delivery
        .start("p".to_string(), &input(2), output("third"), abort.clone())
        .await;
    let end = tokio::time::timeout(STEP, gone).await.unwrap();
    let DeliveryEnd::GaveUp { reason, call } = end else {
        panic!("expected GaveUp, got {end:?}");
    };
    assert!(reason.contains("nor known elsewhere"), "{reason}");
    assert_eq!(
        call,
        output("third"),
        "the message comes back for its dead letter"
    );
    assert_eq!(
        routes.holder("p"),
        None,
        "the stale learned route was forgotten"
    );
    assert!(retried.get() > 0);
    assert!(a.mesh.stats().lookups_not_found() > 0);
}

/// Starts a delivery of message `offset` (its value the offset) to process
/// `p`, in the order of the calls; the task ends with its outcome.
async fn deliver_to_p(
    delivery: &Arc<wasmrelay::cluster::ClusterDelivery>,
    offset: i64,
    abort: &CancellationToken,
) -> JoinHandle<wasmrelay::flow::DeliveryEnd> {
    let end = delivery
        .start(
            "p".to_string(),
            &input(offset),
            output(&offset.to_string()),
            abort.clone(),
        )
        .await;
    tokio::spawn(end)
}

#[tokio::test]
async fn retries_after_a_lost_connection_come_in_order_before_the_next_messages() {
    use wasmrelay::cluster::ClusterDelivery;
    use wasmrelay::flow::DeliveryEnd;
    let a = start("a", SECRET).await;
    let delivery = ClusterDelivery::new(a.gateway.clone(), None, None, delivery_policy());
    let abort = CancellationToken::new();
    let mut process = register(&a, "p").await;
    // Three messages reach the process, which drops its connection before
    // acking any: each is lost, and retried after a jittered pause.
    let mut ends = Vec::new();
    for offset in 0..3 {
        ends.push(deliver_to_p(&delivery, offset, &abort).await);
        assert_eq!(
            next_delivery(&mut process).await.message.unwrap().value,
            offset.to_string()
        );
    }
    drop(process);
    wait_until("p left", || a.gateway.session("p").is_none()).await;
    wait_until("the line recovers", || delivery.lines().recovering() == 1).await;
    let mut process = register(&a, "p").await;
    // The next message starts at once: it must not overtake the retries.
    let next_message = deliver_to_p(&delivery, 3, &abort).await;
    let mut received = Vec::new();
    while received.len() < 4 {
        let deliver = next_delivery(&mut process).await;
        received.push(String::from_utf8(deliver.message.unwrap().value.to_vec()).unwrap());
        process
            .send(Frame::of(Kind::Ack(v1::Ack { seq: deliver.seq })))
            .await
            .unwrap();
    }
    assert_eq!(received, ["0", "1", "2", "3"], "the line's order broke");
    for end in ends {
        assert_eq!(end.await.unwrap(), DeliveryEnd::Delivered);
    }
    assert_eq!(next_message.await.unwrap(), DeliveryEnd::Delivered);
}

#[tokio::test]
async fn messages_whose_ttl_runs_out_behind_a_stuck_one_are_dead_lettered_without_another_try() {
    use wasmrelay::cluster::ClusterDelivery;
    use wasmrelay::flow::DeliveryEnd;
    let a = start("a", SECRET).await;
    let delivery = ClusterDelivery::new(a.gateway.clone(), None, None, delivery_policy());
    let abort = CancellationToken::new();
    let mut process = register(&a, "p").await;
    // The process holds 0 unanswered and refuses 1: the line recovers, 1's
    // retry and the new message 2 wait behind 0.
    let mut ends = Vec::new();
    let mut seqs = Vec::new();
    for offset in 0..2 {
        ends.push(deliver_to_p(&delivery, offset, &abort).await);
        seqs.push(next_delivery(&mut process).await.seq);
    }
    process
        .send(Frame::of(Kind::Nack(v1::Nack {
            seq: seqs[1],
            reason: "not now".to_string(),
        })))
        .await
        .unwrap();
    wait_until("the line recovers", || delivery.lines().recovering() == 1).await;
    let third = deliver_to_p(&delivery, 2, &abort).await;
    // Past every time to live (2 s), 0 is answered.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    process
        .send(Frame::of(Kind::Ack(v1::Ack { seq: seqs[0] })))
        .await
        .unwrap();
    let mut ends = ends.into_iter();
    assert_eq!(ends.next().unwrap().await.unwrap(), DeliveryEnd::Delivered);
    let end = ends.next().unwrap().await.unwrap();
    let DeliveryEnd::GaveUp { reason, call } = end else {
        panic!("expected 1 given up, got {end:?}");
    };
    assert_eq!(call, output("1"));
    assert!(
        reason.contains("refused it: not now")
            && reason.contains("while earlier messages of its line were retried"),
        "{reason}"
    );
    let end = tokio::time::timeout(STEP, third).await.unwrap().unwrap();
    let DeliveryEnd::GaveUp { reason, call } = end else {
        panic!("expected 2 given up, got {end:?}");
    };
    assert_eq!(call, output("2"));
    assert!(
        reason.contains("spent waiting for earlier messages") && reason.contains("not tried"),
        "{reason}"
    );
    // Neither was tried again: nothing more reached the process.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), next(&mut process))
            .await
            .is_err(),
        "a message past its time to live was tried again"
    );
}
