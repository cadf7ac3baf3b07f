//! One client connection, from its first byte to its close: the Hello
//! handshake (version, process id, then the credential, see `auth`, all
//! before a session exists), then a reader (acks, nacks, upstream sends, pings) and a
//! writer (deliveries and answers from the session's bounded queue), and
//! the last word to the client (`Replaced` or `Error`) when the node ends
//! the session.
//!
//! The frames go through `wasmrelay_protocol::io`, whose buffers are given
//! back while the connection is idle: an idle process costs the node its
//! session and two small tasks, not two 8 KiB buffers.
//!
//! Anything a client sends that is not a valid frame, or not allowed at that
//! point, gets an `Error` frame naming the problem and the connection is
//! closed; the node and its other connections are not affected.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, TryAcquireError, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use wasmrelay_protocol::io::{FrameReader, FrameWriter};
use wasmrelay_protocol::v1::{self, ErrorCode};
use wasmrelay_protocol::{CodecError, Frame, FrameCodec, Kind, PROTOCOL_VERSION};

use super::session::{DeliveryResult, Ending, Outbound, Session};
use super::upstream_sends::OrderedSends;
use super::{Gateway, Placement};
use crate::net::Stream;

/// How long the last frame to a closing client may take to go out.
const FAREWELL_TIMEOUT: Duration = Duration::from_secs(1);
/// Frames written before the socket is flushed, when more are queued.
const WRITE_BATCH: usize = 64;

/// The frames sent to a client (buffers only while a batch is written).
type Sink = FrameWriter<WriteHalf<Stream>>;

/// The frames from a client.
type Source = FrameReader<ReadHalf<Stream>>;

/// A connection whose process has registered: what it needs from then on.
struct Registered {
    frames: Source,
    sink: Sink,
    session: Arc<Session>,
    outbound: mpsc::Receiver<Outbound>,
}

/// Serves one accepted connection until it ends.
///
/// The handshake runs boxed: a task is as large as its largest state, and
/// the handshake's (TLS, the Hello, placement, refusals) are needed only
/// until the process registers, while an idle connection lasts for days.
pub(crate) async fn serve_connection(
    gateway: Arc<Gateway>,
    stream: TcpStream,
    peer: SocketAddr,
    shutdown: CancellationToken,
) {
    let Some(registered) = Box::pin(handshake(&gateway, stream, peer)).await else {
        return;
    };
    serve_registered(gateway, registered, peer, shutdown).await;
}

