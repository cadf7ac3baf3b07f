//! Registering with a node: the TCP connection, the TLS handshake when the
//! configuration has [`ClientTls`](crate::ClientTls), and the `Hello`
//! exchange, tried over a list of addresses, following `Redirect`s (dialed
//! with the same TLS configuration, each verified under its own host name
//! unless a server name is set).

use std::collections::VecDeque;

use tokio::io::{ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use wasmrelay_protocol::io::{FrameReader, FrameWriter};
use wasmrelay_protocol::v1::{self, ErrorCode};
use wasmrelay_protocol::{CodecError, Frame, FrameCodec, Kind, PROTOCOL_VERSION};

use crate::config::ClientConfig;
use crate::error::ClientError;
use crate::stream::Stream;

/// The framed socket of a connection, its two directions apart: buffers
/// are held only while bytes are in flight, so an idle connection costs
/// the process none (see `wasmrelay_protocol::io`).
#[derive(Debug)]
pub(crate) struct Transport {
    pub(crate) frames: FrameReader<ReadHalf<Stream>>,
    pub(crate) sink: FrameWriter<WriteHalf<Stream>>,
}

impl Transport {
    fn new(stream: Stream, max_frame_bytes: usize) -> Transport {
        let (read, write) = tokio::io::split(stream);
        Transport {
            frames: FrameReader::new(read, FrameCodec::new(max_frame_bytes)),
            sink: FrameWriter::new(write, FrameCodec::new(max_frame_bytes)),
        }
    }
}

/// How many `Redirect`s in a row are followed before giving up on a chain.
pub(crate) const MAX_REDIRECTS: u32 = 3;

/// How many addresses of one `Redirect` are tried.
const MAX_REDIRECT_TARGETS: usize = 8;

/// An address to try, and which configured address it stands for (for the
/// rotation), if any.
#[derive(Clone, Debug)]
pub(crate) struct Candidate {
    pub(crate) address: String,
    pub(crate) origin: Option<usize>,
}

/// A connection that got its `Welcome`.
#[derive(Debug)]
pub(crate) struct Registered {
    pub(crate) transport: Transport,
    pub(crate) welcome: v1::Welcome,
    /// The address that welcomed the process.
    pub(crate) address: String,
    /// The configured address the chain of redirects started from.
    pub(crate) origin: Option<usize>,
}

/// Why no candidate welcomed the process.
#[derive(Debug)]
pub(crate) enum DialError {
    /// A permanent refusal (see [`is_permanent`]).
    Refused {
        address: String,
        code: ErrorCode,
        message: String,
    },
    /// Every candidate failed; each failure in order.
    Unreachable(Vec<(String, String)>),
    /// The token could not be had; no candidate was tried.
    Token(String),
}

impl From<DialError> for ClientError {
    fn from(error: DialError) -> ClientError {
        match error {
            DialError::Refused {
                address,
                code,
                message,
            } => ClientError::Refused {
                address,
                code,
                message,
            },
            DialError::Unreachable(failures) => ClientError::Unreachable { failures },
            DialError::Token(reason) => ClientError::Token(reason),
        }
    }
}

/// Error codes that retrying (here or elsewhere) cannot fix. A refused
/// token is one: every node of a cluster trusts the same keys.
pub(crate) fn is_permanent(code: ErrorCode) -> bool {
    matches!(
        code,
        ErrorCode::UnsupportedVersion | ErrorCode::BadProcessId | ErrorCode::Unauthorized
    )
}

/// Tries the candidates in order until one welcomes the process. A
/// `Redirect` puts its addresses first in line (up to [`MAX_REDIRECTS`]
/// hops); a permanent refusal stops at once. The token is read once per
/// round.
pub(crate) async fn register(
    config: &ClientConfig,
    candidates: Vec<Candidate>,
) -> Result<Registered, DialError> {
    let token = match &config.token {
        Some(token) => token.current().await.map_err(DialError::Token)?,
        None => String::new(),
    };
    let mut line: VecDeque<(Candidate, u32)> = candidates.into_iter().map(|c| (c, 0)).collect();
    let mut failures = Vec::new();
    while let Some((candidate, hops)) = line.pop_front() {
        let Candidate { address, origin } = candidate;
        match attempt(config, &token, &address, hops).await {
            Ok(Answer::Welcome(transport, welcome)) => {
                return Ok(Registered {
                    transport,
                    welcome,
                    address,
                    origin,
                });
            }
            Ok(Answer::Redirect(targets, reason)) => {
                if targets.is_empty() {
                    failures.push((address, format!("redirected nowhere ({reason})")));
                } else if hops >= MAX_REDIRECTS {
                    failures.push((
                        address,
                        format!("redirected to {targets:?} after {hops} redirects already; giving up on this chain"),
                    ));
                } else {
                    tracing::debug!(%address, ?targets, %reason, "redirected");
                    failures.push((address, format!("redirected to {targets:?} ({reason})")));
                    for target in targets.into_iter().take(MAX_REDIRECT_TARGETS).rev() {
                        let candidate = Candidate {
                            address: target,
                            origin,
                        };
                        line.push_front((candidate, hops + 1));
                    }
                }
            }
            Err(Attempt::Refused(code, message)) => {
                return Err(DialError::Refused {
                    address,
                    code,
                    message,
                });
            }
            Err(Attempt::Failed(reason)) => {
                tracing::debug!(%address, %reason, "connection attempt failed");
                failures.push((address, reason));
            }
        }
    }
    Err(DialError::Unreachable(failures))
}

/// What a node answered to `Hello`.
enum Answer {
    Welcome(Transport, v1::Welcome),
    Redirect(Vec<String>, String),
}

/// Why one address did not welcome the process.
enum Attempt {
    Refused(ErrorCode, String),
    Failed(String),
}

/// Connects to `address` (TCP, then TLS if configured), says `Hello` and
/// waits for the answer, all within the connect timeout.
async fn attempt(
    config: &ClientConfig,
    token: &str,
    address: &str,
    redirects: u32,
) -> Result<Answer, Attempt> {
    let timeout = config.connect_timeout;
    match tokio::time::timeout(timeout, handshake(config, token, address, redirects)).await {
        Ok(result) => result,
        Err(_) => Err(Attempt::Failed(format!(
            "no answer within the connect timeout of {timeout:?}"
        ))),
    }
}

async fn handshake(
    config: &ClientConfig,
    token: &str,
    address: &str,
    redirects: u32,
) -> Result<Answer, Attempt> {
    let tcp = TcpStream::connect(address)
        .await
        .map_err(|e| Attempt::Failed(format!("cannot connect: {e}")))?;
    if let Err(error) = tcp.set_nodelay(true) {
        tracing::debug!(%error, "cannot set TCP_NODELAY");
    }
    let stream = match &config.tls {
        None => Stream::Plain(tcp),
        Some(tls) => Stream::Tls(Box::new(
            tls.connect(address, tcp).await.map_err(Attempt::Failed)?,
        )),
    };
    let mut transport = Transport::new(stream, config.max_frame_bytes);
    let hello = Kind::Hello(v1::Hello {
        protocol_version: PROTOCOL_VERSION,
        process_id: config.process_id.clone(),
        client_name: config.client_name.clone(),
        accepts_redirect: true,
        token: token.to_string(),
        redirects,
    });
    transport
        .sink
        .send(&Frame::of(hello))
        .await
        .map_err(|e| Attempt::Failed(format!("cannot send Hello: {e}")))?;
    loop {
        let frame = match transport.frames.next().await {
            Some(Ok(frame)) => frame,
            Some(Err(error)) => {
                if let Some(code) = error.code() {
                    let _ = transport
                        .sink
                        .send(&Frame::error(code, error.to_string()))
                        .await;
                }
                return Err(Attempt::Failed(match tls_alert(&error) {
                    // With TLS 1.3 the node checks a client certificate
                    // after the client's handshake is done: its refusal
                    // arrives as the answer to Hello.
                    Some(alert) => {
                        format!("the node ended the TLS session before Welcome: {alert}")
                    }
                    None => format!("bad answer to Hello: {error}"),
                }));
            }
            None => {
                return Err(Attempt::Failed(
                    "the node closed the connection without answering Hello".to_string(),
                ));
            }
        };
        match frame.kind {
            Some(Kind::Welcome(welcome)) => {
                if welcome.protocol_version != PROTOCOL_VERSION {
                    tracing::warn!(
                        node_version = welcome.protocol_version,
                        "the node welcomed the process with another protocol version"
                    );
                }
                return Ok(Answer::Welcome(transport, welcome));
            }
            // The connection closes when `transport` is dropped.
            Some(Kind::Redirect(redirect)) => {
                return Ok(Answer::Redirect(redirect.addresses, redirect.reason));
            }
            Some(Kind::Error(error)) => {
                let code = ErrorCode::try_from(error.code).unwrap_or(ErrorCode::Unspecified);
                if is_permanent(code) {
                    return Err(Attempt::Refused(code, error.message));
                }
                return Err(Attempt::Failed(format!(
                    "{}: {}",
                    code.as_str_name(),
                    error.message
                )));
            }
            Some(Kind::Ping(ping)) => {
                let pong = Frame::of(Kind::Pong(v1::Pong { nonce: ping.nonce }));
                transport
                    .sink
                    .send(&pong)
                    .await
                    .map_err(|e| Attempt::Failed(format!("cannot answer Ping: {e}")))?;
            }
            Some(Kind::Pong(_)) => {}
            _ => {
                let name = frame.kind_name();
                let message = format!("unexpected {name} frame before Welcome");
                let _ = transport
                    .sink
                    .send(&Frame::error(ErrorCode::ProtocolViolation, message.clone()))
                    .await;
                return Err(Attempt::Failed(message));
            }
        }
    }
}

/// The TLS error under a codec error, if that is what it is.
fn tls_alert(error: &CodecError) -> Option<&rustls::Error> {
    match error {
        CodecError::Io(io) => io.get_ref()?.downcast_ref::<rustls::Error>(),
        _ => None,
    }
}
