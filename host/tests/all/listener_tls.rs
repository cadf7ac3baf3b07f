//! TLS on the node's own listeners over real TCP: the client listener
//! (processes verify the node; a wrong CA gets nowhere; a changed
//! certificate is used by new connections while open ones go on; mutual
//! TLS makes the certificate's common name the process id it may
//! register), the mesh (mutual TLS: a node of another CA, or a proxy that
//! terminates TLS, gets no link) and the admin API (HTTPS).

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt as _, SinkExt as _, StreamExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;
use wasmrelay::cluster::mesh::{ForwardOutcome, Mesh, MeshOptions, MeshTls};
use wasmrelay::config::MeshTlsConfig;
use wasmrelay::gateway::{ClientAuth, Gateway, GatewayOptions, Upstream, UpstreamError};
use wasmrelay::tls::{ServerTls, TlsFiles};
use wasmrelay_protocol::v1::{self, ErrorCode};
use wasmrelay_protocol::{Frame, FrameCodec, Kind};
use wasmrelay_test_support::pki::{IssuedCert, TestPki};

const STEP: Duration = Duration::from_secs(5);

struct NoUpstream;

impl Upstream for NoUpstream {
    fn send(
        &self,
        _: &str,
        _: v1::Send,
    ) -> BoxFuture<'static, Result<wasmrelay::gateway::Accepted, UpstreamError>> {
        async {
            Err(UpstreamError::Refused(
                "no upstream in this test".to_string(),
            ))
        }
        .boxed()
    }
}

type Conn = Framed<tokio_rustls::client::TlsStream<TcpStream>, FrameCodec>;