/// TLS, the Hello and the credential, placement, and the Welcome: the
/// registered connection, or `None` when it was refused or went away.
async fn handshake(
    gateway: &Arc<Gateway>,
    stream: TcpStream,
    peer: SocketAddr,
) -> Option<Registered> {
    let options = gateway.options();
    let stream =
        // Boxed, like `admit` below: both are large and short-lived.
        match Box::pin(crate::net::accept_tls(options.tls.as_deref(), stream, options.hello_timeout)).await {
            Ok(stream) => stream,
            Err(reason) => {
                gateway.stats().tls_failure();
                tracing::debug!(%peer, %reason, "client connection closed before its Hello");
                return None;
            }
        };
    // The identity a verified client certificate carries (mutual TLS).
    let certificate_name = stream
        .peer_certificates()
        .first()
        .and_then(crate::tls::common_name);
    let (read_half, write_half) = tokio::io::split(stream);
    let mut frames = FrameReader::new(read_half, FrameCodec::new(options.max_frame_bytes));
    let mut framed = FrameWriter::new(write_half, FrameCodec::new(options.max_frame_bytes));

    let hello = match tokio::time::timeout(options.hello_timeout, frames.next()).await {
        Err(_) => {
            let reason = format!("no Hello within {:?}", options.hello_timeout);
            refuse(gateway, &mut framed, peer, ErrorCode::IdleTimeout, reason).await;
            return None;
        }
        Ok(None) => return None,
        Ok(Some(Err(error))) => {
            codec_failure(gateway, &mut framed, peer, error).await;
            return None;
        }
        Ok(Some(Ok(frame))) => match frame.kind {
            Some(Kind::Hello(hello)) => hello,
            _ => {
                let reason = format!("the first frame must be a Hello, not {}", frame.kind_name());
                refuse(
                    gateway,
                    &mut framed,
                    peer,
                    ErrorCode::ProtocolViolation,
                    reason,
                )
                .await;
                return None;
            }
        },
    };
    if hello.protocol_version != PROTOCOL_VERSION {
        let reason = format!(
            "this node speaks protocol version {PROTOCOL_VERSION}; the client sent version {}",
            hello.protocol_version
        );
        refuse(
            gateway,
            &mut framed,
            peer,
            ErrorCode::UnsupportedVersion,
            reason,
        )
        .await;
        return None;
    }
    if let Err(problem) = wasmrelay_protocol::check_process_id(&hello.process_id) {
        refuse(gateway, &mut framed, peer, ErrorCode::BadProcessId, problem).await;
        return None;
    }
    // Before any session is created or replaced: only a Hello that proves
    // the identity it claims may register, or take over, a process id.
    let identity = match gateway.client_auth().check_hello(
        &hello.process_id,
        &hello.token,
        certificate_name.as_deref(),
    ) {
        Ok(identity) => identity,
        Err(refusal) => {
            // Never the token itself: it is a credential.
            tracing::warn!(%peer, process = %hello.process_id, reason = refusal.reason(), %refusal, "refusing a client: no valid credential for its process id");
            let frame = Frame::error(ErrorCode::Unauthorized, refusal.to_string());
            farewell(&mut framed, frame).await;
            return None;
        }
    };

    // Where a process not connected here yet goes: here while below the
    // quota, or (for a client that follows redirects and was not
    // redirected already) wherever the placement policy says.
    let admission = match Box::pin(gateway.admit(
        &hello.process_id,
        hello.accepts_redirect && hello.redirects == 0,
    ))
    .await
    {
        Ok(admission) => admission,
        Err(placement) => {
            let frame = match placement {
                // `admit` never refuses with `Here`.
                Placement::Here => Frame::error(ErrorCode::NodeFull, String::new()),
                Placement::Elsewhere { node_id, address } => {
                    tracing::debug!(%peer, process = %hello.process_id, node = %node_id, %address, "placing a process on another node");
                    Frame::of(Kind::Redirect(v1::Redirect {
                        addresses: vec![address],
                        reason: format!("placed on node {node_id}"),
                    }))
                }
                Placement::Full(reason) => {
                    tracing::info!(%peer, process = %hello.process_id, %reason, "refusing a process: no room");
                    Frame::error(ErrorCode::NodeFull, reason)
                }
            };
            farewell(&mut framed, frame).await;
            return None;
        }
    };

    let (outbound_tx, outbound_rx) = mpsc::channel(options.send_queue);
    let session = Arc::new(Session::new(
        hello.process_id.clone(),
        gateway.next_connection_id(),
        peer.to_string(),
        outbound_tx,
        options.max_unacked,
        options.slow_consumer_timeout,
    ));
    let welcome = Frame::of(Kind::Welcome(v1::Welcome {
        protocol_version: PROTOCOL_VERSION,
        node_id: options.node_id.clone(),
        keepalive_ms: u32::try_from(options.keepalive.as_millis()).unwrap_or(u32::MAX),
        max_frame_bytes: u32::try_from(options.max_frame_bytes).unwrap_or(u32::MAX),
        max_unacked: u32::try_from(options.max_unacked).unwrap_or(u32::MAX),
    }));
    if framed.send(&welcome).await.is_err() {
        return None;
    }
    gateway.register(session.clone());
    drop(admission);
    tracing::debug!(process = %hello.process_id, %peer, client = %hello.client_name, ?identity, "process registered");
    Some(Registered {
        frames,
        sink: framed,
        session,
        outbound: outbound_rx,
    })
}

