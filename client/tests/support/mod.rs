//! A fake relay node for the client tests: a TCP listener (optionally
//! behind TLS, with certificates from [`pki`]) speaking the frame protocol,
//! driven step by step by the test.

#![allow(dead_code)]

pub(crate) mod pki;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use rustls::pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::codec::Framed;
use wasmrelay_client::{ClientConfig, Event, Events};
use wasmrelay_protocol::v1::{self, ErrorCode};
use wasmrelay_protocol::{Frame, FrameCodec, Kind, PROTOCOL_VERSION};

/// How long any single step may take before the test fails.
pub(crate) const STEP: Duration = Duration::from_secs(5);

/// Awaits `future`, failing the test after [`STEP`].
pub(crate) async fn within<F: Future>(what: &str, future: F) -> F::Output {
    match tokio::time::timeout(STEP, future).await {
        Ok(output) => output,
        Err(_) => panic!("timed out after {STEP:?} waiting for {what}"),
    }
}

/// A client configuration for `addresses` with short pauses.
pub(crate) fn config(addresses: &[&str]) -> ClientConfig {
    let mut config = ClientConfig::new(addresses.iter().copied(), "proc-1");
    config.initial_backoff = Duration::from_millis(10);
    config.max_backoff = Duration::from_millis(50);
    config.connect_timeout = Duration::from_secs(2);
    config.send_timeout = STEP;
    config
}

/// The next event, failing after [`STEP`].
pub(crate) async fn next_event(events: &mut Events) -> Event {
    within("an event", events.next())
        .await
        .expect("the event stream ended")
}

/// The socket of an accepted connection: TCP, or TLS over TCP.
pub(crate) trait Socket: AsyncRead + AsyncWrite + Unpin + Send + std::fmt::Debug {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send + std::fmt::Debug> Socket for T {}

/// A fake relay node listening on a local port.
pub(crate) struct FakeNode {
    listener: TcpListener,
    pub(crate) address: String,
    /// Wraps accepted connections when the node speaks TLS.
    tls: Option<TlsAcceptor>,
}

impl std::fmt::Debug for FakeNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeNode")
            .field("address", &self.address)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl FakeNode {
    pub(crate) async fn start() -> FakeNode {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("local address").to_string();
        FakeNode {
            listener,
            address,
            tls: None,
        }
    }

    /// A node that runs a TLS handshake with `config` on every connection
    /// before speaking frames.
    pub(crate) async fn start_tls(config: Arc<rustls::ServerConfig>) -> FakeNode {
        FakeNode {
            tls: Some(TlsAcceptor::from(config)),
            ..FakeNode::start().await
        }
    }

    /// The next connection (its TLS handshake must succeed).
    pub(crate) async fn accept(&self) -> FakeConn {
        let (tcp, _) = within("a connection", self.listener.accept())
            .await
            .expect("accept");
        let Some(acceptor) = &self.tls else {
            return FakeConn {
                framed: Framed::new(Box::new(tcp), FrameCodec::default()),
                peer_certificates: Vec::new(),
            };
        };
        let tls = within("the TLS handshake", acceptor.accept(tcp))
            .await
            .expect("the TLS handshake with the client");
        let peer_certificates = tls
            .get_ref()
            .1
            .peer_certificates()
            .map(|certs| certs.iter().map(|c| c.clone().into_owned()).collect())
            .unwrap_or_default();
        FakeConn {
            framed: Framed::new(Box::new(tls), FrameCodec::default()),
            peer_certificates,
        }
    }

    /// The next connection, whose TLS handshake must fail: the server's
    /// reason.
    pub(crate) async fn accept_failed_handshake(&self) -> std::io::Error {
        let (tcp, _) = within("a connection", self.listener.accept())
            .await
            .expect("accept");
        let acceptor = self.tls.as_ref().expect("a TLS node");
        match within("the TLS handshake", acceptor.accept(tcp)).await {
            Ok(_) => panic!("the TLS handshake succeeded"),
            Err(error) => error,
        }
    }

    /// The next connection and its `Hello`.
    pub(crate) async fn accept_hello(&self) -> (FakeConn, v1::Hello) {
        let mut conn = self.accept().await;
        match conn.recv_kind().await {
            Kind::Hello(hello) => (conn, hello),
            other => panic!("expected Hello, got {other:?}"),
        }
    }

    /// The next connection, welcomed as `node_id` (no keepalive).
    pub(crate) async fn register(&self, node_id: &str) -> FakeConn {
        self.register_with(welcome(node_id, 0)).await
    }

    /// The next connection, welcomed with `welcome`.
    pub(crate) async fn register_with(&self, welcome: v1::Welcome) -> FakeConn {
        let (mut conn, hello) = self.accept_hello().await;
        assert_eq!(hello.process_id, "proc-1");
        conn.send(Kind::Welcome(welcome)).await;
        conn
    }

    /// Fails if a connection arrives within `wait`.
    pub(crate) async fn assert_no_connection(&self, wait: Duration) {
        if let Ok(accepted) = tokio::time::timeout(wait, self.listener.accept()).await {
            panic!("unexpected connection: {accepted:?}");
        }
    }
}

pub(crate) fn welcome(node_id: &str, keepalive_ms: u32) -> v1::Welcome {
    v1::Welcome {
        protocol_version: PROTOCOL_VERSION,
        node_id: node_id.to_string(),
        keepalive_ms,
        max_frame_bytes: 1024 * 1024,
        max_unacked: 100,
    }
}

pub(crate) fn deliver(seq: u64, delivery_id: &str, value: &'static [u8]) -> Kind {
    Kind::Deliver(v1::Deliver {
        seq,
        delivery_id: delivery_id.to_string(),
        message: Some(v1::Message {
            key: Some(bytes::Bytes::from_static(b"k")),
            value: bytes::Bytes::from_static(value),
            headers: vec![v1::Header {
                name: "h".to_string(),
                value: bytes::Bytes::from_static(b"hv"),
            }],
            topic: "in".to_string(),
            partition: 3,
            offset: 41,
            timestamp_ms: 1_700_000_000_000,
        }),
    })
}

pub(crate) fn error(code: ErrorCode, message: &str) -> Kind {
    Kind::Error(v1::Error {
        code: code as i32,
        message: message.to_string(),
    })
}

/// One accepted connection of the fake node.
#[derive(Debug)]
pub(crate) struct FakeConn {
    framed: Framed<Box<dyn Socket>, FrameCodec>,
    /// The certificate chain the client presented over TLS (empty without).
    pub(crate) peer_certificates: Vec<CertificateDer<'static>>,
}

impl FakeConn {
    pub(crate) async fn send(&mut self, kind: Kind) {
        within("sending a frame", self.framed.send(Frame::of(kind)))
            .await
            .expect("send a frame to the client");
    }

    /// The next frame's kind.
    pub(crate) async fn recv_kind(&mut self) -> Kind {
        let frame = within("a frame from the client", self.framed.next())
            .await
            .expect("the client closed the connection")
            .expect("a valid frame");
        frame.kind.expect("a frame kind")
    }

    /// Waits until the client closes the connection.
    pub(crate) async fn expect_closed(&mut self) {
        within("the client to close", async {
            loop {
                match self.framed.next().await {
                    None | Some(Err(_)) => return,
                    Some(Ok(frame)) => assert!(
                        matches!(
                            frame.kind,
                            Some(Kind::Ping(_) | Kind::Pong(_) | Kind::Ack(_))
                        ),
                        "unexpected {frame:?} before close"
                    ),
                }
            }
        })
        .await;
    }
}