/// A gateway on 127.0.0.1 serving TLS with `files`, authenticating Hellos
/// with `auth`.
async fn gateway(
    node_id: &str,
    files: &TlsFiles,
    auth: ClientAuth,
) -> (Arc<Gateway>, std::net::SocketAddr, CancellationToken) {
    let gateway = Gateway::new(
        GatewayOptions {
            node_id: node_id.to_string(),
            hello_timeout: Duration::from_secs(2),
            tls: Some(Arc::new(ServerTls::load(files).unwrap())),
            ..GatewayOptions::default()
        },
        auth,
        Arc::new(NoUpstream),
        None,
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(gateway.clone().serve(listener, stop.clone()));
    (gateway, addr, stop)
}

/// Connects over TLS, trusting `pki`, presenting `identity` if given.
async fn connect(
    addr: std::net::SocketAddr,
    pki: &TestPki,
    identity: Option<&IssuedCert>,
) -> std::io::Result<Conn> {
    let tcp = TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let tls = pki.connector(identity).connect(name, tcp).await?;
    Ok(Framed::new(tls, FrameCodec::default()))
}

fn hello(process_id: &str) -> Frame {
    Frame::of(Kind::Hello(v1::Hello {
        protocol_version: wasmrelay_protocol::PROTOCOL_VERSION,
        process_id: process_id.to_string(),
        client_name: "tls-test".to_string(),
        accepts_redirect: false,
        token: String::new(),
        redirects: 0,
    }))
}

async fn next(conn: &mut Conn) -> Option<Frame> {
    tokio::time::timeout(STEP, conn.next())
        .await
        .expect("no frame within 5 s")
        .map(|f| f.expect("a valid frame"))
}

/// Says Hello for `process_id`; the answer (Welcome or Error).
async fn say_hello(conn: &mut Conn, process_id: &str) -> Kind {
    conn.send(hello(process_id)).await.unwrap();
    next(conn).await.expect("an answer to Hello").kind.unwrap()
}

async fn wait_until(what: &str, done: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + STEP;
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The first certificate the node presented on `conn`.
fn presented(conn: &Conn) -> Vec<u8> {
    conn.get_ref().get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

/// Delivers one message to `process_id` and checks `conn` receives it and
/// its ack gets back.
async fn round_trip(gateway: &Gateway, conn: &mut Conn, process_id: &str, id: &str) {
    let answer = gateway
        .deliver(
            process_id,
            id.to_string(),
            v1::Message {
                value: bytes::Bytes::from_static(b"v"),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let Some(Kind::Deliver(deliver)) = next(conn).await.unwrap().kind else {
        panic!("expected a Deliver");
    };
    assert_eq!(deliver.delivery_id, id);
    conn.send(Frame::of(Kind::Ack(v1::Ack { seq: deliver.seq })))
        .await
        .unwrap();
    let result = tokio::time::timeout(STEP, answer).await.unwrap().unwrap();
    assert!(
        matches!(result, wasmrelay::gateway::DeliveryResult::Acked),
        "{result:?}"
    );
}

#[tokio::test]
async fn processes_connect_over_tls_a_wrong_ca_gets_nowhere_and_a_new_certificate_is_used_by_new_connections()
 {
    let pki = TestPki::new("client-listener");
    let first = pki.server_cert("node");
    let files = TlsFiles {
        cert: first.cert_path.clone(),
        key: first.key_path.clone(),
        client_ca: None,
    };
    let (gateway, addr, stop) = gateway("node-a", &files, ClientAuth::none()).await;

    let mut old = connect(addr, &pki, None).await.unwrap();
    assert!(matches!(say_hello(&mut old, "p-1").await, Kind::Welcome(_)));
    assert_eq!(presented(&old), first.chain()[0].to_vec());
    round_trip(&gateway, &mut old, "p-1", "d-1").await;

    // A client that trusts another CA: the handshake fails, nothing is
    // registered, and the failure is counted.
    let other = TestPki::new("other");
    let error = connect(addr, &other, None)
        .await
        .expect_err("a wrong CA connected");
    assert!(
        error.to_string().contains("UnknownIssuer") || error.to_string().contains("certificate"),
        "{error}"
    );
    wait_until("the failed handshake is counted", || {
        gateway.stats().tls_failures() >= 1
    })
    .await;
    // Plain TCP on a TLS port: no Hello gets through.
    let mut plain = Framed::new(
        TcpStream::connect(addr).await.unwrap(),
        FrameCodec::default(),
    );
    plain.send(hello("p-2")).await.unwrap();
    let answer = tokio::time::timeout(STEP, plain.next()).await.unwrap();
    assert!(
        !matches!(
            answer,
            Some(Ok(Frame {
                kind: Some(Kind::Welcome(_)),
                ..
            }))
        ),
        "a plaintext Hello was welcomed: {answer:?}"
    );
    assert!(gateway.session("p-2").is_none());

    // The certificate files change: new connections get the new one
    // within the reload interval, the open one goes on.
    let second = pki.server_cert("node");
    assert_eq!(second.cert_path, files.cert);
    let deadline = tokio::time::Instant::now() + STEP;
    let mut new = loop {
        let mut conn = connect(addr, &pki, None).await.unwrap();
        if presented(&conn) == second.chain()[0].to_vec() {
            assert!(matches!(
                say_hello(&mut conn, "p-3").await,
                Kind::Welcome(_)
            ));
            break conn;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the new certificate was not used within 5 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    round_trip(&gateway, &mut new, "p-3", "d-2").await;
    round_trip(&gateway, &mut old, "p-1", "d-3").await;
    stop.cancel();
}

#[tokio::test]
async fn with_mutual_tls_the_certificate_common_name_is_the_process_id_it_may_register() {
    let pki = TestPki::new("mtls-clients");
    let server = pki.server_cert("node");
    let files = TlsFiles {
        cert: server.cert_path.clone(),
        key: server.key_path.clone(),
        client_ca: Some(pki.ca_path()),
    };
    let (gateway, addr, stop) = gateway("node-a", &files, ClientAuth::certificate()).await;
    let p1 = pki.client_cert("p-1", "p-1");

    let mut first = connect(addr, &pki, Some(&p1)).await.unwrap();
    assert!(matches!(
        say_hello(&mut first, "p-1").await,
        Kind::Welcome(_)
    ));

    // The certificate of p-1 cannot register p-2, and the refusal names
    // both; p-1's session is not disturbed.
    let mut wrong = connect(addr, &pki, Some(&p1)).await.unwrap();
    let Kind::Error(error) = say_hello(&mut wrong, "p-2").await else {
        panic!("p-1's certificate registered p-2");
    };
    assert_eq!(error.code, ErrorCode::Unauthorized as i32);
    assert!(
        error.message.contains("`p-1`") && error.message.contains("`p-2`"),
        "{}",
        error.message
    );
    assert!(gateway.session("p-2").is_none());
    round_trip(&gateway, &mut first, "p-1", "d-1").await;

    // Without a client certificate, or with one of another CA, the
    // handshake fails (TLS 1.3 reports it at the first read).
    let stranger = TestPki::new("strangers").client_cert("p-1", "p-1");
    for identity in [None, Some(&stranger)] {
        let refused = async {
            let mut conn = connect(addr, &pki, identity).await?;
            conn.send(hello("p-1"))
                .await
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            match conn.next().await {
                Some(Ok(frame)) => Ok(frame),
                Some(Err(error)) => Err(std::io::Error::other(error.to_string())),
                None => Err(std::io::Error::other("closed")),
            }
        };
        let outcome = tokio::time::timeout(STEP, refused).await.unwrap();
        assert!(
            !matches!(
                outcome,
                Ok(Frame {
                    kind: Some(Kind::Welcome(_)),
                    ..
                })
            ),
            "a client without a good certificate registered: {outcome:?}"
        );
    }
    assert_eq!(
        gateway.session("p-1").map(|s| s.peer().to_string()),
        Some(
            first
                .get_ref()
                .get_ref()
                .0
                .local_addr()
                .unwrap()
                .to_string()
        ),
        "the registered session was disturbed"
    );

    // A second connection that proves the same identity takes over.
    let mut second = connect(addr, &pki, Some(&p1)).await.unwrap();
    assert!(matches!(
        say_hello(&mut second, "p-1").await,
        Kind::Welcome(_)
    ));
    let Some(Kind::Replaced(_)) = next(&mut first).await.and_then(|f| f.kind) else {
        panic!("the first connection was not told it was replaced");
    };
    round_trip(&gateway, &mut second, "p-1", "d-2").await;

    // A pattern common name grants the ids it prefixes.
    let billing = pki.client_cert("billing-*", "billing");
    let mut conn = connect(addr, &pki, Some(&billing)).await.unwrap();
    assert!(matches!(
        say_hello(&mut conn, "billing-7").await,
        Kind::Welcome(_)
    ));
    stop.cancel();
}

/// A mesh node with mutual TLS from `pki` (certificate `stem`).
async fn mesh_node(
    id: &str,
    secret: &[u8],
    pki: &TestPki,
    stem: &str,
) -> (Arc<Mesh>, std::net::SocketAddr, CancellationToken) {
    let cert = pki.node_cert(stem);
    let tls = MeshTls::load(&MeshTlsConfig {
        cert: cert.cert_path.clone(),
        key: cert.key_path.clone(),
        ca: pki.ca_path(),
        server_name: None,
    })
    .unwrap();
    let gateway = Gateway::new(
        GatewayOptions {
            node_id: id.to_string(),
            ..GatewayOptions::default()
        },
        ClientAuth::none(),
        Arc::new(NoUpstream),
        None,
    );
    let stop = CancellationToken::new();
    let mesh = Mesh::new(
        MeshOptions {
            node_id: id.to_string(),
            secret: secret.to_vec(),
            connect_timeout: Duration::from_secs(1),
            reconnect_backoff: (Duration::from_millis(20), Duration::from_millis(200)),
            tls: Some(tls),
            ..MeshOptions::default()
        },
        gateway.clone(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mesh_addr = listener.local_addr().unwrap();
    tokio::spawn(mesh.clone().serve(listener, stop.clone()));
    (mesh, mesh_addr, stop)
}

#[tokio::test]
async fn mesh_links_are_mutual_tls_and_a_node_of_another_ca_gets_no_link() {
    const SECRET: &[u8] = b"mesh-tls-secret-0123456789abcdef";
    let pki = TestPki::new("mesh");
    let (a, _, stop_a) = mesh_node("a", SECRET, &pki, "a").await;
    let (b, b_addr, stop_b) = mesh_node("b", SECRET, &pki, "b").await;
    a.set_peers(
        [("b".to_string(), b_addr.to_string())]
            .into_iter()
            .collect(),
    );
    tokio::time::timeout(STEP, a.wait_linked(&["b"]))
        .await
        .expect("a's link to b is up over TLS");
    // A forward over it reaches b's gateway (the process is not there).
    let outcome = a
        .try_forward("b", "nobody", "d-1".to_string(), v1::Message::default())
        .unwrap();
    let outcome = tokio::time::timeout(STEP, outcome).await.unwrap().unwrap();
    assert!(matches!(outcome, ForwardOutcome::NotHere(_)), "{outcome:?}");

    // A node with the cluster secret but a certificate of another CA:
    // neither side gets a link.
    let rogue_pki = TestPki::new("rogue");
    let (rogue, rogue_addr, stop_rogue) = mesh_node("r", SECRET, &rogue_pki, "r").await;
    rogue.set_peers(
        [("b".to_string(), b_addr.to_string())]
            .into_iter()
            .collect(),
    );
    a.set_peers(
        [
            ("b".to_string(), b_addr.to_string()),
            ("r".to_string(), rogue_addr.to_string()),
        ]
        .into_iter()
        .collect(),
    );
    wait_until("b refused the rogue's handshake", || {
        b.stats().unauthorized() >= 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !rogue.linked().contains(&"b".to_string()),
        "a node of another CA got a link"
    );
    assert!(
        !a.linked().contains(&"r".to_string()),
        "a dialed a node of another CA"
    );
    assert!(a.linked().contains(&"b".to_string()));
    for stop in [stop_a, stop_b, stop_rogue] {
        stop.cancel();
    }
}