/// Reads a registered client's frames until the connection ends, with its
/// writer on a task of its own.
async fn serve_registered(
    gateway: Arc<Gateway>,
    registered: Registered,
    peer: SocketAddr,
    shutdown: CancellationToken,
) {
    let Registered {
        mut frames,
        sink,
        session,
        outbound,
    } = registered;
    let options = gateway.options();
    // Awaited when the connection ends.
    #[allow(clippy::disallowed_methods)]
    let writer = tokio::spawn(write_frames(
        sink,
        outbound,
        session.clone(),
        options.slow_consumer_timeout,
    ));
    // The timer is moved only when it fires, to the last frame's time plus
    // the timeout: not on every frame (setting a timer takes its lock).
    let idle_timeout = options.keepalive * 3;
    let idle = tokio::time::sleep(idle_timeout);
    tokio::pin!(idle);
    let mut last_received = Instant::now();
    let sends = Arc::new(Semaphore::new(options.max_unacked));
    // Started at the first Send: a connection that never sends has no task
    // for it.
    let mut upstream_sends: Option<OrderedSends> = None;
    loop {
        let next = tokio::select! {
            _ = session.closed().cancelled() => break,
            _ = shutdown.cancelled() => {
                session.close(ErrorCode::ShuttingDown, "the node is shutting down; connect to another".to_string());
                break;
            }
            _ = &mut idle => {
                if last_received.elapsed() < idle_timeout {
                    idle.as_mut().reset(last_received + idle_timeout);
                    continue;
                }
                session.close(
                    ErrorCode::IdleTimeout,
                    format!(
                        "nothing received for {idle_timeout:?} (send a Ping at least every {:?})",
                        options.keepalive
                    ),
                );
                break;
            }
            next = frames.next() => next,
        };
        last_received = Instant::now();
        let frame = match next {
            None => {
                session.end(Ending::ClientGone(
                    "the client closed the connection".to_string(),
                ));
                break;
            }
            Some(Err(error)) => {
                match error.code() {
                    Some(code) => {
                        gateway.stats().protocol_error();
                        tracing::info!(process = %session.process_id(), %peer, %error, "bad bytes from a client; closing its connection");
                        session.close(code, error.to_string());
                    }
                    // A reset or a stream cut inside a frame: the client went away.
                    None => {
                        tracing::debug!(process = %session.process_id(), %peer, %error, "client connection broke");
                        session.end(Ending::ClientGone(error.to_string()));
                    }
                }
                break;
            }
            Some(Ok(frame)) => frame,
        };
        let handled = match handle_frame(&gateway, &session, frame, &sends, &mut upstream_sends) {
            // Boxed: rare, and the wait would otherwise make every
            // connection's task larger for all its life.
            Ok(Some(send)) => {
                Box::pin(push_when_permitted(
                    &gateway,
                    &session,
                    send,
                    &sends,
                    &mut upstream_sends,
                ))
                .await;
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(violation) => Err(violation),
        };
        if let Err((code, reason)) = handled {
            gateway.stats().protocol_error();
            tracing::info!(process = %session.process_id(), %peer, %reason, "protocol violation; closing the connection");
            session.close(code, reason);
            break;
        }
    }
    // The sends taken are still answered, while the writer lasts.
    drop(upstream_sends);
    gateway.unregister(&session);
    let reason = session.ending().map_or_else(
        || "the connection ended".to_string(),
        |e| e.reason().to_string(),
    );
    session.fail_pending(&reason);
    let _ = writer.await;
    tracing::debug!(process = %session.process_id(), %peer, %reason, "process connection closed");
}

/// Acts on one frame from a registered client; `Err` closes the
/// connection. An upstream send that finds all of the connection's
/// `max_unacked` permits taken comes back (`Ok(Some)`), for the caller to
/// push once one is free.
fn handle_frame(
    gateway: &Arc<Gateway>,
    session: &Arc<Session>,
    frame: Frame,
    sends: &Arc<Semaphore>,
    upstream_sends: &mut Option<OrderedSends>,
) -> Result<Option<v1::Send>, (ErrorCode, String)> {
    match frame.kind {
        Some(Kind::Ack(ack)) => {
            answer(session, ack.seq, DeliveryResult::Acked, "Ack").map(|()| None)
        }
        Some(Kind::Nack(nack)) => answer(
            session,
            nack.seq,
            DeliveryResult::Nacked(nack.reason),
            "Nack",
        )
        .map(|()| None),
        Some(Kind::Ping(ping)) => {
            session.send_frame(Frame::of(Kind::Pong(v1::Pong { nonce: ping.nonce })));
            Ok(None)
        }
        Some(Kind::Pong(_)) => Ok(None),
        Some(Kind::Send(send)) => match sends.clone().try_acquire_owned() {
            Ok(permit) => {
                upstream_sends
                    .get_or_insert_with(|| OrderedSends::start(gateway, session))
                    .push(send, permit);
                Ok(None)
            }
            // Back-pressure: at most `max_unacked` sends of one client in flight.
            Err(TryAcquireError::NoPermits) => Ok(Some(send)),
            Err(TryAcquireError::Closed) => Ok(None),
        },
        Some(other) => Err((
            ErrorCode::ProtocolViolation,
            format!("a client may not send {} frames after Hello", other.name()),
        )),
        None => Err((ErrorCode::BadFrame, "a frame without a kind".to_string())),
    }
}

/// Waits for one of the connection's send permits, then takes `send`
/// upstream (back-pressure: the connection reads nothing meanwhile).
async fn push_when_permitted(
    gateway: &Arc<Gateway>,
    session: &Arc<Session>,
    send: v1::Send,
    sends: &Arc<Semaphore>,
    upstream_sends: &mut Option<OrderedSends>,
) {
    let Ok(permit) = sends.clone().acquire_owned().await else {
        return;
    };
    upstream_sends
        .get_or_insert_with(|| OrderedSends::start(gateway, session))
        .push(send, permit);
}

fn answer(
    session: &Session,
    seq: u64,
    result: DeliveryResult,
    what: &str,
) -> Result<(), (ErrorCode, String)> {
    if session.answer(seq, result) {
        Ok(())
    } else {
        Err((
            ErrorCode::ProtocolViolation,
            format!("{what} for delivery {seq}, which is not awaiting an answer"),
        ))
    }
}

/// Encodes one queued frame into the batch the writer writes next.
fn queue(sink: &mut Sink, frame: &Outbound) -> Result<(), CodecError> {
    match frame {
        Outbound::Frame(frame) => sink.queue(&**frame),
        Outbound::Deliver(deliver) => sink.queue(deliver),
    }
}

/// Writes the session's queued frames, flushing when the queue runs dry;
/// when the session ends, writes the last word (`Replaced` or `Error`) and
/// closes the socket. A write that does not finish within `write_timeout`
/// (a client that does not read) ends the session, and one still going
/// when the session ends is cut short: a stuck client never keeps this
/// task, nor the node's shutdown, waiting.
async fn write_frames(
    mut sink: Sink,
    mut outbound: mpsc::Receiver<Outbound>,
    session: Arc<Session>,
    write_timeout: Duration,
) {
    // A write cut short leaves part of a frame on the wire: no last word
    // may follow it.
    let mut cut_short = false;
    'outer: loop {
        let frame = tokio::select! {
            biased;
            _ = session.closed().cancelled() => break,
            frame = outbound.recv() => match frame {
                Some(frame) => frame,
                None => break,
            },
        };
        if queue(&mut sink, &frame).is_err() {
            break;
        }
        for _ in 1..WRITE_BATCH {
            match outbound.try_recv() {
                Ok(frame) => {
                    if queue(&mut sink, &frame).is_err() {
                        break 'outer;
                    }
                }
                Err(_) => break,
            }
        }
        let flushed = {
            let flush = tokio::time::timeout(write_timeout, sink.flush());
            tokio::pin!(flush);
            tokio::select! {
                flushed = &mut flush => flushed,
                // Ending: the write under way gets a farewell's time.
                _ = session.closed().cancelled() => {
                    match tokio::time::timeout(FAREWELL_TIMEOUT, &mut flush).await {
                        Ok(flushed) => flushed,
                        Err(_) => {
                            cut_short = true;
                            break;
                        }
                    }
                }
            }
        };
        match flushed {
            Ok(Ok(())) => {}
            Ok(Err(_)) => break,
            Err(_) => {
                cut_short = true;
                session.end(Ending::ClientGone(format!(
                    "nothing could be written to the client for {write_timeout:?}: it does not read"
                )));
                break;
            }
        }
    }
    if !cut_short {
        // Boxed: needed once, at the end, and a task is as large as its
        // largest state.
        Box::pin(last_word(sink, &session)).await;
    }
}

/// Writes the session's last word (`Replaced`, `Error` or `Rebalance`), if
/// it has one, and closes the socket.
async fn last_word(mut sink: Sink, session: &Session) {
    let last_word = match session.ending() {
        Some(Ending::Replaced(reason)) => Some(Frame::of(Kind::Replaced(v1::Replaced { reason }))),
        Some(Ending::Error(code, reason)) => Some(Frame::error(code, reason)),
        Some(Ending::Rebalanced { addresses, reason }) => {
            Some(Frame::of(Kind::Rebalance(v1::Rebalance {
                addresses,
                reason,
            })))
        }
        Some(Ending::ClientGone(_)) | None => None,
    };
    match last_word {
        Some(frame) => farewell(&mut sink, frame).await,
        None => {
            let _ = tokio::time::timeout(FAREWELL_TIMEOUT, sink.close()).await;
        }
    }
}

/// Sends `frame` as the last word and closes, each within
/// [`FAREWELL_TIMEOUT`].
async fn farewell(sink: &mut Sink, frame: Frame) {
    let _ = tokio::time::timeout(FAREWELL_TIMEOUT, sink.send(&frame)).await;
    let _ = tokio::time::timeout(FAREWELL_TIMEOUT, sink.close()).await;
}

/// Answers a connection that never registered with `Error` and closes it.
async fn refuse(
    gateway: &Gateway,
    framed: &mut Sink,
    peer: SocketAddr,
    code: ErrorCode,
    reason: String,
) {
    gateway.stats().protocol_error();
    tracing::info!(%peer, ?code, %reason, "refusing a client connection");
    farewell(framed, Frame::error(code, reason)).await;
}

async fn codec_failure(gateway: &Gateway, framed: &mut Sink, peer: SocketAddr, error: CodecError) {
    match error.code() {
        Some(code) => refuse(gateway, framed, peer, code, error.to_string()).await,
        None => tracing::debug!(%peer, %error, "client connection ended before its Hello"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateway::{ClientAuth, RefusingUpstream};

    /// An idle connection costs the node its two tasks, each as large as
    /// its future's largest state: the handshake's and the last word's
    /// states are boxed so that these stay small (they were 1,872 and
    /// 1,144 bytes, and the connection's task twice its future). The
    /// reader holds its idle timer for its whole life (moved when it fires,
    /// not set anew for every frame): 936 bytes with it.
    #[tokio::test]
    async fn a_connection_s_tasks_stay_small() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        let gateway = Gateway::new(
            Default::default(),
            ClientAuth::none(),
            Arc::new(RefusingUpstream),
            None,
        );
        let reader = serve_connection(gateway, client, addr, CancellationToken::new());
        let (outbound_tx, outbound) = mpsc::channel(1);
        let session = Arc::new(Session::new(
            "proc-1".into(),
            1,
            addr.to_string(),
            outbound_tx,
            16,
            Duration::from_secs(1),
        ));
        let (_, write_half) = tokio::io::split(Stream::Plain(accepted));
        let sink = FrameWriter::new(write_half, FrameCodec::new(1024));
        let writer = write_frames(sink, outbound, session, Duration::from_secs(1));
        let (reader_bytes, writer_bytes) = (size_of_val(&reader), size_of_val(&writer));
        assert!(
            reader_bytes <= 960,
            "the connection's future is {reader_bytes} bytes"
        );
        assert!(
            writer_bytes <= 560,
            "the writer's future is {writer_bytes} bytes"
        );
    }
}
